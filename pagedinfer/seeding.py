"""Where every random seed comes from, in one place (the CLI, the engine and the sampler use it).

A line of a batch file that gives no seed gets one from (--seed, the line's identity); a request
with no seed gets one from the engine's seed stream; completion ``i`` of a request draws from a
generator seeded by (seed, prompt, i). The prompt enters so one seed shared by many prompts gives
each its own noise, and the index so the n completions differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

SEED_BITS = 63  # torch.Generator.manual_seed takes any non-negative int below 2**64


def line_seed(base_seed: int, key: str) -> int:
    """The seed of a batch line that gives none: from --seed and the line's identity only."""
    digest = hashlib.blake2b(f"{base_seed}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def completion_seed(base_seed: int, index: int, prompt_token_ids: Sequence[int]) -> int:
    """The seed of completion ``index`` of a request seeded ``base_seed`` with this prompt."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(base_seed.to_bytes(16, "little", signed=True))
    digest.update(index.to_bytes(8, "little"))
    digest.update(b"".join(t.to_bytes(8, "little", signed=True) for t in prompt_token_ids))
    return int.from_bytes(digest.digest(), "little") & ((1 << SEED_BITS) - 1)
