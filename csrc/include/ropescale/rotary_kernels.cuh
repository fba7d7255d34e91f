// The rotary CUDA kernel and its launcher, free of torch: compiled by nvcc for the GPU
// (csrc/cuda/rotary.cu does the ATen glue) and, with ROPESCALE_EMULATION, by the host compiler
// for the SIMT emulation that runs it on the CPU in CI (tests/emulation/test_rotary_emu.cpp).
//
// Shape of the work, in the manner of FlashInfer's pos_enc.cuh: a thread owns kPairs consecutive
// pairs of one token, computes their cos/sin once in fp32 (fp64 for double), or loads them from a
// table of the operands' type or of float, then walks every row that shares the token (each head,
// and each batch row when the table is shared) of q and of k, with 16-byte loads and stores. threadIdx.x runs along the pairs of a row,
// threadIdx.y over tokens, blockIdx.x over groups of tokens, and blockIdx.y splits the rows of a
// token between blocks when there are too few tokens to fill the GPU (decode).
#pragma once

#include "ropescale/portable.h"  // ROPESCALE_LAUNCH_KERNEL, __half, __nv_bfloat16 (real or emulated)

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ropescale/element.h"
#include "ropescale/rotary.h"

namespace ropescale {
namespace rotary {

// `#pragma unroll` for nvcc; host compilers (the emulation) unroll on their own.
#ifndef ROPESCALE_UNROLL
#if defined(__CUDACC__)
#define ROPESCALE_UNROLL _Pragma("unroll")
#else
#define ROPESCALE_UNROLL
#endif
#endif

constexpr int kBlockThreads = 128;
constexpr int kVectorBytes = 16;

// N consecutive elements moved as one aligned access (16 bytes at most per instruction).
template <class T, int N>
struct alignas(sizeof(T) * N < kVectorBytes ? sizeof(T) * N : kVectorBytes) Chunk {
  T v[N];
};

template <class T, int N>
__device__ __forceinline__ Chunk<T, N> load_chunk(const T* p) {
  return *reinterpret_cast<const Chunk<T, N>*>(p);
}
template <class T, int N>
__device__ __forceinline__ void store_chunk(T* p, const Chunk<T, N>& c) {
  *reinterpret_cast<Chunk<T, N>*>(p) = c;
}

// Pairs per thread on the vector path: 16 bytes of the a-halves (and 16 of the b-halves).
template <class T>
constexpr int vector_pairs() {
  return kVectorBytes / static_cast<int>(sizeof(T));
}

// Rotates pairs [first, first + kPairs) of one row.
template <class T, int kPairs, bool kInterleaved>
__device__ __forceinline__ void rotate_chunk(const T* in, T* out, int64_t half, int64_t first,
                                             const PairCoeffs<acc_t<T>> (&coeffs)[kPairs]) {
  using Acc = acc_t<T>;
  if constexpr (kInterleaved && kPairs == 1) {
    // The unaligned path: rows may start on any element, so no two-element accesses.
    Acc ya, yb;
    rotate(coeffs[0], to_acc(in[2 * first]), to_acc(in[2 * first + 1]), &ya, &yb);
    out[2 * first] = from_acc<T>(ya);
    out[2 * first + 1] = from_acc<T>(yb);
  } else if constexpr (kInterleaved) {
    // 2 * kPairs consecutive elements hold the kPairs (even, odd) pairs.
    Chunk<T, 2 * kPairs> x = load_chunk<T, 2 * kPairs>(in + 2 * first);
    ROPESCALE_UNROLL
    for (int j = 0; j < kPairs; ++j) {
      Acc ya, yb;
      rotate(coeffs[j], to_acc(x.v[2 * j]), to_acc(x.v[2 * j + 1]), &ya, &yb);
      x.v[2 * j] = from_acc<T>(ya);
      x.v[2 * j + 1] = from_acc<T>(yb);
    }
    store_chunk<T, 2 * kPairs>(out + 2 * first, x);
  } else {
    Chunk<T, kPairs> xa = load_chunk<T, kPairs>(in + first);
    Chunk<T, kPairs> xb = load_chunk<T, kPairs>(in + half + first);
    ROPESCALE_UNROLL
    for (int j = 0; j < kPairs; ++j) {
      Acc ya, yb;
      rotate(coeffs[j], to_acc(xa.v[j]), to_acc(xb.v[j]), &ya, &yb);
      xa.v[j] = from_acc<T>(ya);
      xb.v[j] = from_acc<T>(yb);
    }
    store_chunk<T, kPairs>(out + first, xa);
    store_chunk<T, kPairs>(out + half + first, xb);
  }
}

// Table: the element type of cos/sin (T, or float for the other types); ignored by kPositions.
template <class T, class Table, int kPairs, bool kInterleaved, TableKind kTable>
__global__ void __launch_bounds__(kBlockThreads) rotary_kernel(const Params<T, Table> p) {
  using Acc = acc_t<T>;
  // 32-bit index arithmetic: tokens and rows stay below 2^31 (checked at the op boundary).
  const uint32_t token = blockIdx.x * blockDim.y + threadIdx.y;
  if (token >= static_cast<uint32_t>(p.tokens())) return;  // no barriers below: leaving early is safe
  const uint32_t seq_len = static_cast<uint32_t>(p.seq_len);
  const int64_t table_row = token / seq_len;
  const int64_t seq = token % seq_len;
  const int64_t half = p.half();
  const uint32_t rows = static_cast<uint32_t>(rows_per_token(p));

  for (int64_t chunk = threadIdx.x; chunk * kPairs < half; chunk += blockDim.x) {
    const int64_t first = chunk * kPairs;
    PairCoeffs<Acc> coeffs[kPairs];  // once per token, reused for every row below
    ROPESCALE_UNROLL
    for (int j = 0; j < kPairs; ++j)
      coeffs[j] = pair_coeffs<kTable, Acc>(p, table_row, seq, first + j, [](Table v) { return to_acc(v); });
    for (uint32_t row = blockIdx.y; row < rows; row += gridDim.y) {
      const Row<T> r = locate_row(p, table_row, seq, row);
      rotate_chunk<T, kPairs, kInterleaved>(r.in, r.out, half, first, coeffs);
    }
  }
  if (p.copy_tail) {
    for (uint32_t row = blockIdx.y; row < rows; row += gridDim.y) {
      const Row<T> r = locate_row(p, table_row, seq, row);
      for (int64_t e = p.rotary_dim + threadIdx.x * kPairs; e < p.head_dim; e += blockDim.x * kPairs)
        store_chunk<T, kPairs>(r.out + e, load_chunk<T, kPairs>(r.in + e));
    }
  }
}

// True when every row access of `x` starts on a multiple of `elements` elements from an aligned
// base, so chunks of that many elements can be moved as one aligned access.
template <class T>
inline bool rows_aligned(const Operand<T>& x, int64_t seq_len, int64_t elements) {
  const auto aligned_ptr = [&](const void* ptr) {
    return reinterpret_cast<uintptr_t>(ptr) % (elements * sizeof(T)) == 0;
  };
  // A stride along a dimension of size 1 is never used.
  const auto aligned_stride = [&](int64_t size, int64_t stride) { return size == 1 || stride % elements == 0; };
  return aligned_ptr(x.in) && aligned_ptr(x.out) && aligned_stride(x.batch, x.in_stride_batch) &&
         aligned_stride(x.heads, x.in_stride_head) && aligned_stride(seq_len, x.in_stride_seq) &&
         aligned_stride(x.batch, x.out_stride_batch) && aligned_stride(x.heads, x.out_stride_head) &&
         aligned_stride(seq_len, x.out_stride_seq);
}

// Whether the 16-byte path applies: whole chunks in both halves (and in the copied tail), and
// aligned rows in every operand. Otherwise the kernel runs one pair per thread.
template <class T, class Table>
inline bool can_vectorize(const Params<T, Table>& p) {
  const int64_t n = vector_pairs<T>();
  if (p.half() % n != 0) return false;
  if (p.copy_tail && (p.head_dim - p.rotary_dim) % n != 0) return false;
  for (int o = 0; o < p.num_operands; ++o)
    if (!rows_aligned(p.operands[o], p.seq_len, n)) return false;
  return true;
}

// Grid and block of a launch; exposed so tests can check that few tokens still give many blocks.
struct LaunchShape {
  dim3 grid, block;
  int pairs_per_thread;
};

template <class T, class Table>
inline LaunchShape launch_shape(const Params<T, Table>& p, int64_t min_blocks) {
  const int pairs = can_vectorize(p) ? vector_pairs<T>() : 1;
  const int64_t chunks = p.half() / pairs;
  const int64_t block_x = std::min<int64_t>(chunks, kBlockThreads);
  const int64_t block_y = std::max<int64_t>(1, std::min<int64_t>(kBlockThreads / block_x, p.tokens()));
  const int64_t grid_x = (p.tokens() + block_y - 1) / block_y;
  // Split the rows of a token over blockIdx.y until the grid reaches min_blocks (the GPU's
  // resident-block capacity), so that a handful of tokens still keeps every SM busy.
  const int64_t wanted = (min_blocks + grid_x - 1) / grid_x;
  const int64_t grid_y = std::max<int64_t>(1, std::min<int64_t>({wanted, rows_per_token(p), 65535}));
  return {dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)),
          dim3(static_cast<unsigned>(block_x), static_cast<unsigned>(block_y)), pairs};
}

// The position kind reads no table: it is built with Table = T only, and Params with another table
// type never name it (the op boundary gives positions Params<T>).
template <class T, class Table, int kPairs, bool kInterleaved>
inline void launch_for_table(const Params<T, Table>& p, const LaunchShape& s, cudaStream_t stream) {
  switch (p.table) {
    case TableKind::kFullWidth:
      ROPESCALE_LAUNCH_KERNEL((rotary_kernel<T, Table, kPairs, kInterleaved, TableKind::kFullWidth>), s.grid, s.block,
                              0, stream, p);
      break;
    case TableKind::kHalfWidth:
      ROPESCALE_LAUNCH_KERNEL((rotary_kernel<T, Table, kPairs, kInterleaved, TableKind::kHalfWidth>), s.grid, s.block,
                              0, stream, p);
      break;
    case TableKind::kPositions:
      if constexpr (std::is_same_v<Table, T>)
        ROPESCALE_LAUNCH_KERNEL((rotary_kernel<T, T, kPairs, kInterleaved, TableKind::kPositions>), s.grid, s.block, 0,
                                stream, p);
      break;
  }
}

template <class T, class Table, int kPairs>
inline void launch_for_layout(const Params<T, Table>& p, const LaunchShape& s, cudaStream_t stream) {
  if (p.interleaved)
    launch_for_table<T, Table, kPairs, true>(p, s, stream);
  else
    launch_for_table<T, Table, kPairs, false>(p, s, stream);
}

// Launches the rotation described by `p` on `stream`. `min_blocks` is how many blocks fill the
// device (SM count x resident blocks per SM). Nothing is launched for empty work. The caller
// checks for launch errors.
// Params<T, float> (float tables with half, bfloat16 or double operands) serve the table kinds only.
template <class T, class Table>
inline void launch_rotary(const Params<T, Table>& p, int64_t min_blocks, cudaStream_t stream) {
  static_assert(std::is_same_v<Table, T> || std::is_same_v<Table, float>, "tables are of the operands' type or float");
  if (p.tokens() == 0 || rows_per_token(p) == 0 || p.rotary_dim == 0) return;
  const LaunchShape shape = launch_shape(p, min_blocks);
  if (shape.pairs_per_thread == vector_pairs<T>())
    launch_for_layout<T, Table, vector_pairs<T>()>(p, shape, stream);
  else
    launch_for_layout<T, Table, 1>(p, shape, stream);
}

}  // namespace rotary
}  // namespace ropescale
