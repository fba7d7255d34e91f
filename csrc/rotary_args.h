// The validated arguments of a rotary op (csrc/rotary.cpp checks them at the op boundary) and
// their translation into the framework-free kernel parameters (include/ropescale/rotary.h) that the
// CPU kernel (cpu/rotary.cpp) and the CUDA kernel (cuda/rotary.cu) both read.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <type_traits>

#include "ropescale/rotary.h"

namespace ropescale {

struct RotaryArgs {
  // q (and k): inputs and outputs, 4-D [batch, heads, seq, head_dim]; out == in when in place.
  at::Tensor in[2], out[2];
  int num_operands = 1;
  int64_t seq_len = 0, head_dim = 0, rotary_dim = 0, table_batch = 1;
  rotary::TableKind table = rotary::TableKind::kFullWidth;
  at::Tensor cos, sin;       // [table_batch, seq, width] (2-D tables are viewed as 3-D); in[0]'s dtype or float32
  at::Tensor positions;      // [table_batch, seq], int32 or int64
  at::Tensor inv_freq;       // [rotary_dim / 2] or, with table_index, [tables, rotary_dim / 2]; float32, contiguous
  double scale = 1.0;
  at::Tensor table_index;    // undefined, or [table_batch, seq] int32/int64: each token's row of inv_freq
  at::Tensor scales;         // with table_index: [tables] float32, each row's factor on cos and sin
  at::Tensor native_angles;  // with table_index: undefined or [tables] bool, rows with an engine's native angles
  bool interleaved = false, conjugate = false, in_place = false;
};

// Kernel parameters with element type T: the backend's own type of the same layout as the
// tensors' dtype (float, double, c10::Half / __half, c10::BFloat16 / __nv_bfloat16); Table the
// same for the cos/sin tables (T, or float).
template <class T, class Table = T>
rotary::Params<T, Table> make_rotary_params(const RotaryArgs& a) {
  rotary::Params<T, Table> p;
  p.num_operands = a.num_operands;
  for (int o = 0; o < a.num_operands; ++o) {
    const at::Tensor& in = a.in[o];
    const at::Tensor& out = a.out[o];
    rotary::Operand<T>& x = p.operands[o];
    x.in = static_cast<const T*>(in.const_data_ptr());
    x.out = static_cast<T*>(out.data_ptr());
    x.batch = in.size(0);
    x.heads = in.size(1);
    x.in_stride_batch = in.stride(0);
    x.in_stride_head = in.stride(1);
    x.in_stride_seq = in.stride(2);
    x.out_stride_batch = out.stride(0);
    x.out_stride_head = out.stride(1);
    x.out_stride_seq = out.stride(2);
  }
  p.seq_len = a.seq_len;
  p.head_dim = a.head_dim;
  p.rotary_dim = a.rotary_dim;
  p.table_batch = a.table_batch;
  p.table = a.table;
  if (a.table == rotary::TableKind::kPositions) {
    p.positions = a.positions.const_data_ptr();
    p.positions_int64 = a.positions.scalar_type() == at::kLong;
    p.positions_stride_batch = a.positions.stride(0);
    p.positions_stride_seq = a.positions.stride(1);
    p.inv_freq = a.inv_freq.const_data_ptr<float>();
    p.scale = a.scale;
    if (a.table_index.defined()) {
      p.table_index = a.table_index.const_data_ptr();
      p.table_index_int64 = a.table_index.scalar_type() == at::kLong;
      p.table_index_stride_batch = a.table_index.stride(0);
      p.table_index_stride_seq = a.table_index.stride(1);
      p.inv_freq_stride = a.inv_freq.size(-1);
      p.scales = a.scales.const_data_ptr<float>();
      if (a.native_angles.defined()) p.native_angles = a.native_angles.const_data_ptr<bool>();
    }
  } else {
    TORCH_INTERNAL_ASSERT(a.cos.element_size() == sizeof(Table) && a.sin.element_size() == sizeof(Table));
    p.cos = static_cast<const Table*>(a.cos.const_data_ptr());
    p.sin = static_cast<const Table*>(a.sin.const_data_ptr());
    p.cos_stride_batch = a.cos.stride(0);
    p.cos_stride_seq = a.cos.stride(1);
    p.sin_stride_batch = a.sin.stride(0);
    p.sin_stride_seq = a.sin.stride(1);
  }
  p.interleaved = a.interleaved;
  p.conjugate = a.conjugate;
  p.copy_tail = !a.in_place && a.rotary_dim < a.head_dim;
  return p;
}

// Whether the cos/sin tables are float32 while the operands are not (half, bfloat16, double
// operands with float32 tables, as autocast produces them): the kernels then take Params<T, float>.
inline bool float32_tables(const RotaryArgs& a) {
  return a.table != rotary::TableKind::kPositions && a.cos.scalar_type() == at::kFloat &&
         a.in[0].scalar_type() != at::kFloat;
}

// Calls f(params) with the kernel parameters of the arguments for element type T (the dtype
// dispatch's own type): Params<T, float> for float32 tables with other operands, else Params<T>.
// The one place both backends choose the table type.
template <class T, class F>
void with_rotary_params(const RotaryArgs& a, F&& f) {
  if constexpr (!std::is_same_v<T, float>) {
    if (float32_tables(a)) {
      f(make_rotary_params<T, float>(a));
      return;
    }
  }
  f(make_rotary_params<T>(a));
}

// The kernels, per backend. Arguments are already checked; the work is not empty.
void rotary_cpu(const RotaryArgs& args);
// The instruction set of the CPU kernel rotary_cpu runs: "AVX512", "AVX2" or "DEFAULT".
std::string rotary_cpu_isa();
// cos/sin of position * inv_freq[i], i < pairs, as rotary_cpu computes them (the angle reduced in
// double, vectorised sin/cos of this CPU's instruction set); for the ReRoPE CPU kernel's tables.
void rotary_cos_sin_cpu(double position, const float* inv_freq, int64_t pairs, float* cos_out, float* sin_out);
#ifdef ROPESCALE_WITH_CUDA
void rotary_cuda(const RotaryArgs& args);
#endif

}  // namespace ropescale
