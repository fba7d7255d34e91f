// Framework-free rotation math shared by the CPU kernels, the CUDA kernels and the emulated CUDA
// kernels: accurate angles at long positions, and the rotation of one pair.
#pragma once

#include <cmath>
#include <cstdint>

#include "ropescale/portable.h"

namespace ropescale {

// 2*pi split in two doubles, so that angle - k*2*pi stays exact for k up to ~2^30.
constexpr double kTwoPiHi = 6.28318530717958623200e+00;
constexpr double kTwoPiLo = 2.44929359829470635445e-16;
constexpr double kInvTwoPi = 0.15915494309189533577;

// position * inv_freq reduced to [-pi, pi], in double: the product is exact for |position| < 2^29
// (a float32 product at position 2^21 is already off by ~0.1 rad), and 2*pi is subtracted in two
// parts so the reduction stays exact as well.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE double rotary_reduced_angle(double position, float inv_freq) {
  const double angle = position * static_cast<double>(inv_freq);
#if defined(__CUDA_ARCH__)
  const double turns = ::nearbyint(angle * kInvTwoPi);
#else
  const double turns = std::nearbyint(angle * kInvTwoPi);
#endif
  return (angle - turns * kTwoPiHi) - turns * kTwoPiLo;
}

// Full-precision float sin and cos (never the fast-math intrinsics).
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE void float_sincos(float angle, float* sin_out, float* cos_out) {
#if defined(__CUDA_ARCH__)
  sincosf(angle, sin_out, cos_out);
#else
  *sin_out = std::sin(angle);
  *cos_out = std::cos(angle);
#endif
}

// sin and cos of position * inv_freq, accurate at long positions: the angle is reduced in double
// (rotary_reduced_angle), then the small angle goes to the float sincos.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE void rotary_sincos(double position, float inv_freq, float* sin_out,
                                                          float* cos_out) {
  float_sincos(static_cast<float>(rotary_reduced_angle(position, inv_freq)), sin_out, cos_out);
}

// sin/cos of the angle an engine's native table holds: position * inv_freq formed in float32 (one rounding),
// then float32 sin/cos. Engines (vLLM's cos_sin_cache, transformers' rotary) build the native model's table this
// way; a request that is the native model takes it rather than the accurate angle (up to 2.4e-4 rad apart at 8k).
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE void native_sincos(double position, float inv_freq, float* sin_out,
                                                          float* cos_out) {
  float_sincos(static_cast<float>(position) * inv_freq, sin_out, cos_out);
}

ROPESCALE_HOST_DEVICE ROPESCALE_INLINE void native_sincos(double position, float inv_freq, double* sin_out,
                                                          double* cos_out) {
  float s, c;
  native_sincos(position, inv_freq, &s, &c);
  *sin_out = s;
  *cos_out = c;
}

// The same in double precision (float64 tensors: gradcheck, references). The product is exact and
// double sin/cos reduce their argument exactly themselves, so no reduction of ours is needed.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE void rotary_sincos(double position, float inv_freq, double* sin_out,
                                                          double* cos_out) {
  const double angle = position * static_cast<double>(inv_freq);
#if defined(__CUDA_ARCH__)
  sincos(angle, sin_out, cos_out);
#else
  *sin_out = std::sin(angle);
  *cos_out = std::cos(angle);
#endif
}

// Rotation of the pair (x1, x2) by the angle with this cos/sin: (x1 c - x2 s, x2 c + x1 s).
// The inverse rotation (the backward pass) is the same call with -sin.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE void rotate_pair(float x1, float x2, float cos_v, float sin_v, float* out1,
                                                        float* out2) {
  *out1 = x1 * cos_v - x2 * sin_v;
  *out2 = x2 * cos_v + x1 * sin_v;
}

}  // namespace ropescale
