// The emulator's scheduler: runs every thread of a threadgroup as a fiber (ucontext) on one
// OS thread. A fiber runs until it reaches a synchronisation point (threadgroup_barrier,
// simdgroup_barrier or a simd_* collective) or returns. The scheduler advances one simdgroup
// at a time: a simd_* collective completes as soon as the live lanes of *its* simdgroup have
// arrived, so a simdgroup can run ahead of the others up to the next threadgroup barrier,
// which completes only when every live thread of the threadgroup waits at it. Which simdgroup
// (and which lane inside it) runs next is forward, reverse or shuffled, so a missing barrier
// changes the result. A watchdog (loop back-edges and synchronisation points count as steps)
// turns a runaway kernel into an error instead of a hang.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <source_location>
#include <string>
#include <type_traits>
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
  char* guard = nullptr;  // a PROT_NONE page just below the stack: overflow faults there
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
  double timeout_s;    // wall-clock limit of the launch; <= 0: none
  uint64_t max_steps;  // limit on loop iterations + synchronisations; 0: none
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
  // watchdog
  uint64_t steps = 0, next_check = 0;
  std::chrono::steady_clock::time_point start;

  ~Runtime() {
    for (auto& f : fibers)
      if (f.guard) munmap(f.guard, size_t(f.stack - f.guard) + kStackBytes);
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

// ---- watchdog ---------------------------------------------------------------------------------

constexpr uint64_t kClockEverySteps = 4096;  // the clock is read once per this many steps

[[noreturn]] inline void runaway(const Runtime& rt, const char* why, const Site& where) {
  fail(std::string("watchdog: ") + why + " after " + std::to_string(rt.steps) +
       " steps (loop iterations and synchronisations) without finishing; an infinite loop? "
       "Last step: " + where.str());
}

inline void check_watchdog(Runtime& rt, const Site& where) {
  const LaunchDesc& d = *rt.launch;
  if (d.max_steps != 0 && rt.steps > d.max_steps)
    runaway(rt, ("step budget of " + std::to_string(d.max_steps) + " exceeded").c_str(), where);
  if (d.timeout_s > 0) {
    const std::chrono::duration<double> spent = std::chrono::steady_clock::now() - rt.start;
    if (spent.count() > d.timeout_s)
      runaway(rt, ("time limit of " + std::to_string(d.timeout_s) + " s exceeded").c_str(),
              where);
  }
  rt.next_check = rt.steps + kClockEverySteps;
  if (d.max_steps != 0) rt.next_check = std::min(rt.next_check, d.max_steps + 1);
}

// One step of the running fiber; translate.py puts a call in every loop condition.
constexpr bool tick(std::source_location l = std::source_location::current()) {
  if (std::is_constant_evaluated()) return true;
  Runtime& rt = *g_rt;
  if (++rt.steps >= rt.next_check && rt.current >= 0)
    check_watchdog(rt, Site{"loop", l.file_name(), unsigned(l.line()), unsigned(l.column())});
  return true;
}

// ---- scheduler --------------------------------------------------------------------------------

inline void block(State s, const Site& site) {
  Runtime& rt = *g_rt;
  if (++rt.steps >= rt.next_check) check_watchdog(rt, site);
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

inline std::vector<uint32_t> order_of(Runtime& rt, uint32_t lo, uint32_t hi) {
  std::vector<uint32_t> idx(hi - lo);
  std::iota(idx.begin(), idx.end(), lo);
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

inline uint32_t n_simdgroups(const Runtime& rt) { return (rt.n_threads + kSimdWidth - 1) / kSimdWidth; }

inline bool has_runnable_lane(const Runtime& rt, uint32_t sg) {
  const uint32_t hi = std::min(rt.n_threads, (sg + 1) * kSimdWidth);
  for (uint32_t t = sg * kSimdWidth; t < hi; ++t)
    if (rt.fibers[t].state == State::Runnable) return true;
  return false;
}

// The simdgroup to advance next, -1 when none has a runnable lane. Forward and reverse run
// the lowest / highest simdgroup as far as it goes (up to a threadgroup barrier or its end)
// before the next one starts; shuffle picks at random after every collective.
inline int pick_simdgroup(Runtime& rt) {
  std::vector<uint32_t> ready;
  for (uint32_t sg = 0; sg < n_simdgroups(rt); ++sg)
    if (has_runnable_lane(rt, sg)) ready.push_back(sg);
  if (ready.empty()) return -1;
  if (rt.launch->order == kForward) return int(ready.front());
  if (rt.launch->order == kReverse) return int(ready.back());
  return int(ready[std::uniform_int_distribution<size_t>(0, ready.size() - 1)(rt.rng)]);
}

// Runs every runnable lane of simdgroup `sg` (in the launch order) until it blocks or returns.
inline void run_simdgroup(Runtime& rt, uint32_t sg) {
  const uint32_t lo = sg * kSimdWidth, hi = std::min(rt.n_threads, lo + kSimdWidth);
  for (uint32_t t : order_of(rt, lo, hi)) {
    if (rt.fibers[t].state != State::Runnable) continue;
    rt.current = int(t);
    swapcontext(&rt.sched_ctx, &rt.fibers[t].ctx);
    rt.current = -1;
    if (rt.failed) return;
  }
}

// No lane of simdgroup `sg` is runnable: if its live lanes all wait at the same collective,
// complete it (each lane then sees every live lane's value and the mask of live lanes).
// Lanes at a collective while others wait at a threadgroup barrier can never meet: divergence.
inline void settle_simdgroup(Runtime& rt, uint32_t sg) {
  const uint32_t lo = sg * kSimdWidth, hi = std::min(rt.n_threads, lo + kSimdWidth);
  int first_simd = -1, at_barrier = -1;
  uint32_t live = 0;
  for (uint32_t t = lo; t < hi; ++t) {
    const State s = rt.fibers[t].state;
    if (s == State::Done) continue;
    live |= 1u << (t - lo);
    if (s == State::Simd && first_simd < 0) first_simd = int(t);
    if (s == State::Barrier && at_barrier < 0) at_barrier = int(t);
  }
  if (first_simd < 0) return;
  const Site& site = rt.fibers[first_simd].site;
  if (at_barrier >= 0)
    return set_error("simdgroup divergence: threads [" + lanes_at(rt, lo, hi, State::Simd) +
                     "] wait at " + site.str() + " while threads [" +
                     lanes_at(rt, lo, hi, State::Barrier) + "] wait at " +
                     rt.fibers[at_barrier].site.str());
  for (uint32_t t = lo; t < hi; ++t)
    if (rt.fibers[t].state == State::Simd && !rt.fibers[t].site.same(site))
      return set_error("simdgroup divergence: thread " + std::to_string(first_simd) +
                       " waits at " + site.str() + " but thread " + std::to_string(t) + " at " +
                       rt.fibers[t].site.str());
  for (uint32_t t = lo; t < hi; ++t) {
    rt.simd_snapshot[t] = rt.simd_in[t];
    if (rt.fibers[t].state == State::Simd) rt.fibers[t].state = State::Runnable;
  }
  rt.simd_mask[sg] = live;
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
    const int sg = pick_simdgroup(rt);
    if (sg >= 0) {
      run_simdgroup(rt, uint32_t(sg));
      if (!rt.failed) settle_simdgroup(rt, uint32_t(sg));
      if (rt.failed) return false;
      continue;
    }
    // Nothing runnable, and every simdgroup was settled after it last ran: each live thread
    // waits at a threadgroup barrier.
    bool all_done = true;
    for (uint32_t t = 0; t < rt.n_threads; ++t) all_done &= rt.fibers[t].state == State::Done;
    if (all_done) return true;
    resolve_barrier(rt);
    if (rt.failed) return false;
  }
}

// ---- faults inside a kernel thread --------------------------------------------------------------

// On a GPU an integer division by zero gives an undefined value and a thread has bounded
// private memory; on the CPU they are SIGFPE and a stack overflow (into the guard page), which
// would kill the test process. While a launch runs, both become the launch's error and the
// faulting fiber is abandoned. Other faults go to the previous handler (e.g. faulthandler).
inline struct sigaction g_previous_fpe, g_previous_segv, g_previous_bus;  // SIGBUS: macOS

inline void on_fault(int sig, siginfo_t* info, void*) {
  Runtime* rt = g_rt;
  if (rt != nullptr && rt->current >= 0) {
    const Fiber& f = rt->fibers[size_t(rt->current)];
    const char* addr = static_cast<const char*>(info->si_addr);
    if (sig == SIGFPE) {
      set_error("arithmetic fault (SIGFPE): an integer division by zero or INT_MIN / -1 "
                "(undefined on a GPU)");
      setcontext(&rt->sched_ctx);
    }
    if (addr >= f.guard && addr < f.stack) {
      set_error("stack overflow: this thread's private memory (local arrays) exceeds the " +
                std::to_string(kStackBytes / 1024) + " KiB the emulator gives a thread");
      setcontext(&rt->sched_ctx);
    }
  }
  // not ours: put the previous handler back; returning re-executes the faulting instruction
  sigaction(sig, sig == SIGFPE ? &g_previous_fpe : sig == SIGBUS ? &g_previous_bus : &g_previous_segv,
            nullptr);
}

struct FaultHandlers {
  stack_t previous_stack{};
  std::vector<char> alt_stack = std::vector<char>(64 * 1024);  // the handler's own stack
  struct sigaction previous_fpe {}, previous_segv {}, previous_bus {};
  FaultHandlers() {
    stack_t st{};
    st.ss_sp = alt_stack.data();
    st.ss_size = alt_stack.size();
    sigaltstack(&st, &previous_stack);
    struct sigaction sa {};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGFPE, &sa, &previous_fpe);
    sigaction(SIGSEGV, &sa, &previous_segv);
    sigaction(SIGBUS, &sa, &previous_bus);
    g_previous_fpe = previous_fpe;
    g_previous_segv = previous_segv;
    g_previous_bus = previous_bus;
  }
  ~FaultHandlers() {
    sigaction(SIGFPE, &previous_fpe, nullptr);
    sigaction(SIGSEGV, &previous_segv, nullptr);
    sigaction(SIGBUS, &previous_bus, nullptr);
    sigaltstack(&previous_stack, nullptr);
  }
  FaultHandlers(const FaultHandlers&) = delete;
  FaultHandlers& operator=(const FaultHandlers&) = delete;
};

inline int launch(const char* name, KernelBody body, const LaunchDesc& d, char* err,
                  size_t err_len) {
  Runtime rt;
  rt.launch = &d;
  rt.body = body;
  rt.kernel_name = name;
  rt.rng.seed(d.seed);
  rt.start = std::chrono::steady_clock::now();
  rt.next_check = d.max_steps != 0 ? std::min(kClockEverySteps, d.max_steps + 1) : kClockEverySteps;
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
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  for (auto& f : rt.fibers) {
    void* p = mmap(nullptr, page + kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return report("could not map a fiber stack");
    f.guard = static_cast<char*>(p);
    f.stack = f.guard + page;
    if (mprotect(f.guard, page, PROT_NONE) != 0) return report("could not protect a stack guard");
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
  FaultHandlers faults;  // from here on a fault inside a kernel thread is reported, not fatal
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
