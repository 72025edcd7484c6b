// Launch plans for selftest.metal, written the way a kernel family's plan header is, plus the
// extern "C" wrappers the emulator tests call (see tests/metal_emu/README.md).
#include "rlx_emu_plan.h"

namespace {
struct CountParams {  // must match selftest.metal
  uint32_t n;
  float scale;
};
}  // namespace

extern "C" int plan_tg_reverse(const int64_t* a, int n, rlx_emu_plan* out) {
  if (n != 2 || a[0] <= 0 || a[1] <= 0) return 1;
  rlx::mps::Launch l;
  l.kernel = "tg_reverse";
  l.threads.x = uint32_t(a[1]);
  l.threadgroups.x = rlx::mps::ceil_div(uint64_t(a[0]), l.threads.x);
  l.threadgroup_memory[0] = rlx::mps::threadgroup_bytes(a[1] * sizeof(float));
  l.n_threadgroup_memory = 1;
  rlx_emu_fill(out, l);
  return 0;
}

extern "C" int plan_histogram(const int64_t* a, int n, rlx_emu_plan* out) {
  if (n != 1 || a[0] <= 0) return 1;
  rlx::mps::Launch l;
  l.kernel = "histogram";
  l.threads.x = 64;
  l.threadgroups.x = rlx::mps::ceil_div(uint64_t(a[0]), 64);
  l.params_index = 3;
  rlx_emu_fill(out, l, CountParams{uint32_t(a[0]), 0.25f});
  return 0;
}
