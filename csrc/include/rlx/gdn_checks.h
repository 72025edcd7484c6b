// Input validation of the gated delta rule ops, shared by every backend's host code so
// that all of them reject bad input with the same messages (which name the argument).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "rlx/acc_type.h"
#include "rlx/gdn_backward_layout.h"

namespace rlx {

struct GdnProblem {
  int64_t batch = 0, seq_len = 0, num_qk_heads = 0, num_v_heads = 0;
  int64_t head_k_dim = 0, head_v_dim = 0;
  int64_t num_seqs = 0;  // N: B, or len(cu_seqlens) - 1
  int64_t longest = 0;   // tokens of the longest sequence (bounds per-sequence scratch)
  int64_t chunk = kGdnDefaultChunk;
  bool gate_per_channel = false, varlen = false, has_initial_state = false;
  at::ScalarType input_dtype = at::kFloat;  // q, k, v, o
  at::ScalarType acc_dtype = at::kFloat;    // g, beta, states, gradients buffer
  int64_t group() const { return num_v_heads / num_qk_heads; }
  int64_t tokens() const { return batch * seq_len; }
};

inline at::ScalarType gdn_acc_dtype(at::ScalarType input) { return acc_dtype(input); }

// Checks shapes, dtypes, devices and cu_seqlens' values (reading them: one host copy when
// they live on an accelerator). Returns the problem sizes.
inline GdnProblem gdn_check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& g,
                                   const at::Tensor& beta,
                                   const std::optional<at::Tensor>& initial_state,
                                   const std::optional<at::Tensor>& cu_seqlens,
                                   int64_t chunk_size) {
  GdnProblem p;
  TORCH_CHECK(q.dim() == 4, op, ": q must be [B, T, H, K], got a ", q.dim(), "-D tensor ",
              q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": k must have q's shape [B, T, H, K] = ", q.sizes(),
              ", got ", k.sizes());
  TORCH_CHECK(v.dim() == 4, op, ": v must be [B, T, HV, V], got a ", v.dim(), "-D tensor ",
              v.sizes());
  p.batch = q.size(0);
  p.seq_len = q.size(1);
  p.num_qk_heads = q.size(2);
  p.head_k_dim = q.size(3);
  p.num_v_heads = v.size(2);
  p.head_v_dim = v.size(3);
  TORCH_CHECK(v.size(0) == p.batch && v.size(1) == p.seq_len, op,
              ": v must share q's batch and time sizes (B, T) = (", p.batch, ", ", p.seq_len,
              "), got v ", v.sizes());
  TORCH_CHECK(p.num_qk_heads >= 1 && p.num_v_heads >= 1 && p.num_v_heads % p.num_qk_heads == 0,
              op, ": the value heads HV = ", p.num_v_heads,
              " must be a positive multiple of the q/k heads H = ", p.num_qk_heads);
  TORCH_CHECK(p.head_k_dim >= 1 && p.head_k_dim <= 256, op,
              ": the key head dim K must be in [1, 256], got ", p.head_k_dim);
  TORCH_CHECK(p.head_v_dim >= 1 && p.head_v_dim <= 256, op,
              ": the value head dim V must be in [1, 256], got ", p.head_v_dim);
  const bool g_head = g.dim() == 3 && g.size(0) == p.batch && g.size(1) == p.seq_len &&
                      g.size(2) == p.num_v_heads;
  const bool g_chan = g.dim() == 4 && g.size(0) == p.batch && g.size(1) == p.seq_len &&
                      g.size(2) == p.num_v_heads && g.size(3) == p.head_k_dim;
  TORCH_CHECK(g_head || g_chan, op, ": g must be [B, T, HV] = [", p.batch, ", ", p.seq_len, ", ",
              p.num_v_heads, "] (per-head gate) or [B, T, HV, K] = [", p.batch, ", ",
              p.seq_len, ", ", p.num_v_heads, ", ", p.head_k_dim,
              "] (per-channel gate), got ", g.sizes());
  p.gate_per_channel = g_chan;
  TORCH_CHECK(beta.dim() == 3 && beta.size(0) == p.batch && beta.size(1) == p.seq_len &&
                  beta.size(2) == p.num_v_heads,
              op, ": beta must be [B, T, HV] = [", p.batch, ", ", p.seq_len, ", ", p.num_v_heads,
              "], got ", beta.sizes());

  p.input_dtype = q.scalar_type();
  TORCH_CHECK(p.input_dtype == at::kHalf || p.input_dtype == at::kBFloat16 ||
                  p.input_dtype == at::kFloat || p.input_dtype == at::kDouble,
              op, ": q must be float16, bfloat16, float32 or float64, got ", p.input_dtype);
  TORCH_CHECK(k.scalar_type() == p.input_dtype && v.scalar_type() == p.input_dtype, op,
              ": q, k and v must share one dtype, got q ", p.input_dtype, ", k ",
              k.scalar_type(), ", v ", v.scalar_type());
  p.acc_dtype = gdn_acc_dtype(p.input_dtype);
  TORCH_CHECK(g.scalar_type() == p.acc_dtype && beta.scalar_type() == p.acc_dtype, op,
              ": g and beta must be ", p.acc_dtype, " (the accumulation dtype for ",
              p.input_dtype, " inputs), got g ", g.scalar_type(), ", beta ",
              beta.scalar_type());
  const char* names[] = {"k", "v", "g", "beta"};
  const at::Tensor* tensors[] = {&k, &v, &g, &beta};
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(tensors[i]->device() == q.device(), op, ": all inputs must be on q's device ",
                q.device(), ", got ", names[i], " on ", tensors[i]->device());
  }
  TORCH_CHECK(chunk_size >= 0, op, ": chunk_size must be >= 0 (0 keeps no checkpoints), got ",
              chunk_size);
  p.chunk = chunk_size;

  p.num_seqs = p.batch;
  if (cu_seqlens.has_value()) {
    const at::Tensor& cu = *cu_seqlens;
    p.varlen = true;
    TORCH_CHECK(cu.dim() == 1 && cu.numel() >= 2 && cu.scalar_type() == at::kLong, op,
                ": cu_seqlens must be a 1-D int64 tensor [N + 1] with N >= 1, got ",
                cu.scalar_type(), " ", cu.sizes());
    TORCH_CHECK(p.batch == 1, op, ": cu_seqlens packs sequences along T, so B must be 1, got B = ",
                p.batch);
    // (on the CPU too: it is read on the host; a tensor on any other device would make
    // that device's kernel run for all inputs)
    TORCH_CHECK(cu.device() == q.device() || cu.device().is_cpu(), op,
                ": all inputs must be on q's device ", q.device(), ", got cu_seqlens on ",
                cu.device());
    const at::Tensor host = cu.to(at::kCPU).contiguous();
    const int64_t* c = host.data_ptr<int64_t>();
    const int64_t n = host.numel();
    TORCH_CHECK(c[0] == 0, op, ": cu_seqlens must start at 0, got ", c[0]);
    for (int64_t i = 1; i < n; ++i) {
      TORCH_CHECK(c[i] >= c[i - 1], op, ": cu_seqlens must be non-decreasing, got ", c[i - 1],
                  " then ", c[i], " at index ", i);
      p.longest = std::max(p.longest, c[i] - c[i - 1]);
    }
    TORCH_CHECK(c[n - 1] == p.seq_len, op, ": cu_seqlens must end at T = ", p.seq_len, ", got ",
                c[n - 1]);
    p.num_seqs = n - 1;
  } else {
    p.longest = p.batch > 0 ? p.seq_len : 0;
  }
  if (initial_state.has_value()) {
    const at::Tensor& h0 = *initial_state;
    p.has_initial_state = true;
    TORCH_CHECK(h0.dim() == 4 && h0.size(0) == p.num_seqs && h0.size(1) == p.num_v_heads &&
                    h0.size(2) == p.head_k_dim && h0.size(3) == p.head_v_dim,
                op, ": initial_state must be [N, HV, K, V] = [", p.num_seqs, ", ", p.num_v_heads,
                ", ", p.head_k_dim, ", ", p.head_v_dim, "], got ", h0.sizes());
    TORCH_CHECK(h0.scalar_type() == p.acc_dtype, op, ": initial_state must be ", p.acc_dtype,
                ", got ", h0.scalar_type());
    TORCH_CHECK(h0.device() == q.device(), op, ": all inputs must be on q's device ",
                q.device(), ", got initial_state on ", h0.device());
  }
  return p;
}

// The backward's checkpoints, grad_o and grad_final_state as the forward made them for p.
inline void gdn_check_backward_shapes(const char* op, const GdnProblem& p, const at::Tensor& v,
                                      const at::Tensor& checkpoints, const at::Tensor& grad_o,
                                      const std::optional<at::Tensor>& grad_final_state) {
  const int64_t K = p.head_k_dim, V = p.head_v_dim, HV = p.num_v_heads;
  TORCH_CHECK(p.chunk >= 1, op, ": chunk_size must be >= 1: the backward needs the forward's ",
              "checkpoints, got ", p.chunk);
  const int64_t slots = gdn_checkpoint_slots(p.num_seqs, p.tokens(), p.chunk);
  TORCH_CHECK(checkpoints.dim() == 4 && checkpoints.size(0) == slots &&
                  checkpoints.size(1) == HV && checkpoints.size(2) == K &&
                  checkpoints.size(3) == V && checkpoints.scalar_type() == p.acc_dtype,
              op, ": checkpoints must be the ", p.acc_dtype, " [", slots, ", ", HV, ", ", K, ", ",
              V, "] tensor that rlx::gated_delta_fwd returned for these inputs, got ",
              checkpoints.scalar_type(), " ", checkpoints.sizes());
  TORCH_CHECK(grad_o.sizes() == v.sizes() && grad_o.scalar_type() == p.input_dtype, op,
              ": grad_o must have o's shape ", v.sizes(), " and dtype ", p.input_dtype,
              ", got ", grad_o.scalar_type(), " ", grad_o.sizes());
  if (grad_final_state.has_value()) {
    const at::Tensor& gh = *grad_final_state;
    TORCH_CHECK(gh.dim() == 4 && gh.size(0) == p.num_seqs && gh.size(1) == HV &&
                    gh.size(2) == K && gh.size(3) == V && gh.scalar_type() == p.acc_dtype,
                op, ": grad_final_state must be ", p.acc_dtype, " [", p.num_seqs, ", ", HV, ", ",
                K, ", ", V, "], got ", gh.scalar_type(), " ", gh.sizes());
  }
}

// The backward's own tensors on q's device (a tensor on another device would make that
// device's kernel run for all inputs: meta's, for instance, returns uninitialized memory).
inline void gdn_check_backward_devices(const char* op, const at::Tensor& q,
                                       const at::Tensor& checkpoints, const at::Tensor& grad_o,
                                       const std::optional<at::Tensor>& grad_final_state,
                                       const std::optional<at::Tensor>& vw) {
  auto check = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK(t.device() == q.device(), op, ": all inputs must be on q's device ", q.device(),
                ", got ", name, " on ", t.device());
  };
  check("checkpoints", checkpoints);
  check("grad_o", grad_o);
  if (grad_final_state.has_value()) check("grad_final_state", *grad_final_state);
  if (vw.has_value()) check("vw", *vw);
}

// vw as the forward returned it: the acc [B, T, HV, V] tensor, or None / empty (the backward
// then recomputes it).
inline void gdn_check_backward_vw(const char* op, const GdnProblem& p, const at::Tensor& v,
                                  const std::optional<at::Tensor>& vw) {
  if (!vw.has_value() || vw->numel() == 0) return;
  TORCH_CHECK(vw->sizes() == v.sizes() && vw->scalar_type() == p.acc_dtype, op,
              ": vw must be the ", p.acc_dtype, " ", v.sizes(),
              " tensor that rlx::gated_delta_fwd returned for these inputs (or None), got ",
              vw->scalar_type(), " ", vw->sizes());
}

// Everything the backward takes beyond the forward's inputs (after gdn_check_inputs), in the
// order every backend checks it: shapes and dtypes, devices, vw.
inline void gdn_check_backward_inputs(const char* op, const GdnProblem& p, const at::Tensor& q,
                                      const at::Tensor& v, const at::Tensor& checkpoints,
                                      const at::Tensor& grad_o,
                                      const std::optional<at::Tensor>& grad_final_state,
                                      const std::optional<at::Tensor>& vw) {
  gdn_check_backward_shapes(op, p, v, checkpoints, grad_o, grad_final_state);
  gdn_check_backward_devices(op, q, checkpoints, grad_o, grad_final_state, vw);
  gdn_check_backward_vw(op, p, v, vw);
}

inline void gdn_check_l2norm_eps(const char* op, std::optional<double> eps) {
  TORCH_CHECK(!eps.has_value() || (std::isfinite(*eps) && *eps >= 0), op,
              ": l2norm_eps must be None or a finite number >= 0, got ", eps.value_or(0));
}

// The checkpoints' tag: what the backward must be given as the forward was (chunk_size sets
// where each chunk's checkpoint lies; l2norm_eps, what the states were made of; whether vw was
// kept), hashed into 32 bits (FNV-1a) and stored in the first 4 bytes of the last checkpoint
// slot, which no sequence ever uses (gdn_backward_layout.h). A backward given checkpoints of
// another forward (e.g. chunk_size 64 vs 65 at T = 128: the same slot count) then fails
// instead of returning wrong gradients.
inline uint32_t gdn_checkpoint_tag(int64_t chunk, std::optional<double> l2norm_eps,
                                   bool keeps_vw) {
  uint32_t h = 2166136261u;
  auto mix = [&h](uint64_t x) {
    for (int i = 0; i < 8; ++i, x >>= 8) h = (h ^ uint32_t(x & 0xff)) * 16777619u;
  };
  uint64_t eps_bits = 0;
  if (l2norm_eps.has_value()) std::memcpy(&eps_bits, &*l2norm_eps, sizeof(eps_bits));
  mix(0x31304e4447ull);  // "GDN01"
  mix(uint64_t(chunk));
  mix(l2norm_eps.has_value() ? 1 : 0);
  mix(eps_bits);
  mix(keeps_vw ? 1 : 0);
  return h;
}

// Writes the tag into host-accessible (CPU) checkpoints; no-op without slots.
inline void gdn_write_checkpoint_tag(at::Tensor& checkpoints, uint32_t tag) {
  if (checkpoints.numel() == 0) return;
  char* last = static_cast<char*>(checkpoints.data_ptr()) +
               (checkpoints.numel() / checkpoints.size(0)) * (checkpoints.size(0) - 1) *
                   checkpoints.element_size();
  std::memcpy(last, &tag, sizeof(tag));
}

inline void gdn_check_checkpoint_tag(const char* op, const at::Tensor& checkpoints,
                                     uint32_t tag) {
  if (checkpoints.numel() == 0) return;
  const at::Tensor last = checkpoints[checkpoints.size(0) - 1].contiguous();
  uint32_t got = 0;
  std::memcpy(&got, last.data_ptr(), sizeof(got));
  TORCH_CHECK(got == tag, op, ": checkpoints do not come from rlx::gated_delta_fwd with this ",
              "chunk_size, l2norm_eps and vw (their tag differs): pass the backward the ",
              "forward's own chunk_size, l2norm_eps and outputs (checkpoints, vw)");
}

// Sequence boundaries [bos, eos) in packed token indices (b * T + t).
inline void gdn_sequence_bounds(const GdnProblem& p, const int64_t* cu, int64_t n, int64_t* bos,
                                int64_t* eos) {
  if (cu != nullptr) {
    *bos = cu[n];
    *eos = cu[n + 1];
  } else {
    *bos = n * p.seq_len;
    *eos = *bos + p.seq_len;
  }
}

}  // namespace rlx
