// CUDA's own element type for an ATen dtype (same size and bits), for the kernel templates.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace ropescale {

template <class T>
struct CudaElement {
  using type = T;
};
template <>
struct CudaElement<c10::Half> {
  using type = __half;
};
template <>
struct CudaElement<c10::BFloat16> {
  using type = __nv_bfloat16;
};

}  // namespace ropescale
