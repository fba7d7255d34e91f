// Portability macros for code shared by the CPU build, nvcc, and the host SIMT emulation that runs
// the CUDA kernels on the CPU in CI (tests/emulation). Include this, never cuda_runtime.h, from
// headers under csrc/include/ropescale.
#pragma once

#if defined(__CUDACC__) || defined(ROPESCALE_EMULATION)
#define ROPESCALE_HOST_DEVICE __host__ __device__
#else
#define ROPESCALE_HOST_DEVICE
#endif

#if defined(__CUDACC__)
#define ROPESCALE_INLINE __forceinline__
#else
#define ROPESCALE_INLINE inline
#endif
