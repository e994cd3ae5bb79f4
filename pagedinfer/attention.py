"""The attention function every Hugging Face layer calls: write new K/V into the pool, read per block table.

Registered once through ``transformers.AttentionInterface`` under the name ``"pagedinfer"``. The
model runner sets a `StepContext` for the duration of one forward pass; each layer finds its pool
tensors by ``module.layer_idx``. The model passes RoPE'd ``query [1, Hq, T, D]`` and un-repeated
``key``/``value [1, Hkv, T, D]`` of ALL tokens packed in one row; masking is ours (per-sequence
causal, sliding window), and so are softcap, attention sinks and the model's ``scaling``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from pagedinfer import cpu_kernel
from pagedinfer.attention_metadata import AttentionMetadata
from pagedinfer.kv_cache import KVCache, LayerShape

ATTN_NAME = "pagedinfer"


@dataclass
class StepContext:
    meta: AttentionMetadata | None
    kv: KVCache | None
    use_cuda_kernels: bool = False
    probe: dict[int, LayerShape] | None = None  # set while discovering the layers' K/V shapes
    _plans: dict = field(default_factory=dict)  # per-step derived index tensors, shared by layers


_ctx: StepContext | None = None


def set_context(ctx: StepContext | None) -> None:
    global _ctx
    _ctx = ctx


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    ctx = _ctx
    if ctx is None:
        raise RuntimeError("the pagedinfer attention runs only inside a pagedinfer engine step")
    layer = module.layer_idx
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)  # [T, kvh, D]
    v = value[0].transpose(0, 1)  # [T, kvh, Dv]
    if ctx.probe is not None:
        ctx.probe[layer] = LayerShape(k.shape[1], k.shape[2], v.shape[2])
        return query.new_zeros(1, q.shape[0], q.shape[1], v.shape[2]), None
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    window = int(kwargs.get("sliding_window") or 0)
    softcap = float(kwargs.get("softcap") or 0.0)
    sinks = kwargs.get("s_aux")
    k_cache, v_cache = ctx.kv.k[layer], ctx.kv.v[layer]
    meta = ctx.meta
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])  # [T, Hq, Dv]
    if ctx.use_cuda_kernels:
        from pagedinfer import cuda_kernels

        cuda_kernels.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        cuda_kernels.paged_attention(out, q, k_cache, v_cache, meta, scale, window, softcap, sinks)
    else:
        use_kernel = (
            k_cache.dtype == torch.float32
            and cpu_kernel.available()
            and cpu_kernel.supports(q.shape[1], k.shape[1], q.shape[2], v.shape[2], k_cache.shape[1])
        )
        plan = ctx._plans.get(use_kernel)  # one plan per step (two if layers differ in kernel support)
        if plan is None:
            plan = ctx._plans[use_kernel] = TorchPlan.build(meta, use_kernel)
        plan.attend(out, q, k, v, k_cache, v_cache, meta.slot_mapping, scale, window, softcap, sinks)
    return out.unsqueeze(0), None  # [1, T, Hq, Dv]


def _softmax(scores: torch.Tensor, mask: torch.Tensor, softcap: float, sinks, out_dtype) -> torch.Tensor:
    """Masked softmax over the last dim; ``sinks`` (per head, shaped to broadcast) add mass only."""
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(out_dtype)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    both = torch.cat([scores, sink], dim=-1)
    return torch.softmax(both, dim=-1, dtype=torch.float32)[..., :-1].to(out_dtype)


@dataclass
class TorchPlan:
    """Index tensors for the CPU path, built once per step and reused by every layer.

    Decode sequences (one new token) are attended together with their contexts padded to the
    longest; each prefill/extend chunk is attended on its own.
    """

    decode_rows: torch.Tensor  # [Sd] packed-row index of each decode token
    decode_slots: torch.Tensor  # [Sd, Lmax] slot of each context position (padded with a valid slot)
    decode_kpos: torch.Tensor  # [Sd, Lmax] key positions
    decode_qpos: torch.Tensor  # [Sd, 1] query positions
    decode_tables: torch.Tensor  # [Sd, max_blocks] int32 block tables of the decode sequences
    decode_lens: torch.Tensor  # [Sd] int32 context lengths of the decode sequences
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]  # (t0, t1, slots, qpos, kpos)
    use_kernel: bool  # decode rows go through the C kernel (float32 on a machine that built it)
    masks: dict = field(default_factory=dict)  # sliding window -> (decode mask, chunk masks)

    @classmethod
    def build(cls, meta: AttentionMetadata, use_kernel: bool) -> TorchPlan:
        bs = meta.block_size
        tables = meta.block_tables.to(torch.int64)
        starts = meta.query_start_loc.tolist()
        decode = [s for s, n in enumerate(meta.query_lens) if n == 1]
        lmax = max((meta.context_lens_host[s] for s in decode), default=1)
        pos = torch.arange(lmax)  # [Lmax]
        idx = torch.tensor(decode, dtype=torch.int64)
        rows = torch.tensor([starts[s] for s in decode], dtype=torch.int64)
        decode_tables = meta.block_tables[idx].contiguous()
        decode_lens = meta.context_lens[idx].contiguous()
        ctx_lens = decode_lens.to(torch.int64).unsqueeze(1)  # [Sd, 1]
        qpos = ctx_lens - 1
        if decode and not use_kernel:
            kpos = torch.minimum(pos.unsqueeze(0), qpos)  # [Sd, Lmax] pad -> last valid
            slots = tables[idx].gather(1, kpos // bs) * bs + kpos % bs  # [Sd, Lmax]
            kpos = pos.unsqueeze(0).expand_as(slots)
        else:  # the CPU kernel reads through the block tables itself
            slots = kpos = torch.zeros(len(decode), 0, dtype=torch.int64)
        chunks = []
        for s, n in enumerate(meta.query_lens):
            if n == 1:
                continue
            length = meta.context_lens_host[s]
            cpos = torch.arange(length)  # [L]
            cslots = tables[s, cpos // bs] * bs + cpos % bs  # [L]
            chunks.append((starts[s], starts[s] + n, cslots, cpos[length - n :].unsqueeze(1), cpos))
        return cls(rows, slots, kpos, qpos, decode_tables, decode_lens, chunks, use_kernel)

    def _masks(self, window: int):
        if window not in self.masks:
            visible = self.decode_kpos <= self.decode_qpos  # [Sd, Lmax]
            if window:
                visible &= self.decode_qpos - self.decode_kpos < window
            chunk_masks = []
            for _, _, _, qpos, kpos in self.chunks:
                m = kpos.unsqueeze(0) <= qpos  # [n, L]
                if window:
                    m &= qpos - kpos.unsqueeze(0) < window
                chunk_masks.append(m)
            self.masks[window] = (visible, chunk_masks)
        return self.masks[window]

    def attend(self, out, q, k, v, k_cache, v_cache, slot_mapping, scale, window, softcap, sinks) -> None:
        """Write this step's ``k``/``v`` at their slots, then attend every query token."""
        k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [NB * bs, kvh, D]
        v_flat = v_cache.view(-1, *v_cache.shape[2:])  # [NB * bs, kvh, Dv]
        k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))
        kvh = k_flat.shape[1]
        hq, d = q.shape[1], q.shape[2]
        g = hq // kvh
        decode_mask, chunk_masks = self._masks(window)
        if len(self.decode_rows) and self.use_kernel:
            q = q if q.stride(-1) == 1 else q.contiguous()
            tables, lens, rows = self.decode_tables, self.decode_lens, self.decode_rows
            cpu_kernel.paged_decode(
                out, q, k_cache, v_cache, tables, lens, rows, scale, window, softcap, sinks
            )
        elif len(self.decode_rows):
            sd = len(self.decode_rows)
            qd = q[self.decode_rows].view(sd, kvh, g, d) * scale  # [Sd, kvh, g, D]
            keys = k_flat[self.decode_slots].permute(0, 2, 3, 1)  # [Sd, kvh, D, Lmax]
            vals = v_flat[self.decode_slots].transpose(1, 2)  # [Sd, kvh, Lmax, Dv]
            scores = qd @ keys.to(qd.dtype)  # [Sd, kvh, g, Lmax]
            sink = None if sinks is None else sinks.view(1, kvh, g, 1)
            probs = _softmax(scores, decode_mask[:, None, None, :], softcap, sink, vals.dtype)
            out[self.decode_rows] = (probs @ vals).reshape(sd, hq, -1).to(out.dtype)
        for (t0, t1, slots, _, _), mask in zip(self.chunks, chunk_masks, strict=True):
            n = t1 - t0
            qc = q[t0:t1].view(n, kvh, g, d).permute(1, 2, 0, 3) * scale  # [kvh, g, n, D]
            keys = k_flat[slots].permute(1, 2, 0).unsqueeze(1)  # [kvh, 1, D, L]
            vals = v_flat[slots].transpose(0, 1).unsqueeze(1)  # [kvh, 1, L, Dv]
            scores = qc @ keys.to(qc.dtype)  # [kvh, g, n, L]
            sink = None if sinks is None else sinks.view(kvh, g, 1, 1)
            probs = _softmax(scores, mask, softcap, sink, vals.dtype)
            out[t0:t1] = (probs @ vals).permute(2, 0, 1, 3).reshape(n, hq, -1).to(out.dtype)


AttentionInterface.register(ATTN_NAME, paged_attention)
