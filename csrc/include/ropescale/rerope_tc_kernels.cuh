// The tensor-core prefill's body (rerope_attention_tc.cuh) and its two kernels, dense and paged.
#pragma once

#include <cmath>
#include <cstdint>

#include "ropescale/portable.h"
#include "ropescale/rerope_math.h"
#include "ropescale/rerope_params.h"
#include "ropescale/rerope_tc_mma.cuh"
#include "ropescale/rerope_tc_problems.cuh"
#include "ropescale/rerope_tc_tiles.cuh"
#include "ropescale/turn_angles.h"

namespace ropescale::rerope_cuda {

// The prefill body over a problem. p.k and p.v rows (and the rotated buffers') must be 16-byte aligned
// (head dim and row / head / batch or page strides multiples of 8).
template <typename T, int kHeadDim, class Problem>
__device__ void rerope_prefill_tc_block(const ReropeParams& p, const Problem& problem) {
  using namespace tc;
  using S = Shape<kHeadDim>;
  ROPESCALE_DYNAMIC_SMEM(T, smem);
  T* const q_near_s = smem;
  T* const q_far_s = q_near_s + S::kQElems;
  T* const k_s = q_far_s + S::kQElems;  // near-side or far-side keys of the current tile
  T* const v_s = k_s + S::kKElems;
  KeyRate* const rates_s = reinterpret_cast<KeyRate*>(v_s + S::kKElems);  // kRotatesKeys: the request's turn rates
  [[maybe_unused]] const bool far_rotated = p.rule.far_key_rotated();

  const int head = problem.head;
  const int kv_head = head / (p.q_heads / p.kv_heads);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // the row group and column pair of the mma fragments
  const int q_len = problem.q_len, k_len = problem.k_len;
  const int q0 = problem.query_block * kBlockM;
  const int n_tiles = (k_len + kBlockN - 1) / kBlockN;
  const float scale = problem.scale();

  // Rows g and g + 8 of the warp's slice: positions (-1 past the queries: never visible), the first key
  // of their near side, and the f32 score factor scale * log-n, times log2(e) for exp2. Positions are at
  // most kMaxPosition (< 2^31; padding clamped to -1), so 32-bit registers hold them: the paged D-128
  // kernel has no registers to spare, and the near start is worked out once per row, not per tile.
  RowBounds rows_of_warp;
  float row_factor[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int query = q0 + 16 * warp + g + 8 * h;
    const int64_t position = query < q_len ? problem.query_position(query) : -1;
    rows_of_warp.position[h] = position < 0 ? -1 : static_cast<int>(position);
    const int64_t near_start = out_of_line_near_start(p.rule, position < 0 ? 0 : position);
    rows_of_warp.near_start[h] = static_cast<int>(near_start < -0x7fffffff ? -0x7fffffff : near_start);
    row_factor[h] = scale * rerope_logn_scale(position, p.logn_length, p.inv_log_train) * 1.4426950408889634f;
  }
  // Position bounds of the block's 64 queries and of the warp's 16 (rows past q_len left out).
  PositionRange block_q, warp_q;
  for (int r = lane; r < kBlockM; r += 32)
    if (q0 + r < q_len) block_q.add(problem.query_position(q0 + r));
  if (lane < 16 && q0 + 16 * warp + lane < q_len) warp_q.add(problem.query_position(q0 + 16 * warp + lane));
  const QueryBounds block_bounds = out_of_line_query_bounds(warp_reduce_range(block_q), p.rule);
  const QueryBounds warp_bounds = out_of_line_query_bounds(warp_reduce_range(warp_q), p.rule);

  store_query_rows<T, kHeadDim>(p, problem, q0, q_near_s, q_far_s);
  if constexpr (Problem::kRotatesKeys) {  // visible after the first tile's barrier, as the query rows
    const KeyRate* const rates = problem.key_rates();
    for (int pair = tid; pair < p.rotary_pairs; pair += kThreads) rates_s[pair] = rates[pair];
  }

  // The keys of one side of a tile into the K tile (rows past k_len zero-filled), as one cp.async group.
  // (Where the rows lie is worked out at each load, from the problem: kept live across the loop, the
  // three row sources cost the paged D-128 kernel its last registers.)
  const auto load_keys = [&](int tile, bool far_side) {
    const int j0 = tile * kBlockN, rows = k_len - j0 < kBlockN ? k_len - j0 : kBlockN;
    if (far_side)
      load_key_rows_async<T, kHeadDim>(k_s, problem.far_keys(kv_head), j0, rows);
    else
      load_key_rows_async<T, kHeadDim>(k_s, problem.near_keys(kv_head), j0, rows);
    device::cp_async_commit();
  };
  // The block's class of a tile: what is loaded. A near tile loads near keys, a far tile far keys, a
  // band tile near keys first, then far keys into the same K tile.
  const auto block_class = [&](int tile) {
    return rerope_classify_tile(block_bounds, problem.key_tile(tile), p.causal);
  };

  float o[S::kDimBlocks][4];
#pragma unroll
  for (int j = 0; j < S::kDimBlocks; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // log2 domain; sum: this lane's
  bool seen[2] = {false, false};  // rows g, g + 8 had a visible pair among this lane's (by the mask)

  int tile = next_active_tile(problem, 0, n_tiles, block_bounds, p.causal);
  if (tile < n_tiles) load_keys(tile, block_class(tile).kind == TileKind::kFar);
  while (tile < n_tiles) {
    device::cp_async_wait<0>();
    __syncthreads();  // K of `tile` (and the query rows) visible; every warp is done with the last V
    const int j0 = tile * kBlockN, rows = k_len - j0 < kBlockN ? k_len - j0 : kBlockN;
    const TileClass block_tile = block_class(tile);
    const TileKind block_kind = block_tile.kind;
    // V rows of padding keys zero-filled (only tiles with padding look at the positions).
    load_key_rows_async<T, kHeadDim>(v_s, problem.values(kv_head), j0, rows,
                                     block_tile.needs_mask ? problem.padding_positions(j0) : nullptr);
    device::cp_async_commit();

    // Keys rotated here (kRotatesKeys): the tile's near side at p, or a far tile's Leaky far side at p/k
    // (ReRoPE's far side is the raw key), while V loads; the barrier publishes them to every warp.
    if constexpr (Problem::kRotatesKeys) {
      if (block_kind != TileKind::kFar || far_rotated) {  // uniform over the block
        rotate_key_tile<T, kHeadDim>(p, k_s, rates_s, j0, rows, block_kind == TileKind::kFar);
        __syncthreads();
      }
    }
    // This warp's class of the tile (its 16 queries): what it computes.
    const TileClass mine = rerope_classify_tile(warp_bounds, problem.key_tile(tile), p.causal);
    float s[kBlockN / 8][4];
    PairBits bits;
    if (mine.kind == TileKind::kBand || mine.needs_mask)
      bits = pair_bits(rows_of_warp, problem.key_positions(), j0, p.causal);
    // Near scores (near and band warps) from the near keys; on a far tile, far scores from the far keys.
    if (mine.kind == TileKind::kNear || mine.kind == TileKind::kBand ||
        (mine.kind == TileKind::kFar && block_kind == TileKind::kFar)) {
      const bool far = block_kind == TileKind::kFar;
      warp_scores<T, kHeadDim>(far ? q_far_s : q_near_s, k_s, s);
    }
    if (block_kind == TileKind::kBand) {  // second turn of the K tile: the far-side keys
      __syncthreads();  // every warp is done with the near keys
      load_keys(tile, true);
      device::cp_async_wait<0>();
      __syncthreads();
      if constexpr (Problem::kRotatesKeys) {
        if (far_rotated) {  // the far side at the rule's far key positions
          rotate_key_tile<T, kHeadDim>(p, k_s, rates_s, j0, rows, true);
          __syncthreads();
        }
      }
      if (mine.kind == TileKind::kFar) warp_scores<T, kHeadDim>(q_far_s, k_s, s);
      // Band warps: the distance rule picks one side per element (near: distance < w).
      if (mine.kind == TileKind::kBand)
        warp_far_scores_where_far<T, kHeadDim>(q_far_s, k_s, s, bits.near);
    }
    if (mine.kind != TileKind::kSkip) {
      // f32 scale (and log-n) per row, masking, online softmax in the log2 domain.
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float x = s[j][i] * row_factor[i / 2];
          if (mine.needs_mask && !((bits.visible >> (4 * j + i)) & 1u)) x = -INFINITY;  // whatever K held
          s[j][i] = x;
          tile_max[i / 2] = fmaxf(tile_max[i / 2], x);
        }
      if (mine.needs_mask) {
        seen[0] |= (bits.visible & 0x33333333u) != 0u;  // bits 4j + {0, 1}: row g
        seen[1] |= (bits.visible & 0xCCCCCCCCu) != 0u;  // bits 4j + {2, 3}: row g + 8
      } else {
        seen[0] = seen[1] = true;
      }
      // fmaxf skips NaN: a visible NaN score reaches the row through its probability (exp2(NaN)).
      float alpha[2], base[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // the 4 lanes of a row group hold the row's 64 scores
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(kFullMask, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(kFullMask, tile_max[h], 2));
        const float new_max = fmaxf(row_max[h], tile_max[h]);
        base[h] = new_max == -INFINITY ? 0.0f : new_max;  // nothing visible yet: exp2(-inf) = 0
        alpha[h] = exp2f(row_max[h] - base[h]);
        row_max[h] = new_max;
        row_sum[h] *= alpha[h];
      }
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          s[j][i] = exp2f(s[j][i] - base[i / 2]);
          row_sum[i / 2] += s[j][i];
        }
#pragma unroll
      for (int j = 0; j < S::kDimBlocks; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
      }
    }
    const int next = next_active_tile(problem, tile + 1, n_tiles, block_bounds, p.causal);
    device::cp_async_wait<0>();
    // V of `tile` visible; every warp is done with the K tile. On tiles with masked pairs, whether V
    // holds a non-finite value (each thread scans the chunks it copied, visible to it after its wait).
    bool v_nonfinite = false;
    if (block_tile.needs_mask) {
      bool found = false;
      for (int c = tid; c < kBlockN * S::kChunks; c += kThreads)
        found |= chunk_has_nonfinite(v_s + smem_offset<kHeadDim>(c / S::kChunks, c % S::kChunks));
      v_nonfinite = __syncthreads_or(found) != 0;
    } else {
      __syncthreads();
    }
    if (next < n_tiles) load_keys(next, block_class(next).kind == TileKind::kFar);
    if (mine.kind != TileKind::kSkip) {
      if (v_nonfinite && mine.needs_mask)
        warp_pv_skip_masked<T, kHeadDim>(s, bits.visible, v_s, o);
      else
        warp_pv<T, kHeadDim>(s, v_s, o);
    }
    tile = next;
  }

  // Normalise and store rows g and g + 8 of the warp's slice. A row without a visible key: zeros and
  // -inf; one with a visible key but a sum that is not > 0 (NaN, or every visible score -inf):
  // non-finite output and lse NaN, as softmax gives.
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float total = row_sum[h];
    total += __shfl_xor_sync(kFullMask, total, 1);
    total += __shfl_xor_sync(kFullMask, total, 2);
    int row_seen = seen[h] ? 1 : 0;
    row_seen |= __shfl_xor_sync(kFullMask, row_seen, 1);
    row_seen |= __shfl_xor_sync(kFullMask, row_seen, 2);
    const int query = q0 + 16 * warp + g + 8 * h;
    if (query >= q_len) continue;
    const int64_t row = problem.out_row(query);
    const float inv = row_seen ? 1.0f / total : 0.0f;
#pragma unroll
    for (int j = 0; j < S::kDimBlocks; ++j)  // one 32-bit store per pair of dims
      device::store_pair<T>(out + row * kHeadDim + 8 * j + 2 * t, o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
    if (t == 0)
      p.lse[row] = !row_seen        ? -INFINITY
                   : total > 0.0f ? (row_max[h] + log2f(total)) * 0.6931471805599453f
                                  : NAN;
  }
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads, tc::Shape<kHeadDim>::kMinBlocksPerSm)
    rerope_prefill_tc_kernel(const ReropeParams p, const KeyTile* tiles) {
  rerope_prefill_tc_block<T, kHeadDim>(p, TcDenseProblem<T>(p, tiles));
}

// rerope_attention_paged's prefill rows: the same body over the requests the schedule kernel gave the
// tensor cores (TcPagedProblem).
// One kernel for both paths of a request (kPagedTcPreRotated, kPagedTcRotating): a block-uniform branch,
// so that one launch serves every tensor-core row whatever the budget left to each.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads, tc::Shape<kHeadDim>::kMinBlocksPerSm)
    rerope_paged_tc_kernel(const ReropeParams p) {
  const PagedTask task = p.paged_tc_tasks[blockIdx.x];
  if (task.request < 0) return;  // past the tasks: uniform over the block, before any barrier
  if (p.paged_requests[task.request].tensor_core == kPagedTcRotating)
    rerope_prefill_tc_block<T, kHeadDim>(p, TcPagedProblem<T, true>(p, task));
  else
    rerope_prefill_tc_block<T, kHeadDim>(p, TcPagedProblem<T, false>(p, task));
}

}  // namespace ropescale::rerope_cuda
