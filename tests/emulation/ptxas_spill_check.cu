// Every CUDA kernel instantiation that ropescale builds from csrc/include/ropescale/*.cuh, compiled
// by the `ptxas_no_spills` test (check_ptxas.cmake) with `nvcc -Xptxas -v` for each target arch, so
// that registers, stack and spills are printed and checked independently of the library's build
// log. Compile only; never linked or run. Keep the list in step with csrc/cuda/*.cu.
// With ROPESCALE_PLANTED_SPILL only planted_spill_kernel below is compiled: the
// `ptxas_check_detects_spills` test shows that the check fails on a spill. (A register cap cannot plant
// one in the real kernels: their __launch_bounds__ take precedence over -maxrregcount.)
#include "ropescale/rerope_attention.cuh"
#include "ropescale/rerope_attention_tc.cuh"
#include "ropescale/rotary_kernels.cuh"

namespace ropescale::rerope_cuda {

template <typename T>
void instantiate_rerope(ReropeParams p, KeyTile* tiles, cudaStream_t stream) {
  // Every SIMT tile shape with_simt_shape() can pick: the wide ones, and the compact 256 tiles of
  // the 99 KiB parts.
  for (const std::size_t smem_optin : {std::size_t{166912}, std::size_t{101376}})
    for (const int head_dim : {64, 128, 256})
      with_simt_shape(head_dim, smem_optin, [&]<class Shape>() {
        launch_rerope_prefill<T, Shape>(p, stream);
        launch_rerope_decode<T, Shape>(p, 2, stream);
        launch_rerope_paged<T, Shape>(p, 2, stream);  // rerope_attention_paged (csrc/cuda/rerope_paged.cu)
      });
  launch_rerope_cache_write<T>(CacheWriteParams{}, stream);
  if constexpr (!std::is_same_v<T, float>) {
    launch_rerope_prefill_tc<T, 64>(p, tiles, stream, IgnoreLaunchStatus{});
    launch_rerope_prefill_tc<T, 80>(p, tiles, stream, IgnoreLaunchStatus{});
    launch_rerope_prefill_tc<T, 96>(p, tiles, stream, IgnoreLaunchStatus{});
    launch_rerope_prefill_tc<T, 128>(p, tiles, stream, IgnoreLaunchStatus{});
    // rerope_attention_paged's prefill rows (csrc/cuda/rerope_paged.cu)
    launch_rerope_paged_tc<T, 64>(p, stream, IgnoreLaunchStatus{});
    launch_rerope_paged_tc<T, 80>(p, stream, IgnoreLaunchStatus{});
    launch_rerope_paged_tc<T, 96>(p, stream, IgnoreLaunchStatus{});
    launch_rerope_paged_tc<T, 128>(p, stream, IgnoreLaunchStatus{});
  }
}

void instantiate_all(ReropeParams p, KeyTile* tiles, cudaStream_t stream) {
#ifndef ROPESCALE_PLANTED_SPILL
  instantiate_rerope<float>(p, tiles, stream);
  instantiate_rerope<__half>(p, tiles, stream);
  instantiate_rerope<__nv_bfloat16>(p, tiles, stream);
#endif
}

}  // namespace ropescale::rerope_cuda

namespace ropescale::rotary {

// Operands' own tables, and float tables with the other operand types (csrc/cuda/rotary.cu takes
// both: rotary_args.h's with_rotary_params).
void instantiate_all(const Params<float>& f, const Params<__half>& h, const Params<__nv_bfloat16>& b,
                     const Params<double>& d, const Params<__half, float>& hf, const Params<__nv_bfloat16, float>& bf,
                     const Params<double, float>& df, cudaStream_t stream) {
#ifndef ROPESCALE_PLANTED_SPILL
  launch_rotary(f, 1, stream);
  launch_rotary(h, 1, stream);
  launch_rotary(b, 1, stream);
  launch_rotary(d, 1, stream);
  launch_rotary(hf, 1, stream);
  launch_rotary(bf, 1, stream);
  launch_rotary(df, 1, stream);
#endif
}

}  // namespace ropescale::rotary

#ifdef ROPESCALE_PLANTED_SPILL
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
#endif
