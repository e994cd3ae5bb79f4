"""Data flows one way: cli -> ray -> lines -> llm -> engine -> core -> model -> lora -> attention -> kernels.

Each package has its own rank and may import only packages ranked strictly below it (or itself):
nothing imports a layer above it, two layers never import each other, and no import cycle can form
between packages. Within a package, `test_no_import_cycles` checks the modules themselves.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pagedinfer"
# rank of each top-level name inside pagedinfer/; a module may import its own package or lower ranks
RANKS = {
    "__main__": 12,
    "cli": 11,  # the command line: runs, blocks, bench; reaches Ray through ray/
    "bench": 10,
    "ray": 9,  # data-parallel replicas and the Ray Data processor
    "lines": 8,  # JSONL lines: input, parsing, records (shared by cli and ray)
    "__init__": 7,  # the package's public names (LLM, SamplingParams, ...)
    "llm": 6,
    "engine": 5,
    "core": 4,
    "model": 3,
    "lora": 2.5,  # LoRA adapters: loading, slots, the step's row groups, the deltas a model's linears add
    "logits": 2,  # what shapes a step's logits: the processors the sampler applies
    "attention": 1,
    "kernels": 0,  # the C kernels' build, cache and bindings: imports nothing above it
}
LEAVES = {
    "config",
    "sampling_params",
    "outputs",
    "seeding",
    "envs",
    "chat_template",
    "chat_render",
    "chat_messages",
    "hf_logging",
    "chat_worker",
    "terminal",
    "errors",
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
        assert layer == own or RANKS[layer] < RANKS[own], (
            f"{rel} ({own}) imports {target} ({layer}), not below it"
        )


def test_ranks_are_a_strict_order():
    """No two packages share a rank: of any two, one may import the other, never both."""
    assert len(set(RANKS.values())) == len(RANKS)


def test_no_import_cycles():
    """Module-level imports (those that run at import time) form no cycle anywhere in the package."""
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        name = ".".join(("pagedinfer", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        tree = ast.parse(path.read_text(encoding="utf-8"))
        deps = set()
        for node in tree.body:  # top level only: function-level imports run later, by design
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagedinfer"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("pagedinfer"))
        graph[name] = deps
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 2 or node not in graph:
            return
        assert state.get(node) != 1, f"import cycle: {' -> '.join([*trail, node])}"
        state[node] = 1
        for dep in sorted(graph[node]):
            visit(dep, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        visit(node, [])


def test_core_holds_no_tensors():
    """The scheduler and the block pool are pure bookkeeping: no torch anywhere in core/."""
    for path in (PACKAGE / "core").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(name.split(".")[0] == "torch" for name in names), path
