// Every CUDA kernel instantiation that ropescale builds from csrc/include/ropescale/*.cuh, compiled
// by the `ptxas_no_spills` test (check_ptxas.cmake) with `nvcc -Xptxas -v` for each target arch, so
// that registers, stack and spills are printed and checked independently of the library's build
// log. Compile only; never linked or run. Keep the list in step with csrc/cuda/*.cu.
#include "ropescale/rerope_attention.cuh"
#include "ropescale/rerope_attention_tc.cuh"
#include "ropescale/rotary_kernels.cuh"

namespace ropescale::rerope_cuda {

template <typename T>
void instantiate_rerope(ReropeParams p, KeyTile* tiles, cudaStream_t stream) {
  launch_rerope_prefill<T, 64>(p, stream);
  launch_rerope_prefill<T, 128>(p, stream);
  launch_rerope_prefill<T, 256>(p, stream);
  launch_rerope_decode<T, 64>(p, 2, stream);
  launch_rerope_decode<T, 128>(p, 2, stream);
  launch_rerope_decode<T, 256>(p, 2, stream);
  if constexpr (!std::is_same_v<T, float>) {
    launch_rerope_prefill_tc<T, 64>(p, tiles, stream, IgnoreLaunchStatus{});
    launch_rerope_prefill_tc<T, 80>(p, tiles, stream, IgnoreLaunchStatus{});
    launch_rerope_prefill_tc<T, 96>(p, tiles, stream, IgnoreLaunchStatus{});
    launch_rerope_prefill_tc<T, 128>(p, tiles, stream, IgnoreLaunchStatus{});
  }
}

void instantiate_all(ReropeParams p, KeyTile* tiles, cudaStream_t stream) {
  instantiate_rerope<float>(p, tiles, stream);
  instantiate_rerope<__half>(p, tiles, stream);
  instantiate_rerope<__nv_bfloat16>(p, tiles, stream);
}

}  // namespace ropescale::rerope_cuda

namespace ropescale::rotary {

void instantiate_all(const Params<float>& f, const Params<__half>& h, const Params<__nv_bfloat16>& b,
                     cudaStream_t stream) {
  launch_rotary(f, 1, stream);
  launch_rotary(h, 1, stream);
  launch_rotary(b, 1, stream);
}

}  // namespace ropescale::rotary
