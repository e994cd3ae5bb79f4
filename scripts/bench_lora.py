"""W1 with 4 LoRA adapters mixed over its lines against the base model alone, in one process.

Model: ``pagedinfer bench``'s random-weight SmolLM2-135M shape (``smollm135m``), saved once under
``--cache``. Adapters: 4 random rank-16 PEFT adapters (``adapter_config.json`` + safetensors, written
here without PEFT) on every linear of every layer (q, k, v, o, gate, up, down), ``lora_alpha`` 32.
Workload: W1 (16 prompts of 64-192 random tokens, n=4, temperature 0.8, 64 new tokens, ignore_eos),
prompt i with adapter i mod 4 in the LoRA runs. One ``LLM(enable_lora=True, max_loras=4)`` serves
both; the runs alternate (base, LoRA, base, ...) ``--repeats`` times after one warm-up each, the
prefix cache emptied before each. Printed: the CPU, each run's generated tokens per second of wall
time and per second of this process's CPU time (less swayed by other jobs on a shared machine), the
best of each and their ratios; ``--profile`` adds the seconds the LoRA runs spent in the deltas (every
``LoRASite.apply``, and the fused gate-up's un-gated product with its activation).

Usage: python scripts/bench_lora.py [--cache DIR] [--repeats 3] [--threads 2] [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedinfer import LLM, LoRARequest, SamplingParams
from pagedinfer.bench.models import MODELS, build_model
from pagedinfer.bench.workloads import WORKLOADS, make_prompts
from pagedinfer.lora import site as lora_site
from pagedinfer.model import llama

RANK, ADAPTERS = 16, 4
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def write_adapter(path: Path, fields: dict, seed: int) -> Path:
    """A random rank-16 LoRA on every linear of a Llama of these config fields, as PEFT saves one."""
    if (path / "adapter_config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    h, inter = fields["hidden_size"], fields["intermediate_size"]
    d = h // fields["num_attention_heads"]
    q, kv = fields["num_attention_heads"] * d, fields["num_key_value_heads"] * d
    shapes = {  # (in, out)
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(fields["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            group = "self_attn" if name in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{i}.{group}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.01
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(TARGETS)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


class DeltaClock:
    """Seconds in ``LoRASite.apply`` (the deltas' GEMMs) and in the fused gate-up's un-gated product
    (the base gate-up GEMM written out whole, reordered, then its activation: what a LoRA step's MLP
    does instead of the gated GEMM)."""

    def __init__(self) -> None:
        self.seconds = {"deltas": 0.0, "ungated gate-up": 0.0}
        self.on = False

        def timed(fn, what: str):
            def wrapper(*args, **kwargs):
                if not self.on:
                    return fn(*args, **kwargs)
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds[what] += time.perf_counter() - start

            return wrapper

        lora_site.LoRASite.apply = timed(lora_site.LoRASite.apply, "deltas")
        llama.packed_linear.ungated = timed(llama.packed_linear.ungated, "ungated gate-up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "pagedinfer-bench-lora")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = DeltaClock() if args.profile else None
    model = build_model("smollm135m", args.cache)
    fields = MODELS["smollm135m"][0]
    adapters = [write_adapter(args.cache / f"lora-{i}", fields, seed=i) for i in range(ADAPTERS)]
    w = WORKLOADS["W1"]
    prompts, max_tokens = make_prompts(w, model.vocab_size)
    params = [
        SamplingParams(n=w.n, temperature=w.temperature, max_tokens=m, ignore_eos=True, seed=w.seed + i)
        for i, m in enumerate(max_tokens)
    ]
    llm = LLM(
        str(model.path), enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANK, kv_cache_memory="2GiB"
    )
    requests = [LoRARequest(f"lora-{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    mixed = [requests[i % ADAPTERS] for i in range(len(prompts))]
    print(f"{cpu_name()}, {torch.get_num_threads()} threads; {w.name}: {w.describe()}")
    print(
        f"{ADAPTERS} adapters of rank {RANK} on q, k, v, o, gate, up, down of all 30 layers, mixed over the lines"
    )

    walls: dict[str, list[float]] = {"base": [], "lora": []}
    cpu_rates: dict[str, list[float]] = {"base": [], "lora": []}

    def run(kind: str) -> float:
        llm.reset_prefix_cache()
        if clock is not None:
            clock.on = kind == "lora"
        start, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            params,
            use_tqdm=False,
            lora_request=mixed if kind == "lora" else None,
        )
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        walls[kind].append(wall)
        if clock is not None:
            clock.on = False
        assert all(o.error is None for o in outs)
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        cpu_rates[kind].append(tokens / cpu)
        return tokens / wall

    run("base"), run("lora")  # warm-up: kernels, page faults, the adapters read
    walls = {"base": [], "lora": []}
    cpu_rates = {"base": [], "lora": []}
    if clock is not None:
        clock.seconds = dict.fromkeys(clock.seconds, 0.0)
    rates: dict[str, list[float]] = {"base": [], "lora": []}
    for r in range(args.repeats):
        for kind in ("base", "lora"):
            rates[kind].append(run(kind))
            print(
                f"  repeat {r + 1} {kind:4}: {rates[kind][-1]:8.1f} generated tok/s, "
                f"{cpu_rates[kind][-1]:8.1f} per CPU second"
            )
    best = {k: max(v) for k, v in rates.items()}
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"best: base {best['base']:.1f} tok/s, 4 adapters mixed {best['lora']:.1f} tok/s: "
        f"ratio {best['lora'] / best['base']:.3f} (median ratio {med['lora'] / med['base']:.3f})"
    )
    cpu_best = {k: max(v) for k, v in cpu_rates.items()}
    print(
        f"per CPU second, best: base {cpu_best['base']:.1f}, mixed {cpu_best['lora']:.1f}: "
        f"ratio {cpu_best['lora'] / cpu_best['base']:.3f}"
    )
    if clock is not None:
        spent = ", ".join(f"{what} {s:.2f} s" for what, s in clock.seconds.items())
        print(
            f"timed LoRA runs: {sum(walls['lora']):.2f} s in all ({spent}); base runs {sum(walls['base']):.2f} s"
        )


if __name__ == "__main__":
    main()
