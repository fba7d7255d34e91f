// rerope_attention on the CPU: the entry point. The kernel (cpu/rerope_attention_kernel.cpp) is
// compiled once per instruction set (DEFAULT, AVX2, AVX512) and picked here for this CPU the way
// ATen picks its own kernels: at::get_cpu_capability(), which honours ATEN_CPU_CAPABILITY.
#include <ATen/ATen.h>
#include <ATen/Version.h>

#include <string>
#include <tuple>

#include "ops.h"
#include "rerope_attention.h"

namespace ropescale {
namespace cpu {
// One declaration per variant CMakeLists.txt builds (ROPESCALE_CPU_AVX2 / _AVX512 say which).
namespace DEFAULT {
void rerope_attention_kernel(const ReropeArgs& args, at::Tensor& out, at::Tensor& lse);
}
#ifdef ROPESCALE_CPU_AVX2
namespace AVX2 {
void rerope_attention_kernel(const ReropeArgs& args, at::Tensor& out, at::Tensor& lse);
}
#endif
#ifdef ROPESCALE_CPU_AVX512
namespace AVX512 {
void rerope_attention_kernel(const ReropeArgs& args, at::Tensor& out, at::Tensor& lse);
}
#endif
}  // namespace cpu

namespace {

using ReropeKernel = void (*)(const ReropeArgs&, at::Tensor&, at::Tensor&);

struct ReropeVariant {
  ReropeKernel kernel;
  const char* isa;
};

ReropeVariant pick_rerope_variant() {
  const std::string capability = at::get_cpu_capability();
#ifdef ROPESCALE_CPU_AVX512
  if (capability == "AVX512") return {&cpu::AVX512::rerope_attention_kernel, "AVX512"};
#endif
#ifdef ROPESCALE_CPU_AVX2
  if (capability == "AVX512" || capability == "AVX2") return {&cpu::AVX2::rerope_attention_kernel, "AVX2"};
#endif
  return {&cpu::DEFAULT::rerope_attention_kernel, "DEFAULT"};
}

const ReropeVariant& rerope_variant() {
  static const ReropeVariant variant = pick_rerope_variant();
  return variant;
}

}  // namespace

std::string rerope_attention_cpu_isa() { return rerope_variant().isa; }

std::tuple<at::Tensor, at::Tensor> rerope_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, const at::Tensor& q_positions,
                                                        const at::Tensor& k_positions, const at::Tensor& inv_freq,
                                                        int64_t window, double leaky_k, double scale,
                                                        int64_t logn_length, bool causal, bool interleaved) {
  const ReropeArgs args = check_rerope_attention_args(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k,
                                                      scale, logn_length, causal, interleaved);
  TORCH_CHECK(args.q.device().is_cpu(), "rerope_attention: the CPU kernel got tensors on ", args.q.device());
  at::Tensor out, lse;
  if (empty_rerope_outputs(args, out, lse)) return {out, lse};
  rerope_variant().kernel(args, out, lse);
  return {out, lse};
}

}  // namespace ropescale
