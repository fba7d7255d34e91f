// Portability layer for ropescale kernel headers (*.cuh).
//
// Kernel headers include this file instead of relying on nvcc-only syntax, so
// the same source compiles
//   * with nvcc, as real CUDA, and
//   * with a host C++20 compiler and ROPESCALE_EMULATION defined, against the
//     CPU SIMT emulation in cuda_emulation.h (used by the CPU-only tests).
//
// Macros:
//   ROPESCALE_DYNAMIC_SMEM(T, name);
//       Declares `T* name` pointing at the block's dynamic shared memory
//       (at least 16-byte aligned). Replaces `extern __shared__ T name[];`,
//       which cannot be emulated. For a T containing commas use an alias.
//   ROPESCALE_LAUNCH_KERNEL(kernel, grid, block, smem_bytes, stream, args...);
//       kernel<<<grid, block, smem_bytes, stream>>>(args...). Wrap a template
//       kernel whose name contains commas in parentheses:
//       ROPESCALE_LAUNCH_KERNEL((k<float, 4>), ...). Under emulation the
//       launch runs synchronously on the CPU and `stream` is ignored.
#pragma once

#if defined(ROPESCALE_EMULATION)

#include <ropescale_emu/cuda_emulation.h>

#define ROPESCALE_DYNAMIC_SMEM(T, name) \
  T* name = reinterpret_cast<T*>(::ropescale_emu::dynamic_shared_memory())

#define ROPESCALE_LAUNCH_KERNEL(kernel, grid, block, smem_bytes, stream, ...) \
  ((void)(stream),                                                            \
   ::ropescale_emu::launch((grid), (block), (smem_bytes), kernel __VA_OPT__(, ) __VA_ARGS__))

#elif defined(__CUDACC__)

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// All `extern __shared__` arrays alias the same dynamic shared memory; one
// fixed element type and alignment keeps their declarations compatible.
#define ROPESCALE_DYNAMIC_SMEM(T, name)                              \
  extern __shared__ __align__(16) unsigned char name##_smem_bytes[]; \
  T* name = reinterpret_cast<T*>(name##_smem_bytes)

#define ROPESCALE_LAUNCH_KERNEL(kernel, grid, block, smem_bytes, stream, ...) \
  kernel<<<(grid), (block), (smem_bytes), (stream)>>>(__VA_ARGS__)

#else
#error "ropescale kernels need nvcc, or a host compiler with ROPESCALE_EMULATION defined"
#endif
