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
}
#ifdef ROPESCALE_CPU_AVX2
namespace AVX2 {
void rotary_kernel(const RotaryArgs& args);
}
#endif
#ifdef ROPESCALE_CPU_AVX512
namespace AVX512 {
void rotary_kernel(const RotaryArgs& args);
}
#endif
}  // namespace cpu

namespace {

using RotaryKernel = void (*)(const RotaryArgs&);

struct CpuVariant {
  RotaryKernel kernel;
  const char* isa;
};

CpuVariant pick_cpu_variant() {
  const std::string capability = at::get_cpu_capability();
#ifdef ROPESCALE_CPU_AVX512
  if (capability == "AVX512") return {&cpu::AVX512::rotary_kernel, "AVX512"};
#endif
#ifdef ROPESCALE_CPU_AVX2
  if (capability == "AVX512" || capability == "AVX2") return {&cpu::AVX2::rotary_kernel, "AVX2"};
#endif
  return {&cpu::DEFAULT::rotary_kernel, "DEFAULT"};
}

const CpuVariant& cpu_variant() {
  static const CpuVariant variant = pick_cpu_variant();
  return variant;
}

}  // namespace

void rotary_cpu(const RotaryArgs& args) { cpu_variant().kernel(args); }

std::string rotary_cpu_isa() { return cpu_variant().isa; }

}  // namespace ropescale
