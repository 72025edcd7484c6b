// Fixed-width vectors of the CPU kernels, through the GCC/Clang vector extension: the same
// source compiles to AVX2 on x86-64 and to pairs of NEON registers on arm64. Explicit vectors
// keep accumulators in registers, where the compiler scalarizes or spills plain local arrays
// of that size.
//   Vec256<float> x = load_vec(p);  x += y * z;  store_vec(q, x);  float s = hsum<float>(x);
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_isa.h"

// Every function here has internal linkage, so the ABI note GCC and clang give for passing
// such vectors without AVX (the baseline copy, cpu_isa.h) does not apply.
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
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

// 256 bits of T: 8 floats or 4 doubles, the kernels' working width.
template <typename T>
inline constexpr int kVecLanes = 32 / sizeof(T);
template <typename T>
using Vec256 = Vec<T, kVecLanes<T>>;

// Unaligned loads and stores (memcpy compiles to one vector move).
template <typename T>
inline Vec256<T> load_vec(const T* p) {
  Vec256<T> x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
template <typename T>
inline void store_vec(T* p, const Vec256<T>& x) {
  std::memcpy(p, &x, sizeof(x));
}

// The sum of x's lanes, in lane order.
template <typename T>
inline T hsum(const Vec256<T>& x) {
  T s = 0;
  for (int l = 0; l < kVecLanes<T>; ++l) s += x[l];
  return s;
}

}  // namespace
}  // namespace RLX_ISA_NS
}  // namespace rlx
