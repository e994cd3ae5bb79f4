"""Non-finite logits are an error, never a token: rows with NaN, +Inf or no finite value fail their
request naming the cause (the weights, an adapter, the logit controls), valid rows beside them draw
exactly what they draw alone; adapters with a non-finite alpha, scaling or weights are refused at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import invoke, one_line_error, read_jsonl, tiny_model, with_weights, write_jsonl
from conftest import ENGINE
from models import save_lora
from safetensors.torch import load_file, save_file

from pagedinfer import LLM, BeamSearchParams, SamplingParams
from pagedinfer.logits.controls import AllowedTokens, LogitBias, Penalties
from pagedinfer.logits.processor import LogitsPipeline
from pagedinfer.model.sampler import NonFinite, SampleRow, sample

NAN, INF = float("nan"), float("inf")
HUGE = torch.finfo(torch.float32).max  # finite, so the load accepts it; any product with it overflows
WEIGHTS = "the model's weights hold NaN or Inf values, or overflow float32"


# -- the sampler's rows ---------------------------------------------------------------------------
def _rows(params: list[SamplingParams], seeds: list[int] | None = None) -> list[SampleRow]:
    """Sampler rows with a prompt of 3 tokens, each drawing from the generator of its seed."""
    seeds = seeds or list(range(len(params)))
    return [
        SampleRow(p, [3, 4, 5], 3, None, torch.Generator().manual_seed(s))
        for p, s in zip(params, seeds, strict=True)
    ]


def _pipeline(vocab: int) -> LogitsPipeline:
    return LogitsPipeline([LogitBias(vocab), Penalties()])


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0},
        {"temperature": 0.8},  # the C draw
        {"temperature": 0.8, "top_k": 40},  # the torch draw
        {"temperature": 0, "logprobs": 2},
    ],
    ids=["greedy", "sampled", "top-k", "logprobs"],
)
@pytest.mark.parametrize("vocab", [300, 4099])
def test_rows_without_a_finite_maximum_draw_nothing_and_the_others_draw_as_alone(fields, vocab):
    gen = torch.Generator().manual_seed(vocab)
    good = torch.randn(3, vocab, generator=gen) * 3  # [3, V]
    bad = torch.randn(3, vocab, generator=gen)
    bad[0, vocab // 2] = NAN
    bad[1, vocab - 1] = INF
    bad[2] = -INF  # no processor masked it: the model's
    mixed = torch.stack([good[0], bad[0], good[1], bad[1], bad[2], good[2]])  # [6, V]
    params = [SamplingParams(**fields)] * 6
    alone = sample(good.clone(), _rows(params[:3], [0, 1, 2]), _pipeline(vocab))
    got = sample(mixed.clone(), _rows(params, [0, 7, 1, 8, 9, 2]), _pipeline(vocab))
    assert got.nonfinite == [NonFinite(1, "NaN"), NonFinite(3, "+Inf"), NonFinite(4, "no finite value")]
    assert [got.token_ids[i] for i in (1, 3, 4)] == [-1, -1, -1]
    assert [got.token_ids[i] for i in (0, 2, 5)] == alone.token_ids
    assert [got.logprobs[i] for i in (0, 2, 5)] == alone.logprobs
    assert [got.top[i] for i in (1, 3, 4)] == [None] * 3


def test_controls_are_blamed_only_for_rows_they_made_non_finite():
    """A repetition penalty far below 1 divides a positive logit past float32 (+Inf, the controls'
    doing); logit_bias, at most 100, cannot overflow even the largest finite logit; a row that was
    NaN before the controls is the model's, and so is a logit too large for its temperature (a
    penalty beside it notwithstanding)."""
    logits = torch.zeros(5, 64)  # [5, V]
    logits[:, 4] = 2.0  # a prompt token, positive: the penalty divides it
    logits[[1, 4], 9] = 3.4e38  # near float32's maximum
    logits[3, 20] = NAN
    params = [
        SamplingParams(temperature=0, repetition_penalty=1e-40),
        SamplingParams(temperature=0, logit_bias={9: 100, 10: -100}),
        SamplingParams(temperature=0.7, logit_bias={9: 100}),
        SamplingParams(temperature=0, logit_bias={9: 100}),
        SamplingParams(temperature=0.7, repetition_penalty=1.5),  # finite after it; 3.4e38 / 0.7 overflows
    ]
    got = sample(logits, _rows(params), _pipeline(64))
    assert got.nonfinite == [
        NonFinite(0, "+Inf", "repetition_penalty=1e-40"),
        NonFinite(3, "NaN"),
        NonFinite(4, "+Inf"),
    ]
    assert got.token_ids[1:3] == [9, 9]


# -- a model whose finite weights overflow at run time, through the command line -------------------
@pytest.fixture(scope="module")
def nan_model(tmp_path_factory) -> Path:
    """The CLI's tiny model whose layer 0 value projection is finite but overflows float32 (a NaN weight is
    refused at load, and so is a model whose one-token probe overflows: attention gives zeros there, so
    this one passes): every value sums +Inf and -Inf to NaN, and every logit after it is NaN."""

    def poison(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.v_proj.weight"][:] = HUGE

    return with_weights(tiny_model(), tmp_path_factory.mktemp("nan") / "nan-llama", poison)


def test_every_line_of_a_nan_model_is_an_error_naming_the_weights(nan_model, tmp_path):
    plain = {"prompt": "To be", "max_tokens": 3}
    lines = [
        {"id": "greedy", **plain, "temperature": 0},
        {"id": "sampled", **plain, "temperature": 0.9, "seed": 1},
        {"id": "top-p", **plain, "temperature": 0.9, "top_p": 0.5, "n": 2},
        {"id": "logprobs", **plain, "temperature": 0, "logprobs": 3},
        {"id": "prompt-logprobs", **plain, "prompt_logprobs": 1},
        {"id": "controls", **plain, "temperature": 0, "logit_bias": {"5": 10}, "allowed_token_ids": [5, 6]},
        {"id": "beam", **plain, "beam_width": 2},
        {
            "custom_id": "chat",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True},
        },
    ]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    result = invoke("run", path, "-q", "--device", "cpu", "--model", nan_model)
    assert result.exit_code == 1, result.output
    records = read_jsonl(tmp_path / "p.out.jsonl")
    first = f"the model produced non-finite logits (NaN) at generated token 1: {WEIGHTS}"
    want = {
        **{key: f"line {n}: {first}" for n, key in enumerate(["greedy", "sampled"], 1)},
        "top-p": f"line 3: the model produced non-finite logits (NaN) at generated token 1 of completion 0: "
        f"{WEIGHTS}",
        "logprobs": f"line 4: {first}",
        "prompt-logprobs": f"line 5: {first}",  # its last prompt row samples first, in the same step
        "controls": f"line 6: {first}",
        "beam": f"line 7: {first}",
        "chat": f"line 8: {first}",
    }
    errors = {r.get("custom_id") or r["id"]: r["error"] for r in records}
    assert errors.pop("chat") == {"code": "invalid_request", "message": want.pop("chat")}
    assert errors == want
    assert "Traceback" not in result.output


def test_prompt_logprob_rows_name_the_prompt_token(nan_model):
    """A prompt chunk before the last: its rows give prompt logprobs only (no token is drawn there)."""
    llm = LLM(str(nan_model), block_size=4, num_blocks=64, max_num_batched_tokens=8, **ENGINE)
    (out,) = llm.generate(
        {"prompt_token_ids": list(range(10, 30))},
        SamplingParams(max_tokens=2, prompt_logprobs=0),
        use_tqdm=False,
    )
    assert out.error == f"the model produced non-finite logits (NaN) at prompt token 2 of 20: {WEIGHTS}"


# -- a NaN in one token's column: after the controls is what counts -------------------------------------
def test_a_nan_the_controls_mask_is_no_error_and_changes_no_token():
    """A NaN in token 7's logit (a model's head row overflowing): masked by allowed_token_ids it is no
    error and the token drawn is the clean row's; unmasked, or reported as the model's own logprobs, it
    fails the row."""
    vocab = 64
    clean = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 3  # [V]
    poisoned = clean.clone()
    poisoned[7] = NAN
    allowed = dict(allowed_token_ids=[t for t in range(vocab) if t != 7])
    params = [
        SamplingParams(temperature=0, **allowed),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, **allowed, logprobs=1),  # the model's own row is reported: NaN
    ]
    pipeline = LogitsPipeline([AllowedTokens(vocab)])
    want = sample(clean[None].clone(), _rows(params[:1]), pipeline)
    got = sample(torch.stack([poisoned] * 3), _rows(params), pipeline)  # [3, V]
    assert want.nonfinite == []
    assert got.token_ids[0] == want.token_ids[0]
    assert got.nonfinite == [NonFinite(1, "NaN"), NonFinite(2, "NaN")]


def test_beam_search_of_a_nan_model_fails_with_its_cause(nan_model):
    llm = LLM(str(nan_model), block_size=4, num_blocks=64, **ENGINE)
    (out,) = llm.beam_search([{"prompt_token_ids": [3, 4, 5]}], BeamSearchParams(beam_width=2, max_tokens=3))
    assert out.error == f"the model produced non-finite logits (NaN) at generated token 1: {WEIGHTS}"
    assert out.sequences == []


# -- adapters --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter(model_root) -> tuple[Path, Path]:
    base = tiny_model()
    return base, save_lora(base, model_root / "nonfinite-loras", "good", 8, seed=31)


def _edited(source: Path, out: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of the adapter ``source`` with ``config`` entries (written as Python's JSON writes NaN)
    and its tensors changed by ``tensors``."""
    shutil.copytree(source, out)
    if config:
        file = out / "adapter_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    if tensors:
        file = out / "adapter_model.safetensors"
        found = load_file(file)
        tensors(found)
        save_file(found, file, metadata={"format": "pt"})
    return out


def _poisoned(t: dict[str, torch.Tensor]) -> None:
    key = next(k for k in sorted(t) if k.endswith("layers.1.self_attn.v_proj.lora_B.weight"))
    t[key][2, 3] = NAN
    t[key][0, :2] = -INF


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"lora_alpha": NAN}, None, "adapter 'x': lora_alpha must be a finite number, found NaN"),
        ({"lora_alpha": INF}, None, "adapter 'x': lora_alpha must be a finite number, found Infinity"),
        ({"lora_alpha": True}, None, "adapter 'x': lora_alpha must be a finite number, found true"),
        (
            {"lora_alpha": 1e308},
            None,
            "adapter 'x': lora_alpha / r (lora_alpha=1e+308, r=8) is beyond float32's range (±3.403e+38)",
        ),
        ({"r": True}, None, "adapter 'x': r must be a positive integer, found true"),
        ({"r": 2.5}, None, "adapter 'x': r must be a positive integer, found 2.5"),
        (
            None,
            _poisoned,
            "adapter 'x': tensor base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight holds 1 NaN "
            "and 2 infinite values of 128",
        ),
    ],
    ids=["alpha-nan", "alpha-inf", "alpha-bool", "alpha-1e308", "r-true", "r-float", "weights"],
)
def test_adapters_with_non_finite_values_are_refused_at_load(adapter, tmp_path, config, tensors, message):
    base, good = adapter
    bad = _edited(good, tmp_path / "x", config, tensors)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be", "max_tokens": 2}])
    result = invoke("run", path, "--model", base, "--device", "cpu", "--quiet", "--lora", f"x={bad}")
    one_line_error(result, message)


def test_an_adapter_that_overflows_at_run_time_fails_its_lines_naming_it(adapter, tmp_path):
    """A finite scaling that still overflows the activations: the adapter's lines fail naming it, the
    base model's line is the one it writes alone."""
    base, good = adapter
    huge = _edited(good, tmp_path / "huge", {"lora_alpha": 2e37})  # scaling 2.5e36: float32, barely
    base_line = {"id": "base", "prompt": "To be", "max_tokens": 4, "temperature": 0}
    lines = [base_line, {"id": "a", "prompt": "To be", "max_tokens": 4, "temperature": 0, "lora": "huge"}]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    result = invoke("run", path, "-q", "--device", "cpu", "--model", base, "--lora", f"huge={huge}")
    assert result.exit_code == 1, result.output
    ok, failed = read_jsonl(tmp_path / "p.out.jsonl")
    assert failed["error"].startswith("line 2: the model produced non-finite logits (")
    assert failed["error"].endswith(
        ": the model's weights or the adapter 'huge' hold NaN or Inf values, or overflow float32"
    )
    alone = write_jsonl(tmp_path / "alone.jsonl", [base_line])
    assert invoke("run", alone, "-q", "--device", "cpu", "--model", base).exit_code == 0
    assert read_jsonl(tmp_path / "alone.out.jsonl") == [ok]


def test_a_repetition_penalty_that_overflows_names_the_controls(tiny_model):
    llm = LLM(str(tiny_model("llama")), block_size=4, num_blocks=64, **ENGINE)
    prompt = {"prompt_token_ids": list(range(3, 60))}  # many seen tokens, some with positive logits
    outs = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(temperature=0, max_tokens=3, repetition_penalty=1e-40),
            SamplingParams(temperature=0.8, max_tokens=3, repetition_penalty=1e-40, seed=3),
            SamplingParams(temperature=0, max_tokens=3, logit_bias={5: 100, 6: -100}),
        ],
        use_tqdm=False,
    )
    words = (
        "the logits became non-finite (+Inf) at generated token 1 under repetition_penalty=1e-40; "
        "the model's own logits were finite"
    )
    assert [o.error for o in outs] == [words, words, None]
