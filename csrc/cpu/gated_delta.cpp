// Gated delta rule: the shape arithmetic every backend shares (the packed backward layout
// and the checkpoint slots, from csrc/include/rlx/). The CPU kernels are in
// gated_delta_forward.cpp and gated_delta_backward.cpp.
#include <torch/library.h>

#include <vector>

#include "rlx/gdn_backward_layout.h"
#include "rlx/gdn_checks.h"

namespace rlx {
namespace {

// [dq.offset, dq.numel, dk..., dv..., dg..., dbeta..., dstate..., total]
std::vector<int64_t> gated_delta_bwd_layout(int64_t batch, int64_t seq_len, int64_t num_qk_heads,
                                            int64_t num_v_heads, int64_t head_k_dim,
                                            int64_t head_v_dim, int64_t num_states,
                                            bool gate_per_channel, bool has_initial_state) {
  const GdnBackwardLayout l =
      GdnBackwardLayout::make(batch, seq_len, num_qk_heads, num_v_heads, head_k_dim, head_v_dim,
                              num_states, gate_per_channel, has_initial_state);
  std::vector<int64_t> out;
  for (const GdnSlice& s : {l.dq, l.dk, l.dv, l.dg, l.dbeta, l.dstate}) {
    out.push_back(s.offset);
    out.push_back(s.numel);
  }
  out.push_back(l.total);
  return out;
}

int64_t gated_delta_checkpoint_slots(int64_t num_seqs, int64_t total_tokens,
                                     int64_t chunk_size) {
  TORCH_CHECK(chunk_size >= 0, "rlx::gated_delta_checkpoint_slots: chunk_size must be >= 0");
  return gdn_checkpoint_slots(num_seqs, total_tokens, chunk_size);
}

}  // namespace
}  // namespace rlx

// Shape arithmetic only (no tensors): one kernel for every backend.
TORCH_LIBRARY_IMPL(rlx, CompositeImplicitAutograd, m) {
  m.impl("gated_delta_bwd_layout", &rlx::gated_delta_bwd_layout);
  m.impl("gated_delta_checkpoint_slots", &rlx::gated_delta_checkpoint_slots);
}
