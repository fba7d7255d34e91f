// Tensor-core prefill of rerope_attention for fp16 and bf16 inputs (sm_80 and newer), framework-free
// like rerope_attention.cuh, whose ReropeParams and rotate-keys pre-pass it shares. The same source
// compiles with nvcc (inline PTX through ropescale/portable.h) and, with ROPESCALE_EMULATION, runs on
// the CPU emulation, whose mma.sync / ldmatrix / cp.async follow the PTX ISA's fragment layouts.
//
// One body (rerope_prefill_tc_block) over two problems, as the SIMT kernels: TcDenseProblem (a batch
// row of rerope_attention; keys pre-rotated by rerope_rotate_keys_kernel, key-tile bounds from
// rerope_key_tiles_kernel) and TcPagedProblem (a prefill request of rerope_attention_paged, chosen by
// rerope_paged_schedule_kernel: tile bounds from the slot indices, its own table and softmax scale, the
// values read in place from the pages, and its keys either rotated through the block table by
// rerope_paged_rotate_keys_kernel into a packed workspace while they fit its budget, or, past it, read
// raw from the pages like the values and rotated tile by tile in shared memory by the body itself, so
// that no length leaves the tensor cores).
//
// The FlashAttention-2 structure, with ReRoPE's tile classification:
//   * one CTA of 4 warps per (64 queries, q head); warp w owns query rows 16w..16w+15 of the block
//     and keeps its output accumulator (16 x D, f32) and its online-softmax state in registers;
//   * the block's queries, rotated twice (near side at p, far side at w + (p - w)/k) in f32 and
//     rounded to T, stay in shared memory; the keys were rotated once by the pre-pass into T
//     buffers (near side at p; Leaky far side at p/k; plain ReRoPE's far side is the raw key);
//   * key tiles of 64 go through shared memory with cp.async: the K tile(s) of tile j+1 are fetched
//     while the warps compute P.V of tile j, and V of tile j while they compute its scores (the
//     FlashAttention-2 K/V ping-pong: one buffer each, always one load in flight);
//   * ldmatrix feeds mma.sync.m16n8k16 (f32 accumulators): S = Q K^T in 16-column steps of the head
//     dim, then O += P V with P (rounded to T) taken from the S accumulators as the A operand;
//   * every key tile is classified from its position bounds (rerope_math.h) against the block's
//     queries, which decides what is loaded, and against each warp's 16 queries, which decides what
//     the warp computes: near or far tiles one product, band tiles both (selected per element by the
//     distance rule), skipped tiles nothing (not even loaded). A per-tile table of key position bounds
//     (rerope_key_tiles_kernel) lets a warp look 32 tiles ahead with one load per lane and a ballot.
//
// Rounding (the contract for low-precision inputs, DESIGN.md): the rotated q and k and the
// probabilities are rounded to T as FlashAttention and SDPA round theirs; every product is
// accumulated in f32 (mma.sync), the softmax is f32, scale and log-n multiply the f32 scores. The
// same path runs at every problem size.
//
// Head dims 64, 80, 96 and 128 (any multiple of 16 up to 128 whose 16-byte chunk count per row
// leaves a tail of 0, 1, 2 or 4 chunks past a multiple of 8). Head dim 256 would need 128
// accumulator registers per thread for O alone plus two score fragments on band tiles: past the
// register file without spills at 4 warps, so the SIMT kernel serves D > 128 (and other dims, and
// fp32). Decode (a few query tokens) stays on the SIMT split-K kernel: it reads the whole cache once
// per token and does ~1 FLOP per byte, so it is bound by memory bandwidth, not by the FMA rate that
// tensor cores raise.
#pragma once

#include "ropescale/portable.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ropescale/element.h"
#include "ropescale/rerope_attention.cuh"
#include "ropescale/rerope_math.h"
#include "ropescale/rotary_math.h"

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

// The first tile >= `from` that the block needs (not skipped), or n_tiles: 32 tiles per step, one
// per lane, agreed by ballot. Every warp computes the same answer from the same inputs.
template <class Problem>
__device__ __forceinline__ int next_active_tile(const Problem& problem, int from, int n_tiles,
                                                const PositionRange& queries, int64_t window, bool causal) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for (int base = from; base < n_tiles; base += 32) {
    const int tile = base + lane;
    bool active = false;
    if (tile < n_tiles)
      active = rerope_classify_tile(queries, problem.key_tile(tile), window, causal).kind != TileKind::kSkip;
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
// rates `rates` (shared memory; near side: rate.near, at p; Leaky far side: rate.far, at p/k), rounded to
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
    position_sincos(j0 + row, far_side ? rates[pair].far : rates[pair].near, &sin_v, &cos_v);
    T* const key = k_tile + row * Shape<kHeadDim>::kRowStride;
    rotate_key_pair_fma(to_acc(key[first]), to_acc(key[second]), cos_v, sin_v, &a, &c);
    key[first] = from_acc<T>(a);
    key[second] = from_acc<T>(c);
    row += row_step;
    pair += pair_step;
    if (pair >= pairs) pair -= pairs, ++row;
  }
}

// ---- the two products ---------------------------------------------------------------------------

// s[j] (n8 block j of the 64 keys, C layout) = Q[warp rows] . K[tile rows]^T over the head dim.
template <typename T, int kHeadDim>
__device__ __forceinline__ void warp_scores(const T* q_tile, const T* k_tile, float (&s)[kBlockN / 8][4]) {
  using S = Shape<kHeadDim>;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < S::kKSteps; ++kk) {
    // A: matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15) of the step, in register order a0..a3.
    uint32_t a[4];
    device::ldmatrix<4>(a, q_tile + smem_offset<kHeadDim>(16 * warp + lane % 8 + 8 * ((lane / 8) % 2), 2 * kk + lane / 16));
#pragma unroll
    for (int nn = 0; nn < kBlockN / 16; ++nn) {
      // B of two n8 blocks: (keys 0-7, dims 0-7), (keys 0-7, dims 8-15), (keys 8-15, ...), ...
      uint32_t bk[4];
      device::ldmatrix<4>(bk, k_tile + smem_offset<kHeadDim>(16 * nn + lane % 8 + 8 * (lane / 16), 2 * kk + (lane / 8) % 2));
      const uint32_t b0[2] = {bk[0], bk[1]}, b1[2] = {bk[2], bk[3]};
      device::mma_m16n8k16<T>(s[2 * nn], a, b0);
      device::mma_m16n8k16<T>(s[2 * nn + 1], a, b1);
    }
  }
}

// Per-element facts of this lane's 32 scores of a tile, one bit each (bit 4j + i for the C-fragment
// element i of n8 block j: row g + 8 (i / 2), key j0 + 8j + 2t + i % 2): whether the pair is on the
// near side of the window, and whether it is visible. Two registers instead of 16 key positions.
struct PairBits {
  uint32_t near = 0, visible = 0;
};
template <class Problem>
__device__ __forceinline__ PairBits pair_bits(const int64_t (&row_pos)[2], const Problem& problem, int j0,
                                              int64_t window, bool causal) {
  const int t = static_cast<int>(threadIdx.x) % 4;
  PairBits bits;
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int key = j0 + 8 * j + 2 * t + c;
      const int64_t key_pos = problem.key_position(key);  // past the keys: -1, never visible
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int bit = 4 * j + 2 * h + c;
        bits.near |= static_cast<uint32_t>(rerope_is_near(row_pos[h], key_pos, window)) << bit;
        bits.visible |= static_cast<uint32_t>(rerope_visible(row_pos[h], key_pos, causal)) << bit;
      }
    }
  return bits;
}

// Band tiles: the far-side product, 16 keys at a time (the Q fragments reloaded for each group,
// which keeps only 8 extra accumulators live), replacing s[j][i] wherever the pair is not near.
template <typename T, int kHeadDim>
__device__ __forceinline__ void warp_far_scores_where_far(const T* q_tile, const T* k_tile, float (&s)[kBlockN / 8][4],
                                                          uint32_t near_bits) {
  using S = Shape<kHeadDim>;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int nn = 0; nn < kBlockN / 16; ++nn) {
    float f[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int kk = 0; kk < S::kKSteps; ++kk) {
      uint32_t a[4], bk[4];
      device::ldmatrix<4>(a, q_tile + smem_offset<kHeadDim>(16 * warp + lane % 8 + 8 * ((lane / 8) % 2), 2 * kk + lane / 16));
      device::ldmatrix<4>(bk, k_tile + smem_offset<kHeadDim>(16 * nn + lane % 8 + 8 * (lane / 16), 2 * kk + (lane / 8) % 2));
      const uint32_t b0[2] = {bk[0], bk[1]}, b1[2] = {bk[2], bk[3]};
      device::mma_m16n8k16<T>(f[0], a, b0);
      device::mma_m16n8k16<T>(f[1], a, b1);
    }
#pragma unroll
    for (int jj = 0; jj < 2; ++jj)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (!((near_bits >> (4 * (2 * nn + jj) + i)) & 1u)) s[2 * nn + jj][i] = f[jj][i];
  }
}

// o += P V: P (16 x 64, from the score accumulators, rounded to T) times the V tile (64 x D).
template <typename T, int kHeadDim>
__device__ __forceinline__ void warp_pv(const float (&prob)[kBlockN / 8][4], const T* v_tile,
                                        float (&o)[Shape<kHeadDim>::kDimBlocks][4]) {
  using S = Shape<kHeadDim>;
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    // The C fragments of key blocks 2kk and 2kk+1 are the A fragment of this 16-key step.
    const uint32_t a[4] = {device::pack2<T>(prob[2 * kk][0], prob[2 * kk][1]),
                           device::pack2<T>(prob[2 * kk][2], prob[2 * kk][3]),
                           device::pack2<T>(prob[2 * kk + 1][0], prob[2 * kk + 1][1]),
                           device::pack2<T>(prob[2 * kk + 1][2], prob[2 * kk + 1][3])};
#pragma unroll
    for (int dd = 0; dd < S::kDimBlocks / 2; ++dd) {
      // B from V [key][dim], transposed: (keys 0-7, dims 0-7), (keys 8-15, dims 0-7), (keys 0-7,
      // dims 8-15), (keys 8-15, dims 8-15).
      uint32_t bv[4];
      device::ldmatrix<4, true>(bv, v_tile + smem_offset<kHeadDim>(16 * kk + lane % 8 + 8 * ((lane / 8) % 2), 2 * dd + lane / 16));
      const uint32_t b0[2] = {bv[0], bv[1]}, b1[2] = {bv[2], bv[3]};
      device::mma_m16n8k16<T>(o[2 * dd], a, b0);
      device::mma_m16n8k16<T>(o[2 * dd + 1], a, b1);
    }
  }
}

// o += P V for a warp whose tile has masked pairs while V holds a non-finite value: the pairs are
// taken one by one and the masked ones skipped, so that a masked key's V never reaches a row (the mma
// would add 0 * NaN), while a visible key's non-finite V propagates as in IEEE arithmetic. Lane (g, t)
// updates its own accumulators (rows g, g + 8; dims 8j + 2t, +1), reading each probability and
// visibility bit from the lane of its row group that holds it. Rare: only tiles with both.
template <typename T, int kHeadDim>
__device__ void warp_pv_skip_masked(const float (&prob)[kBlockN / 8][4], uint32_t visible_bits, const T* v_tile,
                                    float (&o)[Shape<kHeadDim>::kDimBlocks][4]) {
  using S = Shape<kHeadDim>;
  const int lane = static_cast<int>(threadIdx.x) % 32, t = lane % 4;
#pragma unroll 1
  for (int src_t = 0; src_t < 4; ++src_t) {
    const int src = (lane & ~3) | src_t;
    const uint32_t visible = __shfl_sync(kFullMask, visible_bits, src);
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // element i of block j at lane src: row g + 8 (i / 2), key 8j + 2 src_t + i % 2
        const float pr = round_to<T>(__shfl_sync(kFullMask, prob[j][i], src));
        if (!((visible >> (4 * j + i)) & 1u)) continue;
        const T* v_row = v_tile + smem_offset<kHeadDim>(8 * j + 2 * src_t + i % 2, 0) + 2 * t;
#pragma unroll
        for (int dd = 0; dd < S::kDimBlocks; ++dd) {
          o[dd][2 * (i / 2)] += pr * to_acc(v_row[8 * dd]);
          o[dd][2 * (i / 2) + 1] += pr * to_acc(v_row[8 * dd + 1]);
        }
      }
  }
}

}  // namespace tc

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
    rotary_sincos(rerope_far_query_position(pos, p.window, p.leaky_inv), inv_freq, &sc.z, &sc.w);
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
  // Leaky: the keys rotated at p/k; ReRoPE: the raw keys.
  __device__ tc::KeyRows<T> far_keys(int kv_head) const {
    if (p.leaky_inv != 0.0)
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
  [[maybe_unused]] const bool leaky = p.leaky_inv != 0.0;

  const int head = problem.head;
  const int kv_head = head / (p.q_heads / p.kv_heads);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // the row group and column pair of the mma fragments
  const int q_len = problem.q_len, k_len = problem.k_len;
  const int q0 = problem.query_block * kBlockM;
  const int n_tiles = (k_len + kBlockN - 1) / kBlockN;
  const float scale = problem.scale();

  // Rows g and g + 8 of the warp's slice: positions (-1 past the queries: never visible), and the
  // f32 score factor scale * log-n, times log2(e) for exp2.
  int64_t row_pos[2];
  float row_factor[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int query = q0 + 16 * warp + g + 8 * h;
    row_pos[h] = query < q_len ? problem.query_position(query) : -1;
    row_factor[h] = scale * rerope_logn_scale(row_pos[h], p.logn_length, p.inv_log_train) * 1.4426950408889634f;
  }
  // Position bounds of the block's 64 queries and of the warp's 16 (rows past q_len left out).
  PositionRange block_q, warp_q;
  for (int r = lane; r < kBlockM; r += 32)
    if (q0 + r < q_len) block_q.add(problem.query_position(q0 + r));
  if (lane < 16 && q0 + 16 * warp + lane < q_len) warp_q.add(problem.query_position(q0 + 16 * warp + lane));
  block_q = warp_reduce_range(block_q);
  warp_q = warp_reduce_range(warp_q);

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
    return rerope_classify_tile(block_q, problem.key_tile(tile), p.window, p.causal);
  };

  float o[S::kDimBlocks][4];
#pragma unroll
  for (int j = 0; j < S::kDimBlocks; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // log2 domain; sum: this lane's
  bool seen[2] = {false, false};  // rows g, g + 8 had a visible pair among this lane's (by the mask)

  int tile = next_active_tile(problem, 0, n_tiles, block_q, p.window, p.causal);
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
      if (block_kind != TileKind::kFar || leaky) {  // uniform over the block
        rotate_key_tile<T, kHeadDim>(p, k_s, rates_s, j0, rows, block_kind == TileKind::kFar);
        __syncthreads();
      }
    }
    // This warp's class of the tile (its 16 queries): what it computes.
    const TileClass mine = rerope_classify_tile(warp_q, problem.key_tile(tile), p.window, p.causal);
    float s[kBlockN / 8][4];
    PairBits bits;
    if (mine.kind == TileKind::kBand || mine.needs_mask)
      bits = pair_bits(row_pos, problem, j0, p.window, p.causal);
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
        if (leaky) {  // the far side at p/k
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
    const int next = next_active_tile(problem, tile + 1, n_tiles, block_q, p.window, p.causal);
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

// ---- host launchers ------------------------------------------------------------------------------

// Whether the tensor-core prefill serves this problem: fp16/bf16 (the caller's choice of T), a
// supported head dim, and 16-byte aligned k/v rows (checked by the caller on the pointers).
constexpr bool rerope_tc_head_dim(int head_dim) {
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128;
}

// Shared memory of the tensor-core prefill per block (69,632 B at D 128: every GPU from sm_80 on).
inline std::size_t rerope_tc_smem_bytes(int head_dim) {
  switch (head_dim) {
    case 64: return tc::Shape<64>::kSmemBytes;
    case 80: return tc::Shape<80>::kSmemBytes;
    case 96: return tc::Shape<96>::kSmemBytes;
    default: return tc::Shape<128>::kSmemBytes;
  }
}

// Shared memory of the paged tensor-core prefill per block: the same, plus its request's turn rates.
inline std::size_t rerope_paged_tc_smem_bytes(int head_dim) {
  switch (head_dim) {
    case 64: return tc::Shape<64>::kPagedSmemBytes;
    case 80: return tc::Shape<80>::kPagedSmemBytes;
    case 96: return tc::Shape<96>::kPagedSmemBytes;
    default: return tc::Shape<128>::kPagedSmemBytes;
  }
}

// Workspace of the tensor-core prefill, allocated by the caller:
//   p.k_near: T [B, Hkv, Lk, D]; p.k_far: the same, Leaky only; tiles: KeyTile [B, ceil(Lk / 64)];
//   p.q_rotation: float [B, Lq, rotary_pairs, 4] (rerope_tc_query_rotation_floats); p.key_rates:
//   KeyRate [rotary_pairs].
inline int rerope_tc_key_tiles(int k_len) { return (k_len + tc::kBlockN - 1) / tc::kBlockN; }
inline int64_t rerope_tc_query_rotation_floats(const ReropeParams& p) {
  return static_cast<int64_t>(p.batch) * p.q_len * p.rotary_pairs * 4;
}

// Launches the five kernels: the keys' turn rates, keys rotated to T, the queries' sin/cos, the key-tile
// bounds, the prefill. `check(status, what)` runs after every launch (and after the shared-memory opt-in) with
// the CUDA status (0 = ok); it must not return on an error, so that no kernel reads the output of a
// failed one.
template <typename T, int kHeadDim, class Check>
inline void launch_rerope_prefill_tc(ReropeParams p, KeyTile* tiles, cudaStream_t stream, Check&& check) {
  using S = tc::Shape<kHeadDim>;
  const auto blocks_of_256 = [](int64_t items) {
    return dim3(static_cast<unsigned>((items + 255) / 256 < 65535 ? (items + 255) / 256 : 65535));
  };
  launch_rerope_key_rates(p, stream, check);
  ROPESCALE_LAUNCH_KERNEL((rerope_rotate_keys_kernel<T, T>),
                          blocks_of_256(static_cast<int64_t>(p.batch) * p.k_len * (p.head_dim / 2)), dim3(256), 0,
                          stream, p);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the rotate-keys kernel");
  const int64_t rotation_items = static_cast<int64_t>(p.batch) * p.q_len * p.rotary_pairs;
  if (rotation_items > 0) {
    ROPESCALE_LAUNCH_KERNEL(rerope_query_rotation_kernel<4>, blocks_of_256(rotation_items), dim3(256), 0, stream, p);
    check(ROPESCALE_LAST_LAUNCH_ERROR(), "the query-rotation kernel");
  }
  const int n_tiles = rerope_tc_key_tiles(p.k_len);
  ROPESCALE_LAUNCH_KERNEL(rerope_key_tiles_kernel<tc::kBlockN>,
                          dim3(static_cast<unsigned>((n_tiles + kWarps - 1) / kWarps), static_cast<unsigned>(p.batch)),
                          dim3(kThreads), 0, stream, p, tiles);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the key-tiles kernel");
  static device::SmemOptIn opt_in;  // once per device
  check(opt_in.ensure((rerope_prefill_tc_kernel<T, kHeadDim>), S::kSmemBytes),
        "the shared-memory opt-in of the tensor-core prefill");
  const dim3 grid(static_cast<unsigned>((p.q_len + tc::kBlockM - 1) / tc::kBlockM), static_cast<unsigned>(p.q_heads),
                  static_cast<unsigned>(p.batch));
  ROPESCALE_LAUNCH_KERNEL((rerope_prefill_tc_kernel<T, kHeadDim>), grid, dim3(kThreads), S::kSmemBytes, stream, p,
                          static_cast<const KeyTile*>(tiles));
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the tensor-core prefill kernel");
}

// Whether the caches' rows suit the tensor-core prefill's 16-byte cp.async (the values, and the keys
// of the requests that rotate their key tiles in the kernel, are read in place): base addresses and every
// stride (elements) multiples of 16 bytes.
inline bool rerope_paged_tc_aligned(const ReropeParams& p, std::size_t element_bytes) {
  const int64_t per_chunk = static_cast<int64_t>(16 / element_bytes);
  return reinterpret_cast<uintptr_t>(p.v) % 16 == 0 && p.v_stride_b % per_chunk == 0 &&
         p.v_stride_h % per_chunk == 0 && p.v_stride_l % per_chunk == 0 && reinterpret_cast<uintptr_t>(p.k) % 16 == 0 &&
         p.k_stride_b % per_chunk == 0 && p.k_stride_h % per_chunk == 0 && p.k_stride_l % per_chunk == 0;
}

// The tensor-core rows of a paged launch: after launch_rerope_paged (and its split combine, which
// leaves these rows to this launch), whose schedule kernel, run with p.paged_tc, chose the requests (and,
// within p.paged_tc_key_budget, those whose keys the pre-pass rotates) and wrote p.paged_tc_key_offsets
// and p.paged_tc_tasks (p.num_paged_tc_tasks of them, rerope_paged_max_tc_tasks), and whose first kernel
// wrote p.key_rates. Workspaces, allocated by the caller: p.q_rotation float [T, rotary_pairs, 4]; with a
// budget, p.k_near and p.k_far, T [paged_tc_key_budget, Hkv, D] each (rerope_paged_workspace_layout).
// The value cache (and the key cache, read in place by the requests past the budget) must pass
// rerope_paged_tc_aligned; q_heads <= 65535.
template <typename T, int kHeadDim, class Check>
inline void launch_rerope_paged_tc(ReropeParams p, cudaStream_t stream, Check&& check) {
  using S = tc::Shape<kHeadDim>;
  p.batch = 1;
  p.causal = true;
  if (!p.paged_tc || p.num_paged_tc_tasks == 0) return;
  if (p.paged_tc_key_budget > 0) {
    // Grid-stride over the rows in use (known on the device only): up to 1024 blocks of 256, so that a
    // launch whose tensor-core rows all rotate in the kernel (or that has none) costs little.
    const int64_t rotate_items = p.paged_tc_key_budget * (p.head_dim / 2);
    const int64_t rotate_blocks = (rotate_items + 255) / 256 < 1024 ? (rotate_items + 255) / 256 : 1024;
    ROPESCALE_LAUNCH_KERNEL(rerope_paged_rotate_keys_kernel<T>, dim3(static_cast<unsigned>(rotate_blocks)), dim3(256),
                            0, stream, p);
    check(ROPESCALE_LAST_LAUNCH_ERROR(), "the paged rotate-keys kernel");
  }
  if (p.rotary_pairs > 0) {
    ROPESCALE_LAUNCH_KERNEL(rerope_paged_query_rotation_kernel<tc::kBlockM>,
                            dim3(static_cast<unsigned>(p.num_paged_tc_tasks)), dim3(256), 0, stream, p);
    check(ROPESCALE_LAST_LAUNCH_ERROR(), "the paged query-rotation kernel");
  }
  static device::SmemOptIn opt_in;  // once per device
  check(opt_in.ensure((rerope_paged_tc_kernel<T, kHeadDim>), S::kPagedSmemBytes),
        "the shared-memory opt-in of the paged tensor-core prefill");
  const dim3 grid(static_cast<unsigned>(p.num_paged_tc_tasks), static_cast<unsigned>(p.q_heads));
  ROPESCALE_LAUNCH_KERNEL((rerope_paged_tc_kernel<T, kHeadDim>), grid, dim3(kThreads), S::kPagedSmemBytes, stream, p);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the paged tensor-core prefill kernel");
}

}  // namespace ropescale::rerope_cuda
