// Picks the rotary CPU kernel (cpu/rotary_kernel.cpp, compiled once per instruction set) for the
// best instruction set of this CPU, the way ATen picks its own kernels: at::get_cpu_capability(),
// which also honours the ATEN_CPU_CAPABILITY environment variable.
#include <ATen/Version.h>

#include <string>

#include "rotary_args.h"

namespace ropescale {
namespace cpu {
// One declaration per variant CMakeLists.txt builds (ROPESCALE_CPU_AVX2 / _AVX512 say which).
namespace DEFAULT {
void rotary_kernel(const RotaryArgs& args);
void cos_sin(double position, const float* inv_freq, int64_t pairs, float* cos_out, float* sin_out);
}
#ifdef ROPESCALE_CPU_AVX2
namespace AVX2 {
void rotary_kernel(const RotaryArgs& args);
void cos_sin(double position, const float* inv_freq, int64_t pairs, float* cos_out, float* sin_out);
}
#endif
#ifdef ROPESCALE_CPU_AVX512
namespace AVX512 {
void rotary_kernel(const RotaryArgs& args);
void cos_sin(double position, const float* inv_freq, int64_t pairs, float* cos_out, float* sin_out);
}
#endif
}  // namespace cpu

namespace {

using RotaryKernel = void (*)(const RotaryArgs&);
using CosSin = void (*)(double, const float*, int64_t, float*, float*);

struct CpuVariant {
  RotaryKernel kernel;
  CosSin cos_sin;
  const char* isa;
};

// ATEN_CPU_CAPABILITY=avx512 makes at::get_cpu_capability() say AVX512 without asking the CPU, so
// the variant is also capped at what the CPU itself reports: never an illegal instruction.
bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(_M_X64)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(_M_X64)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

CpuVariant pick_cpu_variant() {
  const std::string capability = at::get_cpu_capability();
#ifdef ROPESCALE_CPU_AVX512
  if (capability == "AVX512" && cpu_has_avx512()) return {&cpu::AVX512::rotary_kernel, &cpu::AVX512::cos_sin, "AVX512"};
#endif
#ifdef ROPESCALE_CPU_AVX2
  if ((capability == "AVX512" || capability == "AVX2") && cpu_has_avx2())
    return {&cpu::AVX2::rotary_kernel, &cpu::AVX2::cos_sin, "AVX2"};
#endif
  return {&cpu::DEFAULT::rotary_kernel, &cpu::DEFAULT::cos_sin, "DEFAULT"};
}

const CpuVariant& cpu_variant() {
  static const CpuVariant variant = pick_cpu_variant();
  return variant;
}

}  // namespace

void rotary_cpu(const RotaryArgs& args) { cpu_variant().kernel(args); }

std::string rotary_cpu_isa() { return cpu_variant().isa; }

void rotary_cos_sin_cpu(double position, const float* inv_freq, int64_t pairs, float* cos_out, float* sin_out) {
  cpu_variant().cos_sin(position, inv_freq, pairs, cos_out, sin_out);
}

}  // namespace ropescale
