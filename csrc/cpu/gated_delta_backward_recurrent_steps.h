// Gated delta rule on the CPU, token-by-token backward (gated_delta_backward_recurrent.cpp):
// the passes over the column-major scratch states that each token makes (the states'
// recomputation and the reverse step), and their layout.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "gated_delta_backward.h"
#include "gated_delta_common.h"

namespace rlx {
namespace RLX_ISA_NS {
namespace {

// Column stride of the backward's column-major scratch states: K rounded up to a vector,
// plus one vector when that is a multiple of 128 bytes. A power-of-two stride (K = 64, 128)
// maps the same rows of all V columns onto a few L1 sets, and the row-block sweeps then
// miss L1 on almost every access (the K = 128 backward ran 13x the forward's time).
template <typename acc_t>
inline int64_t padded_column_stride(int64_t K) {
  constexpr int64_t L = kVecLanes<acc_t>;
  const int64_t ld = (K + L - 1) / L * L;
  return (ld * int64_t(sizeof(acc_t))) % 128 == 0 ? ld + L : ld;
}

// dy <- r (dy - x r^2 (x . dy)): l2norm's backward (l2norm_row.h) on an acc_t row, in place.
// Float rows of whole vectors in vector registers: with the generic row_dot (a dependent
// chain per lane, then a scalar sum) the two rows per token took 7% of the backward.
template <typename in_t, typename acc_t>
inline void l2norm_backward_inplace(const in_t* x, acc_t r, int64_t K, acc_t* dy) {
  using vec = SimdVec<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  if constexpr (std::is_same_v<in_t, acc_t>) {
    if (K % L == 0) {
      const acc_t c = r * r * hsum<acc_t>(dot_lanes(K, x, dy));
      for (int64_t d = 0; d < K; d += L) {
        store_vec(dy + d, r * (load_vec(dy + d) - load_vec(x + d) * c));
      }
      return;
    }
  }
  const acc_t c = r * r * row_dot<acc_t>(x, dy, K);
  for (int64_t d = 0; d < K; ++d) dy[d] = r * (dy[d] - static_cast<acc_t>(x[d]) * c);
}

// Recomputes one token on all V columns of a column-major state: dst = P + k u^T with
// P = diag(a) src, u = b vw, vw = v - P^T k (given: the previous token's pass accumulated
// it). Like the forward, the pass also accumulates the next token's P^T k from the values
// it writes: w_part[j] = dst_j * f (per lane; f = a' k' of the next token), so each token
// streams the state once. Rows run over Kp (padding rows are zero in src and f).
// NR row blocks at once (w_part[j] is loaded and stored once for them); pf: the same rows
// of the state two tokens ahead, prefetched for writing (their lines would otherwise be
// read only when the store misses).
template <int64_t NR, typename acc_t>
inline void recompute_rows(const acc_t* __restrict src, acc_t* __restrict dst, int64_t rb,
                           int64_t V, int64_t ld, const acc_t* __restrict a,
                           const acc_t* __restrict kv, const acc_t* __restrict f,
                           const acc_t* __restrict u, const acc_t* pf,
                           SimdVec<acc_t>* __restrict w_part) {
  using vec = SimdVec<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  vec a8[NR], k8[NR], f8[NR];
  for (int64_t m = 0; m < NR; ++m) {
    a8[m] = load_vec(a + rb + m * L);
    k8[m] = load_vec(kv + rb + m * L);
    f8[m] = load_vec(f + rb + m * L);
  }
  for (int64_t j = 0; j < V; ++j) {
    const acc_t uj = u[j];
    __builtin_prefetch(pf + j * ld + rb, 1);
    vec wj = w_part[j];
    for (int64_t m = 0; m < NR; ++m) {
      const int64_t i = j * ld + rb + m * L;
      const vec x = a8[m] * load_vec(src + i) + k8[m] * uj;
      store_vec(dst + i, x);
      wj += f8[m] * x;
    }
    w_part[j] = wj;
  }
}

// (noinline, like reverse_step and project_columns: each is a whole pass over a block's
// state, so the call costs nothing, while inlined into RecurrentBackward's task loop their
// loops got its register allocation, with pointers and row vectors reloaded from the stack
// at every column: the token-by-token backward took about 10% longer.)
template <typename acc_t>
[[gnu::noinline]] void recompute_step(const acc_t* __restrict src, acc_t* __restrict dst,
                                     int64_t Kp, int64_t V, int64_t ld,
                                     const acc_t* __restrict a, const acc_t* __restrict kv,
                                     const acc_t* __restrict f, const acc_t* __restrict u,
                                     const acc_t* pf, SimdVec<acc_t>* __restrict w_part) {
  constexpr int64_t L = sizeof(SimdVec<acc_t>) / sizeof(acc_t);
  const SimdVec<acc_t> zero = opaque(SimdVec<acc_t>{});
  for (int64_t j = 0; j < V; ++j) w_part[j] = zero;
  int64_t rb = 0;
  for (; rb + 2 * L <= Kp; rb += 2 * L) {
    recompute_rows<2>(src, dst, rb, V, ld, a, kv, f, u, pf, w_part);
  }
  if (rb < Kp) recompute_rows<1>(src, dst, rb, V, ld, a, kv, f, u, pf, w_part);
}

// w_part[j] = src_j * f per lane (the first recomputed token's P^T k, before the pipeline).
template <typename acc_t>
[[gnu::noinline]] void project_columns(const acc_t* __restrict src, int64_t Kp, int64_t V,
                                      int64_t ld, const acc_t* __restrict f,
                                      SimdVec<acc_t>* __restrict w_part) {
  using vec = SimdVec<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  const vec zero = opaque(vec{});
  for (int64_t j = 0; j < V; ++j) w_part[j] = zero;
  for (int64_t rb = 0; rb < Kp; rb += L) {
    const vec f8 = load_vec(f + rb);
    for (int64_t j = 0; j < V; ++j) w_part[j] += f8 * load_vec(src + j * ld + rb);
  }
}

// Reverse step of one token over all V columns, in one pass over the states. dS (column-
// major) holds dL/dS_t on entry and dL/dS_{t-1} on exit, both lazily scaled by one factor
// per key row like the forward's state: dS = diag(e) D. Per column j, with u_j = b vw_j:
//   o = S_t^T qs:         d = dS_j + qs go_j,  dq += go_j S_t[:, j]  (= diag(a) S_{t-1}
//                         go + k (u . go): the pass sums go_j S_{t-1}[:, j] only)
//   S_t = P + k u^T:      dk += u_j d,  du_j = d . k = dS_j . k + go_j (qs . k)
//   u = b (v - P^T k):    dv_j = b du_j, dbeta += du_j vw_j, dw_j = -b du_j
//   (w = P^T k)           dP_j = d + dw_j k,  dk += dw_j P_j
//   P = diag(a) S_{t-1}:  dg += dP * P (per channel),  dS_{t-1} = diag(a) dP
//                         (kChannelGate; RecurrentBackward sums it over the rows for one
//                         gate per head)
// In scaled terms (D = dS / e, e' = a e), every line is one FMA per element and the decay
// multiply disappears: d/e = D + (qs/e) go_j, dP/e = d/e + (k/e) dw_j, D_{t-1} = dP/e with
// e <- e'; dk = e (sum u_j d/e) + a (sum dw_j S_{t-1}), dg = a e (sum dP/e S_{t-1}).
// The column sums du_j need dS_j . k before the pass; they are pipelined: the pass for token
// t accumulates dS_{t-1} . k_{t-1} (z) from the values it writes. e is kept in [2^-20, 2^20]
// like the forward's c; a token that would leave it writes diag(e') dP/e and resets e = 1.
// Rows run in blocks of two vectors outside (dq, dk, dg of the rows stay in registers; the
// sums are added to dq..dg unless first, the first column block) and columns inside; the
// state's padding rows (up to ld) and the factors' stay zero. pf: the state the next token
// reads, prefetched.
template <typename acc_t>
struct ReverseRows {
  const acc_t *qe;   // qs / e
  const acc_t *ke;   // k / e
  const acc_t *kp;   // k_{t-1} e' (k_{t-1} when renormalizing; 0 at a sequence start)
  const acc_t *ren;  // e', the renormalizing step's row factors
};

// NR row blocks at once: the column scalars and z[j] are loaded once for them, and the
// NR sets of accumulators are independent FMA chains (one set alone waits on the FMA
// latency at every column).
template <int64_t NR, bool kRenorm, bool kChannelGate, typename acc_t>
inline void reverse_rows(const acc_t* __restrict Sp, acc_t* __restrict dS, int64_t rb,
                         int64_t V, int64_t ld, const ReverseRows<acc_t>& rows,
                         const acc_t* __restrict go, const acc_t* __restrict u,
                         const acc_t* __restrict dw, bool first, const acc_t* pf,
                         acc_t* __restrict dq, acc_t* __restrict dkA, acc_t* __restrict dkB,
                         acc_t* __restrict dg, SimdVec<acc_t>* __restrict z) {
  using vec = SimdVec<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  vec q8[NR], k8[NR], kp8[NR], ren8[NR], dq8[NR] = {}, dkA8[NR] = {}, dkB8[NR] = {},
      dg8[NR] = {};
  for (int64_t m = 0; m < NR; ++m) {
    q8[m] = load_vec(rows.qe + rb + m * L);
    k8[m] = load_vec(rows.ke + rb + m * L);
    kp8[m] = load_vec(rows.kp + rb + m * L);
    ren8[m] = kRenorm ? load_vec(rows.ren + rb + m * L) : vec{};
  }
  for (int64_t j = 0; j < V; ++j) {
    const acc_t goj = go[j], uj = u[j], dwj = dw[j];
    __builtin_prefetch(pf + j * ld + rb);
    vec zj = z[j];
    for (int64_t m = 0; m < NR; ++m) {
      const int64_t i = j * ld + rb + m * L;
      const vec s = load_vec(Sp + i);
      const vec d = load_vec(dS + i) + q8[m] * goj;
      dq8[m] += goj * s;
      dkA8[m] += uj * d;
      vec dP = d + k8[m] * dwj;
      dkB8[m] += dwj * s;
      if (kChannelGate) dg8[m] += dP * s;
      if (kRenorm) dP = ren8[m] * dP;
      store_vec(dS + i, dP);
      zj += dP * kp8[m];
    }
    z[j] = zj;
  }
  for (int64_t m = 0; m < NR; ++m) {
    const int64_t o = rb + m * L;
    if (first) {
      store_vec(dq + o, dq8[m]);
      store_vec(dkA + o, dkA8[m]);
      store_vec(dkB + o, dkB8[m]);
      if (kChannelGate) store_vec(dg + o, dg8[m]);
    } else {
      store_vec(dq + o, load_vec(dq + o) + dq8[m]);
      store_vec(dkA + o, load_vec(dkA + o) + dkA8[m]);
      store_vec(dkB + o, load_vec(dkB + o) + dkB8[m]);
      if (kChannelGate) store_vec(dg + o, load_vec(dg + o) + dg8[m]);
    }
  }
}

template <bool kRenorm, bool kChannelGate, typename acc_t>
[[gnu::noinline]] void reverse_step(const acc_t* __restrict Sp, acc_t* __restrict dS,
                                   int64_t Kp, int64_t V, int64_t ld,
                                   const ReverseRows<acc_t>& rows, const acc_t* __restrict go,
                                   const acc_t* __restrict u, const acc_t* __restrict dw,
                                   bool first, const acc_t* pf, acc_t* __restrict dq,
                                   acc_t* __restrict dkA, acc_t* __restrict dkB,
                                   acc_t* __restrict dg, SimdVec<acc_t>* __restrict z) {
  constexpr int64_t L = sizeof(SimdVec<acc_t>) / sizeof(acc_t);
  const SimdVec<acc_t> zero = opaque(SimdVec<acc_t>{});
  for (int64_t j = 0; j < V; ++j) z[j] = zero;
  int64_t rb = 0;
  for (; rb + 2 * L <= Kp; rb += 2 * L) {
    reverse_rows<2, kRenorm, kChannelGate>(Sp, dS, rb, V, ld, rows, go, u, dw, first, pf, dq,
                                           dkA, dkB, dg, z);
  }
  if (rb < Kp) {
    reverse_rows<1, kRenorm, kChannelGate>(Sp, dS, rb, V, ld, rows, go, u, dw, first, pf, dq,
                                           dkA, dkB, dg, z);
  }
}

// Columns of a backward block: a chunk's recomputed states of one block (C + 1 of them, 300
// KiB for K = 64) then stay in L2 next to the per-token rows, and a state next to the block's
// dS in L1. Measured on the 2-core EPYC (K = V = 64, 1 thread): 16 columns (4.5 KiB states)
// 12.2-13.3 ms, 8 columns 14.5-14.8, 24 columns 13.9-17.4, all 64 columns 15.4-16.8.
template <typename acc_t>
inline int64_t backward_block_columns(int64_t V, int64_t ld) {
  constexpr int64_t L = kVecLanes<acc_t>, kBlockBytes = 4608;
  const int64_t bv = kBlockBytes / (ld * int64_t(sizeof(acc_t))) / L * L;
  return std::min(V, std::max(L, bv));
}

}  // namespace
}  // namespace RLX_ISA_NS
}  // namespace rlx
