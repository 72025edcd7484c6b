// The accumulation type of every kernel, CPU and CUDA: float64 inputs accumulate (and keep
// recurrent state) in float64, every other floating type (float32, float16, bfloat16) in
// float32. As a C++ type for the kernels and as a dtype for the host code's buffers.
//   using acc_t = rlx::acc_type_t<scalar_t>;
//   at::empty(sizes, x.options().dtype(rlx::acc_dtype(x.scalar_type())));
#pragma once

#include <c10/core/ScalarType.h>

namespace rlx {

template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};
template <typename T>
using acc_type_t = typename AccType<T>::type;

inline c10::ScalarType acc_dtype(c10::ScalarType input) {
  return input == c10::kDouble ? c10::kDouble : c10::kFloat;
}

}  // namespace rlx
