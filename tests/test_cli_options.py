"""`pagedinfer run`'s vLLM-named options: the old names as hidden aliases, --gpu-memory-utilization,
--threads and --chat-template (and `LLM(chat_template=...)`), on a tiny random-weight model."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import invoke, one_line_error, read_jsonl, tiny_model, tiny_model_no_tokenizer, write_jsonl

from pagedinfer import SamplingParams
from pagedinfer.config import EngineConfig, PoolSize
from pagedinfer.llm import LLM

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model())


def run(model: str, *args, device: str = "cpu"):
    return invoke("run", *args, "--model", model, "--device", device, "--quiet")


def test_the_old_option_names_still_work_hidden(model, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be", "max_tokens": 2}])
    sources = []
    for flag in ("--kv-cache-memory", "--kv-memory"):
        report = tmp_path / f"{flag}.json"
        assert run(model, prompts, flag, "1MiB", "--report-json", report).exit_code == 0
        sources.append(json.loads(report.read_text())["pool"]["source"])
    assert sources == ["kv_cache_memory=1048576 bytes"] * 2
    # the old name feeds the new option: its value reaches the same check, named by the new name
    one_line_error(
        run(model, prompts, "--max-batched-tokens", "0"),
        "--max-num-batched-tokens must be an integer >= 1, not 0",
    )
    one_line_error(
        run(model, prompts, "--kv-memory", "1MiB", "--kv-cache-memory", "2MiB"),
        "--kv-memory is the old name of --kv-cache-memory: give one of them",
    )
    one_line_error(
        run(model, prompts, "--max-batched-tokens", "8", "--max-num-batched-tokens", "8"),
        "--max-batched-tokens is the old name of --max-num-batched-tokens: give one of them",
    )


@pytest.mark.parametrize(
    ("option", "setting"),
    [("--max-num-seqs", "max_num_seqs"), ("--max-num-batched-tokens", "max_num_batched_tokens")],
)
def test_a_bad_scheduling_limit_names_its_own_option_alone(model, tmp_path, option, setting):
    """Each limit is checked alone: the error names the option given, not it and its neighbour."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be", "max_tokens": 2}])
    result = run(model, prompts, option, "0")
    one_line_error(result, f"{option} must be an integer >= 1, not 0")
    other = "--max-num-batched-tokens" if option == "--max-num-seqs" else "--max-num-seqs"
    assert other not in result.stderr
    with pytest.raises(ValueError, match=rf"^{setting} must be an integer >= 1, not 0$"):
        EngineConfig(**{setting: 0})


def test_a_context_below_one_token_is_refused_by_the_engine_rule_in_the_option_words(model, tmp_path):
    """--max-model-len is checked where EngineConfig checks max_model_len (one home for the rule)."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be", "max_tokens": 2}])
    one_line_error(
        run(model, prompts, "--max-model-len", "0"),
        "--max-model-len must be an integer >= 1, not 0 (unset: the model's context)",
    )


def test_gpu_memory_utilization_is_refused_on_the_cpu_in_one_line(model, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be", "max_tokens": 2}])
    one_line_error(
        run(model, prompts, "--gpu-memory-utilization", "0.5"),  # --device cpu: refused before loading
        "--gpu-memory-utilization sizes the KV pool on CUDA only; on the CPU use --kv-cache-memory or "
        "--num-blocks",
    )
    one_line_error(
        run(model, prompts, "--gpu-memory-utilization", "0.5", "--num-blocks", "8", device="auto"),
        "give --num-blocks or --gpu-memory-utilization, not both",
    )
    one_line_error(
        run(model, prompts, "--gpu-memory-utilization", "1.5", device="auto"),  # checked before loading
        "--gpu-memory-utilization must be a fraction in (0, 1], not 1.5",
    )
    with pytest.raises(ValueError, match="gpu_memory_utilization sizes the KV pool on CUDA only"):
        LLM(model, device="cpu", gpu_memory_utilization=0.5)


def test_a_load_error_of_the_demo_model_hints_at_model_only_when_the_demo_model_is_the_problem(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be", "max_tokens": 2}])
    result = invoke("run", prompts, "--device", "cpu", "--dtype", "float16", "--quantization", "int8")
    one_line_error(result, "--quantization int8 runs under float32 or bfloat16 activations")
    assert "--model" not in result.stderr  # another model would fail the same way


def test_gpu_memory_utilization_sizes_the_pool_from_free_gpu_memory(monkeypatch):
    free = 10 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 80 << 30))
    cuda = torch.device("cuda")
    size = EngineConfig(gpu_memory_utilization=0.5, max_num_seqs=10**6).pool_size(1 << 16, cuda, 4096)
    assert size == PoolSize((free // 2) >> 16, "gpu_memory_utilization", None, 0.5)
    assert str(size).startswith("gpu_memory_utilization=0.5: 50% of free GPU memory")
    default = EngineConfig(max_num_seqs=10**6).pool_size(1 << 16, cuda, 4096)
    assert default.num_blocks == int(free * 0.85) >> 16 and default.origin == "default_gpu"


def test_threads_sets_torch_threads_for_the_run(model, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be", "max_tokens": 2}])
    before = torch.get_num_threads()
    try:
        assert run(model, prompts, "--threads", "1").exit_code == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    one_line_error(
        run(model, prompts, "--threads", "0"), "--threads takes a number of threads (1 or more), not 0"
    )
    one_line_error(
        run(model, prompts, "--threads", "2", "--data-parallel", "2"),
        "--threads sets this process's threads; --data-parallel splits the CPUs among its replicas",
    )


def test_chat_template_file_replaces_the_tokenizers(model, tmp_path):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be?"}]
    prompts = write_jsonl(
        tmp_path / "chat.jsonl", [{"messages": messages, "max_tokens": 3, "temperature": 0}]
    )
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    out = tmp_path / "o.jsonl"
    assert run(model, prompts, "--chat-template", template, "-o", out).exit_code == 0
    (record,) = read_jsonl(out)
    rendered = "[system] Be brief.\n[user] To be?\n[assistant] "
    assert record["prompt"] == rendered
    tok = AutoTokenizer.from_pretrained(model)
    assert record["usage"]["prompt_tokens"] == len(tok(rendered, add_special_tokens=False)["input_ids"])
    llm = LLM(model, device="cpu", chat_template=TEMPLATE)
    assert llm.tokenizer.chat_template == TEMPLATE
    ids = llm.tokenizer(rendered, add_special_tokens=False)["input_ids"]  # the same prompt through the API
    (api,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=3, temperature=0))
    assert api.outputs[0].token_ids == record["outputs"][0]["token_ids"]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "chat template {dir}/none.jinja does not exist"),
        ("directory", "chat template {dir} is a directory, not a Jinja file"),
        ("empty", "chat template {dir}/empty.jinja is empty"),
        ("binary", "chat template {dir}/bin.jinja is not UTF-8 text (byte 1)"),
        (
            "syntax",
            "chat template {dir}/bad.jinja line 2: Unexpected end of template. Jinja was looking for the "
            "following tags: 'endfor' or 'else'. The innermost block that needs to be closed is 'for'.",
        ),
        ("no-tokenizer", "a chat template needs a tokenizer; model {ids!r} has none (token-id prompts only)"),
    ],
)
def test_a_bad_chat_template_is_one_line_before_anything_runs(model, tmp_path, case, message):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": [1, 2], "max_tokens": 2}])
    (tmp_path / "empty.jinja").write_text("  \n", encoding="utf-8")
    (tmp_path / "bin.jinja").write_bytes(b"{\xff")
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}\n{{ m }}", encoding="utf-8")
    (tmp_path / "good.jinja").write_text(TEMPLATE, encoding="utf-8")
    path = {"missing": "none.jinja", "directory": "", "empty": "empty.jinja", "binary": "bin.jinja"}
    path |= {"syntax": "bad.jinja", "no-tokenizer": "good.jinja"}
    target = model if case != "no-tokenizer" else str(tiny_model_no_tokenizer())
    out = tmp_path / "o.jsonl"
    result = run(target, prompts, "--chat-template", tmp_path / path[case], "-o", out)
    one_line_error(result, message.format(dir=tmp_path, ids=target))
    assert not out.exists() or out.read_bytes() == b""  # nothing written (the lock may create the file)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_a_seed_out_of_a_lines_seed_range_is_one_line_before_loading(model, tmp_path, seed):
    """--seed takes the range of a line's own seed (SamplingParams): one line, exit 2, nothing run."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be", "max_tokens": 2}])
    out = tmp_path / "o.jsonl"
    result = run(model, prompts, "--seed", seed, "-o", out)
    one_line_error(result, f"--seed must be an integer from -2**63 to 2**64 - 1, not {seed}")
    assert not out.exists()
    with pytest.raises(ValueError, match=r"^seed must be an integer from -2\*\*63 to 2\*\*64 - 1"):
        EngineConfig(seed=seed)


def test_the_seed_range_ends_are_accepted(model, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be", "max_tokens": 2}])
    for seed in (2**64 - 1, -(2**63)):
        assert run(model, prompts, "--seed", seed, "-o", tmp_path / f"{seed}.jsonl").exit_code == 0


def test_a_prompt_longer_than_max_model_len_names_the_option(model, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": [5, 6, 7, 8, 9], "max_tokens": 2}])
    out = tmp_path / "o.jsonl"
    assert run(model, prompts, "--max-model-len", "4", "-o", out).exit_code == 1
    (record,) = read_jsonl(out)
    assert record["error"] == (
        "line 1: the prompt has 5 tokens; the context is 4 tokens by --max-model-len (API: max_model_len) "
        "(one more is needed to generate)"
    )


@pytest.mark.parametrize(("given", "note"), [("100000", True), ("128", False), ("64", False)])
def test_max_model_len_above_the_models_context_is_noted_once(model, tmp_path, given, note):
    """The tiny model's context is 128: a larger --max-model-len runs capped and says so in one
    stderr line (even with --quiet); the engine's own warning is not said a second time."""
    import warnings

    from pagedinfer.engine.llm_engine import MaxModelLenCapped

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be", "max_tokens": 2}])
    report = tmp_path / "r.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run(model, prompts, "--max-model-len", given, "--report-json", report)
    assert result.exit_code == 0, result.output
    expected = f"note: --max-model-len {given} is above the model's context (128 tokens): using 128"
    assert [ln for ln in result.stderr.splitlines() if "max-model-len" in ln] == ([expected] if note else [])
    assert not [w for w in caught if issubclass(w.category, MaxModelLenCapped)]
    assert json.loads(report.read_text())["pool"]["max_model_len"] == min(int(given), 128)


def test_an_emulated_dtype_is_noted_on_stderr_and_in_the_report(model, tmp_path, monkeypatch):
    """bfloat16 on a CPU without AVX512-BF16 or AMX (faked here: this CPU may have them) runs, says so
    in one stderr line naming the faster choice, and the report's dtype line and JSON say emulated."""
    from pagedinfer.model import dtype as dtype_choice

    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda names: [])
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be", "max_tokens": 2}])
    report = tmp_path / "r.json"
    result = invoke("run", prompts, "--model", model, "--dtype", "bfloat16", "--report-json", report)
    assert result.exit_code == 0, result.output
    note = (
        "pagedinfer: note: bfloat16 runs emulated on this CPU (no amx_bf16/avx512_bf16): float32 is "
        "faster here (--dtype float32), or --quantization int8"
    )
    assert [ln for ln in result.stderr.splitlines() if "emulated" in ln] == [note]
    row = result.stdout.split("│ dtype ", 1)[1].split("│ Weights", 1)[0]  # the report's dtype row
    assert (
        " ".join(row.replace("│", "").split())
        == "bfloat16 --dtype bfloat16; emulated on this CPU (no amx_bf16/avx512_bf16)"
    )
    doc = json.loads(report.read_text())["model"]
    assert doc["dtype_emulated"] is True and doc["dtype_reason"].endswith(
        "emulated on this CPU (no amx_bf16/avx512_bf16)"
    )
