/* y = x W^T (+ bias) on float32 for any row count of x: every CPU linear of a step (decode and prefill).
 *
 * W is repacked once at load into panels of NR = 16 weight rows, k-major: panel j holds
 * W[16j .. 16j+15, kk] for kk = 0 .. k-1 as k runs of 16 floats (the last panel zero-padded). A
 * micro-kernel multiplies MR <= 6 rows of x by one panel with 6 x 2 vector accumulators in
 * registers: per kk it loads 16 weights (two 8-float vectors), broadcasts 6 inputs and issues 12
 * FMAs, so it runs at the FMA units' rate (measured: 89-91 GFLOP/s on one AMD EPYC core, 93.5 peak).
 *
 * Threads take panels two at a time (dynamically: on these shared 2-vCPU machines one core is often
 * slower than the other, and a static split left the faster one waiting); each panel is read once per
 * block of MC rows and then serves every row tile of that block from cache, while the first tile
 * prefetches the next panel. So the weight streams near memory speed at 1-16 rows (where oneDNN's
 * and MKL's GEMMs stream it at half that or less) and the FMA units stay busy at 64 rows and more.
 * MC keeps a block of x (MC x k) within about 384 KB of L2.
 *
 * A fused gate-up weight of a gated MLP is packed with its halves paired (panel j: gate rows
 * 8j..8j+7, then the up rows of the same index), so one tile holds gate and up of the same 8
 * columns and the kernel writes silu(gate) * up directly: the [m, 2I] product is never stored and
 * read back, and the SiLU costs no pass of its own (gemm_panels_silu_mul_f32). Biases are packed
 * the same way (16 per panel) and added before the activation.
 *
 * bfloat16 (CPUs with AVX512-BF16): the same panels with k in pairs (panel j, pair kp: W[16j + c,
 * 2kp + e] at 32 kp + 2c + e, one 64-byte vector), multiplied by pairs of x with vdpbf16ps into
 * float32 accumulators, 8 rows per tile; the sums are rounded once to
 * bfloat16 as a bfloat16 linear's output is, and the gated epilogue rounds gate and up first and
 * silu(gate) again, as cpu_llama_ops.c's bfloat16 silu_mul does. Half the bytes of float32 to stream
 * per step. Requires an even k (x is read in pairs).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_exp.h" /* exp_poly, exp_poly8 */
#include "cpu_vec.h" /* v8, load8, store8 */

#define NR 16
#define MR 6
#define MC_BYTES (384 << 10)
#define MIN_PARALLEL (1 << 16) /* multiply-adds; below this one thread is faster */

/* silu(g) * u as cpu_llama_ops.c's silu_mul computes it: g / (1 + exp(-g)) * u. */
static inline v8 silu_mul8(v8 g, v8 u) {
#if defined(__AVX2__) && defined(__FMA__)
    const v8 e = (v8)exp_poly8((__m256)((v8){0} - g));
#else
    v8 e;
    for (int i = 0; i < 8; i++) e[i] = exp_poly(-g[i]);
#endif
    return g / (1.0f + e) * u;
}

/* A tile's accumulators out: 16 columns plus the panel's bias (b, or NULL), or 8 columns of
 * silu(lo) * hi when gated. */
__attribute__((noinline)) /* out of the kernels' loops: their 12 accumulators keep the registers */
static void store_tile(float *y, v8 lo, v8 hi, const float *b, int gated) {
    if (b) lo += load8(b), hi += load8(b + 8);
    if (gated) {
        store8(y, silu_mul8(lo, hi));
        return;
    }
    store8(y, lo);
    store8(y + 8, hi);
}

/* The loop of a tile kernel below; LOAD_W(kk) gives w0, w1: the panel's 16 weights at input index
 * kk, in float32. */
#define KERNEL_STEP(ROWS, PREFETCH, LOAD_W)                                                         \
    for (int kk = 0; kk < k; kk++) {                                                                \
        PREFETCH;                                                                                   \
        LOAD_W(kk);                                                                                 \
        for (int r = 0; r < ROWS; r++) {                                                            \
            const float s = x[r * lda + kk];                                                        \
            const v8 a = {s, s, s, s, s, s, s, s};                                                  \
            lo[r] += a * w0;                                                                        \
            hi[r] += a * w1;                                                                        \
        }                                                                                           \
    }
/* NAME_ROWS: ROWS rows of x (row stride lda) times one panel of W weights into y (row stride ldy)
 * through store_tile; pf: the next panel, prefetched a 64-byte line at a time while this one is
 * multiplied (NULL: none). SETUP runs first (the int8 kernels load their column scales there). */
#define TILE_KERNEL(NAME, W, ROWS, SETUP, LOAD_W)                                                   \
    static inline void NAME##_##ROWS(const float *x, int64_t lda, const W *p, int k, float *y,      \
                                     int64_t ldy, const W *pf, const float *b, const float *scale, \
                                     int gated) {                                                   \
        SETUP;                                                                                      \
        v8 lo[ROWS], hi[ROWS];                                                                      \
        for (int r = 0; r < ROWS; r++) lo[r] = hi[r] = (v8){0};                                     \
        if (pf) /* kk values per line: 1 (float32), 4 (int8) */                                     \
            KERNEL_STEP(ROWS, if (kk % (64 / (NR * (int)sizeof(W))) == 0)                           \
                                  __builtin_prefetch(pf + (int64_t)kk * NR, 0, 2), LOAD_W)          \
        else                                                                                        \
            KERNEL_STEP(ROWS, (void)0, LOAD_W)                                                      \
        for (int r = 0; r < ROWS; r++) store_tile(y + r * ldy, lo[r], hi[r], b, gated);             \
    }
#define LOAD_F32(kk) const v8 w0 = load8(p + (int64_t)(kk) * NR), w1 = load8(p + (int64_t)(kk) * NR + 8)
#define KERNEL(ROWS) TILE_KERNEL(kernel, float, ROWS, (void)scale, LOAD_F32)
KERNEL(1)
KERNEL(2)
KERNEL(3)
KERNEL(4)
KERNEL(5)
KERNEL(6)

/* m rows of x times one panel: tiles of MR rows, then the rest; only the first tile prefetches. */
static void rows_by_panel(const void *xv, int m, int64_t lda, const void *pv, int k, void *yv, int64_t ldy,
                          const void *pf, const float *b, const float *scale, int gated) {
    const float *x = xv, *p = pv;
    float *y = yv;
    int r = 0;
    for (; r + MR <= m; r += MR, pf = NULL) kernel_6(x + r * lda, lda, p, k, y + r * ldy, ldy, pf, b, scale, gated);
    x += r * lda, y += r * ldy;
    switch (m - r) {
        case 5: kernel_5(x, lda, p, k, y, ldy, pf, b, scale, gated); break;
        case 4: kernel_4(x, lda, p, k, y, ldy, pf, b, scale, gated); break;
        case 3: kernel_3(x, lda, p, k, y, ldy, pf, b, scale, gated); break;
        case 2: kernel_2(x, lda, p, k, y, ldy, pf, b, scale, gated); break;
        case 1: kernel_1(x, lda, p, k, y, ldy, pf, b, scale, gated); break;
    }
}

/* int8 weights (weight-only quantization, one float32 scale per output column): the panels hold
 * int8 values, a quarter of float32's bytes to stream. Every weight is used as q * scale in float32,
 * the dequantized value, so the products are those of the float32 kernel on the dequantized weight,
 * bit for bit, at any row count: up to MR rows convert in registers, more rows dequantize the panel
 * once into a per-thread buffer and run the float32 kernel on it. */
#if defined(__AVX2__)
#include <immintrin.h>
static inline v8 load8_i8(const int8_t *p) { /* vpmovsxbd + vcvtdq2ps (GCC 12 converts lane by lane) */
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
WIDENING_LOAD8(load8_i8, int8_t)
#endif

#define LOAD_I8(kk)                                                                                 \
    const v8 w0 = load8_i8(p + (int64_t)(kk) * NR) * s0, w1 = load8_i8(p + (int64_t)(kk) * NR + 8) * s1
#define IKERNEL(ROWS) TILE_KERNEL(ikernel, int8_t, ROWS, const v8 s0 = load8(scale); const v8 s1 = load8(scale + 8), LOAD_I8)
IKERNEL(1)
IKERNEL(2)
IKERNEL(3)
IKERNEL(4)
IKERNEL(5)
IKERNEL(6)

/* One row times two neighbouring int8 panels (p, then p + k * NR) into y and y + cols, each panel's
 * sums in the same order as ikernel_1's (the same bits): at one row the chain of FMAs into each
 * accumulator, not memory, bounded the int8 kernel (16 bytes of weights per FMA latency), and two
 * panels give it four chains. */
static void ipair_1(const float *x, const int8_t *p, int k, float *y, const float *b, const float *scale,
                    int gated) {
    const int8_t *q = p + (int64_t)k * NR;
    const v8 s0 = load8(scale), s1 = load8(scale + 8), t0 = load8(scale + NR), t1 = load8(scale + NR + 8);
    v8 lo = {0}, hi = {0}, lo2 = {0}, hi2 = {0};
    for (int kk = 0; kk < k; kk++) {
        const float xs = x[kk];
        const v8 a = {xs, xs, xs, xs, xs, xs, xs, xs};
        lo += a * (load8_i8(p + (int64_t)kk * NR) * s0);
        hi += a * (load8_i8(p + (int64_t)kk * NR + 8) * s1);
        lo2 += a * (load8_i8(q + (int64_t)kk * NR) * t0);
        hi2 += a * (load8_i8(q + (int64_t)kk * NR + 8) * t1);
    }
    store_tile(y, lo, hi, b, gated);
    store_tile(y + (gated ? NR / 2 : NR), lo2, hi2, b ? b + NR : NULL, gated);
}

/* The calling thread's buffer of at least n floats (kept for the thread's life: a panel's worth). */
static float *thread_buffer(size_t n) {
    static __thread float *buf;
    static __thread size_t cap;
    if (n > cap) {
        free(buf);
        buf = malloc(n * sizeof(float));
        cap = buf ? n : 0;
    }
    return buf;
}

static void rows_by_panel_i8(const void *xv, int m, int64_t lda, const void *pv, int k, void *yv, int64_t ldy,
                             const void *pfv, const float *b, const float *scale, int gated) {
    const float *x = xv;
    const int8_t *p = pv, *pf = pfv;
    float *y = yv, *w = m > MR ? thread_buffer((size_t)k * NR) : NULL;
    if (w) { /* several tiles: dequantize once (prefetching the next panel), then the float32 kernel */
        const v8 s0 = load8(scale), s1 = load8(scale + 8);
        for (int kk = 0; kk < k; kk++) {
            if (pf && kk % 4 == 0) __builtin_prefetch(pf + (int64_t)kk * NR, 0, 2);
            LOAD_I8(kk);
            store8(w + (int64_t)kk * NR, w0);
            store8(w + (int64_t)kk * NR + 8, w1);
        }
        rows_by_panel(x, m, lda, w, k, y, ldy, NULL, b, NULL, gated);
        return;
    }
    switch (m) { /* no buffer (or none to be had): in registers, MR rows at a time */
        case 6: ikernel_6(x, lda, p, k, y, ldy, pf, b, scale, gated); break;
        case 5: ikernel_5(x, lda, p, k, y, ldy, pf, b, scale, gated); break;
        case 4: ikernel_4(x, lda, p, k, y, ldy, pf, b, scale, gated); break;
        case 3: ikernel_3(x, lda, p, k, y, ldy, pf, b, scale, gated); break;
        case 2: ikernel_2(x, lda, p, k, y, ldy, pf, b, scale, gated); break;
        case 1: ikernel_1(x, lda, p, k, y, ldy, pf, b, scale, gated); break;
        default:
            for (int r = 0; r < m; r += MR)
                rows_by_panel_i8(x + r * lda, m - r < MR ? m - r : MR, lda, pv, k, y + r * ldy, ldy, r ? NULL : pfv,
                                 b, scale, gated);
    }
}

/* One weight type's panel multiply (rows_by_panel, _i8 or _bf16), its rows per tile, the bytes of
 * one element of x and y, and of one weight; pair: one row times two full panels (NULL: none). */
typedef struct {
    void (*rows_by_panel)(const void *x, int m, int64_t lda, const void *p, int k, void *y, int64_t ldy,
                          const void *pf, const float *b, const float *scale, int gated);
    int mr, elem, w_elem;
    void (*pair)(const float *x, const int8_t *p, int k, float *y, const float *b, const float *scale, int gated);
} panel_kernel;

/* One panel j of p times `rows` rows of xb into yb (width columns a row; the last, partial panel
 * through a buffer); next: the panel to prefetch meanwhile (NULL: none). */
static void panel_product(panel_kernel kern, const char *xb, int rows, const char *p, const float *bias,
                          const float *scale, char *yb, int width, int k, int gated, int j, const char *next) {
    const int cols = gated ? NR / 2 : NR, e = kern.elem;
    const char *pj = p + (int64_t)j * k * NR * kern.w_elem;
    const float *bj = bias ? bias + j * NR : NULL, *sj = scale ? scale + j * NR : NULL;
    const int own = width - j * cols < cols ? width - j * cols : cols;
    if (own == cols) {
        kern.rows_by_panel(xb, rows, k, pj, k, yb + (int64_t)j * cols * e, width, next, bj, sj, gated);
        return;
    }
    float tile[8 * NR]; /* 8: the most rows a tile has */
    for (int r0 = 0; r0 < rows; r0 += kern.mr) {
        const int tr = rows - r0 < kern.mr ? rows - r0 : kern.mr;
        kern.rows_by_panel(xb + (int64_t)r0 * k * e, tr, k, pj, k, tile, NR, NULL, bj, sj, gated);
        for (int r = 0; r < tr; r++)
            memcpy(yb + ((int64_t)(r0 + r) * width + j * cols) * e, (char *)tile + r * NR * e, own * e);
    }
}

/* y[m, width] from x[m, k] and the panels of p: width = n (plain) or n / 2 (gated), each panel
 * writing the `cols` = NR or NR / 2 columns it owns; bias and scale (int8 weights): [panels][16]
 * float32 or NULL.
 *
 * Threads take chunks of CHUNK panels from a shared counter and claim their next chunk when they
 * start one, so the panel each one prefetches is always one it will multiply itself (with OpenMP's
 * dynamic schedule the next panel often went to the other thread, into the wrong core's cache). A
 * single row prefetches nothing: the hardware prefetcher alone streams it faster. SmolLM2's 121
 * linears, AMD EPYC (Zen 3, AVX2), 2 threads, alternating in one process: 1 row 33.0 -> 29.1 ms,
 * 16 rows 63.5 -> 56.9, 64 rows 161.5 -> 154.4 (2 rows: the same with and without the prefetch;
 * 4 and 8 rows: 14% and 11% faster with it). */
#define CHUNK 2
static void gemm_panels(panel_kernel kern, const void *x, const void *p, const float *bias, const float *scale,
                        void *y, int m, int n, int k, int gated) {
    const int panels = (n + NR - 1) / NR, width = gated ? n / 2 : n, chunks = (panels + CHUNK - 1) / CHUNK;
    const int cols = gated ? NR / 2 : NR;
    const int mr = kern.mr, e = kern.elem;
    const int64_t blocks = ((int64_t)m * k * e + MC_BYTES - 1) / MC_BYTES; /* equal blocks of x */
    const int mc = (int)((m + blocks - 1) / blocks + mr - 1) / mr * mr;
    const int64_t panel_bytes = (int64_t)k * NR * kern.w_elem;
    for (int m0 = 0; m0 < m; m0 += mc) {
        const int rows = m - m0 < mc ? m - m0 : mc;
        const char *xb = (const char *)x + (int64_t)m0 * k * e;
        char *yb = (char *)y + (int64_t)m0 * width * e;
        int counter = 0;
#pragma omp parallel if ((int64_t)rows * n * k >= MIN_PARALLEL)
        for (int c = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED); c < chunks;) {
            const int after = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED); /* this thread's next chunk */
            const int j1 = (c + 1) * CHUNK < panels ? (c + 1) * CHUNK : panels;
            for (int j = c * CHUNK; j < j1; j++) {
                if (rows == 1 && kern.pair && j + 1 < j1 && (j + 2) * cols <= width) { /* two full panels */
                    kern.pair((const float *)xb, (const int8_t *)p + j * panel_bytes, k, (float *)yb + j * cols,
                              bias ? bias + j * NR : NULL, scale + j * NR, gated);
                    j++;
                    continue;
                }
                const int nj = j + 1 < j1 ? j + 1 : after < chunks ? after * CHUNK : -1;
                const char *next = rows > 1 && nj >= 0 ? (const char *)p + nj * panel_bytes : NULL;
                panel_product(kern, xb, rows, p, bias, scale, yb, width, k, gated, j, next);
            }
            c = after;
        }
    }
}

static const panel_kernel F32 = {rows_by_panel, MR, sizeof(float), sizeof(float), NULL};
static const panel_kernel I8 = {rows_by_panel_i8, MR, sizeof(float), sizeof(int8_t), ipair_1};

/* y[m, n] = x[m, k] @ W^T (+ bias); x and y contiguous, W in panels, bias packed per panel or NULL. */
void gemm_panels_f32(const float *x, const float *p, const float *bias, float *y, int m, int n, int k) {
    gemm_panels(F32, x, p, bias, NULL, y, m, n, k, 0);
}

/* y[m, n / 2] = silu(x Wg^T + bg) * (x Wu^T + bu) for a fused gate-up W [n = 2 I, k] in paired panels. */
void gemm_panels_silu_mul_f32(const float *x, const float *p, const float *bias, float *y, int m, int n,
                              int k) {
    gemm_panels(F32, x, p, bias, NULL, y, m, n, k, 1);
}

/* The same two with int8 panels and their per-column scales (packed per panel like a bias). */
void gemm_panels_i8(const float *x, const int8_t *p, const float *scale, const float *bias, float *y, int m,
                    int n, int k) {
    gemm_panels(I8, x, p, bias, scale, y, m, n, k, 0);
}

void gemm_panels_silu_mul_i8(const float *x, const int8_t *p, const float *scale, const float *bias, float *y,
                             int m, int n, int k) {
    gemm_panels(I8, x, p, bias, scale, y, m, n, k, 1);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define MRB 8 /* rows per bfloat16 tile: 12, 16 and 24 ran 10-45% slower at 64-2048 rows */

/* A tile row's 16 float32 sums (+ bias) out as 16 bfloat16, or 8 of silu(gate) * up when gated. */
__attribute__((noinline)) static void store_tile_bf16(uint16_t *y, __m512 acc, const float *b, int gated) {
    if (b) acc = _mm512_add_ps(acc, _mm512_loadu_ps(b));
    v8 lo = (v8)_mm512_castps512_ps256(acc), hi = (v8)_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    if (!gated) {
        store8_bf16(y, lo);
        store8_bf16(y + 8, hi);
        return;
    }
    const v8 g = round8_bf16(lo), u = round8_bf16(hi); /* the GEMM's bfloat16 outputs */
    const v8 e = (v8)exp_poly8((__m256)((v8){0} - g));
    store8_bf16(y, round8_bf16(g / (1.0f + e)) * u);
}

#define BKERNEL_STEP(ROWS, PREFETCH)                                                               \
    for (int kp = 0; kp < k / 2; kp++) {                                                           \
        PREFETCH;                                                                                  \
        const __m512bh w = (__m512bh)_mm512_loadu_si512(p + (int64_t)kp * 2 * NR);                  \
        for (int r = 0; r < ROWS; r++) {                                                           \
            int32_t pair;                                                                          \
            memcpy(&pair, x + r * lda + 2 * kp, sizeof pair);                                      \
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), w);               \
        }                                                                                          \
    }
#define BKERNEL(ROWS)                                                                              \
    static inline void bkernel_##ROWS(const uint16_t *x, int64_t lda, const uint16_t *p, int k,     \
                                      uint16_t *y, int64_t ldy, const uint16_t *pf, const float *b, \
                                      int gated) {                                                 \
        __m512 acc[ROWS];                                                                          \
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();                               \
        if (pf)                                                                                    \
            BKERNEL_STEP(ROWS, __builtin_prefetch(pf + (int64_t)kp * 2 * NR, 0, 2))                 \
        else                                                                                       \
            BKERNEL_STEP(ROWS, (void)0)                                                            \
        for (int r = 0; r < ROWS; r++) store_tile_bf16(y + r * ldy, acc[r], b, gated);             \
    }
BKERNEL(1)
BKERNEL(2)
BKERNEL(3)
BKERNEL(4)
BKERNEL(5)
BKERNEL(6)
BKERNEL(7)
BKERNEL(8)

static void rows_by_panel_bf16(const void *xv, int m, int64_t lda, const void *pv, int k, void *yv,
                               int64_t ldy, const void *pf, const float *b, const float *scale, int gated) {
    static void (*const tail[MRB])(const uint16_t *, int64_t, const uint16_t *, int, uint16_t *, int64_t,
                                   const uint16_t *, const float *, int) = {
        NULL, bkernel_1, bkernel_2, bkernel_3, bkernel_4, bkernel_5, bkernel_6, bkernel_7};
    const uint16_t *x = xv, *p = pv;
    uint16_t *y = yv;
    int r = 0;
    (void)scale;
    for (; r + MRB <= m; r += MRB, pf = NULL) bkernel_8(x + r * lda, lda, p, k, y + r * ldy, ldy, pf, b, gated);
    if (m > r) tail[m - r](x + r * lda, lda, p, k, y + r * ldy, ldy, pf, b, gated);
}

static const panel_kernel BF16 = {rows_by_panel_bf16, MRB, sizeof(uint16_t), sizeof(uint16_t), NULL};

/* y[m, n] = x[m, k] @ W^T (+ bias) in bfloat16 (float32 sums); W in pair panels, bias float32 per panel. */
void gemm_panels_bf16(const uint16_t *x, const uint16_t *p, const float *bias, uint16_t *y, int m, int n,
                            int k) {
    gemm_panels(BF16, x, p, bias, NULL, y, m, n, k, 0);
}

/* y[m, n / 2] = silu(x Wg^T + bg) * (x Wu^T + bu) in bfloat16, W a fused gate-up in paired pair panels. */
void gemm_panels_silu_mul_bf16(const uint16_t *x, const uint16_t *p, const float *bias, uint16_t *y, int m,
                               int n, int k) {
    gemm_panels(BF16, x, p, bias, NULL, y, m, n, k, 1);
}
#endif
