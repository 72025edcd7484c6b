// The dtypes of x (and of the codebook, scales, bias) as the codebook kernels see them:
// float16 / bfloat16 as their 16-bit patterns with float32 accumulation, float32 and float64
// as themselves. Shared by the 16-bit-code kernels (codebook_codes16.cuh) and the
// small-batch backward (codebook_histogram.cuh); compiled on the CPU by tests/cuda_emu too.
#pragma once

#include <cstdint>

#include "codebook_mma.cuh"  // bits_to_float, float_to_bits

namespace rlx::codebook::cuda {

// The dtype of x (and of the codebook, scales, bias), as the kernels see it.
enum class Elem { kFloat, kDouble, kHalf, kBFloat16 };

template <Elem e>
struct ElemTypes {  // float16 / bfloat16: bit patterns, float32 accumulation
  using storage = uint16_t;
  using acc = float;
};
template <>
struct ElemTypes<Elem::kFloat> {
  using storage = float;
  using acc = float;
};
template <>
struct ElemTypes<Elem::kDouble> {
  using storage = double;
  using acc = double;
};
template <Elem e>
using storage_t = typename ElemTypes<e>::storage;
template <Elem e>
using acc_t = typename ElemTypes<e>::acc;

template <Elem e>
__device__ __forceinline__ acc_t<e> elem_to_acc(storage_t<e> v) {
  if constexpr (e == Elem::kHalf) {
    return bits_to_float<Bits16::kHalf>(v);
  } else if constexpr (e == Elem::kBFloat16) {
    return bits_to_float<Bits16::kBFloat16>(v);
  } else {
    return v;
  }
}
template <Elem e>
__device__ __forceinline__ storage_t<e> acc_to_elem(acc_t<e> v) {
  if constexpr (e == Elem::kHalf) {
    return float_to_bits<Bits16::kHalf>(v);
  } else if constexpr (e == Elem::kBFloat16) {
    return float_to_bits<Bits16::kBFloat16>(v);
  } else {
    return v;
  }
}

}  // namespace rlx::codebook::cuda
