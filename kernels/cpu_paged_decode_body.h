// The typed half of cpu_paged_decode.c, included once per K/V element type (a C template): ELEM is
// the element type of q, the K/V pool and the output; LOAD8 widens 8 elements to a v8 of floats and
// STORE8 narrows one back; FN(name) gives each instantiation its own names; WIDEN_BLOCKS (16-bit
// elements) widens each K/V block to float32 once, into a per-thread buffer, before its query heads
// read it: every row is read by all the query heads of its KV head (and by every sequence sharing
// the block), so widening on each read repeated the conversion that many times: 16 sequences of 128
// tokens, 9/3 heads of 64, 30 layers took 8.9 ms in bfloat16 against 5.7 in float32 for half the
// bytes; widened once, 5.6-5.8 ms (AMD EPYC Zen 4, 2 threads). Logits, softmax state and the
// output accumulators are float32 in every instantiation.
// q . k for one key row (float32: the block as attend_rows reads it): four independent accumulators
// hide the FMA latency.
static inline float FN(dot8)(const v8 *q, const float *k, int chunks) {
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

// Loads one element of every 64-byte line of p[0, n), in address order. The passes below read a
// block's rows head by head (strided); streamed in first, the block is read from memory at close to
// the machine's sequential rate and those passes hit the cache (W2-shaped calls 15-25% faster).
// Used for a block nobody prefetched (the first of a run).
static inline void FN(touch_lines)(const ELEM *p, size_t n) {
  v8 sum = {0};
  for (size_t o = 0; o + 8 <= n; o += 64 / sizeof(ELEM)) sum += LOAD8(p + o);
  volatile float sink = sum[0] + sum[7];  // keeps the loads
  (void)sink;
}

#ifdef WIDEN_BLOCKS
// dst[0, n) = src[0, n) in float32, n a multiple of 8 (rows of heads of 8k elements).
static inline void FN(widen)(float *dst, const ELEM *src, size_t n) {
  for (size_t i = 0; i < n; i += 8) store8(dst + i, LOAD8(src + i));
}
#endif

// Prefetches part `part` of `parts` of the 64-byte lines of p[0, n): the next block's rows are
// fetched a slice per softmax state while this block is computed, so the memory reads overlap the
// arithmetic instead of stalling it.
static inline void FN(prefetch_part)(const ELEM *p, size_t n, int part, int parts) {
  const size_t step = 64 / sizeof(ELEM), lines = (n + step - 1) / step;
  for (size_t i = lines * part / parts; i < lines * (part + 1) / parts; ++i)
    __builtin_prefetch(p + i * step, 0, 3);
}

// The block after the current one (rows n of k and v), prefetched while it is computed; n = 0: none.
typedef struct {
  const ELEM *k, *v;
  int n;
} FN(next_block);

// One block of n K/V rows for nm sequences at once (their query heads and softmax states are
// contiguous: state j * num_heads + i is query head i of the j-th sequence). State by state, so
// its query and its output stay in registers; the block's rows stay in L1 between states. wide:
// room for n rows of K and of V in float32 (WIDEN_BLOCKS), else unused.
static void FN(attend_rows)(int nm, int num_heads, int g, int kc, int vc, int lstride, const v8 *qs,
                        v8 *acc, float *m, float *l, float *logits, const ELEM *k_in,
                        const ELEM *v_in, int n, size_t k_row, size_t v_row, int head_dim,
                        int head_dim_v, float softcap, int prefetched, FN(next_block) next,
                        float *wide) {
#ifdef WIDEN_BLOCKS  // one sequential pass over the block, which also brings it into the cache
  (void)prefetched;
  float *k = wide, *v = wide + (size_t)n * k_row;
  FN(widen)(k, k_in, (size_t)n * k_row);
  FN(widen)(v, v_in, (size_t)n * v_row);
#else
  (void)wide;
  const float *k = k_in, *v = v_in;
  if (!prefetched) {
    FN(touch_lines)(k, (size_t)n * k_row);
    FN(touch_lines)(v, (size_t)n * v_row);
  }
#endif
  const int states = nm * num_heads;
  for (int s = 0; s < states; ++s) {
    if (next.n) {
      FN(prefetch_part)(next.k, (size_t)next.n * k_row, s, states);
      FN(prefetch_part)(next.v, (size_t)next.n * v_row, s, states);
    }
    const int h = s % num_heads / g;  // query head s % num_heads reads KV head h
    const float *kh = k + (size_t)h * head_dim, *vh = v + (size_t)h * head_dim_v;
    const v8 *qv = qs + s * kc;
    float *li = logits + s * lstride, block_max = -INFINITY;
    int t = 0;
    for (; t + 8 <= n; t += 8) {  // 8 rows at a time: 8 independent FMA chains
      v8 d[8] = {{0}};
      for (int c = 0; c < kc; ++c) {
        const v8 qc = qv[c];
        for (int r = 0; r < 8; ++r) d[r] += qc * load8(kh + (t + r) * k_row + 8 * c);
      }
      const v8 sums = sum_lanes8(d);
      memcpy(li + t, &sums, sizeof sums);
    }
    for (; t < n; ++t) li[t] = FN(dot8)(qv, kh + t * k_row, kc);
    if (softcap > 0.f)
      for (t = 0; t < n; ++t) li[t] = softcap * tanhf(li[t] / softcap);
    for (t = 0; t < n; ++t) block_max = li[t] > block_max ? li[t] : block_max;
    v8 *a = acc + s * vc;
    if (block_max > m[s]) {  // rescale what was accumulated under the old maximum
      const float corr = expf(m[s] - block_max);
      l[s] *= corr;
      for (int c = 0; c < vc; ++c) a[c] *= corr;
      m[s] = block_max;
    }
    const int n8 = (n + 7) & ~7;
    for (t = n; t < n8; ++t) li[t] = -INFINITY;  // padding lanes: probability 0
    v8 sum8 = {0};
    for (t = 0; t < n8; t += 8) {
      const v8 p = exp8_nonpos(load8(li + t) - m[s]);
      memcpy(li + t, &p, sizeof p);
      sum8 += p;
    }
    l[s] += hsum8(sum8);
    for (int c0 = 0; c0 < vc; c0 += 8) {  // output chunks 8 at a time, in registers over the rows
      const int w = vc - c0 < 8 ? vc - c0 : 8;
      v8 o[8];
      for (int c = 0; c < 8; ++c) o[c] = c < w ? a[c0 + c] : (v8){0};
      for (t = 0; t < n; ++t) {
        const float p = li[t];
        const float *vt = vh + t * v_row + 8 * c0;
        if (w == 8)
          for (int c = 0; c < 8; ++c) o[c] += p * load8(vt + 8 * c);
        else
          for (int c = 0; c < w; ++c) o[c] += p * load8(vt + 8 * c);
      }
      for (int c = 0; c < w; ++c) a[c0 + c] = o[c];
    }
  }
}

static void FN(paged_decode)(ELEM *out, const ELEM *q, const ELEM *k_cache, const ELEM *v_cache,
                             const int32_t *block_tables, const int32_t *ctx_lens,
                             const int64_t *rows, int s_begin, int s_end, int max_blocks,
                             int block_size, int num_heads, int num_kv_heads, int head_dim,
                             int head_dim_v, int64_t q_token_stride, int64_t q_head_stride,
                             float scale, int window, float softcap, const float *sinks) {
  // All heads of a sequence advance together, block by block, so each K/V row (all KV heads,
  // contiguous in the pool) is read from memory once per step and layer. Neighbouring sequences
  // whose tables start with the same physical blocks (samples of one prompt) are served together
  // over those blocks: the arithmetic per sequence is the same as alone, the shared rows are read
  // once.
  const int kc = head_dim / 8, vc = head_dim_v / 8, lstride = block_size + 8;
  const size_t k_row = (size_t)num_kv_heads * head_dim, v_row = (size_t)num_kv_heads * head_dim_v;
  const size_t member_bytes = (size_t)num_heads * ((kc + vc) * sizeof(v8) + lstride * 4 + 8);
  int gmax = (int)((256u << 10) / member_bytes);  // stack budget 256 KB, at least one member
  gmax = gmax < 1 ? 1 : gmax > 16 ? 16 : gmax;
  // on the stack, sized to this call (cpu_kernel.supports() bounds heads, head and block size so
  // one member stays under 1 MB): thread-local arrays would cost a TLS lookup per use here
  v8 qs[gmax * num_heads * kc], acc[gmax * num_heads * vc];
  float logits[gmax * num_heads * lstride] __attribute__((aligned(32)));
  float m[gmax * num_heads], l[gmax * num_heads];
#ifdef WIDEN_BLOCKS  // on the heap: block and head sizes make it up to 64 MB (one block in float32)
  float *wide = malloc((size_t)block_size * (k_row + v_row) * sizeof(float));
  if (!wide) abort();  // a few hundred KB at the shapes served; no way to report from here
#else
  float *wide = NULL;
#endif
  for (int s0 = s_begin; s0 < s_end;) {
    const int32_t *lead = block_tables + (size_t)s0 * max_blocks;
    int s1 = s0 + 1, min_len = ctx_lens[s0];
    while (window <= 0 && s1 < s_end && s1 - s0 < gmax && ctx_lens[s1] >= block_size &&
           min_len >= block_size && block_tables[(size_t)s1 * max_blocks] == lead[0]) {
      min_len = ctx_lens[s1] < min_len ? ctx_lens[s1] : min_len;
      ++s1;
    }
    int shared = s1 - s0 > 1 ? min_len / block_size : 0;  // full blocks every member reads whole
    for (int j = s0 + 1; j < s1; ++j) {
      const int32_t *table = block_tables + (size_t)j * max_blocks;
      int b = 0;
      while (b < shared && table[b] == lead[b]) ++b;
      shared = b;
    }
    for (int j = 0; j < s1 - s0; ++j)
      for (int i = 0; i < num_heads; ++i) {
        const int st = j * num_heads + i;
        const ELEM *src = q + rows[s0 + j] * q_token_stride + (int64_t)i * q_head_stride;
        for (int c = 0; c < kc; ++c) qs[st * kc + c] = LOAD8(src + 8 * c) * scale;
        for (int c = 0; c < vc; ++c) acc[st * vc + c] = (v8){0};
        m[st] = -INFINITY;
        l[st] = 0.f;
      }
    for (int b = 0; b < shared; ++b) {
      const size_t base = (size_t)lead[b] * block_size;
      const size_t nbase = b + 1 < shared ? (size_t)lead[b + 1] * block_size : 0;
      const FN(next_block) next = {k_cache + nbase * k_row, v_cache + nbase * v_row,
                                   b + 1 < shared ? block_size : 0};
      FN(attend_rows)(s1 - s0, num_heads, num_heads / num_kv_heads, kc, vc, lstride, qs, acc, m, l,
                  logits, k_cache + base * k_row, v_cache + base * v_row, block_size, k_row, v_row,
                  head_dim, head_dim_v, softcap, b > 0, next, wide);
    }
    for (int j = 0; j < s1 - s0; ++j) {  // each member's own blocks, after the shared ones
      const int s = s0 + j, len = ctx_lens[s], st = j * num_heads;
      const int first = (window > 0 && len > window) ? len - window : shared * block_size;
      const int32_t *table = block_tables + (size_t)s * max_blocks;
      for (int b = first / block_size; b * block_size < len; ++b) {
        const int t0 = b * block_size > first ? b * block_size : first;
        const int t1 = (b + 1) * block_size < len ? (b + 1) * block_size : len;
        const size_t base = (size_t)table[b] * block_size + t0 % block_size;
        const int n_next = len - t1 < block_size ? len - t1 : block_size;  // rows of block b + 1
        const size_t nbase = n_next > 0 ? (size_t)table[b + 1] * block_size : 0;
        const FN(next_block) next = {k_cache + nbase * k_row, v_cache + nbase * v_row, n_next};
        FN(attend_rows)(1, num_heads, num_heads / num_kv_heads, kc, vc, lstride, qs + st * kc,
                    acc + st * vc, m + st, l + st, logits, k_cache + base * k_row,
                    v_cache + base * v_row, t1 - t0, k_row, v_row, head_dim, head_dim_v, softcap,
                    b * block_size > first, next, wide);
      }
      for (int i = 0; i < num_heads; ++i) {
        float denom = l[st + i];
        if (sinks) denom += expf(sinks[i] - m[st + i]);
        ELEM *dst = out + (rows[s] * num_heads + i) * (int64_t)head_dim_v;
        const v8 inv = (v8){0} + 1.f / denom;
        for (int c = 0; c < vc; ++c) {
          STORE8(dst + 8 * c, acc[(st + i) * vc + c] * inv);
        }
      }
    }
    s0 = s1;
  }
  free(wide);
}

// paged_decode over parts ranges of sequences, [bounds[p], bounds[p + 1]), one per thread.
void FN(paged_decode_ranges)(const int32_t *bounds, int parts, ELEM *out, const ELEM *q,
                             const ELEM *k_cache, const ELEM *v_cache,
                             const int32_t *block_tables, const int32_t *ctx_lens,
                             const int64_t *rows, int max_blocks, int block_size, int num_heads,
                             int num_kv_heads, int head_dim, int head_dim_v,
                             int64_t q_token_stride, int64_t q_head_stride, float scale, int window,
                             float softcap, const float *sinks) {
#pragma omp parallel for num_threads(parts) schedule(static, 1)
  for (int p = 0; p < parts; ++p)
    FN(paged_decode)(out, q, k_cache, v_cache, block_tables, ctx_lens, rows, bounds[p],
                     bounds[p + 1], max_blocks, block_size, num_heads, num_kv_heads, head_dim,
                     head_dim_v, q_token_stride, q_head_stride, scale, window, softcap, sinks);
}
