"""Write (or check) the golden records under tests/golden/: what every machine must compute.

    python scripts/make_golden.py            # write them; says which cases changed
    python scripts/make_golden.py --check    # change nothing; exit 1 when a case would change

Each case runs a few seeded sampling lines (n > 1, logprobs, prompt_logprobs) and a greedy one on
one model and dtype: the embedded demo model, a tiny Qwen3 whose weights come from a counter-based
hash (the same bits on every machine and library version, where torch's own initialisers take other
vectorised paths on other CPUs), and a tiny Llama in a GGUF Q4_0 file kept in tests/golden/ (made
here once from the same kind of weights); in float32 and in bfloat16. tests/test_reproducibility.py
runs the same cases on the machine at hand and compares the records bit for bit.

The kernels' native build makes them: every build (AVX2, AVX-512, with or without AVX512-BF16)
computes the same bits (docs/reproducibility.md), so any machine can. tests/golden/manifest.json keeps
each case's fingerprint components, which the test uses to tell a change of the libraries from a
failure, and the generated weights' digest, which tells a change of the weights from a change of the
numerics.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
GGUF_FILE = GOLDEN / "tiny-llama-q4_0.gguf"
MANIFEST = GOLDEN / "manifest.json"
SEED = 54
SCALE = 0.25  # weights uniform in [-SCALE, SCALE): a power of two, so the scaling is exact
SHAPE = dict(  # the tiny models' shape (Q4_0 rows: multiples of 32)
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
    tie_word_embeddings=False,
)
IDS = [[17, 201, 45, 3, 99, 140, 7, 251, 63, 12, 88, 190, 33, 5, 120, 77, 230, 41, 9, 150], [64, 2, 180]]
TEXTS = ["ROMEO:\nWhat light", "KING HENRY:"]


def lines(prompts: list) -> list[dict]:
    """The golden lines on two prompts: sampled (n 3, temperature), filtered (top-k, top-p), greedy."""
    first, second = prompts
    return [
        {
            "key": "sampled",
            "prompt": first,
            "n": 3,
            "seed": 7,
            "max_tokens": 10,
            "logprobs": 3,
            "prompt_logprobs": 2,
        },
        {
            "key": "filtered",
            "prompt": second,
            "n": 2,
            "seed": 8,
            "temperature": 0.8,
            "top_k": 20,
            "top_p": 0.9,
            "max_tokens": 10,
            "logprobs": 2,
            "prompt_logprobs": 1,
        },
        {"key": "greedy", "prompt": second, "temperature": 0.0, "max_tokens": 8, "logprobs": 1},
    ]


# case -> (model: "demo", "qwen3" or "gguf", dtype)
CASES = {
    f"{model}-{dtype}": (model, dtype)
    for model in ("demo", "qwen3", "gguf")
    for dtype in ("float32", "bfloat16")
}


def record(out) -> str:
    """A request's record as the contract covers it (token ids, text, logprobs and prompt_logprobs as
    exact floats, finish reasons), as one JSON text: equal texts, equal bits."""
    if out.error is not None:
        raise RuntimeError(f"request {out.request_id} failed: {out.error}")

    def entries(top):
        return None if top is None else sorted([t, lp.logprob, lp.rank] for t, lp in top.items())

    return json.dumps(
        {
            "prompt_logprobs": None
            if out.prompt_logprobs is None
            else [entries(e) for e in out.prompt_logprobs],
            "outputs": [
                {
                    "index": c.index,
                    "text": c.text,
                    "token_ids": list(c.token_ids),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "cumulative_logprob": c.cumulative_logprob,
                    "logprobs": None if c.logprobs is None else [entries(e) for e in c.logprobs],
                }
                for c in out.outputs
            ],
        }
    )


# -- portable random weights -------------------------------------------------------------------------
def uniform(key: str, n: int):
    """``n`` float32 values in [-1, 1) from SplitMix64 over a counter keyed by ``key``: integer
    arithmetic, then an exact conversion, so every machine gets the same bits."""
    import numpy as np

    start = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + np.uint64(start)
        z = z * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(40)).astype(np.int64) - (1 << 23)).astype(np.float32) / np.float32(1 << 23)


def portable_model(family: str, path: Path) -> str:
    """A tiny ``family`` model (llama or qwen3) with `uniform` weights, saved at ``path``; the digest of
    its tensors (names, shapes and bits), which the test checks before comparing any record."""
    import torch
    import transformers as tf

    config = tf.Qwen3Config(**SHAPE, head_dim=16) if family == "qwen3" else tf.LlamaConfig(**SHAPE)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            values = torch.from_numpy(uniform(f"{SEED}:{family}:{name}", tensor.numel())).view(tensor.shape)
            tensor.copy_(values / 8 + 1 if name.endswith("norm.weight") else values * SCALE)  # exact
            digest.update(f"{name}{list(tensor.shape)}".encode() + tensor.numpy().tobytes())
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return digest.hexdigest()


def make_gguf(work: Path) -> tuple[Path, str]:
    """The tiny Llama as a GGUF Q4_0 file (every matrix Q4_0) in ``work``, and its weights' digest."""
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_models import save_gguf

    digest = portable_model("llama", work / "llama")
    return save_gguf(work / "llama", work / GGUF_FILE.name, lambda name: "Q4_0"), digest


# -- running a case ----------------------------------------------------------------------------------
def model_path(model: str, work: Path) -> tuple[str, str | None]:
    """The model to load for a case, and the digest of generated weights (None: a file kept as is)."""
    if model == "demo":
        return None, None
    if model == "gguf":
        return str(GGUF_FILE), None
    path = work / "qwen3"
    digest = portable_model("qwen3", path)
    return str(path), digest


def run_case(case: str, work: Path) -> dict:
    """The case's records (by line key), fingerprint components and generated weights' digest."""
    from pagedinfer import LLM, SamplingParams
    from pagedinfer.engine.fingerprint import components

    model, dtype = CASES[case]
    path, weights = model_path(model, work)
    llm = LLM(path, device="cpu", dtype=dtype, kv_cache_memory="16MiB")
    golden = lines(TEXTS if model == "demo" else IDS)
    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in (g["prompt"] for g in golden)]
    params = [SamplingParams(**{k: v for k, v in g.items() if k not in ("key", "prompt")}) for g in golden]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {
        "records": {g["key"]: record(o) for g, o in zip(golden, outs, strict=True)},
        "components": json.loads(json.dumps(components(llm.engine))),
        "weights": weights,
    }


def golden_file(case: str) -> Path:
    return GOLDEN / f"{case}.jsonl"


def read_golden(case: str) -> dict[str, str]:
    """A golden file: one line per record, ``{"key": ..., "record": ...}``."""
    rows = [json.loads(line) for line in golden_file(case).read_text().splitlines()]
    return {row["key"]: json.dumps(row["record"]) for row in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 when a case would change"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import tempfile

    import torch

    torch.set_num_threads(2)
    old = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {"cases": {}}
    changed = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        made, weights = make_gguf(work)
        manifest = {"gguf_weights": weights, "cases": {}}
        if not (GGUF_FILE.exists() and GGUF_FILE.read_bytes() == made.read_bytes()):
            changed.append(GGUF_FILE.name)
            if not args.check:
                GGUF_FILE.write_bytes(made.read_bytes())
        for case in CASES:
            found = run_case(case, work)
            manifest["cases"][case] = {"components": found["components"], "weights": found["weights"]}
            text = "".join(
                json.dumps({"key": key, "record": json.loads(r)}) + "\n"
                for key, r in found["records"].items()
            )
            path = golden_file(case)
            records = path.exists() and path.read_text() == text
            components = old["cases"].get(case) == manifest["cases"][case]
            state = "records CHANGED" if path.exists() and not records else "new" if not records else None
            print(f"{case}: {state or ('unchanged' if components else 'fingerprint components changed')}")
            if not (records and components):
                changed.append(case)
                if not args.check:
                    path.write_text(text)
    if changed and not args.check:
        MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if changed:
        print(f"make_golden: {'would change' if args.check else 'changed'}: {', '.join(changed)}")
        return 1 if args.check else 0
    print("make_golden: every golden record unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
