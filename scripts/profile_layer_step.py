#!/usr/bin/env python
"""Ops and time of one decode step, per layer, for each model implementation (transformers, pagedinfer).

    python scripts/profile_layer_step.py MODEL_DIR --batch 1,16 --threads 2 [--dtype bfloat16]
        [--kv-cache-dtypes auto,float16]

Runs ``batch`` prompts of ``--context`` random tokens, decodes ``--steps`` tokens each, and times
every decode step (``ModelRunner.execute``: metadata, forward, logits), the GEMMs inside it
(every ``nn.Linear`` / ``PackedLinear`` call, lm_head included, plus the GEMMs the one-call C decode
step times itself, model/decode_step.py) and, in one extra step under a
``TorchDispatchMode``, the aten ops it dispatches. Non-GEMM = step - GEMMs: the time the fused
layers are there to cut. Prints medians; ratios are only meaningful within one run. A table of the
GEMMs by module follows (`role`: the attention's linears, a dense MLP's, a mixture of experts'
router, its experts, the shared expert, the lm_head: ms per step and calls per step, with the
experts' mean per call) and, for a mixture of experts, its layers' whole time per step
(``moe.ExpertMLP``: router, routing, the rows' gathers, the experts, the weighted sums).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pagedinfer import LLM, SamplingParams
from pagedinfer.model import decode_step, moe
from pagedinfer.model.packed_linear import PackedLinear

# the C step's clocks (decode_step.gemm_seconds) are built in only on request
os.environ["PAGEDINFER_CC_FLAGS"] = f"{os.environ.get('PAGEDINFER_CC_FLAGS', '')} {decode_step.TIMERS_FLAG}"


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


ROLES = ("attention", "mlp", "router", "experts", "shared expert", "lm_head", "other")


def role(name: str) -> str:
    """A linear's part of the model, from its module name (our layers' and transformers')."""
    if name.endswith("lm_head"):
        return "lm_head"
    if "shared_expert" in name or ".shared." in name:
        return "shared expert"
    if ".experts." in name or name.endswith(".experts"):
        return "experts"
    if name.endswith((".router", ".gate")):
        return "router"
    if ".self_attn." in name or name.endswith((".qkv_proj", ".o_proj")):
        return "attention"
    return "mlp" if ".mlp." in name or name.endswith((".gate_up_proj", ".down_proj")) else "other"


def measure(model: str, impl: str, batch: int, context: int, steps: int, dtype: str, kv: str) -> dict:
    llm = LLM(model, device="cpu", dtype=dtype, model_impl=impl, kv_cache_dtype=kv)
    runner = llm.engine.runner
    execute = runner.execute
    gemm = [0.0]
    rec: dict[str, list] = {"step": [], "gemm": [], "attention": [], "moe": []}
    counted: list[Counter] = []
    roles = {id(m): role(n) for n, m in llm.engine.loaded.model.named_modules()}
    by_role: Counter = Counter()  # role -> seconds in this step
    calls: Counter = Counter()  # role -> calls in this step
    per_step: list[tuple[Counter, Counter]] = []

    def timed_linear(forward):
        def wrapper(self, x):
            t = time.perf_counter()
            out = forward(self, x)
            took = time.perf_counter() - t
            gemm[0] += took
            by_role[roles.get(id(self), "other")] += took
            calls[roles.get(id(self), "other")] += 1
            return out

        return wrapper

    moe_s = [0.0]

    def timed_moe(forward):
        def wrapper(self, x):
            t = time.perf_counter()
            out = forward(self, x)
            moe_s[0] += time.perf_counter() - t
            return out

        return wrapper

    def timed_execute(items, copies):
        decode = all(s.num_tokens == 1 for s in items)
        if decode and len(rec["step"]) == steps // 2 and not counted:  # one step in the middle, counted
            with OpCounter() as c:
                out = execute(items, copies)
            counted.append(c.ops)
            return out
        gemm[0] = moe_s[0] = 0.0
        by_role.clear()
        calls.clear()
        decode_step.gemm_seconds()  # reset the C step's own GEMM and attention clocks
        decode_step.attention_seconds()
        t = time.perf_counter()
        out = execute(items, copies)
        if decode:
            rec["step"].append(time.perf_counter() - t)
            rec["gemm"].append(gemm[0] + decode_step.gemm_seconds())
            rec["attention"].append(decode_step.attention_seconds())
            rec["moe"].append(moe_s[0])
            per_step.append((Counter(by_role), Counter(calls)))
        return out

    saved = nn.Linear.forward, PackedLinear.forward, moe.ExpertMLP.forward
    nn.Linear.forward, PackedLinear.forward = timed_linear(saved[0]), timed_linear(saved[1])
    moe.ExpertMLP.forward = timed_moe(saved[2])
    runner.execute = timed_execute
    try:
        rng = random.Random(0)
        vocab = llm.engine.loaded.model.get_input_embeddings().num_embeddings
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(context)]} for _ in range(batch)]
        llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False
        )
    finally:
        nn.Linear.forward, PackedLinear.forward, moe.ExpertMLP.forward = saved
    layers = llm.engine.loaded.model.config.num_hidden_layers
    step, g = statistics.median(rec["step"]), statistics.median(rec["gemm"])
    ops = counted[0]
    return {
        "impl": impl,
        "batch": batch,
        "kv": llm.stats.kv_cache_dtype,
        "step_ms": step * 1e3,
        "gemm_ms": g * 1e3,
        "non_gemm_ms": (step - g) * 1e3,
        "non_gemm_share": (step - g) / step,
        "attention_ms": statistics.median(rec["attention"]) * 1e3,
        "ops_per_step": sum(ops.values()),
        "ops_per_layer": sum(ops.values()) / layers,
        "layer_step_ms": step * 1e3 / layers,
        "top_ops": ops.most_common(8),
        "moe_ms": statistics.median(rec["moe"]) * 1e3,
        "roles": {
            r: (
                statistics.median(s[r] for s, _ in per_step) * 1e3,
                statistics.median(c[r] for _, c in per_step),
            )
            for r in ROLES
            if any(c[r] for _, c in per_step)
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--impls", default="transformers,pagedinfer")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="the model's dtype on the CPU")
    ap.add_argument("--kv-cache-dtypes", default="auto", help="the KV pool's, one run each: auto,float16,...")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        "| impl | K/V | batch | step ms | GEMM ms | non-GEMM ms | non-GEMM share | of which C attention ms "
        "| aten ops/step | ops/layer | ms/layer-step |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    tops = []
    for b in map(int, args.batch.split(",")):
        for impl in args.impls.split(","):
            for kv in args.kv_cache_dtypes.split(","):
                r = measure(args.model, impl, b, args.context, args.steps, args.dtype, kv)
                print(
                    f"| {impl} | {r['kv']} | {b} | {r['step_ms']:.2f} | {r['gemm_ms']:.2f} | {r['non_gemm_ms']:.2f} | "
                    f"{r['non_gemm_share']:.0%} | {r['attention_ms']:.2f} | {r['ops_per_step']} | {r['ops_per_layer']:.1f} | {r['layer_step_ms']:.3f} |",
                    flush=True,
                )
                tops.append((impl, b, r))
    for impl, b, r in tops:
        print(f"{impl} batch {b}: " + ", ".join(f"{name} {n}" for name, n in r["top_ops"]))
    print("\nGEMMs by module, median per decode step: ms (calls)")
    print("| impl | batch | " + " | ".join(ROLES) + " | experts ms/call | MoE layers ms |")
    print("|---|---:|" + "---:|" * (len(ROLES) + 2))
    for impl, b, r in tops:
        cells = [
            f"{r['roles'][x][0]:.2f} ({r['roles'][x][1]:.0f})" if x in r["roles"] else "-" for x in ROLES
        ]
        ms, n = r["roles"].get("experts", (0.0, 0))
        per_call = f"{ms / n:.3f}" if n else "-"
        print(f"| {impl} | {b} | " + " | ".join(cells) + f" | {per_call} | {r['moe_ms']:.2f} |")


if __name__ == "__main__":
    main()
