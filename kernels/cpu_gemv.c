/* y = x W^T (+ bias) for a few rows of x on float32: the small-batch linears of a CPU decode step.
 *
 * At 1-8 rows a linear layer is a matrix-vector product bound by reading W once from memory.
 * oneDNN's and MKL's GEMMs stream W at about half the machine's memory speed at these sizes
 * (docs/kernels.md); this loop streams it near memory speed: each thread walks its own contiguous
 * slab of W's rows, a tile of weight rows at a time, and multiplies every row of x against the
 * tile while it sits in L1, so W is read from memory exactly once whatever the row count.
 */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else /* portable: one float per "vector"; the compiler vectorizes what it can */
#define LANES 1
typedef float vec;
static inline vec vzero(void) { return 0.0f; }
static inline vec vload(const float *p) { return *p; }
static inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
static inline float vsum(vec v) { return v; }
#endif

#define MIN_PARALLEL (1 << 16) /* weights; below this one thread is faster */

/* NW weight rows (stride k) times MR rows of x (stride k) into y (row stride ldy): NW * MR
 * accumulators in registers (at most 12 of the 16 vector registers, the rest for the loads). */
#define TILE(NW, MR)                                                                                 \
    static inline void tile_##NW##x##MR(const float *x, const float *w, int64_t k, float *y,         \
                                        int64_t ldy) {                                              \
        vec acc[NW][MR];                                                                             \
        for (int q = 0; q < NW; q++)                                                                 \
            for (int r = 0; r < MR; r++) acc[q][r] = vzero();                                        \
        int64_t i = 0;                                                                               \
        for (; i + LANES <= k; i += LANES) {                                                         \
            vec xv[MR];                                                                              \
            for (int r = 0; r < MR; r++) xv[r] = vload(x + r * k + i);                               \
            for (int q = 0; q < NW; q++) {                                                           \
                vec wv = vload(w + q * k + i);                                                       \
                for (int r = 0; r < MR; r++) acc[q][r] = vfma(wv, xv[r], acc[q][r]);                \
            }                                                                                        \
        }                                                                                            \
        for (int q = 0; q < NW; q++)                                                                 \
            for (int r = 0; r < MR; r++) {                                                           \
                float s = vsum(acc[q][r]);                                                           \
                for (int64_t t = i; t < k; t++) s += w[q * k + t] * x[r * k + t];                    \
                y[r * ldy + q] = s;                                                                  \
            }                                                                                        \
    }
TILE(8, 1)
TILE(4, 1)
TILE(4, 2)
TILE(4, 3)
TILE(1, 1)

/* Rows [m] of x against NW = 4 weight rows: tiles of 3 x-rows, then 2 or 1. */
static inline void rows_x4(const float *x, int m, const float *w, int64_t k, float *y, int64_t n) {
    int r = 0;
    for (; r + 3 <= m; r += 3) tile_4x3(x + r * k, w, k, y + r * n, n);
    if (m - r == 2) tile_4x2(x + r * k, w, k, y + r * n, n);
    if (m - r == 1) tile_4x1(x + r * k, w, k, y + r * n, n);
}

/* y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n] when not NULL); x, w, y contiguous. */
void gemv_f32(const float *x, const float *w, const float *bias, float *y, int m, int n, int k) {
    const int nw = m == 1 ? 8 : 4; /* one x row: 8 weight rows keep 8 FMA chains in flight */
    const int tiles = n / nw;
#pragma omp parallel for schedule(static) if ((int64_t)n * k >= MIN_PARALLEL)
    for (int j = 0; j < tiles; j++) {
        const float *wj = w + (int64_t)j * nw * k;
        if (m == 1)
            tile_8x1(x, wj, k, y + (int64_t)j * nw, n);
        else
            rows_x4(x, m, wj, k, y + (int64_t)j * nw, n);
    }
    for (int j = tiles * nw; j < n; j++) /* the last n % nw weight rows */
        for (int r = 0; r < m; r++) tile_1x1(x + (int64_t)r * k, w + (int64_t)j * k, k, y + (int64_t)r * n + j, n);
    if (bias)
        for (int r = 0; r < m; r++)
            for (int j = 0; j < n; j++) y[(int64_t)r * n + j] += bias[j];
}
