// HugeScratch (scratch.h): one kept block per thread for the whole library.
#include "scratch.h"

#include <c10/util/Exception.h>

#include <cstdlib>

#if defined(__unix__)
#include <sys/mman.h>
#endif

namespace rlx {
namespace {

void* huge_block(size_t bytes, size_t* rounded) {
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t n = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, n);
  TORCH_CHECK(p != nullptr, "rlx::gated_delta_bwd: out of memory for ", n, " bytes of scratch");
#ifdef MADV_HUGEPAGE
  madvise(p, n, MADV_HUGEPAGE);
#endif
  *rounded = n;
  return p;
}

}  // namespace

HugeScratch::HugeScratch(size_t bytes) {
  struct Kept {
    void* p = nullptr;
    size_t n = 0;
    ~Kept() { std::free(p); }
  };
  thread_local Kept kept;
  if (bytes > kKeptScratchBytes) {
    size_t n;
    p_ = huge_block(bytes, &n);
    owned_ = true;
    return;
  }
  if (kept.n < bytes) {
    std::free(kept.p);
    kept.p = nullptr, kept.n = 0;
    kept.p = huge_block(bytes, &kept.n);
  }
  p_ = kept.p;
}

HugeScratch::~HugeScratch() {
  if (owned_) std::free(p_);
}

}  // namespace rlx
