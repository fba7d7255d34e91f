// Input checks of rerope_attention, shared by the CPU and CUDA entry points.
#include "rerope_attention.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace ropescale {

namespace {

at::Tensor checked_positions(const at::Tensor& positions, const char* name, int64_t batch, int64_t length,
                             const at::Tensor& q) {
  TORCH_CHECK(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt,
              "rerope_attention: ", name, " must be an integer tensor (int64 or int32), got ",
              positions.scalar_type());
  TORCH_CHECK(positions.dim() == 2 && positions.size(0) == batch && positions.size(1) == length,
              "rerope_attention: ", name, " must have shape [", batch, ", ", length, "], got ", positions.sizes());
  TORCH_CHECK(positions.device() == q.device(), "rerope_attention: ", name, " must be on ", q.device(),
              " like q, got ", positions.device());
  return positions.to(at::kLong).contiguous();
}

}  // namespace

ReropeArgs check_rerope_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& q_positions, const at::Tensor& k_positions,
                                       const at::Tensor& inv_freq, int64_t window, double leaky_k, double scale,
                                       int64_t logn_length, bool causal, bool interleaved) {
  TORCH_CHECK(q.dim() == 4, "rerope_attention: q must be [B, Hq, Lq, D], got ", q.dim(), " dims");
  TORCH_CHECK(k.dim() == 4, "rerope_attention: k must be [B, Hkv, Lk, D], got ", k.dim(), " dims");
  TORCH_CHECK(v.dim() == 4, "rerope_attention: v must be [B, Hkv, Lk, D], got ", v.dim(), " dims");
  TORCH_CHECK(k.sizes() == v.sizes(), "rerope_attention: k and v must have the same shape, got ", k.sizes(),
              " and ", v.sizes());
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "rerope_attention: q must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype,
              "rerope_attention: q, k and v must have the same dtype, got ", dtype, ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(),
              "rerope_attention: q, k and v must be on the same device, got ", q.device(), ", ", k.device(), ", ",
              v.device());
  TORCH_CHECK(k.size(0) == q.size(0), "rerope_attention: q and k must have the same batch size, got ",
              q.size(0), " and ", k.size(0));
  TORCH_CHECK(k.size(3) == q.size(3), "rerope_attention: q and k must have the same head dim, got ", q.size(3),
              " and ", k.size(3));

  ReropeArgs args;
  args.batch = q.size(0);
  args.q_heads = q.size(1);
  args.q_len = q.size(2);
  args.head_dim = q.size(3);
  args.kv_heads = k.size(1);
  args.k_len = k.size(2);
  TORCH_CHECK(args.kv_heads > 0 && args.q_heads % args.kv_heads == 0,
              "rerope_attention: the number of q heads (", args.q_heads,
              ") must be a multiple of the number of k/v heads (", args.kv_heads, ")");
  TORCH_CHECK(args.head_dim % 2 == 0 && args.head_dim > 0 && args.head_dim <= kReropeMaxHeadDim,
              "rerope_attention: head dim D must be even and in [2, ", kReropeMaxHeadDim, "], got ", args.head_dim);

  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.is_floating_point(),
              "rerope_attention: inv_freq must be a 1-D floating tensor, got ", inv_freq.dim(), " dims of ",
              inv_freq.scalar_type());
  TORCH_CHECK(inv_freq.numel() >= 1 && 2 * inv_freq.numel() <= args.head_dim,
              "rerope_attention: inv_freq must have between 1 and D/2 = ", args.head_dim / 2,
              " entries (rotary_dim / 2), got ", inv_freq.numel());
  TORCH_CHECK(inv_freq.device() == q.device(), "rerope_attention: inv_freq must be on ", q.device(),
              " like q, got ", inv_freq.device());
  args.rotary_pairs = inv_freq.numel();

  TORCH_CHECK(window > 0, "rerope_attention: window must be > 0, got ", window);
  TORCH_CHECK(std::isfinite(leaky_k) && (leaky_k == 0.0 || leaky_k >= 1.0),
              "rerope_attention: leaky_k must be 0 (ReRoPE) or >= 1 (Leaky ReRoPE, slope 1/leaky_k), got ", leaky_k);
  TORCH_CHECK(logn_length == 0 || logn_length >= 2,
              "rerope_attention: logn_length must be 0 (off) or >= 2 (the training length), got ", logn_length);
  TORCH_CHECK(!std::isnan(scale), "rerope_attention: scale must be a number, got nan");

  args.q_positions = checked_positions(q_positions, "q_positions", args.batch, args.q_len, q);
  args.k_positions = checked_positions(k_positions, "k_positions", args.batch, args.k_len, q);
  args.inv_freq = inv_freq.to(at::kFloat).contiguous();
  // Kernels read rows with a unit stride on the head dim; any other strides are fine.
  args.q = q.stride(3) == 1 ? q : q.contiguous();
  args.k = k.stride(3) == 1 ? k : k.contiguous();
  args.v = v.stride(3) == 1 ? v : v.contiguous();

  args.window = window;
  args.leaky_inv = leaky_k == 0.0 ? 0.0 : 1.0 / leaky_k;
  args.logn_length = logn_length;
  args.inv_log_train = logn_length > 0 ? 1.0 / std::log(static_cast<double>(logn_length)) : 0.0;
  args.scale = static_cast<float>(scale < 0.0 ? 1.0 / std::sqrt(static_cast<double>(args.head_dim)) : scale);
  args.causal = causal;
  args.interleaved = interleaved;
  return args;
}

bool empty_rerope_outputs(const ReropeArgs& args, at::Tensor& out, at::Tensor& lse) {
  out = at::empty({args.batch, args.q_heads, args.q_len, args.head_dim}, args.q.options());
  lse = at::empty({args.batch, args.q_heads, args.q_len}, args.q.options().dtype(at::kFloat));
  if (out.numel() == 0) return true;
  if (args.k_len == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return true;
  }
  return false;
}

}  // namespace ropescale
