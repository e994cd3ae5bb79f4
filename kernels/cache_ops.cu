// cache_ops.cu - writes into and copies within the paged KV cache.
// Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, so a token's
// row of num_kv_heads * head_dim elements starts at slot * row and a block is one contiguous range.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// A 16-byte unit: copy_blocks moves caches of any dtype with vector loads and stores.
struct __align__(16) Unit16 {
  unsigned int w[4];
};

// Writes each new token's K and V rows into its slot; slot < 0 marks padding and is skipped.
// grid = (tokens); key/value may be any strided views with contiguous head_dim (e.g. from [1, H, T, D]).
template <typename T>
__global__ void reshape_and_cache(const T* __restrict__ key,    // [tokens, num_kv_heads, head_dim]
                                  const T* __restrict__ value,  // [tokens, num_kv_heads, head_dim_v]
                                  T* __restrict__ k_cache, T* __restrict__ v_cache,
                                  const long long* __restrict__ slot_mapping,  // [tokens]
                                  int key_token, int key_head, int value_token, int value_head,  // strides
                                  int num_kv_heads, int head_dim, int head_dim_v) {
  const long long token = blockIdx.x, slot = slot_mapping[token];
  if (slot < 0) return;
  const int k_row = num_kv_heads * head_dim, v_row = num_kv_heads * head_dim_v;
  for (int i = threadIdx.x; i < k_row; i += blockDim.x)
    k_cache[slot * k_row + i] = key[token * key_token + (long long)(i / head_dim) * key_head + i % head_dim];
  for (int i = threadIdx.x; i < v_row; i += blockDim.x)
    v_cache[slot * v_row + i] =
        value[token * value_token + (long long)(i / head_dim_v) * value_head + i % head_dim_v];
}

// Copies block src -> dst for every (src, dst) pair in every layer's K and V cache, in one launch.
// grid = (pairs, layers); caches are addressed through arrays of per-layer device pointers.
extern "C" __global__ void copy_blocks(const unsigned long long* __restrict__ k_caches,  // [layers]
                                       const unsigned long long* __restrict__ v_caches,  // [layers]
                                       const int* __restrict__ pairs,  // [pairs, 2]: src, dst block
                                       long long k_block_units,        // 16-byte units per K block
                                       long long v_block_units) {
  const long long src = pairs[2 * blockIdx.x], dst = pairs[2 * blockIdx.x + 1];
  Unit16* k = reinterpret_cast<Unit16*>(k_caches[blockIdx.y]);
  Unit16* v = reinterpret_cast<Unit16*>(v_caches[blockIdx.y]);
  for (long long i = threadIdx.x; i < k_block_units; i += blockDim.x)
    k[dst * k_block_units + i] = k[src * k_block_units + i];
  for (long long i = threadIdx.x; i < v_block_units; i += blockDim.x)
    v[dst * v_block_units + i] = v[src * v_block_units + i];
}
