// Gated delta rule on the CPU, backward: the op (host code, compiled once). Checks the inputs
// (and the checkpoints' tag, and vw against the checkpoints: the one kernel here), then runs
// one of the two algorithms (gated_delta_kernels.h): the chunked one where it applies, else
// the token-by-token one. Shared parts and the overview:
// gated_delta_common.h.
#include "cpu_kernel_deps.h"
#include "gated_delta_kernels.h"

RLX_ISA_BEGIN
#include "gated_delta_backward.h"

namespace rlx {
namespace RLX_ISA_NS {

// vw of each chunk's first token against the chunk's checkpoint S (vw = v - exp(g) S^T k;
// vw is only kept with one gate per head): a vw of another forward, e.g. of other inputs,
// fails here instead of giving wrong gradients. One K x V pass per chunk, where the
// chunk's backward makes several per token.
template <typename in_t, typename acc_t>
bool gdn_vw_mismatch(const GdnProblem& p, const Views<in_t, acc_t>& in, const acc_t* ckpt,
                     const acc_t* vw) {
  const int64_t K = p.head_k_dim, V = p.head_v_dim, H = p.num_qk_heads, HV = p.num_v_heads;
  const int64_t C = p.chunk;
  // Far above the forward's rounding (its state is kept scaled by factors in [2^-20, 2^20]),
  // far below a difference in any input.
  const acc_t tol = std::is_same_v<acc_t, double> ? acc_t(1e-9) : acc_t(1e-3);
  std::atomic<bool> mismatch{false};
  at::parallel_for(0, p.num_seqs * HV, 1, [&](int64_t begin, int64_t end) {
    AccVec<acc_t> kr(K), w(V), mag(V);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / HV, hv = task % HV, h = hv / p.group();
      int64_t bos, eos;
      gdn_sequence_bounds(p, in.cu, n, &bos, &eos);
      const int64_t base = gdn_checkpoint_base(n, bos, C);
      for (int64_t c = 0; c < gdn_num_chunks(eos - bos, C); ++c) {
        const int64_t tok = bos + c * C;
        const acc_t* S = ckpt + ((base + c) * HV + hv) * K * V;
        const in_t* kt = in.k + (tok * H + h) * K;
        const acc_t r = in.l2norm ? l2norm_rstd<acc_t>(kt, K, in.l2norm_eps) : acc_t(1);
        const acc_t a = std::exp(in.g[tok * HV + hv]);
        std::fill(w.begin(), w.end(), acc_t(0));
        std::fill(mag.begin(), mag.end(), acc_t(0));
        for (int64_t i = 0; i < K; ++i) {
          kr[i] = r * static_cast<acc_t>(kt[i]);
          for (int64_t j = 0; j < V; ++j) {
            w[j] += kr[i] * S[i * V + j];
            mag[j] += std::abs(kr[i] * S[i * V + j]);
          }
        }
        const in_t* vt = in.v + (tok * HV + hv) * V;
        const acc_t* got = vw + (tok * HV + hv) * V;
        for (int64_t j = 0; j < V; ++j) {
          const acc_t vj = static_cast<acc_t>(vt[j]), expected = vj - a * w[j];
          if (!std::isfinite(expected)) continue;  // non-finite inputs: nothing to compare
          if (!(std::abs(got[j] - expected) <= tol * (1 + std::abs(vj) + a * mag[j]))) {
            mismatch = true;
          }
        }
      }
    }
  });
  return mismatch;
}

#define RLX_INSTANTIATE_VW_CHECK(in_t, acc_t)                                              \
  template bool gdn_vw_mismatch<in_t, acc_t>(const GdnProblem&, const Views<in_t, acc_t>&, \
                                             const acc_t*, const acc_t*);
RLX_GDN_INSTANTIATE(RLX_INSTANTIATE_VW_CHECK)

}  // namespace RLX_ISA_NS
}  // namespace rlx
RLX_ISA_END

#if !defined(RLX_ISA_AVX2_COPY) && !defined(RLX_ISA_AVX512_COPY)
// The op: host code, compiled once.
namespace rlx {
namespace {

// The chunked backward for one gate per head when every g <= 0 (decays, its domain: see
// gated_delta_backward_chunked.cpp), the token-by-token one otherwise.
// RLX_GDN_RECURRENT_BACKWARD=1 forces the token-by-token one (for comparisons).
template <typename acc_t>
bool use_chunked_backward(const GdnProblem& p, const at::Tensor& g) {
  if (p.gate_per_channel) return false;
  const char* force = std::getenv("RLX_GDN_RECURRENT_BACKWARD");
  if (force != nullptr && force[0] == '1') return false;
  const acc_t* x = g.data_ptr<acc_t>();
  bool ok = true;
  for (int64_t i = 0, n = g.numel(); i < n; ++i) ok &= x[i] <= acc_t(0);  // false for NaN
  return ok;
}

}  // namespace

at::Tensor gated_delta_bwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                               const at::Tensor& v_in, const at::Tensor& g_in,
                               const at::Tensor& beta_in, double scale,
                               const std::optional<at::Tensor>& initial_state,
                               const std::optional<at::Tensor>& cu_seqlens,
                               const at::Tensor& checkpoints, const at::Tensor& grad_o_in,
                               const std::optional<at::Tensor>& grad_final_state,
                               int64_t chunk_size, std::optional<double> l2norm_eps,
                               const std::optional<at::Tensor>& vw_in) {
  const char* op = "rlx::gated_delta_bwd";
  gdn_check_l2norm_eps(op, l2norm_eps);
  const GdnProblem p =
      gdn_check_inputs(op, q_in, k_in, v_in, g_in, beta_in, initial_state, cu_seqlens, chunk_size);
  // The checks every backend shares (shapes, devices, vw as the forward returned it).
  gdn_check_backward_inputs(op, p, q_in, v_in, checkpoints, grad_o_in, grad_final_state, vw_in);
  const int64_t K = p.head_k_dim, V = p.head_v_dim, HV = p.num_v_heads;
  const bool has_vw = vw_in.has_value() && vw_in->numel() > 0;
  gdn_check_checkpoint_tag(op, checkpoints,
                           gdn_checkpoint_tag(p.chunk, l2norm_eps, gdn_keeps_vw(p)));
  if (p.input_dtype == at::kHalf || p.input_dtype == at::kBFloat16) {
    // As in the forward: 16-bit q, k, v and grad_o go through the float32 kernels on float32
    // copies (the kernels widen every element they read; the gradients are float32 anyway).
    return gated_delta_bwd_cpu(q_in.to(at::kFloat), k_in.to(at::kFloat), v_in.to(at::kFloat),
                               g_in, beta_in, scale, initial_state, cu_seqlens, checkpoints,
                               grad_o_in.to(at::kFloat), grad_final_state, chunk_size, l2norm_eps,
                               vw_in);
  }
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const at::Tensor g = g_in.contiguous(), beta = beta_in.contiguous();
  const at::Tensor ckpt = checkpoints.contiguous(), grad_o = grad_o_in.contiguous();
  const at::Tensor vw = has_vw ? vw_in->contiguous() : at::Tensor();
  const auto grad_ht = contiguous_opt(grad_final_state);
  const auto cu = contiguous_opt(cu_seqlens);
  const GdnBackwardLayout lay = GdnBackwardLayout::make(
      p.batch, p.seq_len, p.num_qk_heads, HV, K, V, p.num_seqs, p.gate_per_channel,
      p.has_initial_state);
  // Every slice is fully written (the first value head of a group assigns dq/dk).
  at::Tensor buf = at::empty({lay.total}, q.options().dtype(p.acc_dtype));
  advise_huge_pages(buf);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gated_delta_bwd", [&] {
    using acc_t = acc_type_t<scalar_t>;
    const auto views = make_views<scalar_t, acc_t>(q, k, v, g, beta, cu, scale, l2norm_eps);
    const acc_t* gh = grad_ht ? grad_ht->data_ptr<acc_t>() : nullptr;
    if (has_vw && !p.gate_per_channel) {  // (the token-by-token backward does not read vw)
      TORCH_CHECK(!RLX_ISA_CALL_AVX512(gdn_vw_mismatch<scalar_t, acc_t>)(
                      p, views, ckpt.data_ptr<acc_t>(), vw.data_ptr<acc_t>()),
                  op, ": vw does not match the checkpoints and inputs: pass the vw that ",
                  "rlx::gated_delta_fwd returned with these checkpoints for these inputs (or None)");
    }
    if (use_chunked_backward<acc_t>(p, g)) {
      RLX_ISA_CALL_AVX512(gdn_backward_chunked<scalar_t, acc_t>)(
          p, views, ckpt.data_ptr<acc_t>(), has_vw ? vw.data_ptr<acc_t>() : nullptr,
          grad_o.data_ptr<scalar_t>(), gh, lay, buf.data_ptr<acc_t>());
    } else {
      RLX_ISA_CALL_AVX512(gdn_backward_recurrent<scalar_t, acc_t>)(
          p, views, ckpt.data_ptr<acc_t>(), grad_o.data_ptr<scalar_t>(), gh, lay,
          buf.data_ptr<acc_t>());
    }
  });
  return buf;
}

}  // namespace rlx

TORCH_LIBRARY_IMPL(rlx, CPU, m) {
  m.impl("gated_delta_bwd", &rlx::gated_delta_bwd_cpu);
}
#endif
