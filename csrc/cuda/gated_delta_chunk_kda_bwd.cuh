// The C x C algebra of the chunked gated delta backward for a per-channel gate (KDA; the
// forward: gated_delta_chunk_kda.cuh, the per-head backward: gated_delta_chunk_bwd.cuh, whose
// notation this follows). dv_local, dh and dqk take their per-channel variants before it
// (dqk leaves dq = scale e^G o (dO S0^T), dk = e^(G_last - G) o (u dS^T) and their part of
// dL/dG per element). Per chunk and value head, with E_ij[c] = e^(G_i[c] - G_j[c]):
//   dP = scale [j <= i] dO u^T,  dT' = dvw V^T + dW' (K o e^G)^T,  dM = -[j < i] T'^T dT' T'^T
//   dL = dM diag(beta),  dbeta_j += sum_i dM_ij L_ij,  dv = T'^T dvw
//   X1_i = sum_j dP_ij E_ij o k_j     X3_i = sum_j dL_ij E_ij o k_j        (rows i)
//   X24_j = sum_i (dP_ij E_ij o q_i + dL_ij E_ij o k_i)                   (columns j)
//   dq += X1,  dk += X3 + X24 + e^G o (T'^T dW')
//   dL/dG = (dqk's part) + q o X1 + k o (X3 - X24 + e^G o (T'^T dW'))
// since G_i enters E_ij with + and G_j with -, and K o e^G with +. dg is the reverse cumulative
// sum of dL/dG within the chunk, per channel. The X sums over a block of rows a and columns
// b < a (16-token sub-chunks) factor through r = 16a, e^(G_i - G_j) = e^(G_i - G_r)
// e^(G_r - G_j), both <= 1, as in the forward: X1_a = e^(G_a - G_r) o (dP_ab (K_b o
// e^(G_r - G_b))) and X24_b += e^(G_r - G_b) o (dP_ab^T (Q_a o e^(G_a - G_r)) + dL_ab^T (K_a o
// e^(G_a - G_r))) on tensor cores; the diagonal blocks term by term in float32. Warp w holds
// rows 16w .. 16w + 15 of X1, X3 (as the row block) and of X24 (as the column block).
//
// Also compiled on the CPU by tests/cuda_emu (RLX_CUDA_EMULATION).
#pragma once

#include "gated_delta_chunk_bwd_grads.cuh"

namespace rlx::gdn::cuda {

template <Bits16 kind>
__global__ void __launch_bounds__(kChunkThreads) kda_wy_kernel(const ChunkBwdArgs B) {
  const ChunkArgs& A = B.f;
  const Dims<float>& d = A.d;
  const int KP = A.KP, VP = A.VP, lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const int hv = int(blockIdx.x % d.HV), h = hv / d.group;
  const ChunkEntry e = A.chunks[blockIdx.x / d.HV];
  const int len = int(e.len), ld = kChunk + kPad, ldG = KP + 4, m0 = 16 * w;
  float* sG = dynamic_smem<float>();            // [64][KP+4] G (rows past len: G_last)
  float* sBeta = sG + kChunk * ldG;             // [64]
  float* sColM = sBeta + kChunk;                // [4][64] column sums of dM o L per warp
  uint16_t* sT = reinterpret_cast<uint16_t*>(sColM + kChunkWarps * kChunk);  // [64][72] T'
  uint16_t* sDP = sT + kChunk * ld;   // [64][72] dP
  uint16_t* sDL = sDP + kChunk * ld;  // [64][72] dT', then dL
  uint16_t* s0 = sDL + kChunk * ld;   // [64][72] streamed tiles (then Q)
  uint16_t* s1 = s0 + kChunk * ld;    // (then K)
  uint16_t* sQa = s1 + kChunk * ld;   // [64][72] q_i o e^(G_i - G_r), r = 16 (i / 16)
  uint16_t* sKa = sQa + kChunk * ld;  // [64][72] k_i o e^(G_i - G_r)
  uint16_t* sB = sKa + kChunk * ld;   // [4][16][72] warp w: k_j o e^(G_16w - G_j), one b
  // Aliases, so that two blocks fit on an SM (the kernel is latency-bound): the third streamed
  // tile (then dW') is sB, which the channel loop reads only before it loads dW'; dL/dG of one
  // 64-channel tile ([64][65] float) is sQa and sKa, read only before it is written.
  uint16_t* s2 = sB;
  float* sDG = reinterpret_cast<float*>(sQa);
  const int64_t qk_stride = int64_t(d.H) * d.K, v_stride = int64_t(d.HV) * d.V;
  const int64_t pv_stride = int64_t(d.HV) * VP, pk_stride = int64_t(d.HV) * KP;
  const uint16_t* q = A.q + e.t0 * qk_stride + int64_t(h) * d.K;
  const uint16_t* k = A.k + e.t0 * qk_stride + int64_t(h) * d.K;
  const uint16_t* dW = B.dW + e.t0 * pk_stride + int64_t(hv) * KP;
  const uint16_t* dvw = B.dvw + e.t0 * pv_stride + int64_t(hv) * VP;
  const uint16_t* dout = B.dout + e.t0 * v_stride + int64_t(hv) * d.V;
  const uint16_t* v = A.v + e.t0 * v_stride + int64_t(hv) * d.V;
  const float* G = A.G + e.t0 * pk_stride + int64_t(hv) * KP;
  // (landed with the first tiles below; rows 16-byte aligned for the copies)
  load_rows_async<true>(sG, ldG, G, pk_stride, kChunk, KP, len, KP);
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
    sBeta[i] = i < len ? A.beta[(e.t0 + i) * d.HV + hv] : 0.f;
  }
  load_tile_async<kind>(sT, ld, A.Tinv + (e.t0 * d.HV + hv) * kChunk, int64_t(d.HV) * kChunk,
                        kChunk, kChunk, len, kChunk);  // (landed with the first tiles below)
  // dP = scale [j <= i] dO u^T, over V
  {
    float dP[8][4] = {};
    for (int v0 = 0; v0 < VP; v0 += kBwdTile) {
      const int v_ok = max(0, min(kBwdTile, d.V - v0));
      __syncthreads();
      load_tile_async<kind>(s0, ld, dout + v0, v_stride, kChunk, kBwdTile, len, v_ok);
      load_tile_async<kind>(s1, ld, A.u + e.t0 * pv_stride + int64_t(hv) * VP + v0, pv_stride,
                            kChunk, kBwdTile, len, kBwdTile);
      tiles_landed();
      warp_mma<kind, false, false, 8>(dP, s0, ld, m0, s1, ld, 0, 0, kBwdTile, lane);
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = acc_row(m0, r, lane), j = acc_col(nt, r, lane);
        sDP[i * ld + j] = float_to_bits<kind>(j <= i ? d.scale * dP[nt][r] : 0.f);
      }
  }
  // dT' = dvw V^T (over V) + dW' (K o e^G)^T (over K)
  {
    float dT[8][4] = {};
    for (int v0 = 0; v0 < VP; v0 += kBwdTile) {
      const int v_ok = max(0, min(kBwdTile, d.V - v0));
      __syncthreads();
      load_tile_async<kind>(s0, ld, dvw + v0, pv_stride, kChunk, kBwdTile, len, kBwdTile);
      load_tile_async<kind>(s1, ld, v + v0, v_stride, kChunk, kBwdTile, len, v_ok);
      tiles_landed();
      warp_mma<kind, false, false, 8>(dT, s0, ld, m0, s1, ld, 0, 0, kBwdTile, lane);
    }
    for (int k0 = 0; k0 < KP; k0 += kBwdTile) {
      const int k_ok = max(0, min(kBwdTile, d.K - k0));
      __syncthreads();
      load_tile_async<kind>(s0, ld, k + k0, qk_stride, kChunk, kBwdTile, len, k_ok);
      load_tile_async<kind>(s1, ld, dW + k0, pk_stride, kChunk, kBwdTile, len, kBwdTile);
      tiles_landed();
      for (int idx = threadIdx.x; idx < kChunk * kBwdTile; idx += blockDim.x) {  // K o e^G
        const int r = idx / kBwdTile, c = idx % kBwdTile;
        s2[r * ld + c] =
            float_to_bits<kind>(bits_to_float<kind>(s0[r * ld + c]) * exp(sG[r * ldG + k0 + c]));
      }
      __syncthreads();
      warp_mma<kind, false, false, 8>(dT, s1, ld, m0, s2, ld, 0, 0, kBwdTile, lane);
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        sDL[acc_row(m0, r, lane) * ld + acc_col(nt, r, lane)] = float_to_bits<kind>(dT[nt][r]);
      }
  }
  __syncthreads();  // dT' complete; every warp is done with the streamed tiles
  {
    float X[8][4] = {};  // T'^T dT'
    warp_mma<kind, true, true, 8>(X, sT, ld, m0, sDL, ld, 0, 0, kChunk, lane);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        s0[acc_row(m0, r, lane) * ld + acc_col(nt, r, lane)] = float_to_bits<kind>(X[nt][r]);
        X[nt][r] = 0.f;
      }
    __syncthreads();  // T'^T dT' complete; every warp has read dT'
    warp_mma<kind, false, false, 8>(X, s0, ld, m0, sT, ld, 0, 0, kChunk, lane);  // (T'^T dT') T'^T
    float mCol[8][2] = {};  // this lane's part of dM o L's column sums
    const float* Lrows = A.L + (e.t0 * d.HV + hv) * kChunk;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = acc_row(m0, r, lane), j = acc_col(nt, r, lane);
        const float dm = j < i ? -X[nt][r] : 0.f;
        const float L = j < i && i < len ? Lrows[i * int64_t(d.HV) * kChunk + j] : 0.f;
        mCol[nt][r % 2] += dm * L;
        sDL[i * ld + j] = float_to_bits<kind>(dm * sBeta[j]);
      }
    warp_col_sums(mCol, sColM + w * kChunk, lane);
  }
  // dv = T'^T dvw
  for (int v0 = 0; v0 < VP; v0 += kBwdTile) {
    __syncthreads();
    load_tile_async<kind>(s0, ld, dvw + v0, pv_stride, kChunk, kBwdTile, len, kBwdTile);
    tiles_landed();
    float av[8][4] = {};
    warp_mma<kind, true, true, 8>(av, sT, ld, m0, s0, ld, 0, 0, kChunk, lane);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = acc_row(m0, r, lane), c = v0 + acc_col(nt, r, lane);
        if (i < len && c < d.V) B.dv[((e.t0 + i) * d.HV + hv) * d.V + c] = av[nt][r];
      }
  }
  // dbeta (dh_kernel's tiles, then the warps' column sums, in order)
  __syncthreads();  // (sColM complete)
  for (int i = threadIdx.x; i < len; i += blockDim.x) {
    float db = 0.f;
    for (int t = 0; t < B.dbeta_tiles; ++t) {
      db += B.dbeta_part[(int64_t(t) * d.tokens + e.t0 + i) * d.HV + hv];
    }
    for (int x = 0; x < kChunkWarps; ++x) db += sColM[x * kChunk + i];
    B.dbeta[(e.t0 + i) * d.HV + hv] = db;
  }
  // X1, X3, X24, dq, dk and dL/dG, 64 channels at a time
  uint16_t* myB = sB + 16 * w * ld;
  for (int k0 = 0; k0 < KP; k0 += kBwdTile) {
    const int k_ok = max(0, min(kBwdTile, d.K - k0));
    __syncthreads();  // the previous tile's readers are done
    load_tile_async<kind>(s0, ld, q + k0, qk_stride, kChunk, kBwdTile, len, k_ok);
    load_tile_async<kind>(s1, ld, k + k0, qk_stride, kChunk, kBwdTile, len, k_ok);
    tiles_landed();
    for (int idx = threadIdx.x; idx < kChunk * kBwdTile; idx += blockDim.x) {
      const int i = idx / kBwdTile, c = idx % kBwdTile, r = 16 * (i / 16);
      const float f = exp(sG[i * ldG + k0 + c] - sG[r * ldG + k0 + c]);
      sQa[i * ld + c] = float_to_bits<kind>(bits_to_float<kind>(s0[i * ld + c]) * f);
      sKa[i * ld + c] = float_to_bits<kind>(bits_to_float<kind>(s1[i * ld + c]) * f);
    }
    float X1[8][4] = {}, X3[8][4] = {}, X24[8][4] = {};
#pragma unroll
    for (int b = 0; b < 3; ++b) {  // row block w, column blocks b < w
      __syncthreads();  // (first: sQa, sKa are in; then: this warp's previous block is read)
      if (b < w) {
        for (int idx = lane; idx < 16 * kBwdTile; idx += kWarp) {
          const int jj = idx / kBwdTile, c = idx % kBwdTile, j = 16 * b + jj;
          const float f = exp(sG[m0 * ldG + k0 + c] - sG[j * ldG + k0 + c]);
          myB[jj * ld + c] = float_to_bits<kind>(bits_to_float<kind>(s1[j * ld + c]) * f);
        }
      }
      __syncthreads();
      if (b < w) {
        uint32_t ap[4], al[4];
        frag_a(ap, sDP, ld, m0, 16 * b, lane);
        frag_a(al, sDL, ld, m0, 16 * b, lane);
#pragma unroll
        for (int nt = 0; nt < 8; nt += 2) {
          uint32_t bf[4];
          frag_b2_t(bf, myB, ld, 8 * nt, 0, lane);
          const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
          mma_16816<kind>(X1[nt], ap, b0);
          mma_16816<kind>(X1[nt + 1], ap, b1);
          mma_16816<kind>(X3[nt], al, b0);
          mma_16816<kind>(X3[nt + 1], al, b1);
        }
      }
    }
#pragma unroll
    for (int a = 1; a < 4; ++a) {  // column block w, row blocks a > w
      if (a <= w) continue;
      float t[8][4] = {};
      uint32_t ap[4], al[4];
      frag_a_t(ap, sDP, ld, m0, 16 * a, lane);
      frag_a_t(al, sDL, ld, m0, 16 * a, lane);
#pragma unroll
      for (int nt = 0; nt < 8; nt += 2) {
        mma_pair<kind, true>(t[nt], t[nt + 1], ap, sQa, ld, 8 * nt, 16 * a, lane);
        mma_pair<kind, true>(t[nt], t[nt + 1], al, sKa, ld, 8 * nt, 16 * a, lane);
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int j = acc_row(m0, r, lane), c = k0 + acc_col(nt, r, lane);
          X24[nt][r] += exp(sG[16 * a * ldG + c] - sG[j * ldG + c]) * t[nt][r];
        }
    }
    __syncthreads();  // every warp is done with sB (s2), sQa and sKa (sDG)
    load_tile_async<kind>(s2, ld, dW + k0, pk_stride, kChunk, kBwdTile, len, kBwdTile);
    // X1, X3 to the rows' own scale; then the diagonal block term by term, y outermost so that
    // the lane's 32 elements are 32 independent chains. One exponential per (x, y, c): the
    // pairs y <= x take e^(G_x - G_y) (X1, X3), y >= x e^(G_y - G_x) (X24), both at y = x.
    float gx[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int x = acc_row(m0, r, lane), c = k0 + acc_col(nt, r, lane);
        gx[nt][r] = sG[x * ldG + c];
        const float f = exp(gx[nt][r] - sG[m0 * ldG + c]);
        X1[nt][r] *= f;
        X3[nt][r] *= f;
      }
    for (int y = m0; y < m0 + 16; ++y) {
      float dpxy[2], dlxy[2], dpyx[2], dlyx[2];  // rows x = m0 + lane / 4 + 8h
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int x = m0 + lane / 4 + 8 * h;
        dpxy[h] = y <= x ? bits_to_float<kind>(sDP[x * ld + y]) : 0.f;
        dlxy[h] = y <= x ? bits_to_float<kind>(sDL[x * ld + y]) : 0.f;  // (0 at y = x)
        dpyx[h] = y >= x ? bits_to_float<kind>(sDP[y * ld + x]) : 0.f;
        dlyx[h] = y >= x ? bits_to_float<kind>(sDL[y * ld + x]) : 0.f;
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int cl = acc_col(nt, 0, lane);
        const uint32_t kyw = word_at(s1 + y * ld + cl), qyw = word_at(s0 + y * ld + cl);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int h = r / 2, x = m0 + lane / 4 + 8 * h;
          const float ky = bits_to_float<kind>(uint16_t(kyw >> (16 * (r % 2))));
          const float qy = bits_to_float<kind>(uint16_t(qyw >> (16 * (r % 2))));
          const float dxy = gx[nt][r] - sG[y * ldG + k0 + cl + r % 2];
          const float E = exp(y <= x ? dxy : -dxy);
          const float Ek = E * ky;
          X1[nt][r] += dpxy[h] * Ek;
          X3[nt][r] += dlxy[h] * Ek;
          X24[nt][r] += (dpyx[h] * qy + dlyx[h] * ky) * E;
        }
      }
    }
    tiles_landed();  // (dW')
    float kg[8][4] = {};  // T'^T dW'
    warp_mma<kind, true, true, 8>(kg, sT, ld, m0, s2, ld, 0, 0, kChunk, lane);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int x = acc_row(m0, r, lane), cl = acc_col(nt, r, lane), c = k0 + cl;
        float dG = 0.f;
        if (x < len) {
          const float kx = bits_to_float<kind>(s1[x * ld + cl]);
          const float qx = bits_to_float<kind>(s0[x * ld + cl]);
          const float dk_w = X3[nt][r] + exp(sG[x * ldG + c]) * kg[nt][r];
          dG = B.dg_part[(e.t0 + x) * pk_stride + int64_t(hv) * KP + c] + qx * X1[nt][r] +
               kx * (dk_w - X24[nt][r]);
          if (c < d.K) {
            const int64_t at = ((e.t0 + x) * d.HV + hv) * d.K + c;
            B.dq[at] += X1[nt][r];
            B.dk[at] += dk_w + X24[nt][r];
          }
        }
        sDG[x * (kChunk + 1) + cl] = dG;
      }
    __syncthreads();
    const int cl = threadIdx.x;
    if (cl < kBwdTile && k0 + cl < d.K) {  // dg: the reverse cumulative sum, per channel
      float acc = 0.f;
      for (int x = len - 1; x >= 0; --x) {
        acc += sDG[x * (kChunk + 1) + cl];
        B.dg[((e.t0 + x) * d.HV + hv) * d.K + k0 + cl] = acc;
      }
    }
  }
}

__host__ __device__ inline size_t kda_wy_smem(int KP) {
  static_assert(sizeof(float) * kChunk * (kChunk + 1) <= 2 * sizeof(uint16_t) * kChunk * (kChunk + kPad),
                "dL/dG of a tile fits sQa and sKa");
  return sizeof(float) * (size_t(kChunk) * (KP + 4) + kChunk + kChunkWarps * kChunk) +
         sizeof(uint16_t) * 8 * size_t(kChunk) * (kChunk + kPad);
}

}  // namespace rlx::gdn::cuda
