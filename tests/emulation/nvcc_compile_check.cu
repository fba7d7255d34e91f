// Compile-only check that emu_test_kernels.cuh, emu_matrix_kernels.cuh (and portable.h, with its
// inline PTX for mma.sync, ldmatrix and cp.async) are valid CUDA:
//   nvcc -std=c++17 -arch=sm_80 -I tests/emulation/include -I csrc/include -c -x cu
//        tests/emulation/nvcc_compile_check.cu -o /tmp/nvcc_compile_check.o
// (one line; run from the repository root)
// Built by CMake as the target `emulation_nvcc_compile_check` when nvcc is
// found. It is never linked or run: the emulation tests are the CPU path.
#include "emu_matrix_kernels.cuh"
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
  ROPESCALE_LAUNCH_KERNEL(mma_from_global_kernel<__half>, dim3(1), dim3(32), 0, stream, nullptr, nullptr, nullptr,
                          nullptr, 0);
  ROPESCALE_LAUNCH_KERNEL(mma_from_global_kernel<__nv_bfloat16>, dim3(1), dim3(32), 0, stream, nullptr, nullptr,
                          nullptr, nullptr, 0);
  ROPESCALE_LAUNCH_KERNEL((ldmatrix_kernel<1, false>), dim3(1), dim3(32), 1024, stream, nullptr, nullptr, 0);
  ROPESCALE_LAUNCH_KERNEL((ldmatrix_kernel<2, true>), dim3(1), dim3(32), 1024, stream, nullptr, nullptr, 0);
  ROPESCALE_LAUNCH_KERNEL((ldmatrix_kernel<4, false>), dim3(1), dim3(32), 1024, stream, nullptr, nullptr, 0);
  ROPESCALE_LAUNCH_KERNEL((ldmatrix_kernel<4, true>), dim3(1), dim3(32), 1024, stream, nullptr, nullptr, 0);
  ROPESCALE_LAUNCH_KERNEL(ldmatrix_mma_kernel<__half>, dim3(1), dim3(32), 2048, stream, nullptr, nullptr, nullptr,
                          nullptr);
  ROPESCALE_LAUNCH_KERNEL(ldmatrix_mma_kernel<__nv_bfloat16>, dim3(1), dim3(32), 2048, stream, nullptr, nullptr,
                          nullptr, nullptr);
  ROPESCALE_LAUNCH_KERNEL(cp_async_kernel, dim3(1), dim3(64), 2048, stream, nullptr, CpAsyncOutputs{});
  ROPESCALE_LAUNCH_KERNEL(matrix_misuse_kernel, dim3(1), dim3(32), 1024, stream, nullptr, nullptr, 0);
  ROPESCALE_LAUNCH_KERNEL(static_shared_first_read_kernel, dim3(1), dim3(kCells), 0, stream, nullptr);
  ROPESCALE_LAUNCH_KERNEL(block_ticket_kernel, dim3(1), dim3(32), 0, stream, nullptr, nullptr);
  (void)ROPESCALE_OPT_IN_DYNAMIC_SMEM(dynamic_smem_kernel, 64 * 1024);
  ROPESCALE_LAUNCH_KERNEL(dynamic_smem_kernel, dim3(1), dim3(64), 1024, stream, nullptr, 1024);
  launch_scale_by_3(nullptr, nullptr, 0, stream);
}

}  // namespace emu_test
