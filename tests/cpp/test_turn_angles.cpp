// Catch2 tests of the fixed-point key angles (csrc/include/ropescale/turn_angles.h) that the CUDA ReRoPE
// kernels rotate keys with: against sin/cos of the exact angle (the product position * inv_freq is
// exact in long double's 64-bit significand up to |position| < 2^40), next to rotary_sincos, the
// double-precision reduction every other path uses (docs/DESIGN.md, "Input rules").
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "ropescale/rotary_math.h"
#include "ropescale/turn_angles.h"

namespace {

constexpr long double kTwoPi = 6.283185307179586476925286766559005768L;

// sin/cos of position * inv_freq * multiplier, from the exact product (multiplier a power of two).
void exact_sincos(int64_t position, float inv_freq, long double multiplier, long double* s, long double* c) {
  const long double angle = static_cast<long double>(position) * static_cast<long double>(inv_freq) * multiplier;
  const long double reduced = std::fmod(angle, kTwoPi);
  *s = std::sin(reduced);
  *c = std::cos(reduced);
}

// The dim-128 / base-1e4 table of DESIGN's figures.
std::vector<float> table_128() {
  std::vector<float> t;
  for (int i = 0; i < 64; ++i) t.push_back(static_cast<float>(std::pow(10000.0, -2.0 * i / 128)));
  return t;
}

struct Errors {
  double turns = 0, rotary = 0;
};

// Largest |sin - exact| and |cos - exact| over positions drawn below 2^bits (and 2^bits - 1 itself).
Errors max_errors(int bits, long double multiplier, int samples, unsigned seed) {
  std::mt19937_64 gen(seed);
  Errors e;
  for (const float inv_freq : table_128()) {
    const unsigned long long rate = ropescale::turn_rate(inv_freq, static_cast<double>(multiplier));
    for (int i = 0; i < samples; ++i) {
      const int64_t position = i == 0 ? (int64_t{1} << bits) - 1 : static_cast<int64_t>(gen() >> (64 - bits));
      long double s, c;
      exact_sincos(position, inv_freq, multiplier, &s, &c);
      float ts, tc;
      ropescale::position_sincos(position, rate, &ts, &tc);
      e.turns = std::max(e.turns, static_cast<double>(std::max(std::fabs(ts - s), std::fabs(tc - c))));
      float rs, rc;
      ropescale::rotary_sincos(static_cast<double>(position) * static_cast<double>(multiplier), inv_freq, &rs, &rc);
      e.rotary = std::max(e.rotary, static_cast<double>(std::max(std::fabs(rs - s), std::fabs(rc - c))));
    }
  }
  return e;
}

}  // namespace

TEST_CASE("key angles from turn rates: cos/sin error against the exact angle, up to 2^31", "[turn_angles]") {
  // The figures DESIGN quotes (printed): the fixed-point angles stay at ~1.3 ulp of the float result at
  // every position up to 2^31; the double-precision reduction grows past 2^29.
  for (const int bits : {12, 20, 29, 31}) {
    const Errors e = max_errors(bits, 1.0L, 3000, 100 + bits);
    std::printf("turn_angles: positions < 2^%d: max |error| %.3g (rotary_sincos: %.3g)\n", bits, e.turns, e.rotary);
    INFO("2^" << bits << ": turn rates " << e.turns << ", rotary_sincos " << e.rotary);
    CHECK(e.turns < 8.5e-8);
    CHECK(e.turns < e.rotary);
  }
  // Up to 2^40, the double-precision product is no longer exact; the fixed-point angle's only error is
  // the rate's rounding, position * 2^-65 turns (1.9e-7 rad at 2^40).
  const Errors far = max_errors(40, 1.0L, 300, 7);
  std::printf("turn_angles: positions < 2^40: max |error| %.3g (rotary_sincos: %.3g)\n", far.turns, far.rotary);
  CHECK(far.turns < 2.5e-7);
}

TEST_CASE("key angles: Leaky ReRoPE's far side at p/k from its own rate", "[turn_angles]") {
  for (const long double k : {2.0L, 8.0L, 16.0L}) {  // 1/k exact in double: the exact angle is p * theta / k
    const Errors e = max_errors(31, 1.0L / k, 1000, 300 + static_cast<unsigned>(k));
    INFO("k = " << static_cast<double>(k) << ": " << e.turns);
    CHECK(e.turns < 8.5e-8);
  }
}

TEST_CASE("key angles: sincos_turns on the quarter turns is exact, and covers the whole turn", "[turn_angles]") {
  float s, c;
  ropescale::sincos_turns(0, &s, &c);
  CHECK((s == 0.0f && c == 1.0f));
  ropescale::sincos_turns(1ull << 62, &s, &c);
  CHECK((s == 1.0f && c == 0.0f));
  ropescale::sincos_turns(1ull << 63, &s, &c);
  CHECK((s == 0.0f && c == -1.0f));
  ropescale::sincos_turns(3ull << 62, &s, &c);
  CHECK((s == -1.0f && c == 0.0f));
  std::mt19937_64 gen(5);
  double worst = 0;
  for (int i = 0; i < 200000; ++i) {
    const unsigned long long turns = gen();
    const long double angle = static_cast<long double>(turns) * (kTwoPi / 18446744073709551616.0L);
    ropescale::sincos_turns(turns, &s, &c);
    worst = std::max(worst, static_cast<double>(std::max(std::fabs(s - std::sin(angle)), std::fabs(c - std::cos(angle)))));
  }
  CHECK(worst < 8.5e-8);
}

TEST_CASE("turn rates: the fraction of a turn to 2^-64, for any sign and size of inv_freq", "[turn_angles]") {
  std::mt19937 gen(9);
  std::uniform_real_distribution<float> wide(-40.0f, 40.0f);
  for (int i = 0; i < 20000; ++i) {
    const float inv_freq = i % 3 == 0 ? std::ldexp(1.0f + std::fabs(wide(gen)) / 40.0f, -(i % 60)) : wide(gen);
    long double exact = static_cast<long double>(inv_freq) / kTwoPi;
    exact -= std::floor(exact);
    // in [0, 2^64), to ~1 + |inv_freq / 2 pi| units (the long double quotient's own rounding)
    const long double want = exact * 18446744073709551616.0L;
    long double diff = static_cast<long double>(ropescale::turn_rate(inv_freq, 1.0)) - want;
    if (diff > 9.2e18L) diff -= 18446744073709551616.0L;
    if (diff < -9.2e18L) diff += 18446744073709551616.0L;
    INFO("inv_freq " << inv_freq << " diff " << static_cast<double>(diff));
    REQUIRE(std::fabs(diff) <= 2.0L + std::fabs(inv_freq));
  }
  // Non-finite: 0 (the query side, rotated in double from the same table, carries the NaN).
  CHECK(ropescale::turn_rate(NAN, 1.0) == 0);
  CHECK(ropescale::turn_rate(INFINITY, 1.0) == 0);
  const ropescale::KeyRate plain = ropescale::key_rate(0.5f, false, 0.0);
  CHECK(plain.far == 0);
  CHECK(plain.near == ropescale::turn_rate(0.5f, 1.0));
}
