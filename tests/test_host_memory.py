"""glibc malloc keeps freed step buffers in the heap instead of mapping and unmapping them every step."""

import json
import subprocess
import sys

import pytest

from pagedinfer.model import host_memory

STEP = """
import json, torch
from pagedinfer.model.host_memory import keep_freed_memory

def heap():  # the [heap] mapping's (start, end) in this process
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = line.split()[0].split("-")
            return int(lo, 16), int(hi, 16)

applied = keep_freed_memory()
small = torch.empty(256 * 1024).fill_(1.0)  # 1 MB: a decode step's activation
lo, hi = heap()
in_heap = lo <= small.data_ptr() < hi
big = torch.empty(5 * 1024 * 1024).fill_(1.0)  # 20 MB: a prefill's
grown = heap()[1]
del big
print(json.dumps({"applied": applied, "in_heap": in_heap, "kept": heap()[1] == grown}))
"""


def step(tuning: str) -> dict:
    env = {"PAGEDINFER_MALLOC_TUNING": tuning, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", STEP], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="mallopt and /proc/self/maps: glibc on Linux"
)
def test_step_buffers_come_from_the_heap_and_stay_there():
    """With the settings a 1 MB buffer comes from the heap, and the heap keeps a freed 20 MB one;
    glibc's defaults map the 1 MB buffer on its own (128 KB threshold at start)."""
    assert step("1") == {"applied": True, "in_heap": True, "kept": True}
    assert step("0") == {"applied": False, "in_heap": False, "kept": True}  # 20 MB: mapped, heap untouched


def test_the_environment_turns_it_off(monkeypatch):
    host_memory.keep_freed_memory.cache_clear()
    monkeypatch.setenv("PAGEDINFER_MALLOC_TUNING", "0")
    assert host_memory.keep_freed_memory() is False
    host_memory.keep_freed_memory.cache_clear()
