"""Compare the token ids of two `pagedinfer run` output files line by line (exit 1 if any differ)."""

import json
import sys


def token_ids(path: str) -> list[list[list[int]]]:
    with open(path) as f:
        return [[o["token_ids"] for o in json.loads(line)["outputs"]] for line in f]


def main(a: str, b: str) -> int:
    left, right = token_ids(a), token_ids(b)
    same = sum(x == y for x, y in zip(left, right, strict=True))
    print(f"{same}/{len(left)} lines with identical token ids: {a} vs {b}")
    return int(same != len(left))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
