"""Where the kernel sources live, and what each library is built from.

The sources are the repository's top-level ``kernels/`` folder, which the wheel installs as the package
``pagedinfer.kernels.csrc`` (pyproject's ``package-dir``). Nothing lists them by hand: every
``kernels/cpu_<name>.c`` is the root of a library, and a library links each other unit ``cpu_<x>.c``
whose header ``cpu_<x>.h`` it includes (the C way of saying "I call that file's functions").
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# a source checkout run in place: kernels/ beside the pagedinfer/ package this file belongs to
_CHECKOUT = Path(__file__).resolve().parents[2] / "kernels"


def kernels_dir() -> Path:
    """The folder holding ``cpu_paged_decode.c``, the ``.cu`` files and the CUDA shim.

    The checkout's own folder wins, so a clone run in place (or an editable install) compiles the
    sources beside its code; an installed wheel finds them as the package ``pagedinfer.kernels.csrc``.
    """
    if (_CHECKOUT / "cpu_paged_decode.c").is_file():
        return _CHECKOUT
    spec = importlib.util.find_spec("pagedinfer.kernels.csrc")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("pagedinfer's kernel sources are missing: reinstall pagedinfer")
    return Path(next(iter(spec.submodule_search_locations)))


KERNELS_DIR = kernels_dir()


def local_includes(*sources: Path) -> list[Path]:
    """``sources`` and every file they include with ``#include "..."``, recursively, each once."""
    found: list[Path] = []
    pending = list(reversed(sources))
    while pending:
        path = pending.pop()
        if path in found:
            continue
        found.append(path)
        for line in path.read_text().splitlines():
            if line.startswith('#include "'):
                pending.append(path.parent / line.split('"')[1])
    return found


def translation_units(root: Path) -> list[Path]:
    """The units the library of ``root`` is compiled from: ``root``, then every ``.c`` beside a header
    that one of them includes (recursively), each once, in the order found."""
    units = [root]
    for unit in units:  # grows while it is walked: a linked unit's own headers link theirs
        for path in local_includes(unit):
            linked = path.with_suffix(".c")
            if path.suffix == ".h" and linked.is_file() and linked not in units:
                units.append(linked)
    return units


def library_roots() -> list[Path]:
    """Every CPU library's root unit (``kernels/cpu_*.c``), sorted: what `build.prebuild` builds."""
    return sorted(KERNELS_DIR.glob("cpu_*.c"))
