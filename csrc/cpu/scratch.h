// Per-thread scratch of the CPU kernels: one block per thread in transparent huge pages
// (HugeScratch), cut into named slices (ScratchCarver), so that no kernel sums its slice
// sizes by hand.
#pragma once

#include <cstddef>
#include <cstdint>

namespace rlx {

// Per-thread scratch in 2 MiB-aligned blocks advised for transparent huge pages. Blocks of up
// to kKeptScratchBytes are kept across calls (grown when too small: fresh ones cost page
// faults every call); larger ones, which only very long chunks of large states need, are
// freed when the call ends. One kept block per thread for the whole library (scratch.cpp),
// whichever kernel asks for it; a thread uses one HugeScratch at a time.
constexpr size_t kKeptScratchBytes = size_t(64) << 20;

class HugeScratch {
 public:
  explicit HugeScratch(size_t bytes);
  ~HugeScratch();
  HugeScratch(const HugeScratch&) = delete;
  HugeScratch& operator=(const HugeScratch&) = delete;
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
  bool owned_ = false;
};

// Lays named slices out one after another. A kernel's scratch type describes its slices once,
// in a `template <class Carver> void lay_out(Carver&)` that calls take() for each; run on a
// counting carver it gives the block's size, run on the block it sets the pointers, so the
// size and the slices cannot disagree.
//   HugeScratch block(scratch_bytes<float>(s));
//   carve_scratch<float>(s, block.get());
template <typename T>
class ScratchCarver {
 public:
  ScratchCarver() = default;  // counts only: take() returns nullptr
  explicit ScratchCarver(void* block) : base_(static_cast<T*>(block)) {}
  // The next n elements.
  T* take(int64_t n) {
    const int64_t at = used_;
    used_ += n;
    return base_ ? base_ + at : nullptr;
  }
  // Moves the next slice to a multiple of n elements from the block's start.
  void align(int64_t n) { used_ = (used_ + n - 1) / n * n; }
  int64_t size() const { return used_; }
  size_t bytes() const { return size_t(used_) * sizeof(T); }

 private:
  T* base_ = nullptr;
  int64_t used_ = 0;
};

// The bytes that the slices of s (S::lay_out) take, and s's slices set on a block of them.
template <typename T, typename S>
inline size_t scratch_bytes(S& s) {
  ScratchCarver<T> count;
  s.lay_out(count);
  return count.bytes();
}
template <typename T, typename S>
inline void carve_scratch(S& s, void* block) {
  ScratchCarver<T> carver(block);
  s.lay_out(carver);
}

}  // namespace rlx
