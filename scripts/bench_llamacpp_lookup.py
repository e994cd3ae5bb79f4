"""llama.cpp's prompt-lookup decoding (its ``llama-lookup`` example) on W6, beside our speculation.

Each W6 line (prompts/w6.jsonl) is rendered with the model's chat template (pagedinfer's tokenizer,
the same text our chat runs score) and run through ``llama-lookup`` greedily, once with drafting off
(``--spec-draft-n-max 0``) and once on (``--spec-draft-n-max K``, its n-gram caches of sizes 1-4 over
the prompt and output so far), alternating, each line a process of its own, one CPU thread as
scripts/bench_speculative_w6.py uses. The JSON line gets its schema as llama.cpp's grammar. Tokens/s
is generated tokens over llama.cpp's own encode plus decode time (model load excluded), so it is
comparable with bench_speculative_w6.py's batch-1 rate (which includes each prompt's prefill).

    python scripts/bench_llamacpp_lookup.py MODEL.gguf [--repeats 2] [--draft 5] [--bin PATH]

``--bin`` defaults to the native build of scripts/bench_llamacpp_build.sh with its examples on:
``cmake -DLLAMA_BUILD_EXAMPLES=ON ~/.cache/pagedinfer-llamacpp/build && cmake --build
~/.cache/pagedinfer-llamacpp/build --target llama-lookup``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

W6 = Path(__file__).resolve().parent.parent / "prompts" / "w6.jsonl"
DEFAULT_BIN = Path.home() / ".cache" / "pagedinfer-llamacpp" / "build" / "bin" / "llama-lookup"
FIGURES = {  # llama-lookup's closing log lines
    "encode_s": re.compile(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds"),
    "tokens": re.compile(r"decoded\s+(\d+) tokens"),
    "decode_s": re.compile(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds"),
    "drafted": re.compile(r"n_drafted\s+=\s+(\d+)"),
    "accepted": re.compile(r"n_accept\s+=\s+(\d+)"),
}


def rendered_prompts(model: str) -> list[tuple[dict, str]]:
    """Each W6 line with its chat rendered as our chat runs render it."""
    from pagedinfer import LLM

    tokenizer = LLM(model, num_blocks=16).get_tokenizer()
    lines = [json.loads(text) for text in W6.read_text().splitlines()]
    return [
        (line, tokenizer.apply_chat_template(line["messages"], add_generation_prompt=True, tokenize=False))
        for line in lines
    ]


def run_line(binary: Path, model: str, line: dict, prompt: str, draft: int, work: Path) -> dict[str, float]:
    """One line through llama-lookup: its closing figures."""
    prompt_file = work / f"{line['id']}.txt"
    prompt_file.write_text(prompt)
    cmd = [str(binary), "-m", model, "-f", str(prompt_file), "-n", str(line["max_tokens"]), "--temp", "0"]
    cmd += ["-t", "1", "--spec-draft-n-max", str(draft), "-co", "off"]
    so = line.get("structured_outputs")
    if so:
        cmd += ["--json-schema", json.dumps(so["json"])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    return {key: float(pattern.search(out).group(1)) for key, pattern in FIGURES.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--draft", type=int, default=5)
    ap.add_argument("--bin", type=Path, default=DEFAULT_BIN)
    args = ap.parse_args()
    lines = rendered_prompts(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for draft in (0, args.draft):
                runs = [
                    run_line(args.bin, args.model, line, prompt, draft, Path(tmp)) for line, prompt in lines
                ]
                tokens = sum(r["tokens"] for r in runs)
                seconds = sum(r["encode_s"] + r["decode_s"] for r in runs)
                drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
                print(
                    rep,
                    "b1",
                    "off" if draft == 0 else f"lookup k={draft}",
                    int(tokens),
                    f"{seconds:.2f}s",
                    f"{tokens / seconds:.2f} tok/s",
                    f"accepted {int(accepted)} of {int(drafted)} drafted",
                    flush=True,
                )


if __name__ == "__main__":
    main()
