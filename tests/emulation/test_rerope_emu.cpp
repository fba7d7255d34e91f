// The CUDA kernels of rerope_attention (csrc/include/ropescale/rerope_attention.cuh), run on the CPU
// SIMT emulation against a double-precision reference written from the definition:
//   score(i, j) = scale * <rot(q_i * logn(p_i), r(p_i - p_j)), k_j>,
//   r(d) = d for d < w, else w (ReRoPE) or w + (d - w)/k (Leaky ReRoPE),
// masked where p_j > p_i (causal) or either position is negative (padding).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include "ropescale/rerope_attention.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using ropescale::rerope_cuda::ReropeParams;

struct Case {
  int batch, q_heads, kv_heads, q_len, k_len, dim, rotary_dim;
  int64_t window;
  double leaky_k;
  int64_t logn_length;
  bool causal, interleaved;
  int pad;  // batch row b is left-padded by pad * b keys (position -1)
  std::string name() const {
    return "B" + std::to_string(batch) + " Hq" + std::to_string(q_heads) + " Hkv" + std::to_string(kv_heads) + " Lq" +
           std::to_string(q_len) + " Lk" + std::to_string(k_len) + " D" + std::to_string(dim) + " R" +
           std::to_string(rotary_dim) + " w" + std::to_string(window) + " k" + std::to_string(leaky_k) + " logn" +
           std::to_string(logn_length) + (causal ? " causal" : " full") + (interleaved ? " interleaved" : "") +
           " pad" + std::to_string(pad);
  }
};

struct Problem {
  Case c;
  std::vector<float> q, k, v, inv_freq;  // contiguous [B, H, L, D]
  std::vector<int64_t> q_pos, k_pos;
};

Problem make_problem(const Case& c, unsigned seed) {
  Problem p{c, {}, {}, {}, {}, {}, {}};
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  p.q.resize(static_cast<size_t>(c.batch) * c.q_heads * c.q_len * c.dim);
  p.k.resize(static_cast<size_t>(c.batch) * c.kv_heads * c.k_len * c.dim);
  p.v.resize(p.k.size());
  for (auto* t : {&p.q, &p.k, &p.v})
    for (float& x : *t) x = normal(gen);
  for (int i = 0; i < c.rotary_dim / 2; ++i)
    p.inv_freq.push_back(static_cast<float>(std::pow(10000.0, -2.0 * i / c.rotary_dim)));
  // Keys at 0..Lk-1 (after left padding); queries are the last Lq keys' positions.
  for (int b = 0; b < c.batch; ++b) {
    const int n_pad = std::min(c.pad * b, c.k_len);
    for (int j = 0; j < c.k_len; ++j) p.k_pos.push_back(j < n_pad ? -1 : j - n_pad);
    for (int i = 0; i < c.q_len; ++i) p.q_pos.push_back(p.k_pos[static_cast<size_t>(b) * c.k_len + c.k_len - c.q_len + i]);
  }
  return p;
}

// Double-precision reference: (out, lse) per row [B, Hq, Lq].
void reference(const Problem& pr, std::vector<double>& out, std::vector<double>& lse) {
  const Case& c = pr.c;
  const int group = c.q_heads / c.kv_heads, pairs = c.rotary_dim / 2;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  out.assign(static_cast<size_t>(c.batch) * c.q_heads * c.q_len * c.dim, 0.0);
  lse.assign(static_cast<size_t>(c.batch) * c.q_heads * c.q_len, -std::numeric_limits<double>::infinity());
  std::vector<double> scores(c.k_len), rotated(c.dim);
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.q_heads; ++h)
      for (int i = 0; i < c.q_len; ++i) {
        const int64_t pi = pr.q_pos[static_cast<size_t>(b) * c.q_len + i];
        const float* q = &pr.q[((static_cast<size_t>(b) * c.q_heads + h) * c.q_len + i) * c.dim];
        double factor = 1.0;
        if (c.logn_length > 0 && pi + 1 > c.logn_length)
          factor = std::log(static_cast<double>(pi + 1)) / std::log(static_cast<double>(c.logn_length));
        double row_max = -std::numeric_limits<double>::infinity();
        for (int j = 0; j < c.k_len; ++j) {
          const int64_t pj = pr.k_pos[static_cast<size_t>(b) * c.k_len + j];
          const bool visible = pi >= 0 && pj >= 0 && (!c.causal || pj <= pi);
          if (!visible) {
            scores[j] = -std::numeric_limits<double>::infinity();
            continue;
          }
          const int64_t dist = pi - pj;
          const double r = dist < c.window ? static_cast<double>(dist)
                                           : (c.leaky_k == 0 ? static_cast<double>(c.window)
                                                             : c.window + (dist - c.window) / c.leaky_k);
          for (int d = 0; d < c.dim; ++d) rotated[d] = q[d] * factor;
          for (int e = 0; e < pairs; ++e) {
            const int a = c.interleaved ? 2 * e : e, bb = c.interleaved ? 2 * e + 1 : e + pairs;
            const double angle = r * static_cast<double>(pr.inv_freq[e]);
            const double x1 = q[a] * factor, x2 = q[bb] * factor;
            rotated[a] = x1 * std::cos(angle) - x2 * std::sin(angle);
            rotated[bb] = x2 * std::cos(angle) + x1 * std::sin(angle);
          }
          const float* k = &pr.k[((static_cast<size_t>(b) * c.kv_heads + h / group) * c.k_len + j) * c.dim];
          double dot = 0.0;
          for (int d = 0; d < c.dim; ++d) dot += rotated[d] * k[d];
          scores[j] = dot * scale;
          row_max = std::max(row_max, scores[j]);
        }
        if (row_max == -std::numeric_limits<double>::infinity()) continue;
        double sum = 0.0;
        double* o = &out[((static_cast<size_t>(b) * c.q_heads + h) * c.q_len + i) * c.dim];
        for (int j = 0; j < c.k_len; ++j) {
          if (scores[j] == -std::numeric_limits<double>::infinity()) continue;
          const double w = std::exp(scores[j] - row_max);
          sum += w;
          const float* v = &pr.v[((static_cast<size_t>(b) * c.kv_heads + h / group) * c.k_len + j) * c.dim];
          for (int d = 0; d < c.dim; ++d) o[d] += w * v[d];
        }
        for (int d = 0; d < c.dim; ++d) o[d] /= sum;
        lse[(static_cast<size_t>(b) * c.q_heads + h) * c.q_len + i] = row_max + std::log(sum);
      }
}

float to_float_host(float x) { return x; }
float to_float_host(__half x) { return __half2float(x); }
float to_float_host(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
T from_float_host(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  if constexpr (std::is_same_v<T, __half>) return __float2half(x);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16(x);
}

enum class Plan { kPrefill, kDecode };

template <typename T>
void run_kernels(Problem pr, Plan plan, int splits, double atol) {
  const Case& c = pr.c;
  // Inputs in T; the reference sees exactly the rounded values.
  std::vector<T> q(pr.q.size()), k(pr.k.size()), v(pr.v.size());
  for (size_t i = 0; i < q.size(); ++i) pr.q[i] = to_float_host(q[i] = from_float_host<T>(pr.q[i]));
  for (size_t i = 0; i < k.size(); ++i) pr.k[i] = to_float_host(k[i] = from_float_host<T>(pr.k[i]));
  for (size_t i = 0; i < v.size(); ++i) pr.v[i] = to_float_host(v[i] = from_float_host<T>(pr.v[i]));
  std::vector<double> ref_out, ref_lse;
  reference(pr, ref_out, ref_lse);

  const size_t rows = static_cast<size_t>(c.batch) * c.q_heads * c.q_len;
  std::vector<T> out(rows * c.dim, from_float_host<T>(-7.0f));
  std::vector<float> lse(rows, -7.0f);
  std::vector<float> k_near(static_cast<size_t>(c.batch) * c.kv_heads * c.k_len * c.dim, NAN);
  std::vector<float> k_far(k_near.size(), NAN);
  std::vector<float> partial_out(static_cast<size_t>(splits) * rows * c.dim, NAN), partial_lse(splits * rows, NAN);

  ReropeParams p;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.q_stride_l = c.dim, p.q_stride_h = static_cast<int64_t>(c.q_len) * c.dim, p.q_stride_b = p.q_stride_h * c.q_heads;
  p.k_stride_l = c.dim, p.k_stride_h = static_cast<int64_t>(c.k_len) * c.dim, p.k_stride_b = p.k_stride_h * c.kv_heads;
  p.v_stride_l = p.k_stride_l, p.v_stride_h = p.k_stride_h, p.v_stride_b = p.k_stride_b;
  p.q_positions = pr.q_pos.data();
  p.k_positions = pr.k_pos.data();
  p.inv_freq = pr.inv_freq.data();
  p.k_near = k_near.data();
  p.k_far = c.leaky_k != 0 ? k_far.data() : nullptr;
  p.out = out.data();
  p.lse = lse.data();
  p.partial_out = partial_out.data();
  p.partial_lse = partial_lse.data();
  p.batch = c.batch, p.q_heads = c.q_heads, p.kv_heads = c.kv_heads, p.q_len = c.q_len, p.k_len = c.k_len;
  p.head_dim = c.dim, p.rotary_pairs = c.rotary_dim / 2;
  p.window = c.window, p.logn_length = c.logn_length;
  p.leaky_inv = c.leaky_k == 0 ? 0.0 : 1.0 / c.leaky_k;
  p.inv_log_train = c.logn_length > 0 ? 1.0 / std::log(static_cast<double>(c.logn_length)) : 0.0;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.dim)));
  p.causal = c.causal, p.interleaved = c.interleaved;

  const auto launch = [&]<int kMaxDim>() {
    if (plan == Plan::kPrefill)
      ropescale::rerope_cuda::launch_rerope_prefill<T, kMaxDim>(p, nullptr);
    else
      ropescale::rerope_cuda::launch_rerope_decode<T, kMaxDim>(p, splits, nullptr);
  };
  if (c.dim <= 64)
    launch.template operator()<64>();
  else if (c.dim <= 128)
    launch.template operator()<128>();
  else
    launch.template operator()<256>();

  INFO(c.name() << (plan == Plan::kPrefill ? " prefill" : " decode") << " splits " << splits);
  for (size_t r = 0; r < rows; ++r) {
    INFO("row " << r << " lse " << lse[r] << " ref " << ref_lse[r]);
    if (std::isinf(ref_lse[r])) {
      REQUIRE((std::isinf(lse[r]) && lse[r] < 0));
    } else {
      REQUIRE(std::abs(lse[r] - ref_lse[r]) <= 2e-5 * (1 + std::abs(ref_lse[r])));
    }
    for (int d = 0; d < c.dim; ++d) {
      const double got = to_float_host(out[r * c.dim + d]), want = ref_out[r * c.dim + d];
      INFO("dim " << d << " got " << got << " want " << want);
      REQUIRE(std::abs(got - want) <= atol + atol * std::abs(want));
    }
  }
}

}  // namespace

// Odd sizes, GQA 1/2/4/8, windows 1/7/64/past the sequence, ReRoPE and Leaky, log-n, padding,
// causal and not, partial rotary and interleaved pairs, three head-dim buckets.
const std::vector<Case> kCases = {
    {2, 4, 2, 37, 37, 10, 10, 7, 0.0, 0, true, false, 5},       // two query blocks, three key tiles
    {1, 2, 1, 21, 50, 10, 10, 7, 16.0, 20, true, false, 0},     // Leaky + log-n
    {1, 8, 1, 9, 70, 16, 16, 1, 0.0, 0, false, false, 0},       // GQA 8, non-causal
    {1, 8, 1, 7, 70, 16, 16, 40, 64.0, 30, true, true, 0},      // band tiles, interleaved
    {2, 2, 2, 13, 66, 24, 8, 1000, 0.0, 0, true, false, 9},     // partial rotary, window past the end
    {1, 4, 1, 3, 101, 64, 64, 9, 16.0, 50, true, false, 0},     // decode-like, GQA 4
    {2, 2, 1, 1, 100, 130, 130, 20, 0.0, 60, true, false, 30},  // D bucket 256, padding
    {1, 2, 1, 5, 41, 256, 128, 5, 16.0, 0, false, true, 0},     // D = 256
};

TEST_CASE("prefill kernel matches the double reference", "[rerope][prefill]") {
  unsigned seed = 1;
  for (const Case& c : kCases) run_kernels<float>(make_problem(c, seed++), Plan::kPrefill, 1, 2e-5);
}

TEST_CASE("decode kernel matches the double reference, with and without key splits", "[rerope][decode]") {
  unsigned seed = 100;
  for (const Case& c : kCases) {
    // Splits where decoding uses them (few queries), and once with full query blocks.
    const int splits = c.q_len <= 3 || &c == &kCases.front() ? 3 : 1;
    run_kernels<float>(make_problem(c, seed++), Plan::kDecode, splits, 2e-5);
  }
}

TEST_CASE("half and bfloat16 inputs accumulate in float", "[rerope][lowp]") {
  const Case c{2, 4, 2, 11, 50, 32, 32, 7, 16.0, 0, true, false, 4};
  // Output rounding only: the reference sees the rounded inputs.
  run_kernels<__half>(make_problem(c, 7), Plan::kPrefill, 1, 2e-3);
  run_kernels<__nv_bfloat16>(make_problem(c, 8), Plan::kDecode, 2, 1e-2);
}

TEST_CASE("rows without a visible key give zeros and -inf", "[rerope][edge]") {
  // Non-causal with every key padded for batch row 1; causal queries before every key.
  Case c{2, 2, 1, 5, 9, 8, 8, 3, 0.0, 0, false, false, 9};
  run_kernels<float>(make_problem(c, 3), Plan::kPrefill, 1, 1e-5);
  run_kernels<float>(make_problem(c, 4), Plan::kDecode, 2, 1e-5);
}

TEST_CASE("race check: one small launch of each kernel", "[tsan]") {
  const Case c{1, 4, 2, 9, 70, 8, 8, 5, 16.0, 10, true, false, 0};
  run_kernels<float>(make_problem(c, 9), Plan::kPrefill, 1, 2e-5);
  run_kernels<float>(make_problem(c, 10), Plan::kDecode, 3, 2e-5);
}
