// extern "C" wrappers of rlx/mps_gated_delta_plan.h for tests/test_metal_gated_delta.py
// (compiled by tests.metal_emu.compile_cpp). Arguments, in order:
//   batch, seq_len, H, HV, K, V, N, max_chunks, chunk, gate_per_channel, varlen,
//   has_initial_state, has_grad_final, float32 bits of scale, dtype (0 f32, 1 f16, 2 bf16),
//   max_threads, partial_budget [, window]
#include <cstring>

#include "rlx/mps_gated_delta_plan.h"
#include "rlx_emu_plan.h"

namespace {
constexpr int kShapeArgs = 17;

bool read_shape(const int64_t* a, int n, rlx::mps::GdnShape* s) {
  if (n < kShapeArgs) return false;
  s->batch = a[0];
  s->seq_len = a[1];
  s->num_qk_heads = a[2];
  s->num_v_heads = a[3];
  s->head_k_dim = a[4];
  s->head_v_dim = a[5];
  s->num_seqs = a[6];
  s->max_chunks = a[7];
  s->chunk = a[8];
  s->gate_per_channel = a[9] != 0;
  s->varlen = a[10] != 0;
  s->has_initial_state = a[11] != 0;
  s->has_grad_final = a[12] != 0;
  const uint32_t bits = uint32_t(a[13]);
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  s->scale = scale;
  if (a[14] < 0 || a[14] > 2) return false;
  s->dtype = rlx::mps::GdnDtype(a[14]);
  return s->head_k_dim >= 1 && s->head_k_dim <= 256 && s->num_qk_heads >= 1 &&
         s->num_v_heads % s->num_qk_heads == 0 && s->chunk >= 1;
}
}  // namespace

extern "C" int plan_gdn_forward(const int64_t* a, int n, rlx_emu_plan* out) {
  rlx::mps::GdnShape s;
  if (n != kShapeArgs || !read_shape(a, n, &s)) return 1;
  const auto f = rlx::mps::gdn_forward_plan(s, uint32_t(a[15]));
  rlx_emu_fill(out, f.launch, f.params);
  return 0;
}

// Which launch of the backward: the gated_delta_bwd (reduce == 0) or the reduction of window w.
static int plan_backward_launch(const int64_t* a, int n, rlx_emu_plan* out, bool reduce) {
  rlx::mps::GdnShape s;
  if (n != kShapeArgs + 1 || !read_shape(a, n, &s)) return 1;
  const auto b = rlx::mps::gdn_backward_plan(s, uint32_t(a[15]), uint64_t(a[16]));
  if (a[17] < 0 || a[17] >= int64_t(b.num_windows)) return 2;
  rlx_emu_fill(out, reduce ? b.reduce : b.backward, b.window(uint32_t(a[17])));
  return 0;
}

extern "C" int plan_gdn_backward(const int64_t* a, int n, rlx_emu_plan* out) {
  return plan_backward_launch(a, n, out, false);
}

extern "C" int plan_gdn_reduce(const int64_t* a, int n, rlx_emu_plan* out) {
  return plan_backward_launch(a, n, out, true);
}

// out: num_windows, partial_floats, carry_floats, simdgroups, sub, window_chunks
extern "C" int gdn_backward_sizes(const int64_t* a, int n, int64_t* out) {
  rlx::mps::GdnShape s;
  if (n != kShapeArgs || !read_shape(a, n, &s)) return 1;
  const auto b = rlx::mps::gdn_backward_plan(s, uint32_t(a[15]), uint64_t(a[16]));
  out[0] = b.num_windows;
  out[1] = int64_t(b.partial_floats);
  out[2] = int64_t(b.carry_floats);
  out[3] = b.params.simdgroups;
  out[4] = b.params.sub;
  out[5] = b.params.window_chunks;
  return 0;
}
