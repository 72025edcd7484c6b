// The emulator's scheduler: runs every thread of a threadgroup as a fiber (ucontext) on one
// OS thread. A fiber runs until it reaches a synchronisation point (threadgroup_barrier,
// simdgroup_barrier or a simd_* collective) or returns; when every live fiber is blocked the
// scheduler resolves the pending simdgroup collectives, then the threadgroup barrier, and
// reports any divergence. The order in which runnable fibers (and threadgroups) are resumed is
// forward, reverse or shuffled, so a missing barrier changes the result.
#pragma once

#include <ucontext.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <source_location>
#include <string>
#include <vector>

namespace metal_emu {

constexpr uint32_t kSimdWidth = 32;
constexpr uint32_t kMaxThreads = 1024;
constexpr uint64_t kMaxThreadgroupMemory = 32768;
constexpr size_t kSlotBytes = 64;  // largest value a simd_* collective can exchange
constexpr size_t kStackBytes = 256 * 1024;

enum Order : int { kForward = 0, kReverse = 1, kShuffle = 2 };
enum class State : uint8_t { Runnable, Barrier, Simd, Done };

struct Site {
  const char* what = "";
  const char* file = "";
  unsigned line = 0;
  unsigned column = 0;
  bool same(const Site& o) const {
    return line == o.line && column == o.column && std::strcmp(what, o.what) == 0 &&
           std::strcmp(file, o.file) == 0;
  }
  std::string str() const {
    return std::string(what) + " at " + file + ":" + std::to_string(line) + ":" +
           std::to_string(column);
  }
};

struct Fiber {
  ucontext_t ctx;
  State state = State::Runnable;
  Site site;
  char* stack = nullptr;
};

struct Runtime;
using KernelBody = void (*)(Runtime&);

// What Python hands over (mirrors metal_emu/__init__.py's _Launch).
struct LaunchDesc {
  uint32_t threadgroups[3];
  uint32_t threads[3];
  uint32_t n_buffers;
  void* const* buffers;
  const uint64_t* buffer_bytes;
  uint32_t n_threadgroup_memory;
  const uint64_t* threadgroup_memory_bytes;
  int32_t order;
  uint64_t seed;
};

struct Runtime {
  const LaunchDesc* launch = nullptr;
  KernelBody body = nullptr;
  const char* kernel_name = "";
  uint32_t tg_pos[3] = {0, 0, 0};
  uint32_t n_threads = 0;
  int current = -1;  // thread index in threadgroup of the running fiber, -1 in the scheduler
  bool failed = false;
  std::string error;
  ucontext_t sched_ctx;
  std::vector<Fiber> fibers;
  std::vector<std::vector<unsigned char>> tg_memory;
  std::vector<std::array<unsigned char, kSlotBytes>> simd_in, simd_snapshot;
  std::vector<uint32_t> simd_mask;  // active lanes of each simdgroup at its last collective
  std::mt19937_64 rng;

  ~Runtime() {
    for (auto& f : fibers)
      if (f.stack) munmap(f.stack, kStackBytes);
  }
};

inline thread_local Runtime* g_rt = nullptr;

inline std::string thread_description(const Runtime& rt, int t) {
  const uint32_t tx = rt.launch->threads[0], ty = rt.launch->threads[1];
  char buf[200];
  std::snprintf(buf, sizeof buf, "threadgroup (%u,%u,%u) thread (%u,%u,%u) [index %d]",
                rt.tg_pos[0], rt.tg_pos[1], rt.tg_pos[2], t % tx, (t / tx) % ty, t / (tx * ty),
                t);
  return buf;
}

// Records the first error (the scheduler stops at it).
inline void set_error(const std::string& msg) {
  Runtime& rt = *g_rt;
  if (rt.failed) return;
  rt.failed = true;
  rt.error = std::string("kernel ") + rt.kernel_name + ": " + msg;
  if (rt.current >= 0) rt.error += " (" + thread_description(rt, rt.current) + ")";
  else rt.error += " (threadgroup (" + std::to_string(rt.tg_pos[0]) + "," +
                   std::to_string(rt.tg_pos[1]) + "," + std::to_string(rt.tg_pos[2]) + "))";
}

// Records the error and leaves the running fiber for good (it is never resumed).
[[noreturn]] inline void fail(const std::string& msg) {
  Runtime& rt = *g_rt;
  set_error(msg);
  if (rt.current >= 0) {
    Fiber& f = rt.fibers[rt.current];
    swapcontext(&f.ctx, &rt.sched_ctx);
  }
  std::abort();  // unreachable: a failed fiber is never resumed
}

inline void block(State s, const Site& site) {
  Runtime& rt = *g_rt;
  Fiber& f = rt.fibers[rt.current];
  f.state = s;
  f.site = site;
  swapcontext(&f.ctx, &rt.sched_ctx);
}

inline void fiber_main() {
  Runtime& rt = *g_rt;
  rt.body(rt);
  rt.fibers[rt.current].state = State::Done;
  // returning switches to uc_link (the scheduler)
}

inline std::vector<uint32_t> order_of(Runtime& rt, uint32_t n) {
  std::vector<uint32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0u);
  if (rt.launch->order == kReverse) std::reverse(idx.begin(), idx.end());
  if (rt.launch->order == kShuffle) std::shuffle(idx.begin(), idx.end(), rt.rng);
  return idx;
}

inline std::string lanes_at(const Runtime& rt, uint32_t lo, uint32_t hi, State s) {
  std::string out;
  for (uint32_t t = lo; t < hi; ++t)
    if (rt.fibers[t].state == s) {
      if (!out.empty()) out += ",";
      out += std::to_string(t);
    }
  return out;
}

// Resolves simdgroup collectives whose live lanes all arrived; returns whether any did.
inline bool resolve_simdgroups(Runtime& rt) {
  bool progressed = false;
  for (uint32_t lo = 0; lo < rt.n_threads; lo += kSimdWidth) {
    const uint32_t hi = std::min(rt.n_threads, lo + kSimdWidth);
    int first_simd = -1, at_barrier = -1;
    uint32_t live = 0;
    for (uint32_t t = lo; t < hi; ++t) {
      const State s = rt.fibers[t].state;
      if (s == State::Done) continue;
      live |= 1u << (t - lo);
      if (s == State::Simd && first_simd < 0) first_simd = int(t);
      if (s == State::Barrier && at_barrier < 0) at_barrier = int(t);
    }
    if (first_simd < 0) continue;
    const Site& site = rt.fibers[first_simd].site;
    if (at_barrier >= 0) {
      set_error("simdgroup divergence: threads [" + lanes_at(rt, lo, hi, State::Simd) +
                "] wait at " + site.str() + " while threads [" +
                lanes_at(rt, lo, hi, State::Barrier) + "] wait at " +
                rt.fibers[at_barrier].site.str());
      return false;
    }
    for (uint32_t t = lo; t < hi; ++t) {
      if (rt.fibers[t].state == State::Simd && !rt.fibers[t].site.same(site)) {
        set_error("simdgroup divergence: thread " + std::to_string(first_simd) + " waits at " +
                  site.str() + " but thread " + std::to_string(t) + " at " +
                  rt.fibers[t].site.str());
        return false;
      }
    }
    for (uint32_t t = lo; t < hi; ++t) {
      rt.simd_snapshot[t] = rt.simd_in[t];
      if (rt.fibers[t].state == State::Simd) rt.fibers[t].state = State::Runnable;
    }
    rt.simd_mask[lo / kSimdWidth] = live;
    progressed = true;
  }
  return progressed;
}

// Every live thread is at a threadgroup barrier: check they are all at the same one.
inline void resolve_barrier(Runtime& rt) {
  int first = -1;
  for (uint32_t t = 0; t < rt.n_threads; ++t)
    if (rt.fibers[t].state == State::Barrier) {
      first = int(t);
      break;
    }
  const Site& site = rt.fibers[first].site;
  std::string exited, elsewhere;
  for (uint32_t t = 0; t < rt.n_threads; ++t) {
    const Fiber& f = rt.fibers[t];
    if (f.state == State::Done) exited += (exited.empty() ? "" : ",") + std::to_string(t);
    else if (!f.site.same(site)) elsewhere = std::to_string(t) + " at " + f.site.str();
  }
  if (!elsewhere.empty())
    return set_error("barrier divergence: thread " + std::to_string(first) + " waits at " +
                     site.str() + " but thread " + elsewhere);
  if (!exited.empty())
    return set_error("barrier divergence: threads [" + exited +
                     "] returned while the others wait at " + site.str());
  for (uint32_t t = 0; t < rt.n_threads; ++t) rt.fibers[t].state = State::Runnable;
}

inline bool run_threadgroup(Runtime& rt) {
  for (uint32_t t = 0; t < rt.n_threads; ++t) {
    Fiber& f = rt.fibers[t];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &rt.sched_ctx;
    makecontext(&f.ctx, fiber_main, 0);
    f.state = State::Runnable;
  }
  for (auto& m : rt.tg_memory) std::memset(m.data(), 0xff, m.size());  // NaN / -1 poison
  for (;;) {
    for (uint32_t t : order_of(rt, rt.n_threads)) {
      if (rt.fibers[t].state != State::Runnable) continue;
      rt.current = int(t);
      swapcontext(&rt.sched_ctx, &rt.fibers[t].ctx);
      rt.current = -1;
      if (rt.failed) return false;
    }
    bool all_done = true;
    for (uint32_t t = 0; t < rt.n_threads; ++t) all_done &= rt.fibers[t].state == State::Done;
    if (all_done) return true;
    const bool progressed = resolve_simdgroups(rt);
    if (rt.failed) return false;
    if (progressed) continue;
    resolve_barrier(rt);
    if (rt.failed) return false;
  }
}

inline int launch(const char* name, KernelBody body, const LaunchDesc& d, char* err,
                  size_t err_len) {
  Runtime rt;
  rt.launch = &d;
  rt.body = body;
  rt.kernel_name = name;
  rt.rng.seed(d.seed);
  Runtime* saved = g_rt;
  g_rt = &rt;
  auto report = [&](const std::string& msg) {
    std::snprintf(err, err_len, "%s", msg.c_str());
    g_rt = saved;
    return 1;
  };
  rt.n_threads = d.threads[0] * d.threads[1] * d.threads[2];
  if (rt.n_threads == 0 || rt.n_threads > kMaxThreads)
    return report("threads per threadgroup must be between 1 and 1024, got " +
                  std::to_string(rt.n_threads));
  rt.fibers.resize(rt.n_threads);
  for (auto& f : rt.fibers) {
    void* p = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return report("could not map a fiber stack");
    f.stack = static_cast<char*>(p);
  }
  rt.simd_in.resize(rt.n_threads);
  rt.simd_snapshot.resize(rt.n_threads);
  rt.simd_mask.resize((rt.n_threads + kSimdWidth - 1) / kSimdWidth);
  uint64_t tg_total = 0;
  for (uint32_t i = 0; i < d.n_threadgroup_memory; ++i) {
    if (d.threadgroup_memory_bytes[i] % 16 != 0)
      return report("threadgroup memory " + std::to_string(i) + " is " +
                    std::to_string(d.threadgroup_memory_bytes[i]) +
                    " bytes; setThreadgroupMemoryLength needs a multiple of 16");
    tg_total += d.threadgroup_memory_bytes[i];
  }
  if (tg_total > kMaxThreadgroupMemory)
    return report("threadgroup memory totals " + std::to_string(tg_total) +
                  " bytes, more than the 32 KiB an Apple GPU has");
  rt.tg_memory.resize(d.n_threadgroup_memory);
  for (uint32_t i = 0; i < d.n_threadgroup_memory; ++i)
    rt.tg_memory[i].resize(d.threadgroup_memory_bytes[i]);

  const uint32_t gx = d.threadgroups[0], gy = d.threadgroups[1], gz = d.threadgroups[2];
  const uint64_t n_groups = uint64_t(gx) * gy * gz;
  std::vector<uint32_t> group_order;
  if (n_groups <= (1u << 24)) {
    group_order.resize(n_groups);
    std::iota(group_order.begin(), group_order.end(), 0u);
    if (d.order == kReverse) std::reverse(group_order.begin(), group_order.end());
    if (d.order == kShuffle) std::shuffle(group_order.begin(), group_order.end(), rt.rng);
  } else {
    return report("too many threadgroups for the emulator: " + std::to_string(n_groups));
  }
  for (uint32_t g : group_order) {
    rt.tg_pos[0] = g % gx;
    rt.tg_pos[1] = (g / gx) % gy;
    rt.tg_pos[2] = g / (gx * gy);
    if (!run_threadgroup(rt)) return report(rt.error);
  }
  g_rt = saved;
  return 0;
}

}  // namespace metal_emu
