// Portability macros for code shared by the CPU build, nvcc, and the host SIMT emulation that runs
// the CUDA kernels on the CPU in CI (tests/emulation). Headers under csrc/include/ropescale include
// this, never cuda_runtime.h.
//
//   ROPESCALE_HOST_DEVICE, ROPESCALE_INLINE
//       qualifiers for math shared by CPU code, CUDA kernels and emulated kernels.
//   ROPESCALE_DYNAMIC_SMEM(T, name);                      (kernels only: nvcc or emulation)
//       Declares `T* name` pointing at the block's dynamic shared memory (at least 16-byte
//       aligned). Replaces `extern __shared__ T name[];`, which cannot be emulated.
//   ROPESCALE_LAUNCH_KERNEL(kernel, grid, block, smem_bytes, stream, args...);
//       kernel<<<grid, block, smem_bytes, stream>>>(args...). Wrap a template kernel whose name
//       contains commas in parentheses: ROPESCALE_LAUNCH_KERNEL((k<float, 4>), ...). Under
//       emulation the launch runs synchronously on the CPU and `stream` is ignored.
#pragma once

#if defined(ROPESCALE_EMULATION)

#include <ropescale_emu/cuda_emulation.h>

#define ROPESCALE_HOST_DEVICE __host__ __device__
#define ROPESCALE_INLINE inline

#define ROPESCALE_DYNAMIC_SMEM(T, name) \
  T* name = reinterpret_cast<T*>(::ropescale_emu::dynamic_shared_memory())

#define ROPESCALE_LAUNCH_KERNEL(kernel, grid, block, smem_bytes, stream, ...) \
  ((void)(stream),                                                            \
   ::ropescale_emu::launch((grid), (block), (smem_bytes), kernel __VA_OPT__(, ) __VA_ARGS__))

#elif defined(__CUDACC__)

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define ROPESCALE_HOST_DEVICE __host__ __device__
#define ROPESCALE_INLINE __forceinline__

// All `extern __shared__` arrays alias the same dynamic shared memory; one fixed element type and
// alignment keeps their declarations compatible.
#define ROPESCALE_DYNAMIC_SMEM(T, name)                              \
  extern __shared__ __align__(16) unsigned char name##_smem_bytes[]; \
  T* name = reinterpret_cast<T*>(name##_smem_bytes)

#define ROPESCALE_LAUNCH_KERNEL(kernel, grid, block, smem_bytes, stream, ...) \
  kernel<<<(grid), (block), (smem_bytes), (stream)>>>(__VA_ARGS__)

#else  // a plain host compiler: the shared math only, no kernels

#define ROPESCALE_HOST_DEVICE
#define ROPESCALE_INLINE inline

#endif
