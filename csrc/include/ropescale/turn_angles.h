// Rotation angles of integer positions in 64-bit fixed-point turns: the CUDA ReRoPE kernels' key
// rotation, with no FP64 per position (FP64 runs at 1/64 of the FP32 rate on A10, L4, RTX 4090).
//
//   rate  = frac(inv_freq * multiplier / (2 pi)) * 2^64, rounded: turns per position as a 64-bit
//           fraction, once per (table, rotation pair) in double-double (turn_rate; multiplier 1 for
//           the near side at p, 1/k for Leaky ReRoPE's far side at p/k);
//   turns = position * rate mod 2^64: EXACT integer arithmetic, so the reduction by whole turns loses
//           nothing at any position; the only error is the rate's rounding, |position| * 2^-65 turns
//           (2^-34 turns = 3.7e-10 rad at 2^31);
//   sin, cos of the turns (sincos_turns): reduced to the nearest quarter turn in integers, the rest
//           (|angle| <= pi/4) converted to a float-float angle and evaluated by fixed polynomials with
//           explicit fmaf, so the host (CPU emulation, Catch2) and the GPU compute the same bits.
// Measured against sin/cos of the exact angle (long double) over the dim-128 / base-1e4 table
// (tests/cpp/test_turn_angles.cpp): max error 7.6e-8 up to 2^29, 7.5e-8 up to 2^31, 2.0e-7 up to 2^40;
// rotary_sincos, the double-precision reduction the rest of ropescale uses, on the same sample: 1.4e-7,
// 2.9e-7 and 1.2e-4.
#pragma once

#include <cmath>
#include <cstdint>

#include "ropescale/portable.h"

namespace ropescale {

// The two turn rates of one rotation pair: near side (at p) and Leaky ReRoPE's far side (at p/k; 0
// for plain ReRoPE, whose far-side key is the raw key).
struct KeyRate {
  unsigned long long near, far;
};

namespace turn_detail {
// 1/(2 pi) as a double-double, and 2 pi / 2^64 as a float-float.
constexpr double kInvTwoPiHi = 0x1.45f306dc9c883p-3;
constexpr double kInvTwoPiLo = -0x1.6b01ec5417056p-57;
constexpr float kTurnUnitHi = 0x1.921fb6p-62f;
constexpr float kTurnUnitLo = -0x1.777a5cp-87f;

ROPESCALE_HOST_DEVICE ROPESCALE_INLINE double fma64(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return ::fma(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE double floor64(double x) {
#if defined(__CUDA_ARCH__)
  return ::floor(x);
#else
  return std::floor(x);
#endif
}
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE double trunc64(double x) {
#if defined(__CUDA_ARCH__)
  return ::trunc(x);
#else
  return std::trunc(x);
#endif
}
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE float fma32(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return ::fmaf(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
}  // namespace turn_detail

// frac(inv_freq * multiplier / (2 pi)) * 2^64, rounded (mod 2^64). The product inv_freq * multiplier is
// exact as a double-double (two-product), and so, to ~2^-104, is its quotient by 2 pi. A non-finite or
// absurd (>= 2^40 turns per position) rate gives 0: the query side, rotated from the same table in
// double, still turns the row non-finite.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE unsigned long long turn_rate(float inv_freq, double multiplier) {
  using namespace turn_detail;
  const double a = static_cast<double>(inv_freq);
  const double x_hi = a * multiplier;
  const double x_lo = fma64(a, multiplier, -x_hi);
  const double t_hi = x_hi * kInvTwoPiHi;
  const double t_lo = fma64(x_hi, kInvTwoPiHi, -t_hi) + fma64(x_hi, kInvTwoPiLo, x_lo * kInvTwoPiHi);
  if (!(t_hi < 0x1p40 && t_hi > -0x1p40)) return 0;
  // frac = t_hi without its whole turns (exact: the bits left are a subset of t_hi's), in (-1, 1);
  // frac * 2^64 = whole + fraction (exact), whole taken mod 2^64 in integers, and the fraction with
  // t_lo * 2^64 is the remainder below the double, rounded.
  const double frac = t_hi - trunc64(t_hi);
  const double scaled = frac * 0x1p64;
  const double whole = floor64(scaled);
  const double rest = (scaled - whole) + t_lo * 0x1p64;  // |rest| < 2^52
#if defined(__CUDA_ARCH__)
  const unsigned long long magnitude = __double2ull_rz(whole < 0.0 ? -whole : whole);
  const long long low = __double2ll_rn(rest);
#else
  const unsigned long long magnitude = static_cast<unsigned long long>(whole < 0.0 ? -whole : whole);
  const long long low = static_cast<long long>(std::nearbyint(rest));
#endif
  const unsigned long long high = whole < 0.0 ? 0ull - magnitude : magnitude;
  return high + static_cast<unsigned long long>(low);
}

// The rates of one pair: near side always; the far side's (at far_key_index(p) times far_multiplier:
// Leaky ReRoPE's 1/k, Self-Extend's and Dual Chunk's 1) when the rule rotates far keys.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE KeyRate key_rate(float inv_freq, bool far_rotated, double far_multiplier) {
  return KeyRate{turn_rate(inv_freq, 1.0), far_rotated ? turn_rate(inv_freq, far_multiplier) : 0ull};
}

// sin and cos of `turns` (a fraction of a full turn, 2^64 = one turn). The nearest quarter turn q is
// taken off in integers; the rest r (|r| <= 1/8 turn) becomes the angle a + e (float-float, |a| <= pi/4),
// whose sin and cos come from Taylor polynomials (truncation below 3e-9), then e's first-order term,
// then the quarter turn's exact swap and signs. Every multiply-add is an explicit fmaf, so that nvcc's
// contraction cannot make the GPU differ from the host.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE void sincos_turns(unsigned long long turns, float* sin_out, float* cos_out) {
  using namespace turn_detail;
  const unsigned long long quarter = ((turns + (1ull << 61)) >> 62) & 3ull;
  const long long rest = static_cast<long long>(turns - (quarter << 62));  // in [-2^61, 2^61)
#if defined(__CUDA_ARCH__)
  const float hi = __ll2float_rn(rest);
  const float lo = __ll2float_rn(rest - static_cast<long long>(hi));
#else
  const float hi = static_cast<float>(rest);
  const float lo = static_cast<float>(rest - static_cast<long long>(hi));
#endif
  const float a = hi * kTurnUnitHi;
  const float e = fma32(hi, kTurnUnitLo, fma32(lo, kTurnUnitHi, fma32(hi, kTurnUnitHi, -a)));
  const float a2 = a * a;
  // sin(a) = a + a^3 (-1/3! + a^2 (1/5! + a^2 (-1/7! + a^2 / 9!)))
  float ps = fma32(a2, 2.75573192e-6f, -1.98412698e-4f);
  ps = fma32(a2, ps, 8.33333333e-3f);
  ps = fma32(a2, ps, -1.66666667e-1f);
  const float s = fma32(a * a2, ps, a);
  // cos(a) = 1 + a^2 (-1/2 + a^2 (1/4! + a^2 (-1/6! + a^2 (1/8! - a^2 / 10!))))
  float pc = fma32(a2, -2.75573192e-7f, 2.48015873e-5f);
  pc = fma32(a2, pc, -1.38888889e-3f);
  pc = fma32(a2, pc, 4.16666667e-2f);
  pc = fma32(a2, pc, -0.5f);
  const float c = fma32(a2, pc, 1.0f);
  // sin(a + e) = sin a + e cos a, cos(a + e) = cos a - e sin a (|e| < 2^-24 |a|: the next term is below 2^-48).
  const float sin_a = fma32(e, c, s), cos_a = fma32(-e, s, c);
  switch (quarter) {
    case 0: *sin_out = sin_a, *cos_out = cos_a; break;
    case 1: *sin_out = cos_a, *cos_out = -sin_a; break;
    case 2: *sin_out = -sin_a, *cos_out = -cos_a; break;
    default: *sin_out = -cos_a, *cos_out = sin_a; break;
  }
}

// The rotation of a key's pair (x1, x2) by the angle with this cos/sin, (x1 c - x2 s, x2 c + x1 s), with
// explicit fmaf (rotary_math.h's rotate_pair leaves the contraction to the compiler): the CUDA kernels
// that rotate keys (pre-passes, SIMT key tiles, the paged tensor-core prefill's tiles) and the emulation
// round the same way.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE void rotate_key_pair_fma(float x1, float x2, float cos_v, float sin_v,
                                                                float* out1, float* out2) {
  using namespace turn_detail;
  const float x2_sin = x2 * sin_v, x1_sin = x1 * sin_v;
  *out1 = fma32(x1, cos_v, -x2_sin);
  *out2 = fma32(x2, cos_v, x1_sin);
}

// sin and cos of position * rate (rate from turn_rate): exact turns, then sincos_turns.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE void position_sincos(long long position, unsigned long long rate, float* sin_out,
                                                            float* cos_out) {
  sincos_turns(static_cast<unsigned long long>(position) * rate, sin_out, cos_out);
}

}  // namespace ropescale
