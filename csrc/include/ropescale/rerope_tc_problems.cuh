// The problems of the tensor-core prefill (rerope_attention_tc.cuh), as rerope_simt_problems.cuh's for
// the SIMT body: a dense batch row or a paged prefill request, one kernel body for both.
#pragma once

#include <cstdint>

#include "ropescale/portable.h"
#include "ropescale/rerope_math.h"
#include "ropescale/rerope_params.h"
#include "ropescale/rerope_tc_tiles.cuh"
#include "ropescale/turn_angles.h"

namespace ropescale::rerope_cuda {

// What a tensor-core block works on (as DenseProblem / PagedProblem do for the SIMT body): the 64
// queries of query block `query_block` of one q head, over one batch row of rerope_attention
// (TcDenseProblem) or one request of rerope_attention_paged (TcPagedProblem). The body reads
// positions, key-tile bounds, q, the query rotation, the key and value rows, the output rows and the
// softmax scale only through these.

// Grid: x = query blocks (heaviest first), y = q heads, z = batch. p.k_near (and p.k_far for Leaky)
// hold the keys rotated by rerope_rotate_keys_kernel<T, T>: T [B, Hkv, Lk, D], contiguous; `tiles` the
// key-tile bounds of rerope_key_tiles_kernel.
template <typename T>
struct TcDenseProblem {
  static constexpr bool kRotatesKeys = false;  // keys pre-rotated by rerope_rotate_keys_kernel
  const ReropeParams& p;
  const KeyTile* tiles;  // this batch row's
  int b, head, query_block, q_len, k_len;
  bool active = true;

  __device__ TcDenseProblem(const ReropeParams& params, const KeyTile* key_tiles)
      : p(params),
        b(static_cast<int>(blockIdx.z)),
        head(static_cast<int>(blockIdx.y)),
        query_block(static_cast<int>(gridDim.x - 1 - blockIdx.x)),  // the longest rows first
        q_len(params.q_len),
        k_len(params.k_len) {
    tiles = key_tiles + static_cast<int64_t>(b) * ((k_len + tc::kBlockN - 1) / tc::kBlockN);
  }
  __device__ int64_t query_position(int query) const { return p.q_positions[static_cast<int64_t>(b) * q_len + query]; }
  __device__ int64_t key_position(int key) const {
    return key < k_len ? p.k_positions[static_cast<int64_t>(b) * k_len + key] : -1;
  }
  // What pair_bits reads the key positions from (not the problem: see tc::StoredKeyPositions).
  __device__ tc::StoredKeyPositions key_positions() const {
    return {p.k_positions + static_cast<int64_t>(b) * k_len, k_len};
  }
  __device__ PositionRange key_tile(int tile) const { return tc::key_tile_range(tiles[tile]); }
  // The positions of the tile's keys when some may be padding (their V rows are zero-filled).
  __device__ const int64_t* padding_positions(int j0) const {
    return p.k_positions + static_cast<int64_t>(b) * k_len + j0;
  }
  __device__ const T* q_row(int query) const {
    return static_cast<const T*>(p.q) + b * p.q_stride_b + head * p.q_stride_h + query * p.q_stride_l;
  }
  __device__ int64_t rotation_row(int query) const { return static_cast<int64_t>(b) * q_len + query; }
  __device__ int64_t out_row(int query) const { return (static_cast<int64_t>(b) * p.q_heads + head) * q_len + query; }
  __device__ float scale() const { return p.scale; }
  __device__ const KeyRate* key_rates() const { return p.key_rates; }
  __device__ tc::KeyRows<T> near_keys(int kv_head) const {
    return {static_cast<const T*>(p.k_near) + (static_cast<int64_t>(b) * p.kv_heads + kv_head) * k_len * p.head_dim,
            p.head_dim};
  }
  // The keys rotated at the rule's far position (Leaky, Self-Extend, Dual Chunk); ReRoPE: the raw keys.
  __device__ tc::KeyRows<T> far_keys(int kv_head) const {
    if (p.rule.far_key_rotated())
      return {static_cast<const T*>(p.k_far) + (static_cast<int64_t>(b) * p.kv_heads + kv_head) * k_len * p.head_dim,
              p.head_dim};
    return {static_cast<const T*>(p.k) + b * p.k_stride_b + kv_head * p.k_stride_h, p.k_stride_l};
  }
  __device__ tc::KeyRows<T> values(int kv_head) const {
    return {static_cast<const T*>(p.v) + b * p.v_stride_b + kv_head * p.v_stride_h, p.v_stride_l};
  }
};

// Grid: x = the schedule kernel's tensor-core tasks (request, query block), y = q heads. The request's
// keys 0 .. seq_len - 1 (slot j at position j, no padding), its queries at seq_len - q_len + i; the
// values are read in place, through the block table. Its keys, by the request's path:
//   kRotate false (kPagedTcPreRotated): p.k_near and p.k_far hold their two sides (rerope_paged_rotate_keys_
//     kernel; ReRoPE's far side is the raw key) from row p.paged_tc_key_offsets[r] on (T [rows, Hkv, D]);
//   kRotate true (kPagedTcRotating): the raw keys, read through the block table like the values; the
//     body rotates each key tile it loads in shared memory (rotate_key_tile) from the request's turn rates,
//     the near side at p and Leaky's far side at p/k (ReRoPE's far side is the raw key), bit for bit the
//     pre-pass's keys: no workspace, so any length stays on the tensor cores.
template <typename T, bool kRotate>
struct TcPagedProblem {
  static constexpr bool kRotatesKeys = kRotate;
  const ReropeParams& p;
  int request = 0, head = 0, query_block = 0, q_len = 0, k_len = 0, q_begin = 0, key_offset = 0;

  __device__ TcPagedProblem(const ReropeParams& params, const PagedTask& t) : p(params) {
    const PagedRequest r = p.paged_requests[t.request];
    request = t.request;
    head = static_cast<int>(blockIdx.y);
    query_block = t.query_block;
    q_len = r.q_len;
    k_len = r.seq_len;
    q_begin = r.q_begin;
    if constexpr (!kRotate) key_offset = p.paged_tc_key_offsets[t.request];
  }
  __device__ int64_t query_position(int query) const { return static_cast<int64_t>(k_len) - q_len + query; }
  __device__ int64_t key_position(int key) const { return key < k_len ? key : -1; }
  // What pair_bits reads the key positions from: the problem itself (its key_position reads no parameter).
  __device__ const TcPagedProblem& key_positions() const { return *this; }
  __device__ PositionRange key_tile(int tile) const {
    const int j0 = tile * tc::kBlockN, count = k_len - j0 < tc::kBlockN ? k_len - j0 : tc::kBlockN;
    PositionRange r;
    r.min = j0;
    r.max = j0 + count - 1;
    r.count = count;
    r.any_padding = count < tc::kBlockN;  // keys past the last: never visible
    return r;
  }
  __device__ const int64_t* padding_positions(int) const { return nullptr; }  // no padding keys
  __device__ const T* q_row(int query) const {
    return static_cast<const T*>(p.q) + static_cast<int64_t>(q_begin + query) * p.q_stride_l + head * p.q_stride_h;
  }
  __device__ int64_t rotation_row(int query) const { return q_begin + query; }
  __device__ int64_t out_row(int query) const { return static_cast<int64_t>(q_begin + query) * p.q_heads + head; }
  __device__ float scale() const { return p.scale_factors ? p.scale * p.scale_factors[request] : p.scale; }
  __device__ const KeyRate* key_rates() const { return p.key_rates + request * p.inv_freq_stride; }
  __device__ tc::KeyRows<T> near_keys(int kv_head) const {
    if constexpr (kRotate) return cache_keys(kv_head);
    return {static_cast<const T*>(p.k_near) + (static_cast<int64_t>(key_offset) * p.kv_heads + kv_head) * p.head_dim,
            static_cast<int64_t>(p.kv_heads) * p.head_dim};
  }
  __device__ tc::KeyRows<T> far_keys(int kv_head) const {
    if constexpr (kRotate) return cache_keys(kv_head);
    return {static_cast<const T*>(p.k_far) + (static_cast<int64_t>(key_offset) * p.kv_heads + kv_head) * p.head_dim,
            static_cast<int64_t>(p.kv_heads) * p.head_dim};
  }
  __device__ tc::KeyRows<T> cache_keys(int kv_head) const {
    return {static_cast<const T*>(p.k) + kv_head * p.k_stride_h, p.k_stride_l, table(), p.block_size, p.k_stride_b};
  }
  __device__ tc::KeyRows<T> values(int kv_head) const {
    return {static_cast<const T*>(p.v) + kv_head * p.v_stride_h, p.v_stride_l, table(), p.block_size, p.v_stride_b};
  }
  __device__ const int* table() const { return p.block_table + static_cast<int64_t>(request) * p.max_blocks; }
};

}  // namespace ropescale::rerope_cuda
