// Gated delta rule backward on tensor cores, the chunked (WY / UT-transform) formulation for
// one gate per head (the forward: gated_delta_chunk.cuh, whose notation this follows). Per
// chunk, with S0 the state before it, dS the gradient of the state after it, dO the output's:
//   du  = scale P^T dO + (K o e^(G_last - G)) dS,   P = [j <= i] (Q K^T) o e^(G_i - G_j)
//   dvw = beta o du,  dbeta = du . vw (+ the WY part),  dU' = dvw,  dW' = -dvw S0^T
//   dS0 = e^(G_last) dS + scale (Q o e^G)^T dO - W'^T dvw
// after the forward's prep kernel has been re-run for G, W' and T', and u and S0 have been
// taken from the forward's vw and 64-token checkpoints (from_forward_kernel; with sparser
// checkpoints the forward's state kernel re-runs for them). Then
// per chunk the gradients of the inputs (gated_delta_chunk_bwd_grads.cuh):
//   dq = scale e^G o (dO S0^T) + dP K,     dP = scale [j <= i] (dO u^T) o e^(G_i - G_j)
//   dk = e^(G_last - G) o (u dS^T) + dP^T Q + (dA + dA^T) K + e^G o (T'^T dW')
//   dv = T'^T dvw,  dT' = dvw V^T + dW' (K o e^G)^T,  dM = -[j < i] T'^T dT' T'^T,
//   dA = (dM o beta_j) o e^(G_i - G_j),  dbeta_j += sum_i dM_ij L_ij
// and dg the reverse cumulative sum, within the chunk, of the gradient of G (the terms each
// e^(G_i - G_j) or e^G_i factor contributes). Every exponent is a difference G_i - G_j with
// j <= i, or G_i, or G_last - G_j, as in the forward; past a chunk's last token G is padded
// with G_last rather than 0, so that e^(G_i - G_j) of a padding row stays <= 1 (with 0 it
// overflows under strong decay, and 0 x inf is NaN).
//
// Kernels, in launch order after the re-run prep:
//   from_forward_kernel  chunk parallel: S0 (16-bit, transposed) and u (16-bit) from the
//                    forward's float32 checkpoints and vw, the values state_kernel would write
//   dv_local_kernel  chunk parallel: scale P^T dO (float32)
//   dh_kernel        one block per (sequence, value head, BV-column tile), the chunks last
//                    first with dS [KP][BV] in float32 mma accumulators: du, dvw, dbeta's
//                    du . vw, each chunk's dS (16-bit) and dS0 (dh0) at the end
//   dqk_kernel, wy_kernel (gated_delta_chunk_bwd_grads.cuh)
// No atomics: every element is written by one thread, partial sums over tiles are added in a
// fixed order, so the results are bitwise reproducible.
#pragma once

#include "gated_delta_chunk.cuh"
#include "gated_delta_chunk_state.cuh"

namespace rlx::gdn::cuda {

constexpr int kBwdTile = 64;  // columns per tile of the chunk-parallel backward kernels

// Buffers of the chunked backward ([tokens, HV, X] unless said); f holds the inputs and what
// the re-run prep and state kernels wrote (G, W', T', u, the chunk states hT).
struct ChunkBwdArgs {
  ChunkArgs f;
  const uint16_t* dout = nullptr;  // [tokens, HV, V]
  const float* dht = nullptr;      // [N, HV, K, V] or nullptr
  const float* vw = nullptr;       // [tokens, HV, V] the forward's vw
  const float* ckpt = nullptr;     // [slots64, HV, K, V] the forward's 64-token checkpoints
  float* duL = nullptr;            // [tokens, HV, VP] scale P^T dO
  uint16_t* dvw = nullptr;         // [tokens, HV, VP]
  uint16_t* dS = nullptr;          // [slots64, HV, KP, VP] dL/dS after each chunk
  uint16_t* dW = nullptr;          // [tokens, HV, KP] dL/dW'
  float* dbeta_part = nullptr;     // [dbeta_tiles, tokens, HV] du . vw per dh_kernel tile
  int dbeta_tiles = 0;
  float* dg_part = nullptr;        // [KP / 64, tokens, HV] dqk_kernel's part of dL/dG
                                   // ([tokens, HV, KP] for a per-channel gate)
  float *dq = nullptr, *dk = nullptr;  // [tokens, HV, K]: per value head (summed on the host)
  // The fused q/k L2 norm with one value head per q/k head: the raw rows [tokens, H, K] (f.q,
  // f.k are the normalized ones) and their factors r [tokens, H]; wy_kernel<.., true> then
  // applies the l2norm backward to the rows of dq and dk it completes, so dq and dk are the
  // raw rows' gradients.
  const uint16_t *q_raw = nullptr, *k_raw = nullptr;
  const float *q_rstd = nullptr, *k_rstd = nullptr;
  float *dv = nullptr, *dg = nullptr, *dbeta = nullptr, *dh0 = nullptr;  // packed slices
};

// Sum over the 4 lanes that hold one accumulator row (lane / 4 alike).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(kFull, x, 1);
  return x + __shfl_xor_sync(kFull, x, 2);
}

// ---- from_forward: S0 and u of one chunk and value head from the forward's outputs ----------
// hT = 16-bit S0^T (pads zero) from the float32 checkpoint of the chunk's slot, u = 16-bit
// beta o vw (pad columns zero): the roundings state_kernel applies to the same float32 values,
// so the backward's results do not depend on which of the two produced them.
template <Bits16 kind>
__global__ void __launch_bounds__(kChunkThreads) from_forward_kernel(const ChunkBwdArgs B) {
  const ChunkArgs& A = B.f;
  const Dims<float>& d = A.d;
  const int KP = A.KP, VP = A.VP, hv = int(blockIdx.x % d.HV);
  const ChunkEntry e = A.chunks[blockIdx.x / d.HV];
  // The tile's rows hold 66 elements (33 words, odd): the 32 lanes of a warp store the words
  // (k, k + 1) of 32 consecutive columns v to 32 distinct banks (with 72, four to a bank).
  constexpr int ld = kChunk + 2;
  const int len = int(e.len);
  uint16_t* sT = dynamic_smem<uint16_t>();  // [64 v][66]: a 64 x 64 tile of S0^T
  const float* S = B.ckpt + (e.slot * d.HV + hv) * int64_t(d.K) * d.V;
  uint16_t* hT = A.hT + (e.slot * d.HV + hv) * int64_t(VP) * KP;
  for (int k0 = 0; k0 < KP; k0 += 64) {
    for (int v0 = 0; v0 < VP; v0 += 64) {
      __syncthreads();  // the previous tile's readers are done
      for (int idx = threadIdx.x; idx < 32 * 64; idx += blockDim.x) {  // rows k, k + 1
        const int r = 2 * (idx / 64), c = idx % 64, k = k0 + r, v = v0 + c;  // (reads along v)
        const bool ok = v < d.V;
        const float* at = S + int64_t(k) * d.V + v;
        const uint16_t lo = ok && k < d.K ? float_to_bits<kind>(at[0]) : uint16_t(0);
        const uint16_t hi = ok && k + 1 < d.K ? float_to_bits<kind>(at[d.V]) : uint16_t(0);
        *reinterpret_cast<uint32_t*>(sT + c * ld + r) = pack2(lo, hi);
      }
      __syncthreads();
      for (int idx = threadIdx.x; idx < 64 * 8; idx += blockDim.x) {  // rows of S0^T, 16 bytes
        const int c = idx / 8, r = 8 * (idx % 8);
        const uint32_t* from = reinterpret_cast<const uint32_t*>(sT + c * ld + r);
        uint32_t* to = reinterpret_cast<uint32_t*>(hT + int64_t(v0 + c) * KP + k0 + r);
        to[0] = from[0], to[1] = from[1], to[2] = from[2], to[3] = from[3];
      }
    }
  }
  const int64_t v_stride = int64_t(d.HV) * d.V, pv_stride = int64_t(d.HV) * VP;
  for (int idx = threadIdx.x; idx < len * VP; idx += blockDim.x) {
    const int i = idx / VP, c = idx % VP;
    const int64_t t = e.t0 + i;
    const float x = c < d.V ? B.vw[t * v_stride + int64_t(hv) * d.V + c] : 0.f;
    A.u[t * pv_stride + int64_t(hv) * VP + c] = float_to_bits<kind>(A.beta[t * d.HV + hv] * x);
  }
}

__host__ __device__ inline size_t from_forward_smem() {
  return sizeof(uint16_t) * size_t(kChunk) * (kChunk + 2);
}

// ---- dv_local: scale P^T dO of one chunk, value head and 64-column tile ---------------------
// kPerChannel (a gate per key channel): P is the prep's (gated_delta_chunk_kda.cuh)
template <Bits16 kind, bool kPerChannel = false>
__global__ void __launch_bounds__(kChunkThreads) dv_local_kernel(const ChunkBwdArgs B) {
  const ChunkArgs& A = B.f;
  const Dims<float>& d = A.d;
  const int KP = A.KP, VP = A.VP, lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const int nvt = VP / kBwdTile;
  const int vt = int(blockIdx.x % nvt), hv = int(blockIdx.x / nvt % d.HV), h = hv / d.group;
  const ChunkEntry e = A.chunks[blockIdx.x / nvt / d.HV];
  const int len = int(e.len), v0 = vt * kBwdTile;
  const int ldK = KP + kPad, ldC = kChunk + kPad;
  float* sG = dynamic_smem<float>();
  uint16_t* sQ = reinterpret_cast<uint16_t*>(sG + kChunk);  // [64][KP+8]
  uint16_t* sK = sQ + kChunk * ldK;                          // [64][KP+8]
  uint16_t* sDo = sK + kChunk * ldK;                         // [64][72] dO tile
  uint16_t* sP = sDo + kChunk * ldC;                         // [64][72] P (i, j)
  const int64_t qk_stride = int64_t(d.H) * d.K, v_stride = int64_t(d.HV) * d.V;
  for (int i = threadIdx.x; i < kChunk && !kPerChannel; i += blockDim.x) {
    sG[i] = A.G[(e.t0 + min(i, len - 1)) * d.HV + hv];  // (padded with G_last)
  }
  if constexpr (kPerChannel) {
    load_tile_async<kind>(sP, ldC, A.P + (e.t0 * d.HV + hv) * kChunk, int64_t(d.HV) * kChunk,
                          kChunk, kChunk, len, kChunk);
  } else {
    load_tile_async<kind>(sQ, ldK, A.q + e.t0 * qk_stride + int64_t(h) * d.K, qk_stride, kChunk,
                          KP, len, d.K);
    load_tile_async<kind>(sK, ldK, A.k + e.t0 * qk_stride + int64_t(h) * d.K, qk_stride, kChunk,
                          KP, len, d.K);
  }
  load_tile_async<kind>(sDo, ldC, B.dout + e.t0 * v_stride + int64_t(hv) * d.V + v0, v_stride,
                        kChunk, kBwdTile, len, max(0, min(kBwdTile, d.V - v0)));
  tiles_landed();
  if constexpr (!kPerChannel) {
    float P[8][4] = {};
    warp_mma<kind, false, false, 8>(P, sQ, ldK, 16 * w, sK, ldK, 0, 0, KP, lane);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = acc_row(16 * w, r, lane), j = acc_col(nt, r, lane);
        const float p = j <= i ? d.scale * P[nt][r] * exp(sG[i] - sG[j]) : 0.f;
        sP[i * ldC + j] = float_to_bits<kind>(p);
      }
  }
  __syncthreads();
  // rows j of P^T (A = sP read transposed), columns of the dO tile (B = sDo, [k][n])
  float acc[8][4] = {};
  warp_mma<kind, true, true, 8>(acc, sP, ldC, 16 * w, sDo, ldC, 0, 16 * w, kChunk, lane);
  const int64_t pv_stride = int64_t(d.HV) * VP;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int j = acc_row(16 * w, r, lane), c = v0 + acc_col(nt, r, lane);
      if (j < len) {
        B.duL[(e.t0 + j) * pv_stride + int64_t(hv) * VP + c] = kPerChannel ? d.scale * acc[nt][r]
                                                                           : acc[nt][r];
      }
    }
}

__host__ __device__ inline size_t dv_local_smem(int KP) {
  return sizeof(float) * kChunk +
         sizeof(uint16_t) * (size_t(2 * kChunk) * (KP + kPad) + size_t(2 * kChunk) * (kChunk + kPad));
}

// ---- dh: the reverse recurrence over chunks of one sequence, value head and BV columns -------
// dS [KP][BV] in accumulators (warp w rows 16 (MT w + mt) ..). Per chunk, last first:
//   store dS;  du = duL + e^(G_last - G) o (K dS);  dvw = beta o du;
//   dS = e^(G_last) dS + [Q; W']^T [scale e^G o dO; -dvw]   (one product over 2C rows)
// The gates scale the fp32 product (du) or the dO rows, so that K, Q, W' and dO are copied
// raw: the previous chunk's tiles are copied (cp.async) while the current one is in use (K
// and dO once du is done, Q and W' into the second of two buffers), and its gates, duL and vw
// loaded into registers, so the serial loop waits on no global load.
// kPerChannel (a gate per key channel): K and Q are the prep's K o e^(G_last - G) and Q o e^G,
// so du = duL + Kd dS and dS = diag(e^(G_last)) dS + [Qg; W']^T [scale dO; -dvw].
template <Bits16 kind, int MT, int NT, bool kPerChannel = false>
__global__ void __launch_bounds__(kChunkThreads) dh_kernel(const ChunkBwdArgs B) {
  using rlx::codebook::cuda::async_commit;
  using rlx::codebook::cuda::async_wait;
  using rlx::codebook::cuda::copy16_async;
  const ChunkArgs& A = B.f;
  using Tile = StateTile<MT, NT>;
  constexpr int BV = 8 * NT, KP = 64 * MT, C2 = 2 * kChunk;
  constexpr int ldK = KP + kPad, ldY = C2 + kPad, ldO = BV + kPad;
  const Dims<float>& d = A.d;
  const int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp, VP = A.VP;
  const int nvt = VP / BV;
  const int vt = int(blockIdx.x % nvt), hv = int(blockIdx.x / nvt % d.HV), h = hv / d.group;
  const int64_t n = blockIdx.x / nvt / d.HV;
  const int64_t bos = d.cu != nullptr ? d.cu[n] : n * d.seq_len;
  const int64_t eos = d.cu != nullptr ? d.cu[n + 1] : bos + d.seq_len;
  const int v0 = vt * BV, cols_ok = max(0, min(BV, d.V - v0));
  float* sG = dynamic_smem<float>();                                // [64]
  float* sBeta = sG + kChunk;                                       // [64]
  uint16_t* sDsT = reinterpret_cast<uint16_t*>(sBeta + kChunk);     // [BV][KP+8] dS^T
  uint16_t* sK = sDsT + BV * ldK;                                   // [64][KP+8] K
  uint16_t* sX = sK + kChunk * ldK;                                 // [2][128][KP+8] [Q; W']
  uint16_t* sO = sX + 2 * C2 * ldK;                                 // [64][BV+8] dO
  uint16_t* sYT = sO + kChunk * ldO;                                // [BV][136]
  const int64_t KV = int64_t(d.K) * d.V, qk_stride = int64_t(d.H) * d.K;
  const int64_t v_stride = int64_t(d.HV) * d.V, pv_stride = int64_t(d.HV) * VP;
  const int64_t pk_stride = int64_t(d.HV) * KP;
  // (per channel: Qg and Kd, rows of KP)
  const uint16_t* q = kPerChannel ? A.Qg + int64_t(hv) * KP : A.q + int64_t(h) * d.K;
  const uint16_t* k = kPerChannel ? A.Kd + int64_t(hv) * KP : A.k + int64_t(h) * d.K;
  const int64_t qk_rows = kPerChannel ? pk_stride : qk_stride;
  const int k_cols = kPerChannel ? KP : d.K;
  const uint16_t* dout = B.dout + int64_t(hv) * d.V + v0;
  const bool qk_async = kPerChannel || (d.K % 8 == 0 && reinterpret_cast<uintptr_t>(A.q) % 16 == 0 &&
                                         reinterpret_cast<uintptr_t>(A.k) % 16 == 0);
  const bool o_async = d.V % 8 == 0 && reinterpret_cast<uintptr_t>(B.dout) % 16 == 0;
  // chunk (t0, len)'s K, Q and W' (into buffer buf) and dO tiles, as one copy group; where
  // rows are not 16-byte aligned, copied synchronously instead
  auto fetch = [&](int64_t t0, int len, int buf) {
    uint16_t* dQ = sX + buf * C2 * ldK;
    uint16_t* dW = dQ + kChunk * ldK;
    for (int idx = threadIdx.x; idx < kChunk * (KP / 8); idx += blockDim.x) {
      const int r = idx / (KP / 8), c = 8 * (idx % (KP / 8));
      if (r < len) {
        copy16_async(dW + r * ldK + c, A.W + (t0 + r) * pk_stride + int64_t(hv) * KP + c);
      } else {
        zero16(dW + r * ldK + c);
      }
      if (qk_async) {
        if (r < len && c < k_cols) {
          copy16_async(sK + r * ldK + c, k + (t0 + r) * qk_rows + c);
          copy16_async(dQ + r * ldK + c, q + (t0 + r) * qk_rows + c);
        } else {
          zero16(sK + r * ldK + c);
          zero16(dQ + r * ldK + c);
        }
      }
    }
    if (!qk_async) {
      load_tile<kind, false>(sK, ldK, k + t0 * qk_stride, qk_stride, kChunk, KP, len, d.K);
      load_tile<kind, false>(dQ, ldK, q + t0 * qk_stride, qk_stride, kChunk, KP, len, d.K);
    }
    if (o_async) {
      for (int idx = threadIdx.x; idx < kChunk * (BV / 8); idx += blockDim.x) {
        const int r = idx / (BV / 8), c = 8 * (idx % (BV / 8));
        if (r < len && c < cols_ok) {
          copy16_async(sO + r * ldO + c, dout + (t0 + r) * v_stride + c);
        } else {
          zero16(sO + r * ldO + c);
        }
      }
    } else {
      load_tile<kind, false>(sO, ldO, dout + t0 * v_stride, v_stride, kChunk, BV, len, cols_ok);
    }
    async_commit();
  };
  // chunk (t0, len)'s gates (G padded with G_last; thread i < 64 holds row i), duL and vw
  // (this thread's accumulator elements) into registers
  // (per channel: e^(G_last) of this thread's state rows (r / 2) instead of the gates)
  float g_reg = 0.f, beta_reg = 0.f, duL[NT][4], vw[NT][4];
  float row_decay[MT][2] = {}, row_decay_next[MT][2] = {};
  auto load_rows = [&](int64_t t0, int len) {
    if constexpr (kPerChannel) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r2 = 0; r2 < 2; ++r2) {
          row_decay_next[mt][r2] = exp(A.G[(t0 + len - 1) * pk_stride + int64_t(hv) * KP +
                                           Tile::row(w, mt, 2 * r2, lane)]);
        }
    }
    if (int(threadIdx.x) < kChunk) {
      const int i = int(threadIdx.x);
      if constexpr (!kPerChannel) g_reg = A.G[(t0 + min(i, len - 1)) * d.HV + hv];
      beta_reg = i < len ? A.beta[(t0 + i) * d.HV + hv] : 0.f;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = acc_row(16 * w, r, lane), c = v0 + acc_col(nt, r, lane);
        duL[nt][r] = i < len ? B.duL[(t0 + i) * pv_stride + int64_t(hv) * VP + c] : 0.f;
        vw[nt][r] = i < len && c < d.V ? B.vw[(t0 + i) * v_stride + int64_t(hv) * d.V + c] : 0.f;
      }
  };
  Tile S;  // dS
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = Tile::row(w, mt, r, lane), col = v0 + Tile::col(nt, r, lane);
        S.s[mt][nt][r] = B.dht != nullptr && row < d.K && col < d.V
                             ? B.dht[(n * d.HV + hv) * KV + int64_t(row) * d.V + col]
                             : 0.f;
      }
  const int64_t base64 = checkpoint_base(n, bos, kChunk);
  const int64_t nc = num_chunks(eos - bos, kChunk);
  if (nc > 0) {
    const int64_t t0 = bos + (nc - 1) * kChunk;
    const int len = int(eos - t0);
    fetch(t0, len, int((nc - 1) & 1));
    load_rows(t0, len);
    if (int(threadIdx.x) < kChunk) {
      sG[threadIdx.x] = g_reg;
      sBeta[threadIdx.x] = beta_reg;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      row_decay[mt][0] = row_decay_next[mt][0];
      row_decay[mt][1] = row_decay_next[mt][1];
    }
  }
  for (int64_t j = nc - 1; j >= 0; --j) {
    const int buf = int(j & 1);
    const int64_t t0 = bos + j * kChunk;
    const int len = int(min(int64_t(kChunk), eos - t0));
    async_wait<0>();
    __syncthreads();  // the chunk's tiles and gates are in; the previous chunk's readers done
    uint16_t* dS_out = B.dS + ((base64 + j) * d.HV + hv) * int64_t(KP) * VP + v0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int row = Tile::row(w, mt, r, lane), cl = Tile::col(nt, r, lane);
          const uint16_t bits = float_to_bits<kind>(S.s[mt][nt][r]);
          sDsT[cl * ldK + row] = bits;
          dS_out[int64_t(row) * VP + cl] = bits;
        }
    for (int idx = threadIdx.x; idx < BV * kChunk; idx += blockDim.x) {  // scale e^G o dO
      const int c = idx / kChunk, i = idx % kChunk;
      const float f = kPerChannel ? d.scale : d.scale * exp(sG[i]);
      sYT[c * ldY + i] = float_to_bits<kind>(f * bits_to_float<kind>(sO[i * ldO + c]));
    }
    __syncthreads();
    const float g_last = sG[len - 1];
    // du = duL + e^(G_last - G) o (K dS): warp w chunk rows 16w .. 16w + 15
    {
      float kd[NT][4] = {};
      warp_mma<kind, false, false, NT>(kd, sK, ldK, 16 * w, sDsT, ldK, 0, 0, KP, lane);
      float db[2] = {0.f, 0.f};  // du . vw of rows (lane / 4) and (lane / 4 + 8)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = acc_row(16 * w, r, lane), cl = acc_col(nt, r, lane), c = v0 + cl;
          const bool ok = i < len;
          const float du = duL[nt][r] + (kPerChannel ? kd[nt][r] : exp(g_last - sG[i]) * kd[nt][r]);
          const float dvw = ok ? sBeta[i] * du : 0.f;
          sYT[cl * ldY + kChunk + i] = float_to_bits<kind>(-dvw);
          if (ok) {
            B.dvw[(t0 + i) * pv_stride + int64_t(hv) * VP + c] = float_to_bits<kind>(dvw);
            db[r / 2] += du * vw[nt][r];  // (vw is 0 past V)
          }
        }
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        const float s = quad_sum(db[r2]);
        const int i = acc_row(16 * w, 2 * r2, lane);
        if (lane % 4 == 0 && i < len) {
          B.dbeta_part[(int64_t(vt) * d.tokens + t0 + i) * d.HV + hv] = s;
        }
      }
    }
    __syncthreads();  // sK and sO are free, sYT complete
    if (j > 0) {  // the previous chunk (a full one)
      fetch(t0 - kChunk, kChunk, buf ^ 1);
      load_rows(t0 - kChunk, kChunk);
    }
    const float decay = exp(g_last);
    const uint16_t* cX = sX + buf * C2 * ldK;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) S.s[mt][nt][r] *= kPerChannel ? row_decay[mt][r / 2] : decay;
      warp_mma<kind, true, false, NT>(S.s[mt], cX, ldK, 16 * (MT * w + mt), sYT, ldY, 0, 0, C2,
                                      lane);
    }
    if (j > 0 && int(threadIdx.x) < kChunk) {  // (nothing reads the gates in this phase)
      sG[threadIdx.x] = g_reg;
      sBeta[threadIdx.x] = beta_reg;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      row_decay[mt][0] = row_decay_next[mt][0];
      row_decay[mt][1] = row_decay_next[mt][1];
    }
  }
  if (B.dh0 == nullptr) return;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = Tile::row(w, mt, r, lane), col = v0 + Tile::col(nt, r, lane);
        if (row < d.K && col < d.V) {
          B.dh0[(n * d.HV + hv) * KV + int64_t(row) * d.V + col] = S.s[mt][nt][r];
        }
      }
}

__host__ __device__ inline size_t dh_smem(int KP, int BV) {
  return sizeof(float) * 2 * kChunk +
         sizeof(uint16_t) * (size_t(BV + 5 * kChunk) * (KP + kPad) +
                             size_t(kChunk) * (BV + kPad) + size_t(BV) * (2 * kChunk + kPad));
}

}  // namespace rlx::gdn::cuda
