// Gated delta rule on the CPU: token-by-token recurrence with float32 (float64) state.
//
// Per (sequence, value head hv), state S in R^{K x V}, q/k head h = hv / (HV / H):
//   P = diag(a_t) S_{t-1}, a_t = exp(g_t)      (one gate per head, or one per key channel)
//   w = P^T k_t,  u = beta_t (v_t - w),  S_t = P + k_t u^T,  o_t = scale S_t^T q_t
// Forward: parallel over (sequence, hv, V-block) -- the columns of S evolve independently --
// and keeps S every C tokens in the checkpoint buffer (gdn_backward_layout.h).
// Backward: parallel over (sequence, q/k head); for each value head of the group it walks
// the chunks backwards, recomputes the chunk's states from its checkpoint in L2-sized
// sub-chunks (see backward_kernel), and runs the reverse recurrence for dS over them. dq/dk of a group are summed over its
// value heads in a fixed order, so results are bitwise reproducible.
// The only exponentials are exp(g_t) of the inputs themselves (<= 1 for the log-space
// decays g <= 0 the op is meant for); nothing is ever divided by a decay.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "rlx/gdn_backward_layout.h"
#include "rlx/gdn_checks.h"

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

// Row-major [K, V] state <-> column-major [V, K] scratch with column stride ld >= K.
template <typename acc_t>
inline void gather_columns(const acc_t* src, int64_t K, int64_t V, int64_t ld, acc_t* dst) {
  for (int64_t r = 0; r < K; ++r) {
    for (int64_t j = 0; j < V; ++j) dst[j * ld + r] = src[r * V + j];
  }
}
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

// NV vectors (NV * 32 bytes of columns) per call, accumulators held in vector registers.
template <int64_t NV, typename acc_t>
inline void step_rows_block(acc_t* __restrict S, int64_t K, int64_t ld,
                            const acc_t* __restrict a, const acc_t* __restrict kv,
                            const acc_t* __restrict qs, const acc_t* __restrict vv, acc_t b,
                            acc_t* __restrict o) {
  using vec = Vec256<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  vec w[NV] = {}, u[NV], out[NV] = {};
  for (int64_t r = 0; r < K; ++r) {
    const acc_t* s = S + r * ld;
    const acc_t f = a[r] * kv[r];
    for (int64_t n = 0; n < NV; ++n) w[n] += f * load_vec(s + n * L);
  }
  for (int64_t n = 0; n < NV; ++n) u[n] = b * (load_vec(vv + n * L) - w[n]);
  for (int64_t r = 0; r < K; ++r) {
    acc_t* s = S + r * ld;
    const acc_t ar = a[r], kr = kv[r], qr = qs[r];
    for (int64_t n = 0; n < NV; ++n) {
      const vec x = ar * load_vec(s + n * L) + kr * u[n];
      store_vec(s + n * L, x);
      out[n] += qr * x;
    }
  }
  std::memcpy(o, out, sizeof(out));
}

// Tail columns (fewer than one vector), one at a time.
template <typename acc_t>
inline void step_rows_column(acc_t* S, int64_t K, int64_t ld, const acc_t* a, const acc_t* kv,
                             const acc_t* qs, acc_t vj, acc_t b, acc_t* o) {
  acc_t w = 0, out = 0;
  for (int64_t r = 0; r < K; ++r) w += a[r] * kv[r] * S[r * ld];
  const acc_t u = b * (vj - w);
  for (int64_t r = 0; r < K; ++r) {
    const acc_t x = a[r] * S[r * ld] + kv[r] * u;
    S[r * ld] = x;
    out += qs[r] * x;
  }
  *o = out;
}

template <typename acc_t>
inline void step_rows(acc_t* S, int64_t K, int64_t nv, const acc_t* a, const acc_t* kv,
                      const acc_t* qs, const acc_t* vv, acc_t b, acc_t* o) {
  constexpr int64_t L = 32 / sizeof(acc_t);
  int64_t j = 0;
  for (; j + 4 * L <= nv; j += 4 * L) step_rows_block<4>(S + j, K, nv, a, kv, qs, vv + j, b, o + j);
  for (; j + L <= nv; j += L) step_rows_block<1>(S + j, K, nv, a, kv, qs, vv + j, b, o + j);
  for (; j < nv; ++j) step_rows_column(S + j, K, nv, a, kv, qs, vv[j], b, o + j);
}

template <typename in_t, typename acc_t>
void forward_kernel(const GdnProblem& p, const Views<in_t, acc_t>& in, const acc_t* h0,
                    in_t* out, acc_t* ht, acc_t* ckpt) {
  const int64_t K = p.head_k_dim, V = p.head_v_dim, HV = p.num_v_heads, C = p.chunk;
  // Column blocks keep the state block in L1 (<= 32 KiB; 16 KiB blocks measured ~20%
  // slower on one thread for K = V = 128) and give every thread work.
  const int64_t threads = at::get_num_threads();
  int64_t BV = V;
  auto tasks_for = [&](int64_t bv) { return p.num_seqs * HV * ((V + bv - 1) / bv); };
  while (BV > 16 && (K * BV * int64_t(sizeof(acc_t)) > 32768 || tasks_for(BV) < 2 * threads)) {
    BV = (BV / 2 + 7) / 8 * 8;
  }
  const int64_t nvb = (V + BV - 1) / BV;
  at::parallel_for(0, p.num_seqs * HV * nvb, 1, [&](int64_t begin, int64_t end) {
    AccVec<acc_t> S(K * BV), a(K), kv(K), qs(K), vv(BV), o(BV);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t vb = task % nvb, hv = (task / nvb) % HV, n = task / (nvb * HV);
      const int64_t h = hv / p.group(), v0 = vb * BV, nv = std::min(BV, V - v0);
      int64_t bos, eos;
      gdn_sequence_bounds(p, in.cu, n, &bos, &eos);
      const int64_t base = gdn_checkpoint_base(n, bos, C);
      // S is [K, nv] row-major here; states outside are [K, V].
      for (int64_t r = 0; r < K; ++r) {
        for (int64_t j = 0; j < nv; ++j) {
          S[r * nv + j] = h0 ? h0[((n * HV + hv) * K + r) * V + v0 + j] : acc_t(0);
        }
      }
      auto store_state = [&](acc_t* dst) {
        for (int64_t r = 0; r < K; ++r) {
          std::memcpy(dst + r * V + v0, &S[r * nv], nv * sizeof(acc_t));
        }
      };
      for (int64_t tok = bos; tok < eos; ++tok) {
        if (C > 0 && (tok - bos) % C == 0) {
          store_state(ckpt + ((base + (tok - bos) / C) * HV + hv) * K * V);
        }
        load_decay(p, in.g, tok, hv, a.data());
        load_row(in.k, tok, p.num_qk_heads, h, K, kv.data());
        load_row(in.q, tok, p.num_qk_heads, h, K, qs.data());
        for (int64_t r = 0; r < K; ++r) qs[r] *= in.scale;
        const in_t* vsrc = in.v + (tok * HV + hv) * V + v0;
        for (int64_t j = 0; j < nv; ++j) vv[j] = static_cast<acc_t>(vsrc[j]);
        step_rows(S.data(), K, nv, a.data(), kv.data(), qs.data(), vv.data(),
                  in.beta[tok * HV + hv], o.data());
        in_t* odst = out + (tok * HV + hv) * V + v0;
        for (int64_t j = 0; j < nv; ++j) odst[j] = static_cast<in_t>(o[j]);
      }
      store_state(ht + (n * HV + hv) * K * V);
    }
  });
}

// Recomputes one token on all V columns of a column-major state: dst = P + k u^T with
// P = diag(a) src, u = b (v - P^T k); stores v - P^T k per column in vw. Row blocks
// outside, columns inside, like reverse_step.
template <typename acc_t>
inline void recompute_step(const acc_t* __restrict src, acc_t* __restrict dst, int64_t K,
                           int64_t V, int64_t ld, const acc_t* __restrict a, const acc_t* __restrict kv,
                           const acc_t* __restrict vv, acc_t b, acc_t* __restrict vw,
                           Vec256<acc_t>* __restrict w_part) {
  using vec = Vec256<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  const int64_t Kv = K / L * L;
  for (int64_t j = 0; j < V; ++j) {
    w_part[j] = vec{};
    vw[j] = 0;  // first collects the tail rows' share of w_j
  }
  for (int64_t rb = 0; rb < Kv; rb += L) {
    const vec f8 = load_vec(a + rb) * load_vec(kv + rb);
    for (int64_t j = 0; j < V; ++j) w_part[j] += f8 * load_vec(src + j * ld + rb);
  }
  for (int64_t r = Kv; r < K; ++r) {
    const acc_t f = a[r] * kv[r];
    for (int64_t j = 0; j < V; ++j) vw[j] += f * src[j * ld + r];
  }
  for (int64_t j = 0; j < V; ++j) {
    acc_t w = vw[j];
    for (int64_t l = 0; l < L; ++l) w += w_part[j][l];
    vw[j] = vv[j] - w;
  }
  for (int64_t rb = 0; rb < Kv; rb += L) {
    const vec a8 = load_vec(a + rb), k8 = load_vec(kv + rb);
    for (int64_t j = 0; j < V; ++j) {
      const int64_t i = j * ld + rb;
      store_vec(dst + i, a8 * load_vec(src + i) + k8 * (b * vw[j]));
    }
  }
  for (int64_t r = Kv; r < K; ++r) {
    for (int64_t j = 0; j < V; ++j) dst[j * ld + r] = a[r] * src[j * ld + r] + kv[r] * b * vw[j];
  }
}

// Reverse step of one token over all V columns. dS (column-major) holds dL/dS_t on entry
// and dL/dS_{t-1} on exit. Per column j, with u_j = b vw_j:
//   P = diag(a) S_{t-1},  S_t = P + k u^T  (rebuilt from S_{t-1}: one state read, not two)
//   o = S_t^T qs:        dS_j += qs go_j,  dq += go_j S_t[:, j]
//   S_t = P + k u^T:      dk += u_j dS_j,   du_j = dS_j . k
//   u = b (v - P^T k):    dv_j = b du_j, dbeta += du_j vw_j, dw_j = -b du_j
//   (w = P^T k)           dP_j = dS_j + dw_j k,  dk += dw_j P_j
//   P = diag(a) S_{t-1}:  dg += dP_j * P_j (per channel),  dS_j <- a * dP_j
//
// Loops run over blocks of L rows (one vector) outside and columns inside, so dq, dk and dg
// of a row block stay in registers while the columns stream by; du_j, a reduction down a
// column, accumulates per column as a vector and is summed once at the end. Columns go in
// pairs with separate accumulators for even and odd columns, so no FMA waits on the previous
// one's latency.
template <typename acc_t>
inline void reverse_step(const acc_t* __restrict Sp, acc_t* __restrict dS, int64_t K,
                         int64_t V, int64_t ld, const acc_t* __restrict a, const acc_t* __restrict kv,
                         const acc_t* __restrict qs, const acc_t* __restrict go,
                         const acc_t* __restrict vw, acc_t b, acc_t* __restrict dq,
                         acc_t* __restrict dk, acc_t* __restrict dg, acc_t* __restrict dv,
                         acc_t* __restrict dbeta, Vec256<acc_t>* __restrict du_part,
                         acc_t* __restrict dw) {
  using vec = Vec256<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  const int64_t Kv = K / L * L, V2 = V / 2 * 2;
  for (int64_t j = 0; j < V; ++j) {
    du_part[j] = vec{};
    dw[j] = 0;  // first collects the tail rows' share of du_j
  }
  // Pass 1: dS += qs go^T; dq = S_t go; dk = dS u; du_j = dS_j . k.
  for (int64_t rb = 0; rb < Kv; rb += L) {
    const vec q8 = load_vec(qs + rb), k8 = load_vec(kv + rb), a8 = load_vec(a + rb);
    vec dq8 = {}, dk8 = {}, dq8b = {}, dk8b = {};
    auto column = [&](int64_t j, vec& dqa, vec& dka) {
      const int64_t i = j * ld + rb;
      const acc_t goj = go[j], uj = b * vw[j];
      const vec St = a8 * load_vec(Sp + i) + k8 * uj;
      const vec d = load_vec(dS + i) + q8 * goj;
      store_vec(dS + i, d);
      dqa += goj * St;
      dka += uj * d;
      du_part[j] += d * k8;
    };
    for (int64_t j = 0; j < V2; j += 2) {
      column(j, dq8, dk8);
      column(j + 1, dq8b, dk8b);
    }
    if (V2 < V) column(V2, dq8, dk8);
    store_vec(dq + rb, dq8 + dq8b);
    store_vec(dk + rb, dk8 + dk8b);
  }
  for (int64_t r = Kv; r < K; ++r) {
    acc_t dqr = 0, dkr = 0;
    for (int64_t j = 0; j < V; ++j) {
      const int64_t i = j * ld + r;
      const acc_t uj = b * vw[j];
      const acc_t St = a[r] * Sp[i] + kv[r] * uj;
      const acc_t d = dS[i] + qs[r] * go[j];
      dS[i] = d;
      dqr += go[j] * St;
      dkr += uj * d;
      dw[j] += d * kv[r];  // the tail rows' share of du_j
    }
    dq[r] = dqr;
    dk[r] = dkr;
  }
  acc_t db = 0;
  for (int64_t j = 0; j < V; ++j) {
    acc_t du = dw[j];
    for (int64_t l = 0; l < L; ++l) du += du_part[j][l];
    dv[j] = b * du;
    db += du * vw[j];
    dw[j] = -b * du;
  }
  *dbeta = db;
  // Pass 2: dP = dS + k dw^T; dk += P dw; dg = sum_j dP * P; dS = diag(a) dP.
  for (int64_t rb = 0; rb < Kv; rb += L) {
    const vec a8 = load_vec(a + rb), k8 = load_vec(kv + rb);
    vec dk8 = load_vec(dk + rb), dg8 = {}, dk8b = {}, dg8b = {};
    auto column = [&](int64_t j, vec& dka, vec& dga) {
      const int64_t i = j * ld + rb;
      const vec P = a8 * load_vec(Sp + i);
      const vec dP = load_vec(dS + i) + k8 * dw[j];
      dka += dw[j] * P;
      dga += dP * P;
      store_vec(dS + i, a8 * dP);
    };
    for (int64_t j = 0; j < V2; j += 2) {
      column(j, dk8, dg8);
      column(j + 1, dk8b, dg8b);
    }
    if (V2 < V) column(V2, dk8, dg8);
    store_vec(dk + rb, dk8 + dk8b);
    store_vec(dg + rb, dg8 + dg8b);
  }
  for (int64_t r = Kv; r < K; ++r) {
    acc_t dkr = dk[r], dgr = 0;
    for (int64_t j = 0; j < V; ++j) {
      const int64_t i = j * ld + r;
      const acc_t P = a[r] * Sp[i];
      const acc_t dP = dS[i] + kv[r] * dw[j];
      dkr += dw[j] * P;
      dgr += dP * P;
      dS[i] = a[r] * dP;
    }
    dk[r] = dkr;
    dg[r] = dgr;
  }
}

template <typename in_t, typename acc_t>
void backward_kernel(const GdnProblem& p, const Views<in_t, acc_t>& in, const acc_t* ckpt,
                     const in_t* grad_o, const acc_t* grad_ht, const GdnBackwardLayout& lay,
                     acc_t* buf) {
  const int64_t K = p.head_k_dim, V = p.head_v_dim, H = p.num_qk_heads, HV = p.num_v_heads;
  const int64_t C = p.chunk, KV = K * V, G = p.group();
  // Scratch states are column-major with a padded column stride; SV values each.
  const int64_t ld = padded_column_stride<acc_t>(K), SV = V * ld;
  acc_t *dq = buf + lay.dq.offset, *dk = buf + lay.dk.offset, *dv = buf + lay.dv.offset;
  acc_t *dg = buf + lay.dg.offset, *dbeta = buf + lay.dbeta.offset;
  acc_t* dstate = p.has_initial_state ? buf + lay.dstate.offset : nullptr;
  // One task per (sequence, q/k head): the value heads of its group run in order and sum
  // into the same dq/dk rows, so no two threads write the same gradient.
  // Sub-chunk length: its states take at most 8 MiB. Measured on the 2-core EPYC, a whole
  // chunk of 64 states (1.2 MiB for K = V = 64, 4.4 MiB for 128) streams from L2/L3 faster
  // than an extra recomputation walk costs (L2-sized sub-chunks of 256 KiB were 15-40%
  // slower), so sub-chunks only bound the scratch for very large states or chunks.
  const int64_t Cs =
      std::clamp<int64_t>((int64_t(8) << 20) / (SV * int64_t(sizeof(acc_t))), 1, C);
  at::parallel_for(0, p.num_seqs * H, 1, [&](int64_t begin, int64_t end) {
    // Two levels of recomputation bound the scratch: a chunk is first walked forward from
    // its checkpoint keeping only the state at every sub-chunk start (subs); then each
    // sub-chunk, last first, recomputes its Cs states (states[i] = S before its token i)
    // and runs the reverse recurrence over them. With Cs = C (the usual case) the first
    // walk does nothing.
    AccVec<acc_t> subs(gdn_num_chunks(C, Cs) * SV), states((Cs + 1) * SV), dS(SV), vws(Cs * V);
    AccVec<acc_t> a(K), kv(K), qs(K), vv(V), go(V), dqt(K), dkt(K), dgt(K), dw(V);
    std::vector<Vec256<acc_t>> du_part(V);
    // Recomputes tokens [tok0, tok0 + count) from states[0], filling states[1..count], vws.
    auto recompute = [&](int64_t tok0, int64_t count, int64_t h, int64_t hv) {
      for (int64_t i = 0; i < count; ++i) {
        const int64_t tok = tok0 + i;
        load_decay(p, in.g, tok, hv, a.data());
        load_row(in.k, tok, H, h, K, kv.data());
        load_row(in.v, tok, HV, hv, V, vv.data());
        recompute_step(&states[i * SV], &states[(i + 1) * SV], K, V, ld, a.data(), kv.data(),
                       vv.data(), in.beta[tok * HV + hv], &vws[i * V], du_part.data());
      }
    };
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % H, n = task / H;
      int64_t bos, eos;
      gdn_sequence_bounds(p, in.cu, n, &bos, &eos);
      const int64_t base = gdn_checkpoint_base(n, bos, C);
      const int64_t nchunks = gdn_num_chunks(eos - bos, C);
      for (int64_t hv = h * G; hv < (h + 1) * G; ++hv) {
        if (grad_ht) {
          gather_columns(grad_ht + (n * HV + hv) * KV, K, V, ld, dS.data());
        } else {
          std::fill(dS.begin(), dS.end(), acc_t(0));
        }
        for (int64_t c = nchunks - 1; c >= 0; --c) {
          const int64_t t0 = bos + c * C, len = std::min(C, eos - t0);
          const int64_t nsub = gdn_num_chunks(len, Cs);
          gather_columns(ckpt + ((base + c) * HV + hv) * KV, K, V, ld, subs.data());
          for (int64_t s = 0; s + 1 < nsub; ++s) {
            std::memcpy(states.data(), &subs[s * SV], SV * sizeof(acc_t));
            recompute(t0 + s * Cs, Cs, h, hv);
            std::memcpy(&subs[(s + 1) * SV], &states[Cs * SV], SV * sizeof(acc_t));
          }
          for (int64_t s = nsub - 1; s >= 0; --s) {
            const int64_t s0 = t0 + s * Cs, slen = std::min(Cs, t0 + len - s0);
            std::memcpy(states.data(), &subs[s * SV], SV * sizeof(acc_t));
            recompute(s0, slen, h, hv);
            for (int64_t i = slen - 1; i >= 0; --i) {  // reverse recurrence
              const int64_t tok = s0 + i;
              load_decay(p, in.g, tok, hv, a.data());
              load_row(in.k, tok, H, h, K, kv.data());
              load_row(in.q, tok, H, h, K, qs.data());
              for (int64_t r = 0; r < K; ++r) qs[r] *= in.scale;
              load_row(grad_o, tok, HV, hv, V, go.data());
              reverse_step(&states[i * SV], dS.data(), K, V, ld, a.data(),
                           kv.data(), qs.data(), go.data(), &vws[i * V], in.beta[tok * HV + hv],
                           dqt.data(), dkt.data(), dgt.data(), dv + (tok * HV + hv) * V,
                           dbeta + tok * HV + hv, du_part.data(), dw.data());
              acc_t* dq_row = dq + (tok * H + h) * K;
              acc_t* dk_row = dk + (tok * H + h) * K;
              for (int64_t r = 0; r < K; ++r) {
                dq_row[r] += in.scale * dqt[r];
                dk_row[r] += dkt[r];
              }
              if (p.gate_per_channel) {
                std::memcpy(dg + (tok * HV + hv) * K, dgt.data(), K * sizeof(acc_t));
              } else {
                acc_t sum = 0;
                for (int64_t r = 0; r < K; ++r) sum += dgt[r];
                dg[tok * HV + hv] = sum;
              }
            }
          }
        }
        if (dstate) scatter_columns(dS.data(), K, V, ld, dstate + (n * HV + hv) * KV);
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
                              const std::optional<at::Tensor>& cu, double scale) {
  return Views<in_t, acc_t>{q.data_ptr<in_t>(),    k.data_ptr<in_t>(),
                            v.data_ptr<in_t>(),    g.data_ptr<acc_t>(),
                            beta.data_ptr<acc_t>(), cu ? cu->data_ptr<int64_t>() : nullptr,
                            static_cast<acc_t>(scale)};
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
    int64_t chunk_size) {
  const GdnProblem p = gdn_check_inputs("rlx::gated_delta_fwd", q_in, k_in, v_in, g_in, beta_in,
                                        initial_state, cu_seqlens, chunk_size);
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
  zero_unused_slots(p, cu ? cu->data_ptr<int64_t>() : nullptr, ckpt);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "gated_delta_fwd",
                                  [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    forward_kernel<scalar_t, acc_t>(p, make_views<scalar_t, acc_t>(q, k, v, g, beta, cu, scale),
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
                               int64_t chunk_size) {
  const char* op = "rlx::gated_delta_bwd";
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
  // Zeroed: dq/dk accumulate over the value heads of a group.
  at::Tensor buf = at::zeros({lay.total}, q.options().dtype(p.acc_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "gated_delta_bwd",
                                  [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    backward_kernel<scalar_t, acc_t>(
        p, make_views<scalar_t, acc_t>(q, k, v, g, beta, cu, scale), ckpt.data_ptr<acc_t>(),
        grad_o.data_ptr<scalar_t>(), grad_ht ? grad_ht->data_ptr<acc_t>() : nullptr, lay,
        buf.data_ptr<acc_t>());
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
