// The run-time choice of the CPU kernels' copy (cpu_isa.h) and rlx::_cpu_isa, which reports
// it (tests check that RLX_CPU_ISA=baseline gives the baseline copy the AVX2 one's results).
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu_isa.h"

namespace rlx {
namespace {

CpuIsa choose_cpu_isa() {
  const char* force = std::getenv("RLX_CPU_ISA");
  if (force != nullptr && std::strcmp(force, "baseline") == 0) return CpuIsa::kBaseline;
#if RLX_ISA_HAVE_AVX2_COPY
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kBaseline;
}

std::string cpu_isa_op() { return cpu_isa_name(cpu_isa()); }

}  // namespace

CpuIsa cpu_isa() {
  static const CpuIsa isa = choose_cpu_isa();
  return isa;
}

const char* cpu_isa_name(CpuIsa isa) { return isa == CpuIsa::kAvx2 ? "avx2" : "baseline"; }

}  // namespace rlx

TORCH_LIBRARY_IMPL(rlx, CompositeImplicitAutograd, m) {
  m.impl("_cpu_isa", &rlx::cpu_isa_op);
}
