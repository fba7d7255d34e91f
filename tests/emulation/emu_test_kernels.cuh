// Test kernels for the SIMT emulation, written as ordinary CUDA: the same file
// compiles with nvcc (see nvcc_compile_check.cu) and, with ROPESCALE_EMULATION,
// with the host compiler (see test_emulation.cpp).
#pragma once

#include "ropescale/portable.h"

#include <cstdint>

namespace emu_test {

// ---- 3D grid / 3D block index math -----------------------------------------
__device__ __forceinline__ unsigned pack_coords(uint3 block, uint3 thread) {
  return (block.x << 24) | (block.y << 20) | (block.z << 16) | (thread.x << 8) |
         (thread.y << 4) | thread.z;
}

// out[linear block][linear thread] = packed (blockIdx, threadIdx).
__global__ void write_coords_kernel(unsigned* out) {
  const unsigned block_linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned thread_linear =
      threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned threads_per_block = blockDim.x * blockDim.y * blockDim.z;
  out[block_linear * threads_per_block + thread_linear] = pack_coords(blockIdx, threadIdx);
}

inline void launch_write_coords(dim3 grid, dim3 block, unsigned* out, cudaStream_t stream) {
  ROPESCALE_LAUNCH_KERNEL(write_coords_kernel, grid, block, 0, stream, out);
}

// ---- block reduction: static __shared__ + __syncthreads ---------------------
template <int kBlockSize>
__global__ void __launch_bounds__(kBlockSize)
    block_sum_kernel(const float* __restrict__ in, float* __restrict__ block_sums, int n) {
  __shared__ float partial[kBlockSize];
  const int tid = static_cast<int>(threadIdx.x);
  const int i = static_cast<int>(blockIdx.x) * kBlockSize + tid;
  partial[tid] = i < n ? in[i] : 0.0f;
  __syncthreads();
  for (int stride = kBlockSize / 2; stride > 0; stride /= 2) {
    if (tid < stride) partial[tid] += partial[tid + stride];
    __syncthreads();
  }
  if (tid == 0) block_sums[blockIdx.x] = partial[0];
}

template <int kBlockSize>
inline void launch_block_sum(const float* in, float* block_sums, int n, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((n + kBlockSize - 1) / kBlockSize);
  ROPESCALE_LAUNCH_KERNEL(block_sum_kernel<kBlockSize>, dim3(blocks), dim3(kBlockSize), 0, stream,
                          in, block_sums, n);
}

// ---- warp shuffles -----------------------------------------------------------
constexpr unsigned kFullMask = 0xffffffffu;

template <class T>
__device__ __forceinline__ T warp_sum_xor(T v, int width = 32) {
  for (int lane_mask = width / 2; lane_mask > 0; lane_mask /= 2)
    v += __shfl_xor_sync(kFullMask, v, lane_mask, width);
  return v;
}

template <class T>
__device__ __forceinline__ T warp_sum_down(T v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(kFullMask, v, offset);
  return v;
}

struct WarpOpsOutputs {
  float* xor_sum;      // per thread: sum over its warp (every lane)
  float* down_sum;     // per warp: lane 0's __shfl_down_sync sum
  float* scan;         // per thread: inclusive prefix sum within the warp (__shfl_up_sync)
  float* broadcast;    // per thread: lane 5's value (__shfl_sync)
  float* segment_sum;  // per thread: sum over its 8-lane segment (width 8)
  double* double_sum;  // per thread: warp sum in double
  int* int_sum;        // per thread: warp sum of (int)in
};

__global__ void warp_ops_kernel(const float* in, WarpOpsOutputs out) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned lane = threadIdx.x % 32;
  const float v = in[i];
  out.xor_sum[i] = warp_sum_xor(v);
  const float down = warp_sum_down(v);
  if (lane == 0) out.down_sum[i / 32] = down;
  float scan = v;
  for (unsigned offset = 1; offset < 32; offset *= 2) {
    const float up = __shfl_up_sync(kFullMask, scan, offset);
    if (lane >= offset) scan += up;
  }
  out.scan[i] = scan;
  out.broadcast[i] = __shfl_sync(kFullMask, v, 5);
  out.segment_sum[i] = warp_sum_xor(v, 8);
  out.double_sum[i] = warp_sum_xor(static_cast<double>(v));
  out.int_sum[i] = warp_sum_xor(static_cast<int>(v));
}

// ---- partial last warp (blockDim.x not a multiple of 32), votes ----------------
struct PartialWarpOutputs {
  int* warp_sums;             // [block][warp]
  unsigned* ballots;          // [block][warp]: __ballot_sync(odd value)
  unsigned* active_masks;     // [block][warp]: __activemask()
  int* any_all;               // [block][warp][2]: __any_sync(v > 90), __all_sync(v >= 0)
  int* block_votes;           // [block][3]: __syncthreads_count(odd), _or(v > 90), _and(v >= 0)
};

__global__ void partial_warp_kernel(const int* in, PartialWarpOutputs out) {
  const unsigned tid = threadIdx.x;
  const unsigned lane = tid % 32;
  const unsigned warp = tid / 32;
  const unsigned warps_per_block = (blockDim.x + 31) / 32;
  const unsigned slot = blockIdx.x * warps_per_block + warp;
  const int value = in[blockIdx.x * blockDim.x + tid];

  const unsigned active = __activemask();
  const unsigned ballot = __ballot_sync(kFullMask, value % 2 != 0);
  const int any_large = __any_sync(kFullMask, value > 90);
  const int all_non_negative = __all_sync(kFullMask, value >= 0);
  // Lanes past the end of a partial warp do not exist: skip their values.
  const unsigned lanes_in_warp = min(32u, blockDim.x - warp * 32);
  int sum = value;
  for (unsigned offset = 16; offset > 0; offset /= 2) {
    const int other = __shfl_down_sync(kFullMask, sum, offset);
    if (lane + offset < lanes_in_warp) sum += other;
  }
  if (lane == 0) {
    out.warp_sums[slot] = sum;
    out.ballots[slot] = ballot;
    out.active_masks[slot] = active;
    out.any_all[2 * slot] = any_large;
    out.any_all[2 * slot + 1] = all_non_negative;
  }
  const int odd_count = __syncthreads_count(value % 2 != 0);
  const int any_block = __syncthreads_or(value > 90);
  const int all_block = __syncthreads_and(value >= 0);
  if (tid == 0) {
    out.block_votes[3 * blockIdx.x] = odd_count;
    out.block_votes[3 * blockIdx.x + 1] = any_block;
    out.block_votes[3 * blockIdx.x + 2] = all_block;
  }
}

// ---- dynamic shared memory -----------------------------------------------------
// Reverses each block's chunk through shared memory; counts misaligned bases.
template <class T>
__global__ void reverse_in_block_kernel(const T* in, T* out, unsigned* misaligned) {
  ROPESCALE_DYNAMIC_SMEM(T, tile);
  const unsigned t = threadIdx.x;
  const unsigned base = blockIdx.x * blockDim.x;
  if (reinterpret_cast<std::uintptr_t>(tile) % 16 != 0) atomicAdd(misaligned, 1u);
  tile[t] = in[base + t];
  __syncthreads();
  out[base + t] = tile[blockDim.x - 1 - t];
}

template <class T>
inline void launch_reverse_in_block(const T* in, T* out, unsigned* misaligned, unsigned blocks,
                                    unsigned threads, cudaStream_t stream) {
  ROPESCALE_LAUNCH_KERNEL(reverse_in_block_kernel<T>, dim3(blocks), dim3(threads),
                          threads * sizeof(T), stream, in, out, misaligned);
}

// ---- atomics across blocks -------------------------------------------------------
struct AtomicOutputs {
  int* bins;
  float* float_total;
  double* double_total;
  unsigned* count;
  int* max_value;
  int* owner;        // starts at -1; atomicCAS lets exactly one thread claim it
  unsigned* claims;  // number of successful claims
};

__global__ void atomics_kernel(const int* values, int n, int num_bins, AtomicOutputs out) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;  // exited threads must not block anyone
  const int v = values[i];
  atomicAdd(&out.bins[v % num_bins], 1);
  atomicAdd(out.float_total, static_cast<float>(v));
  atomicAdd(out.double_total, 0.5 * v);
  atomicAdd(out.count, 1u);
  atomicMax(out.max_value, v);
  if (atomicCAS(out.owner, -1, i) == -1) atomicAdd(out.claims, 1u);
}

// Heavy contention on one address: lost updates show if atomicAdd is not atomic.
__global__ void contended_counter_kernel(unsigned* counter, float* float_counter, int iterations) {
  for (int k = 0; k < iterations; ++k) {
    atomicAdd(counter, 1u);
    atomicAdd(float_counter, 1.0f);
  }
}

// ---- __half / __nv_bfloat16 ----------------------------------------------------------
struct HalfOutputs {
  float* half_roundtrip;
  float* bf16_roundtrip;
  float* half_square;     // __hmul(h, h)
  float* half_neighbour;  // __shfl_xor_sync(h, 1)
  float* bf16_neighbour;  // __shfl_xor_sync(b, 1)
};

__global__ void half_kernel(const float* in, HalfOutputs out) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  const __half h = __float2half(in[i]);
  const __nv_bfloat16 b = __float2bfloat16(in[i]);
  out.half_roundtrip[i] = __half2float(h);
  out.bf16_roundtrip[i] = __bfloat162float(b);
  out.half_square[i] = __half2float(__hmul(h, h));
  out.half_neighbour[i] = __half2float(__shfl_xor_sync(kFullMask, h, 1));
  out.bf16_neighbour[i] = __bfloat162float(__shfl_xor_sync(kFullMask, b, 1));
}

// ---- error paths -----------------------------------------------------------------------
// Thread 3 traps while the others wait at a barrier: the launch must report the
// error rather than hang.
__global__ void trap_in_one_thread_kernel(int* passed_barrier) {
  if (threadIdx.x == 3) __trap();
  __syncthreads();
  atomicAdd(passed_barrier, 1);
}

// Two half-warp collectives with disjoint masks at the same time: valid CUDA,
// but beyond the emulation's full-mask model, so it must be reported.
__global__ void split_mask_shuffle_kernel(int* out) {
  const unsigned lane = threadIdx.x % 32;
  const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
  out[threadIdx.x] = __shfl_sync(mask, static_cast<int>(lane), 0, 16);
}

// Lane 0 waits at __syncthreads while lanes 1..31 wait at __syncwarp: a
// deadlock (undefined behaviour in CUDA) that the emulation turns into an error.
__global__ void divergent_barrier_kernel() {
  if (threadIdx.x == 0)
    __syncthreads();
  else
    __syncwarp();
}

// A kernel with two template parameters, launched through the parenthesised
// form of ROPESCALE_LAUNCH_KERNEL.
template <class T, int kScale>
__global__ void scale_kernel(const T* in, T* out, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = in[i] * static_cast<T>(kScale);
}

inline void launch_scale_by_3(const float* in, float* out, int n, cudaStream_t stream) {
  ROPESCALE_LAUNCH_KERNEL((scale_kernel<float, 3>), dim3((n + 127) / 128), dim3(128), 0, stream,
                          in, out, n);
}

}  // namespace emu_test
