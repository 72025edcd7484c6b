// Just enough of CUDA's device built-ins to run csrc/cuda/gated_delta_*.cu kernels on a CPU:
// one std::thread per CUDA thread, __syncthreads as a block barrier, warp shuffles through a
// per-warp exchange with barriers, dynamic shared memory per block.
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
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
};
struct Block {
  std::barrier<>* bar;
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

inline void __syncthreads() { emu::block->bar->arrive_and_wait(); }

template <class T>
T __shfl_xor_sync(unsigned, T v, int off) {
  static_assert(sizeof(T) <= sizeof(double), "shuffle of a wide type");
  emu::Warp& w = *(*emu::block->warps)[threadIdx.x / 32];
  const int lane = threadIdx.x % 32;
  std::memcpy(&w.slots[lane], &v, sizeof(T));
  w.bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &w.slots[lane ^ off], sizeof(T));
  w.bar.arrive_and_wait();
  return r;
}

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
    Block blk{&bar, &warps, reinterpret_cast<unsigned char*>(mem.data())};
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        tid = dim3(t);
        bid = dim3(b);
        block = &blk;
        kernel();
      });
    }
    for (auto& th : ts) th.join();
  }
}
}  // namespace emu
