// fla's l2norm of one row, y = x r with r = (sum x^2 + eps)^-1/2; its backward is
// dx = r (dy - x r^2 (x . dy)). Shared by the l2norm ops and the gated delta kernels, which
// normalize q and k themselves.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_isa.h"

namespace rlx {
namespace RLX_ISA_NS {

// sum_d a[d] * b[d] in 8 independent lanes (then summed in a fixed order): a single running
// sum is one dependent add per element, ~4x slower for the K = 64 rows these ops see.
template <typename acc_t, typename in_t, typename in2_t = in_t>
inline acc_t row_dot(const in_t* a, const in2_t* b, int64_t D) {
  acc_t lanes[8] = {};
  const int64_t D8 = D / 8 * 8;
  for (int64_t d0 = 0; d0 < D8; d0 += 8) {
    for (int64_t l = 0; l < 8; ++l) {
      lanes[l] += static_cast<acc_t>(a[d0 + l]) * static_cast<acc_t>(b[d0 + l]);
    }
  }
  for (int64_t d = D8; d < D; ++d) {
    lanes[d - D8] += static_cast<acc_t>(a[d]) * static_cast<acc_t>(b[d]);
  }
  acc_t s = 0;
  for (acc_t v : lanes) s += v;
  return s;
}

// r = (sum x^2 + eps)^-1/2
template <typename acc_t, typename in_t>
inline acc_t l2norm_rstd(const in_t* x, int64_t D, acc_t eps) {
  return acc_t(1) / std::sqrt(row_dot<acc_t>(x, x, D) + eps);
}

}  // namespace RLX_ISA_NS
}  // namespace rlx
