"""CuPy-like ``RawModule`` that runs the project's CUDA kernels on the CPU.

Why: development and CI machines have no GPU, yet the kernels must be executed, not just compiled.
The unchanged ``.cu`` source is compiled with g++ through ``kernels/cpu/cuda_shim.h`` (every CUDA
thread a fiber, blocks one after another) and launched through ctypes with a ``void**`` argument
array, like ``cuLaunchKernel``. Plug it into the GPU backend with
``cuda_kernels.set_raw_module_factory(cuda_on_cpu.RawModule)`` and pass CPU tensors.

Race probes: ``PAGEDINFER_CPU_REVERSE=1`` runs each block's threads in reverse order, and
``PAGEDINFER_CPU_EAGER_COPIES=1`` lands asynchronous (cp.async) copies at issue instead of at the
latest wait that must see them. ``PAGEDINFER_CPU_CXXFLAGS`` changes the g++ flags (e.g.
``-O1 -g -fsanitize=address``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedinfer import envs
from pagedinfer.kernels import kernel_cache
from pagedinfer.kernels.sources import KERNELS_DIR

SHIM_DIR = KERNELS_DIR / "cpu"

_EXTERN_C_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\('
)
_LAUNCH_LOCK = threading.Lock()  # kernels keep __shared__ in statics: one launch at a time


def _compile(source: str, flags: list[str]) -> Path:
    """Builds the shared library once per (source, flags, shim) and returns its path (checked: see
    `kernel_cache`)."""
    shim = "".join(p.read_text() for p in sorted(SHIM_DIR.rglob("*.h")))
    key = hashlib.sha256("\0".join([source, *flags, shim]).encode()).hexdigest()[:24]
    cache = kernel_cache.folder("cuda_on_cpu")
    so = cache / f"{key}.so"
    if so.exists():
        return kernel_cache.library(so)
    # private names, renamed into place: concurrent builders don't collide, nothing half-written is read
    mine = f"{key}.{os.getpid()}.{threading.get_ident()}"
    cpp, tmp = cache / f"{mine}.cpp", cache / f"{mine}.tmp"
    cpp.write_text(source)
    result = subprocess.run(["g++", *flags, str(cpp), "-o", str(tmp)], capture_output=True, text=True)
    os.replace(cpp, cache / f"{key}.cpp")  # kept beside the library, to read or debug
    if result.returncode:
        raise RuntimeError(f"g++ failed on {cache / f'{key}.cpp'}:\n{result.stderr[-6000:]}")
    return kernel_cache.seal(tmp, so)


class RawModule:
    """Compiles CUDA C with g++; ``get_function`` takes a name expression or an extern "C" kernel name."""

    def __init__(
        self, code: str, options: Sequence[str] = (), name_expressions: Sequence[str] = (), **_: Any
    ):
        self._names = list(dict.fromkeys([*name_expressions, *_EXTERN_C_KERNEL.findall(code)]))
        wrappers = "".join(
            f'extern "C" int pagedinfer_launch_{i}(const unsigned* g, const unsigned* b, void** p, int f)'
            f" {{ return shim::launch(&{name}, g, b, p, f); }}\n"  # taking the address instantiates the template
            for i, name in enumerate(self._names)
        )
        source = re.sub(r"\bstatic\s+__shared__", "__shared__", code) + "\n" + wrappers
        flags = [
            "-std=c++20",
            *envs.cuda_cpu_cxxflags(),
            "-fno-strict-aliasing",  # kernels reinterpret rows as 16-byte vectors
            "-shared",
            "-fPIC",
            "-w",
            f"-I{SHIM_DIR / 'include'}",
            "-include",
            str(SHIM_DIR / "cuda_shim.h"),
            *(o for o in options if o.startswith(("-D", "-I"))),
        ]
        self._lib = ctypes.CDLL(str(_compile(source, flags)))

    def get_function(self, name: str) -> RawKernel:
        return RawKernel(getattr(self._lib, f"pagedinfer_launch_{self._names.index(name)}"), name)


def _as_ctype(arg: Any) -> ctypes._SimpleCData | ctypes.Array:
    """Marshals one argument the way CuPy does; pointers come from arrays and tensors."""
    if isinstance(arg, np.generic):  # before ndarray: numpy scalars also expose __array_interface__
        return (ctypes.c_char * arg.nbytes).from_buffer_copy(arg.tobytes())
    if isinstance(arg, np.ndarray):
        return ctypes.c_void_p(arg.ctypes.data)
    if isinstance(arg, torch.Tensor):
        if arg.device.type != "cpu":
            raise ValueError(f"CPU kernels need CPU tensors, got {arg.device}")
        return ctypes.c_void_p(arg.data_ptr())
    if arg is None:
        return ctypes.c_void_p(0)
    if isinstance(arg, bool):
        return ctypes.c_bool(arg)
    if isinstance(arg, int):
        return ctypes.c_int64(arg)  # CuPy passes a Python int as long long
    if isinstance(arg, float):
        return ctypes.c_double(arg)  # and a Python float as double
    raise TypeError(f"unsupported kernel argument {type(arg).__name__}")


class RawKernel:
    """One kernel; called like ``cupy.RawKernel``: ``kernel(grid, block, args)``."""

    def __init__(self, fn: Any, name: str):
        self._fn, self.name = fn, name
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint)] * 2 + [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        fn.restype = ctypes.c_int

    def __call__(
        self, grid: tuple[int, ...], block: tuple[int, ...], args: Sequence[Any], *, shared_mem: int = 0
    ):
        if shared_mem:
            raise NotImplementedError("the CPU shim supports static __shared__ memory only")
        dims = [(*(d if isinstance(d, tuple | list) else (d,)), 1, 1)[:3] for d in (grid, block)]
        g, b = ((ctypes.c_uint * 3)(*d) for d in dims)
        values = [_as_ctype(a) for a in args]
        params = (ctypes.c_void_p * max(1, len(values)))(*(ctypes.addressof(v) for v in values))
        flags = envs.cuda_cpu_probes()
        with _LAUNCH_LOCK:
            failed = self._fn(g, b, params, flags)
        if failed:
            raise RuntimeError(
                f"kernel {self.name} deadlocked (divergent __syncthreads or partial-warp shuffle)"
            )
