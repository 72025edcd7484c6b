// Gated delta rule on the CPU, backward for one gate per head with g <= 0 (Gated DeltaNet's
// decays): the chunked (WY) form, where a block of Cs tokens is a handful of small matrix
// products instead of Cs passes over the state. gated_delta_backward.cpp picks it; the
// token-by-token backward (gated_delta_backward_recurrent.cpp) handles the other cases (a gate
// per key channel, or any g > 0, whose decay products could overflow here).
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
// vw comes from the forward when it kept it (gdn_keeps_vw; else ChunkedBackward::solve_vw).
// That is 7 products of a Cs x K (or V) block with a K x V state per sub-chunk (8 when vw is
// solved for), ~7 multiply-adds per state element and token where the token-by-token
// backward does ~8, plus the Cs x Cs products; they run as register-tiled matrix products
// (gemm, gated_delta_backward_chunked_ops.h) near the FMA peak instead of one pass over the
// state per token. Cs = 16: 8 and 32 were slower (fewer products per pass over a state; more
// Cs x Cs work).

#include "cpu_kernel_deps.h"
#include "gated_delta_kernels.h"

RLX_ISA_BEGIN
#include "gated_delta_backward.h"
#include "gated_delta_backward_chunked_ops.h"
#include "gated_delta_backward_chunked_scratch.h"
#include "gated_delta_backward_chunked_dg.h"

namespace rlx {
namespace RLX_ISA_NS {
namespace {

// One thread's walk over its tasks (sequence, q/k head): per value head, the chunks last
// first; per chunk, a forward walk over its sub-chunks from the checkpoint (forward_sub),
// then a backward walk, last sub-chunk first (backward_sub). The stages of a sub-chunk's
// backward follow the equations at the top of this file.
template <typename in_t, typename acc_t>
class ChunkedBackward {
 public:
  static constexpr int64_t L = kVecLanes<acc_t>, Cs = kCs, CC = kCC;

  ChunkedBackward(const GdnProblem& p, const Views<in_t, acc_t>& in, const acc_t* ckpt,
                  const acc_t* vw_saved, const in_t* grad_o, const acc_t* grad_ht,
                  const GdnBackwardLayout& lay, acc_t* buf)
      : p_(p), in_(in), ckpt_(ckpt), vw_saved_(vw_saved), grad_o_(grad_o), grad_ht_(grad_ht),
        K(p.head_k_dim), V(p.head_v_dim), H(p.num_qk_heads), HV(p.num_v_heads), C(p.chunk),
        KV(K * V), G(p.group()), Kp((K + L - 1) / L * L), Vp((V + L - 1) / L * L), SP(Kp * Vp),
        dq_(buf + lay.dq.offset), dk_(buf + lay.dk.offset), dv_(buf + lay.dv.offset),
        dg_(buf + lay.dg.offset), dbeta_(buf + lay.dbeta.offset),
        dstate_(p.has_initial_state ? buf + lay.dstate.offset : nullptr),
        s_(gdn_num_chunks(longest_chunk(p), Cs), Kp, Vp),
        block_(scratch_bytes<acc_t>(s_)),
        state_(s_.subs.size() + 1),
        lanes_(3 * Cs) {
    carve_scratch<acc_t>(s_, block_.get());
  }

  void run_task(int64_t task) {
    const BackwardTask tk = backward_task(p_, in_.cu, task);
    for (int64_t hv = tk.h * G; hv < (tk.h + 1) * G; ++hv) run_head(tk, hv);
  }

 private:
  static constexpr const acc_t* kNoScale = nullptr;   // gemm's rs: rows not scaled
  static constexpr const acc_t* kNoAddend = nullptr;  // gemm's X: C = the product

  // Input rows prefetched and gradient rows drained a few at a time, between products.
  void pump() {
    ahead_.fetch(kPumpLines);
    drain_.drain(kDrainRows);
  }

  // l2norm factors of rows [t0, t0 + n) of q or k (1 without l2norm).
  void rstd_rows(const in_t* x, int64_t t0, int64_t n, int64_t h, acc_t* out) const {
    if (in_.l2norm) {
      l2norm_rstd_rows(x + (t0 * H + h) * K, H * K, n, K, in_.l2norm_eps, out);
    } else {
      std::fill(out, out + n, acc_t(1));
    }
  }

  // A checkpoint as a padded state: read in place when it needs no padding (K, V multiples
  // of the vector length), else copied padded into dst.
  const acc_t* padded_state(const acc_t* src, acc_t* dst) const {
    if (K == Kp && V == Vp) return src;
    std::fill(dst, dst + SP, acc_t(0));
    for (int64_t r = 0; r < K; ++r) std::copy(src + r * V, src + (r + 1) * V, dst + r * Vp);
    return dst;
  }

  // One value head of a task: all its chunks, last first, from dS = grad_final_state.
  void run_head(const BackwardTask& tk, int64_t hv) {
    const bool first_head = hv == tk.h * G;  // assigns dq/dk rather than adding to them
    const bool last_head = hv == (tk.h + 1) * G - 1;
    acc_t* const dS = s_.dS;
    std::fill(dS, dS + SP, acc_t(0));
    if (grad_ht_) {
      const acc_t* src = grad_ht_ + (tk.n * HV + hv) * KV;
      for (int64_t r = 0; r < K; ++r) std::copy(src + r * V, src + (r + 1) * V, &dS[r * Vp]);
    }
    for (int64_t c = tk.nchunks - 1; c >= 0; --c) run_chunk(tk, hv, c, first_head, last_head);
    drain_.flush();  // (the next value head reads the dq, dk sums back)
    if (dstate_) {
      acc_t* dst = dstate_ + (tk.n * HV + hv) * KV;
      for (int64_t r = 0; r < K; ++r) std::copy(&dS[r * Vp], &dS[r * Vp] + V, dst + r * V);
    }
  }

  void run_chunk(const BackwardTask& tk, int64_t hv, int64_t c, bool first_head,
                 bool last_head) {
    const int64_t h = tk.h, t0 = tk.bos + c * C, len = std::min(C, tk.eos - t0);
    const int64_t ns = gdn_num_chunks(len, Cs);
    const acc_t* ck = ckpt_ + ((tk.base + c) * HV + hv) * KV;
    state_[0] = padded_state(ck, s_.states);
    ahead_.restart();  // this chunk's q and go rows, for its backward walk
    for (int64_t s = ns - 1; s >= 0; --s) {
      const int64_t t = t0 + s * Cs, n = std::min(Cs, len - s * Cs);
      ahead_.add(in_.q, t, n, H, h, K, sizeof(in_t));
      ahead_.add(grad_o_, t, n, HV, hv, V, sizeof(in_t));
    }
    for (int64_t s = 0; s < ns; ++s) {
      forward_sub(s, t0 + s * Cs, std::min(Cs, len - s * Cs), h, hv, s + 1 < ns);
    }
    ahead_.restart();  // the k and v rows of the chunk before, for its forward walk
    if (c > 0) ahead_.add(ck - HV * KV, 0, 1, 1, 0, KV, sizeof(acc_t));  // its checkpoint
    for (int64_t t = t0 - C; c > 0 && t < t0; t += Cs) {
      const int64_t n = std::min(Cs, t0 - t);
      ahead_.add(in_.k, t, n, H, h, K, sizeof(in_t));
      ahead_.add(in_.v, t, n, HV, hv, V, sizeof(in_t));
      if (vw_saved_) ahead_.add(vw_saved_, t, n, HV, hv, V, sizeof(acc_t));
    }
    for (int64_t s = ns - 1; s >= 0; --s) {
      backward_sub(s, t0 + s * Cs, h, hv, first_head, last_head);
    }
  }

  // vw of a sub-chunk when the forward did not keep it (sb's k and v rows, A, gam and b
  // filled): vw = v - gam S0^T k - sum_{j<i} A[i][j] u_j with u_j = b_j vw_j, i.e.
  // (I + A diag(b)) vw = v - gam S0^T k: the right-hand side, then vw = inverse x it.
  void solve_vw(SubChunk<acc_t>& sb, const acc_t* S0) {
    acc_t *const rhs = s_.rhs, *const mat = s_.mat;
    gemm(Cs, Vp, Kp, sb.kc, Kp, S0, Vp, rhs, Vp, sb.gam, kNoAddend);
    for (int64_t x = 0; x < Cs * Vp; x += L) {
      store_vec(rhs + x, load_vec(sb.vc + x) - load_vec(rhs + x));
    }
    pump();
    for (int64_t i = 0; i < Cs; ++i) {
      for (int64_t j = 0; j < Cs; j += L) {
        store_vec(mat + i * Cs + j, load_vec(sb.A + i * Cs + j) * load_vec(sb.b + j));
      }
    }
    unit_lower_inverse<Cs>(mat, s_.inv);
    pump();
    gemm(Cs, Vp, Cs, s_.inv, Cs, rhs, Vp, sb.vw, Vp, kNoScale, kNoAddend, acc_t(1), Tri::kLower);
  }

  // The forward walk over sub-chunk s (tokens [t0, t0 + n)): fills subs[s] and, when
  // next_state, the state after it, state[s + 1] (in states), from state[s].
  void forward_sub(int64_t s, int64_t t0, int64_t n, int64_t h, int64_t hv, bool next_state) {
    SubChunk<acc_t>& sb = s_.subs[s];
    sb.n = n;
    const acc_t* S0 = state_[s];
    acc_t* S1 = &s_.states[(s + 1) * SP];
    state_[s + 1] = S1;
    rstd_rows(in_.k, t0, n, h, sb.rk);
    load_rows(in_.k, t0, n, Cs, H, h, K, Kp, sb.rk, acc_t(1), sb.kc);
    load_rows(in_.v, t0, n, Cs, HV, hv, V, Vp, kNoScale, acc_t(1), sb.vc);
    gather_columns(sb.kc, Cs, Kp, Cs, sb.kct);
    pump();
    decay_products(sb, t0, n, hv);
    gather_columns(sb.E, Cs, Cs, Cs, sb.ET);
    pump();
    acc_t* const mat = s_.mat;
    gemm(Cs, Cs, Kp, sb.kc, Kp, sb.kct, Cs, mat, Cs, kNoScale, kNoAddend);
    hadamard(CC, sb.E, mat, sb.A);
    for (int64_t i = 0; i < Cs; ++i) sb.A[i * Cs + i] = 0;
    if (vw_saved_) {
      load_rows(vw_saved_, t0, n, Cs, HV, hv, V, Vp, kNoScale, acc_t(1), sb.vw);
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
    acc_t* const tmp = s_.tmp;
    for (int64_t r = 0; r < Kp; ++r) {
      for (int64_t j = 0; j < Cs; j += L) {
        store_vec(&tmp[r * Cs + j],
                  load_vec(sb.kct + r * Cs + j) * load_vec(sb.E + (n - 1) * Cs + j));
      }
    }
    gemm(Kp, Vp, Cs, tmp, Cs, sb.u, Vp, S1, Vp, kNoScale, S0, sb.gam[n - 1]);
    pump();
  }

  // gam, beta and E of the sub-chunk's n tokens from t0 (zero past them).
  void decay_products(SubChunk<acc_t>& sb, int64_t t0, int64_t n, int64_t hv) const {
    std::fill(sb.E, sb.E + CC, acc_t(0));
    std::fill(sb.gam, sb.gam + Cs, acc_t(0));
    std::fill(sb.b, sb.b + Cs, acc_t(0));
    acc_t gam = 1;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t tok = t0 + i;
      const acc_t a = std::exp(in_.g[tok * HV + hv]);
      gam *= a;
      sb.gam[i] = gam;
      sb.b[i] = in_.beta[tok * HV + hv];
      for (int64_t j = 0; j < i; ++j) sb.E[i * Cs + j] = sb.E[(i - 1) * Cs + j] * a;
      sb.E[i * Cs + i] = 1;
    }
  }

  // The backward walk over sub-chunk s (tokens from s0): dS goes from dL/dS_{n-1} to dL/dS0,
  // and the sub-chunk's gradient rows are written (dq, dk summed over a q/k head's value
  // heads).
  void backward_sub(int64_t s, int64_t s0, int64_t h, int64_t hv, bool first_head,
                    bool last_head) {
    const SubChunk<acc_t>& sb = s_.subs[s];
    acc_t* const dqr = s_.grad_rows + (step_++ % 2) * Cs * (2 * Kp + Vp);
    acc_t* const dkr = dqr + Cs * Kp;  // (right after dqr: one product fills both)
    acc_t* const dvr = dkr + Cs * Kp;
    const acc_t* S0 = state_[s];
    // dg's term <dSn, S0>, in double (exact: one K x V dot per Cs tokens, against the
    // products' ~7 Cs)
    const double dsn_s0 = dot_f64(SP, s_.dS, S0);
    DgTerms terms;
    pump();
    load_backward_rows(sb, s0, h, hv);
    solve_du(sb);
    grad_q(sb, S0, dqr, terms);
    grad_k(sb, dkr, terms);
    propagate_dS(sb);
    write_dg_dbeta(sb, s0, hv, dsn_s0, terms);
    drain_.flush();  // the rows of the step before (the other set)
    write_dv(sb, s0, hv, dvr);
    write_dq_dk(sb, s0, h, first_head, last_head, dqr, dkr);
    pump();
  }

  // The q rows (unscaled: scale goes into the products that use them), go rows, qs^T and
  // the row factors.
  void load_backward_rows(const SubChunk<acc_t>& sb, int64_t s0, int64_t h, int64_t hv) {
    const int64_t m = sb.n;
    rstd_rows(in_.q, s0, m, h, s_.rq);
    load_rows(in_.q, s0, m, Cs, H, h, K, Kp, s_.rq, acc_t(1), s_.qs);
    for (int64_t t = 0; t < Cs; ++t) {
      s_.sgam[t] = in_.scale * sb.gam[t];
      s_.sgam[Cs + t] = sb.gam[t];
    }
    load_rows(grad_o_, s0, m, Cs, HV, hv, V, Vp, kNoScale, acc_t(1), s_.go());
    gather_columns(s_.qs, Cs, Kp, 2 * Cs, s_.qkt);  // columns [0, Cs): qs^T
    for (int64_t t = 0; t < Cs; ++t) s_.elast[t] = sb.E[(m - 1) * Cs + t];
    pump();
  }

  // du = E[n-1][t] dSn^T k_t + sum_{j>=t} E[j][t] (qs_j . k_t) go_j
  //      - sum_{j>t} A[j][t] b_j du_j,
  // i.e. (I + diag(b) A)^T du = the first two terms: du = inverse^T x them; dw = -b du.
  void solve_du(const SubChunk<acc_t>& sb) {
    acc_t *const rhs = s_.rhs, *const mat = s_.mat, *const mat2 = s_.mat2, *const du = s_.du;
    gemm(Cs, Vp, Kp, sb.kc, Kp, s_.dS, Vp, rhs, Vp, s_.elast, kNoAddend);
    gemm(Cs, Cs, Kp, sb.kc, Kp, s_.qkt, 2 * Cs, mat, Cs, kNoScale, kNoAddend);
    std::copy(mat, mat + CC, s_.kq);
    hadamard(CC, sb.ET, mat, mat, in_.scale);
    gemm(Cs, Vp, Cs, mat, Cs, s_.go(), Vp, rhs, Vp, kNoScale, rhs, acc_t(1), Tri::kUpper);
    pump();
    for (int64_t i = 0; i < Cs; ++i) {
      for (int64_t j = 0; j < Cs; j += L) {
        store_vec(mat + i * Cs + j, sb.b[i] * load_vec(sb.A + i * Cs + j));
      }
    }
    unit_lower_inverse<Cs>(mat, mat2);
    gather_columns(mat2, Cs, Cs, Cs, s_.inv);
    gemm(Cs, Vp, Cs, s_.inv, Cs, rhs, Vp, du, Vp, kNoScale, kNoAddend, acc_t(1), Tri::kUpper);
    acc_t* const dW = s_.dw();
    for (int64_t x = 0; x < Cs * Vp; x += L) {
      store_vec(dW + x, -sb.b[x / Vp] * load_vec(du + x));
    }
    pump();
  }

  // dq / scale = gam S0 go + sum_{j<=t} E[t][j] (go_t . u_j) k_j; also the first terms of dk
  // (gam_t S0 dw_t, into dkr, which follows dqr), [go; dw] u^T for grad_k and dg's gam terms.
  void grad_q(const SubChunk<acc_t>& sb, const acc_t* S0, acc_t* dqr, DgTerms& terms) {
    gather_columns(sb.u, Cs, Vp, Cs, s_.ut);
    gather_columns(S0, Kp, Vp, Kp, s_.S0T);
    pump();
    // [go; dw] u^T and [go; dw] S0^T (the latter's rows scaled by scale gam and gam)
    gemm(2 * Cs, Cs, Vp, s_.ow, Vp, s_.ut, Cs, s_.gw, Cs, kNoScale, kNoAddend);
    gemm(2 * Cs, Kp, Vp, s_.ow, Vp, s_.S0T, Kp, dqr, Kp, s_.sgam, kNoAddend);
    const acc_t* const dkr = dqr + Cs * Kp;
    for (int64_t t = 0; t < sb.n; ++t) {
      terms.gam[t] = dot_f64(Kp, s_.qs + t * Kp, dqr + t * Kp) +
                     dot_f64(Kp, sb.kc + t * Kp, dkr + t * Kp);
    }
    hadamard(CC, sb.E, s_.gu(), s_.mat, in_.scale);
    gemm(Cs, Kp, Cs, s_.mat, Cs, sb.kc, Kp, dqr, Kp, kNoScale, dqr, acc_t(1), Tri::kLower);
  }

  // dk = E[n-1][t] dSn u_t + gam_t S0 dw_t + sum_{j>=t} E[j][t] (go_j . u_t) qs_j
  //      + (sum_{j>t} E[j][t] (dw_j . u_t) + sum_{j<t} E[t][j] (dw_t . u_j)) k_j
  // (dSn u_t as the Kp x Cs product dSn u^T transposed: a quarter of the values
  // to transpose that dSn^T would need); also dg's dSn terms.
  void grad_k(const SubChunk<acc_t>& sb, acc_t* dkr, DgTerms& terms) {
    acc_t *const mat = s_.mat, *const mat2 = s_.mat2, *const dsu = s_.dsu;
    gemm(Kp, Cs, Vp, s_.dS, Vp, s_.ut, Cs, s_.tmp, Cs, kNoScale, kNoAddend);
    gather_columns(s_.tmp, Kp, Cs, Kp, dsu);
    for (int64_t t = 0; t < sb.n; ++t) {
      terms.dsn[t] = double(s_.elast[t]) * dot_f64(Kp, sb.kc + t * Kp, dsu + t * Kp);
    }
    for (int64_t t = 0; t < Cs; ++t) {
      for (int64_t d = 0; d < Kp; d += L) {
        store_vec(dkr + t * Kp + d,
                  load_vec(dkr + t * Kp + d) + s_.elast[t] * load_vec(dsu + t * Kp + d));
      }
    }
    gather_columns(s_.gu(), Cs, Cs, Cs, mat2);
    hadamard(CC, sb.ET, mat2, mat, in_.scale);
    gemm(Cs, Kp, Cs, mat, Cs, s_.qs, Kp, dkr, Kp, kNoScale, dkr, acc_t(1), Tri::kUpper);
    gather_columns(s_.wu(), Cs, Cs, Cs, mat2);
    hadamard(CC, sb.ET, mat2, mat);
    hadamard(CC, sb.E, s_.wu(), mat2);
    for (int64_t x = 0; x < CC; x += L) {
      store_vec(&mat[x], load_vec(&mat[x]) + load_vec(&mat2[x]));
    }
    for (int64_t t = 0; t < Cs; ++t) mat[t * Cs + t] = 0;
    gemm(Cs, Kp, Cs, mat, Cs, sb.kc, Kp, dkr, Kp, kNoScale, dkr);
    pump();
  }

  // dS0 = gam_{n-1} dSn + [gam qs | gam k]^T [go; dw]
  void propagate_dS(const SubChunk<acc_t>& sb) {
    for (int64_t r = 0; r < Kp; ++r) {
      acc_t* x = &s_.qkt[r * 2 * Cs];
      for (int64_t j = 0; j < Cs; j += L) {
        store_vec(x + j, load_vec(x + j) * load_vec(s_.sgam + j));
        store_vec(x + Cs + j, load_vec(sb.kct + r * Cs + j) * load_vec(sb.gam + j));
      }
    }
    gemm(Kp, Vp, 2 * Cs, s_.qkt, 2 * Cs, s_.ow, Vp, s_.dS, Vp, kNoScale, s_.dS,
         sb.gam[sb.n - 1]);
    pump();
  }

  // dg and dbeta of the sub-chunk's tokens (gated_delta_backward_chunked_dg.h).
  void write_dg_dbeta(const SubChunk<acc_t>& sb, int64_t s0, int64_t hv, double dsn_s0,
                      const DgTerms& terms) {
    chunked_dg_dbeta(sb, s_, lanes_.data(), in_.scale, dsn_s0, terms, dg_ + s0 * HV + hv,
                     dbeta_ + s0 * HV + hv, HV);
  }

  // dv = b du: streamed out by the drain when its rows are whole vectors.
  void write_dv(const SubChunk<acc_t>& sb, int64_t s0, int64_t hv, acc_t* dvr) {
    for (int64_t t = 0; t < sb.n; ++t) {
      acc_t* dv_row = dv_ + ((s0 + t) * HV + hv) * V;
      const acc_t* dut = s_.du + t * Vp;
      const acc_t bt = sb.b[t];
      if (V % L == 0) {
        acc_t* x = dvr + t * Vp;
        for (int64_t d = 0; d < V; d += L) store_vec(x + d, bt * load_vec(dut + d));
        drain_.rows.push_back({dv_row, x, V});
      } else {
        for (int64_t d = 0; d < V; ++d) dv_row[d] = bt * dut[d];
      }
    }
  }

  // dq, dk of a q/k head sum over its value heads: the last one reads the others' sum
  // back, finishes the rows (l2norm's backward) and streams them out.
  void write_dq_dk(const SubChunk<acc_t>& sb, int64_t s0, int64_t h, bool first_head,
                   bool last_head, acc_t* dqr, acc_t* dkr) {
    const int64_t m = sb.n;
    if (last_head && !first_head) {
      for (int64_t t = 0; t < m; ++t) {
        put_row<true>(dqr + t * Kp, dq_ + ((s0 + t) * H + h) * K, K);
        put_row<true>(dkr + t * Kp, dk_ + ((s0 + t) * H + h) * K, K);
      }
    }
    if (in_.l2norm && last_head) l2norm_backward_rows(sb, dqr, dkr);
    for (int64_t t = 0; t < m; ++t) {
      acc_t* dq_row = dq_ + ((s0 + t) * H + h) * K;
      acc_t* dk_row = dk_ + ((s0 + t) * H + h) * K;
      if (last_head && K % L == 0) {
        drain_.rows.push_back({dq_row, dqr + t * Kp, K});
        drain_.rows.push_back({dk_row, dkr + t * Kp, K});
      } else if (last_head || first_head) {
        put_row<false>(dq_row, dqr + t * Kp, K);
        put_row<false>(dk_row, dkr + t * Kp, K);
      } else {
        put_row<true>(dq_row, dqr + t * Kp, K);
        put_row<true>(dk_row, dkr + t * Kp, K);
      }
    }
  }

  // l2norm's backward from the normalized rows y = r x at hand (qs, kc):
  // dx = r (dy - y (y . dy)), in place on the dq and dk rows.
  void l2norm_backward_rows(const SubChunk<acc_t>& sb, acc_t* dqr, acc_t* dkr) {
    SimdVec<acc_t>* const lanes = lanes_.data();
    acc_t* const sums = s_.sums;
    for (int64_t t = 0; t < Cs; ++t) {
      lanes[t] = dot_lanes(Kp, s_.qs + t * Kp, dqr + t * Kp);
      lanes[Cs + t] = dot_lanes(Kp, sb.kc + t * Kp, dkr + t * Kp);
    }
    for (int64_t i = 0; i < 2; ++i) hsum_columns(lanes + i * Cs, Cs, sums + i * Cs);
    for (int64_t t = 0; t < sb.n; ++t) {
      const acc_t *y = s_.qs + t * Kp, *yk = sb.kc + t * Kp;
      acc_t *x = dqr + t * Kp, *xk = dkr + t * Kp;
      for (int64_t d = 0; d < Kp; d += L) {
        store_vec(x + d, s_.rq[t] * (load_vec(x + d) - sums[t] * load_vec(y + d)));
        store_vec(xk + d, sb.rk[t] * (load_vec(xk + d) - sums[Cs + t] * load_vec(yk + d)));
      }
    }
  }

  const GdnProblem& p_;
  const Views<in_t, acc_t>& in_;
  const acc_t *const ckpt_, *const vw_saved_;
  const in_t* const grad_o_;
  const acc_t* const grad_ht_;
  const int64_t K, V, H, HV, C, KV, G, Kp, Vp, SP;
  acc_t *const dq_, *const dk_, *const dv_, *const dg_, *const dbeta_, *const dstate_;
  ChunkedScratch<acc_t> s_;
  const HugeScratch block_;
  std::vector<const acc_t*> state_;  // the states before the sub-chunks
  VecArray<acc_t> lanes_;  // per-token lane sums (3 Cs)
  RowQueue ahead_;  // input rows of the next walk, fetched by pump() between products
  RowDrain<acc_t> drain_;
  int64_t step_ = 0;  // backward steps so far: picks the set of gradient rows
};

}  // namespace

template <typename in_t, typename acc_t>
void gdn_backward_chunked(const GdnProblem& p, const Views<in_t, acc_t>& in, const acc_t* ckpt,
                          const acc_t* vw_saved, const in_t* grad_o, const acc_t* grad_ht,
                          const GdnBackwardLayout& lay, acc_t* buf) {
  const int64_t tasks = p.num_seqs * p.num_qk_heads;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    ChunkedBackward<in_t, acc_t> walk(p, in, ckpt, vw_saved, grad_o, grad_ht, lay, buf);
    for (int64_t task; (task = next_task.fetch_add(1)) < tasks;) walk.run_task(task);
#if RLX_ISA_AVX
    _mm_sfence();  // the streamed rows are visible before the parallel region ends
#endif
  });
}

#define RLX_INSTANTIATE_CHUNKED(in_t, acc_t)                                                 \
  template void gdn_backward_chunked<in_t, acc_t>(                                         \
      const GdnProblem&, const Views<in_t, acc_t>&, const acc_t*, const acc_t*, const in_t*, \
      const acc_t*, const GdnBackwardLayout&, acc_t*);
RLX_GDN_INSTANTIATE(RLX_INSTANTIATE_CHUNKED)

}  // namespace RLX_ISA_NS
}  // namespace rlx
RLX_ISA_END
