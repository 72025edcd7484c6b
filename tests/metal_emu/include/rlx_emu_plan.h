// C view of a launch plan for the emulator's Python side (mirrors metal_emu.CPlan). Test-only
// wrappers include this and the kernel family's plan header, and export functions
//   extern "C" int plan_xxx(const int64_t* args, int n_args, rlx_emu_plan* out);
// that tests call with metal_emu.call_plan(lib.plan_xxx, *args).
#pragma once

#include <cstdint>
#include <cstring>

#include "rlx/mps_launch.h"

extern "C" {
struct rlx_emu_plan {
  char kernel[128];
  uint32_t threadgroups[3];
  uint32_t threads[3];
  uint32_t n_threadgroup_memory;
  uint32_t threadgroup_memory[8];
  int32_t params_index;
  uint32_t params_size;
  unsigned char params[1024];
};
}

inline void rlx_emu_fill(rlx_emu_plan* out, const rlx::mps::Launch& l) {
  std::memset(out, 0, sizeof(*out));
  std::strncpy(out->kernel, l.kernel, sizeof(out->kernel) - 1);
  const rlx::mps::Size3* dims[2] = {&l.threadgroups, &l.threads};
  uint32_t* dst[2] = {out->threadgroups, out->threads};
  for (int i = 0; i < 2; ++i) {
    dst[i][0] = dims[i]->x;
    dst[i][1] = dims[i]->y;
    dst[i][2] = dims[i]->z;
  }
  out->n_threadgroup_memory = l.n_threadgroup_memory;
  for (uint32_t i = 0; i < l.n_threadgroup_memory; ++i)
    out->threadgroup_memory[i] = l.threadgroup_memory[i];
  out->params_index = l.params_index;
}

template <class Params>
inline void rlx_emu_fill(rlx_emu_plan* out, const rlx::mps::Launch& l, const Params& p) {
  static_assert(sizeof(Params) <= sizeof(out->params), "params struct too large");
  rlx_emu_fill(out, l);
  out->params_size = sizeof(Params);
  std::memcpy(out->params, &p, sizeof(Params));
}
