/* y = x W^T (+ bias) for any row count of x: every CPU linear of a step (decode and prefill), with W
 * in float32, bfloat16, int8 or int4 (weight-only quantization) or a GGUF block type kept as stored.
 *
 * W is repacked once at load into panels of NR = 16 weight rows, k-major: panel j holds W[16j ..
 * 16j+15, kk] for kk = 0 .. k-1 (the last panel zero-padded), in the weight's own format
 * (cpu_gemm_formats.h: float32 as 16 floats per k; quantized types as their values with the scale
 * fields of each group). A tile multiplies up to MR rows of x by one panel (or, at one to three rows,
 * by two or four panels, so enough independent FMA chains run) with its accumulators in registers:
 * per kk it forms the panel's 16 weights in float32 (a load; or a widening load, a conversion and a
 * multiply by the group's scale, plus its offset, for quantized types: in registers), broadcasts
 * each row's input and issues one FMA per row and panel. Every weight enters as the float32 value its
 * format's dequantizer gives, and every product is fma(x, w, acc) in k order, so a quantized panel's
 * products are those of the float32 kernel on the dequantized weight, bit for bit, at every row
 * count and tile shape (batch-invariant). With AVX-512 a panel row is one 512-bit register (MR 12);
 * elsewhere two 8-float vectors (MR 6); both give the same bits (cpu_panel_vec.h).
 *
 * More than MR rows (AVX-512): row blocks of up to WR = 8 rows by WP = 3 panels (24 accumulators, each
 * broadcast of x feeding three FMAs). On cores with full-width 512-bit FMA units a tile of one panel
 * loads a panel vector per MR FMAs and falls behind oneDNN there; of the wide shapes tried 8 x 3 was the
 * fastest, for float32, the quantized kinds and bfloat16 alike (-DWR=6 -DWP=4, -DWRB=6 -DWPB=4 build
 * the 6 x 4 runner-up; docs/kernels.md). Over a quantized chunk of WP panels the first row block goes
 * through a tile that converts in registers and also stores the float32 weights it forms into a
 * per-thread buffer, which the float32 tiles of the other rows then read from cache (a separate pass
 * that dequantized the chunk before the tiles waited on memory with nothing to overlap it). Every row
 * block prefetches its share of the next chunk's lines. AVX2 builds keep MR x 1 tiles (WR = MR,
 * WP = 1), and multiply 7 to 11 rows of the quantized kinds in SPLIT by half tiles: the rows by 8
 * columns, each half panel formed once for all of them.
 *
 * Threads take panels a chunk at a time (dynamically: on a shared machine one core is often slower
 * than the other, and a static split left the faster one waiting); each panel is read once per block
 * of MC rows and then serves every row tile of that block from cache, while the first tile prefetches
 * the thread's next panel. So the weight streams near memory speed at decode row counts (where
 * oneDNN's and MKL's GEMMs stream it well below that) and the FMA units stay busy at prefill row
 * counts. MC keeps a block of x (MC x k) within about 384 KB of L2.
 *
 * A fused gate-up weight of a gated MLP is packed with its halves paired (panel j: gate rows
 * 8j..8j+7, then the up rows of the same index), so one tile holds gate and up of the same 8
 * columns and the kernel writes silu(gate) * up directly: the [m, 2I] product is never stored and
 * read back, and the SiLU costs no pass of its own. Biases are packed the same way (16 per panel)
 * and added before the activation.
 *
 * bfloat16: the same panels with k in pairs (panel j, pair kp: W[16j + c, 2kp + e] at 32 kp + 2c +
 * e, one 64-byte vector), multiplied by pairs of x with vdpbf16ps into float32 accumulators, 8 rows
 * per tile (without AVX512-BF16 the same products in the same order by fused multiply-adds, the
 * instruction's bits: epairs_tile); the sums are rounded once to bfloat16 as a bfloat16
 * linear's output is, and the gated epilogue rounds gate and up first and silu(gate) again, as
 * cpu_llama_ops.c's bfloat16 silu_mul does. Requires an even k (x is read in pairs). With AMX, from
 * AMX_MIN_ROWS rows and k a multiple of 32, the same panels feed TDPBF16PS as its B tiles. Quantized
 * panels under bfloat16 activations (a segment's bf16_io) become such pair panels in registers, each
 * weight rounded to bfloat16 (qtile_bf16; past 8 rows the first row block leaves them in a buffer for
 * the others), so their products are a bfloat16 linear's over the dequantized weight, bit for bit.
 *
 * A Q4_0, Q4_1, Q8_0, I8, I4 or I4Z segment marked q8_dot takes llama.cpp's numerics instead (activations
 * quantized per block, integer dot products: cpu_gemm_q8dot.h), at every row count.
 *
 * A linear is one or more segments (gemm_segment: a run of output columns in one format, e.g. the
 * fused QKV of a GGUF whose V is Q6_K and Q, K are Q4_K), each written into its columns of y.
 */

#include "cpu_gemm.h" /* gemm_segment, the entry points below */

/* The parts, in this order (each uses the ones before it): */
#include "cpu_gemm_common.h"
#include "cpu_gemm_f32.h"
#include "cpu_gemm_quantized.h"
#include "cpu_gemm_bf16.h"
#include "cpu_gemm_bf16_emulated.h"
#include "cpu_gemm_amx.h"
#include "cpu_gemm_q8dot.h"
#include "cpu_gemm_schedule.h"

/* 1 where this build has the kind's kernel (every build has every kind's), else 0. */
int gemm_kind_available(int kind) { return kind >= 0 && kind < K_COUNT; }

/* 1 where the bfloat16 pair panels multiply with vdpbf16ps, 0 where the same products are emulated. */
int gemm_native_bf16(void) { return NATIVE_BF16; }

/* 1 where bfloat16 panels of 8 rows and more run on AMX tiles here (built for them, and Linux lets
 * this process use them), else 0. */
int gemm_amx(void) {
#if HAVE_AMX
    return amx_ready();
#else
    return 0;
#endif
}

/* Bytes of one panel of k weights per column in this kind (group: I4's), as packed_linear.py lays it. */
int64_t gemm_panel_bytes(int kind, int k, int group) { return panel_bytes(kind, k, group); }

/* y[m, sum of cols] = x[m, k] @ W^T (+ bias) for W in nseg segments, each writing its columns (x and y
 * float32, or bfloat16 for BF16 panels and bf16_io segments); gated: silu(gate) * up of each paired panel (one segment).
 * Safe at m = 0 (nothing to do). */
void gemm_segments(const gemm_segment *seg, int nseg, const void *x, void *y, int m, int k, int gated) {
    if (m <= 0 || k <= 0) return;
    int64_t width = 0;
    for (int i = 0; i < nseg; i++) {
        assert(gemm_kind_available(seg[i].kind) && bf16_io(&seg[i]) == bf16_io(&seg[0]));
        assert(!seg[i].q8_dot || (q8_kind(seg[i].kind) && !seg[i].bf16_io && k % 32 == 0 && seg[i].group % 32 == 0));
        width += seg[i].cols;
    }
    const int e = bf16_io(&seg[0]) ? 2 : 4;
    for (int i = 0, at = 0; i < nseg; at += seg[i].cols, i++)
        gemm_segment_run(&seg[i], x, (char *)y + (int64_t)at * e, width, m, k, gated);
}

/* Rows `rows[0 .. n)` of the segment's W (output features; not gated) as float32 into out[n, k]: the
 * weights the kernels multiply by (an embedding lookup on a quantized, tied lm_head). Every row is
 * checked against the segment's s->cols first: 0, or (nothing written) REFUSED_TOKEN. */
int gemm_panel_rows(const gemm_segment *s, const int64_t *rows, int n, int k, float *out, refusal *why) {
    assert(gemm_kind_available(s->kind) && s->kind != K_BF16);
    const int refused = check_indexes(rows, n, 0, s->cols, REFUSED_TOKEN, why);
    if (refused || n <= 0 || k <= 0) return refused;
    const int64_t pbytes = panel_bytes(s->kind, k, s->group);
#pragma omp parallel if ((int64_t)n * k >= MIN_PARALLEL)
    {
        float *w = thread_buffer(PANEL_BUFFER, (size_t)k * NR);
#pragma omp for
        for (int i = 0; i < n; i++) {
            const int64_t j = rows[i] / NR, c = rows[i] % NR;
            const uint8_t *p = (const uint8_t *)s->panels + j * pbytes;
            if (s->kind == K_F32) {
                for (int kk = 0; kk < k; kk++) out[(int64_t)i * k + kk] = ((const float *)p)[(int64_t)kk * NR + c];
                continue;
            }
            DEQUANTIZE_OF[s->kind](p, k, s->group, s->scale ? s->scale + j * NR : NULL, w, NULL, NULL);
            for (int kk = 0; kk < k; kk++) out[(int64_t)i * k + kk] = w[(int64_t)kk * NR + c];
        }
    }
    return REFUSED_NONE;
}
