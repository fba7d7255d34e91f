// The rotary ops (apply_rotary*, DESIGN.md "Rotation"): every argument is checked here, once, for
// every backend; then the output is allocated and the CPU or CUDA kernel runs. The kernels
// themselves are in cpu/rotary_kernel.cpp and cuda/rotary.cu (over include/ropescale/rotary*.h).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "ops.h"
#include "position_limits.h"
#include "rotary_args.h"

namespace ropescale {
namespace {

using rotary::TableKind;

bool is_rotary_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// ---- The checks: metadata only, symbolic sizes allowed. The ONE check of every rotary op, run by
// the CPU and CUDA kernels (through table_args / position_args) and by the Meta kernels
// (FakeTensorMode, torch.compile), so both refuse the same inputs with the same message.

// q, k or x: 4-D [batch, heads, seq, head_dim], a float type, unit stride along head_dim.
void check_operand(const char* op, const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 4, op, ": ", name, " must be 4-D [batch, heads, seq, head_dim], got shape ",
              x.sym_sizes());
  TORCH_CHECK(is_rotary_dtype(x.scalar_type()), op, ": ", name,
              " must be float32, float16, bfloat16 or float64, got ", x.scalar_type());
  TORCH_CHECK(x.sym_stride(3) == 1 || x.sym_size(3) <= 1, op, ": ", name,
              " must have a unit stride along head_dim (the last dimension), got strides ", x.sym_strides());
}

void check_same_device(const char* op, const at::Tensor& x, const char* x_name, const char* name,
                       const at::Tensor& t) {
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " must be on the same device as ", x_name, " (",
              x.device(), "), got ", t.device());
}

// Operands: x alone, or q and k (same dtype, device, seq length and head_dim; batch and heads free).
void check_operands(const char* op, const at::Tensor& q, const at::Tensor* k, const char* const names[2]) {
  check_operand(op, names[0], q);
  if (k == nullptr) return;
  check_same_device(op, q, "q", "k", *k);
  check_operand(op, names[1], *k);
  TORCH_CHECK(k->scalar_type() == q.scalar_type(), op, ": q and k must have the same dtype, got ", q.scalar_type(),
              " and ", k->scalar_type());
  TORCH_CHECK(k->sym_size(2) == q.sym_size(2), op, ": q and k must have the same sequence length (dim 2), got ",
              q.sym_size(2), " and ", k->sym_size(2));
  TORCH_CHECK(k->sym_size(3) == q.sym_size(3), op, ": q and k must have the same head_dim, got ", q.sym_size(3),
              " and ", k->sym_size(3));
}

// The batch rows of a table (cos/sin or positions) must be 1 or the batch of every operand.
void check_table_batch(const char* op, const char* table, const c10::SymInt& table_batch, const at::Tensor& q,
                       const at::Tensor* k, const char* const names[2]) {
  if (table_batch == 1) return;
  TORCH_CHECK(q.sym_size(0) == table_batch, op, ": ", table, " has ", table_batch,
              " batch rows, which must be 1 or the batch size of ", names[0], " (", q.sym_size(0), ")");
  if (k != nullptr)
    TORCH_CHECK(k->sym_size(0) == table_batch, op, ": ", table, " has ", table_batch,
                " batch rows, which must be 1 or the batch size of ", names[1], " (", k->sym_size(0), ")");
}

void check_rotary_dim(const char* op, const c10::SymInt& rotary_dim, const c10::SymInt& head_dim,
                      const char* source) {
  TORCH_CHECK(rotary_dim >= 2 && rotary_dim % 2 == 0, op, ": rotary_dim (", source,
              ") must be a positive even number, got ", rotary_dim);
  TORCH_CHECK(rotary_dim <= head_dim, op, ": rotary_dim (", source, ") = ", rotary_dim,
              " is larger than head_dim = ", head_dim);
}

// cos/sin: [seq, width] or [batch or 1, seq, width], the operands' device, unit last stride, both
// of the operands' dtype or both float32 (whatever the operands' dtype: the tables autocast and
// FlashInfer/vLLM-style callers hand over with fp16/bf16 q and k; the kernels compute in fp32, fp64
// for double operands, and round once to the operands' dtype, which the outputs have). Tables of
// another dtype are refused rather than converted: a half table with float32 operands would round
// the rotation to the table's precision, and a float64 table with float32 operands would be read as
// its float32 rounding (the math is fp32); both are a cast the caller should see.
// Full width: rotary_dim = width (transformers' rotate-half layout, one entry per feature); half
// width: rotary_dim = 2 * width (one entry per pair). A full-width table with interleaved pairs is
// refused: its layout is ambiguous (GPT-J/Cohere write c0 c0 c1 c1, transformers' Llama c0 c1 ..
// c0 c1, and the wrong one rotates silently wrong); one entry per pair says it exactly.
void check_tables(const char* op, const at::Tensor& x, const at::Tensor* k, const at::Tensor& cos,
                  const at::Tensor& sin, bool interleaved, bool half_width, const char* const names[2]) {
  check_same_device(op, x, names[0], "cos", cos);
  check_same_device(op, x, names[0], "sin", sin);
  TORCH_CHECK(cos.dim() == 2 || cos.dim() == 3, op,
              ": cos must be [seq, rotary_dim] or [batch, seq, rotary_dim], got shape ", cos.sym_sizes());
  TORCH_CHECK(sin.sym_sizes() == cos.sym_sizes(), op, ": sin and cos must have the same shape, got ",
              sin.sym_sizes(), " and ", cos.sym_sizes());
  const at::ScalarType table_dtype = cos.scalar_type();
  TORCH_CHECK(sin.scalar_type() == table_dtype && (table_dtype == x.scalar_type() || table_dtype == at::kFloat), op,
              ": cos and sin must both be float32 or both have the dtype of ", names[0], " (", x.scalar_type(),
              "), got ", cos.scalar_type(), " and ", sin.scalar_type());
  TORCH_CHECK((cos.sym_stride(-1) == 1 || cos.sym_size(-1) <= 1) && (sin.sym_stride(-1) == 1 || sin.sym_size(-1) <= 1),
              op, ": cos and sin must have a unit stride along their last dimension, got strides ", cos.sym_strides(),
              " and ", sin.sym_strides());
  TORCH_CHECK(!interleaved || half_width, op,
              ": interleaved=True takes a half-width table (half_width=True, one cos/sin entry per pair, "
              "[.., seq, rotary_dim / 2]); a full-width table is ambiguous with interleaved pairs (GPT-J/Cohere "
              "repeat each entry, c0 c0 c1 c1; transformers' Llama writes c0 c1 .. c0 c1): pass "
              "cos[..., ::2].contiguous() for the first, cos[..., :rotary_dim // 2] for the second");
  TORCH_CHECK(cos.sym_size(-2) == x.sym_size(2), op, ": cos/sin cover ", cos.sym_size(-2), " positions but ",
              names[0], " has seq length ", x.sym_size(2), " (dim 2)");
  check_table_batch(op, "cos/sin", cos.dim() == 3 ? cos.sym_size(0) : c10::SymInt(1), x, k, names);
  const c10::SymInt& width = cos.sym_size(-1);
  check_rotary_dim(op, half_width ? width * 2 : width, x.sym_size(3),
                   half_width ? "2 * cos.size(-1), half_width=True" : "cos.size(-1)");
}

// positions: int32/int64 [seq] or [batch or 1, seq]; inv_freq: float32 [rotary_dim / 2].
void check_positions(const char* op, const at::Tensor& x, const at::Tensor* k, const at::Tensor& positions,
                     const at::Tensor& inv_freq, double scale, const char* const names[2]) {
  check_same_device(op, x, names[0], "positions", positions);
  check_same_device(op, x, names[0], "inv_freq", inv_freq);
  TORCH_CHECK(positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong, op,
              ": positions must be int32 or int64, got ", positions.scalar_type());
  TORCH_CHECK(positions.dim() == 1 || positions.dim() == 2, op,
              ": positions must be [seq] or [batch, seq], got shape ", positions.sym_sizes());
  TORCH_CHECK(inv_freq.dim() == 1, op, ": inv_freq must be 1-D [rotary_dim / 2], got shape ", inv_freq.sym_sizes());
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat, op, ": inv_freq must be float32, got ", inv_freq.scalar_type());
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  TORCH_CHECK(positions.sym_size(-1) == x.sym_size(2), op, ": positions has ", positions.sym_size(-1),
              " entries per row but ", names[0], " has seq length ", x.sym_size(2), " (dim 2)");
  check_table_batch(op, "positions", positions.dim() == 2 ? positions.sym_size(0) : c10::SymInt(1), x, k, names);
  check_rotary_dim(op, inv_freq.sym_size(0) * 2, x.sym_size(3), "2 * inv_freq.size(0)");
}

// The data check of the position ops: |position| <= kMaxPosition. CPU tensors only: on CUDA it
// would need a host sync on every call, so there the range is the caller's (documented) contract.
void check_position_range(const char* op, const at::Tensor& positions) {
  if (positions.numel() == 0 || !positions.device().is_cpu()) return;
  const int64_t largest = positions.abs().max().item<int64_t>();  // int64 min: abs overflows, stays negative
  TORCH_CHECK(largest >= 0 && largest <= kMaxPosition, op, ": positions must be within +-", kMaxPosition,
              " (2^31 - 1: beyond it the rotation angles lose accuracy), got ",
              largest >= 0 ? largest : std::numeric_limits<int64_t>::min());
}

// ---- The per-request op (apply_rotary_per_request): packed tokens, a table per token's request.

// q [T, Hq, D] and k [T, Hk, D] (Hk may be 0: q alone): a float type, one device and dtype, unit last stride.
void check_packed_operand(const char* op, const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3, op, ": ", name, " must be 3-D [tokens, heads, head_dim] (an engine's packed tokens), got "
              "shape ", x.sym_sizes());
  TORCH_CHECK(is_rotary_dtype(x.scalar_type()), op, ": ", name,
              " must be float32, float16, bfloat16 or float64, got ", x.scalar_type());
  TORCH_CHECK(x.sym_stride(2) == 1 || x.sym_size(2) <= 1, op, ": ", name,
              " must have a unit stride along head_dim (the last dimension), got strides ", x.sym_strides());
}

void check_index(const char* op, const char* name, const at::Tensor& index, const at::Tensor& q) {
  check_same_device(op, q, "q", name, index);
  TORCH_CHECK(index.scalar_type() == at::kInt || index.scalar_type() == at::kLong, op, ": ", name,
              " must be int32 or int64, got ", index.scalar_type());
  TORCH_CHECK(index.dim() == 1 && index.sym_size(0) == q.sym_size(0), op, ": ", name,
              " must be 1-D with one entry per token of q (", q.sym_size(0), "), got shape ", index.sym_sizes());
}

// request_index [T] picks each token's row of inv_freq [R, rotary_dim/2] (float32, unit last stride) and of
// attention_factors [R] (float32); positions [T].
void check_per_request(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                       const at::Tensor& request_index, const at::Tensor& inv_freq,
                       const at::Tensor& attention_factors, const std::optional<at::Tensor>& native_angles) {
  check_packed_operand(op, "q", q);
  check_packed_operand(op, "k", k);
  check_same_device(op, q, "q", "k", k);
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), op, ": q and k must have the same dtype, got ", q.scalar_type(),
              " and ", k.scalar_type());
  TORCH_CHECK(k.sym_size(0) == q.sym_size(0) && k.sym_size(2) == q.sym_size(2), op,
              ": q and k must have the same tokens and head_dim (dims 0 and 2), got shapes ", q.sym_sizes(), " and ",
              k.sym_sizes());
  check_index(op, "positions", positions, q);
  check_index(op, "request_index", request_index, q);
  check_same_device(op, q, "q", "inv_freq", inv_freq);
  check_same_device(op, q, "q", "attention_factors", attention_factors);
  TORCH_CHECK(inv_freq.dim() == 2, op, ": inv_freq must be 2-D [requests, rotary_dim / 2] (a table per request), got "
              "shape ", inv_freq.sym_sizes());
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat, op, ": inv_freq must be float32, got ", inv_freq.scalar_type());
  TORCH_CHECK(attention_factors.scalar_type() == at::kFloat, op, ": attention_factors must be float32, got ",
              attention_factors.scalar_type());
  TORCH_CHECK(attention_factors.dim() == 1 && attention_factors.sym_size(0) == inv_freq.sym_size(0), op,
              ": attention_factors must be [requests] with one entry per row of inv_freq (", inv_freq.sym_size(0),
              "), got shape ", attention_factors.sym_sizes());
  TORCH_CHECK(inv_freq.sym_size(0) >= 1 || q.sym_size(0) == 0, op,
              ": inv_freq has no rows (no request) but q has ", q.sym_size(0), " tokens");
  check_rotary_dim(op, inv_freq.sym_size(1) * 2, q.sym_size(2), "2 * inv_freq.size(1)");
  if (native_angles.has_value()) {
    check_same_device(op, q, "q", "native_angles", *native_angles);
    TORCH_CHECK(native_angles->scalar_type() == at::kBool && native_angles->dim() == 1 &&
                    native_angles->sym_size(0) == inv_freq.sym_size(0),
                op, ": native_angles must be bool [requests] with one entry per row of inv_freq (",
                inv_freq.sym_size(0), "), got ", native_angles->scalar_type(), " of shape ", native_angles->sym_sizes());
  }
}

// The data checks on CPU tensors (on CUDA a host sync per call: the caller's contract there): positions in
// range, every request_index a row of inv_freq, finite attention factors.
void check_per_request_values(const char* op, const at::Tensor& positions, const at::Tensor& request_index,
                              const at::Tensor& inv_freq, const at::Tensor& attention_factors) {
  check_position_range(op, positions);
  // Plain loops, not ATen reductions: a decode step has a handful of tokens, and three reductions would cost
  // as much as the rotation itself.
  if (request_index.numel() != 0 && request_index.device().is_cpu()) {
    const at::Tensor index = request_index.contiguous();
    int64_t low = std::numeric_limits<int64_t>::max(), high = std::numeric_limits<int64_t>::min();
    const auto scan = [&](const auto* values) {
      for (int64_t i = 0; i < index.numel(); ++i) {
        low = std::min<int64_t>(low, values[i]);
        high = std::max<int64_t>(high, values[i]);
      }
    };
    if (index.scalar_type() == at::kLong)
      scan(index.const_data_ptr<int64_t>());
    else
      scan(index.const_data_ptr<int32_t>());
    TORCH_CHECK(low >= 0 && high < inv_freq.size(0), op, ": request_index must be in [0, ", inv_freq.size(0),
                ") (the rows of inv_freq), got values from ", low, " to ", high);
  }
  if (attention_factors.numel() != 0 && attention_factors.device().is_cpu()) {
    const at::Tensor factors = attention_factors.contiguous();
    const float* values = factors.const_data_ptr<float>();
    for (int64_t i = 0; i < factors.numel(); ++i)
      TORCH_CHECK(std::isfinite(values[i]), op, ": attention_factors must be finite, got ", values[i], " at ", i);
  }
}

// ---- The checked arguments in the kernels' form (concrete sizes).

void set_operands(RotaryArgs& a, const at::Tensor& q, const at::Tensor* k) {
  a.in[0] = q;
  a.num_operands = 1;
  if (k != nullptr) {
    a.in[1] = *k;
    a.num_operands = 2;
  }
  a.seq_len = q.size(2);
  a.head_dim = q.size(3);
}

void set_tables(RotaryArgs& a, const at::Tensor& cos, const at::Tensor& sin, bool half_width) {
  a.cos = cos.dim() == 2 ? cos.unsqueeze(0) : cos;
  a.sin = sin.dim() == 2 ? sin.unsqueeze(0) : sin;
  a.table_batch = a.cos.size(0);
  a.table = half_width ? TableKind::kHalfWidth : TableKind::kFullWidth;
  a.rotary_dim = half_width ? 2 * a.cos.size(2) : a.cos.size(2);
}

void set_positions(RotaryArgs& a, const at::Tensor& positions, const at::Tensor& inv_freq, double scale) {
  a.positions = positions.dim() == 1 ? positions.unsqueeze(0) : positions;
  a.table_batch = a.positions.size(0);
  a.inv_freq = inv_freq.contiguous();
  a.table = TableKind::kPositions;
  a.rotary_dim = 2 * inv_freq.size(0);
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
      if (a.table_index.defined()) {
        check_no_overlap(op, a.in[o], names[o], a.table_index, "request_index");
        check_no_overlap(op, a.in[o], names[o], a.scales, "attention_factors");
        if (a.native_angles.defined()) check_no_overlap(op, a.in[o], names[o], a.native_angles, "native_angles");
      }
      a.out[o] = a.in[o];
    } else if (!a.out[o].defined()) {
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
  const char* const* names = k ? kQK : kX;
  check_operands(op, q, k, names);
  check_tables(op, q, k, cos, sin, interleaved, half_width, names);
  RotaryArgs a;
  set_operands(a, q, k);
  set_tables(a, cos, sin, half_width);
  a.interleaved = interleaved;
  a.conjugate = conjugate;
  return a;
}

RotaryArgs position_args(const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& positions,
                         const at::Tensor& inv_freq, double scale, bool interleaved, bool conjugate) {
  const char* const* names = k ? kQK : kX;
  check_operands(op, q, k, names);
  check_positions(op, q, k, positions, inv_freq, scale, names);
  check_position_range(op, positions);
  RotaryArgs a;
  set_operands(a, q, k);
  set_positions(a, positions, inv_freq, scale);
  a.interleaved = interleaved;
  a.conjugate = conjugate;
  return a;
}

// q [T, Hq, D] and k [T, Hk, D] as the kernels' [1, heads, T, D] operands (same memory), positions and
// request_index as one table row of T tokens; out3: the 3-D outputs (undefined in place).
RotaryArgs per_request_args(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                            const at::Tensor& request_index, const at::Tensor& inv_freq,
                            const at::Tensor& attention_factors, bool interleaved,
                            const std::optional<at::Tensor>& native_angles, const at::Tensor* out3) {
  check_per_request(op, q, k, positions, request_index, inv_freq, attention_factors, native_angles);
  check_per_request_values(op, positions, request_index, inv_freq, attention_factors);
  RotaryArgs a;
  const at::Tensor q4 = q.transpose(0, 1).unsqueeze(0), k4 = k.transpose(0, 1).unsqueeze(0);
  set_operands(a, q4, &k4);
  a.positions = positions.unsqueeze(0);
  a.table_index = request_index.unsqueeze(0);
  a.inv_freq = inv_freq.contiguous();
  a.scales = attention_factors.contiguous();
  if (native_angles.has_value()) a.native_angles = native_angles->contiguous();
  a.table = TableKind::kPositions;
  a.rotary_dim = 2 * inv_freq.size(1);
  a.interleaved = interleaved;
  if (out3 != nullptr)
    for (int o = 0; o < 2; ++o) a.out[o] = out3[o].transpose(0, 1).unsqueeze(0);
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

std::tuple<at::Tensor, at::Tensor> apply_rotary_per_request(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& positions, const at::Tensor& request_index,
                                                            const at::Tensor& inv_freq,
                                                            const at::Tensor& attention_factors, bool interleaved,
                                                            const std::optional<at::Tensor>& native_angles) {
  const at::Tensor out[2] = {at::empty_like(q), at::empty_like(k)};  // the 3-D layouts of q and k
  RotaryArgs a = per_request_args("apply_rotary_per_request", q, k, positions, request_index, inv_freq,
                                  attention_factors, interleaved, native_angles, out);
  run("apply_rotary_per_request", a, /*in_place=*/false);
  return {out[0], out[1]};
}

void apply_rotary_per_request_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                               const at::Tensor& request_index, const at::Tensor& inv_freq,
                               const at::Tensor& attention_factors, bool interleaved,
                               const std::optional<at::Tensor>& native_angles) {
  RotaryArgs a = per_request_args("apply_rotary_per_request_", q, k, positions, request_index, inv_freq,
                                  attention_factors, interleaved, native_angles, nullptr);
  run("apply_rotary_per_request_", a, /*in_place=*/true);
}

// ---- Meta kernels (FakeTensorMode, torch.compile, meta tensors): the same checks as the kernels
// above (not the data check of the positions, nor the in-place aliasing checks, which need memory),
// then outputs laid out as the kernels lay theirs (empty_like).

at::Tensor apply_rotary_meta(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                             bool half_width, bool conjugate) {
  check_operands("apply_rotary", x, nullptr, kX);
  check_tables("apply_rotary", x, nullptr, cos, sin, interleaved, half_width, kX);
  return at::empty_like(x);
}

void apply_rotary_meta_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                        bool half_width, bool conjugate) {
  check_operands("apply_rotary_", x, nullptr, kX);
  check_tables("apply_rotary_", x, nullptr, cos, sin, interleaved, half_width, kX);
}

std::tuple<at::Tensor, at::Tensor> apply_rotary_qk_meta(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& cos, const at::Tensor& sin,
                                                        bool interleaved, bool half_width, bool conjugate) {
  check_operands("apply_rotary_qk", q, &k, kQK);
  check_tables("apply_rotary_qk", q, &k, cos, sin, interleaved, half_width, kQK);
  return {at::empty_like(q), at::empty_like(k)};
}

void apply_rotary_qk_meta_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                           bool interleaved, bool half_width, bool conjugate) {
  check_operands("apply_rotary_qk_", q, &k, kQK);
  check_tables("apply_rotary_qk_", q, &k, cos, sin, interleaved, half_width, kQK);
}

at::Tensor apply_rotary_pos_meta(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq,
                                 double scale, bool interleaved, bool conjugate) {
  check_operands("apply_rotary_pos", x, nullptr, kX);
  check_positions("apply_rotary_pos", x, nullptr, positions, inv_freq, scale, kX);
  return at::empty_like(x);
}

void apply_rotary_pos_meta_(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq,
                            double scale, bool interleaved, bool conjugate) {
  check_operands("apply_rotary_pos_", x, nullptr, kX);
  check_positions("apply_rotary_pos_", x, nullptr, positions, inv_freq, scale, kX);
}

std::tuple<at::Tensor, at::Tensor> apply_rotary_pos_qk_meta(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& positions, const at::Tensor& inv_freq,
                                                            double scale, bool interleaved, bool conjugate) {
  check_operands("apply_rotary_pos_qk", q, &k, kQK);
  check_positions("apply_rotary_pos_qk", q, &k, positions, inv_freq, scale, kQK);
  return {at::empty_like(q), at::empty_like(k)};
}

void apply_rotary_pos_qk_meta_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                               const at::Tensor& inv_freq, double scale, bool interleaved, bool conjugate) {
  check_operands("apply_rotary_pos_qk_", q, &k, kQK);
  check_positions("apply_rotary_pos_qk_", q, &k, positions, inv_freq, scale, kQK);
}

std::tuple<at::Tensor, at::Tensor> apply_rotary_per_request_meta(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& positions,
                                                                 const at::Tensor& request_index,
                                                                 const at::Tensor& inv_freq,
                                                                 const at::Tensor& attention_factors, bool interleaved,
                                                                 const std::optional<at::Tensor>& native_angles) {
  check_per_request("apply_rotary_per_request", q, k, positions, request_index, inv_freq, attention_factors,
                    native_angles);
  return {at::empty_like(q), at::empty_like(k)};
}

void apply_rotary_per_request_meta_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                    const at::Tensor& request_index, const at::Tensor& inv_freq,
                                    const at::Tensor& attention_factors, bool interleaved,
                                    const std::optional<at::Tensor>& native_angles) {
  check_per_request("apply_rotary_per_request_", q, k, positions, request_index, inv_freq, attention_factors,
                    native_angles);
}

// ---- The checks as ops of their own (ropescale::_check_rotary, _check_rotary_pos), for the
// plain-PyTorch paths that compute these ops (the reference kernels): the metadata checks and, for
// CPU positions, the range check; `op` names the op in the messages.

void check_rotary(c10::string_view op, const at::Tensor& x, const std::optional<at::Tensor>& k, const at::Tensor& cos,
                  const at::Tensor& sin, bool interleaved, bool half_width) {
  const std::string name(op);
  const at::Tensor* k_ptr = k.has_value() ? &*k : nullptr;
  const char* const* names = k_ptr ? kQK : kX;
  check_operands(name.c_str(), x, k_ptr, names);
  check_tables(name.c_str(), x, k_ptr, cos, sin, interleaved, half_width, names);
}

void check_rotary_pos(c10::string_view op, const at::Tensor& x, const std::optional<at::Tensor>& k,
                      const at::Tensor& positions, const at::Tensor& inv_freq, double scale) {
  const std::string name(op);
  const at::Tensor* k_ptr = k.has_value() ? &*k : nullptr;
  const char* const* names = k_ptr ? kQK : kX;
  check_operands(name.c_str(), x, k_ptr, names);
  check_positions(name.c_str(), x, k_ptr, positions, inv_freq, scale, names);
  check_position_range(name.c_str(), positions);
}

void check_rotary_per_request(c10::string_view op, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& positions, const at::Tensor& request_index,
                              const at::Tensor& inv_freq, const at::Tensor& attention_factors,
                              const std::optional<at::Tensor>& native_angles) {
  const std::string name(op);
  check_per_request(name.c_str(), q, k, positions, request_index, inv_freq, attention_factors, native_angles);
  check_per_request_values(name.c_str(), positions, request_index, inv_freq, attention_factors);
}

}  // namespace ropescale
