// Just enough of CUDA's device built-ins to run the kernels of csrc/cuda/gated_delta_*.cu and
// csrc/cuda/codebook_*.cuh on a CPU: one std::thread per CUDA thread, __syncthreads as a block
// barrier, warp shuffles, votes and mma.sync through a per-warp exchange with barriers, dynamic
// shared memory per block; ldmatrix through the same exchange.
#pragma once

#include <algorithm>
#include <barrier>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

using std::exp;
using std::max;
using std::min;

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

namespace emu {
struct Warp {
  std::barrier<> bar{32};
  double slots[32];
  uint32_t frag_a[32][4], frag_b[32][2];  // mma operands of every lane
};
// RLX_EMU_SERIAL_WARPS: between two block barriers the warps run one at a time, in an order
// that rotates from one barrier to the next, so that every warp in turn runs its whole phase
// before the others start theirs (and after they end theirs). A read of what another warp
// writes with no barrier between them then sees the value from before (or the NaN that
// shared memory starts as): missing barriers show in the results however the OS schedules.
inline const bool serial_warps = std::getenv("RLX_EMU_SERIAL_WARPS") != nullptr;
struct Turns {
  std::mutex m;
  std::condition_variable cv;
  std::vector<unsigned> alive;  // threads of each warp that have not returned
  unsigned warps = 0, phase = 0, pos = 0, arrived = 0;
  unsigned current() const { return (phase + pos) % warps; }
  // the current warp's threads have all arrived (or returned): the next warp's turn
  void advance() {
    unsigned left = 0;
    for (unsigned a : alive) left += a;
    while (left > 0 && arrived == alive[current()]) {
      arrived = 0;
      if (++pos == warps) pos = 0, ++phase;
      if (alive[current()] != 0) break;
    }
    cv.notify_all();
  }
  void wait_turn(std::unique_lock<std::mutex>& lk, unsigned w, unsigned after_phase) {
    cv.wait(lk, [&] { return phase > after_phase && current() == w; });
  }
  void arrive_and_wait(unsigned w) {
    std::unique_lock<std::mutex> lk(m);
    const unsigned my_phase = phase;
    ++arrived;
    advance();
    wait_turn(lk, w, my_phase);
  }
  void leave() {
    std::unique_lock<std::mutex> lk(m);
    --alive[current()];
    advance();
  }
};
struct Block {
  std::barrier<>* bar;
  Turns* turns;  // serial_warps only
  std::vector<std::unique_ptr<Warp>>* warps;
  unsigned char* smem;
};
inline thread_local dim3 tid, bid;
inline dim3 bdim;
inline thread_local Block* block = nullptr;
}  // namespace emu

#define threadIdx emu::tid
#define blockIdx emu::bid
#define blockDim emu::bdim

inline void __syncthreads() {
  if (emu::block->turns != nullptr) {
    emu::block->turns->arrive_and_wait(threadIdx.x / 32);
  } else {
    emu::block->bar->arrive_and_wait();
  }
}

// Lane src's value (src taken modulo 32, as the hardware does).
template <class T>
T __shfl_sync(unsigned, T v, int src) {
  static_assert(sizeof(T) <= sizeof(double), "shuffle of a wide type");
  emu::Warp& w = *(*emu::block->warps)[threadIdx.x / 32];
  const int lane = threadIdx.x % 32;
  std::memcpy(&w.slots[lane], &v, sizeof(T));
  w.bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &w.slots[src & 31], sizeof(T));
  w.bar.arrive_and_wait();
  return r;
}

template <class T>
T __shfl_xor_sync(unsigned mask, T v, int off) {
  return __shfl_sync(mask, v, static_cast<int>(threadIdx.x % 32) ^ off);
}

// A warp barrier, and the warp votes the histogram backward uses (all 32 lanes take part).
inline void __syncwarp(unsigned = 0xffffffffu) {
  (*emu::block->warps)[threadIdx.x / 32]->bar.arrive_and_wait();
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
namespace emu {
// Every lane's value, exchanged through the warp's slots.
inline void warp_values(unsigned v, unsigned (&all)[32]) {
  Warp& w = *(*block->warps)[tid.x / 32];
  const int lane = tid.x % 32;
  std::memcpy(&w.slots[lane], &v, sizeof(v));
  w.bar.arrive_and_wait();
  for (int l = 0; l < 32; ++l) std::memcpy(&all[l], &w.slots[l], sizeof(unsigned));
  w.bar.arrive_and_wait();
}
}  // namespace emu
inline unsigned __match_any_sync(unsigned, unsigned key) {
  unsigned all[32], peers = 0;
  emu::warp_values(key, all);
  for (int l = 0; l < 32; ++l)
    if (all[l] == key) peers |= 1u << l;
  return peers;
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
  unsigned all[32];
  emu::warp_values(v, all);
  return *std::max_element(all, all + 32);
}

struct uint2 {
  uint32_t x, y;
};
struct uint4 {
  uint32_t x, y, z, w;
};

namespace emu {
// IEEE binary16 and bfloat16 bit patterns <-> float (round to nearest even).
inline float half_to_float(uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return static_cast<float>(h);
}
inline uint16_t float_to_half(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
inline float bf16_to_float(uint16_t u) {
  const uint32_t w = uint32_t(u) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t w;
  std::memcpy(&w, &f, 4);
  if (std::isnan(f)) return uint16_t((w >> 16) | 0x40);
  w += 0x7fffu + ((w >> 16) & 1u);
  return uint16_t(w >> 16);
}

// mma.sync.m16n8k16 (16-bit A and B, float32 C) for the calling warp, with the PTX ISA's
// fragment layout: lane (g = lane / 4, t = lane % 4) holds A[g][2t, 2t+1], A[g+8][2t, 2t+1],
// A[g][2t+8, 2t+9], A[g+8][2t+8, 2t+9] (a[0..3], low half first), B[2t, 2t+1][g],
// B[2t+8, 2t+9][g] (b[0..1]) and C[g][2t, 2t+1], C[g+8][2t, 2t+1] (c[0..3]).
template <class ToFloat>
void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], ToFloat f) {
  Warp& w = *(*block->warps)[tid.x / 32];
  const int lane = tid.x % 32;
  std::memcpy(w.frag_a[lane], a, sizeof(a));
  std::memcpy(w.frag_b[lane], b, sizeof(b));
  w.bar.arrive_and_wait();
  auto elem = [](uint32_t reg, int k) { return uint16_t(reg >> (16 * (k & 1))); };
  for (int i = 0; i < 4; ++i) {
    const int row = lane / 4 + 8 * (i / 2), col = 2 * (lane % 4) + (i % 2);
    float s = c[i];
    for (int k = 0; k < 16; ++k) {
      const uint32_t ar = w.frag_a[(row % 8) * 4 + (k % 8) / 2][(row / 8) + 2 * (k / 8)];
      const uint32_t br = w.frag_b[col * 4 + (k % 8) / 2][k / 8];
      s += f(elem(ar, k)) * f(elem(br, k));
    }
    c[i] = s;
  }
  w.bar.arrive_and_wait();
}

// ldmatrix.sync.aligned.m8n8.x{N}[.trans].shared.b16 for the calling warp: lane 8j + r gives
// the address of row r (8 16-bit elements) of matrix j < N; lane (g = lane / 4, t = lane % 4)
// receives elements 2t, 2t+1 of row g of matrix j in r[j] (trans: elements g of rows 2t and
// 2t+1), low half first. The addresses are exchanged between the lanes as on the GPU, so a
// lane reads the rows other lanes name; a row address not 16-byte aligned aborts.
template <int N, bool kTrans>
void ldmatrix(uint32_t (&out)[N], const uint16_t* row) {
  Warp& w = *(*block->warps)[tid.x / 32];
  const int lane = tid.x % 32;
  if (lane < 8 * N && reinterpret_cast<uintptr_t>(row) % 16 != 0) {
    std::fprintf(stderr, "ldmatrix: row address not 16-byte aligned\n");
    std::abort();
  }
  static_assert(sizeof(row) <= sizeof(double), "pointer wider than a slot");
  std::memcpy(&w.slots[lane], &row, sizeof(row));
  w.bar.arrive_and_wait();
  auto row_of = [&](int l) {
    const uint16_t* p;
    std::memcpy(&p, &w.slots[l], sizeof(p));
    return p;
  };
  const int g = lane / 4, t = lane % 4;
  for (int j = 0; j < N; ++j) {
    uint16_t lo, hi;
    if (kTrans) {
      lo = row_of(8 * j + 2 * t)[g];
      hi = row_of(8 * j + 2 * t + 1)[g];
    } else {
      lo = row_of(8 * j + g)[2 * t];
      hi = row_of(8 * j + g)[2 * t + 1];
    }
    out[j] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  w.bar.arrive_and_wait();
}
}  // namespace emu

template <class T>
T* dynamic_smem() {
  return reinterpret_cast<T*>(emu::block->smem);
}

namespace emu {
// Runs kernel() for every thread of every block (blocks one after another). Shared memory
// starts as NaN bytes, so reads of never-written shared memory show up in the results.
template <class F>
void launch(unsigned blocks, unsigned threads, size_t smem_bytes, F kernel) {
  bdim = dim3(threads);
  for (unsigned b = 0; b < blocks; ++b) {
    std::barrier<> bar(threads);
    std::vector<std::unique_ptr<Warp>> warps;
    for (unsigned w = 0; w < (threads + 31) / 32; ++w) warps.push_back(std::make_unique<Warp>());
    std::vector<double> mem((smem_bytes + 7) / 8 + 2, std::nan(""));
    Turns turns;
    turns.warps = (threads + 31) / 32;
    for (unsigned w = 0; w < turns.warps; ++w) turns.alive.push_back(std::min(32u, threads - 32 * w));
    turns.phase = 1;  // (warp 1 first: so that warp 0 is not always first)
    Block blk{&bar, serial_warps ? &turns : nullptr, &warps,
              reinterpret_cast<unsigned char*>(mem.data())};
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        tid = dim3(t);
        bid = dim3(b);
        block = &blk;
        if (blk.turns != nullptr) {
          std::unique_lock<std::mutex> lk(turns.m);
          turns.wait_turn(lk, t / 32, 0);
        }
        kernel();
        if (blk.turns != nullptr) turns.leave();
      });
    }
    for (auto& th : ts) th.join();
  }
}
}  // namespace emu
