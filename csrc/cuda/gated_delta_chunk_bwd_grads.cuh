// The chunk-parallel gradient kernels of the chunked gated delta backward (the equations:
// gated_delta_chunk_bwd.cuh), run after dh_kernel:
//   dqk_kernel  per (chunk, value head, 64 key columns): the products over V with the chunk's
//               states, dO S0^T, dvw S0^T (dW') and u dS^T; dq and dk's first terms, dW', and
//               their part of dL/dG (with e^(G_last) <dS, S0>)
//   wy_kernel   per (chunk, value head): the C x C algebra (dP, dT', dM through T'), then dq,
//               dk's other terms, dv, and dg (reverse cumulative sum of dL/dG) and dbeta
// dq and dk are per value head ([tokens, HV, K]); the host adds a GVA group's heads. Where
// each q/k head has one value head, wy_kernel<kind, true> also applies the fused q/k L2
// norm's backward, dx = r (dy - y (y . dy)) with y = x r, r = (sum x^2 + eps)^-1/2 of the raw
// row x: a block holds whole rows of dq and dk once it has added its terms, so no separate
// pass over them (float32 [tokens, H, K] each, read and written again) is needed.
#pragma once

#include "gated_delta_chunk_bwd.cuh"

namespace rlx::gdn::cuda {

template <Bits16 kind>
__device__ __forceinline__ float bf_at(const uint16_t* t, int idx) {
  return bits_to_float<kind>(t[idx]);
}

// Column sums over one warp's 16 rows of per-lane partials v[nt][c] (column 8 nt + 2 (lane % 4)
// + c): a butterfly over the lanes that share lane % 4, lanes 0..3 store the sums.
__device__ __forceinline__ void warp_col_sums(const float (&v)[8][2], float* dst, int lane) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float x = v[nt][c];
      x += __shfl_xor_sync(kFull, x, 4);
      x += __shfl_xor_sync(kFull, x, 8);
      x += __shfl_xor_sync(kFull, x, 16);
      if (lane < 4) dst[8 * nt + 2 * lane + c] = x;
    }
}

// ---- dqk: one chunk, value head and 64-key-column tile ---------------------------------------
// kPerChannel (a gate per key channel): dq = scale e^G o (dO S0^T), dk = e^(G_last - G) o
// (u dS^T) per element, and their part of dL/dG per element into dg_part ([tokens, HV, KP]):
// q o dq - k o dk, plus at the last row sum_i k_i o dk_i + e^(G_last) o rowsum(dS o S0).
template <Bits16 kind, bool kPerChannel = false>
__global__ void __launch_bounds__(kChunkThreads) dqk_kernel(const ChunkBwdArgs B) {
  const ChunkArgs& A = B.f;
  const Dims<float>& d = A.d;
  const int KP = A.KP, VP = A.VP, lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const int nkt = KP / kBwdTile;
  const int kt = int(blockIdx.x % nkt), hv = int(blockIdx.x / nkt % d.HV), h = hv / d.group;
  const ChunkEntry e = A.chunks[blockIdx.x / nkt / d.HV];
  const int len = int(e.len), k0 = kt * kBwdTile, ld = kBwdTile + kPad;
  float* sG = dynamic_smem<float>();  // [64]
  float* sRowQ = sG + kChunk;         // [64] scale e^G_i q_i . (dO S0^T)_i
  float* sRowK = sRowQ + kChunk;      // [64] e^(G_last - G_i) k_i . (u dS^T)_i
  float* sRed = sRowK + kChunk;       // [128] <dS, S0> per thread
  uint16_t* sDo = reinterpret_cast<uint16_t*>(sRed + kChunkThreads);  // [64][72] (then Q)
  uint16_t* sDvw = sDo + kChunk * ld;                                  // [64][72] (then K)
  uint16_t* sU = sDvw + kChunk * ld;                                   // [64][72]
  uint16_t* sS0T = sU + kChunk * ld;                                   // [64 v][72] S0^T (v, k)
  uint16_t* sDs = sS0T + kChunk * ld;                                  // [64 k][72] dS (k, v)
  const int64_t qk_stride = int64_t(d.H) * d.K, v_stride = int64_t(d.HV) * d.V;
  const int64_t pv_stride = int64_t(d.HV) * VP, pk_stride = int64_t(d.HV) * KP;
  for (int i = threadIdx.x; i < kChunk && !kPerChannel; i += blockDim.x) {
    sG[i] = A.G[(e.t0 + min(i, len - 1)) * d.HV + hv];  // (padded with G_last)
  }
  float dQi[8][4] = {}, dWp[8][4] = {}, dHU[8][4] = {}, hs = 0.f;
  const uint16_t* S0 = A.hT + (e.slot * d.HV + hv) * int64_t(VP) * KP;
  const uint16_t* dS = B.dS + (e.slot * d.HV + hv) * int64_t(KP) * VP;
  for (int v0 = 0; v0 < VP; v0 += kBwdTile) {
    __syncthreads();  // the previous tile's readers are done
    load_tile_async<kind>(sDo, ld, B.dout + e.t0 * v_stride + int64_t(hv) * d.V + v0, v_stride,
                          kChunk, kBwdTile, len, max(0, min(kBwdTile, d.V - v0)));
    load_tile_async<kind>(sDvw, ld, B.dvw + e.t0 * pv_stride + int64_t(hv) * VP + v0, pv_stride,
                          kChunk, kBwdTile, len, kBwdTile);
    load_tile_async<kind>(sU, ld, A.u + e.t0 * pv_stride + int64_t(hv) * VP + v0, pv_stride,
                          kChunk, kBwdTile, len, kBwdTile);
    load_tile_async<kind>(sDs, ld, dS + int64_t(k0) * VP + v0, int64_t(VP), kBwdTile, kBwdTile,
                          kBwdTile, kBwdTile);
    load_tile_async<kind>(sS0T, ld, S0 + int64_t(v0) * KP + k0, int64_t(KP), kBwdTile, kBwdTile,
                          kBwdTile, kBwdTile);
    tiles_landed();
    // (B = S0^T [v][k] rows, read transposed by ldmatrix.trans)
    warp_mma<kind, false, true, 8>(dQi, sDo, ld, 16 * w, sS0T, ld, 0, 0, kBwdTile, lane);
    warp_mma<kind, false, true, 8>(dWp, sDvw, ld, 16 * w, sS0T, ld, 0, 0, kBwdTile, lane);
    warp_mma<kind, false, false, 8>(dHU, sU, ld, 16 * w, sDs, ld, 0, 0, kBwdTile, lane);
    if constexpr (kPerChannel) {  // thread kk < 64: channel k0 + kk's sum over v
      const int kk = threadIdx.x;
      for (int vv = 0; vv < kBwdTile && kk < kBwdTile; ++vv) {
        hs += bf_at<kind>(sDs, kk * ld + vv) * bf_at<kind>(sS0T, vv * ld + kk);
      }
    } else {
      for (int idx = threadIdx.x; idx < kBwdTile * kBwdTile; idx += blockDim.x) {
        const int kk = idx / kBwdTile, vv = idx % kBwdTile;
        hs += bf_at<kind>(sDs, kk * ld + vv) * bf_at<kind>(sS0T, vv * ld + kk);
      }
    }
  }
  __syncthreads();
  uint16_t* sQ = sDo;
  uint16_t* sK = sDvw;
  const int k_ok = max(0, min(kBwdTile, d.K - k0));
  load_tile_async<kind>(sQ, ld, A.q + e.t0 * qk_stride + int64_t(h) * d.K + k0, qk_stride,
                        kChunk, kBwdTile, len, k_ok);
  load_tile_async<kind>(sK, ld, A.k + e.t0 * qk_stride + int64_t(h) * d.K + k0, qk_stride,
                        kChunk, kBwdTile, len, k_ok);
  sRed[threadIdx.x] = hs;
  tiles_landed();
  if constexpr (kPerChannel) {
    const float* G = A.G + e.t0 * pk_stride + int64_t(hv) * KP;
    float* dG = B.dg_part + e.t0 * pk_stride + int64_t(hv) * KP;
    float col[8][2] = {};  // this lane's part of sum_i k_i o dk_i
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = acc_row(16 * w, r, lane), cl = acc_col(nt, r, lane), c = k0 + cl;
        if (i >= len) continue;
        B.dW[(e.t0 + i) * pk_stride + int64_t(hv) * KP + c] = float_to_bits<kind>(-dWp[nt][r]);
        const float gi = G[i * pk_stride + c];
        const float dq = d.scale * exp(gi) * dQi[nt][r];
        const float dk = exp(G[(len - 1) * pk_stride + c] - gi) * dHU[nt][r];
        const float kv = bf_at<kind>(sK, i * ld + cl);
        const int64_t row = (e.t0 + i) * d.HV + hv;
        if (c < d.K) {
          B.dq[row * d.K + c] = dq;
          B.dk[row * d.K + c] = dk;
        }
        dG[i * pk_stride + c] = bf_at<kind>(sQ, i * ld + cl) * dq - kv * dk;
        col[nt][r % 2] += kv * dk;
      }
    warp_col_sums(col, sRowQ + w * kChunk, lane);  // ([4][64] over sRowQ .. sRed)
    __syncthreads();
    const int kk = threadIdx.x;
    if (kk < kBwdTile) {  // G_last's terms, channel k0 + kk
      float val = exp(G[(len - 1) * pk_stride + k0 + kk]) * hs;
      for (int x = 0; x < kChunkWarps; ++x) val += sRowQ[x * kChunk + kk];
      dG[(len - 1) * pk_stride + k0 + kk] += val;
    }
    return;
  }
  const float g_last = sG[len - 1];
  float rq[2] = {0.f, 0.f}, rk[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = acc_row(16 * w, r, lane), cl = acc_col(nt, r, lane), c = k0 + cl;
      rq[r / 2] += bf_at<kind>(sQ, i * ld + cl) * dQi[nt][r];
      rk[r / 2] += bf_at<kind>(sK, i * ld + cl) * dHU[nt][r];
      if (i >= len) continue;
      const int64_t row = (e.t0 + i) * d.HV + hv;
      if (c < d.K) {
        B.dq[row * d.K + c] = d.scale * exp(sG[i]) * dQi[nt][r];
        B.dk[row * d.K + c] = exp(g_last - sG[i]) * dHU[nt][r];
      }
      B.dW[(e.t0 + i) * pk_stride + int64_t(hv) * KP + c] = float_to_bits<kind>(-dWp[nt][r]);
    }
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    const float sq = quad_sum(rq[r2]), sk = quad_sum(rk[r2]);
    const int i = acc_row(16 * w, 2 * r2, lane);
    if (lane % 4 == 0) {
      sRowQ[i] = i < len ? d.scale * exp(sG[i]) * sq : 0.f;
      sRowK[i] = i < len ? exp(g_last - sG[i]) * sk : 0.f;
    }
  }
  __syncthreads();
  const int i = threadIdx.x;
  if (i >= len) return;
  float val = sRowQ[i] - sRowK[i];
  if (i == len - 1) {  // G_last's terms: e^(G_last) <dS, S0> + sum_j e^(G_last - G_j) k_j . (dS u_j)
    float s = 0.f, t = 0.f;
    for (int x = 0; x < kChunkThreads; ++x) s += sRed[x];
    for (int j = 0; j < len; ++j) t += sRowK[j];
    val += exp(g_last) * s + t;
  }
  B.dg_part[(int64_t(kt) * d.tokens + e.t0 + i) * d.HV + hv] = val;
}

__host__ __device__ inline size_t dqk_smem() {
  return sizeof(float) * (3 * kChunk + kChunkThreads) +
         sizeof(uint16_t) * 5 * size_t(kChunk) * (kBwdTile + kPad);
}

// ---- wy: the C x C algebra of one chunk and value head, then dq, dk, dv, dg, dbeta -----------
// The 64 x 64 products are taken two at a time (dO u^T with Q K^T, then dvw V^T + dW' (K o
// e^G)^T with K K^T, then the dq and the dk products apart), so that at most two sets of
// accumulators are live: three blocks fit on an SM (registers and shared memory), where four
// live sets held it to two. The terms of dL/dG and dbeta that are row and column sums over the
// C x C matrices (dP o (Q K^T) + dL o L, dM o L) are summed from the accumulators as they
// come: per lane, then across the lanes of a row (rows) or through shared memory per warp
// (columns), in a fixed order.
template <Bits16 kind, bool kL2norm = false>
__global__ void __launch_bounds__(kChunkThreads, 3) wy_kernel(const ChunkBwdArgs B) {
  const ChunkArgs& A = B.f;
  const Dims<float>& d = A.d;
  const int KP = A.KP, VP = A.VP, lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const int hv = int(blockIdx.x % d.HV), h = hv / d.group;
  const ChunkEntry e = A.chunks[blockIdx.x / d.HV];
  const int len = int(e.len), ld = kChunk + kPad;
  float* sG = dynamic_smem<float>();  // [64]
  float* sBeta = sG + kChunk;         // [64]
  float* sRow = sBeta + kChunk;       // [64] e^G_i k_i . (T'^T dW')_i
  float* sRowF = sRow + kChunk;       // [64] row sums of F = dP o (Q K^T) + dL o L
  float* sColF = sRowF + kChunk;      // [4][64] column sums of F over warp w's rows
  float* sColM = sColF + kChunkWarps * kChunk;  // [4][64] the same of dM o L
  uint16_t* sT = reinterpret_cast<uint16_t*>(sColM + kChunkWarps * kChunk);  // [64][72] T'
  uint16_t* sDP = sT + kChunk * ld;   // [64][72] dP
  uint16_t* sDA = sDP + kChunk * ld;  // [64][72] dT', then dA
  uint16_t* s0 = sDA + kChunk * ld;   // [3][64][72] streamed tiles (s0: T'^T dT' between)
  uint16_t* s1 = s0 + kChunk * ld;
  uint16_t* s2 = s1 + kChunk * ld;
  const int64_t qk_stride = int64_t(d.H) * d.K, v_stride = int64_t(d.HV) * d.V;
  const int64_t pv_stride = int64_t(d.HV) * VP, pk_stride = int64_t(d.HV) * KP;
  const uint16_t* q = A.q + e.t0 * qk_stride + int64_t(h) * d.K;
  const uint16_t* k = A.k + e.t0 * qk_stride + int64_t(h) * d.K;
  const uint16_t* dW = B.dW + e.t0 * pk_stride + int64_t(hv) * KP;
  const uint16_t* dvw = B.dvw + e.t0 * pv_stride + int64_t(hv) * VP;
  const uint16_t* dout = B.dout + e.t0 * v_stride + int64_t(hv) * d.V;
  const uint16_t* v = A.v + e.t0 * v_stride + int64_t(hv) * d.V;
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
    sG[i] = A.G[(e.t0 + min(i, len - 1)) * d.HV + hv];  // (padded with G_last)
    sBeta[i] = i < len ? A.beta[(e.t0 + i) * d.HV + hv] : 0.f;
  }
  load_tile_async<kind>(sT, ld, A.Tinv + (e.t0 * d.HV + hv) * kChunk, int64_t(d.HV) * kChunk,
                        kChunk, kChunk, len, kChunk);  // (landed with the first tiles below)
  const int m0 = 16 * w;
  float fRow[2] = {0.f, 0.f}, fCol[8][2] = {};  // this lane's parts of F's row, column sums
  // dP = scale [j <= i] (dO u^T) o e^(G_i - G_j), over V
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
      const float dp = j <= i ? d.scale * dP[nt][r] * exp(sG[i] - sG[j]) : 0.f;
      dP[nt][r] = dp;
      sDP[i * ld + j] = float_to_bits<kind>(dp);
    }
  // Q K^T over K: F's first term dP o (Q K^T)
  {
    float QK[8][4] = {};
    for (int k0 = 0; k0 < KP; k0 += kBwdTile) {
      const int k_ok = max(0, min(kBwdTile, d.K - k0));
      __syncthreads();
      load_tile_async<kind>(s0, ld, q + k0, qk_stride, kChunk, kBwdTile, len, k_ok);
      load_tile_async<kind>(s1, ld, k + k0, qk_stride, kChunk, kBwdTile, len, k_ok);
      tiles_landed();
      warp_mma<kind, false, false, 8>(QK, s0, ld, m0, s1, ld, 0, 0, kBwdTile, lane);
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float f = dP[nt][r] * QK[nt][r];
        fRow[r / 2] += f;
        fCol[nt][r % 2] += f;
      }
  }
  // dT' = dvw V^T (over V) + dW' (K o e^G)^T (over K), and K K^T
  float dT[8][4] = {}, KK[8][4] = {};
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
      s2[r * ld + c] = float_to_bits<kind>(bits_to_float<kind>(s0[r * ld + c]) * exp(sG[r]));
    }
    __syncthreads();
    warp_mma<kind, false, false, 8>(KK, s0, ld, m0, s0, ld, 0, 0, kBwdTile, lane);
    warp_mma<kind, false, false, 8>(dT, s1, ld, m0, s2, ld, 0, 0, kBwdTile, lane);
  }
  // L (into KK), dT' to 16 bits (sDA: no warp reads it before the barrier below)
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = acc_row(m0, r, lane), j = acc_col(nt, r, lane);
      KK[nt][r] = j < i ? KK[nt][r] * exp(sG[i] - sG[j]) : 0.f;
      sDA[i * ld + j] = float_to_bits<kind>(dT[nt][r]);
    }
  __syncthreads();  // dT' complete; every warp is done with the streamed tiles
  float X[8][4] = {};  // T'^T dT'
  warp_mma<kind, true, true, 8>(X, sT, ld, m0, sDA, ld, 0, 0, kChunk, lane);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      s0[acc_row(m0, r, lane) * ld + acc_col(nt, r, lane)] = float_to_bits<kind>(X[nt][r]);
      X[nt][r] = 0.f;
    }
  __syncthreads();  // T'^T dT' complete; every warp has read dT'
  warp_mma<kind, false, false, 8>(X, s0, ld, m0, sT, ld, 0, 0, kChunk, lane);  // (T'^T dT') T'^T
  {
    float mCol[8][2] = {};  // this lane's part of dM o L's column sums
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = acc_row(m0, r, lane), j = acc_col(nt, r, lane);
        const float dm = j < i ? -X[nt][r] : 0.f, dl = dm * sBeta[j], L = KK[nt][r];
        mCol[nt][r % 2] += dm * L;
        fRow[r / 2] += dl * L;
        fCol[nt][r % 2] += dl * L;
        sDA[i * ld + j] = float_to_bits<kind>(j < i ? dl * exp(sG[i] - sG[j]) : 0.f);
      }
    warp_col_sums(mCol, sColM + w * kChunk, lane);
  }
  warp_col_sums(fCol, sColF + w * kChunk, lane);
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    const float s = quad_sum(fRow[r2]);
    if (lane % 4 == 0) sRowF[acc_row(m0, 2 * r2, lane)] = s;
  }
  // dq += dP K;  dk += dP^T Q + (dA + dA^T) K + e^G o (T'^T dW')
  float rk[2] = {0.f, 0.f};
  // kL2norm: this lane's parts of sum x dy of its two rows (r / 2), q and k
  float qxy[2] = {0.f, 0.f}, kxy[2] = {0.f, 0.f};
  for (int k0 = 0; k0 < KP; k0 += kBwdTile) {
    const int k_ok = max(0, min(kBwdTile, d.K - k0));
    __syncthreads();
    load_tile_async<kind>(s0, ld, q + k0, qk_stride, kChunk, kBwdTile, len, k_ok);
    load_tile_async<kind>(s1, ld, k + k0, qk_stride, kChunk, kBwdTile, len, k_ok);
    load_tile_async<kind>(s2, ld, dW + k0, pk_stride, kChunk, kBwdTile, len, kBwdTile);
    tiles_landed();
    {
      float aq[8][4] = {};
      warp_mma<kind, false, true, 8>(aq, sDP, ld, m0, s1, ld, 0, 0, kChunk, lane);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = acc_row(m0, r, lane), c = k0 + acc_col(nt, r, lane);
          if (i < len && c < d.K) {
            const int64_t at = ((e.t0 + i) * d.HV + hv) * d.K + c;
            const float dy = B.dq[at] + aq[nt][r];
            B.dq[at] = dy;
            if constexpr (kL2norm) {
              qxy[r / 2] += bits_to_float<kind>(B.q_raw[(e.t0 + i) * qk_stride + h * d.K + c]) * dy;
            }
          }
        }
    }
    float ak[8][4] = {}, akg[8][4] = {};
    warp_mma<kind, true, true, 8>(ak, sDP, ld, m0, s0, ld, 0, 0, kChunk, lane);
    warp_mma<kind, false, true, 8>(ak, sDA, ld, m0, s1, ld, 0, 0, kChunk, lane);
    warp_mma<kind, true, true, 8>(ak, sDA, ld, m0, s1, ld, 0, 0, kChunk, lane);
    warp_mma<kind, true, true, 8>(akg, sT, ld, m0, s2, ld, 0, 0, kChunk, lane);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = acc_row(m0, r, lane), cl = acc_col(nt, r, lane), c = k0 + cl;
        const float eg = exp(sG[i]);
        rk[r / 2] += eg * bf_at<kind>(s1, i * ld + cl) * akg[nt][r];
        if (i < len && c < d.K) {
          const int64_t at = ((e.t0 + i) * d.HV + hv) * d.K + c;
          const float dy = B.dk[at] + (ak[nt][r] + eg * akg[nt][r]);
          B.dk[at] = dy;
          if constexpr (kL2norm) {
            kxy[r / 2] += bits_to_float<kind>(B.k_raw[(e.t0 + i) * qk_stride + h * d.K + c]) * dy;
          }
        }
      }
  }
  if constexpr (kL2norm) {
    // y . dy = r sum x dy (quad sums: the 4 lanes of a row, in order), then
    // dx = r dy - x r^2 (y . dy), in place: each element is rewritten by the thread that wrote
    // it above
    float rq[2], sq[2], rkk[2], sk[2];
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const int i = min(acc_row(m0, 2 * r2, lane), len - 1);
      const int64_t row = (e.t0 + i) * d.H + h;
      rq[r2] = B.q_rstd[row];
      rkk[r2] = B.k_rstd[row];
      sq[r2] = rq[r2] * rq[r2] * rq[r2] * quad_sum(qxy[r2]);
      sk[r2] = rkk[r2] * rkk[r2] * rkk[r2] * quad_sum(kxy[r2]);
    }
    for (int k0 = 0; k0 < KP; k0 += kBwdTile) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = acc_row(m0, r, lane), c = k0 + acc_col(nt, r, lane);
          if (i >= len || c >= d.K) continue;
          const int64_t at = ((e.t0 + i) * d.HV + hv) * d.K + c;
          const int64_t xat = (e.t0 + i) * qk_stride + h * d.K + c;
          const float xq = bits_to_float<kind>(B.q_raw[xat]);
          const float xk = bits_to_float<kind>(B.k_raw[xat]);
          B.dq[at] = rq[r / 2] * B.dq[at] - xq * sq[r / 2];
          B.dk[at] = rkk[r / 2] * B.dk[at] - xk * sk[r / 2];
        }
    }
  }
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    const float s = quad_sum(rk[r2]);
    if (lane % 4 == 0) sRow[acc_row(m0, 2 * r2, lane)] = s;
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
  __syncthreads();
  // dL/dG_i, dbeta_i (the tiles' parts in order), then dg = its reverse cumulative sum
  const int i = threadIdx.x;
  if (i < len) {
    float dG = sRow[i] + sRowF[i], db = 0.f;
    const int nkt = KP / kBwdTile;
    for (int t = 0; t < nkt; ++t) dG += B.dg_part[(int64_t(t) * d.tokens + e.t0 + i) * d.HV + hv];
    for (int t = 0; t < B.dbeta_tiles; ++t) {
      db += B.dbeta_part[(int64_t(t) * d.tokens + e.t0 + i) * d.HV + hv];
    }
    for (int x = 0; x < kChunkWarps; ++x) {
      dG -= sColF[x * kChunk + i];
      db += sColM[x * kChunk + i];
    }
    B.dbeta[(e.t0 + i) * d.HV + hv] = db;
    sRow[i] = dG;  // (its own entry: read above by this thread alone)
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float acc = 0.f;
    for (int t = len - 1; t >= 0; --t) B.dg[(e.t0 + t) * d.HV + hv] = acc += sRow[t];
  }
}

__host__ __device__ inline size_t wy_smem() {
  return sizeof(float) * (4 * kChunk + 2 * kChunkWarps * kChunk) +
         sizeof(uint16_t) * 6 * size_t(kChunk) * (kChunk + kPad);
}

}  // namespace rlx::gdn::cuda
