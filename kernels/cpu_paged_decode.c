// Paged decode attention for the CPU (float32): one query token per sequence, K/V read in place
// through the block table, never gathered into a contiguous copy. All query heads of a KV head are
// served from one read of each K/V row (grouped-query attention). Online softmax, block by block.
// Compiled at first use with the system C compiler and called through ctypes (which releases the
// GIL, so Python threads can run disjoint sequence ranges in parallel).
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_GROUP 64   // query heads per KV head
#define MAX_DIM 512    // head size
#define MAX_BLOCK 128  // block size

void paged_decode_f32(float *out, const float *q, const float *k_cache, const float *v_cache,
                      const int32_t *block_tables, const int32_t *ctx_lens, const int64_t *rows,
                      int s_begin, int s_end, int max_blocks, int block_size, int num_heads,
                      int num_kv_heads, int head_dim, int head_dim_v, int64_t q_token_stride,
                      int64_t q_head_stride, float scale, int window, float softcap,
                      const float *sinks) {
  const int g = num_heads / num_kv_heads;
  float qs[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], logits[MAX_BLOCK][MAX_GROUP];
  float m[MAX_GROUP], l[MAX_GROUP];
  for (int s = s_begin; s < s_end; ++s) {
    const int len = ctx_lens[s];
    const int first = (window > 0 && len > window) ? len - window : 0;
    const int32_t *table = block_tables + (size_t)s * max_blocks;
    for (int h = 0; h < num_kv_heads; ++h) {
      for (int j = 0; j < g; ++j) {
        const float *src = q + rows[s] * q_token_stride + (int64_t)(h * g + j) * q_head_stride;
        for (int d = 0; d < head_dim; ++d) qs[j][d] = src[d] * scale;
        for (int d = 0; d < head_dim_v; ++d) acc[j][d] = 0.f;
        m[j] = -INFINITY;
        l[j] = 0.f;
      }
      for (int b = first / block_size; b * block_size < len; ++b) {
        const int t0 = b * block_size > first ? b * block_size : first;
        const int t1 = (b + 1) * block_size < len ? (b + 1) * block_size : len;
        const size_t base = (size_t)table[b] * block_size;
        float block_max[MAX_GROUP];
        for (int j = 0; j < g; ++j) block_max[j] = -INFINITY;
        for (int t = t0; t < t1; ++t) {
          const float *k = k_cache + ((base + t % block_size) * num_kv_heads + h) * head_dim;
          for (int j = 0; j < g; ++j) {
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_dim; ++d) dot += qs[j][d] * k[d];
            if (softcap > 0.f) dot = softcap * tanhf(dot / softcap);
            logits[t - t0][j] = dot;
            if (dot > block_max[j]) block_max[j] = dot;
          }
        }
        for (int j = 0; j < g; ++j) {
          if (block_max[j] > m[j]) {  // rescale what was accumulated under the old maximum
            const float corr = expf(m[j] - block_max[j]);
            l[j] *= corr;
            for (int d = 0; d < head_dim_v; ++d) acc[j][d] *= corr;
            m[j] = block_max[j];
          }
        }
        for (int t = t0; t < t1; ++t) {
          const float *v = v_cache + ((base + t % block_size) * num_kv_heads + h) * head_dim_v;
          for (int j = 0; j < g; ++j) {
            const float p = expf(logits[t - t0][j] - m[j]);
            l[j] += p;
#pragma omp simd
            for (int d = 0; d < head_dim_v; ++d) acc[j][d] += p * v[d];
          }
        }
      }
      for (int j = 0; j < g; ++j) {
        float denom = l[j];
        if (sinks) denom += expf(sinks[h * g + j] - m[j]);
        float *dst = out + (rows[s] * num_heads + h * g + j) * (int64_t)head_dim_v;
        for (int d = 0; d < head_dim_v; ++d) dst[d] = acc[j][d] / denom;
      }
    }
  }
}
