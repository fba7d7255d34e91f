// rerope_attention on the CPU: flash-style (blocked over keys, online softmax), never an Lq x Lk
// matrix. Each side of the window is ordinary attention over pre-rotated operands (rerope_math.h),
// so a tile of (query block x key block) wholly inside or outside the window costs one product and
// only the band around the window edge costs two.
//
// Plan: classify every tile from the position bounds of its blocks; rotate just the key blocks some
// tile needs on the near side (a decode step rotates only the keys in its window) and, for Leaky
// ReRoPE, on the far side; then run one task per (batch, q head, query block), heaviest first,
// with BLAS products and a vectorised exp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "ops.h"
#include "rerope_attention.h"
#include "ropescale/rerope_math.h"
#include "ropescale/rotary_math.h"

// The softmax inner loops are compiled for several x86 levels and picked at load time, since the
// extension cannot assume more than the baseline ISA.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ROPESCALE_CPU_CLONES __attribute__((target_clones("default", "arch=haswell", "arch=skylake-avx512")))
#else
#define ROPESCALE_CPU_CLONES
#endif

namespace ropescale {
namespace {

using at::native::TransposeType;

constexpr int64_t kBlockQ = 64;   // query rows per task
constexpr int64_t kBlockK = 128;  // keys per tile: small enough that the band stays thin
constexpr int kLanes = 16;        // independent accumulators: lets the reductions vectorise
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for the softmax: Cephes' polynomial on [-ln2/2, ln2/2] times 2^n (about 1 ulp), written
// branch-free so that it vectorises; exactly 0 below the float range (x = -inf included).
inline __attribute__((always_inline)) float softmax_exp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
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

// Folds a tile of scores into the running softmax of its rows: row_max/row_sum are updated, the
// scores become their unnormalised probabilities, and each acc row is rescaled by exp(old - new).
ROPESCALE_CPU_CLONES void online_softmax_update(float* scores, int64_t rows, int64_t cols, int64_t ld_scores,
                                                float* row_max, float* row_sum, float* acc, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld_scores;
    float lane_max[kLanes];
    for (int t = 0; t < kLanes; ++t) lane_max[t] = kNegInf;
    int64_t c = 0;
    for (; c + kLanes <= cols; c += kLanes)
      for (int t = 0; t < kLanes; ++t) lane_max[t] = std::max(lane_max[t], s[c + t]);
    float tile_max = kNegInf;
    for (int t = 0; t < kLanes; ++t) tile_max = std::max(tile_max, lane_max[t]);
    for (; c < cols; ++c) tile_max = std::max(tile_max, s[c]);

    const float old_max = row_max[r];
    const float new_max = std::max(old_max, tile_max);
    if (new_max == kNegInf) {  // nothing visible in this row so far
      std::fill(s, s + cols, 0.0f);
      continue;
    }
    float lane_sum[kLanes] = {};
    c = 0;
    for (; c + kLanes <= cols; c += kLanes)
      for (int t = 0; t < kLanes; ++t) {
        const float p = softmax_exp(s[c + t] - new_max);
        s[c + t] = p;
        lane_sum[t] += p;
      }
    float tile_sum = 0.0f;
    for (int t = 0; t < kLanes; ++t) tile_sum += lane_sum[t];
    for (; c < cols; ++c) {
      s[c] = softmax_exp(s[c] - new_max);
      tile_sum += s[c];
    }
    const float alpha = old_max == kNegInf ? 0.0f : std::exp(old_max - new_max);
    row_sum[r] = row_sum[r] * alpha + tile_sum;
    row_max[r] = new_max;
    if (alpha != 1.0f) {
      float* a = acc + r * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] *= alpha;
    }
  }
}

// On transposed scores S^T[cols x rows] (one row per key): the near product where the pair is
// inside the window, the far one outside, and -inf where the pair is masked (causal edge, padding).
void select_band_and_mask(float* near_t, const float* far_t, int64_t rows, int64_t cols, int64_t ld,
                          const int64_t* q_pos, const int64_t* k_pos, int64_t window, bool causal, bool band,
                          bool mask) {
  for (int64_t c = 0; c < cols; ++c) {
    float* s = near_t + c * ld;
    const float* s_far = far_t + c * ld;
    const int64_t pk = k_pos[c];
    if (band)
      for (int64_t r = 0; r < rows; ++r) s[r] = rerope_is_near(q_pos[r], pk, window) ? s[r] : s_far[r];
    if (mask)
      for (int64_t r = 0; r < rows; ++r) s[r] = rerope_visible(q_pos[r], pk, causal) ? s[r] : kNegInf;
  }
}

// dst[rows x cols] (ld_dst) = src[cols x rows]^T (ld_src), in cache-sized squares.
ROPESCALE_CPU_CLONES void transpose_block(const float* src, int64_t ld_src, int64_t cols, int64_t rows, float* dst,
                                          int64_t ld_dst) {
  constexpr int64_t kSquare = 16;
  for (int64_t c0 = 0; c0 < cols; c0 += kSquare)
    for (int64_t r0 = 0; r0 < rows; r0 += kSquare) {
      const int64_t c1 = std::min(cols, c0 + kSquare), r1 = std::min(rows, r0 + kSquare);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) dst[r * ld_dst + c] = src[c * ld_src + r];
    }
}

// Row-major C[m x n] = A[m x k] . B[k x n] (+ C when accumulate), through ATen's BLAS entry.
inline void matmul(int64_t m, int64_t n, int64_t k, const float* a, int64_t ld_a, const float* b, int64_t ld_b,
                   float* c, int64_t ld_c, bool accumulate) {
  at::native::cpublas::brgemm(m, n, k, ld_a, ld_b, ld_c, accumulate, a, b, c, /*is_vnni=*/false);
}

constexpr int64_t kFewRows = 4;  // up to this many query rows (decoding), scores are plain dot products

// Transposed scores S^T[cols x rows] = K[cols x D] . Q^T for keys stored as rows (stride ld_k): BLAS
// on the transposed queries q_t[D x rows] (stride ld_qt), or, for a handful of rows (a matrix-vector
// product, where BLAS is slow), dot products with the row-major queries q[rows x D].
ROPESCALE_CPU_CLONES void key_query_scores(const float* keys, int64_t ld_k, int64_t cols, const float* q,
                                           const float* q_t, int64_t ld_qt, int64_t rows, int64_t dim, float* out_t,
                                           int64_t ld_out) {
  if (rows > kFewRows) {
    matmul(cols, rows, dim, keys, ld_k, q_t, ld_qt, out_t, ld_out, false);
    return;
  }
  for (int64_t c = 0; c < cols; ++c) {
    const float* key = keys + c * ld_k;
    for (int64_t r = 0; r < rows; ++r) {
      const float* query = q + r * dim;
      float lanes[kLanes] = {};
      int64_t d = 0;
      for (; d + kLanes <= dim; d += kLanes)
        for (int t = 0; t < kLanes; ++t) lanes[t] += key[d + t] * query[d + t];
      float sum = 0.0f;
      for (int t = 0; t < kLanes; ++t) sum += lanes[t];
      for (; d < dim; ++d) sum += key[d] * query[d];
      out_t[c * ld_out + r] = sum;
    }
  }
}

// out = rot(x * factor) with the pair angles' cos/sin; dims past the rotary ones are only scaled.
inline void rotate_row(const float* x, float factor, const float* cos_v, const float* sin_v, int64_t pairs,
                       int64_t dim, bool interleaved, float* out) {
  for (int64_t d = 0; d < dim; ++d) out[d] = x[d] * factor;
  for (int64_t i = 0; i < pairs; ++i) {
    int a, b;
    rotary_pair_dims(static_cast<int>(i), static_cast<int>(pairs), interleaved, &a, &b);
    rotate_pair(x[a] * factor, x[b] * factor, cos_v[i], sin_v[i], &out[a], &out[b]);
  }
}

inline void sincos_row(double position, const float* inv_freq, int64_t pairs, float* cos_out, float* sin_out) {
  for (int64_t i = 0; i < pairs; ++i) rotary_sincos(position, inv_freq[i], &sin_out[i], &cos_out[i]);
}

template <typename scalar_t>
inline void load_row(const scalar_t* src, int64_t dim, float* dst) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
}

// A float view of k or v that BLAS can read block by block: the tensor itself when it already is
// float32 with rows at least D apart, a float copy otherwise.
struct FloatRows {
  at::Tensor storage;
  const float* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_l = 0;

  explicit FloatRows(const at::Tensor& t) {
    const bool usable = t.scalar_type() == at::kFloat && t.stride(3) == 1 && t.stride(2) >= t.size(3);
    storage = usable ? t : t.to(at::kFloat).contiguous();
    data = storage.data_ptr<float>();
    stride_b = storage.stride(0);
    stride_h = storage.stride(1);
    stride_l = storage.stride(2);
  }
  const float* row(int64_t b, int64_t h, int64_t l) const { return data + b * stride_b + h * stride_h + l * stride_l; }
};

template <typename scalar_t>
void rerope_attention_cpu_kernel(const ReropeArgs& a, at::Tensor& out, at::Tensor& lse) {
  const int64_t B = a.batch, Hq = a.q_heads, Hkv = a.kv_heads, Lq = a.q_len, Lk = a.k_len, D = a.head_dim;
  const int64_t P = a.rotary_pairs, group = Hq / Hkv;
  const bool leaky = a.leaky_inv != 0.0;
  const int64_t* q_pos = a.q_positions.data_ptr<int64_t>();
  const int64_t* k_pos = a.k_positions.data_ptr<int64_t>();
  const float* inv_freq = a.inv_freq.data_ptr<float>();
  const int64_t n_qb = (Lq + kBlockQ - 1) / kBlockQ, n_kb = (Lk + kBlockK - 1) / kBlockK;

  // ---- tile classification, and which key blocks each side needs rotated
  std::vector<PositionRange> q_ranges(B * n_qb), k_ranges(B * n_kb);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Lq; ++i) q_ranges[b * n_qb + i / kBlockQ].add(q_pos[b * Lq + i]);
    for (int64_t j = 0; j < Lk; ++j) k_ranges[b * n_kb + j / kBlockK].add(k_pos[b * Lk + j]);
  }
  std::vector<TileClass> tiles(B * n_qb * n_kb);
  std::vector<uint8_t> needs_near(B * n_kb, 0), needs_far(B * n_kb, 0);
  std::vector<int64_t> task_cost(B * n_qb, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t qb = 0; qb < n_qb; ++qb)
      for (int64_t kb = 0; kb < n_kb; ++kb) {
        const TileClass tc =
            rerope_classify_tile(q_ranges[b * n_qb + qb], k_ranges[b * n_kb + kb], a.window, a.causal);
        tiles[(b * n_qb + qb) * n_kb + kb] = tc;
        needs_near[b * n_kb + kb] |= tc.kind == TileKind::kNear || tc.kind == TileKind::kBand;
        needs_far[b * n_kb + kb] |= tc.kind == TileKind::kFar || tc.kind == TileKind::kBand;
        task_cost[b * n_qb + qb] += tc.kind == TileKind::kSkip ? 0 : (tc.kind == TileKind::kBand ? 3 : 2);
      }

  // ---- query rotation tables (shared by all heads): near at p, far at w + (p - w)/k; row factors
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  std::vector<float> q_near_cs(2 * B * Lq * P), q_far_cs(2 * (leaky ? B * Lq : 1) * P), row_factor(B * Lq);
  if (!leaky) sincos_row(static_cast<double>(a.window), inv_freq, P, q_far_cs.data(), q_far_cs.data() + P);
  at::parallel_for(0, B * Lq, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t p = q_pos[row];
      sincos_row(static_cast<double>(p), inv_freq, P, &q_near_cs[2 * row * P], &q_near_cs[(2 * row + 1) * P]);
      if (leaky)
        sincos_row(rerope_far_query_position(p, a.window, a.leaky_inv), inv_freq, P, &q_far_cs[2 * row * P],
                   &q_far_cs[(2 * row + 1) * P]);
      row_factor[row] = a.scale * rerope_logn_scale(p, a.logn_length, a.inv_log_train);
    }
  });

  // ---- key operands: rotated copies of the blocks that need them (uninitialised elsewhere, never read)
  const FloatRows k_raw(a.k), v_rows(a.v);
  at::Tensor k_near = at::empty({B, Hkv, Lk, D}, f32);
  at::Tensor k_far = leaky ? at::empty({B, Hkv, Lk, D}, f32) : at::Tensor();
  float* k_near_data = k_near.data_ptr<float>();
  float* k_far_data = leaky ? k_far.data_ptr<float>() : nullptr;
  at::parallel_for(0, B * n_kb, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cs(2 * P);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t b = block / n_kb, j0 = (block % n_kb) * kBlockK, j1 = std::min(Lk, j0 + kBlockK);
      const bool do_near = needs_near[block], do_far = leaky && needs_far[block];
      if (!do_near && !do_far) continue;
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t p = k_pos[b * Lk + j];
        if (do_near) {
          sincos_row(static_cast<double>(p), inv_freq, P, cs.data(), cs.data() + P);
          for (int64_t h = 0; h < Hkv; ++h)
            rotate_row(k_raw.row(b, h, j), 1.0f, cs.data(), cs.data() + P, P, D, a.interleaved,
                       k_near_data + ((b * Hkv + h) * Lk + j) * D);
        }
        if (do_far) {
          sincos_row(rerope_far_key_position(p, a.leaky_inv), inv_freq, P, cs.data(), cs.data() + P);
          for (int64_t h = 0; h < Hkv; ++h)
            rotate_row(k_raw.row(b, h, j), 1.0f, cs.data(), cs.data() + P, P, D, a.interleaved,
                       k_far_data + ((b * Hkv + h) * Lk + j) * D);
        }
      }
    }
  });

  // ---- attention tasks, heaviest first, handed out dynamically (causal rows differ in cost)
  std::vector<int64_t> tasks;
  tasks.reserve(B * Hq * n_qb);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t qb = 0; qb < n_qb; ++qb) tasks.push_back((b * Hq + h) * n_qb + qb);
  std::stable_sort(tasks.begin(), tasks.end(), [&](int64_t x, int64_t y) {
    return task_cost[(x / (Hq * n_qb)) * n_qb + x % n_qb] > task_cost[(y / (Hq * n_qb)) * n_qb + y % n_qb];
  });
  std::atomic<int64_t> next_task{0};
  const auto* q_data = a.q.data_ptr<scalar_t>();
  auto* out_data = out.data_ptr<scalar_t>();
  float* lse_data = lse.data_ptr<float>();
  const int64_t sq0 = a.q.stride(0), sq1 = a.q.stride(1), sq2 = a.q.stride(2);

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> q_row(D), acc(kBlockQ * D), row_max(kBlockQ), row_sum(kBlockQ);
    std::vector<float> q_near(kBlockQ * D), q_far(kBlockQ * D), q_near_t(D * kBlockQ), q_far_t(D * kBlockQ);
    std::vector<float> scores_t(kBlockK * kBlockQ), far_scores_t(kBlockK * kBlockQ), probs(kBlockQ * kBlockK);
    for (int64_t t = next_task.fetch_add(1); t < static_cast<int64_t>(tasks.size()); t = next_task.fetch_add(1)) {
      const int64_t task = tasks[t];
      const int64_t qb = task % n_qb, h = (task / n_qb) % Hq, b = task / (n_qb * Hq), hkv = h / group;
      const int64_t i0 = qb * kBlockQ, rows = std::min(kBlockQ, Lq - i0);
      const int64_t* row_pos = q_pos + b * Lq + i0;

      // The query block's operands for both sides, scaled by scale * log-n.
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = b * Lq + i0 + r;
        load_row(q_data + b * sq0 + h * sq1 + (i0 + r) * sq2, D, q_row.data());
        const float* near_cs = &q_near_cs[2 * row * P];
        const float* far_cs = leaky ? &q_far_cs[2 * row * P] : q_far_cs.data();
        rotate_row(q_row.data(), row_factor[row], near_cs, near_cs + P, P, D, a.interleaved, &q_near[r * D]);
        rotate_row(q_row.data(), row_factor[row], far_cs, far_cs + P, P, D, a.interleaved, &q_far[r * D]);
      }
      if (rows > kFewRows) {
        transpose_block(q_near.data(), D, rows, D, q_near_t.data(), kBlockQ);
        transpose_block(q_far.data(), D, rows, D, q_far_t.data(), kBlockQ);
      }
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);

      for (int64_t kb = 0; kb < n_kb; ++kb) {
        const TileClass tc = tiles[(b * n_qb + qb) * n_kb + kb];
        if (tc.kind == TileKind::kSkip) continue;
        const int64_t j0 = kb * kBlockK, cols = std::min(kBlockK, Lk - j0);
        const bool band = tc.kind == TileKind::kBand;
        if (tc.kind != TileKind::kFar)
          key_query_scores(k_near_data + ((b * Hkv + hkv) * Lk + j0) * D, D, cols, q_near.data(), q_near_t.data(),
                           kBlockQ, rows, D, scores_t.data(), kBlockQ);
        if (tc.kind != TileKind::kNear) {
          const float* far_keys = leaky ? k_far_data + ((b * Hkv + hkv) * Lk + j0) * D : k_raw.row(b, hkv, j0);
          key_query_scores(far_keys, leaky ? D : k_raw.stride_l, cols, q_far.data(), q_far_t.data(), kBlockQ, rows, D,
                           band ? far_scores_t.data() : scores_t.data(), kBlockQ);
        }
        if (band || tc.needs_mask)
          select_band_and_mask(scores_t.data(), far_scores_t.data(), rows, cols, kBlockQ, row_pos,
                               k_pos + b * Lk + j0, a.window, a.causal, band, tc.needs_mask);
        transpose_block(scores_t.data(), kBlockQ, cols, rows, probs.data(), kBlockK);
        online_softmax_update(probs.data(), rows, cols, kBlockK, row_max.data(), row_sum.data(), acc.data(), D);
        matmul(rows, D, cols, probs.data(), kBlockK, v_rows.row(b, hkv, j0), v_rows.stride_l, acc.data(), D, true);
      }

      for (int64_t r = 0; r < rows; ++r) {
        const int64_t out_row = (b * Hq + h) * Lq + i0 + r;
        scalar_t* o = out_data + out_row * D;
        if (row_sum[r] > 0.0f) {
          const float inv = 1.0f / row_sum[r];
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[r * D + d] * inv);
          lse_data[out_row] = row_max[r] + std::log(row_sum[r]);
        } else {  // no visible key
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(0.0f);
          lse_data[out_row] = kNegInf;
        }
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rerope_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, const at::Tensor& q_positions,
                                                        const at::Tensor& k_positions, const at::Tensor& inv_freq,
                                                        int64_t window, double leaky_k, double scale,
                                                        int64_t logn_length, bool causal, bool interleaved) {
  const ReropeArgs args = check_rerope_attention_args(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k,
                                                      scale, logn_length, causal, interleaved);
  TORCH_CHECK(args.q.device().is_cpu(), "rerope_attention: the CPU kernel got tensors on ", args.q.device());
  at::Tensor out = at::empty({args.batch, args.q_heads, args.q_len, args.head_dim}, args.q.options());
  at::Tensor lse = at::empty({args.batch, args.q_heads, args.q_len}, args.q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  if (args.k_len == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.q.scalar_type(), "rerope_attention_cpu",
                                  [&] { rerope_attention_cpu_kernel<scalar_t>(args, out, lse); });
  return {out, lse};
}

}  // namespace ropescale
