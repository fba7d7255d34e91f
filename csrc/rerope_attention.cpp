// Input checks of rerope_attention, shared by the CPU and CUDA entry points and by the Meta kernel
// (FakeTensorMode, torch.compile): one check, so the op and its fake refuse the same inputs with the
// same message.
#include "rerope_attention.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "position_limits.h"

namespace ropescale {

namespace {

// Metadata only (never the data), with symbolic sizes allowed: the Meta kernel runs it on fake
// tensors.
void check_positions_meta(const at::Tensor& positions, const char* name, const c10::SymInt& batch,
                          const c10::SymInt& length, const at::Tensor& q) {
  TORCH_CHECK(positions.device() == q.device(), "rerope_attention: ", name, " must be on ", q.device(),
              " like q, got ", positions.device());
  TORCH_CHECK(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt,
              "rerope_attention: ", name, " must be an integer tensor (int64 or int32), got ",
              positions.scalar_type());
  TORCH_CHECK(positions.dim() == 2 && positions.sym_size(0) == batch && positions.sym_size(1) == length,
              "rerope_attention: ", name, " must have shape [", batch, ", ", length, "], got ",
              positions.sym_sizes());
}

}  // namespace

void check_region_arguments(const char* op, int64_t window, double leaky_k, int64_t group, int64_t chunk_size, int64_t far_start,
                            bool causal) {
  TORCH_CHECK(group >= 0, op, ": group must be >= 0 (0: not Self-Extend), got ", group);
  TORCH_CHECK(chunk_size >= 0, op, ": chunk_size must be >= 0 (0: not Dual Chunk Attention), got ", chunk_size);
  TORCH_CHECK(group == 0 || chunk_size == 0, op, ": group (Self-Extend) and chunk_size (Dual Chunk Attention) ",
              "exclude each other, got group=", group, ", chunk_size=", chunk_size);
  TORCH_CHECK(std::isfinite(leaky_k) && (leaky_k == 0.0 || leaky_k >= 1.0), op,
              ": leaky_k must be 0 (ReRoPE) or >= 1 (Leaky ReRoPE, slope 1/leaky_k), got ", leaky_k);
  TORCH_CHECK(far_start == -1 || (group == 0 && chunk_size == 0), op,
              ": far_start applies to (Leaky) ReRoPE and STRING only; Self-Extend (group) and Dual Chunk Attention ",
              "(chunk_size) need far_start=-1, got ", far_start);
  TORCH_CHECK(leaky_k == 0.0 || (group == 0 && chunk_size == 0), op,
              ": leaky_k applies to Leaky ReRoPE only; Self-Extend (group) and Dual Chunk Attention (chunk_size) ",
              "need leaky_k=0, got ", leaky_k);
  if (chunk_size > 0) {
    TORCH_CHECK(chunk_size <= kMaxPosition, op, ": chunk_size must be <= ", kMaxPosition, ", got ", chunk_size);
    TORCH_CHECK(window >= 0 && window < chunk_size, op,
                ": Dual Chunk Attention takes window = local_size with 0 <= local_size < chunk_size = ", chunk_size,
                ", got ", window);
    TORCH_CHECK(causal, op, ": Dual Chunk Attention is defined for causal attention only (causal=False given)");
    return;
  }
  TORCH_CHECK(window > 0 && window <= kMaxPosition, op, ": window must be > 0 and <= ", kMaxPosition, ", got ",
              window);
  TORCH_CHECK(far_start == -1 || (far_start >= 0 && far_start <= window), op,
              ": far_start must be -1 (the window) or in [0, window = ", window, "], got ", far_start);
  TORCH_CHECK(group <= kMaxPosition, op, ": group must be <= ", kMaxPosition, ", got ", group);
}

void check_rerope_attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& q_positions, const at::Tensor& k_positions,
                                 const at::Tensor& inv_freq, int64_t window, double leaky_k, double scale,
                                 int64_t logn_length, bool allow_float64, int64_t group, int64_t chunk_size, int64_t far_start,
                                 bool causal) {
  TORCH_CHECK(q.dim() == 4, "rerope_attention: q must be 4-D [B, Hq, Lq, D], got shape ", q.sym_sizes());
  TORCH_CHECK(k.dim() == 4, "rerope_attention: k must be 4-D [B, Hkv, Lk, D], got shape ", k.sym_sizes());
  TORCH_CHECK(v.dim() == 4, "rerope_attention: v must be 4-D [B, Hkv, Lk, D], got shape ", v.sym_sizes());
  // Devices first: a tensor on another device (meta among CPU tensors) must never reach a kernel.
  TORCH_CHECK(k.device() == q.device(), "rerope_attention: k must be on ", q.device(), " like q, got ", k.device());
  TORCH_CHECK(v.device() == q.device(), "rerope_attention: v must be on ", q.device(), " like q, got ", v.device());
  TORCH_CHECK(inv_freq.device() == q.device(), "rerope_attention: inv_freq must be on ", q.device(),
              " like q, got ", inv_freq.device());
  TORCH_CHECK(k.sym_sizes() == v.sym_sizes(), "rerope_attention: k and v must have the same shape, got ",
              k.sym_sizes(), " and ", v.sym_sizes());
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 ||
                  (allow_float64 && dtype == at::kDouble),
              "rerope_attention: q must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype,
              "rerope_attention: q, k and v must have the same dtype, got ", dtype, ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(k.sym_size(0) == q.sym_size(0), "rerope_attention: q and k must have the same batch size, got ",
              q.sym_size(0), " and ", k.sym_size(0));
  TORCH_CHECK(k.sym_size(3) == q.sym_size(3), "rerope_attention: q and k must have the same head dim, got ",
              q.sym_size(3), " and ", k.sym_size(3));
  const c10::SymInt& q_heads = q.sym_size(1);
  const c10::SymInt& kv_heads = k.sym_size(1);
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "rerope_attention: the number of q heads (", q_heads,
              ") must be a multiple of the number of k/v heads (", kv_heads, ")");
  const c10::SymInt& head_dim = q.sym_size(3);
  TORCH_CHECK(head_dim % 2 == 0 && head_dim > 0 && head_dim <= kReropeMaxHeadDim,
              "rerope_attention: head dim D must be even and in [2, ", kReropeMaxHeadDim, "], got ", head_dim);

  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.is_floating_point(),
              "rerope_attention: inv_freq must be a 1-D floating tensor, got shape ", inv_freq.sym_sizes(), " of ",
              inv_freq.scalar_type());
  TORCH_CHECK(inv_freq.sym_numel() >= 1 && 2 * inv_freq.sym_numel() <= head_dim,
              "rerope_attention: inv_freq must have between 1 and D/2 = ", head_dim / 2,
              " entries (rotary_dim / 2), got ", inv_freq.sym_numel());

  check_region_arguments("rerope_attention", window, leaky_k, group, chunk_size, far_start, causal);
  TORCH_CHECK(logn_length == 0 || logn_length >= 2,
              "rerope_attention: logn_length must be 0 (off) or >= 2 (the training length), got ", logn_length);
  // -1 (the schema's default; None in Python) means 1/sqrt(D). Anything else must be a softmax
  // scale: finite (inf makes every score +-inf or nan) and > 0 (0 or a negative one is a mistake, not
  // a request for 1/sqrt(D)). A large finite scale is a hard maximum, computed as such.
  TORCH_CHECK(scale == -1.0 || (std::isfinite(scale) && scale > 0.0 && scale <= std::numeric_limits<float>::max()),
              "rerope_attention: scale must be finite and > 0 (or -1, None in Python, for 1/sqrt(D)), got ", scale);

  check_positions_meta(q_positions, "q_positions", q.sym_size(0), q.sym_size(2), q);
  check_positions_meta(k_positions, "k_positions", q.sym_size(0), k.sym_size(2), q);
}

void check_rerope_positions(const at::Tensor& positions, const char* name) {
  if (!positions.device().is_cpu() || positions.numel() == 0) return;
  const int64_t largest = positions.max().item<int64_t>();
  TORCH_CHECK(largest <= kMaxPosition, "rerope_attention: ", name, " must be <= ", kMaxPosition,
              " (2^31 - 1: beyond it the rotation angles lose accuracy), got ", largest);
}

ReropeArgs check_rerope_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& q_positions, const at::Tensor& k_positions,
                                       const at::Tensor& inv_freq, int64_t window, double leaky_k, double scale,
                                       int64_t logn_length, bool causal, bool interleaved, int64_t group,
                                       int64_t chunk_size, int64_t far_start) {
  check_rerope_attention_meta(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, scale, logn_length,
                              /*allow_float64=*/false, group, chunk_size, far_start, causal);

  ReropeArgs args;
  args.batch = q.size(0);
  args.q_heads = q.size(1);
  args.q_len = q.size(2);
  args.head_dim = q.size(3);
  args.kv_heads = k.size(1);
  args.k_len = k.size(2);
  args.rotary_pairs = inv_freq.numel();
  args.q_positions = q_positions.to(at::kLong).contiguous();
  args.k_positions = k_positions.to(at::kLong).contiguous();
  // Data checks: on the CPU only (a CUDA check would need a host sync on every call).
  check_rerope_positions(args.q_positions, "q_positions");
  check_rerope_positions(args.k_positions, "k_positions");
  args.inv_freq = inv_freq.to(at::kFloat).contiguous();
  // Kernels read rows with a unit stride on the head dim; any other strides are fine.
  args.q = q.stride(3) == 1 ? q : q.contiguous();
  args.k = k.stride(3) == 1 ? k : k.contiguous();
  args.v = v.stride(3) == 1 ? v : v.contiguous();

  args.rule = make_region_rule(window, leaky_k, group, chunk_size, far_start);
  args.logn_length = logn_length;
  args.inv_log_train = logn_length > 0 ? 1.0 / std::log(static_cast<double>(logn_length)) : 0.0;
  args.scale = static_cast<float>(scale == -1.0 ? 1.0 / std::sqrt(static_cast<double>(args.head_dim)) : scale);
  args.causal = causal;
  args.interleaved = interleaved;
  return args;
}

std::tuple<at::Tensor, at::Tensor> rerope_attention_meta(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, const at::Tensor& q_positions,
                                                         const at::Tensor& k_positions, const at::Tensor& inv_freq,
                                                         int64_t window, double leaky_k, double scale,
                                                         int64_t logn_length, bool causal, bool interleaved,
                                                         int64_t group, int64_t chunk_size, int64_t far_start) {
  check_rerope_attention_meta(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, scale, logn_length,
                              /*allow_float64=*/false, group, chunk_size, far_start, causal);
  at::Tensor out = at::empty_symint(q.sym_sizes(), q.options());
  at::Tensor lse = at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2)}, q.options().dtype(at::kFloat));
  return {out, lse};
}

void check_rerope_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& q_positions, const at::Tensor& k_positions, const at::Tensor& inv_freq,
                            int64_t window, double leaky_k, double scale, int64_t logn_length, bool allow_float64,
                            int64_t group, int64_t chunk_size, int64_t far_start, bool causal) {
  check_rerope_attention_meta(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k, scale, logn_length,
                              allow_float64, group, chunk_size, far_start, causal);
  check_rerope_positions(q_positions, "q_positions");
  check_rerope_positions(k_positions, "k_positions");
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
