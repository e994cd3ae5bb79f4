"""JSONL batch lines, from input to output record: reading the input once, parsing and keying each
line (no model needed), and the record each line gets. Below ``cli/`` and ``ray/``, which both use it."""
