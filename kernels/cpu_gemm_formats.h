/* The weight formats of cpu_gemm.c's panels, and how a tile reads one group of a panel.
 *
 * Every format keeps the checkpoint's numbers and uses each weight as the float32 value its
 * dequantizer gives (gguf-py's, for GGUF types): w = q * s, or q * s + m, with s and m the group's
 * float32 scale and offset built from the stored fields exactly as that dequantizer builds them (the
 * products d * sc of K-quants, float16 d and m widened). q * s is exact wherever the dequantizer
 * then adds (at most 22 significant bits), so one fused q * s + m rounds as its two steps do, and a
 * product of the float32 kernel over the dequantized weight, fma(x, w, acc) in k order, is the
 * same bits here.
 *
 * Layout: a panel holds 16 weight rows (output columns) over all of k, cut into groups of G
 * consecutive k (the format's scale block: 32, 16 for Q6_K, 32 or 128 for int4), one record per
 * group, records in k order; the K-quants put their super-block's float16 d (and dmin) before each
 * run of 256 k. A record is its scale fields for the 16 columns, then the values k-major (16 per
 * k): int8 as they are (Q8_0), or as nibbles in chunks of 4 k (32 bytes: value i of the chunk's 64,
 * i = 16 * kk + column, in the low nibble of byte i for i < 32, the high nibble of byte i - 32 else),
 * then for 5- and 6-bit types one bit plane per extra bit (8 bytes per chunk, bit i for value i).
 * The tiles read the plain 4-bit kinds (fmt_direct: Q4_0, Q4_1, Q4_K, I4) from their nibbles in registers:
 * 16 bytes of a chunk widened to 32-bit lanes hold two k's values (low and high nibbles), a mask or
 * a shift apart, and w = q * s + m with m = -8 * s for Q4_0 and I4 (q * s and 8 * s exact, so the
 * sum is (q - 8) * s exactly, as long as 8 * s is finite). Otherwise (other kinds, and dequantizing a
 * panel for the wide tiles, faster that way) a group is unpacked into int8 (offset removed, planes
 * added) in a small buffer; from there each k's 16 weights are one widening load, a conversion and a
 * multiply (+ add) away.
 *
 *   Q8_0   G 32: d[16] f16 | q[32][16] i8                              w = d * q
 *   Q4_0   G 32: d[16] f16 | nibbles                                   w = d * (q - 8)
 *   Q4_1   G 32: d[16] f16 | m[16] f16 | nibbles                       w = d * q + m
 *   Q5_0   G 32: d | nibbles | plane 4                                 w = d * (q - 16)
 *   Q5_1   G 32: d | m | nibbles | plane 4                             w = d * q + m
 *   Q4_K   256: d[16] f16 | dmin[16] f16, 8 x G 32: sc[16] u8 | mn[16] u8 | nibbles
 *                                                                      w = (d * sc) * q - dmin * mn
 *   Q5_K   as Q4_K, each group + plane 4
 *   Q6_K   256: d[16] f16, 16 x G 16: sc[16] i8 | nibbles | planes 4, 5   w = (d * sc) * (q - 32)
 *   MXFP4  G 32: e[16] u8 (E8M0) | nibbles             w = 2^(e - 128) * MXFP4_VALUES[q] (llama.cpp's)
 *   I4     G 32 or 128 (the last one shorter if k is not a multiple): s[16] f32 | nibbles
 *                                                                      w = s * (q - 8)
 *   I4Z    as I4 with z[16] u8 after s (zero points)                   w = s * (q - z)
 *   I8     k x 16 int8 (one group), s[16] f32 per panel in a separate array  w = s * q
 *   F32    k x 16 float32; BF16: k in pairs for vdpbf16ps (cpu_gemm.c)
 *
 * MXFP4 (fmt_lookup) holds an index per weight into MXFP4_VALUES (E2M1's values doubled, as llama.cpp's
 * kvalues_mxfp4) and a power of two per group (llama.cpp's ggml_e8m0_to_fp32_half: 2^(e - 128), the two
 * smallest subnormal); every product of the two is a float32 exactly, as llama.cpp's dequantizer gives it.
 *
 * The types' ids and the traits above (group, planes, fields, zero) are declared once, in
 * pagedinfer/kernels/weight_types.py, which generates cpu_weight_types.h.
 */
#ifndef PAGEDINFER_CPU_GEMM_FORMATS_H
#define PAGEDINFER_CPU_GEMM_FORMATS_H
#include <stdint.h>
#include <string.h>

#include "cpu_panel_vec.h"    /* vh, PV_HALVES, VW */
#include "cpu_weight_types.h" /* K_<type>, the fmt_* traits (generated) */

#define NR 16 /* weight rows per panel */

#define MAX_GROUP 128 /* the longest group (I4 at group 128) */

/* Bytes of one group record of gl values per column (gl a multiple of 4 but for I4's last group). */
static inline __attribute__((always_inline)) int64_t fmt_record_bytes(int f, int gl) {
    if (f == K_Q8_0) return 32 + (int64_t)gl * NR;
    const int chunks = (gl + 3) / 4;
    return fmt_head_bytes(f) + (int64_t)chunks * (32 + 8 * fmt_planes(f));
}

/* Bytes of one panel of k weights per column (group g for I4). */
static int64_t panel_bytes(int f, int k, int g) {
    switch (f) {
        case K_F32: return (int64_t)k * NR * 4;
        case K_BF16: return (int64_t)k * NR * 2;
        case K_I8: return (int64_t)k * NR;
        default: break;
    }
    const int G = fmt_group(f, g), full = k / G, rest = k % G, S = fmt_super(f);
    int64_t bytes = full * fmt_record_bytes(f, G) + (rest ? fmt_record_bytes(f, rest) : 0);
    return bytes + (int64_t)(full + S - 1) / S * fmt_super_bytes(f);
}

/* Byte offset of group gi's record in a panel (all groups before it full). */
static inline __attribute__((always_inline)) int64_t group_offset(int f, int gi, int g) {
    const int S = fmt_super(f);
    const int64_t rec = fmt_record_bytes(f, fmt_group(f, g));
    return (int64_t)(gi / S + 1) * fmt_super_bytes(f) + (int64_t)gi * rec;
}

/* MXFP4's 16 values (E2M1 doubled), indexed by the stored nibble: llama.cpp's kvalues_mxfp4. */
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* An E8M0 exponent byte as llama.cpp's ggml_e8m0_to_fp32_half: 2^(e - 128) (e 0 and 1: subnormal). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* VW exponent bytes as their float32 scales. */
static inline vh vh_e8m0_half(const uint8_t *e) {
    float f[VW];
    for (int i = 0; i < VW; i++) f[i] = e8m0_half(e[i]);
    return vh_load(f);
}

/* Nibble chunks into int8 values: table[q] where a table is given (MXFP4's), else q minus off (a
 * per-column offset: off[16], repeated over the k). */
static inline void unpack_nibbles(const uint8_t *src, int chunks, const int8_t *off, const int8_t *table,
                                  int8_t *dst) {
#if defined(__AVX2__)
    const __m256i mask = _mm256_set1_epi8(0x0f);
    const __m256i o = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)off));
    const __m256i t = table ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table)) : o;
    for (int c = 0; c < chunks; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(src + 32 * c));
        const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        _mm256_storeu_si256((__m256i *)(dst + 64 * c), table ? _mm256_shuffle_epi8(t, lo) : _mm256_sub_epi8(lo, o));
        _mm256_storeu_si256((__m256i *)(dst + 64 * c + 32),
                            table ? _mm256_shuffle_epi8(t, hi) : _mm256_sub_epi8(hi, o));
    }
#else
    for (int c = 0; c < chunks; c++)
        for (int i = 0; i < 32; i++) {
            const int lo = src[32 * c + i] & 15, hi = src[32 * c + i] >> 4;
            dst[64 * c + i] = (int8_t)(table ? table[lo] : lo - off[i % 16]);
            dst[64 * c + 32 + i] = (int8_t)(table ? table[hi] : hi - off[i % 16]);
        }
#endif
}

/* dst[i] += add where bit i of the chunk's 64-bit plane word is set. */
static inline void add_plane(const uint8_t *plane, int chunks, int8_t add, int8_t *dst) {
    for (int c = 0; c < chunks; c++) {
        uint64_t bits;
        memcpy(&bits, plane + 8 * c, sizeof bits);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        const __m256i a = _mm256_set1_epi8(add);
        for (int h = 0; h < 2; h++) {
            __m256i *d = (__m256i *)(dst + 64 * c + 32 * h);
            const __m256i v = _mm256_loadu_si256(d);
            _mm256_storeu_si256(d, _mm256_mask_add_epi8(v, (__mmask32)(bits >> (32 * h)), v, a));
        }
#elif defined(__AVX2__)
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2,
                                                2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ull), a = _mm256_set1_epi8(add);
        for (int h = 0; h < 2; h++) {
            const __m256i w = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)(uint32_t)(bits >> (32 * h))), spread);
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(w, bit), bit);
            __m256i *d = (__m256i *)(dst + 64 * c + 32 * h);
            _mm256_storeu_si256(d, _mm256_add_epi8(_mm256_loadu_si256(d), _mm256_and_si256(set, a)));
        }
#else
        for (int i = 0; i < 64; i++)
            if (bits >> i & 1) dst[64 * c + i] = (int8_t)(dst[64 * c + i] + add);
#endif
    }
}

/* Group gi (k values g0 .. g0 + gl - 1) of the panel at p: its scale s, offset m (formats with one),
 * each as PV_HALVES vectors, and int8 values q (16 per k; unpacked into buf, or in place for Q8_0 and
 * I8; direct, for fmt_direct kinds: q is the nibble chunks). scale: I8's per-panel column scales. */
static inline __attribute__((always_inline)) void group_setup(int f, int direct, const uint8_t *p, int gi, int g0,
                                                              int gl, int g, const float *scale, vh *s, vh *m,
                                                              const int8_t **q, int8_t *buf) {
    if (f == K_I8) {
        for (int h = 0; h < PV_HALVES; h++) s[h] = vh_load(scale + h * VW);
        *q = (const int8_t *)p + (int64_t)g0 * NR;
        return;
    }
    const int S = fmt_super(f);
    const uint8_t *r = p + group_offset(f, gi, g);
    const uint8_t *sup = p + (int64_t)(gi / S) * (fmt_super_bytes(f) + S * fmt_record_bytes(f, fmt_group(f, g)));
    const uint16_t *d = (const uint16_t *)r, *dm = (const uint16_t *)(r + 32);
    for (int h = 0; h < PV_HALVES; h++) {
        const int c = h * VW; /* this half's first column */
        switch (f) {
            case K_Q4_1: case K_Q5_1: m[h] = vh_f16(dm + c); /* fall through */
            case K_Q8_0: case K_Q4_0: case K_Q5_0: s[h] = vh_f16(d + c); break;
            case K_Q4_K: case K_Q5_K: /* d * sc and -(dmin * mn), each product exact */
                s[h] = vh_f16((const uint16_t *)sup + c) * vh_u8(r + c);
                m[h] = -(vh_f16((const uint16_t *)(sup + 32) + c) * vh_u8(r + 16 + c));
                break;
            case K_Q6_K: s[h] = vh_f16((const uint16_t *)sup + c) * vh_i8((const int8_t *)r + c); break;
            case K_MXFP4: s[h] = vh_e8m0_half(r + c); break;
            default: s[h] = vh_load((const float *)r + c); break; /* I4, I4Z */
        }
        if (direct && fmt_zero(f)) m[h] = vh_splat(-(float)fmt_zero(f)) * s[h];
    }
    if (f == K_Q8_0) {
        *q = (const int8_t *)(r + 32);
        return;
    }
    const uint8_t *nib = r + fmt_head_bytes(f);
    if (direct) {
        *q = (const int8_t *)nib;
        return;
    }
    static const int8_t zero[16] = {0};
    int8_t off[16];
    const int8_t *o = zero;
    if (fmt_zero(f)) {
        memset(off, fmt_zero(f), sizeof off);
        o = off;
    } else if (f == K_I4Z) {
        o = (const int8_t *)(r + 64);
    }
    const int chunks = (gl + 3) / 4;
    unpack_nibbles(nib, chunks, o, fmt_lookup(f) ? MXFP4_VALUES : NULL, buf);
    if (fmt_planes(f) >= 1) add_plane(nib + 32 * chunks, chunks, 16, buf);
    if (fmt_planes(f) >= 2) add_plane(nib + 40 * chunks, chunks, 32, buf);
    *q = buf;
}

/* Half h of the 16 values at k index kk of a nibble group (q: its chunks), in float32: the chunk's
 * bytes 16 * (kk & 1) .. + 15 hold k 4c + (kk & 1) in their low nibbles and the k two further in
 * their high ones. Loops that know kk & 3 (unrolled by 4) widen each 16 bytes once for both k. */
static inline __attribute__((always_inline)) vh nibble_values(const uint8_t *q, int kk, int h) {
    const uint8_t *b = q + 32 * (kk >> 2) + 16 * (kk & 1) + h * VW;
    const int high = kk & 2;
#if defined(PV_ZMM)
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    return (vh)_mm512_cvtepi32_ps(high ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15)));
#elif defined(__AVX2__)
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
    return (vh)_mm256_cvtepi32_ps(high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15)));
#else
    vh v;
    for (int i = 0; i < VW; i++) v[i] = (float)(high ? b[i] >> 4 : b[i] & 15);
    return v;
#endif
}

/* Half h of the 16 weights at k index kk of the group set up as above, in float32. */
static inline __attribute__((always_inline)) vh group_weights(int f, int direct, const vh *s, const vh *m,
                                                              const int8_t *q, int kk, int h) {
    const vh v = direct ? nibble_values((const uint8_t *)q, kk, h) : vh_i8(q + (int64_t)kk * NR + h * VW);
    return fmt_has_min(f, direct) ? m[h] + v * s[h] : v * s[h];
}
#endif
