// The run-time choice of the CPU kernels' copy (cpu_isa.h) and rlx::_cpu_isa, which reports
// it (tests check that RLX_CPU_ISA=baseline and =avx2 give the default copy's results).
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu_isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

namespace rlx {
namespace {

CpuIsa supported_cpu_isa() {
#if RLX_ISA_HAVE_AVX2_COPY
  // (__builtin_cpu_supports also checks that the OS saves the AVX and AVX-512 registers.)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return CpuIsa::kBaseline;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return CpuIsa::kAvx512;
  }
  return CpuIsa::kAvx2;
#else
  return CpuIsa::kBaseline;
#endif
}

// RLX_CPU_ISA caps the choice (a copy the CPU lacks is never chosen).
CpuIsa choose_cpu_isa() {
  const CpuIsa best = supported_cpu_isa();
  const char* force = std::getenv("RLX_CPU_ISA");
  if (force != nullptr && std::strcmp(force, "baseline") == 0) return CpuIsa::kBaseline;
  if (force != nullptr && std::strcmp(force, "avx2") == 0 && best > CpuIsa::kAvx2) {
    return CpuIsa::kAvx2;
  }
  return best;
}

std::string cpu_isa_op() { return cpu_isa_name(cpu_isa()); }

}  // namespace

CpuIsa cpu_isa() {
  static const CpuIsa isa = choose_cpu_isa();
  return isa;
}

bool cpu_has_f16c() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // CPUID leaf 1 (clang's __builtin_cpu_supports has no "f16c").
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
  }();
  return has;
#else
  return false;
#endif
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

}  // namespace rlx

TORCH_LIBRARY_IMPL(rlx, CompositeImplicitAutograd, m) {
  m.impl("_cpu_isa", &rlx::cpu_isa_op);
}
