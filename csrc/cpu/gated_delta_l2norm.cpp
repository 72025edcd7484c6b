// fla's l2norm over the last dim, y = x / sqrt(sum(x^2) + eps), as one native op per
// direction: q and k are normalized with 2 parallel regions instead of a dozen small ops.
// Accumulates in float32 (float64 for float64 input); y keeps x's dtype.
#include "cpu_kernel_deps.h"
#include "gated_delta_kernels.h"

RLX_ISA_BEGIN
#include "l2norm_row.h"

namespace rlx {
namespace RLX_ISA_NS {
namespace {

// Rows per task: about 64K elements (256 KiB of float32), enough to amortize waking a
// thread; q/k of the benchmark's small shape (512K elements) took 0.3 ms on one thread.
int64_t grain(int64_t D) { return std::max<int64_t>(1, (int64_t(1) << 16) / D); }

}  // namespace

template <typename scalar_t>
void l2norm_rows(const scalar_t* xp, int64_t rows, int64_t D, double eps, scalar_t* yp,
                 acc_type_t<scalar_t>* rp) {
  using acc_t = acc_type_t<scalar_t>;
  at::parallel_for(0, rows, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t* row = xp + i * D;
      const acc_t r = l2norm_rstd<acc_t>(row, D, static_cast<acc_t>(eps));
      rp[i] = r;
      for (int64_t d = 0; d < D; ++d) {
        yp[i * D + d] = static_cast<scalar_t>(static_cast<acc_t>(row[d]) * r);
      }
    }
  });
}

// y = x r with r = (sum x^2 + eps)^-1/2:  dx = r (dy - x r^2 (x . dy)).
template <typename scalar_t>
void l2norm_backward_rows(const scalar_t* gp, const scalar_t* xp,
                          const acc_type_t<scalar_t>* rp, int64_t rows, int64_t D,
                          scalar_t* dp) {
  using acc_t = acc_type_t<scalar_t>;
  at::parallel_for(0, rows, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t* xr = xp + i * D;
      const scalar_t* gr = gp + i * D;
      const acc_t xg = row_dot<acc_t>(xr, gr, D);
      const acc_t r = rp[i], c = r * r * xg;
      for (int64_t d = 0; d < D; ++d) {
        const acc_t dy = static_cast<acc_t>(gr[d]), xv = static_cast<acc_t>(xr[d]);
        dp[i * D + d] = static_cast<scalar_t>(r * (dy - xv * c));
      }
    }
  });
}

#define RLX_INSTANTIATE_L2NORM(scalar_t)                                                    \
  template void l2norm_rows<scalar_t>(const scalar_t*, int64_t, int64_t, double, scalar_t*, \
                                      acc_type_t<scalar_t>*);                               \
  template void l2norm_backward_rows<scalar_t>(const scalar_t*, const scalar_t*,            \
                                               const acc_type_t<scalar_t>*, int64_t, int64_t, \
                                               scalar_t*);
RLX_INSTANTIATE_L2NORM(float)
RLX_INSTANTIATE_L2NORM(double)
RLX_INSTANTIATE_L2NORM(at::Half)
RLX_INSTANTIATE_L2NORM(at::BFloat16)

}  // namespace RLX_ISA_NS
}  // namespace rlx
RLX_ISA_END

#if !defined(RLX_ISA_AVX2_COPY)
// The ops: host code, compiled once.
namespace rlx {
namespace {

void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, op,
              ": x must have at least one dim with a non-empty last dim, got ", x.sizes());
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble, op,
              ": x must be float16, bfloat16, float32 or float64, got ", t);
}

std::tuple<at::Tensor, at::Tensor> l2norm_fwd_cpu(const at::Tensor& x_in, double eps) {
  check_x("rlx::gated_delta_l2norm_fwd", x_in);
  const at::Tensor x = x_in.contiguous();
  const int64_t D = x.size(-1), rows = x.numel() / D;
  at::Tensor y = at::empty_like(x);
  advise_huge_pages(y);
  at::Tensor rstd =
      at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(acc_dtype(x.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "l2norm_fwd", [&] {
    RLX_ISA_CALL(l2norm_rows<scalar_t>)(x.data_ptr<scalar_t>(), rows, D, eps,
                                        y.data_ptr<scalar_t>(),
                                        rstd.data_ptr<acc_type_t<scalar_t>>());
  });
  return {y, rstd};
}

at::Tensor l2norm_bwd_cpu(const at::Tensor& grad_in, const at::Tensor& x_in,
                          const at::Tensor& rstd_in) {
  const char* op = "rlx::gated_delta_l2norm_bwd";
  check_x(op, x_in);
  TORCH_CHECK(grad_in.sizes() == x_in.sizes() && grad_in.scalar_type() == x_in.scalar_type(),
              op,
              ": grad_y must have x's shape ", x_in.sizes(), " and dtype ", x_in.scalar_type(),
              ", got ", grad_in.scalar_type(), " ", grad_in.sizes());
  TORCH_CHECK(rstd_in.sizes() == x_in.sizes().slice(0, x_in.dim() - 1) &&
                  rstd_in.scalar_type() == acc_dtype(x_in.scalar_type()),
              op, ": rstd must be the ", acc_dtype(x_in.scalar_type()), " tensor of shape ",
              x_in.sizes().slice(0, x_in.dim() - 1), " from gated_delta_l2norm_fwd, got ",
              rstd_in.scalar_type(), " ", rstd_in.sizes());
  const at::Tensor x = x_in.contiguous(), grad = grad_in.contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const int64_t D = x.size(-1), rows = x.numel() / D;
  at::Tensor dx = at::empty_like(x);
  advise_huge_pages(dx);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "l2norm_bwd", [&] {
    RLX_ISA_CALL(l2norm_backward_rows<scalar_t>)(
        grad.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
        rstd.data_ptr<acc_type_t<scalar_t>>(), rows, D, dx.data_ptr<scalar_t>());
  });
  return dx;
}

}  // namespace
}  // namespace rlx

TORCH_LIBRARY_IMPL(rlx, CPU, m) {
  m.impl("gated_delta_l2norm_fwd", &rlx::l2norm_fwd_cpu);
  m.impl("gated_delta_l2norm_bwd", &rlx::l2norm_bwd_cpu);
}
#endif
