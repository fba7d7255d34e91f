// Framework-free RoPE frequency math, in double precision.
//
// Every scaled inv_freq table ropescale offers is built from the functions here; the ATen ops in
// csrc/frequencies.cpp only validate arguments and copy results into tensors. Keeping the math
// free of torch lets Catch2 test it directly (tests/cpp) and lets kernels reuse the scalar parts.
//
// Notation (../shared/DESIGN.md): rotary dim d, base b, pair i in [0, d/2), theta_i = b^(-2i/d),
// wavelength lambda_i = 2*pi/theta_i, original context L, scale factor s.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

namespace ropescale {
namespace freq {

// Long loops (the research quantities run up to billions of steps) call `poll` every
// kPollMask + 1 steps when one is given: the op layer passes one that checks for Ctrl-C and throws
// to stop the loop. Empty by default (C++ tests, callers that need no interruption).
using Poll = std::function<void()>;
inline constexpr int64_t kPollMask = 4095;


constexpr double kTwoPi = 6.283185307179586476925286766559;

// theta_i = base^(-2i/dim) for i in [0, dim/2).
inline std::vector<double> default_inv_freq(int64_t dim, double base) {
  std::vector<double> inv_freq(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i)
    inv_freq[i] = std::pow(base, -static_cast<double>(2 * i) / static_cast<double>(dim));
  return inv_freq;
}

// Position interpolation (Chen et al.): every frequency divided by the factor.
inline std::vector<double> linear_inv_freq(int64_t dim, double base, double factor) {
  std::vector<double> inv_freq = default_inv_freq(dim, base);
  for (double& f : inv_freq) f /= factor;
  return inv_freq;
}

// transformers' `proportional` (Gemma 4): over a head of head_dim features, the first
// floor(p * head_dim / 2) pairs take theta_i = base^(-2i/head_dim) (the exponent over the FULL head
// dim, not over the rotated part) and the remaining pairs frequency 0 (not rotated: cos 1, sin 0);
// the whole table is divided by the factor. Always head_dim/2 entries.
inline int64_t proportional_rotated_pairs(int64_t head_dim, double partial_rotary_factor) {
  // transformers: int(partial_rotary_factor * head_dim // 2), the floor of the double product over 2.
  return static_cast<int64_t>(std::floor(partial_rotary_factor * static_cast<double>(head_dim) / 2.0));
}

inline std::vector<double> proportional_inv_freq(int64_t head_dim, double base, double factor,
                                                 double partial_rotary_factor) {
  std::vector<double> inv_freq = default_inv_freq(head_dim, base);
  const int64_t rotated = proportional_rotated_pairs(head_dim, partial_rotary_factor);
  for (int64_t i = 0; i < head_dim / 2; ++i) inv_freq[i] = i < rotated ? inv_freq[i] / factor : 0.0;
  return inv_freq;
}

// NTK-aware (bloc97): base b * s^(d/(d-2)), so the lowest frequency is interpolated by exactly s
// and the highest is unchanged.
inline double ntk_base(int64_t dim, double base, double factor) {
  return base * std::pow(factor, static_cast<double>(dim) / static_cast<double>(dim - 2));
}

// Dynamic NTK (emozilla), transformers' rule: the effective factor grows with the length,
// s_eff = s*len/L - (s-1), and the table is the default one while len <= L.
inline double dynamic_ntk_base(int64_t dim, double base, double factor, int64_t original_max_position,
                               int64_t seq_len) {
  if (seq_len <= original_max_position) return base;
  const double effective = factor * static_cast<double>(seq_len) / static_cast<double>(original_max_position) -
                           (factor - 1.0);
  return base * std::pow(effective, static_cast<double>(dim) / static_cast<double>(dim - 2));
}

// YaRN: the (fractional) dimension index whose pair turns `num_rotations` times over the
// original context, i.e. the inverse of r(d) = L / lambda_d.
inline double yarn_correction_dim(double num_rotations, int64_t dim, double base, int64_t original_max_position) {
  return static_cast<double>(dim) *
         std::log(static_cast<double>(original_max_position) / (num_rotations * kTwoPi)) / (2.0 * std::log(base));
}

// YaRN: the dimension range [low, high] over which the ramp goes from extrapolation to
// interpolation. beta_fast (many turns) gives the low end; truncate floors/ceils as the reference
// implementation does. Clamped to [0, dim-1] as transformers does.
inline std::pair<double, double> yarn_correction_range(double beta_fast, double beta_slow, int64_t dim, double base,
                                                       int64_t original_max_position, bool truncate) {
  double low = yarn_correction_dim(beta_fast, dim, base, original_max_position);
  double high = yarn_correction_dim(beta_slow, dim, base, original_max_position);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  return {std::max(low, 0.0), std::min(high, static_cast<double>(dim - 1))};
}

// gamma for pair i: 0 below `low` (keep theta), 1 above `high` (theta/s), linear in between.
// A degenerate range is widened by 0.001 as in the reference code, so the ramp is a step there.
inline double yarn_ramp(double i, double low, double high) {
  if (low == high) high += 0.001;
  return std::clamp((i - low) / (high - low), 0.0, 1.0);
}

// YaRN's NTK-by-parts table: h(theta_i) = gamma_i * theta_i / s + (1 - gamma_i) * theta_i.
inline std::vector<double> yarn_inv_freq(int64_t dim, double base, double factor, int64_t original_max_position,
                                         double beta_fast, double beta_slow, bool truncate) {
  const auto [low, high] = yarn_correction_range(beta_fast, beta_slow, dim, base, original_max_position, truncate);
  std::vector<double> inv_freq = default_inv_freq(dim, base);
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double gamma = yarn_ramp(static_cast<double>(i), low, high);
    inv_freq[i] = gamma * (inv_freq[i] / factor) + (1.0 - gamma) * inv_freq[i];
  }
  return inv_freq;
}

// Grok's yarn_log (SGLang 0.5.23, python/sglang/srt/models/grok.py, ScalingRotaryEmbedding._compute_inv_freq):
// YaRN's truncated correction range, Grok's own ramp (its _yarn_linear_ramp_mask widens a degenerate range
// DOWNWARD, low -= 0.001, where yarn_ramp widens it upward), the mask m_i = (1 - ramp_i) * extrapolation_factor,
// and the two tables blended geometrically: exp(m_i ln(theta_i) + (1 - m_i) ln(theta_i / s)).
inline std::vector<double> yarn_log_inv_freq(int64_t dim, double base, double factor, int64_t original_max_position,
                                             double beta_fast, double beta_slow, double extrapolation_factor) {
  auto [low, high] = yarn_correction_range(beta_fast, beta_slow, dim, base, original_max_position, true);
  if (low == high) low -= 0.001;
  std::vector<double> inv_freq = default_inv_freq(dim, base);
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double mask = (1.0 - ramp) * extrapolation_factor;
    inv_freq[i] = std::exp(std::log(inv_freq[i]) * mask + std::log(inv_freq[i] / factor) * (1.0 - mask));
  }
  return inv_freq;
}

// YaRN's mscale: 0.1 * mscale * ln(s) + 1, and 1 for s <= 1.
inline double yarn_mscale(double factor, double mscale) {
  if (factor <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(factor) + 1.0;
}

// The factor applied to cos and sin (sqrt(1/t) in the paper). As transformers: the DeepSeek
// variant mscale/mscale_all_dim when both are non-zero, else 0.1*ln(s)+1.
inline double yarn_attention_factor(double factor, double mscale, double mscale_all_dim) {
  if (mscale != 0.0 && mscale_all_dim != 0.0) return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim);
  return yarn_mscale(factor, 1.0);
}

// Llama 3.1: wavelengths longer than L/low_freq_factor are interpolated by s, shorter than
// L/high_freq_factor kept, and a smooth blend in between.
inline std::vector<double> llama3_inv_freq(int64_t dim, double base, double factor, double low_freq_factor,
                                           double high_freq_factor, int64_t original_max_position) {
  const double old_len = static_cast<double>(original_max_position);
  const double low_freq_wavelen = old_len / low_freq_factor;
  const double high_freq_wavelen = old_len / high_freq_factor;
  std::vector<double> inv_freq = default_inv_freq(dim, base);
  for (double& f : inv_freq) {
    const double wavelen = kTwoPi / f;
    if (wavelen > low_freq_wavelen) {
      f = f / factor;
    } else if (wavelen >= high_freq_wavelen) {
      const double smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
      f = (1.0 - smooth) * f / factor + smooth * f;
    }
  }
  return inv_freq;
}

// LongRoPE: theta_i / ext_i with the long factors past the original context, the short ones
// otherwise (transformers picks long when seq_len > L).
inline std::vector<double> longrope_inv_freq(int64_t dim, double base, const std::vector<double>& short_factor,
                                             const std::vector<double>& long_factor, int64_t original_max_position,
                                             int64_t seq_len) {
  const std::vector<double>& ext = seq_len > original_max_position ? long_factor : short_factor;
  std::vector<double> inv_freq = default_inv_freq(dim, base);
  for (int64_t i = 0; i < dim / 2; ++i) inv_freq[i] /= ext[i];
  return inv_freq;
}

// LongRoPE's attention factor: sqrt(1 + ln(s)/ln(L)), 1 for s <= 1.
inline double longrope_attention_factor(double factor, int64_t original_max_position) {
  if (factor <= 1.0) return 1.0;
  return std::sqrt(1.0 + std::log(factor) / std::log(static_cast<double>(original_max_position)));
}

// Resonance RoPE (Algorithm 1): wavelength rounded to the nearest integer. Returns theta itself
// when the dimension is not rounded: non-finite wavelength (theta == 0), or, with a positive
// `original_max_position`, a post-critical one (wavelength >= L). Throws when rounding would
// give a zero wavelength.
inline bool resonance_rounds(double theta, int64_t original_max_position) {
  const double wavelen = kTwoPi / theta;
  if (!std::isfinite(wavelen)) return false;
  return original_max_position <= 0 || wavelen < static_cast<double>(original_max_position);
}

inline double resonance_theta(double theta) {
  const double rounded = std::nearbyint(kTwoPi / theta);
  if (rounded < 1.0) throw std::invalid_argument("wavelength rounds to 0: inv_freq must be < 4*pi");
  return kTwoPi / rounded;
}

// B_m = sum_i cos(m * theta_i) for m = 0..max_distance (Men et al.).
inline std::vector<double> similarity_decay(const std::vector<double>& inv_freq, int64_t max_distance) {
  std::vector<double> curve(max_distance + 1);
  for (int64_t m = 0; m <= max_distance; ++m) {
    double sum = 0.0;
    for (double theta : inv_freq) sum += std::cos(static_cast<double>(m) * theta);
    curve[m] = sum;
  }
  return curve;
}

// First distance m in [0, max_distance] with B_m < 0, or -1 when there is none. Stops at the
// first negative term, which is what makes the base search fast for bad bases.
inline int64_t first_negative_distance(const std::vector<double>& inv_freq, int64_t max_distance,
                                       const Poll& poll = {}) {
  for (int64_t m = 0; m <= max_distance; ++m) {
    if (poll && (m & kPollMask) == 0) poll();
    double sum = 0.0;
    for (double theta : inv_freq) sum += std::cos(static_cast<double>(m) * theta);
    if (sum < 0.0) return m;
  }
  return -1;
}

// L_theta = sup{ L <= max_distance : B_m >= 0 for all m in [0, L] }.
inline int64_t effective_context_length(const std::vector<double>& inv_freq, int64_t max_distance,
                                        const Poll& poll = {}) {
  const int64_t first = first_negative_distance(inv_freq, max_distance, poll);
  return first < 0 ? max_distance : first - 1;
}

// First m in [0, max_distance] with B_m < 0 (or -1), for the base search: cos(m*theta) and
// sin(m*theta) advance by one rotation per step (vectorisable, no libm call), re-seeded from
// std::cos/std::sin every 1024 steps so the drift stays near 1e-13.
inline int64_t first_negative_distance_fast(const std::vector<double>& inv_freq, int64_t max_distance,
                                            const Poll& poll = {}) {
  const size_t n = inv_freq.size();
  std::vector<double> c(n), s(n), step_c(n), step_s(n);
  for (size_t i = 0; i < n; ++i) {
    step_c[i] = std::cos(inv_freq[i]);
    step_s[i] = std::sin(inv_freq[i]);
  }
  for (int64_t m = 0; m <= max_distance; ++m) {
    if (m % 1024 == 0) {
      if (poll && (m & kPollMask) == 0) poll();
      for (size_t i = 0; i < n; ++i) {
        c[i] = std::cos(static_cast<double>(m) * inv_freq[i]);
        s[i] = std::sin(static_cast<double>(m) * inv_freq[i]);
      }
    }
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) sum += c[i];
    if (sum < 0.0) return m;
    for (size_t i = 0; i < n; ++i) {
      const double next_c = c[i] * step_c[i] - s[i] * step_s[i];
      s[i] = s[i] * step_c[i] + c[i] * step_s[i];
      c[i] = next_c;
    }
  }
  return -1;
}

// B_m at one distance, exactly.
inline double similarity_at(const std::vector<double>& inv_freq, int64_t m) {
  double sum = 0.0;
  for (double theta : inv_freq) sum += std::cos(static_cast<double>(m) * theta);
  return sum;
}

// True when B_m >= 0 for every m in [0, context_length] at this base (exact cos).
inline bool base_supports_context(double base, int64_t dim, int64_t context_length, const Poll& poll = {}) {
  return first_negative_distance(default_inv_freq(dim, base), context_length, poll) < 0;
}

// Result of the lower-bound search: the smallest good base found, and the largest bad base
// below it (the bracket's other end, so callers can see the resolution).
struct BaseBound {
  double base;
  double bad_below;
};

// Decides "B_m >= 0 for all m <= L" for many nearby bases. Neighbouring bad bases usually fail
// at the same few distances, so those distances are tried first (a handful of cos calls) before
// a full fast scan; a base the fast scan calls good is confirmed with exact cos.
class BaseChecker {
 public:
  BaseChecker(int64_t dim, int64_t context_length, Poll poll = {})
      : dim_(dim), length_(context_length), poll_(std::move(poll)) {}

  bool good(double base) {
    const std::vector<double> theta = default_inv_freq(dim_, base);
    for (size_t k = 0; k < witnesses_.size(); ++k) {
      if (similarity_at(theta, witnesses_[k]) < 0.0) {
        std::rotate(witnesses_.begin(), witnesses_.begin() + k, witnesses_.begin() + k + 1);  // most recent first
        return false;
      }
    }
    int64_t m = first_negative_distance_fast(theta, length_, poll_);
    if (m < 0) m = first_negative_distance(theta, length_, poll_);  // confirm exactly
    if (m < 0) return true;
    witnesses_.insert(witnesses_.begin(), m);
    if (witnesses_.size() > kMaxWitnesses) witnesses_.pop_back();
    return false;
  }

 private:
  static constexpr size_t kMaxWitnesses = 64;
  int64_t dim_;
  int64_t length_;
  std::vector<int64_t> witnesses_;
  Poll poll_;
};

// base_L = inf{ base : B_m >= 0 for all m in [0, L] }. The good set is not an interval (a larger
// base can fail again, and narrow good islands sit below the main good range), so this never
// bisects over a wide bracket: it walks up a geometric grid from base 2 with ratio `grid_ratio`
// and refines by bisection only inside the grid step where the first good base appears. A good
// island narrower than one grid step (default 0.1%) can be missed.
inline BaseBound base_lower_bound(int64_t context_length, int64_t dim, double grid_ratio = 1.001,
                                  double rel_tol = 1e-7, double max_base = 1e15, const Poll& poll = {}) {
  BaseChecker checker(dim, context_length, poll);
  double lo = 2.0, hi = 2.0;
  while (!checker.good(hi)) {
    lo = hi;
    hi *= grid_ratio;
    if (hi > max_base) throw std::runtime_error("base_lower_bound: no base up to 1e15 supports this context");
  }
  if (hi == lo) return {hi, hi};  // base 2 itself is good (tiny contexts)
  // Inside one grid step: bisect, keeping `hi` good and `lo` bad.
  while ((hi - lo) > rel_tol * hi) {
    const double mid = 0.5 * (lo + hi);
    if (checker.good(mid))
      hi = mid;
    else
      lo = mid;
  }
  return {hi, lo};
}

// Smallest circular distance between angles on [0, 2*pi).
inline double circular_distance(double a, double b) {
  const double d = std::fabs(a - b);
  return std::min(d, kTwoPi - d);
}

// Resonance feature gap of one pair with frequency theta: the largest distance, over test
// positions n in [train_length, test_length), from the rotated unit feature at n to the nearest
// one seen in training (m < train_length). For unit features |f(m) - f(n)| = 2 sin(delta/2)
// with delta the angle between them. Computed by sorting the training angles once.
inline double feature_gap(double theta, int64_t train_length, int64_t test_length, const Poll& poll = {}) {
  if (theta == 0.0 || test_length <= train_length || train_length <= 0) return 0.0;
  std::vector<double> seen(train_length);
  for (int64_t m = 0; m < train_length; ++m) seen[m] = std::fmod(static_cast<double>(m) * theta, kTwoPi);
  std::sort(seen.begin(), seen.end());
  double gap = 0.0;
  for (int64_t n = train_length; n < test_length; ++n) {
    if (poll && ((n - train_length) & kPollMask) == 0) poll();
    const double angle = std::fmod(static_cast<double>(n) * theta, kTwoPi);
    const auto above = std::lower_bound(seen.begin(), seen.end(), angle);
    // Nearest neighbours on the circle: the sorted successor and predecessor, wrapping around.
    const double next = above == seen.end() ? seen.front() : *above;
    const double prev = above == seen.begin() ? seen.back() : *(above - 1);
    const double delta = std::min(circular_distance(angle, next), circular_distance(angle, prev));
    gap = std::max(gap, 2.0 * std::sin(0.5 * delta));
  }
  return gap;
}

}  // namespace freq
}  // namespace ropescale
