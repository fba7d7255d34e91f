// rerope_attention and rerope_attention_paged on the CPU: the entry points (and rerope_cache_write_).
// The kernels (cpu/rerope_attention_kernel.cpp, one body for both ops) are compiled once per
// instruction set (DEFAULT, AVX2, AVX512) and picked here for this CPU the way ATen picks its own
// kernels: at::get_cpu_capability(), which honours ATEN_CPU_CAPABILITY.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>

#include <cstring>
#include <string>
#include <tuple>

#include "ops.h"
#include "rerope_attention.h"
#include "rerope_paged.h"

namespace ropescale {
namespace cpu {
// One declaration per variant CMakeLists.txt builds (ROPESCALE_CPU_AVX2 / _AVX512 say which).
namespace DEFAULT {
void rerope_attention_kernel(const ReropeArgs& args, at::Tensor& out, at::Tensor& lse);
void rerope_attention_paged_kernel(const ReropePagedArgs& args, at::Tensor& out, at::Tensor& lse);
}
#ifdef ROPESCALE_CPU_AVX2
namespace AVX2 {
void rerope_attention_kernel(const ReropeArgs& args, at::Tensor& out, at::Tensor& lse);
void rerope_attention_paged_kernel(const ReropePagedArgs& args, at::Tensor& out, at::Tensor& lse);
}
#endif
#ifdef ROPESCALE_CPU_AVX512
namespace AVX512 {
void rerope_attention_kernel(const ReropeArgs& args, at::Tensor& out, at::Tensor& lse);
void rerope_attention_paged_kernel(const ReropePagedArgs& args, at::Tensor& out, at::Tensor& lse);
}
#endif
}  // namespace cpu

namespace {

using ReropeKernel = void (*)(const ReropeArgs&, at::Tensor&, at::Tensor&);
using ReropePagedKernel = void (*)(const ReropePagedArgs&, at::Tensor&, at::Tensor&);

struct ReropeVariant {
  ReropeKernel kernel;
  ReropePagedKernel paged_kernel;
  const char* isa;
};

ReropeVariant pick_rerope_variant() {
  const std::string capability = at::get_cpu_capability();
#ifdef ROPESCALE_CPU_AVX512
  if (capability == "AVX512") return {&cpu::AVX512::rerope_attention_kernel, &cpu::AVX512::rerope_attention_paged_kernel, "AVX512"};
#endif
#ifdef ROPESCALE_CPU_AVX2
  if (capability == "AVX512" || capability == "AVX2") return {&cpu::AVX2::rerope_attention_kernel, &cpu::AVX2::rerope_attention_paged_kernel, "AVX2"};
#endif
  return {&cpu::DEFAULT::rerope_attention_kernel, &cpu::DEFAULT::rerope_attention_paged_kernel, "DEFAULT"};
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
                                                        int64_t logn_length, bool causal, bool interleaved,
                                                        int64_t group, int64_t chunk_size, int64_t far_start) {
  const ReropeArgs args = check_rerope_attention_args(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k,
                                                      scale, logn_length, causal, interleaved, group, chunk_size, far_start);
  TORCH_CHECK(args.q.device().is_cpu(), "rerope_attention: the CPU kernel got tensors on ", args.q.device());
  at::Tensor out, lse;
  if (empty_rerope_outputs(args, out, lse)) return {out, lse};
  rerope_variant().kernel(args, out, lse);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> rerope_attention_paged_cpu(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
    double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
    bool interleaved, int64_t group, int64_t chunk_size, int64_t far_start) {
  const ReropePagedArgs args = check_rerope_paged_args(q, key_cache, value_cache, block_table, seq_lens,
                                                       query_start_loc, inv_freq, window, leaky_k, scale,
                                                       scale_factors, logn_length, interleaved, std::nullopt,
                                                       group, chunk_size, far_start);
  TORCH_CHECK(args.q.device().is_cpu(), "rerope_attention_paged: the CPU kernel got tensors on ", args.q.device());
  at::Tensor out = at::empty({args.tokens, args.q_heads, args.head_dim}, args.q.options());
  at::Tensor lse = at::empty({args.tokens, args.q_heads}, args.q.options().dtype(at::kFloat));
  // Every row belongs to a request with q_len <= seq_len, so every row sees key 0: no empty rows.
  if (out.numel() > 0) rerope_variant().paged_kernel(args, out, lse);
  return {out, lse};
}

// The CPU kernel needs no workspace: an engine's reservation is checked as on CUDA, then left alone.
std::tuple<at::Tensor, at::Tensor> rerope_attention_paged_workspace_cpu(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
    double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
    bool interleaved, int64_t group, int64_t chunk_size, int64_t far_start, const at::Tensor& workspace) {
  check_rerope_paged_meta(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window,
                          leaky_k, scale, scale_factors, logn_length, /*allow_float64=*/false, workspace,
                          group, chunk_size, far_start);
  return rerope_attention_paged_cpu(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq,
                                    window, leaky_k, scale, scale_factors, logn_length, interleaved, group,
                                    chunk_size, far_start);
}

void rerope_cache_write_cpu_(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
                             const at::Tensor& value, const at::Tensor& slot_mapping) {
  check_rerope_cache_write(key_cache, value_cache, key, value, slot_mapping);
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2), block_size = key_cache.size(2);
  if (tokens == 0) return;
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const at::Tensor k = key.stride(2) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(2) == 1 ? value : value.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const size_t row_bytes = dim * key.element_size();
  auto* k_cache = static_cast<char*>(key_cache.data_ptr());
  auto* v_cache = static_cast<char*>(value_cache.data_ptr());
  const auto* k_data = static_cast<const char*>(k.data_ptr());
  const auto* v_data = static_cast<const char*>(v.data_ptr());
  const int64_t item = key.element_size();
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;  // padding (vLLM's -1)
      const int64_t page = slot[t] / block_size, offset = slot[t] % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(k_cache + (page * key_cache.stride(0) + h * key_cache.stride(1) + offset * dim) * item,
                    k_data + (t * k.stride(0) + h * k.stride(1)) * item, row_bytes);
        std::memcpy(v_cache + (page * value_cache.stride(0) + h * value_cache.stride(1) + offset * dim) * item,
                    v_data + (t * v.stride(0) + h * v.stride(1)) * item, row_bytes);
      }
    }
  });
}

}  // namespace ropescale
