// The chunked gated delta backward's data (gated_delta_backward_chunked.cpp): the sub-chunk
// size, what the forward walk over a chunk keeps per sub-chunk for the backward walk, dg's
// per-token terms and a thread's scratch, carved from one block. Included inside the kernel
// file's ISA region, like the other kernel headers: everything here is in rlx::RLX_ISA_NS.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_isa.h"

namespace rlx {
namespace RLX_ISA_NS {
namespace {

constexpr int64_t kCs = 16, kCC = kCs * kCs;  // sub-chunk: a multiple of L for float and double
constexpr int64_t kPumpLines = 40, kDrainRows = 6;  // per pump (see ChunkedBackward::pump)

// kFirstLanes[t][j] = (j < t): dg's mask over the sub-chunk's tokens before t.
struct FirstLanes {
  double w[kCs + 1][kCs];
  constexpr FirstLanes() : w{} {
    for (int t = 0; t <= kCs; ++t) {
      for (int j = 0; j < kCs; ++j) w[t][j] = j < t ? 1 : 0;
    }
  }
  constexpr const double* operator[](int64_t t) const { return w[t]; }
};
inline constexpr FirstLanes kFirstLanes{};

// dg's per-token terms of one sub-chunk (see the top of this file), in double:
// gam_t (qs_t . S0 go_t + k_t . S0 dw_t) and E[n-1][t] (k_t . dSn u_t).
struct DgTerms {
  double gam[kCs], dsn[kCs];
};

// What the forward walk over a chunk keeps per sub-chunk for the backward walk: the k and v
// rows (k^T too), u, vw, A (strictly lower), E and E^T, gam, beta, k's l2norm factors.
template <typename acc_t>
struct SubChunk {
  int64_t n;
  acc_t *kc, *kct, *vc, *u, *vw, *A, *E, *ET, *gam, *b, *rk;
};

// A thread's scratch, in one block kept across calls (HugeScratch): fresh vectors here cost
// ~150 page faults a call. Every value is written before it is read.
template <typename acc_t>
struct ChunkedScratch {
  int64_t Kp, Vp, SP;  // padded K, V; padded state size Kp * Vp
  std::vector<SubChunk<acc_t>> subs;  // one per sub-chunk of the longest chunk
  // nsubs + 1 padded states: before each sub-chunk (and a slot for the state after the last,
  // which forward_sub is not asked for)
  acc_t* states;
  // The backward walk over one sub-chunk:
  acc_t *dS, *S0T;     // dL/dS (padded [Kp, Vp]); S0^T
  acc_t *dsu, *qs;     // (dSn u^T)^T; the q rows (l2-normalized, unscaled)
  acc_t* ow;           // [go; dw]: rows [0, Cs) go, rows [Cs, 2 Cs) dw
  acc_t *du, *ut;      // du; u^T
  acc_t* qkt;          // [qs^T | gam k^T], Kp x 2 Cs
  acc_t *mat, *mat2;   // Cs x Cs work matrices
  acc_t* gw;           // [go u^T; dw u^T], 2 Cs x Cs
  acc_t* grad_rows;    // dq, dk and dv rows: two sets, one filled while the other drains
  acc_t *elast, *rq, *tmp, *rhs, *inv;  // E[n-1][.]; q's l2norm factors; Kp x Cs; Cs x Vp; Cs x Cs
  acc_t* kq;           // k_i . qs_j (Cs x Cs), kept for dg
  acc_t *sgam, *sums;  // [scale gam | gam]; per-token sums (3 Cs)

  ChunkedScratch(int64_t nsubs, int64_t kp, int64_t vp)
      : Kp(kp), Vp(vp), SP(kp * vp), subs(nsubs) {}
  acc_t* go() const { return ow; }
  acc_t* dw() const { return ow + kCs * Vp; }
  acc_t* gu() const { return gw; }
  acc_t* wu() const { return gw + kCC; }

  template <typename Carver>
  void lay_out(Carver& c) {
    const int64_t Cs = kCs, CC = kCC;
    for (SubChunk<acc_t>& sb : subs) {
      sb.kc = c.take(Cs * Kp), sb.kct = c.take(Kp * Cs), sb.vc = c.take(Cs * Vp);
      sb.u = c.take(Cs * Vp), sb.vw = c.take(Cs * Vp);
      sb.A = c.take(CC), sb.E = c.take(CC), sb.ET = c.take(CC);
      sb.gam = c.take(Cs), sb.b = c.take(Cs), sb.rk = c.take(Cs);
    }
    states = c.take((int64_t(subs.size()) + 1) * SP);
    dS = c.take(SP), S0T = c.take(SP), dsu = c.take(Cs * Kp);
    qs = c.take(Cs * Kp), ow = c.take(2 * Cs * Vp), du = c.take(Cs * Vp);
    ut = c.take(Vp * Cs), qkt = c.take(Kp * 2 * Cs);
    mat = c.take(CC), mat2 = c.take(CC), gw = c.take(2 * CC);
    grad_rows = c.take(2 * Cs * (2 * Kp + Vp));
    elast = c.take(Cs), rq = c.take(Cs), tmp = c.take(Kp * Cs);
    rhs = c.take(Cs * Vp), inv = c.take(CC), kq = c.take(CC);
    sgam = c.take(2 * Cs), sums = c.take(3 * Cs);
  }
};

}  // namespace
}  // namespace RLX_ISA_NS
}  // namespace rlx
