// Launch plans of the gated delta rule Metal kernels (csrc/mps/kernels/gated_delta.metal),
// shared by the host code (csrc/mps/gated_delta.mm) and the emulator tests. Plain C++17.
//
// Forward: one dispatch, threadgroups (V-blocks, HV, N), one simdgroup per state column.
// Backward: windows of chunks, from the last down to chunk 0; each is a gated_delta_bwd
// dispatch (writes dv and dstate to the packed buffer, per-V-block partial sums of dq, dk,
// dg, dbeta to `partials`, and hands dS to the next window through `carry`) followed by a
// gated_delta_bwd_reduce dispatch (adds the partials in a fixed order into the packed
// buffer). Windows bound the partials' memory; all dispatches go into one command buffer.
//
// Tuning (not measured: nothing here has run on an Apple GPU). The backward trades two costs
// through the simdgroups per threadgroup (nsg = state columns per V-block): the partial sums
// move num_vblocks * (2K + 2) floats per (token, value head) through memory, fewer with more
// columns per threadgroup; but the states kept per sub-chunk take sub * nsg * 32 ceil(K/32)
// floats of threadgroup memory, and a shorter sub-chunk recomputes more (C (C / sub + 1) / 2
// steps per chunk of C). The rule below takes the most simdgroups (<= 8) that keep sub >= 8.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "rlx/gdn_backward_layout.h"
#include "rlx/mps_gated_delta_params.h"
#include "rlx/mps_launch.h"

namespace rlx::mps {

enum class GdnDtype { Float32 = 0, Float16 = 1, BFloat16 = 2 };

// Problem sizes, as validated by rlx::gdn_check_inputs.
struct GdnShape {
  int64_t batch = 0, seq_len = 0, num_qk_heads = 1, num_v_heads = 1;
  int64_t head_k_dim = 1, head_v_dim = 1;
  int64_t num_seqs = 0;    // N
  int64_t max_chunks = 0;  // most chunks of any sequence: ceil(max length / chunk)
  int64_t chunk = kGdnDefaultChunk;
  bool gate_per_channel = false, varlen = false, has_initial_state = false;
  bool has_grad_final = false;
  double scale = 1.0;
  bool qk_l2norm = false;  // l2norm_eps given: q and k rows normalized in the kernels
  double l2norm_eps = 0.0;
  GdnDtype dtype = GdnDtype::Float32;
};

constexpr uint32_t kGdnMaxKPerLane = 8;          // the kernels' register arrays: K <= 256
constexpr uint32_t kGdnForwardSimdgroups = 4;    // columns per forward threadgroup
constexpr uint32_t kGdnReduceSimdgroups = 4;     // rows per reduction threadgroup
constexpr uint64_t kGdnPartialBudget = 128ull << 20;  // bytes of backward partials per window

// The forward's vw output and the checkpoints' tag (gdn_checkpoint_tag, rlx/gdn_checks.h) follow
// the same rule on every backend (gdn_keeps_vw), so that outputs and checkpoints pass between
// them. The host code writes the tag after the forward kernel (which zeroes the unused slots)
// and checks it before the backward.
inline bool gdn_forward_keeps_vw(const GdnShape& s) {
  return gdn_keeps_vw(s.chunk, s.gate_per_channel);
}

inline GdnParams gdn_params(const GdnShape& s) {
  GdnParams p{};
  const GdnBackwardLayout l = GdnBackwardLayout::make(
      s.batch, s.seq_len, s.num_qk_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim,
      s.num_seqs, s.gate_per_channel, s.has_initial_state);
  p.tokens = uint64_t(s.batch * s.seq_len);
  p.dq_offset = uint64_t(l.dq.offset);
  p.dk_offset = uint64_t(l.dk.offset);
  p.dv_offset = uint64_t(l.dv.offset);
  p.dg_offset = uint64_t(l.dg.offset);
  p.dbeta_offset = uint64_t(l.dbeta.offset);
  p.dstate_offset = uint64_t(l.dstate.offset);
  p.seq_len = uint32_t(s.seq_len);
  p.num_seqs = uint32_t(s.num_seqs);
  p.num_qk_heads = uint32_t(s.num_qk_heads);
  p.num_v_heads = uint32_t(s.num_v_heads);
  p.head_k_dim = uint32_t(s.head_k_dim);
  p.head_v_dim = uint32_t(s.head_v_dim);
  p.group = uint32_t(s.num_v_heads / s.num_qk_heads);
  p.k_per_lane = ceil_div(uint64_t(s.head_k_dim), kSimdWidth);
  p.gate_per_channel = s.gate_per_channel;
  p.has_initial_state = s.has_initial_state;
  p.has_grad_final = s.has_grad_final;
  p.varlen = s.varlen;
  p.chunk = uint32_t(s.chunk);
  p.qk_l2norm = s.qk_l2norm;
  p.l2norm_eps = float(s.l2norm_eps);
  p.keeps_vw = gdn_forward_keeps_vw(s);
  p.scale = float(s.scale);
  return p;
}

inline const char* gdn_kernel_name(bool backward, GdnDtype t) {
  static const char* const fwd[] = {"gated_delta_fwd_f32", "gated_delta_fwd_f16",
                                    "gated_delta_fwd_bf16"};
  static const char* const bwd[] = {"gated_delta_bwd_f32", "gated_delta_bwd_f16",
                                    "gated_delta_bwd_bf16"};
  return (backward ? bwd : fwd)[int(t)];
}

constexpr const char* kGdnReduceKernel = "gated_delta_bwd_reduce";

inline const char* gdn_l2norm_kernel_name(GdnDtype t) {
  static const char* const names[] = {"gated_delta_bwd_l2norm_f32", "gated_delta_bwd_l2norm_f16",
                                      "gated_delta_bwd_l2norm_bf16"};
  return names[int(t)];
}

// Buffer slots of gated_delta_fwd.
enum GdnForwardSlot : int {
  kFwdQ = 0, kFwdK, kFwdV, kFwdG, kFwdBeta, kFwdInitialState, kFwdCuSeqlens, kFwdO,
  kFwdFinalState, kFwdCheckpoints, kFwdParams, kFwdVw
};
// Buffer slots of gated_delta_bwd and gated_delta_bwd_reduce.
enum GdnBackwardSlot : int {
  kBwdQ = 0, kBwdK, kBwdV, kBwdG, kBwdBeta, kBwdCuSeqlens, kBwdCheckpoints, kBwdGradO,
  kBwdGradFinalState, kBwdPacked, kBwdPartials, kBwdCarry, kBwdParams
};
enum GdnReduceSlot : int { kRedCuSeqlens = 0, kRedPartials, kRedPacked, kRedParams };
// Buffer slots of gated_delta_bwd_l2norm.
enum GdnL2normSlot : int { kNormQ = 0, kNormK, kNormPacked, kNormParams };

struct GdnForwardPlan {
  Launch launch;  // threadgroups.count() == 0: nothing to dispatch (N == 0)
  GdnParams params;
};

// max_threads: the pipeline's maxTotalThreadsPerThreadgroup (a multiple of 32).
inline GdnForwardPlan gdn_forward_plan(const GdnShape& s, uint32_t max_threads = 1024) {
  GdnForwardPlan f;
  f.params = gdn_params(s);
  const uint32_t nsg = std::max<uint32_t>(
      1, std::min<uint32_t>({kGdnForwardSimdgroups, max_threads / kSimdWidth,
                             uint32_t(s.head_v_dim)}));
  f.params.simdgroups = nsg;
  f.params.num_vblocks = ceil_div(uint64_t(s.head_v_dim), nsg);
  f.launch.kernel = gdn_kernel_name(false, s.dtype);
  f.launch.threads.x = nsg * kSimdWidth;
  f.launch.threadgroups = {f.params.num_vblocks, uint32_t(s.num_v_heads), uint32_t(s.num_seqs)};
  f.launch.params_index = kFwdParams;
  return f;
}

struct GdnBackwardPlan {
  Launch backward, reduce;  // per window; params.window_lo/hi set by window()
  Launch l2norm;            // after the last window, with l2norm_eps only (params.qk_l2norm)
  GdnParams params;
  uint32_t num_windows = 0;
  uint64_t partial_floats = 0;  // size of the partials buffer
  uint64_t carry_floats = 0;    // size of the carry buffer (0: not used, bind any buffer)

  // Params of window w (w = 0 is the last chunks; the host encodes w = 0, 1, ...).
  GdnParams window(uint32_t w) const {
    GdnParams p = params;
    const int64_t hi = int64_t(params.window_hi) - int64_t(w) * params.window_chunks;
    p.window_hi = uint32_t(hi);
    p.window_lo = uint32_t(std::max<int64_t>(0, hi - params.window_chunks));
    return p;
  }
};

// Threadgroup floats of gated_delta_bwd: states of one sub-chunk for every simdgroup, then
// one row of contributions per simdgroup (dq, dk: Kp each; dg: Kp or 1; dbeta: 1).
inline uint64_t gdn_backward_tg_floats(uint32_t nsg, uint32_t sub, uint32_t kp, bool per_channel) {
  const uint64_t row = 2ull * kp + (per_channel ? kp : 1) + 1;
  return uint64_t(sub) * nsg * kp + nsg * row;
}

// partial_budget: bytes of partial sums one window may use (at least one chunk's worth).
// max_threads / max_reduce_threads: maxTotalThreadsPerThreadgroup of the gated_delta_bwd_*
// and gated_delta_bwd_reduce pipelines (multiples of 32; with l2norm, the smaller of the
// reduce and gated_delta_bwd_l2norm_* pipelines', which share the threadgroup size).
inline GdnBackwardPlan gdn_backward_plan(const GdnShape& s, uint32_t max_threads = 1024,
                                         uint64_t partial_budget = kGdnPartialBudget,
                                         uint32_t max_reduce_threads = 1024) {
  GdnBackwardPlan b;
  b.params = gdn_params(s);
  GdnParams& p = b.params;
  const uint32_t kp = p.k_per_lane * kSimdWidth;
  const uint32_t chunk = uint32_t(s.chunk);
  const uint64_t tg_floats_max = kMaxThreadgroupMemory / sizeof(float);
  // The most simdgroups (fewest V-blocks, so fewest partials) whose sub-chunk of kept
  // states is still >= min(8, C) steps; a shorter sub-chunk means more recomputation
  // (each chunk costs C (C / sub + 1) / 2 recomputed steps).
  uint32_t nsg = std::max<uint32_t>(1, std::min<uint32_t>({8, max_threads / kSimdWidth,
                                                           uint32_t(s.head_v_dim)}));
  uint32_t sub = 1;
  for (; nsg >= 1; --nsg) {
    const uint64_t rows = gdn_backward_tg_floats(nsg, 0, kp, s.gate_per_channel);
    const uint64_t rest = tg_floats_max - std::min(tg_floats_max, rows);
    sub = uint32_t(std::min<uint64_t>(chunk, rest / (uint64_t(nsg) * kp)));
    if (sub >= std::min<uint32_t>(8, chunk) || nsg == 1) break;
  }
  sub = std::max<uint32_t>(1, sub);  // nsg == 1 always fits one state (K <= 256)
  p.simdgroups = nsg;
  p.sub = sub;
  p.num_vblocks = ceil_div(uint64_t(s.head_v_dim), nsg);
  p.reduce_simdgroups =
      std::max<uint32_t>(1, std::min<uint32_t>(kGdnReduceSimdgroups, max_reduce_threads / kSimdWidth));

  // Partial floats per row: dq + dk (K each), dg (K or 1), dbeta, for every (V-block, hv).
  const uint64_t per_row = uint64_t(p.num_vblocks) * s.num_v_heads *
                           (2ull * s.head_k_dim + (s.gate_per_channel ? s.head_k_dim : 1) + 1);
  const uint64_t per_chunk_bytes = per_row * uint64_t(s.num_seqs) * chunk * sizeof(float);
  const uint64_t max_chunks = uint64_t(std::max<int64_t>(s.max_chunks, 1));
  const uint64_t fit = per_chunk_bytes == 0 ? max_chunks : partial_budget / per_chunk_bytes;
  const uint32_t w = uint32_t(std::clamp<uint64_t>(fit, 1, max_chunks));
  p.window_chunks = w;
  p.window_hi = uint32_t(max_chunks);
  p.window_lo = uint32_t(max_chunks - std::min<uint64_t>(w, max_chunks));
  b.num_windows = ceil_div(max_chunks, w);

  const uint64_t rows = uint64_t(s.num_seqs) * w * chunk;
  const uint64_t per_vb_rows = uint64_t(p.num_vblocks) * rows * s.num_v_heads;
  p.part_dk_offset = per_vb_rows * s.head_k_dim;
  p.part_dg_offset = 2 * p.part_dk_offset;
  p.part_dbeta_offset = p.part_dg_offset + per_vb_rows * (s.gate_per_channel ? s.head_k_dim : 1);
  b.partial_floats = p.part_dbeta_offset + per_vb_rows;
  b.carry_floats = b.num_windows > 1 ? uint64_t(s.num_seqs) * s.num_v_heads * s.head_k_dim *
                                           s.head_v_dim
                                     : 0;

  b.backward.kernel = gdn_kernel_name(true, s.dtype);
  b.backward.threads.x = nsg * kSimdWidth;
  b.backward.threadgroups = {p.num_vblocks, uint32_t(s.num_v_heads), uint32_t(s.num_seqs)};
  b.backward.threadgroup_memory[0] =
      threadgroup_bytes(gdn_backward_tg_floats(nsg, sub, kp, s.gate_per_channel) * sizeof(float));
  b.backward.n_threadgroup_memory = 1;
  b.backward.params_index = kBwdParams;

  b.reduce.kernel = kGdnReduceKernel;
  b.reduce.threads.x = p.reduce_simdgroups * kSimdWidth;
  b.reduce.threadgroups = {ceil_div(rows, p.reduce_simdgroups), uint32_t(s.num_qk_heads), 1};
  b.reduce.params_index = kRedParams;

  // gradients of the raw q and k rows from those of the normalized ones: one simdgroup per
  // row, grid (row blocks, 2: q then k)
  b.l2norm.kernel = gdn_l2norm_kernel_name(s.dtype);
  b.l2norm.threads.x = p.reduce_simdgroups * kSimdWidth;
  b.l2norm.threadgroups = {
      ceil_div(uint64_t(s.batch * s.seq_len * s.num_qk_heads), p.reduce_simdgroups), 2, 1};
  b.l2norm.params_index = kNormParams;
  if (s.num_seqs == 0) {
    b.num_windows = 0;
    b.backward.threadgroups = {0, 0, 0};
  }
  return b;
}

}  // namespace rlx::mps
