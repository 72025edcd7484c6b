// Gated delta rule on the CPU, token-by-token backward (any gate: one per head or one per key
// channel, any sign): per chunk, recompute the states from the forward's checkpoint, then run
// the reverse recurrence over them. The passes over the state:
// gated_delta_backward_recurrent_steps.h; the overview: gated_delta_common.h.
#include "cpu_kernel_deps.h"
#include "gated_delta_kernels.h"

RLX_ISA_BEGIN
#include "gated_delta_backward.h"
#include "gated_delta_backward_recurrent_steps.h"

namespace rlx {
namespace RLX_ISA_NS {
namespace {

// Kp-long rows kept per token of a sub-chunk (RecurrentScratch::rowbuf): the recompute's
// rows (decays a, key k, a k), ReverseRows' rows (qe, ke, kp, ren), e before the token, and
// the sums over the blocks of the dq, dk (two parts) and dg partials.
enum TokenRow : int64_t { kA, kK, kAK, kQE, kKE, kKP, kRen, kE, kDQ, kDKA, kDKB, kDG, kTokenRows };

// The states, rowbuf and dS: the scratch the inner loops stream, in this thread's transparent
// huge pages (every element read is written first).
template <typename acc_t>
struct RecurrentScratch {
  int64_t Cs, BS, Kp, SV;  // sub-chunk tokens; values of a block's state, a row, a state
  acc_t* states;  // states[i] = the block's state before token i of the sub-chunk (i >= 1)
  // Per token of a sub-chunk, shared by its blocks, kTokenRows rows. A token's rows lie
  // together: as separate arrays their rows of one token would fall in the same L1 sets (the
  // arrays are a multiple of 4 KiB apart).
  acc_t* rowbuf;
  // dS starts on a 4 KiB boundary like the states: the reverse pass then reads state i at a
  // multiple of 512 bytes from dS modulo 4 KiB (K = 64), which none of the few dS columns
  // stored just before matches. The likely gain: no load waits on a store it only seems to
  // overlap (4 KiB aliasing). It measured faster than dS in the heap, or 2304 bytes past a
  // boundary, with one thread and with two.
  acc_t* dS;

  template <typename Carver>
  void lay_out(Carver& c) {
    states = c.take((Cs + 1) * BS);
    rowbuf = c.take((Cs + 1) * kTokenRows * Kp);
    c.align(4096 / sizeof(acc_t));
    dS = c.take(SV);
  }
};

// One thread's walk over its tasks (sequence, q/k head). Two levels of recomputation bound
// the scratch: a chunk is first walked forward from its checkpoint keeping only the state at
// every sub-chunk start (subs_); then each sub-chunk, last first, recomputes its states
// block by block and runs the reverse recurrence of the block over them (run_subchunk).
// With Cs = C (the usual case) the first walk does nothing.
template <typename in_t, typename acc_t>
class RecurrentBackward {
 public:
  using vec = SimdVec<acc_t>;
  using ivec = decltype(vec{} < vec{});  // comparison masks
  static constexpr int64_t L = kVecLanes<acc_t>;

  RecurrentBackward(const GdnProblem& p, const Views<in_t, acc_t>& in, const acc_t* ckpt,
                    const in_t* grad_o, const acc_t* grad_ht, const GdnBackwardLayout& lay,
                    acc_t* buf)
      : p_(p), in_(in), ckpt_(ckpt), grad_o_(grad_o), grad_ht_(grad_ht),
        K(p.head_k_dim), V(p.head_v_dim), H(p.num_qk_heads), HV(p.num_v_heads), C(p.chunk),
        KV(K * V), G(p.group()),
        // Scratch states are column-major with a padded column stride; SV values each, BS
        // for the BV columns of a block.
        ld(padded_column_stride<acc_t>(K)), SV(V * ld), Kp((K + L - 1) / L * L),
        BV(backward_block_columns<acc_t>(V, ld)), BS(BV * ld),
        Cs(subchunk_tokens(p, BS, Kp)), nsubs(gdn_num_chunks(longest_chunk(p), Cs)),
        lo(std::ldexp(acc_t(1), -20)), hi(std::ldexp(acc_t(1), 20)),
        dq_(buf + lay.dq.offset), dk_(buf + lay.dk.offset), dv_(buf + lay.dv.offset),
        dg_(buf + lay.dg.offset), dbeta_(buf + lay.dbeta.offset),
        dstate_(p.has_initial_state ? buf + lay.dstate.offset : nullptr),
        s_{Cs, BS, Kp, SV, nullptr, nullptr, nullptr},
        subs_(nsubs * SV), vws_(Cs * BV), block_(scratch_bytes<acc_t>(s_)),
        tqk_(Cs), tb_(Cs), sdb_(Cs), sgu_(Cs), trenorm_(Cs), trq_(Cs), trk_(Cs),
        e_(Kp), kv_(Kp), qs_(Kp), kprev_(Kp), go_(BV), u_(BV), dw_(BV), w_(BV), z_(V),
        dqt_(Kp), dkt_(Kp), dgt_(Kp), zpart_(BV) {
    carve_scratch<acc_t>(s_, block_.get());
  }

  void run_task(int64_t task) {
    const BackwardTask tk = backward_task(p_, in_.cu, task);
    for (int64_t hv = tk.h * G; hv < (tk.h + 1) * G; ++hv) run_head(tk, hv);
  }

 private:
  // Sub-chunk length: a block's states and the per-token rows take at most 8 MiB (only very
  // large states or chunks are split).
  static int64_t subchunk_tokens(const GdnProblem& p, int64_t BS, int64_t Kp) {
    return std::clamp<int64_t>(
        (int64_t(8) << 20) / ((BS + kTokenRows * Kp) * int64_t(sizeof(acc_t))), 1,
        longest_chunk(p));
  }

  acc_t* row(int64_t which, int64_t i) const { return &s_.rowbuf[(i * kTokenRows + which) * Kp]; }
  // The block's state before token i of the sub-chunk: the first one is read where it lies
  // (in subs_, same column-major layout), the others are recomputed into states.
  const acc_t* state(int64_t i) const { return i == 0 ? state0_ : &s_.states[i * BS]; }
  // The l2norm factor of k's row tok (1 without l2norm).
  acc_t rk(int64_t tok, int64_t h) const {
    return in_.l2norm ? l2norm_rstd<acc_t>(in_.k + (tok * H + h) * K, K, in_.l2norm_eps)
                      : acc_t(1);
  }
  void scale_row(acc_t r, acc_t* x) const {  // (x: a scratch row of Kp, whole vectors)
    if (r != acc_t(1)) {
      for (int64_t j = 0; j < Kp; j += L) store_vec(x + j, r * load_vec(x + j));
    }
  }

  // One value head of a task: its chunks, last first, from dS = grad_final_state.
  void run_head(const BackwardTask& tk, int64_t hv) {
    const int64_t h = tk.h, bos = tk.bos, eos = tk.eos;
    const bool first_head = hv == h * G;  // assigns dq/dk rather than adding to them
    const bool last_head = hv == (h + 1) * G - 1;
    acc_t* const dS = s_.dS;
    std::fill(dS, dS + SV, acc_t(0));
    if (grad_ht_) gather_columns(grad_ht_ + (tk.n * HV + hv) * KV, K, V, ld, dS);
    std::fill(e_.begin(), e_.end(), acc_t(1));
    // z_j = dS_j . k of the last token (the pipeline's start).
    std::fill(z_.begin(), z_.end(), acc_t(0));
    if (grad_ht_ && eos > bos) {
      load_row(in_.k, eos - 1, H, h, K, kv_.data());
      scale_row(rk(eos - 1, h), kv_.data());
      for (int64_t j = 0; j < V; ++j) {
        acc_t s = 0;
        for (int64_t r = 0; r < K; ++r) s += dS[j * ld + r] * kv_[r];
        z_[j] = s;
      }
    }
    for (int64_t c = tk.nchunks - 1; c >= 0; --c) run_chunk(tk, hv, c, first_head, last_head);
    if (dstate_) {  // dS = diag(e) D
      for (int64_t j = 0; j < V; ++j) {
        for (int64_t r = 0; r < K; ++r) dS[j * ld + r] *= e_[r];
      }
      scatter_columns(dS, K, V, ld, dstate_ + (tk.n * HV + hv) * KV);
    }
  }

  void run_chunk(const BackwardTask& tk, int64_t hv, int64_t c, bool first_head,
                 bool last_head) {
    const int64_t h = tk.h, bos = tk.bos;
    const int64_t t0 = bos + c * C, len = std::min(C, tk.eos - t0);
    const int64_t nsub = gdn_num_chunks(len, Cs);
    const acc_t* ck = ckpt_ + ((tk.base + c) * HV + hv) * KV;
    // A block's first state, from subs_ (gathering each block from the checkpoint, 16
    // values per row, took 9% of the backward in a profile; one gather of all columns 4%;
    // copying each block's into states 4.5%).
    gather_columns(ck, K, V, ld, subs_.data());
    if (c > 0) {  // the next chunk's checkpoint (written long ago) goes to L2 meanwhile
      prefetch_rows_l2(ck - HV * KV, KV * sizeof(acc_t));
    }
    for (int64_t s = 0; s + 1 < nsub; ++s) {  // the sub-chunks' first states
      forward_rows(t0 + s * Cs, Cs, h, hv);
      for (int64_t v0 = 0; v0 < V; v0 += BV) {
        const int64_t nv = std::min(BV, V - v0);
        state0_ = &subs_[s * SV + v0 * ld];
        recompute(t0 + s * Cs, Cs, hv, v0, nv);
        std::memcpy(&subs_[(s + 1) * SV + v0 * ld], &s_.states[Cs * BS], nv * ld * sizeof(acc_t));
      }
    }
    for (int64_t s = nsub - 1; s >= 0; --s) {
      const int64_t s0 = t0 + s * Cs, slen = std::min(Cs, t0 + len - s0);
      prefetch_next_inputs(s0, h, hv, bos);
      forward_rows(s0, slen, h, hv);
      reverse_rows_of(s0, slen, h, bos);
      for (int64_t v0 = 0; v0 < V; v0 += BV) {
        state0_ = &subs_[s * SV + v0 * ld];
        reverse_block(s0, slen, hv, v0, std::min(BV, V - v0));
      }
      write_subchunk_grads(s0, slen, h, hv, first_head, last_head);
    }
  }

  // The rows of the inputs of the sub-chunk processed next (they lie one or more KiB apart
  // and the walk over sub-chunks runs backwards: the hardware does not prefetch them) go to
  // L2 during this one.
  void prefetch_next_inputs(int64_t s0, int64_t h, int64_t hv, int64_t bos) const {
    const int64_t gk = p_.gate_per_channel ? K : 1;
    for (int64_t tok = std::max(bos, s0 - Cs); tok < s0; ++tok) {
      prefetch_rows_l2(in_.q + (tok * H + h) * K, K * sizeof(in_t));
      prefetch_rows_l2(in_.k + (tok * H + h) * K, K * sizeof(in_t));
      prefetch_rows_l2(in_.v + (tok * HV + hv) * V, V * sizeof(in_t));
      prefetch_rows_l2(grad_o_ + (tok * HV + hv) * V, V * sizeof(in_t));
      prefetch_rows_l2(in_.g + (tok * HV + hv) * gk, gk * sizeof(acc_t));
    }
  }

  // Row factors of tokens [t0, t0 + len) for the recompute.
  void forward_rows(int64_t t0, int64_t len, int64_t h, int64_t hv) {
    if (in_.l2norm) {
      l2norm_rstd_rows(in_.k + (t0 * H + h) * K, H * K, len, K, in_.l2norm_eps, trk_.data());
    } else {
      std::fill(trk_.begin(), trk_.begin() + len, acc_t(1));
    }
    for (int64_t i = 0; i < len; ++i) {
      const int64_t tok = t0 + i;
      if (i + kRowPrefetchTokens < len) {  // little work per row: fetch further ahead
        prefetch_bytes(in_.k + ((tok + kRowPrefetchTokens) * H + h) * K, K * sizeof(in_t));
      }
      acc_t *a = row(kA, i), *kr = row(kK, i), *ak = row(kAK, i);
      load_decay(p_, in_.g, tok, hv, a);
      load_row(in_.k, tok, H, h, K, kr);
      scale_row(trk_[i], kr);
      for (int64_t r = K; r < Kp; ++r) {  // padding rows: a = 1, k = 0
        a[r] = 1;
        kr[r] = 0;
      }
      for (int64_t r = 0; r < Kp; ++r) ak[r] = a[r] * kr[r];
      tb_[i] = in_.beta[tok * HV + hv];
    }
    std::fill(row(kAK, len), row(kAK, len) + Kp, acc_t(0));  // ends the pipeline
  }

  // ReverseRows of tokens [t0, t0 + len), last first, advancing e (vectors over the padded
  // rows: a = e = ren = 1 and q = k = 0 there, so padding rows stay zero and never trigger
  // a renormalization).
  void reverse_rows_of(int64_t t0, int64_t len, int64_t h, int64_t bos) {
    if (in_.l2norm) {
      l2norm_rstd_rows(in_.q + (t0 * H + h) * K, H * K, len, K, in_.l2norm_eps, trq_.data());
    } else {
      std::fill(trq_.begin(), trq_.begin() + len, acc_t(1));
    }
    for (int64_t i = len - 1; i >= 0; --i) {
      const int64_t tok = t0 + i;
      if (tok - kPrefetchTokens >= bos) {
        const int64_t tp = tok - kPrefetchTokens;
        prefetch_bytes(in_.q + (tp * H + h) * K, K * sizeof(in_t));
        prefetch_bytes(in_.k + (tp * H + h) * K, K * sizeof(in_t));
      }
      load_row(in_.q, tok, H, h, K, qs_.data());
      scale_row(trq_[i], qs_.data());
      // k_{t-1}: the sub-chunk's row from forward_rows, or the token before it.
      const acc_t* kp_row = row(kK, std::max<int64_t>(i - 1, 0));
      if (i == 0 && tok > bos) {
        load_row(in_.k, tok - 1, H, h, K, kprev_.data());
        scale_row(rk(tok - 1, h), kprev_.data());
        kp_row = kprev_.data();
      }
      const acc_t *a = row(kA, i), *kr = row(kK, i);
      acc_t *qe = row(kQE, i), *ke = row(kKE, i), *ren = row(kRen, i);
      vec qk8 = {};
      ivec ok8 = ~ivec{};
      for (int64_t rb = 0; rb < Kp; rb += L) {
        const vec e8 = load_vec(&e_[rb]), en8 = load_vec(a + rb) * e8;
        const vec inv8 = acc_t(1) / e8, q8 = in_.scale * load_vec(&qs_[rb]);
        const vec k8 = load_vec(kr + rb);
        qk8 += q8 * k8;
        store_vec(qe + rb, q8 * inv8);
        store_vec(ke + rb, k8 * inv8);
        store_vec(ren + rb, en8);
        ok8 &= (en8 >= lo) & (en8 <= hi);  // false for NaN too
      }
      bool renorm = false;
      for (int64_t l = 0; l < L; ++l) renorm |= ok8[l] == 0;
      trenorm_[i] = renorm;
      tqk_[i] = hsum<acc_t>(qk8);
      for (int64_t rb = 0; rb < Kp; rb += L) {
        const vec k8 = tok > bos ? load_vec(kp_row + rb) : vec{};
        const vec ren8 = load_vec(ren + rb);
        store_vec(row(kKP, i) + rb, renorm ? k8 : k8 * ren8);
        store_vec(row(kE, i) + rb, load_vec(&e_[rb]));
        store_vec(&e_[rb], renorm ? vec{} + acc_t(1) : ren8);
      }
    }
  }

  // Recomputes tokens [t0, t0 + len) on columns [v0, v0 + nv) from state(0), filling
  // states[1..len] and vws_.
  void recompute(int64_t t0, int64_t len, int64_t hv, int64_t v0, int64_t nv) {
    acc_t* const states = s_.states;
    project_columns(state(0), Kp, nv, ld, row(kAK, 0), zpart_.data());
    hsum_columns(zpart_.data(), nv, w_.data());
    for (int64_t i = 0; i < len; ++i) {
      const int64_t tok = t0 + i;
      if (i + kPrefetchTokens < len) {
        prefetch_bytes(in_.v + ((tok + kPrefetchTokens) * HV + hv) * V + v0, nv * sizeof(in_t));
      }
      const in_t* __restrict vt = in_.v + (tok * HV + hv) * V + v0;
      acc_t* __restrict vw = &vws_[i * BV];
      acc_t* __restrict ui = u_.data();
      const acc_t* __restrict wi = w_.data();
      const acc_t b = tb_[i];
      for (int64_t j = 0; j < nv; ++j) {
        vw[j] = static_cast<acc_t>(vt[j]) - wi[j];
        ui[j] = b * vw[j];
      }
      recompute_step(state(i), &states[(i + 1) * BS], Kp, nv, ld, row(kA, i), row(kK, i),
                     row(kAK, i + 1), u_.data(), &states[std::min(i + 2, len) * BS],
                     zpart_.data());
      hsum_columns(zpart_.data(), nv, w_.data());
    }
  }

  // The reverse recurrence of the sub-chunk's tokens from s0 on columns [v0, v0 + nv), over
  // the block's recomputed states.
  void reverse_block(int64_t s0, int64_t slen, int64_t hv, int64_t v0, int64_t nv) {
    const bool first = v0 == 0;  // assigns the sums over blocks
    recompute(s0, slen, hv, v0, nv);
    acc_t* dSb = &s_.dS[v0 * ld];
    for (int64_t i = slen - 1; i >= 0; --i) {
      const int64_t tok = s0 + i;
      if (tok - kPrefetchTokens >= s0) {
        prefetch_bytes(grad_o_ + ((tok - kPrefetchTokens) * HV + hv) * V + v0,
                       nv * sizeof(in_t));
      }
      column_scalars(i, tok, hv, v0, nv, first);
      const ReverseRows<acc_t> rows{row(kQE, i), row(kKE, i), row(kKP, i), row(kRen, i)};
      const acc_t* pf = state(std::max<int64_t>(i - 1, 0));  // next token's
      // dg = <dP, P> summed in the pass for one gate per head too (the chunked backward's
      // recursion over tokens instead, its psi, lost about a digit of a gate parameter's
      // gradient here over 64-token sub-chunks).
      constexpr bool kChannelGate = true;
      if (trenorm_[i]) {
        reverse_step<true, kChannelGate>(state(i), dSb, Kp, nv, ld, rows, go_.data(), u_.data(),
                                         dw_.data(), first, pf, row(kDQ, i), row(kDKA, i),
                                         row(kDKB, i), row(kDG, i), zpart_.data());
      } else {
        reverse_step<false, kChannelGate>(state(i), dSb, Kp, nv, ld, rows, go_.data(),
                                          u_.data(), dw_.data(), first, pf, row(kDQ, i),
                                          row(kDKA, i), row(kDKB, i), row(kDG, i),
                                          zpart_.data());
      }
      hsum_columns(zpart_.data(), nv, &z_[v0]);
    }
  }

  // Token i's column scalars on the block: du_j from the pipelined z_j, then dv, dw, u and
  // the sums du . vw (dbeta) and go . u over the blocks.
  void column_scalars(int64_t i, int64_t tok, int64_t hv, int64_t v0, int64_t nv, bool first) {
    const int64_t nvv = nv / L * L;
    const acc_t b = tb_[i], qk = tqk_[i];
    const acc_t* vw = &vws_[i * BV];
    const in_t* got = grad_o_ + (tok * HV + hv) * V + v0;
    acc_t *const go = go_.data(), *const u = u_.data(), *const dw = dw_.data();
    for (int64_t j = 0; j < nv; ++j) go[j] = static_cast<acc_t>(got[j]);
    acc_t* dv_row = dv_ + (tok * HV + hv) * V + v0;
    acc_t* zb = &z_[v0];
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
    sdb_[i] = first ? db : sdb_[i] + db;
    sgu_[i] = first ? gu : sgu_[i] + gu;
  }

  // The sub-chunk's gradients from the sums over its blocks: dq, dk (summed over the q/k
  // head's value heads, then through l2norm's backward), dg, dbeta.
  void write_subchunk_grads(int64_t s0, int64_t slen, int64_t h, int64_t hv, bool first_head,
                            bool last_head) {
    acc_t *const dqt = dqt_.data(), *const dkt = dkt_.data(), *const dgt = dgt_.data();
    for (int64_t i = 0; i < slen; ++i) {
      const int64_t tok = s0 + i;
      if (i + kRowPrefetchTokens < slen) {  // rows written (read when adding) below
        const int64_t tp = tok + kRowPrefetchTokens;
        prefetch_bytes(dq_ + (tp * H + h) * K, K * sizeof(acc_t));
        prefetch_bytes(dk_ + (tp * H + h) * K, K * sizeof(acc_t));
      }
      for (int64_t rb = 0; rb < Kp; rb += L) {
        const vec a8 = load_vec(row(kA, i) + rb), e8 = load_vec(row(kE, i) + rb);
        // dq = S_t go = diag(a) S_{t-1} go + k (u . go)
        const vec dq8 = a8 * load_vec(row(kDQ, i) + rb) + load_vec(row(kK, i) + rb) * sgu_[i];
        store_vec(&dqt[rb], in_.scale * dq8);
        store_vec(&dkt[rb], e8 * load_vec(row(kDKA, i) + rb) + a8 * load_vec(row(kDKB, i) + rb));
        // a e
        store_vec(&dgt[rb], load_vec(row(kDG, i) + rb) * load_vec(row(kRen, i) + rb));
      }
      acc_t* __restrict dq_row = dq_ + (tok * H + h) * K;
      acc_t* __restrict dk_row = dk_ + (tok * H + h) * K;
      if (in_.l2norm && last_head) {  // the group's sums, through l2norm's backward
        if (!first_head) {
          put_row<true>(dqt, dq_row, K);
          put_row<true>(dkt, dk_row, K);
        }
        l2norm_backward_inplace(in_.q + (tok * H + h) * K, trq_[i], K, dqt);
        l2norm_backward_inplace(in_.k + (tok * H + h) * K, trk_[i], K, dkt);
        put_row<false>(dq_row, dqt, K);
        put_row<false>(dk_row, dkt, K);
      } else if (first_head) {
        put_row<false>(dq_row, dqt, K);
        put_row<false>(dk_row, dkt, K);
      } else {
        put_row<true>(dq_row, dqt, K);
        put_row<true>(dk_row, dkt, K);
      }
      if (p_.gate_per_channel) {
        put_row<false>(dg_ + (tok * HV + hv) * K, dgt, K);
      } else {  // one gate for all rows: their sum
        double sum = 0;
        for (int64_t r = 0; r < K; ++r) sum += dgt[r];
        dg_[tok * HV + hv] = acc_t(sum);
      }
      dbeta_[tok * HV + hv] = sdb_[i];
    }
  }

  const GdnProblem& p_;
  const Views<in_t, acc_t>& in_;
  const acc_t* const ckpt_;
  const in_t* const grad_o_;
  const acc_t* const grad_ht_;
  const int64_t K, V, H, HV, C, KV, G, ld, SV, Kp, BV, BS, Cs, nsubs;
  const acc_t lo, hi;  // the range the row factors e are kept in
  acc_t *const dq_, *const dk_, *const dv_, *const dg_, *const dbeta_, *const dstate_;
  RecurrentScratch<acc_t> s_;
  AccVec<acc_t> subs_, vws_;  // the sub-chunks' first states; the block's vw per token
  const HugeScratch block_;
  const acc_t* state0_ = nullptr;  // the block's state before the sub-chunk (in subs_)
  // Per token of a sub-chunk: q . k, beta, the sums over blocks of du . vw and go . u,
  // whether the token renormalizes, and the l2norm factors r of its q and k rows (1 without
  // l2norm; the rows are scaled as they are loaded).
  AccVec<acc_t> tqk_, tb_, sdb_, sgu_;
  std::vector<char> trenorm_;
  AccVec<acc_t> trq_, trk_;
  AccVec<acc_t> e_, kv_, qs_, kprev_, go_, u_, dw_, w_, z_;
  AccVec<acc_t> dqt_, dkt_, dgt_;
  VecArray<acc_t> zpart_;
};

}  // namespace

template <typename in_t, typename acc_t>
void gdn_backward_recurrent(const GdnProblem& p, const Views<in_t, acc_t>& in,
                            const acc_t* ckpt, const in_t* grad_o, const acc_t* grad_ht,
                            const GdnBackwardLayout& lay, acc_t* buf) {
  // One task per (sequence, q/k head): the value heads of its group run in order and sum
  // into the same dq/dk rows, so no two threads write the same gradient.
  // Threads take tasks in turn (a task's results do not depend on the thread that runs
  // it): with a few long tasks, a static split leaves every thread waiting on one that is
  // slowed down, e.g. by another process on its core.
  const int64_t tasks = p.num_seqs * p.num_qk_heads;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    RecurrentBackward<in_t, acc_t> walk(p, in, ckpt, grad_o, grad_ht, lay, buf);
    for (int64_t task; (task = next_task.fetch_add(1)) < tasks;) walk.run_task(task);
  });
}

#define RLX_INSTANTIATE_RECURRENT(in_t, acc_t)                                             \
  template void gdn_backward_recurrent<in_t, acc_t>(const GdnProblem&,                     \
                                                    const Views<in_t, acc_t>&, const acc_t*, \
                                                    const in_t*, const acc_t*,             \
                                                    const GdnBackwardLayout&, acc_t*);
RLX_GDN_INSTANTIATE(RLX_INSTANTIATE_RECURRENT)

}  // namespace RLX_ISA_NS
}  // namespace rlx
RLX_ISA_END
