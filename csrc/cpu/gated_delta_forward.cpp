// Gated delta rule on the CPU, forward: one pass over the state per token, keeping a
// checkpoint of the state every C tokens for the backward. Shared parts and the overview:
// gated_delta_common.h.
#include "cpu_kernel_deps.h"
#include "gated_delta_kernels.h"

RLX_ISA_BEGIN
#include "gated_delta_common.h"

namespace rlx {
namespace RLX_ISA_NS {
namespace {

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
  using vec = SimdVec<acc_t>;
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
  constexpr int64_t L = kVecLanes<acc_t>;
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

// u = b (v - w) over nv columns; with vw, v - w also goes there (the forward's vw output,
// gdn_keeps_vw), streamed past the caches when aligned: the backward reads it much later,
// and plain stores cost a read for ownership per line (prototype, in-process A/B at B=1
// T=2048 H=4 K=V=64, 2 threads: the forward 0.2-0.7 ms slower with plain stores, 0.02-0.08
// ms streamed).
template <typename in_t, typename acc_t>
inline void residual_row(const in_t* __restrict vt, const acc_t* __restrict w, acc_t b,
                         int64_t nv, acc_t* __restrict u, acc_t* __restrict vw, bool streamed) {
  using vec = SimdVec<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  int64_t j = 0;
  for (; j + L <= nv; j += L) {
    vec v8;
    if constexpr (std::is_same_v<in_t, acc_t>) {
      v8 = load_vec(vt + j);
    } else {
      for (int64_t l = 0; l < L; ++l) v8[l] = static_cast<acc_t>(vt[j + l]);
    }
    const vec x = v8 - load_vec(w + j);
    store_vec(u + j, b * x);
    if (vw) streamed ? stream_vec(vw + j, x) : store_vec(vw + j, x);
  }
  for (; j < nv; ++j) {
    const acc_t x = static_cast<acc_t>(vt[j]) - w[j];
    u[j] = b * x;
    if (vw) vw[j] = x;
  }
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
                    in_t* out, acc_t* ht, acc_t* ckpt, acc_t* vw_out) {
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
  // vw's block rows are vector-aligned when V and BV are multiples of a vector and vw is
  // (BV is a multiple of 8 floats: 16-float vectors need the second test).
  constexpr int64_t kLanes = kVecLanes<acc_t>;
  const bool vw_streamed = V % kLanes == 0 && BV % kLanes == 0 &&
                           reinterpret_cast<uintptr_t>(vw_out) % sizeof(SimdVec<acc_t>) == 0;
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
          // The next chunk's rows go to L2 meanwhile: the pass above is the first to read
          // them, a strided row at a time.
          for (int64_t tok = t0 + TC; tok < std::min(eos, t0 + 2 * TC); ++tok) {
            prefetch_rows_l2(in.q + (tok * H + h) * K, K * sizeof(in_t));
            prefetch_rows_l2(in.k + (tok * H + h) * K, K * sizeof(in_t));
          }
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
            // (across the chunk's end too: stopping there left the next chunk's first tokens
            // to read v and write o cold; forward 1.69 -> 1.64 ms median, 2 threads)
            if (tok + kPrefetchTokens < eos) {
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
            acc_t* vw_row = vw_out ? vw_out + (tok * HV + hv) * V + v0 : nullptr;
            residual_row(vt, w, b, nv, u.data(), vw_row, vw_streamed);
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
#if RLX_ISA_AVX
    _mm_sfence();  // vw's streamed rows are visible before the parallel region ends
#endif
  });
}

}  // namespace

template <typename in_t, typename acc_t>
void gdn_forward(const GdnProblem& p, const Views<in_t, acc_t>& in, const acc_t* h0, in_t* o,
                 acc_t* ht, acc_t* ckpt, acc_t* vw) {
  forward_kernel<in_t, acc_t>(p, in, h0, o, ht, ckpt, vw);
}

#define RLX_INSTANTIATE_FORWARD(in_t, acc_t)                                                 \
  template void gdn_forward<in_t, acc_t>(const GdnProblem&, const Views<in_t, acc_t>&,       \
                                         const acc_t*, in_t*, acc_t*, acc_t*, acc_t*);
RLX_GDN_INSTANTIATE(RLX_INSTANTIATE_FORWARD)

}  // namespace RLX_ISA_NS
}  // namespace rlx
RLX_ISA_END

#if !defined(RLX_ISA_AVX2_COPY) && !defined(RLX_ISA_AVX512_COPY)
// The op: host code, compiled once.
namespace rlx {
namespace {

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

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_delta_fwd_cpu(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& g_in, const at::Tensor& beta_in, double scale,
    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
    int64_t chunk_size, std::optional<double> l2norm_eps) {
  const GdnProblem p = gdn_check_inputs("rlx::gated_delta_fwd", q_in, k_in, v_in, g_in, beta_in,
                                        initial_state, cu_seqlens, chunk_size);
  gdn_check_l2norm_eps("rlx::gated_delta_fwd", l2norm_eps);
  if (p.input_dtype == at::kHalf || p.input_dtype == at::kBFloat16) {
    // 16-bit q, k, v run the float32 kernel on float32 copies: the kernel widens every element
    // it reads to float32 and rounds o once either way, so the results are the same, and the
    // kernels are compiled for two input types instead of four (half the build time and
    // code; the copies cost a pass over q, k, v and o next to the K x V work per token).
    auto out = gated_delta_fwd_cpu(q_in.to(at::kFloat), k_in.to(at::kFloat), v_in.to(at::kFloat),
                                   g_in, beta_in, scale, initial_state, cu_seqlens, chunk_size,
                                   l2norm_eps);
    std::get<0>(out) = std::get<0>(out).to(p.input_dtype);
    return out;
  }
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
  at::Tensor vw = gdn_keeps_vw(p) ? at::empty(v.sizes(), q.options().dtype(p.acc_dtype))
                                  : at::empty({0}, q.options().dtype(p.acc_dtype));
  advise_huge_pages(o);
  advise_huge_pages(ckpt);
  advise_huge_pages(vw);
  zero_unused_slots(p, cu ? cu->data_ptr<int64_t>() : nullptr, ckpt);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gated_delta_fwd", [&] {
    using acc_t = acc_type_t<scalar_t>;
    RLX_ISA_CALL_AVX512(gdn_forward<scalar_t, acc_t>)(
        p, make_views<scalar_t, acc_t>(q, k, v, g, beta, cu, scale, l2norm_eps),
        h0 ? h0->data_ptr<acc_t>() : nullptr, o.data_ptr<scalar_t>(), ht.data_ptr<acc_t>(),
        ckpt.data_ptr<acc_t>(), vw.numel() > 0 ? vw.data_ptr<acc_t>() : nullptr);
  });
  gdn_write_checkpoint_tag(ckpt, gdn_checkpoint_tag(p.chunk, l2norm_eps, gdn_keeps_vw(p)));
  return {o, ht, ckpt, vw};
}

}  // namespace rlx

TORCH_LIBRARY_IMPL(rlx, CPU, m) {
  m.impl("gated_delta_fwd", &rlx::gated_delta_fwd_cpu);
}
#endif
