// The subset of Metal's <metal_stdlib> that rlx kernels may use, for the CPU emulator:
// scalar and vector types (half and bfloat are 16-bit storage types converted through float
// with round-to-nearest-even, arithmetic rounded back after every operation as in Metal),
// math, bounds-checked device/threadgroup pointers, barriers, 32-lane simdgroup collectives
// and atomics. Everything lives in namespace metal; translated kernels say
// `using namespace metal;` exactly as Metal sources do.
#pragma once

#include <bit>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <limits>
#include <source_location>
#include <string>
#include <type_traits>

#include "runtime.h"

// The emulator accepts the Metal 3.1 language (bfloat); sources guard bfloat kernels with
// `#if __METAL_VERSION__ >= 310` so that older macOS still compiles the rest.
#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 310
#endif

namespace metal {

using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;
using ulong = uint64_t;

// ---- 16-bit floating types -------------------------------------------------------------------

inline uint16_t float_to_half_bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u)  // inf or nan
    return uint16_t(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u | ((absx >> 13) & 0x3ffu) : 0));
  if (absx >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (absx < 0x38800000u) {  // result is subnormal (or zero): scale into the subnormal grid
    const float a = std::bit_cast<float>(absx);
    const float scaled = a * 16777216.0f;  // 2^24: one half-subnormal ulp becomes 1.0
    const uint32_t q = uint32_t(std::nearbyint(scaled));  // ties-to-even in default mode
    return uint16_t(sign | q);
  }
  // normal: rebias exponent, round mantissa 23 -> 10 bits to nearest even
  uint32_t m = absx + 0xc8000000u;  // exponent - 112
  m += 0x0fffu + ((m >> 13) & 1u);
  return uint16_t(sign | (m >> 13));
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {
    const float v = float(man) * 5.9604644775390625e-8f;  // 2^-24
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13));
}

inline uint16_t float_to_bfloat_bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // quiet nan
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bfloat_bits_to_float(uint16_t b) { return std::bit_cast<float>(uint32_t(b) << 16); }

template <bool IsBfloat>
struct float16_storage {
  uint16_t bits = 0;
  float16_storage() = default;
  template <class U>
    requires std::is_arithmetic_v<U>
  float16_storage(U v) : bits(encode(float(v))) {}
  explicit float16_storage(float16_storage<!IsBfloat> o) : bits(encode(float(o))) {}
  static uint16_t encode(float f) {
    return IsBfloat ? float_to_bfloat_bits(f) : float_to_half_bits(f);
  }
  operator float() const { return IsBfloat ? bfloat_bits_to_float(bits) : half_bits_to_float(bits); }
  float16_storage operator-() const { return float16_storage(-float(*this)); }
  float16_storage operator+() const { return *this; }
  template <class U>
  float16_storage& operator+=(U v) { return *this = float16_storage(float(*this) + float(v)); }
  template <class U>
  float16_storage& operator-=(U v) { return *this = float16_storage(float(*this) - float(v)); }
  template <class U>
  float16_storage& operator*=(U v) { return *this = float16_storage(float(*this) * float(v)); }
  template <class U>
  float16_storage& operator/=(U v) { return *this = float16_storage(float(*this) / float(v)); }
};
using half = float16_storage<false>;
using bfloat = float16_storage<true>;
static_assert(sizeof(half) == 2 && sizeof(bfloat) == 2);

template <class T>
inline constexpr bool is_f16_v = std::is_same_v<T, half> || std::is_same_v<T, bfloat>;
template <class T>
concept Scalar = std::is_arithmetic_v<T> || is_f16_v<T>;
template <class T>
concept FloatScalar = std::is_floating_point_v<T> || is_f16_v<T>;

// Metal's usual arithmetic conversions: half op half -> half, half op int -> half,
// half op float -> float.
template <class A, class B>
using f16_result_t = std::conditional_t<
    is_f16_v<A> && is_f16_v<B>, A,
    std::conditional_t<is_f16_v<A> && std::is_integral_v<B>, A,
                       std::conditional_t<is_f16_v<B> && std::is_integral_v<A>, B, float>>>;

#define METAL_EMU_F16_BINOP(op)                                                           \
  template <Scalar A, Scalar B>                                                           \
    requires(is_f16_v<A> || is_f16_v<B>)                                                  \
  inline f16_result_t<A, B> operator op(A a, B b) {                                       \
    return f16_result_t<A, B>(float(a) op float(b));                                      \
  }
METAL_EMU_F16_BINOP(+)
METAL_EMU_F16_BINOP(-)
METAL_EMU_F16_BINOP(*)
METAL_EMU_F16_BINOP(/)
#undef METAL_EMU_F16_BINOP
#define METAL_EMU_F16_CMP(op)                                                             \
  template <Scalar A, Scalar B>                                                           \
    requires(is_f16_v<A> || is_f16_v<B>)                                                  \
  inline bool operator op(A a, B b) { return float(a) op float(b); }
METAL_EMU_F16_CMP(<)
METAL_EMU_F16_CMP(>)
METAL_EMU_F16_CMP(<=)
METAL_EMU_F16_CMP(>=)
METAL_EMU_F16_CMP(==)
METAL_EMU_F16_CMP(!=)
#undef METAL_EMU_F16_CMP

// ---- vectors ---------------------------------------------------------------------------------

template <class T, int N>
struct vec_storage;
template <class T>
struct vec_storage<T, 2> {
  T x{}, y{};
};
template <class T>
struct alignas(4 * sizeof(T)) vec_storage<T, 3> {  // Metal's 3-vectors are padded to 4
  T x{}, y{}, z{};
};
template <class T>
struct vec_storage<T, 4> {
  T x{}, y{}, z{}, w{};
};

template <class T, int N>
struct vec : vec_storage<T, N> {
  vec() = default;
  template <Scalar U>
  vec(U s) {  // broadcast, as in float4(0.0f)
    for (int i = 0; i < N; ++i) (*this)[i] = T(s);
  }
  template <Scalar... U>
    requires(sizeof...(U) == N && N > 1)
  vec(U... s) {
    int i = 0;
    ((void)((*this)[i++] = T(s)), ...);
  }
  template <class U>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) (*this)[i] = T(o[i]);
  }
  T& operator[](int i) { return (&this->x)[i]; }
  const T& operator[](int i) const { return (&this->x)[i]; }

  // Swizzles: translate.py rewrites `v.zyx` to `v.template swz<2, 1, 0>()`, and a swizzle that
  // is assigned to (`v.xy = w`, `v.wz += w`) to `v.template swz_ref<3, 2>() += w`.
  template <int... I>
  vec<T, int(sizeof...(I))> swz() const {
    static_assert(((I < N) && ...), "swizzle names a component this vector does not have");
    return vec<T, int(sizeof...(I))>((*this)[I]...);
  }
  template <int... I>
  struct swizzle_ref {
    static constexpr int M = int(sizeof...(I));
    vec& v;
    template <class F, class U>
    swizzle_ref& apply(F f, const U& o) {
      const vec<T, M> rhs(o);  // a vector of M components, or a scalar broadcast
      const vec old = v;
      int k = 0;
      ((v[I] = T(f(old[I], rhs[k++]))), ...);
      return *this;
    }
    template <class U>
    swizzle_ref& operator=(const U& o) { return apply([](T, T b) { return b; }, o); }
    template <class U>
    swizzle_ref& operator+=(const U& o) { return apply([](T a, T b) { return a + b; }, o); }
    template <class U>
    swizzle_ref& operator-=(const U& o) { return apply([](T a, T b) { return a - b; }, o); }
    template <class U>
    swizzle_ref& operator*=(const U& o) { return apply([](T a, T b) { return a * b; }, o); }
    template <class U>
    swizzle_ref& operator/=(const U& o) { return apply([](T a, T b) { return a / b; }, o); }
    operator vec<T, M>() const { return v.template swz<I...>(); }
  };
  template <int... I>
  swizzle_ref<I...> swz_ref() {
    static_assert(((I < N) && ...), "swizzle names a component this vector does not have");
    static_assert(all_distinct<I...>(), "a swizzle that is written to repeats a component");
    return swizzle_ref<I...>{*this};
  }

 private:
  template <int... I>
  static constexpr bool all_distinct() {
    const int idx[] = {I...};
    for (int a = 0; a < int(sizeof...(I)); ++a)
      for (int b = a + 1; b < int(sizeof...(I)); ++b)
        if (idx[a] == idx[b]) return false;
    return true;
  }
};

#define METAL_EMU_VEC_BINOP(op)                                                           \
  template <class T, int N>                                                               \
  inline vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {                  \
    vec<T, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] op b[i]);                                   \
    return r;                                                                             \
  }                                                                                       \
  template <class T, int N, Scalar S>                                                     \
  inline vec<T, N> operator op(const vec<T, N>& a, S s) {                                 \
    return a op vec<T, N>(s);                                                             \
  }                                                                                       \
  template <class T, int N, Scalar S>                                                     \
  inline vec<T, N> operator op(S s, const vec<T, N>& a) {                                 \
    return vec<T, N>(s) op a;                                                             \
  }                                                                                       \
  template <class T, int N, class U>                                                      \
  inline vec<T, N>& operator op##=(vec<T, N>& a, const U& b) {                            \
    return a = a op b;                                                                    \
  }
METAL_EMU_VEC_BINOP(+)
METAL_EMU_VEC_BINOP(-)
METAL_EMU_VEC_BINOP(*)
METAL_EMU_VEC_BINOP(/)
#undef METAL_EMU_VEC_BINOP
template <class T, int N>
inline vec<T, N> operator-(const vec<T, N>& a) {
  return vec<T, N>(T(0)) - a;
}

#define METAL_EMU_VEC_ALIASES(T)                                                          \
  using T##2 = vec<T, 2>;                                                                 \
  using T##3 = vec<T, 3>;                                                                 \
  using T##4 = vec<T, 4>;
METAL_EMU_VEC_ALIASES(float)
METAL_EMU_VEC_ALIASES(half)
METAL_EMU_VEC_ALIASES(bfloat)
METAL_EMU_VEC_ALIASES(int)
METAL_EMU_VEC_ALIASES(uint)
METAL_EMU_VEC_ALIASES(short)
METAL_EMU_VEC_ALIASES(ushort)
METAL_EMU_VEC_ALIASES(char)
METAL_EMU_VEC_ALIASES(uchar)
METAL_EMU_VEC_ALIASES(bool)
#undef METAL_EMU_VEC_ALIASES

template <class T>
struct is_vec : std::false_type {};
template <class T, int N>
struct is_vec<vec<T, N>> : std::true_type {};

template <class To, class From>
inline To as_type(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of the same size");
  To r;
  std::memcpy(&r, &v, sizeof(To));
  return r;
}

template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <bool B>
struct numeric_limits<float16_storage<B>> {
  using T = float16_storage<B>;
  static T from_bits(uint16_t b) {
    T t;
    t.bits = b;
    return t;
  }
  static T infinity() { return from_bits(B ? 0x7f80 : 0x7c00); }
  static T quiet_NaN() { return from_bits(B ? 0x7fc0 : 0x7e00); }
  static T max() { return from_bits(B ? 0x7f7f : 0x7bff); }
  static T lowest() { return from_bits(B ? 0xff7f : 0xfbff); }
  static T epsilon() { return from_bits(B ? 0x3c00 : 0x1400); }
};

// ---- math ------------------------------------------------------------------------------------

#define METAL_EMU_UNARY(name, expr)                                                       \
  template <FloatScalar T>                                                                \
  inline T name(T x_) {                                                                   \
    const float x = float(x_);                                                            \
    return T(expr);                                                                       \
  }                                                                                       \
  template <class T, int N>                                                               \
  inline vec<T, N> name(const vec<T, N>& v) {                                             \
    vec<T, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = name(v[i]);                                        \
    return r;                                                                             \
  }
METAL_EMU_UNARY(exp, std::exp(x))
METAL_EMU_UNARY(exp2, std::exp2(x))
METAL_EMU_UNARY(log, std::log(x))
METAL_EMU_UNARY(log2, std::log2(x))
METAL_EMU_UNARY(sqrt, std::sqrt(x))
METAL_EMU_UNARY(rsqrt, 1.0f / std::sqrt(x))
METAL_EMU_UNARY(sin, std::sin(x))
METAL_EMU_UNARY(cos, std::cos(x))
METAL_EMU_UNARY(tanh, std::tanh(x))
METAL_EMU_UNARY(fabs, std::fabs(x))
METAL_EMU_UNARY(floor, std::floor(x))
METAL_EMU_UNARY(ceil, std::ceil(x))
METAL_EMU_UNARY(round, std::round(x))
METAL_EMU_UNARY(trunc, std::trunc(x))
METAL_EMU_UNARY(rint, std::nearbyint(x))
METAL_EMU_UNARY(sign, x > 0 ? 1.0f : (x < 0 ? -1.0f : 0.0f))
METAL_EMU_UNARY(saturate, std::fmin(std::fmax(x, 0.0f), 1.0f))
#undef METAL_EMU_UNARY

template <FloatScalar T>
inline T abs(T x) {
  return T(std::fabs(float(x)));
}
template <std::integral T>
inline T abs(T x) {
  return x < 0 ? T(-x) : x;
}
template <class T, int N>
inline vec<T, N> abs(const vec<T, N>& v) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = abs(v[i]);
  return r;
}

template <Scalar T>
inline T max(T a, T b) {
  if constexpr (FloatScalar<T>) return T(std::fmax(float(a), float(b)));
  else return a < b ? b : a;
}
template <Scalar T>
inline T min(T a, T b) {
  if constexpr (FloatScalar<T>) return T(std::fmin(float(a), float(b)));
  else return b < a ? b : a;
}
template <FloatScalar T>
inline T fmax(T a, T b) { return max(a, b); }
template <FloatScalar T>
inline T fmin(T a, T b) { return min(a, b); }
template <Scalar T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <FloatScalar T>
inline T fma(T a, T b, T c) { return T(std::fma(float(a), float(b), float(c))); }
template <FloatScalar T>
inline T pow(T a, T b) { return T(std::pow(float(a), float(b))); }
template <FloatScalar T>
inline T powr(T a, T b) { return T(std::pow(float(a), float(b))); }
template <FloatScalar T>
inline T mix(T a, T b, T t) { return T(float(a) + (float(b) - float(a)) * float(t)); }
template <FloatScalar T>
inline T copysign(T a, T b) { return T(std::copysign(float(a), float(b))); }
template <class T>
inline T select(T a, T b, bool c) { return c ? b : a; }
template <FloatScalar T>
inline bool isnan(T x) { return std::isnan(float(x)); }
template <FloatScalar T>
inline bool isinf(T x) { return std::isinf(float(x)); }
template <FloatScalar T>
inline bool isfinite(T x) { return std::isfinite(float(x)); }
#define METAL_EMU_VEC_BINARY(name)                                                        \
  template <class T, int N>                                                               \
  inline vec<T, N> name(const vec<T, N>& a, const vec<T, N>& b) {                         \
    vec<T, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = name(a[i], b[i]);                                  \
    return r;                                                                             \
  }
METAL_EMU_VEC_BINARY(max)
METAL_EMU_VEC_BINARY(min)
METAL_EMU_VEC_BINARY(fmax)
METAL_EMU_VEC_BINARY(fmin)
METAL_EMU_VEC_BINARY(pow)
METAL_EMU_VEC_BINARY(copysign)
#undef METAL_EMU_VEC_BINARY

// Component-wise comparisons give bool vectors; all / any / select take them.
#define METAL_EMU_VEC_CMP(op)                                                             \
  template <class T, int N>                                                               \
  inline vec<bool, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {               \
    vec<bool, N> r;                                                                       \
    for (int i = 0; i < N; ++i) r[i] = a[i] op b[i];                                      \
    return r;                                                                             \
  }                                                                                       \
  template <class T, int N, Scalar S>                                                     \
  inline vec<bool, N> operator op(const vec<T, N>& a, S s) {                              \
    return a op vec<T, N>(s);                                                             \
  }                                                                                       \
  template <class T, int N, Scalar S>                                                     \
  inline vec<bool, N> operator op(S s, const vec<T, N>& a) {                              \
    return vec<T, N>(s) op a;                                                             \
  }
METAL_EMU_VEC_CMP(<)
METAL_EMU_VEC_CMP(>)
METAL_EMU_VEC_CMP(<=)
METAL_EMU_VEC_CMP(>=)
METAL_EMU_VEC_CMP(==)
METAL_EMU_VEC_CMP(!=)
#undef METAL_EMU_VEC_CMP
template <int N>
inline bool all(const vec<bool, N>& b) {
  for (int i = 0; i < N; ++i)
    if (!b[i]) return false;
  return true;
}
template <int N>
inline bool any(const vec<bool, N>& b) {
  for (int i = 0; i < N; ++i)
    if (b[i]) return true;
  return false;
}
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <class T, int N, class L>
inline vec<T, N> clamp(const vec<T, N>& x, const L& lo, const L& hi) {  // L: vector or scalar
  const vec<T, N> l(lo), h(hi);
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = clamp(x[i], l[i], h[i]);
  return r;
}
template <class T, int N, class U>
inline vec<T, N> mix(const vec<T, N>& a, const vec<T, N>& b, const U& t) {  // t: vector or scalar
  const vec<T, N> tt(t);
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = mix(a[i], b[i], tt[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = fma(a[i], b[i], c[i]);
  return r;
}
template <class T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  float s = 0.0f;
  for (int i = 0; i < N; ++i) s += float(a[i]) * float(b[i]);
  return T(s);
}

namespace precise {
using metal::cos;
using metal::exp;
using metal::exp2;
using metal::log;
using metal::log2;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
}  // namespace precise
namespace fast = precise;

// ---- bounds-checked device / threadgroup pointers --------------------------------------------

// What `device T*`, `constant T*` and `threadgroup T*` become: a pointer that knows the extent
// of the buffer it points into and checks every access against it.
template <class T>
struct Ptr {
  char* base = nullptr;  // start of the bound buffer
  int64_t bytes = 0;     // its size
  int64_t offset = 0;    // byte offset of this pointer inside it
  const char* label = "pointer";

  Ptr() = default;
  Ptr(void* b, int64_t n, const char* l) : base(static_cast<char*>(b)), bytes(n), label(l) {}
  // `thread T* p = &x`: a pointer to one private object
  Ptr(T* p) : base(reinterpret_cast<char*>(const_cast<std::remove_const_t<T>*>(p))),
              bytes(p ? int64_t(sizeof(T)) : 0), label("thread pointer") {}
  template <class U>
    requires std::is_convertible_v<U*, T*>
  Ptr(const Ptr<U>& o) : base(o.base), bytes(o.bytes), offset(o.offset), label(o.label) {}
  template <class U>
    requires(!std::is_convertible_v<U*, T*>)
  explicit Ptr(const Ptr<U>& o) : base(o.base), bytes(o.bytes), offset(o.offset), label(o.label) {}

  T* checked(int64_t i) const {
    const int64_t at = offset + i * int64_t(sizeof(T));
    if (base == nullptr || at < 0 || at + int64_t(sizeof(T)) > bytes)
      metal_emu::fail(std::string("out-of-bounds access to ") + label + ": bytes [" +
                      std::to_string(at) + ", " + std::to_string(at + int64_t(sizeof(T))) +
                      ") of a " + std::to_string(bytes) + "-byte buffer");
    if (at % int64_t(alignof(T)) != 0)
      metal_emu::fail(std::string("misaligned access to ") + label + " at byte " +
                      std::to_string(at));
    return reinterpret_cast<T*>(base + at);
  }
  T& operator[](int64_t i) const { return *checked(i); }
  T& operator*() const { return *checked(0); }
  T* operator->() const { return checked(0); }
  Ptr operator+(int64_t n) const {
    Ptr r = *this;
    r.offset += n * int64_t(sizeof(T));
    return r;
  }
  Ptr operator-(int64_t n) const { return *this + (-n); }
  int64_t operator-(const Ptr& o) const { return (offset - o.offset) / int64_t(sizeof(T)); }
  Ptr& operator+=(int64_t n) { return *this = *this + n; }
  Ptr& operator-=(int64_t n) { return *this = *this - n; }
  Ptr& operator++() { return *this += 1; }
  Ptr& operator--() { return *this -= 1; }
  Ptr operator++(int) { Ptr r = *this; *this += 1; return r; }
  Ptr operator--(int) { Ptr r = *this; *this -= 1; return r; }
  bool operator==(const Ptr& o) const { return base == o.base && offset == o.offset; }
  bool operator<(const Ptr& o) const { return offset < o.offset; }
};
template <class T>
Ptr<T> operator+(int64_t n, const Ptr<T>& p) { return p + n; }

// ---- bounds-checked private arrays -----------------------------------------------------------

// What a private array `float s[8]` becomes (translate.py): `Array<float, 8, "s"> s`. Same
// layout and aggregate initialisation as the C array; indexing is checked, and it decays to a
// bounds-checked `thread float*` (a Ptr over the whole array) when passed to a function.
template <size_t N>
struct Label {
  char text[N];
  constexpr Label(const char (&s)[N]) {
    for (size_t i = 0; i < N; ++i) text[i] = s[i];
  }
};

template <class T, size_t N, Label Name>
struct Array {
  T v[N];

  constexpr T& operator[](int64_t i) { return v[index(i)]; }
  constexpr const T& operator[](int64_t i) const { return v[index(i)]; }
  static constexpr int64_t index(int64_t i) {
    if (i < 0 || i >= int64_t(N))
      metal_emu::fail(std::string("out-of-bounds index ") + std::to_string(i) +
                      " into private array '" + Name.text + "' of " + std::to_string(N) +
                      " elements");
    return i;
  }
  template <class U>
    requires std::is_convertible_v<T*, U*>
  operator Ptr<U>() { return Ptr<U>(static_cast<void*>(v), int64_t(sizeof v), Name.text); }
  template <class U>
    requires std::is_convertible_v<const T*, U*>
  operator Ptr<U>() const {
    return Ptr<U>(const_cast<void*>(static_cast<const void*>(v)), int64_t(sizeof v), Name.text);
  }
  T* begin() { return v; }
  T* end() { return v + N; }
  const T* begin() const { return v; }
  const T* end() const { return v + N; }
};

// ---- barriers --------------------------------------------------------------------------------

enum class mem_flags : uint32_t { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint32_t(a) | uint32_t(b)); }

inline metal_emu::Site site_of(const char* what, const std::source_location& l) {
  return metal_emu::Site{what, l.file_name(), unsigned(l.line()), unsigned(l.column())};
}

inline void threadgroup_barrier(mem_flags, std::source_location l = std::source_location::current()) {
  metal_emu::block(metal_emu::State::Barrier, site_of("threadgroup_barrier", l));
}

// ---- simdgroup collectives (32 lanes) --------------------------------------------------------

// Every live lane of the simdgroup deposits `v` and waits; once all have arrived each lane sees
// the snapshot of all deposits and the mask of lanes that took part.
struct SimdView {
  const std::array<unsigned char, metal_emu::kSlotBytes>* slots;  // lane 0 of this simdgroup
  uint32_t mask;
  uint32_t lane;
  template <class T>
  T at(uint32_t l) const {
    T r;
    std::memcpy(&r, slots[l].data(), sizeof(T));
    return r;
  }
  bool active(uint32_t l) const { return l < 32 && ((mask >> l) & 1u); }
};

template <class T>
inline SimdView simd_exchange(const T& v, const char* what, const std::source_location& l) {
  static_assert(sizeof(T) <= metal_emu::kSlotBytes, "value too large for a simd collective");
  metal_emu::Runtime& rt = *metal_emu::g_rt;
  const uint32_t t = uint32_t(rt.current);
  std::memcpy(rt.simd_in[t].data(), &v, sizeof(T));
  metal_emu::block(metal_emu::State::Simd, site_of(what, l));
  const uint32_t group = t / metal_emu::kSimdWidth;
  return SimdView{&rt.simd_snapshot[group * metal_emu::kSimdWidth], rt.simd_mask[group],
                  t % metal_emu::kSimdWidth};
}

inline void simdgroup_barrier(mem_flags, std::source_location l = std::source_location::current()) {
  simd_exchange(0, "simdgroup_barrier", l);
}

#define METAL_EMU_SIMD_REDUCE(name, init, combine)                                        \
  template <class T>                                                                      \
  inline T name(T v, std::source_location l = std::source_location::current()) {         \
    const SimdView s = simd_exchange(v, #name, l);                                        \
    T acc = init;                                                                         \
    bool first = true;                                                                    \
    for (uint32_t i = 0; i < 32; ++i) {                                                   \
      if (!s.active(i)) continue;                                                         \
      const T x = s.at<T>(i);                                                             \
      acc = first ? x : T(combine);                                                       \
      first = false;                                                                      \
    }                                                                                     \
    return acc;                                                                           \
  }
METAL_EMU_SIMD_REDUCE(simd_sum, T(0), acc + x)
METAL_EMU_SIMD_REDUCE(simd_prod, T(1), acc * x)
METAL_EMU_SIMD_REDUCE(simd_max, T(0), max(acc, x))
METAL_EMU_SIMD_REDUCE(simd_min, T(0), min(acc, x))
METAL_EMU_SIMD_REDUCE(simd_and, T(0), acc & x)
METAL_EMU_SIMD_REDUCE(simd_or, T(0), acc | x)
METAL_EMU_SIMD_REDUCE(simd_xor, T(0), acc ^ x)
#undef METAL_EMU_SIMD_REDUCE

// Reading a lane that is not active (beyond a partial simdgroup, or returned) gives an undefined
// value on a GPU; the emulator returns all-ones bits (NaN for floats, -1 for ints) so that any
// use of it shows in the results.
template <class T>
inline T simd_read_lane(const SimdView& s, uint32_t src) {
  if (!s.active(src)) {
    T poison;
    std::memset(&poison, 0xff, sizeof(T));
    return poison;
  }
  return s.at<T>(src);
}

template <class T>
inline T simd_shuffle(T v, ushort src, std::source_location l = std::source_location::current()) {
  const SimdView s = simd_exchange(v, "simd_shuffle", l);
  return simd_read_lane<T>(s, src);
}
template <class T>
inline T simd_broadcast(T v, ushort src, std::source_location l = std::source_location::current()) {
  const SimdView s = simd_exchange(v, "simd_broadcast", l);
  return simd_read_lane<T>(s, src);
}
template <class T>
inline T simd_shuffle_xor(T v, ushort mask, std::source_location l = std::source_location::current()) {
  const SimdView s = simd_exchange(v, "simd_shuffle_xor", l);
  return simd_read_lane<T>(s, s.lane ^ mask);
}
// Lanes whose source falls outside the simdgroup keep their own value (Metal's definition).
template <class T>
inline T simd_shuffle_down(T v, ushort delta, std::source_location l = std::source_location::current()) {
  const SimdView s = simd_exchange(v, "simd_shuffle_down", l);
  const uint32_t src = s.lane + delta;
  return src < 32 ? simd_read_lane<T>(s, src) : v;
}
template <class T>
inline T simd_shuffle_up(T v, ushort delta, std::source_location l = std::source_location::current()) {
  const SimdView s = simd_exchange(v, "simd_shuffle_up", l);
  return s.lane >= delta ? simd_read_lane<T>(s, s.lane - delta) : v;
}
template <class T>
inline T simd_broadcast_first(T v, std::source_location l = std::source_location::current()) {
  const SimdView s = simd_exchange(v, "simd_broadcast_first", l);
  for (uint32_t i = 0; i < 32; ++i)
    if (s.active(i)) return s.at<T>(i);
  return v;
}
template <class T>
inline T simd_prefix_inclusive_sum(T v, std::source_location l = std::source_location::current()) {
  const SimdView s = simd_exchange(v, "simd_prefix_inclusive_sum", l);
  T acc = T(0);
  for (uint32_t i = 0; i <= s.lane; ++i)
    if (s.active(i)) acc = T(acc + s.at<T>(i));
  return acc;
}
template <class T>
inline T simd_prefix_exclusive_sum(T v, std::source_location l = std::source_location::current()) {
  const SimdView s = simd_exchange(v, "simd_prefix_exclusive_sum", l);
  T acc = T(0);
  for (uint32_t i = 0; i < s.lane; ++i)
    if (s.active(i)) acc = T(acc + s.at<T>(i));
  return acc;
}
inline bool simd_all(bool b, std::source_location l = std::source_location::current()) {
  const SimdView s = simd_exchange(b, "simd_all", l);
  for (uint32_t i = 0; i < 32; ++i)
    if (s.active(i) && !s.at<bool>(i)) return false;
  return true;
}
inline bool simd_any(bool b, std::source_location l = std::source_location::current()) {
  const SimdView s = simd_exchange(b, "simd_any", l);
  for (uint32_t i = 0; i < 32; ++i)
    if (s.active(i) && s.at<bool>(i)) return true;
  return false;
}
inline bool simd_is_first(std::source_location l = std::source_location::current()) {
  const SimdView s = simd_exchange(0, "simd_is_first", l);
  for (uint32_t i = 0; i < 32; ++i)
    if (s.active(i)) return i == s.lane;
  return false;
}

// ---- atomics (threads of a launch run on one OS thread, so plain read-modify-write is exact) ---

enum memory_order { memory_order_relaxed };

template <class T>
struct atomic {
  T value;
};
using atomic_int = atomic<int>;
using atomic_uint = atomic<uint>;
using atomic_float = atomic<float>;
static_assert(sizeof(atomic_float) == 4);

template <class T>
inline atomic<T>* atomic_target(atomic<T>* p) { return p; }
template <class T>
inline atomic<T>* atomic_target(const Ptr<atomic<T>>& p) { return p.checked(0); }

template <class P, class T>
inline auto atomic_fetch_add_explicit(P p, T v, memory_order) {
  auto* a = atomic_target(p);
  const auto old = a->value;
  a->value = decltype(old)(old + v);
  return old;
}
template <class P, class T>
inline auto atomic_fetch_sub_explicit(P p, T v, memory_order) {
  auto* a = atomic_target(p);
  const auto old = a->value;
  a->value = decltype(old)(old - v);
  return old;
}
template <class P, class T>
inline auto atomic_fetch_max_explicit(P p, T v, memory_order) {
  auto* a = atomic_target(p);
  const auto old = a->value;
  a->value = old < v ? decltype(old)(v) : old;
  return old;
}
template <class P, class T>
inline auto atomic_fetch_min_explicit(P p, T v, memory_order) {
  auto* a = atomic_target(p);
  const auto old = a->value;
  a->value = v < old ? decltype(old)(v) : old;
  return old;
}
template <class P>
inline auto atomic_load_explicit(P p, memory_order) { return atomic_target(p)->value; }
template <class P, class T>
inline void atomic_store_explicit(P p, T v, memory_order) { atomic_target(p)->value = v; }
template <class P, class T>
inline auto atomic_exchange_explicit(P p, T v, memory_order) {
  auto* a = atomic_target(p);
  const auto old = a->value;
  a->value = v;
  return old;
}
template <class P, class T>
inline bool atomic_compare_exchange_weak_explicit(P p, T* expected, T desired, memory_order,
                                                  memory_order) {
  auto* a = atomic_target(p);
  if (a->value == *expected) {
    a->value = desired;
    return true;
  }
  *expected = a->value;
  return false;
}

}  // namespace metal

#ifndef MAXFLOAT
#define MAXFLOAT 3.402823466e+38f
#endif
#ifndef HUGE_VALH
#define HUGE_VALH metal::half(INFINITY)
#endif
