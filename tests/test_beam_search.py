"""Beam search inside the engine equals transformers' beams; beams share blocks and free them when pruned."""

import random

import pytest
import torch
from conftest import ENGINE
from models import _hf_model, submit

from pagedinfer import LLM, BeamSearchParams
from pagedinfer.core.beam import BeamSearch, Candidate


def hf_beams(path, prompt: list[int], p: BeamSearchParams) -> list[tuple[list[int], float]]:
    """transformers' ``generate(num_beams=K, num_return_sequences=K)``: (generated ids, score), best first."""
    ids = torch.tensor([prompt])
    out = _hf_model(str(path)).generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=p.max_tokens,
        do_sample=False,
        num_beams=p.beam_width,
        num_return_sequences=p.beam_width,
        length_penalty=p.length_penalty,
        early_stopping=p.early_stopping,
        eos_token_id=p.stop_token_ids or None,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    beams = []
    for i in range(p.beam_width):
        n = int((out.beam_indices[i] >= 0).sum())  # this beam's generated length
        beams.append(
            (out.sequences[i, len(prompt) : len(prompt) + n].tolist(), float(out.sequences_scores[i]))
        )
    return beams


def prompts(seed: int, count: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 256) for _ in range(rng.randrange(5, 14))] for _ in range(count)]


def assert_same_beams(path, prompt, params, got):
    want = hf_beams(path, prompt, params)
    assert [s.token_ids for s in got.sequences] == [w[0] for w in want]
    assert [s.score for s in got.sequences] == pytest.approx([w[1] for w in want], abs=1e-4)
    for s in got.sequences:
        assert s.score == pytest.approx(s.cumulative_logprob / len(s.token_ids) ** params.length_penalty)


# width -> (length_penalty, early_stopping, with a stop token): each stopping rule at some width
SETTINGS = {2: (2.0, False, False), 4: (0.0, True, True), 8: (0.5, "never", True)}


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_beams_equal_transformers(tiny_model, family, width):
    path = tiny_model(family)
    length_penalty, early_stopping, stop = SETTINGS[width]
    batch = prompts(width)
    stop_ids = []
    if stop:  # a token the free beams produce early, so that beams end on it
        free = hf_beams(path, batch[0], BeamSearchParams(width, 8))
        stop_ids = [free[0][0][1]]
    params = BeamSearchParams(width, 8, length_penalty, early_stopping, stop_token_ids=stop_ids)
    llm = LLM(str(path), block_size=4, num_blocks=300, **ENGINE)
    out = llm.beam_search([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for prompt, got in zip(batch, out, strict=True):
        assert len(got.sequences) == width
        assert_same_beams(path, prompt, params, got)
    if stop and length_penalty <= 0:  # short finished beams win: the stop rule shows in the output
        assert any(s.finish_reason == "stop" for s in out[0].sequences)
    assert llm.engine.pool.num_used == 0


def test_beams_share_blocks_and_prune_at_once(tiny_model):
    """At every step the blocks in use are exactly those the live beams' tables reference."""
    path = tiny_model("llama")
    llm = LLM(str(path), block_size=4, num_blocks=300, enable_prefix_caching=False, **ENGINE)
    engine = llm.engine
    params = BeamSearchParams(4, 12)
    batch = prompts(7)
    reqs = [submit(engine, {"prompt_token_ids": p}, params) for p in batch]
    tables_per_step = []
    while engine.has_unfinished:
        engine.step()
        live = {b for r in reqs if not r.finished for s in r.completions for b in s.block_table}
        assert engine.pool.num_used == len(live)
        tables_per_step.append(sum(len(s.block_table) for r in reqs if not r.finished for s in r.completions))
    assert engine.pool.num_used == 0
    assert max(tables_per_step) > engine.stats.peak_blocks_used  # beams share their common blocks
    for prompt, req in zip(batch, reqs, strict=True):
        assert_same_beams(path, prompt, params, engine.output(req))


def test_beams_survive_preemption(tiny_model):
    path = tiny_model("gpt2")
    params = BeamSearchParams(4, 10, early_stopping=True)
    batch = prompts(11, 4)
    llm = LLM(str(path), block_size=4, num_blocks=26, **ENGINE)
    out = llm.beam_search([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert llm.stats.preemptions > 0 and llm.engine.pool.num_used == 0
    for prompt, got in zip(batch, out, strict=True):
        assert_same_beams(path, prompt, params, got)


def test_finished_list_keeps_the_best_and_stops_early():
    """The bookkeeping alone: a stop token finishes a candidate; with early_stopping, K finished end it."""
    search = BeamSearch(2, 10, 1.0, True, frozenset({0}))
    assert search.num_candidates == 4
    running = search.step(
        [Candidate(0, 0, -1.0), Candidate(0, 5, -1.5), Candidate(0, 6, -2.0), Candidate(0, 0, -9)], [[]]
    )
    assert [(c.token, c.cumulative_logprob) for c in running] == [(5, -1.5), (6, -2.0)]
    assert [(h.token_ids, h.score, h.finish_reason) for h in search.finished] == [([0], -1.0, "stop")]
    running = search.step([Candidate(1, 0, -2.2), Candidate(0, 7, -2.5)], [[5], [6]])
    assert [h.token_ids for h in search.finished] == [[0], [6, 0]] and search.done and running == []


def test_cli_beam_width_flag_and_per_line(tmp_path):
    from cli_helpers import read_jsonl, tiny_model, write_jsonl
    from typer.testing import CliRunner

    from pagedinfer.cli.app import app

    model = str(tiny_model())
    lines = [
        {"prompt_token_ids": [5, 6, 7, 8, 9], "max_tokens": 4},  # --beam-width 2
        {"prompt_token_ids": [9, 8, 7], "max_tokens": 3, "beam_width": 3, "length_penalty": 0.0},
        {"prompt_token_ids": [1, 2, 3], "max_tokens": 3, "beam_width": 0, "temperature": 0},  # sampling
        {"prompt_token_ids": [1, 2, 3], "beam_width": 2, "n": 2},
    ]
    path = write_jsonl(tmp_path / "beams.jsonl", lines)
    args = ["run", str(path), "--model", model, "--device", "cpu", "--quiet", "--beam-width", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1  # the last line is bad
    records = read_jsonl(tmp_path / "beams.out.jsonl")
    llm = LLM(model, device="cpu", dtype="float32")
    for record, params in zip(records, [BeamSearchParams(2, 4), BeamSearchParams(3, 3, 0.0)], strict=False):
        want = llm.beam_search({"prompt_token_ids": record["prompt_token_ids"]}, params, use_tqdm=False)[0]
        assert [b["token_ids"] for b in record["beams"]] == [s.token_ids for s in want.sequences]
        assert [b["cumulative_logprob"] for b in record["beams"]] == pytest.approx(
            [s.cumulative_logprob for s in want.sequences], abs=1e-5
        )
    assert len(records[2]["outputs"]) == 1 and "beams" not in records[2]
    assert records[3]["error"] == "line 4: a beam search line takes no 'n' (beams are greedy and ranked)"
