// dg and dbeta of one sub-chunk of the chunked gated delta backward
// (gated_delta_backward_chunked.cpp, whose top states the equations), from the pieces its
// earlier stages left in the scratch: du, [go; dw] u^T, k_i . qs_j, and the per-token terms.
// Included inside the kernel file's ISA region: everything here is in rlx::RLX_ISA_NS.
#pragma once

#include <cstdint>
#include <cstring>

#include "gated_delta_backward.h"
#include "gated_delta_backward_chunked_scratch.h"
#include "gated_delta_common.h"

namespace rlx {
namespace RLX_ISA_NS {
namespace {

// Per-token sums first, as lane vectors reduced eight tokens at a time; then dg, last
// token first:
// dg_t = gam_{n-1} <dSn, S0> + sum_{i>=t} terms.gam[i] + sum_{j<t} terms.dsn[j]
//        + sum_{j<t} col[j],  col[j] = sum_{i>=t} Z[i][j] (a row more per token),
// in double and by sums alone: no term enters that the result does not hold.
// dg and dbeta of token t go to dg[t * stride], dbeta[t * stride]; lanes: 3 Cs lane vectors.
template <typename acc_t, typename scale_t>
void chunked_dg_dbeta(const SubChunk<acc_t>& sb, const ChunkedScratch<acc_t>& s,
                      SimdVec<acc_t>* lanes, scale_t scale, double dsn_s0, const DgTerms& terms,
                      acc_t* dg, acc_t* dbeta, int64_t stride) {
  constexpr int64_t L = kVecLanes<acc_t>, Cs = kCs, CC = kCC;
  acc_t *const sums = s.sums, *const du = s.du, *const mat = s.mat, *const mat2 = s.mat2;
  const acc_t *const gu = s.gu(), *const wu = s.wu();
  const int64_t m = sb.n, Vp = s.Vp;
  for (int64_t t = 0; t < Cs; ++t) {
    lanes[2 * Cs + t] = dot_lanes(Vp, du + t * Vp, sb.vw + t * Vp);
  }
  hsum_columns(lanes + 2 * Cs, Cs, sums + 2 * Cs);
  gather_columns(s.kq, Cs, Cs, Cs, mat2);  // qs_i . k_j
  for (int64_t x = 0; x < CC; x += L) {  // Z (E and A: zero above the diagonal)
    store_vec(mat + x, scale * (load_vec(sb.E + x) * load_vec(mat2 + x)) *
                           load_vec(gu + x) + load_vec(sb.A + x) * load_vec(wu + x));
  }
  for (int64_t t = 0; t < Cs; ++t) mat[t * Cs + t] = 0;
  double dsn_before[Cs], dsn_sum = 0;
  for (int64_t t = 0; t < m; ++t) {
    dsn_before[t] = dsn_sum;
    dsn_sum += terms.dsn[t];
  }
  using vd = SimdVec<double>;
  using row = Vec<acc_t, kVecLanes<double>>;  // a vd's lanes of a row of Z, in acc_t
  constexpr int64_t LD = kVecLanes<double>, NC = Cs / LD;
  vd col[NC] = {};
  const double base = double(sb.gam[m - 1]) * dsn_s0;
  double gam_suffix = 0;
  for (int64_t t = m - 1; t >= 0; --t) {
    gam_suffix += terms.gam[t];
    vd straddle = {};
    for (int64_t c = 0; c < NC; ++c) {
      row z;
      std::memcpy(&z, mat + t * Cs + c * LD, sizeof(z));
      col[c] += __builtin_convertvector(z, vd);
      straddle += col[c] * load_vec(kFirstLanes[t] + c * LD);
    }
    dg[t * stride] = acc_t(base + gam_suffix + dsn_before[t] + hsum<double>(straddle));
    dbeta[t * stride] = sums[2 * Cs + t];
  }
}

}  // namespace
}  // namespace RLX_ISA_NS
}  // namespace rlx
