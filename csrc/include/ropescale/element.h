// The element types of the CUDA kernels (float, double, __half, __nv_bfloat16: CUDA's own, or the
// emulation's host build of them) and the one set of conversions between an element and the type a
// kernel computes in. Explicit calls, because torch builds define __CUDA_NO_HALF_CONVERSIONS__. The
// ATen dtype -> element type map is csrc/cuda/cuda_element.h; the CPU kernels use ATen's own types
// and at::vec conversions, with round_to<T> under the same name (cpu/rerope_attention_kernel.cpp).
#pragma once

#include "ropescale/portable.h"

#if defined(ROPESCALE_EMULATION) || defined(__CUDACC__)

#include <type_traits>

namespace ropescale {

// What a kernel computes in for element type T: float, or double for double.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// An element as acc_t (exact).
ROPESCALE_HOST_DEVICE __forceinline__ float to_acc(float x) { return x; }
ROPESCALE_HOST_DEVICE __forceinline__ double to_acc(double x) { return x; }
ROPESCALE_HOST_DEVICE __forceinline__ float to_acc(__half x) { return __half2float(x); }
ROPESCALE_HOST_DEVICE __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

// acc_t<T> rounded to the nearest T (ties to even). T is named: from_acc<__half>(x).
template <class T>
ROPESCALE_HOST_DEVICE __forceinline__ T from_acc(acc_t<T> x) {
  if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(x);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(x);
  else
    return x;
}

// x rounded to T and back. For fp16/bf16 inputs every kernel rounds where FlashAttention and SDPA
// round (the rotated q and k, the probabilities before P.V) and accumulates in f32, so the
// precision is the same at every problem size, tensor-core prefill and SIMT decode alike; fp32
// inputs are untouched.
template <class T>
ROPESCALE_HOST_DEVICE __forceinline__ float round_to(float x) {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return to_acc(from_acc<T>(x));
}

}  // namespace ropescale

#endif  // ROPESCALE_EMULATION || __CUDACC__
