// The rotary CUDA kernel (csrc/include/ropescale/rotary_kernels.cuh), its exact code, run on the CPU
// through the SIMT emulation and compared with a float64 reference written here from the
// definition (DESIGN.md "Rotation"): y = x * cos + rotate(x) * sin on the first rotary_dim
// features, the rest copied (or untouched in place). Small odd shapes, every dtype, both layouts,
// every table kind (positions with one table for every token, or a table per token: an engine's batch
// of requests of different scales), q alone and q+k with different head (and batch) counts, strided and
// misaligned rows (the one-pair-per-thread path), and grids split over rows (few tokens); tables of
// the operands' type and float tables with half, bfloat16 and double operands. Every output is
// the float64 value of the given entries rounded ONCE to the operands' type, within what fp32 (fp64)
// arithmetic adds: a kernel that rounded a float table to the operands' type first fails.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include "ropescale/rotary_kernels.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using ropescale::from_acc;  // the kernel's element conversions, on the host
using ropescale::to_acc;
using ropescale::rotary::launch_rotary;
using ropescale::rotary::launch_shape;
using ropescale::rotary::Params;
using ropescale::rotary::TableKind;

// Half a unit in the last place of `value` in T (the error of rounding an exact value once).
template <class T>
double half_ulp(double value) {
  if constexpr (std::is_same_v<T, double>) {
    return 0.0;  // the math is double itself: all of the error is in `arithmetic` below
  } else {
    constexpr int kMantissa = std::is_same_v<T, __half> ? 10 : (std::is_same_v<T, __nv_bfloat16> ? 7 : 23);
    constexpr int kMinExponent = std::is_same_v<T, __half> ? -14 : -126;  // below it: subnormal spacing
    const double magnitude = std::fabs(value);
    const int exponent = magnitude > 0.0 ? std::max(std::ilogb(magnitude), kMinExponent) : kMinExponent;
    return std::ldexp(1.0, exponent - kMantissa - 1);
  }
}

// What one output element may differ from the exact value of the given entries: its rounding to T
// once, plus what the compute type's arithmetic costs on `terms`: fp32 for every type but double.
// `terms` is the sum of the absolute products |x_a cos| + |x_b sin| for tables; with positions, whose
// fp32 sin/cos of the reduced angle are off by a few float ulps of the scale, scale * (|x_a| + |x_b|).
template <class T>
double tolerance(double expected, double terms, bool positions) {
  const double arithmetic = std::is_same_v<T, double> ? std::ldexp(1.0, -50) : std::ldexp(1.0, positions ? -21 : -22);
  return half_ulp<T>(expected) + arithmetic * terms + 1e-300;
}

// Element layouts of a [batch, heads, seq, head_dim] operand inside a larger buffer.
enum class Layout {
  kContiguous,  // [B, H, S, D]
  kTransposed,  // transformers' [B, H, S, D] view of a [B, S, H, D] tensor
  kPadded,      // rows one element apart and a base one element off: no 16-byte access possible
};

template <class T>
struct Buffer {
  std::vector<T> data;
  int64_t offset = 0, batch = 0, heads = 0, seq = 0, dim = 0;
  int64_t stride_b = 0, stride_h = 0, stride_s = 0;

  Buffer(int64_t b, int64_t h, int64_t s, int64_t d, Layout layout) : batch(b), heads(h), seq(s), dim(d) {
    switch (layout) {
      case Layout::kContiguous:
        stride_s = d, stride_h = s * d, stride_b = h * s * d;
        break;
      case Layout::kTransposed:
        stride_h = d, stride_s = h * d, stride_b = s * h * d;
        break;
      case Layout::kPadded:
        offset = 1, stride_s = d + 1, stride_h = s * (d + 1), stride_b = h * s * (d + 1) + 3;
        break;
    }
    data.resize(offset + b * stride_b + 16);
  }
  int64_t index(int64_t b, int64_t h, int64_t s, int64_t e) const {
    return offset + b * stride_b + h * stride_h + s * stride_s + e;
  }
  T* base() { return data.data() + offset; }
};

// A tiny independent reference: the four table entries of feature e of a token, in double.
struct Reference {
  TableKind table;
  bool interleaved;
  int64_t rotary_dim, width, table_batch, seq;
  std::vector<double> cos, sin;        // [table_batch, seq, width] (tables)
  std::vector<int64_t> positions;      // [table_batch, seq]
  std::vector<float> inv_freq;         // [tables, rotary_dim / 2]
  double scale = 1.0;
  std::vector<int64_t> table_rows;     // per token: its row of inv_freq and of scales (empty: row 0, scale)
  std::vector<float> scales;
  std::vector<char> native_angles;     // per row: angles formed as a native table (a float32 product)

  // cos and sin multiplying feature e (< rotary_dim) of a token: x*cos + rotate(x)*sin.
  void entry(int64_t tb, int64_t s, int64_t e, double* c, double* sn) const {
    const int64_t half = rotary_dim / 2;
    const int64_t pair = interleaved ? e / 2 : e % half;
    if (table == TableKind::kPositions) {
      const int64_t row = table_rows.empty() ? 0 : table_rows[tb * seq + s];
      const double factor = table_rows.empty() ? scale : static_cast<double>(scales[row]);
      const bool native = !native_angles.empty() && native_angles[row];
      const double angle =
          native ? static_cast<double>(static_cast<float>(positions[tb * seq + s]) * inv_freq[row * half + pair])
                 : static_cast<double>(positions[tb * seq + s]) * static_cast<double>(inv_freq[row * half + pair]);
      *c = factor * std::cos(angle);
      *sn = factor * std::sin(angle);
      return;
    }
    const int64_t col = table == TableKind::kFullWidth ? e : pair;
    *c = cos[(tb * seq + s) * width + col];
    *sn = sin[(tb * seq + s) * width + col];
  }
  // rotate(x)[e]: half-split cat(-x2, x1); interleaved (-x1, x0, -x3, x2, ...).
  double rotated(const std::vector<double>& row, int64_t e) const {
    const int64_t half = rotary_dim / 2;
    if (interleaved) return e % 2 == 0 ? -row[e + 1] : row[e - 1];
    return e < half ? -row[e + half] : row[e - half];
  }
};

struct Case {
  TableKind table = TableKind::kFullWidth;
  bool interleaved = false;
  bool with_k = false;
  bool shared_table = false;  // table batch 1 (q and k batch sizes then differ)
  bool in_place = false;
  bool conjugate = false;
  Layout layout = Layout::kContiguous;
  int64_t seq = 3, head_dim = 16, rotary_dim = 16;
  int64_t min_blocks = 1;
  bool positions_int64 = true;
  bool per_token_tables = false;  // kPositions: each token's row of three tables (int32 indices, or int64)
};

std::string describe(const Case& c) {
  return "table=" + std::to_string(static_cast<int>(c.table)) + " interleaved=" + std::to_string(c.interleaved) +
         " with_k=" + std::to_string(c.with_k) + " shared_table=" + std::to_string(c.shared_table) +
         " in_place=" + std::to_string(c.in_place) + " conjugate=" + std::to_string(c.conjugate) +
         " layout=" + std::to_string(static_cast<int>(c.layout)) + " seq=" + std::to_string(c.seq) +
         " head_dim=" + std::to_string(c.head_dim) + " rotary_dim=" + std::to_string(c.rotary_dim) +
         " min_blocks=" + std::to_string(c.min_blocks) + " per_token_tables=" + std::to_string(c.per_token_tables);
}

// Runs one case through the emulated kernel; checks every output element against the reference,
// that the tail is copied (or untouched in place), and that nothing outside the operands changed.
// Table: the element type of the cos/sin tables (T, or float).
template <class T, class Table = T>
void run_case(const Case& c, std::mt19937& rng) {
  INFO(describe(c) << " float_tables=" << (!std::is_same_v<Table, T>));
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  const int64_t batch_q = 2, heads_q = 3, heads_k = 2;
  const int64_t batch_k = c.shared_table ? 1 : batch_q;
  const int64_t table_batch = c.shared_table ? 1 : batch_q;
  const int64_t S = c.seq, D = c.head_dim, R = c.rotary_dim;

  Reference ref;
  ref.table = c.table;
  ref.interleaved = c.interleaved;
  ref.rotary_dim = R;
  ref.width = c.table == TableKind::kFullWidth ? R : R / 2;
  ref.table_batch = table_batch;
  ref.seq = S;
  std::vector<Table> cos_table, sin_table;
  std::vector<int32_t> positions32, rows32;
  std::vector<uint8_t> native_flags;
  std::vector<int64_t> positions64;
  if (c.table == TableKind::kPositions) {
    for (int64_t i = 0; i < table_batch * S; ++i) ref.positions.push_back(static_cast<int64_t>(rng() % 5000));
    const int64_t tables = c.per_token_tables ? 3 : 1;
    for (int64_t t = 0; t < tables; ++t)  // the default table, then tables of 1/2 and 1/5 of its frequencies
      for (int64_t i = 0; i < R / 2; ++i)
        ref.inv_freq.push_back(static_cast<float>(std::pow(1e4, -2.0 * i / R) / (t == 0 ? 1.0 : 3.0 * t - 1.0)));
    ref.scale = 1.25;
    if (c.per_token_tables) {
      ref.scales = {1.0f, 1.0693f, 1.25f};  // the largest scale bounds the tolerance's terms below
      ref.native_angles = {1, 0, 0};  // row 0: an engine's native table
      for (int64_t i = 0; i < table_batch * S; ++i) {
        ref.table_rows.push_back(static_cast<int64_t>(rng() % tables));
        rows32.push_back(static_cast<int32_t>(ref.table_rows.back()));
      }
    }
    for (int64_t p : ref.positions) {
      positions32.push_back(static_cast<int32_t>(p));
      positions64.push_back(p);
    }
  } else {
    // Arbitrary tables (not cos/sin of anything): the kernel must apply exactly the entries given.
    for (int64_t i = 0; i < table_batch * S * ref.width; ++i) {
      cos_table.push_back(from_acc<Table>(uniform(rng)));
      sin_table.push_back(from_acc<Table>(uniform(rng)));
      ref.cos.push_back(to_acc(cos_table.back()));
      ref.sin.push_back(to_acc(sin_table.back()));
    }
  }

  const int num_operands = c.with_k ? 2 : 1;
  const int64_t batches[2] = {batch_q, batch_k}, heads[2] = {heads_q, heads_k};
  std::vector<Buffer<T>> inputs, outputs;
  for (int o = 0; o < num_operands; ++o) {
    inputs.emplace_back(batches[o], heads[o], S, D, c.layout);
    outputs.emplace_back(batches[o], heads[o], S, D, Layout::kContiguous);
    for (T& v : inputs.back().data) v = from_acc<T>(normal(rng));
    for (T& v : outputs.back().data) v = from_acc<T>(-7.0);  // sentinel
  }
  const std::vector<Buffer<T>> originals = inputs;

  Params<T, Table> p;
  p.num_operands = num_operands;
  for (int o = 0; o < num_operands; ++o) {
    Buffer<T>& in = inputs[o];
    Buffer<T>& out = c.in_place ? inputs[o] : outputs[o];
    p.operands[o] = {in.base(), out.base(), in.batch, in.heads, in.stride_b, in.stride_h, in.stride_s,
                     out.stride_b, out.stride_h, out.stride_s};
  }
  p.seq_len = S;
  p.head_dim = D;
  p.rotary_dim = R;
  p.table_batch = table_batch;
  p.table = c.table;
  if (c.table == TableKind::kPositions) {
    p.positions = c.positions_int64 ? static_cast<const void*>(positions64.data()) : positions32.data();
    p.positions_int64 = c.positions_int64;
    p.positions_stride_batch = S;
    p.positions_stride_seq = 1;
    p.inv_freq = ref.inv_freq.data();
    p.scale = ref.scale;
    if (c.per_token_tables) {
      p.table_index = c.positions_int64 ? static_cast<const void*>(ref.table_rows.data()) : rows32.data();
      p.table_index_int64 = c.positions_int64;
      p.table_index_stride_batch = S;
      p.table_index_stride_seq = 1;
      p.inv_freq_stride = R / 2;
      p.scales = ref.scales.data();
      native_flags.assign(ref.native_angles.begin(), ref.native_angles.end());
      p.native_angles = reinterpret_cast<const bool*>(native_flags.data());
      p.scale = -99.0;  // must not be read
    }
  } else {
    p.cos = cos_table.data();
    p.sin = sin_table.data();
    p.cos_stride_batch = p.sin_stride_batch = S * ref.width;
    p.cos_stride_seq = p.sin_stride_seq = ref.width;
  }
  p.interleaved = c.interleaved;
  p.conjugate = c.conjugate;
  p.copy_tail = !c.in_place && R < D;

  launch_rotary(p, c.min_blocks, nullptr);

  double worst = 0.0;
  for (int o = 0; o < num_operands; ++o) {
    const Buffer<T>& in = originals[o];
    const Buffer<T>& out = c.in_place ? inputs[o] : outputs[o];
    for (int64_t b = 0; b < in.batch; ++b)
      for (int64_t h = 0; h < in.heads; ++h)
        for (int64_t s = 0; s < S; ++s) {
          const int64_t tb = table_batch == 1 ? 0 : b;
          std::vector<double> x(R), expected(R), terms(R);
          for (int64_t e = 0; e < R; ++e) x[e] = to_acc(in.data[in.index(b, h, s, e)]);
          for (int64_t e = 0; e < R; ++e) {
            double cs, sn;
            ref.entry(tb, s, e, &cs, &sn);
            const int64_t partner = c.interleaved ? (e ^ 1) : (e < R / 2 ? e + R / 2 : e - R / 2);
            if (!c.conjugate) {
              expected[e] = x[e] * cs + ref.rotated(x, e) * sn;
              terms[e] = std::fabs(x[e] * cs) + std::fabs(ref.rotated(x, e) * sn);
            } else {
              // The transpose of the forward map M (y = M x): (M^T x)[e] = sum_f M[f][e] x[f]. Row f
              // of M has cos_f at f and sin_f at f's partner with rotate's sign.
              double cp, sp;
              ref.entry(tb, s, partner, &cp, &sp);
              // rotate(x)[partner] = sign * x[e], sign = -1 when partner is the first of its pair.
              const bool partner_first = c.interleaved ? partner % 2 == 0 : partner < R / 2;
              expected[e] = x[e] * cs + (partner_first ? -sp : sp) * x[partner];
              terms[e] = std::fabs(x[e] * cs) + std::fabs(sp * x[partner]);
            }
            if (c.table == TableKind::kPositions) terms[e] = ref.scale * (std::fabs(x[e]) + std::fabs(x[partner]));
          }
          for (int64_t e = 0; e < R; ++e) {
            const double got = to_acc(out.data[out.index(b, h, s, e)]);
            const double err = std::fabs(got - expected[e]);
            // A native row's sin/cos are float32 whatever T (an engine's native table is), of unreduced angles of
            // thousands of radians: a few float ulps, not the reduced path's one.
            const bool native_row = !ref.table_rows.empty() && ref.native_angles[ref.table_rows[tb * S + s]];
            const double tol = native_row ? half_ulp<T>(expected[e]) + 8 * tolerance<float>(expected[e], terms[e], true)
                                          : tolerance<T>(expected[e], terms[e], c.table == TableKind::kPositions);
            worst = std::max(worst, err / tol);
            if (err > tol) {
              FAIL_CHECK("operand " << o << " [" << b << "," << h << "," << s << "," << e << "]: error " << err << " > tol " << tol << ", got " << got
                                    << ", expected " << expected[e]);
              return;
            }
          }
          for (int64_t e = R; e < D; ++e)  // tail: copied bit for bit, or untouched in place
            REQUIRE(to_acc(out.data[out.index(b, h, s, e)]) == to_acc(in.data[in.index(b, h, s, e)]));
        }
    // Nothing outside the operand's elements was written (padding, gaps, sentinels).
    std::vector<bool> owned(out.data.size(), false);
    for (int64_t b = 0; b < in.batch; ++b)
      for (int64_t h = 0; h < in.heads; ++h)
        for (int64_t s = 0; s < S; ++s)
          for (int64_t e = 0; e < D; ++e) owned[out.index(b, h, s, e)] = true;
    const std::vector<T>& untouched = c.in_place ? originals[o].data : std::vector<T>(out.data.size(), from_acc<T>(-7.0));
    for (size_t i = 0; i < owned.size(); ++i)
      if (!owned[i]) REQUIRE(to_acc(out.data[i]) == to_acc(untouched[i]));
  }
  CHECK(worst <= 1.0);
}

// Every table kind (only the two table kinds with float tables for other operands: the position
// kind reads none), layout, stride and operand mix.
template <class T, class Table = T>
void run_grid(bool quick) {
  std::mt19937 rng(1234);
  std::vector<TableKind> tables = {TableKind::kFullWidth, TableKind::kHalfWidth};
  if constexpr (std::is_same_v<Table, T>) tables.push_back(TableKind::kPositions);
  for (TableKind table : tables)
    for (bool interleaved : {false, true})
      for (Layout layout : {Layout::kContiguous, Layout::kTransposed, Layout::kPadded})
        for (bool with_k : {false, true}) {
          Case c;
          c.table = table;
          c.interleaved = interleaved;
          c.layout = layout;
          c.with_k = with_k;
          c.shared_table = with_k && layout == Layout::kTransposed;
          c.in_place = layout == Layout::kPadded;
          c.conjugate = with_k && !interleaved;
          c.positions_int64 = layout != Layout::kContiguous;
          // Partial rotary on the padded layout; odd seq lengths; few tokens split over rows.
          c.seq = layout == Layout::kContiguous ? 17 : (layout == Layout::kTransposed ? 3 : 1);
          c.rotary_dim = layout == Layout::kPadded ? 8 : 16;
          c.head_dim = layout == Layout::kContiguous ? 16 : 24;
          c.min_blocks = c.seq == 1 ? 64 : 1;
          run_case<T, Table>(c, rng);
          if (table == TableKind::kPositions && !c.conjugate) {  // the same with a table per token
            c.per_token_tables = true;
            run_case<T, Table>(c, rng);
          }
          if (quick) break;
        }
}

}  // namespace

TEST_CASE("rotary kernel, float32: every table kind, layout, stride and operand mix", "[rotary][float]") {
  run_grid<float>(false);
}

TEST_CASE("rotary kernel, float64", "[rotary][double]") { run_grid<double>(false); }

TEST_CASE("rotary kernel, float16 (fp32 math)", "[rotary][half]") { run_grid<__half>(false); }

TEST_CASE("rotary kernel, bfloat16 (fp32 math)", "[rotary][bfloat16]") { run_grid<__nv_bfloat16>(false); }

// Float tables with other operands (what autocast gives: fp32 cos/sin, fp16/bf16 q and k), read as
// they are and rounded once with the result.
TEST_CASE("rotary kernel, float16 operands with float32 tables", "[rotary][half][float_tables]") {
  run_grid<__half, float>(false);
}

TEST_CASE("rotary kernel, bfloat16 operands with float32 tables", "[rotary][bfloat16][float_tables]") {
  run_grid<__nv_bfloat16, float>(false);
}

TEST_CASE("rotary kernel, float64 operands with float32 tables", "[rotary][double][float_tables]") {
  run_grid<double, float>(false);
}

// The bound above is tight enough to see the difference: tables rounded to bfloat16 before the
// rotation (what a caller that casts fp32 tables to q's dtype gets) miss it on the same inputs.
TEST_CASE("rotary kernel: a bfloat16 rounding of float32 tables is outside the rounded-once bound",
          "[rotary][float_tables]") {
  std::mt19937 rng(99);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  const int64_t S = 64, D = 64, half = D / 2;
  std::vector<float> cos_f(S * half), sin_f(S * half);
  std::vector<__nv_bfloat16> cos_b(S * half), sin_b(S * half), x(S * D), out_f(S * D), out_b(S * D);
  for (int64_t i = 0; i < S * half; ++i) {
    cos_f[i] = static_cast<float>(uniform(rng));
    sin_f[i] = static_cast<float>(uniform(rng));
    cos_b[i] = __float2bfloat16_rn(cos_f[i]);
    sin_b[i] = __float2bfloat16_rn(sin_f[i]);
  }
  for (auto& v : x) v = __float2bfloat16_rn(static_cast<float>(normal(rng)));
  const auto params = [&](auto* cos, auto* sin, __nv_bfloat16* out) {
    Params<__nv_bfloat16, std::remove_const_t<std::remove_pointer_t<decltype(cos)>>> p;
    p.operands[0] = {x.data(), out, 1, 1, S * D, S * D, D, S * D, S * D, D};
    p.seq_len = S;
    p.head_dim = p.rotary_dim = D;
    p.table = TableKind::kHalfWidth;
    p.cos = cos;
    p.sin = sin;
    p.cos_stride_batch = p.sin_stride_batch = S * half;
    p.cos_stride_seq = p.sin_stride_seq = half;
    return p;
  };
  launch_rotary(params(cos_f.data(), sin_f.data(), out_f.data()), 1, nullptr);
  launch_rotary(params(cos_b.data(), sin_b.data(), out_b.data()), 1, nullptr);
  double worst_f = 0.0, worst_b = 0.0;  // in units of the bound
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < half; ++i) {
      const double c = cos_f[s * half + i], sn = sin_f[s * half + i];
      const double xa = to_acc(x[s * D + i]), xb = to_acc(x[s * D + half + i]);
      const double ya = xa * c - xb * sn, yb = xb * c + xa * sn;
      const double ta = std::fabs(xa * c) + std::fabs(xb * sn), tb = std::fabs(xb * c) + std::fabs(xa * sn);
      const auto ratio = [&](const std::vector<__nv_bfloat16>& out, int64_t e, double y, double t) {
        return std::fabs(to_acc(out[s * D + e]) - y) / tolerance<__nv_bfloat16>(y, t, false);
      };
      worst_f = std::max({worst_f, ratio(out_f, i, ya, ta), ratio(out_f, half + i, yb, tb)});
      worst_b = std::max({worst_b, ratio(out_b, i, ya, ta), ratio(out_b, half + i, yb, tb)});
    }
  CHECK(worst_f <= 1.0);
  CHECK(worst_b > 1.0);
}

TEST_CASE("rotary kernel: head_dim 40 leaves a partial vector per row; rotary_dim 2", "[rotary][edges]") {
  std::mt19937 rng(7);
  for (bool interleaved : {false, true}) {
    Case c;
    c.interleaved = interleaved;
    c.head_dim = 40;  // 20 pairs: not a multiple of 8 (bf16 vector) -> one pair per thread
    c.rotary_dim = 40;
    c.seq = 5;
    c.with_k = true;
    run_case<__nv_bfloat16>(c, rng);
    run_case<float>(c, rng);  // 20 pairs: a multiple of 4 -> vector path
    c.rotary_dim = 2;
    c.table = TableKind::kPositions;
    run_case<float>(c, rng);
  }
}

TEST_CASE("rotary launch shape: many tokens use one block row, few tokens split rows over blocks",
          "[rotary][launch]") {
  Params<float> p;
  p.num_operands = 2;
  p.operands[0].batch = p.operands[1].batch = 1;
  p.operands[0].heads = 32;
  p.operands[1].heads = 8;
  p.head_dim = p.rotary_dim = 128;
  p.table_batch = 1;
  static std::vector<float> storage(64);  // any 16-byte aligned base with zero strides
  for (auto& x : p.operands) x.in = x.out = storage.data();

  p.seq_len = 4096;
  auto many = launch_shape(p, /*min_blocks=*/132 * 16);
  CHECK(many.pairs_per_thread == 4);                     // 16-byte fp32 accesses
  CHECK(many.block.x == 16);                             // 64 pairs / 4
  CHECK(many.block.x * many.block.y == 128);
  CHECK(many.grid.x == 4096 / many.block.y);
  CHECK(many.grid.x * many.grid.y >= 132 * 16 / 2);

  p.seq_len = 1;  // decode: one token, 40 rows
  auto one = launch_shape(p, 132 * 16);
  CHECK(one.grid.x == 1);
  CHECK(one.grid.y == 40);  // every row its own block
  CHECK(one.block.y == 1);

  p.seq_len = 20000;
  auto lots = launch_shape(p, 132 * 16);
  CHECK(lots.grid.y == 1);  // enough tokens: sin/cos computed once per token
}
