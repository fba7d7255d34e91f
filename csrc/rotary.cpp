// The rotary ops (apply_rotary*, DESIGN.md "Rotation"): every argument is checked here, once, for
// every backend; then the output is allocated and the CPU or CUDA kernel runs. The kernels
// themselves are in cpu/rotary_kernel.cpp and cuda/rotary.cu (over include/ropescale/rotary*.h).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <cmath>
#include <string>

#include "ops.h"
#include "rotary_args.h"

namespace ropescale {
namespace {

using rotary::TableKind;

bool is_rotary_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// q, k or x: 4-D [batch, heads, seq, head_dim], a float type, unit stride along head_dim.
void check_operand(const char* op, const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 4, op, ": ", name, " must be 4-D [batch, heads, seq, head_dim], got shape ", x.sizes());
  TORCH_CHECK(is_rotary_dtype(x.scalar_type()), op, ": ", name,
              " must be float32, float16, bfloat16 or float64, got ", x.scalar_type());
  TORCH_CHECK(x.stride(3) == 1 || x.size(3) <= 1, op, ": ", name,
              " must have a unit stride along head_dim (the last dimension), got strides ", x.strides());
}

void check_same_device(const char* op, const at::Tensor& x, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " must be on the same device as the rotated tensor (",
              x.device(), "), got ", t.device());
}

// The batch rows of a table (cos/sin or positions) must be 1 or the batch of every operand.
void check_table_batch(const char* op, const char* table, int64_t table_batch, const RotaryArgs& a,
                       const char* const names[2]) {
  if (table_batch == 1) return;
  for (int o = 0; o < a.num_operands; ++o)
    TORCH_CHECK(a.in[o].size(0) == table_batch, op, ": ", table, " has ", table_batch,
                " batch rows, which must be 1 or the batch size of ", names[o], " (", a.in[o].size(0), ")");
}

// Operands: x alone, or q and k (same dtype, device, seq length and head_dim; batch and heads free).
void set_operands(const char* op, RotaryArgs& a, const at::Tensor& q, const at::Tensor* k, const char* const names[2]) {
  check_operand(op, names[0], q);
  a.in[0] = q;
  a.num_operands = 1;
  if (k != nullptr) {
    check_operand(op, names[1], *k);
    TORCH_CHECK(k->scalar_type() == q.scalar_type(), op, ": q and k must have the same dtype, got ", q.scalar_type(),
                " and ", k->scalar_type());
    check_same_device(op, q, "k", *k);
    TORCH_CHECK(k->size(2) == q.size(2), op, ": q and k must have the same sequence length (dim 2), got ", q.size(2),
                " and ", k->size(2));
    TORCH_CHECK(k->size(3) == q.size(3), op, ": q and k must have the same head_dim, got ", q.size(3), " and ",
                k->size(3));
    a.in[1] = *k;
    a.num_operands = 2;
  }
  a.seq_len = q.size(2);
  a.head_dim = q.size(3);
}

void check_rotary_dim(const char* op, const RotaryArgs& a, const std::string& source) {
  TORCH_CHECK(a.rotary_dim >= 2 && a.rotary_dim % 2 == 0, op, ": rotary_dim (", source,
              ") must be a positive even number, got ", a.rotary_dim);
  TORCH_CHECK(a.rotary_dim <= a.head_dim, op, ": rotary_dim (", source, ") = ", a.rotary_dim,
              " is larger than head_dim = ", a.head_dim);
}

// cos/sin: [seq, width] or [batch or 1, seq, width], the operands' dtype and device, unit last
// stride. Full width: rotary_dim = width (transformers); half width: rotary_dim = 2 * width.
void set_tables(const char* op, RotaryArgs& a, const at::Tensor& cos, const at::Tensor& sin, bool half_width,
                const char* const names[2]) {
  const at::Tensor& x = a.in[0];
  TORCH_CHECK(cos.dim() == 2 || cos.dim() == 3, op, ": cos must be [seq, rotary_dim] or [batch, seq, rotary_dim], got shape ",
              cos.sizes());
  TORCH_CHECK(sin.sizes() == cos.sizes(), op, ": sin and cos must have the same shape, got ", sin.sizes(), " and ",
              cos.sizes());
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), op,
              ": cos and sin must have the dtype of ", names[0], " (", x.scalar_type(), "), got ", cos.scalar_type(),
              " and ", sin.scalar_type());
  check_same_device(op, x, "cos", cos);
  check_same_device(op, x, "sin", sin);
  TORCH_CHECK((cos.stride(-1) == 1 || cos.size(-1) <= 1) && (sin.stride(-1) == 1 || sin.size(-1) <= 1), op,
              ": cos and sin must have a unit stride along their last dimension, got strides ", cos.strides(), " and ",
              sin.strides());
  a.cos = cos.dim() == 2 ? cos.unsqueeze(0) : cos;
  a.sin = sin.dim() == 2 ? sin.unsqueeze(0) : sin;
  TORCH_CHECK(a.cos.size(1) == a.seq_len, op, ": cos/sin cover ", a.cos.size(1), " positions but ", names[0],
              " has seq length ", a.seq_len, " (dim 2)");
  a.table_batch = a.cos.size(0);
  check_table_batch(op, "cos/sin", a.table_batch, a, names);
  a.table = half_width ? TableKind::kHalfWidth : TableKind::kFullWidth;
  a.rotary_dim = half_width ? 2 * a.cos.size(2) : a.cos.size(2);
  check_rotary_dim(op, a, half_width ? "2 * cos.size(-1), half_width=True" : "cos.size(-1)");
}

// positions: int32/int64 [seq] or [batch or 1, seq]; inv_freq: float32 [rotary_dim / 2].
void set_positions(const char* op, RotaryArgs& a, const at::Tensor& positions, const at::Tensor& inv_freq,
                   double scale, const char* const names[2]) {
  const at::Tensor& x = a.in[0];
  TORCH_CHECK(positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong, op,
              ": positions must be int32 or int64, got ", positions.scalar_type());
  TORCH_CHECK(positions.dim() == 1 || positions.dim() == 2, op, ": positions must be [seq] or [batch, seq], got shape ",
              positions.sizes());
  TORCH_CHECK(inv_freq.dim() == 1, op, ": inv_freq must be 1-D [rotary_dim / 2], got shape ", inv_freq.sizes());
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat, op, ": inv_freq must be float32, got ", inv_freq.scalar_type());
  check_same_device(op, x, "positions", positions);
  check_same_device(op, x, "inv_freq", inv_freq);
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  a.positions = positions.dim() == 1 ? positions.unsqueeze(0) : positions;
  TORCH_CHECK(a.positions.size(1) == a.seq_len, op, ": positions has ", a.positions.size(1), " entries per row but ",
              names[0], " has seq length ", a.seq_len, " (dim 2)");
  a.table_batch = a.positions.size(0);
  check_table_batch(op, "positions", a.table_batch, a, names);
  a.inv_freq = inv_freq.contiguous();
  a.table = TableKind::kPositions;
  a.rotary_dim = 2 * inv_freq.size(0);
  check_rotary_dim(op, a, "2 * inv_freq.size(0)");
  a.scale = scale;
}

constexpr const char* kX[2] = {"x", nullptr};
constexpr const char* kQK[2] = {"q", "k"};

void check_no_overlap(const char* op, const at::Tensor& written, const char* written_name, const at::Tensor& other,
                      const char* other_name) {
  const at::MemOverlapStatus status = at::get_overlap_status(written, other);
  TORCH_CHECK(status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial, op, ": ", written_name,
              " is written in place but shares memory with ", other_name);
}

// Allocates the outputs (same layout as the inputs where possible) or, in place, checks that the
// operands can be written safely; then runs the kernel of the operands' device on the non-empty
// operands.
void run(const char* op, RotaryArgs& a, bool in_place) {
  a.in_place = in_place;
  const char* const* names = a.num_operands == 2 ? kQK : kX;
  for (int o = 0; o < a.num_operands; ++o) {
    if (in_place) {
      TORCH_CHECK(at::has_internal_overlap(a.in[o]) != at::MemOverlap::Yes, op, ": ", names[o],
                  " has elements that share memory (an expanded tensor?), so it cannot be written in place");
      const bool positions = a.table == TableKind::kPositions;
      check_no_overlap(op, a.in[o], names[o], positions ? a.positions : a.cos, positions ? "positions" : "cos");
      check_no_overlap(op, a.in[o], names[o], positions ? a.inv_freq : a.sin, positions ? "inv_freq" : "sin");
      a.out[o] = a.in[o];
    } else {
      a.out[o] = at::empty_like(a.in[o]);
    }
  }
  if (in_place && a.num_operands == 2) check_no_overlap(op, a.in[0], "q", a.in[1], "k");

  // The kernels index tokens and rows with 32-bit arithmetic.
  int64_t rows = 0;
  for (int o = 0; o < a.num_operands; ++o) rows += (a.table_batch == 1 ? a.in[o].size(0) : 1) * a.in[o].size(1);
  TORCH_CHECK(a.table_batch * a.seq_len <= rotary::Params<float>::kMaxIndex && rows <= rotary::Params<float>::kMaxIndex,
              op, ": more than 2^31 - 1 tokens or rows per token are not supported");

  RotaryArgs work = a;
  work.num_operands = 0;
  for (int o = 0; o < a.num_operands; ++o) {
    if (a.in[o].numel() == 0) continue;
    work.in[work.num_operands] = a.in[o];
    work.out[work.num_operands] = a.out[o];
    ++work.num_operands;
  }
  if (work.num_operands == 0) return;
  const at::Device device = a.in[0].device();
  if (device.is_cpu()) {
    rotary_cpu(work);
    return;
  }
#ifdef ROPESCALE_WITH_CUDA
  if (device.is_cuda()) {
    rotary_cuda(work);
    return;
  }
#endif
  TORCH_CHECK(false, op, ": no kernel for device ", device);
}

RotaryArgs table_args(const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& cos,
                      const at::Tensor& sin, bool interleaved, bool half_width, bool conjugate) {
  RotaryArgs a;
  const char* const* names = k ? kQK : kX;
  set_operands(op, a, q, k, names);
  set_tables(op, a, cos, sin, half_width, names);
  a.interleaved = interleaved;
  a.conjugate = conjugate;
  return a;
}

RotaryArgs position_args(const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& positions,
                         const at::Tensor& inv_freq, double scale, bool interleaved, bool conjugate) {
  RotaryArgs a;
  const char* const* names = k ? kQK : kX;
  set_operands(op, a, q, k, names);
  set_positions(op, a, positions, inv_freq, scale, names);
  a.interleaved = interleaved;
  a.conjugate = conjugate;
  return a;
}

}  // namespace

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                        bool half_width, bool conjugate) {
  RotaryArgs a = table_args("apply_rotary", x, nullptr, cos, sin, interleaved, half_width, conjugate);
  run("apply_rotary", a, /*in_place=*/false);
  return a.out[0];
}

void apply_rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                   bool half_width, bool conjugate) {
  RotaryArgs a = table_args("apply_rotary_", x, nullptr, cos, sin, interleaved, half_width, conjugate);
  run("apply_rotary_", a, /*in_place=*/true);
}

std::tuple<at::Tensor, at::Tensor> apply_rotary_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                   const at::Tensor& sin, bool interleaved, bool half_width,
                                                   bool conjugate) {
  RotaryArgs a = table_args("apply_rotary_qk", q, &k, cos, sin, interleaved, half_width, conjugate);
  run("apply_rotary_qk", a, /*in_place=*/false);
  return {a.out[0], a.out[1]};
}

void apply_rotary_qk_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                      bool interleaved, bool half_width, bool conjugate) {
  RotaryArgs a = table_args("apply_rotary_qk_", q, &k, cos, sin, interleaved, half_width, conjugate);
  run("apply_rotary_qk_", a, /*in_place=*/true);
}

at::Tensor apply_rotary_pos(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq, double scale,
                            bool interleaved, bool conjugate) {
  RotaryArgs a = position_args("apply_rotary_pos", x, nullptr, positions, inv_freq, scale, interleaved, conjugate);
  run("apply_rotary_pos", a, /*in_place=*/false);
  return a.out[0];
}

void apply_rotary_pos_(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq, double scale,
                       bool interleaved, bool conjugate) {
  RotaryArgs a = position_args("apply_rotary_pos_", x, nullptr, positions, inv_freq, scale, interleaved, conjugate);
  run("apply_rotary_pos_", a, /*in_place=*/true);
}

std::tuple<at::Tensor, at::Tensor> apply_rotary_pos_qk(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& positions, const at::Tensor& inv_freq,
                                                       double scale, bool interleaved, bool conjugate) {
  RotaryArgs a = position_args("apply_rotary_pos_qk", q, &k, positions, inv_freq, scale, interleaved, conjugate);
  run("apply_rotary_pos_qk", a, /*in_place=*/false);
  return {a.out[0], a.out[1]};
}

void apply_rotary_pos_qk_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                          const at::Tensor& inv_freq, double scale, bool interleaved, bool conjugate) {
  RotaryArgs a = position_args("apply_rotary_pos_qk_", q, &k, positions, inv_freq, scale, interleaved, conjugate);
  run("apply_rotary_pos_qk_", a, /*in_place=*/true);
}

}  // namespace ropescale
