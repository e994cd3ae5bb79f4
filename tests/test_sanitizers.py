"""The sanitizer tier: the C kernels built with AddressSanitizer and UndefinedBehaviorSanitizer, and the
tests that drive every C entry point run against them in a child process, which fails on any report.

The sanitizers' flags go through ``PAGEDINFER_CC_FLAGS`` after the defaults (``-O1``, as the sanitizers'
documentation advises; instrumenting ``-O3`` code took longer to build), with the debug build
(``PAGEDINFER_KERNEL_DEBUG=1``: the kernels' assertions, and their bindings'), into a folder of the
kernel cache of their own (``sanitized``: kept between runs as the plain builds are, since building
them takes minutes on 2 cores). The child runs with the sanitizer runtime preloaded (Python itself is
not instrumented; leak checks off, since Python keeps memory to the end by design).
``PAGEDINFER_SANITIZER_TESTS`` replaces the selection (``tests``: all of them; docs/development.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import DEVICE

from pagedinfer import envs
from pagedinfer.kernels import build, kernel_cache

REPO = Path(__file__).resolve().parents[1]
# alignment: the kernels load and store through memcpy and unaligned intrinsics; object-size and
# pointer-overflow: AddressSanitizer sees every access those would; the three slow the build markedly.
# Instrumentation by calls: quicker to build than inline checks, the same reports.
FLAGS = (
    "-O1 -g1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined "
    "-fno-sanitize=alignment,object-size,pointer-overflow --param=asan-instrumentation-with-call-threshold=0"
)
# every C entry point, each dtype of it, through its Python binding: the refusals of out-of-range
# indexes, decode attention and the K/V write, the GEMM of every panel format and the embedding
# lookup, the elementwise chains and the sampler's C passes, the one-call decode step in engines
# (float32 and bfloat16, 16-bit pools, int8 and GGUF weights), and the LoRA deltas (float32 and
# bfloat16 rows on one and two threads, and adapters in an engine)
TESTS = [
    "tests/test_kernel_bounds.py",
    "tests/test_cpu_kernel_16bit.py::test_half_kernel_matches_reference",
    "tests/test_cpu_kernel_16bit.py::test_float32_queries_over_half_pool_match_reference",
    "tests/test_cpu_kernel_16bit.py::test_completions_over_shared_runs_equal_themselves_alone",
    "tests/test_fast_path.py::test_c_chains_equal_their_torch_form",
    "tests/test_fast_path.py::test_c_argmax_equals_torchs",
    "tests/test_fast_path.py::test_c_temperature_draw_inverts_each_rows_cdf",
    "tests/test_fast_path.py::test_bfloat16_c_chains_round_like_transformers_modules",
    "tests/test_packed_linear.py::test_panel_kernel_gives_the_products_for_any_row_count",
    "tests/test_packed_linear.py::test_gated_linear_gives_silu_of_gate_times_up_in_every_layout",
    "tests/test_packed_linear.py::test_bfloat16_panel_kernel_for_any_row_count",
    "tests/test_packed_linear.py::test_every_c_entry_is_safe_at_zero_rows",
    "tests/test_gguf_types.py::test_panels_dequantize_as_gguf_py",
    "tests/test_gguf_types.py::test_products_equal_the_float32_panels_on_the_dequantized_weight",
    "tests/test_gguf_types.py::test_a_gguf_run_equals_the_float32_run_of_its_dequantized_weights[Q8_0]",
    "tests/test_gguf_types.py::test_a_gguf_run_equals_the_float32_run_of_its_dequantized_weights[Q4_K]",
    "tests/test_decode_step.py::test_c_step_gives_the_bits_of_the_layer_by_layer_path",
    "tests/test_engine.py::test_two_completions_through_the_engine",
    "tests/test_engine.py::test_seeded_sampling_is_reproducible_alone_and_amid_others",
    "tests/test_lora_delta.py::test_each_row_depends_on_itself_alone",
    "tests/test_lora_delta.py::test_batch_size_and_threads_change_no_row",
    "tests/test_lora_delta.py::test_bfloat16_rows_are_the_float32_sums_rounded_once",
    "tests/test_lora.py::test_greedy_matches_peft_with_every_linear_packed[panels]",
]
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer")

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the C kernels are the CPU's")


def runtime() -> str:
    """The compiler's AddressSanitizer runtime (preloaded: it must come before every other library)."""
    compiler = shutil.which(envs.c_compiler())
    if compiler is None:
        pytest.fail(f"no C compiler ({envs.c_compiler()}) on PATH")
    found = subprocess.run(
        [compiler, "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    if not Path(found).is_file():
        pytest.fail(
            f"{envs.c_compiler()} has no AddressSanitizer runtime (libasan.so; gcc's package ships it)"
        )
    return found


@pytest.fixture(scope="module")
def sanitized() -> dict[str, str]:
    """The environment of a child process whose C kernels are the sanitized builds, every one built
    first (in parallel; nothing to do once cached): beside the plain builds, in a folder of their own."""
    env = {
        **os.environ,
        "PAGEDINFER_CACHE": str(kernel_cache.folder("sanitized")),
        "PAGEDINFER_CC_FLAGS": FLAGS,
        "PAGEDINFER_KERNEL_DEBUG": "1",  # the kernels' assertions, and the bindings'
        "LD_PRELOAD": runtime(),
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    with pytest.MonkeyPatch.context() as patch:
        for name in ("PAGEDINFER_CACHE", "PAGEDINFER_CC_FLAGS", "PAGEDINFER_KERNEL_DEBUG"):
            patch.setenv(name, env[name])
        build.prebuild()  # every library
    return env


def run_sanitized(env: dict[str, str], args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_the_kernels_tests_pass_under_the_sanitizers(sanitized):
    """The selected tests pass with every kernel library instrumented (checked in the child: each is
    the sanitized build, linked to the runtime) and nothing is reported."""
    selection = os.environ.get("PAGEDINFER_SANITIZER_TESTS", "").split() or TESTS
    probe = run_sanitized(
        sanitized,
        [
            "-c",
            "from pagedinfer.kernels import paged_decode\n"
            "from pagedinfer.lora import delta\n"
            "from pagedinfer.model import decode_step, fused_ops, packed_linear\n"
            "for load in (paged_decode._library, fused_ops._library, fused_ops._sampling_library,\n"
            "             packed_linear._gemm_library, decode_step._library, delta.library):\n"
            "    assert hasattr(load(), '__asan_init'), f'{load.__module__}: not a sanitized build'\n",
        ],
        timeout=600,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    run = run_sanitized(
        sanitized,
        ["-m", "pytest", "-p", "no:cacheprovider", "-x", "--no-real-model", *selection],
        timeout=1800,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0 and not any(r in output for r in REPORTS), output[-6000:]
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-2000:]


def test_the_tier_reports_an_overflow_and_undefined_behaviour(sanitized, tmp_path):
    """A deliberately buggy source built and loaded the same way: a write one past a heap buffer and a
    signed overflow each end the child with the sanitizer's report; the same calls in range do not."""
    source = tmp_path / "buggy.c"
    source.write_text(
        textwrap.dedent(
            """\
            #include <stdlib.h>
            int store(int i) { int *a = malloc(4 * sizeof *a); a[i] = 1; int r = a[0]; free(a); return r; }
            int add_one(int x) { return x + 1; }
            """
        )
    )
    script = (  # the call in range, then out of it
        "import ctypes, sys\n"
        "from pathlib import Path\n"
        "from pagedinfer.kernels import build\n"
        "lib = ctypes.CDLL(str(build.compile_library(Path(sys.argv[1]))))\n"
        "assert hasattr(lib, '__asan_init')\n"
        "call = getattr(lib, sys.argv[2])\n"
        "print(call(0), flush=True)\n"
        "print(call(int(sys.argv[3])), flush=True)\n"
    )
    for call, value, report in (
        ("store", 4, "ERROR: AddressSanitizer: heap-buffer-overflow"),
        ("add_one", 2**31 - 1, "runtime error: signed integer overflow"),
    ):
        caught = run_sanitized(sanitized, ["-c", script, str(source), call, str(value)], timeout=300)
        assert caught.stdout == "1\n", caught.stderr[-2000:]  # in range: no report
        assert caught.returncode != 0 and report in caught.stderr, caught.stderr[-2000:]
