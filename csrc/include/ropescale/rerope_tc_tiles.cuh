// The tensor-core prefill's tiles (rerope_attention_tc.cuh): key-tile bounds, the block shape per head
// dim, position bounds reduced over a warp, and the shared-memory tiles: key and value rows by
// cp.async, the rotated query rows, key tiles rotated in place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ropescale/portable.h"
#include "ropescale/element.h"
#include "ropescale/rerope_math.h"
#include "ropescale/rerope_paged_plan.h"
#include "ropescale/rerope_params.h"
#include "ropescale/rotary_math.h"
#include "ropescale/turn_angles.h"

namespace ropescale::rerope_cuda {

// Position bounds of one tile of keys (rerope_math.h's PositionRange, flattened for global memory).
struct KeyTile {
  long long min, max;  // over the valid (>= 0) positions
  int count;           // valid positions
  int any_padding;     // some key is padding (position < 0) or past the last key
};

namespace tc {

// 4 warps of 32 threads (rerope_cuda::kWarps, kThreads), 16 query rows each.
static_assert(kWarps == 4 && kThreads == 128, "the tensor-core prefill uses 4 warps");
constexpr int kBlockM = 16 * kWarps;  // queries per block
constexpr int kBlockN = 64;           // keys per tile
static_assert(kBlockM == kPagedTcQueries, "the paged schedule counts tensor-core blocks of kBlockM queries");

// Where the rows (one kv head) of keys or values lie: row `key` at base + key * stride, or, through a
// block-table row (`pages`, a paged cache), at base + pages[key / block_size] * page_stride +
// (key % block_size) * stride. The pages were validated by the schedule kernel.
template <typename T>
struct KeyRows {
  const T* base = nullptr;
  int64_t stride = 0;
  const int* pages = nullptr;
  int block_size = 1;
  int64_t page_stride = 0;
  __device__ __forceinline__ const T* operator()(int key) const {
    if (pages == nullptr) return base + static_cast<int64_t>(key) * stride;
    return base + static_cast<int64_t>(pages[key / block_size]) * page_stride +
           static_cast<int64_t>(key % block_size) * stride;
  }
};

template <int kHeadDim>
struct Shape {
  static_assert(kHeadDim % 16 == 0 && kHeadDim >= 16 && kHeadDim <= 128, "tensor-core head dims: 16..128, step 16");
  static constexpr int kChunks = kHeadDim / 8;     // 16-byte chunks of a row
  static constexpr int kKSteps = kHeadDim / 16;    // mma k-steps of S = Q K^T
  static constexpr int kDimBlocks = kHeadDim / 8;  // n8 blocks of O
  // Shared rows are padded by one 16-byte chunk: the 8 rows an ldmatrix reads at one column then
  // start in 8 different 16-byte bank groups (row r at chunk r * (kChunks + 1) mod 8: distinct for
  // every even kChunks), and every address stays affine in the unrolled loops' indices, so the
  // compiler folds them into immediate offsets instead of holding one register per address.
  static constexpr int kRowStride = kHeadDim + 8;
  // Dynamic shared memory (16-bit elements): q near, q far (kBlockM rows), one K tile, one V tile
  // (kBlockN rows). A band tile's two K sides take turns in the K tile.
  static constexpr int kQElems = kBlockM * kRowStride;
  static constexpr int kKElems = kBlockN * kRowStride;
  static constexpr std::size_t kSmemBytes = (2 * kQElems + 2 * kKElems) * 2;
  // The paged kernel also keeps its request's key turn rates (KeyRate per rotation pair) after the tiles,
  // for the key tiles it rotates itself.
  static constexpr std::size_t kPagedSmemBytes = kSmemBytes + kHeadDim / 2 * sizeof(KeyRate);
  // Static + dynamic shared memory must fit an A100 block (163 KiB); nothing static here.
  static_assert(kPagedSmemBytes <= 166912, "shared memory above the sm_80 per-block maximum");
  // Resident blocks per SM asked of ptxas through __launch_bounds__: 2 (8 warps), which leaves 255
  // registers per thread. The shared memory would allow 3 blocks up to D 96 on an A100 (164 KiB per
  // SM), but at 168 registers ptxas spills at D 80 and 96 (sm_90) and has 2 to spare at D 64.
  static constexpr int kMinBlocksPerSm = 2;
};

// Element offset of (row, 16-byte chunk) in a padded [rows][kRowStride] shared tile.
template <int kHeadDim>
__device__ __forceinline__ int smem_offset(int row, int chunk) {
  return row * Shape<kHeadDim>::kRowStride + chunk * 8;
}

// ---- position bounds, reduced over a warp -----------------------------------------------------

__device__ __forceinline__ PositionRange warp_reduce_range(PositionRange r) {
  long long lo = r.min, hi = r.max;
  int count = r.count, padding = r.any_padding ? 1 : 0;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const long long other_lo = __shfl_xor_sync(kFullMask, lo, offset);
    const long long other_hi = __shfl_xor_sync(kFullMask, hi, offset);
    lo = other_lo < lo ? other_lo : lo;
    hi = other_hi > hi ? other_hi : hi;
    count += __shfl_xor_sync(kFullMask, count, offset);
    padding |= __shfl_xor_sync(kFullMask, padding, offset);
  }
  PositionRange out;
  out.min = lo;
  out.max = hi;
  out.count = count;
  out.any_padding = padding != 0;
  return out;
}

__device__ __forceinline__ PositionRange key_tile_range(const KeyTile& t) {
  PositionRange r;
  r.min = t.min;
  r.max = t.max;
  r.count = t.count;
  r.any_padding = t.any_padding != 0;
  return r;
}

// The region rule's near start and query bounds, called out of line by the tensor-core kernels: set up
// once per block, and inlined there, Dual Chunk's branch costs the D-128 kernels their last registers
// (sm_80: up to 316 bytes of spill loads per thread, measured; out of line: none, a 64-byte stack frame).
static __device__ ROPESCALE_NOINLINE int64_t out_of_line_near_start(const RegionRule& rule, int64_t q) {
  return rule.near_start(q);
}
static __device__ ROPESCALE_NOINLINE QueryBounds out_of_line_query_bounds(const PositionRange& queries,
                                                                          const RegionRule& rule) {
  return query_bounds(queries, rule);
}

// The first tile >= `from` that the block needs (not skipped), or n_tiles: 32 tiles per step, one
// per lane, agreed by ballot. Every warp computes the same answer from the same inputs.
template <class Problem>
__device__ __forceinline__ int next_active_tile(const Problem& problem, int from, int n_tiles,
                                                const QueryBounds& queries, bool causal) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for (int base = from; base < n_tiles; base += 32) {
    const int tile = base + lane;
    bool active = false;
    if (tile < n_tiles)
      active = rerope_classify_tile(queries, problem.key_tile(tile), causal).kind != TileKind::kSkip;
    const unsigned ballot = __ballot_sync(kFullMask, active);
    if (ballot != 0u) return base + __ffs(static_cast<int>(ballot)) - 1;
  }
  return n_tiles;
}

// ---- shared-memory tiles ----------------------------------------------------------------------

// cp.async of the kBlockN rows from key j0 on (`rows_valid` of them real, the rest zero-filled) into a
// shared tile; with `positions`, the rows of padding keys (position < 0) are zero-filled too, so that
// whatever they hold never reaches the mma (0 * NaN).
template <typename T, int kHeadDim>
__device__ __forceinline__ void load_key_rows_async(T* dst, const KeyRows<T>& src, int j0, int rows_valid,
                                                    const int64_t* positions = nullptr) {
  using S = Shape<kHeadDim>;
  for (int c = static_cast<int>(threadIdx.x); c < kBlockN * S::kChunks; c += kThreads) {
    const int row = c / S::kChunks, chunk = c % S::kChunks;
    const bool valid = row < rows_valid && (positions == nullptr || positions[row] >= 0);
    const T* from = src(valid ? j0 + row : j0) + (valid ? chunk * 8 : 0);  // (row j0: any real address)
    device::cp_async_16(dst + smem_offset<kHeadDim>(row, chunk), from, valid ? 16 : 0);
  }
}

// Whether any of the 8 16-bit values of the 16-byte chunk at `chunk` (shared) is inf or NaN: its
// exponent bits all set.
template <typename T>
__device__ __forceinline__ bool chunk_has_nonfinite(const T* chunk) {
  constexpr uint32_t kExponent = std::is_same_v<T, __half> ? 0x7C00u : 0x7F80u;
  const uint4 words = *reinterpret_cast<const uint4*>(chunk);
  const uint32_t w[4] = {words.x, words.y, words.z, words.w};
  bool found = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) found |= (w[i] & kExponent) == kExponent || ((w[i] >> 16) & kExponent) == kExponent;
  return found;
}

// The block's query rows, rotated near (at p) and far (at w + (p - w)/k) in f32 from the sin/cos of
// p.q_rotation, rounded to T, into the shared q tiles. Rows past the queries and padding rows are zeros.
template <typename T, int kHeadDim, class Problem>
__device__ void store_query_rows(const ReropeParams& p, const Problem& problem, int q0, T* q_near, T* q_far) {
  const int half_dim = kHeadDim / 2;
  for (int idx = static_cast<int>(threadIdx.x); idx < kBlockM * half_dim; idx += kThreads) {
    const int r = idx / half_dim, pair = idx % half_dim;
    const int query = q0 + r;
    const int64_t pos = query < problem.q_len ? problem.query_position(query) : -1;
    int first = 2 * pair, second = 2 * pair + 1;
    float near1 = 0.0f, near2 = 0.0f, far1 = 0.0f, far2 = 0.0f;
    if (pair < p.rotary_pairs) rotary_pair_dims(pair, p.rotary_pairs, p.interleaved, &first, &second);
    if (pos >= 0) {
      const T* src = problem.q_row(query);
      const float x1 = to_acc(src[first]), x2 = to_acc(src[second]);
      if (pair < p.rotary_pairs) {
        const float4 sc =
            reinterpret_cast<const float4*>(p.q_rotation)[problem.rotation_row(query) * p.rotary_pairs + pair];
        rotate_pair(x1, x2, sc.y, sc.x, &near1, &near2);
        rotate_pair(x1, x2, sc.w, sc.z, &far1, &far2);
      } else {  // past the rotary dims: the same on both sides
        near1 = far1 = x1;
        near2 = far2 = x2;
      }
    }
    const int o1 = smem_offset<kHeadDim>(r, first / 8) + first % 8;
    const int o2 = smem_offset<kHeadDim>(r, second / 8) + second % 8;
    q_near[o1] = from_acc<T>(near1);
    q_near[o2] = from_acc<T>(near2);
    q_far[o1] = from_acc<T>(far1);
    q_far[o2] = from_acc<T>(far2);
  }
}

// Rotates in place one side of the key tile `k_tile`, which holds the raw keys j0 .. j0 + rows - 1 (the
// rows past them are zeros and are left so): every rotation pair at its key's position, from the turn
// rates `rates` (shared memory; near side: rate.near, at p; far side: rate.far, at the rule's
// far_key_index(p)), rounded to
// T. Bit for bit what the pre-pass (rotate_key_pair) writes into the workspace. One thread per (row,
// pair), stepping by kThreads items without a division per item.
template <typename T, int kHeadDim>
__device__ __forceinline__ void rotate_key_tile(const ReropeParams& p, T* k_tile, const KeyRate* rates, int j0,
                                                int rows, bool far_side) {
  const int pairs = p.rotary_pairs;
  const int tid = static_cast<int>(threadIdx.x);
  const int row_step = kThreads / pairs, pair_step = kThreads % pairs;
  int row = tid / pairs, pair = tid % pairs;
  while (row < rows) {
    int first, second;
    rotary_pair_dims(pair, pairs, p.interleaved, &first, &second);
    float sin_v, cos_v, a, c;
    position_sincos(far_side ? p.rule.far_key_index(j0 + row) : j0 + row, far_side ? rates[pair].far : rates[pair].near,
                    &sin_v, &cos_v);
    T* const key = k_tile + row * Shape<kHeadDim>::kRowStride;
    rotate_key_pair_fma(to_acc(key[first]), to_acc(key[second]), cos_v, sin_v, &a, &c);
    key[first] = from_acc<T>(a);
    key[second] = from_acc<T>(c);
    row += row_step;
    pair += pair_step;
    if (pair >= pairs) pair -= pairs, ++row;
  }
}

}  // namespace tc

}  // namespace ropescale::rerope_cuda
