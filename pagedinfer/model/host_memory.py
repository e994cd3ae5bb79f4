"""glibc's malloc told to keep freed step buffers instead of handing them back to the OS after every step.

A CPU step allocates activations of hundreds of KB to tens of MB (a batch-64 gate-up output is 786
KB, a prefill's up to 24 MB) and frees them at once. By default glibc serves such sizes with mmap, or
trims the heap top past a threshold it adapts as it goes, so the next step faults the same pages in
again and the kernel zeroes them, step after step. The settings below keep those pages in the
process, which cuts the minor faults and the system time several-fold (docs/kernels.md, "Host memory
between steps"). The cost: up to `TRIM_BYTES` of freed memory stays in the process.
``PAGEDINFER_MALLOC_TUNING=0`` leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from pagedinfer import envs

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt(3) parameters
MMAP_BYTES = 32 << 20  # allocations below this come from the heap (glibc's upper limit for it)
TRIM_BYTES = 256 << 20  # free memory at the heap's top kept before it is returned
TOP_PAD_BYTES = 32 << 20  # each heap growth asks the OS for this much more than needed


@functools.cache
def keep_freed_memory() -> bool:
    """Apply the settings once per process; False where there is no glibc ``mallopt`` or it is turned off."""
    if not envs.malloc_tuning():
        return False
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_BYTES), (M_TRIM_THRESHOLD, TRIM_BYTES), (M_TOP_PAD, TOP_PAD_BYTES))
    return all(mallopt(param, value) == 1 for param, value in settings)
