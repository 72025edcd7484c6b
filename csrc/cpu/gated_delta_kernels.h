// Gated delta rule on the CPU: the kernels' entry points, which each ISA copy defines
// (cpu_isa.h), and what the host code (the ops in gated_delta_forward.cpp,
// gated_delta_backward.cpp and gated_delta_l2norm.cpp, compiled once) hands them: raw
// pointers and sizes. Included
// before the ISA region, so that nothing here is compiled for AVX2.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "rlx/acc_type.h"
#include "rlx/gdn_backward_layout.h"
#include "rlx/gdn_checks.h"
#include "cpu_isa.h"

namespace rlx {

// Raw pointers of one call; token index tok = b * T + t (the packed position when varlen).
template <typename in_t, typename acc_t>
struct Views {
  const in_t *q, *k, *v;
  const acc_t *g, *beta;
  const int64_t* cu;  // nullptr when not varlen
  acc_t scale;
  bool l2norm;  // q and k are L2-normalized inside the kernels (l2norm_row.h)
  acc_t l2norm_eps;
};

// The kernels' input dtypes, each entry point explicitly instantiated for them (in the file
// that defines it): float32 and float64 (the host code widens 16-bit inputs to float32).
#define RLX_GDN_INSTANTIATE(MACRO) \
  MACRO(float, float)              \
  MACRO(double, double)

RLX_ISA_DECLARE(
    // The forward (gated_delta_forward.cpp): o, the final states ht, the checkpoints (every
    // used slot) and vw when kept (else nullptr); h0: the initial states or nullptr.
    template <typename in_t, typename acc_t>
    void gdn_forward(const GdnProblem& p, const Views<in_t, acc_t>& in, const acc_t* h0,
                     in_t* o, acc_t* ht, acc_t* ckpt, acc_t* vw);

    // Token by token (gated_delta_backward_recurrent.cpp): recomputes each chunk's states
    // from its checkpoint, then runs the reverse recurrence over them.
    template <typename in_t, typename acc_t>
    void gdn_backward_recurrent(const GdnProblem& p, const Views<in_t, acc_t>& in,
                                const acc_t* ckpt, const in_t* grad_o, const acc_t* grad_ht,
                                const GdnBackwardLayout& lay, acc_t* buf);

    // Chunked (gated_delta_backward_chunked.cpp): one gate per head, every g <= 0. vw_saved:
    // the forward's vw, or nullptr (then solved for).
    template <typename in_t, typename acc_t>
    void gdn_backward_chunked(const GdnProblem& p, const Views<in_t, acc_t>& in,
                              const acc_t* ckpt, const acc_t* vw_saved, const in_t* grad_o,
                              const acc_t* grad_ht, const GdnBackwardLayout& lay, acc_t* buf);

    // Whether vw disagrees with the checkpoints and inputs (gated_delta_backward.cpp).
    template <typename in_t, typename acc_t>
    bool gdn_vw_mismatch(const GdnProblem& p, const Views<in_t, acc_t>& in, const acc_t* ckpt,
                         const acc_t* vw);

    // fla's l2norm over rows of D values (gated_delta_l2norm.cpp), for every floating
    // scalar_t: y = x rstd, rstd = (sum x^2 + eps)^-1/2; and its backward,
    // dx = rstd (dy - x rstd^2 (x . dy)).
    template <typename scalar_t>
    void l2norm_rows(const scalar_t* x, int64_t rows, int64_t D, double eps, scalar_t* y,
                     acc_type_t<scalar_t>* rstd);
    template <typename scalar_t>
    void l2norm_backward_rows(const scalar_t* grad, const scalar_t* x,
                              const acc_type_t<scalar_t>* rstd, int64_t rows, int64_t D,
                              scalar_t* dx);)

// Whether the forward keeps vw = v - P^T k per token (gated_delta_fwd's fourth output): the
// chunked backward (one gate per head) then reads it instead of recomputing it, a triangular
// solve and a product with the state per sub-chunk. The token-by-token backward (a gate per
// key channel) does not use it.
inline bool gdn_keeps_vw(const GdnProblem& p) { return gdn_keeps_vw(p.chunk, p.gate_per_channel); }

inline std::optional<at::Tensor> contiguous_opt(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return t;
  return t->contiguous();
}

template <typename in_t, typename acc_t>
Views<in_t, acc_t> make_views(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& g, const at::Tensor& beta,
                              const std::optional<at::Tensor>& cu, double scale,
                              std::optional<double> l2norm_eps) {
  return Views<in_t, acc_t>{q.data_ptr<in_t>(),    k.data_ptr<in_t>(),
                            v.data_ptr<in_t>(),    g.data_ptr<acc_t>(),
                            beta.data_ptr<acc_t>(), cu ? cu->data_ptr<int64_t>() : nullptr,
                            static_cast<acc_t>(scale), l2norm_eps.has_value(),
                            static_cast<acc_t>(l2norm_eps.value_or(0))};
}

}  // namespace rlx
