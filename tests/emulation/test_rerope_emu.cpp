// The CUDA kernels of rerope_attention (csrc/include/ropescale/rerope_attention.cuh, and the
// tensor-core prefill of rerope_attention_tc.cuh), run on the CPU SIMT emulation against a
// double-precision reference written from the definition:
//   score(i, j) = scale * <rot(q_i * logn(p_i), r(p_i - p_j)), k_j>,
//   r(d) = d for d < w, else w (ReRoPE) or w + (d - w)/k (Leaky ReRoPE); Self-Extend and Dual Chunk
//   Attention by their own definitions (DESIGN.md; reference_relative_position below),
// masked where p_j > p_i (causal) or either position is negative (padding). Masked keys never
// contribute, whatever they hold; visible ones follow IEEE arithmetic (a NaN or inf propagates), and
// a row without a visible key is zeros with lse -inf (decided by the mask).
// ROPESCALE_EMU_RACE_CHECKS_ONLY (the ThreadSanitizer build, which runs the [tsan] cases alone): every other case is
// left out, and with it most of this file's compile time (the grid's instantiations).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include "ropescale/rerope_attention.cuh"
#include "ropescale/rerope_attention_tc.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

// The kernels' element conversions, on the host.
using ropescale::from_acc;
using ropescale::round_to;
using ropescale::to_acc;
using ropescale::rerope_cuda::ReropeParams;

struct Case {
  int batch, q_heads, kv_heads, q_len, k_len, dim, rotary_dim;
  int64_t window;
  double leaky_k;
  int64_t logn_length;
  bool causal, interleaved;
  int pad;  // batch row b is left-padded by pad * b keys (position -1)
  int64_t group = 0, chunk_size = 0;  // Self-Extend's G / Dual Chunk's C (window: its local_size): with_region
  int64_t far_start = -1;  // STRING's W (leaky_k 1, window its S): with_string
  ropescale::RegionRule rule() const {
    return ropescale::make_region_rule(window, leaky_k, group, chunk_size, far_start);
  }
  std::string name() const {
    return "B" + std::to_string(batch) + " Hq" + std::to_string(q_heads) + " Hkv" + std::to_string(kv_heads) + " Lq" +
           std::to_string(q_len) + " Lk" + std::to_string(k_len) + " D" + std::to_string(dim) + " R" +
           std::to_string(rotary_dim) + " w" + std::to_string(window) + " k" + std::to_string(leaky_k) + " logn" +
           std::to_string(logn_length) + (causal ? " causal" : " full") + (interleaved ? " interleaved" : "") +
           " pad" + std::to_string(pad) + " G" + std::to_string(group) + " C" + std::to_string(chunk_size) +
           " far" + std::to_string(far_start);
  }
};

// The case as Self-Extend (group > 0) or Dual Chunk Attention (chunk_size > 0, its window the local size).
template <class C>
C with_region(C c, int64_t group, int64_t chunk_size) {
  c.group = group;
  c.chunk_size = chunk_size;
  return c;
}

// The case as STRING with shifted offset S = its window and local value W: ReRoPE's far side, slope 1, from W.
template <class C>
C with_string(C c, int64_t local_value) {
  c.leaky_k = 1.0;
  c.far_start = local_value;
  return c;
}

// The relative position of a visible pair, from each method's definition (not from RegionRule's two
// sides): ReRoPE / Leaky ReRoPE, Self-Extend's floored groups, Dual Chunk's three regions, STRING's shift.
template <class C>
double reference_relative_position(const C& c, int64_t pi, int64_t pj) {
  const int64_t dist = pi - pj, w = c.window;
  if (c.chunk_size > 0) {
    const int64_t n = c.chunk_size - w, cq = pi / n, ck = pj / n, oq = pi % n, ok = pj % n;
    if (cq == ck) return static_cast<double>(oq - ok);
    if (cq - ck == 1) return static_cast<double>(std::min(n + oq, c.chunk_size) - ok);
    return static_cast<double>(std::min(2 * n - 1, c.chunk_size) - ok);
  }
  if (dist < w) return static_cast<double>(dist);
  if (c.group > 0) return static_cast<double>(pi / c.group - pj / c.group + w - w / c.group);
  if (c.far_start >= 0) return static_cast<double>(dist - w + c.far_start);  // STRING: d - S + W
  return c.leaky_k == 0 ? static_cast<double>(w) : w + (dist - w) / c.leaky_k;
}

struct Problem {
  Case c;
  std::vector<float> q, k, v, inv_freq;  // contiguous [B, H, L, D]
  std::vector<int64_t> q_pos, k_pos;
  double scale_factor = 1.0;  // multiplies the softmax scale 1/sqrt(D) (the paged op's scale_factors)
  // The launch's key turn rates (a workspace the launchers fill; garbage until then).
  mutable std::vector<ropescale::KeyRate> key_rates{};
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
  // Keys at 0..Lk-1 (after left padding); queries are the last Lq keys' positions. Where Lq > Lk the
  // first Lq - Lk queries have no key to share a position with: they are padding (-1).
  for (int b = 0; b < c.batch; ++b) {
    const int n_pad = std::min(c.pad * b, c.k_len);
    for (int j = 0; j < c.k_len; ++j) p.k_pos.push_back(j < n_pad ? -1 : j - n_pad);
    for (int i = 0; i < c.q_len; ++i) {
      const int key = c.k_len - c.q_len + i;
      p.q_pos.push_back(key < 0 ? -1 : p.k_pos[static_cast<size_t>(b) * c.k_len + key]);
    }
  }
  return p;
}

// Double-precision reference: (out, lse) per row [B, Hq, Lq].
void reference(const Problem& pr, std::vector<double>& out, std::vector<double>& lse) {
  const Case& c = pr.c;
  const int group = c.q_heads / c.kv_heads, pairs = c.rotary_dim / 2;
  const double scale = pr.scale_factor / std::sqrt(static_cast<double>(c.dim));
  out.assign(static_cast<size_t>(c.batch) * c.q_heads * c.q_len * c.dim, 0.0);
  lse.assign(static_cast<size_t>(c.batch) * c.q_heads * c.q_len, -std::numeric_limits<double>::infinity());
  std::vector<double> scores(c.k_len), rotated(c.dim);
  std::vector<char> visible(c.k_len);
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.q_heads; ++h)
      for (int i = 0; i < c.q_len; ++i) {
        const int64_t pi = pr.q_pos[static_cast<size_t>(b) * c.q_len + i];
        const float* q = &pr.q[((static_cast<size_t>(b) * c.q_heads + h) * c.q_len + i) * c.dim];
        double factor = 1.0;
        if (c.logn_length > 0 && pi + 1 > c.logn_length)
          factor = std::log(static_cast<double>(pi + 1)) / std::log(static_cast<double>(c.logn_length));
        double row_max = -std::numeric_limits<double>::infinity();
        bool any_visible = false;
        for (int j = 0; j < c.k_len; ++j) {
          const int64_t pj = pr.k_pos[static_cast<size_t>(b) * c.k_len + j];
          visible[j] = pi >= 0 && pj >= 0 && (!c.causal || pj <= pi);
          any_visible |= visible[j] != 0;
          if (!visible[j]) continue;
          const double r = reference_relative_position(c, pi, pj);
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
          row_max = std::max(row_max, scores[j]);  // (skips NaN: it reaches the row through exp)
        }
        if (!any_visible) continue;
        double sum = 0.0;
        double* o = &out[((static_cast<size_t>(b) * c.q_heads + h) * c.q_len + i) * c.dim];
        for (int j = 0; j < c.k_len; ++j) {
          if (!visible[j]) continue;
          const double w = std::exp(scores[j] - row_max);
          sum += w;
          const float* v = &pr.v[((static_cast<size_t>(b) * c.kv_heads + h / group) * c.k_len + j) * c.dim];
          for (int d = 0; d < c.dim; ++d) o[d] += w * v[d];
        }
        for (int d = 0; d < c.dim; ++d) o[d] /= sum;
        lse[(static_cast<size_t>(b) * c.q_heads + h) * c.q_len + i] = row_max + std::log(sum);
      }
}

enum class Plan { kPrefill, kDecode };

// The SIMT launch of a plan with the tile shape the emulated device's shared memory allows (as the
// CUDA glue picks it from sharedMemPerBlockOptin): wide tiles on sm_80/90, compact ones for head dims
// above 128 on the 99 KiB parts. Returns whether the tiles were compact.
template <typename T>
bool launch_simt(const ReropeParams& p, Plan plan, int splits) {
  bool compact = false;
  const std::size_t missing = ropescale::rerope_cuda::with_simt_shape(
      p.head_dim, static_cast<std::size_t>(ropescale_emu::shared_memory_per_block_optin()), [&]<class Shape>() {
        compact = Shape::kCompact;
        if (plan == Plan::kPrefill)
          ropescale::rerope_cuda::launch_rerope_prefill<T, Shape>(p, nullptr);
        else
          ropescale::rerope_cuda::launch_rerope_decode<T, Shape>(p, splits, nullptr);
      });
  REQUIRE(missing == 0);
  return compact;
}

ReropeParams make_params(const Case& c, const Problem& pr) {
  ReropeParams p;
  p.q_stride_l = c.dim, p.q_stride_h = static_cast<int64_t>(c.q_len) * c.dim, p.q_stride_b = p.q_stride_h * c.q_heads;
  p.k_stride_l = c.dim, p.k_stride_h = static_cast<int64_t>(c.k_len) * c.dim, p.k_stride_b = p.k_stride_h * c.kv_heads;
  p.v_stride_l = p.k_stride_l, p.v_stride_h = p.k_stride_h, p.v_stride_b = p.k_stride_b;
  p.q_positions = pr.q_pos.data();
  p.k_positions = pr.k_pos.data();
  p.inv_freq = pr.inv_freq.data();
  pr.key_rates.assign(static_cast<size_t>(c.rotary_dim / 2), ropescale::KeyRate{0x5a5a5a5a5a5a5a5aull, 7ull});
  p.key_rates = pr.key_rates.data();
  p.batch = c.batch, p.q_heads = c.q_heads, p.kv_heads = c.kv_heads, p.q_len = c.q_len, p.k_len = c.k_len;
  p.head_dim = c.dim, p.rotary_pairs = c.rotary_dim / 2;
  p.rule = c.rule(), p.logn_length = c.logn_length;
  p.inv_log_train = c.logn_length > 0 ? 1.0 / std::log(static_cast<double>(c.logn_length)) : 0.0;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.dim)));
  p.causal = c.causal, p.interleaved = c.interleaved;
  return p;
}

// ---- the tensor-core prefill (fp16 / bf16) ------------------------------------------------------
//
// Its tolerance is relative to what the ordinary low-precision computation loses: the same ReRoPE
// attention done "the SDPA way" in T, as a user would with two FlashAttention / SDPA calls on
// operands rotated in float64 and rounded to T: scores accumulated in f32 from the rounded q and k,
// softmax in f32, probabilities rounded to T before P.V (f32 accumulation), the output rounded to T.
// The kernel may be at most twice as far from the float64 reference as that computation is, on the
// same inputs (FlashAttention's own test criterion).

// Rotation of `src` (dims [0, D)) at `position` in float64 (pairs per the case), rounded to T.
template <typename T>
void rotate_rounded(const Case& c, const std::vector<float>& inv_freq, const float* src, double position, double factor,
                    float* dst) {
  const int pairs = c.rotary_dim / 2;
  for (int d = 0; d < c.dim; ++d) dst[d] = round_to<T>(src[d] * factor);
  for (int e = 0; e < pairs; ++e) {
    const int a = c.interleaved ? 2 * e : e, b = c.interleaved ? 2 * e + 1 : e + pairs;
    const double angle = position * static_cast<double>(inv_freq[e]);
    const double x1 = src[a] * factor, x2 = src[b] * factor;
    dst[a] = round_to<T>(x1 * std::cos(angle) - x2 * std::sin(angle));
    dst[b] = round_to<T>(x2 * std::cos(angle) + x1 * std::sin(angle));
  }
}

template <typename T>
void sdpa_way(const Problem& pr, std::vector<float>& out, std::vector<float>& lse) {
  const Case& c = pr.c;
  const int group = c.q_heads / c.kv_heads, D = c.dim;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))) * static_cast<float>(pr.scale_factor);
  const ropescale::RegionRule rule = c.rule();
  // Keys rotated once per side, rounded to T.
  std::vector<float> k_near(pr.k.size()), k_far(pr.k.size());
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.kv_heads; ++h)
      for (int j = 0; j < c.k_len; ++j) {
        const size_t at = ((static_cast<size_t>(b) * c.kv_heads + h) * c.k_len + j) * D;
        const int64_t pj = pr.k_pos[static_cast<size_t>(b) * c.k_len + j];
        rotate_rounded<T>(c, pr.inv_freq, &pr.k[at], static_cast<double>(pj), 1.0, &k_near[at]);
        rotate_rounded<T>(c, pr.inv_freq, &pr.k[at], rule.far_key_position(pj), 1.0, &k_far[at]);
      }
  out.assign(static_cast<size_t>(c.batch) * c.q_heads * c.q_len * D, 0.0f);
  lse.assign(static_cast<size_t>(c.batch) * c.q_heads * c.q_len, -INFINITY);
  std::vector<float> q_near(D), q_far(D), scores(c.k_len);
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.q_heads; ++h)
      for (int i = 0; i < c.q_len; ++i) {
        const size_t row = (static_cast<size_t>(b) * c.q_heads + h) * c.q_len + i;
        const int64_t pi = pr.q_pos[static_cast<size_t>(b) * c.q_len + i];
        double factor = 1.0;
        if (c.logn_length > 0 && pi + 1 > c.logn_length)
          factor = std::log(static_cast<double>(pi + 1)) / std::log(static_cast<double>(c.logn_length));
        rotate_rounded<T>(c, pr.inv_freq, &pr.q[row * D], static_cast<double>(pi), factor, q_near.data());
        rotate_rounded<T>(c, pr.inv_freq, &pr.q[row * D], rule.far_query_position(pi), factor, q_far.data());
        float row_max = -INFINITY;
        for (int j = 0; j < c.k_len; ++j) {
          const int64_t pj = pr.k_pos[static_cast<size_t>(b) * c.k_len + j];
          if (!(pi >= 0 && pj >= 0 && (!c.causal || pj <= pi))) {
            scores[j] = -INFINITY;
            continue;
          }
          const bool near = rule.is_near(pi, pj);
          const float* qq = near ? q_near.data() : q_far.data();
          const float* kk = &(near ? k_near : k_far)[((static_cast<size_t>(b) * c.kv_heads + h / group) * c.k_len + j) * D];
          float dot = 0.0f;
          for (int d = 0; d < D; ++d) dot = std::fma(qq[d], kk[d], dot);
          scores[j] = dot * scale;
          row_max = std::max(row_max, scores[j]);
        }
        if (row_max == -INFINITY) continue;
        float sum = 0.0f;
        std::vector<float> acc(D, 0.0f);
        for (int j = 0; j < c.k_len; ++j) {
          if (scores[j] == -INFINITY) continue;
          const float prob = std::exp(scores[j] - row_max);
          sum += prob;
          const float rounded = round_to<T>(prob);
          const float* vv = &pr.v[((static_cast<size_t>(b) * c.kv_heads + h / group) * c.k_len + j) * D];
          for (int d = 0; d < D; ++d) acc[d] = std::fma(rounded, vv[d], acc[d]);
        }
        for (int d = 0; d < D; ++d) out[row * D + d] = round_to<T>(acc[d] / sum);
        lse[row] = row_max + std::log(sum);
      }
}

// Checks the kernel's (out, lse) against the float64 reference: rows with no visible key exactly
// zeros and -inf; otherwise the largest error at most twice that of the SDPA way in T.
template <typename T>
void check_within_sdpa_error(const Problem& pr, const std::vector<double>& ref_out, const std::vector<double>& ref_lse,
                             const std::vector<T>& out, const std::vector<float>& lse, const char* kernel) {
  const Case& c = pr.c;
  std::vector<float> low_out, low_lse;
  sdpa_way<T>(pr, low_out, low_lse);
  const size_t rows = lse.size();
  // Largest errors against float64: the low-precision SDPA way, and the kernel.
  double low_out_err = 0, low_lse_err = 0, out_err = 0, lse_err = 0;
  size_t worst_out = 0, worst_lse = 0;
  for (size_t r = 0; r < rows; ++r) {
    INFO(c.name() << " " << kernel << " row " << r << " lse " << lse[r] << " ref " << ref_lse[r]);
    if (std::isinf(ref_lse[r])) {  // nothing visible: exactly zeros and -inf
      REQUIRE((std::isinf(lse[r]) && lse[r] < 0));
      for (int d = 0; d < c.dim; ++d) REQUIRE(to_acc(out[r * c.dim + d]) == 0.0f);
      continue;
    }
    REQUIRE(std::isfinite(lse[r]));
    low_lse_err = std::max(low_lse_err, std::abs(low_lse[r] - ref_lse[r]));
    if (std::abs(lse[r] - ref_lse[r]) > lse_err) lse_err = std::abs(lse[r] - ref_lse[r]), worst_lse = r;
    for (int d = 0; d < c.dim; ++d) {
      const size_t i = r * c.dim + d;
      REQUIRE(std::isfinite(to_acc(out[i])));
      low_out_err = std::max(low_out_err, std::abs(low_out[i] - ref_out[i]));
      if (std::abs(to_acc(out[i]) - ref_out[i]) > out_err)
        out_err = std::abs(to_acc(out[i]) - ref_out[i]), worst_out = i;
    }
  }
  INFO(c.name() << (std::is_same_v<T, __half> ? " fp16" : " bf16") << ": kernel error out " << out_err << " (at "
                << worst_out << ", got " << to_acc(out[worst_out]) << " want " << ref_out[worst_out]
                << "), lse " << lse_err << " (row " << worst_lse << "); SDPA-way error out " << low_out_err << ", lse "
                << low_lse_err);
  if (std::getenv("ROPESCALE_EMU_PRINT"))  // the margins, for whoever tunes the grid
    std::printf("%s %s %s: out error %.3g (SDPA way %.3g), lse error %.3g (SDPA way %.3g)\n", kernel,
                c.name().c_str(), std::is_same_v<T, __half> ? "fp16" : "bf16", out_err, low_out_err, lse_err,
                low_lse_err);
  CHECK(out_err <= 2 * low_out_err + 1e-6);
  CHECK(lse_err <= 2 * low_lse_err + 1e-6);
}

// The problem's inputs in T, and the float64 reference on exactly those rounded values.
template <typename T>
void round_inputs_and_reference(Problem& pr, std::vector<T>& q, std::vector<T>& k, std::vector<T>& v,
                                std::vector<double>& ref_out, std::vector<double>& ref_lse) {
  auto round = [](std::vector<float>& values, std::vector<T>& rounded) {
    rounded.resize(values.size());
    for (size_t i = 0; i < values.size(); ++i) values[i] = to_acc(rounded[i] = from_acc<T>(values[i]));
  };
  round(pr.q, q);
  round(pr.k, k);
  round(pr.v, v);
  reference(pr, ref_out, ref_lse);
}

template <typename T>
void run_kernels(Problem pr, Plan plan, int splits, double atol) {
  const Case& c = pr.c;
  std::vector<T> q, k, v;
  std::vector<double> ref_out, ref_lse;
  round_inputs_and_reference(pr, q, k, v, ref_out, ref_lse);

  const size_t rows = static_cast<size_t>(c.batch) * c.q_heads * c.q_len;
  std::vector<T> out(rows * c.dim, from_acc<T>(-7.0f));
  std::vector<float> lse(rows, -7.0f);
  std::vector<float> k_near(static_cast<size_t>(c.batch) * c.kv_heads * c.k_len * c.dim, NAN);
  std::vector<float> k_far(k_near.size(), NAN);
  std::vector<float> partial_out(static_cast<size_t>(splits) * rows * c.dim, NAN), partial_lse(splits * rows, NAN);

  ReropeParams p = make_params(c, pr);
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.k_near = k_near.data();
  p.k_far = c.rule().far_key_rotated() ? k_far.data() : nullptr;
  p.out = out.data();
  p.lse = lse.data();
  p.partial_out = partial_out.data();
  p.partial_lse = partial_lse.data();

  launch_simt<T>(p, plan, splits);

  INFO(c.name() << (plan == Plan::kPrefill ? " prefill" : " decode") << " splits " << splits);
  if constexpr (!std::is_same_v<T, float>) {  // fp16/bf16: rounded like SDPA, judged against its error
    check_within_sdpa_error<T>(pr, ref_out, ref_lse, out, lse, plan == Plan::kPrefill ? "SIMT prefill" : "decode");
    (void)atol;
    return;
  }
  for (size_t r = 0; r < rows; ++r) {
    INFO("row " << r << " lse " << lse[r] << " ref " << ref_lse[r]);
    if (std::isinf(ref_lse[r])) {
      REQUIRE((std::isinf(lse[r]) && lse[r] < 0));
    } else {
      REQUIRE(std::abs(lse[r] - ref_lse[r]) <= 2e-5 * (1 + std::abs(ref_lse[r])));
    }
    for (int d = 0; d < c.dim; ++d) {
      const double got = to_acc(out[r * c.dim + d]), want = ref_out[r * c.dim + d];
      INFO("dim " << d << " got " << got << " want " << want);
      REQUIRE(std::abs(got - want) <= atol + atol * std::abs(want));
    }
  }
}

template <typename T>
void launch_tc(const ReropeParams& p, ropescale::rerope_cuda::KeyTile* tiles) {
  using namespace ropescale::rerope_cuda;
  switch (p.head_dim) {
    case 64: launch_rerope_prefill_tc<T, 64>(p, tiles, nullptr, IgnoreLaunchStatus{}); break;
    case 80: launch_rerope_prefill_tc<T, 80>(p, tiles, nullptr, IgnoreLaunchStatus{}); break;
    case 96: launch_rerope_prefill_tc<T, 96>(p, tiles, nullptr, IgnoreLaunchStatus{}); break;
    case 128: launch_rerope_prefill_tc<T, 128>(p, tiles, nullptr, IgnoreLaunchStatus{}); break;
    default: FAIL("no tensor-core kernel for head dim " << p.head_dim);
  }
}

template <typename T>
void run_tensor_core(Problem pr) {
  const Case& c = pr.c;
  std::vector<T> q, k, v;
  std::vector<double> ref_out, ref_lse;
  round_inputs_and_reference(pr, q, k, v, ref_out, ref_lse);

  const size_t rows = static_cast<size_t>(c.batch) * c.q_heads * c.q_len;
  std::vector<T> out(rows * c.dim, from_acc<T>(-7.0f));
  std::vector<float> lse(rows, -7.0f);
  // Workspaces start as NaN: whatever the kernels read before writing shows.
  std::vector<T> k_near(k.size(), from_acc<T>(NAN)), k_far(k.size(), from_acc<T>(NAN));
  std::vector<ropescale::rerope_cuda::KeyTile> tiles(
      static_cast<size_t>(c.batch) * ropescale::rerope_cuda::rerope_tc_key_tiles(c.k_len),
      ropescale::rerope_cuda::KeyTile{-5, -5, -5, -5});
  ReropeParams p = make_params(c, pr);
  p.q = q.data(), p.k = k.data(), p.v = v.data();
  p.k_near = k_near.data();
  p.k_far = c.rule().far_key_rotated() ? k_far.data() : nullptr;
  std::vector<float> q_rotation(ropescale::rerope_cuda::rerope_tc_query_rotation_floats(p), NAN);
  p.q_rotation = q_rotation.data();
  p.out = out.data(), p.lse = lse.data();
  launch_tc<T>(p, tiles.data());

  check_within_sdpa_error<T>(pr, ref_out, ref_lse, out, lse, "tensor-core prefill");
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

#ifndef ROPESCALE_EMU_RACE_CHECKS_ONLY
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

TEST_CASE("half and bfloat16 inputs on the SIMT kernels: within twice the SDPA-way error", "[rerope][lowp]") {
  // Rounded where the tensor-core prefill rounds (rotated q/k, probabilities): the same precision at
  // every size. D 32 and 256 are SIMT-only head dims; decode is SIMT at every head dim.
  const Case c{2, 4, 2, 11, 50, 32, 32, 7, 16.0, 0, true, false, 4};
  run_kernels<__half>(make_problem(c, 7), Plan::kPrefill, 1, 0.0);
  run_kernels<__nv_bfloat16>(make_problem(c, 8), Plan::kDecode, 2, 0.0);
  const Case wide{1, 2, 1, 3, 70, 256, 256, 9, 0.0, 20, true, false, 0};
  run_kernels<__nv_bfloat16>(make_problem(wide, 9), Plan::kPrefill, 1, 0.0);
  run_kernels<__half>(make_problem(wide, 10), Plan::kDecode, 3, 0.0);
  const Case tc_dim{1, 4, 1, 1, 90, 128, 128, 20, 16.0, 0, true, false, 0};
  run_kernels<__nv_bfloat16>(make_problem(tc_dim, 11), Plan::kDecode, 2, 0.0);
}

TEST_CASE("rows without a visible key give zeros and -inf", "[rerope][edge]") {
  // Non-causal with every key padded for batch row 1; causal queries before every key.
  Case c{2, 2, 1, 5, 9, 8, 8, 3, 0.0, 0, false, false, 9};
  run_kernels<float>(make_problem(c, 3), Plan::kPrefill, 1, 1e-5);
  run_kernels<float>(make_problem(c, 4), Plan::kDecode, 2, 1e-5);
}
#endif

TEST_CASE("race check: one small launch of each kernel", "[tsan]") {
  const Case c{1, 4, 2, 9, 70, 8, 8, 5, 16.0, 10, true, false, 0};
  run_kernels<float>(make_problem(c, 9), Plan::kPrefill, 1, 2e-5);
  run_kernels<float>(make_problem(c, 10), Plan::kDecode, 3, 2e-5);
  // The compact tiles of the 99 KiB parts: one key tile, a band tile's two sides in turn.
  const ropescale_emu::ScopedTarget ampere(ropescale_emu::Target::kSm86);
  const Case wide{1, 2, 1, 9, 70, 160, 160, 5, 16.0, 0, true, false, 0};
  run_kernels<float>(make_problem(wide, 11), Plan::kPrefill, 1, 2e-5);
  run_kernels<float>(make_problem(wide, 12), Plan::kDecode, 2, 2e-5);
}

// The same features as kCases (odd sizes, GQA, windows 1 / inside / past the sequence, ReRoPE and
// Leaky, log-n, padding, causal and not, partial rotary, interleaved pairs) at the tensor-core head
// dims, with several 64-query blocks and 64-key tiles: near, far, band and skipped tiles, tiles
// skipped by some warps only, partial last tiles and blocks.
const std::vector<Case> kTensorCoreCases = {
    {2, 4, 2, 100, 100, 64, 64, 7, 0.0, 0, true, false, 5},       // two query blocks, band + far + skipped tiles
    {1, 2, 1, 70, 150, 80, 80, 40, 16.0, 100, true, false, 0},    // Leaky + log-n, D 80, Lq < Lk
    {1, 8, 2, 65, 130, 96, 96, 1, 0.0, 0, false, false, 0},       // GQA 4, non-causal, window 1, D 96
    {1, 4, 1, 80, 200, 128, 128, 70, 64.0, 0, true, true, 0},     // band across tiles, interleaved, D 128
    {2, 2, 2, 33, 90, 64, 32, 1000, 0.0, 0, true, false, 9},      // partial rotary, window past the end
    {1, 2, 1, 130, 130, 128, 128, 5, 0.0, 60, true, false, 0},    // three query blocks, log-n
    {2, 2, 1, 20, 70, 96, 64, 20, 16.0, 0, false, true, 30},      // non-causal padding, partial interleaved
};

#ifndef ROPESCALE_EMU_RACE_CHECKS_ONLY
TEST_CASE("tensor-core prefill matches the double reference within twice the SDPA-way error",
          "[rerope][tensor_core]") {
  // bf16 and fp16 alternate (emulated tensor-core launches are slow), so that each head dim runs in
  // both; D 80 has one case, which runs twice.
  unsigned seed = 200;
  for (size_t i = 0; i < kTensorCoreCases.size(); ++i) {
    const Case& c = kTensorCoreCases[i];
    if (i % 2 == 0 || c.dim == 80) run_tensor_core<__nv_bfloat16>(make_problem(c, seed++));
    if (i % 2 == 1 || c.dim == 80) run_tensor_core<__half>(make_problem(c, seed++));
  }
}

TEST_CASE("tensor-core prefill: rows without a visible key give zeros and -inf", "[rerope][tensor_core][edge]") {
  // Non-causal with every key padded for batch row 1; causal queries before every key.
  run_tensor_core<__nv_bfloat16>(make_problem(Case{2, 2, 1, 17, 9, 64, 64, 3, 0.0, 0, false, false, 9}, 5));
  run_tensor_core<__half>(make_problem(Case{2, 2, 1, 17, 9, 64, 64, 3, 0.0, 0, true, false, 9}, 6));
}
#endif

TEST_CASE("race check: one small tensor-core launch, blocks shuffled", "[tsan]") {
  const ropescale_emu::ScopedBlockOrder shuffled(ropescale_emu::BlockOrder::kShuffled, 3);
  run_tensor_core<__nv_bfloat16>(make_problem(Case{1, 2, 1, 70, 70, 64, 64, 7, 16.0, 0, true, false, 0}, 11));
}

// ---- shared memory: the 99 KiB parts (sm_86, sm_89, sm_120) ---------------------------------------

#ifndef ROPESCALE_EMU_RACE_CHECKS_ONLY
TEST_CASE("SIMT kernels on a 99 KiB part: compact tiles above head dim 128 match the double reference",
          "[rerope][smem]") {
  const ropescale_emu::ScopedTarget ampere(ropescale_emu::Target::kSm86);
  // The wide 256 tiles do not fit such a device: a launch of them is refused, as the driver would.
  using Wide = ropescale::rerope_cuda::TileShape<256>;
  REQUIRE(Wide::kSmemBytes > static_cast<std::size_t>(ropescale_emu::shared_memory_per_block_optin()));
  {
    Problem pr = make_problem(kCases[6], 40);
    std::vector<float> q(pr.q), k(pr.k), v(pr.v), k_near(pr.k.size()), out(pr.q.size() / pr.c.dim * pr.c.dim), lse(pr.q.size() / pr.c.dim);
    ReropeParams p = make_params(pr.c, pr);
    p.q = q.data(), p.k = k.data(), p.v = v.data(), p.k_near = k_near.data(), p.out = out.data(), p.lse = lse.data();
    CHECK_THROWS_WITH((ropescale::rerope_cuda::launch_rerope_prefill<float, Wide>(p, nullptr)),
                      Catch::Contains("without the kernel's opt-in"));
  }
  // Every case of the grid whose head dim is above 128 (the others use the same tiles on every part).
  unsigned seed = 300;
  for (const Case& c : kCases) {
    if (c.dim <= 128) continue;
    run_kernels<float>(make_problem(c, seed++), Plan::kPrefill, 1, 2e-5);
    run_kernels<float>(make_problem(c, seed++), Plan::kDecode, 3, 2e-5);
  }
  const Case wide{1, 2, 1, 3, 70, 256, 256, 9, 0.0, 20, true, false, 0};
  run_kernels<__nv_bfloat16>(make_problem(wide, seed++), Plan::kPrefill, 1, 0.0);
  run_kernels<__half>(make_problem(wide, seed++), Plan::kDecode, 2, 0.0);
  // The tensor-core prefill fits there at every head dim it takes (69,632 B at D 128).
  REQUIRE(ropescale::rerope_cuda::rerope_tc_smem_bytes(128) <=
          static_cast<std::size_t>(ropescale_emu::shared_memory_per_block_optin()));
  run_tensor_core<__nv_bfloat16>(make_problem(kTensorCoreCases[3], seed++));
}
#endif

// ---- non-finite values: masked keys never contribute, visible ones propagate ----------------------

enum class Kernel { kSimtPrefill, kSimtDecode, kTensorCore };

// Rounds the problem's inputs to T (in place) and runs one kernel on them: (out as float, lse).
template <typename T>
void run_on(Problem& pr, Kernel kernel, int splits, std::vector<float>& out_f, std::vector<float>& lse) {
  const Case& c = pr.c;
  const auto rounded = [](std::vector<float>& values) {
    std::vector<T> r(values.size());
    for (size_t i = 0; i < values.size(); ++i) values[i] = to_acc(r[i] = from_acc<T>(values[i]));
    return r;
  };
  std::vector<T> q = rounded(pr.q), k = rounded(pr.k), v = rounded(pr.v);
  const size_t rows = static_cast<size_t>(c.batch) * c.q_heads * c.q_len;
  std::vector<T> out(rows * c.dim, from_acc<T>(-7.0f));
  lse.assign(rows, -7.0f);
  ReropeParams p = make_params(c, pr);
  p.q = q.data(), p.k = k.data(), p.v = v.data(), p.out = out.data(), p.lse = lse.data();
  if (kernel == Kernel::kTensorCore) {
    if constexpr (!std::is_same_v<T, float>) {
      std::vector<T> k_near(k.size()), k_far(k.size());
      std::vector<ropescale::rerope_cuda::KeyTile> tiles(static_cast<size_t>(c.batch) *
                                                         ropescale::rerope_cuda::rerope_tc_key_tiles(c.k_len));
      p.k_near = k_near.data();
      p.k_far = c.rule().far_key_rotated() ? k_far.data() : nullptr;
      std::vector<float> q_rotation(ropescale::rerope_cuda::rerope_tc_query_rotation_floats(p));
      p.q_rotation = q_rotation.data();
      launch_tc<T>(p, tiles.data());
    }
  } else {
    std::vector<float> k_near(k.size()), k_far(k.size());
    std::vector<float> partial_out(static_cast<size_t>(splits) * rows * c.dim), partial_lse(splits * rows);
    p.k_near = k_near.data();
    p.k_far = c.rule().far_key_rotated() ? k_far.data() : nullptr;
    p.partial_out = partial_out.data(), p.partial_lse = partial_lse.data();
    launch_simt<T>(p, kernel == Kernel::kSimtPrefill ? Plan::kPrefill : Plan::kDecode, splits);
  }
  out_f.resize(out.size());
  for (size_t i = 0; i < out.size(); ++i) out_f[i] = to_acc(out[i]);
}

// Plants non-finite values: padding keys (masked for every query) get NaN V and inf K; key `mid`,
// visible to the later queries only (causal), inf in one V dim; one visible query row a NaN; the
// last key of the last batch row a NaN K dim; a padding query row (if any) NaN everywhere. Rows that
// see none of them are untouched.
void plant_nonfinite(Problem& pr) {
  const Case& c = pr.c;
  const size_t D = c.dim;
  const auto key_row = [&](std::vector<float>& t, int b, int h, int j) {
    return &t[((static_cast<size_t>(b) * c.kv_heads + h) * c.k_len + j) * D];
  };
  for (int b = 0; b < c.batch; ++b)
    for (int j = 0; j < c.k_len; ++j)
      if (pr.k_pos[static_cast<size_t>(b) * c.k_len + j] < 0)
        for (int h = 0; h < c.kv_heads; ++h)
          for (size_t d = 0; d < D; ++d) key_row(pr.v, b, h, j)[d] = NAN, key_row(pr.k, b, h, j)[d] = INFINITY;
  const int mid = c.k_len - 1 - c.q_len / 2;
  key_row(pr.v, 0, 0, mid)[D / 2] = INFINITY;
  pr.q[(static_cast<size_t>(c.q_heads - 1) * c.q_len + c.q_len / 3) * D + 1] = NAN;  // batch 0, last head
  key_row(pr.k, c.batch - 1, c.kv_heads - 1, c.k_len - 1)[0] = NAN;
  for (int b = 0; b < c.batch; ++b)
    for (int i = 0; i < c.q_len; ++i)
      if (pr.q_pos[static_cast<size_t>(b) * c.q_len + i] < 0)
        for (int h = 0; h < c.q_heads; ++h)
          for (size_t d = 0; d < D; ++d) pr.q[((static_cast<size_t>(b) * c.q_heads + h) * c.q_len + i) * D + d] = NAN;
}

// The kernel on planted non-finite values against the float64 reference on the same inputs: the same
// pattern of non-finite outputs and lse (rows and columns), and where the reference is finite, the
// kernel's result on the clean inputs (up to a rounding of T where the tensor-core path took the
// pair-by-pair P.V).
template <typename T>
void check_nonfinite_semantics(const Case& c, unsigned seed, Kernel kernel, int splits) {
  Problem clean = make_problem(c, seed), poisoned = clean;
  plant_nonfinite(poisoned);
  std::vector<float> clean_out, clean_lse, out, lse;
  run_on<T>(clean, kernel, splits, clean_out, clean_lse);
  run_on<T>(poisoned, kernel, splits, out, lse);
  std::vector<double> ref_out, ref_lse;
  reference(poisoned, ref_out, ref_lse);
  const double tol = std::is_same_v<T, float> ? 1e-6 : std::is_same_v<T, __half> ? 1e-3 : 8e-3;
  size_t finite_rows = 0, nonfinite_rows = 0, partial_rows = 0;
  for (size_t r = 0; r < lse.size(); ++r) {
    INFO(c.name() << " kernel " << static_cast<int>(kernel) << " row " << r << " lse " << lse[r] << " ref "
                  << ref_lse[r] << " clean " << clean_lse[r]);
    REQUIRE(std::isfinite(lse[r]) == std::isfinite(ref_lse[r]));
    if (std::isinf(ref_lse[r]) && ref_lse[r] < 0) REQUIRE((std::isinf(lse[r]) && lse[r] < 0));  // nothing visible
    if (std::isfinite(ref_lse[r])) CHECK(std::abs(lse[r] - clean_lse[r]) <= tol * (1 + std::abs(clean_lse[r])));
    size_t nonfinite = 0;
    for (int d = 0; d < c.dim; ++d) {
      const size_t i = r * c.dim + d;
      INFO("dim " << d << " got " << out[i] << " ref " << ref_out[i] << " clean " << clean_out[i]);
      REQUIRE(std::isfinite(out[i]) == std::isfinite(ref_out[i]));
      nonfinite += !std::isfinite(out[i]);
      if (std::isfinite(ref_out[i])) CHECK(std::abs(out[i] - clean_out[i]) <= tol * (1 + std::abs(clean_out[i])));
    }
    (nonfinite == 0 ? finite_rows : nonfinite == static_cast<size_t>(c.dim) ? nonfinite_rows : partial_rows) += 1;
  }
  // The planted values reached both kinds of rows, and one column alone somewhere.
  CHECK(finite_rows > 0);
  CHECK(nonfinite_rows > 0);
  CHECK(partial_rows > 0);
}

#ifndef ROPESCALE_EMU_RACE_CHECKS_ONLY
TEST_CASE("SIMT kernels: masked keys never contribute, visible non-finite values propagate", "[rerope][nonfinite]") {
  // Prefill: causal with padded keys and padded queries (batch row 1), GQA 2.
  const Case prefill{2, 4, 2, 37, 37, 10, 10, 7, 0.0, 0, true, false, 5};
  check_nonfinite_semantics<float>(prefill, 50, Kernel::kSimtPrefill, 1);
  check_nonfinite_semantics<__nv_bfloat16>(prefill, 51, Kernel::kSimtPrefill, 1);
  // Decode against 9 keys and against 40 (split three ways): the same rule at every size.
  check_nonfinite_semantics<float>(Case{2, 4, 2, 3, 9, 16, 16, 4, 16.0, 0, true, false, 3}, 52, Kernel::kSimtDecode, 1);
  check_nonfinite_semantics<float>(Case{2, 4, 2, 3, 40, 16, 16, 4, 16.0, 0, true, false, 3}, 53, Kernel::kSimtDecode, 3);
  check_nonfinite_semantics<__half>(Case{2, 4, 2, 3, 40, 16, 16, 4, 0.0, 0, true, false, 3}, 54, Kernel::kSimtDecode, 3);
  // The compact tiles (99 KiB parts), head dim 256: one key tile, a band tile's sides in turn.
  const ropescale_emu::ScopedTarget ampere(ropescale_emu::Target::kSm86);
  check_nonfinite_semantics<float>(Case{2, 2, 1, 20, 40, 256, 128, 5, 16.0, 0, true, false, 7}, 55,
                                   Kernel::kSimtPrefill, 1);
}

TEST_CASE("tensor-core prefill: masked keys never contribute, visible non-finite values propagate",
          "[rerope][tensor_core][nonfinite]") {
  // Causal, padded keys and padded queries (batch row 1); key `mid` in a diagonal tile, so its NaN V
  // meets masked pairs in the same mma.
  check_nonfinite_semantics<__nv_bfloat16>(Case{2, 2, 1, 70, 70, 64, 64, 7, 0.0, 0, true, false, 9}, 60,
                                           Kernel::kTensorCore, 1);
  check_nonfinite_semantics<__half>(Case{2, 2, 2, 40, 70, 80, 80, 9, 16.0, 0, true, false, 33}, 61,
                                    Kernel::kTensorCore, 1);
}
#endif

// ---- rerope_attention_paged: requests packed along T, keys and values read through a block table --
//
// Each request is checked against the dense float64 reference (and, for fp16/bf16, the SDPA-way
// error) of the same request as a dense problem: its queries at seq_len - q_len + i, keys 0 .. seq_len - 1
// gathered from its pages, its own rotation table and softmax scale. The caches live in guarded
// memory (a PROT_NONE page right after the key cache and right before the value cache: a read past
// either end of the cache faults), every slot that no request owns holds NaN (a read of one shows
// in the result), and the block-table entries past a request's pages point outside the cache.
namespace {

using ropescale::rerope_cuda::PagedRequest;
using ropescale::rerope_cuda::PagedTask;

// `bytes` of memory touching a PROT_NONE page at its end (kAtEnd) or at its start.
class GuardedBuffer {
 public:
  GuardedBuffer(size_t bytes, bool at_end) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t span = (bytes + page - 1) / page * page;
    size_ = span + 2 * page;
    base_ = static_cast<unsigned char*>(mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    REQUIRE(base_ != MAP_FAILED);
    REQUIRE(mprotect(base_, page, PROT_NONE) == 0);
    REQUIRE(mprotect(base_ + page + span, page, PROT_NONE) == 0);
    data_ = at_end ? base_ + page + span - bytes : base_ + page;
  }
  ~GuardedBuffer() { munmap(base_, size_); }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data_);
  }

 private:
  unsigned char* base_ = nullptr;
  unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

struct PagedCase {
  std::vector<std::pair<int, int>> requests;  // (q_len, seq_len)
  int q_heads, kv_heads, dim, rotary_dim, block_size;
  int64_t window;
  double leaky_k;
  int64_t logn_length;
  bool interleaved, per_request_tables;  // inv_freq row and scale factor per request
  int table_pages = 0;                   // block-table width at least (max_model_len / block_size)
  int64_t group = 0, chunk_size = 0;     // Self-Extend / Dual Chunk: with_region
  int64_t far_start = -1;  // STRING's W (leaky_k 1, window its S): with_string
  ropescale::RegionRule rule() const {
    return ropescale::make_region_rule(window, leaky_k, group, chunk_size, far_start);
  }
  std::string name() const {
    std::string s = "requests";
    for (auto [q_len, seq_len] : requests) s += " " + std::to_string(q_len) + "/" + std::to_string(seq_len);
    return s + " Hq" + std::to_string(q_heads) + " Hkv" + std::to_string(kv_heads) + " D" + std::to_string(dim) +
           " R" + std::to_string(rotary_dim) + " bs" + std::to_string(block_size) + " w" + std::to_string(window) +
           " k" + std::to_string(leaky_k) + " logn" + std::to_string(logn_length) +
           (interleaved ? " interleaved" : "") + (per_request_tables ? " per-request tables" : "") + " G" +
           std::to_string(group) + " C" + std::to_string(chunk_size) + " far" + std::to_string(far_start);
  }
};

// What makes a request's metadata bad (for the poisoned-request test).
enum class Poison { kNone, kPagePastCache, kNegativePage, kSeqPastTable, kQueriesPastSeq };

template <typename T>
struct PagedRun {
  PagedCase c;
  std::vector<Problem> dense;  // request r as a dense problem (batch 1)
  std::vector<int> qsl, seq_lens, block_table;
  std::vector<float> inv_freq, scale_factors;
  std::vector<T> q;
  int tokens = 0, num_blocks = 0, max_blocks = 0;
};

// Builds the packed problem: q [T, Hq, D]; request r's keys in pages taken from a shuffled pool (with
// spare pages), block-table entries past its pages pointing outside the cache.
template <typename T>
PagedRun<T> make_paged(const PagedCase& c, unsigned seed, std::vector<float>& key_slots, std::vector<float>& value_slots) {
  PagedRun<T> run;
  run.c = c;
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  const int R = static_cast<int>(c.requests.size()), pairs = c.rotary_dim / 2;
  run.qsl.push_back(0);
  int pages_total = 0;
  for (auto [q_len, seq_len] : c.requests) {
    run.qsl.push_back(run.qsl.back() + q_len);
    run.seq_lens.push_back(seq_len);
    const int pages = (seq_len + c.block_size - 1) / c.block_size;
    pages_total += pages;
    run.max_blocks = std::max(run.max_blocks, pages + 1);
  }
  run.max_blocks = std::max(run.max_blocks, c.table_pages);
  run.tokens = run.qsl.back();
  run.num_blocks = pages_total + 3;  // spare pages: NaN, never read
  std::vector<int> pool(run.num_blocks);
  for (int i = 0; i < run.num_blocks; ++i) pool[i] = i;
  std::shuffle(pool.begin(), pool.end(), gen);
  run.block_table.assign(static_cast<size_t>(R) * run.max_blocks, run.num_blocks + 1000);
  const size_t slot_floats = static_cast<size_t>(c.kv_heads) * c.block_size * c.dim;  // one page
  key_slots.assign(run.num_blocks * slot_floats, NAN);
  value_slots.assign(key_slots.size(), NAN);
  run.q.resize(static_cast<size_t>(run.tokens) * c.q_heads * c.dim);
  for (T& x : run.q) x = from_acc<T>(normal(gen));
  int next_page = 0;
  for (int r = 0; r < R; ++r) {
    const auto [q_len, seq_len] = c.requests[r];
    // Per-request tables: a different linear factor per request (as Dynamic NTK/YaRN give each request
    // the table of its own length) and its attention factor squared as the scale factor.
    const double factor = c.per_request_tables ? 1.0 + 0.75 * r : 1.0;
    Case dc{1, c.q_heads, c.kv_heads, q_len, seq_len, c.dim, c.rotary_dim, c.window, c.leaky_k, c.logn_length,
            true, c.interleaved, 0, c.group, c.chunk_size, c.far_start};
    Problem pr{dc, {}, {}, {}, {}, {}, {}};
    pr.scale_factor = c.per_request_tables ? 1.0 + 0.1 * r : 1.0;
    for (int i = 0; i < pairs; ++i)
      pr.inv_freq.push_back(static_cast<float>(std::pow(10000.0, -2.0 * i / c.rotary_dim) / factor));
    if (c.per_request_tables || r == 0) run.inv_freq.insert(run.inv_freq.end(), pr.inv_freq.begin(), pr.inv_freq.end());
    run.scale_factors.push_back(static_cast<float>(pr.scale_factor));
    for (int j = 0; j < seq_len; ++j) pr.k_pos.push_back(j);
    for (int i = 0; i < q_len; ++i) pr.q_pos.push_back(seq_len - q_len + i);
    // q rows of the request, [Hq, q_len, D] in the dense problem (the rounded values).
    pr.q.resize(static_cast<size_t>(c.q_heads) * q_len * c.dim);
    for (int h = 0; h < c.q_heads; ++h)
      for (int i = 0; i < q_len; ++i)
        for (int d = 0; d < c.dim; ++d)
          pr.q[(static_cast<size_t>(h) * q_len + i) * c.dim + d] =
              to_acc(run.q[(static_cast<size_t>(run.qsl[r] + i) * c.q_heads + h) * c.dim + d]);
    // Keys and values (rounded to T), into the dense problem and the request's pages.
    pr.k.resize(static_cast<size_t>(c.kv_heads) * seq_len * c.dim);
    pr.v.resize(pr.k.size());
    const int pages = (seq_len + c.block_size - 1) / c.block_size;
    for (int i = 0; i < pages; ++i) run.block_table[static_cast<size_t>(r) * run.max_blocks + i] = pool[next_page++];
    for (int h = 0; h < c.kv_heads; ++h)
      for (int j = 0; j < seq_len; ++j) {
        const int page = run.block_table[static_cast<size_t>(r) * run.max_blocks + j / c.block_size];
        const size_t slot = ((static_cast<size_t>(page) * c.kv_heads + h) * c.block_size + j % c.block_size) * c.dim;
        for (int d = 0; d < c.dim; ++d) {
          const size_t at = (static_cast<size_t>(h) * seq_len + j) * c.dim + d;
          pr.k[at] = key_slots[slot + d] = to_acc(from_acc<T>(normal(gen)));
          pr.v[at] = value_slots[slot + d] = to_acc(from_acc<T>(normal(gen)));
        }
      }
    run.dense.push_back(std::move(pr));
  }
  return run;
}

// What a paged launch decided, per request (the schedule kernel's PagedRequest): the path
// (kPagedSimt, kPagedTcPreRotated, kPagedTcRotating) and the SIMT key-split length.
struct PagedDecisions {
  std::vector<int> tensor_core, keys_per_split;
};
// Tensor-core budgets for launch_paged / run_paged: no tensor-core launch at all (fp32, or a launch the
// glue keeps on SIMT), or rerope_paged.cu's default budget; any other value >= 0 is the budget itself.
constexpr int64_t kNoTensorCores = -2, kDefaultBudget = -1;

// Runs the paged launch (schedule, SIMT attention, combine) with the tile shape the emulated device
// allows, then, with the tensor cores on (fp16/bf16, tc_key_budget >= 0), the tensor-core prefill of the
// requests the schedule gave it (pre-rotated keys within the budget, keys rotated in the kernel past it),
// as rerope_paged.cu does.
template <typename T>
PagedDecisions launch_paged(ReropeParams p, int splits, int64_t tc_key_budget = kNoTensorCores) {
  using namespace ropescale::rerope_cuda;
  PagedDecisions decisions;
  const bool tensor_cores = tc_key_budget >= 0 && !std::is_same_v<T, float>;
  const std::size_t missing = with_simt_shape(
      p.head_dim, static_cast<std::size_t>(ropescale_emu::shared_memory_per_block_optin()), [&]<class Shape>() {
        // Workspaces start as garbage: whatever the kernels read before writing shows.
        std::vector<PagedRequest> requests(p.requests, PagedRequest{-5, -5, -5, -5, -5, -5});
        std::vector<ropescale::KeyRate> key_rates(
            static_cast<size_t>(rerope_key_rate_rows(p)) * p.rotary_pairs, ropescale::KeyRate{0x5a5a5a5a5a5a5a5aull, 7ull});
        p.key_rates = key_rates.data();
        std::vector<int> offsets(p.requests + 1, -5);
        std::vector<int> page_flags(static_cast<size_t>(p.requests) * rerope_paged_page_chunks(p.max_blocks), -5);
        p.paged_page_flags = page_flags.data();
        p.num_paged_tasks = static_cast<int>(
            rerope_paged_max_tasks(p.q_len, p.requests, p.q_heads / p.kv_heads, Shape::kRows));
        std::vector<PagedTask> tasks(p.num_paged_tasks, PagedTask{-5, -5, -5, -5});
        const size_t rows = static_cast<size_t>(p.q_len) * p.q_heads;
        std::vector<float> partial_out(splits * rows * p.head_dim, NAN), partial_lse(splits * rows, NAN);
        p.paged_requests = requests.data();
        p.paged_task_offsets = offsets.data();
        p.paged_tasks = tasks.data();
        p.partial_out = partial_out.data();
        p.partial_lse = partial_lse.data();
        // The tensor-core workspaces (NaN / garbage, like the others).
        std::vector<int> tc_key_offsets(p.requests + 1, -5);
        std::vector<PagedTask> tc_tasks(rerope_paged_max_tc_tasks(p.q_len, p.requests), PagedTask{-5, -5, -5, -5});
        const size_t rotated = tensor_cores ? static_cast<size_t>(tc_key_budget) * p.kv_heads * p.head_dim : 0;
        std::vector<T> k_near(rotated, from_acc<T>(NAN)), k_far(rotated, from_acc<T>(NAN));
        std::vector<float> q_rotation(static_cast<size_t>(p.q_len) * p.rotary_pairs * 4, NAN);
        if (tensor_cores) {
          p.paged_tc = true;
          p.paged_tc_key_budget = tc_key_budget;
          p.paged_tc_key_offsets = tc_key_offsets.data();
          p.paged_tc_tasks = tc_tasks.data();
          p.num_paged_tc_tasks = static_cast<int>(tc_tasks.size());
          p.k_near = rotated > 0 ? k_near.data() : nullptr;
          p.k_far = rotated > 0 ? k_far.data() : nullptr;  // Leaky: keys at p/k; ReRoPE: the raw keys
          p.q_rotation = q_rotation.data();
        }
        // rerope_paged.cu's own launch sequence (one params for the SIMT and the tensor-core rows).
        launch_rerope_paged_with_tensor_cores<T, Shape>(p, splits, nullptr, [](int status, const char* what) {
          if (status != 0) FAIL(what << " failed");
        });
        for (const PagedRequest& r : requests) {
          decisions.tensor_core.push_back(r.tensor_core);
          decisions.keys_per_split.push_back(r.keys_per_split);
        }
      });
  REQUIRE(missing == 0);
  return decisions;
}

// The caches in T, guarded (a PROT_NONE page right after the key cache, right before the value cache).
template <typename T>
struct PagedCaches {
  GuardedBuffer keys, values;
  PagedCaches(const std::vector<float>& key_slots, const std::vector<float>& value_slots)
      : keys(std::max<size_t>(key_slots.size(), 1) * sizeof(T), true),
        values(std::max<size_t>(value_slots.size(), 1) * sizeof(T), false) {
    for (size_t i = 0; i < key_slots.size(); ++i) keys.as<T>()[i] = from_acc<T>(key_slots[i]);
    for (size_t i = 0; i < value_slots.size(); ++i) values.as<T>()[i] = from_acc<T>(value_slots[i]);
  }
};

template <typename T>
ReropeParams paged_params(const PagedRun<T>& run, const PagedCaches<T>& caches, T* out, float* lse) {
  const PagedCase& c = run.c;
  ReropeParams p;
  p.q = run.q.data();
  p.q_stride_l = static_cast<int64_t>(c.q_heads) * c.dim, p.q_stride_h = c.dim;
  p.k = caches.keys.template as<T>();
  p.v = caches.values.template as<T>();
  p.k_stride_l = p.v_stride_l = c.dim;
  p.k_stride_h = p.v_stride_h = static_cast<int64_t>(c.block_size) * c.dim;
  p.k_stride_b = p.v_stride_b = static_cast<int64_t>(c.kv_heads) * c.block_size * c.dim;
  p.inv_freq = run.inv_freq.data();
  p.inv_freq_stride = c.per_request_tables ? c.rotary_dim / 2 : 0;
  p.scale_factors = c.per_request_tables ? run.scale_factors.data() : nullptr;
  p.block_table = run.block_table.data();
  p.seq_lens = run.seq_lens.data();
  p.query_start_loc = run.qsl.data();
  p.requests = static_cast<int>(c.requests.size());
  p.num_blocks = run.num_blocks, p.block_size = c.block_size, p.max_blocks = run.max_blocks;
  p.out = out;
  p.lse = lse;
  p.batch = 1, p.q_heads = c.q_heads, p.kv_heads = c.kv_heads, p.q_len = run.tokens, p.k_len = 0;
  p.head_dim = c.dim, p.rotary_pairs = c.rotary_dim / 2;
  p.rule = c.rule(), p.logn_length = c.logn_length;
  p.inv_log_train = c.logn_length > 0 ? 1.0 / std::log(static_cast<double>(c.logn_length)) : 0.0;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.dim)));
  p.causal = true, p.interleaved = c.interleaved;
  return p;
}

// The rows of request r from the packed [T, Hq, D] output, in its dense layout [Hq, q_len, D].
template <typename T>
void unpack_request(const PagedRun<T>& run, int r, const std::vector<T>& out, const std::vector<float>& lse,
                    std::vector<T>& dense_out, std::vector<float>& dense_lse) {
  const PagedCase& c = run.c;
  const int q_len = run.qsl[r + 1] - run.qsl[r];
  dense_out.assign(static_cast<size_t>(c.q_heads) * q_len * c.dim, from_acc<T>(0.0f));
  dense_lse.assign(static_cast<size_t>(c.q_heads) * q_len, 0.0f);
  for (int h = 0; h < c.q_heads; ++h)
    for (int i = 0; i < q_len; ++i) {
      const size_t token = static_cast<size_t>(run.qsl[r] + i);
      dense_lse[static_cast<size_t>(h) * q_len + i] = lse[token * c.q_heads + h];
      for (int d = 0; d < c.dim; ++d)
        dense_out[(static_cast<size_t>(h) * q_len + i) * c.dim + d] = out[(token * c.q_heads + h) * c.dim + d];
    }
}

// The packed output of a paged launch, and what its schedule decided.
template <typename T>
struct PagedResult {
  std::vector<T> out;
  std::vector<float> lse;
  PagedDecisions decisions;
};

// The paged launch against each request's dense float64 reference: fp32 within 2e-5, fp16/bf16 within
// twice the SDPA-way error. `poison` spoils request `poisoned`'s metadata: its rows must be NaN, the
// others unaffected. With the tensor cores on (a budget >= 0, or kDefaultBudget: rerope_paged.cu's),
// `tensor_core`, when given, is the path each request must have taken (kPagedSimt 0, kPagedTcPreRotated
// 1, kPagedTcRotating 2).
template <typename T>
PagedResult<T> run_paged(const PagedCase& c, unsigned seed, int splits, Poison poison = Poison::kNone,
                         int poisoned = -1, int64_t tc_key_budget = kNoTensorCores,
                         const std::vector<int>& tensor_core = {}) {
  std::vector<float> key_slots, value_slots;
  PagedRun<T> run = make_paged<T>(c, seed, key_slots, value_slots);
  if (poison != Poison::kNone) {
    int* table = run.block_table.data() + static_cast<size_t>(poisoned) * run.max_blocks;
    const int last_page = (run.seq_lens[poisoned] - 1) / c.block_size;
    switch (poison) {
      case Poison::kPagePastCache: table[last_page] = run.num_blocks; break;
      case Poison::kNegativePage: table[0] = -1; break;
      case Poison::kSeqPastTable: run.seq_lens[poisoned] = run.max_blocks * c.block_size + 1; break;
      case Poison::kQueriesPastSeq: run.seq_lens[poisoned] = run.qsl[poisoned + 1] - run.qsl[poisoned] - 1; break;
      case Poison::kNone: break;
    }
  }
  const PagedCaches<T> caches(key_slots, value_slots);
  const size_t rows = static_cast<size_t>(run.tokens) * c.q_heads;
  std::vector<T> out(rows * c.dim, from_acc<T>(-7.0f));
  std::vector<float> lse(rows, -7.0f);
  if (tc_key_budget == kDefaultBudget)
    tc_key_budget = ropescale::rerope_cuda::rerope_paged_tc_key_budget(
        run.tokens, static_cast<int64_t>(c.requests.size()), static_cast<int64_t>(run.max_blocks) * c.block_size);
  const PagedDecisions decisions =
      launch_paged<T>(paged_params(run, caches, out.data(), lse.data()), splits, tc_key_budget);
  if (!tensor_core.empty()) {
    INFO(c.name() << ": which requests took the tensor cores (1: pre-rotated keys, 2: keys rotated in the kernel)");
    CHECK(decisions.tensor_core == tensor_core);
  }

  for (int r = 0; r < static_cast<int>(c.requests.size()); ++r) {
    INFO(c.name() << " splits " << splits << " request " << r);
    std::vector<T> got_out;
    std::vector<float> got_lse;
    unpack_request(run, r, out, lse, got_out, got_lse);
    if (r == poisoned) {
      for (float x : got_lse) REQUIRE(std::isnan(x));
      for (T x : got_out) REQUIRE(std::isnan(to_acc(x)));
      continue;
    }
    const Problem& pr = run.dense[r];
    if (pr.c.q_len == 0) continue;  // no rows
    std::vector<double> ref_out, ref_lse;
    reference(pr, ref_out, ref_lse);
    if constexpr (!std::is_same_v<T, float>) {
      check_within_sdpa_error<T>(pr, ref_out, ref_lse, got_out, got_lse, "paged");
    } else {
      for (size_t row = 0; row < got_lse.size(); ++row) {
        INFO("row " << row << " lse " << got_lse[row] << " ref " << ref_lse[row]);
        REQUIRE(std::abs(got_lse[row] - ref_lse[row]) <= 2e-5 * (1 + std::abs(ref_lse[row])));
        for (int d = 0; d < c.dim; ++d) {
          const double got = got_out[row * c.dim + d], want = ref_out[row * c.dim + d];
          INFO("dim " << d << " got " << got << " want " << want);
          REQUIRE(std::abs(got - want) <= 2e-5 + 2e-5 * std::abs(want));
        }
      }
    }
  }
  return {std::move(out), std::move(lse), decisions};
}

// Decode rows (1 query), chunked-prefill rows (a chunk at the end of a longer sequence), full-prefill
// rows (q_len = seq_len), an empty row range, in one launch; the window puts near, band and far tiles
// in the longer requests.
const std::vector<std::pair<int, int>> kMixedRequests = {{1, 70}, {9, 45}, {35, 35}, {0, 6}, {1, 1}, {3, 40}};

}  // namespace

#ifndef ROPESCALE_EMU_RACE_CHECKS_ONLY
TEST_CASE("paged kernel: decode, chunked-prefill and prefill rows in one launch match the double reference",
          "[rerope][paged]") {
  unsigned seed = 500;
  // Block sizes 1, 16 and odd; GQA 1/2/4; ReRoPE, Leaky, log-n; partial rotary and interleaved pairs;
  // a shared table and per-request tables and scale factors; with key splits (even cases) and without.
  const std::vector<PagedCase> cases = {
      {kMixedRequests, 4, 2, 16, 16, 16, 8, 0.0, 0, false, false},
      {kMixedRequests, 4, 1, 24, 16, 5, 7, 16.0, 20, false, true},
      {kMixedRequests, 2, 2, 10, 10, 1, 12, 0.0, 30, true, true},
      {{{2, 90}, {40, 40}}, 8, 2, 32, 32, 16, 20, 8.0, 0, false, false},
  };
  for (size_t i = 0; i < cases.size(); ++i) run_paged<float>(cases[i], seed++, i % 2 == 0 ? 3 : 1);
}

TEST_CASE("paged kernel: half and bfloat16 within twice the SDPA-way error", "[rerope][paged][lowp]") {
  const PagedCase c{kMixedRequests, 4, 2, 32, 32, 7, 8, 16.0, 0, false, true};
  run_paged<__half>(c, 600, 2);
  run_paged<__nv_bfloat16>(c, 601, 1);
}

TEST_CASE("paged kernel: a request whose metadata points outside the cache gets NaN rows, nothing read outside",
          "[rerope][paged][poison]") {
  // Guarded caches: a read past the key cache's end or before the value cache's start faults.
  // The spoiled request: a decode row (launched with key splits) or a prefill row.
  const PagedCase c{{{1, 40}, {9, 30}, {20, 20}, {0, 6}}, 4, 2, 16, 16, 5, 8, 0.0, 0, false, false};
  struct Spoil {
    Poison poison;
    int request, splits;
  };
  unsigned seed = 700;
  for (const Spoil& s : {Spoil{Poison::kPagePastCache, 0, 3}, Spoil{Poison::kPagePastCache, 2, 1},
                         Spoil{Poison::kNegativePage, 2, 1}, Spoil{Poison::kSeqPastTable, 0, 3},
                         Spoil{Poison::kQueriesPastSeq, 2, 1}})
    run_paged<float>(c, seed++, s.splits, s.poison, s.request);
  // A block-table row of more than one chunk of the prepare kernel's page checks (1,100 pages of one
  // key): the bad page in the second chunk, the first one, or none.
  const PagedCase long_row{{{1, 1100}, {2, 30}}, 2, 1, 8, 8, 1, 16, 0.0, 0, false, false};
  REQUIRE(ropescale::rerope_cuda::rerope_paged_page_chunks(1101) == 2);
  run_paged<float>(long_row, seed++, 2, Poison::kPagePastCache, 0);
  run_paged<float>(long_row, seed++, 1, Poison::kNegativePage, 0);
  run_paged<float>(long_row, seed++, 3);
}
#endif

// The tensor-core prefill of paged requests (fp16 / bf16 at its head dims): requests of more than 4
// rows whose keys fit the pre-pass budget run there, the others (decode rows, an empty row range,
// what does not fit) on the SIMT body, in one launch; each request against its dense float64
// reference. The requests: decode, a prefill of two query blocks, empty, a chunked prefill, a few
// decode rows, a chunk whose queries start mid-sequence (40 of 130: near, band, far and skipped tiles).
const std::vector<std::pair<int, int>> kTensorCoreRequests = {{1, 70}, {70, 70}, {0, 6}, {9, 45}, {3, 40}, {40, 130}};

#ifndef ROPESCALE_EMU_RACE_CHECKS_ONLY
TEST_CASE("paged kernel: prefill requests on the tensor cores, decode rows on SIMT, within twice the SDPA-way error",
          "[rerope][paged][tensor_core]") {
  // fp16: block size 16, GQA 2, ReRoPE, per-request tables and scale factors, key splits on the SIMT rows.
  run_paged<__half>({kTensorCoreRequests, 4, 2, 64, 64, 16, 20, 0.0, 0, false, true}, 900, 2, Poison::kNone, -1,
                    kDefaultBudget, {0, 1, 0, 1, 0, 1});
  // bf16: block size 1, GQA 4, Leaky + log-n, partial interleaved rotary, D 80.
  run_paged<__nv_bfloat16>({kTensorCoreRequests, 4, 1, 80, 48, 1, 30, 8.0, 50, true, true}, 901, 1, Poison::kNone, -1,
                           kDefaultBudget, {0, 1, 0, 1, 0, 1});
  // A budget of 130 keys: the first two prefill requests (70 + 45 keys) are pre-rotated; the last (130
  // keys) stays on the tensor cores, rotating its key tiles in the kernel.
  run_paged<__half>({kTensorCoreRequests, 2, 2, 96, 96, 7, 9, 16.0, 0, false, false}, 902, 1, Poison::kNone, -1, 130,
                    {0, 1, 0, 1, 0, 2});
}
#endif

// The requests past the budget rotate their key tiles in the kernel from the pages, with the same turn
// rates and the same rounding as the pre-pass: the same rows, bit for bit, as when their keys are
// pre-rotated (and both within the SDPA-way rule of the float64 reference).
#ifndef ROPESCALE_EMU_RACE_CHECKS_ONLY
TEST_CASE("paged tensor-core prefill: keys rotated in the kernel give the pre-rotated keys' result bit for bit",
          "[rerope][paged][tensor_core]") {
  const std::vector<PagedCase> cases = {
      // ReRoPE (far tiles read the raw keys, near and band tiles rotate), fp16, per-request tables.
      {kTensorCoreRequests, 4, 2, 64, 64, 16, 20, 0.0, 0, false, true},
      // Leaky + log-n (every tile rotates: far tiles at p/k), partial interleaved rotary, D 80, block size 1.
      {kTensorCoreRequests, 4, 1, 80, 48, 1, 30, 8.0, 50, true, true},
      // D 128, Leaky with a window inside the first tile, odd block size.
      {{{70, 70}, {2, 9}, {33, 160}}, 2, 2, 128, 128, 7, 5, 4.0, 0, false, false},
  };
  unsigned seed = 920;
  for (const PagedCase& c : cases) {
    std::vector<int> pre_rotated, rotating;
    for (auto [q_len, seq_len] : c.requests) {
      pre_rotated.push_back(q_len > 4 ? 1 : 0);
      rotating.push_back(q_len > 4 ? 2 : 0);
    }
    INFO(c.name());
    if (c.dim == 80) {
      const auto a = run_paged<__nv_bfloat16>(c, seed, 1, Poison::kNone, -1, kDefaultBudget, pre_rotated);
      const auto b = run_paged<__nv_bfloat16>(c, seed, 1, Poison::kNone, -1, 0, rotating);
      CHECK(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(a.out[0])) == 0);
      CHECK(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0);
    } else {
      const auto a = run_paged<__half>(c, seed, 2, Poison::kNone, -1, kDefaultBudget, pre_rotated);
      const auto b = run_paged<__half>(c, seed, 2, Poison::kNone, -1, 0, rotating);
      CHECK(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(a.out[0])) == 0);
      CHECK(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0);
    }
    ++seed;
  }
}
#endif

// Issue 26's cliff: a chunk of queries against a long context stays on the tensor cores past the
// pre-pass budget (max(4 T, 65536) keys by default), rotating its key tiles in the kernel: 64 queries
// at the end of a 70,000-key sequence (Leaky ReRoPE: every tile rotates, near at p and far at p/k;
// angles up to position 69,999), against the float64 reference within twice the SDPA-way error. One
// head (one block of 1,094 key tiles): ~3 minutes on an idle 2-core machine, its own ctest case.
#ifndef ROPESCALE_EMU_RACE_CHECKS_ONLY
TEST_CASE("paged tensor-core prefill: 64 queries against 70k keys stay on the tensor cores",
          "[rerope][paged][tensor_core][long]") {
  const PagedCase c{{{64, 70000}}, 1, 1, 64, 64, 16, 2048, 16.0, 0, false, false};
  REQUIRE(ropescale::rerope_cuda::rerope_paged_tc_key_budget(64, 1, 70000 + 16) < 70000);
  run_paged<__half>(c, 990, 1, Poison::kNone, -1, kDefaultBudget, {2});
}
#endif

// Decode splits follow each request's own length, not the block table's width: a 4k request and a
// 100-key one, each decoding one query, with block tables sized for 128k keys (max_model_len) and the
// split count of 132 SMs (rerope_paged_split_count). The 4k request spreads over 32 splits of 4 tiles
// (the block table's width would have given splits of 32 tiles: 4 of them live); the short one takes
// one split, the others exit.
#ifndef ROPESCALE_EMU_RACE_CHECKS_ONLY
TEST_CASE("paged kernel: decode splits follow the lengths, not the block table's width", "[rerope][paged][splits]") {
  using namespace ropescale::rerope_cuda;
  const int block_size = 16, table_pages = 131072 / block_size;
  const PagedCase c{{{1, 4096}, {1, 100}}, 4, 2, 32, 32, block_size, 512, 0.0, 0, false, false, table_pages};
  const int splits = rerope_paged_split_count(2, 2, 4, 2, TileShape<64>::kRows, int64_t{table_pages} * block_size, 132);
  REQUIRE(splits == 66);  // 2 waves of 132 SMs over 2 requests x 2 kv heads
  const auto result = run_paged<float>(c, 995, splits);
  CHECK(result.decisions.keys_per_split == std::vector<int>{128, 128});
  CHECK(rerope_paged_live_splits(4096, splits) == 32);
  CHECK(rerope_paged_live_splits(100, splits) == 1);
}

TEST_CASE("paged tensor-core prefill: a spoiled request gets NaN rows, nothing read outside",
          "[rerope][paged][tensor_core][poison]") {
  // Guarded caches as above; the spoiled request would have taken the tensor cores, the prefill
  // requests after it still do (their rotated keys' offsets skip it).
  const PagedCase c{{{1, 40}, {9, 30}, {20, 20}, {0, 6}, {12, 50}}, 4, 2, 64, 64, 5, 8, 0.0, 0, false, false};
  run_paged<__half>(c, 950, 1, Poison::kPagePastCache, 2, kDefaultBudget, {0, 1, 0, 0, 1});
  run_paged<__nv_bfloat16>(c, 951, 2, Poison::kNegativePage, 1, kDefaultBudget, {0, 0, 1, 0, 1});
  // The same with every tensor-core request rotating its keys in the kernel (budget 0).
  run_paged<__half>(c, 952, 1, Poison::kPagePastCache, 4, 0, {0, 2, 2, 0, 0});
}

TEST_CASE("cache write kernel: raw keys and values at their slots, negative and past-the-cache slots skipped",
          "[rerope][paged][cache_write]") {
  using namespace ropescale::rerope_cuda;
  const int tokens = 11, kv_heads = 2, dim = 12, block_size = 5, num_blocks = 4;
  const int64_t slots = static_cast<int64_t>(num_blocks) * block_size;
  std::mt19937 gen(3);
  std::normal_distribution<float> normal;
  // key and value [T, Hkv, D] strided (token stride 2 * Hkv * D, as a slice of a wider tensor).
  std::vector<__half> key(2 * tokens * kv_heads * dim), value(key.size());
  for (size_t i = 0; i < key.size(); ++i) key[i] = __float2half(normal(gen)), value[i] = __float2half(normal(gen));
  const std::vector<int64_t> slot_mapping = {7, -1, 0, 19, 3, slots, 12, -5, 8, 15, 1};
  std::vector<__half> key_cache(slots * kv_heads * dim, __float2half(-3.0f)), value_cache(key_cache);
  CacheWriteParams p;
  p.key_cache = key_cache.data(), p.value_cache = value_cache.data();
  p.key = key.data(), p.value = value.data(), p.slot_mapping = slot_mapping.data();
  p.key_stride_t = p.value_stride_t = 2 * kv_heads * dim, p.key_stride_h = p.value_stride_h = dim;
  p.cache_stride_block = p.vcache_stride_block = static_cast<int64_t>(kv_heads) * block_size * dim;
  p.cache_stride_h = p.vcache_stride_h = static_cast<int64_t>(block_size) * dim;
  p.cache_stride_slot = p.vcache_stride_slot = dim;
  p.tokens = tokens, p.slots = slots, p.kv_heads = kv_heads, p.head_dim = dim, p.block_size = block_size;
  launch_rerope_cache_write<__half>(p, nullptr);
  std::vector<int> writer(slots, -1);
  for (int t = 0; t < tokens; ++t)
    if (slot_mapping[t] >= 0 && slot_mapping[t] < slots) writer[slot_mapping[t]] = t;
  for (int64_t s = 0; s < slots; ++s)
    for (int h = 0; h < kv_heads; ++h)
      for (int d = 0; d < dim; ++d) {
        const size_t at = ((s / block_size * kv_heads + h) * block_size + s % block_size) * dim + d;
        const int t = writer[s];
        INFO("slot " << s << " head " << h << " dim " << d);
        REQUIRE(__half2float(key_cache[at]) ==
                (t < 0 ? -3.0f : __half2float(key[(static_cast<size_t>(t) * 2 * kv_heads + h) * dim + d])));
        REQUIRE(__half2float(value_cache[at]) ==
                (t < 0 ? -3.0f : __half2float(value[(static_cast<size_t>(t) * 2 * kv_heads + h) * dim + d])));
      }
}
#endif

TEST_CASE("race check: one small paged launch with splits, blocks shuffled", "[tsan][paged]") {
  const ropescale_emu::ScopedBlockOrder shuffled(ropescale_emu::BlockOrder::kShuffled, 5);
  const PagedCase c{{{1, 40}, {5, 12}}, 2, 1, 8, 8, 3, 5, 16.0, 10, false, true};
  run_paged<float>(c, 800, 2);
}

TEST_CASE("race check: one small paged launch with tensor-core rows, blocks shuffled", "[tsan][paged]") {
  const ropescale_emu::ScopedBlockOrder shuffled(ropescale_emu::BlockOrder::kShuffled, 7);
  const PagedCase c{{{1, 40}, {9, 70}}, 2, 1, 64, 64, 16, 5, 16.0, 0, false, true};
  run_paged<__nv_bfloat16>(c, 801, 2, Poison::kNone, -1, kDefaultBudget, {0, 1});
}

TEST_CASE("race check: one small paged launch rotating key tiles in the tensor-core kernel, blocks shuffled",
          "[tsan][paged]") {
  const ropescale_emu::ScopedBlockOrder shuffled(ropescale_emu::BlockOrder::kShuffled, 9);
  // Leaky: near, band and far tiles all rotate in shared memory; a second request pre-rotated in the
  // same launch (budget 80: the first request's 70 keys).
  const PagedCase c{{{9, 70}, {1, 40}, {20, 130}}, 2, 1, 64, 64, 16, 40, 8.0, 0, false, true};
  run_paged<__nv_bfloat16>(c, 802, 2, Poison::kNone, -1, 80, {1, 0, 2});
}

// ---- Self-Extend and Dual Chunk Attention (issue 31): the same kernels under the other region rules,
// against the double reference written from each method's definition (reference_relative_position).
// Self-Extend: G dividing W and not, G past every position (ReRoPE with window W); Dual Chunk: local
// size 0, below and above the chunk length n, chunks shorter than a key tile (band tiles everywhere) and
// longer (near, far and band tiles).
const std::vector<Case> kRegionCases = {
    with_region(Case{2, 4, 2, 37, 37, 10, 10, 7, 0.0, 0, true, false, 5}, 3, 0),      // SE: G 3, W 7, padding
    with_region(Case{1, 8, 1, 9, 70, 16, 16, 4, 0.0, 0, false, true, 0}, 4, 0),       // SE: non-causal, interleaved
    with_region(Case{1, 4, 1, 3, 101, 64, 64, 9, 0.0, 50, true, false, 0}, 2, 0),     // SE: decode-like, log-n
    with_region(Case{2, 2, 2, 13, 66, 24, 8, 6, 0.0, 0, true, false, 9}, 1000, 0),    // SE: G past the end, partial
    with_region(Case{2, 4, 2, 37, 37, 10, 10, 3, 0.0, 0, true, false, 5}, 0, 10),     // DCA: n 7, padding
    with_region(Case{1, 4, 1, 3, 101, 64, 64, 0, 0.0, 50, true, false, 0}, 0, 16),    // DCA: local 0, log-n
    with_region(Case{1, 8, 1, 7, 70, 16, 16, 9, 0.0, 0, true, true, 0}, 0, 14),       // DCA: local 9 >= n 5
    with_region(Case{2, 2, 1, 1, 100, 130, 130, 20, 0.0, 60, true, false, 30}, 0, 45),  // DCA: D 130, padding
};

#ifndef ROPESCALE_EMU_RACE_CHECKS_ONLY
TEST_CASE("Self-Extend and Dual Chunk: prefill and decode kernels match the double reference", "[rerope][region]") {
  unsigned seed = 1000;
  for (const Case& c : kRegionCases) {
    run_kernels<float>(make_problem(c, seed++), Plan::kPrefill, 1, 2e-5);
    run_kernels<float>(make_problem(c, seed++), Plan::kDecode, c.q_len <= 3 ? 3 : 1, 2e-5);
  }
}

TEST_CASE("Self-Extend and Dual Chunk: half and bfloat16, SIMT and tensor cores, within twice the SDPA-way error",
          "[rerope][region][lowp]") {
  run_kernels<__half>(make_problem(kRegionCases[0], 1100), Plan::kPrefill, 1, 0.0);
  // Without log-n: the kernels apply it to the scores, the SDPA-way model to q before rounding, and with it
  // the 2x rule fails on about 1 seed in 40 for ReRoPE as for Dual Chunk (measured over 40 seeds each).
  run_kernels<__nv_bfloat16>(
      make_problem(with_region(Case{1, 4, 1, 3, 101, 64, 64, 0, 0.0, 0, true, false, 0}, 0, 16), 1101), Plan::kDecode,
      2, 0.0);
  // Tensor-core prefill: Self-Extend with band, far and skipped tiles; Dual Chunk with chunks of 30 and of 7.
  run_tensor_core<__nv_bfloat16>(
      make_problem(with_region(Case{2, 4, 2, 100, 100, 64, 64, 7, 0.0, 0, true, false, 5}, 3, 0), 1102));
  run_tensor_core<__half>(
      make_problem(with_region(Case{1, 4, 1, 80, 200, 128, 128, 20, 0.0, 0, true, true, 0}, 0, 50), 1103));
  run_tensor_core<__half>(
      make_problem(with_region(Case{1, 2, 1, 130, 130, 64, 64, 5, 0.0, 60, true, false, 0}, 0, 12), 1104));
}
#endif

// ---- STRING (issue 44): ReRoPE's far rule with slope 1 from W; the kernels have no code of their own for it.
const std::vector<Case> kStringCases = {
    with_string(Case{2, 4, 2, 37, 37, 10, 10, 7, 0.0, 0, true, false, 5}, 2),      // S 7, W 2, padding
    with_string(Case{1, 8, 1, 9, 70, 16, 16, 4, 0.0, 0, false, true, 0}, 0),       // W 0, non-causal, interleaved
    with_string(Case{1, 4, 1, 3, 101, 64, 64, 30, 0.0, 50, true, false, 0}, 8),    // decode-like, log-n
    with_string(Case{2, 2, 1, 1, 300, 130, 130, 200, 0.0, 0, true, false, 30}, 128),  // D 130, far tiles
};

#ifndef ROPESCALE_EMU_RACE_CHECKS_ONLY
TEST_CASE("STRING: prefill, decode, tensor-core and paged kernels match the double reference", "[rerope][string]") {
  unsigned seed = 1300;
  for (const Case& c : kStringCases) {
    run_kernels<float>(make_problem(c, seed++), Plan::kPrefill, 1, 2e-5);
    run_kernels<float>(make_problem(c, seed++), Plan::kDecode, c.q_len <= 3 ? 3 : 1, 2e-5);
  }
  run_kernels<__half>(make_problem(kStringCases[0], 1320), Plan::kPrefill, 1, 0.0);
  run_tensor_core<__nv_bfloat16>(
      make_problem(with_string(Case{2, 4, 2, 100, 100, 64, 64, 40, 0.0, 0, true, false, 5}, 8), 1321));
  run_paged<float>(with_string(PagedCase{kMixedRequests, 4, 2, 16, 16, 16, 40, 0.0, 0, false, false}, 8), 1322, 3);
  run_paged<__half>(with_string(PagedCase{kTensorCoreRequests, 4, 2, 64, 64, 16, 20, 0.0, 0, false, true}, 4),
                    1323, 2, Poison::kNone, -1, kDefaultBudget, {0, 1, 0, 1, 0, 1});
}

TEST_CASE("Self-Extend and Dual Chunk: paged decode, chunked-prefill and prefill rows in one launch",
          "[rerope][region][paged]") {
  run_paged<float>(with_region(PagedCase{kMixedRequests, 4, 2, 16, 16, 16, 8, 0.0, 0, false, false}, 3, 0), 1200, 3);
  run_paged<float>(with_region(PagedCase{kMixedRequests, 4, 1, 24, 16, 5, 4, 0.0, 20, false, true}, 0, 11), 1201, 1);
  // Tensor-core rows: keys pre-rotated, and (budget 130) rotated in the kernel from the pages.
  run_paged<__half>(with_region(PagedCase{kTensorCoreRequests, 4, 2, 64, 64, 16, 20, 0.0, 0, false, true}, 4, 0),
                    1202, 2, Poison::kNone, -1, kDefaultBudget, {0, 1, 0, 1, 0, 1});
  run_paged<__nv_bfloat16>(
      with_region(PagedCase{kTensorCoreRequests, 4, 1, 80, 48, 1, 6, 0.0, 50, true, true}, 0, 25), 1203, 1,
      Poison::kNone, -1, 130, {0, 1, 0, 1, 0, 2});
}
#endif
