/* llama.cpp's numerics for Q4_0, Q4_1 and Q8_0 panels, and the same integer math for int8 and int4 ones
 * (a segment's q8_dot, `--matmul-numerics llama.cpp`):
 * each row of x quantized per block of 32 values to int8 with one scale (as llama.cpp's
 * quantize_row_q8_0 and quantize_row_q8_1: d = amax / 127 stored as float16, q = roundf(x / d) with
 * x / d taken as x * (1 / d); for Q4_1 also s = float16(sum(q) * d), d the float32 scale before its
 * rounding), integer dot products of those values with the weights' stored integers, block by block,
 * and the block sums added in float32 in block order from 0, per row and column:
 * acc = fma(d_w * d_x, (float)isum, acc), then for Q4_1 acc = fma(m_w, s_x, acc) (llama.cpp's
 * q4_1 x q8_1 dot: the block min times the activation block's sum). int8 and int4 (I8, I4, I4Z) have
 * float32 column scales over a group of k (I8: all of k; I4: 32 or 128) instead: their integers
 * (int4's minus its zero, 8 or z) make the block sums as above, added per group with the activations'
 * scale alone, t = fma(d_x, (float)isum, t) from 0 in block order, and the column's scale applied
 * after each group: acc = fma(s_w, t, acc) in group order from 0. The integer sums are exact and the
 * float steps the same IEEE operations in every build (vector lanes do what the scalar loop does,
 * column by column), so every build, ISA, tile and row count gives the same bits, and a row's outputs
 * depend on that row alone.
 *
 * Layout (cpu_gemm_formats.h): a group record's values are k-major, 16 columns per k (Q4_0 and Q4_1 as
 * nibble chunks of 4 k). The vector path turns each 4-k chunk into two vectors of 8 columns x 4 bytes
 * (a column's 4 values in one 32-bit lane, in the order k0, k2, k1, k3), the layout of vpdpbusd and of
 * vpmaddubsw + vpmaddwd; x's values are stored in that order too (Q8_SLOT), so a chunk's 4 values of a
 * row are one broadcast. Unsigned by signed: the nibbles as they are (Q4_0's and I4's 8, I4Z's z
 * subtracted from the sum: isum - 8 * sum(x)); Q8_0's and I8's signed values through vpsignb (AVX2)
 * or plus 128 (VNNI: isum - 128 * sum(x)). I8's values are Q8_0's without the records' heads, the
 * I4 kinds' nibbles Q4_0's.
 * With AVX-512 VNNI both vectors are one 512-bit operand (one vpdpbusd per row and chunk).
 *
 * Tiles: Q8_ROWS rows per pass over a panel (each chunk rearranged once for all of them). Past Q8_ROWS
 * rows a thread rearranges each panel once into its buffer, and every pass over the panel reads the
 * vectors from there.
 *
 * A part of cpu_gemm.c (included once, in its order; not a header of its own).
 */
#include <math.h>

#define Q8_BLOCK 32 /* values per activation block: the Q4_0 / Q4_1 / Q8_0 group, int4's a multiple */
#define Q8_MC 256   /* rows per block of x over which the panels are shared out */

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define Q8_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define Q8_VNNI 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q8_VECTOR 1
#else
#define Q8_VECTOR 0
#endif
#if Q8_VECTOR && Q8_VNNI && defined(__AVX512VNNI__) && defined(__AVX512F__)
#define Q8_ZMM 1
#else
#define Q8_ZMM 0
#endif
/* rows per pass: their integer sums stay in registers (32 vector registers with AVX-512, 16 without) */
#if defined(__AVX512F__)
#define Q8_ROWS 8
#else
#define Q8_ROWS 4
#endif

/* Where the value at k index j of a block goes in x's quantized block: chunk j / 4, order k0, k2, k1, k3. */
static inline int q8_slot(int j) { return (j & ~3) | (j & 1) << 1 | (j & 3) >> 1; }

#if Q8_VECTOR
/* roundf (half away from zero) per lane: trunc(v), plus one away from zero where |v - trunc(v)| >= 0.5
 * (v - trunc(v) is exact). */
static inline __attribute__((always_inline)) __m256 q8_round(__m256 v) {
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC), neg = _mm256_set1_ps(-0.0f);
    const __m256 half = _mm256_cmp_ps(_mm256_andnot_ps(neg, _mm256_sub_ps(v, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    return _mm256_add_ps(t, _mm256_and_ps(half, _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(v, neg))));
}
#endif

/* Rows x[m, k] (k a multiple of 32) quantized per block: q[m, k] int8 (Q8_SLOT order), d[m, k / 32] the
 * float16 scale widened, sum[m, k / 32] the block's sum of q, xs[m, k / 32] float16(sum * d) widened.
 * The vector path computes the same values (max, products and roundf are exact per lane). */
static void q8_quantize_rows(const float *x, int m, int k, int8_t *q, float *d, int32_t *sum, float *xs) {
    const int nb = k / Q8_BLOCK;
    for (int64_t b = 0; b < (int64_t)m * nb; b++) {
        const float *v = x + b * Q8_BLOCK;
#if Q8_VECTOR
        const __m256 neg = _mm256_set1_ps(-0.0f);
        __m256 xv[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            xv[i] = _mm256_loadu_ps(v + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(neg, xv[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
        float amax = 0.0f;
        for (int j = 0; j < Q8_BLOCK; j++) amax = fmaxf(amax, fabsf(v[j]));
#endif
        const float s = amax / 127.0f, inv = s != 0.0f ? 1.0f / s : 0.0f;
        d[b] = (float)(_Float16)s; /* rounded to nearest even, as llama.cpp stores it */
        int32_t total = 0;
#if Q8_VECTOR
        __m256i qi[4];
        for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(q8_round(_mm256_mul_ps(xv[i], _mm256_set1_ps(inv))));
        const __m256i all = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(all), _mm256_extracti128_si256(all, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
        total = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1)));
        /* int8 in lanes j 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31; then j order, then slots */
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        const __m256i slots = _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15, 0, 2, 1, 3, 4, 6,
                                               5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
        _mm256_storeu_si256((__m256i *)(q + b * Q8_BLOCK), _mm256_shuffle_epi8(ordered, slots));
#else
        for (int j = 0; j < Q8_BLOCK; j++) {
            const int8_t qj = (int8_t)roundf(v[j] * inv);
            q[b * Q8_BLOCK + q8_slot(j)] = qj;
            total += qj;
        }
#endif
        sum[b] = total;
        xs[b] = (float)(_Float16)((float)total * s);
    }
}

/* Signed int8 values (Q8_0, I8), not nibbles. */
static inline __attribute__((always_inline)) int q8_signed(int f) { return f == K_Q8_0 || f == K_I8; }

/* float32 column scales over groups of k, applied after each group (I8, I4, I4Z), not a GGUF block's. */
static inline __attribute__((always_inline)) int q8_ours(int f) { return f == K_I8 || f == K_I4 || f == K_I4Z; }

/* The kinds this file multiplies. */
static inline int q8_kind(int f) { return f == K_Q4_0 || f == K_Q4_1 || q8_signed(f) || q8_ours(f); }

/* Blocks of 32 k per group of the panel (I8: the nb of all of k). */
static inline __attribute__((always_inline)) int q8_group_blocks(int f, int g, int nb) {
    return f == K_I8 ? nb : fmt_group(f, g) / Q8_BLOCK;
}

/* A panel's blocks walked in order (no division per block): head, the scale fields of the group record
 * holding the block (I8: none, the panel); in, the block's index in its group of per blocks. */
typedef struct {
    const uint8_t *head;
    int in, per, last; /* last: the panel's last block */
    int64_t rec;       /* bytes of a full group record */
} q8_walk;

static inline __attribute__((always_inline)) q8_walk q8_start(int f, const uint8_t *p, int g, int nb) {
    return (q8_walk){p, 0, q8_group_blocks(f, g, nb), nb - 1, f == K_I8 ? 0 : fmt_record_bytes(f, fmt_group(f, g))};
}

/* The block's values (32 k x 16 columns: 512 bytes of int8 or 256 of nibbles). */
static inline __attribute__((always_inline)) const uint8_t *q8_values(int f, const q8_walk *w) {
    return w->head + fmt_head_bytes(f) + (int64_t)w->in * (q8_signed(f) ? 512 : 256);
}

/* 1 where block b ends its group (int4's last group may be short). */
static inline __attribute__((always_inline)) int q8_ends(const q8_walk *w, int b) {
    return w->in == w->per - 1 || b == w->last;
}

/* On to the next block (past a group's last: the next group record). */
static inline __attribute__((always_inline)) void q8_step(q8_walk *w) {
    if (++w->in == w->per) w->head += w->rec, w->in = 0;
}

/* The integer each weight of a block's values holds at k index kk, column c (nibbles: 0..15). */
static inline int q8_weight(int f, const uint8_t *v, int kk, int c) {
    if (q8_signed(f)) return ((const int8_t *)v)[kk * NR + c];
    const uint8_t b = v[32 * (kk >> 2) + 16 * (kk & 1) + c];
    return kk & 2 ? b >> 4 : b & 15;
}

/* The stored integer subtracted from column c's weights (head: its group record's): Q4_0's and I4's 8,
 * I4Z's z. */
static inline int q8_zero(int f, const uint8_t *head, int c) {
    return f == K_Q4_0 || f == K_I4 ? 8 : f == K_I4Z ? head[64 + c] : 0;
}

#if Q8_VECTOR
/* Chunk ch (k 4 ch .. 4 ch + 3) of a record's values as two vectors of 8 columns x 4 bytes: w[0] columns
 * 0-3 and 8-11, w[1] columns 4-7 and 12-15, each column's bytes k0, k2, k1, k3; Q8_0's signed, plus 128
 * with VNNI. */
static inline __attribute__((always_inline)) void q8_chunk(int f, const uint8_t *v, int ch, __m256i *w) {
    __m256i lo, hi; /* lane 0: k0 (k2), lane 1: k1 (k3), 16 columns each */
    if (!q8_signed(f)) {
        const __m256i nib = _mm256_loadu_si256((const __m256i *)(v + 32 * ch)), mask = _mm256_set1_epi8(15);
        lo = _mm256_and_si256(nib, mask);
        hi = _mm256_and_si256(_mm256_srli_epi16(nib, 4), mask);
    } else {
        lo = _mm256_loadu_si256((const __m256i *)(v + 64 * ch));
        hi = _mm256_loadu_si256((const __m256i *)(v + 64 * ch + 32));
        if (Q8_VNNI) {
            const __m256i flip = _mm256_set1_epi8((char)0x80);
            lo = _mm256_xor_si256(lo, flip), hi = _mm256_xor_si256(hi, flip);
        }
    }
    lo = _mm256_permute4x64_epi64(lo, 0xD8); /* lane 0: k0 of columns 0-7, k1 of 0-7; lane 1: of 8-15 */
    hi = _mm256_permute4x64_epi64(hi, 0xD8);
    const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi); /* (k0, k2), (k1, k3) */
    w[0] = _mm256_unpacklo_epi16(a, b);
    w[1] = _mm256_unpackhi_epi16(a, b);
}

/* acc += per 32-bit lane, the sum of its 4 byte products of w and x (w unsigned but Q8_0's and I8's
 * without VNNI, signed then; x signed). */
static inline __attribute__((always_inline)) __m256i q8_dot4(int f, __m256i acc, __m256i w, __m256i x) {
#if Q8_VNNI
    (void)f;
    return DPBUSD(acc, w, x);
#else
    const __m256i pairs = q8_signed(f) ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                                      : _mm256_maddubs_epi16(w, x);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* The offset every stored value carries in the vector path's products (subtracted as off * sum(x)); I4Z's:
 * its zeros, per column. */
static inline int q8_offset(int f) { return f == K_Q4_0 || f == K_I4 ? 8 : q8_signed(f) && Q8_VNNI ? 128 : 0; }

/* A panel's values (nb blocks) rearranged as q8_chunk makes them, into u: chunk c's w[0], w[1] at 64 c. */
static void q8_unpack_panel(int f, const uint8_t *p, int nb, int g, uint8_t *u) {
    q8_walk at = q8_start(f, p, g, nb);
    for (int b = 0; b < nb; b++, q8_step(&at))
        for (int ch = 0; ch < Q8_BLOCK / 4; ch++) {
            __m256i w[2];
            q8_chunk(f, q8_values(f, &at), ch, w);
            uint8_t *o = u + ((int64_t)b * Q8_BLOCK / 4 + ch) * 64;
            _mm256_storeu_si256((__m256i *)o, w[0]);
            _mm256_storeu_si256((__m256i *)(o + 32), w[1]);
        }
}

/* One row's block: its integer sums s0 (columns 0-3, 8-11) and s1 (4-7, 12-15) added to acc[16] as the
 * header comment says (GGUF kinds); dw, mw: the block's weight scales and mins of columns 0-7 and 8-15. */
static inline __attribute__((always_inline)) void q8_block_sums(int f, __m256i s0, __m256i s1, const __m256 *dw,
                                                                const __m256 *mw, int32_t xsum, float dx, float sx,
                                                                float *acc) {
    const __m256i off = _mm256_set1_epi32(q8_offset(f) * xsum);
    const __m256i i0 = _mm256_sub_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), off); /* columns 0-7 */
    const __m256i i1 = _mm256_sub_epi32(_mm256_permute2x128_si256(s0, s1, 0x31), off); /* 8-15 */
    const __m256 vdx = _mm256_set1_ps(dx);
    __m256 lo = _mm256_fmadd_ps(_mm256_mul_ps(dw[0], vdx), _mm256_cvtepi32_ps(i0), _mm256_loadu_ps(acc));
    __m256 hi = _mm256_fmadd_ps(_mm256_mul_ps(dw[1], vdx), _mm256_cvtepi32_ps(i1), _mm256_loadu_ps(acc + 8));
    if (f == K_Q4_1) {
        lo = _mm256_fmadd_ps(mw[0], _mm256_set1_ps(sx), lo);
        hi = _mm256_fmadd_ps(mw[1], _mm256_set1_ps(sx), hi);
    }
    _mm256_storeu_ps(acc, lo);
    _mm256_storeu_ps(acc + 8, hi);
}
#endif

/* Rows `rows` (at most Q8_ROWS) of quantized x (q, d, sum, xs of their first row; nb blocks a row) times
 * one panel at p (group g; scale: I8's column scales of the panel) into acc[rows][16] float32 sums (before
 * bias); pre: its chunks read from u (q8_unpack_panel), not rearranged here. */
static inline __attribute__((always_inline)) void q8_panel(int f, int pre, const uint8_t *p, const uint8_t *u,
                                                           int nb, int g, const float *scale, const int8_t *q,
                                                           const float *d, const int32_t *sum, const float *xs,
                                                           int rows, float acc[Q8_ROWS][NR]) {
    const int64_t k = (int64_t)nb * Q8_BLOCK;
    q8_walk at = q8_start(f, p, g, nb);
#if Q8_ZMM
    /* lanes in the sums' column order, columns 0-3, 8-11, 4-7, 12-15 (an involution), until the end */
    const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    __m512 sums[Q8_ROWS], t[Q8_ROWS]; /* t: our kinds' group sums */
    for (int r = 0; r < rows; r++) sums[r] = t[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, q8_step(&at)) {
        const uint8_t *head = at.head, *v = q8_values(f, &at);
        const uint8_t *ub = pre ? u + (int64_t)b * Q8_BLOCK / 4 * 64 : NULL;
        __m512i s[Q8_ROWS];
        for (int r = 0; r < rows; r++) s[r] = _mm512_setzero_si512();
        for (int ch = 0; ch < Q8_BLOCK / 4; ch++) {
            __m512i w;
            if (pre) {
                w = _mm512_loadu_si512(ub + 64 * ch);
            } else {
                __m256i h[2];
                q8_chunk(f, v, ch, h);
                w = _mm512_inserti64x4(_mm512_castsi256_si512(h[0]), h[1], 1);
            }
            for (int r = 0; r < rows; r++) {
                int32_t four;
                memcpy(&four, q + r * k + (int64_t)b * Q8_BLOCK + 4 * ch, sizeof four);
                s[r] = _mm512_dpbusd_epi32(s[r], w, _mm512_set1_epi32(four));
            }
        }
        if (q8_ours(f)) {
            const int last = q8_ends(&at, b);
            const __m512i z = f == K_I4Z ? _mm512_permutexvar_epi32(order, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(head + 64))))
                                         : _mm512_setzero_si512();
            const __m512 sw = last ? _mm512_permutexvar_ps(order, _mm512_loadu_ps(f == K_I8 ? scale : (const float *)head))
                                   : _mm512_setzero_ps();
            for (int r = 0; r < rows; r++) {
                const __m512i xsum = _mm512_set1_epi32(sum[r * nb + b]);
                const __m512i i = f == K_I4Z ? _mm512_sub_epi32(s[r], _mm512_mullo_epi32(z, xsum))
                                             : _mm512_sub_epi32(s[r], _mm512_set1_epi32(q8_offset(f) * sum[r * nb + b]));
                t[r] = _mm512_fmadd_ps(_mm512_set1_ps(d[r * nb + b]), _mm512_cvtepi32_ps(i), t[r]);
                if (last) sums[r] = _mm512_fmadd_ps(sw, t[r], sums[r]), t[r] = _mm512_setzero_ps();
            }
            continue;
        }
        const __m512 dw = _mm512_permutexvar_ps(order, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)head)));
        const __m512 mw = f == K_Q4_1 ? _mm512_permutexvar_ps(order, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(head + 32))))
                                      : dw;
        for (int r = 0; r < rows; r++) {
            const __m512i i = _mm512_sub_epi32(s[r], _mm512_set1_epi32(q8_offset(f) * sum[r * nb + b]));
            sums[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(d[r * nb + b])), _mm512_cvtepi32_ps(i), sums[r]);
            if (f == K_Q4_1) sums[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r * nb + b]), sums[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(acc[r], _mm512_permutexvar_ps(order, sums[r]));
#elif Q8_VECTOR
    /* our kinds: t the group sums, acc the sums, both in s0 / s1's column order (0-3, 8-11 | 4-7, 12-15)
     * until the end; the others' block sums go to acc in column order (q8_block_sums) */
    float t[Q8_ROWS][NR];
    for (int r = 0; r < rows; r++) memset(acc[r], 0, sizeof acc[r]), memset(t[r], 0, sizeof t[r]);
    for (int b = 0; b < nb; b++, q8_step(&at)) {
        const uint8_t *head = at.head, *v = q8_values(f, &at);
        const uint8_t *ub = pre ? u + (int64_t)b * Q8_BLOCK / 4 * 64 : NULL;
        __m256i s0[Q8_ROWS], s1[Q8_ROWS];
        for (int r = 0; r < rows; r++) s0[r] = s1[r] = _mm256_setzero_si256();
        for (int ch = 0; ch < Q8_BLOCK / 4; ch++) {
            __m256i w[2];
            if (pre) {
                w[0] = _mm256_loadu_si256((const __m256i *)(ub + 64 * ch));
                w[1] = _mm256_loadu_si256((const __m256i *)(ub + 64 * ch + 32));
            } else {
                q8_chunk(f, v, ch, w);
            }
            for (int r = 0; r < rows; r++) {
                int32_t four;
                memcpy(&four, q + r * k + (int64_t)b * Q8_BLOCK + 4 * ch, sizeof four);
                const __m256i xb = _mm256_set1_epi32(four);
                s0[r] = q8_dot4(f, s0[r], w[0], xb);
                s1[r] = q8_dot4(f, s1[r], w[1], xb);
            }
        }
        if (q8_ours(f)) {
            __m256i z[2]; /* I4Z's zeros in s0 / s1's column order */
            if (f == K_I4Z) {
                int32_t zc[4]; /* the zeros of columns 0-3, 4-7, 8-11, 12-15 */
                memcpy(zc, head + 64, sizeof zc);
                z[0] = _mm256_cvtepu8_epi32(_mm_setr_epi32(zc[0], zc[2], 0, 0));
                z[1] = _mm256_cvtepu8_epi32(_mm_setr_epi32(zc[1], zc[3], 0, 0));
            }
            for (int r = 0; r < rows; r++) {
                const int32_t xsum = sum[r * nb + b];
                const __m256 vdx = _mm256_set1_ps(d[r * nb + b]);
                __m256i off[2] = {_mm256_set1_epi32(q8_offset(f) * xsum), _mm256_set1_epi32(q8_offset(f) * xsum)};
                if (f == K_I4Z)
                    for (int h = 0; h < 2; h++) off[h] = _mm256_mullo_epi32(z[h], _mm256_set1_epi32(xsum));
                const __m256i i0 = _mm256_sub_epi32(s0[r], off[0]), i1 = _mm256_sub_epi32(s1[r], off[1]);
                _mm256_storeu_ps(t[r], _mm256_fmadd_ps(vdx, _mm256_cvtepi32_ps(i0), _mm256_loadu_ps(t[r])));
                _mm256_storeu_ps(t[r] + 8, _mm256_fmadd_ps(vdx, _mm256_cvtepi32_ps(i1), _mm256_loadu_ps(t[r] + 8)));
            }
            if (q8_ends(&at, b)) {
                const float *sw = f == K_I8 ? scale : (const float *)head;
                const __m256 sw0 = _mm256_setr_m128(_mm_loadu_ps(sw), _mm_loadu_ps(sw + 8));
                const __m256 sw1 = _mm256_setr_m128(_mm_loadu_ps(sw + 4), _mm_loadu_ps(sw + 12));
                for (int r = 0; r < rows; r++) {
                    _mm256_storeu_ps(acc[r], _mm256_fmadd_ps(sw0, _mm256_loadu_ps(t[r]), _mm256_loadu_ps(acc[r])));
                    _mm256_storeu_ps(acc[r] + 8, _mm256_fmadd_ps(sw1, _mm256_loadu_ps(t[r] + 8), _mm256_loadu_ps(acc[r] + 8)));
                    memset(t[r], 0, sizeof t[r]);
                }
            }
            continue;
        }
        __m256 dw[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)head)),
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 16)))};
        __m256 mw[2] = {dw[0], dw[1]};
        if (f == K_Q4_1) {
            mw[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 32)));
            mw[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 48)));
        }
        for (int r = 0; r < rows; r++)
            q8_block_sums(f, s0[r], s1[r], dw, mw, sum[r * nb + b], d[r * nb + b], xs[r * nb + b], acc[r]);
    }
    if (q8_ours(f))
        for (int r = 0; r < rows; r++) {
            const __m256 a0 = _mm256_loadu_ps(acc[r]), a1 = _mm256_loadu_ps(acc[r] + 8);
            _mm256_storeu_ps(acc[r], _mm256_permute2f128_ps(a0, a1, 0x20));
            _mm256_storeu_ps(acc[r] + 8, _mm256_permute2f128_ps(a0, a1, 0x31));
        }
#else
    (void)pre, (void)u;
    float t[Q8_ROWS][NR]; /* our kinds' group sums */
    for (int r = 0; r < rows; r++) memset(acc[r], 0, sizeof acc[r]), memset(t[r], 0, sizeof t[r]);
    for (int b = 0; b < nb; b++, q8_step(&at)) {
        const uint8_t *head = at.head, *v = q8_values(f, &at);
        const int last = q8_ends(&at, b);
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = q + r * k + (int64_t)b * Q8_BLOCK;
            const float dx = d[r * nb + b];
            for (int c = 0; c < NR; c++) {
                int32_t isum = 0;
                for (int j = 0; j < Q8_BLOCK; j++) isum += q8_weight(f, v, j, c) * xq[q8_slot(j)];
                isum -= q8_zero(f, head, c) * sum[r * nb + b];
                if (q8_ours(f)) {
                    t[r][c] = fmaf(dx, (float)isum, t[r][c]);
                    if (last) acc[r][c] = fmaf(f == K_I8 ? scale[c] : ((const float *)head)[c], t[r][c], acc[r][c]), t[r][c] = 0.0f;
                    continue;
                }
                acc[r][c] = fmaf(half_to_float(((const uint16_t *)head)[c]) * dx, (float)isum, acc[r][c]);
                if (f == K_Q4_1) acc[r][c] = fmaf(half_to_float(((const uint16_t *)head)[NR + c]), xs[r * nb + b], acc[r][c]);
            }
        }
    }
#endif
}

/* q8_panel instantiated per kind, reading of the chunks and row count (its sums then stay in registers). */
typedef void (*q8_panel_fn)(const uint8_t *p, const uint8_t *u, int nb, int g, const float *scale,
                            const int8_t *q, const float *d, const int32_t *sum, const float *xs,
                            float acc[Q8_ROWS][NR]);
#define Q8_PANEL(F, R, PRE)                                                                                    \
    static void q8_panel_##F##_##R##_##PRE(const uint8_t *p, const uint8_t *u, int nb, int g,                 \
                                           const float *scale, const int8_t *q, const float *d,                \
                                           const int32_t *sum, const float *xs, float acc[Q8_ROWS][NR]) {     \
        q8_panel(F, PRE, p, u, nb, g, scale, q, d, sum, xs, R, acc);                                           \
    }
#define Q8_ENTRY(F, R, PRE) q8_panel_##F##_##R##_##PRE,
#if Q8_ROWS == 8
#define Q8_EACH_ROWS(X, F, PRE) X(F, 1, PRE) X(F, 2, PRE) X(F, 3, PRE) X(F, 4, PRE) X(F, 5, PRE) X(F, 6, PRE) X(F, 7, PRE) X(F, 8, PRE)
#else
#define Q8_EACH_ROWS(X, F, PRE) X(F, 1, PRE) X(F, 2, PRE) X(F, 3, PRE) X(F, 4, PRE)
#endif
/* the kinds this file serves, in Q8_PANEL_OF's order (q8_kind_index) */
#define Q8_KINDS(X) X(K_Q4_0) X(K_Q4_1) X(K_Q8_0) X(K_I8) X(K_I4) X(K_I4Z)
#define Q8_PANELS(F) Q8_EACH_ROWS(Q8_PANEL, F, 0) Q8_EACH_ROWS(Q8_PANEL, F, 1)
Q8_KINDS(Q8_PANELS)
#define Q8_KIND_ENTRIES(F) {{Q8_EACH_ROWS(Q8_ENTRY, F, 0)}, {Q8_EACH_ROWS(Q8_ENTRY, F, 1)}},
static const q8_panel_fn Q8_PANEL_OF[6][2][Q8_ROWS] = {Q8_KINDS(Q8_KIND_ENTRIES)};
static inline int q8_kind_index(int f) {
    static const int index[K_COUNT] = {[K_Q4_0] = 0, [K_Q4_1] = 1, [K_Q8_0] = 2, [K_I8] = 3, [K_I4] = 4, [K_I4Z] = 5};
    return index[f];
}

/* y[m, s->cols] (row stride ldy) = x[m, k] W^T under llama.cpp's numerics (s->q8_dot: Q4_0, Q4_1,
 * Q8_0, I8, I4 and I4Z, float32 x and y, k a multiple of 32): x quantized per row and block, then the panels shared out
 * among the threads, each panel's rows Q8_ROWS at a time; bias and silu(gate) * up as store_tile adds them. */
static void q8_segment_run(const gemm_segment *s, const float *x, float *y, int64_t ldy, int m, int k, int gated) {
    const int f = s->kind, nb = k / Q8_BLOCK, cols = gated ? NR / 2 : NR, width = s->cols;
    const int panels = (width + cols - 1) / cols;
    const int64_t pbytes = panel_bytes(f, k, s->group);
    for (int m0 = 0; m0 < m; m0 += Q8_MC) {
        const int rows = m - m0 < Q8_MC ? m - m0 : Q8_MC;
        /* this block's x as int8 values, then scales, sums and scaled sums: (rows k + 3 rows nb) x 4 bytes */
        float *buf = thread_buffer(X_BUFFER, (size_t)rows * k / 4 + (size_t)3 * rows * nb);
        int8_t *q = (int8_t *)buf;
        float *d = buf + (size_t)rows * k / 4;
        int32_t *sum = (int32_t *)(d + (size_t)rows * nb);
        float *xs = (float *)(sum + (size_t)rows * nb);
        q8_quantize_rows(x + (int64_t)m0 * k, rows, k, q, d, sum, xs);
        const int pre = Q8_VECTOR && rows > Q8_ROWS; /* several passes over each panel: rearrange it once */
        /* static: panels cost alike, and a dynamic schedule's hand-offs outweigh a few-row panel's work */
#pragma omp parallel for schedule(static) if ((int64_t)rows * width * k >= MIN_PARALLEL)
        for (int j = 0; j < panels; j++) {
            const uint8_t *p = (const uint8_t *)s->panels + j * pbytes;
            const float *bias = s->bias ? s->bias + (int64_t)j * NR : NULL;
            const int own = width - j * cols < cols ? width - j * cols : cols;
            uint8_t *u = NULL;
#if Q8_VECTOR
            if (pre) { /* k x 16 bytes */
                u = (uint8_t *)thread_buffer(PANEL_BUFFER, (size_t)k * NR / 4);
                q8_unpack_panel(f, p, nb, s->group, u);
            }
#endif
            for (int r0 = 0; r0 < rows; r0 += Q8_ROWS) {
                const int n = rows - r0 < Q8_ROWS ? rows - r0 : Q8_ROWS;
                float acc[Q8_ROWS][NR], out[NR];
                Q8_PANEL_OF[q8_kind_index(f)][pre][n - 1](p, u, nb, s->group, s->scale ? s->scale + (int64_t)j * NR : NULL,
                                                          q + (int64_t)r0 * k, d + (int64_t)r0 * nb,
                                                          sum + (int64_t)r0 * nb, xs + (int64_t)r0 * nb, acc);
                for (int r = 0; r < n; r++) {
                    store_tile(out, load8(acc[r]), load8(acc[r] + 8), bias, gated);
                    memcpy(y + (int64_t)(m0 + r0 + r) * ldy + (int64_t)j * cols, out, (size_t)own * sizeof(float));
                }
            }
        }
    }
}
