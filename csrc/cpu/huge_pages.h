// Transparent huge pages for large, freshly allocated CPU outputs.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#if defined(__unix__)
#include <sys/mman.h>
#endif

namespace rlx {

// A fresh 4 KiB page took 1.5-1.8 us to fault in on the development VM, and glibc maps
// large outputs anew on every call (above its mmap threshold, at most 32 MiB). Advising the
// 2 MiB-aligned interior of a large output before it is first written lets the kernel back
// it with huge pages, one fault per 2 MiB, where transparent huge pages are enabled for
// advised memory; pages already in place (memory the allocator reused) are unaffected.
inline void advise_huge_pages(const at::Tensor& t) {
#if defined(__unix__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t bytes = static_cast<uintptr_t>(t.numel()) * t.element_size();
  if (bytes < 4 * kHuge) return;  // smaller outputs are usually reused heap memory
  const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t lo = (p + kHuge - 1) / kHuge * kHuge, hi = (p + bytes) / kHuge * kHuge;
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#endif
}

}  // namespace rlx
