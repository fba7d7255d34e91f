// Test kernels for the tensor-core and asynchronous-copy primitives of ropescale/portable.h
// (ropescale::device: mma_m16n8k16, ldmatrix, cp_async_16), and for the emulation's launch rules
// (static shared memory poisoning, block order, the 48 KiB opt-in). Plain CUDA: the same file
// compiles with nvcc (nvcc_compile_check.cu) and, with ROPESCALE_EMULATION, runs in
// test_emulation.cpp, which compares the results with plain matrix products written there.
//
// The fragments are loaded here from global memory straight from the PTX ISA's table (section
// 9.7.14.5.8, "Matrix Fragments for mma.m16n8k16 with floating point type"), register by register
// for each lane, which is written independently of the emulation's element-by-element
// transcription (ropescale_emu/warp_matrix.h). `mapping` selects deliberately wrong lane mappings,
// which the tests require NOT to reproduce the product: a test that could not tell a wrong
// mapping from the right one would prove nothing.
#pragma once

#include "ropescale/portable.h"

#include <cstdint>
#include <cstring>

namespace emu_test {

enum FragmentMapping : int {
  kDocumented = 0,
  kRowHalvesSwapped = 1,    // A: registers 1 and 2 exchanged (rows g+8 vs columns +8)
  kGroupThreadSwapped = 2,  // groupID and threadID_in_group taken from the wrong lane bits
  kBHalvesSwapped = 3,      // B: the two k halves exchanged
};

template <typename T>
__device__ __forceinline__ uint32_t pack_bits(T lo, T hi) {
  uint16_t l, h;
  memcpy(&l, &lo, 2);
  memcpy(&h, &hi, 2);
  return static_cast<uint32_t>(l) | (static_cast<uint32_t>(h) << 16);
}

// One warp: d = a b + c with a 16x16 row-major, b 16x8 stored b[k * 8 + n], c and d 16x8 row-major.
template <typename T>
__global__ void mma_from_global_kernel(const T* a, const T* b, const float* c, float* d, int mapping) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  int g = lane / 4, t = lane % 4;  // groupID, threadID_in_group
  if (mapping == kGroupThreadSwapped) g = lane % 8, t = lane / 8;
  // Lane (g, t) holds A rows g and g + 8, columns 2t, 2t+1 and 2t+8, 2t+9:
  //   reg 0 = (g, 2t..2t+1), reg 1 = (g+8, 2t..), reg 2 = (g, 2t+8..), reg 3 = (g+8, 2t+8..)
  uint32_t af[4] = {pack_bits(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]),
                    pack_bits(a[(g + 8) * 16 + 2 * t], a[(g + 8) * 16 + 2 * t + 1]),
                    pack_bits(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]),
                    pack_bits(a[(g + 8) * 16 + 2 * t + 8], a[(g + 8) * 16 + 2 * t + 9])};
  if (mapping == kRowHalvesSwapped) {
    const uint32_t tmp = af[1];
    af[1] = af[2];
    af[2] = tmp;
  }
  // B column g, rows 2t, 2t+1 (reg 0) and 2t+8, 2t+9 (reg 1).
  uint32_t bf[2] = {pack_bits(b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g]),
                    pack_bits(b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g])};
  if (mapping == kBHalvesSwapped) {
    const uint32_t tmp = bf[0];
    bf[0] = bf[1];
    bf[1] = tmp;
  }
  // C/D rows g (c0, c1) and g + 8 (c2, c3), columns 2t, 2t + 1.
  float acc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
  ropescale::device::mma_m16n8k16<T>(acc, af, bf);
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

// ldmatrix of kNum 8x8 matrices (16-bit cells, matrices[m * 64 + row * 8 + col]) placed in shared
// memory with a row stride of kStride cells and matrix m at column 8 * (m % 2); lane l passes the
// address of row l % 8 of matrix l / 8 (or row 7 - l % 8 with reversed_rows). Lanes past 8 * kNum
// pass a misaligned pointer, which ldmatrix must ignore. out[lane * kNum + m] = register m.
constexpr int kLdmatrixStride = 24;  // 48 bytes: rows stay 16-byte aligned
template <int kNum, bool kTrans>
__global__ void ldmatrix_kernel(const uint16_t* matrices, uint32_t* out, int reversed_rows) {
  ROPESCALE_DYNAMIC_SMEM(uint16_t, smem);
  const int lane = static_cast<int>(threadIdx.x);
  for (int i = lane; i < kNum * 64; i += 32) {
    const int m = i / 64, row = (i / 8) % 8, col = i % 8;
    smem[(m * 8 + row) * kLdmatrixStride + 8 * (m % 2) + col] = matrices[i];
  }
  __syncwarp();
  const int m = lane / 8, row = reversed_rows ? 7 - lane % 8 : lane % 8;
  const uint16_t* address = m < kNum ? smem + (m * 8 + row) * kLdmatrixStride + 8 * (m % 2) : smem + 1;
  uint32_t r[kNum];
  ropescale::device::ldmatrix<kNum, kTrans>(r, address);
  for (int k = 0; k < kNum; ++k) out[lane * kNum + k] = r[k];
}

// ldmatrix feeding mma, as a kernel does: A (16x16 row-major) through ldmatrix.x4; B (16x8) once
// from a [k][n] copy through ldmatrix.x2.trans, once from a [n][k] copy through two ldmatrix.x1.
// d_trans and d_x1 (16x8 row-major) must both equal the plain product a b.
template <typename T>
__global__ void ldmatrix_mma_kernel(const T* a, const T* b, float* d_trans, float* d_x1) {
  ROPESCALE_DYNAMIC_SMEM(T, smem);
  constexpr int kAStride = 24, kBStride = 16, kBtStride = 24;
  T* a_s = smem;                    // [16][kAStride]
  T* b_s = a_s + 16 * kAStride;     // [16 k][kBStride], columns 0..7 used
  T* bt_s = b_s + 16 * kBStride;    // [8 n][kBtStride], columns 0..15 used
  const int lane = static_cast<int>(threadIdx.x);
  for (int i = lane; i < 256; i += 32) a_s[(i / 16) * kAStride + i % 16] = a[i];
  for (int i = lane; i < 128; i += 32) {
    const int k = i / 8, n = i % 8;
    b_s[k * kBStride + n] = b[i];
    bt_s[n * kBtStride + k] = b[i];
  }
  __syncwarp();
  // A: matrix m = lane / 8 is (rows 8 (m % 2) .., columns 8 (m / 2) ..): registers a0..a3.
  uint32_t af[4];
  ropescale::device::ldmatrix<4>(af, a_s + (lane % 8 + 8 * ((lane / 8) % 2)) * kAStride + 8 * (lane / 16));
  // B from [k][n], transposed: matrix 0 = k rows 0..7, matrix 1 = k rows 8..15.
  uint32_t bf[2];
  ropescale::device::ldmatrix<2, true>(bf, b_s + (lane % 16) * kBStride);
  // B from [n][k]: k columns 0..7, then 8..15.
  uint32_t lo[1], hi[1];
  ropescale::device::ldmatrix<1>(lo, bt_s + (lane % 8) * kBtStride);
  ropescale::device::ldmatrix<1>(hi, bt_s + (lane % 8) * kBtStride + 8);
  const uint32_t bx1[2] = {lo[0], hi[0]};
  float acc_trans[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc_x1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  ropescale::device::mma_m16n8k16<T>(acc_trans, af, bf);
  ropescale::device::mma_m16n8k16<T>(acc_x1, af, bx1);
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    d_trans[row * 8 + col] = acc_trans[i];
    d_x1[row * 8 + col] = acc_x1[i];
  }
}

// cp.async in two groups, 64 threads: group 0 copies chunk t (16 bytes) in full; group 1 copies
// chunk 64 + t with 16, 8 or 0 source bytes (t % 3), the rest zero-filled. After wait<1> each
// thread reads its own group-0 chunk (complete) and its own group-1 chunk (still in flight:
// undefined on a GPU, 0xFF bytes in the emulation); after wait<0> and a barrier, another thread's.
struct CpAsyncOutputs {
  float4* own_after_wait1;
  float4* pending_after_wait1;
  float4* other_after_wait0;  // chunk 127 - t
};
__global__ void cp_async_kernel(const float4* src, CpAsyncOutputs out) {
  ROPESCALE_DYNAMIC_SMEM(float4, smem);
  const int t = static_cast<int>(threadIdx.x);
  ropescale::device::cp_async_16(&smem[t], &src[t], 16);
  ropescale::device::cp_async_commit();
  ropescale::device::cp_async_16(&smem[64 + t], &src[64 + t], t % 3 == 0 ? 16 : (t % 3 == 1 ? 8 : 0));
  ropescale::device::cp_async_commit();
  ropescale::device::cp_async_wait<1>();
  out.own_after_wait1[t] = smem[t];
  out.pending_after_wait1[t] = smem[64 + t];
  ropescale::device::cp_async_wait<0>();
  __syncthreads();
  out.other_after_wait0[t] = smem[127 - t];
}

// Misuse the emulation must refuse (each throws ropescale_emu::device_error):
//   0: mma with one lane exited, 1: ldmatrix from global memory, 2: ldmatrix row not 16-byte
//   aligned, 3: cp.async into global memory.
__global__ void matrix_misuse_kernel(const __half* global_halves, float* global_out, int which) {
  ROPESCALE_DYNAMIC_SMEM(__half, smem);
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (which == 0) {
    if (lane == 5) return;
    uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    ropescale::device::mma_m16n8k16<__half>(acc, a, b);
  } else if (which == 1) {
    uint32_t r[1];
    ropescale::device::ldmatrix<1>(r, global_halves + 8 * (lane % 8));
  } else if (which == 2) {
    uint32_t r[1];
    ropescale::device::ldmatrix<1>(r, smem + 8 * (lane % 8) + 1);
  } else {
    ropescale::device::cp_async_16(global_out + 4 * lane, global_halves, 16);
    ropescale::device::cp_async_wait<0>();
  }
}

// Reads each cell of a static __shared__ array before writing it; out[block][t] = what it read.
// Not a template: GCC drops the section attribute that lets the emulation poison static __shared__
// variables when they are declared in a function template (see cuda_emulation.h).
constexpr int kCells = 32;
__global__ void static_shared_first_read_kernel(int* out) {
  __shared__ int cells[kCells];
  const int t = static_cast<int>(threadIdx.x);
  out[blockIdx.x * kCells + t] = cells[t];
  __syncthreads();
  cells[t] = 1000 + static_cast<int>(blockIdx.x);  // what the next block would see without poisoning
}

// tickets[linear block] = the order in which the blocks ran.
__global__ void block_ticket_kernel(unsigned* counter, unsigned* tickets) {
  if (threadIdx.x == 0)
    tickets[blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)] = atomicAdd(counter, 1u);
}

// Writes its dynamic shared memory size worth of bytes, to check the launch limits.
__global__ void dynamic_smem_kernel(unsigned char* out, int bytes) {
  ROPESCALE_DYNAMIC_SMEM(unsigned char, smem);
  for (int i = static_cast<int>(threadIdx.x); i < bytes; i += static_cast<int>(blockDim.x)) smem[i] = 1;
  __syncthreads();
  if (threadIdx.x == 0) out[0] = smem[bytes - 1];
}

}  // namespace emu_test
