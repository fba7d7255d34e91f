// ATen-side pieces of rerope_attention shared by the CPU and CUDA entry points: the input checks
// (done once, at the op boundary) and the normalised arguments both backends run from.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "ropescale/rerope_math.h"

namespace ropescale {

struct ReropeArgs {
  at::Tensor q, k, v;                    // [B, H, L, D], unit stride on the last dim
  at::Tensor q_positions, k_positions;   // int64 [B, Lq] / [B, Lk], contiguous
  at::Tensor inv_freq;                   // float32 [rotary_dim / 2], contiguous
  int64_t batch = 0, q_heads = 0, kv_heads = 0, q_len = 0, k_len = 0, head_dim = 0, rotary_pairs = 0;
  int64_t logn_length = 0;
  RegionRule rule;             // ReRoPE / Leaky ReRoPE, Self-Extend or Dual Chunk (rerope_math.h)
  double inv_log_train = 0.0;  // 1/ln(logn_length), 0 when log-n is off
  float scale = 0.0f;          // softmax scale (1/sqrt(D) when the caller passed -1)
  bool causal = true, interleaved = false;
};

inline constexpr int64_t kReropeMaxHeadDim = 256;

// The region arguments every ReRoPE-family op takes (window, leaky_k, group, chunk_size; DESIGN.md),
// checked in one place for the dense and paged ops, their Meta kernels and the composites' checks:
// group > 0 is Self-Extend (window >= 1, leaky_k 0), chunk_size > 0 Dual Chunk with window its
// local_size (0 <= window < chunk_size, leaky_k 0, causal), neither (Leaky) ReRoPE (window >= 1).
void check_region_arguments(const char* op, int64_t window, double leaky_k, int64_t group, int64_t chunk_size, int64_t far_start,
                            bool causal);

// The op's checks on metadata (devices, dtypes, shapes, head counts, D, the scalars), the ONE check
// shared by the CPU and CUDA kernels and the Meta kernel (FakeTensorMode, torch.compile); symbolic
// sizes are fine. Messages name the op and the argument.
void check_rerope_attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& q_positions, const at::Tensor& k_positions,
                                 const at::Tensor& inv_freq, int64_t window, double leaky_k, double scale,
                                 int64_t logn_length, bool allow_float64, int64_t group, int64_t chunk_size, int64_t far_start,
                                 bool causal);

// The data check: positions <= kMaxPosition (position_limits.h). CPU tensors only; on CUDA it
// would cost a host sync per call, so there the range is the caller's (documented) contract.
void check_rerope_positions(const at::Tensor& int64_positions, const char* name);

// Validates the op's arguments (check_rerope_attention_meta, then check_rerope_positions) and
// normalises them: int32 positions and float64 inv_freq are converted, the last dims made unit-stride.
ReropeArgs check_rerope_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& q_positions, const at::Tensor& k_positions,
                                       const at::Tensor& inv_freq, int64_t window, double leaky_k, double scale,
                                       int64_t logn_length, bool causal, bool interleaved, int64_t group,
                                       int64_t chunk_size, int64_t far_start);

// The op ropescale::_check_rerope_attention: both checks above, for the plain-PyTorch paths that
// compute this op (rerope_attention_composite, which also takes float64: allow_float64; the
// reference kernels), so that they refuse what the op refuses with its messages.
void check_rerope_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& q_positions, const at::Tensor& k_positions, const at::Tensor& inv_freq,
                            int64_t window, double leaky_k, double scale, int64_t logn_length, bool allow_float64,
                            int64_t group, int64_t chunk_size, int64_t far_start, bool causal);

// The Meta kernel: the shared check, then empty outputs of the right shapes.
std::tuple<at::Tensor, at::Tensor> rerope_attention_meta(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, const at::Tensor& q_positions,
                                                         const at::Tensor& k_positions, const at::Tensor& inv_freq,
                                                         int64_t window, double leaky_k, double scale,
                                                         int64_t logn_length, bool causal, bool interleaved,
                                                         int64_t group, int64_t chunk_size, int64_t far_start);

// The op's outputs, out [B, Hq, Lq, D] in q's dtype and lse [B, Hq, Lq] float32; returns true when
// they are already final (no query, or no key: zeros and -inf) and no kernel needs to run.
bool empty_rerope_outputs(const ReropeArgs& args, at::Tensor& out, at::Tensor& lse);

// The instruction set of the CPU kernel rerope_attention runs: "AVX512", "AVX2" or "DEFAULT".
std::string rerope_attention_cpu_isa();

}  // namespace ropescale
