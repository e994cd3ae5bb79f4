"""Incremental detokenization and stop-string matching for one completion.

Text grows one token at a time through `tokenizers`' DecodeStream, which holds back bytes until
they form whole UTF-8 characters, so a Korean syllable or an emoji is never emitted in halves.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,  # a tokenizers.Tokenizer (the fast tokenizer's backend)
        prompt_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str],
        include_stop: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(ids=list(prompt_ids[-8:]), skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self.text = ""

    def step(self, token_id: int) -> str | None:
        """Append one token's text; return the stop string it completed, if any (text is then cut)."""
        chunk = self._stream.step(self._tokenizer, token_id)
        if not chunk:
            return None
        scan_from = max(0, len(self.text) - self._longest_stop + 1)
        self.text += chunk
        hits = [(at, stop) for stop in self._stop if (at := self.text.find(stop, scan_from)) >= 0]
        if not hits:
            return None
        at, stop = min(hits)  # the earliest stop string in the text wins
        self.text = self.text[: at + len(stop)] if self._include_stop else self.text[:at]
        return stop
