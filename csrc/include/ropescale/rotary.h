// Framework-free description of one rotary application, shared by the CPU kernel
// (csrc/cpu/rotary.cpp), the CUDA kernel (rotary_kernels.cuh) and its CPU emulation
// (tests/emulation): the parameters as raw pointers and strides, which elements form a pair, which
// table entries a pair reads, and the rotation of a pair. No torch and no CUDA headers here.
//
// The contract (../shared/DESIGN.md, "Rotation"): x is [batch, heads, seq, head_dim] with any
// strides and a unit last-dim stride; the first rotary_dim features are rotated, the rest are
// copied (or left alone in place). Pair i of a row is (a, b) = (i, i + rotary_dim/2) in the
// half-split layout (NeoX, transformers' Llama) or (2i, 2i+1) interleaved (GPT-J), and
//   y_a = x_a * cos_a - x_b * sin_a,   y_b = x_b * cos_b + x_a * sin_b.
// With a full-width table (transformers' [.., seq, rotary_dim]) cos_a = cos[a], cos_b = cos[b]:
// that is exactly x * cos + rotate_half(x) * sin, whatever the table holds. With a half-width table
// ([.., seq, rotary_dim/2]) both read cos[i]; with positions, cos = scale * cos(p * inv_freq[i]), and
// with a table per token (an engine's batch of requests of different scales) the token's row r of
// inv_freq [tables, rotary_dim/2] and its scale scales[r] instead.
// Tables are of the operands' type T or of float (fp32 tables with fp16/bf16/fp64 operands, as
// FlashInfer and vLLM take them and autocast produces them): Params' second parameter. Either way
// the math is fp32 (fp64 for double operands) and the result is rounded once to T.
#pragma once

#include <cstdint>

#include "ropescale/portable.h"
#include "ropescale/rotary_math.h"

namespace ropescale {
namespace rotary {

// Where cos/sin come from.
enum class TableKind : int {
  kFullWidth = 0,  // cos/sin [table_batch, seq, rotary_dim], one entry per feature
  kHalfWidth = 1,  // cos/sin [table_batch, seq, rotary_dim/2], one entry per pair
  kPositions = 2,  // positions [table_batch, seq] x inv_freq [rotary_dim/2], sin/cos on the fly
};

// One rotated tensor (q or k): logical [batch, heads, seq, head_dim], unit stride along head_dim.
// `in == out` for the in-place ops. Strides are in elements.
template <class T>
struct Operand {
  const T* in = nullptr;
  T* out = nullptr;
  int64_t batch = 0, heads = 0;
  int64_t in_stride_batch = 0, in_stride_head = 0, in_stride_seq = 0;
  int64_t out_stride_batch = 0, out_stride_head = 0, out_stride_seq = 0;
};

// Everything a kernel needs, for q alone or q and k together (one pass, one launch). `Table` is the
// element type of the cos/sin tables: T itself, or float for T = half, bfloat16 or double (the op
// boundary accepts nothing else). The position kind reads no table and uses Table = T.
template <class T, class Table = T>
struct Params {
  Operand<T> operands[2];
  int num_operands = 1;
  int64_t seq_len = 0, head_dim = 0, rotary_dim = 0;
  // Batch rows of the table (cos/sin or positions): 1 when one table serves every batch row of
  // every operand, else equal to each operand's batch. A "token" is one (table row, seq) pair:
  // its sin/cos are computed once and reused for every head (and batch row) that shares it.
  int64_t table_batch = 1;

  TableKind table = TableKind::kFullWidth;
  // kFullWidth / kHalfWidth: tables of type Table (T or float), unit last-dim stride.
  const Table* cos = nullptr;
  const Table* sin = nullptr;
  int64_t cos_stride_batch = 0, cos_stride_seq = 0, sin_stride_batch = 0, sin_stride_seq = 0;
  // kPositions: int32 or int64 positions, float32 inv_freq (contiguous), scale on cos and sin.
  const void* positions = nullptr;
  bool positions_int64 = true;
  int64_t positions_stride_batch = 0, positions_stride_seq = 0;
  const float* inv_freq = nullptr;
  double scale = 1.0;
  // kPositions with a table per token: token (b, s) reads row table_index[b, s] of inv_freq (rows of
  // inv_freq_stride floats) and takes scales[row] instead of `scale`. None (nullptr): row 0, `scale`.
  const void* table_index = nullptr;
  bool table_index_int64 = true;
  int64_t table_index_stride_batch = 0, table_index_stride_seq = 0, inv_freq_stride = 0;
  const float* scales = nullptr;
  // With a table per token: rows whose angles are formed as an engine's native table forms them (native_sincos),
  // e.g. a request that fits the trained length and is the native model; nullptr: none.
  const bool* native_angles = nullptr;

  bool interleaved = false;
  // Apply the transpose of the map (angle -theta for a true rotation): the backward pass.
  bool conjugate = false;
  // Out-of-place with rotary_dim < head_dim: copy features [rotary_dim, head_dim) unchanged.
  bool copy_tail = false;

  // Sizes the kernels index with 32-bit arithmetic; the op boundary checks both stay below 2^31.
  static constexpr int64_t kMaxIndex = (int64_t{1} << 31) - 1;

  ROPESCALE_HOST_DEVICE int64_t half() const { return rotary_dim / 2; }
  ROPESCALE_HOST_DEVICE int64_t tokens() const { return table_batch * seq_len; }
};

// Rows (batch row, head) of operand `o` that share one token's table.
template <class T, class Table>
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE int64_t operand_rows_per_token(const Params<T, Table>& p, int o) {
  const Operand<T>& x = p.operands[o];
  return (p.table_batch == 1 ? x.batch : 1) * x.heads;
}

template <class T, class Table>
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE int64_t rows_per_token(const Params<T, Table>& p) {
  int64_t rows = 0;
  for (int o = 0; o < p.num_operands; ++o) rows += operand_rows_per_token(p, o);
  return rows;
}

// Input and output row (head_dim elements) of the row-th (operand, batch row, head) of a token.
template <class T>
struct Row {
  const T* in;
  T* out;
};

// Row indices use 32-bit arithmetic (a 64-bit division is a long subroutine on GPUs): the op
// boundary guarantees fewer than 2^31 tokens and rows per token.
template <class T, class Table>
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE Row<T> locate_row(const Params<T, Table>& p, int64_t table_row, int64_t seq,
                                                         uint32_t row) {
  int o = 0;
  const uint32_t first_rows = static_cast<uint32_t>(operand_rows_per_token(p, 0));
  if (row >= first_rows) {
    o = 1;
    row -= first_rows;
  }
  const Operand<T>& x = p.operands[o];
  const uint32_t heads = static_cast<uint32_t>(x.heads);
  const int64_t batch = p.table_batch == 1 ? static_cast<int64_t>(row / heads) : table_row;
  const int64_t head = row % heads;
  return {x.in + batch * x.in_stride_batch + head * x.in_stride_head + seq * x.in_stride_seq,
          x.out + batch * x.out_stride_batch + head * x.out_stride_head + seq * x.out_stride_seq};
}

// Elements (a, b) of pair i within a row.
struct PairIndex {
  int64_t a, b;
};

ROPESCALE_HOST_DEVICE ROPESCALE_INLINE PairIndex pair_elements(bool interleaved, int64_t half, int64_t i) {
  return interleaved ? PairIndex{2 * i, 2 * i + 1} : PairIndex{i, i + half};
}

// The table entries pair i reads: its own two elements in a full-width table, entry i otherwise.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE PairIndex table_entries(TableKind table, bool interleaved, int64_t half,
                                                               int64_t i) {
  return table == TableKind::kFullWidth ? pair_elements(interleaved, half, i) : PairIndex{i, i};
}

// The linear map of one pair: y_a = x_a cos_a - x_b sin_a, y_b = x_b cos_b + x_a sin_b.
template <class Acc>
struct PairCoeffs {
  Acc cos_a, sin_a, cos_b, sin_b;
};

// The transposed map: x_a = y_a cos_a + y_b sin_b, x_b = y_b cos_b - y_a sin_a. For a rotation
// (cos_a = cos_b, sin_a = sin_b) it is the rotation by -theta; in general it is what the backward
// pass of the forward map needs, whatever the tables hold.
template <class Acc>
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE PairCoeffs<Acc> conjugated(const PairCoeffs<Acc>& c) {
  return {c.cos_a, -c.sin_b, c.cos_b, -c.sin_a};
}

template <class Acc>
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE void rotate(const PairCoeffs<Acc>& c, Acc xa, Acc xb, Acc* ya, Acc* yb) {
  *ya = xa * c.cos_a - xb * c.sin_a;
  *yb = xb * c.cos_b + xa * c.sin_b;
}

// Coefficients of pair i at a position: scale * (cos, sin) of position * inv_freq, the angle
// reduced in double (rotary_sincos), so they stay accurate at positions in the millions.
template <class Acc>
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE PairCoeffs<Acc> position_coeffs(double position, float inv_freq,
                                                                       Acc scale, bool native_angles = false) {
  Acc s, c;
  if (native_angles)
    native_sincos(position, inv_freq, &s, &c);
  else
    rotary_sincos(position, inv_freq, &s, &c);
  s *= scale;
  c *= scale;
  return {c, s, c, s};
}

// Position of a token (int32 or int64 positions, any strides).
template <class T, class Table>
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE double token_position(const Params<T, Table>& p, int64_t table_row,
                                                             int64_t seq) {
  const int64_t offset = table_row * p.positions_stride_batch + seq * p.positions_stride_seq;
  return p.positions_int64 ? static_cast<double>(static_cast<const int64_t*>(p.positions)[offset])
                           : static_cast<double>(static_cast<const int32_t*>(p.positions)[offset]);
}

// The inv_freq row and scale of a token (kPositions): row table_index[token] with its own scale when
// the parameters have a table per token, else the one table and `scale`.
struct TokenTable {
  const float* inv_freq;
  double scale;
  bool native_angles;
};

template <class T, class Table>
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE TokenTable token_table(const Params<T, Table>& p, int64_t table_row,
                                                              int64_t seq) {
  if (p.table_index == nullptr) return {p.inv_freq, p.scale, false};
  const int64_t offset = table_row * p.table_index_stride_batch + seq * p.table_index_stride_seq;
  const int64_t row = p.table_index_int64 ? static_cast<const int64_t*>(p.table_index)[offset]
                                          : static_cast<int64_t>(static_cast<const int32_t*>(p.table_index)[offset]);
  return {p.inv_freq + row * p.inv_freq_stride, static_cast<double>(p.scales[row]),
          p.native_angles != nullptr && p.native_angles[row]};
}

// Coefficients of pair i of a token from a table of kind kTable, conjugated when asked. `to_acc`
// converts a table entry of type Table to a type that widens exactly to Acc (the conversion
// differs between the host types and CUDA's __half/__nv_bfloat16; a float entry goes to a double
// Acc exactly). The kind is a template parameter so that a kernel carries only its own table's
// code and, for the symmetric kinds, two values per pair instead of four.
template <TableKind kTable, class Acc, class T, class Table, class ToAcc>
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE PairCoeffs<Acc> pair_coeffs(const Params<T, Table>& p, int64_t table_row,
                                                                   int64_t seq, int64_t i, ToAcc to_acc) {
  PairCoeffs<Acc> c;
  if constexpr (kTable == TableKind::kPositions) {
    const TokenTable table = token_table(p, table_row, seq);
    c = position_coeffs<Acc>(token_position(p, table_row, seq), table.inv_freq[i], static_cast<Acc>(table.scale),
                             table.native_angles);
  } else {
    const PairIndex e = table_entries(kTable, p.interleaved, p.half(), i);
    const Table* cos_row = p.cos + table_row * p.cos_stride_batch + seq * p.cos_stride_seq;
    const Table* sin_row = p.sin + table_row * p.sin_stride_batch + seq * p.sin_stride_seq;
    c = {static_cast<Acc>(to_acc(cos_row[e.a])), static_cast<Acc>(to_acc(sin_row[e.a])),
         static_cast<Acc>(to_acc(cos_row[e.b])), static_cast<Acc>(to_acc(sin_row[e.b]))};
  }
  return p.conjugate ? conjugated(c) : c;
}

// The same, for the table kind the parameters name.
template <class Acc, class T, class Table, class ToAcc>
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE PairCoeffs<Acc> pair_coeffs(const Params<T, Table>& p, int64_t table_row,
                                                                   int64_t seq, int64_t i, ToAcc to_acc) {
  switch (p.table) {
    case TableKind::kFullWidth:
      return pair_coeffs<TableKind::kFullWidth, Acc>(p, table_row, seq, i, to_acc);
    case TableKind::kHalfWidth:
      return pair_coeffs<TableKind::kHalfWidth, Acc>(p, table_row, seq, i, to_acc);
    default:
      return pair_coeffs<TableKind::kPositions, Acc>(p, table_row, seq, i, to_acc);
  }
}

}  // namespace rotary
}  // namespace ropescale
