// CPU features chosen at run time. The extension's baseline is plain x86-64 (plain arm64), so
// a wheel runs on any CPU of its architecture; the kernels are compiled once more for
// AVX2+FMA, and each op's entry picks a copy once per process (cpu_isa()). The codebook
// forward and gather (codebook.cpp, codebook_gather.cpp) and the gated delta rule's forward and
// backward have a third copy, for AVX-512 (csrc/cpu/avx512/, RLX_ISA_AVX512_COPY, namespace
// isa_avx512; the gated delta files' copies also define RLX_VEC_512, so that their vectors,
// vec.h, are 512 bits wide): only the files whose kernels use 512-bit vectors get one, and an
// AVX-512 CPU runs the AVX2 copy of every other file.
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
//   3. defines the op's kernel entry points (raw pointers and sizes) in rlx::RLX_ISA_NS,
//      closes the region (RLX_ISA_END), and, in the baseline copy only, the op itself: the
//      host code (checks, allocation, dtype dispatch), which calls the entry points of the
//      copy cpu_isa() picks (RLX_ISA_CALL), and the registration.
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

#if defined(RLX_ISA_AVX512_COPY)
#define RLX_ISA_NS isa_avx512
#define RLX_ISA_AVX 1
#define RLX_ISA_AVX512 1
#if defined(__clang__)
#define RLX_ISA_BEGIN                                                                     \
  _Pragma(                                                                                \
      "clang attribute push(__attribute__((target(\"avx2,fma,avx512f,avx512bw,avx512vl,avx512dq\"))), apply_to = function)")
#define RLX_ISA_END _Pragma("clang attribute pop")
#else
#define RLX_ISA_BEGIN \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,avx512f,avx512bw,avx512vl,avx512dq\")")
#define RLX_ISA_END _Pragma("GCC pop_options")
#endif
#elif defined(RLX_ISA_AVX2_COPY)
#define RLX_ISA_NS isa_avx2
#define RLX_ISA_AVX 1
#define RLX_ISA_AVX512 0
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
#define RLX_ISA_AVX512 0  // (512-bit code only in the AVX-512 copies, even under -march=native)
#if defined(__AVX__)  // a build for a newer baseline (CXXFLAGS=-march=...)
#define RLX_ISA_AVX 1
#else
#define RLX_ISA_AVX 0
#endif
#define RLX_ISA_BEGIN
#define RLX_ISA_END
#endif

namespace rlx {

enum class CpuIsa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// The kernels' copy for this process: AVX-512 (F, BW, VL, DQ) where the CPU has it, else
// AVX2+FMA where it has both, else the baseline; RLX_CPU_ISA=baseline or avx2 caps the choice
// (tests compare the copies). Chosen on first use. Files without an AVX-512 copy run their
// AVX2 one on kAvx512 (RLX_ISA_CALL).
CpuIsa cpu_isa();
const char* cpu_isa_name(CpuIsa isa);

// Whether the CPU converts float16 in hardware (F16C, CPUID leaf 1; x86-64 only, false
// elsewhere). The AVX2 copies' float16 codebook kernels need it on top of AVX2.
bool cpu_has_f16c();

}  // namespace rlx

// Host code (argument checks, allocation, dtype dispatch, registration) is compiled once, in
// the baseline copy after the region (#if !defined(RLX_ISA_AVX2_COPY)); only the kernels'
// entry points, which take raw pointers and sizes, are compiled per copy. Around them:
// RLX_ISA_DECLARE(decls) declares decls (declarations that name no namespace) in both
// copies' namespaces, isa_base and isa_avx2, of the enclosing namespace (a header outside the
// region does this for an op's entry points, so that both copies define what the host calls);
// RLX_ISA_CALL(fn) is the address of fn (a function, or a function template's specialization,
// of the enclosing namespace's copies) in the copy cpu_isa() picks, among isa_base and
// isa_avx2; RLX_ISA_CALL_AVX512(fn) also picks isa_avx512, for an fn that the file's AVX-512
// copy defines (its declaration there comes from RLX_ISA_DECLARE too).
#if RLX_ISA_HAVE_AVX2_COPY
#define RLX_ISA_DECLARE(...)   \
  namespace isa_base {         \
  __VA_ARGS__                  \
  }                            \
  namespace isa_avx2 {         \
  __VA_ARGS__                  \
  }                            \
  namespace isa_avx512 {       \
  __VA_ARGS__                  \
  }
#define RLX_ISA_CALL(...)                                                   \
  (::rlx::cpu_isa() >= ::rlx::CpuIsa::kAvx2 ? &isa_avx2::__VA_ARGS__ \
                                            : &isa_base::__VA_ARGS__)
#define RLX_ISA_CALL_AVX512(...)                                           \
  (::rlx::cpu_isa() == ::rlx::CpuIsa::kAvx512 ? &isa_avx512::__VA_ARGS__ \
                                              : RLX_ISA_CALL(__VA_ARGS__))
#else
#define RLX_ISA_DECLARE(...) \
  namespace isa_base {       \
  __VA_ARGS__                \
  }
#define RLX_ISA_CALL(...) (&isa_base::__VA_ARGS__)
#define RLX_ISA_CALL_AVX512(...) (&isa_base::__VA_ARGS__)
#endif
