// Catch2 tests of the framework-free rotation math (csrc/include/ropescale/rotary_math.h, rotary.h):
// angle reduction at long positions, and the pair map and its transpose. Expected values come from
// long double evaluations and from the definitions, not from the code under test.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <random>

#include "ropescale/rotary.h"

using namespace ropescale;

TEST_CASE("rotary_sincos stays accurate at positions up to 2^24", "[rotary_math]") {
  std::mt19937_64 rng(3);
  double worst_float = 0.0, worst_double = 0.0;
  for (int trial = 0; trial < 20000; ++trial) {
    const double position = static_cast<double>(rng() % (int64_t{1} << 24));
    // inv_freq over the whole RoPE range: base^(-2i/d) for base up to 1e7.
    const float inv_freq = static_cast<float>(std::pow(10.0, -7.0 * static_cast<double>(rng() % 1000) / 1000.0));
    const long double angle = static_cast<long double>(position) * static_cast<long double>(inv_freq);
    const long double s_ref = std::sin(angle), c_ref = std::cos(angle);
    float s, c;
    rotary_sincos(position, inv_freq, &s, &c);
    worst_float = std::max({worst_float, static_cast<double>(std::fabs(s - s_ref)), static_cast<double>(std::fabs(c - c_ref))});
    double sd, cd;
    rotary_sincos(position, inv_freq, &sd, &cd);
    worst_double = std::max({worst_double, static_cast<double>(std::fabs(sd - s_ref)), static_cast<double>(std::fabs(cd - c_ref))});
  }
  // A float32 angle at 2^24 would be off by up to ~1 rad; the reduction in double keeps the float
  // result within a few float ulps of 1, and the double one near double precision.
  CHECK(worst_float < 3e-7);
  CHECK(worst_double < 1e-11);
}

TEST_CASE("rotary_reduced_angle lands in [-pi, pi] and differs from the angle by whole turns", "[rotary_math]") {
  for (double position : {0.0, 1.0, 12345.0, 1048576.0, 16777215.0}) {
    for (float inv_freq : {1.0f, 0.7f, 1e-3f, 3.3e-6f}) {
      const double r = rotary_reduced_angle(position, inv_freq);
      CHECK(std::fabs(r) <= 3.14159265358979323846 + 1e-12);
      const long double turns = (static_cast<long double>(position) * inv_freq - r) / (2.0L * 3.14159265358979323846264L);
      CHECK(std::fabs(turns - std::nearbyint(turns)) < 1e-9);
    }
  }
}

TEST_CASE("pair elements and table entries per layout", "[rotary]") {
  using rotary::pair_elements;
  using rotary::table_entries;
  using rotary::TableKind;
  CHECK(pair_elements(false, 8, 3).a == 3);
  CHECK(pair_elements(false, 8, 3).b == 11);
  CHECK(pair_elements(true, 8, 3).a == 6);
  CHECK(pair_elements(true, 8, 3).b == 7);
  CHECK(table_entries(TableKind::kFullWidth, false, 8, 3).b == 11);  // transformers' cat(freqs, freqs)
  CHECK(table_entries(TableKind::kFullWidth, true, 8, 3).a == 6);    // repeat_interleave'd tables
  CHECK(table_entries(TableKind::kHalfWidth, true, 8, 3).b == 3);    // one entry per pair
}

TEST_CASE("the conjugated map is the transpose of the pair map, for any coefficients", "[rotary]") {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(-2.0, 2.0);
  for (int trial = 0; trial < 100; ++trial) {
    const rotary::PairCoeffs<double> c{u(rng), u(rng), u(rng), u(rng)};
    // Matrix of the forward map M (y = M x), written from its definition.
    const double m[2][2] = {{c.cos_a, -c.sin_a}, {c.sin_b, c.cos_b}};
    const double xa = u(rng), xb = u(rng);
    double ya, yb;
    rotary::rotate(rotary::conjugated(c), xa, xb, &ya, &yb);
    CHECK(ya == Approx(m[0][0] * xa + m[1][0] * xb).margin(1e-14));
    CHECK(yb == Approx(m[0][1] * xa + m[1][1] * xb).margin(1e-14));
  }
}

TEST_CASE("position coefficients rotate by the angle and scale by the attention factor", "[rotary]") {
  const auto c = rotary::position_coeffs<double>(1000.0, 0.01f, 1.5);
  const double angle = 1000.0 * static_cast<double>(0.01f);
  CHECK(c.cos_a == Approx(1.5 * std::cos(angle)).margin(1e-13));
  CHECK(c.sin_b == Approx(1.5 * std::sin(angle)).margin(1e-13));
  double ya, yb;
  rotary::rotate(c, 1.0, 0.0, &ya, &yb);  // (1, 0) rotated by the angle
  CHECK(ya == Approx(1.5 * std::cos(angle)).margin(1e-13));
  CHECK(yb == Approx(1.5 * std::sin(angle)).margin(1e-13));
}

TEST_CASE("pair coefficients read a float table as it is, for operands of another type", "[rotary]") {
  // Float tables with double operands (Params<double, float>): the pair's own entries of the float
  // table (a and b of a full-width row), converted exactly, transposed for the conjugate.
  const float cos_row[4] = {0.1f, -0.7f, 0.3f, 0.9f};  // full width, rotary_dim 4: pairs (0, 2), (1, 3)
  const float sin_row[4] = {0.2f, 0.5f, -0.6f, 0.8f};
  rotary::Params<double, float> p;
  p.rotary_dim = p.head_dim = 4;
  p.seq_len = 1;
  p.table = rotary::TableKind::kFullWidth;
  p.cos = cos_row;
  p.sin = sin_row;
  const auto to_acc = [](float v) { return static_cast<double>(v); };
  const auto c = rotary::pair_coeffs<double>(p, 0, 0, 1, to_acc);
  CHECK(c.cos_a == static_cast<double>(cos_row[1]));
  CHECK(c.sin_a == static_cast<double>(sin_row[1]));
  CHECK(c.cos_b == static_cast<double>(cos_row[3]));
  CHECK(c.sin_b == static_cast<double>(sin_row[3]));
  p.conjugate = true;
  const auto t = rotary::pair_coeffs<double>(p, 0, 0, 1, to_acc);
  CHECK(t.sin_a == -static_cast<double>(sin_row[3]));
  CHECK(t.sin_b == -static_cast<double>(sin_row[1]));
}
