"""LoRA adapters per request: greedy tokens equal PEFT's (unmerged) on transformers, adapters mixed in
one batch equal each alone, more adapters than slots swapped in and out, prefix caching keyed by
adapter, and the errors of adapters that cannot run."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers as tf
from cli_helpers import invoke, one_line_error, read_jsonl, tiny_model, write_jsonl
from conftest import ENGINE
from models import ALL_LINEARS, COMMON, DECODER, hf_greedy, peft_greedy, save_lora

from pagedinfer import LLM, LoRARequest, SamplingParams
from pagedinfer.model.random_models import save_random_model

LENGTHS = (1, 5, 9, 16, 23)  # below, at and across blocks of 4
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(2, 256) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def loras(tiny_model, model_root):
    """``loras(family)``: rank 8 on every linear, rank 16 on every linear and lm_head (rsLoRA)."""

    def make(family: str) -> dict[str, Path]:
        base, root = tiny_model(family), model_root / "loras"
        return {
            "r8": save_lora(base, root, f"{family}-r8", 8, seed=1),
            "r16": save_lora(
                base, root, f"{family}-r16", 16, seed=2, targets=[*ALL_LINEARS, "lm_head"], use_rslora=True
            ),
        }

    return make


def _request(name: str, path: Path) -> LoRARequest:
    return LoRARequest(name, {"r8": 1, "r16": 2}.get(name, 9), str(path))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("impl", ["transformers", "pagedinfer"])
@pytest.mark.parametrize("mix", ["one", "mixed"])
@pytest.mark.parametrize("num_blocks", [256, 14], ids=["roomy-pool", "preempting-pool"])
def test_greedy_matches_peft(tiny_model, loras, prompts, family, impl, mix, num_blocks):
    base, adapters = tiny_model(family), loras(family)
    llm = LLM(
        str(base),
        block_size=4,
        num_blocks=num_blocks,
        model_impl=impl,
        enable_lora=True,
        max_loras=2,
        **ENGINE,
    )
    assert llm.engine.loaded.impl == impl
    names = (
        ["r8"] * len(prompts) if mix == "one" else [[None, "r8", "r16"][i % 3] for i in range(len(prompts))]
    )
    if mix == "mixed":  # the same prompt under each adapter: K/V of one never serves another
        prompts, names = [*prompts, prompts[-1], prompts[-1]], [*names, "r16", None]
    requests = [None if n is None else _request(n, adapters[n]) for n in names]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=requests
    )
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        want = _reference(base, adapters, name, prompt)
        assert out.error is None and out.outputs[0].token_ids == want, f"{name}, prompt of {len(prompt)}"
    assert (llm.stats.preemptions > 0) == (num_blocks == 14)
    assert llm.engine.pool.num_used == 0


def _reference(base: Path, adapters: dict[str, Path], name: str | None, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens: the base model's, or PEFT's with adapter ``name``."""
    if name is None:
        return hf_greedy(base, prompt, MAX_TOKENS)
    return peft_greedy(base, adapters[name], prompt, MAX_TOKENS)


@pytest.mark.parametrize("gemm", ["panels", "onednn"])
def test_greedy_matches_peft_with_every_linear_packed(tiny_model, loras, prompts, gemm, monkeypatch):
    """The tiny weights are below the packing threshold: pack all of them, the fused gate-up in paired
    panels (panels) or oneDNN's layout, so the deltas meet the packed GEMMs' products."""
    from pagedinfer.model import packed_linear

    if gemm == "panels" and not packed_linear.panel_dtype(torch.float32, 64):
        pytest.skip("the panel kernel did not build")
    monkeypatch.setattr(packed_linear, "MIN_WEIGHTS", 0)
    monkeypatch.setenv("PAGEDINFER_CPU_GEMM", gemm)
    base, adapters = tiny_model("llama"), loras("llama")
    llm = LLM(
        str(base),
        block_size=4,
        num_blocks=256,
        model_impl="pagedinfer",
        enable_lora=True,
        max_loras=2,
        **ENGINE,
    )
    gate_up = llm.engine.loaded.model.layers[0].gate_up_proj
    assert isinstance(gate_up, packed_linear.PackedLinear) and (gate_up.segments is not None) == (
        gemm == "panels"
    )
    names = [[None, "r8", "r16"][i % 3] for i in range(len(prompts))]
    requests = [None if n is None else _request(n, adapters[n]) for n in names]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=requests
    )
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        want = _reference(base, adapters, name, prompt)
        assert out.outputs[0].token_ids == want, f"{name}, prompt of {len(prompt)}"


@pytest.mark.parametrize("impl", ["transformers", "pagedinfer"])
def test_four_adapters_mixed_equal_each_alone(tiny_model, model_root, prompts, impl):
    """Seeded sampling, n=2: a batch mixing 4 adapters (and base lines) gives each line the tokens it gets
    when its adapter's lines run alone."""
    base = tiny_model("qwen2")
    root = model_root / "loras"
    adapters = {
        "qv": save_lora(base, root, "qwen2-qv", 8, seed=11, targets=["q_proj", "v_proj"]),
        "mlp": save_lora(base, root, "qwen2-mlp", 16, seed=12, targets=["gate_proj", "up_proj", "down_proj"]),
        "all8": save_lora(base, root, "qwen2-all8", 8, seed=13),
        "all16": save_lora(base, root, "qwen2-all16", 16, seed=14, use_rslora=True),
    }
    requests = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())}
    order = [None, *adapters]
    lines = [(p, order[(i + j) % len(order)]) for i, p in enumerate(prompts) for j in range(2)]
    params = [
        SamplingParams(n=2, temperature=0.9, max_tokens=8, ignore_eos=True, seed=100 + i)
        for i in range(len(lines))
    ]
    llm = LLM(
        str(base), block_size=4, num_blocks=256, model_impl=impl, enable_lora=True, max_loras=4, **ENGINE
    )

    def run(indices: list[int]) -> dict[int, list[list[int]]]:
        outs = llm.generate(
            [{"prompt_token_ids": lines[i][0]} for i in indices],
            [params[i] for i in indices],
            use_tqdm=False,
            lora_request=[None if lines[i][1] is None else requests[lines[i][1]] for i in indices],
        )
        return {i: [c.token_ids for c in o.outputs] for i, o in zip(indices, outs, strict=True)}

    mixed = run(list(range(len(lines))))
    assert llm.stats.to_dict()["lora"]["base_requests"] == sum(name is None for _, name in lines)
    for name in order:
        llm.reset_prefix_cache()
        alone = run([i for i, (_, n) in enumerate(lines) if n == name])
        assert alone == {i: mixed[i] for i in alone}, name


@pytest.mark.parametrize("max_loras", [1, 2])
def test_prefix_cache_is_keyed_by_adapter(tiny_model, loras, max_loras):
    """With one slot, r16 takes the slot r8 held: the cache is keyed by what an adapter computes with,
    not by its slot, so r16 finds none of r8's blocks (and the same weights under another name do)."""
    base, adapters = tiny_model("llama"), loras("llama")
    llm = LLM(str(base), block_size=4, num_blocks=256, enable_lora=True, max_loras=max_loras, **ENGINE)
    prompt = {"prompt_token_ids": list(range(2, 22))}  # 5 full blocks
    r8, r16 = _request("r8", adapters["r8"]), _request("r16", adapters["r16"])
    llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=r8)
    for other in (None, r16):  # another adapter, or the base model: nothing cached for it
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=other)
        assert llm.stats.prefix_cache_hits == 0
    for same in (r8, LoRARequest("r8-again", 5, str(adapters["r8"]))):  # r8's weights: its blocks
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=same)
        assert llm.stats.prefix_cache_hits == 19
    assert llm.stats.to_dict()["lora"]["slot_loads"] == 1  # r8-again, another name, holds its own slot


@pytest.mark.parametrize(
    ("impl", "num_blocks", "max_loras"),
    [("pagedinfer", 256, 1), ("pagedinfer", 14, 2), ("transformers", 14, 1)],
    ids=["one-slot", "two-slots-preempting", "transformers-one-slot-preempting"],
)
def test_more_adapters_than_slots_match_peft(
    tiny_model, loras, model_root, prompts, impl, num_blocks, max_loras
):
    """Four adapters and base lines interleaved, one or two slots (and a pool that preempts): lines of
    other adapters wait and adapters are swapped in and out, each line equal to PEFT's with its adapter."""
    base, root = tiny_model("llama"), model_root / "loras"
    adapters = {
        **loras("llama"),
        "qv": save_lora(base, root, "llama-qv", 8, seed=31, targets=["q_proj", "v_proj"]),
        "mlp": save_lora(base, root, "llama-mlp", 4, seed=32, targets=["gate_proj", "up_proj", "down_proj"]),
    }
    llm = LLM(
        str(base),
        block_size=4,
        num_blocks=num_blocks,
        model_impl=impl,
        enable_lora=True,
        max_loras=max_loras,
        max_num_seqs=2,  # a window of 4 lines: adapters are needed again after they were swapped out
        **ENGINE,
    )
    order = [*adapters, None]
    lines = [(p, order[(i + j) % len(order)]) for i, p in enumerate(prompts) for j in range(2)]
    requests = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())}
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in lines],
        GREEDY,
        use_tqdm=False,
        lora_request=[None if n is None else requests[n] for _, n in lines],
    )
    for (prompt, name), out in zip(lines, outs, strict=True):
        want = _reference(base, adapters, name, prompt)
        assert out.error is None and out.outputs[0].token_ids == want, f"{name}, prompt of {len(prompt)}"
    lora = llm.stats.to_dict()["lora"]
    assert lora["slot_loads"] > len(adapters)  # swapped out and back in
    assert lora["adapter_reads"] > len(adapters)  # max_cpu_loras = max_loras: read again from disk
    assert (llm.stats.preemptions > 0) == (num_blocks == 14)
    assert llm.engine.pool.num_used == 0


def test_an_adapter_read_again_must_be_unchanged(tiny_model, loras, model_root, tmp_path):
    """One slot and one adapter in memory: an adapter that left memory is read again when its lines
    run; if its files changed (or are gone) since it was checked, those lines fail, the others run."""
    base, adapters = tiny_model("llama"), loras("llama")
    names = ("one", "two", "three")
    for name in names:
        shutil.copytree(adapters["r8"], tmp_path / name)
    llm = LLM(str(base), block_size=4, num_blocks=256, enable_lora=True, max_loras=1, **ENGINE)
    prompts = [{"prompt_token_ids": [5, 6, 7]}] * 4
    first = [*(LoRARequest(n, i, str(tmp_path / n)) for i, n in enumerate(names)), None]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=first)
    assert [o.error for o in outs] == [None] * 4
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    other = save_lora(base, model_root / "loras", "llama-r8-other", 8, seed=41)
    shutil.copy(other / "adapter_model.safetensors", tmp_path / "one")  # other weights under one's name
    shutil.rmtree(tmp_path / "two")  # "three", last used, is still in memory and in the slot
    again = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[*names, None])
    assert again[0].error.startswith(
        f"lora: adapter 'one': the files in {tmp_path / 'one'} changed since they were first read"
    ), again[0].error
    assert again[1].error.startswith("lora: adapter 'two': no adapter_config.json in"), again[1].error
    assert [o.outputs[0].token_ids for o in again[2:]] == [o.outputs[0].token_ids for o in outs[2:]]


def test_max_cpu_loras_holds_at_least_max_loras():
    from pagedinfer.config import EngineConfig

    assert EngineConfig(max_loras=3).max_cpu_loras is None  # the engine keeps max_loras (vLLM's default)
    for value in (1, True, 2.5):
        with pytest.raises(ValueError, match=r"max_cpu_loras must be an integer >= max_loras \(2\)"):
            EngineConfig(max_loras=2, max_cpu_loras=value)


def test_n_completions_of_an_adapter_line_share_their_prompt(tiny_model, loras):
    base, adapters = tiny_model("llama"), loras("llama")
    llm = LLM(str(base), block_size=4, num_blocks=256, enable_lora=True, **ENGINE)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=5, ignore_eos=True)
    (out,) = llm.generate(
        {"prompt_token_ids": list(range(2, 20))},
        params,
        use_tqdm=False,
        lora_request=_request("r8", adapters["r8"]),
    )
    assert out.error is None and len(out.outputs) == 4
    assert llm.stats.prompt_tokens_computed == 18  # prefilled once for the 4 completions


def _adapter_of_another_llama(root: Path, name: str, **overrides) -> Path:
    """A rank-8 adapter of a tiny llama unlike the test's by ``overrides`` (another base)."""
    other = root / f"{name}-base"
    if not (other / "config.json").exists():
        save_random_model(tf.LlamaConfig(**COMMON, **{**DECODER, **overrides}), other, 0)
    return save_lora(other, root, name, 8, seed=3)


def test_adapters_that_cannot_run_fail_their_request_alone(tiny_model, loras, model_root):
    base, adapters = tiny_model("llama"), loras("llama")
    root = model_root / "loras"
    deeper = _adapter_of_another_llama(root, "three-layers", num_hidden_layers=3)
    wider = _adapter_of_another_llama(root, "wider", hidden_size=128)
    embed = save_lora(base, root, "embed", 8, seed=4, targets=["embed_tokens", "q_proj"])
    llm = LLM(
        str(base), block_size=4, num_blocks=256, enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE
    )
    cases = {
        "r16": (adapters["r16"], "lora: adapter 'r16': rank 16 is above max_lora_rank=8"),
        "deeper": (
            deeper,
            "lora: adapter 'deeper' targets model.layers.2.mlp.down_proj, which this model has no linear",
        ),
        "wider": (wider, "lora: adapter 'wider' does not fit this model (trained for another base?)"),
        "embed": (
            embed,
            "lora: adapter 'embed': LoRA on the embeddings (model.embed_tokens) is not supported",
        ),
        "missing": (root / "nowhere", "lora: adapter 'missing': no adapter_config.json in"),
    }
    names = ["r8", *cases]
    requests = [
        LoRARequest(n, i, str(adapters["r8"] if n == "r8" else cases[n][0])) for i, n in enumerate(names)
    ]
    outs = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}] * len(names), GREEDY, use_tqdm=False, lora_request=requests
    )
    assert outs[0].error is None
    for name, out in zip(names[1:], outs[1:], strict=True):
        assert out.error is not None and out.error.startswith(cases[name][1]), (name, out.error)
    more = [LoRARequest(n, 7 + i, str(adapters["r8"])) for i, n in enumerate(("third", "fourth"))]
    swapped = llm.generate([{"prompt_token_ids": [5]}] * 2, GREEDY, use_tqdm=False, lora_request=more)
    assert [o.error for o in swapped] == [None, None]  # more adapters than max_loras=2: swapped in
    plain = LLM(str(base), block_size=4, num_blocks=64, **ENGINE)
    (off,) = plain.generate({"prompt_token_ids": [5]}, GREEDY, use_tqdm=False, lora_request=requests[0])
    assert off.error.startswith("lora: this engine has no LoRA enabled")


# -- the command line -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_adapters(model_root):
    base = tiny_model()
    root = model_root / "cli-loras"
    return base, save_lora(base, root, "a", 8, seed=21), save_lora(base, root, "b", 16, seed=22)


def test_cli_lines_pick_their_adapter(cli_adapters, tmp_path):
    base, a, b = cli_adapters
    lines = [
        {"id": "base", "prompt": "To be", "max_tokens": 4, "ignore_eos": True, "temperature": 0},
        {"id": "a", "prompt": "To be", "max_tokens": 4, "ignore_eos": True, "temperature": 0, "lora": "a"},
        {"id": "b", "prompt": "To be", "max_tokens": 4, "ignore_eos": True, "temperature": 0, "lora": "b"},
        {
            "custom_id": "openai-b",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "b", "prompt": "To be", "max_tokens": 4, "ignore_eos": True, "temperature": 0},
        },
        {"id": "unknown", "prompt": "To be", "lora": "zzz"},
        {"id": "bad", "prompt": "To be", "lora": 3},
    ]
    path = write_jsonl(tmp_path / "l.jsonl", lines)
    report = tmp_path / "r.json"
    args = ["run", path, "--model", base, "--device", "cpu", "--lora", f"a={a}", "--lora", f"b={b}"]
    result = invoke(*args, "--report-json", report, env={"COLUMNS": "100"})
    assert result.exit_code == 1, result.output
    records = {r.get("custom_id") or r["id"]: r for r in read_jsonl(tmp_path / "l.out.jsonl")}
    text = {k: r["outputs"][0]["text"] for k, r in records.items() if k in ("base", "a", "b")}
    assert len(set(text.values())) == 3  # three models
    assert records["openai-b"]["response"]["body"]["choices"][0]["text"] == text["b"]
    assert records["openai-b"]["response"]["body"]["model"] == "b"
    assert "lora: unknown adapter 'zzz' (loaded: 'a', 'b')" in records["unknown"]["error"]
    assert "lora must be an adapter's name" in records["bad"]["error"]
    doc = json.loads(report.read_text())["lora"]
    assert doc["enabled"] and doc["base_requests"] == 1 and doc["base_completion_tokens"] == 4
    use = {x["name"]: (x["rank"], x["requests"], x["completion_tokens"]) for x in doc["adapters"]}
    assert use == {"a": (8, 1, 4), "b": (16, 2, 8)}
    assert "Adapters" in result.stdout and "b (rank 16): 2 lines" in " ".join(result.stdout.split())


def test_cli_ten_adapters_in_two_slots_equal_peft_and_ten_slots(cli_adapters, model_root, tmp_path):
    """10 adapters, 2 slots, 3 kept in memory, 2 lines at a time: every line runs, each equal to PEFT's
    greedy tokens with its adapter, and the file is byte-identical to a run with 10 slots."""
    base = cli_adapters[0]
    paths = [save_lora(base, model_root / "cli-loras", f"ten-{i}", 4, seed=100 + i) for i in range(10)]
    rng = random.Random(5)
    lines = []
    for i in range(24):
        name = None if i % 6 == 5 else f"a{i % 10}"
        prompt = [rng.randrange(3, 100) for _ in range(3 + i % 7)]
        line = {
            "id": f"l{i}",
            "prompt_token_ids": prompt,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }
        lines.append(line if name is None else {**line, "lora": name})
    path = write_jsonl(tmp_path / "ten.jsonl", lines)
    loras = [a for i, p in enumerate(paths) for a in ("--lora", f"a{i}={p}")]
    common = ("run", path, "--model", base, "--device", "cpu", "--quiet", *loras)
    swapped, report = tmp_path / "two.jsonl", tmp_path / "two.json"
    two = ("--max-loras", 2, "--max-cpu-loras", 3, "--max-num-seqs", 2, "--report-json", report)
    assert invoke(*common, "-o", swapped, *two).exit_code == 0
    assert invoke(*common, "-o", tmp_path / "all.jsonl", "--max-loras", 10).exit_code == 0
    assert swapped.read_bytes() == (tmp_path / "all.jsonl").read_bytes()
    for line, record in zip(lines, read_jsonl(swapped), strict=True):
        prompt, name = line["prompt_token_ids"], line.get("lora")
        want = (
            hf_greedy(base, prompt, 6) if name is None else peft_greedy(base, paths[int(name[1:])], prompt, 6)
        )
        assert record["id"] == line["id"] and record["outputs"][0]["token_ids"] == want, line
    lora = json.loads(report.read_text())["lora"]
    assert lora["slot_loads"] > 10 and lora["adapter_reads"] > 10  # swapped, and read again from disk
    assert sum(a["requests"] for a in lora["adapters"]) == 20 and lora["base_requests"] == 4


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--lora", "a"], "--lora takes NAME=PATH"),
        (["--lora", "a=/nonexistent"], "--lora a=/nonexistent: no adapter_config.json there"),
        (["--lora", "a={a}", "--lora", "a={b}"], "--lora a is given twice"),
        (["--lora", "b={b}", "--max-lora-rank", "8"], "rank 16 is above max_lora_rank=8"),
        (["--max-loras", "2"], "--max-loras needs --lora"),
        (["--max-cpu-loras", "2"], "--max-cpu-loras needs --lora"),
        (
            ["--lora", "a={a}", "--max-loras", "0"],
            "--max-loras takes a number of adapters (1 or more), not 0",
        ),
        (
            ["--lora", "a={a}", "--max-loras", "2", "--max-cpu-loras", "1"],
            "--max-cpu-loras 1 is below --max-loras 2",
        ),
    ],
)
def test_cli_lora_option_errors_are_one_line(cli_adapters, tmp_path, options, message):
    base, a, b = cli_adapters
    path = write_jsonl(tmp_path / "l.jsonl", [{"prompt": "To be", "max_tokens": 2}])
    options = [o.format(a=a, b=b) for o in options]
    one_line_error(invoke("run", path, "--model", base, "--device", "cpu", "--quiet", *options), message)
