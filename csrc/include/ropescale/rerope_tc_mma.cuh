// The tensor-core prefill's two products on mma.sync.m16n8k16 (rerope_attention_tc.cuh): S = Q K^T,
// with the far side where a band tile's pairs need it, and O += P V (pair by pair where a masked key's
// V is not finite).
#pragma once

#include <cstdint>

#include "ropescale/portable.h"
#include "ropescale/element.h"
#include "ropescale/rerope_math.h"
#include "ropescale/rerope_params.h"
#include "ropescale/rerope_tc_tiles.cuh"

namespace ropescale::rerope_cuda::tc {

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
// A lane's two query rows: their positions (-1: padding or past the queries) and the first key position of
// their near side (RegionRule::near_start).
struct RowBounds {
  int position[2], near_start[2];
};
// The dense problem's key positions apart from the problem, whose reference to the kernel's parameters,
// passed to pair_bits (not inlined), would copy the parameters into local memory (504 bytes a thread);
// -1 from `count` on.
struct StoredKeyPositions {
  const int64_t* base;
  int count;
  __device__ __forceinline__ int64_t key_position(int key) const { return key < count ? base[key] : -1; }
};
// Not inlined: inlined, its 32 comparisons cost the D-128 kernels a spill on sm_80 (it runs on band and
// masked tiles only). `keys`: the problem's key_positions().
template <class KeyPositions>
__device__ ROPESCALE_NOINLINE PairBits pair_bits(const RowBounds& rows, const KeyPositions& keys, int j0,
                                                 bool causal) {
  const int t = static_cast<int>(threadIdx.x) % 4;
  PairBits bits;
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int key = j0 + 8 * j + 2 * t + c;
      const int64_t key_pos = keys.key_position(key);  // past the keys: -1, never visible
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int bit = 4 * j + 2 * h + c;
        bits.near |= static_cast<uint32_t>(key_pos >= rows.near_start[h]) << bit;
        bits.visible |= static_cast<uint32_t>(rerope_visible(rows.position[h], key_pos, causal)) << bit;
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

}  // namespace ropescale::rerope_cuda::tc
