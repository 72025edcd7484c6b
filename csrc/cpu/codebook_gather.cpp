// rlx::codebook_matmul and its backward for 16-bit indices on CPU: the gather kernels of
// codebook_gather.h for small batches, dequantized tiles + GEMM (codebook_lut.h) for large
// ones. codebook.cpp and codebook_backward.cpp call these after checking the inputs.
#include "cpu_kernel_deps.h"
#include "codebook_kernels.h"

RLX_ISA_BEGIN
#include "codebook_gather.h"

namespace rlx::codebook::cpu::RLX_ISA_NS {
namespace {

const uint16_t* u16_data(const at::Tensor& contiguous_indices) {
  // int16 and uint16 share the bit pattern; reading uint16 is AQLM's "modulo 2^16".
  return static_cast<const uint16_t*>(contiguous_indices.const_data_ptr());
}

// raw[b, j] = sum_{g,m} x[b, g] . C[m, I[j,g,m]] in acc_t ([B, N], unscaled, no bias).
template <typename acc_t>
at::Tensor gather_raw(const Dims& d, const at::Tensor& x_acc, const uint16_t* ip,
                      const at::Tensor& idx, const CodebookAcc<acc_t>& C) {
  if (use_gather_dense(d)) {
    check_index_range_u16(ip, idx.numel(), d);
    return dense_raw<acc_t>(d, x_acc, ip, C.data());
  }
  auto raw = at::empty({d.rows, d.out_features}, x_acc.options());
  BadIndex bad;
  gather_forward<acc_t>(d, x_acc.const_data_ptr<acc_t>(), ip, C.data(), raw.data_ptr<acc_t>(),
                        bad);
  bad.raise_if_any(d);
  return raw;
}

}  // namespace

at::Tensor gather_forward_op(const at::Tensor& x, const at::Tensor& indices,
                             const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
                             const std::optional<at::Tensor>& bias, const Dims& d) {
  auto out = at::empty(output_shape(x, d), x.options());
  if (out.numel() == 0) return out;
  const at::ScalarType acc = acc_dtype(x.scalar_type());
  auto x_acc = x.reshape({d.rows, d.in_features}).to(acc).contiguous();
  auto idx = indices.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "codebook_matmul", [&] {
    using acc_t = typename AccType<scalar_t>::type;
    const CodebookAcc<acc_t> C(codebook, d, /*transposed=*/false);
    at::Tensor raw = gather_raw<acc_t>(d, x_acc, u16_data(idx), idx, C);
    if (scales.has_value()) raw = raw * scales->to(acc);
    if (bias.has_value()) raw = raw + bias->to(acc);
    out.view({d.rows, d.out_features}).copy_(raw);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gather_backward_op(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& indices,
    const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
    std::array<bool, 4> mask, const Dims& d) {
  const auto skipped = [&] { return at::empty({0}, x.options()); };
  const at::ScalarType acc = acc_dtype(x.scalar_type());
  auto g_acc = grad_out.reshape({d.rows, d.out_features}).to(acc).contiguous();
  auto x_acc = x.reshape({d.rows, d.in_features}).to(acc).contiguous();
  auto idx = indices.contiguous();
  const uint16_t* ip = u16_data(idx);
  at::Tensor dx = skipped(), dC = skipped(), ds = skipped(), db = skipped();
  if (mask[3]) db = g_acc.sum(0).to(x.scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "codebook_matmul_backward", [&] {
    using acc_t = typename AccType<scalar_t>::type;
    const CodebookAcc<acc_t> C(codebook, d, /*transposed=*/false);
    if (mask[2]) ds = (g_acc * gather_raw<acc_t>(d, x_acc, ip, idx, C)).sum(0).to(x.scalar_type());
    if (!mask[0] && !mask[1]) return;
    const at::Tensor gs = scales.has_value() ? (g_acc * scales->to(acc)).contiguous() : g_acc;
    const int64_t med = d.num_codebooks * d.num_entries * d.entry_dim;
    at::Tensor parts, dx_acc;
    if (use_gather_dense(d)) {
      check_index_range_u16(ip, idx.numel(), d);
      const int64_t gpb = std::max<int64_t>(1, ceil_div(d.groups, 16));
      if (mask[1]) parts = at::zeros({ceil_div(d.groups, gpb), med}, at::dtype(acc));
      if (mask[0]) dx_acc = at::zeros({d.rows, d.in_features}, at::dtype(acc));
      dense_backward<acc_t>(d, gs, x_acc, ip, C.data(), mask[0] ? &dx_acc : nullptr,
                            mask[1] ? parts.data_ptr<acc_t>() : nullptr, gpb);
    } else {
      const int64_t chunks = gather_backward_chunks(d, sizeof(acc_t), mask[1]);
      if (mask[1]) parts = at::zeros({chunks, med}, at::dtype(acc));
      if (mask[0]) dx_acc = at::empty({d.rows, d.in_features}, at::dtype(acc));
      BadIndex bad;
      gather_backward<acc_t>(d, gs.const_data_ptr<acc_t>(), x_acc.const_data_ptr<acc_t>(), ip,
                             C.data(), mask[0] ? dx_acc.data_ptr<acc_t>() : nullptr,
                             mask[1] ? parts.data_ptr<acc_t>() : nullptr, chunks, bad);
      bad.raise_if_any(d);
    }
    if (mask[0]) dx = dx_acc.view(x.sizes()).to(x.scalar_type()).contiguous();
    if (mask[1]) {
      // Fixed-order reduction of the chunk partials.
      at::Tensor total = at::zeros({med}, at::dtype(acc));
      for (int64_t p = 0; p < parts.size(0); ++p) total.add_(parts[p]);
      dC = total.view(codebook.sizes()).to(x.scalar_type());
    }
  });
  return {dx, dC, ds, db};
}

}  // namespace rlx::codebook::cpu::RLX_ISA_NS
RLX_ISA_END
