"""The portable attention path (the CPU; CUDA without CuPy): K/V writes, decode and prefill reads.

Portable because it runs wherever torch does: where the C kernel serves the pool (`cpu_kernel`),
every query row, decode or prompt, goes through it; else decode rows take a padded gather in torch
ops and prompt chunks SDPA, or a matmul + softmax when the model needs softcap or sinks. (The CuPy
kernels are `cuda_kernels`.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from pagedinfer.attention.metadata import AttentionMetadata
from pagedinfer.kernels import paged_decode


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


def _row_seqs(q_lens: torch.Tensor) -> torch.Tensor:
    """The sequence of each packed query row, for sequences of ``q_lens`` rows each: ``[T]``."""
    return torch.repeat_interleave(torch.arange(len(q_lens), device=q_lens.device), q_lens)


def row_contexts(
    meta: AttentionMetadata, q_lens: torch.Tensor | None = None, starts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed query row's sequence ``[T]`` (int64) and its own context length ``[T]`` (int32): a
    row at position p of its sequence reads that sequence's positions up to p, as the C kernel attends
    every row (``q_lens`` ``[S]`` and ``starts`` ``[S]``, the rows' first packed row, where the caller
    has them)."""
    dev = meta.context_lens.device
    if q_lens is None:
        q_lens = torch.tensor(meta.query_lens, device=dev)  # [S]
    if starts is None:
        starts = meta.query_start_loc.to(torch.int64)  # [S + 1]
    seq = _row_seqs(q_lens)  # [T]
    rows = torch.arange(len(seq), device=dev)  # [T] packed rows, in order
    first = meta.context_lens.to(torch.int64)[seq] - q_lens[seq]  # [T] the context before its chunk
    return seq, (first + rows - starts[seq] + 1).to(torch.int32)


@dataclass
class PortablePlan:
    """Index tensors for the portable path, built once per step and reused by every layer.

    With the C kernel every query row is a "decode" row of its own context (`_kernel_rows`) and the
    chunk fields are empty. Without it decode sequences (one new token) are attended together with
    their contexts padded to the longest, and prefill/extend chunks each take one fused
    ``scaled_dot_product_attention`` call; models with softcapping or sinks attend all chunks at
    once, padded to the longest chunk and context, with a batched matmul + softmax.
    """

    decode_rows: torch.Tensor  # [Sd] packed-row index of each decode token (with the kernel: every row)
    decode_slots: torch.Tensor  # [Sd, Lmax] slot of each context position (padded with a valid slot)
    decode_kpos: torch.Tensor  # [Sd, Lmax] key positions
    decode_qpos: torch.Tensor  # [Sd, 1] query positions
    decode_tables: torch.Tensor  # [Sd, max_blocks] int32 block table of each decode row's sequence
    decode_lens: torch.Tensor  # [Sd] int32 context length of each decode row (a prompt row: up to itself)
    decode_lens_host: list[int]  # the same, as a list
    chunk_rows: torch.Tensor  # [Sc, Nmax] packed-row index of each chunk token (padded: first row)
    chunk_valid: torch.Tensor  # [Sc, Nmax] real (not padding) chunk tokens
    chunk_slots: torch.Tensor  # [Sc, Cmax] slot of each context position (padded with a valid slot)
    chunk_qpos: torch.Tensor  # [Sc, Nmax, 1] query positions
    chunk_kpos: torch.Tensor  # [Cmax] key positions
    chunk_spans: list[tuple[int, int, int]]  # per chunk: first packed row, tokens, context length
    prompt_runs: list[tuple[int, int, int]]  # per run of whole prompts of one length, adjacent in the
    # packed row (chunk_spans in order, every chunk in exactly one run): first packed row, prompts, tokens each
    use_kernel: bool  # every row goes through the C kernel (a pool and dtypes it has an instantiation for)
    masks: dict = field(default_factory=dict)  # sliding window -> (decode mask, chunk mask)
    ranges: dict = field(default_factory=dict)  # kernel work per key -> its thread ranges

    @classmethod
    def build(cls, meta: AttentionMetadata, use_kernel: bool) -> PortablePlan:
        bs = meta.block_size
        tables = meta.block_tables.to(torch.int64)
        starts = meta.query_start_loc.to(torch.int64)
        dev = meta.context_lens.device  # the model's: index tensors live beside the pool
        q_lens = torch.tensor(meta.query_lens, device=dev)  # [S]
        ctx_lens = meta.context_lens.to(torch.int64)  # [S]
        if use_kernel:
            return cls._kernel_rows(meta, q_lens, starts)
        decode = torch.nonzero(q_lens == 1).flatten()  # [Sd]
        chunk = torch.nonzero(q_lens > 1).flatten()  # [Sc]
        decode_lens = meta.context_lens[decode].contiguous()
        qpos = ctx_lens[decode].unsqueeze(1) - 1  # [Sd, 1]
        if len(decode) and not use_kernel:
            slots, kpos = cls._context(tables[decode], ctx_lens[decode], bs)
            kpos = kpos.unsqueeze(0).expand_as(slots)
        else:  # the CPU kernel reads through the block tables itself
            slots = kpos = torch.zeros(len(decode), 0, dtype=torch.int64, device=dev)
        if len(chunk):
            n = q_lens[chunk]  # [Sc]
            offs = torch.arange(int(n.max()), device=dev)  # [Nmax]
            chunk_valid = offs.unsqueeze(0) < n.unsqueeze(1)  # [Sc, Nmax]
            chunk_rows = starts[chunk].unsqueeze(1) + torch.where(chunk_valid, offs, 0)  # [Sc, Nmax]
            chunk_qpos = (ctx_lens[chunk] - n).unsqueeze(1) + offs  # [Sc, Nmax]
            chunk_slots, chunk_kpos = cls._context(tables[chunk], ctx_lens[chunk], bs)
            spans = list(zip(starts[chunk].tolist(), n.tolist(), ctx_lens[chunk].tolist(), strict=True))
            runs = cls._prompt_runs(spans)
        else:  # a decode-only step (most steps): nothing to index
            chunk_rows = chunk_slots = chunk_qpos = torch.zeros(0, 0, dtype=torch.int64, device=dev)
            chunk_valid = torch.zeros(0, 0, dtype=torch.bool, device=dev)
            chunk_kpos = torch.zeros(0, dtype=torch.int64, device=dev)
            spans, runs = [], []
        return cls(
            starts[decode],
            slots,
            kpos,
            qpos,
            meta.block_tables[decode].contiguous(),
            decode_lens,
            decode_lens.tolist()
            if meta.context_lens_host is None  # a graph step's metadata (never captured on this path)
            else [meta.context_lens_host[i] for i in decode.tolist()],
            chunk_rows,
            chunk_valid,
            chunk_slots,
            chunk_qpos.unsqueeze(2),
            chunk_kpos,
            spans,
            runs,
            use_kernel,
        )

    @classmethod
    def _kernel_rows(
        cls, meta: AttentionMetadata, q_lens: torch.Tensor, starts: torch.Tensor
    ) -> PortablePlan:
        """Every query row through the C kernel as a single-token query over its own context: a prompt
        chunk's row at position p reads its sequence's blocks up to p. Each row's terms then depend
        only on its own context, never on how the prompt was cut into chunks or what else ran in the
        step, so a row has the same bits chunked or not, cached or recomputed, and as a decode row
        (SDPA's blocking varies with the chunk's length). K/V are read in place, never gathered.
        """
        dev = meta.context_lens.device
        seq, lens = row_contexts(meta, q_lens, starts)  # [T] each
        rows = torch.arange(len(seq), device=dev)  # [T] packed rows, in order
        tables = meta.block_tables if len(seq) == len(q_lens) else meta.block_tables[seq]  # [T, max_blocks]
        no_slots = torch.zeros(len(seq), 0, dtype=torch.int64, device=dev)  # the kernel reads the tables
        no_chunks = torch.zeros(0, 0, dtype=torch.int64, device=dev)
        return cls(
            decode_rows=rows,
            decode_slots=no_slots,
            decode_kpos=no_slots,
            decode_qpos=no_slots,
            decode_tables=tables.contiguous(),
            decode_lens=lens,
            decode_lens_host=lens.tolist(),
            chunk_rows=no_chunks,
            chunk_valid=torch.zeros(0, 0, dtype=torch.bool, device=dev),
            chunk_slots=no_chunks,
            chunk_qpos=no_chunks,
            chunk_kpos=torch.zeros(0, dtype=torch.int64, device=dev),
            chunk_spans=[],
            prompt_runs=[],
            use_kernel=True,
        )

    def for_group(self, meta: AttentionMetadata) -> PortablePlan:
        """This kernel plan over another layer group's block tables (``meta``: that group's view of the
        same step): the rows, context lengths and thread ranges are every group's, only the tables
        differ, so they alone are gathered again."""
        tables = meta.block_tables  # [S, max_blocks]
        if len(self.decode_rows) != tables.shape[0]:  # prompt rows: each row reads its sequence's table
            tables = tables[_row_seqs(torch.tensor(meta.query_lens, device=tables.device))]  # [T, max_blocks]
        return replace(self, decode_tables=tables.contiguous(), masks={}, ranges=self.ranges)

    @staticmethod
    def _prompt_runs(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """``spans`` cut into runs that one SDPA call can attend: whole prompts (context = tokens) of
        one length that follow each other in the packed row; every other chunk is a run of its own."""
        runs: list[tuple[int, int, int, bool]] = []  # (first row, prompts, tokens each, whole)
        for start, n, c in spans:
            if (
                runs
                and c == n
                and runs[-1][2] == n
                and runs[-1][0] + runs[-1][1] * n == start
                and runs[-1][3]
            ):
                first, count, _, _ = runs[-1]
                runs[-1] = (first, count + 1, n, True)
            else:
                runs.append((start, 1, n, c == n))
        return [(start, count, n) for start, count, n, _ in runs]

    @staticmethod
    def _context(tables: torch.Tensor, lens: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``[S, Lmax]`` of every context position (past each length: the last valid one)."""
        pos = torch.arange(int(lens.max()) if len(lens) else 0, device=lens.device)  # [Lmax]
        clamped = torch.minimum(pos.unsqueeze(0), lens.unsqueeze(1) - 1)  # [S, Lmax]
        return tables.gather(1, clamped // bs) * bs + clamped % bs, pos

    def _masks(self, window: int):
        """(decode mask, chunk mask) for ``window``, built on first need in the step: the kernel's
        decode rows and whole prompts without a window use none."""
        if window not in self.masks:
            visible = self.decode_kpos <= self.decode_qpos  # [Sd, Lmax]
            chunk = self.chunk_kpos <= self.chunk_qpos  # [Sc, Nmax, Cmax]
            if window:
                visible &= self.decode_qpos - self.decode_kpos < window
                chunk &= self.chunk_qpos - self.chunk_kpos < window
            self.masks[window] = (visible, chunk)
        return self.masks[window]

    def attend(self, out, q, k, v, k_cache, v_cache, slot_mapping, scale, window, softcap, sinks) -> None:
        """Write this step's ``k``/``v`` at their slots, then attend every query token."""
        k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [NB * bs, kvh, D]
        v_flat = v_cache.view(-1, *v_cache.shape[2:])  # [NB * bs, kvh, Dv]
        if self.use_kernel and k.stride(-1) == v.stride(-1) == 1:  # use_kernel: the kernel has these dtypes
            paged_decode.store_kv(k_cache, v_cache, k, v, slot_mapping)
        else:
            k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
            v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))
        if len(self.decode_rows) and self.use_kernel:
            self._decode_kernel(out, q, v, k_cache, v_cache, scale, window, softcap, sinks)
        elif len(self.decode_rows):
            self._decode_torch(out, q, k_flat, v_flat, scale, window, softcap, sinks)
        if len(self.chunk_rows) and not softcap and sinks is None:
            self._chunks_sdpa(out, q, k, v, k_flat, v_flat, scale, window)
        elif len(self.chunk_rows):
            self._chunks_matmul(out, q, k_flat, v_flat, scale, window, softcap, sinks)

    def _decode_kernel(self, out, q, v, k_cache, v_cache, scale, window, softcap, sinks) -> None:
        """Decode rows through the C kernel, reading K/V in place through the block tables."""
        q = q if q.stride(-1) == 1 else q.contiguous()
        per_key = q.shape[1] * (q.shape[2] + v.shape[2])  # multiply-adds per key and sequence
        if per_key not in self.ranges:
            self.ranges[per_key] = paged_decode.split(self.decode_lens_host, per_key)
        paged_decode.paged_decode(
            out,
            q,
            k_cache,
            v_cache,
            self.decode_tables,
            self.decode_lens,
            self.decode_rows,
            self.ranges[per_key],
            scale,
            window,
            softcap,
            sinks,
        )

    def _decode_torch(self, out, q, k_flat, v_flat, scale, window, softcap, sinks) -> None:
        """Decode rows attended together, their contexts gathered and padded to the longest."""
        kvh, hq, d = k_flat.shape[1], q.shape[1], q.shape[2]
        sd, g = len(self.decode_rows), hq // kvh
        qd = q[self.decode_rows].view(sd, kvh, g, d) * scale  # [Sd, kvh, g, D]
        keys = k_flat[self.decode_slots].permute(0, 2, 3, 1)  # [Sd, kvh, D, Lmax]
        vals = v_flat[self.decode_slots].transpose(1, 2)  # [Sd, kvh, Lmax, Dv]
        scores = qd @ keys.to(qd.dtype)  # [Sd, kvh, g, Lmax]
        sink = None if sinks is None else sinks.view(1, kvh, g, 1)
        decode_mask = self._masks(window)[0]  # [Sd, Lmax]
        probs = _softmax(scores, decode_mask[:, None, None, :], softcap, sink, vals.dtype)
        out[self.decode_rows] = (probs @ vals).reshape(sd, hq, -1).to(out.dtype)

    def _chunks_sdpa(self, out, q, k, v, k_flat, v_flat, scale, window) -> None:
        """Fused SDPA (no [N, C] probabilities kept, no padding to the longest chunk): one call per run
        of whole prompts of one length, adjacent in the packed row (``prompt_runs``), one per other chunk.

        Whole prompts attend their own rows of this step, causally, so SDPA skips the masked half
        instead of computing it and masking it out (rounded as the pool holds them, where the pool's
        dtype is narrower: --kv-cache-dtype); a run of B of them is a batch of B, read in place
        through views of the packed rows (64 prompts of 128 tokens: 1 call a layer instead of 64).
        """
        hq, kvh = q.shape[1], k.shape[1]
        i = 0  # the run's first chunk in chunk_spans
        for start, count, n in self.prompt_runs:
            c = self.chunk_spans[i][2]
            rows = slice(start, start + count * n)
            whole = c == n
            if whole:  # [B, n, h, D] views of the run's rows
                kc = k[rows].to(k_flat.dtype).view(count, n, kvh, -1)
                vc = v[rows].to(v_flat.dtype).view(count, n, kvh, -1)
            else:  # one chunk with a cached context: its keys gathered from the pool
                kc, vc = (
                    k_flat[self.chunk_slots[i, :c]].unsqueeze(0),
                    v_flat[self.chunk_slots[i, :c]].unsqueeze(0),
                )
            qc = q[rows].view(count, n, hq, -1)  # [B, n, Hq, D]
            causal = whole and not window
            res = F.scaled_dot_product_attention(
                qc.transpose(1, 2),  # [B, Hq, n, D]
                kc.transpose(1, 2).to(qc.dtype),  # [B, kvh, c, D]
                vc.transpose(1, 2).to(qc.dtype),  # [B, kvh, c, Dv]
                attn_mask=None if causal else self._masks(window)[1][i, :n, :c],
                is_causal=causal,
                scale=scale,
                enable_gqa=True,
            )  # [B, Hq, n, Dv]
            out[rows].view(count, n, hq, -1).copy_(res.transpose(1, 2).to(out.dtype))
            i += count

    def _chunks_matmul(self, out, q, k_flat, v_flat, scale, window, softcap, sinks) -> None:
        """All chunks at once, padded to the longest chunk and context: a batched matmul + softmax
        (for models with softcapping or sinks, which SDPA does not take)."""
        kvh, hq, d = k_flat.shape[1], q.shape[1], q.shape[2]
        g = hq // kvh
        sc, nmax = self.chunk_rows.shape
        qc = q[self.chunk_rows].view(sc, nmax, kvh, g, d).permute(0, 2, 3, 1, 4) * scale  # [Sc, kvh, g, N, D]
        keys = k_flat[self.chunk_slots].permute(0, 2, 3, 1).unsqueeze(2)  # [Sc, kvh, 1, D, Cmax]
        vals = v_flat[self.chunk_slots].transpose(1, 2).unsqueeze(2)  # [Sc, kvh, 1, Cmax, Dv]
        scores = qc @ keys.to(qc.dtype)  # [Sc, kvh, g, N, Cmax]
        sink = None if sinks is None else sinks.view(1, kvh, g, 1, 1)
        chunk_mask = self._masks(window)[1]  # [Sc, Nmax, Cmax]
        probs = _softmax(scores, chunk_mask[:, None, None], softcap, sink, vals.dtype)
        res = (probs @ vals).permute(0, 3, 1, 2, 4).reshape(sc, nmax, hq, -1)  # [Sc, N, Hq, Dv]
        out[self.chunk_rows[self.chunk_valid]] = res[self.chunk_valid].to(out.dtype)
