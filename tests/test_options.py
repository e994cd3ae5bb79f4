"""Every setting is declared once (`config`) and reaches every place made from the declarations: the
command line of ``pagedinfer run`` (and ``bench``), `LLM`'s keyword arguments, the options ``--resume``
keeps, and the configuration a Ray replica is sent. A setting added to a declaration that one of
them misses fails here."""

from __future__ import annotations

import inspect
import json
import pickle
from pathlib import Path

import pytest
import typer.main
from cli_helpers import invoke, write_jsonl

from pagedinfer.bench.options import BenchOptions
from pagedinfer.cli.app import app
from pagedinfer.cli.options import declared
from pagedinfer.cli.resume import run_options
from pagedinfer.cli.run_options import RunOptions
from pagedinfer.config import (
    LINE_DEFAULTS,
    EngineConfig,
    LLMConfig,
    ModelConfig,
    Setting,
    SpeculativeConfig,
    llm_settings,
    parse_size,
    settings,
)
from pagedinfer.llm import LLM

API_ONLY = {"load_format", "use_cuda_kernels", "enable_lora"}  # enable_lora: set by --lora
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def other_value(s: Setting, tmp_path: Path) -> tuple[list[str], object]:
    """Command-line words setting ``s`` to a value other than its default, and the value it becomes."""
    flag, default = s.flags[0], s.cli_default
    if "/" in flag:
        on, off = flag.split("/")
        return [off if default else on], not default
    if s.type is bool:
        return [flag], not default
    if s.option.choices:
        value = [c for c in s.option.choices if c != default][-1]
        return [flag, value], value
    if s.option.cli_type is Path:  # the chat template: a file on the command line, its text in the LLM
        path = tmp_path / "t.jinja"
        path.write_text(TEMPLATE, encoding="utf-8")
        return [flag, str(path)], TEMPLATE
    if s.option.cli_type is dict:  # speculative decoding: a JSON object, parsed into its config
        return [flag, '{"num_speculative_tokens": 2}'], SpeculativeConfig(2)
    if s.option.cli_type is str:  # a size
        return [flag, "1MiB"], parse_size("1MiB")
    if s.name == "model":  # a directory (a hub id would be looked up)
        return [flag, str(tmp_path)], str(tmp_path)
    if s.type in (str | None, Path | None):
        return [flag, str(tmp_path / "x")], s.type.__args__[0](tmp_path / "x")
    value = 0.5 if "float" in str(s.type) and not default else 2 * default if default else 8
    return [flag, str(value)], value


def section(config: LLMConfig, name: str):
    return config.model_config if name in {s.name for s in settings(ModelConfig)} else config.engine_config


@pytest.fixture
def adapter(tmp_path) -> list[str]:
    """``--lora a=DIR``: a directory the command line accepts (its files are read when the model loads)."""
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}", encoding="utf-8")
    return ["--lora", f"a={folder}"]


@pytest.fixture
def captured(monkeypatch):
    """What a run hands the replicas (`ReplicaSpec`) and the single-process `LLM`, stopped there."""
    from pagedinfer.lora import adapter
    from pagedinfer.model.loader import ModelLoadError
    from pagedinfer.ray import driver

    seen: dict = {}

    class Replicas:
        def __init__(self, spec):
            seen["spec"] = spec
            raise driver.RayUnavailable("stopped by the test")

    def load(self, model=None, **options):
        seen["llm"] = LLMConfig.of(model, **options)
        raise ModelLoadError("stopped by the test")

    monkeypatch.setattr(driver, "DataParallelEngines", Replicas)
    monkeypatch.setattr(adapter, "read_adapter", lambda name, path: None)
    monkeypatch.setattr(LLM, "__init__", load)
    return seen


@pytest.mark.parametrize("setting", [s for s in llm_settings() if s.flags], ids=lambda s: s.name)
def test_every_flagged_setting_reaches_the_llm_and_the_replicas(setting, tmp_path, captured, adapter):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "max_tokens": 2}])
    words, value = other_value(setting, tmp_path)
    if setting.option.panel == "lora":
        words += adapter
    for parallel in ([], ["--data-parallel", "1"]):
        result = invoke("run", prompts, *words, *parallel, "-o", tmp_path / "o.jsonl", "--quiet")
        assert result.exit_code == 2 and "stopped by the test" in result.stderr, result.output
    single, spec = captured["llm"], captured["spec"]
    assert getattr(section(single, setting.name), setting.name) == value
    sent = pickle.loads(pickle.dumps(spec.llm))  # what Ray sends a replica
    assert sent == single


def test_the_settings_without_a_flag_are_the_apis_alone():
    assert {s.name for s in llm_settings() if not s.flags} == API_ONLY
    assert not [s.name for s in (*LINE_DEFAULTS, *settings(RunOptions)) if not s.flags]


def test_llms_signature_is_the_settings_in_order_with_their_defaults():
    params = list(inspect.signature(LLM).parameters.values())
    assert [(p.name, p.default) for p in params] == [(s.name, s.default) for s in llm_settings()]
    assert params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD  # LLM("model-dir")
    assert {p.kind for p in params[1:]} == {inspect.Parameter.KEYWORD_ONLY}


@pytest.mark.parametrize("setting", llm_settings(), ids=lambda s: s.name)
def test_every_setting_is_an_llm_argument_of_its_config(setting, tmp_path):
    value = other_value(setting, tmp_path)[1] if setting.flags else not setting.default
    if setting.name == "load_format":
        value = "dummy"
    config = LLMConfig.of(**{setting.name: value})
    assert getattr(section(config, setting.name), setting.name) == value


def test_an_unknown_argument_names_ours_for_vllms():
    with pytest.raises(TypeError, match=r"^LLM.__init__\(\) got an unexpected keyword argument 'foo'$"):
        LLMConfig.of(foo=1)
    with pytest.raises(TypeError, match=r"'scheduling_policy' \(vLLM's name; here it is schedule_policy\)$"):
        LLM(scheduling_policy="fcfs")


@pytest.mark.parametrize("setting", llm_settings(), ids=lambda s: s.name)
def test_the_resume_table_keeps_exactly_the_settings_declared_so(setting, tmp_path):
    value = other_value(setting, tmp_path)[1] if setting.flags else not setting.default
    if setting.name in ("model", "seed"):
        opts = RunOptions(tmp_path, **{setting.name: value})
    else:
        opts = RunOptions(tmp_path, engine={setting.name: value})
    kept = run_options(opts)
    if setting.option.resume:
        shown = kept[setting.flag]
        assert shown == (json.loads(json.dumps(value)) if setting.name != "chat_template" else shown)
        assert shown != run_options(RunOptions(tmp_path))[setting.flag]
    else:
        assert setting.flag not in kept and kept == run_options(RunOptions(tmp_path))


@pytest.mark.parametrize("setting", [*LINE_DEFAULTS, *settings(RunOptions)], ids=lambda s: s.name)
def test_every_line_default_and_run_option_reaches_the_run(setting, tmp_path, monkeypatch, adapter):
    from pagedinfer.cli import run

    seen = {}
    monkeypatch.setattr(run, "execute", lambda opts, out, err: seen.setdefault("opts", opts) and 0)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    if setting.name == "loras":
        words, value = adapter, ((adapter[1].split("=")[0], adapter[1].split("=", 1)[1]),)
    elif setting.name == "stop":
        words, value = ["--stop", "a", "--stop", "b"], ["a", "b"]
    elif setting.name == "ray_address":
        words, value = ["--ray-address", "auto", "--data-parallel", "2"], "auto"
    elif setting.name == "progress_interval":
        words, value = ["--progress-interval", "2.5"], 2.5
    else:
        words, value = other_value(setting, tmp_path)
    assert invoke("run", prompts).exit_code == 0  # every default as the command line gives it
    given = {s.name: s.cli_default for s in LINE_DEFAULTS if s.cli_default is not None}
    assert seen.pop("opts").sampling == {**given, "stop": []}  # max_tokens: each line's kind decides
    assert invoke("run", prompts, *words).exit_code == 0
    opts = seen["opts"]
    got = opts.sampling[setting.name] if setting in LINE_DEFAULTS else getattr(opts, setting.name)
    assert got == value
    if setting.option.resume:
        assert setting.flag in run_options(opts)


def test_every_bench_option_reaches_the_benchmark(monkeypatch, tmp_path):
    from pagedinfer.bench import runner

    command = typer.main.get_command(app).commands["bench"]
    names = {p.name for p in command.params}
    assert {s.name for s in declared(BenchOptions)} <= names
    seen = {}
    monkeypatch.setattr(runner, "run_bench", lambda opts: seen.setdefault("opts", opts) and {"workloads": {}})
    words = (
        "-w W1 --systems pagedinfer --dtype bfloat16 --quick --prompts 3 --max-prompt-len 5 --max-tokens 6"
    )
    words += " --hf-prompts 2 --threads 1 --block-size 8 --num-blocks 9 --max-num-batched-tokens 10"
    words += " --max-num-seqs 11 --hf-batch-size 12 --hf-cb-max-requests 13 --repeats 2 --gemm-size 64"
    words += f" --model-cache {tmp_path} --in-process --json {tmp_path / 'b.json'}"
    assert invoke("bench", *words.split()).exit_code == 0
    opts = seen["opts"]
    assert opts.workloads == ("W1",) and opts.systems == ("pagedinfer",) and opts.dtypes == ("bfloat16",)
    assert (opts.shrink.prompts, opts.shrink.prompt_len, opts.shrink.max_tokens, opts.shrink.hf_prompts) == (
        3,
        5,
        6,
        2,
    )
    assert (opts.threads, opts.block_size, opts.num_blocks, opts.max_num_batched_tokens) == (1, 8, 9, 10)
    assert (opts.max_num_seqs, opts.hf_batch_size, opts.hf_cb_max_requests, opts.repeats) == (11, 12, 13, 2)
    assert (opts.gemm_size, opts.model_cache, opts.in_process, opts.json) == (
        64,
        tmp_path,
        True,
        tmp_path / "b.json",
    )
    assert opts.quick and opts.device == "cpu"


def test_engine_messages_and_the_report_name_the_options():
    from pagedinfer.cli.report import describe_source
    from pagedinfer.config import PoolSize, engine_option_words

    assert engine_option_words("give num_blocks or gpu_memory_utilization, not both") == (
        "give --num-blocks or --gpu-memory-utilization, not both"
    )
    assert engine_option_words("seed must be an integer; the seeds") == "--seed must be an integer; the seeds"
    assert describe_source(PoolSize(8, "num_blocks")) == "--num-blocks 8"
    assert describe_source(PoolSize(8, "kv_cache_memory", 1 << 20)) == "--kv-cache-memory (1.0 MiB)"
    with pytest.raises(ValueError, match="^max_num_seqs must be"):
        EngineConfig(max_num_seqs=0)


def test_a_resume_file_keeping_the_options_in_another_order_is_read_alike(tmp_path):
    """The resume file keeps the options in the settings' order; an earlier version kept them in
    another: the same options in any order resume, another value is refused, by name."""
    from cli_helpers import tiny_model

    model = str(tiny_model())
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"id": i, "prompt": "To be", "max_tokens": 2} for i in range(3)]
    )
    out = tmp_path / "o.jsonl"
    args = ("run", prompts, "--model", model, "--device", "cpu", "-o", out, "--quiet")
    assert invoke(*args).exit_code == 0
    complete = out.read_bytes()
    sidecar = tmp_path / "o.jsonl.resume"
    head, options = sidecar.read_bytes().split(b"\n", 1)[0], json.loads(sidecar.read_bytes().split(b"\n")[1])
    reordered = dict(reversed(list(options["options"].items())))
    assert list(reordered) != list(options["options"])
    sidecar.write_bytes(head + b"\n" + json.dumps({"options": reordered}).encode() + b"\n")
    out.write_bytes(b"".join(complete.splitlines(keepends=True)[:1]))
    refused = invoke(*args, "--resume", "--seed", "3")
    assert refused.exit_code == 2 and "was written with --seed 0; this run has --seed 3" in refused.stderr
    assert invoke(*args, "--resume").exit_code == 0
    assert out.read_bytes() == complete
