// Gated delta rule on the CPU, backward: what its two algorithms share (their entry points
// are declared in gated_delta_kernels.h). gated_delta_backward.cpp checks the inputs and
// picks one:
//   gated_delta_backward_recurrent.cpp  token by token (any gate; the general case)
//   gated_delta_backward_chunked.cpp    the chunked (WY) form, one gate per head with g <= 0
// Both write every gradient into the packed buffer (rlx/gdn_backward_layout.h).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <new>
#include <type_traits>

#include "gated_delta_common.h"
#include "rlx/gdn_backward_layout.h"
#include "rlx/gdn_checks.h"
#include "cpu_isa.h"
#include "gated_delta_kernels.h"

namespace rlx {
namespace RLX_ISA_NS {

namespace {

// n zeroed vectors on the heap, aligned for them. (Not std::vector<SimdVec<acc_t>>: GCC drops
// a vector type's attributes in a template argument, and outside an AVX target it aligns a
// 32-byte vector to 16 bytes, so the baseline std::allocator would hand the AVX2 copy's
// aligned moves 16-byte-aligned memory.)
template <typename acc_t>
class VecArray {
 public:
  explicit VecArray(size_t n)
      : p_(static_cast<SimdVec<acc_t>*>(::operator new(n * sizeof(SimdVec<acc_t>), kAlign))) {
    for (size_t i = 0; i < n; ++i) p_[i] = SimdVec<acc_t>{};
  }
  ~VecArray() { ::operator delete(p_, kAlign); }
  VecArray(const VecArray&) = delete;
  VecArray& operator=(const VecArray&) = delete;
  SimdVec<acc_t>* data() const { return p_; }

 private:
  static constexpr std::align_val_t kAlign{sizeof(SimdVec<acc_t>)};
  SimdVec<acc_t>* p_;
};

// Prefetch distance (tokens) of the loops that do O(K) work per token (kPrefetchTokens:
// gated_delta_common.h).
constexpr int64_t kRowPrefetchTokens = 16;

// Loads row (tok, head) of a [tokens, heads, dim] input as acc_t.
template <typename in_t, typename acc_t>
inline void load_row(const in_t* base, int64_t tok, int64_t heads, int64_t head, int64_t dim,
                     acc_t* out) {
  const in_t* src = base + (tok * heads + head) * dim;
  for (int64_t i = 0; i < dim; ++i) out[i] = static_cast<acc_t>(src[i]);
}

// Column-major [V, K] scratch with column stride ld -> row-major [K, V] state (see
// gather_columns below).
template <typename acc_t>
inline void scatter_columns(const acc_t* src, int64_t K, int64_t V, int64_t ld, acc_t* dst) {
  for (int64_t r = 0; r < K; ++r) {
    for (int64_t j = 0; j < V; ++j) dst[r * V + j] = src[j * ld + r];
  }
}

// x, hidden from the optimizer: GCC turns loops that only copy or zero a few hundred bytes
// (the backward's per-token gradient rows and column sums) into memmove/memset calls, ~3% of
// the backward in a profile. An empty asm on the value keeps them inline vector moves.
template <typename vec>
inline vec opaque(vec x) {
#if RLX_VEC_BYTES == 64
  asm("" : "+v"(x));  // one zmm register (AVX-512 copy)
#elif defined(__x86_64__) || defined(_M_X64)
  asm("" : "+x"(x));  // one xmm (baseline) or ymm (AVX2 copy) register
#elif defined(__aarch64__) && defined(__clang__)
  // NEON registers hold 128 bits: each half goes through one. (GCC's aarch64 port would spill
  // the halves through the stack, so it gets no barrier.)
  static_assert(sizeof(vec) == 32, "a 256-bit vector");
  typedef float half_vec __attribute__((vector_size(16)));
  half_vec h[2];
  __builtin_memcpy(h, &x, sizeof(h));
  asm("" : "+w"(h[0]), "+w"(h[1]));
  __builtin_memcpy(&x, h, sizeof(h));
#endif
  return x;
}

// Row-major [K, V] state -> column-major [V, K] scratch with column stride ld >= K. Float
// states go through 8 x 8 tiles transposed in 256-bit registers where the copy has AVX (the
// scalar loop's strided stores took 3% of the backward in a profile).
template <typename acc_t>
inline void gather_columns(const acc_t* __restrict src, int64_t K, int64_t V, int64_t ld,
                           acc_t* __restrict dst) {
  int64_t K8 = 0, V8 = 0;
#if (RLX_VEC_BYTES == 32 || RLX_VEC_BYTES == 64) && \
    (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
  if constexpr (std::is_same_v<acc_t, float>) {
    using vec = Vec<float, 8>;  // 8 x 8 tiles in 256-bit registers in either copy
    auto store8 = [](float* p, const vec& v) { std::memcpy(p, &v, sizeof(v)); };
    K8 = K / 8 * 8;
    V8 = V / 8 * 8;
    for (int64_t r0 = 0; r0 < K8; r0 += 8) {
      for (int64_t j0 = 0; j0 < V8; j0 += 8) {
        vec x[8], t[8], y[8];
        for (int64_t i = 0; i < 8; ++i) std::memcpy(&x[i], src + (r0 + i) * V + j0, sizeof(vec));
        for (int64_t i = 0; i < 8; i += 2) {
          t[i] = __builtin_shufflevector(x[i], x[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
          t[i + 1] = __builtin_shufflevector(x[i], x[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
        }
        for (int64_t i = 0; i < 8; i += 4) {
          y[i] = __builtin_shufflevector(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
          y[i + 1] = __builtin_shufflevector(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
          y[i + 2] = __builtin_shufflevector(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
          y[i + 3] = __builtin_shufflevector(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
        }
        for (int64_t i = 0; i < 4; ++i) {  // y[i]: columns i and i + 4 of rows r0..r0+3
          store8(dst + (j0 + i) * ld + r0,
                 __builtin_shufflevector(y[i], y[i + 4], 0, 1, 2, 3, 8, 9, 10, 11));
          store8(dst + (j0 + i + 4) * ld + r0,
                 __builtin_shufflevector(y[i], y[i + 4], 4, 5, 6, 7, 12, 13, 14, 15));
        }
      }
    }
  }
#endif
  for (int64_t r = 0; r < K; ++r) {  // what the tiles left: rows from K8, columns from V8
    for (int64_t j = r < K8 ? V8 : 0; j < V; ++j) dst[j * ld + r] = src[r * V + j];
  }
}

// dst[0, n) = src, or += src, in vector moves (see opaque).
template <bool kAdd, typename acc_t>
inline void put_row(acc_t* __restrict dst, const acc_t* __restrict src, int64_t n) {
  constexpr int64_t L = kVecLanes<acc_t>;
  int64_t r = 0;
  for (; r + L <= n; r += L) {
    store_vec(dst + r, kAdd ? load_vec(dst + r) + load_vec(src + r) : opaque(load_vec(src + r)));
  }
  for (; r < n; ++r) dst[r] = kAdd ? dst[r] + src[r] : src[r];
}

// The longest chunk any sequence has: scratch sized for chunk_size itself would grow with it
// even where every sequence is shorter (chunk_size = 2^24 at T = 40 asked for 42 GB).
inline int64_t longest_chunk(const GdnProblem& p) {
  return std::max<int64_t>(1, std::min(p.chunk, p.longest));
}

// A backward task: one sequence n and q/k head h (its value heads run in order and sum into
// the same dq/dk rows, so no two threads write the same gradient), with the sequence's
// tokens [bos, eos), first checkpoint slot and number of chunks.
struct BackwardTask {
  int64_t h, n, bos, eos, base, nchunks;
};
inline BackwardTask backward_task(const GdnProblem& p, const int64_t* cu, int64_t task) {
  BackwardTask t;
  t.h = task % p.num_qk_heads, t.n = task / p.num_qk_heads;
  gdn_sequence_bounds(p, cu, t.n, &t.bos, &t.eos);
  t.base = gdn_checkpoint_base(t.n, t.bos, p.chunk);
  t.nchunks = gdn_num_chunks(t.eos - t.bos, p.chunk);
  return t;
}

}  // namespace
}  // namespace RLX_ISA_NS
}  // namespace rlx
