// Catch2 tests of the framework-free frequency math (csrc/include/ropescale/frequencies.h).
// Expected values are derived here from the papers' definitions, not from the code under test.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <cmath>

#include "ropescale/frequencies.h"

using namespace ropescale::freq;

TEST_CASE("default table is base^(-2i/d)", "[frequencies]") {
  for (int64_t dim : {2, 8, 64, 128}) {
    const auto t = default_inv_freq(dim, 10000.0);
    REQUIRE(t.size() == static_cast<size_t>(dim / 2));
    CHECK(t[0] == 1.0);
    for (size_t i = 1; i < t.size(); ++i) {
      CHECK(t[i] < t[i - 1]);
      CHECK(t[i] == Approx(std::exp(-std::log(10000.0) * 2.0 * i / dim)).epsilon(1e-14));
    }
  }
}

TEST_CASE("NTK-aware base interpolates the lowest frequency by exactly s", "[frequencies]") {
  for (int64_t dim : {16, 64, 128}) {
    for (double s : {2.0, 8.0, 32.0}) {
      const auto plain = default_inv_freq(dim, 10000.0);
      const auto ntk = default_inv_freq(dim, ntk_base(dim, 10000.0, s));
      CHECK(ntk[0] == plain[0]);  // highest frequency unchanged
      // lowest: theta_{d/2-1} * s^(-(d-2)/d * d/(d-2)) = theta / s
      CHECK(ntk.back() == Approx(plain.back() / s).epsilon(1e-12));
    }
  }
}

TEST_CASE("proportional: base^(-2i/head_dim)/s on the first floor(p*head_dim/2) pairs, 0 after", "[proportional]") {
  // Gemma 4's full-attention layers: head_dim 256 (here also 8 and 64), p = 0.25.
  for (int64_t head_dim : {8, 64, 256}) {
    for (double p : {0.25, 0.5, 1.0}) {
      for (double s : {1.0, 8.0}) {
        const auto t = proportional_inv_freq(head_dim, 1e6, s, p);
        REQUIRE(t.size() == static_cast<size_t>(head_dim / 2));  // the full head, whatever p is
        const auto rotated = static_cast<size_t>(p * head_dim / 2);  // p*head_dim/2 is an integer here
        CHECK(proportional_rotated_pairs(head_dim, p) == static_cast<int64_t>(rotated));
        for (size_t i = 0; i < t.size(); ++i) {
          if (i < rotated) {
            // The exponent runs over the full head_dim, not over the 2*rotated features.
            CHECK(t[i] == Approx(std::exp(-std::log(1e6) * 2.0 * i / head_dim) / s).epsilon(1e-14));
          } else {
            CHECK(t[i] == 0.0);
          }
        }
      }
    }
  }
  // p = 1 is linear scaling.
  const auto linear = linear_inv_freq(64, 1e4, 4.0);
  const auto full = proportional_inv_freq(64, 1e4, 4.0, 1.0);
  for (size_t i = 0; i < full.size(); ++i) CHECK(full[i] == linear[i]);
  // transformers' int(p * head_dim // 2): the floor (0.3 * 10 = 3 -> 1 pair; 0.3 * 6 = 1.8 -> none).
  CHECK(proportional_rotated_pairs(10, 0.3) == 1);
  CHECK(proportional_rotated_pairs(6, 0.3) == 0);
  CHECK(proportional_rotated_pairs(256, 0.25) == 32);
  const auto none = proportional_inv_freq(6, 1e4, 1.0, 0.3);
  for (double theta : none) CHECK(theta == 0.0);
}

TEST_CASE("dynamic NTK is the default table up to the original length", "[frequencies]") {
  CHECK(dynamic_ntk_base(128, 1e4, 4.0, 4096, 100) == 1e4);
  CHECK(dynamic_ntk_base(128, 1e4, 4.0, 4096, 4096) == 1e4);
  // at len = s*L the effective factor is s*s - (s-1)
  const double expected = 1e4 * std::pow(4.0 * 4.0 - 3.0, 128.0 / 126.0);
  CHECK(dynamic_ntk_base(128, 1e4, 4.0, 4096, 4 * 4096) == Approx(expected).epsilon(1e-14));
}

TEST_CASE("YaRN correction dimension inverts r(d) = L / lambda_d", "[yarn]") {
  // The pair at the returned (fractional) index turns exactly num_rotations times over L.
  for (double rot : {1.0, 32.0, 7.5}) {
    const double d = yarn_correction_dim(rot, 128, 1e4, 4096);
    const double theta = std::pow(1e4, -2.0 * d / 128.0);
    CHECK(4096.0 / (kTwoPi / theta) == Approx(rot).epsilon(1e-12));
  }
}

TEST_CASE("YaRN correction range floors/ceils and clamps", "[yarn]") {
  const double low = yarn_correction_dim(32, 128, 1e4, 4096);
  const double high = yarn_correction_dim(1, 128, 1e4, 4096);
  auto [tl, th] = yarn_correction_range(32, 1, 128, 1e4, 4096, true);
  CHECK(tl == std::floor(low));
  CHECK(th == std::ceil(high));
  auto [ul, uh] = yarn_correction_range(32, 1, 128, 1e4, 4096, false);
  CHECK(ul == low);
  CHECK(uh == high);
  // A tiny original length puts the range below 0 and a huge one past dim-1: clamped.
  auto [cl, ch] = yarn_correction_range(32, 1, 16, 1e4, 1, true);
  CHECK(cl == 0.0);
  auto [dl, dh] = yarn_correction_range(32, 1, 16, 2.0, 1 << 30, true);
  CHECK(dh == 15.0);
  (void)ch;
  (void)dl;
}

TEST_CASE("YaRN ramp: 0 below, 1 above, linear between, step when degenerate", "[yarn]") {
  CHECK(yarn_ramp(0, 2, 6) == 0.0);
  CHECK(yarn_ramp(2, 2, 6) == 0.0);
  CHECK(yarn_ramp(3, 2, 6) == 0.25);
  CHECK(yarn_ramp(6, 2, 6) == 1.0);
  CHECK(yarn_ramp(60, 2, 6) == 1.0);
  CHECK(yarn_ramp(4, 4, 4) == 0.0);
  CHECK(yarn_ramp(5, 4, 4) == 1.0);
}

TEST_CASE("YaRN table: high frequencies kept, low ones divided by s", "[yarn]") {
  const int64_t dim = 128;
  const double s = 16.0;
  const auto plain = default_inv_freq(dim, 1e4);
  const auto yarn = yarn_inv_freq(dim, 1e4, s, 4096, 32, 1, true);
  const auto [low, high] = yarn_correction_range(32, 1, dim, 1e4, 4096, true);
  for (int64_t i = 0; i < dim / 2; ++i) {
    if (i <= low) CHECK(yarn[i] == plain[i]);
    if (i >= high) CHECK(yarn[i] == Approx(plain[i] / s).epsilon(1e-15));
    if (i > low && i < high) {
      CHECK(yarn[i] < plain[i]);
      CHECK(yarn[i] > plain[i] / s);
    }
  }
}

TEST_CASE("Grok's yarn_log: kept and interpolated ends, a geometric blend between, weighted by e", "[yarn_log]") {
  const int64_t dim = 128;
  const double s = 16.0;
  const auto plain = default_inv_freq(dim, 1e4);
  const auto [low, high] = yarn_correction_range(8, 1, dim, 1e4, 8192, true);
  for (double e : {1.0, 0.5, 0.0}) {
    const auto grok = yarn_log_inv_freq(dim, 1e4, s, 8192, 8, 1, e);
    for (int64_t i = 0; i < dim / 2; ++i) {
      // theta^m (theta/s)^(1-m) = theta / s^(1-m), m = (1 - ramp) e
      const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
      CHECK(grok[i] == Approx(plain[i] / std::pow(s, 1.0 - (1.0 - ramp) * e)).epsilon(1e-13));
      if (i >= high) CHECK(grok[i] == Approx(plain[i] / s).epsilon(1e-13));
      if (i <= low) CHECK(grok[i] == Approx(plain[i] / std::pow(s, 1.0 - e)).epsilon(1e-13));
    }
  }
  // A range clamped to [0, 0] (L <= 2 pi beta_slow): Grok widens it downward, so pair 0 is interpolated too,
  // where YaRN's ramp (widened upward) keeps it.
  const auto clamped = yarn_log_inv_freq(8, 1e4, 4.0, 6, 32, 1, 1.0);
  CHECK(clamped[0] == Approx(0.25).epsilon(1e-15));
  CHECK(yarn_inv_freq(8, 1e4, 4.0, 6, 32, 1, true)[0] == 1.0);
}

TEST_CASE("YaRN attention factor", "[yarn]") {
  CHECK(yarn_attention_factor(16, 1, 0) == Approx(0.1 * std::log(16.0) + 1).epsilon(1e-15));
  CHECK(yarn_attention_factor(1, 1, 0) == 1.0);
  CHECK(yarn_attention_factor(0.5, 1, 0) == 1.0);
  // DeepSeek variant: equal mscales cancel.
  CHECK(yarn_attention_factor(40, 0.707, 0.707) == Approx(1.0).epsilon(1e-15));
  CHECK(yarn_attention_factor(40, 1, 0.5) ==
        Approx((0.1 * std::log(40.0) + 1) / (0.05 * std::log(40.0) + 1)).epsilon(1e-15));
}

TEST_CASE("Llama 3.1 rule: three bands", "[llama3]") {
  const auto plain = default_inv_freq(128, 5e5);
  const auto l3 = llama3_inv_freq(128, 5e5, 8, 1, 4, 8192);
  for (size_t i = 0; i < plain.size(); ++i) {
    const double wavelen = kTwoPi / plain[i];
    if (wavelen < 8192.0 / 4) CHECK(l3[i] == plain[i]);
    if (wavelen > 8192.0) CHECK(l3[i] == Approx(plain[i] / 8).epsilon(1e-15));
    if (wavelen > 2048.0 && wavelen < 8192.0) {
      CHECK(l3[i] < plain[i]);
      CHECK(l3[i] > plain[i] / 8);
    }
  }
}

TEST_CASE("Resonance rounding gives integer wavelengths", "[resonance]") {
  const auto plain = default_inv_freq(128, 1e4);
  for (double theta : plain) {
    const double rounded = resonance_theta(theta);
    const double wavelen = kTwoPi / rounded;
    CHECK(std::fabs(wavelen - std::nearbyint(wavelen)) < 1e-9);
    CHECK(std::fabs(wavelen - kTwoPi / theta) <= 0.5 + 1e-12);
  }
  // pre-critical only: wavelength >= L is left alone, infinite wavelengths always.
  CHECK(resonance_rounds(1.0, 0));
  CHECK(resonance_rounds(1.0, 100));           // wavelength 6.28 < 100
  CHECK_FALSE(resonance_rounds(1e-4, 100));    // wavelength 62832 >= 100
  CHECK_FALSE(resonance_rounds(0.0, 0));       // theta 0: nothing to round
  CHECK_THROWS(resonance_theta(20.0));         // wavelength 0.31 rounds to 0
}

TEST_CASE("similarity decay and effective context", "[base-bound]") {
  const std::vector<double> theta{1.0, 0.5};
  const auto curve = similarity_decay(theta, 10);
  for (int m = 0; m <= 10; ++m) CHECK(curve[m] == Approx(std::cos(m * 1.0) + std::cos(m * 0.5)).margin(1e-15));
  // cos(m) + cos(m/2): 2, 1.42, 0.12, -0.92 -> first negative at m = 3
  CHECK(first_negative_distance(theta, 10) == 3);
  CHECK(effective_context_length(theta, 10) == 2);
  CHECK(effective_context_length(theta, 1) == 1);  // no negative term within range
}

TEST_CASE("base lower bound: good at the bound, bad 1% below", "[base-bound]") {
  for (int64_t len : {64, 1000, 4096}) {
    const BaseBound bound = base_lower_bound(len, 128);
    CHECK(base_supports_context(bound.base, 128, len));
    CHECK_FALSE(base_supports_context(bound.bad_below, 128, len));
    CHECK(bound.base - bound.bad_below <= 1e-6 * bound.base);
    CHECK_FALSE(base_supports_context(0.99 * bound.base, 128, len));
  }
}

TEST_CASE("base lower bound respects a good set that is not an interval", "[base-bound]") {
  // Find a length where some base above the bound fails again, and check the search still
  // returns a good base below that failure (a bisection over a wide bracket would not).
  bool found_non_interval = false;
  for (int64_t len = 200; len <= 2000 && !found_non_interval; len += 100) {
    const BaseBound bound = base_lower_bound(len, 64);
    for (double b = bound.base; b < bound.base * 3; b *= 1.002) {
      if (!base_supports_context(b, 64, len)) {
        found_non_interval = true;
        CHECK(bound.base < b);
        CHECK(base_supports_context(bound.base, 64, len));
        break;
      }
    }
  }
  CHECK(found_non_interval);
}

TEST_CASE("feature gap: zero for rounded pre-critical wavelengths, positive for plain RoPE", "[resonance]") {
  const int64_t train = 64, test = 256;
  const double plain = std::pow(1e4, -2.0 * 3 / 64);  // wavelength ~ 10.4 < 64
  const double rounded = resonance_theta(plain);
  CHECK(feature_gap(rounded, train, test) < 1e-9);
  CHECK(feature_gap(plain, train, test) > 1e-3);
  // A period longer than the training length leaves positions never seen: a large gap.
  CHECK(feature_gap(kTwoPi / 1000.0, train, test) > 0.5);
  CHECK(feature_gap(0.0, train, test) == 0.0);
}
