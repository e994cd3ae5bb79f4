"""Unique keys in generated JSON objects: llguidance's grammars do not enforce them.

A JSON schema's ``properties`` are unique by construction, but keys matched by ``additionalProperties``
(all of a ``json_object``'s keys) may repeat: uniqueness over unbounded strings is not context-free,
so no grammar can say it. RFC 8259 says names SHOULD be unique and most readers keep the last value
silently, so a repeated key loses data. Here a sequence's JSON is followed as far as keys go
(`JsonKeys`), and `KeyGuard` bans each token that would close a key its object already has.

The grammar guarantees the text is valid JSON, so following it needs only its structural bytes
(``{ } [ ] : , "`` and escapes; none occurs inside a multi-byte UTF-8 character). A token can only
close a repeated key if it holds enough quotes: one inside a key, three inside a value string (close,
open, close), two elsewhere; the few allowed tokens with that many quotes are the ones tried.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

QUOTE = ord('"')


@dataclass(frozen=True)
class _Object:
    """An open object: its keys so far, and whether a key comes next (after ``{`` or ``,``)."""

    keys: frozenset[str] = frozenset()
    expect_key: bool = True


class JsonKeys:
    """Where a sequence's JSON text is, as far as keys go: the open containers and the open string."""

    def __init__(self) -> None:
        self.stack: list[_Object | None] = []  # innermost last; None: an array
        self.string: bytes | None = None  # the open string's raw bytes (escapes as written)
        self.is_key = False  # the open string is a key
        self.escape = False  # the open string's last byte is an unescaped backslash

    def copy(self) -> JsonKeys:
        other = JsonKeys.__new__(JsonKeys)
        other.stack, other.string = list(self.stack), self.string  # frames are immutable
        other.is_key, other.escape = self.is_key, self.escape
        return other

    def feed(self, data: bytes) -> str | None:
        """Follow ``data``; return a key it closes that its object has already (then stop), else None."""
        start = 0  # where the open string's unread bytes begin in data
        for i, byte in enumerate(data):
            if self.string is not None:
                if self.escape:
                    self.escape = False
                elif byte == 0x5C:  # backslash
                    self.escape = True
                elif byte == QUOTE:
                    raw, self.string = self.string + data[start:i], None
                    if self.is_key:
                        key = json.loads(b'"' + raw + b'"')
                        top = self.stack[-1]
                        if key in top.keys:
                            return key
                        self.stack[-1] = _Object(top.keys | {key}, expect_key=False)
                continue
            if byte == QUOTE:
                top = self.stack[-1] if self.stack else None
                self.string, self.is_key, start = b"", top is not None and top.expect_key, i + 1
            elif byte == ord("{"):
                self.stack.append(_Object())
            elif byte == ord("["):
                self.stack.append(None)
            elif byte in b"}]" and self.stack:  # the grammar closes only what is open
                self.stack.pop()
            elif byte == ord(",") and self.stack and self.stack[-1] is not None:
                self.stack[-1] = replace(self.stack[-1], expect_key=True)
        if self.string is not None:
            self.string += data[start:]
        return None

    @property
    def quotes_to_repeat(self) -> int:
        """The fewest quotes a token needs to close a key its object has already."""
        if self.string is None:
            return 2
        if not self.is_key:
            return 3
        return 1 if self.stack[-1].keys else 3  # a first key can only be repeated by a later one


class KeyGuard:
    """A vocabulary's view for `JsonKeys`: each token's bytes and the tokens with 1, 2, 3+ quotes."""

    def __init__(self, vocab_size: int, token_bytes: Callable[[int], bytes]) -> None:
        self.token_bytes = [token_bytes(t) for t in range(vocab_size)]
        quotes = torch.tensor([min(b.count(QUOTE), 3) for b in self.token_bytes])  # [V]
        self._with = {n: torch.nonzero(quotes >= n).flatten() for n in (1, 2, 3)}  # [<= V] each

    def banned(self, keys: JsonKeys, bitmask: torch.Tensor) -> list[int]:
        """The tokens ``bitmask`` (one row, int32 words, bit t: token t allowed) allows that would
        close a key its object has already."""
        ids = self._with[keys.quotes_to_repeat]
        allowed = (bitmask[ids >> 5] >> (ids & 31)) & 1  # [len(ids)]
        return [t for t in ids[allowed.bool()].tolist() if keys.copy().feed(self.token_bytes[t]) is not None]
