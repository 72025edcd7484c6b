// Minimal declarations of the Metal Shading Language for compiling a .metal file as plain
// C++14 (g++ -std=c++14 -pedantic-errors -fsyntax-only; see tests/test_metal_cxx14.py). MSL is
// based on C++14, so a construct of a later standard (if constexpr, structured bindings,
// inline variables, fold expressions, ...) is an error here, while the emulator's C++20 shim
// accepts it. Declarations only: nothing is linked or run. `bfloat` exists only from Metal 3.1
// (`__METAL_VERSION__ >= 310`), as in Metal.
#pragma once

#ifndef __METAL_VERSION__
#error "compile with -D__METAL_VERSION__=300 or 310"
#endif

// Address spaces and the kernel keyword (the [[...]] attributes are stripped beforehand).
#define kernel
#define device
#define threadgroup
#define thread
#define constant const

namespace metal {

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
// <metal_stdlib>'s fixed-width integers (what the params headers shared with the host use)
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;

struct half {
  half();
  half(float);
  operator float() const;
};
#if __METAL_VERSION__ >= 310
struct bfloat {
  bfloat();
  bfloat(float);
  operator float() const;
};
#endif

template <class T, int N>
struct vec {
  T x, y, z, w;
  vec();
  explicit vec(T);
  vec(T, T);
  vec(T, T, T);
  vec(T, T, T, T);
  T& operator[](int);
  const T& operator[](int) const;
};
template <class T, int N> vec<T, N> operator+(vec<T, N>, vec<T, N>);
template <class T, int N> vec<T, N> operator-(vec<T, N>, vec<T, N>);
template <class T, int N> vec<T, N> operator*(vec<T, N>, vec<T, N>);
template <class T, int N> vec<T, N> operator*(vec<T, N>, T);
template <class T, int N> vec<T, N> operator*(T, vec<T, N>);
template <class T, int N> vec<T, N> operator/(vec<T, N>, vec<T, N>);
template <class T, int N> vec<T, N>& operator+=(vec<T, N>&, vec<T, N>);
template <class T, int N> vec<T, N>& operator*=(vec<T, N>&, T);

#define RLX_VECTORS(T)     \
  typedef vec<T, 2> T##2;  \
  typedef vec<T, 3> T##3;  \
  typedef vec<T, 4> T##4;
RLX_VECTORS(float)
RLX_VECTORS(half)
RLX_VECTORS(int)
RLX_VECTORS(uint)
RLX_VECTORS(short)
RLX_VECTORS(ushort)
RLX_VECTORS(char)
RLX_VECTORS(uchar)
RLX_VECTORS(bool)
#if __METAL_VERSION__ >= 310
RLX_VECTORS(bfloat)
#endif
#undef RLX_VECTORS

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
mem_flags operator|(mem_flags, mem_flags);
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);

template <class T> T simd_sum(T);
template <class T> T simd_prod(T);
template <class T> T simd_max(T);
template <class T> T simd_min(T);
template <class T> T simd_and(T);
template <class T> T simd_or(T);
template <class T> T simd_xor(T);
template <class T> T simd_shuffle(T, ushort);
template <class T> T simd_shuffle_up(T, ushort);
template <class T> T simd_shuffle_down(T, ushort);
template <class T> T simd_shuffle_xor(T, ushort);
template <class T> T simd_broadcast(T, ushort);
template <class T> T simd_broadcast_first(T);
template <class T> T simd_prefix_inclusive_sum(T);
template <class T> T simd_prefix_exclusive_sum(T);
bool simd_all(bool);
bool simd_any(bool);
bool simd_is_first();

#define RLX_UNARY(f) template <class T> T f(T);
#define RLX_BINARY(f) template <class T> T f(T, T);
#define RLX_MATH                                                                          \
  RLX_UNARY(exp) RLX_UNARY(exp2) RLX_UNARY(log) RLX_UNARY(log2) RLX_UNARY(sqrt)            \
  RLX_UNARY(rsqrt) RLX_UNARY(sin) RLX_UNARY(cos) RLX_UNARY(tanh) RLX_UNARY(abs)             \
  RLX_UNARY(fabs) RLX_UNARY(floor) RLX_UNARY(ceil) RLX_UNARY(round) RLX_UNARY(trunc)        \
  RLX_UNARY(rint) RLX_UNARY(sign) RLX_UNARY(saturate) RLX_BINARY(max) RLX_BINARY(min)       \
  RLX_BINARY(fmax) RLX_BINARY(fmin) RLX_BINARY(pow) RLX_BINARY(powr) RLX_BINARY(copysign)  \
  RLX_BINARY(divide) template <class T> T clamp(T, T, T);                                  \
  template <class T> T fma(T, T, T);                                                      \
  template <class T, class U> T mix(T, T, U);
RLX_MATH
namespace precise {
RLX_MATH
}
namespace fast {
RLX_MATH
}
#undef RLX_MATH
#undef RLX_BINARY
#undef RLX_UNARY
template <class T> T select(T, T, bool);
template <class T> bool isnan(T);
template <class T> bool isinf(T);
template <class T> bool isfinite(T);
template <class T, int N> T dot(vec<T, N>, vec<T, N>);
template <int N> bool all(vec<bool, N>);
template <int N> bool any(vec<bool, N>);
template <class T, class U> T as_type(U);

template <class T>
struct numeric_limits {
  static constexpr T quiet_NaN();
  static constexpr T infinity();
  static constexpr T max();
  static constexpr T min();
  static constexpr T lowest();
  static constexpr T epsilon();
};

enum memory_order { memory_order_relaxed };
struct atomic_int {
  int v;
};
struct atomic_uint {
  uint v;
};
struct atomic_float {
  float v;
};
template <class A, class T> void atomic_store_explicit(A*, T, memory_order);
template <class A> int atomic_load_explicit(A*, memory_order);
template <class A, class T> T atomic_fetch_add_explicit(A*, T, memory_order);
template <class A, class T> T atomic_fetch_max_explicit(A*, T, memory_order);
template <class A, class T> T atomic_fetch_min_explicit(A*, T, memory_order);

}  // namespace metal

#define MAXFLOAT 3.402823466e+38f
#define INFINITY (__builtin_inff())
