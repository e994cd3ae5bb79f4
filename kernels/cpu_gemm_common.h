/* What every weight kind's GEMM tiles share: the bfloat16 pair rounding (vdpbf16ps or its emulation),
 * the list of quantized kinds, the tile sizes, the gated epilogue (silu(gate) * up) and the tile stores.
 *
 * A part of cpu_gemm.c (included once, in its order; not a header of its own).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bounds.h"       /* the entry points' index checks, refusal */
#include "cpu_exp.h"          /* exp_poly, exp_poly8 */
#include "cpu_gemm_formats.h" /* formats, vh, NR */
#include "cpu_vec.h"          /* v8, load8, store8 */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* _mm_getcsr (flush_subnormals); the AVX-512 intrinsics */
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define NATIVE_BF16 1 /* vdpbf16ps; else the pair panels' products emulated (epairs_tile) */

/* Two k's 16 float32 weights (a: k, b: k + 1) as one vector of a bfloat16 pair panel: word c holds
 * (a[c], b[c]), each rounded to nearest even as torch rounds (vcvtne2ps2bf16 would flush a float32
 * subnormal, which no format's weight is: the smallest is a float16 subnormal times a small integer). */
static inline __attribute__((always_inline)) __m512bh bf16_pairs(__m512 a, __m512 b) {
    static const uint16_t order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_loadu_si512(order), (__m512i)_mm512_cvtne2ps_pbh(b, a));
}
#else
#define NATIVE_BF16 0
typedef uint32_t vhu __attribute__((vector_size(VW * 4))); /* a pair panel's words, VW at a time */

/* Each lane's bfloat16, rounded to nearest even, in the lane's top half (the bottom half is garbage), as
 * vcvtne2ps2bf16 rounds: a subnormal is flushed to a zero of its sign (checked against it lane for
 * lane); no NaN comes here (a format's weights are finite). */
static inline vhu bf16_round_bits(vh v) {
    vhu b = (vhu)v;
    const vhu subnormal = (vhu)((b & 0x7f800000u) == 0);
    b &= ~subnormal | 0x80000000u;
    return b + 0x7fffu + ((b >> 16) & 1u);
}
#endif

#if defined(PV_ZMM)
#define MR 12 /* rows per tile: 8 and 16 measured slower (docs/kernels.md) */
#else
#define MR 6
#endif
#define MC_BYTES (384 << 10)
#define MIN_PARALLEL (1 << 16) /* multiply-adds; below this one thread is faster */

/* Panels per tile at `rows` rows: enough independent FMA chains to cover the FMA latency. */
static inline int tile_panels(int rows) {
#if defined(PV_ZMM)
    return rows == 1 ? 4 : rows <= 3 ? 2 : 1;
#else
    return rows == 1 ? 2 : 1;
#endif
}

/* Rows a block when m rows are cut into the fewest blocks of at most `most` rows, of equal size but
 * the last (17 rows, at most 8: 6, 6, 5). */
static inline int equal_blocks(int m, int most) {
    const int blocks = (m + most - 1) / most;
    return (m + blocks - 1) / blocks;
}

/* exp(-g) lane by lane, as cpu_llama_ops.c's SiLU takes it. */
static inline v8 exp_neg8(v8 g) {
#if defined(__AVX2__) && defined(__FMA__)
    return (v8)exp_poly8((__m256)((v8){0} - g));
#else
    v8 e;
    for (int i = 0; i < 8; i++) e[i] = exp_poly(-g[i]);
    return e;
#endif
}

/* silu(g) * u as cpu_llama_ops.c's silu_mul computes it: g / (1 + exp(-g)) * u. */
static inline v8 silu_mul8(v8 g, v8 u) { return g / (1.0f + exp_neg8(g)) * u; }

/* A bfloat16 tile row's 16 float32 sums (lo: columns 0-7, hi: 8-15; + bias) out as 16 bfloat16, or 8 of
 * silu(gate) * up when gated. Inline: called once per accumulator, as a function it had the tiles
 * spill all of them to the stack and reload each as an argument (docs/kernels.md). */
static inline __attribute__((always_inline)) void store_tile_bf16(uint16_t *y, v8 lo, v8 hi, const float *b,
                                                                  int gated) {
    if (b) lo += load8(b), hi += load8(b + 8);
    if (!gated) {
        store8_bf16(y, lo);
        store8_bf16(y + 8, hi);
        return;
    }
    const v8 g = round8_bf16(lo), u = round8_bf16(hi); /* the GEMM's bfloat16 outputs */
    store8_bf16(y, round8_bf16(g / (1.0f + exp_neg8(g))) * u);
}

/* A tile's accumulators out: 16 columns plus the panel's bias (b, or NULL), or 8 columns of
 * silu(lo) * hi when gated. Inline, as store_tile_bf16 (above) says why. */
static inline __attribute__((always_inline)) void store_tile(float *y, v8 lo, v8 hi, const float *b, int gated) {
    if (b) lo += load8(b), hi += load8(b + 8);
    if (gated) {
        store8(y, silu_mul8(lo, hi));
        return;
    }
    store8(y, lo);
    store8(y + 8, hi);
}
#if defined(PV_ZMM)
#define STORE_TILE(y, acc, b, gated) store_tile(y, vh_lo((acc)[0]), vh_hi((acc)[0]), b, gated)
#else
#define STORE_TILE(y, acc, b, gated) store_tile(y, (acc)[0], (acc)[1], b, gated)
#endif

