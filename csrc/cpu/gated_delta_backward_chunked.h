// Gated delta rule on the CPU, backward for one gate per head with g <= 0 (Gated DeltaNet's
// decays): the chunked (WY) form, where a block of Cs tokens is a handful of small matrix
// products instead of Cs passes over the state. Included by gated_delta_backward.cpp, which
// picks it; the token-by-token backward there handles the other cases (a gate per key
// channel, or any g > 0, whose decay products could overflow here).
//
// Within a sub-chunk of n <= Cs tokens (0-based t), with a_t = exp(g_t) <= 1,
// gam_t = a_0 ... a_t and E[i][j] = a_{j+1} ... a_i (j <= i; products only, no division,
// so a strong decay underflows to 0 instead of overflowing), S0 the state before the
// sub-chunk, k/q rows already l2-normalized (qs = scale q):
//   S_i = gam_i S0 + sum_{j<=i} E[i][j] k_j u_j^T,
//   vw_i = v_i - gam_i S0^T k_i - sum_{j<i} A[i][j] u_j,  u_i = b_i vw_i,
//   A[i][j] = E[i][j] (k_i . k_j)  (j < i; a unit lower triangular system in vw).
// The backward, given dSn = dL/dS_{n-1} (from the sub-chunk after) and go = dL/do:
//   (I + diag(b) A)^T du = E[n-1][t] dSn^T k_t + sum_{j>=t} E[j][t] (qs_j . k_t) go_j,
//   dw = -b du, dv = b du, dbeta_t = du_t . vw_t,
//   dq_t / scale = S_t go_t = gam_t S0 go_t + sum_{j<=t} E[t][j] (go_t . u_j) k_j,
//   dk_t = D_t u_t + a_t S_{t-1} dw_t  (D_t = dL/dS_t incl. the output's qs_t go_t^T)
//        = E[n-1][t] dSn u_t + sum_{j>=t} E[j][t] (go_j . u_t) qs_j
//          + sum_{j>t} E[j][t] (dw_j . u_t) k_j + gam_t S0 dw_t
//          + sum_{j<t} E[t][j] (u_j . dw_t) k_j,
//   dS0 = gam_{n-1} dSn + sum_t gam_t (qs_t go_t^T + k_t dw_t^T),
// and dg without a pass over the state per token, from the decay products g_t enters
// (d gam_i / d g_t = gam_i [t <= i], d E[i][j] / d g_t = E[i][j] [j < t <= i]; u held fixed
// by the adjoint du, as in the adjoint's -b du = dw):
//   dg_t = gam_{n-1} <dSn, S0> + sum_{i>=t} gam_i (qs_i . S0 go_i + k_i . S0 dw_i)
//          + sum_{j<t} E[n-1][j] (k_j . dSn u_j) + sum_{i>=t} sum_{j<t} Z[i][j],
//   Z[i][j] = E[i][j] (qs_i . k_j) (go_i . u_j) + A[i][j] (dw_i . u_j)   (j < i),
// summed in double (Z's entries, products alone, in acc_t) from pieces the products above
// give (the S0 go and S0 dw rows, dSn u, the Cs x Cs dot products). Every term carries the
// factor a_t, so dg_t keeps its relative accuracy however strong the decay: a recursion
// over tokens instead (dg_t = dg_{t+1} +
// q_{t+1} . dq_{t+1} - b_{t+1} du_{t+1} . v_{t+1}, from <dSn, S_{n-1}>) adds and cancels
// terms of the size of go . o, and its rounding, ~1e-7 of those and the same for every
// token, made a gate parameter's gradient several times less accurate than the
// token-by-token backward's where the decays are strong.
// vw comes from the forward when it kept it (gdn_keeps_vw; else solve_vw below).
// That is 7 products of a Cs x K (or V) block with a K x V state per sub-chunk (8 when vw is
// solved for), ~7 multiply-adds per state element and token where the token-by-token
// backward does ~8, plus the Cs x Cs products; they run as register-tiled
// matrix products (gemm below) near the FMA peak instead of one pass over the state per
// token. Cs = 16: 8 and 32 were slower (fewer products per pass over a state; more Cs x Cs
// work).
#pragma once

namespace rlx {
namespace {

// C[M x N] = diag(rs) A[M x P] B[P x N] (+ cs X, X[M x N] with C's row stride: C itself to
// accumulate, or another matrix), row-major; N a multiple of the vector length. An
// MR x NV-vector tile of C stays in registers over the whole inner dimension. (The scaled
// addend saves a pass over a state where the products decay it first: S1 and dS.)
template <int64_t MR, int64_t NV, typename acc_t>
inline void gemm_tile(int64_t P, const acc_t* __restrict A, int64_t lda,
                      const acc_t* __restrict B, int64_t ldb, acc_t* C, int64_t ldc,
                      const acc_t* rs, const acc_t* X, acc_t cs) {
  using vec = Vec256<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  vec c[MR][NV];
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t v = 0; v < NV; ++v) c[m][v] = vec{};
  }
  for (int64_t p = 0; p < P; ++p) {
    vec b[NV];
    for (int64_t v = 0; v < NV; ++v) b[v] = load_vec(B + p * ldb + v * L);
    for (int64_t m = 0; m < MR; ++m) {
      const acc_t a = A[m * lda + p];
      for (int64_t v = 0; v < NV; ++v) c[m][v] += a * b[v];
    }
  }
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t v = 0; v < NV; ++v) {
      const vec x = rs ? rs[m] * c[m][v] : c[m][v];
      const int64_t o = m * ldc + v * L;
      store_vec(C + o, X ? cs * load_vec(X + o) + x : x);
    }
  }
}

// Tiles of 6 rows by 2 vectors: 12 independent accumulators keep both FMA pipes busy through
// their 4-cycle latency, and with the 2 B vectors and the broadcast A value they use 15 of
// AVX2's 16 vector registers.
template <int64_t MR, typename acc_t>
inline void gemm_cols(int64_t P, int64_t N, const acc_t* A, int64_t lda, const acc_t* B,
                      int64_t ldb, acc_t* C, int64_t ldc, const acc_t* rs, const acc_t* X,
                      acc_t cs) {
  constexpr int64_t L = 32 / sizeof(acc_t);
  int64_t j = 0;
  for (; j + 2 * L <= N; j += 2 * L) {
    gemm_tile<MR, 2>(P, A, lda, B + j, ldb, C + j, ldc, rs, X ? X + j : X, cs);
  }
  if (j < N) gemm_tile<MR, 1>(P, A, lda, B + j, ldb, C + j, ldc, rs, X ? X + j : X, cs);
}

// A's zero triangle, when it has one (M = P): a row tile then runs over A's nonzero columns
// only.
enum class Tri { kFull, kLower, kUpper };

template <typename acc_t>
inline void gemm(int64_t M, int64_t N, int64_t P, const acc_t* A, int64_t lda, const acc_t* B,
                 int64_t ldb, acc_t* C, int64_t ldc, const acc_t* rs, const acc_t* X,
                 acc_t cs = 1, Tri tri = Tri::kFull) {
  constexpr int64_t MR = 6;
  for (int64_t i = 0; i < M; i += MR) {
    const int64_t m = std::min(MR, M - i);
    const int64_t p0 = tri == Tri::kUpper ? i : 0;
    const int64_t p1 = tri == Tri::kLower ? std::min(P, i + m) : P;
    const acc_t* Ai = A + i * lda + p0;
    const acc_t* Bi = B + p0 * ldb;
    acc_t* Ci = C + i * ldc;
    const acc_t* rsi = rs ? rs + i : nullptr;
    const acc_t* Xi = X ? X + i * ldc : nullptr;
    const int64_t Pi = p1 - p0;
    switch (m) {
      case 6: gemm_cols<6>(Pi, N, Ai, lda, Bi, ldb, Ci, ldc, rsi, Xi, cs); break;
      case 5: gemm_cols<5>(Pi, N, Ai, lda, Bi, ldb, Ci, ldc, rsi, Xi, cs); break;
      case 4: gemm_cols<4>(Pi, N, Ai, lda, Bi, ldb, Ci, ldc, rsi, Xi, cs); break;
      case 3: gemm_cols<3>(Pi, N, Ai, lda, Bi, ldb, Ci, ldc, rsi, Xi, cs); break;
      case 2: gemm_cols<2>(Pi, N, Ai, lda, Bi, ldb, Ci, ldc, rsi, Xi, cs); break;
      default: gemm_cols<1>(Pi, N, Ai, lda, Bi, ldb, Ci, ldc, rsi, Xi, cs);
    }
  }
}

// out[0, n) = c x y elementwise, n a multiple of the vector length.
template <typename acc_t>
inline void hadamard(int64_t n, const acc_t* x, const acc_t* y, acc_t* out, acc_t c = 1) {
  constexpr int64_t L = 32 / sizeof(acc_t);
  for (int64_t i = 0; i < n; i += L) store_vec(out + i, c * (load_vec(x + i) * load_vec(y + i)));
}

template <typename acc_t>
inline acc_t dot(int64_t n, const acc_t* x, const acc_t* y) {
  return hsum<acc_t>(dot_lanes(n, x, y));
}

// sum x y in double (a float product is exact in double): <dS, S>, which
// dg's recursion starts from at every sub-chunk; in float its rounding, ~1e-7 of
// sum |dS| |S|, went into every dg of the sub-chunk alike, and so into a gate parameter's
// gradient (a sum of dg over tokens) without cancelling.
template <typename acc_t>
inline double dot_f64(int64_t n, const acc_t* x, const acc_t* y) {
  if constexpr (std::is_same_v<acc_t, double>) {
    return dot(n, x, y);
  } else {
    typedef float v4f __attribute__((vector_size(16)));
    using vd = Vec256<double>;
    vd acc[4] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      for (int64_t m = 0; m < 4; ++m) {
        v4f a, b;
        std::memcpy(&a, x + i + 4 * m, sizeof(a));
        std::memcpy(&b, y + i + 4 * m, sizeof(b));
        acc[m] += __builtin_convertvector(a, vd) * __builtin_convertvector(b, vd);
      }
    }
    const vd t = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    double tail = 0;
    for (; i < n; ++i) tail += double(x[i]) * double(y[i]);
    return ((t[0] + t[1]) + (t[2] + t[3])) + tail;
  }
}

// Loads n rows (tok0.., head) of a [tokens, heads, dim] input into a zero-padded [Cs, ld]
// acc_t matrix, each row times f[i] (1 when f is null) and c.
template <typename in_t, typename acc_t>
inline void load_rows(const in_t* base, int64_t tok0, int64_t n, int64_t rows, int64_t heads,
                      int64_t head, int64_t dim, int64_t ld, const acc_t* f, acc_t c,
                      acc_t* out) {
  for (int64_t i = 0; i < rows; ++i) {
    acc_t* o = out + i * ld;
    if (i < n) {
      const in_t* src = base + ((tok0 + i) * heads + head) * dim;
      const acc_t s = f ? c * f[i] : c;
      for (int64_t d = 0; d < dim; ++d) o[d] = s * static_cast<acc_t>(src[d]);
      for (int64_t d = dim; d < ld; ++d) o[d] = 0;
    } else {
      for (int64_t d = 0; d < ld; ++d) o[d] = 0;
    }
  }
}

// X = (I + M)^-1 for a strictly lower triangular n x n M (row-major, n a multiple of the
// vector length): X is unit lower triangular, row i = e_i - sum_{j<i} M[i][j] X_j. The
// sub-chunk's two triangular solves then run as one small matrix product each. Row i is
// summed in registers, in two chains (even and odd j): through memory, each term would wait
// on the store of the one before.
template <int64_t n, typename acc_t>
inline void unit_lower_inverse(const acc_t* __restrict M, acc_t* __restrict X) {
  using vec = Vec256<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t), NV = n / L;
  for (int64_t i = 0; i < n; ++i) {
    vec x0[NV] = {}, x1[NV] = {};
    x0[i / L][i % L] = 1;
    int64_t j = 0;
    for (; j + 1 < i; j += 2) {
      const acc_t c0 = -M[i * n + j], c1 = -M[i * n + j + 1];
      for (int64_t v = 0; v < NV; ++v) {
        x0[v] += c0 * load_vec(X + j * n + v * L);
        x1[v] += c1 * load_vec(X + (j + 1) * n + v * L);
      }
    }
    if (j < i) {
      const acc_t c0 = -M[i * n + j];
      for (int64_t v = 0; v < NV; ++v) x0[v] += c0 * load_vec(X + j * n + v * L);
    }
    for (int64_t v = 0; v < NV; ++v) store_vec(X + i * n + v * L, x0[v] + x1[v]);
  }
}

// Rows of [tokens, heads, dim] inputs to prefetch into L2, a few lines at a time. The input
// rows a walk reads lie a KiB or more apart, and the chunks run backwards: the hardware does
// not prefetch them, and a burst of prefetches for a whole sub-chunk stalls on the few
// line-fill buffers. So while one walk runs, the rows the next one reads are queued in the
// order it reads them (the forward walk of a chunk queues its q and go rows, last sub-chunk
// first; the backward walk the checkpoint and the k, v and vw rows of the chunk before,
// sub-chunk by sub-chunk) and fetched between products. Into L2, not L1: a walk's rows (48
// KiB or more) would evict the states the products work on, and themselves before they are
// read. (In-process A/B of the backward op, 1 thread, B=1 T=2048 H=4 K=V=64: 10.9 -> 10.2 ms
// median with L2 and the order, 10.0 -> 9.7 ms with L2 alone; then the checkpoint with 40
// lines per pump instead of 24, 9.44 -> 9.13 and 9.53 -> 9.19 ms.)
struct RowQueue {
  std::vector<std::pair<const char*, int64_t>> rows;  // (row, bytes)
  size_t next = 0;
  int64_t byte = 0;
  void restart() { rows.clear(), next = 0, byte = 0; }
  void add(const void* base, int64_t t0, int64_t n, int64_t heads, int64_t head, int64_t dim,
           int64_t elem) {
    const char* c = static_cast<const char*>(base);
    for (int64_t tok = t0; tok < t0 + n; ++tok) {
      rows.emplace_back(c + ((tok * heads + head) * dim) * elem, dim * elem);
    }
  }
  void fetch(int64_t lines) {
    for (; lines > 0 && next < rows.size(); --lines) {
      __builtin_prefetch(rows[next].first + byte, 0, 2);
      byte += 64;
      if (byte >= rows[next].second) ++next, byte = 0;
    }
  }
};

// Gradient rows waiting to be streamed out (stream_row), a few at a time between products:
// written all at once, the sub-chunk's rows (~200 lines) wait on the few write-combining
// buffers.
template <typename acc_t>
struct RowDrain {
  struct Row {
    acc_t* dst;
    const acc_t* src;
    int64_t n;
  };
  std::vector<Row> rows;
  size_t next = 0;
  void drain(int64_t n) {
    for (; n > 0 && next < rows.size(); --n, ++next) {
      stream_row(rows[next].dst, rows[next].src, rows[next].n);
    }
  }
  void flush() {
    drain(int64_t(rows.size()));
    rows.clear(), next = 0;
  }
};

// kFirstLanes[t][j] = (j < t): dg's mask over the sub-chunk's tokens before t.
struct FirstLanes {
  double w[17][16];
  constexpr FirstLanes() : w{} {
    for (int t = 0; t <= 16; ++t) {
      for (int j = 0; j < 16; ++j) w[t][j] = j < t ? 1 : 0;
    }
  }
  constexpr const double* operator[](int64_t t) const { return w[t]; }
};
inline constexpr FirstLanes kFirstLanes{};

template <typename in_t, typename acc_t>
void chunked_backward_kernel(const GdnProblem& p, const Views<in_t, acc_t>& in,
                             const acc_t* ckpt, const acc_t* vw_saved, const in_t* grad_o,
                             const acc_t* grad_ht, const GdnBackwardLayout& lay, acc_t* buf) {
  const int64_t K = p.head_k_dim, V = p.head_v_dim, H = p.num_qk_heads, HV = p.num_v_heads;
  const int64_t C = p.chunk, KV = K * V, G = p.group();
  constexpr int64_t L = 32 / sizeof(acc_t);
  constexpr int64_t Cs = 16, CC = Cs * Cs;  // sub-chunk: a multiple of L for float and double
  constexpr int64_t kPumpLines = 40, kDrainRows = 6;  // per pump (see pump)
  const int64_t Kp = (K + L - 1) / L * L, Vp = (V + L - 1) / L * L, SP = Kp * Vp;
  acc_t *dq = buf + lay.dq.offset, *dk = buf + lay.dk.offset, *dv = buf + lay.dv.offset;
  acc_t *dg = buf + lay.dg.offset, *dbeta = buf + lay.dbeta.offset;
  acc_t* dstate = p.has_initial_state ? buf + lay.dstate.offset : nullptr;
  const int64_t nsubs = gdn_num_chunks(longest_chunk(p), Cs);
  const acc_t* const no_scale = nullptr;   // gemm's rs: rows not scaled
  const acc_t* const no_addend = nullptr;  // gemm's X: C = the product
  const int64_t tasks = p.num_seqs * H;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    // What the forward walk over a chunk keeps per sub-chunk for the backward walk: the k
    // and v rows (k^T too), u, vw, A (strictly lower), E and E^T, gam, beta, k's l2norm
    // factors; and the states before each sub-chunk.
    struct Sub {
      int64_t n;
      acc_t *kc, *kct, *vc, *u, *vw, *A, *E, *ET, *gam, *b, *rk;
    };
    // All scratch in one per-thread block kept across calls (HugeScratch): fresh vectors
    // here cost ~150 page faults a call. Every value is written before it is read.
    const int64_t sub_size = 2 * Cs * Kp + 3 * Cs * Vp + 3 * CC + 3 * Cs;
    const int64_t scratch_size = nsubs * sub_size + (nsubs + 1) * SP + 2 * SP + 2 * Cs * Kp +
                                 3 * Cs * Vp + Vp * Cs + 2 * Kp * Cs + 4 * CC +
                                 2 * Cs * (2 * Kp + Vp) + 2 * Cs + Kp * Cs + Cs * Vp + 2 * CC +
                                 5 * Cs;
    const HugeScratch scratch_block(scratch_size * sizeof(acc_t));
    acc_t* free = static_cast<acc_t*>(scratch_block.get());
    auto take = [&](int64_t n) { acc_t* r = free; free += n; return r; };
    std::vector<Sub> subs(nsubs);
    for (Sub& sb : subs) {
      sb.kc = take(Cs * Kp), sb.kct = take(Kp * Cs), sb.vc = take(Cs * Vp);
      sb.u = take(Cs * Vp), sb.vw = take(Cs * Vp);
      sb.A = take(CC), sb.E = take(CC), sb.ET = take(CC);
      sb.gam = take(Cs), sb.b = take(Cs), sb.rk = take(Cs);
    }
    acc_t* const states = take((nsubs + 1) * SP);
    // The states before the sub-chunks (and a slot for the state after the last, which
    // forward_sub is not asked for): a checkpoint is read in place when it needs no padding
    // (K, V multiples of the vector length), else copied padded.
    std::vector<const acc_t*> state(nsubs + 1);
    auto padded_state = [&](const acc_t* src, acc_t* dst) -> const acc_t* {
      if (K == Kp && V == Vp) return src;
      std::fill(dst, dst + SP, acc_t(0));
      for (int64_t r = 0; r < K; ++r) std::copy(src + r * V, src + (r + 1) * V, dst + r * Vp);
      return dst;
    };
    // Backward scratch of one sub-chunk.
    acc_t *const dS = take(SP), *const S0T = take(SP), *const dsu = take(Cs * Kp);
    acc_t *const qs = take(Cs * Kp), *const ow = take(2 * Cs * Vp), *const du = take(Cs * Vp);
    acc_t *const ut = take(Vp * Cs), *const qkt = take(Kp * 2 * Cs);
    acc_t *const mat = take(CC), *const mat2 = take(CC), *const gu = take(CC),
          *const wu = take(CC);
    // dq, dk and dv rows of a sub-chunk: two sets, one filled while the other drains
    acc_t* const grad_rows = take(2 * Cs * (2 * Kp + Vp));
    acc_t *const elast = take(Cs), *const rq = take(Cs), *const tmp = take(Kp * Cs);
    acc_t *const rhs = take(Cs * Vp), *const inv = take(CC);
    acc_t* const kq = take(CC);  // k_i . qs_j, kept for dg
    acc_t *const sgam = take(2 * Cs), *const sums = take(3 * Cs);
    std::vector<Vec256<acc_t>> lanes_buf(3 * Cs);
    Vec256<acc_t>* const lanes = lanes_buf.data();
    acc_t* const dOc = ow;           // rows [0, Cs): go
    acc_t* const dW = ow + Cs * Vp;   // rows [Cs, 2 Cs): dw
    auto rstd_rows = [&](const in_t* x, int64_t t0, int64_t n, int64_t h, acc_t* out) {
      if (in.l2norm) {
        l2norm_rstd_rows(x + (t0 * H + h) * K, H * K, n, K, in.l2norm_eps, out);
      } else {
        std::fill(out, out + n, acc_t(1));
      }
    };
    RowQueue ahead;  // input rows of the next walk, fetched by pump() between products
    RowDrain<acc_t> drain;
    int64_t step = 0;  // backward steps so far: picks the set of gradient rows
    auto pump = [&] {
      ahead.fetch(kPumpLines);
      drain.drain(kDrainRows);
    };

    // vw of a sub-chunk when the forward did not keep it (sb's k and v rows, A, gam and b
    // filled): vw = v - gam S0^T k - sum_{j<i} A[i][j] u_j with u_j = b_j vw_j, i.e.
    // (I + A diag(b)) vw = v - gam S0^T k: the right-hand side, then vw = inverse x it.
    auto solve_vw = [&](Sub& sb, const acc_t* S0) {
      gemm(Cs, Vp, Kp, sb.kc, Kp, S0, Vp, rhs, Vp, sb.gam, no_addend);
      for (int64_t x = 0; x < Cs * Vp; x += L) {
        store_vec(rhs + x, load_vec(sb.vc + x) - load_vec(rhs + x));
      }
      pump();
      for (int64_t i = 0; i < Cs; ++i) {
        for (int64_t j = 0; j < Cs; j += L) {
          store_vec(mat + i * Cs + j, load_vec(sb.A + i * Cs + j) * load_vec(sb.b + j));
        }
      }
      unit_lower_inverse<Cs>(mat, inv);
      pump();
      gemm(Cs, Vp, Cs, inv, Cs, rhs, Vp, sb.vw, Vp, no_scale, no_addend, acc_t(1), Tri::kLower);
    };

    // The forward walk over sub-chunk s (tokens [t0, t0 + n)): fills subs[s] and the state
    // after it, state[s + 1] (in states), from state[s].
    auto forward_sub = [&](int64_t s, int64_t t0, int64_t n, int64_t h, int64_t hv,
                           bool next_state) {
      Sub& sb = subs[s];
      sb.n = n;
      const acc_t* S0 = state[s];
      acc_t* S1 = &states[(s + 1) * SP];
      state[s + 1] = S1;
      rstd_rows(in.k, t0, n, h, sb.rk);
      load_rows(in.k, t0, n, Cs, H, h, K, Kp, sb.rk, acc_t(1), sb.kc);
      load_rows(in.v, t0, n, Cs, HV, hv, V, Vp, no_scale, acc_t(1), sb.vc);
      gather_columns(sb.kc, Cs, Kp, Cs, sb.kct);
      pump();
      std::fill(sb.E, sb.E + CC, acc_t(0));
      std::fill(sb.gam, sb.gam + Cs, acc_t(0));
      std::fill(sb.b, sb.b + Cs, acc_t(0));
      acc_t gam = 1;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t tok = t0 + i;
        const acc_t a = std::exp(in.g[tok * HV + hv]);
        gam *= a;
        sb.gam[i] = gam;
        sb.b[i] = in.beta[tok * HV + hv];
        for (int64_t j = 0; j < i; ++j) sb.E[i * Cs + j] = sb.E[(i - 1) * Cs + j] * a;
        sb.E[i * Cs + i] = 1;
      }
      gather_columns(sb.E, Cs, Cs, Cs, sb.ET);
      pump();
      gemm(Cs, Cs, Kp, sb.kc, Kp, sb.kct, Cs, mat, Cs, no_scale, no_addend);
      hadamard(CC, sb.E, mat, sb.A);
      for (int64_t i = 0; i < Cs; ++i) sb.A[i * Cs + i] = 0;
      if (vw_saved) {
        load_rows(vw_saved, t0, n, Cs, HV, hv, V, Vp, no_scale, acc_t(1), sb.vw);
      } else {
        solve_vw(sb, S0);
      }
      for (int64_t i = 0; i < Cs; ++i) {
        const acc_t* r = sb.vw + i * Vp;
        acc_t* ui = sb.u + i * Vp;
        for (int64_t d = 0; d < Vp; d += L) store_vec(ui + d, sb.b[i] * load_vec(r + d));
      }
      pump();
      if (!next_state) return;
      // S1 = gam_{n-1} S0 + sum_j E[n-1][j] k_j u_j^T
      for (int64_t r = 0; r < Kp; ++r) {
        for (int64_t j = 0; j < Cs; j += L) {
          store_vec(&tmp[r * Cs + j],
                    load_vec(sb.kct + r * Cs + j) * load_vec(sb.E + (n - 1) * Cs + j));
        }
      }
      gemm(Kp, Vp, Cs, tmp, Cs, sb.u, Vp, S1, Vp, no_scale, S0, sb.gam[n - 1]);
      pump();
    };

    for (int64_t task; (task = next_task.fetch_add(1)) < tasks;) {
      const BackwardTask tk = backward_task(p, in.cu, task);
      const int64_t h = tk.h, n = tk.n, bos = tk.bos, eos = tk.eos;
      const int64_t base = tk.base, nchunks = tk.nchunks;
      for (int64_t hv = h * G; hv < (h + 1) * G; ++hv) {
        const bool first_head = hv == h * G;  // assigns dq/dk rather than adding to them
        const bool last_head = hv == (h + 1) * G - 1;
        std::fill(dS, dS + SP, acc_t(0));
        if (grad_ht) {
          const acc_t* src = grad_ht + (n * HV + hv) * KV;
          for (int64_t r = 0; r < K; ++r) std::copy(src + r * V, src + (r + 1) * V, &dS[r * Vp]);
        }
        for (int64_t c = nchunks - 1; c >= 0; --c) {
          const int64_t t0 = bos + c * C, len = std::min(C, eos - t0);
          const int64_t ns = gdn_num_chunks(len, Cs);
          const acc_t* ck = ckpt + ((base + c) * HV + hv) * KV;
          state[0] = padded_state(ck, states);
          ahead.restart();  // this chunk's q and go rows, for its backward walk
          for (int64_t s = ns - 1; s >= 0; --s) {
            const int64_t t = t0 + s * Cs, n = std::min(Cs, len - s * Cs);
            ahead.add(in.q, t, n, H, h, K, sizeof(in_t));
            ahead.add(grad_o, t, n, HV, hv, V, sizeof(in_t));
          }
          for (int64_t s = 0; s < ns; ++s) {
            forward_sub(s, t0 + s * Cs, std::min(Cs, len - s * Cs), h, hv, s + 1 < ns);
          }
          ahead.restart();  // the k and v rows of the chunk before, for its forward walk
          if (c > 0) ahead.add(ck - HV * KV, 0, 1, 1, 0, KV, sizeof(acc_t));  // its checkpoint
          for (int64_t t = t0 - C; c > 0 && t < t0; t += Cs) {
            const int64_t n = std::min(Cs, t0 - t);
            ahead.add(in.k, t, n, H, h, K, sizeof(in_t));
            ahead.add(in.v, t, n, HV, hv, V, sizeof(in_t));
            if (vw_saved) ahead.add(vw_saved, t, n, HV, hv, V, sizeof(acc_t));
          }
          for (int64_t s = ns - 1; s >= 0; --s) {
            const Sub& sb = subs[s];
            const int64_t s0 = t0 + s * Cs, m = sb.n;
            acc_t* const dqr = grad_rows + (step++ % 2) * Cs * (2 * Kp + Vp);
            acc_t* const dkr = dqr + Cs * Kp;
            acc_t* const dvr = dkr + Cs * Kp;
            const acc_t* S0 = state[s];
            // dg's terms, in double: <dSn, S0> (exact: one K x V dot per Cs tokens, against
            // the products' ~7 Cs), and per token gam_t (qs_t . S0 go_t + k_t . S0 dw_t)
            // and E[n-1][t] (k_t . dSn u_t)
            const double dsn_s0 = dot_f64(SP, dS, S0);
            double gam_terms[Cs], dsn_terms[Cs];
            pump();
            rstd_rows(in.q, s0, m, h, rq);
            // q rows unscaled: scale goes into the products that use them.
            load_rows(in.q, s0, m, Cs, H, h, K, Kp, rq, acc_t(1), qs);
            for (int64_t t = 0; t < Cs; ++t) {
              sgam[t] = in.scale * sb.gam[t];
              sgam[Cs + t] = sb.gam[t];
            }
            load_rows(grad_o, s0, m, Cs, HV, hv, V, Vp, no_scale, acc_t(1), dOc);
            gather_columns(qs, Cs, Kp, 2 * Cs, qkt);  // columns [0, Cs): qs^T
            for (int64_t t = 0; t < Cs; ++t) elast[t] = sb.E[(m - 1) * Cs + t];
            pump();
            // du = E[n-1][t] dSn^T k_t + sum_{j>=t} E[j][t] (qs_j . k_t) go_j
            //      - sum_{j>t} A[j][t] b_j du_j,
            // i.e. (I + diag(b) A)^T du = the first two terms: du = inverse^T x them.
            gemm(Cs, Vp, Kp, sb.kc, Kp, dS, Vp, rhs, Vp, elast, no_addend);
            gemm(Cs, Cs, Kp, sb.kc, Kp, qkt, 2 * Cs, mat, Cs, no_scale, no_addend);
            std::copy(mat, mat + CC, kq);
            hadamard(CC, sb.ET, mat, mat, in.scale);
            gemm(Cs, Vp, Cs, mat, Cs, dOc, Vp, rhs, Vp, no_scale, rhs, acc_t(1), Tri::kUpper);
            pump();
            for (int64_t i = 0; i < Cs; ++i) {
              for (int64_t j = 0; j < Cs; j += L) {
                store_vec(mat + i * Cs + j, sb.b[i] * load_vec(sb.A + i * Cs + j));
              }
            }
            unit_lower_inverse<Cs>(mat, mat2);
            gather_columns(mat2, Cs, Cs, Cs, inv);
            gemm(Cs, Vp, Cs, inv, Cs, rhs, Vp, du, Vp, no_scale, no_addend, acc_t(1), Tri::kUpper);
            for (int64_t x = 0; x < Cs * Vp; x += L) {
              store_vec(dW + x, -sb.b[x / Vp] * load_vec(du + x));
            }
            pump();
            // dq / scale = gam S0 go + sum_{j<=t} E[t][j] (go_t . u_j) k_j
            gather_columns(sb.u, Cs, Vp, Cs, ut);
            gather_columns(S0, Kp, Vp, Kp, S0T);
            pump();
            // [go; dw] u^T and [go; dw] S0^T (the latter's rows scaled by scale gam and gam)
            gemm(2 * Cs, Cs, Vp, ow, Vp, ut, Cs, gu, Cs, no_scale, no_addend);
            gemm(2 * Cs, Kp, Vp, ow, Vp, S0T, Kp, dqr, Kp, sgam, no_addend);
            for (int64_t t = 0; t < m; ++t) {
              gam_terms[t] = dot_f64(Kp, qs + t * Kp, dqr + t * Kp) +
                             dot_f64(Kp, sb.kc + t * Kp, dkr + t * Kp);
            }
            hadamard(CC, sb.E, gu, mat, in.scale);
            gemm(Cs, Kp, Cs, mat, Cs, sb.kc, Kp, dqr, Kp, no_scale, dqr, acc_t(1), Tri::kLower);
            // dk = E[n-1][t] dSn u_t + gam_t S0 dw_t + sum_{j>=t} E[j][t] (go_j . u_t) qs_j
            //      + (sum_{j>t} E[j][t] (dw_j . u_t) + sum_{j<t} E[t][j] (dw_t . u_j)) k_j
            // (dSn u_t as the Kp x Cs product dSn u^T transposed: a quarter of the values
            // to transpose that dSn^T would need)
            gemm(Kp, Cs, Vp, dS, Vp, ut, Cs, tmp, Cs, no_scale, no_addend);
            gather_columns(tmp, Kp, Cs, Kp, dsu);
            for (int64_t t = 0; t < m; ++t) {
              dsn_terms[t] = double(elast[t]) * dot_f64(Kp, sb.kc + t * Kp, dsu + t * Kp);
            }
            for (int64_t t = 0; t < Cs; ++t) {
              for (int64_t d = 0; d < Kp; d += L) {
                store_vec(dkr + t * Kp + d,
                          load_vec(dkr + t * Kp + d) + elast[t] * load_vec(dsu + t * Kp + d));
              }
            }
            gather_columns(gu, Cs, Cs, Cs, mat2);
            hadamard(CC, sb.ET, mat2, mat, in.scale);
            gemm(Cs, Kp, Cs, mat, Cs, qs, Kp, dkr, Kp, no_scale, dkr, acc_t(1), Tri::kUpper);
            gather_columns(wu, Cs, Cs, Cs, mat2);
            hadamard(CC, sb.ET, mat2, mat);
            hadamard(CC, sb.E, wu, mat2);
            for (int64_t x = 0; x < CC; x += L) {
              store_vec(&mat[x], load_vec(&mat[x]) + load_vec(&mat2[x]));
            }
            for (int64_t t = 0; t < Cs; ++t) mat[t * Cs + t] = 0;
            gemm(Cs, Kp, Cs, mat, Cs, sb.kc, Kp, dkr, Kp, no_scale, dkr);
            pump();
            // dS0 = gam_{n-1} dSn + [gam qs | gam k]^T [go; dw]
            for (int64_t r = 0; r < Kp; ++r) {
              acc_t* x = &qkt[r * 2 * Cs];
              for (int64_t j = 0; j < Cs; j += L) {
                store_vec(x + j, load_vec(x + j) * load_vec(sgam + j));
                store_vec(x + Cs + j, load_vec(sb.kct + r * Cs + j) * load_vec(sb.gam + j));
              }
            }
            gemm(Kp, Vp, 2 * Cs, qkt, 2 * Cs, ow, Vp, dS, Vp, no_scale, dS, sb.gam[m - 1]);
            pump();
            // The sub-chunk's gradients. Per-token sums first, as lane vectors reduced eight
            // tokens at a time; then dg (see the top of the file), last token first:
            // dg_t = gam_{n-1} <dSn, S0> + sum_{i>=t} gam_terms[i] + sum_{j<t} dsn_terms[j]
            //        + sum_{j<t} col[j],  col[j] = sum_{i>=t} Z[i][j] (a row more per token),
            // in double and by sums alone: no term enters that the result does not hold.
            for (int64_t t = 0; t < Cs; ++t) {
              lanes[2 * Cs + t] = dot_lanes(Vp, du + t * Vp, sb.vw + t * Vp);
            }
            hsum_columns(lanes + 2 * Cs, Cs, sums + 2 * Cs);
            gather_columns(kq, Cs, Cs, Cs, mat2);  // qs_i . k_j
            for (int64_t x = 0; x < CC; x += L) {  // Z (E and A: zero above the diagonal)
              store_vec(mat + x, in.scale * (load_vec(sb.E + x) * load_vec(mat2 + x)) *
                                     load_vec(gu + x) + load_vec(sb.A + x) * load_vec(wu + x));
            }
            for (int64_t t = 0; t < Cs; ++t) mat[t * Cs + t] = 0;
            double dsn_before[Cs], dsn_sum = 0;
            for (int64_t t = 0; t < m; ++t) {
              dsn_before[t] = dsn_sum;
              dsn_sum += dsn_terms[t];
            }
            using vd = Vec256<double>;
            constexpr int64_t LD = 4, NC = Cs / LD;
            static_assert(Cs == 16, "kFirstLanes' size");
            vd col[NC] = {};
            const double base = double(sb.gam[m - 1]) * dsn_s0;
            double gam_suffix = 0;
            for (int64_t t = m - 1; t >= 0; --t) {
              gam_suffix += gam_terms[t];
              vd straddle = {};
              for (int64_t c = 0; c < NC; ++c) {
                typedef acc_t row4 __attribute__((vector_size(LD * sizeof(acc_t))));
                row4 z;
                std::memcpy(&z, mat + t * Cs + c * LD, sizeof(z));
                col[c] += __builtin_convertvector(z, vd);
                straddle += col[c] * load_vec(kFirstLanes[t] + c * LD);
              }
              dg[(s0 + t) * HV + hv] =
                  acc_t(base + gam_suffix + dsn_before[t] + hsum<double>(straddle));
              dbeta[(s0 + t) * HV + hv] = sums[2 * Cs + t];
            }
            drain.flush();  // the rows of the step before (the other set)
            for (int64_t t = 0; t < m; ++t) {
              acc_t* dv_row = dv + ((s0 + t) * HV + hv) * V;
              const acc_t* dut = du + t * Vp;
              const acc_t bt = sb.b[t];
              if (V % L == 0) {
                acc_t* x = dvr + t * Vp;
                for (int64_t d = 0; d < V; d += L) store_vec(x + d, bt * load_vec(dut + d));
                drain.rows.push_back({dv_row, x, V});
              } else {
                for (int64_t d = 0; d < V; ++d) dv_row[d] = bt * dut[d];
              }
            }
            // dq, dk of a q/k head sum over its value heads: the last one reads the others'
            // sum back, finishes the rows (l2norm's backward) and streams them out.
            if (last_head && !first_head) {
              for (int64_t t = 0; t < m; ++t) {
                put_row<true>(dqr + t * Kp, dq + ((s0 + t) * H + h) * K, K);
                put_row<true>(dkr + t * Kp, dk + ((s0 + t) * H + h) * K, K);
              }
            }
            if (in.l2norm && last_head) {
              // l2norm's backward from the normalized rows y = r x at hand (qs, kc):
              // dx = r (dy - y (y . dy)).
              for (int64_t t = 0; t < Cs; ++t) {
                lanes[t] = dot_lanes(Kp, qs + t * Kp, dqr + t * Kp);
                lanes[Cs + t] = dot_lanes(Kp, sb.kc + t * Kp, dkr + t * Kp);
              }
              for (int64_t i = 0; i < 2; ++i) hsum_columns(lanes + i * Cs, Cs, sums + i * Cs);
              for (int64_t t = 0; t < m; ++t) {
                const acc_t *y = qs + t * Kp, *yk = sb.kc + t * Kp;
                acc_t *x = dqr + t * Kp, *xk = dkr + t * Kp;
                for (int64_t d = 0; d < Kp; d += L) {
                  store_vec(x + d, rq[t] * (load_vec(x + d) - sums[t] * load_vec(y + d)));
                  store_vec(xk + d,
                            sb.rk[t] * (load_vec(xk + d) - sums[Cs + t] * load_vec(yk + d)));
                }
              }
            }
            for (int64_t t = 0; t < m; ++t) {
              acc_t* dq_row = dq + ((s0 + t) * H + h) * K;
              acc_t* dk_row = dk + ((s0 + t) * H + h) * K;
              if (last_head && K % L == 0) {
                drain.rows.push_back({dq_row, dqr + t * Kp, K});
                drain.rows.push_back({dk_row, dkr + t * Kp, K});
              } else if (last_head || first_head) {
                put_row<false>(dq_row, dqr + t * Kp, K);
                put_row<false>(dk_row, dkr + t * Kp, K);
              } else {
                put_row<true>(dq_row, dqr + t * Kp, K);
                put_row<true>(dk_row, dkr + t * Kp, K);
              }
            }
            pump();
          }
        }
        drain.flush();  // (the next value head reads the dq, dk sums back)
        if (dstate) {
          acc_t* dst = dstate + (n * HV + hv) * KV;
          for (int64_t r = 0; r < K; ++r) std::copy(&dS[r * Vp], &dS[r * Vp] + V, dst + r * V);
        }
      }
    }
#if defined(__AVX__)
    _mm_sfence();  // the streamed rows are visible before the parallel region ends
#endif
  });
}

}  // namespace
}  // namespace rlx
