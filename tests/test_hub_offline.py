"""A hub id on a machine without a network: served from the local Hugging Face cache when it is there,
else refused in one line at once (huggingface_hub alone retries for about 50 s). The hub is made
unreachable by pointing HF_ENDPOINT at a closed local port."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from cli_helpers import tiny_model, write_jsonl

PROXIES = {"http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"}


def offline_run(tmp_path, model: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be", "max_tokens": 4, "temperature": 0}])
    environ = {k: v for k, v in os.environ.items() if k not in PROXIES}
    environ |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": str(tmp_path / "hub"), **env}
    cmd = [sys.executable, "-m", "pagedinfer", "run", str(prompts), "--model", model, "--quiet", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=300)


def test_a_hub_id_without_network_or_cache_is_one_line_at_once(tmp_path):
    run = offline_run(tmp_path, "pagedinfer-tests/absent")
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "error: cannot load model 'pagedinfer-tests/absent': no network (cannot reach 127.0.0.1: Connection "
        f"refused) and no local copy in the Hugging Face cache ({tmp_path / 'hub'})"
    ]
    run = offline_run(
        tmp_path, "pagedinfer-tests/absent", HF_HUB_OFFLINE="1", HF_ENDPOINT="https://huggingface.co"
    )
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "error: cannot load model 'pagedinfer-tests/absent': no network (HF_HUB_OFFLINE is set) and no local "
        f"copy in the Hugging Face cache ({tmp_path / 'hub'})"
    ]


def test_a_cached_hub_id_runs_without_network_as_its_directory_does(tmp_path):
    snapshot = tmp_path / "hub" / "models--pagedinfer-tests--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model(), snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    records = []
    for model in ("pagedinfer-tests/tiny", str(tiny_model())):
        out = tmp_path / "out.jsonl"
        run = offline_run(tmp_path, model, "-o", str(out))
        assert run.returncode == 0, run.stderr[-2000:]
        assert "Retrying" not in run.stderr
        records.append(json.loads(out.read_text()))
    assert records[0]["outputs"] == records[1]["outputs"] and len(records[0]["outputs"][0]["token_ids"]) == 4
