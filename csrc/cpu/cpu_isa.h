// CPU features chosen at run time. The extension's baseline is plain x86-64 (plain arm64), so
// a wheel runs on any CPU of its architecture; the kernels are compiled once more for
// AVX2+FMA, and each op's entry picks a copy once per process (cpu_isa()).
//
// How a kernel file is compiled twice: csrc/cpu/foo.cpp is the baseline copy, and
// csrc/cpu/avx2/foo.cpp defines RLX_ISA_AVX2_COPY and includes it. foo.cpp
//   1. includes cpu_kernel_deps.h (every torch, standard and rlx/ header a kernel uses) and
//      this header: outside any target region, so no inline function of torch, libstdc++ or
//      rlx/ gets AVX2 code (the linker keeps one copy of such a function for the whole
//      library, and an AVX2 one would then run in baseline callers);
//   2. opens the region (RLX_ISA_BEGIN) and includes the kernel headers of csrc/cpu, which put
//      everything they define into namespace rlx::RLX_ISA_NS (isa_base or isa_avx2): their
//      code takes the region's target and each copy has its own names;
//   3. defines the op's implementation in rlx::RLX_ISA_NS, closes the region (RLX_ISA_END),
//      and, in the baseline copy only, the dispatcher (RLX_ISA_CALL) and the registration.
// Templates defined before the region (std::vector, at::parallel_for) keep the baseline
// target where the region instantiates them; tests/test_cpu_isa.py checks that every
// function of the built library with AVX instructions is in an isa_avx2 namespace (or in
// symmetric_matmul's AVX512 path, which has its own check).
// Inside the region test RLX_ISA_AVX, not __AVX__ (a target region does not define it in
// clang).
#pragma once

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define RLX_ISA_HAVE_AVX2_COPY 1
#else
#define RLX_ISA_HAVE_AVX2_COPY 0
#endif

#if defined(RLX_ISA_AVX2_COPY)
#define RLX_ISA_NS isa_avx2
#define RLX_ISA_AVX 1
#if defined(__clang__)
#define RLX_ISA_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma\"))), apply_to = function)")
#define RLX_ISA_END _Pragma("clang attribute pop")
#else
#define RLX_ISA_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma\")")
#define RLX_ISA_END _Pragma("GCC pop_options")
#endif
#else
#define RLX_ISA_NS isa_base
#if defined(__AVX__)  // a build for a newer baseline (CXXFLAGS=-march=...)
#define RLX_ISA_AVX 1
#else
#define RLX_ISA_AVX 0
#endif
#define RLX_ISA_BEGIN
#define RLX_ISA_END
#endif

namespace rlx {

enum class CpuIsa : int { kBaseline = 0, kAvx2 = 1 };

// The kernels' copy for this process: AVX2+FMA where the CPU has both, else the baseline;
// RLX_CPU_ISA=baseline forces the baseline (tests compare the copies). Chosen on first use.
CpuIsa cpu_isa();
const char* cpu_isa_name(CpuIsa isa);

}  // namespace rlx

// In the baseline copy, after the region: RLX_ISA_DECLARE_AVX2 declares the AVX2 copy's fn
// (same type as the baseline's), RLX_ISA_PICK is a pointer to the fn of the copy cpu_isa()
// picks, for TORCH_LIBRARY_IMPL. ns: the namespace that holds isa_base and isa_avx2.
#if RLX_ISA_HAVE_AVX2_COPY
#define RLX_ISA_DECLARE_AVX2(ns, fn) \
  namespace ns::isa_avx2 {           \
  decltype(::ns::isa_base::fn) fn;   \
  }
#define RLX_ISA_PICK(ns, fn) \
  (::rlx::cpu_isa() == ::rlx::CpuIsa::kAvx2 ? &::ns::isa_avx2::fn : &::ns::isa_base::fn)
#else
#define RLX_ISA_DECLARE_AVX2(ns, fn)
#define RLX_ISA_PICK(ns, fn) (&::ns::isa_base::fn)
#endif
