// The SIMT tile engine (rerope_attention.cuh): the tile shapes by head dim and shared memory, the
// block's shared-memory views and row table, and the steps of a block: its query rows in, a key or
// value tile in, a tile's scores, its online softmax and P.V, the rows out.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ropescale/portable.h"
#include "ropescale/element.h"
#include "ropescale/rerope_math.h"
#include "ropescale/rerope_paged_plan.h"
#include "ropescale/rerope_params.h"
#include "ropescale/rerope_simt_problems.cuh"
#include "ropescale/rotary_math.h"

namespace ropescale::rerope_cuda {

constexpr int kBlockK = 32;  // keys per tile: one per lane
// The paged sizing rules (rerope_paged_plan.h, free of kernels for the host glue and the Catch2 tests)
// split keys in tiles of this size.
static_assert(kPagedTileKeys == kBlockK, "the SIMT key tile of the paged split rule");

template <int kHeadDimBucket, bool kCompactTiles = false>
struct TileShape {
  static constexpr int kMaxDim = kHeadDimBucket;
  static constexpr bool kCompact = kCompactTiles;
  static_assert(kMaxDim % 32 == 0 && kMaxDim <= 256, "head dim bucket");
  // Register budget of the accumulators; the compact tiles halve it (fewer rows in shared memory).
  static constexpr int kRowsPerWarp = (kMaxDim <= 128 ? 8 : 4) / (kCompact ? 2 : 1);
  static constexpr int kRows = kWarps * kRowsPerWarp;
  // Key tiles in shared memory: near and far side at once (wide), or one side at a time (compact).
  static constexpr int kKeyTiles = kCompact ? 1 : 2;
  static constexpr int kDimsPerLane = kMaxDim / 32;
  static constexpr int kQStride = kMaxDim;     // rows read as broadcasts
  static constexpr int kKStride = kMaxDim + 4;  // lane j reads row j as float4: +4 spreads the banks
  static constexpr int kVStride = kMaxDim;     // lanes read consecutive dims
  // Dynamic shared memory: in floats, q near/far, k near/far (or one k tile), v, per-row
  // probabilities; then the block's row table (BlockRows) and the positions of the current key tile.
  // Everything is dynamic, so the emulation poisons all of it before each block.
  static constexpr int kSmemFloats =
      2 * kRows * kQStride + kKeyTiles * kBlockK * kKStride + kBlockK * kVStride + kRows * kBlockK;
  static constexpr std::size_t kRowTableBytes = kRows * (2 * sizeof(int) + sizeof(long long) + sizeof(bool));
  static constexpr std::size_t kRowTableOffset = kSmemFloats * sizeof(float);
  static constexpr std::size_t kTilePositionsOffset = (kRowTableOffset + kRowTableBytes + 7) / 8 * 8;
  // The (page, slot) of each key of the current tile, by parity (paged problems only).
  static constexpr std::size_t kTileRowsOffset = kTilePositionsOffset + 2 * kBlockK * sizeof(long long);
  static constexpr std::size_t kSmemBytes = kTileRowsOffset + 2 * kBlockK * 2 * sizeof(int);
  // No static shared memory; the whole block must fit an A100 (163 KiB per block, opted in), and
  // the compact tiles the 99 KiB parts (101,376 B per block).
  static_assert(kSmemBytes <= (kCompact ? 101376u : 166912u), "shared memory above the per-block maximum");
  // Blocks per SM the shared memory allows on an A100 (164 KiB per SM, 1 KiB reserved per block),
  // handed to ptxas through __launch_bounds__: without it, ptxas aims at a higher occupancy than
  // the shared memory allows and spills to get there (CUDA 13: 128 registers and spills at D 128).
  static constexpr int kMinBlocksPerSm =
      167936 / (kSmemBytes + 1024) > 0 ? static_cast<int>(167936 / (kSmemBytes + 1024)) : 1;
};

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}
__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

// Shared-memory views of one block. With the compact tiles k_far is k_near: one side at a time.
template <class Shape>
struct SmemTiles {
  float* q_near;  // [kRows][kQStride]
  float* q_far;   // [kRows][kQStride]
  float* k_near;  // [kBlockK][kKStride]
  float* k_far;   // [kBlockK][kKStride]
  float* v;       // [kBlockK][kVStride]
  float* probs;   // [kRows][kBlockK]; kMaskedProb where the pair is masked

  __device__ explicit SmemTiles(float* base)
      : q_near(base),
        q_far(base + Shape::kRows * Shape::kQStride),
        k_near(base + 2 * Shape::kRows * Shape::kQStride),
        k_far(k_near + (Shape::kKeyTiles - 1) * kBlockK * Shape::kKStride),
        v(k_near + Shape::kKeyTiles * kBlockK * Shape::kKStride),
        probs(v + kBlockK * Shape::kVStride) {}
};

// Marks a masked (row, key) pair in SmemTiles::probs: a probability is never -inf (NaN at worst).
constexpr float kMaskedProb = -INFINITY;

// Rows of one block: which (head, query) each row is, its position, and the block's bounds.
template <class Shape>
struct BlockRows {
  int head[Shape::kRows];
  int query[Shape::kRows];
  long long position[Shape::kRows];
  bool valid[Shape::kRows];
};

// Writes the rotated (rounded like T, then scale * log-n scaled in f32) operands of the block's query
// rows: near side at p, far side at w + (p - w)/k. Rows past the problem and padded head dims are zeros.
template <typename T, class Shape, class Problem>
__device__ void load_query_rows(const ReropeParams& p, const Problem& problem, const BlockRows<Shape>& rows,
                                SmemTiles<Shape>& s, int padded_dim) {
  const T* q = static_cast<const T*>(p.q);
  const float* inv_freq = problem.inv_freq();
  const float scale = problem.scale();
  const int tid = static_cast<int>(threadIdx.x);
  // Dims past the rotary ones (copied) and the zero padding up to a multiple of 4.
  for (int idx = tid; idx < Shape::kRows * padded_dim; idx += kThreads) {
    const int r = idx / padded_dim, d = idx % padded_dim;
    if (d < 2 * p.rotary_pairs) continue;
    float x = 0.0f;
    if (rows.valid[r] && d < p.head_dim) {
      const float factor = scale * rerope_logn_scale(rows.position[r], p.logn_length, p.inv_log_train);
      x = to_acc(q[problem.q_offset(rows.head[r], rows.query[r]) + d]) * factor;
    }
    s.q_near[r * Shape::kQStride + d] = x;
    s.q_far[r * Shape::kQStride + d] = x;
  }
  // Rotation pairs.
  for (int idx = tid; idx < Shape::kRows * p.rotary_pairs; idx += kThreads) {
    const int r = idx / p.rotary_pairs, pair = idx % p.rotary_pairs;
    int first, second;
    rotary_pair_dims(pair, p.rotary_pairs, p.interleaved, &first, &second);
    float* near_row = s.q_near + r * Shape::kQStride;
    float* far_row = s.q_far + r * Shape::kQStride;
    if (!rows.valid[r]) {
      near_row[first] = near_row[second] = far_row[first] = far_row[second] = 0.0f;
      continue;
    }
    const int64_t pos = rows.position[r];
    const float factor = scale * rerope_logn_scale(pos, p.logn_length, p.inv_log_train);
    const T* src = q + problem.q_offset(rows.head[r], rows.query[r]);
    const float x1 = to_acc(src[first]), x2 = to_acc(src[second]);
    float sin_v, cos_v, a, c;
    rotary_sincos(static_cast<double>(pos), inv_freq[pair], &sin_v, &cos_v);
    rotate_pair(x1, x2, cos_v, sin_v, &a, &c);
    near_row[first] = round_to<T>(a) * factor;
    near_row[second] = round_to<T>(c) * factor;
    rotary_sincos(p.rule.far_query_position(pos), inv_freq[pair], &sin_v, &cos_v);
    rotate_pair(x1, x2, cos_v, sin_v, &a, &c);
    far_row[first] = round_to<T>(a) * factor;
    far_row[second] = round_to<T>(c) * factor;
  }
}

// Loads a [kBlockK x padded_dim] tile of float rows, row j at base + row_offset(j) (zeros past the
// keys and past D: rows past rows_in_range are never addressed).
template <typename Src, int kStride, class RowOffset>
__device__ void load_tile(const Src* base, RowOffset row_offset, int rows_in_range, int dim, int padded_dim,
                          float* dst) {
  for (int idx = static_cast<int>(threadIdx.x); idx < kBlockK * padded_dim; idx += kThreads) {
    const int j = idx / padded_dim, d = idx % padded_dim;
    dst[j * kStride + d] = (j < rows_in_range && d < dim) ? to_acc(base[row_offset(j) + d]) : 0.0f;
  }
}

// Per-warp state of the online softmax for its rows.
template <class Shape>
struct RowAccumulators {
  static constexpr int kR = Shape::kRowsPerWarp;
  static constexpr int kDims = Shape::kDimsPerLane;
  float acc[kR][kDims];
  float row_max[kR];  // the same in every lane
  float row_sum[kR];  // sum over this lane's keys (rescaled with the common max)
  unsigned seen = 0;  // bit r: row r has had a visible key (by the mask), the same in every lane

  __device__ void init() {
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.0f;
#pragma unroll
      for (int t = 0; t < kDims; ++t) acc[r][t] = 0.0f;
    }
  }
};

// scores[r] += <q_row(r), k_row(lane)> for the warp's rows (float4 over the padded head dim).
template <class Shape>
__device__ __forceinline__ void warp_scores(const float* q_tile, const float* k_tile, int padded_dim,
                                            float (&scores)[Shape::kRowsPerWarp]) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const float4* key = reinterpret_cast<const float4*>(k_tile + lane * Shape::kKStride);
#pragma unroll
  for (int r = 0; r < Shape::kRowsPerWarp; ++r) scores[r] = 0.0f;
  for (int d4 = 0; d4 < padded_dim / 4; ++d4) {
    const float4 kv = key[d4];
#pragma unroll
    for (int r = 0; r < Shape::kRowsPerWarp; ++r) {
      const float4 qv = reinterpret_cast<const float4*>(q_tile + (warp + kWarps * r) * Shape::kQStride)[d4];
      scores[r] += dot4(qv, kv);
    }
  }
}

// One key tile through the warp's rows, from its scores (near, far or, on band tiles, both, picked
// per pair by the distance rule): masks, online softmax, P.V (with the probabilities rounded like T).
// Masked pairs get no probability and are skipped in P.V; a row's visibility comes from the mask.
template <typename T, class Shape>
__device__ void process_tile(const ReropeParams& p, const BlockRows<Shape>& rows, const SmemTiles<Shape>& s,
                             TileClass tile, int64_t key_position, const float (&scores)[Shape::kRowsPerWarp],
                             const float (&far_scores)[Shape::kRowsPerWarp], RowAccumulators<Shape>& st) {
  constexpr int kR = Shape::kRowsPerWarp;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    const int row = warp + kWarps * r;
    if (!rows.valid[row]) continue;  // uniform over the warp: the row past the problem costs nothing
    const int64_t q_position = rows.position[row];
    float score = scores[r];
    if (tile.kind == TileKind::kBand && !p.rule.is_near(q_position, key_position)) score = far_scores[r];
    const bool visible = !tile.needs_mask || rerope_visible(q_position, key_position, p.causal);
    if (!visible) score = -INFINITY;
    if (!tile.needs_mask || __any_sync(kFullMask, visible)) st.seen |= 1u << r;  // tile-uniform branch
    // fmaxf skips NaN: a visible NaN score reaches the row through its probability. While no
    // visible score is above -inf, exponents are taken against 0, so that NaN and -inf scores still
    // give NaN and 0.
    const float new_max = fmaxf(st.row_max[r], warp_max(score));
    const float base = new_max == -INFINITY ? 0.0f : new_max;
    const float prob = visible ? expf(score - base) : 0.0f;
    const float alpha = expf(st.row_max[r] - base);
    st.row_sum[r] = st.row_sum[r] * alpha + prob;  // this lane's keys only: reduced once, at the end
    st.row_max[r] = new_max;
#pragma unroll
    for (int t = 0; t < Shape::kDimsPerLane; ++t) st.acc[r][t] *= alpha;
    s.probs[row * kBlockK + lane] = visible ? round_to<T>(prob) : kMaskedProb;
  }
  __syncwarp();
  // P.V; on tiles with masked pairs, those pairs are skipped (a warp-uniform test: every lane reads
  // the same probability), so a masked key's V never reaches the row, not even as 0 * NaN.
  const auto accumulate = [&](auto skip_masked) {
    for (int j = 0; j < kBlockK; ++j) {
      float v_slot[Shape::kDimsPerLane];
#pragma unroll
      for (int t = 0; t < Shape::kDimsPerLane; ++t) v_slot[t] = s.v[j * Shape::kVStride + lane + 32 * t];
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        if (!rows.valid[warp + kWarps * r]) continue;
        const float pj = s.probs[(warp + kWarps * r) * kBlockK + j];
        if (decltype(skip_masked)::value && pj == kMaskedProb) continue;
#pragma unroll
        for (int t = 0; t < Shape::kDimsPerLane; ++t) st.acc[r][t] += pj * v_slot[t];
      }
    }
  };
  if (tile.needs_mask)
    accumulate(std::true_type{});
  else
    accumulate(std::false_type{});
  __syncwarp();
}

// Writes the warp's rows: normalised output and lse, into out/lse or into the split's partials.
// A row without a visible key: zeros and -inf. A row with one whose sum is not > 0 (NaN, or every
// visible score -inf): non-finite output and lse NaN (what softmax gives), also in a split's
// partials, so that the combine propagates it.
template <typename T, class Shape, class Problem>
__device__ void store_rows(const ReropeParams& p, const Problem& problem, const BlockRows<Shape>& rows,
                           const RowAccumulators<Shape>& st) {
  const int split = problem.task.split;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int r = 0; r < Shape::kRowsPerWarp; ++r) {
    const int row = warp + kWarps * r;
    if (!rows.valid[row]) continue;
    const int64_t out_row = problem.out_row(rows.head[row], rows.query[row]);
    const float row_sum = warp_sum(st.row_sum[r]);
    const bool seen = (st.seen >> r) & 1u;
    const float inv = seen ? 1.0f / row_sum : 0.0f;
    const float lse = !seen ? -INFINITY : row_sum > 0.0f ? st.row_max[r] + logf(row_sum) : NAN;
    const int64_t rows_total = static_cast<int64_t>(p.batch) * p.q_heads * p.q_len;
#pragma unroll
    for (int t = 0; t < Shape::kDimsPerLane; ++t) {
      const int d = lane + 32 * t;
      if (d >= p.head_dim) continue;
      const float value = st.acc[r][t] * inv;
      if (p.num_splits > 1)
        p.partial_out[(split * rows_total + out_row) * p.head_dim + d] = value;
      else
        static_cast<T*>(p.out)[out_row * p.head_dim + d] = from_acc<T>(value);
    }
    if (lane == 0) {
      if (p.num_splits > 1)
        p.partial_lse[split * rows_total + out_row] = lse;
      else
        p.lse[out_row] = lse;
    }
  }
}

// Fills the block's row table: rows r = (head offset r / queries_per_block, query r % queries_per_block).
template <class Shape, class Problem>
__device__ void map_block_rows(const ReropeParams& p, const Problem& problem, BlockRows<Shape>& rows) {
  const BlockTask& task = problem.task;
  const int group = p.q_heads / p.kv_heads;
  for (int r = static_cast<int>(threadIdx.x); r < Shape::kRows; r += kThreads) {
    const int head_offset = task.head_block * task.heads_per_block + r / task.queries_per_block;
    const int query = task.query_block * task.queries_per_block + r % task.queries_per_block;
    const bool valid =
        r < task.heads_per_block * task.queries_per_block && head_offset < group && query < task.q_len;
    rows.valid[r] = valid;
    rows.head[r] = valid ? task.kv_head * group + head_offset : 0;
    rows.query[r] = valid ? query : 0;
    rows.position[r] = valid ? problem.query_position(query) : -1;
  }
}

}  // namespace ropescale::rerope_cuda
