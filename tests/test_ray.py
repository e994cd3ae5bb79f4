"""`pagedinfer run --data-parallel` and the Ray Data processor: same bytes as one process, faults included.

Loopback only: every test gets its own Ray temp dir, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray's
processes on 127.0.0.1, usage stats are off, and Ray is stopped when the test ends. Replica workers
import this checkout (PYTHONPATH), not an installed pagedinfer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read when ray is imported: keep Ray on 127.0.0.1
import ray  # noqa: E402
from cli_helpers import CORPUS, read_jsonl, sigterm, tiny_model, write_jsonl  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from pagedinfer.cli.app import app  # noqa: E402
from pagedinfer.config import LLMConfig  # noqa: E402
from pagedinfer.lines.line import LineError, LineRequest  # noqa: E402
from pagedinfer.lines.parse import parse_lines  # noqa: E402
from pagedinfer.lines.records import error_record  # noqa: E402
from pagedinfer.lines.source import InputLines  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# the CLI's sampling defaults (app.run's options), for the tests that call the driver directly
DEFAULTS = {"n": 1, "max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "stop": []}
ENGINE = {"device": "cpu", "dtype": "float32"}
MESSAGES = [{"role": "user", "content": "To be?"}]
LINES = [
    {"id": "a", "prompt": "To be, or not to be", "n": 2, "max_tokens": 6},
    "not json {",
    {"id": "b", "prompt_token_ids": [5, 6, 7], "max_tokens": 5, "seed": 3, "temperature": 0.8},
    {
        "id": "c",
        "messages": MESSAGES,
        "n": 3,
        "max_tokens": 4,
    },  # no logprobs: their last digits vary with the batch
    {"id": "d", "prompt": "x", "n": 0},
    {"id": "long", "prompt": "the quick brown fox " * 60},  # too long for the context: fails on a replica
    # structured outputs: compiled inside each replica (a bad schema fails there)
    {"id": "s", "prompt": "To be", "n": 2, "seed": 4, "structured_outputs": {"regex": "[a-z]{2,5}!"}},
    {"id": "bad-schema", "prompt": "x", "structured_outputs": {"json": {"type": "nonsense"}}},
    *[
        {"id": f"r{i}", "prompt": CORPUS[i % 5][:20], "max_tokens": 4 + 8 * i, "ignore_eos": True}
        for i in range(12)
    ],
]


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model())


@pytest.fixture(scope="module")
def job(model, tmp_path_factory) -> tuple[Path, bytes]:
    """The input, and the output of single-process `pagedinfer run` on it (the reference bytes)."""
    root = tmp_path_factory.mktemp("ray-job")
    path = write_jsonl(root / "in.jsonl", LINES)
    result = cli(model, path, "-o", root / "single.jsonl")
    assert result.exit_code == 1, result.output  # bad lines: exit 1, the good lines all written
    return path, (root / "single.jsonl").read_bytes()


@pytest.fixture
def ray_env(monkeypatch):
    """A Ray of the test's own: loopback, own temp dir, no usage stats; stopped at the end."""
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    monkeypatch.setenv("RAY_TMPDIR", tmp)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's own processes: loopback too
    monkeypatch.setattr(
        ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False
    )  # in case ray came in earlier
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    yield tmp
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def cli(model: str, path: Path, *args):
    result = CliRunner().invoke(
        app, ["run", str(path), "--model", model, "--device", "cpu", "--quiet", *map(str, args)]
    )
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_two_local_replicas_write_the_same_bytes(model, job, ray_env, tmp_path):
    path, reference = job
    report = tmp_path / "report.json"
    out = tmp_path / "dp.jsonl"
    result = cli(model, path, "-o", out, "--data-parallel", 2, "--report-json", report)
    assert result.exit_code == 1, result.output
    assert out.read_bytes() == reference
    assert "4 failed (lines 2, 5, 6, 8)" in result.output
    doc = json.loads(report.read_text())
    replicas = doc["data_parallel"]["replicas"]
    assert len(replicas) == 2 and all(r["requests"] > 0 for r in replicas)  # both replicas ran lines
    assert doc["scheduling"]["requests"] == sum(r["requests"] for r in replicas)
    assert doc["pool"]["num_blocks"] == sum(r["num_blocks"] for r in replicas)
    assert not ray.is_initialized()  # the run stopped the Ray it started


def test_two_node_cluster_writes_the_same_bytes(model, job, ray_env, tmp_path):
    from ray.cluster_utils import Cluster

    path, reference = job
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        assert cluster.address.startswith("127.0.0.1:")
        report = tmp_path / "report.json"
        out = tmp_path / "dp.jsonl"
        args = ("-o", out, "--data-parallel", 2, "--ray-address", cluster.address, "--report-json", report)
        result = cli(model, path, *args)
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert result.exit_code == 1, result.output
    assert out.read_bytes() == reference
    replicas = json.loads(report.read_text())["data_parallel"]["replicas"]
    assert len({r["node"] for r in replicas}) == 2  # one replica per node (SPREAD)


def test_hostile_lines_and_adapters_under_two_replicas(model, model_root, ray_env, tmp_path):
    """A --lora adapter under --data-parallel 2 and a file mixing good lines (base and adapter ones,
    n=2, a regex) with hostile ones (not JSON, an unknown field, an id past the vocabulary, an adapter
    that is not loaded): the good lines' records are byte for byte those they get alone in one process,
    the others exact error records, exit 1. An adapter whose config cannot be served is one error
    line, exit 2, before Ray starts."""
    from models import save_lora

    root = model_root / "ray-loras"
    adapter = save_lora(Path(model), root, "a", 8, seed=21)
    good = [
        {"id": "base", "prompt": "To be", "max_tokens": 5, "seed": 3, "temperature": 0.8},
        {"id": "a", "prompt": "To be", "max_tokens": 5, "temperature": 0, "lora": "a"},
        {"id": "a-n2", "prompt_token_ids": [5, 6, 7], "n": 2, "max_tokens": 4, "seed": 7, "lora": "a"},
        {
            "id": "a-re",
            "prompt": "Say",
            "lora": "a",
            "seed": 4,
            "structured_outputs": {"regex": "[a-z]{2,5}!"},
        },
    ]
    hostile = [
        "not json {",
        {"id": "field", "prompt": "x", "temprature": 0.5},
        {"id": "vocab", "prompt_token_ids": [5, 10**6]},
        {"id": "missing", "prompt": "x", "lora": "nope"},
    ]
    lines = [good[0], hostile[0], good[1], hostile[1], hostile[2], good[2], hostile[3], good[3]]
    path, out = write_jsonl(tmp_path / "mix.jsonl", lines), tmp_path / "mix.out.jsonl"
    alone = write_jsonl(tmp_path / "alone.jsonl", [x if x in good else "" for x in lines])  # same numbers
    lora = ("--lora", f"a={adapter}")
    assert cli(model, alone, "-o", tmp_path / "alone.out.jsonl", *lora).exit_code == 0
    report = tmp_path / "report.json"
    result = cli(model, path, "-o", out, "--data-parallel", 2, *lora, "--report-json", report)
    assert result.exit_code == 1, result.output
    doc = json.loads(report.read_text())["lora"]  # the replicas' figures merged
    assert [(a["name"], a["requests"]) for a in doc["adapters"]] == [("a", 3)] and doc["base_requests"] == 1
    records = out.read_text(encoding="utf-8").splitlines()
    assert [r for r in records if '"error": null' in r] == (
        tmp_path / "alone.out.jsonl"
    ).read_text().splitlines()
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    assert [json.loads(r) for r in records if '"error": null' not in r] == [
        {"id": 2, "line": 2, "error": "line 2: not valid JSON (Expecting value at character 1 of 10)"},
        {"id": "field", "line": 4, "prompt": "x", "error": "line 4: unknown field 'temprature'"},
        {
            "id": "vocab",
            "line": 5,
            "error": f"line 5: prompt_token_ids must be a list of integers in [0, {vocab})",
        },
        {
            "id": "missing",
            "line": 7,
            "prompt": "x",
            "error": "line 7: lora: unknown adapter 'nope' (loaded: 'a')",
        },
    ]

    dora = root / "dora"
    shutil.copytree(adapter, dora, dirs_exist_ok=True)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    result = cli(model, path, "-o", out, "--data-parallel", 2, *lora, "--lora", f"dora={dora}")
    assert result.exit_code == 2 and not ray.is_initialized()
    assert (
        result.output.strip()
        == f"error: --lora dora={dora}: adapter 'dora': DoRA (use_dora) is not supported"
    )


def test_a_replica_checks_its_adapters_against_its_model(model, model_root):
    """An adapter whose files read fine but that was trained for another base ends the replica's start
    with the single-process run's words (the driver shows its last line: `_replica_error`)."""
    import transformers as tf
    from models import save_lora

    from pagedinfer.lora.adapter import AdapterError
    from pagedinfer.model.random_models import save_random_model
    from pagedinfer.ray.actor import EngineReplica

    wider, root = model_root / "wider-llama", model_root / "ray-loras"
    config = tf.AutoConfig.from_pretrained(model).to_dict()
    save_random_model(tf.LlamaConfig(**{**config, "hidden_size": 128, "head_dim": None}), wider, 0)
    other = save_lora(wider, root, "wide", 8, seed=3)
    engine = {**ENGINE, "enable_lora": True}  # as the command line sets it with --lora
    with pytest.raises(AdapterError, match=rf"^--lora wide={other}: adapter 'wide' does not fit this model"):
        EngineReplica(LLMConfig.of(model, **engine), None, "m", loras=(("wide", str(other)),))
    adapter = save_lora(Path(model), root, "a", 8, seed=21)
    replica = EngineReplica(LLMConfig.of(model, **engine), None, "m", loras=(("a", str(adapter)),))
    assert list(replica.llm.engine.lora.named) == ["a"]


def test_killed_replica_is_restarted_and_its_lines_rerun(model, job, ray_env):
    from pagedinfer.ray.driver import DataParallelEngines, ReplicaSpec

    path, reference = job
    items = list(parse_lines(InputLines(path), DEFAULTS, 0))
    rows = [(pos, item) for pos, item in enumerate(items) if isinstance(item, LineRequest)]
    engines = DataParallelEngines(ReplicaSpec(LLMConfig.of(model, **ENGINE), 2, None, model, window=3))
    got: dict[int, dict | LineError] = {}
    try:
        victim = engines.infos[0]["pid"]
        for answer in engines.run(rows):
            if not got:
                os.kill(victim, signal.SIGKILL)  # mid-batch: replica 0 holds up to 3 unfinished lines
            got[answer.position] = answer.result
    finally:
        engines.close()
    assert engines.restarts == [1, 0]
    assert engines.rerun_rows >= 1
    assert engines.infos[0]["pid"] != victim
    assert sorted(got) == [pos for pos, _ in rows]  # every line exactly once
    expected = reference.decode().splitlines()
    for pos, result in got.items():
        record = error_record(result) if isinstance(result, LineError) else result
        assert json.dumps(record, ensure_ascii=False) == expected[pos]


def test_interrupted_data_parallel_run_resumes_to_the_same_bytes(model, job, ray_env, tmp_path, monkeypatch):
    from pagedinfer.ray.driver import DataParallelEngines

    path, reference = job
    out = tmp_path / "dp.jsonl"
    original = DataParallelEngines.run

    def interrupted(self, rows, on_progress=None):  # a real Ctrl-C once the first line is back
        for k, item in enumerate(original(self, rows, on_progress)):
            if k == 0:
                os.kill(os.getpid(), signal.SIGINT)
            yield item

    with monkeypatch.context() as m:
        m.setattr(DataParallelEngines, "run", interrupted)
        first = cli(model, path, "-o", out, "--data-parallel", 2)
    assert first.exit_code == 130, first.output
    written = read_jsonl(out)
    assert 0 < len([r for r in written if r["error"] is None]) < 13  # some lines, not all
    resumed = cli(model, path, "-o", out, "--data-parallel", 2, "--resume")
    failed = any(r["error"] is not None for r in read_jsonl(out))
    assert resumed.exit_code == (1 if failed else 0), resumed.output  # 1: a line failed, in either run
    assert out.read_bytes() == reference


def test_processor_keeps_every_row_and_reports_the_failing_one(model, job, ray_env):
    from pagedinfer.ray import ProcessorConfig, build_processor

    _, reference = job
    expected = {r["id"]: r for r in map(json.loads, reference.decode().splitlines())}
    rows = [
        {"id": f"r{i}", "prompt": CORPUS[i % 5][:20], "max_tokens": 4 + 8 * i, "ignore_eos": True, "n": None}
        for i in range(4)
    ]
    rows.insert(2, {"id": "d", "prompt": "x", "max_tokens": None, "ignore_eos": None, "n": 0})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = ProcessorConfig(
        model=model,
        engine_kwargs=ENGINE,
        sampling_params=DEFAULTS,
        batch_size=8,
        should_continue_on_error=True,
    )
    out = sorted(build_processor(config)(ray.data.from_items(rows)).take_all(), key=lambda r: r["id"])
    assert [r["id"] for r in out] == ["d", "r0", "r1", "r2", "r3"]  # none dropped
    assert out[0]["error"] == "n must be an integer >= 1" and out[0]["generated_text"] is None
    for row in out[1:]:
        want = expected[row["id"]]
        assert row["error"] is None
        assert list(row["generated_tokens"]) == want["outputs"][0]["token_ids"]  # same seed, same tokens
        assert row["generated_text"] == want["outputs"][0]["text"]
        assert row["num_generated_tokens"] == want["usage"]["completion_tokens"]

    strict = ProcessorConfig(model=model, engine_kwargs=ENGINE, sampling_params=DEFAULTS, batch_size=8)
    with pytest.raises(Exception, match=r"row id='d': n must be an integer >= 1"):
        build_processor(strict)(ray.data.from_items(rows)).take_all()


def test_without_ray_one_line_error_naming_the_command(model, job, monkeypatch):
    path, _ = job
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    result = cli(model, path, "--data-parallel", 2, "-o", "-")
    assert result.exit_code == 2
    assert (
        result.output.strip()
        == "error: pagedinfer run --data-parallel needs Ray: pip install 'pagedinfer[ray]'"
    )


def test_replica_error_becomes_one_line_without_the_class_path():
    from pagedinfer.ray.driver import _replica_error

    text = "ActorDiedError: ...\nTraceback:\n  ...\npagedinfer.model.loader.ModelLoadError: model directory /x does not exist"
    assert _replica_error(RuntimeError(text)) == "model directory /x does not exist"


def test_sigterm_to_a_data_parallel_driver_finishes_like_a_single_run(ray_env, tmp_path):
    """Ray's driver takes SIGTERM for itself at ray.init; the run takes it back: the step ends, the
    finished lines are on disk, the summary is printed, exit 143 (no stack dump)."""
    import subprocess
    import time

    lines = [{"id": f"s{i}", "prompt_token_ids": [3, 4 + i], "max_tokens": 2} for i in range(4)]
    # far more work than a fast machine finishes between the first record and the signal (8 running per
    # replica, 400 x 200 tokens); the run stops early, so the size costs nothing. The embedded demo model,
    # not the tiny one: a pump must end with lines still running (the tiny model finishes a replica's
    # window inside one pump on a fast CPU, and then no line is mid-generation at any reply)
    lines += [
        {"id": f"l{i}", "prompt_token_ids": [5, 6 + i % 200], "max_tokens": 200, "ignore_eos": True}
        for i in range(400)
    ]
    path = write_jsonl(tmp_path / "t.jsonl", lines)
    out = tmp_path / "t.out.jsonl"
    cmd = [sys.executable, "-m", "pagedinfer", "run", str(path), "-o", str(out), "-q"]
    cmd += ["--device", "cpu", "--data-parallel", "2", "--max-num-seqs", "8", "--no-report"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = time.monotonic()
    while not (out.exists() and out.read_bytes().count(b"\n") >= 1):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - start < 600
        time.sleep(0.05)
    kept, summary, _ = sigterm(proc, out)
    assert len(kept) < len(lines)
    # the lines the replicas reported running in their last replies (8 each at most), with their tokens
    found = re.search(
        r"(\d+) lines not run: (\d+) interrupted mid-generation \(([\d,]+) tokens? generated, not kept\), "
        r"(\d+) not started",
        summary,
    )
    assert found, summary
    left, cut, tokens, waiting = (int(g.replace(",", "")) for g in found.groups())
    assert left == len(lines) - len(kept) and 0 < cut <= 16 and left == cut + waiting
    assert 0 < tokens <= 200 * cut
