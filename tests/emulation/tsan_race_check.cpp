// Checks that the ThreadSanitizer build of the emulation can see races between
// CUDA threads: this kernel forgets the __syncthreads() between writing and
// reading shared memory. CTest expects "ThreadSanitizer: data race" in the
// output (test emulation_tsan_detects_race).
#include "ropescale/portable.h"

#include <cstdio>
#include <vector>

__global__ void reverse_without_barrier_kernel(const float* in, float* out) {
  ROPESCALE_DYNAMIC_SMEM(float, tile);
  tile[threadIdx.x] = in[threadIdx.x];
  // Missing __syncthreads(): reads another thread's write unordered.
  out[threadIdx.x] = tile[blockDim.x - 1 - threadIdx.x];
}

int main() {
  const unsigned threads = 64;
  std::vector<float> in(threads, 1.0f), out(threads, 0.0f);
  ROPESCALE_LAUNCH_KERNEL(reverse_without_barrier_kernel, dim3(1), dim3(threads),
                          threads * sizeof(float), nullptr, in.data(), out.data());
  std::puts("kernel finished");
  return 0;
}
