"""What a run computes without importing transformers is what transformers computes: the tokenizer's
snapshot (`tokenizer_snapshot`) tokenizes, decodes and renders chats as transformers' tokenizer of the
same files, the chat messages are normalized as its helpers normalize them, and the fingerprint names
its installed version. tests/test_cli_startup.py checks that such runs import no transformers."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import transformers
from gguf_fuzz import bases, encode
from test_chat_render import CHAT, PARTS, QWEN_STYLE
from test_real_model import real_model, smollm2  # noqa: F401 - smollm2: the real tier's GGUF fixture
from transformers import AutoTokenizer
from transformers.tokenization_utils_tokenizers import TokenizersBackend
from transformers.utils import chat_template_utils as hf_chat

from pagedinfer import LLM, chat_messages, chat_render
from pagedinfer.engine import fingerprint
from pagedinfer.model import gguf, own_config, tokenizer_snapshot
from pagedinfer.model.loader import DEMO_MODEL

REPO = Path(__file__).resolve().parents[1]
TEXTS = [
    "",
    "ROMEO: O Juliet!",
    "  two leading spaces, three trailing   ",
    "tabs\tand\nnew lines\r\n\n",
    "unicode: café naïve Æsir straße 中文 日本語 한국어 Ελληνικά",
    "emoji: 🙂 👍🏽 👨‍👩‍👧 🏳️‍🌈",
    "\u00a0no-break space, zero\u200bwidth, combining e\u0301",
    "special tokens inside text: <|bos|> a <|eos|> b <|user|> <|im_start|>c<|im_end|> <s></s>",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "quotes ' \" ` and {braces} [brackets] \\backslash",
    "numbers 1234567890 3.14159 -0.5e-7",
    "long " + "abc" * 200,
]


def snapshot_and_transformers(folder, load_hf, cache, monkeypatch) -> tuple[object, object]:
    """The folder's tokenizer through its snapshot, and transformers' own (the first load, which saved it)."""
    monkeypatch.setenv("PAGEDINFER_TOKENIZER_CACHE", str(cache))
    theirs = tokenizer_snapshot.load(folder, load_hf)
    ours = tokenizer_snapshot.load(folder, load_hf)
    assert type(theirs) is TokenizersBackend
    assert type(ours) is tokenizer_snapshot.Tokenizer
    return ours, theirs


def assert_answers_alike(ours, theirs) -> None:
    """Every answer the engine asks of a tokenizer, equal for the varied text set."""
    assert ours.get_vocab() == theirs.get_vocab()
    assert (len(ours), ours.vocab_size) == (len(theirs), theirs.vocab_size)
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    every = []
    for text in TEXTS:
        for special in (True, False):
            ids = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours(text, add_special_tokens=special)["input_ids"] == ids, (text, special)
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(
                text, add_special_tokens=special
            )
            every.append(ids)
    step = max(1, len(theirs) // 3000)
    every.append(list(range(0, len(theirs), step)) + list(range(len(theirs) - 40, len(theirs))))
    for ids in every:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
        for i in ids[:50]:
            assert ours.decode(i) == theirs.decode(i)
            assert ours.convert_ids_to_tokens(i) == theirs.convert_ids_to_tokens(i)
    assert sum(map(len, every)) > 500
    if theirs.chat_template is None:
        assert ours.chat_template is None
        return
    assert ours.get_chat_template() == theirs.get_chat_template()
    for chat in (CHAT, CHAT[:2], [{"role": "user", "content": TEXTS[5] + TEXTS[7] + TEXTS[8]}]):
        expected = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        text = chat_render.render(ours.get_chat_template(), chat, ours.special_tokens_map, 10**6)
        assert text == expected  # byte-identical
        ids = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours(text, add_special_tokens=False)["input_ids"] == ids


def test_the_demo_models_snapshot_answers_as_transformers(tmp_path, monkeypatch):
    load = own_config.tokenizer_loader(DEMO_MODEL, own_config.read(DEMO_MODEL))
    ours, theirs = snapshot_and_transformers(DEMO_MODEL, lambda: load(DEMO_MODEL), tmp_path, monkeypatch)
    assert theirs.chat_template  # the demo model has one: its rendering is compared
    assert_answers_alike(ours, theirs)


def test_a_gguf_vocabularys_snapshot_answers_as_transformers(tmp_path, monkeypatch):
    """The tokenizer transformers makes of a GGUF's metadata (a byte-level BPE), from its cache folder."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "gguf"))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(encode(bases()[0].layout)[0])
    folder = gguf.open_checkpoint(path).folder
    load = own_config.tokenizer_loader(folder, own_config.read(folder))
    ours, theirs = snapshot_and_transformers(folder, lambda: load(folder), tmp_path / "tok", monkeypatch)
    assert_answers_alike(ours, theirs)


@real_model
def test_smollm2_gguf_snapshot_answers_as_transformers(smollm2, tmp_path, monkeypatch):  # noqa: F811
    folder = gguf.open_checkpoint(smollm2["gguf"]).folder
    load = own_config.tokenizer_loader(folder, own_config.read(folder))
    ours, theirs = snapshot_and_transformers(folder, lambda: load(folder), tmp_path, monkeypatch)
    assert "<|im_start|>" in theirs.chat_template
    assert_answers_alike(ours, theirs)


def test_a_subclass_is_loaded_by_transformers_every_time(tmp_path, monkeypatch):
    """Qwen2's files get transformers' Qwen2Tokenizer (a subclass): no snapshot, its own class each load."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((DEMO_MODEL / name).read_bytes())
    bare = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2", **bare, "num_attention_heads": 2})
    )
    load = own_config.tokenizer_loader(tmp_path, own_config.read(tmp_path))
    monkeypatch.setenv("PAGEDINFER_TOKENIZER_CACHE", str(tmp_path / "cache"))
    for _ in range(2):
        tok = tokenizer_snapshot.load(tmp_path, lambda: load(tmp_path))
        assert type(tok).__name__ == "Qwen2Tokenizer"
    assert not (tmp_path / "cache").exists()


def test_a_damaged_snapshot_is_loaded_again_and_replaced(tmp_path, monkeypatch):
    load = own_config.tokenizer_loader(DEMO_MODEL, own_config.read(DEMO_MODEL))
    snapshot_and_transformers(DEMO_MODEL, lambda: load(DEMO_MODEL), tmp_path, monkeypatch)
    (backend,) = tmp_path.glob(f"*/{tokenizer_snapshot.BACKEND}")
    backend.write_text("{not json")
    assert type(tokenizer_snapshot.load(DEMO_MODEL, lambda: load(DEMO_MODEL))) is TokenizersBackend
    ours = tokenizer_snapshot.load(DEMO_MODEL, lambda: load(DEMO_MODEL))
    assert ours.encode(TEXTS[1]) == AutoTokenizer.from_pretrained(DEMO_MODEL).encode(TEXTS[1])


def test_the_llm_hands_out_transformers_tokenizer_with_its_chat_template(tmp_path, monkeypatch):
    """The engine runs on the snapshot; `LLM.tokenizer` is still transformers' (loaded when asked for),
    with --chat-template's template, and renders as the engine does."""
    monkeypatch.setenv("PAGEDINFER_TOKENIZER_CACHE", str(tmp_path))
    load = own_config.tokenizer_loader(DEMO_MODEL, own_config.read(DEMO_MODEL))
    tokenizer_snapshot.load(DEMO_MODEL, lambda: load(DEMO_MODEL))  # the first load: saved
    llm = LLM(chat_template=QWEN_STYLE, device="cpu", dtype="float32")
    assert type(llm.engine.loaded.tokenizer) is tokenizer_snapshot.Tokenizer
    tok = llm.get_tokenizer()
    assert type(tok) is TokenizersBackend and tok is llm.tokenizer
    assert tok.chat_template == QWEN_STYLE
    out = llm.chat(CHAT[1:2], use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.apply_chat_template(CHAT[1:2], add_generation_prompt=True)["input_ids"]


class Role(str, enum.Enum):
    USER = "user"


@dataclasses.dataclass
class Message:
    role: str
    content: object
    thinking: str | None = None


class Dumps:  # what a pydantic model gives (the OpenAI SDK's messages)
    def model_dump(self) -> dict:
        return {"role": "assistant", "content": None, "reasoning": "hmm", "tool_calls": [{"id": 1}]}


@pytest.mark.parametrize(
    "messages",
    [
        CHAT,
        CHAT + PARTS,
        [Message(Role.USER, [{"type": "text", "text": "x"}, (1, np.float32(2.5), np.bool_(False))])],
        [Message("assistant", "done", thinking="because"), Dumps()],
        [{"role": "user", "content": {"nested": [None, object(), np.arange(3)]}}],
        [{"role": "assistant", "content": "a", "reasoning_content": None, "thinking": "t"}],
    ],
    ids=["chat", "parts", "dataclass-enum-numpy", "objects-reasoning", "placeholders", "reasoning-names"],
)
def test_chat_messages_are_normalized_as_transformers_does(messages):
    theirs = hf_chat._alias_reasoning_fields(
        hf_chat._plain_template_data(hf_chat._normalize_chat_messages(messages))
    )
    ours = chat_messages.template_chat(messages)
    assert ours == theirs
    assert repr(ours) == repr(theirs)  # the same types too (tuples, plain str of an enum)


def test_a_message_that_is_no_dict_is_refused_in_transformers_words():
    with pytest.raises(TypeError) as theirs:
        hf_chat._normalize_chat_messages(["hi"])
    with pytest.raises(TypeError) as ours:
        chat_messages.template_chat(["hi"])
    assert str(ours.value) == str(theirs.value)


def test_the_fingerprint_names_the_installed_transformers():
    assert fingerprint.libraries()["transformers"] == transformers.__version__


@pytest.mark.parametrize("imported_first", [False, True], ids=["before-import", "after-import"])
def test_the_command_lines_quieting_holds_whether_or_not_transformers_is_imported(imported_first):
    """`quiet_transformers` before transformers is imported (its environment switches) leaves it as
    its own ``set_verbosity_error`` and ``disable_progress_bar`` do after (a fresh process each)."""
    code = (
        ("import transformers.utils.logging\n" if imported_first else "")
        + "from pagedinfer.hf_logging import quiet_transformers\n"
        + "quiet_transformers()\n"
        + "from transformers.utils import logging as l\n"
        + "print(l.get_verbosity(), l.is_progress_bar_enabled())\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")
    }
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [str(logging.ERROR), "False"]
