// Muon's fused elementwise steps on the CPU: the kernels' entry points, which each ISA copy
// defines (cpu_isa.h, muon_update.cpp), and the matrix index the host code hands them.
// Included before the ISA region, so that nothing here is compiled for AVX2.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_isa.h"

namespace rlx {

// Maps matrix index -> (tensor, offset of the matrix in it), for lists of [count, rows, cols].
struct MatrixIndex {
  std::vector<int64_t> first;  // first matrix of each tensor, plus the total at the end
  int64_t size;                // rows * cols

  MatrixIndex(const at::TensorList& tensors, int64_t size) : size(size) {
    first.push_back(0);
    for (const at::Tensor& t : tensors) first.push_back(first.back() + t.numel() / size);
  }
  int64_t total() const { return first.back(); }
  std::pair<int64_t, int64_t> locate(int64_t matrix) const {
    const int64_t i =
        std::upper_bound(first.begin(), first.end(), matrix) - first.begin() - 1;
    return {i, (matrix - first[i]) * size};
  }
};

RLX_ISA_DECLARE(
    // Per matrix of index: the momentum buffers bufs[t] (updated in place), and the
    // normalized Newton-Schulz input, out (float or c10::BFloat16, [index.total(), size]).
    // rows > 0: each matrix (rows x size/rows, row-major) is written as its transpose.
    template <typename out_t>
    void muon_ns_input_rows(const MatrixIndex& index, const float* const* grads,
                            float* const* bufs, float momentum, bool nesterov, double eps,
                            double safety, out_t* out, int64_t rows);
    // params[t] <- decay params[t] - step ortho (ortho float or c10::BFloat16); rows > 0:
    // each matrix of ortho is stored as its transpose (size/rows x rows).
    template <typename in_t>
    void muon_apply_rows(const MatrixIndex& index, float* const* params, const in_t* ortho,
                         float decay, float step, int64_t rows);)

}  // namespace rlx
