// rerope_cache_write_: key / value [T, Hkv, D] (row strides in elements, unit last stride) stored at
// slot_mapping[t] = page * block_size + offset of the caches [num_blocks, Hkv, block_size, D]; a
// negative slot is skipped, as vLLM pads, and so is a slot past the cache (the CPU op refuses it; on
// CUDA a check would cost a host sync). One thread per element: consecutive threads write
// consecutive dims of one (token, head) row, coalesced on both sides.
#pragma once

#include <cstdint>

#include "ropescale/portable.h"
#include "ropescale/rerope_params.h"

namespace ropescale::rerope_cuda {

struct CacheWriteParams {
  void* key_cache = nullptr;
  void* value_cache = nullptr;
  const void* key = nullptr;
  const void* value = nullptr;
  const int64_t* slot_mapping = nullptr;
  int64_t key_stride_t = 0, key_stride_h = 0, value_stride_t = 0, value_stride_h = 0;
  int64_t cache_stride_block = 0, cache_stride_h = 0, cache_stride_slot = 0;  // key cache
  int64_t vcache_stride_block = 0, vcache_stride_h = 0, vcache_stride_slot = 0;  // value cache
  int64_t tokens = 0, slots = 0;
  int kv_heads = 0, head_dim = 0, block_size = 1;
};

template <typename T>
__global__ void __launch_bounds__(256) rerope_cache_write_kernel(const CacheWriteParams p) {
  const int64_t total = p.tokens * p.kv_heads * p.head_dim;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(idx % p.head_dim);
    const int h = static_cast<int>((idx / p.head_dim) % p.kv_heads);
    const int64_t t = idx / (static_cast<int64_t>(p.head_dim) * p.kv_heads);
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0 || slot >= p.slots) continue;
    const int64_t page = slot / p.block_size, offset = slot % p.block_size;
    static_cast<T*>(p.key_cache)[page * p.cache_stride_block + h * p.cache_stride_h + offset * p.cache_stride_slot + d] =
        static_cast<const T*>(p.key)[t * p.key_stride_t + h * p.key_stride_h + d];
    static_cast<T*>(p.value_cache)[page * p.vcache_stride_block + h * p.vcache_stride_h + offset * p.vcache_stride_slot +
                                   d] = static_cast<const T*>(p.value)[t * p.value_stride_t + h * p.value_stride_h + d];
  }
}

template <typename T, class Check = IgnoreLaunchStatus>
inline void launch_rerope_cache_write(const CacheWriteParams& p, cudaStream_t stream, Check&& check = {}) {
  const int64_t total = p.tokens * p.kv_heads * p.head_dim;
  if (total == 0) return;
  const int64_t blocks = (total + 255) / 256 < 65535 ? (total + 255) / 256 : 65535;
  ROPESCALE_LAUNCH_KERNEL(rerope_cache_write_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream, p);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the cache-write kernel");
}

}  // namespace ropescale::rerope_cuda
