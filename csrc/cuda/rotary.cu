// ATen glue of the rotary CUDA kernel (include/ropescale/rotary_kernels.cuh): arguments were
// checked at the op boundary (rotary.cpp); here only the device guard, the current stream, the
// dtype dispatch and the launch check.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "ropescale/rotary_kernels.cuh"
#include "rotary_args.h"

namespace ropescale {
namespace {

// CUDA's own element type for an ATen dtype (same size and bits).
template <class T>
struct CudaElement {
  using type = T;
};
template <>
struct CudaElement<at::Half> {
  using type = __half;
};
template <>
struct CudaElement<at::BFloat16> {
  using type = __nv_bfloat16;
};

}  // namespace

void rotary_cuda(const RotaryArgs& args) {
  const c10::cuda::CUDAGuard guard(args.in[0].device());
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  // Enough blocks to fill every SM to its resident-thread limit.
  const int64_t min_blocks =
      static_cast<int64_t>(props->multiProcessorCount) * (props->maxThreadsPerMultiProcessor / rotary::kBlockThreads);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.in[0].scalar_type(), "rotary_cuda", [&] {
    using T = typename CudaElement<scalar_t>::type;
    rotary::launch_rotary(make_rotary_params<T>(args), min_blocks, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace ropescale
