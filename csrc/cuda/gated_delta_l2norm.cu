// rlx::gated_delta_l2norm_fwd / _bwd on CUDA: fla's l2norm over the last dim, as on the CPU
// (csrc/cpu/gated_delta_l2norm.cpp): y = x r, r = (sum x^2 + eps)^-1/2 in the accumulation
// dtype; dx = r (dy - x r^2 (x . dy)). The kernels are gated_delta_l2norm.cuh's; the ops run
// below autograd (they have no autograd formula; like the CPU kernels they must not record
// one of their own for inputs that require grad).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "gated_delta_l2norm.cuh"
#include "rlx/gdn_checks.h"

namespace rlx::gdn::cuda {
namespace {

void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, op,
              ": x must have at least one dim with a non-empty last dim, got ", x.sizes());
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble, op,
              ": x must be float16, bfloat16, float32 or float64, got ", t);
}

std::tuple<at::Tensor, at::Tensor> l2norm_fwd_cuda(const at::Tensor& x, double eps) {
  const char* op = "rlx::gated_delta_l2norm_fwd";
  check_x(op, x);
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const c10::cuda::CUDAGuard guard(x.device());
  return l2norm_rows(x, eps, /*out_acc=*/false, /*want_rstd=*/true);
}

at::Tensor l2norm_bwd_cuda(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& rstd) {
  const char* op = "rlx::gated_delta_l2norm_bwd";
  check_x(op, x);
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto acc = gdn_acc_dtype(x.scalar_type());
  TORCH_CHECK(grad_y.sizes() == x.sizes() && grad_y.scalar_type() == x.scalar_type(), op,
              ": grad_y must have x's shape ", x.sizes(), " and dtype ", x.scalar_type(),
              ", got ", grad_y.scalar_type(), " ", grad_y.sizes());
  TORCH_CHECK(rstd.sizes() == x.sizes().slice(0, x.dim() - 1) && rstd.scalar_type() == acc, op,
              ": rstd must be the ", acc, " tensor of shape ",
              x.sizes().slice(0, x.dim() - 1), " from gated_delta_l2norm_fwd, got ",
              rstd.scalar_type(), " ", rstd.sizes());
  TORCH_CHECK(grad_y.device() == x.device() && rstd.device() == x.device(), op,
              ": grad_y, x and rstd must be on one device");
  const c10::cuda::CUDAGuard guard(x.device());
  return l2norm_rows_backward(x, grad_y, rstd);
}

}  // namespace
}  // namespace rlx::gdn::cuda

TORCH_LIBRARY_IMPL(rlx, CUDA, m) {
  m.impl("gated_delta_l2norm_fwd", &rlx::gdn::cuda::l2norm_fwd_cuda);
  m.impl("gated_delta_l2norm_bwd", &rlx::gdn::cuda::l2norm_bwd_cuda);
}
