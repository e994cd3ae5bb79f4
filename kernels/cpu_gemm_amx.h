/* bfloat16 pair panels on AMX tiles (TDPBF16PS) from AMX_MIN_ROWS rows, where the CPU has them and
 * Linux lets the process use them; pair_panels picks AMX or the vdpbf16ps tiles.
 *
 * A part of cpu_gemm.c (included once, in its order; not a header of its own).
 */

#if NATIVE_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 8 /* fewer rows: vdpbf16ps tiles (as fast or faster there) */
#endif


typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* m rows of bfloat16 x (row stride k, k a multiple of 32) times np pair panels through AMX: a pair
 * panel's 16 pairs of k (64 bytes each) are exactly a TDPBF16PS B tile, so the panels need no other
 * layout. Blocks of up to 32 rows by 2 panels: C tiles 0-3 (rows 0-15 / 16-31 by panel 0 / 1), x
 * tiles 4-5, panel tiles 6-7; the float32 sums then leave through store_tile_bf16 as the vdpbf16ps
 * tiles' do. The first block of rows prefetches the next pair of panels (after the last pair: pf),
 * slice by slice beside its own loads: the tile loads alone left the multiplies waiting on memory. */
static void rows_by_panels_amx(const uint16_t *x, int m, int k, const uint8_t *p, int64_t pbytes, int np,
                               uint16_t *y, int64_t ldy, int cols, const float *b, int gated, const uint8_t *pf) {
    float c[4][16 * 16] __attribute__((aligned(64)));
    for (int r0 = 0; r0 < m; r0 += 32) {
        const int rows = m - r0 < 32 ? m - r0 : 32, ra = rows < 16 ? rows : 16, rb = rows - ra;
        tile_config cfg = {.palette = 1};
        for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
        cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)ra;
        cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)(rb ? rb : 1);
        cfg.rows[6] = cfg.rows[7] = 16;
        _tile_loadconfig(&cfg);
        const uint16_t *xa = x + (int64_t)r0 * k, *xb = xa + (int64_t)16 * k;
        for (int t = 0; t < np; t += 2) {
            const int two = t + 1 < np;
            const uint8_t *p0 = p + t * pbytes, *p1 = p0 + pbytes;
            const uint8_t *n0 = r0 ? NULL : t + 2 < np ? p0 + 2 * pbytes : pf; /* the pair to prefetch */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int k0 = 0; k0 < k; k0 += 32) {
                if (n0)
                    for (int l = 0; l < 1024; l += 64) {
                        __builtin_prefetch(n0 + (int64_t)k0 * 32 + l, 0, 3);
                        __builtin_prefetch(n0 + pbytes + (int64_t)k0 * 32 + l, 0, 3);
                    }
                _tile_loadd(4, xa + k0, k * 2);
                _tile_loadd(6, p0 + (int64_t)k0 * 32, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (rb) {
                    _tile_loadd(5, xb + k0, k * 2);
                    _tile_dpbf16ps(2, 5, 6);
                }
                if (two) {
                    _tile_loadd(7, p1 + (int64_t)k0 * 32, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    if (rb) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
            for (int u = 0; u <= two; u++) {
                const float *bu = b ? b + (t + u) * NR : NULL;
                for (int r = 0; r < rows; r++)
                    STORE_ZMM_BF16(y + (int64_t)(r0 + r) * ldy + (t + u) * cols,
                                    _mm512_load_ps(c[(r >= 16) * 2 + u] + (r & 15) * 16), bu, gated);
            }
        }
    }
    _tile_release();
}

/* 1 where TDPBF16PS gives the vdpbf16ps tiles' bits, row for row. A row's bits must not depend on how
 * many rows share the call (the reproducibility contract), and not every CPU's tiles add as the
 * instruction does: some sum a tile's products wider before rounding. So the tiles serve only once
 * they have given the same bits on inputs that tell the two apart, in every other row: in column 0 a
 * product of 1, products below half its ulp (each rounded away one by one, kept by a wider sum), then
 * -1; in column 1 the pairs (0, 1), (-1, 2^-26) (the odd product first, as vdpbf16ps adds them: 0;
 * the even first: 2^-26); the other rows and columns pseudo-random. */
static int amx_agrees(void) {
    enum { M = 16, K = 64, NP = 2 };
    uint16_t x[M * K], p[NP * K * NR] __attribute__((aligned(64))), ya[M * NP * NR], yb[M * NP * NR];
    uint32_t seed = 12345;
    for (int i = 0; i < M * K; i++) { /* x: [M, K] bfloat16, in [-2, 2) */
        seed = seed * 1664525u + 1013904223u;
        x[i] = (uint16_t)(0x3f80 | (seed >> 25)) ^ (uint16_t)((seed >> 8) & 0x8000) ^ (uint16_t)((seed >> 9) & 0x80);
    }
    for (int i = 0; i < NP * K * NR; i++) { /* p: NP pair panels of [K / 2, NR, 2] bfloat16 */
        seed = seed * 1664525u + 1013904223u;
        p[i] = (uint16_t)(0x3f80 | (seed >> 25)) ^ (uint16_t)((seed >> 8) & 0x8000);
    }
    for (int r = 0; r < M; r += 2) /* x's even rows all 1 */
        for (int kk = 0; kk < K; kk++) x[r * K + kk] = 0x3f80;
    for (int kk = 0; kk < K; kk++) { /* bfloat16 1 0x3f80, -1 0xbf80, 2^-26 0x3280 */
        p[(kk / 2) * 2 * NR + (kk & 1)] = kk == 0 ? 0x3f80 : kk == K - 1 ? 0xbf80 : 0x3280;
        p[(kk / 2) * 2 * NR + 2 + (kk & 1)] = kk == 1 ? 0x3f80 : kk == 2 ? 0xbf80 : kk == 3 ? 0x3280 : 0;
    }
    rows_by_panels_amx(x, M, K, (const uint8_t *)p, (int64_t)K * NR * 2, NP, ya, NP * NR, NR, NULL, 0, NULL);
    rows_by_panels_bf16(x, M, K, p, (int64_t)K * NR, NP, yb, NP * NR, NR, NULL, NULL, 0, 0);
    return memcmp(ya, yb, sizeof ya) == 0;
}

/* 1 once Linux lets this process use the AMX tile registers (ARCH_REQ_XCOMP_PERM for XTILEDATA) and
 * the tiles agree with the vdpbf16ps tiles here (amx_agrees). */
static int amx_ready(void) {
    static int state; /* 0 unknown, 1 serving, -1 refused or disagreeing */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0 && amx_agrees() ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}
#else
#define HAVE_AMX 0
#endif

#if NATIVE_BF16
/* m rows of bfloat16 x times np pair panels at p (pbytes apart) into y: AMX tiles where they serve,
 * else vdpbf16ps tiles; pf: the panel after them, prefetched meanwhile (NULL: none). */
static void pair_panels(const char *x, int m, int k, const uint8_t *p, int64_t pbytes, int np, char *y, int64_t ldy,
                        int cols, const float *b, int gated, const uint8_t *pf) {
#if HAVE_AMX
    if (m >= AMX_MIN_ROWS && k % 32 == 0 && amx_ready()) {
        rows_by_panels_amx((const uint16_t *)x, m, k, p, pbytes, np, (uint16_t *)y, ldy, cols, b, gated, pf);
        return;
    }
#endif
    rows_by_panels_bf16((const uint16_t *)x, m, k, (const uint16_t *)p, pbytes / 2, np, (uint16_t *)y, ldy, cols,
                        (const uint16_t *)pf, b, gated, 0);
}
#endif

