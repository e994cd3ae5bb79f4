"""Every kernel instantiation the GPU backend can ask for compiles with NVRTC, as CuPy compiles it.

No GPU needed: CuPy's thin NVRTC binding compiles to cubin without touching a device. The sweep over
all dtype x head size x block size instantiations uses --Ofast-compile=max (same front end, NVVM and
ptxas limits such as static shared memory, about 10x faster); a typical and the largest instantiation
are compiled with exactly the production options too. Skipped only when libnvrtc cannot be loaded.
"""

from __future__ import annotations

import pytest

from pagedinfer.attention import cuda_kernels

ARCHS = ["sm_80", "sm_90"]


@pytest.fixture(scope="module")
def nvrtc():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()  # loads libnvrtc
    except (ImportError, OSError, RuntimeError) as e:
        pytest.skip(f"libnvrtc is not available: {e}")
    return nvrtc


def compile_cubin(nvrtc, source: str, names: list[str], arch: str, fast: bool) -> bytes:
    """Compiles one source with name expressions; fails the test with NVRTC's log on error."""
    prog = nvrtc.createProgram((cuda_kernels.KERNELS_DIR / source).read_text(), source, (), ())
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        options = (
            f"--gpu-architecture={arch}",
            "--device-as-default-execution-space",  # added by CuPy
            *cuda_kernels.nvrtc_options(),
            *(["--Ofast-compile=max"] if fast else []),
        )
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            pytest.fail(f"{source} for {arch}: {e}\n{nvrtc.getProgramLog(prog)}")
        assert all(nvrtc.getLoweredName(prog, n) for n in names)
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


@pytest.mark.parametrize("source", list(cuda_kernels.name_expressions()))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_instantiation_compiles(nvrtc, arch, source):
    names = cuda_kernels.name_expressions()[source]
    assert len(compile_cubin(nvrtc, source, names, arch, fast=True)) > 0


# (dtype, head, block, decode GROUP): a Llama-3 shape, and the largest rows with the largest group
@pytest.mark.parametrize("combo", [("__half", 128, 16, 4), ("float", 256, 32, 8)], ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_production_options_compile(nvrtc, arch, combo):
    names = list(cuda_kernels._attention_names(*combo))
    assert set(names) <= set(cuda_kernels.name_expressions()["paged_attention.cu"])
    assert len(compile_cubin(nvrtc, "paged_attention.cu", names, arch, fast=False)) > 0
