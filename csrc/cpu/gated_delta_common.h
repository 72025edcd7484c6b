// Gated delta rule on the CPU: token-by-token recurrence with float32 (float64) state.
// What the forward (gated_delta_forward.cpp) and the backward (gated_delta_backward*.cpp)
// share: the layouts, vectors, row loads, reductions and prefetches below.
//
// Per (sequence, value head hv), state S in R^{K x V}, q/k head h = hv / (HV / H):
//   P = diag(a_t) S_{t-1}, a_t = exp(g_t)      (one gate per head, or one per key channel)
//   w = P^T k_t,  u = beta_t (v_t - w),  S_t = P + k_t u^T,  o_t = scale S_t^T q_t
// Forward: parallel over (sequence, hv, group of V-blocks) -- the columns of S evolve
// independently -- and keeps S every C tokens in the checkpoint buffer
// (gdn_backward_layout.h).
// Backward (token by token, gated_delta_backward_recurrent.cpp; the chunked form for decays,
// gated_delta_backward_chunked.cpp, works on blocks of tokens instead):
// parallel over (sequence, q/k head); for each value head of the group it walks
// the chunks backwards, recomputes the chunk's states from its checkpoint (in sub-chunks
// when they are very large, see RecurrentBackward), and runs the reverse recurrence for dS
// over them, one block of columns at a time (the columns evolve independently; a block's
// states fit L2): the per-token row factors are computed once per chunk for all blocks, and
// the blocks' partial dq/dk/dg/dbeta are summed in a fixed order. dq/dk of a group are summed
// over its value heads in a fixed order, so results are bitwise reproducible.
// Both directions stream the state once per token: each pass also accumulates the next
// token's state projection (software pipelining), and the state (forward) and dS
// (backward) are kept lazily decayed, scaled by per-row factors in [2^-20, 2^20] that are
// renormalized before they leave that range (see TokenCoeffs, ReverseRows).
// The only exponentials are exp(g_t) of the inputs themselves (<= 1 for the log-space
// decays g <= 0 the op is meant for); nothing is divided by a decay, only by those
// bounded scale factors.
// With l2norm_eps, q and k are L2-normalized as they are read (q_t -> r q_t, one factor r
// per row, l2norm_row.h): in the forward r joins the per-token scalar factors, the backward
// scales the rows it loads and takes a q/k head's gradients through l2norm's backward once
// its value heads are summed.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "rlx/acc_type.h"
#include "rlx/gdn_backward_layout.h"
#include "rlx/gdn_checks.h"
#include "cpu_isa.h"
#include "gated_delta_kernels.h"
#include "huge_pages.h"
#include "l2norm_row.h"
#include "vec.h"

namespace rlx {

namespace RLX_ISA_NS {
namespace {

// The forward keeps its state block row-major ([K, nv], fla's layout): a block of columns is
// updated with S^T k and S^T q accumulating down the rows in vector registers. The backward
// works on column-major states (column j of S, K contiguous values, is what a token's
// update touches for output channel j): its loops run over row blocks outside and columns
// inside, so the sums over V (dq, dk, dg) stay in registers and the sums over K (per
// column) accumulate as vectors. Checkpoints and user-facing states keep fla's [K, V]
// layout and are transposed on the way in and out of the backward (once per C tokens).
// Every reduction runs in a fixed order, so results are reproducible bit for bit.

template <typename acc_t>
using AccVec = std::vector<acc_t>;

// Decay factors a = exp(g) of value head hv: one per key channel, or one broadcast to all K.
template <typename acc_t>
inline void load_decay(const GdnProblem& p, const acc_t* g, int64_t tok, int64_t hv,
                       acc_t* a) {
  const int64_t K = p.head_k_dim;
  if (p.gate_per_channel) {
    const acc_t* src = g + (tok * p.num_v_heads + hv) * K;
    for (int64_t i = 0; i < K; ++i) a[i] = std::exp(src[i]);
  } else {
    const acc_t e = std::exp(g[tok * p.num_v_heads + hv]);
    for (int64_t i = 0; i < K; ++i) a[i] = e;
  }
}

// out[j] = the sum of x[j]'s lanes, j < n. Eight 8-float vectors at a time are reduced by a
// transpose-and-add tree: 14 in-register shuffles and 7 adds for 8 sums, against ~15
// instructions per column for hsum (the backward reduces 2 V columns per token; in-process
// A/B, one thread: 4-8% faster by the minimum in three of four runs, equal in the fourth).
// 16-float vectors are first folded to 8 lanes (low half + high half). Fixed order, so still
// reproducible.
template <typename acc_t>
inline void hsum_columns(const SimdVec<acc_t>* __restrict x, int64_t n, acc_t* __restrict out) {
  int64_t j = 0;
#if (RLX_VEC_BYTES == 32 || RLX_VEC_BYTES == 64) && \
    (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
  if constexpr (std::is_same_v<acc_t, float>) {
    using vec = Vec<float, 8>;
    auto fold = [](const SimdVec<float>& a) -> vec {
#if RLX_VEC_BYTES == 64
      return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else
      return a;
#endif
    };
    auto pair = [&](const SimdVec<float>& a, const SimdVec<float>& b) {
      const vec a8 = fold(a), b8 = fold(b);
      return __builtin_shufflevector(a8, b8, 0, 8, 2, 10, 4, 12, 6, 14) +
             __builtin_shufflevector(a8, b8, 1, 9, 3, 11, 5, 13, 7, 15);
    };
    auto quad = [](const vec& a, const vec& b) {
      return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
             __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
    };
    for (; j + 8 <= n; j += 8) {
      const vec t0 = quad(pair(x[j], x[j + 1]), pair(x[j + 2], x[j + 3]));
      const vec t1 = quad(pair(x[j + 4], x[j + 5]), pair(x[j + 6], x[j + 7]));
      const vec s = __builtin_shufflevector(t0, t1, 0, 1, 2, 3, 8, 9, 10, 11) +
                    __builtin_shufflevector(t0, t1, 4, 5, 6, 7, 12, 13, 14, 15);
      std::memcpy(out + j, &s, sizeof(s));
    }
  }
#endif
  for (; j < n; ++j) out[j] = hsum<acc_t>(x[j]);
}

// sum_i x[i] y[i] over [0, n) as a vector of lane sums (n a multiple of the vector length).
template <typename acc_t>
inline SimdVec<acc_t> dot_lanes(int64_t n, const acc_t* __restrict x, const acc_t* __restrict y) {
  using vec = SimdVec<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  vec s0 = {}, s1 = {};
  int64_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    s0 += load_vec(x + i) * load_vec(y + i);
    s1 += load_vec(x + i + L) * load_vec(y + i + L);
  }
  if (i < n) s0 += load_vec(x + i) * load_vec(y + i);
  return s0 + s1;
}

// out[i] = l2norm_rstd of the K-long row x + i * stride, i < n. Float rows of whole vectors
// are summed as vectors and reduced eight rows at a time by hsum_columns: a row at a time,
// the reduction and the square root are one dependent chain per row (~90 cycles; it made
// the fused l2norm slower than the separate op's pass over q and k).
template <typename in_t, typename acc_t>
inline void l2norm_rstd_rows(const in_t* x, int64_t stride, int64_t n, int64_t K, acc_t eps,
                             acc_t* out) {
  using vec = SimdVec<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  if constexpr (std::is_same_v<in_t, acc_t>) {
    if (K % L == 0) {
      constexpr int64_t kRows = 64;
      vec part[kRows] = {};  // (zeroed: GCC cannot see that hsum_columns reads only [0, m))
      for (int64_t i0 = 0; i0 < n; i0 += kRows) {
        const int64_t m = std::min(kRows, n - i0);
        for (int64_t i = 0; i < m; ++i) {
          const acc_t* r = x + (i0 + i) * stride;
          part[i] = dot_lanes(K, r, r);
        }
        hsum_columns(part, m, out + i0);
      }
      for (int64_t i = 0; i < n; ++i) out[i] = acc_t(1) / std::sqrt(out[i] + eps);
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) out[i] = l2norm_rstd<acc_t>(x + i * stride, K, eps);
}

// Rows of consecutive tokens lie H*K (HV*V) elements apart, often a page or more: the
// hardware prefetchers do not follow that stride, and each token then waits on a few cache
// misses (~1/3 of the K = V = 128 forward's time). Prefetching a few tokens ahead hides them.
constexpr int64_t kPrefetchTokens = 4;
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

inline void prefetch_rows_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

// *dst = x through a non-temporal store (dst vector-aligned) where AVX has one: for rows
// written once and read by no one soon, which would otherwise first be read for ownership,
// a cache miss the token loops wait on.
template <typename acc_t>
inline void stream_vec(acc_t* dst, const SimdVec<acc_t>& x) {
#if RLX_VEC_BYTES == 64
  if constexpr (std::is_same_v<acc_t, float>) {
    _mm512_stream_ps(dst, reinterpret_cast<const __m512&>(x));
  } else {
    _mm512_stream_pd(dst, reinterpret_cast<const __m512d&>(x));
  }
#elif RLX_ISA_AVX
  if constexpr (std::is_same_v<acc_t, float>) {
    _mm256_stream_ps(dst, reinterpret_cast<const __m256&>(x));
  } else {
    _mm256_stream_pd(dst, reinterpret_cast<const __m256d&>(x));
  }
#elif defined(__aarch64__) && defined(__clang__)
  // One STNP of two q registers (Apple silicon's compiler is clang; GCC has no such builtin).
  // Arm orders it like any store, so unlike x86's streaming stores it needs no fence.
  __builtin_nontemporal_store(x, reinterpret_cast<SimdVec<acc_t>*>(dst));
#else
  store_vec(dst, x);
#endif
}

// dst[0, n) = src, streamed (stream_vec) when dst is vector-aligned.
template <typename acc_t>
inline void stream_row(acc_t* __restrict dst, const acc_t* __restrict src, int64_t n) {
  constexpr int64_t L = kVecLanes<acc_t>;
  int64_t i = 0;
  if (reinterpret_cast<uintptr_t>(dst) % sizeof(SimdVec<acc_t>) == 0) {
    for (; i + L <= n; i += L) stream_vec(dst + i, load_vec(src + i));
  }
  for (; i < n; ++i) dst[i] = src[i];
}

}  // namespace
}  // namespace RLX_ISA_NS
}  // namespace rlx
