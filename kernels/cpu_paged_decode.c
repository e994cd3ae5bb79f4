// Paged decode attention for the CPU (float32): one query token per sequence, K/V read in place
// through the block table, never gathered into a contiguous copy. All query heads of a KV head are
// served from one read of each K/V row (grouped-query attention). Online softmax, block by block.
// Compiled at first use with the system C compiler and called through ctypes (which releases the
// GIL, so Python threads can run disjoint sequence ranges in parallel). Head sizes must be
// multiples of 8: rows are processed as 8-float vectors (GCC/Clang vector extensions).
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
  v8 v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline float hsum8(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// exp(x) for x <= 0 (logit minus running maximum), 8 lanes at once: Cephes' expf polynomial after
// x = n ln2 + r, |r| <= ln2 / 2; lanes below -87.3 (and -inf) give 0. About 1 ulp from expf.
static inline v8 exp8_nonpos(v8 x) {
  const v8 lo = (v8){0} - 87.3f;
  const v8i under = x < lo;
  x = (v8)(((v8i)x & ~under) | ((v8i)lo & under));
  const v8i n = __builtin_convertvector(x * 1.44269504f - 0.5f, v8i);  // round to nearest, x <= 0
  const v8 nf = __builtin_convertvector(n, v8);
  const v8 r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
  v8 p = (v8){0} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const v8 scale = (v8)((n + 127) << 23);  // 2^n
  return (v8)((v8i)(p * scale) & ~under);
}

// q . k for one key row: four independent accumulators hide the FMA latency.
static inline float dot8(const v8 *q, const float *k, int chunks) {
  v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
  int c = 0;
  for (; c + 4 <= chunks; c += 4) {
    s0 += q[c] * load8(k + 8 * c);
    s1 += q[c + 1] * load8(k + 8 * c + 8);
    s2 += q[c + 2] * load8(k + 8 * c + 16);
    s3 += q[c + 3] * load8(k + 8 * c + 24);
  }
  for (; c < chunks; ++c) s0 += q[c] * load8(k + 8 * c);
  return hsum8((s0 + s1) + (s2 + s3));
}

void paged_decode_f32(float *out, const float *q, const float *k_cache, const float *v_cache,
                      const int32_t *block_tables, const int32_t *ctx_lens, const int64_t *rows,
                      int s_begin, int s_end, int max_blocks, int block_size, int num_heads,
                      int num_kv_heads, int head_dim, int head_dim_v, int64_t q_token_stride,
                      int64_t q_head_stride, float scale, int window, float softcap,
                      const float *sinks) {
  // All heads of a sequence advance together, block by block, so each K/V row (all KV heads,
  // contiguous in the pool) is read from memory exactly once per step and layer.
  const int g = num_heads / num_kv_heads, kc = head_dim / 8, vc = head_dim_v / 8;
  const size_t k_row = (size_t)num_kv_heads * head_dim, v_row = (size_t)num_kv_heads * head_dim_v;
  // on the stack, sized to this call (a few KB; cpu_kernel.supports() bounds heads, head and block
  // size so they stay under 1 MB): thread-local arrays would cost a TLS lookup per use here
  v8 qs[num_heads * kc], acc[num_heads * vc];
  float logits[num_heads * (block_size + 8)] __attribute__((aligned(32)));
  float m[num_heads], l[num_heads];
  for (int s = s_begin; s < s_end; ++s) {
    const int len = ctx_lens[s];
    const int first = (window > 0 && len > window) ? len - window : 0;
    const int32_t *table = block_tables + (size_t)s * max_blocks;
    for (int i = 0; i < num_heads; ++i) {
      const float *src = q + rows[s] * q_token_stride + (int64_t)i * q_head_stride;
      for (int c = 0; c < kc; ++c) qs[i * kc + c] = load8(src + 8 * c) * scale;
      for (int c = 0; c < vc; ++c) acc[i * vc + c] = (v8){0};
      m[i] = -INFINITY;
      l[i] = 0.f;
    }
    for (int b = first / block_size; b * block_size < len; ++b) {
      const int t0 = b * block_size > first ? b * block_size : first;
      const int t1 = (b + 1) * block_size < len ? (b + 1) * block_size : len;
      const int n = t1 - t0;
      const size_t base = (size_t)table[b] * block_size + t0 % block_size;
      const float *k = k_cache + base * k_row, *v = v_cache + base * v_row;
      for (int t = 0; t < n; ++t)  // query head i reads KV head i / g of row t
        for (int i = 0; i < num_heads; ++i)
          logits[i * (block_size + 8) + t] = dot8(qs + i * kc, k + t * k_row + (size_t)(i / g) * head_dim, kc);
      for (int i = 0; i < num_heads; ++i) {
        float *li = logits + i * (block_size + 8), block_max = -INFINITY;
        if (softcap > 0.f)
          for (int t = 0; t < n; ++t) li[t] = softcap * tanhf(li[t] / softcap);
        for (int t = 0; t < n; ++t) block_max = li[t] > block_max ? li[t] : block_max;
        if (block_max > m[i]) {  // rescale what was accumulated under the old maximum
          const float corr = expf(m[i] - block_max);
          l[i] *= corr;
          for (int c = 0; c < vc; ++c) acc[i * vc + c] *= corr;
          m[i] = block_max;
        }
        const int n8 = (n + 7) & ~7;
        for (int t = n; t < n8; ++t) li[t] = -INFINITY;  // padding lanes: probability 0
        v8 sum8 = {0};
        for (int t = 0; t < n8; t += 8) {
          const v8 p = exp8_nonpos(load8(li + t) - m[i]);
          memcpy(li + t, &p, sizeof p);
          sum8 += p;
        }
        l[i] += hsum8(sum8);
      }
      for (int t = 0; t < n; ++t)
        for (int i = 0; i < num_heads; ++i) {
          const float p = logits[i * (block_size + 8) + t];
          const float *vt = v + t * v_row + (size_t)(i / g) * head_dim_v;
          v8 *a = acc + i * vc;
          for (int c = 0; c < vc; ++c) a[c] += p * load8(vt + 8 * c);
        }
    }
    for (int i = 0; i < num_heads; ++i) {
      float denom = l[i];
      if (sinks) denom += expf(sinks[i] - m[i]);
      float *dst = out + (rows[s] * num_heads + i) * (int64_t)head_dim_v;
      const v8 inv = (v8){0} + 1.f / denom;
      for (int c = 0; c < vc; ++c) {
        const v8 r = acc[i * vc + c] * inv;
        memcpy(dst + 8 * c, &r, sizeof r);
      }
    }
  }
}

// Write this step's K/V rows of n tokens into their pool slots (slot < 0: padding, skipped). The
// sources are strided views ([token, head, dim] with any token/head stride, unit dim stride).
void store_kv_f32(float *k_cache, float *v_cache, const float *k, const float *v,
                  const int64_t *slots, int n, int num_kv_heads, int head_dim, int head_dim_v,
                  int64_t k_token_stride, int64_t k_head_stride, int64_t v_token_stride,
                  int64_t v_head_stride) {
  for (int i = 0; i < n; ++i) {
    if (slots[i] < 0) continue;
    float *kd = k_cache + slots[i] * num_kv_heads * (int64_t)head_dim;
    float *vd = v_cache + slots[i] * num_kv_heads * (int64_t)head_dim_v;
    for (int h = 0; h < num_kv_heads; ++h) {
      memcpy(kd + h * head_dim, k + i * k_token_stride + h * k_head_stride, head_dim * sizeof(float));
      memcpy(vd + h * head_dim_v, v + i * v_token_stride + h * v_head_stride,
             head_dim_v * sizeof(float));
    }
  }
}
