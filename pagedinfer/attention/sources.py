"""Where the kernel sources live: the repository's top-level ``kernels/`` folder, which the wheel
installs as the package ``pagedinfer.kernels`` (pyproject's ``package-dir``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# a source checkout run in place: kernels/ beside the pagedinfer/ package this file belongs to
_CHECKOUT = Path(__file__).resolve().parents[2] / "kernels"


def kernels_dir() -> Path:
    """The folder holding ``cpu_paged_decode.c``, the ``.cu`` files and the CUDA shim.

    The checkout's own folder wins, so a clone run in place (or an editable install) compiles the
    sources beside its code; an installed wheel finds them as the package ``pagedinfer.kernels``.
    """
    if (_CHECKOUT / "cpu_paged_decode.c").is_file():
        return _CHECKOUT
    spec = importlib.util.find_spec("pagedinfer.kernels")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("pagedinfer's kernel sources are missing: reinstall pagedinfer")
    return Path(next(iter(spec.submodule_search_locations)))


KERNELS_DIR = kernels_dir()
