// Argument validation for the codebook matmul ops, shared by every backend (CPU, MPS, ...)
// so that each one raises the same ValueError, naming the argument, for the same bad input.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <array>
#include <optional>

namespace rlx::codebook {

// Problem sizes of out[..., N] = x[..., K] @ dequant(indices, codebook)^T.
struct Dims {
  int64_t rows;           // B: product of x's leading dimensions
  int64_t in_features;    // K
  int64_t out_features;   // N
  int64_t groups;         // K / D: entries per output row and codebook
  int64_t num_codebooks;  // M (additive codebooks)
  int64_t num_entries;    // E <= 256 (uint8 indices) or <= 65536 (16-bit indices)
  int64_t entry_dim;      // D
  int64_t index_bytes;    // 1: uint8 indices; 2: int16 / uint16, read as uint16 (mod 2^16)
};

// Indices are uint8 (E <= 256) or 16 bits (E <= 65536): int16 codes, as AQLM stores them, are
// read as their uint16 bit pattern, i.e. modulo 2^16.
inline bool is_supported_index(at::ScalarType t) {
  return t == at::kByte || t == at::kShort || t == at::kUInt16;
}
inline int64_t max_entries(at::ScalarType index_type) {
  return index_type == at::kByte ? 256 : 65536;
}

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline void check_vector(const std::optional<at::Tensor>& v, const char* name, const at::Tensor& x,
                         int64_t n) {
  if (!v.has_value()) return;
  TORCH_CHECK_VALUE(v->dim() == 1 && v->size(0) == n, "codebook_matmul: ", name,
                    " must have shape [N] = [", n, "], got ", v->sizes());
  TORCH_CHECK_VALUE(v->scalar_type() == x.scalar_type(), "codebook_matmul: ", name,
                    " must have x's dtype ", x.scalar_type(), ", got ", v->scalar_type());
  TORCH_CHECK_VALUE(v->device() == x.device(), "codebook_matmul: ", name,
                    " must be on x's device ", x.device(), ", got ", v->device());
}

// A float16/bfloat16 codebook with float32 x (AQLM's 1x16 checkpoints keep their codebooks in
// float16): the CPU gather kernels read such entries as they are, accumulating in float32.
inline bool half_codebook_ok(const at::Tensor& x, const at::Tensor& indices,
                             const at::Tensor& codebook) {
  const at::ScalarType c = codebook.scalar_type();
  return x.scalar_type() == at::kFloat && (c == at::kHalf || c == at::kBFloat16) &&
         indices.scalar_type() != at::kByte && x.device().is_cpu() && codebook.device().is_cpu();
}

// Checks shapes, dtypes and devices (never tensor values) and returns the sizes.
inline Dims check_inputs(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& codebook,
                         const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "codebook_matmul: x must have shape [..., K], got a 0-d tensor");
  TORCH_CHECK_VALUE(is_supported_float(x.scalar_type()),
                    "codebook_matmul: x must be float32, float64, float16 or bfloat16, got ",
                    x.scalar_type());
  TORCH_CHECK_VALUE(is_supported_index(indices.scalar_type()),
                    "codebook_matmul: indices must be uint8, int16 or uint16, got ",
                    indices.scalar_type());
  TORCH_CHECK_VALUE(indices.dim() == 2 || indices.dim() == 3,
                    "codebook_matmul: indices must have shape [N, K/D] or [N, K/D, M], got ",
                    indices.sizes());
  TORCH_CHECK_VALUE(codebook.dim() == indices.dim(),
                    "codebook_matmul: codebook must have shape [E, D] for 2-d indices or [M, E, D] "
                    "for 3-d indices; got codebook ",
                    codebook.sizes(), " with indices ", indices.sizes());
  TORCH_CHECK_VALUE(codebook.scalar_type() == x.scalar_type() || half_codebook_ok(x, indices, codebook),
                    "codebook_matmul: codebook must have x's dtype ", x.scalar_type(),
                    " (or float16/bfloat16 with float32 x and 16-bit indices on CPU), got ",
                    codebook.scalar_type());
  TORCH_CHECK_VALUE(indices.device() == x.device(),
                    "codebook_matmul: indices must be on x's device ", x.device(), ", got ",
                    indices.device());
  TORCH_CHECK_VALUE(codebook.device() == x.device(),
                    "codebook_matmul: codebook must be on x's device ", x.device(), ", got ",
                    codebook.device());
  Dims d{};
  d.in_features = x.size(-1);
  d.rows = 1;
  for (int64_t i = 0; i + 1 < x.dim(); ++i) d.rows *= x.size(i);
  d.out_features = indices.size(0);
  d.groups = indices.size(1);
  d.num_codebooks = indices.dim() == 3 ? indices.size(2) : 1;
  d.num_entries = codebook.size(-2);
  d.entry_dim = codebook.size(-1);
  TORCH_CHECK_VALUE(d.num_codebooks >= 1, "codebook_matmul: indices' last dim M must be >= 1");
  if (codebook.dim() == 3) {
    TORCH_CHECK_VALUE(codebook.size(0) == d.num_codebooks,
                      "codebook_matmul: codebook has ", codebook.size(0),
                      " codebooks but indices' last dim M is ", d.num_codebooks);
  }
  d.index_bytes = indices.scalar_type() == at::kByte ? 1 : 2;
  const int64_t top = max_entries(indices.scalar_type());
  TORCH_CHECK_VALUE(d.num_entries >= 1 && d.num_entries <= top,
                    "codebook_matmul: codebook must have 1 to ", top, " entries E (",
                    d.index_bytes == 1 ? "uint8" : "16-bit", " indices), got E=", d.num_entries);
  TORCH_CHECK_VALUE(d.entry_dim >= 1, "codebook_matmul: codebook entry dim D must be >= 1");
  TORCH_CHECK_VALUE(d.in_features % d.entry_dim == 0, "codebook_matmul: x's last dim K=",
                    d.in_features, " must be a multiple of the codebook entry dim D=", d.entry_dim);
  TORCH_CHECK_VALUE(d.groups == d.in_features / d.entry_dim, "codebook_matmul: indices must have ",
                    "shape [N, K/D", (indices.dim() == 3 ? ", M]" : "]"), " with K/D = ",
                    d.in_features / d.entry_dim, ", got ", indices.sizes());
  check_vector(scales, "scales", x, d.out_features);
  check_vector(bias, "bias", x, d.out_features);
  return d;
}

// grad_out must be [..., N] with x's leading dimensions, dtype and device.
inline void check_grad_out(const at::Tensor& grad_out, const at::Tensor& x, const Dims& d) {
  auto expected = x.sizes().vec();
  expected.back() = d.out_features;
  TORCH_CHECK_VALUE(grad_out.sizes().vec() == expected,
                    "codebook_matmul_backward: grad_out must have shape ", at::IntArrayRef(expected),
                    ", got ", grad_out.sizes());
  TORCH_CHECK_VALUE(grad_out.scalar_type() == x.scalar_type(),
                    "codebook_matmul_backward: grad_out must have x's dtype ", x.scalar_type(),
                    ", got ", grad_out.scalar_type());
  TORCH_CHECK_VALUE(grad_out.device() == x.device(),
                    "codebook_matmul_backward: grad_out must be on x's device ", x.device(),
                    ", got ", grad_out.device());
}

// Every check of codebook_matmul_backward (the forward's, grad_out's and the mask's), for
// every backend; returns the problem's dimensions.
inline Dims check_backward_inputs(const at::Tensor& grad_out, const at::Tensor& x,
                                  const at::Tensor& indices, const at::Tensor& codebook,
                                  const std::optional<at::Tensor>& scales,
                                  std::array<bool, 4> mask) {
  const Dims d = check_inputs(x, indices, codebook, scales, std::nullopt);
  check_grad_out(grad_out, x, d);
  TORCH_CHECK_VALUE(!mask[2] || scales.has_value(),
                    "codebook_matmul_backward: output_mask[2] (grad_scales) needs scales");
  return d;
}

// Output shape [..., N].
inline std::vector<int64_t> output_shape(const at::Tensor& x, const Dims& d) {
  auto shape = x.sizes().vec();
  shape.back() = d.out_features;
  return shape;
}

}  // namespace rlx::codebook
