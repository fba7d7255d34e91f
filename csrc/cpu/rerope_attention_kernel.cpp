// rerope_attention and rerope_attention_paged on the CPU, one body: flash-style (blocked over keys,
// online softmax), never an Lq x Lk matrix. Both ops hand the plans below a list of problems (a batch
// row; a request of the paged op, with its own q_len, seq_len, table and scale) and a layout that says
// where a problem's q, k, v, out and lse rows lie (DenseLayout; PagedLayout reads keys and values
// through the block table). Each side of the window is ordinary attention over pre-rotated operands
// (rerope_math.h), so a tile of (query block x key block) wholly inside or outside the window costs
// one product and only the band around the window edge costs two.
//
// Compiled once per instruction set (CPU_CAPABILITY = DEFAULT, AVX2, AVX512; CMakeLists.txt) and
// picked at run time by cpu/rerope_attention.cpp; the softmax and the rounding are written with
// at::vec vectors, so they are vector code on every variant (not left to the auto-vectoriser).
// Everything here but the entry point has internal linkage.
//
// Two plans share the tile classification, the masking and the online softmax:
// * prefill (more than kDecodeRows query rows): compute-bound. The key blocks some tile needs are
//   prepared once as transposed panels [D x kBlockK] (near side: rotated at p; far side at the region
//   rule's far key position: Leaky p/k, Self-Extend floor(p/G), Dual Chunk p mod n; ReRoPE far side:
//   raw; gathered from their pages), then one task per (problem, q head, query
//   block), heaviest first: scores and P.V by BLAS, the online softmax with a vectorised exp.
// * decode (a few query rows against a long cache): bound by reading the cache. The q heads of a
//   GQA group share one pass over their kv head, so every key and value is read once; the keys are
//   split into chunks over the threads and the chunks' partial softmax states merged by their lse
//   (flash-decoding); a chunk walks every kv head of a block before the next block, so a key's cos/sin
//   row is read once for all heads, and asks for its next tile while reading this one (the cache's
//   pages defeat the hardware prefetcher); keys are read where they lie and only the window's (near
//   and band tiles) are rotated, with cos/sin computed once per key for all heads (Leaky ReRoPE,
//   Self-Extend and Dual Chunk also rotate far keys).
//
// Non-finite inputs (DESIGN.md, the shared rule of every path): a MASKED pair (causal, padding)
// never contributes, whatever q/k/v hold; a row with no visible key (decided from the positions,
// never from the scores) gives zeros and lse = -inf. For visible keys the arithmetic is SDPA's: a
// NaN or +inf score poisons its row (out and lse NaN), a row whose visible scores are all -inf is
// NaN, and a non-finite v_j[d] of a visible key makes out[i, d] non-finite even where its
// probability underflowed to 0. The row maximum is NaN-propagating (a plain max would skip a NaN
// score and turn the row into zeros); P.V by BLAS over a tile with masked columns would compute
// 0 * NaN for them, so when such a tile's value block is not finite its non-finite value rows are
// zeroed for BLAS (the other rows sum in BLAS's order, as without them) and added to the rows that
// see them alone (masked_tile_accumulate). The packed (AMX) path packs such a block's values with
// those rows zeroed and adds them the same way after every tile's GEMM: a masked key's value then
// changes no bit of any row, whatever it holds (a scalar fallback would sum in another order).
//
// Precision (DESIGN.md, "Versions and precision"), the same in both plans and at every size:
// products are accumulated in float32 and the softmax is float32 throughout. For float16/bfloat16
// inputs the rotated q and k operands and the probabilities fed to P.V are rounded to the input
// dtype, as PyTorch's SDPA and FlashAttention do (their operands are the rotated tensors in that
// dtype); the row sums take the unrounded probabilities, as theirs do. A product of two rounded
// values is exact in float32, so float32 GEMMs over them are bf16/fp16 products with float32
// accumulation on every instruction set. The softmax scale and the log-n factor multiply the
// float32 scores (SDPA's order), not the rounded operands. float32 inputs round nothing.
// Where the CPU has a packed-B bf16/fp16 GEMM (AMX; cpublas::could_pack) the prefill multiplies the
// same rounded operands in the input dtype instead (use_packed_gemm): the same products, another
// summation order, as SDPA's CPU flash kernel does.
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>  // convert_to_float / convert_from_float
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "rerope_attention.h"
#include "rerope_paged.h"
#include "rotary_args.h"
#include "ropescale/rerope_math.h"
#include "ropescale/rotary_math.h"

namespace ropescale {
namespace {

constexpr int64_t kBlockQ = 128;    // query rows per prefill task
constexpr int64_t kBlockK = 128;    // keys per tile: small enough that the band stays thin
constexpr int64_t kDecodeRows = 4;  // up to this many query rows take the decode plan
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using fVec = at::vec::Vectorized<float>;
using iVec = at::vec::Vectorized<int32_t>;

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer

// exp(x) for the softmax: Cephes' polynomial on [-ln2/2, ln2/2] times 2^n (about 1 ulp); exactly 0
// below the float range (x = -inf included). The vector and the scalar version are the same
// formula (the scalar one serves the last cols % (2 x vector width) columns of a row).
inline float softmax_exp(float x) {
  const float clamped = std::min(std::max(x, -87.0f), 88.0f);
  const float shifted = clamped * kLog2e + kRound;
  const float n = shifted - kRound;
  const int32_t n_int = std::bit_cast<int32_t>(shifted) - std::bit_cast<int32_t>(kRound);
  const float r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float result = p * std::bit_cast<float>((n_int + 127) << 23);
  return x < -87.0f ? 0.0f : result;
}

inline fVec softmax_exp(const fVec& x) {
  const fVec clamped = at::vec::clamp(x, fVec(-87.0f), fVec(88.0f));
  const fVec n = at::vec::fmadd(clamped, fVec(kLog2e), fVec(kRound)) - fVec(kRound);
  const fVec r = at::vec::fnmadd(n, fVec(-2.12194440e-4f), at::vec::fnmadd(n, fVec(0.693359375f), clamped));
  fVec p(1.9875691500e-4f);
  p = at::vec::fmadd(p, r, fVec(1.3981999507e-3f));
  p = at::vec::fmadd(p, r, fVec(8.3334519073e-3f));
  p = at::vec::fmadd(p, r, fVec(4.1665795894e-2f));
  p = at::vec::fmadd(p, r, fVec(1.6666665459e-1f));
  p = at::vec::fmadd(p, r, fVec(5.0000001201e-1f));
  p = at::vec::fmadd(p * r, r, r + fVec(1.0f));
  const iVec exponent = (at::vec::convert_to_int_of_same_size(n) + iVec(127)) << iVec(23);
  const fVec result = p * at::vec::cast<float>(exponent);
  return fVec::blendv(result, fVec(0.0f), x < fVec(-87.0f));
}

// max that propagates NaN (std::max and a comparison skip it): a NaN score must poison its row.
inline float nan_max(float a, float b) { return (std::isnan(a) || a > b) ? a : b; }

// Largest lane (NaN when a lane is NaN: at::vec::maximum propagates it) and sum of the lanes of a
// vector (shuffle trees on AVX2/AVX-512).
inline float lanes_max(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return at::vec::maximum(x, y); }, v);
}

inline float lanes_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, v);
}

// x rounded to round_t and back (round to nearest even, as a conversion to the dtype does); float:
// unchanged.
template <typename round_t>
inline float round_to(float x) {
  if constexpr (std::is_same_v<round_t, float>)
    return x;
  else
    return static_cast<float>(static_cast<round_t>(x));
}

template <typename round_t>
inline void round_to(fVec& a, fVec& b) {
  if constexpr (!std::is_same_v<round_t, float>)
    std::tie(a, b) = at::vec::convert_to_float<round_t>(at::vec::convert_from_float<round_t>(a, b));
}

// Rounds n floats in place to round_t (the rotated operands of a float16/bfloat16 input).
template <typename round_t>
void round_rows(float* x, int64_t n) {
  if constexpr (!std::is_same_v<round_t, float>) {
    constexpr int64_t kStep = 2 * fVec::size();
    int64_t i = 0;
    for (; i + kStep <= n; i += kStep) {
      fVec a = fVec::loadu(x + i), b = fVec::loadu(x + i + fVec::size());
      round_to<round_t>(a, b);
      a.store(x + i);
      b.store(x + i + fVec::size());
    }
    for (; i < n; ++i) x[i] = round_to<round_t>(x[i]);
  }
}

// float -> bfloat16 rows with AVX512-BF16's vcvtne2ps2bf16 (round to nearest even, as the ATen
// conversion, which takes ~10 integer instructions per vector instead). Compiled for that
// extension alone and called only where the CPU has it (has_avx512_bf16), from the AVX-512 variant.
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define ROPESCALE_NATIVE_BF16 1
__attribute__((target("avx512f,avx512bf16"))) void convert_row_native_bf16(const float* src, int64_t n,
                                                                             at::BFloat16* dst) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(reinterpret_cast<void*>(dst + i), reinterpret_cast<__m512i>(packed));
  }
  for (; i < n; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);
}

bool has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
#endif

// dst[0, n) = src[0, n) converted to lp_t (bfloat16 / float16), vectorised.
template <typename lp_t>
void convert_row(const float* src, int64_t n, lp_t* dst) {
  constexpr int64_t kStep = 2 * fVec::size();
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep)
    at::vec::convert_from_float<lp_t>(fVec::loadu(src + i), fVec::loadu(src + i + fVec::size())).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<lp_t>(src[i]);
}

// Folds a tile of raw scores (q.k, unscaled; masked pairs -inf) into the running softmax of its rows.
// Row r's scores are scaled by row_factor[r] (softmax scale x log-n, > 0) in place; row_max (of the
// scaled scores) and row_sum are updated, the scores become their unnormalised probabilities rounded
// to round_t (what P.V multiplies; the row sum takes them unrounded), and each acc row is rescaled by
// exp(old - new). A NaN or +inf score poisons its row: row_max and row_sum become NaN, acc NaN, the
// probabilities 0 (the final step writes NaN for such a row).
// With probs_out (the packed path) the rounded probabilities go there as round_t instead (same ld,
// columns [0, cols)), and the scores are left scaled.
template <typename round_t>
void online_softmax_update(float* scores, int64_t rows, int64_t cols, int64_t ld_scores, const float* row_factor,
                           float* row_max, float* row_sum, float* acc, int64_t dim, round_t* probs_out = nullptr) {
  constexpr int64_t kWidth = fVec::size();
  bool native_bf16 = false;
#ifdef ROPESCALE_NATIVE_BF16
  if constexpr (std::is_same_v<round_t, at::BFloat16>) native_bf16 = probs_out != nullptr && has_avx512_bf16();
#endif
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld_scores;
    // The scores are scaled first, and the maximum taken over the scaled values: the largest then
    // gives exp(0) = 1 exactly, whatever the scale (a product recomputed inside an FMA rounds
    // differently, and at scale 1e30 that rounding alone underflowed every exponent to 0).
    const fVec factor_vec(row_factor[r]);
    int64_t c = 0;
    fVec max_vec(kNegInf);
    for (; c + kWidth <= cols; c += kWidth) {
      const fVec scaled = fVec::loadu(s + c) * factor_vec;  // -inf stays -inf (factor > 0)
      scaled.store(s + c);
      max_vec = at::vec::maximum(scaled, max_vec);
    }
    float tile_max = lanes_max(max_vec);
    for (; c < cols; ++c) {
      s[c] *= row_factor[r];
      tile_max = nan_max(tile_max, s[c]);
    }
    const float old_max = row_max[r];
    const float new_max = nan_max(old_max, tile_max);
    round_t* out = probs_out ? probs_out + r * ld_scores : nullptr;
    if (std::isnan(new_max) || new_max == std::numeric_limits<float>::infinity()) {  // poisoned row
      if (out)
        std::fill(out, out + cols, round_t(0.0f));
      else
        std::fill(s, s + cols, 0.0f);
      row_max[r] = row_sum[r] = std::numeric_limits<float>::quiet_NaN();
      std::fill(acc + r * dim, acc + (r + 1) * dim, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    if (new_max == kNegInf) {  // nothing visible in this row so far, or only -inf scores
      if (out)
        std::fill(out, out + cols, round_t(0.0f));
      else
        std::fill(s, s + cols, 0.0f);
      continue;
    }
    const fVec shift_vec(-new_max);
    fVec sum_vec(0.0f);
    // float16/bfloat16: ATen's exp_u20 (about 1e-6 relative; SDPA's CPU flash kernel uses it), far
    // below the rounding of the probabilities to the dtype that follows. float32: the 1-ulp exp.
    auto exp_of = [](const fVec& x) {
      if constexpr (std::is_same_v<round_t, float>)
        return softmax_exp(x);
      else
        return x.exp_u20();
    };
    for (c = 0; c + 2 * kWidth <= cols; c += 2 * kWidth) {
      fVec p0 = exp_of(fVec::loadu(s + c) + shift_vec);
      fVec p1 = exp_of(fVec::loadu(s + c + kWidth) + shift_vec);
      sum_vec = sum_vec + p0 + p1;
      if constexpr (!std::is_same_v<round_t, float>) {
        if (out) {
          if (native_bf16) {  // converted row-wise below
            p0.store(s + c);
            p1.store(s + c + kWidth);
          } else {
            at::vec::convert_from_float<round_t>(p0, p1).store(out + c);
          }
          continue;
        }
      }
      round_to<round_t>(p0, p1);
      p0.store(s + c);
      p1.store(s + c + kWidth);
    }
    float tile_sum = lanes_sum(sum_vec);
    [[maybe_unused]] const int64_t vector_cols = c;  // used by the native bf16 conversion
    for (; c < cols; ++c) {
      const float p = softmax_exp(s[c] - new_max);
      tile_sum += p;
      if (out)
        out[c] = static_cast<round_t>(p);
      else
        s[c] = round_to<round_t>(p);
    }
#ifdef ROPESCALE_NATIVE_BF16
    if constexpr (std::is_same_v<round_t, at::BFloat16>)
      if (native_bf16) convert_row_native_bf16(s, vector_cols, out);
#endif
    const float alpha = old_max == kNegInf ? 0.0f : std::exp(old_max - new_max);
    row_sum[r] = row_sum[r] * alpha + tile_sum;
    row_max[r] = new_max;
    if (alpha != 1.0f) {
      float* a = acc + r * dim;
      const fVec alpha_vec(alpha);
      int64_t d = 0;
      for (; d + kWidth <= dim; d += kWidth) (fVec::loadu(a + d) * alpha_vec).store(a + d);
      for (; d < dim; ++d) a[d] *= alpha;
    }
  }
}

// Scores of a band tile: the near product where the pair is inside the window, the far one outside;
// -inf where the pair is masked (causal edge, padding).
void select_band_and_mask(float* near_scores, const float* far_scores, int64_t rows, int64_t cols, int64_t ld,
                          const int64_t* q_pos, const int64_t* k_pos, const RegionRule& rule, bool causal, bool band,
                          bool mask) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = near_scores + r * ld;
    const float* s_far = far_scores + r * ld;
    const int64_t pq = q_pos[r], near_start = rule.near_start(pq);
    if (band)
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) s[c] = k_pos[c] >= near_start ? s[c] : s_far[c];
    if (mask)
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) s[c] = rerope_visible(pq, k_pos[c], causal) ? s[c] : kNegInf;
  }
}

// scores[rows x cols] (ld_scores) = q[rows x D] . panel, a transposed key panel [D x kBlockK].
inline void tile_scores(const float* q, int64_t rows, int64_t dim, const float* panel, int64_t cols, float* scores,
                        int64_t ld_scores) {
  at::native::cpublas::brgemm(rows, cols, dim, dim, kBlockK, ld_scores, /*add_C=*/false, q, panel, scores,
                              /*is_vnni=*/false);
}

// acc[rows x D] += probs[rows x cols] . V[cols x D] (V rows with stride ld_v).
inline void tile_accumulate(const float* probs, int64_t rows, int64_t cols, int64_t ld_probs, const float* v,
                            int64_t ld_v, int64_t dim, float* acc) {
  at::native::cpublas::brgemm(rows, dim, cols, ld_probs, ld_v, dim, /*add_C=*/true, probs, v, acc, /*is_vnni=*/false);
}

// out = rot(x) with the pair angles' cos/sin; dims past the rotary ones are copied. One loop per
// layout so that each vectorises.
inline void rotate_row(const float* x, const float* cos_v, const float* sin_v, int64_t pairs, int64_t dim,
                       bool interleaved, float* out) {
  std::copy(x + 2 * pairs, x + dim, out + 2 * pairs);
  if (interleaved) {
    for (int64_t i = 0; i < pairs; ++i)
      rotate_pair(x[2 * i], x[2 * i + 1], cos_v[i], sin_v[i], &out[2 * i], &out[2 * i + 1]);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < pairs; ++i) rotate_pair(x[i], x[i + pairs], cos_v[i], sin_v[i], &out[i], &out[i + pairs]);
  }
}

template <typename scalar_t>
inline void load_row(const scalar_t* src, int64_t dim, float* dst) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
}
// ---- the problems one call computes, and where their tensors lie
//
// Both ops run the same two plans over a list of PROBLEMS: a problem is q_len queries against k_len
// keys with their own positions, rotation table and softmax scale (a batch row of rerope_attention, a
// request of rerope_attention_paged). Where a problem's q, k, v, out and lse rows lie is the LAYOUT's
// business (DenseLayout, PagedLayout: a template parameter, so each layout's addressing inlines).

// What every problem of a call shares.
struct AttentionShape {
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0, rotary_pairs = 0, logn_length = 0;
  RegionRule rule;
  double inv_log_train = 0.0;
  bool causal = true, interleaved = false;
};

// The shape both ops share, from their normalised arguments (ReropeArgs, ReropePagedArgs name it alike).
template <class Args>
AttentionShape attention_shape(const Args& a, bool causal) {
  return {a.q_heads, a.kv_heads, a.head_dim, a.rotary_pairs, a.logn_length, a.rule,
          a.inv_log_train, causal, a.interleaved};
}

struct Problem {
  int64_t index = 0;               // the layout's index of the problem (batch row, request)
  int64_t q_len = 0, k_len = 0;    // both > 0
  const int64_t* q_pos = nullptr;  // [q_len]
  const int64_t* k_pos = nullptr;  // [k_len]
  const float* inv_freq = nullptr;  // [rotary_pairs]
  float scale = 0.0f;              // softmax scale of its scores
  int64_t q_blocks() const { return (q_len + kBlockQ - 1) / kBlockQ; }
  int64_t k_blocks() const { return (k_len + kBlockK - 1) / kBlockK; }
};

// Where each problem's query rows, query blocks, key blocks and tiles start in the flat per-call
// arrays (prefix sums, n + 1 entries each), and the problem of every query block and key block.
struct ProblemOffsets {
  std::vector<int64_t> rows{0}, q_blocks{0}, k_blocks{0}, tiles{0};
  std::vector<int64_t> q_block_problem, k_block_problem;

  explicit ProblemOffsets(const std::vector<Problem>& problems) {
    for (size_t p = 0; p < problems.size(); ++p) {
      const Problem& pr = problems[p];
      rows.push_back(rows.back() + pr.q_len);
      q_blocks.push_back(q_blocks.back() + pr.q_blocks());
      k_blocks.push_back(k_blocks.back() + pr.k_blocks());
      tiles.push_back(tiles.back() + pr.q_blocks() * pr.k_blocks());
      q_block_problem.insert(q_block_problem.end(), pr.q_blocks(), static_cast<int64_t>(p));
      k_block_problem.insert(k_block_problem.end(), pr.k_blocks(), static_cast<int64_t>(p));
    }
  }
  // The problem that owns a flat query row.
  int64_t problem_of_row(int64_t row) const {
    return std::upper_bound(rows.begin(), rows.end(), row) - rows.begin() - 1;
  }
};

// rerope_attention: q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (any strides, unit last), out [B, Hq, Lq, D]
// and lse [B, Hq, Lq] contiguous; problem b is batch row b.
template <typename scalar_t>
struct DenseLayout {
  const scalar_t *q, *k, *v;
  scalar_t* out;
  float* lse;
  int64_t sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, q_heads, q_len, head_dim;

  const scalar_t* q_row(int64_t b, int64_t h, int64_t i) const { return q + b * sq0 + h * sq1 + i * sq2; }
  const scalar_t* key_row(int64_t b, int64_t h, int64_t j) const { return k + b * sk0 + h * sk1 + j * sk2; }
  const scalar_t* value_row(int64_t b, int64_t h, int64_t j) const { return v + b * sv0 + h * sv1 + j * sv2; }
  // The key and value rows of slots j0 .. j0 + n - 1, looked up once for the loops that read them.
  void tile_rows(int64_t b, int64_t h, int64_t j0, int64_t n, const scalar_t** keys, const scalar_t** values) const {
    for (int64_t c = 0; c < n; ++c) {
      keys[c] = key_row(b, h, j0 + c);
      values[c] = value_row(b, h, j0 + c);
    }
  }
  scalar_t* out_row(int64_t b, int64_t h, int64_t i) const { return out + ((b * q_heads + h) * q_len + i) * head_dim; }
  float* lse_at(int64_t b, int64_t h, int64_t i) const { return lse + (b * q_heads + h) * q_len + i; }
  // Whether BLAS can read a key block's values where they lie (float32, rows at least D apart), and how.
  bool float_values_in_place() const { return std::is_same_v<scalar_t, float> && sv2 >= head_dim; }
  int64_t float_values_ld() const { return sv2; }
};

// rerope_attention_paged: q [T, Hq, D] (unit last stride), the caches [num_blocks, Hkv, block_size, D]
// (last two dims contiguous), key slot j of request r in page block_table[r, j / block_size]; out
// [T, Hq, D] and lse [T, Hq] contiguous; problem r is request r, its query i is row starts[r] + i.
template <typename scalar_t>
struct PagedLayout {
  const scalar_t *q, *key_cache, *value_cache;
  scalar_t* out;
  float* lse;
  const int32_t *block_table, *starts;
  int64_t sq0, sq1, sk0, sk1, sv0, sv1, block_size, max_blocks, q_heads, head_dim;

  const scalar_t* q_row(int64_t r, int64_t h, int64_t i) const { return q + (starts[r] + i) * sq0 + h * sq1; }
  int64_t page_of(int64_t r, int64_t j) const { return block_table[r * max_blocks + j / block_size]; }
  const scalar_t* key_row(int64_t r, int64_t h, int64_t j) const {
    return key_cache + page_of(r, j) * sk0 + h * sk1 + (j % block_size) * head_dim;
  }
  const scalar_t* value_row(int64_t r, int64_t h, int64_t j) const {
    return value_cache + page_of(r, j) * sv0 + h * sv1 + (j % block_size) * head_dim;
  }
  // As DenseLayout's: slot by slot through the block table, one division per tile (a division per row
  // and use, on the decode loop's address path, cost more than its arithmetic).
  void tile_rows(int64_t r, int64_t h, int64_t j0, int64_t n, const scalar_t** keys, const scalar_t** values) const {
    const int32_t* pages = block_table + r * max_blocks;
    int64_t page = j0 / block_size, slot = j0 % block_size;
    for (int64_t c = 0; c < n; ++c) {
      keys[c] = key_cache + pages[page] * sk0 + h * sk1 + slot * head_dim;
      values[c] = value_cache + pages[page] * sv0 + h * sv1 + slot * head_dim;
      if (++slot == block_size) {
        slot = 0;
        ++page;
      }
    }
  }
  scalar_t* out_row(int64_t r, int64_t h, int64_t i) const { return out + ((starts[r] + i) * q_heads + h) * head_dim; }
  float* lse_at(int64_t r, int64_t h, int64_t i) const { return lse + (starts[r] + i) * q_heads + h; }
  // A key block (kBlockK slots from a multiple of kBlockK) lies in one page when pages hold whole blocks.
  bool float_values_in_place() const { return std::is_same_v<scalar_t, float> && block_size % kBlockK == 0; }
  int64_t float_values_ld() const { return head_dim; }
};

// cos/sin rows [kBlockK x 2P] (cos then sin) for the keys of the flagged key blocks (flat over the
// problems), at position_of(p) with the block's problem's table: one sincos per key and pair, shared by
// every head.
struct KeyRotations {
  std::vector<int64_t> slot;  // per key block: its rows in `cs`, -1 when not flagged
  std::vector<float> cs;
  int64_t pairs = 0;

  template <typename PositionOf>
  KeyRotations(const std::vector<uint8_t>& flagged, const std::vector<Problem>& problems, const ProblemOffsets& off,
               int64_t pair_count, PositionOf position_of)
      : slot(flagged.size(), -1), pairs(pair_count) {
    std::vector<int64_t> blocks;
    for (size_t i = 0; i < flagged.size(); ++i)
      if (flagged[i]) {
        slot[i] = static_cast<int64_t>(blocks.size());
        blocks.push_back(static_cast<int64_t>(i));
      }
    cs.resize(blocks.size() * kBlockK * 2 * pairs);
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const int64_t p = off.k_block_problem[blocks[n]];
        const Problem& pr = problems[p];
        const int64_t j0 = (blocks[n] - off.k_blocks[p]) * kBlockK, j1 = std::min(pr.k_len, j0 + kBlockK);
        for (int64_t j = j0; j < j1; ++j) {
          float* row = &cs[(n * kBlockK + j - j0) * 2 * pairs];
          rotary_cos_sin_cpu(position_of(pr.k_pos[j]), pr.inv_freq, pairs, row, row + pairs);
        }
      }
    });
  }
  const float* rows(int64_t block) const { return slot[block] < 0 ? nullptr : &cs[slot[block] * kBlockK * 2 * pairs]; }
};

// The key cos/sin of the near side (positions as they are) or of Leaky ReRoPE's far side (at p/k), for the
// flagged blocks, remembered from one call to the next: every layer of an engine step calls the op with the
// same positions and tables (a dynamic method's tables change per step, not per layer), and computing
// them again, a sincos per key and pair, was about a fifth of a Dynamic-YaRN decode call (every key near).
// The entry is keyed on everything the rows depend on (the side, k, the flags, the pairs, each problem's
// key positions and table bits), compared in full, so a hit returns the numbers a fresh computation
// would; an entry is kept only up to kCachedRotationBytes (larger ones are computed every call).
constexpr size_t kCachedRotationBytes = size_t{64} << 20;

std::shared_ptr<const KeyRotations> key_rotations(const std::vector<uint8_t>& flagged,
                                                  const std::vector<Problem>& problems, const ProblemOffsets& off,
                                                  int64_t pairs, bool far, const RegionRule& rule) {
  const auto compute = [&] {
    if (!far)
      return std::make_shared<const KeyRotations>(flagged, problems, off, pairs,
                                                  [](int64_t p) { return static_cast<double>(p); });
    return std::make_shared<const KeyRotations>(flagged, problems, off, pairs,
                                                [&](int64_t p) { return rule.far_key_position(p); });
  };
  if (std::find(flagged.begin(), flagged.end(), uint8_t{1}) == flagged.end()) return compute();  // nothing to do
  std::vector<int64_t> key{pairs, -1, 0, 0, 0};  // the far side's: its rule too
  if (far) key = {pairs, static_cast<int64_t>(rule.kind), rule.group, rule.chunk, std::bit_cast<int64_t>(rule.leaky_inv)};
  key.insert(key.end(), flagged.begin(), flagged.end());
  for (const Problem& pr : problems) {
    key.push_back(pr.k_len);
    key.insert(key.end(), pr.k_pos, pr.k_pos + pr.k_len);
    for (int64_t i = 0; i < pairs; ++i) key.push_back(std::bit_cast<uint32_t>(pr.inv_freq[i]));
  }
  static std::mutex mutex;
  static std::vector<int64_t> cached_key[2];
  static std::shared_ptr<const KeyRotations> cached[2];
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (cached[far] && cached_key[far] == key) return cached[far];
  }
  auto rotations = compute();
  const std::lock_guard<std::mutex> lock(mutex);
  if (rotations->cs.size() * sizeof(float) <= kCachedRotationBytes) {
    cached_key[far] = std::move(key);
    cached[far] = rotations;
  } else {  // too big to keep: drop the older entry too, so its memory goes
    cached_key[far].clear();
    cached[far].reset();
  }
  return rotations;
}

// Key rows c = 0 .. cols-1 of a block (key_at(c) points at one, in the input dtype) as float rows
// [cols x D]: rotated with a KeyRotations block's cos/sin rows (and rounded to scalar_t, as the rotated
// operand) when `rot` is given, as stored otherwise.
template <typename scalar_t, typename KeyAt>
void load_key_rows(KeyAt key_at, int64_t cols, int64_t dim, const float* rot, int64_t pairs, bool interleaved,
                   float* scratch, float* dst) {
  for (int64_t c = 0; c < cols; ++c) {
    if (rot) {
      load_row(key_at(c), dim, scratch);
      rotate_row(scratch, rot + c * 2 * pairs, rot + c * 2 * pairs + pairs, pairs, dim, interleaved, dst + c * dim);
    } else {
      load_row(key_at(c), dim, dst + c * dim);
    }
  }
  if (rot) round_rows<scalar_t>(dst, cols * dim);
}

// The decode plan's two products, register-blocked: a few query rows (a GQA group) against a tile of
// keys and values read where they lie (any cache dtype), each key and value element loaded once per
// row group, the partial sums kept in vector registers (the scalar loops they replace spent about half
// the decode time storing and reloading their accumulators). D is walked in chunks of two float vectors
// (one 16-bit vector: bf16/fp16 convert in one step); a partial last chunk loads zeros past D.
constexpr int64_t kChunk = 2 * fVec::size();

template <typename T>
inline void load_chunk(const T* src, int64_t n, fVec& lo, fVec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    if (n >= kChunk) {
      lo = fVec::loadu(src);
      hi = fVec::loadu(src + fVec::size());
    } else {
      lo = fVec::loadu(src, std::min<int64_t>(n, fVec::size()));
      hi = n > fVec::size() ? fVec::loadu(src + fVec::size(), n - fVec::size()) : fVec(0.0f);
    }
  } else {
    using Vec = at::vec::Vectorized<T>;
    static_assert(Vec::size() == kChunk);
    std::tie(lo, hi) = at::vec::convert_to_float<T>(n >= kChunk ? Vec::loadu(src) : Vec::loadu(src, n));
  }
}

// load_chunk's inverse for float rows: lo and hi into dst[0, n).
inline void store_chunk(const fVec& lo, const fVec& hi, int64_t n, float* dst) {
  if (n >= kChunk) {
    lo.store(dst);
    hi.store(dst + fVec::size());
  } else {
    lo.store(dst, std::min<int64_t>(n, fVec::size()));
    if (n > fVec::size()) hi.store(dst + fVec::size(), n - fVec::size());
  }
}

// {sum of a's lanes, b's, c's, d's} into out[0, 4): on AVX2 three horizontal adds and one fold for the
// four (1.25 instructions per dot product instead of a shuffle tree each).
inline void lanes_sum4(const fVec& a, const fVec& b, const fVec& c, const fVec& d, float* out) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#if defined(CPU_CAPABILITY_AVX512)
  // Each 512-bit vector folded to 256 bits (low half + high half), then as on AVX2. (at::vec's and GCC's
  // own 512-bit reductions trip GCC 12's -Wuninitialized false positive on their undefined operands.)
  alignas(64) float spill[4][16];
  const __m512 all[4] = {a, b, c, d};
  __m256 v[4];
  for (int i = 0; i < 4; ++i) {
    _mm512_store_ps(spill[i], all[i]);
    v[i] = _mm256_add_ps(_mm256_load_ps(spill[i]), _mm256_load_ps(spill[i] + 8));
  }
#else
  const __m256 v[4] = {a, b, c, d};
#endif
  const __m256 ab = _mm256_hadd_ps(v[0], v[1]), cd = _mm256_hadd_ps(v[2], v[3]);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // per 128-bit half: sum(a), sum(b), sum(c), sum(d)
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
  out[0] = lanes_sum(a);
  out[1] = lanes_sum(b);
  out[2] = lanes_sum(c);
  out[3] = lanes_sum(d);
#endif
}

// scores[r][c] = <q_r, key_c> for kRows (1 or 2) rows and the key rows c = 0 .. cols-1, four keys at a time
// (8 accumulators, the q chunks and a key chunk: 14 of AVX2's 16 registers).
template <int kRows, typename KeyAt>
void row_scores_block(const float* q, int64_t dim, KeyAt key_at, int64_t cols, float* scores, int64_t ld_scores) {
  constexpr int kKeys = 4;
  for (int64_t c0 = 0; c0 < cols; c0 += kKeys) {
    const int64_t keys = std::min<int64_t>(kKeys, cols - c0);
    decltype(key_at(0)) key[kKeys];
    for (int k = 0; k < kKeys; ++k) key[k] = key_at(c0 + std::min<int64_t>(k, keys - 1));  // repeats are dropped
    fVec acc[kRows][kKeys];
    for (int r = 0; r < kRows; ++r)
      for (int k = 0; k < kKeys; ++k) acc[r][k] = fVec(0.0f);
    for (int64_t d = 0; d < dim; d += kChunk) {
      const int64_t n = std::min(kChunk, dim - d);
      fVec q_lo[kRows], q_hi[kRows];
      for (int r = 0; r < kRows; ++r) load_chunk(q + r * dim + d, n, q_lo[r], q_hi[r]);
      for (int k = 0; k < kKeys; ++k) {
        fVec k_lo, k_hi;
        load_chunk(key[k] + d, n, k_lo, k_hi);
        for (int r = 0; r < kRows; ++r) acc[r][k] = at::vec::fmadd(q_hi[r], k_hi, at::vec::fmadd(q_lo[r], k_lo, acc[r][k]));
      }
    }
    for (int r = 0; r < kRows; ++r) {
      float sums[kKeys];
      lanes_sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], sums);
      std::copy(sums, sums + keys, scores + r * ld_scores + c0);
    }
  }
}

// Scores of a few query rows against key rows (key_at(c): read where they lie, any cache dtype), rows
// two at a time.
template <typename KeyAt>
void row_scores(const float* q, int64_t rows, int64_t dim, KeyAt key_at, int64_t cols, float* scores,
                int64_t ld_scores) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) row_scores_block<2>(q + r * dim, dim, key_at, cols, scores + r * ld_scores, ld_scores);
  if (r < rows) row_scores_block<1>(q + r * dim, dim, key_at, cols, scores + r * ld_scores, ld_scores);
}

// acc[kRows x D] += probs . V over every column of a tile (every pair visible): per D chunk, the kRows
// accumulator pairs stay in registers over all the value rows.
template <int kRows, typename prob_t, typename ValueAt>
void visible_accumulate_block(const prob_t* probs, int64_t cols, int64_t ld_probs, ValueAt value_at, int64_t dim,
                              float* acc) {
  for (int64_t d = 0; d < dim; d += kChunk) {
    const int64_t n = std::min(kChunk, dim - d);
    fVec lo[kRows], hi[kRows];
    for (int r = 0; r < kRows; ++r) load_chunk(acc + r * dim + d, n, lo[r], hi[r]);
    for (int64_t c = 0; c < cols; ++c) {
      fVec v_lo, v_hi;
      load_chunk(value_at(c) + d, n, v_lo, v_hi);
      for (int r = 0; r < kRows; ++r) {
        const fVec p(static_cast<float>(probs[r * ld_probs + c]));
        lo[r] = at::vec::fmadd(p, v_lo, lo[r]);
        hi[r] = at::vec::fmadd(p, v_hi, hi[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) store_chunk(lo[r], hi[r], n, acc + r * dim + d);
  }
}

// Whether every element of a row is finite (x * 0 is 0 for finite x, NaN otherwise).
template <typename value_t>
inline bool row_is_finite(const value_t* x, int64_t dim) {
  float zero = 0.0f;
#pragma omp simd reduction(+ : zero)
  for (int64_t d = 0; d < dim; ++d) zero += static_cast<float>(x[d]) * 0.0f;
  return zero == 0.0f;
}

// acc[rows x D] += probs . V for a few rows (value_at(c): value rows read where they lie, any cache
// dtype; probs of any float type): every value row is read once for all the rows. A zero probability
// is skipped when the pair is masked (whatever the value holds) or the value row is finite; a visible
// key's non-finite value is added even at probability 0 (0 * inf = NaN, as SDPA's P.V computes).
// With every pair visible (no masked pair in the tile: `all_visible`) the skip never applies (adding
// 0 * v for a finite v changes no bit; a non-finite one must be added), so the register-blocked loop
// runs, four rows at a time.
template <typename prob_t, typename ValueAt>
void row_accumulate(const prob_t* probs, int64_t rows, int64_t cols, int64_t ld_probs, ValueAt value_at, int64_t dim,
                    float* acc, const int64_t* row_pos, const int64_t* key_pos, bool causal, bool all_visible = false) {
  if (all_visible) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      visible_accumulate_block<4>(probs + r * ld_probs, cols, ld_probs, value_at, dim, acc + r * dim);
    const int64_t rest = rows - r;
    if (rest == 3) visible_accumulate_block<3>(probs + r * ld_probs, cols, ld_probs, value_at, dim, acc + r * dim);
    if (rest == 2) visible_accumulate_block<2>(probs + r * ld_probs, cols, ld_probs, value_at, dim, acc + r * dim);
    if (rest == 1) visible_accumulate_block<1>(probs + r * ld_probs, cols, ld_probs, value_at, dim, acc + r * dim);
    return;
  }
  for (int64_t c = 0; c < cols; ++c) {
    const auto* value = value_at(c);
    int finite = -1;  // unknown until a zero probability of a visible pair asks
    for (int64_t r = 0; r < rows; ++r) {
      const float p = static_cast<float>(probs[r * ld_probs + c]);
      if (p == 0.0f) {  // masked pairs have probability 0 (so do poisoned rows and underflows)
        if (!rerope_visible(row_pos[r], key_pos[c], causal)) continue;
        if (finite < 0) finite = row_is_finite(value, dim);
        if (finite) continue;
      }
      float* a = acc + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += p * static_cast<float>(value[d]);
    }
  }
}

// acc[rows] += p * v for each NON-FINITE value row v of a tile and each row that sees its key (visible:
// 0 * inf = NaN there, as SDPA's P.V computes; masked: nothing), after a GEMM that had those value rows
// zeroed. probs [rows x cols] with leading dimension ld_probs, of any float type.
template <typename prob_t, typename ValueAt>
void add_non_finite_value_rows(const prob_t* probs, int64_t rows, int64_t cols, int64_t ld_probs, ValueAt value_at,
                               int64_t dim, float* acc, const int64_t* row_pos, const int64_t* key_pos, bool causal) {
  for (int64_t c = 0; c < cols; ++c) {
    const auto* value = value_at(c);
    if (row_is_finite(value, dim)) continue;
    for (int64_t r = 0; r < rows; ++r) {
      if (!rerope_visible(row_pos[r], key_pos[c], causal)) continue;
      const float p = static_cast<float>(probs[r * ld_probs + c]);
      float* a = acc + r * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] += p * static_cast<float>(value[d]);
    }
  }
}

// acc[rows x D] += probs[rows x cols] . V for a tile with masked pairs whose values hold a non-finite
// element (the float path): BLAS over the values with the non-finite rows zeroed, so that every row
// sums in the order of the same tile with finite values (a masked pair's value changes nothing, to
// the bit), then each non-finite value row added to the rows that see it. `values` is scratch
// [kBlockK x D].
template <typename ValueAt>
void masked_tile_accumulate(const float* probs, int64_t rows, int64_t cols, ValueAt value_at, int64_t dim, float* acc,
                            const int64_t* row_pos, const int64_t* key_pos, bool causal, float* values) {
  for (int64_t c = 0; c < cols; ++c) {
    float* row = values + c * dim;
    load_row(value_at(c), dim, row);
    if (!row_is_finite(row, dim)) std::fill(row, row + dim, 0.0f);
  }
  tile_accumulate(probs, rows, cols, kBlockK, values, dim, dim, acc);
  add_non_finite_value_rows(probs, rows, cols, kBlockK, value_at, dim, acc, row_pos, key_pos, causal);
}

// Which query rows (flat over the problems) have at least one visible key, from the positions alone
// (the mask decides what a row with no visible key returns, never its scores).
std::vector<uint8_t> rows_with_visible_keys(const std::vector<Problem>& problems, const ProblemOffsets& off,
                                            bool causal) {
  std::vector<uint8_t> seen(off.rows.back(), 0);
  for (size_t p = 0; p < problems.size(); ++p) {
    const Problem& pr = problems[p];
    PositionRange keys;
    for (int64_t j = 0; j < pr.k_len; ++j) keys.add(pr.k_pos[j]);
    for (int64_t i = 0; i < pr.q_len; ++i) {
      const int64_t q = pr.q_pos[i];
      seen[off.rows[p] + i] = keys.count > 0 && q >= 0 && (!causal || keys.min <= q);
    }
  }
  return seen;
}

// The final value of a row: acc / row_sum and its lse when the row saw a key and its scores were
// sane; zeros and -inf when no key is visible (the mask); NaN (out and lse) when its visible scores
// were NaN, +inf, or all -inf (SDPA's softmax is NaN there).
template <typename scalar_t>
inline void write_row(bool seen, float max, float sum, const float* acc, int64_t dim, scalar_t* out, float* lse) {
  if (!seen) {
    std::fill(out, out + dim, static_cast<scalar_t>(0.0f));
    *lse = kNegInf;
  } else if (std::isfinite(max) && sum > 0.0f) {
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<scalar_t>(acc[d] * inv);
    *lse = max + std::log(sum);
  } else {
    std::fill(out, out + dim, static_cast<scalar_t>(std::numeric_limits<float>::quiet_NaN()));
    *lse = std::numeric_limits<float>::quiet_NaN();
  }
}

// Per-(key block, kv head) panels [key blocks, Hkv, panel_size] of element type panel_t, written only
// for the blocks that need them: transposed keys [D x kBlockK], float values [kBlockK x D] where BLAS
// cannot read them in place, and, on the packed path, values [kBlockK x D], all in the layout the GEMM
// reads (float rows, or VNNI as cpublas::pack writes it).
template <typename panel_t>
struct Panels {
  at::Tensor storage;
  panel_t* data = nullptr;
  int64_t heads = 0, size = 0;

  Panels(int64_t blocks, int64_t heads_, int64_t size_, bool allocate = true) : heads(heads_), size(size_) {
    if (!allocate) return;
    storage = at::empty({blocks, heads_, size_}, at::TensorOptions().dtype(c10::CppTypeToScalarType<panel_t>::value));
    data = storage.data_ptr<panel_t>();
  }
  panel_t* panel(int64_t block, int64_t h) const { return data + (block * heads + h) * size; }
};

// The bf16/fp16 GEMMs on the packed path: cpublas::brgemm with VNNI-packed B, which oneDNN runs on
// AMX (or AVX-512 BF16/FP16) tiles, as SDPA's CPU flash kernel does. Operands are the same rounded
// values as on the float path and accumulation is float32, so both paths compute the same products;
// only the summation order differs. could_pack says whether this CPU has such a kernel.
constexpr int64_t kPackN = 64;  // columns per packed B block (oneDNN's largest)
static_assert(kBlockK % kPackN == 0, "key panels are packed in whole column blocks");

template <typename scalar_t>
bool use_packed_gemm(int64_t head_dim) {
#ifdef CPU_CAPABILITY_AVX512
  // Only in the AVX-512 variant: ATen's pack runs only at that capability (ATEN_CPU_CAPABILITY=avx2 on
  // an AMX machine makes could_pack true and pack fail).
  if constexpr (std::is_same_v<scalar_t, float>) {
    return false;
  } else {
    // oneDNN packs B in column blocks of 16, 32, 48 or 64 (kPackN); VNNI pairs the reduction dim.
    return head_dim % 16 == 0 && at::native::cpublas::could_pack(c10::CppTypeToScalarType<scalar_t>::value);
  }
#else
  (void)head_dim;
  return false;
#endif
}

// ---- prefill plan: classify the tiles, rotate the queries, prepare the key panels, run the tasks

// Every (query block, key block) tile's class, which key blocks each side needs, and each query
// block's cost (the work of its tiles: 2 per one-product tile, 3 per band tile).
struct PrefillTiles {
  std::vector<TileClass> tiles;               // [tiles of every problem], flat as ProblemOffsets::tiles
  std::vector<uint8_t> needs_near, needs_far;  // per key block
  std::vector<int64_t> task_cost;             // per query block
};

PrefillTiles classify_prefill_tiles(const AttentionShape& s, const std::vector<Problem>& problems,
                                    const ProblemOffsets& off) {
  const int64_t n_problems = static_cast<int64_t>(problems.size());
  const int64_t total_qb = off.q_blocks.back(), total_kb = off.k_blocks.back();
  std::vector<PositionRange> q_ranges(total_qb), k_ranges(total_kb);
  for (int64_t p = 0; p < n_problems; ++p) {
    const Problem& pr = problems[p];
    for (int64_t i = 0; i < pr.q_len; ++i) q_ranges[off.q_blocks[p] + i / kBlockQ].add(pr.q_pos[i]);
    for (int64_t j = 0; j < pr.k_len; ++j) k_ranges[off.k_blocks[p] + j / kBlockK].add(pr.k_pos[j]);
  }
  PrefillTiles result{std::vector<TileClass>(off.tiles.back()), std::vector<uint8_t>(total_kb, 0),
                      std::vector<uint8_t>(total_kb, 0), std::vector<int64_t>(total_qb, 0)};
  std::vector<TileClass>& tiles = result.tiles;
  std::vector<uint8_t>& needs_near = result.needs_near;
  std::vector<uint8_t>& needs_far = result.needs_far;
  std::vector<int64_t>& task_cost = result.task_cost;
  for (int64_t p = 0; p < n_problems; ++p) {
    const int64_t n_qb = problems[p].q_blocks(), n_kb = problems[p].k_blocks();
    for (int64_t qb = 0; qb < n_qb; ++qb)
      for (int64_t kb = 0; kb < n_kb; ++kb) {
        const int64_t gq = off.q_blocks[p] + qb, gk = off.k_blocks[p] + kb;
        const TileClass tc = rerope_classify_tile(q_ranges[gq], k_ranges[gk], s.rule, s.causal);
        tiles[off.tiles[p] + qb * n_kb + kb] = tc;
        needs_near[gk] |= tc.kind == TileKind::kNear || tc.kind == TileKind::kBand;
        needs_far[gk] |= tc.kind == TileKind::kFar || tc.kind == TileKind::kBand;
        task_cost[gq] += tc.kind == TileKind::kSkip ? 0 : (tc.kind == TileKind::kBand ? 3 : 2);
      }
  }
  return result;
}

// The query rotation tables, shared by all heads (cos then sin, 2P floats a row): near at p, far at
// w + (p - w)/k (ReRoPE: one row per problem, at w); and every row's score factor (softmax scale x log-n).
struct QueryRotations {
  std::vector<float> near_cs, far_cs, row_factor;
};

QueryRotations query_rotations(const AttentionShape& s, const std::vector<Problem>& problems,
                               const ProblemOffsets& off) {
  const int64_t P = s.rotary_pairs;
  const bool per_row = s.rule.far_query_varies();
  const int64_t n_problems = static_cast<int64_t>(problems.size());
  const int64_t total_rows = off.rows.back();
  QueryRotations result{std::vector<float>(2 * total_rows * P),
                        std::vector<float>(2 * (per_row ? total_rows : n_problems) * P), std::vector<float>(total_rows)};
  std::vector<float>& q_near_cs = result.near_cs;
  std::vector<float>& q_far_cs = result.far_cs;
  std::vector<float>& row_factor = result.row_factor;
  if (!per_row)
    for (int64_t p = 0; p < n_problems; ++p)
      rotary_cos_sin_cpu(s.rule.far_query_position(0), problems[p].inv_freq, P, &q_far_cs[2 * p * P],
                         &q_far_cs[(2 * p + 1) * P]);
  at::parallel_for(0, total_rows, 256, [&](int64_t begin, int64_t end) {
    int64_t p = off.problem_of_row(begin);
    for (int64_t row = begin; row < end; ++row) {
      while (row >= off.rows[p + 1]) ++p;
      const Problem& pr = problems[p];
      const int64_t pos = pr.q_pos[row - off.rows[p]];
      rotary_cos_sin_cpu(static_cast<double>(pos), pr.inv_freq, P, &q_near_cs[2 * row * P],
                         &q_near_cs[(2 * row + 1) * P]);
      if (per_row)
        rotary_cos_sin_cpu(s.rule.far_query_position(pos), pr.inv_freq, P,
                           &q_far_cs[2 * row * P], &q_far_cs[(2 * row + 1) * P]);
      row_factor[row] = pr.scale * rerope_logn_scale(pos, s.logn_length, s.inv_log_train);
    }
  });
  return result;
}

// The element type of the packed path's operands (float inputs never take it).
template <typename scalar_t>
using packed_t = std::conditional_t<std::is_same_v<scalar_t, float>, at::BFloat16, scalar_t>;

// The key blocks some tile needs, prepared once for every query block: per (key block, kv head) the
// keys of each side the block needs, rotated and rounded, as transposed panels (float, or packed for
// the packed GEMM), the values where BLAS cannot read them in place (or packed), and whether the values
// hold a non-finite element (then a tile with masked pairs must not multiply them by its zero
// probabilities). Panels of blocks that no tile needs are left uninitialised and never read.
template <typename scalar_t>
struct KeyPanels {
  bool packed = false, values_in_place = false;  // use_packed_gemm; float values read where they lie
  Panels<float> near_panels, far_panels, v_float;
  Panels<packed_t<scalar_t>> near_packed, far_packed, v_packed;
  std::vector<uint8_t> v_not_finite;  // [key blocks, Hkv]
};

template <typename scalar_t, typename Layout>
KeyPanels<scalar_t> prepare_key_panels(const AttentionShape& s, const std::vector<Problem>& problems,
                                       const ProblemOffsets& off, const PrefillTiles& tile_classes,
                                       const Layout& layout) {
  const int64_t Hkv = s.kv_heads, D = s.head_dim, P = s.rotary_pairs;
  const int64_t total_kb = off.k_blocks.back();
  const std::vector<uint8_t>& needs_near = tile_classes.needs_near;
  const std::vector<uint8_t>& needs_far = tile_classes.needs_far;
  const auto near_rot = key_rotations(needs_near, problems, off, P, false, s.rule);
  const auto far_rot = key_rotations(s.rule.far_key_rotated() ? needs_far : std::vector<uint8_t>(total_kb, 0),
                                     problems, off, P, true, s.rule);
  using lp_t = packed_t<scalar_t>;
  const at::ScalarType lp_dtype = c10::CppTypeToScalarType<lp_t>::value;
  const bool packed = use_packed_gemm<scalar_t>(D);
  const bool values_in_place = !packed && layout.float_values_in_place();
  KeyPanels<scalar_t> result{packed,
                             values_in_place,
                             Panels<float>(total_kb, Hkv, D * kBlockK, !packed),
                             Panels<float>(total_kb, Hkv, D * kBlockK, !packed),
                             Panels<float>(total_kb, Hkv, kBlockK * D, !packed && !values_in_place),
                             Panels<lp_t>(total_kb, Hkv, D * kBlockK, packed),
                             Panels<lp_t>(total_kb, Hkv, D * kBlockK, packed),
                             Panels<lp_t>(total_kb, Hkv, kBlockK * D, packed),
                             std::vector<uint8_t>(total_kb * Hkv, 0)};
  const Panels<float>& near_panels = result.near_panels;
  const Panels<float>& far_panels = result.far_panels;
  const Panels<float>& v_float = result.v_float;
  const Panels<lp_t>& near_packed = result.near_packed;
  const Panels<lp_t>& far_packed = result.far_packed;
  const Panels<lp_t>& v_packed = result.v_packed;
  std::vector<uint8_t>& v_not_finite = result.v_not_finite;
  at::parallel_for(0, total_kb * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(D), key_rows(kBlockK * D);
    std::vector<lp_t> staging(packed ? kBlockK * D : 0);
    std::vector<uint8_t> finite_value(kBlockK);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t block = unit / Hkv, h = unit % Hkv, p = off.k_block_problem[block];
      const Problem& pr = problems[p];
      const int64_t j0 = (block - off.k_blocks[p]) * kBlockK, cols = std::min(kBlockK, pr.k_len - j0);
      auto key_at = [&](int64_t c) { return layout.key_row(pr.index, h, j0 + c); };
      auto value_at = [&](int64_t c) { return layout.value_row(pr.index, h, j0 + c); };
      for (int64_t c = 0; c < cols && !v_not_finite[unit]; ++c) v_not_finite[unit] = !row_is_finite(value_at(c), D);
      if (!needs_near[block] && !needs_far[block]) continue;
      // The block's keys, rotated for one side (and rounded), transposed [D x kBlockK]: into the float
      // panel, or into the staging panel (zero past cols) that is then packed.
      auto write_panel = [&](const Panels<float>& panels, const Panels<lp_t>& packed_panels, const float* rot) {
        load_key_rows<scalar_t>(key_at, cols, D, rot, P, s.interleaved, scratch.data(), key_rows.data());
        if (!packed) {
          float* panel = panels.panel(block, h);
          for (int64_t c = 0; c < cols; ++c)
            for (int64_t d = 0; d < D; ++d) panel[d * kBlockK + c] = key_rows[c * D + d];
          return;
        }
        // Column blocks of kPackN keys, each [D x kPackN], packed one after the other.
        lp_t* out = packed_panels.panel(block, h);
        for (int64_t n0 = 0; n0 < kBlockK; n0 += kPackN) {
          for (int64_t d = 0; d < D; ++d)
            for (int64_t c = 0; c < kPackN; ++c)
              staging[d * kPackN + c] = n0 + c < cols ? static_cast<lp_t>(key_rows[(n0 + c) * D + d]) : lp_t(0.0f);
          at::native::cpublas::pack(D, kPackN, kPackN, kPackN, lp_dtype, lp_dtype, staging.data(), out + n0 * D);
        }
      };
      if (needs_near[block]) write_panel(near_panels, near_packed, near_rot->rows(block));
      if (needs_far[block]) write_panel(far_panels, far_packed, far_rot->rows(block));  // ReRoPE: raw keys
      if (packed) {
        // The block's values [kBlockK x D] (zero past cols) in column blocks of up to kPackN dims; a block
        // with non-finite values gets those rows zeroed (every tile adds them after its GEMM).
        for (int64_t c = 0; c < cols; ++c) finite_value[c] = !v_not_finite[unit] || row_is_finite(value_at(c), D);
        lp_t* out = v_packed.panel(block, h);
        for (int64_t d0 = 0; d0 < D; d0 += kPackN) {
          const int64_t width = std::min(kPackN, D - d0);
          for (int64_t c = 0; c < kBlockK; ++c)
            for (int64_t d = 0; d < width; ++d)
              staging[c * width + d] = c < cols && finite_value[c] ? static_cast<lp_t>(value_at(c)[d0 + d]) : lp_t(0.0f);
          at::native::cpublas::pack(kBlockK, width, width, width, lp_dtype, lp_dtype, staging.data(), out + kBlockK * d0);
        }
      } else if (!values_in_place) {  // float rows [cols x D] (exact: a conversion, or a gather of pages)
        float* panel = v_float.panel(block, h);
        for (int64_t c = 0; c < cols; ++c) load_row(value_at(c), D, panel + c * D);
      }
    }
  });
  return result;
}

// The attention tasks (problem, q head, query block), as global query block * Hq + head, heaviest first:
// handed out in this order (causal rows differ in cost).
std::vector<int64_t> tasks_heaviest_first(const std::vector<int64_t>& task_cost, int64_t Hq) {
  const int64_t total_qb = static_cast<int64_t>(task_cost.size());
  std::vector<int64_t> tasks;  // global query block * Hq + head
  tasks.reserve(total_qb * Hq);
  for (int64_t gq = 0; gq < total_qb; ++gq)
    for (int64_t h = 0; h < Hq; ++h) tasks.push_back(gq * Hq + h);
  std::stable_sort(tasks.begin(), tasks.end(),
                   [&](int64_t x, int64_t y) { return task_cost[x / Hq] > task_cost[y / Hq]; });
  return tasks;
}

// Runs the tasks, handed out dynamically over the threads. A task: its query block's operands for both
// sides (rotated, rounded), then per tile it needs the scores (near, far or both), the band's selection
// and the mask, the online softmax and P.V; then its rows written.
template <typename scalar_t, typename Layout>
void run_prefill_tasks(const AttentionShape& s, const std::vector<Problem>& problems, const ProblemOffsets& off,
                       const PrefillTiles& tile_classes, const std::vector<uint8_t>& row_seen,
                       const QueryRotations& queries, const KeyPanels<scalar_t>& panels,
                       const std::vector<int64_t>& tasks, const Layout& layout) {
  const int64_t Hq = s.q_heads, Hkv = s.kv_heads, D = s.head_dim, P = s.rotary_pairs, group = Hq / Hkv;
  const bool per_row = s.rule.far_query_varies();
  using lp_t = packed_t<scalar_t>;
  const std::vector<TileClass>& tiles = tile_classes.tiles;
  const std::vector<float>& q_near_cs = queries.near_cs;
  const std::vector<float>& q_far_cs = queries.far_cs;
  const std::vector<float>& row_factor = queries.row_factor;
  const bool packed = panels.packed, values_in_place = panels.values_in_place;
  const Panels<float>& near_panels = panels.near_panels;
  const Panels<float>& far_panels = panels.far_panels;
  const Panels<float>& v_float = panels.v_float;
  const Panels<lp_t>& near_packed = panels.near_packed;
  const Panels<lp_t>& far_packed = panels.far_packed;
  const Panels<lp_t>& v_packed = panels.v_packed;
  const std::vector<uint8_t>& v_not_finite = panels.v_not_finite;
  std::atomic<int64_t> next_task{0};

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> q_row(D), q_near(kBlockQ * D), q_far(kBlockQ * D), acc(kBlockQ * D);
    std::vector<float> scores(kBlockQ * kBlockK), far_scores(kBlockQ * kBlockK), row_max(kBlockQ), row_sum(kBlockQ);
    std::vector<float> masked_values(packed ? 0 : kBlockK * D);
    std::vector<lp_t> q_near_lp(packed ? kBlockQ * D : 0), q_far_lp(packed ? kBlockQ * D : 0),
        probs_lp(packed ? kBlockQ * kBlockK : 0);
    for (int64_t t = next_task.fetch_add(1); t < static_cast<int64_t>(tasks.size()); t = next_task.fetch_add(1)) {
      const int64_t gq = tasks[t] / Hq, h = tasks[t] % Hq, hkv = h / group, p = off.q_block_problem[gq];
      const Problem& pr = problems[p];
      const int64_t qb = gq - off.q_blocks[p], n_kb = pr.k_blocks();
      const int64_t i0 = qb * kBlockQ, rows = std::min(kBlockQ, pr.q_len - i0), row0 = off.rows[p] + i0;
      const int64_t* row_pos = pr.q_pos + i0;

      // The query block's operands for both sides, rotated and rounded to scalar_t.
      for (int64_t r = 0; r < rows; ++r) {
        load_row(layout.q_row(pr.index, h, i0 + r), D, q_row.data());
        const float* near_cs = &q_near_cs[2 * (row0 + r) * P];
        const float* far_cs = &q_far_cs[2 * (per_row ? row0 + r : p) * P];
        rotate_row(q_row.data(), near_cs, near_cs + P, P, D, s.interleaved, &q_near[r * D]);
        rotate_row(q_row.data(), far_cs, far_cs + P, P, D, s.interleaved, &q_far[r * D]);
      }
      if (packed) {  // the GEMM reads them in lp_t: the conversion is the rounding
        convert_row(q_near.data(), rows * D, q_near_lp.data());
        convert_row(q_far.data(), rows * D, q_far_lp.data());
      } else {
        round_rows<scalar_t>(q_near.data(), rows * D);
        round_rows<scalar_t>(q_far.data(), rows * D);
      }
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);

      for (int64_t kb = 0; kb < n_kb; ++kb) {
        const TileClass tc = tiles[off.tiles[p] + qb * n_kb + kb];
        if (tc.kind == TileKind::kSkip) continue;
        const int64_t block = off.k_blocks[p] + kb, j0 = kb * kBlockK, cols = std::min(kBlockK, pr.k_len - j0);
        const bool band = tc.kind == TileKind::kBand;
        const int64_t* key_pos = pr.k_pos + j0;
        // Scores: the packed path computes all kBlockK columns (past cols the keys are zero; not read).
        auto scores_of = [&](const float* q, const lp_t* q_lp, const Panels<float>& panels,
                             const Panels<lp_t>& packed_panels, float* dst) {
          if (packed)
            for (int64_t n0 = 0; n0 < kBlockK; n0 += kPackN)
              at::native::cpublas::brgemm(rows, kPackN, D, D, kPackN, kBlockK, /*add_C=*/false, q_lp,
                                          packed_panels.panel(block, hkv) + n0 * D, dst + n0, /*is_vnni=*/true);
          else
            tile_scores(q, rows, D, panels.panel(block, hkv), cols, dst, kBlockK);
        };
        if (tc.kind != TileKind::kFar) scores_of(q_near.data(), q_near_lp.data(), near_panels, near_packed, scores.data());
        if (tc.kind != TileKind::kNear)
          scores_of(q_far.data(), q_far_lp.data(), far_panels, far_packed, band ? far_scores.data() : scores.data());
        if (band || tc.needs_mask)
          select_band_and_mask(scores.data(), far_scores.data(), rows, cols, kBlockK, row_pos, key_pos, s.rule,
                               s.causal, band, tc.needs_mask);
        scalar_t* probs_out = nullptr;
        if constexpr (std::is_same_v<scalar_t, lp_t>)
          if (packed) probs_out = probs_lp.data();
        online_softmax_update<scalar_t>(scores.data(), rows, cols, kBlockK, &row_factor[row0], row_max.data(),
                                        row_sum.data(), acc.data(), D, probs_out);
        const bool values_not_finite = v_not_finite[block * Hkv + hkv];  // rare
        auto value_at = [&](int64_t c) { return layout.value_row(pr.index, hkv, j0 + c); };
        if (packed) {  // P in lp_t (zero columns past cols) times the packed V (its non-finite rows zeroed)
          if (cols < kBlockK)
            for (int64_t r = 0; r < rows; ++r)
              std::fill(&probs_lp[r * kBlockK] + cols, &probs_lp[r * kBlockK] + kBlockK, lp_t(0.0f));
          for (int64_t d0 = 0; d0 < D; d0 += kPackN) {
            const int64_t width = std::min(kPackN, D - d0);
            at::native::cpublas::brgemm(rows, width, kBlockK, kBlockK, width, D, /*add_C=*/true, probs_lp.data(),
                                        v_packed.panel(block, hkv) + kBlockK * d0, acc.data() + d0, /*is_vnni=*/true);
          }
          if (values_not_finite)
            add_non_finite_value_rows(probs_lp.data(), rows, cols, kBlockK, value_at, D, acc.data(), row_pos, key_pos,
                                      s.causal);
        } else if (tc.needs_mask && values_not_finite) {
          masked_tile_accumulate(scores.data(), rows, cols, value_at, D, acc.data(), row_pos, key_pos, s.causal,
                                 masked_values.data());
        } else if (values_in_place) {
          const float* v_rows = reinterpret_cast<const float*>(layout.value_row(pr.index, hkv, j0));
          tile_accumulate(scores.data(), rows, cols, kBlockK, v_rows, layout.float_values_ld(), D, acc.data());
        } else {
          tile_accumulate(scores.data(), rows, cols, kBlockK, v_float.panel(block, hkv), D, D, acc.data());
        }
      }

      for (int64_t r = 0; r < rows; ++r)
        write_row(row_seen[row0 + r] != 0, row_max[r], row_sum[r], &acc[r * D], D,
                  layout.out_row(pr.index, h, i0 + r), layout.lse_at(pr.index, h, i0 + r));
    }
    if (packed) at::native::cpublas::brgemm_release(/*is_vnni=*/true);  // the AMX tile state of this thread
  });
}

// The prefill plan (more than kDecodeRows query rows; see the top of this file).
template <typename scalar_t, typename Layout>
void rerope_prefill_plan(const AttentionShape& s, const std::vector<Problem>& problems, const Layout& layout) {
  const ProblemOffsets off(problems);
  const PrefillTiles tiles = classify_prefill_tiles(s, problems, off);
  const std::vector<uint8_t> row_seen = rows_with_visible_keys(problems, off, s.causal);
  const QueryRotations queries = query_rotations(s, problems, off);
  const KeyPanels<scalar_t> panels = prepare_key_panels<scalar_t>(s, problems, off, tiles, layout);
  const std::vector<int64_t> tasks = tasks_heaviest_first(tiles.task_cost, s.q_heads);
  run_prefill_tasks<scalar_t>(s, problems, off, tiles, row_seen, queries, panels, tasks, layout);
}

// ---- decode plan: classify the tiles, the keys' cos/sin, the units' partial attention, their merge

// Each key block's class against all the query rows of its problem (one block), and which key blocks
// have their keys rotated: the near side's (near and band tiles), Leaky ReRoPE's far side's.
struct DecodeTiles {
  std::vector<TileClass> tiles;                        // per key block
  std::vector<uint8_t> near_blocks, far_rotated_blocks;  // per key block
};

DecodeTiles classify_decode_tiles(const AttentionShape& s, const std::vector<Problem>& problems,
                                  const ProblemOffsets& off) {
  const bool far_rotated = s.rule.far_key_rotated();
  const int64_t n_problems = static_cast<int64_t>(problems.size()), total_kb = off.k_blocks.back();
  DecodeTiles result{std::vector<TileClass>(total_kb), std::vector<uint8_t>(total_kb, 0),
                     std::vector<uint8_t>(total_kb, 0)};
  std::vector<TileClass>& tiles = result.tiles;
  std::vector<uint8_t>& near_blocks = result.near_blocks;
  std::vector<uint8_t>& far_rotated_blocks = result.far_rotated_blocks;
  for (int64_t p = 0; p < n_problems; ++p) {
    const Problem& pr = problems[p];
    PositionRange queries;
    for (int64_t i = 0; i < pr.q_len; ++i) queries.add(pr.q_pos[i]);
    for (int64_t kb = 0; kb < pr.k_blocks(); ++kb) {
      PositionRange keys;
      for (int64_t j = kb * kBlockK; j < std::min(pr.k_len, (kb + 1) * kBlockK); ++j) keys.add(pr.k_pos[j]);
      const int64_t block = off.k_blocks[p] + kb;
      const TileClass tc = rerope_classify_tile(queries, keys, s.rule, s.causal);
      tiles[block] = tc;
      near_blocks[block] = tc.kind == TileKind::kNear || tc.kind == TileKind::kBand;
      far_rotated_blocks[block] = far_rotated && (tc.kind == TileKind::kFar || tc.kind == TileKind::kBand);
    }
  }
  return result;
}

// The units of work, (problem, span of kv heads, chunk of key blocks): about eight per thread in all,
// taken by the threads in turn (a static split left a thread idle for up to a unit's time). A unit walks
// its chunk block by block and, in each block, every kv head of its span: the block's key cos/sin rows
// are read once for all of them (from memory once, then from cache), and the heads' pages of a block lie
// together. A span is every kv head unless the keys are too few to make enough units by chunks alone.
// Each unit keeps the partial softmax state of its rows (row r of kv head h0 + t: unit row
// t * group * q_len + r; r: head r / q_len of the kv head's group, query r % q_len): running max, sum and
// unnormalised output.
struct DecodeUnits {
  int64_t chunk_blocks = 0, heads_per_unit = 0, max_rows = 0;
  std::vector<int64_t> unit_begin, chunks_of;       // per problem: its first unit; its chunks per head span
  std::vector<float> part_acc, part_max, part_sum;  // [units, max_rows, D], [units, max_rows] x 2
  // The unit holding (problem p, kv head hkv, chunk c); the kv head's rows start at unit row
  // (hkv % heads_per_unit) * group * q_len.
  int64_t unit_of(int64_t p, int64_t hkv, int64_t c) const {
    return unit_begin[p] + (hkv / heads_per_unit) * chunks_of[p] + c;
  }
};

DecodeUnits decode_units(const AttentionShape& s, const std::vector<Problem>& problems, const ProblemOffsets& off) {
  const int64_t Hkv = s.kv_heads, D = s.head_dim, group = s.q_heads / Hkv;
  const int64_t n_problems = static_cast<int64_t>(problems.size()), total_kb = off.k_blocks.back();
  const int64_t wanted = std::max<int64_t>(8 * at::get_num_threads(), 1);
  // Head spans only when the chunks alone cannot make `wanted` units; then chunks sized to fill them.
  const int64_t spans = std::clamp<int64_t>((wanted + total_kb - 1) / total_kb, 1, Hkv);
  const int64_t heads_per_unit = (Hkv + spans - 1) / spans, head_spans = (Hkv + heads_per_unit - 1) / heads_per_unit;
  const int64_t chunk_blocks = std::max<int64_t>(1, (total_kb * head_spans + wanted - 1) / wanted);
  int64_t max_rows = 0;
  for (const Problem& pr : problems) max_rows = std::max(max_rows, heads_per_unit * group * pr.q_len);
  std::vector<int64_t> unit_begin{0}, chunks_of(n_problems);
  for (int64_t p = 0; p < n_problems; ++p) {
    chunks_of[p] = (problems[p].k_blocks() + chunk_blocks - 1) / chunk_blocks;
    unit_begin.push_back(unit_begin.back() + head_spans * chunks_of[p]);
  }
  const int64_t units = unit_begin.back();
  std::vector<float> part_acc(units * max_rows * D), part_max(units * max_rows), part_sum(units * max_rows);
  return DecodeUnits{chunk_blocks, heads_per_unit, max_rows, std::move(unit_begin), std::move(chunks_of),
                     std::move(part_acc), std::move(part_max), std::move(part_sum)};
}

// Asks for a row's cache lines (into L2) ahead of its use. The hardware prefetcher stops at every 4 KiB
// page and at every jump between cache pages, so a unit asks for its next tile while reading this one
// (benchmarks/bench_paged_decode.py --layers 30: see the decode plan's notes in RESULTS.md).
template <typename T>
inline void prefetch_row(const T* row, int64_t bytes) {
  const char* first = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(first + b, /*rw=*/0, /*locality=*/2);
}

// Every unit's attention over its chunk: per block and kv head of its span, the keys read where they lie
// (rotated only where a side needs it), the scores, the band's selection and the mask, the online softmax
// and P.V into the unit's partial state. The rows' operands for both sides (rotated and rounded to
// scalar_t as in the prefill plan) are made once per unit from the call's query cos/sin.
template <typename scalar_t, typename Layout>
void attend_decode_units(const AttentionShape& s, const std::vector<Problem>& problems, const ProblemOffsets& off,
                         const DecodeTiles& tile_classes, const QueryRotations& qr,
                         const std::shared_ptr<const KeyRotations>& near_rot,
                         const std::shared_ptr<const KeyRotations>& far_rot, const Layout& layout, DecodeUnits& u) {
  const int64_t Hq = s.q_heads, Hkv = s.kv_heads, D = s.head_dim, P = s.rotary_pairs, group = Hq / Hkv;
  const bool far_rotated = s.rule.far_key_rotated(), far_per_row = s.rule.far_query_varies();
  const std::vector<TileClass>& tiles = tile_classes.tiles;
  const int64_t units = u.unit_begin.back(), row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  std::atomic<int64_t> next_unit{0};
  at::parallel_for(0, std::min<int64_t>(units, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(D), q_near(u.max_rows * D), q_far(u.max_rows * D);
    std::vector<float> near_keys(kBlockK * D), far_keys(kBlockK * D);
    std::vector<float> scores(u.max_rows * kBlockK), far_scores(u.max_rows * kBlockK);
    std::vector<int64_t> row_pos(u.max_rows);
    std::vector<float> row_factor(u.max_rows);
    std::vector<const scalar_t*> key_rows(kBlockK), value_rows(kBlockK), next_keys(kBlockK), next_values(kBlockK);
    for (int64_t unit; (unit = next_unit.fetch_add(1, std::memory_order_relaxed)) < units;) {
      const int64_t p = std::upper_bound(u.unit_begin.begin(), u.unit_begin.end(), unit) - u.unit_begin.begin() - 1;
      const Problem& pr = problems[p];
      const int64_t local = unit - u.unit_begin[p], chunk = local % u.chunks_of[p];
      const int64_t h0 = (local / u.chunks_of[p]) * u.heads_per_unit, h1 = std::min(Hkv, h0 + u.heads_per_unit);
      const int64_t Lq = pr.q_len, head_rows = group * Lq, rows = (h1 - h0) * head_rows;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = h0 * group + r / Lq, i = r % Lq, row = off.rows[p] + i;
        const float* near_cs = &qr.near_cs[2 * row * P];
        const float* far_cs = &qr.far_cs[2 * (far_per_row ? row : p) * P];
        row_pos[r] = pr.q_pos[i];
        row_factor[r] = qr.row_factor[row];
        load_row(layout.q_row(pr.index, h, i), D, scratch.data());
        rotate_row(scratch.data(), near_cs, near_cs + P, P, D, s.interleaved, &q_near[r * D]);
        rotate_row(scratch.data(), far_cs, far_cs + P, P, D, s.interleaved, &q_far[r * D]);
      }
      round_rows<scalar_t>(q_near.data(), rows * D);
      round_rows<scalar_t>(q_far.data(), rows * D);
      float* unit_acc = &u.part_acc[unit * u.max_rows * D];
      float* unit_max = &u.part_max[unit * u.max_rows];
      float* unit_sum = &u.part_sum[unit * u.max_rows];
      std::fill(unit_max, unit_max + rows, kNegInf);
      std::fill(unit_sum, unit_sum + rows, 0.0f);
      std::fill(unit_acc, unit_acc + rows * D, 0.0f);

      const int64_t kb_end = std::min(pr.k_blocks(), (chunk + 1) * u.chunk_blocks);
      for (int64_t kb = chunk * u.chunk_blocks; kb < kb_end; ++kb) {
        const int64_t block = off.k_blocks[p] + kb;
        const TileClass tc = tiles[block];
        if (tc.kind == TileKind::kSkip) continue;
        const int64_t j0 = kb * kBlockK, cols = std::min(kBlockK, pr.k_len - j0);
        const bool band = tc.kind == TileKind::kBand;
        const int64_t* key_pos = pr.k_pos + j0;
        for (int64_t hkv = h0; hkv < h1; ++hkv) {
          const int64_t t = (hkv - h0) * head_rows;  // the kv head's first unit row
          float *acc = unit_acc + t * D, *row_max = unit_max + t, *row_sum = unit_sum + t;
          layout.tile_rows(pr.index, hkv, j0, cols, key_rows.data(), value_rows.data());
          // The unit's next tile (the next kv head's, else the next block's first head's, with the next
          // block's key cos/sin rows): the first read of row c of this tile asks for its row c (keys_ahead
          // is cleared after that read).
          int64_t ahead = 0;
          const float* next_cs[2] = {nullptr, nullptr};
          if (hkv + 1 < h1) {
            ahead = cols;
            layout.tile_rows(pr.index, hkv + 1, j0, ahead, next_keys.data(), next_values.data());
          } else if (kb + 1 < kb_end) {
            ahead = std::min(kBlockK, pr.k_len - j0 - kBlockK);
            layout.tile_rows(pr.index, h0, j0 + kBlockK, ahead, next_keys.data(), next_values.data());
            next_cs[0] = near_rot->rows(block + 1);
            next_cs[1] = far_rot->rows(block + 1);
          }
          int64_t keys_ahead = ahead;
          auto key_at = [&](int64_t c) {
            if (c < keys_ahead) {
              prefetch_row(next_keys[c], row_bytes);
              for (const float* cs : next_cs)
                if (cs) prefetch_row(cs + c * 2 * P, 2 * P * static_cast<int64_t>(sizeof(float)));
            }
            return key_rows[c];
          };
          auto value_at = [&](int64_t c) {
            if (c < ahead) prefetch_row(next_values[c], row_bytes);
            return value_rows[c];
          };
          if (tc.kind != TileKind::kFar) {
            load_key_rows<scalar_t>(key_at, cols, D, near_rot->rows(block), P, s.interleaved, scratch.data(),
                                    near_keys.data());
            keys_ahead = 0;
            row_scores(&q_near[t * D], head_rows, D, [&](int64_t c) { return &near_keys[c * D]; }, cols,
                       scores.data(), kBlockK);
          }
          if (tc.kind != TileKind::kNear) {
            float* far_dst = band ? far_scores.data() : scores.data();
            if (!far_rotated) {  // ReRoPE's far keys are the stored keys: read in place
              row_scores(&q_far[t * D], head_rows, D, key_at, cols, far_dst, kBlockK);
            } else {
              load_key_rows<scalar_t>(key_at, cols, D, far_rot->rows(block), P, s.interleaved, scratch.data(),
                                      far_keys.data());
              row_scores(&q_far[t * D], head_rows, D, [&](int64_t c) { return &far_keys[c * D]; }, cols, far_dst,
                         kBlockK);
            }
          }
          if (band || tc.needs_mask)
            select_band_and_mask(scores.data(), far_scores.data(), head_rows, cols, kBlockK, &row_pos[t], key_pos,
                                 s.rule, s.causal, band, tc.needs_mask);
          online_softmax_update<scalar_t>(scores.data(), head_rows, cols, kBlockK, &row_factor[t], row_max, row_sum,
                                          acc, D);
          row_accumulate(scores.data(), head_rows, cols, kBlockK, value_at, D, acc, &row_pos[t], key_pos,
                         s.causal, !tc.needs_mask);
        }
      }
    }
  });
}

// The units of every row merged by their lse (NaN-propagating; a chunk whose visible scores were all
// -inf still adds its acc with weight 0, so a non-finite value there stays non-finite), and written.
template <typename Layout>
void merge_decode_units(const AttentionShape& s, const std::vector<Problem>& problems, const ProblemOffsets& off,
                        const DecodeUnits& u, const std::vector<uint8_t>& row_seen, const Layout& layout) {
  const int64_t Hkv = s.kv_heads, D = s.head_dim, group = s.q_heads / Hkv;
  const int64_t n_problems = static_cast<int64_t>(problems.size());
  const int64_t max_rows = u.max_rows;
  at::parallel_for(0, n_problems * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(D);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t p = index / Hkv, hkv = index % Hkv;
      const Problem& pr = problems[p];
      const int64_t Lq = pr.q_len, chunks = u.chunks_of[p], first_unit = u.unit_of(p, hkv, 0);
      const int64_t t = (hkv % u.heads_per_unit) * group * Lq;  // the kv head's first row in its units
      for (int64_t r = 0; r < group * Lq; ++r) {
        const int64_t h = hkv * group + r / Lq, i = r % Lq;
        float global_max = kNegInf;
        for (int64_t c = 0; c < chunks; ++c)
          global_max = nan_max(global_max, u.part_max[(first_unit + c) * max_rows + t + r]);
        std::fill(merged.begin(), merged.end(), 0.0f);
        float total = 0.0f;
        if (std::isfinite(global_max)) {
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t part = (first_unit + c) * max_rows + t + r;
            const float weight = std::exp(u.part_max[part] - global_max);  // 0 for a chunk at -inf
            total += weight * u.part_sum[part];
            const float* acc = &u.part_acc[part * D];
            for (int64_t d = 0; d < D; ++d) merged[d] += weight * acc[d];
          }
        }
        write_row(row_seen[off.rows[p] + i] != 0, global_max, total, merged.data(), D, layout.out_row(pr.index, h, i),
                  layout.lse_at(pr.index, h, i));
      }
    }
  });
}

// The decode plan (up to kDecodeRows query rows; see the top of this file).
template <typename scalar_t, typename Layout>
void rerope_decode_plan(const AttentionShape& s, const std::vector<Problem>& problems, const Layout& layout) {
  const ProblemOffsets off(problems);
  const DecodeTiles tiles = classify_decode_tiles(s, problems, off);
  const auto near_rot = key_rotations(tiles.near_blocks, problems, off, s.rotary_pairs, false, s.rule);
  const auto far_rot = key_rotations(tiles.far_rotated_blocks, problems, off, s.rotary_pairs, true, s.rule);
  const QueryRotations query_rot = query_rotations(s, problems, off);
  DecodeUnits units = decode_units(s, problems, off);
  attend_decode_units<scalar_t>(s, problems, off, tiles, query_rot, near_rot, far_rot, layout, units);
  const std::vector<uint8_t> row_seen = rows_with_visible_keys(problems, off, s.causal);
  merge_decode_units(s, problems, off, units, row_seen, layout);
}

}  // namespace

namespace cpu {
namespace CPU_CAPABILITY {

void rerope_attention_kernel(const ReropeArgs& a, at::Tensor& out, at::Tensor& lse) {
  const AttentionShape s = attention_shape(a, a.causal);
  const int64_t* q_pos = a.q_positions.data_ptr<int64_t>();
  const int64_t* k_pos = a.k_positions.data_ptr<int64_t>();
  std::vector<Problem> problems(a.batch);
  for (int64_t b = 0; b < a.batch; ++b)
    problems[b] = {b, a.q_len, a.k_len, q_pos + b * a.q_len, k_pos + b * a.k_len, a.inv_freq.data_ptr<float>(),
                   a.scale};
  AT_DISPATCH_V2(a.q.scalar_type(), "rerope_attention_cpu", AT_WRAP([&] {
                   const DenseLayout<scalar_t> layout{
                       a.q.data_ptr<scalar_t>(), a.k.data_ptr<scalar_t>(), a.v.data_ptr<scalar_t>(),
                       out.data_ptr<scalar_t>(), lse.data_ptr<float>(), a.q.stride(0), a.q.stride(1), a.q.stride(2),
                       a.k.stride(0), a.k.stride(1), a.k.stride(2), a.v.stride(0), a.v.stride(1), a.v.stride(2),
                       a.q_heads, a.q_len, a.head_dim};
                   if (a.q_len <= kDecodeRows)
                     rerope_decode_plan<scalar_t>(s, problems, layout);
                   else
                     rerope_prefill_plan<scalar_t>(s, problems, layout);
                 }),
                 at::kFloat, at::kHalf, at::kBFloat16);
}

void rerope_attention_paged_kernel(const ReropePagedArgs& a, at::Tensor& out, at::Tensor& lse) {
  const AttentionShape s = attention_shape(a, /*causal=*/true);
  const int32_t* starts = a.query_start_loc.data_ptr<int32_t>();
  const int32_t* seq_lens = a.seq_lens.data_ptr<int32_t>();
  const float* inv_freq = a.inv_freq.data_ptr<float>();
  const float* factors = a.scale_factors ? a.scale_factors->data_ptr<float>() : nullptr;
  // Positions are implicit: key slot j is at position j, query i at seq_len - q_len + i. One 0, 1, 2, ...
  // array serves every request's keys, and its tail every request's queries.
  int64_t longest = 0;
  for (int64_t r = 0; r < a.requests; ++r) longest = std::max<int64_t>(longest, seq_lens[r]);
  std::vector<int64_t> positions(longest);
  for (int64_t j = 0; j < longest; ++j) positions[j] = j;
  std::vector<Problem> decode, prefill;  // a request's rows take the plan their count calls for
  for (int64_t r = 0; r < a.requests; ++r) {
    const int64_t q_len = starts[r + 1] - starts[r], k_len = seq_lens[r];
    if (q_len == 0) continue;
    const Problem problem{r,
                          q_len,
                          k_len,
                          positions.data() + (k_len - q_len),
                          positions.data(),
                          inv_freq + (a.per_request_inv_freq ? r * a.rotary_pairs : 0),
                          a.scale * (factors ? factors[r] : 1.0f)};
    (q_len <= kDecodeRows ? decode : prefill).push_back(problem);
  }
  AT_DISPATCH_V2(a.q.scalar_type(), "rerope_attention_paged_cpu", AT_WRAP([&] {
                   const PagedLayout<scalar_t> layout{a.q.data_ptr<scalar_t>(),
                                                      a.key_cache.data_ptr<scalar_t>(),
                                                      a.value_cache.data_ptr<scalar_t>(),
                                                      out.data_ptr<scalar_t>(),
                                                      lse.data_ptr<float>(),
                                                      a.block_table.data_ptr<int32_t>(),
                                                      starts,
                                                      a.q.stride(0),
                                                      a.q.stride(1),
                                                      a.key_cache.stride(0),
                                                      a.key_cache.stride(1),
                                                      a.value_cache.stride(0),
                                                      a.value_cache.stride(1),
                                                      a.block_size,
                                                      a.max_blocks,
                                                      a.q_heads,
                                                      a.head_dim};
                   if (!decode.empty()) rerope_decode_plan<scalar_t>(s, decode, layout);
                   if (!prefill.empty()) rerope_prefill_plan<scalar_t>(s, prefill, layout);
                 }),
                 at::kFloat, at::kHalf, at::kBFloat16);
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace ropescale
