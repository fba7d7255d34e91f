// ATen glue of the rotary CUDA kernel (include/ropescale/rotary_kernels.cuh): arguments were
// checked at the op boundary (rotary.cpp); here only the device guard, the current stream, the
// dtype dispatch (the operands', then the tables': theirs or float32, rotary_args.h) and the launch
// check. Device attributes are asked once per device (device_info.h).
// c10/cuda only: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers, which a
// compiler-only CUDA toolkit does not have.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda_element.h"
#include "device_info.h"
#include "ropescale/rotary_kernels.cuh"
#include "rotary_args.h"

namespace ropescale {
namespace {

// Blocks of kBlockThreads that fill every SM of the device to its resident-thread limit.
int64_t resident_blocks(int device) {
  const CudaDeviceInfo info = cuda_device_info(device);
  return static_cast<int64_t>(info.multiprocessors) * (info.max_threads_per_multiprocessor / rotary::kBlockThreads);
}

}  // namespace

void rotary_cuda(const RotaryArgs& args) {
  const c10::cuda::CUDAGuard guard(args.in[0].device());
  const int64_t min_blocks = resident_blocks(args.in[0].get_device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.in[0].scalar_type(), "rotary_cuda", [&] {
    using T = typename CudaElement<scalar_t>::type;
    with_rotary_params<T>(args, [&](const auto& p) { rotary::launch_rotary(p, min_blocks, stream); });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace ropescale
