/* Quantized panels (int8, int4, GGUF blocks) dequantized a panel at a time, into float32 or bfloat16
 * pairs, in the calling thread's buffers: what the wide tiles past MR rows and gemm_panel_rows read.
 *
 * A part of cpu_gemm.c (included once, in its order; not a header of its own).
 */
/* The panel at p of format f as k x 16 float32 weights into w (the values the tiles multiply by); or,
 * with pairs, as a bfloat16 pair panel there instead (K_BF16's layout: 32-bit word
 * 16 kp + c holds column c's weights at k 2 kp and 2 kp + 1, each rounded to bfloat16 as torch rounds),
 * so bfloat16 activations over a quantized weight take the products of a bfloat16 linear over the
 * dequantized weight: the same tiles over the same panel, the same bits. pf: a panel to prefetch
 * meanwhile (NULL: none), a group's record per group (int8's 64-byte line every 4 k). */
static inline __attribute__((always_inline)) void dequantize_panel(const int f, const uint8_t *p, int k, int g,
                                                                   const float *scale, float *w, uint32_t *pairs,
                                                                   const uint8_t *pf) {
    const int G = f == K_I8 ? k : fmt_group(f, g);
    int8_t buf[MAX_GROUP * NR];
    for (int g0 = 0, gi = 0; g0 < k; g0 += G, gi++) {
        const int gl = k - g0 < G ? k - g0 : G;
        vh s[PV_HALVES], m[PV_HALVES];
        const int8_t *q;
        const int direct = pairs && fmt_direct(f); /* the pairs read nibbles in registers */
        group_setup(f, direct, p, gi, g0, gl, g, scale, s, m, &q, buf);
        if (pf && f != K_I8) prefetch_group(f, pf, 1, 0, gi, g, gl);
        if (pairs) { /* gl is even: k is (bfloat16 x is read in pairs), and so is every group length */
            for (int kk = 0; kk < gl; kk += 2) {
                if (pf && f == K_I8 && kk % 4 == 0) __builtin_prefetch(pf + (int64_t)(g0 + kk) * NR, 0, 2);
#if NATIVE_BF16
                const __m512bh w = bf16_pairs((__m512)group_weights(f, direct, s, m, q, kk, 0),
                                              (__m512)group_weights(f, direct, s, m, q, kk + 1, 0));
                _mm512_storeu_si512(pairs + (int64_t)(g0 + kk) / 2 * NR, (__m512i)w);
#else
                for (int h = 0; h < PV_HALVES; h++) {
                    const vhu w = bf16_round_bits(group_weights(f, direct, s, m, q, kk, h)) >> 16 |
                                  (bf16_round_bits(group_weights(f, direct, s, m, q, kk + 1, h)) & 0xffff0000u);
                    memcpy(pairs + (int64_t)(g0 + kk) / 2 * NR + h * VW, &w, sizeof w);
                }
#endif
            }
            continue;
        }
        for (int kk = 0; kk < gl; kk++)
            for (int h = 0; h < PV_HALVES; h++)
                vh_store(w + (int64_t)(g0 + kk) * NR + h * VW, group_weights(f, 0, s, m, q, kk, h));
    }
}
#define DEQUANTIZE(F)                                                                                       \
    static void dequantize_##F(const uint8_t *p, int k, int g, const float *scale, float *w, uint32_t *pairs, \
                               const uint8_t *pf) {                                                        \
        dequantize_panel(F, p, k, g, scale, w, pairs, pf);                                                  \
    }
QUANTIZED_KINDS(DEQUANTIZE)
typedef void (*dequantize_fn)(const uint8_t *p, int k, int g, const float *scale, float *w, uint32_t *pairs,
                              const uint8_t *pf);
#define DEQUANTIZE_ENTRY(F) [F] = dequantize_##F,
static const dequantize_fn DEQUANTIZE_OF[K_COUNT] = {QUANTIZED_KINDS(DEQUANTIZE_ENTRY)};

/* The calling thread's buffers (kept for the thread's life): PANEL_BUFFER for a chunk of panels in
 * float32 or as pairs, X_BUFFER for a block of bfloat16 x widened (widen_pairs) before the threads
 * start, which they all read. */
enum { PANEL_BUFFER, X_BUFFER };

/* The calling thread's buffer `slot` of at least n floats. */
static float *thread_buffer(int slot, size_t n) {
    static __thread float *buf[2];
    static __thread size_t cap[2];
    if (n > cap[slot]) {
        free(buf[slot]);
        buf[slot] = malloc(n * sizeof(float));
        cap[slot] = buf[slot] ? n : 0;
    }
    return buf[slot];
}

