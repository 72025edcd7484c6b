// Gated delta rule forward on tensor cores: the chunked (WY / UT-transform) formulation for
// one gate per head, chunks of C = 64 tokens, float32 state and accumulation, mma.sync
// m16n8k16 on 16-bit operands (the input dtype, bf16 or fp16).
//
// Within a chunk (tokens i, j = 0 .. C-1 after the chunk's start, S0 the state before it,
// G_i the chunk-local cumulative log-gate up to and including token i) the token recurrence
//   P_i = exp(g_i) S_{i-1},  vw_i = v_i - P_i^T k_i,  u_i = beta_i vw_i,  S_i = P_i + k_i u_i^T
// unrolls to
//   vw = (V - (K o e^G) S0) - L u,   L_ij = [j < i] (k_i . k_j) e^(G_i - G_j)
// so with M = L diag(beta) and T' = (I + M)^-1 (unit lower triangular):
//   vw = U' - W' S0,  U' = T' V,  W' = T' (K o e^G)                          (prep_kernel)
//   S_C = e^(G_last) S0 + (K o e^(G_last - G))^T (beta o vw)                  (state_kernel)
//   o = scale (e^G o (Q S0) + ([j <= i] (Q K^T) o e^(G_i - G_j)) u)          (output_kernel)
// Every exponent is a difference G_i - G_j with j <= i (or G_i, G_last - G_j): never
// positive, so any g (down to -30 per step and below) only underflows to 0.
//
// The tiles, fragments and copies these kernels share: gated_delta_chunk_tiles.cuh.
//
// Also compiled on the CPU by tests/cuda_emu (RLX_CUDA_EMULATION).
#pragma once

#include "gated_delta_chunk_tiles.cuh"

namespace rlx::gdn::cuda {

// ---- prep: G, W' and U' of one chunk and value head (U' only where A.U is set) ------------
template <Bits16 kind>
__global__ void __launch_bounds__(kChunkThreads) prep_kernel(const ChunkArgs A) {
  const Dims<float>& d = A.d;
  const int KP = A.KP, VP = A.VP, lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const int hv = int(blockIdx.x % d.HV), h = hv / d.group;
  const ChunkEntry e = A.chunks[blockIdx.x / d.HV];
  const int len = int(e.len);
  float* sG = dynamic_smem<float>();
  float* sBeta = sG + kChunk;
  float* sM = sBeta + kChunk;  // [64][65] M (float32)
  const int ldK = KP + kPad, ldV = VP + kPad;
  uint16_t* sK = reinterpret_cast<uint16_t*>(sM + kChunk * (kChunk + 1));  // [64][KP+8]
  uint16_t* sKg = sK + kChunk * ldK;   // [64][KP+8] K o e^G
  uint16_t* sV = sKg + kChunk * ldK;   // [64][VP+8] V
  uint16_t* sT = sV + kChunk * ldV;    // [64][72] T'
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
    sG[i] = i < len ? A.g[(e.t0 + i) * d.HV + hv] : 0.f;
    sBeta[i] = i < len ? A.beta[(e.t0 + i) * d.HV + hv] : 0.f;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // the chunk's cumulative gate (64 adds: not worth a scan)
    float acc = 0.f;
    for (int i = 0; i < kChunk; ++i) sG[i] = acc += sG[i];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < len; i += blockDim.x) A.G[(e.t0 + i) * d.HV + hv] = sG[i];
  const int64_t qk_stride = int64_t(d.H) * d.K, v_stride = int64_t(d.HV) * d.V;
  const uint16_t* k = A.k + e.t0 * qk_stride + int64_t(h) * d.K;
  load_tile_async<kind>(sK, ldK, k, qk_stride, kChunk, KP, len, d.K);
  if (A.U != nullptr) {  // (the backward's prep needs no U')
    load_tile_async<kind>(sV, ldV, A.v + e.t0 * v_stride + int64_t(hv) * d.V, v_stride, kChunk,
                          VP, len, d.V);
  }
  tiles_landed();
  // K o e^G from the landed K, 8 elements at a time (rows, not the transposed copy W' = T' (K
  // o e^G) once took: ldmatrix.trans reads B = K o e^G from rows)
  for (int idx = threadIdx.x; idx < kChunk * (KP / 8); idx += blockDim.x) {
    const int r = idx / (KP / 8), c = 8 * (idx % (KP / 8));
    const float f = exp(sG[r]);
    const uint32_t* from = reinterpret_cast<const uint32_t*>(sK + r * ldK + c);
    uint32_t* to = reinterpret_cast<uint32_t*>(sKg + r * ldK + c);
#pragma unroll
    for (int e2 = 0; e2 < 4; ++e2) {
      const uint32_t x = from[e2];
      to[e2] = pack2(float_to_bits<kind>(bits_to_float<kind>(uint16_t(x)) * f),
                     float_to_bits<kind>(bits_to_float<kind>(uint16_t(x >> 16)) * f));
    }
  }
  // M = strictly-lower(K K^T o e^(G_i - G_j)) diag(beta); warp w: rows 16w .. 16w + 15
  {
    float acc[8][4] = {};
    for (int k0 = 0; k0 < KP; k0 += 16) {
      uint32_t a[4];
      frag_a(a, sK, ldK, 16 * w, k0, lane);
#pragma unroll
      for (int nt = 0; nt < 8; nt += 2) {
        if (nt > 2 * w) continue;  // above the diagonal
        mma_pair<kind, false>(acc[nt], acc[nt + 1], a, sK, ldK, 8 * nt, k0, lane);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = 16 * w + lane / 4 + 8 * (r / 2), j = 8 * nt + 2 * (lane % 4) + (r % 2);
        sM[i * (kChunk + 1) + j] = j < i ? acc[nt][r] * exp(sG[i] - sG[j]) * sBeta[j] : 0.f;
      }
    }
  }
  __syncthreads();
  solve_unit_lower<kind>(sM, sT, A.Tinv != nullptr ? A.Tinv + (e.t0 * d.HV + hv) * kChunk : nullptr,
                         int64_t(d.HV) * kChunk, len);
  __syncthreads();
  // W' = T' (K o e^G), U' = T' V
  const int64_t pk_stride = int64_t(d.HV) * KP, pv_stride = int64_t(d.HV) * VP;
  store_t_product<kind>(sT, sKg, ldK, KP, A.W + e.t0 * pk_stride + int64_t(hv) * KP, pk_stride, len);
  if (A.U != nullptr) {
    store_t_product<kind>(sT, sV, ldV, VP, A.U + e.t0 * pv_stride + int64_t(hv) * VP, pv_stride, len);
  }
}

__host__ __device__ inline size_t prep_smem(int KP, int VP) {
  return sizeof(float) * (2 * kChunk + kChunk * (kChunk + 1)) +
         sizeof(uint16_t) * size_t(kChunk) * (2 * (KP + kPad) + (VP + kPad) + (kChunk + kPad));
}

// ---- output: o of one chunk, value head and 64-column tile ---------------------------------
// kPerChannel (gated_delta_chunk_kda.cuh): Q is the prep's Q o e^G and P its rows of P, read
// instead of formed from Q K^T.
template <Bits16 kind, bool kPerChannel = false>
__global__ void __launch_bounds__(kChunkThreads) output_kernel(const ChunkArgs A) {
  const Dims<float>& d = A.d;
  const int KP = A.KP, VP = A.VP, lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const int nvt = VP / kOutCols;
  const int vt = int(blockIdx.x % nvt), hv = int(blockIdx.x / nvt % d.HV), h = hv / d.group;
  const ChunkEntry e = A.chunks[blockIdx.x / nvt / d.HV];
  const int len = int(e.len), v0 = vt * kOutCols;
  const int ldK = KP + kPad, ldC = kChunk + kPad;
  float* sG = dynamic_smem<float>();
  uint16_t* sQ = reinterpret_cast<uint16_t*>(sG + kChunk);  // [64][KP+8]
  uint16_t* sK = sQ + kChunk * ldK;                          // [64][KP+8]
  uint16_t* sST = sK + kChunk * ldK;                         // [64][KP+8] S0^T
  uint16_t* sU = sST + kOutCols * ldK;                       // [64][72] u
  const int64_t qk_stride = int64_t(d.H) * d.K, pv_stride = int64_t(d.HV) * VP;
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
    sG[i] = i < len && !kPerChannel ? A.G[(e.t0 + i) * d.HV + hv] : 0.f;
  }
  if constexpr (kPerChannel) {  // (P in sK's place)
    const int64_t pk_stride = int64_t(d.HV) * KP;
    load_tile_async<kind>(sQ, ldK, A.Qg + e.t0 * pk_stride + int64_t(hv) * KP, pk_stride, kChunk,
                          KP, len, KP);
    load_tile_async<kind>(sK, ldC, A.P + (e.t0 * d.HV + hv) * kChunk, int64_t(d.HV) * kChunk,
                          kChunk, kChunk, len, kChunk);
  } else {
    load_tile_async<kind>(sQ, ldK, A.q + e.t0 * qk_stride + int64_t(h) * d.K, qk_stride, kChunk,
                          KP, len, d.K);
    load_tile_async<kind>(sK, ldK, A.k + e.t0 * qk_stride + int64_t(h) * d.K, qk_stride, kChunk,
                          KP, len, d.K);
  }
  load_tile_async<kind>(sST, ldK, A.hT + ((e.slot * d.HV + hv) * VP + v0) * KP, int64_t(KP),
                        kOutCols, KP, kOutCols, KP);
  load_tile_async<kind>(sU, ldC, A.u + e.t0 * pv_stride + int64_t(hv) * VP + v0, pv_stride,
                        kChunk, kOutCols, len, kOutCols);
  tiles_landed();
  const int g4 = lane / 4, t2 = 2 * (lane % 4);
  // P = [j <= i] (Q K^T) o e^(G_i - G_j), rows 16w .. 16w + 15
  float P[8][4] = {};
  for (int k0 = 0; k0 < KP && !kPerChannel; k0 += 16) {
    uint32_t a[4];
    frag_a(a, sQ, ldK, 16 * w, k0, lane);
#pragma unroll
    for (int nt = 0; nt < 8; nt += 2) {
      if (nt > 2 * w) continue;
      mma_pair<kind, false>(P[nt], P[nt + 1], a, sK, ldK, 8 * nt, k0, lane);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 8 && !kPerChannel; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = 16 * w + g4 + 8 * (r / 2), j = 8 * nt + t2 + (r % 2);
      P[nt][r] = j <= i ? P[nt][r] * exp(sG[i] - sG[j]) : 0.f;
    }
  float O[8][4] = {}, Y[8][4] = {};
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {  // O = P u: P's accumulators are the A fragments
    if (kk > w) continue;
    uint32_t a[4];
    if constexpr (kPerChannel) {
      frag_a(a, sK, ldC, 16 * w, 16 * kk, lane);
    } else {
      a[0] = pack2(float_to_bits<kind>(P[2 * kk][0]), float_to_bits<kind>(P[2 * kk][1]));
      a[1] = pack2(float_to_bits<kind>(P[2 * kk][2]), float_to_bits<kind>(P[2 * kk][3]));
      a[2] = pack2(float_to_bits<kind>(P[2 * kk + 1][0]), float_to_bits<kind>(P[2 * kk + 1][1]));
      a[3] = pack2(float_to_bits<kind>(P[2 * kk + 1][2]), float_to_bits<kind>(P[2 * kk + 1][3]));
    }
#pragma unroll
    for (int nt = 0; nt < 8; nt += 2) {
      mma_pair<kind, true>(O[nt], O[nt + 1], a, sU, ldC, 8 * nt, 16 * kk, lane);
    }
  }
  warp_mma<kind, false, false, 8>(Y, sQ, ldK, 16 * w, sST, ldK, 0, 0, KP, lane);  // Y = Q S0
  const int64_t v_stride = int64_t(d.HV) * d.V;
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    const int i = 16 * w + g4 + 8 * r2;
    if (i >= len) continue;
    const float eg = kPerChannel ? 1.f : exp(sG[i]);  // (per channel: in Q o e^G)
    uint16_t* out = A.out + (e.t0 + i) * v_stride + int64_t(hv) * d.V;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = v0 + 8 * nt + t2 + c, r = 2 * r2 + c;
        if (col < d.V) out[col] = float_to_bits<kind>(d.scale * (eg * Y[nt][r] + O[nt][r]));
      }
  }
}

__host__ __device__ inline size_t output_smem(int KP) {
  return sizeof(float) * kChunk + sizeof(uint16_t) * (size_t(2 * kChunk + kOutCols) * (KP + kPad) +
                                                      size_t(kChunk) * (kOutCols + kPad));
}

}  // namespace rlx::gdn::cuda
