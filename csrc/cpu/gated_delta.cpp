// Gated delta rule on the CPU: token-by-token recurrence with float32 (float64) state.
//
// Per (sequence, value head hv), state S in R^{K x V}, q/k head h = hv / (HV / H):
//   P = diag(a_t) S_{t-1}, a_t = exp(g_t)      (one gate per head, or one per key channel)
//   w = P^T k_t,  u = beta_t (v_t - w),  S_t = P + k_t u^T,  o_t = scale S_t^T q_t
// Forward: parallel over (sequence, hv, group of V-blocks) -- the columns of S evolve
// independently -- and keeps S every C tokens in the checkpoint buffer
// (gdn_backward_layout.h).
// Backward: parallel over (sequence, q/k head); for each value head of the group it walks
// the chunks backwards, recomputes the chunk's states from its checkpoint (in sub-chunks
// when they are very large, see backward_kernel), and runs the reverse recurrence for dS
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
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__unix__)
#include <sys/mman.h>
#endif

#include "rlx/gdn_backward_layout.h"
#include "rlx/gdn_checks.h"
#include "huge_pages.h"
#include "l2norm_row.h"

namespace rlx {
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

// Raw pointers of one call; token index tok = b * T + t (the packed position when varlen).
template <typename in_t, typename acc_t>
struct Views {
  const in_t *q, *k, *v;
  const acc_t *g, *beta;
  const int64_t* cu;  // nullptr when not varlen
  acc_t scale;
  bool l2norm;  // q and k are L2-normalized inside the kernels (l2norm_row.h)
  acc_t l2norm_eps;
};

// Loads row (tok, head) of a [tokens, heads, dim] input as acc_t.
template <typename in_t, typename acc_t>
inline void load_row(const in_t* base, int64_t tok, int64_t heads, int64_t head, int64_t dim,
                     acc_t* out) {
  const in_t* src = base + (tok * heads + head) * dim;
  for (int64_t i = 0; i < dim; ++i) out[i] = static_cast<acc_t>(src[i]);
}

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

// Column-major [V, K] scratch with column stride ld -> row-major [K, V] state (see
// gather_columns below).
template <typename acc_t>
inline void scatter_columns(const acc_t* src, int64_t K, int64_t V, int64_t ld, acc_t* dst) {
  for (int64_t r = 0; r < K; ++r) {
    for (int64_t j = 0; j < V; ++j) dst[r * V + j] = src[j * ld + r];
  }
}

// Column stride of the backward's column-major scratch states: K rounded up to a vector,
// plus one vector when that is a multiple of 128 bytes. A power-of-two stride (K = 64, 128)
// maps the same rows of all V columns onto a few L1 sets, and the row-block sweeps then
// miss L1 on almost every access (the K = 128 backward ran 13x the forward's time).
template <typename acc_t>
inline int64_t padded_column_stride(int64_t K) {
  constexpr int64_t L = 32 / sizeof(acc_t);
  const int64_t ld = (K + L - 1) / L * L;
  return (ld * int64_t(sizeof(acc_t))) % 128 == 0 ? ld + L : ld;
}

// 256-bit vectors through the GCC/Clang vector extension (portable to NEON and AVX).
// Every function here has internal linkage, so the ABI note GCC gives for passing such
// vectors in a build without AVX (RLX_AVX2=0) does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
template <typename T>
struct VecOf;
template <>
struct VecOf<float> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct VecOf<double> {
  typedef double type __attribute__((vector_size(32)));
};
template <typename acc_t>
using Vec256 = typename VecOf<acc_t>::type;

template <typename acc_t>
inline Vec256<acc_t> load_vec(const acc_t* p) {
  Vec256<acc_t> x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
template <typename acc_t>
inline void store_vec(acc_t* p, const Vec256<acc_t>& x) {
  std::memcpy(p, &x, sizeof(x));
}

// x, hidden from the optimizer: GCC turns loops that only copy or zero a few hundred bytes
// (the backward's per-token gradient rows and column sums) into memmove/memset calls, ~3% of
// the backward in a profile. An empty asm on the value keeps them inline vector moves.
template <typename vec>
inline vec opaque(vec x) {
#if defined(__AVX__)
  asm("" : "+x"(x));
#endif
  return x;
}

// Row-major [K, V] state -> column-major [V, K] scratch with column stride ld >= K. Float
// states go through 8 x 8 tiles transposed in registers (the scalar loop's strided stores
// took 3% of the backward in a profile).
template <typename acc_t>
inline void gather_columns(const acc_t* __restrict src, int64_t K, int64_t V, int64_t ld,
                           acc_t* __restrict dst) {
  int64_t K8 = 0, V8 = 0;
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  if constexpr (std::is_same_v<acc_t, float>) {
    using vec = Vec256<float>;
    K8 = K / 8 * 8;
    V8 = V / 8 * 8;
    for (int64_t r0 = 0; r0 < K8; r0 += 8) {
      for (int64_t j0 = 0; j0 < V8; j0 += 8) {
        vec x[8], t[8], y[8];
        for (int64_t i = 0; i < 8; ++i) x[i] = load_vec(src + (r0 + i) * V + j0);
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
          store_vec(dst + (j0 + i) * ld + r0,
                    __builtin_shufflevector(y[i], y[i + 4], 0, 1, 2, 3, 8, 9, 10, 11));
          store_vec(dst + (j0 + i + 4) * ld + r0,
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

template <typename acc_t>
inline acc_t hsum(const Vec256<acc_t>& x) {
  constexpr int64_t L = sizeof(x) / sizeof(acc_t);
  acc_t s = 0;
  for (int64_t l = 0; l < L; ++l) s += x[l];
  return s;
}

// out[j] = the sum of x[j]'s lanes, j < n. Eight float vectors at a time are reduced by a
// transpose-and-add tree: 14 in-register shuffles and 7 adds for 8 sums, against ~15
// instructions per column for hsum (the backward reduces 2 V columns per token; in-process
// A/B, one thread: 4-8% faster by the minimum in three of four runs, equal in the fourth).
// Fixed order, so still reproducible.
template <typename acc_t>
inline void hsum_columns(const Vec256<acc_t>* __restrict x, int64_t n, acc_t* __restrict out) {
  int64_t j = 0;
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  if constexpr (std::is_same_v<acc_t, float>) {
    using vec = Vec256<float>;
    auto pair = [](const vec& a, const vec& b) {
      return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
             __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
    };
    auto quad = [](const vec& a, const vec& b) {
      return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
             __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
    };
    for (; j + 8 <= n; j += 8) {
      const vec t0 = quad(pair(x[j], x[j + 1]), pair(x[j + 2], x[j + 3]));
      const vec t1 = quad(pair(x[j + 4], x[j + 5]), pair(x[j + 6], x[j + 7]));
      store_vec(out + j, __builtin_shufflevector(t0, t1, 0, 1, 2, 3, 8, 9, 10, 11) +
                             __builtin_shufflevector(t0, t1, 4, 5, 6, 7, 12, 13, 14, 15));
    }
  }
#endif
  for (; j < n; ++j) out[j] = hsum<acc_t>(x[j]);
}

// out[i] = l2norm_rstd of the K-long row x + i * stride, i < n. Float rows of whole vectors
// are summed as vectors and reduced eight rows at a time by hsum_columns: a row at a time,
// the reduction and the square root are one dependent chain per row (~90 cycles; it made
// the fused l2norm slower than the separate op's pass over q and k).
template <typename in_t, typename acc_t>
inline void l2norm_rstd_rows(const in_t* x, int64_t stride, int64_t n, int64_t K, acc_t eps,
                             acc_t* out) {
  using vec = Vec256<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  if constexpr (std::is_same_v<in_t, acc_t>) {
    if (K % L == 0) {
      constexpr int64_t kRows = 64;
      vec part[kRows] = {};  // (zeroed: GCC cannot see that hsum_columns reads only [0, m))
      for (int64_t i0 = 0; i0 < n; i0 += kRows) {
        const int64_t m = std::min(kRows, n - i0);
        for (int64_t i = 0; i < m; ++i) {
          const acc_t* r = x + (i0 + i) * stride;
          vec s0 = {}, s1 = {};
          int64_t d = 0;
          for (; d + 2 * L <= K; d += 2 * L) {
            const vec a = load_vec(r + d), b = load_vec(r + d + L);
            s0 += a * a;
            s1 += b * b;
          }
          if (d < K) {
            const vec a = load_vec(r + d);
            s0 += a * a;
          }
          part[i] = s0 + s1;
        }
        hsum_columns(part, m, out + i0);
      }
      for (int64_t i = 0; i < n; ++i) out[i] = acc_t(1) / std::sqrt(out[i] + eps);
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) out[i] = l2norm_rstd<acc_t>(x + i * stride, K, eps);
}

// dy <- r (dy - x r^2 (x . dy)): l2norm's backward (l2norm_row.h) on an acc_t row, in place.
// Float rows of whole vectors in vector registers: with the generic row_dot (a dependent
// chain per lane, then a scalar sum) the two rows per token took 7% of the backward.
template <typename in_t, typename acc_t>
inline void l2norm_backward_inplace(const in_t* x, acc_t r, int64_t K, acc_t* dy) {
  using vec = Vec256<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  if constexpr (std::is_same_v<in_t, acc_t>) {
    if (K % L == 0) {
      vec s0 = {}, s1 = {};
      int64_t d = 0;
      for (; d + 2 * L <= K; d += 2 * L) {
        s0 += load_vec(x + d) * load_vec(dy + d);
        s1 += load_vec(x + d + L) * load_vec(dy + d + L);
      }
      if (d < K) s0 += load_vec(x + d) * load_vec(dy + d);
      const acc_t c = r * r * hsum<acc_t>(s0 + s1);
      for (d = 0; d < K; d += L) store_vec(dy + d, r * (load_vec(dy + d) - load_vec(x + d) * c));
      return;
    }
  }
  const acc_t c = r * r * row_dot<acc_t>(x, dy, K);
  for (int64_t d = 0; d < K; ++d) dy[d] = r * (dy[d] - static_cast<acc_t>(x[d]) * c);
}

// Rows of consecutive tokens lie H*K (HV*V) elements apart, often a page or more: the
// hardware prefetchers do not follow that stride, and each token then waits on a few cache
// misses (~1/3 of the K = V = 128 forward's time). Prefetching a few tokens ahead hides them.
constexpr int64_t kPrefetchTokens = 4;
constexpr int64_t kRowPrefetchTokens = 16;  // for loops that do O(K) work per token
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

inline void prefetch_rows_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

// Forward, one pass over the state per token. The state block is kept lazily decayed,
// S = diag(c) St (c: one factor per key row), so that a token costs three FMAs per state
// element instead of a multiply and three FMAs:
//   P = diag(a) S = diag(a c) St;  with c' = a c:  S_t = diag(c') (St + diag(1/c') k u^T)
//   so  St <- St + kk u^T, kk = k / c'   (no multiply by the decay)
//       o_t = scale S_t^T q = St^T (scale c' q)
// c' is kept in [2^-20, 2^20], where 1/c' and the rescaled St stay far from
// overflow/underflow; a token that would leave it (a strong decay: g = -30 does on every
// token, the usual decays every ~100) renormalizes instead, St <- diag(a c) St + k u^T, c = 1,
// which is the plain recurrence. Software pipelining: while a row of S_t is written, the
// next token's w = P_{t+1}^T k_{t+1} = St^T (a_{t+1} c' k_{t+1}) accumulates from it, so
// each token streams the state block once.
// With one gate per head the factors are scalars times the q/k rows: the rows are then
// used as they are and the scalars applied to u, o and w instead (raw_rows below).
template <typename acc_t>
struct TokenCoeffs {
  const acc_t *alpha;  // a c, the renormalizing step's row factors
  const acc_t *kk;     // k / c' (k when renormalizing)
  const acc_t *qq;     // scale c' q
  const acc_t *ff;     // next token's a c' k (zero after the last token)
};

// NV vectors of columns; x = St row after the update.
template <int64_t NV, bool kRenorm, typename acc_t>
inline void fused_rows_block(acc_t* __restrict S, int64_t K, int64_t ld,
                             const TokenCoeffs<acc_t>& cf, const acc_t* __restrict u,
                             acc_t* __restrict o, acc_t* __restrict w) {
  using vec = Vec256<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  vec uu[NV], out[NV], wn[NV];
  for (int64_t n = 0; n < NV; ++n) {
    uu[n] = load_vec(u + n * L);
    out[n] = wn[n] = vec{};
  }
  for (int64_t r = 0; r < K; ++r) {
    acc_t* s = S + r * ld;
    const acc_t kr = cf.kk[r], qr = cf.qq[r], fr = cf.ff[r];
    for (int64_t n = 0; n < NV; ++n) {
      const vec old = load_vec(s + n * L);
      const vec x = (kRenorm ? cf.alpha[r] * old : old) + kr * uu[n];
      store_vec(s + n * L, x);
      out[n] += qr * x;
      wn[n] += fr * x;
    }
  }
  // Stored vector by vector: a memcpy of the arrays made GCC keep them in memory, zeroed by
  // two `rep stos` per call (4% of the forward in a profile).
  for (int64_t n = 0; n < NV; ++n) {
    store_vec(o + n * L, out[n]);
    store_vec(w + n * L, wn[n]);
  }
}

// Tail columns (fewer than one vector), one at a time, with the same arithmetic per column.
template <bool kRenorm, typename acc_t>
inline void fused_rows_column(acc_t* S, int64_t K, int64_t ld, const TokenCoeffs<acc_t>& cf,
                              acc_t uj, acc_t* o, acc_t* w) {
  acc_t out = 0, wn = 0;
  for (int64_t r = 0; r < K; ++r) {
    const acc_t x = (kRenorm ? cf.alpha[r] * S[r * ld] : S[r * ld]) + cf.kk[r] * uj;
    S[r * ld] = x;
    out += cf.qq[r] * x;
    wn += cf.ff[r] * x;
  }
  *o = out;
  *w = wn;
}

template <bool kRenorm, typename acc_t>
inline void fused_rows(acc_t* S, int64_t K, int64_t nv, const TokenCoeffs<acc_t>& cf,
                       const acc_t* u, acc_t* o, acc_t* w) {
  constexpr int64_t L = 32 / sizeof(acc_t);
  int64_t j = 0;
  for (; j + 4 * L <= nv; j += 4 * L) {
    fused_rows_block<4, kRenorm>(S + j, K, nv, cf, u + j, o + j, w + j);
  }
  for (; j + 2 * L <= nv; j += 2 * L) {
    fused_rows_block<2, kRenorm>(S + j, K, nv, cf, u + j, o + j, w + j);
  }
  for (; j + L <= nv; j += L) fused_rows_block<1, kRenorm>(S + j, K, nv, cf, u + j, o + j, w + j);
  for (; j < nv; ++j) fused_rows_column<kRenorm>(S + j, K, nv, cf, u[j], o + j, w + j);
}

// w = S^T f over nv columns of a row-major block: the first token's w, before the pipeline.
template <typename acc_t>
inline void project_rows(const acc_t* S, int64_t K, int64_t nv, const acc_t* f, acc_t* w) {
  std::fill(w, w + nv, acc_t(0));
  for (int64_t r = 0; r < K; ++r) {
    for (int64_t j = 0; j < nv; ++j) w[j] += f[r] * S[r * nv + j];
  }
}

template <typename in_t, typename acc_t>
void forward_kernel(const GdnProblem& p, const Views<in_t, acc_t>& in, const acc_t* h0,
                    in_t* out, acc_t* ht, acc_t* ckpt) {
  // With in.l2norm, q and k rows are normalized on the fly: their factors r (one per row, see
  // l2norm_row.h) join the per-token factors below (rqs, rks).
  auto rk = [&](int64_t tok, int64_t h) {
    return in.l2norm ? l2norm_rstd<acc_t>(in.k + (tok * p.num_qk_heads + h) * p.head_k_dim,
                                          p.head_k_dim, in.l2norm_eps)
                     : acc_t(1);
  };
  const int64_t K = p.head_k_dim, V = p.head_v_dim, H = p.num_qk_heads, HV = p.num_v_heads;
  const int64_t C = p.chunk, heads = p.num_seqs * HV;
  const int64_t threads = at::get_num_threads();
  // Column blocks of at most 16 KiB keep the state block in L1 (32 KiB here) next to the
  // token's row factors, and give every thread work. (Before the row factors were shared by
  // the blocks of a group, 32 KiB blocks were ~15% faster for K = V = 128; now both tie.)
  const int64_t block_bytes = 16384;
  int64_t BV = V;
  auto tasks_for = [&](int64_t bv) { return heads * ((V + bv - 1) / bv); };
  while (BV > 16 &&
         (K * BV * int64_t(sizeof(acc_t)) > block_bytes || tasks_for(BV) < 2 * threads)) {
    BV = (BV / 2 + 7) / 8 * 8;
  }
  const int64_t nvb = (V + BV - 1) / BV;
  // A task runs a group of a head's column blocks over chunks of TC tokens: the per-token
  // row factors (and the strided q/k rows they come from) are computed once per chunk and
  // then read by every block of the group. Groups split a head only when there are fewer
  // heads than twice the threads.
  if (heads == 0) return;
  const int64_t wanted = std::clamp<int64_t>((2 * threads + heads - 1) / heads, 1, nvb);
  const int64_t bpg = (nvb + wanted - 1) / wanted;  // blocks per group
  const int64_t groups = (nvb + bpg - 1) / bpg;     // none of them empty
  constexpr int64_t TC = 32;
  const acc_t lo = std::ldexp(acc_t(1), -20), hi = std::ldexp(acc_t(1), 20);
  at::parallel_for(0, heads * groups, 1, [&](int64_t begin, int64_t end) {
    AccVec<acc_t> S(bpg * K * BV), W(bpg * BV), c(K), a(K), u(BV), o(BV);
    // Per token of a chunk: TokenCoeffs' rows, and c before the token (checkpoints).
    AccVec<acc_t> alpha(TC * K), kk(TC * K), qq(TC * K), ff(TC * K), cb(TC * K);
    bool renorm[TC];
    // raw_rows (one gate per head, float32/64 inputs): the q and k rows of the inputs serve
    // as TokenCoeffs' kk, qq and ff as they are, and their scalar factors go to the V-long
    // vectors instead: u by tus = 1/c', o by tqs = scale c', w by tfs = a c'. Only the rare
    // rows of alpha (renormalizing tokens) and cb (checkpoint tokens) are written. This skips
    // writing four K-long rows per token, whose q/k loads were also the forward's main misses
    // (in-process A/B of the forward, 1 thread, B=1 T=2048 H=4 K=V=64: min 2.89 -> 2.69 ms
    // on top of fused_rows_block's vector stores, 3.13 -> 2.81 ms with them).
    const bool raw_rows = std::is_same_v<in_t, acc_t> && !p.gate_per_channel;
    acc_t tus[TC], tqs[TC], tfs[TC];
    // The chunk's l2norm factors (rks[i] of token t0 + i, one more for the next token).
    acc_t rqs[TC], rks[TC + 1];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t grp = task % groups, hv = (task / groups) % HV, n = task / (groups * HV);
      const int64_t h = hv / p.group(), vb0 = grp * bpg, vb1 = std::min(nvb, vb0 + bpg);
      int64_t bos, eos;
      gdn_sequence_bounds(p, in.cu, n, &bos, &eos);
      const int64_t base = gdn_checkpoint_base(n, bos, C);
      auto block_cols = [&](int64_t vb, int64_t* v0, int64_t* nv) {
        *v0 = vb * BV;
        *nv = std::min(BV, V - *v0);
      };
      // Each block's S is [K, nv] row-major; states outside are [K, V].
      for (int64_t vb = vb0; vb < vb1; ++vb) {
        int64_t v0, nv;
        block_cols(vb, &v0, &nv);
        acc_t* Sb = &S[(vb - vb0) * K * BV];
        for (int64_t r = 0; r < K; ++r) {
          for (int64_t j = 0; j < nv; ++j) {
            Sb[r * nv + j] = h0 ? h0[((n * HV + hv) * K + r) * V + v0 + j] : acc_t(0);
          }
        }
      }
      // c: one factor per key row for a per-channel gate, the scalar c0 for a per-head one.
      std::fill(c.begin(), c.end(), acc_t(1));
      acc_t c0 = 1, a0 = 1;  // a0: the per-head gate's a of the next token
      auto store_state = [&](const acc_t* Sb, const acc_t* cr, int64_t v0, int64_t nv,
                             acc_t* dst) {  // S = diag(c) St
        for (int64_t r = 0; r < K; ++r) {
          for (int64_t j = 0; j < nv; ++j) dst[r * V + v0 + j] = cr[r] * Sb[r * nv + j];
        }
      };
      // ff = a_tok c k_tok, the factors of w_tok = P^T k_tok (a: the next token's decays).
      // r: k_tok's l2norm factor (1 without l2norm).
      auto next_factors = [&](int64_t tok, acc_t* f, acc_t r) {
        const in_t* kt = in.k + (tok * H + h) * K;
        if (p.gate_per_channel) {
          load_decay(p, in.g, tok, hv, a.data());
          for (int64_t j = 0; j < K; ++j) f[j] = a[j] * c[j] * r * static_cast<acc_t>(kt[j]);
        } else {
          a0 = std::exp(in.g[tok * HV + hv]);
          const acc_t fs = a0 * c0 * r;
          for (int64_t j = 0; j < K; ++j) f[j] = fs * static_cast<acc_t>(kt[j]);
        }
      };
      if (bos < eos) {
        next_factors(bos, ff.data(), rk(bos, h));
        for (int64_t vb = vb0; vb < vb1; ++vb) {
          int64_t v0, nv;
          block_cols(vb, &v0, &nv);
          project_rows(&S[(vb - vb0) * K * BV], K, nv, ff.data(), &W[(vb - vb0) * BV]);
        }
      }
      for (int64_t t0 = bos; t0 < eos; t0 += TC) {
        const int64_t len = std::min(TC, eos - t0);
        if (in.l2norm) {
          l2norm_rstd_rows(in.q + (t0 * H + h) * K, H * K, len, K, in.l2norm_eps, rqs);
          l2norm_rstd_rows(in.k + (t0 * H + h) * K, H * K, std::min(len + 1, eos - t0), K,
                           in.l2norm_eps, rks);
        }
        // Row factors of the chunk's tokens (the decays of tok, a and a0, come from the
        // previous token's next_factors).
        for (int64_t i = 0; i < len; ++i) {
          const int64_t tok = t0 + i;
          if (!raw_rows && tok + kPrefetchTokens < eos) {
            const int64_t tp = tok + kPrefetchTokens;
            prefetch_bytes(in.k + (tp * H + h) * K, K * sizeof(in_t));
            prefetch_bytes(in.q + (tp * H + h) * K, K * sizeof(in_t));
          }
          acc_t *al = &alpha[i * K], *kki = &kk[i * K], *qqi = &qq[i * K], *cbi = &cb[i * K];
          if (raw_rows) {
            if (C > 0 && (tok - bos) % C == 0) std::fill(cbi, cbi + K, c0);
            const acc_t cn = a0 * c0;
            renorm[i] = !(cn >= lo && cn <= hi);
            if (renorm[i]) std::fill(al, al + K, cn);
            c0 = renorm[i] ? acc_t(1) : cn;
            const bool l2 = in.l2norm;
            tus[i] = (l2 ? rks[i] : acc_t(1)) / c0;
            tqs[i] = in.scale * c0 * (l2 ? rqs[i] : acc_t(1));
            a0 = tok + 1 < eos ? std::exp(in.g[(tok + 1) * HV + hv]) : acc_t(0);
            tfs[i] = tok + 1 < eos ? a0 * c0 * (l2 ? rks[i + 1] : acc_t(1)) : acc_t(0);
            continue;
          }
          const in_t* kt = in.k + (tok * H + h) * K;
          const in_t* qt = in.q + (tok * H + h) * K;
          const acc_t rkt = in.l2norm ? rks[i] : acc_t(1), rqt = in.l2norm ? rqs[i] : acc_t(1);
          if (p.gate_per_channel) {
            std::copy(c.begin(), c.end(), cbi);
            int bad = 0;
            for (int64_t r = 0; r < K; ++r) {
              al[r] = a[r] * c[r];
              bad |= !(al[r] >= lo && al[r] <= hi);  // also catches NaN
            }
            renorm[i] = bad != 0;
            for (int64_t r = 0; r < K; ++r) {
              const acc_t kr = rkt * static_cast<acc_t>(kt[r]);
              c[r] = renorm[i] ? acc_t(1) : al[r];
              kki[r] = renorm[i] ? kr : kr / c[r];
              qqi[r] = in.scale * c[r] * rqt * static_cast<acc_t>(qt[r]);
            }
          } else {
            std::fill(cbi, cbi + K, c0);
            const acc_t cn = a0 * c0;
            renorm[i] = !(cn >= lo && cn <= hi);
            if (renorm[i]) std::fill(al, al + K, cn);
            c0 = renorm[i] ? acc_t(1) : cn;
            const acc_t inv = rkt / c0, qs = in.scale * c0 * rqt;
            for (int64_t r = 0; r < K; ++r) {
              kki[r] = inv * static_cast<acc_t>(kt[r]);
              qqi[r] = qs * static_cast<acc_t>(qt[r]);
            }
          }
          if (tok + 1 < eos) {
            next_factors(tok + 1, &ff[i * K], in.l2norm ? rks[i + 1] : acc_t(1));
          } else {
            std::fill(&ff[i * K], &ff[i * K] + K, acc_t(0));
          }
        }
        for (int64_t vb = vb0; vb < vb1; ++vb) {
          int64_t v0, nv;
          block_cols(vb, &v0, &nv);
          acc_t *Sb = &S[(vb - vb0) * K * BV], *w = &W[(vb - vb0) * BV];
          for (int64_t i = 0; i < len; ++i) {
            const int64_t tok = t0 + i;
            if (C > 0 && (tok - bos) % C == 0) {
              store_state(Sb, &cb[i * K], v0, nv,
                          ckpt + ((base + (tok - bos) / C) * HV + hv) * K * V);
            }
            if (i + kPrefetchTokens < len) {
              const int64_t tp = tok + kPrefetchTokens;
              prefetch_bytes(in.v + (tp * HV + hv) * V + v0, nv * sizeof(in_t));
              prefetch_bytes(out + (tp * HV + hv) * V + v0, nv * sizeof(in_t));
            }
            TokenCoeffs<acc_t> cf{&alpha[i * K], &kk[i * K], &qq[i * K], &ff[i * K]};
            acc_t b = in.beta[tok * HV + hv], os = 1, ws = 1;
            if (raw_rows) {
              if constexpr (std::is_same_v<in_t, acc_t>) {
                const acc_t* krow = in.k + (tok * H + h) * K;
                cf.kk = krow;
                cf.qq = in.q + (tok * H + h) * K;
                cf.ff = tok + 1 < eos ? krow + H * K : krow;  // tfs = 0 after the last token
                if (tok + kPrefetchTokens < eos) {
                  prefetch_bytes(krow + kPrefetchTokens * H * K, K * sizeof(in_t));
                  prefetch_bytes(cf.qq + kPrefetchTokens * H * K, K * sizeof(in_t));
                }
              }
              b *= tus[i];
              os = tqs[i];
              ws = tfs[i];
            }
            const in_t* vt = in.v + (tok * HV + hv) * V + v0;
            for (int64_t j = 0; j < nv; ++j) u[j] = b * (static_cast<acc_t>(vt[j]) - w[j]);
            if (renorm[i]) {
              fused_rows<true>(Sb, K, nv, cf, u.data(), o.data(), w);
            } else {
              fused_rows<false>(Sb, K, nv, cf, u.data(), o.data(), w);
            }
            in_t* odst = out + (tok * HV + hv) * V + v0;
            if (raw_rows) {
              for (int64_t j = 0; j < nv; ++j) {
                odst[j] = static_cast<in_t>(os * o[j]);
                w[j] *= ws;
              }
            } else {
              for (int64_t j = 0; j < nv; ++j) odst[j] = static_cast<in_t>(o[j]);
            }
          }
        }
      }
      // The final state: c after the last token.
      if (!p.gate_per_channel) std::fill(c.begin(), c.end(), c0);
      for (int64_t vb = vb0; vb < vb1; ++vb) {
        int64_t v0, nv;
        block_cols(vb, &v0, &nv);
        store_state(&S[(vb - vb0) * K * BV], c.data(), v0, nv, ht + (n * HV + hv) * K * V);
      }
    }
  });
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
                           Vec256<acc_t>* __restrict w_part) {
  using vec = Vec256<acc_t>;
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

template <typename acc_t>
inline void recompute_step(const acc_t* __restrict src, acc_t* __restrict dst, int64_t Kp,
                           int64_t V, int64_t ld, const acc_t* __restrict a,
                           const acc_t* __restrict kv, const acc_t* __restrict f,
                           const acc_t* __restrict u, const acc_t* pf,
                           Vec256<acc_t>* __restrict w_part) {
  constexpr int64_t L = sizeof(Vec256<acc_t>) / sizeof(acc_t);
  const Vec256<acc_t> zero = opaque(Vec256<acc_t>{});
  for (int64_t j = 0; j < V; ++j) w_part[j] = zero;
  int64_t rb = 0;
  for (; rb + 2 * L <= Kp; rb += 2 * L) {
    recompute_rows<2>(src, dst, rb, V, ld, a, kv, f, u, pf, w_part);
  }
  if (rb < Kp) recompute_rows<1>(src, dst, rb, V, ld, a, kv, f, u, pf, w_part);
}

// w_part[j] = src_j * f per lane (the first recomputed token's P^T k, before the pipeline).
template <typename acc_t>
inline void project_columns(const acc_t* __restrict src, int64_t Kp, int64_t V, int64_t ld,
                            const acc_t* __restrict f, Vec256<acc_t>* __restrict w_part) {
  using vec = Vec256<acc_t>;
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
//                         (kChannelGate; one gate per head gets dg without this FMA, from
//                         a recursion over tokens: see backward_kernel)
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
                         acc_t* __restrict dg, Vec256<acc_t>* __restrict z) {
  using vec = Vec256<acc_t>;
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
inline void reverse_step(const acc_t* __restrict Sp, acc_t* __restrict dS, int64_t Kp,
                         int64_t V, int64_t ld, const ReverseRows<acc_t>& rows,
                         const acc_t* __restrict go, const acc_t* __restrict u,
                         const acc_t* __restrict dw, bool first, const acc_t* pf,
                         acc_t* __restrict dq, acc_t* __restrict dkA, acc_t* __restrict dkB,
                         acc_t* __restrict dg, Vec256<acc_t>* __restrict z) {
  constexpr int64_t L = sizeof(Vec256<acc_t>) / sizeof(acc_t);
  const Vec256<acc_t> zero = opaque(Vec256<acc_t>{});
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
  constexpr int64_t L = 32 / sizeof(acc_t), kBlockBytes = 4608;
  const int64_t bv = kBlockBytes / (ld * int64_t(sizeof(acc_t))) / L * L;
  return std::min(V, std::max(L, bv));
}

// dst[0, n) = src, or += src, in vector moves (see opaque).
template <bool kAdd, typename acc_t>
inline void put_row(acc_t* __restrict dst, const acc_t* __restrict src, int64_t n) {
  constexpr int64_t L = 32 / sizeof(acc_t);
  int64_t r = 0;
  for (; r + L <= n; r += L) {
    store_vec(dst + r, kAdd ? load_vec(dst + r) + load_vec(src + r) : opaque(load_vec(src + r)));
  }
  for (; r < n; ++r) dst[r] = kAdd ? dst[r] + src[r] : src[r];
}

// Per-thread scratch kept across calls (grown when too small), in 2 MiB-aligned blocks
// advised for transparent huge pages.
inline void* huge_scratch(size_t bytes) {
  struct Buf {
    void* p = nullptr;
    size_t n = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf buf;
  if (buf.n < bytes) {
    std::free(buf.p);
    constexpr size_t kHuge = size_t(2) << 20;
    const size_t n = (bytes + kHuge - 1) / kHuge * kHuge;
    buf.p = std::aligned_alloc(kHuge, n);
    TORCH_CHECK(buf.p != nullptr, "rlx::gated_delta_bwd: out of memory for ", n, " bytes");
#ifdef MADV_HUGEPAGE
    madvise(buf.p, n, MADV_HUGEPAGE);
#endif
    buf.n = n;
  }
  return buf.p;
}

template <typename in_t, typename acc_t>
void backward_kernel(const GdnProblem& p, const Views<in_t, acc_t>& in, const acc_t* ckpt,
                     const in_t* grad_o, const acc_t* grad_ht, const GdnBackwardLayout& lay,
                     acc_t* buf) {
  const int64_t K = p.head_k_dim, V = p.head_v_dim, H = p.num_qk_heads, HV = p.num_v_heads;
  const int64_t C = p.chunk, KV = K * V, G = p.group();
  constexpr int64_t L = 32 / sizeof(acc_t);
  // Scratch states are column-major with a padded column stride; SV values each, BS for the
  // BV columns of a block.
  const int64_t ld = padded_column_stride<acc_t>(K), SV = V * ld, Kp = (K + L - 1) / L * L;
  const int64_t BV = backward_block_columns<acc_t>(V, ld), BS = BV * ld;
  acc_t *dq = buf + lay.dq.offset, *dk = buf + lay.dk.offset, *dv = buf + lay.dv.offset;
  acc_t *dg = buf + lay.dg.offset, *dbeta = buf + lay.dbeta.offset;
  acc_t* dstate = p.has_initial_state ? buf + lay.dstate.offset : nullptr;
  const acc_t lo = std::ldexp(acc_t(1), -20), hi = std::ldexp(acc_t(1), 20);
  using vec = Vec256<acc_t>;
  using ivec = decltype(vec{} < vec{});  // comparison masks
  // Sub-chunk length: a block's states and the per-token rows take at most 8 MiB (only very
  // large states or chunks are split; see the two-level recomputation below).
  // Kp-long rows kept per token of a sub-chunk (see rowbuf).
  enum : int64_t { kA, kK, kAK, kQE, kKE, kKP, kRen, kE, kDQ, kDKA, kDKB, kDG, kTokenRows };
  const int64_t Cs = std::clamp<int64_t>(
      (int64_t(8) << 20) / ((BS + kTokenRows * Kp) * int64_t(sizeof(acc_t))), 1, C);
  // One task per (sequence, q/k head): the value heads of its group run in order and sum
  // into the same dq/dk rows, so no two threads write the same gradient.
  // Threads take tasks in turn (a task's results do not depend on the thread that runs
  // it): with a few long tasks, a static split leaves every thread waiting on one that is
  // slowed down, e.g. by another process on its core.
  const int64_t tasks = p.num_seqs * H;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    // Two levels of recomputation bound the scratch: a chunk is first walked forward from
    // its checkpoint keeping only the state at every sub-chunk start (subs); then each
    // sub-chunk, last first, recomputes its states (states[i] = S before its token i) block
    // by block and runs the reverse recurrence of the block over them. With Cs = C (the
    // usual case) the first walk does nothing.
    const int64_t nsubs = gdn_num_chunks(C, Cs);
    AccVec<acc_t> subs(nsubs * SV), vws(Cs * BV);
    // The states, rowbuf and dS, the scratch the inner loops stream, in per-thread transparent
    // huge pages (every element read is written first). dS starts on a 4 KiB boundary like
    // the states: the reverse pass then reads state i at a multiple of 512 bytes from dS
    // modulo 4 KiB (K = 64), which none of the few dS columns stored just before matches.
    // The likely gain: no load waits on a store it only seems to overlap (4 KiB aliasing;
    // there are no hardware counters on this VM to confirm it). Backward q25 / min in ms,
    // dS in the heap -> here, alternating in one process: two threads 5.70 / 5.55 -> 5.38 /
    // 5.30 and 5.81 / 5.65 -> 5.73 / 5.22, one thread 10.61 / 10.29 -> 10.49 / 10.10 and
    // 10.51 / 10.24 -> 10.23 / 10.05 (medians swing more either way); 2304 bytes past a
    // boundary was slower than on it (median 11.30 vs 10.75, one thread).
    const int64_t rows_end = (Cs + 1) * BS + (Cs + 1) * kTokenRows * Kp;
    constexpr int64_t kPage = 4096 / sizeof(acc_t);
    const int64_t dS_offset = (rows_end + kPage - 1) / kPage * kPage;
    acc_t* const scratch =
        static_cast<acc_t*>(huge_scratch((dS_offset + SV) * sizeof(acc_t)));
    acc_t* const states = scratch;
    // Per token of a sub-chunk, shared by its blocks: the recompute's rows (decays a, key k,
    // a k; one extra zero row of a k ends the pipeline), ReverseRows' rows and e before the
    // token, and the sums over the blocks of dq, dk, dg partials (sdq..sdg), du . vw, go . u.
    // A token's rows lie together: as separate arrays their rows of one token would fall in
    // the same L1 sets (the arrays are a multiple of 4 KiB apart).
    acc_t* const rowbuf = scratch + (Cs + 1) * BS;
    acc_t* const dS = scratch + dS_offset;
    AccVec<acc_t> tqk(Cs), tb(Cs), sdb(Cs), sgu(Cs), sdv(Cs), tqdq(Cs);
    auto row = [&](int64_t which, int64_t i) { return &rowbuf[(i * kTokenRows + which) * Kp]; };
    std::vector<char> trenorm(Cs);
    acc_t sphi = 0;  // <dS, S> at the end of the sub-chunk (one gate per head)
    // in.l2norm: the factors r of the q and k rows of each token (1 without l2norm), and of
    // the k row before it; the rows are scaled as they are loaded.
    AccVec<acc_t> trq(Cs), trk(Cs);
    auto rk = [&](int64_t tok, int64_t h) {
      return in.l2norm ? l2norm_rstd<acc_t>(in.k + (tok * H + h) * K, K, in.l2norm_eps)
                       : acc_t(1);
    };
    auto scale_row = [&](acc_t r, acc_t* x) {  // (x: a scratch row of Kp, whole vectors)
      if (r != acc_t(1)) {
        for (int64_t j = 0; j < Kp; j += L) store_vec(x + j, r * load_vec(x + j));
      }
    };
    AccVec<acc_t> e(Kp), kv(Kp), qs(Kp), kprev(Kp), go(BV), u(BV), dw(BV), w(BV), z(V);
    AccVec<acc_t> dqt(Kp), dkt(Kp), dgt(Kp);
    std::vector<Vec256<acc_t>> zpart(BV), vqdq(Cs);
    // Row factors of tokens [t0, t0 + len) for the recompute.
    auto forward_rows = [&](int64_t t0, int64_t len, int64_t h, int64_t hv) {
      if (in.l2norm) {
        l2norm_rstd_rows(in.k + (t0 * H + h) * K, H * K, len, K, in.l2norm_eps, trk.data());
      } else {
        std::fill(trk.begin(), trk.begin() + len, acc_t(1));
      }
      for (int64_t i = 0; i < len; ++i) {
        const int64_t tok = t0 + i;
        if (i + kRowPrefetchTokens < len) {  // little work per row: fetch further ahead
          prefetch_bytes(in.k + ((tok + kRowPrefetchTokens) * H + h) * K, K * sizeof(in_t));
        }
        acc_t *a = row(kA, i), *kr = row(kK, i), *ak = row(kAK, i);
        load_decay(p, in.g, tok, hv, a);
        load_row(in.k, tok, H, h, K, kr);
        scale_row(trk[i], kr);
        for (int64_t r = K; r < Kp; ++r) {  // padding rows: a = 1, k = 0
          a[r] = 1;
          kr[r] = 0;
        }
        for (int64_t r = 0; r < Kp; ++r) ak[r] = a[r] * kr[r];
        tb[i] = in.beta[tok * HV + hv];
      }
      std::fill(row(kAK, len), row(kAK, len) + Kp, acc_t(0));
    };
    // ReverseRows of tokens [t0, t0 + len), last first, advancing e (vectors over the padded
    // rows: a = e = ren = 1 and q = k = 0 there, so padding rows stay zero and never trigger
    // a renormalization).
    auto reverse_rows_of = [&](int64_t t0, int64_t len, int64_t h, int64_t bos) {
      if (in.l2norm) {
        l2norm_rstd_rows(in.q + (t0 * H + h) * K, H * K, len, K, in.l2norm_eps, trq.data());
      } else {
        std::fill(trq.begin(), trq.begin() + len, acc_t(1));
      }
      for (int64_t i = len - 1; i >= 0; --i) {
        const int64_t tok = t0 + i;
        if (tok - kPrefetchTokens >= bos) {
          const int64_t tp = tok - kPrefetchTokens;
          prefetch_bytes(in.q + (tp * H + h) * K, K * sizeof(in_t));
          prefetch_bytes(in.k + (tp * H + h) * K, K * sizeof(in_t));
        }
        load_row(in.q, tok, H, h, K, qs.data());
        scale_row(trq[i], qs.data());
        // k_{t-1}: the sub-chunk's row from forward_rows, or the token before it.
        const acc_t* kp_row = row(kK, std::max<int64_t>(i - 1, 0));
        if (i == 0 && tok > bos) {
          load_row(in.k, tok - 1, H, h, K, kprev.data());
          scale_row(rk(tok - 1, h), kprev.data());
          kp_row = kprev.data();
        }
        const acc_t *a = row(kA, i), *kr = row(kK, i);
        acc_t *qe = row(kQE, i), *ke = row(kKE, i), *ren = row(kRen, i);
        vec qk8 = {};
        ivec ok8 = ~ivec{};
        for (int64_t rb = 0; rb < Kp; rb += L) {
          const vec e8 = load_vec(&e[rb]), en8 = load_vec(a + rb) * e8;
          const vec inv8 = acc_t(1) / e8, q8 = in.scale * load_vec(&qs[rb]);
          const vec k8 = load_vec(kr + rb);
          qk8 += q8 * k8;
          store_vec(qe + rb, q8 * inv8);
          store_vec(ke + rb, k8 * inv8);
          store_vec(ren + rb, en8);
          ok8 &= (en8 >= lo) & (en8 <= hi);  // false for NaN too
        }
        bool renorm = false;
        for (int64_t l = 0; l < L; ++l) renorm |= ok8[l] == 0;
        trenorm[i] = renorm;
        tqk[i] = hsum<acc_t>(qk8);
        for (int64_t rb = 0; rb < Kp; rb += L) {
          const vec k8 = tok > bos ? load_vec(kp_row + rb) : vec{};
          const vec ren8 = load_vec(ren + rb);
          store_vec(row(kKP, i) + rb, renorm ? k8 : k8 * ren8);
          store_vec(row(kE, i) + rb, load_vec(&e[rb]));
          store_vec(&e[rb], renorm ? vec{} + acc_t(1) : ren8);
        }
      }
    };
    // The block's state before token i of the sub-chunk: the first one is read where it
    // lies (in subs, same column-major layout), the others are recomputed into states.
    const acc_t* state0 = nullptr;
    auto state = [&](int64_t i) { return i == 0 ? state0 : &states[i * BS]; };
    // Recomputes tokens [t0, t0 + len) on columns [v0, v0 + nv) from state(0), filling
    // states[1..len] and vws.
    auto recompute = [&](int64_t t0, int64_t len, int64_t hv, int64_t v0, int64_t nv) {
      project_columns(state(0), Kp, nv, ld, row(kAK, 0), zpart.data());
      hsum_columns(zpart.data(), nv, w.data());
      for (int64_t i = 0; i < len; ++i) {
        const int64_t tok = t0 + i;
        if (i + kPrefetchTokens < len) {
          prefetch_bytes(in.v + ((tok + kPrefetchTokens) * HV + hv) * V + v0, nv * sizeof(in_t));
        }
        const in_t* __restrict vt = in.v + (tok * HV + hv) * V + v0;
        acc_t* __restrict vw = &vws[i * BV];
        acc_t* __restrict ui = u.data();
        const acc_t* __restrict wi = w.data();
        const acc_t b = tb[i];
        for (int64_t j = 0; j < nv; ++j) {
          vw[j] = static_cast<acc_t>(vt[j]) - wi[j];
          ui[j] = b * vw[j];
        }
        recompute_step(state(i), &states[(i + 1) * BS], Kp, nv, ld, row(kA, i), row(kK, i),
                       row(kAK, i + 1), u.data(), &states[std::min(i + 2, len) * BS],
                       zpart.data());
        hsum_columns(zpart.data(), nv, w.data());
      }
    };
    for (int64_t task; (task = next_task.fetch_add(1)) < tasks;) {
      const int64_t h = task % H, n = task / H;
      int64_t bos, eos;
      gdn_sequence_bounds(p, in.cu, n, &bos, &eos);
      const int64_t base = gdn_checkpoint_base(n, bos, C);
      const int64_t nchunks = gdn_num_chunks(eos - bos, C);
      for (int64_t hv = h * G; hv < (h + 1) * G; ++hv) {
        const bool first_head = hv == h * G;  // assigns dq/dk rather than adding to them
        const bool last_head = hv == (h + 1) * G - 1;
        std::fill(dS, dS + SV, acc_t(0));
        if (grad_ht) gather_columns(grad_ht + (n * HV + hv) * KV, K, V, ld, dS);
        std::fill(e.begin(), e.end(), acc_t(1));
        // z_j = dS_j . k of the last token (the pipeline's start).
        std::fill(z.begin(), z.end(), acc_t(0));
        if (grad_ht && eos > bos) {
          load_row(in.k, eos - 1, H, h, K, kv.data());
          scale_row(rk(eos - 1, h), kv.data());
          for (int64_t j = 0; j < V; ++j) {
            acc_t s = 0;
            for (int64_t r = 0; r < K; ++r) s += dS[j * ld + r] * kv[r];
            z[j] = s;
          }
        }
        for (int64_t c = nchunks - 1; c >= 0; --c) {
          const int64_t t0 = bos + c * C, len = std::min(C, eos - t0);
          const int64_t nsub = gdn_num_chunks(len, Cs);
          const acc_t* ck = ckpt + ((base + c) * HV + hv) * KV;
          // A block's first state, from subs (gathering each block from the checkpoint, 16
          // values per row, took 9% of the backward in a profile; one gather of all columns 4%;
          // copying each block's into states 4.5%).
          gather_columns(ck, K, V, ld, subs.data());
          auto first_state = [&](int64_t s, int64_t v0) { state0 = &subs[s * SV + v0 * ld]; };
          if (c > 0) {  // the next chunk's checkpoint (written long ago) goes to L2 meanwhile
            prefetch_rows_l2(ck - HV * KV, KV * sizeof(acc_t));
          }
          for (int64_t s = 0; s + 1 < nsub; ++s) {
            forward_rows(t0 + s * Cs, Cs, h, hv);
            for (int64_t v0 = 0; v0 < V; v0 += BV) {
              const int64_t nv = std::min(BV, V - v0);
              first_state(s, v0);
              recompute(t0 + s * Cs, Cs, hv, v0, nv);
              std::memcpy(&subs[(s + 1) * SV + v0 * ld], &states[Cs * BS],
                          nv * ld * sizeof(acc_t));
            }
          }
          for (int64_t s = nsub - 1; s >= 0; --s) {
            const int64_t s0 = t0 + s * Cs, slen = std::min(Cs, t0 + len - s0);
            // The rows of the inputs of the sub-chunk processed next (they lie one or more
            // KiB apart and the walk over sub-chunks runs backwards: the hardware does not
            // prefetch them) go to L2 during this one.
            for (int64_t tok = std::max(bos, s0 - Cs); tok < s0; ++tok) {
              prefetch_rows_l2(in.q + (tok * H + h) * K, K * sizeof(in_t));
              prefetch_rows_l2(in.k + (tok * H + h) * K, K * sizeof(in_t));
              prefetch_rows_l2(in.v + (tok * HV + hv) * V, V * sizeof(in_t));
              prefetch_rows_l2(grad_o + (tok * HV + hv) * V, V * sizeof(in_t));
              prefetch_rows_l2(in.g + (tok * HV + hv) * (p.gate_per_channel ? K : 1),
                               (p.gate_per_channel ? K : 1) * sizeof(acc_t));
            }
            forward_rows(s0, slen, h, hv);
            reverse_rows_of(s0, slen, h, bos);
            for (int64_t v0 = 0; v0 < V; v0 += BV) {
              const int64_t nv = std::min(BV, V - v0), nvv = nv / L * L;
              const bool first = v0 == 0;  // assigns the sums over blocks
              first_state(s, v0);
              recompute(s0, slen, hv, v0, nv);
              acc_t* dSb = &dS[v0 * ld];
              if (!p.gate_per_channel) {  // phi = <dS, S> after the sub-chunk, dS = diag(e) D
                const acc_t *Se = &states[slen * BS], *ee = row(kE, slen - 1);
                vec phi8 = {};
                for (int64_t j = 0; j < nv; ++j) {
                  for (int64_t rb = 0; rb < Kp; rb += L) {
                    const int64_t x = j * ld + rb;
                    phi8 += load_vec(ee + rb) * load_vec(dSb + x) * load_vec(Se + x);
                  }
                }
                sphi = first ? hsum<acc_t>(phi8) : sphi + hsum<acc_t>(phi8);
              }
              for (int64_t i = slen - 1; i >= 0; --i) {  // reverse recurrence
                const int64_t tok = s0 + i;
                if (tok - kPrefetchTokens >= s0) {
                  prefetch_bytes(grad_o + ((tok - kPrefetchTokens) * HV + hv) * V + v0,
                                 nv * sizeof(in_t));
                }
                // Column scalars: du_j from the pipelined z_j.
                const acc_t b = tb[i], qk = tqk[i];
                const acc_t* vw = &vws[i * BV];
                const in_t* got = grad_o + (tok * HV + hv) * V + v0;
                const in_t* vt = in.v + (tok * HV + hv) * V + v0;
                for (int64_t j = 0; j < nv; ++j) go[j] = static_cast<acc_t>(got[j]);
                acc_t* dv_row = dv + (tok * HV + hv) * V + v0;
                acc_t* zb = &z[v0];
                vec db8 = {}, gu8 = {}, dvv8 = {};
                for (int64_t j = 0; j < nvv; j += L) {
                  const vec go8 = load_vec(&go[j]), vw8 = load_vec(vw + j);
                  const vec du8 = load_vec(zb + j) + go8 * qk, u8 = b * vw8;
                  vec v8;
                  for (int64_t l = 0; l < L; ++l) v8[l] = static_cast<acc_t>(vt[j + l]);
                  store_vec(dv_row + j, b * du8);
                  db8 += du8 * vw8;
                  dvv8 += du8 * v8;
                  gu8 += go8 * u8;
                  store_vec(&dw[j], -b * du8);
                  store_vec(&u[j], u8);
                }
                acc_t db = hsum<acc_t>(db8), gu = hsum<acc_t>(gu8), dvv = hsum<acc_t>(dvv8);
                for (int64_t j = nvv; j < nv; ++j) {
                  const acc_t du = zb[j] + go[j] * qk;
                  dv_row[j] = b * du;
                  db += du * vw[j];
                  dvv += du * static_cast<acc_t>(vt[j]);
                  dw[j] = -b * du;
                  u[j] = b * vw[j];
                  gu += go[j] * u[j];
                }
                sdb[i] = first ? db : sdb[i] + db;
                sgu[i] = first ? gu : sgu[i] + gu;
                sdv[i] = first ? dvv : sdv[i] + dvv;
                const ReverseRows<acc_t> rows{row(kQE, i), row(kKE, i), row(kKP, i),
                                              row(kRen, i)};
                const acc_t* pf = state(std::max<int64_t>(i - 1, 0));  // next token's
                auto step = [&](auto renorm, auto channel_gate) {
                  constexpr bool r = decltype(renorm)::value, c = decltype(channel_gate)::value;
                  reverse_step<r, c>(state(i), dSb, Kp, nv, ld, rows, go.data(),
                                     u.data(), dw.data(), first, pf, row(kDQ, i),
                                     row(kDKA, i), row(kDKB, i), row(kDG, i), zpart.data());
                };
                using yes = std::true_type;
                using no = std::false_type;
                if (p.gate_per_channel) {
                  trenorm[i] ? step(yes{}, yes{}) : step(no{}, yes{});
                } else {
                  trenorm[i] ? step(yes{}, no{}) : step(no{}, no{});
                }
                hsum_columns(zpart.data(), nv, zb);
              }
            }
            // The sub-chunk's gradients from the sums over its blocks.
            for (int64_t i = 0; i < slen; ++i) {
              const int64_t tok = s0 + i;
              if (i + kRowPrefetchTokens < slen) {  // rows written (read when adding) below
                const int64_t tp = tok + kRowPrefetchTokens;
                prefetch_bytes(dq + (tp * H + h) * K, K * sizeof(acc_t));
                prefetch_bytes(dk + (tp * H + h) * K, K * sizeof(acc_t));
              }
              vec qdq8 = {};
              for (int64_t rb = 0; rb < Kp; rb += L) {
                const vec a8 = load_vec(row(kA, i) + rb), e8 = load_vec(row(kE, i) + rb);
                // dq = S_t go = diag(a) S_{t-1} go + k (u . go)
                const vec dq8 =
                    a8 * load_vec(row(kDQ, i) + rb) + load_vec(row(kK, i) + rb) * sgu[i];
                store_vec(&dqt[rb], in.scale * dq8);
                // q . dq of this value head (one gate per head; for the recursion below),
                // as qe e . dq8 with qe e = scale q: a strided re-read of q missed cache.
                if (!p.gate_per_channel) {
                  qdq8 += load_vec(row(kQE, i) + rb) * e8 * dq8;
                }
                store_vec(&dkt[rb],
                          e8 * load_vec(row(kDKA, i) + rb) + a8 * load_vec(row(kDKB, i) + rb));
                if (p.gate_per_channel) {  // a e
                  store_vec(&dgt[rb], load_vec(row(kDG, i) + rb) * load_vec(row(kRen, i) + rb));
                }
              }
              vqdq[i] = qdq8;
              acc_t* __restrict dq_row = dq + (tok * H + h) * K;
              acc_t* __restrict dk_row = dk + (tok * H + h) * K;
              if (in.l2norm && last_head) {  // the group's sums, through l2norm's backward
                if (!first_head) {
                  put_row<true>(dqt.data(), dq_row, K);
                  put_row<true>(dkt.data(), dk_row, K);
                }
                l2norm_backward_inplace(in.q + (tok * H + h) * K, trq[i], K, dqt.data());
                l2norm_backward_inplace(in.k + (tok * H + h) * K, trk[i], K, dkt.data());
                put_row<false>(dq_row, dqt.data(), K);
                put_row<false>(dk_row, dkt.data(), K);
              } else if (first_head) {
                put_row<false>(dq_row, dqt.data(), K);
                put_row<false>(dk_row, dkt.data(), K);
              } else {
                put_row<true>(dq_row, dqt.data(), K);
                put_row<true>(dk_row, dkt.data(), K);
              }
              if (p.gate_per_channel) {
                put_row<false>(dg + (tok * HV + hv) * K, dgt.data(), K);
              }
              dbeta[tok * HV + hv] = sdb[i];
            }
            if (!p.gate_per_channel) {
              // One gate per head: dg_t = <dS~_t, S~_t> (S~_t = a_t S_{t-1}, dS~_t its
              // gradient) needs no pass over the state. With phi_t = <dS_t, S_t> (dS_t: the
              // gradient from tokens after t), psi_t = dg_t satisfies
              //   psi_t = phi_t + q_t . dq_t - b_t du_t . v_t   and   phi_{t-1} = psi_t,
              // since S_t = (I - b k k^T) S~_t + b k v^T, dS~_t = (I - b k k^T) D_t with
              // D_t = dS_t + scale q_t go_t^T, and go_t . o_t = q_t . dq_t. phi is exact at
              // each sub-chunk end (sphi), so rounding builds up over <= C tokens only.
              hsum_columns(vqdq.data(), slen, tqdq.data());
              acc_t psi = sphi;
              for (int64_t i = slen - 1; i >= 0; --i) {
                psi += tqdq[i] - tb[i] * sdv[i];
                dg[(s0 + i) * HV + hv] = psi;
              }
            }
          }
        }
        if (dstate) {  // dS = diag(e) D
          for (int64_t j = 0; j < V; ++j) {
            for (int64_t r = 0; r < K; ++r) dS[j * ld + r] *= e[r];
          }
          scatter_columns(dS, K, V, ld, dstate + (n * HV + hv) * KV);
        }
      }
    }
  });
}

std::optional<at::Tensor> contiguous_opt(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return t;
  return t->contiguous();
}

template <typename in_t, typename acc_t>
Views<in_t, acc_t> make_views(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& g, const at::Tensor& beta,
                              const std::optional<at::Tensor>& cu, double scale,
                              std::optional<double> l2norm_eps) {
  return Views<in_t, acc_t>{q.data_ptr<in_t>(),    k.data_ptr<in_t>(),
                            v.data_ptr<in_t>(),    g.data_ptr<acc_t>(),
                            beta.data_ptr<acc_t>(), cu ? cu->data_ptr<int64_t>() : nullptr,
                            static_cast<acc_t>(scale), l2norm_eps.has_value(),
                            static_cast<acc_t>(l2norm_eps.value_or(0))};
}

void check_l2norm_eps(const char* op, std::optional<double> eps) {
  TORCH_CHECK(!eps.has_value() || (std::isfinite(*eps) && *eps >= 0), op,
              ": l2norm_eps must be None or a finite number >= 0, got ", eps.value_or(0));
}

// Slots no sequence uses (the slack of gdn_checkpoint_slots) are zeroed so that the output
// is fully defined.
void zero_unused_slots(const GdnProblem& p, const int64_t* cu, at::Tensor& ckpt) {
  if (p.chunk == 0) return;  // no checkpoints kept
  std::vector<bool> used(ckpt.size(0), false);
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    int64_t bos, eos;
    gdn_sequence_bounds(p, cu, n, &bos, &eos);
    const int64_t base = gdn_checkpoint_base(n, bos, p.chunk);
    for (int64_t j = 0; j < gdn_num_chunks(eos - bos, p.chunk); ++j) used[base + j] = true;
  }
  for (int64_t s = 0; s < ckpt.size(0); ++s) {
    if (!used[s]) ckpt[s].zero_();
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_delta_fwd_cpu(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& g_in, const at::Tensor& beta_in, double scale,
    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
    int64_t chunk_size, std::optional<double> l2norm_eps) {
  const GdnProblem p = gdn_check_inputs("rlx::gated_delta_fwd", q_in, k_in, v_in, g_in, beta_in,
                                        initial_state, cu_seqlens, chunk_size);
  check_l2norm_eps("rlx::gated_delta_fwd", l2norm_eps);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const at::Tensor g = g_in.contiguous(), beta = beta_in.contiguous();
  const auto h0 = contiguous_opt(initial_state);
  const auto cu = contiguous_opt(cu_seqlens);
  const int64_t K = p.head_k_dim, V = p.head_v_dim, HV = p.num_v_heads;
  at::Tensor o = at::empty_like(v);
  at::Tensor ht = at::empty({p.num_seqs, HV, K, V}, q.options().dtype(p.acc_dtype));
  at::Tensor ckpt =
      at::empty({gdn_checkpoint_slots(p.num_seqs, p.tokens(), p.chunk), HV, K, V},
                q.options().dtype(p.acc_dtype));
  advise_huge_pages(o);
  advise_huge_pages(ckpt);
  zero_unused_slots(p, cu ? cu->data_ptr<int64_t>() : nullptr, ckpt);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "gated_delta_fwd",
                                  [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    forward_kernel<scalar_t, acc_t>(p,
                                    make_views<scalar_t, acc_t>(q, k, v, g, beta, cu, scale,
                                                                l2norm_eps),
                                    h0 ? h0->data_ptr<acc_t>() : nullptr,
                                    o.data_ptr<scalar_t>(), ht.data_ptr<acc_t>(),
                                    ckpt.data_ptr<acc_t>());
  });
  return {o, ht, ckpt};
}

at::Tensor gated_delta_bwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                               const at::Tensor& v_in, const at::Tensor& g_in,
                               const at::Tensor& beta_in, double scale,
                               const std::optional<at::Tensor>& initial_state,
                               const std::optional<at::Tensor>& cu_seqlens,
                               const at::Tensor& checkpoints, const at::Tensor& grad_o_in,
                               const std::optional<at::Tensor>& grad_final_state,
                               int64_t chunk_size, std::optional<double> l2norm_eps) {
  const char* op = "rlx::gated_delta_bwd";
  check_l2norm_eps(op, l2norm_eps);
  const GdnProblem p =
      gdn_check_inputs(op, q_in, k_in, v_in, g_in, beta_in, initial_state, cu_seqlens, chunk_size);
  const int64_t K = p.head_k_dim, V = p.head_v_dim, HV = p.num_v_heads;
  TORCH_CHECK(p.chunk >= 1, op, ": chunk_size must be >= 1: the backward needs the forward's ",
              "checkpoints, got ", p.chunk);
  const int64_t slots = gdn_checkpoint_slots(p.num_seqs, p.tokens(), p.chunk);
  TORCH_CHECK(checkpoints.dim() == 4 && checkpoints.size(0) == slots &&
                  checkpoints.size(1) == HV && checkpoints.size(2) == K &&
                  checkpoints.size(3) == V && checkpoints.scalar_type() == p.acc_dtype,
              op, ": checkpoints must be the ", p.acc_dtype, " [", slots, ", ", HV, ", ", K, ", ",
              V, "] tensor that rlx::gated_delta_fwd returned for these inputs, got ",
              checkpoints.scalar_type(), " ", checkpoints.sizes());
  TORCH_CHECK(grad_o_in.sizes() == v_in.sizes() && grad_o_in.scalar_type() == p.input_dtype, op,
              ": grad_o must have o's shape ", v_in.sizes(), " and dtype ", p.input_dtype,
              ", got ", grad_o_in.scalar_type(), " ", grad_o_in.sizes());
  if (grad_final_state.has_value()) {
    const at::Tensor& gh = *grad_final_state;
    TORCH_CHECK(gh.dim() == 4 && gh.size(0) == p.num_seqs && gh.size(1) == HV &&
                    gh.size(2) == K && gh.size(3) == V && gh.scalar_type() == p.acc_dtype,
                op, ": grad_final_state must be ", p.acc_dtype, " [", p.num_seqs, ", ", HV, ", ",
                K, ", ", V, "], got ", gh.scalar_type(), " ", gh.sizes());
  }
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const at::Tensor g = g_in.contiguous(), beta = beta_in.contiguous();
  const at::Tensor ckpt = checkpoints.contiguous(), grad_o = grad_o_in.contiguous();
  const auto grad_ht = contiguous_opt(grad_final_state);
  const auto cu = contiguous_opt(cu_seqlens);
  const GdnBackwardLayout lay = GdnBackwardLayout::make(
      p.batch, p.seq_len, p.num_qk_heads, HV, K, V, p.num_seqs, p.gate_per_channel,
      p.has_initial_state);
  // Every slice is fully written (the first value head of a group assigns dq/dk).
  at::Tensor buf = at::empty({lay.total}, q.options().dtype(p.acc_dtype));
  advise_huge_pages(buf);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "gated_delta_bwd",
                                  [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    backward_kernel<scalar_t, acc_t>(
        p, make_views<scalar_t, acc_t>(q, k, v, g, beta, cu, scale, l2norm_eps),
        ckpt.data_ptr<acc_t>(), grad_o.data_ptr<scalar_t>(),
        grad_ht ? grad_ht->data_ptr<acc_t>() : nullptr, lay, buf.data_ptr<acc_t>());
  });
  return buf;
}

// [dq.offset, dq.numel, dk..., dv..., dg..., dbeta..., dstate..., total]
std::vector<int64_t> gated_delta_bwd_layout(int64_t batch, int64_t seq_len, int64_t num_qk_heads,
                                            int64_t num_v_heads, int64_t head_k_dim,
                                            int64_t head_v_dim, int64_t num_states,
                                            bool gate_per_channel, bool has_initial_state) {
  const GdnBackwardLayout l =
      GdnBackwardLayout::make(batch, seq_len, num_qk_heads, num_v_heads, head_k_dim, head_v_dim,
                              num_states, gate_per_channel, has_initial_state);
  std::vector<int64_t> out;
  for (const GdnSlice& s : {l.dq, l.dk, l.dv, l.dg, l.dbeta, l.dstate}) {
    out.push_back(s.offset);
    out.push_back(s.numel);
  }
  out.push_back(l.total);
  return out;
}

int64_t gated_delta_checkpoint_slots(int64_t num_seqs, int64_t total_tokens,
                                     int64_t chunk_size) {
  TORCH_CHECK(chunk_size >= 0, "rlx::gated_delta_checkpoint_slots: chunk_size must be >= 0");
  return gdn_checkpoint_slots(num_seqs, total_tokens, chunk_size);
}

}  // namespace
}  // namespace rlx

TORCH_LIBRARY_IMPL(rlx, CPU, m) {
  m.impl("gated_delta_fwd", &rlx::gated_delta_fwd_cpu);
  m.impl("gated_delta_bwd", &rlx::gated_delta_bwd_cpu);
}

// Shape arithmetic only (no tensors): one kernel for every backend.
TORCH_LIBRARY_IMPL(rlx, CompositeImplicitAutograd, m) {
  m.impl("gated_delta_bwd_layout", &rlx::gated_delta_bwd_layout);
  m.impl("gated_delta_checkpoint_slots", &rlx::gated_delta_checkpoint_slots);
}
