// ATen-side pieces of rerope_attention shared by the CPU and CUDA entry points: the input checks
// (done once, at the op boundary) and the normalised arguments both backends run from.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace ropescale {

struct ReropeArgs {
  at::Tensor q, k, v;                    // [B, H, L, D], unit stride on the last dim
  at::Tensor q_positions, k_positions;   // int64 [B, Lq] / [B, Lk], contiguous
  at::Tensor inv_freq;                   // float32 [rotary_dim / 2], contiguous
  int64_t batch = 0, q_heads = 0, kv_heads = 0, q_len = 0, k_len = 0, head_dim = 0, rotary_pairs = 0;
  int64_t window = 0, logn_length = 0;
  double leaky_inv = 0.0;      // 1/k, 0 for plain ReRoPE
  double inv_log_train = 0.0;  // 1/ln(logn_length), 0 when log-n is off
  float scale = 0.0f;          // softmax scale (1/sqrt(D) when the caller passed < 0)
  bool causal = true, interleaved = false;
};

inline constexpr int64_t kReropeMaxHeadDim = 256;

// Validates the op's arguments (messages name the op and the argument) and normalises them:
// int32 positions and float64 inv_freq are converted, the last dims made unit-stride.
ReropeArgs check_rerope_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& q_positions, const at::Tensor& k_positions,
                                       const at::Tensor& inv_freq, int64_t window, double leaky_k, double scale,
                                       int64_t logn_length, bool causal, bool interleaved);

// The op's outputs, out [B, Hq, Lq, D] in q's dtype and lse [B, Hq, Lq] float32; returns true when
// they are already final (no query, or no key: zeros and -inf) and no kernel needs to run.
bool empty_rerope_outputs(const ReropeArgs& args, at::Tensor& out, at::Tensor& lse);

// The instruction set of the CPU kernel rerope_attention runs: "AVX512", "AVX2" or "DEFAULT".
std::string rerope_attention_cpu_isa();

}  // namespace ropescale
