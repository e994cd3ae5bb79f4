"""The command line: `pagedinfer run` (JSONL in, JSONL out, the memory report), `blocks`, `bench`."""
