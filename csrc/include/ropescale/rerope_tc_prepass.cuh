// The tensor-core prefill's own pre-passes (rerope_attention_tc.cuh): the queries' sin/cos and the
// key-tile bounds of a dense launch, the keys (through the block table) and the queries' sin/cos of the
// paged requests. The keys' turn rates and the dense keys come from rerope_key_prepass.cuh.
#pragma once

#include <cstdint>

#include "ropescale/portable.h"
#include "ropescale/rerope_key_prepass.cuh"
#include "ropescale/rerope_math.h"
#include "ropescale/rerope_params.h"
#include "ropescale/rerope_tc_tiles.cuh"
#include "ropescale/rotary_math.h"

namespace ropescale::rerope_cuda {

// Tensor-core prefill pre-pass: sin and cos of every query's rotation pairs, near side (at p) and far
// side (at w + (p - w)/k), into p.q_rotation [B, Lq, rotary_pairs, 4] = (sin, cos near, sin, cos
// far): once per (query, pair) rather than once per head in every block's prologue, which would
// repeat the double-precision reduction Hq times. One thread per (batch, query, pair). (A template
// only so that the header may be included by several translation units of one program.)
__device__ __forceinline__ float4 query_rotation(const ReropeParams& p, int64_t pos, float inv_freq) {
  float4 sc;
  sc.x = 0.0f, sc.y = 1.0f, sc.z = 0.0f, sc.w = 1.0f;  // padding queries: never read
  if (pos >= 0) {
    rotary_sincos(static_cast<double>(pos), inv_freq, &sc.x, &sc.y);
    rotary_sincos(p.rule.far_query_position(pos), inv_freq, &sc.z, &sc.w);
  }
  return sc;
}
template <int kValuesPerPair>
__global__ void __launch_bounds__(256) rerope_query_rotation_kernel(const ReropeParams p) {
  static_assert(kValuesPerPair == 4, "(sin, cos) near and far");
  const int64_t total = static_cast<int64_t>(p.batch) * p.q_len * p.rotary_pairs;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int pair = static_cast<int>(idx % p.rotary_pairs);
    reinterpret_cast<float4*>(p.q_rotation)[idx] =
        query_rotation(p, p.q_positions[idx / p.rotary_pairs], p.inv_freq[pair]);
  }
}

// Position bounds of every tile of kTile keys, per batch row: tiles[b * n_tiles + t]. Keys past
// k_len count as padding. One warp per tile. (A template only so that the header may be included
// by several translation units of one program.)
template <int kTile>
__global__ void __launch_bounds__(kThreads) rerope_key_tiles_kernel(const ReropeParams p, KeyTile* tiles) {
  const int n_tiles = (p.k_len + kTile - 1) / kTile;
  const int tile = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / 32;
  const int b = static_cast<int>(blockIdx.y), lane = static_cast<int>(threadIdx.x) % 32;
  if (tile >= n_tiles) return;  // warp-uniform
  PositionRange range;
  for (int j = lane; j < kTile; j += 32) {
    const int key = tile * kTile + j;
    range.add(key < p.k_len ? p.k_positions[static_cast<int64_t>(b) * p.k_len + key] : -1);
  }
  range = tc::warp_reduce_range(range);
  if (lane == 0) tiles[static_cast<int64_t>(b) * n_tiles + tile] = KeyTile{range.min, range.max, range.count,
                                                                            range.any_padding ? 1 : 0};
}

// Paged pre-pass: the keys of the tensor-core requests, read through the block table (pages the
// schedule kernel validated; slots < seq_len only) and rotated once for every kv head with the
// request's own table (near side at p = the slot index; Leaky far side at p/k, ReRoPE's the raw key),
// as T into p.k_near and p.k_far [rows, Hkv, D], request r's keys from row paged_tc_key_offsets[r] on. One thread per
// (row, pair), grid-stride over the rows in use (paged_tc_key_offsets[requests], read on the device).
template <typename T>
__global__ void __launch_bounds__(256) rerope_paged_rotate_keys_kernel(const ReropeParams p) {
  const int half_dim = p.head_dim / 2;
  const int* offsets = p.paged_tc_key_offsets;
  const int64_t total = static_cast<int64_t>(offsets[p.requests]) * half_dim;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int pair = static_cast<int>(idx % half_dim);
    const int row = static_cast<int>(idx / half_dim);
    int r = 0, hi = p.requests - 1;  // the last request whose rows start at or before `row`
    while (r < hi) {
      const int mid = (r + hi + 1) / 2;
      if (offsets[mid] <= row) r = mid;
      else hi = mid - 1;
    }
    const int key = row - offsets[r];
    const int64_t page = p.block_table[static_cast<int64_t>(r) * p.max_blocks + key / p.block_size];
    const T* src = static_cast<const T*>(p.k) + page * p.k_stride_b + (key % p.block_size) * p.k_stride_l;
    rotate_key_pair<T, T>(p, p.key_rates + r * p.inv_freq_stride, key, pair,
                          [&](int h) { return src + h * p.k_stride_h; },
                          [&](int h) { return (static_cast<int64_t>(row) * p.kv_heads + h) * p.head_dim; });
  }
}

// Paged pre-pass: one block per tensor-core task, the sin/cos of its queries (at seq_len - q_len + i,
// with the request's own table) into p.q_rotation [T, rotary_pairs, 4] at their tokens' rows. (A
// template only so that the header may be included by several translation units of one program.)
template <int kQueries>
__global__ void __launch_bounds__(256) rerope_paged_query_rotation_kernel(const ReropeParams p) {
  const PagedTask task = p.paged_tc_tasks[blockIdx.x];
  if (task.request < 0) return;
  const PagedRequest r = p.paged_requests[task.request];
  const float* inv_freq = p.inv_freq + task.request * p.inv_freq_stride;
  for (int idx = static_cast<int>(threadIdx.x); idx < kQueries * p.rotary_pairs; idx += static_cast<int>(blockDim.x)) {
    const int query = task.query_block * kQueries + idx / p.rotary_pairs, pair = idx % p.rotary_pairs;
    if (query >= r.q_len) continue;
    const int64_t pos = static_cast<int64_t>(r.seq_len) - r.q_len + query;
    reinterpret_cast<float4*>(p.q_rotation)[static_cast<int64_t>(r.q_begin + query) * p.rotary_pairs + pair] =
        query_rotation(p, pos, inv_freq[pair]);
  }
}

}  // namespace ropescale::rerope_cuda
