"""The one line runner (`lines.runner`): rows in, answers out, the same way for the command line
(`run`) and a Ray replica (`add`, `step`); a line parsing refused comes back in the same stream, and
a line whose record cannot be built is that line's error on either way."""

from __future__ import annotations

import json

import pytest
from cli_helpers import tiny_model

from pagedinfer.lines import runner as runner_module
from pagedinfer.lines.line import LineError
from pagedinfer.lines.parse import LineParser
from pagedinfer.lines.runner import Answer, LineRunner
from pagedinfer.llm import LLM

LINES = [
    {"id": "a", "prompt": "To be", "max_tokens": 3, "temperature": 0},
    "not json {",
    {"id": "c", "prompt_token_ids": [5, 6, 7], "max_tokens": 2, "seed": 1},
    {"id": "long", "prompt_token_ids": [5] * 200, "max_tokens": 2},  # beyond the context of 128
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(tiny_model()), device="cpu", block_size=4, num_blocks=64)


def rows() -> list:
    parser = LineParser({}, 0, openai_file=False)
    texts = [line if isinstance(line, str) else json.dumps(line) for line in LINES]
    return [(position, parser.parse(position + 1, text)) for position, text in enumerate(texts)]


def by_position(answers) -> dict[int, Answer]:
    return {answer.position: answer for answer in answers}


def test_run_and_add_step_answer_alike_and_a_bad_line_passes_through(llm):
    runner = LineRunner(llm, "m")
    order = [answer.position for answer in runner.run(rows())]
    assert order.index(1) < order.index(0)  # the unparsable line: answered as it is pulled, not at the end
    streamed = by_position(runner.run(rows()))
    assert llm.stats.requests == 3  # the line parsing refused never reached the engine
    pushed = LineRunner(llm, "m")
    answers = pushed.add(rows())
    while pushed.pending:
        answers += pushed.step()
    stepped = by_position(answers)
    assert sorted(streamed) == sorted(stepped) == [0, 1, 2, 3]
    for position in streamed:
        assert streamed[position].key == stepped[position].key
        assert streamed[position].record == stepped[position].record
    assert isinstance(streamed[1].result, LineError) and streamed[1].record["error"].startswith("line 2: ")
    assert streamed[3].record["error"].startswith("line 4: the prompt has 200 tokens")
    assert streamed[0].record["outputs"][0]["finish_reason"] == "length"
    assert [a.key for a in (streamed[0], streamed[2])] == ['id:"a"', 'id:"c"']


def test_a_record_that_cannot_be_built_is_its_lines_error_either_way(llm, monkeypatch):
    real = runner_module.success_record

    def fragile(item, *args):
        if item.id == "c":
            raise KeyError("boom")
        return real(item, *args)

    monkeypatch.setattr(runner_module, "success_record", fragile)
    streamed = by_position(LineRunner(llm, "m").run(rows()))
    pushed = LineRunner(llm, "m")
    answers = pushed.add(rows())
    while pushed.pending:
        answers += pushed.step()
    stepped = by_position(answers)
    expected = "line 3: could not build the output: KeyError: 'boom'"
    assert streamed[2].record["error"] == stepped[2].record["error"] == expected
    assert streamed[0].record["error"] is None and stepped[0].record["error"] is None


def test_rejected_names_the_rows_that_can_never_run(llm):
    requests = [(position, item) for position, item in rows() if not isinstance(item, LineError)]
    (answer,) = LineRunner(llm, "m").rejected(requests)
    assert answer.position == 3 and answer.key == 'id:"long"'
    assert answer.record["error"].startswith("line 4: the prompt has 200 tokens")
