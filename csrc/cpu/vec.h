// The CPU kernels' vectors, through the GCC/Clang vector extension: one register wide in each
// copy (cpu_isa.h), 256 bits in the AVX2 copy and 128 in the x86-64 baseline (SSE2), so the
// same source compiles to AVX2 or SSE2 on x86-64 and to NEON on arm64 (there a pair of
// registers under clang, which keeps such pairs in registers, and one under GCC, which does
// not); 512 bits in the gated delta kernels' AVX-512 copy (RLX_VEC_512). Explicit vectors
// keep accumulators in registers, where the compiler scalarizes or spills plain local arrays
// of that size; a vector wider than the copy's registers would be kept in memory by GCC,
// every operation a load and a store.
//   SimdVec<float> x = load_vec(p);  x += y * z;  store_vec(q, x);  float s = hsum<float>(x);
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_isa.h"

// Every function here has internal linkage, so the ABI note GCC and clang give for passing
// such vectors without AVX (the baseline copy, cpu_isa.h) does not apply.
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

// The kernels' working width in bytes (kVecBytes), as a macro for code written for one width.
// An AVX-512 copy whose file defines RLX_VEC_512 before its includes works on 512-bit vectors
// (the gated delta kernels'); the codebook's AVX-512 copy keeps 256-bit ones for its shared
// code and uses 512-bit intrinsics where it needs them.
#if RLX_ISA_AVX512 && defined(RLX_VEC_512)
#define RLX_VEC_BYTES 64
#elif RLX_ISA_AVX || (defined(__aarch64__) && defined(__clang__))
#define RLX_VEC_BYTES 32
#else
#define RLX_VEC_BYTES 16
#endif

namespace rlx {
namespace RLX_ISA_NS {
namespace {

// N lanes of T, aligned to their size in every copy: GCC otherwise aligns a 32-byte vector
// to 16 bytes outside an AVX target (in the baseline copy, and in the baseline code of
// std::allocator or a struct layout that the AVX2 copy also uses), while the AVX2 copy's
// aligned moves assume 32.
template <typename T, int N>
struct VecOf {
  typedef T type __attribute__((vector_size(N * sizeof(T)), aligned(N * sizeof(T))));
};
template <typename T, int N>
using Vec = typename VecOf<T, N>::type;

// The kernels' working width in bytes: 64 (16 floats, 8 doubles) in an RLX_VEC_512 copy, 32
// (8 floats, 4 doubles) with AVX and on arm64 under clang, else 16 (4 floats, 2 doubles).
inline constexpr int kVecBytes = RLX_VEC_BYTES;
template <typename T>
inline constexpr int kVecLanes = kVecBytes / sizeof(T);
template <typename T>
using SimdVec = Vec<T, kVecLanes<T>>;

// Unaligned loads and stores (memcpy compiles to one vector move).
template <typename T>
inline SimdVec<T> load_vec(const T* p) {
  SimdVec<T> x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
template <typename T>
inline void store_vec(T* p, const SimdVec<T>& x) {
  std::memcpy(p, &x, sizeof(x));
}

// The sum of x's lanes, in lane order.
template <typename T>
inline T hsum(const SimdVec<T>& x) {
  T s = 0;
  for (int l = 0; l < kVecLanes<T>; ++l) s += x[l];
  return s;
}

}  // namespace
}  // namespace RLX_ISA_NS
}  // namespace rlx
