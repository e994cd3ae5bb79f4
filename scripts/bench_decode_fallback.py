"""Decode attention with and without the C kernel, one W1-shaped call (the figure kernels/paged_decode.py quotes).

python scripts/bench_decode_fallback.py
"""

import time

import torch

from pagedinfer.attention.metadata import AttentionMetadata
from pagedinfer.attention.portable_backend import PortablePlan

torch.set_num_threads(2)
S, L, hq, kvh, d, bs = 64, 250, 9, 3, 64, 16
nb = S * (L // bs + 1)
kc = torch.randn(nb, bs, kvh, d)
vc = torch.randn(nb, bs, kvh, d)
tables = torch.arange(nb, dtype=torch.int32).view(S, -1)
lens = [L] * S
meta = AttentionMetadata(
    slot_mapping=(tables[:, (L - 1) // bs].long() * bs + (L - 1) % bs),
    query_start_loc=torch.arange(S + 1, dtype=torch.int32),
    context_lens=torch.tensor(lens, dtype=torch.int32),
    block_tables=tables,
    query_lens=[1] * S,
    context_lens_host=lens,
    block_size=bs,
    max_query_len=1,
    max_context_len=L,
)
q = torch.randn(S, hq, d)
k = torch.randn(S, kvh, d)
v = torch.randn(S, kvh, d)
out = torch.empty(S, hq, d)
res = {}
for _rep in range(3):
    for use in (True, False):
        plan = PortablePlan.build(meta, use)
        t = time.perf_counter()
        for _ in range(20):
            plan.attend(out, q, k, v, kc, vc, meta.slot_mapping, 0.125, 0, 0.0, None)
        res.setdefault(use, []).append((time.perf_counter() - t) / 20)
print({k: [f"{x * 1e3:.2f}ms" for x in v] for k, v in res.items()}, "ratio", min(res[False]) / min(res[True]))
