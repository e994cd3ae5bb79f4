"""The benchmark's workloads: which model, which prompts (drawn from a fixed seed), which systems."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from pagedinfer.config import option

# every system a workload may name (the registry in systems.py serves each)
SAMPLING_SYSTEMS = ("pagedinfer", "hf_generate", "hf_generate_batch")


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    model: str  # a key of models.MODELS
    num_prompts: int
    prompt_len: tuple[int, int]  # inclusive range of each prompt's own (drawn) length
    max_tokens: tuple[int, int]  # inclusive range of per-prompt max_tokens (equal ends: one value)
    n: int  # completions per prompt; with beam search, the beam width
    temperature: float
    seed: int
    hf_batch_size: int | None = None  # prompts per hf_generate batch; None: all in one batch
    shared_prefix: int = 0  # tokens of one system prompt put before every prompt
    beam_search: bool = False  # beams (width n, length_penalty 1, no early stopping) instead of completions
    systems: tuple[str, ...] = SAMPLING_SYSTEMS
    dtypes: tuple[str, ...] = ("float32",)  # each dtype is run in turn, every system in that dtype
    device: str = "cpu"  # "cuda": a GPU workload (random weights drawn on the device, never saved)

    def describe(self) -> str:
        mt = self.max_tokens
        tokens = f"{mt[0]} new tokens" if mt[0] == mt[1] else f"max_tokens {mt[0]}-{mt[1]} per prompt"
        if self.beam_search:
            mode = f"beam search, width {self.n}, length_penalty 1.0, no early stopping"
        else:
            sampling = "greedy" if self.temperature == 0 else f"temperature {self.temperature}"
            mode = f"n={self.n}, {sampling}"
        prefix = f"a shared {self.shared_prefix}-token prefix + " if self.shared_prefix else ""
        lens = f"{self.prompt_len[0]}-{self.prompt_len[1]}"
        return f"{self.num_prompts} prompts of {prefix}{lens} random tokens, {mode}, {tokens}, ignore_eos"


_PAGED_AND_PEERS = ("pagedinfer", "pagedinfer_no_prefix_cache", "hf_generate", "hf_generate_batch")

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("W0", "overhead-bound", "tiny2l", 64, (8, 40), (32, 32), 1, 0.0, 1000),
        Workload("W1", "parallel sampling", "smollm135m", 16, (64, 192), (64, 64), 4, 0.8, 1001),
        Workload("W2", "mixed lengths", "smollm135m", 48, (32, 512), (16, 256), 1, 0.0, 1002, 16),
        Workload(
            "W3",
            "shared prefix",
            "smollm135m",
            64,
            (16, 64),
            (32, 32),
            1,
            0.0,
            1003,
            shared_prefix=512,
            systems=_PAGED_AND_PEERS,
        ),  # fmt: skip
        Workload(
            "W4",
            "beam search",
            "smollm135m",
            8,
            (64, 128),
            (64, 64),
            4,
            0.0,
            1004,
            beam_search=True,
            systems=("pagedinfer", "hf_generate"),
        ),  # fmt: skip
        Workload(
            "W5",
            "Llama-3.2-1B shape",
            "llama1b",
            32,
            (128, 512),
            (128, 128),
            2,
            0.8,
            1005,
            systems=("pagedinfer", "hf_generate"),
            dtypes=("bfloat16", "float32"),
        ),  # fmt: skip
        Workload(
            "G1",
            "Llama-3.2-1B shape on a GPU",
            "llama1b",
            256,
            (128, 1024),
            (256, 256),
            4,
            0.8,
            1101,
            hf_batch_size=64,
            dtypes=("bfloat16",),
            device="cuda",
        ),  # fmt: skip
        Workload(
            "G2",
            "Llama-3.1-8B shape on a GPU",
            "llama8b",
            256,
            (128, 1024),
            (256, 256),
            4,
            0.8,
            1102,
            hf_batch_size=32,
            dtypes=("bfloat16",),
            device="cuda",
        ),  # fmt: skip
    )
}
GPU_WORKLOADS = tuple(name for name, w in WORKLOADS.items() if w.device == "cuda")

# --quick: a smoke test of every workload (a few minutes in all on 2 cores, W5 aside)
QUICK: dict[str, dict] = {
    "W0": dict(num_prompts=16, max_tokens=(8, 8)),
    "W1": dict(num_prompts=4, prompt_len=(16, 48), max_tokens=(8, 8)),
    "W2": dict(num_prompts=8, prompt_len=(16, 96), max_tokens=(4, 16), hf_batch_size=4),
    "W3": dict(num_prompts=8, shared_prefix=64, max_tokens=(8, 8)),
    "W4": dict(num_prompts=2, prompt_len=(16, 32), max_tokens=(8, 8)),
    "W5": dict(num_prompts=2, prompt_len=(16, 48), max_tokens=(4, 4)),
    "G1": dict(num_prompts=16, max_tokens=(16, 16)),
    "G2": dict(num_prompts=16, max_tokens=(16, 16)),
}


@dataclass(frozen=True)
class Shrink:
    """Cuts applied to a workload after its prompts are drawn, so the prompts kept are those of the
    full workload (``--prompts``, ``--max-prompt-len``, ``--max-tokens``; None: no cut)."""

    prompts: int | None = option(None, "Keep only each workload's first N prompts.")
    prompt_len: int | None = option(  # each drawn part (a prompt; W3's shared prefix)
        None,
        "Cut each prompt (W3: the shared prefix and each question) to its first N tokens.",
        flags=("--max-prompt-len",),
    )
    max_tokens: int | None = option(None, "Cap every prompt's new tokens at N.")
    hf_prompts: int | None = option(  # slow on a GPU
        None,
        "The transformers systems run only the first N prompts (slow on a GPU); their tok/s is over those "
        "(the table says so).",
    )

    def describe(self) -> str:
        parts = [
            f"first {self.prompts} prompts" if self.prompts else "",
            f"prompt parts cut to {self.prompt_len} tokens" if self.prompt_len else "",
            f"max_tokens capped at {self.max_tokens}" if self.max_tokens else "",
            f"the transformers systems run only the first {self.hf_prompts} prompts (tok/s over theirs)"
            if self.hf_prompts
            else "",
        ]
        return ", ".join(p for p in parts if p)


def quick(w: Workload) -> Workload:
    return replace(w, **QUICK[w.name])


def make_prompts(w: Workload, vocab: int, shrink: Shrink = Shrink()) -> tuple[list[list[int]], list[int]]:
    """The workload's prompts (token ids in 1..vocab-1) and per-prompt max_tokens, from its seed."""
    rng = random.Random(w.seed)
    cut = shrink.prompt_len
    prefix = [rng.randrange(1, vocab) for _ in range(w.shared_prefix)][:cut]
    own = [[rng.randrange(1, vocab) for _ in range(rng.randint(*w.prompt_len))] for _ in range(w.num_prompts)]
    max_tokens = [rng.randint(*w.max_tokens) for _ in range(w.num_prompts)]
    keep = shrink.prompts or w.num_prompts
    prompts = [prefix + p[:cut] for p in own[:keep]]
    cap = shrink.max_tokens
    return prompts, [min(m, cap) if cap else m for m in max_tokens[:keep]]


def default_num_blocks(prompts: list[list[int]], max_tokens: list[int], n: int, block_size: int) -> int:
    """Blocks for every completion at full length with no sharing: nobody preempts, nobody runs out."""
    return sum(n * -(-(len(p) + m) // block_size) for p, m in zip(prompts, max_tokens, strict=True))
