"""Where the kernel sources live: the repository's top-level ``kernels/`` folder, which the wheel
installs as the package ``pagedinfer.kernels`` (pyproject's ``package-dir``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[2] / "kernels"  # a source checkout run in place


def kernels_dir() -> Path:
    """The folder holding ``cpu_paged_decode.c``, the ``.cu`` files and the CUDA shim."""
    spec = importlib.util.find_spec("pagedinfer.kernels")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return _CHECKOUT


KERNELS_DIR = kernels_dir()
