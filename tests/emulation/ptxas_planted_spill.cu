// A kernel that must spill, compiled by the `ptxas_check_detects_spills` test (check_ptxas.cmake) with
// `nvcc -Xptxas -v`: the spill check (scripts/ptxas_summary.py, which `ptxas_no_spills` runs over the library's
// own ptxas reports) must fail on it, or it is blind. (A register cap cannot plant one in the real kernels: their
// __launch_bounds__ take precedence over -maxrregcount.) Compile only; never linked or run.
// 1024 threads x 2 blocks per SM leave 32 registers a thread, and 96 loaded values stay live until
// their sum is known (the stores may alias the input, so they cannot be re-read): it must spill.
__global__ void __launch_bounds__(1024, 2) planted_spill_kernel(const float* in, float* out) {
  float v[96];
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 96; ++i) {
    v[i] = in[threadIdx.x + i * 1024];
    sum += v[i];
  }
#pragma unroll
  for (int i = 0; i < 96; ++i) out[threadIdx.x + i * 1024] = v[i] * sum;
}
