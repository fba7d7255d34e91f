// Compile-only check that emu_test_kernels.cuh (and portable.h) is valid CUDA:
//   nvcc -std=c++17 -arch=sm_80 -I tests/emulation/include -I csrc/include -c -x cu
//        tests/emulation/nvcc_compile_check.cu -o /tmp/nvcc_compile_check.o
// (one line; run from the repository root)
// Built by CMake as the target `emulation_nvcc_compile_check` when nvcc is
// found. It is never linked or run: the emulation tests are the CPU path.
#include "emu_test_kernels.cuh"

namespace emu_test {

// Instantiate every templated kernel and launcher once.
template __global__ void block_sum_kernel<256>(const float*, float*, int);
template __global__ void reverse_in_block_kernel<double>(const double*, double*, unsigned*);
template void launch_block_sum<256>(const float*, float*, int, cudaStream_t);
template void launch_reverse_in_block<float>(const float*, float*, unsigned*, unsigned, unsigned,
                                             cudaStream_t);

void launch_all_for_compile_check(cudaStream_t stream) {
  ROPESCALE_LAUNCH_KERNEL(warp_ops_kernel, dim3(1), dim3(32), 0, stream, nullptr, WarpOpsOutputs{});
  ROPESCALE_LAUNCH_KERNEL(partial_warp_kernel, dim3(1), dim3(48), 0, stream, nullptr,
                          PartialWarpOutputs{});
  ROPESCALE_LAUNCH_KERNEL(atomics_kernel, dim3(1), dim3(32), 0, stream, nullptr, 0, 1,
                          AtomicOutputs{});
  ROPESCALE_LAUNCH_KERNEL(contended_counter_kernel, dim3(1), dim3(32), 0, stream, nullptr, nullptr,
                          1);
  ROPESCALE_LAUNCH_KERNEL(half_kernel, dim3(1), dim3(32), 0, stream, nullptr, HalfOutputs{});
  ROPESCALE_LAUNCH_KERNEL(trap_in_one_thread_kernel, dim3(1), dim3(32), 0, stream, nullptr);
  ROPESCALE_LAUNCH_KERNEL(split_mask_shuffle_kernel, dim3(1), dim3(32), 0, stream, nullptr);
  ROPESCALE_LAUNCH_KERNEL(divergent_barrier_kernel, dim3(1), dim3(32), 0, stream);
  launch_write_coords(dim3(2, 2, 2), dim3(4, 2, 2), nullptr, stream);
  launch_scale_by_3(nullptr, nullptr, 0, stream);
}

}  // namespace emu_test
