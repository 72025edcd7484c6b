// Gated delta rule on the CPU, backward: per chunk, recompute the states from the forward's
// checkpoint, then run the reverse recurrence over them. Shared parts and the overview:
// gated_delta_common.h.
#include <torch/library.h>

#if defined(__unix__)
#include <sys/mman.h>
#endif

#include "gated_delta_common.h"

namespace rlx {
namespace {

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

// x, hidden from the optimizer: GCC turns loops that only copy or zero a few hundred bytes
// (the backward's per-token gradient rows and column sums) into memmove/memset calls, ~3% of
// the backward in a profile. An empty asm on the value keeps them inline vector moves.
template <typename vec>
inline vec opaque(vec x) {
#if defined(__AVX__)
  asm("" : "+x"(x));
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

// dy <- r (dy - x r^2 (x . dy)): l2norm's backward (l2norm_row.h) on an acc_t row, in place.
// Float rows of whole vectors in vector registers: with the generic row_dot (a dependent
// chain per lane, then a scalar sum) the two rows per token took 7% of the backward.
template <typename in_t, typename acc_t>
inline void l2norm_backward_inplace(const in_t* x, acc_t r, int64_t K, acc_t* dy) {
  using vec = Vec256<acc_t>;
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
//                         (kChannelGate; backward_kernel sums it over the rows for one
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

// Per-thread scratch in 2 MiB-aligned blocks advised for transparent huge pages. Blocks of up
// to kKeptScratchBytes are kept across calls (grown when too small: fresh ones cost page
// faults every call); larger ones, which only very long chunks of large states need, are
// freed when the call ends.
constexpr size_t kKeptScratchBytes = size_t(64) << 20;

inline void* huge_block(size_t bytes, size_t* rounded) {
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

class HugeScratch {
 public:
  explicit HugeScratch(size_t bytes) {
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
  ~HugeScratch() {
    if (owned_) std::free(p_);
  }
  HugeScratch(const HugeScratch&) = delete;
  HugeScratch& operator=(const HugeScratch&) = delete;
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
  bool owned_ = false;
};

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
      (int64_t(8) << 20) / ((BS + kTokenRows * Kp) * int64_t(sizeof(acc_t))), 1,
      longest_chunk(p));
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
    const int64_t nsubs = gdn_num_chunks(longest_chunk(p), Cs);
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
    const HugeScratch scratch_block((dS_offset + SV) * sizeof(acc_t));
    acc_t* const scratch = static_cast<acc_t*>(scratch_block.get());
    acc_t* const states = scratch;
    // Per token of a sub-chunk, shared by its blocks: the recompute's rows (decays a, key k,
    // a k; one extra zero row of a k ends the pipeline), ReverseRows' rows and e before the
    // token, and the sums over the blocks of dq, dk, dg partials (sdq..sdg), du . vw, go . u.
    // A token's rows lie together: as separate arrays their rows of one token would fall in
    // the same L1 sets (the arrays are a multiple of 4 KiB apart).
    acc_t* const rowbuf = scratch + (Cs + 1) * BS;
    acc_t* const dS = scratch + dS_offset;
    AccVec<acc_t> tqk(Cs), tb(Cs), sdb(Cs), sgu(Cs);
    auto row = [&](int64_t which, int64_t i) { return &rowbuf[(i * kTokenRows + which) * Kp]; };
    std::vector<char> trenorm(Cs);
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
    std::vector<Vec256<acc_t>> zpart(BV);
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
      const BackwardTask tk = backward_task(p, in.cu, task);
      const int64_t h = tk.h, n = tk.n, bos = tk.bos, eos = tk.eos;
      const int64_t base = tk.base, nchunks = tk.nchunks;
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
                for (int64_t j = 0; j < nv; ++j) go[j] = static_cast<acc_t>(got[j]);
                acc_t* dv_row = dv + (tok * HV + hv) * V + v0;
                acc_t* zb = &z[v0];
                vec db8 = {}, gu8 = {};
                for (int64_t j = 0; j < nvv; j += L) {
                  const vec go8 = load_vec(&go[j]), vw8 = load_vec(vw + j);
                  const vec du8 = load_vec(zb + j) + go8 * qk, u8 = b * vw8;
                  store_vec(dv_row + j, b * du8);
                  db8 += du8 * vw8;
                  gu8 += go8 * u8;
                  store_vec(&dw[j], -b * du8);
                  store_vec(&u[j], u8);
                }
                acc_t db = hsum<acc_t>(db8), gu = hsum<acc_t>(gu8);
                for (int64_t j = nvv; j < nv; ++j) {
                  const acc_t du = zb[j] + go[j] * qk;
                  dv_row[j] = b * du;
                  db += du * vw[j];
                  dw[j] = -b * du;
                  u[j] = b * vw[j];
                  gu += go[j] * u[j];
                }
                sdb[i] = first ? db : sdb[i] + db;
                sgu[i] = first ? gu : sgu[i] + gu;
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
                using no = std::false_type;  // (no renormalization)
                // dg = <dP, P> summed in the pass for one gate per head too (the
                // chunked backward's recursion over tokens instead, psi below, lost about a
                // digit of a gate parameter's gradient here over 64-token sub-chunks).
                trenorm[i] ? step(yes{}, yes{}) : step(no{}, yes{});
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
              for (int64_t rb = 0; rb < Kp; rb += L) {
                const vec a8 = load_vec(row(kA, i) + rb), e8 = load_vec(row(kE, i) + rb);
                // dq = S_t go = diag(a) S_{t-1} go + k (u . go)
                const vec dq8 =
                    a8 * load_vec(row(kDQ, i) + rb) + load_vec(row(kK, i) + rb) * sgu[i];
                store_vec(&dqt[rb], in.scale * dq8);
                store_vec(&dkt[rb],
                          e8 * load_vec(row(kDKA, i) + rb) + a8 * load_vec(row(kDKB, i) + rb));
                // a e
                store_vec(&dgt[rb], load_vec(row(kDG, i) + rb) * load_vec(row(kRen, i) + rb));
              }
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
              } else {  // one gate for all rows: their sum
                double sum = 0;
                for (int64_t r = 0; r < K; ++r) sum += dgt[r];
                dg[tok * HV + hv] = acc_t(sum);
              }
              dbeta[tok * HV + hv] = sdb[i];
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

}  // namespace
}  // namespace rlx

// The chunked backward, here because it uses the helpers above (gather_columns, put_row,
// HugeScratch).
#include "gated_delta_backward_chunked.h"

namespace rlx {
namespace {

// vw of each chunk's first token against the chunk's checkpoint S (vw = v - exp(g) S^T k;
// vw is only kept with one gate per head): a vw of another forward, e.g. of other inputs,
// fails here instead of giving wrong gradients. One K x V pass per chunk, where the
// chunk's backward makes several per token.
template <typename in_t, typename acc_t>
void check_vw_matches(const char* op, const GdnProblem& p, const Views<in_t, acc_t>& in,
                      const acc_t* ckpt, const acc_t* vw) {
  const int64_t K = p.head_k_dim, V = p.head_v_dim, H = p.num_qk_heads, HV = p.num_v_heads;
  const int64_t C = p.chunk;
  // Far above the forward's rounding (its state is kept scaled by factors in [2^-20, 2^20]),
  // far below a difference in any input.
  const acc_t tol = std::is_same_v<acc_t, double> ? acc_t(1e-9) : acc_t(1e-3);
  std::atomic<bool> mismatch{false};
  at::parallel_for(0, p.num_seqs * HV, 1, [&](int64_t begin, int64_t end) {
    AccVec<acc_t> kr(K), w(V), mag(V);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / HV, hv = task % HV, h = hv / p.group();
      int64_t bos, eos;
      gdn_sequence_bounds(p, in.cu, n, &bos, &eos);
      const int64_t base = gdn_checkpoint_base(n, bos, C);
      for (int64_t c = 0; c < gdn_num_chunks(eos - bos, C); ++c) {
        const int64_t tok = bos + c * C;
        const acc_t* S = ckpt + ((base + c) * HV + hv) * K * V;
        const in_t* kt = in.k + (tok * H + h) * K;
        const acc_t r = in.l2norm ? l2norm_rstd<acc_t>(kt, K, in.l2norm_eps) : acc_t(1);
        const acc_t a = std::exp(in.g[tok * HV + hv]);
        std::fill(w.begin(), w.end(), acc_t(0));
        std::fill(mag.begin(), mag.end(), acc_t(0));
        for (int64_t i = 0; i < K; ++i) {
          kr[i] = r * static_cast<acc_t>(kt[i]);
          for (int64_t j = 0; j < V; ++j) {
            w[j] += kr[i] * S[i * V + j];
            mag[j] += std::abs(kr[i] * S[i * V + j]);
          }
        }
        const in_t* vt = in.v + (tok * HV + hv) * V;
        const acc_t* got = vw + (tok * HV + hv) * V;
        for (int64_t j = 0; j < V; ++j) {
          const acc_t vj = static_cast<acc_t>(vt[j]), expected = vj - a * w[j];
          if (!std::isfinite(expected)) continue;  // non-finite inputs: nothing to compare
          if (!(std::abs(got[j] - expected) <= tol * (1 + std::abs(vj) + a * mag[j]))) {
            mismatch = true;
          }
        }
      }
    }
  });
  TORCH_CHECK(!mismatch, op, ": vw does not match the checkpoints and inputs: pass the vw that ",
              "rlx::gated_delta_fwd returned with these checkpoints for these inputs (or None)");
}

// The chunked backward for one gate per head when every g <= 0 (decays, its domain: see
// gated_delta_backward_chunked.h), the token-by-token one otherwise.
// RLX_GDN_RECURRENT_BACKWARD=1 forces the token-by-token one (for comparisons).
template <typename acc_t>
bool use_chunked_backward(const GdnProblem& p, const at::Tensor& g) {
  if (p.gate_per_channel) return false;
  const char* force = std::getenv("RLX_GDN_RECURRENT_BACKWARD");
  if (force != nullptr && force[0] == '1') return false;
  const acc_t* x = g.data_ptr<acc_t>();
  bool ok = true;
  for (int64_t i = 0, n = g.numel(); i < n; ++i) ok &= x[i] <= acc_t(0);  // false for NaN
  return ok;
}

at::Tensor gated_delta_bwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                               const at::Tensor& v_in, const at::Tensor& g_in,
                               const at::Tensor& beta_in, double scale,
                               const std::optional<at::Tensor>& initial_state,
                               const std::optional<at::Tensor>& cu_seqlens,
                               const at::Tensor& checkpoints, const at::Tensor& grad_o_in,
                               const std::optional<at::Tensor>& grad_final_state,
                               int64_t chunk_size, std::optional<double> l2norm_eps,
                               const std::optional<at::Tensor>& vw_in) {
  const char* op = "rlx::gated_delta_bwd";
  gdn_check_l2norm_eps(op, l2norm_eps);
  const GdnProblem p =
      gdn_check_inputs(op, q_in, k_in, v_in, g_in, beta_in, initial_state, cu_seqlens, chunk_size);
  // The checks every backend shares (shapes, devices, vw as the forward returned it).
  gdn_check_backward_inputs(op, p, q_in, v_in, checkpoints, grad_o_in, grad_final_state, vw_in);
  const int64_t K = p.head_k_dim, V = p.head_v_dim, HV = p.num_v_heads;
  const bool has_vw = vw_in.has_value() && vw_in->numel() > 0;
  gdn_check_checkpoint_tag(op, checkpoints,
                           gdn_checkpoint_tag(p.chunk, l2norm_eps, gdn_keeps_vw(p)));
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const at::Tensor g = g_in.contiguous(), beta = beta_in.contiguous();
  const at::Tensor ckpt = checkpoints.contiguous(), grad_o = grad_o_in.contiguous();
  const at::Tensor vw = has_vw ? vw_in->contiguous() : at::Tensor();
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
    const auto views = make_views<scalar_t, acc_t>(q, k, v, g, beta, cu, scale, l2norm_eps);
    const acc_t* gh = grad_ht ? grad_ht->data_ptr<acc_t>() : nullptr;
    if (has_vw && !p.gate_per_channel) {  // (the token-by-token backward does not read vw)
      check_vw_matches(op, p, views, ckpt.data_ptr<acc_t>(), vw.data_ptr<acc_t>());
    }
    if (use_chunked_backward<acc_t>(p, g)) {
      chunked_backward_kernel<scalar_t, acc_t>(p, views, ckpt.data_ptr<acc_t>(),
                                               has_vw ? vw.data_ptr<acc_t>() : nullptr,
                                               grad_o.data_ptr<scalar_t>(), gh, lay,
                                               buf.data_ptr<acc_t>());
    } else {
      backward_kernel<scalar_t, acc_t>(p, views, ckpt.data_ptr<acc_t>(),
                                       grad_o.data_ptr<scalar_t>(), gh, lay,
                                       buf.data_ptr<acc_t>());
    }
  });
  return buf;
}

}  // namespace
}  // namespace rlx

TORCH_LIBRARY_IMPL(rlx, CPU, m) {
  m.impl("gated_delta_bwd", &rlx::gated_delta_bwd_cpu);
}
