// The SIMT kernels (rerope_attention.cuh): one block body over a dense or a paged problem, its prefill,
// decode and paged kernels, and the combine of the key splits.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ropescale/portable.h"
#include "ropescale/element.h"
#include "ropescale/rerope_math.h"
#include "ropescale/rerope_params.h"
#include "ropescale/rerope_simt_problems.cuh"
#include "ropescale/rerope_simt_tiles.cuh"
#include "ropescale/turn_angles.h"

namespace ropescale::rerope_cuda {

// The kernel body shared by prefill (keys pre-rotated in global memory; dense problems only) and
// decode (keys rotated here, tile by tile, only where needed), over a dense batch row or a paged
// request (Problem).
template <typename T, class Shape, bool kKeysPreRotated, class Problem>
__device__ void rerope_attention_block(const ReropeParams& p) {
  static_assert(!kKeysPreRotated || std::is_same_v<Problem, DenseProblem>, "pre-rotated keys: dense problems only");
  constexpr int kR = Shape::kRowsPerWarp;
  const Problem problem(p, Shape::kRows);
  if (!problem.task.active) return;  // uniform over the block, before any barrier
  ROPESCALE_DYNAMIC_SMEM(float, smem);
  SmemTiles<Shape> s(smem);
  unsigned char* const smem_bytes = reinterpret_cast<unsigned char*>(smem);
  BlockRows<Shape>& rows = *reinterpret_cast<BlockRows<Shape>*>(smem_bytes + Shape::kRowTableOffset);
  // By tile parity: a skipped tile may run ahead.
  long long (*tile_positions)[kBlockK] = reinterpret_cast<long long (*)[kBlockK]>(smem_bytes + Shape::kTilePositionsOffset);
  TileRow (*tile_rows)[kBlockK] = reinterpret_cast<TileRow (*)[kBlockK]>(smem_bytes + Shape::kTileRowsOffset);

  const int b = problem.task.problem, kv_head = problem.task.kv_head;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;
  const int padded_dim = (p.head_dim + 3) / 4 * 4;
  const bool far_rotated = p.rule.far_key_rotated();
  const KeyRate* const key_rates = problem.key_rates();

  map_block_rows<Shape>(p, problem, rows);
  __syncthreads();
  RowAccumulators<Shape> st;
  st.init();
  // A paged request whose metadata would read outside the cache (rerope_paged_schedule_kernel): NaN
  // rows, no key read.
  if (problem.task.poisoned) {
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      st.row_max[r] = st.row_sum[r] = NAN;
#pragma unroll
      for (int t = 0; t < Shape::kDimsPerLane; ++t) st.acc[r][t] = NAN;
    }
    st.seen = ~0u;
    store_rows<T, Shape>(p, problem, rows, st);
    return;
  }
  const int keys_per_split = problem.keys_per_split();
  const int key_begin = problem.task.split * keys_per_split;
  const int key_end =
      key_begin + keys_per_split < problem.task.k_len ? key_begin + keys_per_split : problem.task.k_len;
  // Bounds of the block's query positions, computed by every thread (no shuffles, no barrier).
  PositionRange query_range;
  for (int r = 0; r < Shape::kRows; ++r)
    if (rows.valid[r]) query_range.add(rows.position[r]);
  // (A split past the problem's keys stores its empty rows, -inf, for the combine.)
  if (key_begin < key_end) load_query_rows<T, Shape>(p, problem, rows, s, padded_dim);

  const T* k = static_cast<const T*>(p.k) + problem.k_base();
  const T* v = static_cast<const T*>(p.v) + problem.v_base();
  const int64_t rotated_offset = (static_cast<int64_t>(b) * p.kv_heads + kv_head) * p.k_len * p.head_dim;

  for (int j0 = key_begin, parity = 0; j0 < key_end; j0 += kBlockK, parity ^= 1) {
    const int keys_in_tile = key_end - j0 < kBlockK ? key_end - j0 : kBlockK;
    if (tid < kBlockK) {
      tile_positions[parity][tid] = tid < keys_in_tile ? problem.key_position(j0 + tid) : -1;
      if (tid < keys_in_tile) problem.locate_key(j0 + tid, &tile_rows[parity][tid]);
    }
    __syncthreads();  // positions published; the previous tile is consumed (and the query rows written)
    const TileRow* const key_rows = tile_rows[parity];
    const auto k_row = [&](int j) { return problem.k_row(key_rows, j0, j); };
    const auto v_row = [&](int j) { return problem.v_row(key_rows, j0, j); };
    // Every thread classifies the same positions, so the whole block agrees on the tile's class.
    PositionRange key_range;
    for (int j = 0; j < keys_in_tile; ++j) key_range.add(tile_positions[parity][j]);
    TileClass tile = rerope_classify_tile(query_range, key_range, p.rule, p.causal);
    if (tile.kind == TileKind::kSkip) continue;
    tile.needs_mask |= keys_in_tile < kBlockK;  // lanes past the last key (position -1: never visible)
    const int64_t key_position = tile_positions[parity][lane];
    const bool need_near = tile.kind != TileKind::kFar, need_far = tile.kind != TileKind::kNear;

    // One side of the key tile into `dst` (zeros past the keys and past D). Prefill: the
    // pre-rotated keys (far side: p.k_far when the rule rotates far keys, the raw keys for ReRoPE). Decode:
    // the raw keys, then, per rotation pair, rotated in place (near at p, far at the rule's index, from the pair's turn rates:
    // no FP64 per key; ReRoPE's far side is the raw key); one thread reads and writes each pair. Ends
    // before the barrier that publishes it.
    const auto stage_keys = [&](bool far_side, float* dst) {
      if constexpr (kKeysPreRotated) {
        if (!far_side || far_rotated)
          load_tile<float, Shape::kKStride>(
              static_cast<const float*>(far_side ? p.k_far : p.k_near) + rotated_offset +
                  static_cast<int64_t>(j0) * p.head_dim,
              [&](int j) { return static_cast<int64_t>(j) * p.head_dim; }, keys_in_tile, p.head_dim, padded_dim, dst);
        else
          load_tile<T, Shape::kKStride>(k, k_row, keys_in_tile, p.head_dim, padded_dim, dst);
      } else {
        load_tile<T, Shape::kKStride>(k, k_row, keys_in_tile, p.head_dim, padded_dim, dst);
        if (far_side && !far_rotated) return;
        __syncthreads();
        for (int idx = tid; idx < kBlockK * p.rotary_pairs; idx += kThreads) {
          const int j = idx / p.rotary_pairs, pair = idx % p.rotary_pairs;
          int first, second;
          rotary_pair_dims(pair, p.rotary_pairs, p.interleaved, &first, &second);
          float* row = dst + j * Shape::kKStride;
          const int64_t pos = j < keys_in_tile ? tile_positions[parity][j] : 0;
          const KeyRate rate = key_rates[pair];
          float sin_v, cos_v, a, c;
          position_sincos(far_side ? p.rule.far_key_index(pos) : pos, far_side ? rate.far : rate.near, &sin_v, &cos_v);
          rotate_key_pair_fma(row[first], row[second], cos_v, sin_v, &a, &c);
          row[first] = round_to<T>(a);
          row[second] = round_to<T>(c);
        }
      }
    };

    load_tile<T, Shape::kVStride>(v, v_row, keys_in_tile, p.head_dim, padded_dim, s.v);
    // Scores from operands picked by pointer, never a score array picked at run time (that would
    // demote both arrays to local memory): far tiles score from the far operands, band tiles fill
    // far_scores as well.
    float scores[kR], far_scores[kR];
    const bool far = tile.kind == TileKind::kFar;
    if constexpr (Shape::kKeyTiles == 2) {
      if (need_near) stage_keys(false, s.k_near);
      if (need_far) stage_keys(true, s.k_far);
      __syncthreads();
      warp_scores<Shape>(far ? s.q_far : s.q_near, far ? s.k_far : s.k_near, padded_dim, scores);
      if (tile.kind == TileKind::kBand) warp_scores<Shape>(s.q_far, s.k_far, padded_dim, far_scores);
    } else {  // one key tile: a band tile's far side after its near scores
      stage_keys(far, s.k_near);
      __syncthreads();
      warp_scores<Shape>(far ? s.q_far : s.q_near, s.k_near, padded_dim, scores);
      if (tile.kind == TileKind::kBand) {
        __syncthreads();  // every warp is done with the near keys
        stage_keys(true, s.k_near);
        __syncthreads();
        warp_scores<Shape>(s.q_far, s.k_near, padded_dim, far_scores);
      }
    }
    process_tile<T, Shape>(p, rows, s, tile, key_position, scores, far_scores, st);
  }
  store_rows<T, Shape>(p, problem, rows, st);
}

template <typename T, class Shape>
__global__ void __launch_bounds__(kThreads, Shape::kMinBlocksPerSm) rerope_prefill_kernel(const ReropeParams p) {
  rerope_attention_block<T, Shape, true, DenseProblem>(p);
}

template <typename T, class Shape>
__global__ void __launch_bounds__(kThreads, Shape::kMinBlocksPerSm) rerope_decode_kernel(const ReropeParams p) {
  rerope_attention_block<T, Shape, false, DenseProblem>(p);
}

template <typename T, class Shape>
__global__ void __launch_bounds__(kThreads, Shape::kMinBlocksPerSm) rerope_paged_kernel(const ReropeParams p) {
  rerope_attention_block<T, Shape, false, PagedProblem>(p);
}

// Merges the decode splits of each row by their log-sum-exp. One warp per row, lanes over D.
// Memory-bound: 8 resident blocks per SM asked for (64 registers; it needs about 40). A split
// without a visible key has lse -inf and is left out; one with a non-finite row (lse NaN, or a
// non-finite column) makes the merged row non-finite, never zeros.
template <typename T>
__global__ void __launch_bounds__(kThreads, 8) rerope_combine_kernel(const ReropeParams p) {
  const int64_t rows_total = static_cast<int64_t>(p.batch) * p.q_heads * p.q_len;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (row >= rows_total) return;
  float max_lse = -INFINITY;
  bool seen = false;
  for (int s = 0; s < p.num_splits; ++s) {
    const float lse = p.partial_lse[s * rows_total + row];
    max_lse = fmaxf(max_lse, lse);
    seen |= lse != -INFINITY;
  }
  float total = 0.0f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float lse = p.partial_lse[s * rows_total + row];
    total += lse == -INFINITY ? 0.0f : expf(lse - max_lse);
  }
  for (int d = lane; d < p.head_dim; d += 32) {
    float value = 0.0f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float lse = p.partial_lse[s * rows_total + row];
      if (lse != -INFINITY) value += expf(lse - max_lse) * p.partial_out[(s * rows_total + row) * p.head_dim + d];
    }
    static_cast<T*>(p.out)[row * p.head_dim + d] = from_acc<T>(seen ? value / total : 0.0f);
  }
  if (lane == 0) p.lse[row] = seen ? max_lse + logf(total) : -INFINITY;
}

}  // namespace ropescale::rerope_cuda
