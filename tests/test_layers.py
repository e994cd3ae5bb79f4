"""Data flows one way: cli -> llm/engine -> core -> model -> attention. Nothing imports a layer above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pagedinfer"
# rank of each top-level name inside pagedinfer/; a module may import its own rank or lower ones
RANKS = {
    "cli": 5,
    "bench": 5,
    "ray": 5,
    "__main__": 5,
    "__init__": 4,
    "llm": 4,
    "engine": 4,
    "core": 3,
    "model": 2,
    "logits": 2,
    "attention": 1,
    "kernels": 0,
}
LEAVES = {
    "config",
    "sampling_params",
    "outputs",
    "seeding",
    "openai_params",
}  # plain records any layer may import


def layer_of(dotted: str) -> str:
    """'pagedinfer.core.scheduler' -> 'core'."""
    return dotted.split(".")[1] if dotted.count(".") else "__init__"


def imports(path: Path) -> set[str]:
    """Every pagedinfer module this file imports, at any depth (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagedinfer"):
            base = node.module
            if base != "pagedinfer":
                found.add(base)
                continue
            for a in node.names:  # `from pagedinfer import core` names a package; `import LLM`, __init__
                is_module = (PACKAGE / a.name).is_dir() or (PACKAGE / f"{a.name}.py").is_file()
                found.add(f"pagedinfer.{a.name}" if is_module else "pagedinfer")
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pagedinfer"))
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_layer_above_its_own(path):
    rel = path.relative_to(PACKAGE).with_suffix("")
    own = rel.parts[0]
    for target in imports(path):
        layer = layer_of(target)
        if layer in LEAVES:
            continue
        if own in LEAVES:
            pytest.fail(f"{rel} is a leaf record module but imports {target}")
        assert layer in RANKS, f"{rel} imports {target}: add its package to RANKS"
        assert RANKS[layer] <= RANKS[own], f"{rel} ({own}) imports {target} ({layer}), a layer above it"


def test_core_holds_no_tensors():
    """The scheduler and the block pool are pure bookkeeping: no torch anywhere in core/."""
    for path in (PACKAGE / "core").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(name.split(".")[0] == "torch" for name in names), path
