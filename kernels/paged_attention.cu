// paged_attention.cu - attention that reads the paged KV cache in place through block tables.
//
// Cache layout per layer: k_cache [num_blocks, BLOCK, num_kv_heads, HEAD], v_cache the same;
// a token's slot is block_id * BLOCK + offset. A CUDA block serves up to MAX_GROUP query heads
// that share one KV head, so K and V are read once for the whole group (grouped-query attention).
// logit = scale * q.k, then softcap * tanh(logit / softcap) when softcap > 0; a query at
// position pos sees keys k <= pos with pos - k < window (window > 0); optional per-head sinks add
// exp(sink) to the softmax denominator only (gpt-oss).
// Compiled with NVRTC on GPUs (pagedinfer/attention/cuda_kernels.py) and with g++ + cpu/cuda_shim.h in
// tests: full-warp shuffles only, no inline PTX, no <cmath> macros such as INFINITY. Asynchronous
// global -> shared copies go through the CUDA pipeline primitives (cp.async on sm_80+), which the shim
// defers until the matching wait, so a read before the wait shows on the CPU too.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline_primitives.h>

#define NEG_INF (-__int_as_float(0x7f800000))

constexpr int NUM_THREADS = 128;
constexpr int NUM_WARPS = NUM_THREADS / 32;
constexpr int MAX_GROUP = 8;                // query heads per CUDA block; larger groups span blocks
constexpr int DECODE_TILE_BYTES = 8192;     // decode: bytes of K (and of V) rows per tile and buffer
constexpr int ROWS_PER_WARP = 4;            // prefill (query token, head) rows per warp
constexpr int PREFILL_ROWS = NUM_WARPS * ROWS_PER_WARP;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// 16 bytes of a K/V row: one vector load. Rows are 16-byte aligned since HEAD * sizeof(T) % 16 == 0.
template <typename T>
struct __align__(16) Vec16 {
  T v[16 / sizeof(T)];
};
template <typename T>
__device__ __forceinline__ Vec16<T> load16(const T* p) { return *reinterpret_cast<const Vec16<T>*>(p); }
template <typename T>
__device__ __forceinline__ Vec16<T> zero16() {
  Vec16<T> z;
  for (int i = 0; i < 16 / int(sizeof(T)); ++i) z.v[i] = from_float<T>(0.f);
  return z;
}

// Start of `key`'s row for `kv_head`, looked up through the sequence's block table.
template <typename T, int HEAD, int BLOCK>
__device__ __forceinline__ const T* kv_row(const T* cache, const int* table, int key, int kv_head,
                                           int num_kv_heads) {
  const long long slot = (long long)table[key / BLOCK] * BLOCK + key % BLOCK;
  return cache + (slot * num_kv_heads + kv_head) * HEAD;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float apply_softcap(float x, float softcap) {
  return softcap > 0.f ? softcap * tanhf(x / softcap) : x;
}
// Factor turning an accumulator (relative to running max m, sum l) into the output, sink included.
__device__ __forceinline__ float output_scale(float m, float l, const float* sinks, int head) {
  if (sinks == nullptr) return 1.f / l;
  const float s = sinks[head], top = fmaxf(m, s), e = __expf(m - top);
  return e / (l * e + __expf(s - top));
}

// Query heads [first, first + count) sharing kv_head, served by the CUDA block at `index`, which
// takes at most `cap` of them.
struct HeadGroup {
  int kv_head, first, count;
};
__device__ __forceinline__ HeadGroup head_group(int index, int num_heads, int num_kv_heads, int cap) {
  const int group = num_heads / num_kv_heads, chunks = (group + cap - 1) / cap;
  const int kv_head = index / chunks, chunk = index % chunks;
  return {kv_head, kv_head * group + chunk * cap, min(cap, group - chunk * cap)};
}

// Decode: one query token per sequence. grid = (num_kv_heads * head chunks, seqs, partitions);
// a CUDA block serves GROUP (<= MAX_GROUP) query heads of one KV head over one partition of the
// visible keys [lo, ctx), lo = max(0, ctx - window), so a few long sequences still fill the GPU.
// * Tiles of TILE keys' K and V rows are copied global -> shared with cp.async (the CUDA pipeline
//   primitives), double-buffered: tile t + 1 is in flight while tile t is scored.
// * Each key's row is read from shared memory by a lane group of LANES lanes (a lane per 16-byte
//   piece; HEAD * sizeof(T) / 16 lanes rounded up to a power of two), the query's matching pieces
//   held in registers for every head of the group; partial dots are summed with xor shuffles
//   inside the group. Each lane group keeps its own online softmax (max, sum, its pieces of the
//   output) over keys g, g + KEY_GROUPS, ... of every tile, so a tile needs no softmax barrier.
// * At the end the groups' states are merged: with shuffles inside a warp, then across the warps
//   through shared memory. One partition writes `out`; several write part_acc/part_ml, merged by
//   paged_decode_merge.
template <typename T, int HEAD, int GROUP>
__global__ void __launch_bounds__(NUM_THREADS)
    paged_decode_kernel(T* __restrict__ out,              // [tokens, num_heads, HEAD]
                        float* __restrict__ part_acc,     // [seqs, num_heads, partitions, HEAD]
                        float* __restrict__ part_ml,      // [seqs, num_heads, partitions, 2]: max, sum
                        const T* __restrict__ query,      // [tokens, num_heads, HEAD]; strides q_token, q_head, 1
                        const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                        const int* __restrict__ query_start_loc,  // [seqs + 1]
                        const int* __restrict__ context_lens,     // [seqs]
                        const int* __restrict__ block_tables,     // [seqs, max_blocks]
                        const float* __restrict__ sinks,          // [num_heads] or null
                        int q_token, int q_head, int num_heads, int num_kv_heads, int max_blocks,
                        int block_shift,  // log2(block size)
                        float scale, int window, float softcap, int partition_size) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int PIECES = HEAD / VEC;  // 16-byte pieces of a row
  constexpr int LANES = PIECES > 16 ? 32 : PIECES > 8 ? 16 : PIECES > 4 ? 8 : 4;  // lanes reading a row
  constexpr int PER_LANE = (PIECES + LANES - 1) / LANES;                          // pieces per lane
  constexpr int KEY_GROUPS = NUM_THREADS / LANES;                                 // rows read side by side
  constexpr int TILE = DECODE_TILE_BYTES / (HEAD * sizeof(T)) / KEY_GROUPS * KEY_GROUPS;  // keys per tile
  constexpr int KEYS_PER_GROUP = TILE / KEY_GROUPS;
  static_assert(KEYS_PER_GROUP >= 1 && HEAD % VEC == 0 && GROUP <= MAX_GROUP, "decode tile shape");
  // Shared memory: two tiles of K and V rows, reused after the key loop for the cross-warp merge.
  constexpr int TILE_BYTES = 4 * TILE * HEAD * sizeof(T), MERGE_BYTES = NUM_WARPS * GROUP * HEAD * 4;
  __shared__ __align__(16) unsigned char s_raw[TILE_BYTES > MERGE_BYTES ? TILE_BYTES : MERGE_BYTES];
  __shared__ float s_ml[NUM_WARPS][GROUP][2];
  T(*s_kv)[2][TILE * HEAD] = reinterpret_cast<T(*)[2][TILE * HEAD]>(s_raw);  // [buffer][K, V][key * HEAD + d]
  float(*s_acc)[GROUP][HEAD] = reinterpret_cast<float(*)[GROUP][HEAD]>(s_raw);  // [warp][head][d]

  const int seq = blockIdx.y, part = blockIdx.z, tid = threadIdx.x, warp = tid / 32;
  const int kg = tid / LANES, lane = tid % LANES;  // key group, and lane (piece) within it
  const int token = query_start_loc[seq];
  if (query_start_loc[seq + 1] == token) return;
  const int ctx = context_lens[seq];
  const int begin = (window > 0 ? max(0, ctx - window) : 0) + part * partition_size;
  if (begin >= ctx) return;  // this sequence has fewer partitions than the grid
  const int end = min(ctx, begin + partition_size);
  const HeadGroup hg = head_group(blockIdx.x, num_heads, num_kv_heads, GROUP);
  const int* table = block_tables + (long long)seq * max_blocks;
  const int block_mask = (1 << block_shift) - 1;

  // Copies keys [t0, t0 + TILE) & [t0, end) into buffer `buf` and commits them as one batch (an
  // empty batch past the end, so that "all but the newest batch landed" always means this tile).
  auto issue = [&](int t0, int buf) {
    const int n = min(TILE, end - t0);
    for (int i = tid; i < TILE * PIECES; i += NUM_THREADS) {  // consecutive threads: a row's pieces
      const int j = i / PIECES, c = i % PIECES, key = t0 + j;
      if (j < n) {
        const long long slot = ((long long)table[key >> block_shift] << block_shift) + (key & block_mask);
        const long long at = (slot * num_kv_heads + hg.kv_head) * HEAD + c * VEC;
        __pipeline_memcpy_async(&s_kv[buf][0][j * HEAD + c * VEC], k_cache + at, 16);
        __pipeline_memcpy_async(&s_kv[buf][1][j * HEAD + c * VEC], v_cache + at, 16);
      }
    }
    __pipeline_commit();
  };

  float q[GROUP][PER_LANE][VEC];  // this lane's pieces of each head's query, times scale
  float acc[GROUP][PER_LANE][VEC], m[GROUP], l[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m[g] = NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int c = lane + i * LANES;
      const T* qp = query + (long long)token * q_token + (long long)(hg.first + g) * q_head + c * VEC;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {  // element by element: the query view need not be 16-byte aligned
        q[g][i][e] = g < hg.count && c < PIECES ? to_float(qp[e]) * scale : 0.f;
        acc[g][i][e] = 0.f;
      }
    }
  }

  issue(begin, 0);
#pragma unroll 1
  for (int t0 = begin, buf = 0; t0 < end; t0 += TILE, buf ^= 1) {
    issue(t0 + TILE, buf ^ 1);  // buffer buf ^ 1 was released by the barrier ending the last tile
    __pipeline_wait_prior(1);   // this thread's copies of tile t0 have landed ...
    __syncthreads();            // ... and every thread's
    const int n = min(TILE, end - t0);
    const T* s_k = s_kv[buf][0];
    const T* s_v = s_kv[buf][1];
    float s[KEYS_PER_GROUP][GROUP];  // logits, then probabilities, of this group's keys of the tile
#pragma unroll
    for (int r = 0; r < KEYS_PER_GROUP; ++r) {
      const int j = kg + r * KEY_GROUPS;
      float dot[GROUP] = {};
      if (j < n)  // rows past n hold stale bytes
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
          const int c = lane + i * LANES;
          if (c < PIECES) {
            const Vec16<T> x = *reinterpret_cast<const Vec16<T>*>(s_k + j * HEAD + c * VEC);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              const float k = to_float(x.v[e]);
#pragma unroll
              for (int g = 0; g < GROUP; ++g) dot[g] += q[g][i][e] * k;
            }
          }
        }
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int o = LANES / 2; o > 0; o >>= 1) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
        s[r][g] = j < n ? apply_softcap(dot[g], softcap) : NEG_INF;
      }
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {  // online softmax of this group's keys
      float m_new = m[g];
#pragma unroll
      for (int r = 0; r < KEYS_PER_GROUP; ++r) m_new = fmaxf(m_new, s[r][g]);
      const float base = m_new == NEG_INF ? 0.f : m_new;  // no key yet: avoid inf - inf
      const float corr = __expf(m[g] - base);
      m[g] = m_new;
      l[g] *= corr;
#pragma unroll
      for (int r = 0; r < KEYS_PER_GROUP; ++r) {
        s[r][g] = __expf(s[r][g] - base);
        l[g] += s[r][g];
      }
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][i][e] *= corr;
    }
#pragma unroll
    for (int r = 0; r < KEYS_PER_GROUP; ++r) {
      const int j = kg + r * KEY_GROUPS;
      if (j < n)
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
          const int c = lane + i * LANES;
          if (c < PIECES) {
            const Vec16<T> x = *reinterpret_cast<const Vec16<T>*>(s_v + j * HEAD + c * VEC);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              const float v = to_float(x.v[e]);
#pragma unroll
              for (int g = 0; g < GROUP; ++g) acc[g][i][e] += s[r][g] * v;
            }
          }
        }
    }
    __syncthreads();  // buffer buf consumed: the next iteration's copies may overwrite it
  }

  // Merge the lane groups of a warp (lanes lane, lane + LANES, ... hold the same pieces) ...
#pragma unroll
  for (int o = LANES; o < 32; o <<= 1)
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float m_o = __shfl_xor_sync(0xffffffffu, m[g], o), l_o = __shfl_xor_sync(0xffffffffu, l[g], o);
      const float top = fmaxf(m[g], m_o), base = top == NEG_INF ? 0.f : top;
      const float a = __expf(m[g] - base), b = __expf(m_o - base);
      m[g] = top;
      l[g] = l[g] * a + l_o * b;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][i][e] = acc[g][i][e] * a + __shfl_xor_sync(0xffffffffu, acc[g][i][e], o) * b;
    }
  // ... then the warps, through shared memory (the tiles' buffers: the loop's last barrier freed them)
  if (tid % 32 < LANES) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        const int c = lane + i * LANES;
        if (c < PIECES)
#pragma unroll
          for (int e = 0; e < VEC; ++e) s_acc[warp][g][c * VEC + e] = acc[g][i][e];
      }
      if (lane == 0) {
        s_ml[warp][g][0] = m[g];
        s_ml[warp][g][1] = l[g];
      }
    }
  }
  __syncthreads();
  const bool single = gridDim.z == 1;
  for (int i = tid; i < hg.count * HEAD; i += NUM_THREADS) {
    const int g = i / HEAD, d = i % HEAD, head = hg.first + g;
    float top = NEG_INF;
    for (int w = 0; w < NUM_WARPS; ++w) top = fmaxf(top, s_ml[w][g][0]);
    float o = 0.f, sum = 0.f;
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float f = s_ml[w][g][0] == NEG_INF ? 0.f : __expf(s_ml[w][g][0] - top);
      o += s_acc[w][g][d] * f;
      sum += s_ml[w][g][1] * f;
    }
    const long long p = ((long long)seq * num_heads + head) * gridDim.z + part;
    if (single) {
      out[((long long)token * num_heads + head) * HEAD + d] = from_float<T>(o * output_scale(top, sum, sinks, head));
    } else {
      part_acc[p * HEAD + d] = o;
      if (d == 0) {
        part_ml[2 * p] = top;
        part_ml[2 * p + 1] = sum;
      }
    }
  }
}

// Merges a decode's partitions: out = sum_p acc_p e^(m_p - M) / (sum_p l_p e^(m_p - M) + e^(sink - M)).
// grid = (num_heads, seqs); a thread per output element.
template <typename T, int HEAD>
__global__ void __launch_bounds__(NUM_THREADS)
    paged_decode_merge(T* __restrict__ out,                 // [tokens, num_heads, HEAD]
                       const float* __restrict__ part_acc,  // [seqs, num_heads, partitions, HEAD]
                       const float* __restrict__ part_ml,   // [seqs, num_heads, partitions, 2]
                       const int* __restrict__ query_start_loc, const int* __restrict__ context_lens,
                       const float* __restrict__ sinks, int num_heads, int partitions, int window,
                       int partition_size) {
  const int head = blockIdx.x, seq = blockIdx.y;
  const int token = query_start_loc[seq];
  if (query_start_loc[seq + 1] == token) return;
  const int ctx = context_lens[seq], len = window > 0 ? min(ctx, window) : ctx;
  const int n = (len + partition_size - 1) / partition_size;  // partitions this sequence wrote
  const long long base = ((long long)seq * num_heads + head) * partitions;
  float top = sinks ? sinks[head] : NEG_INF;
  for (int p = 0; p < n; ++p) top = fmaxf(top, part_ml[2 * (base + p)]);
  float denom = sinks ? __expf(sinks[head] - top) : 0.f;
  for (int p = 0; p < n; ++p) denom += part_ml[2 * (base + p) + 1] * __expf(part_ml[2 * (base + p)] - top);
  for (int d = threadIdx.x; d < HEAD; d += NUM_THREADS) {
    float o = 0.f;
    for (int p = 0; p < n; ++p) o += part_acc[(base + p) * HEAD + d] * __expf(part_ml[2 * (base + p)] - top);
    out[((long long)token * num_heads + head) * HEAD + d] = from_float<T>(o / denom);
  }
}

// Prefill / extend: sequence s's q_len new queries sit at positions ctx - q_len + i and attend
// causally to the cached keys and to the chunk itself. grid = (query tiles, seqs, num_kv_heads *
// head chunks). A block holds PREFILL_ROWS (query token, head) rows of one head group, token-major;
// warp w owns rows 4w..4w+3 and keeps their online softmax in registers. Keys come in tiles of KT:
// K is staged transposed so lane j scores key j, then V reuses the buffer.
template <typename T, int HEAD, int BLOCK>
__global__ void __launch_bounds__(NUM_THREADS)
    paged_prefill_kernel(T* __restrict__ out,          // [tokens, num_heads, HEAD]
                         const T* __restrict__ query,  // [tokens, num_heads, HEAD]; strides q_token, q_head, 1
                         const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                         const int* __restrict__ query_start_loc,  // [seqs + 1]
                         const int* __restrict__ context_lens,     // [seqs]
                         const int* __restrict__ block_tables,     // [seqs, max_blocks]
                         const float* __restrict__ sinks,          // [num_heads] or null
                         int q_token, int q_head, int num_heads, int num_kv_heads, int max_blocks, float scale,
                         int window, float softcap) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CHUNKS = HEAD / VEC;
  constexpr int KT = HEAD * sizeof(T) > 512 ? 16 : 32;  // keys per tile; keeps shared memory < 48 KB
  constexpr int DIMS_PER_LANE = (HEAD + 31) / 32;
  __shared__ float s_q[PREFILL_ROWS][HEAD];
  __shared__ __align__(16) T s_kv[KT * HEAD];  // K transposed [HEAD][KT], then V [KT][HEAD]
  __shared__ float s_p[NUM_WARPS][KT][ROWS_PER_WARP];

  const int seq = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int q_begin = query_start_loc[seq], q_len = query_start_loc[seq + 1] - q_begin;
  const HeadGroup hg = head_group(blockIdx.z, num_heads, num_kv_heads, MAX_GROUP);
  const int per_token = min(num_heads / num_kv_heads, MAX_GROUP);  // rows per query token
  const int tokens = PREFILL_ROWS / per_token, tok0 = blockIdx.x * tokens;
  if (tok0 >= q_len) return;
  const int ctx = context_lens[seq], pos0 = ctx - q_len;  // position of the chunk's first query
  const int hi = pos0 + min(tok0 + tokens, q_len);        // keys [lo, hi) are visible to some row
  const int lo = window > 0 ? max(0, pos0 + tok0 - window + 1) : 0;
  const int* table = block_tables + (long long)seq * max_blocks;

  for (int i = tid; i < PREFILL_ROWS * HEAD; i += NUM_THREADS) {
    const int r = i / HEAD, d = i % HEAD, t = tok0 + r / per_token, g = r % per_token;
    const bool valid = r < tokens * per_token && t < q_len && g < hg.count;
    s_q[r][d] =
        valid ? to_float(query[(long long)(q_begin + t) * q_token + (long long)(hg.first + g) * q_head + d]) * scale
              : 0.f;
  }
  int pos[ROWS_PER_WARP];  // query position of each of this warp's rows; -1 for padding rows
  float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][DIMS_PER_LANE];
#pragma unroll
  for (int r = 0; r < ROWS_PER_WARP; ++r) {
    const int row = warp * ROWS_PER_WARP + r, t = tok0 + row / per_token;
    pos[r] = row < tokens * per_token && t < q_len && row % per_token < hg.count ? pos0 + t : -1;
    m[r] = NEG_INF;
    l[r] = 0.f;
    for (int i = 0; i < DIMS_PER_LANE; ++i) acc[r][i] = 0.f;
  }

  for (int k0 = lo; k0 < hi; k0 += KT) {
    __syncthreads();  // s_q ready; the previous tile's V consumed
    for (int i = tid; i < KT * CHUNKS; i += NUM_THREADS) {  // consecutive threads: consecutive keys
      const int j = i % KT, c = i / KT, key = k0 + j;
      const Vec16<T> x =
          key < hi ? load16(kv_row<T, HEAD, BLOCK>(k_cache, table, key, hg.kv_head, num_kv_heads) + c * VEC)
                   : zero16<T>();
      for (int e = 0; e < VEC; ++e) s_kv[(c * VEC + e) * KT + j] = x.v[e];
    }
    __syncthreads();
    float s[ROWS_PER_WARP] = {};
    if (lane < KT)
#pragma unroll 4
      for (int d = 0; d < HEAD; ++d) {
        const float k = to_float(s_kv[d * KT + lane]);
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) s[r] += s_q[warp * ROWS_PER_WARP + r][d] * k;
      }
    const int key = k0 + lane;
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
      const bool visible = lane < KT && key <= pos[r] && (window <= 0 || pos[r] - key < window);
      const float x = visible ? apply_softcap(s[r], softcap) : NEG_INF;
      const float m_new = fmaxf(m[r], warp_max(x));
      const float base = m_new == NEG_INF ? 0.f : m_new;  // nothing visible yet: avoid inf - inf
      const float p = __expf(x - base), corr = __expf(m[r] - base);
      l[r] = l[r] * corr + warp_sum(p);
      m[r] = m_new;
      for (int i = 0; i < DIMS_PER_LANE; ++i) acc[r][i] *= corr;
      if (lane < KT) s_p[warp][lane][r] = p;
    }
    __syncthreads();  // every warp has scored: the buffer can take V
    for (int i = tid; i < KT * CHUNKS; i += NUM_THREADS) {  // zeros past hi: p = 0 must not meet garbage
      const int j = i / CHUNKS, c = i % CHUNKS, key = k0 + j;
      *reinterpret_cast<Vec16<T>*>(&s_kv[j * HEAD + c * VEC]) =
          key < hi ? load16(kv_row<T, HEAD, BLOCK>(v_cache, table, key, hg.kv_head, num_kv_heads) + c * VEC)
                   : zero16<T>();
    }
    __syncthreads();
#pragma unroll 1
    for (int j = 0; j < KT; ++j) {
      float p[ROWS_PER_WARP];
#pragma unroll
      for (int r = 0; r < ROWS_PER_WARP; ++r) p[r] = s_p[warp][j][r];
#pragma unroll
      for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        if (d < HEAD) {
          const float v = to_float(s_kv[j * HEAD + d]);
#pragma unroll
          for (int r = 0; r < ROWS_PER_WARP; ++r) acc[r][i] += p[r] * v;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS_PER_WARP; ++r) {
    if (pos[r] < 0) continue;
    const int row = warp * ROWS_PER_WARP + r, head = hg.first + row % per_token;
    const float f = output_scale(m[r], l[r], sinks, head);
    T* o = out + ((long long)(q_begin + tok0 + row / per_token) * num_heads + head) * HEAD;
    for (int i = 0; i < DIMS_PER_LANE; ++i)
      if (lane + 32 * i < HEAD) o[lane + 32 * i] = from_float<T>(acc[r][i] * f);
  }
}
