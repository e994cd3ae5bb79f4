"""The model's tokenizer without importing transformers, where transformers' own is its plain backend.

Importing transformers costs most of a second of a run's start-up, for a tokenizer whose every
answer the engine reads comes from its backend, a `tokenizers.Tokenizer`: encode, decode, the
vocabulary. When transformers loads a tokenizer of the class ``TokenizersBackend`` itself (what
transformers 5 saves, and what it makes of a GGUF's vocabulary), that backend as it stands after the
load (special tokens added, post-processor set) is saved once, with the few facts read beside it
(its special tokens, its chat template), in a snapshot folder named by the content of the files it
read and the versions of transformers and tokenizers (``$PAGEDINFER_TOKENIZER_CACHE``). A later load
of the same files reads the snapshot into `Tokenizer`, which answers what the engine asks exactly as
transformers' class answers it (tests/test_transformers_free.py compares the two on a varied text set).

Only a tokenizer whose decode is its backend's alone is kept (no clean-up of spaces after it) and
whose chat template is one text (or none); any other, and a subclass (which may change what its
methods do), is loaded by transformers every time, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import tokenizers

from pagedinfer import envs

SNAPSHOT_VERSION = 1  # bump when a snapshot's contents change
BACKEND, FACTS = "tokenizer.json", "facts.json"
# the files of a model folder a tokenizer may read (weights never are): the snapshot's key
KEY_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".vocab")
KEY_FOLDERS = ("additional_chat_templates",)


class Tokenizer:
    """transformers' ``TokenizersBackend`` as the engine uses it, over the same backend: ``tok(text,
    add_special_tokens=...)``, `encode`, `decode`, the vocabulary, the special tokens and the chat
    template. `hf` gives transformers' own (loaded then), for whoever asks for it by name."""

    is_fast = True

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens_map: dict[str, object],
        chat_template: str | None,
        load_hf: Callable[[], object],
    ) -> None:
        self.backend_tokenizer = backend
        self.special_tokens_map = special_tokens_map
        self.chat_template = chat_template  # replaced by --chat-template's (the loader)
        self._load_hf = load_hf
        self._hf: object | None = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size (without the added tokens), as transformers' ``vocab_size``."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True  # as transformers' tokenizers: not empty when the vocabulary is

    def get_chat_template(self) -> str:
        if self.chat_template is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
        return self.chat_template

    def hf(self) -> object:
        """transformers' tokenizer of the same files (imported and loaded at the first call), with this
        one's chat template."""
        if self._hf is None:
            self._hf = self._load_hf()
            self._hf.chat_template = self.chat_template
        return self._hf


def load(folder: str | Path, load_hf: Callable[[], object]) -> object:
    """The tokenizer in the local folder ``folder``: a `Tokenizer` from its snapshot when there is
    one, else what ``load_hf`` (transformers' loading) gives, whose snapshot is saved where it can be
    kept. What ``load_hf`` raises propagates."""
    try:
        key = _key(Path(folder))
    except OSError:
        return load_hf()
    where = envs.tokenizer_cache() / key
    if (where / FACTS).is_file():
        try:
            return _read(where, load_hf)
        except Exception:  # noqa: BLE001 - a damaged snapshot
            pass  # is loaded again by transformers and saved anew
    tok = load_hf()
    with contextlib.suppress(OSError, TypeError, ValueError):  # a cache that cannot be written: none kept
        _save(tok, where)
    return tok


def _key(folder: Path) -> str:
    """The snapshot's name: the versions that compute it and every file a tokenizer may read."""
    h = hashlib.sha256()
    versions = (SNAPSHOT_VERSION, importlib.metadata.version("transformers"), tokenizers.__version__)
    h.update(repr(versions).encode())
    files = [p for p in folder.iterdir() if p.is_file() and p.suffix in KEY_SUFFIXES]
    files += [p for name in KEY_FOLDERS if (folder / name).is_dir() for p in (folder / name).rglob("*")]
    for path in sorted(p for p in files if p.is_file()):
        h.update(f"{path.relative_to(folder)}\0{path.stat().st_size}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:32]


def _read(where: Path, load_hf: Callable[[], object]) -> Tokenizer:
    facts = json.loads((where / FACTS).read_text(encoding="utf-8"))
    backend = tokenizers.Tokenizer.from_file(str(where / BACKEND))
    backend.encode_special_tokens = facts["split_special_tokens"]
    return Tokenizer(backend, facts["special_tokens_map"], facts["chat_template"], load_hf)


def keeps(tok: object) -> bool:
    """Whether `Tokenizer` answers as ``tok`` does: transformers' ``TokenizersBackend`` itself, its
    decode the backend's alone, its chat template one text or none."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if type(tok) is not TokenizersBackend:
        return False
    cleans = tok.clean_up_tokenization_spaces and not (
        type(tok.backend_tokenizer.model).__name__ == "BPE"  # transformers skips the clean-up of BPE
        and not getattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    )
    return not cleans and (tok.chat_template is None or isinstance(tok.chat_template, str))


def _save(tok: object, where: Path) -> None:
    """``tok``'s snapshot in ``where`` (atomically), when `keeps` it."""
    if not keeps(tok):
        return
    backend = tokenizers.Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.no_truncation()  # as transformers' encode sets it for a call without truncation or padding
    backend.no_padding()
    facts = {
        "special_tokens_map": tok.special_tokens_map,
        "chat_template": tok.chat_template,
        "split_special_tokens": bool(tok.split_special_tokens),
    }
    text = json.dumps(facts, ensure_ascii=False)  # TypeError for a value JSON cannot hold: none kept
    tmp = where.with_name(f"{where.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    backend.save(str(tmp / BACKEND))
    (tmp / FACTS).write_text(text, encoding="utf-8")
    shutil.rmtree(where, ignore_errors=True)
    os.replace(tmp, where)
