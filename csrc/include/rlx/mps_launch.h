// Launch-plan vocabulary shared by the Metal host code (csrc/mps/*.mm) and the emulator tests
// (tests/metal_emu/): plain C++17, no torch, no Metal. Each kernel family has its own plan
// header (e.g. rlx/mps_codebook_plan.h) that turns shapes into a Launch plus a params struct.
#pragma once

#include <cstdint>

namespace rlx::mps {

constexpr uint32_t kSimdWidth = 32;                 // Apple GPUs: 32 lanes per simdgroup
constexpr uint32_t kMaxThreadsPerThreadgroup = 1024;
constexpr uint32_t kMaxThreadgroupMemory = 32768;   // bytes, every Apple-silicon GPU
constexpr int kMaxThreadgroupBuffers = 4;

struct Size3 {
  uint32_t x = 1, y = 1, z = 1;
  uint64_t count() const { return uint64_t(x) * y * z; }
};

// One dispatchThreadgroups:threadsPerThreadgroup: call.
struct Launch {
  const char* kernel = "";  // host name of the kernel in the embedded library
  Size3 threadgroups;       // the grid, counted in threadgroups
  Size3 threads;            // threads per threadgroup
  uint32_t threadgroup_memory[kMaxThreadgroupBuffers] = {};  // bytes of [[threadgroup(i)]]
  uint32_t n_threadgroup_memory = 0;
  int params_index = -1;  // [[buffer(i)]] slot of the params struct (setBytes), -1: none
};

constexpr uint32_t ceil_div(uint64_t a, uint64_t b) { return uint32_t((a + b - 1) / b); }

// setThreadgroupMemoryLength: wants a multiple of 16 bytes.
constexpr uint32_t threadgroup_bytes(uint64_t bytes) { return uint32_t((bytes + 15) / 16 * 16); }

}  // namespace rlx::mps
