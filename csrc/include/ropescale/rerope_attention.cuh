// CUDA kernels of rerope_attention, framework-free (raw pointers, sizes, strides) so that the same
// source compiles with nvcc and, with ROPESCALE_EMULATION, runs on the CPU emulation in CI.
//
// One tile engine, two launch plans:
//   * prefill: rerope_rotate_keys_kernel rotates every key once (near side at p, Leaky far side at
//     p/k) into float buffers; rerope_prefill_kernel then runs one block per (32 queries, head),
//     streaming 32-key tiles of the pre-rotated keys through shared memory.
//   * decode (one or a few query tokens against a long pre-RoPE cache): rerope_decode_kernel packs
//     the query rows of every head of a GQA group into one block, splits the keys over the grid
//     (flash-decoding), rotates in shared memory only the key tiles that need it (ReRoPE: the tiles
//     inside the window; Leaky: every tile, for its far side), and rerope_combine_kernel merges the
//     splits by their log-sum-exp.
// In both, every key tile is classified from its position bounds (rerope_math.h): near and far tiles
// compute one product per score, band tiles (straddling the window edge) both, skipped tiles none;
// the softmax is online (running max and sum per row, fp32 accumulation).
//
// Thread layout: 4 warps; warp w owns the query rows w, w+4, ...; lane j owns key j of a tile for
// the scores and head-dim slots lane, lane+32, ... of the output accumulators for P.V.
//
// Shared memory decides the tile shape (TileShape): the wide tiles hold both sides of a key tile at
// once and fit A100/H100-class parts at every head dim (the 256 bucket needs 134,928 B per block);
// the compact tiles (head dims up to 256 in under 99 KiB, for sm_86/89/120) hold one side at a
// time, so a band tile loads its far side after its near scores, and keep fewer query rows per
// block. with_simt_shape() picks one from the device's sharedMemPerBlockOptin.
//
// Masked keys (causal, padding) never contribute, whatever their K and V hold: their scores are
// replaced by -inf and their (row, key) pairs are skipped in P.V (no 0 * NaN). Visible keys follow
// IEEE arithmetic: a non-finite q, k or v propagates into the row. Whether a row saw a visible key
// is decided by the mask, never by the scores: a row with none gives zeros and lse = -inf.
//
// These scalar-FMA kernels serve fp32 inputs, head dims the tensor-core prefill does not take, and
// every decode. Decode stays here on purpose: one query token against the cache reads every key and
// value once and does about one FLOP per byte read, so it is bound by memory bandwidth; tensor
// cores would raise a compute rate that is not the limit. The fp16/bf16 prefill runs on tensor
// cores (rerope_attention_tc.cuh).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "ropescale/portable.h"
#include "ropescale/rerope_math.h"
#include "ropescale/rotary_math.h"

namespace ropescale::rerope_cuda {

// ---- element types: float, __half, __nv_bfloat16 (explicit conversions: torch builds define
// __CUDA_NO_HALF_CONVERSIONS__)
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// x rounded to T and back. For fp16/bf16 inputs every kernel rounds where FlashAttention and SDPA
// round (the rotated q and k, the probabilities before P.V) and accumulates in f32, so the
// precision is the same at every problem size, tensor-core prefill and SIMT decode alike; fp32
// inputs are untouched.
template <typename T>
__device__ __forceinline__ float round_like(float x) {
  return to_float(from_float<T>(x));
}
template <>
__device__ __forceinline__ float round_like<float>(float x) { return x; }

// Everything a launch needs. Strides are in elements, last dim unit-stride.
struct ReropeParams {
  const void* q = nullptr;  // [B, Hq, Lq, D]
  const void* k = nullptr;  // [B, Hkv, Lk, D]
  const void* v = nullptr;  // [B, Hkv, Lk, D]
  int64_t q_stride_b = 0, q_stride_h = 0, q_stride_l = 0;
  int64_t k_stride_b = 0, k_stride_h = 0, k_stride_l = 0;
  int64_t v_stride_b = 0, v_stride_h = 0, v_stride_l = 0;
  const int64_t* q_positions = nullptr;  // [B, Lq], contiguous
  const int64_t* k_positions = nullptr;  // [B, Lk], contiguous
  const float* inv_freq = nullptr;       // [rotary_pairs]
  void* k_near = nullptr;  // prefill: keys rotated at p, [B, Hkv, Lk, D] (float; T for the tensor-core prefill)
  void* k_far = nullptr;   // prefill, Leaky: keys rotated at p/k, the same layout and type
  float* q_rotation = nullptr;  // tensor-core prefill: [B, Lq, rotary_pairs] x (sin, cos near; sin, cos far)
  void* out = nullptr;                   // [B, Hq, Lq, D], contiguous
  float* lse = nullptr;                  // [B, Hq, Lq]
  float* partial_out = nullptr;          // decode splits: float [splits, B, Hq, Lq, D]
  float* partial_lse = nullptr;          // decode splits: [splits, B, Hq, Lq]
  int batch = 0, q_heads = 0, kv_heads = 0, q_len = 0, k_len = 0, head_dim = 0, rotary_pairs = 0;
  int64_t window = 1, logn_length = 0;
  double leaky_inv = 0.0, inv_log_train = 0.0;
  float scale = 1.0f;
  bool causal = true, interleaved = false;
  // Launch plan (set by the launchers).
  int queries_per_block = 0, heads_per_block = 0, num_splits = 1, keys_per_split = 0;
};

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockK = 32;  // keys per tile: one per lane
constexpr unsigned kFullMask = 0xffffffffu;

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
  static constexpr std::size_t kSmemBytes = kTilePositionsOffset + 2 * kBlockK * sizeof(long long);
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
template <typename T, class Shape>
__device__ void load_query_rows(const ReropeParams& p, int b, const BlockRows<Shape>& rows, SmemTiles<Shape>& s,
                                int padded_dim) {
  const T* q = static_cast<const T*>(p.q);
  const int tid = static_cast<int>(threadIdx.x);
  // Dims past the rotary ones (copied) and the zero padding up to a multiple of 4.
  for (int idx = tid; idx < Shape::kRows * padded_dim; idx += kThreads) {
    const int r = idx / padded_dim, d = idx % padded_dim;
    if (d < 2 * p.rotary_pairs) continue;
    float x = 0.0f;
    if (rows.valid[r] && d < p.head_dim) {
      const float factor = p.scale * rerope_logn_scale(rows.position[r], p.logn_length, p.inv_log_train);
      x = to_float(q[b * p.q_stride_b + rows.head[r] * p.q_stride_h + rows.query[r] * p.q_stride_l + d]) * factor;
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
    const float factor = p.scale * rerope_logn_scale(pos, p.logn_length, p.inv_log_train);
    const T* src = q + b * p.q_stride_b + rows.head[r] * p.q_stride_h + rows.query[r] * p.q_stride_l;
    const float x1 = to_float(src[first]), x2 = to_float(src[second]);
    float sin_v, cos_v, a, c;
    rotary_sincos(static_cast<double>(pos), p.inv_freq[pair], &sin_v, &cos_v);
    rotate_pair(x1, x2, cos_v, sin_v, &a, &c);
    near_row[first] = round_like<T>(a) * factor;
    near_row[second] = round_like<T>(c) * factor;
    rotary_sincos(rerope_far_query_position(pos, p.window, p.leaky_inv), p.inv_freq[pair], &sin_v, &cos_v);
    rotate_pair(x1, x2, cos_v, sin_v, &a, &c);
    far_row[first] = round_like<T>(a) * factor;
    far_row[second] = round_like<T>(c) * factor;
  }
}

// Loads a [kBlockK x padded_dim] tile of float rows (zeros past the keys and past D).
template <typename Src, int kStride>
__device__ void load_tile(const Src* base, int64_t row_stride, int rows_in_range, int dim, int padded_dim, float* dst) {
  for (int idx = static_cast<int>(threadIdx.x); idx < kBlockK * padded_dim; idx += kThreads) {
    const int j = idx / padded_dim, d = idx % padded_dim;
    dst[j * kStride + d] = (j < rows_in_range && d < dim) ? to_float(base[j * row_stride + d]) : 0.0f;
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
    if (tile.kind == TileKind::kBand && !rerope_is_near(q_position, key_position, p.window)) score = far_scores[r];
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
    s.probs[row * kBlockK + lane] = visible ? round_like<T>(prob) : kMaskedProb;
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
template <typename T, class Shape>
__device__ void store_rows(const ReropeParams& p, int b, int split, const BlockRows<Shape>& rows,
                           const RowAccumulators<Shape>& st) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int r = 0; r < Shape::kRowsPerWarp; ++r) {
    const int row = warp + kWarps * r;
    if (!rows.valid[row]) continue;
    const int64_t out_row = (static_cast<int64_t>(b) * p.q_heads + rows.head[row]) * p.q_len + rows.query[row];
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
        static_cast<T*>(p.out)[out_row * p.head_dim + d] = from_float<T>(value);
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
template <class Shape>
__device__ void map_block_rows(const ReropeParams& p, int b, int kv_head, int query_block, int head_block,
                               BlockRows<Shape>& rows) {
  const int group = p.q_heads / p.kv_heads;
  for (int r = static_cast<int>(threadIdx.x); r < Shape::kRows; r += kThreads) {
    const int head_offset = head_block * p.heads_per_block + r / p.queries_per_block;
    const int query = query_block * p.queries_per_block + r % p.queries_per_block;
    const bool valid = r < p.heads_per_block * p.queries_per_block && head_offset < group && query < p.q_len;
    rows.valid[r] = valid;
    rows.head[r] = valid ? kv_head * group + head_offset : 0;
    rows.query[r] = valid ? query : 0;
    rows.position[r] = valid ? p.q_positions[static_cast<int64_t>(b) * p.q_len + query] : -1;
  }
}

// The kernel body shared by prefill (keys pre-rotated in global memory) and decode (keys rotated
// here, tile by tile, only where needed). Grid: x = key split, y = (query block, head block),
// z = (batch, kv head).
template <typename T, class Shape, bool kKeysPreRotated>
__device__ void rerope_attention_block(const ReropeParams& p) {
  constexpr int kR = Shape::kRowsPerWarp;
  ROPESCALE_DYNAMIC_SMEM(float, smem);
  SmemTiles<Shape> s(smem);
  unsigned char* const smem_bytes = reinterpret_cast<unsigned char*>(smem);
  BlockRows<Shape>& rows = *reinterpret_cast<BlockRows<Shape>*>(smem_bytes + Shape::kRowTableOffset);
  // By tile parity: a skipped tile may run ahead.
  long long (*tile_positions)[kBlockK] = reinterpret_cast<long long (*)[kBlockK]>(smem_bytes + Shape::kTilePositionsOffset);

  const int split = static_cast<int>(blockIdx.x);
  const int query_blocks = (p.q_len + p.queries_per_block - 1) / p.queries_per_block;
  const int query_block = static_cast<int>(blockIdx.y) % query_blocks;
  const int head_block = static_cast<int>(blockIdx.y) / query_blocks;
  const int b = static_cast<int>(blockIdx.z) / p.kv_heads, kv_head = static_cast<int>(blockIdx.z) % p.kv_heads;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;
  const int padded_dim = (p.head_dim + 3) / 4 * 4;
  const bool leaky = p.leaky_inv != 0.0;

  map_block_rows<Shape>(p, b, kv_head, query_block, head_block, rows);
  __syncthreads();
  // Bounds of the block's query positions, computed by every thread (no shuffles, no barrier).
  PositionRange query_range;
  for (int r = 0; r < Shape::kRows; ++r)
    if (rows.valid[r]) query_range.add(rows.position[r]);
  load_query_rows<T, Shape>(p, b, rows, s, padded_dim);

  RowAccumulators<Shape> st;
  st.init();
  const int key_begin = split * p.keys_per_split;
  const int key_end = key_begin + p.keys_per_split < p.k_len ? key_begin + p.keys_per_split : p.k_len;
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride_b + kv_head * p.k_stride_h;
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride_b + kv_head * p.v_stride_h;
  const int64_t* k_positions = p.k_positions + static_cast<int64_t>(b) * p.k_len;
  const int64_t rotated_offset = (static_cast<int64_t>(b) * p.kv_heads + kv_head) * p.k_len * p.head_dim;

  for (int j0 = key_begin, parity = 0; j0 < key_end; j0 += kBlockK, parity ^= 1) {
    const int keys_in_tile = key_end - j0 < kBlockK ? key_end - j0 : kBlockK;
    if (tid < kBlockK) tile_positions[parity][tid] = tid < keys_in_tile ? k_positions[j0 + tid] : -1;
    __syncthreads();  // positions published; the previous tile is consumed (and the query rows written)
    // Every thread classifies the same positions, so the whole block agrees on the tile's class.
    PositionRange key_range;
    for (int j = 0; j < keys_in_tile; ++j) key_range.add(tile_positions[parity][j]);
    TileClass tile = rerope_classify_tile(query_range, key_range, p.window, p.causal);
    if (tile.kind == TileKind::kSkip) continue;
    tile.needs_mask |= keys_in_tile < kBlockK;  // lanes past the last key (position -1: never visible)
    const int64_t key_position = tile_positions[parity][lane];
    const bool need_near = tile.kind != TileKind::kFar, need_far = tile.kind != TileKind::kNear;

    // One side of the key tile into `dst` (zeros past the keys and past D). Prefill: the
    // pre-rotated keys (far side: p.k_far for Leaky, the raw keys for ReRoPE). Decode: the raw keys,
    // then, per rotation pair, rotated in place (near at p, Leaky far at p/k; ReRoPE's far side is
    // the raw key); one thread reads and writes each pair. Ends before the barrier that publishes it.
    const auto stage_keys = [&](bool far_side, float* dst) {
      if constexpr (kKeysPreRotated) {
        if (!far_side || leaky)
          load_tile<float, Shape::kKStride>(static_cast<const float*>(far_side ? p.k_far : p.k_near) + rotated_offset +
                                                static_cast<int64_t>(j0) * p.head_dim,
                                            p.head_dim, keys_in_tile, p.head_dim, padded_dim, dst);
        else
          load_tile<T, Shape::kKStride>(k + j0 * p.k_stride_l, p.k_stride_l, keys_in_tile, p.head_dim, padded_dim, dst);
      } else {
        load_tile<T, Shape::kKStride>(k + j0 * p.k_stride_l, p.k_stride_l, keys_in_tile, p.head_dim, padded_dim, dst);
        if (far_side && !leaky) return;
        __syncthreads();
        for (int idx = tid; idx < kBlockK * p.rotary_pairs; idx += kThreads) {
          const int j = idx / p.rotary_pairs, pair = idx % p.rotary_pairs;
          int first, second;
          rotary_pair_dims(pair, p.rotary_pairs, p.interleaved, &first, &second);
          float* row = dst + j * Shape::kKStride;
          const int64_t pos = j < keys_in_tile ? k_positions[j0 + j] : 0;
          float sin_v, cos_v, a, c;
          rotary_sincos(far_side ? rerope_far_key_position(pos, p.leaky_inv) : static_cast<double>(pos),
                        p.inv_freq[pair], &sin_v, &cos_v);
          rotate_pair(row[first], row[second], cos_v, sin_v, &a, &c);
          row[first] = round_like<T>(a);
          row[second] = round_like<T>(c);
        }
      }
    };

    load_tile<T, Shape::kVStride>(v + j0 * p.v_stride_l, p.v_stride_l, keys_in_tile, p.head_dim, padded_dim, s.v);
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
  store_rows<T, Shape>(p, b, split, rows, st);
}

template <typename T, class Shape>
__global__ void __launch_bounds__(kThreads, Shape::kMinBlocksPerSm) rerope_prefill_kernel(const ReropeParams p) {
  rerope_attention_block<T, Shape, true>(p);
}

template <typename T, class Shape>
__global__ void __launch_bounds__(kThreads, Shape::kMinBlocksPerSm) rerope_decode_kernel(const ReropeParams p) {
  rerope_attention_block<T, Shape, false>(p);
}

// Prefill pre-pass: every key rotated once, for all kv heads from one sin/cos: near side at p into
// k_near, and for Leaky ReRoPE the far side at p/k into k_far, as Out (float for the SIMT prefill,
// T for the tensor-core one: rounded to the input dtype). One thread per (batch, key, pair); pairs
// past the rotary ones copy two un-rotated dims.
template <typename T, typename Out>
__global__ void __launch_bounds__(256) rerope_rotate_keys_kernel(const ReropeParams p) {
  const int half_dim = p.head_dim / 2;
  const int64_t total = static_cast<int64_t>(p.batch) * p.k_len * half_dim;
  const T* k = static_cast<const T*>(p.k);
  Out* const k_near = static_cast<Out*>(p.k_near);
  Out* const k_far = static_cast<Out*>(p.k_far);
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int pair = static_cast<int>(idx % half_dim);
    const int j = static_cast<int>((idx / half_dim) % p.k_len);
    const int b = static_cast<int>(idx / (static_cast<int64_t>(half_dim) * p.k_len));
    const int64_t pos = p.k_positions[static_cast<int64_t>(b) * p.k_len + j];
    const bool rotated = pair < p.rotary_pairs;
    int first = 2 * pair, second = 2 * pair + 1;
    float near_sin = 0.0f, near_cos = 1.0f, far_sin = 0.0f, far_cos = 1.0f;
    if (rotated) {
      rotary_pair_dims(pair, p.rotary_pairs, p.interleaved, &first, &second);
      rotary_sincos(static_cast<double>(pos), p.inv_freq[pair], &near_sin, &near_cos);
      if (k_far) rotary_sincos(rerope_far_key_position(pos, p.leaky_inv), p.inv_freq[pair], &far_sin, &far_cos);
    }
    for (int h = 0; h < p.kv_heads; ++h) {
      const T* src = k + b * p.k_stride_b + h * p.k_stride_h + j * p.k_stride_l;
      const float x1 = to_float(src[first]), x2 = to_float(src[second]);
      const int64_t dst = ((static_cast<int64_t>(b) * p.kv_heads + h) * p.k_len + j) * p.head_dim;
      float a, c;  // rounded like T (a no-op for fp32; for Out = T, the one rounding to T)
      rotate_pair(x1, x2, near_cos, near_sin, &a, &c);
      k_near[dst + first] = from_float<Out>(round_like<T>(a));
      k_near[dst + second] = from_float<Out>(round_like<T>(c));
      if (k_far) {
        rotate_pair(x1, x2, far_cos, far_sin, &a, &c);
        k_far[dst + first] = from_float<Out>(round_like<T>(a));
        k_far[dst + second] = from_float<Out>(round_like<T>(c));
      }
    }
  }
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
    static_cast<T*>(p.out)[row * p.head_dim + d] = from_float<T>(seen ? value / total : 0.0f);
  }
  if (lane == 0) p.lse[row] = seen ? max_lse + logf(total) : -INFINITY;
}

// ---- host launchers -------------------------------------------------------------------------

// A launcher calls check(status, what) after every launch and after every shared-memory opt-in, with
// the CUDA status (0 = ok). The caller's check must not return on an error (it throws), so that no
// kernel reads the output of a failed one. The emulation throws from the launch itself.
struct IgnoreLaunchStatus {
  void operator()(int, const char*) const {}
};

// Calls f.template operator()<Shape>() with the SIMT tile shape for `head_dim` on a device whose
// blocks may opt in to `smem_per_block_optin` bytes of shared memory (cudaDevAttrMaxSharedMemoryPerBlockOptin,
// static + dynamic): the wide tiles where they fit (every bucket on sm_80/87/90/100, the 64 and 128
// buckets everywhere from sm_80 on), the compact 256 tiles on the 99 KiB parts (sm_86/89/120).
// Returns 0, or the bytes the smallest shape would need when none fits (f not called).
template <class F>
inline std::size_t with_simt_shape(int head_dim, std::size_t smem_per_block_optin, F&& f) {
  const auto run = [&]<class Shape>() -> std::size_t {
    if (Shape::kSmemBytes > smem_per_block_optin) return Shape::kSmemBytes;
    f.template operator()<Shape>();
    return 0;
  };
  if (head_dim <= 64) return run.template operator()<TileShape<64>>();
  if (head_dim <= 128) return run.template operator()<TileShape<128>>();
  if (TileShape<256>::kSmemBytes <= smem_per_block_optin) return run.template operator()<TileShape<256>>();
  return run.template operator()<TileShape<256, true>>();
}

// Grid y of the prefill and of the decode plan (query blocks x head blocks): must be <= 65535.
template <class Shape>
inline int64_t rerope_prefill_grid_y(const ReropeParams& p) {
  return (static_cast<int64_t>(p.q_len) + Shape::kRows - 1) / Shape::kRows * (p.q_heads / p.kv_heads);
}
template <class Shape>
inline int64_t rerope_decode_grid_y(const ReropeParams& p) {
  const int group = p.q_heads / p.kv_heads;
  const int queries_per_block = p.q_len < Shape::kRows ? p.q_len : Shape::kRows;
  const int heads_per_block = group < Shape::kRows / queries_per_block ? group : Shape::kRows / queries_per_block;
  return (static_cast<int64_t>(p.q_len) + queries_per_block - 1) / queries_per_block *
         ((group + heads_per_block - 1) / heads_per_block);
}

// Prefill plan: one block per (Shape::kRows queries of one head); keys rotated once by the pre-pass
// into p.k_near (and p.k_far for Leaky), which the caller allocates: float [B, Hkv, Lk, D] each.
template <typename T, class Shape, class Check = IgnoreLaunchStatus>
inline void launch_rerope_prefill(ReropeParams p, cudaStream_t stream, Check&& check = {}) {
  const int64_t rotate_items = static_cast<int64_t>(p.batch) * p.k_len * (p.head_dim / 2);
  const int64_t rotate_blocks = (rotate_items + 255) / 256 < 65535 ? (rotate_items + 255) / 256 : 65535;
  if (rotate_items > 0) {
    ROPESCALE_LAUNCH_KERNEL((rerope_rotate_keys_kernel<T, float>), dim3(static_cast<unsigned>(rotate_blocks)),
                            dim3(256), 0, stream, p);
    check(ROPESCALE_LAST_LAUNCH_ERROR(), "the rotate-keys kernel");
  }
  p.queries_per_block = Shape::kRows;
  p.heads_per_block = 1;
  p.num_splits = 1;
  p.keys_per_split = p.k_len;
  const int query_blocks = (p.q_len + Shape::kRows - 1) / Shape::kRows;
  const dim3 grid(1, static_cast<unsigned>(query_blocks * (p.q_heads / p.kv_heads)),
                  static_cast<unsigned>(p.batch * p.kv_heads));
  static device::SmemOptIn opt_in;  // once per device
  check(opt_in.ensure((rerope_prefill_kernel<T, Shape>), Shape::kSmemBytes),
        "the shared-memory opt-in of the prefill kernel");
  ROPESCALE_LAUNCH_KERNEL((rerope_prefill_kernel<T, Shape>), grid, dim3(kThreads), Shape::kSmemBytes, stream, p);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the prefill kernel");
}

// How many key splits a decode launch uses: enough blocks for ~2 waves on `multiprocessors` SMs,
// at least 4 key tiles per split. Splits > 1 need p.partial_out / p.partial_lse.
template <class Shape>
inline int rerope_decode_splits(const ReropeParams& p, int multiprocessors) {
  const int group = p.q_heads / p.kv_heads;
  const int queries_per_block = p.q_len < Shape::kRows ? p.q_len : Shape::kRows;
  const int heads_per_block = group < Shape::kRows / queries_per_block ? group : Shape::kRows / queries_per_block;
  const int64_t blocks = static_cast<int64_t>(p.batch) * p.kv_heads *
                         ((p.q_len + queries_per_block - 1) / queries_per_block) *
                         ((group + heads_per_block - 1) / heads_per_block);
  const int64_t max_splits = (p.k_len + 4 * kBlockK - 1) / (4 * kBlockK);
  int64_t splits = (2 * static_cast<int64_t>(multiprocessors) + blocks - 1) / blocks;
  splits = splits < max_splits ? splits : max_splits;
  return splits < 1 ? 1 : static_cast<int>(splits);
}

// Decode plan: the query rows of every head of a GQA group share a block (and each rotated key
// tile); keys split `num_splits` ways, merged by rerope_combine_kernel when num_splits > 1.
template <typename T, class Shape, class Check = IgnoreLaunchStatus>
inline void launch_rerope_decode(ReropeParams p, int num_splits, cudaStream_t stream, Check&& check = {}) {
  const int group = p.q_heads / p.kv_heads;
  p.queries_per_block = p.q_len < Shape::kRows ? p.q_len : Shape::kRows;
  p.heads_per_block = group < Shape::kRows / p.queries_per_block ? group : Shape::kRows / p.queries_per_block;
  const int tiles = (p.k_len + kBlockK - 1) / kBlockK;
  const int tiles_per_split = (tiles + num_splits - 1) / num_splits;
  p.keys_per_split = tiles_per_split * kBlockK;
  p.num_splits = (p.k_len + p.keys_per_split - 1) / p.keys_per_split;
  const int query_blocks = (p.q_len + p.queries_per_block - 1) / p.queries_per_block;
  const int head_blocks = (group + p.heads_per_block - 1) / p.heads_per_block;
  const dim3 grid(static_cast<unsigned>(p.num_splits), static_cast<unsigned>(query_blocks * head_blocks),
                  static_cast<unsigned>(p.batch * p.kv_heads));
  static device::SmemOptIn opt_in;  // once per device
  check(opt_in.ensure((rerope_decode_kernel<T, Shape>), Shape::kSmemBytes),
        "the shared-memory opt-in of the decode kernel");
  ROPESCALE_LAUNCH_KERNEL((rerope_decode_kernel<T, Shape>), grid, dim3(kThreads), Shape::kSmemBytes, stream, p);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the decode kernel");
  if (p.num_splits > 1) {
    const int64_t rows_total = static_cast<int64_t>(p.batch) * p.q_heads * p.q_len;
    ROPESCALE_LAUNCH_KERNEL(rerope_combine_kernel<T>, dim3(static_cast<unsigned>((rows_total + kWarps - 1) / kWarps)),
                            dim3(kThreads), 0, stream, p);
    check(ROPESCALE_LAST_LAUNCH_ERROR(), "the split-combine kernel");
  }
}

}  // namespace ropescale::rerope_cuda
