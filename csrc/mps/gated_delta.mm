// Gated delta rule on MPS: host code of csrc/mps/kernels/gated_delta.metal. Validation is every
// backend's (rlx/gdn_checks.h), launch plans come from rlx/mps_gated_delta_plan.h (also run by
// the Linux emulator tests), encoding from mps_common.h. Same contracts as the CPU op:
// checkpoints every chunk_size tokens, one packed float32 gradient buffer.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "mps_common.h"
#include "rlx/gdn_backward_layout.h"
#include "rlx/gdn_checks.h"
#include "rlx/mps_gated_delta_plan.h"

namespace rlx {
namespace {

constexpr const char* kSource = "gated_delta";

mps::GdnDtype kernel_dtype(const char* op, at::ScalarType t) {
  switch (t) {
    case at::kFloat: return mps::GdnDtype::Float32;
    case at::kHalf: return mps::GdnDtype::Float16;
    case at::kBFloat16: return mps::GdnDtype::BFloat16;
    default:
      TORCH_CHECK(false, op, ": on MPS, q, k and v must be float32, float16 or bfloat16 (Apple "
                  "GPUs have no float64), got ", t);
  }
  return mps::GdnDtype::Float32;
}

// Sizes for the plan. The longest sequence bounds the backward's windows; cu_seqlens was
// already read on the host by gdn_check_inputs, this reads it once more.
mps::GdnShape shape_of(const char* op, const GdnProblem& p,
                       const std::optional<at::Tensor>& cu_seqlens, double scale,
                       bool has_grad_final, std::optional<double> l2norm_eps) {
  mps::GdnShape s;
  s.batch = p.batch;
  s.seq_len = p.seq_len;
  s.num_qk_heads = p.num_qk_heads;
  s.num_v_heads = p.num_v_heads;
  s.head_k_dim = p.head_k_dim;
  s.head_v_dim = p.head_v_dim;
  s.num_seqs = p.num_seqs;
  s.chunk = p.chunk;
  s.gate_per_channel = p.gate_per_channel;
  s.varlen = p.varlen;
  s.has_initial_state = p.has_initial_state;
  s.has_grad_final = has_grad_final;
  s.scale = scale;
  s.qk_l2norm = l2norm_eps.has_value();
  s.l2norm_eps = l2norm_eps.value_or(0.0);
  s.dtype = kernel_dtype(op, p.input_dtype);
  int64_t longest = p.seq_len;
  if (cu_seqlens.has_value()) {
    const at::Tensor cu = cu_seqlens->to(at::kCPU).contiguous();
    const int64_t* c = cu.data_ptr<int64_t>();
    longest = 0;
    for (int64_t i = 0; i + 1 < cu.numel(); ++i) longest = std::max(longest, c[i + 1] - c[i]);
  }
  s.max_chunks = gdn_num_chunks(longest, p.chunk);
  const int64_t limit = int64_t(UINT32_MAX);
  TORCH_CHECK(p.seq_len < limit && p.num_seqs < limit && s.max_chunks * p.chunk < limit, op,
              ": sequences longer than 2^32 tokens are not supported on MPS");
  return s;
}

void check_mps(const char* op, const at::Tensor& q) {
  TORCH_CHECK(q.is_mps(), op, ": q must be on the MPS device, got ", q.device());
}

// cu_seqlens may come from the CPU (it is small, and read on the host anyway).
at::Tensor on_device(const at::Tensor& cu_seqlens, const at::Tensor& like) {
  return cu_seqlens.to(like.device()).contiguous();
}

uint32_t max_threads(bool backward, mps::GdnDtype t) {
  return mps::max_threads(kSource, mps::gdn_kernel_name(backward, t));
}

// The checkpoints' tag (rlx/gdn_checks.h) in the first 4 bytes of the last slot: written by a
// PyTorch fill behind the forward kernel (same stream, so after its zeros), and read back on
// the host before the backward (one 4-byte copy, which waits for the GPU like the read of
// cu_seqlens in shape_of).
uint32_t tag_of(const mps::GdnShape& s, std::optional<double> l2norm_eps) {
  return gdn_checkpoint_tag(s.chunk, l2norm_eps, mps::gdn_forward_keeps_vw(s));
}

void write_tag(at::Tensor& ckpt, uint32_t tag) {
  if (ckpt.numel() == 0) return;
  int32_t word = 0;
  std::memcpy(&word, &tag, sizeof(word));
  ckpt.select(0, ckpt.size(0) - 1).view({-1}).view(at::kInt).narrow(0, 0, 1).fill_(word);
}

void check_tag(const char* op, const at::Tensor& ckpt, uint32_t tag) {
  if (ckpt.numel() == 0) return;
  // [1, 1]: the last slot's first element, on the host, for the CPU op's own check.
  const at::Tensor head = ckpt.narrow(0, ckpt.size(0) - 1, 1).reshape({1, -1}).narrow(1, 0, 1);
  gdn_check_checkpoint_tag(op, head.to(at::kCPU), tag);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_delta_fwd_mps(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& g_in, const at::Tensor& beta_in, double scale,
    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
    int64_t chunk_size, std::optional<double> l2norm_eps) {
  const char* op = "rlx::gated_delta_fwd";
  const GdnProblem p = gdn_check_inputs(op, q_in, k_in, v_in, g_in, beta_in, initial_state,
                                        cu_seqlens, chunk_size);
  gdn_check_l2norm_eps(op, l2norm_eps);  // (the CPU forward's order)
  check_mps(op, q_in);
  const mps::GdnShape s = shape_of(op, p, cu_seqlens, scale, false, l2norm_eps);
  const int64_t K = p.head_k_dim, V = p.head_v_dim, HV = p.num_v_heads;
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const at::Tensor g = g_in.contiguous(), beta = beta_in.contiguous();
  at::Tensor o = at::empty_like(v, at::MemoryFormat::Contiguous);
  at::Tensor ht = at::empty({p.num_seqs, HV, K, V}, q.options().dtype(at::kFloat));
  at::Tensor ckpt = at::empty({gdn_checkpoint_slots(p.num_seqs, p.tokens(), p.chunk), HV, K, V},
                              q.options().dtype(at::kFloat));
  // vw (v - P^T k per token) as the CPU forward returns it (rlx::gdn_keeps_vw)
  at::Tensor vw = at::empty(mps::gdn_forward_keeps_vw(s) ? v.sizes() : at::IntArrayRef{0},
                            q.options().dtype(at::kFloat));
  const mps::GdnForwardPlan plan = mps::gdn_forward_plan(s, max_threads(false, s.dtype));
  mps::Dispatch d;
  d.launch = plan.launch;
  d.set_params(plan.params);
  // Absent optional inputs bind a tensor the kernel never reads (its flags say so).
  d.buffers = {{mps::kFwdQ, q},
               {mps::kFwdK, k},
               {mps::kFwdV, v},
               {mps::kFwdG, g},
               {mps::kFwdBeta, beta},
               {mps::kFwdInitialState, initial_state ? initial_state->contiguous() : ht},
               {mps::kFwdCuSeqlens, cu_seqlens ? on_device(*cu_seqlens, q) : ht},
               {mps::kFwdO, o},
               {mps::kFwdFinalState, ht},
               {mps::kFwdCheckpoints, ckpt.numel() > 0 ? ckpt : ht},  // chunk_size 0: none
               {mps::kFwdVw, vw.numel() > 0 ? vw : ht}};
  mps::encode(kSource, {d});
  write_tag(ckpt, tag_of(s, l2norm_eps));
  return {o, ht, ckpt, vw};
}

at::Tensor gated_delta_bwd_mps(const at::Tensor& q_in, const at::Tensor& k_in,
                               const at::Tensor& v_in, const at::Tensor& g_in,
                               const at::Tensor& beta_in, double scale,
                               const std::optional<at::Tensor>& initial_state,
                               const std::optional<at::Tensor>& cu_seqlens,
                               const at::Tensor& checkpoints, const at::Tensor& grad_o_in,
                               const std::optional<at::Tensor>& grad_final_state,
                               int64_t chunk_size, std::optional<double> l2norm_eps,
                               const std::optional<at::Tensor>& vw) {
  const char* op = "rlx::gated_delta_bwd";
  gdn_check_l2norm_eps(op, l2norm_eps);
  const GdnProblem p =
      gdn_check_inputs(op, q_in, k_in, v_in, g_in, beta_in, initial_state, cu_seqlens, chunk_size);
  // (vw, when given, is checked like on every backend and not read: the kernels recompute
  // v - P^T k alongside the states they recompute anyway)
  gdn_check_backward_inputs(op, p, q_in, v_in, checkpoints, grad_o_in, grad_final_state, vw);
  check_mps(op, q_in);
  const int64_t K = p.head_k_dim, V = p.head_v_dim, HV = p.num_v_heads;
  const mps::GdnShape s =
      shape_of(op, p, cu_seqlens, scale, grad_final_state.has_value(), l2norm_eps);
  check_tag(op, checkpoints, tag_of(s, l2norm_eps));
  const GdnBackwardLayout lay = GdnBackwardLayout::make(
      p.batch, p.seq_len, p.num_qk_heads, HV, K, V, p.num_seqs, p.gate_per_channel,
      p.has_initial_state);
  const auto f32 = q_in.options().dtype(at::kFloat);
  // Every element is written by the kernels (no zero-fill pass).
  at::Tensor packed = at::empty({lay.total}, f32);
  // The l2norm kernel runs with the reduction's threadgroups (params.reduce_simdgroups).
  uint32_t reduce_threads = mps::max_threads(kSource, mps::kGdnReduceKernel);
  if (s.qk_l2norm) {
    reduce_threads = std::min(
        reduce_threads, mps::max_threads(kSource, mps::gdn_l2norm_kernel_name(s.dtype)));
  }
  const mps::GdnBackwardPlan plan = mps::gdn_backward_plan(
      s, max_threads(true, s.dtype), mps::kGdnPartialBudget, reduce_threads);
  at::Tensor partials = at::empty({int64_t(std::max<uint64_t>(plan.partial_floats, 1))}, f32);
  at::Tensor carry = plan.carry_floats > 0 ? at::empty({int64_t(plan.carry_floats)}, f32)
                                           : partials;
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const at::Tensor g = g_in.contiguous(), beta = beta_in.contiguous();
  const at::Tensor ckpt = checkpoints.contiguous(), grad_o = grad_o_in.contiguous();
  const at::Tensor cu = cu_seqlens ? on_device(*cu_seqlens, q) : packed;
  const at::Tensor grad_ht = grad_final_state ? grad_final_state->contiguous() : packed;

  std::vector<mps::Dispatch> dispatches;
  for (uint32_t w = 0; w < plan.num_windows; ++w) {
    const mps::GdnParams params = plan.window(w);
    mps::Dispatch bwd;
    bwd.launch = plan.backward;
    bwd.set_params(params);
    bwd.buffers = {{mps::kBwdQ, q},
                   {mps::kBwdK, k},
                   {mps::kBwdV, v},
                   {mps::kBwdG, g},
                   {mps::kBwdBeta, beta},
                   {mps::kBwdCuSeqlens, cu},
                   {mps::kBwdCheckpoints, ckpt},
                   {mps::kBwdGradO, grad_o},
                   {mps::kBwdGradFinalState, grad_ht},
                   {mps::kBwdPacked, packed},
                   {mps::kBwdPartials, partials},
                   {mps::kBwdCarry, carry}};
    mps::Dispatch red;
    red.launch = plan.reduce;
    red.set_params(params);
    red.buffers = {{mps::kRedCuSeqlens, cu}, {mps::kRedPartials, partials},
                   {mps::kRedPacked, packed}};
    dispatches.push_back(std::move(bwd));
    dispatches.push_back(std::move(red));
  }
  if (s.qk_l2norm && plan.l2norm.threadgroups.count() > 0) {  // dq, dk of the raw rows
    mps::Dispatch norm;
    norm.launch = plan.l2norm;
    norm.set_params(plan.params);
    norm.buffers = {{mps::kNormQ, q}, {mps::kNormK, k}, {mps::kNormPacked, packed}};
    dispatches.push_back(std::move(norm));
  }
  mps::encode(kSource, dispatches);
  return packed;
}

}  // namespace
}  // namespace rlx

TORCH_LIBRARY_IMPL(rlx, MPS, m) {
  m.impl("gated_delta_fwd", &rlx::gated_delta_fwd_mps);
  m.impl("gated_delta_bwd", &rlx::gated_delta_bwd_mps);
}
