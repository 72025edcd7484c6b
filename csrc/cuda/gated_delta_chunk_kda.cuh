// The chunked gated delta forward for a per-channel gate (KDA: g [tokens, HV, K]), the prep
// step; state_kernel and output_kernel (gated_delta_chunk_state.cuh, gated_delta_chunk.cuh)
// take their per-channel variants. With G_i[c] the chunk-local cumulative log-gate of channel c
// up to and including token i (non-increasing in i), the per-head equations become
//   L_ij = [j < i] sum_c k_i[c] k_j[c] e^(G_i[c] - G_j[c])
//   P_ij = [j <= i] sum_c q_i[c] k_j[c] e^(G_i[c] - G_j[c])
//   W' = T' (K o e^G),  U' = T' V,  T' = (I + L diag(beta))^-1
//   S_C = diag(e^(G_last)) S0 + (K o e^(G_last - G))^T (beta o vw)
//   o = scale ((Q o e^G) S0 + P u)
// L and P are no longer a product masked by a matrix of decays. Over 16-token sub-chunks, a
// block of rows a and columns b < a factors through the reference token r = 16a (j < r <= i):
//   e^(G_i - G_j) = e^(G_i - G_r) e^(G_r - G_j),  both factors <= 1,
// so the block is (K_a o e^(G_a - G_r)) (K_b o e^(G_r - G_b))^T (Q_a for P) on tensor cores.
// The four diagonal 16 x 16 blocks (j, i in one sub-chunk, no such r) are summed elementwise in
// float32, one exponential per term. Every exponent is G_i - G_j with j <= i, G_i, or
// G_last - G_j: never positive, so g down to -30 per step only underflows. Rows past a chunk's
// last token carry g = 0 (their G is G_last), so the padding never overflows either.
//
// prep writes, besides G, W' and U' (as the per-head prep): Q o e^G and K o e^(G_last - G)
// (16-bit, [tokens, HV, KP]) for the output and state kernels, and the rows of P (16-bit,
// [tokens, HV, 64], zero above the diagonal), which the output kernel reads instead of forming
// P from Q K^T; for the backward also L (float32, [tokens, HV, 64]: dbeta's sum of dM o L)
// and T'. K is at most 128 (G is kept in float32 shared memory).
//
// Also compiled on the CPU by tests/cuda_emu (RLX_CUDA_EMULATION).
#pragma once

#include "gated_delta_chunk.cuh"

namespace rlx::gdn::cuda {

// Bytes of kda_prep_kernel's region R: sKa and sQa, later M (float32) and V.
__host__ __device__ inline size_t kda_prep_region(int KP, int VP) {
  const size_t factors = sizeof(uint16_t) * 2 * size_t(kChunk) * (KP + kPad);
  const size_t m_v = sizeof(float) * size_t(kChunk) * (kChunk + 1) +
                     sizeof(uint16_t) * size_t(kChunk) * (VP + kPad);
  return factors > m_v ? factors : m_v;
}

__host__ __device__ inline size_t kda_prep_smem(int KP, int VP) {
  return sizeof(float) * (size_t(kChunk) * (KP + 4) + kChunk) +
         sizeof(uint16_t) * size_t(kChunk) * (2 * (KP + kPad) + (kChunk + kPad)) +
         kda_prep_region(KP, VP);
}

// ---- prep for a per-channel gate: one chunk and value head -----------------------------------
template <Bits16 kind>
__global__ void __launch_bounds__(kChunkThreads) kda_prep_kernel(const ChunkArgs A) {
  const Dims<float>& d = A.d;
  const int KP = A.KP, VP = A.VP, lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const int hv = int(blockIdx.x % d.HV), h = hv / d.group;
  const ChunkEntry e = A.chunks[blockIdx.x / d.HV];
  const int len = int(e.len);
  // G rows of KP + 4 floats: 16-byte aligned for the copies, and the lanes of a warp that read
  // one column of 16 rows hit 8 banks at most twice each
  const int ldG = KP + 4, ldK = KP + kPad, ldV = VP + kPad;
  // Regions are reused as the kernel goes, so that two blocks fit on an SM at K = V = 128
  // (kda_prep_smem): sQ holds Q (the diagonal blocks), then sB (the blocks b < a), then K o e^G;
  // the region R holds sKa and sQa (up to the blocks b < a), then M and V.
  float* sG = dynamic_smem<float>();   // [64][KP+4] G
  float* sBeta = sG + kChunk * ldG;    // [64]
  uint16_t* sK = reinterpret_cast<uint16_t*>(sBeta + kChunk);  // [64][KP+8] K
  uint16_t* sQ = sK + kChunk * ldK;    // [64][KP+8] Q, then K o e^G
  uint16_t* sB = sQ;                   // [4][16][KP+8] warp w: k_j o e^(G_16w - G_j), one b
  uint16_t* sR = sQ + kChunk * ldK;    // the region R
  uint16_t* sKa = sR;                  // [64][KP+8] k_i o e^(G_i - G_r), r = 16 (i / 16)
  uint16_t* sQa = sKa + kChunk * ldK;  // [64][KP+8] q_i o e^(G_i - G_r)
  float* sM = reinterpret_cast<float*>(sR);  // [64][65] M = L diag(beta) (float32)
  uint16_t* sV = reinterpret_cast<uint16_t*>(sM + kChunk * (kChunk + 1));  // [64][VP+8] V
  uint16_t* sT = sR + kda_prep_region(KP, VP) / sizeof(uint16_t);  // [64][72] T'
  const int64_t g_stride = int64_t(d.HV) * d.K;
  // the gate rows in one group of copies, Q and K in the next: the cumulative sum waits for
  // the first only
  load_rows_async(sG, ldG, A.g + e.t0 * g_stride + int64_t(hv) * d.K, g_stride, kChunk, KP, len,
                  d.K);
  rlx::codebook::cuda::async_commit();
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
    sBeta[i] = i < len ? A.beta[(e.t0 + i) * d.HV + hv] : 0.f;
  }
  const int64_t qk_stride = int64_t(d.H) * d.K, v_stride = int64_t(d.HV) * d.V;
  load_tile_async<kind>(sK, ldK, A.k + e.t0 * qk_stride + int64_t(h) * d.K, qk_stride, kChunk,
                        KP, len, d.K);
  load_tile_async<kind>(sQ, ldK, A.q + e.t0 * qk_stride + int64_t(h) * d.K, qk_stride, kChunk,
                        KP, len, d.K);
  rlx::codebook::cuda::async_commit();
  rlx::codebook::cuda::async_wait<1>();
  __syncthreads();
  // the cumulative gate, one channel per thread (rows past len add g = 0: G_last)
  for (int c = threadIdx.x; c < KP; c += blockDim.x) {
    float acc = 0.f;
    for (int i = 0; i < kChunk; ++i) sG[i * ldG + c] = acc += sG[i * ldG + c];
  }
  tiles_landed();
  const int64_t pk_stride = int64_t(d.HV) * KP;
  float* G = A.G + e.t0 * pk_stride + int64_t(hv) * KP;
  uint16_t* Qg = A.Qg + e.t0 * pk_stride + int64_t(hv) * KP;
  uint16_t* Kd = A.Kd + e.t0 * pk_stride + int64_t(hv) * KP;
  // the row factors, two channels at a time
  for (int idx = threadIdx.x; idx < kChunk * (KP / 2); idx += blockDim.x) {
    const int i = idx / (KP / 2), c = 2 * (idx % (KP / 2)), r = 16 * (i / 16);
    uint16_t ka[2], qa[2], qg[2], kd[2];
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const float gi = sG[i * ldG + c + x];
      const float kf = bits_to_float<kind>(sK[i * ldK + c + x]);
      const float qf = bits_to_float<kind>(sQ[i * ldK + c + x]);
      const float er = exp(gi - sG[r * ldG + c + x]);
      ka[x] = float_to_bits<kind>(kf * er);
      qa[x] = float_to_bits<kind>(qf * er);
      qg[x] = float_to_bits<kind>(qf * exp(gi));
      kd[x] = float_to_bits<kind>(kf * exp(sG[(kChunk - 1) * ldG + c + x] - gi));
    }
    *reinterpret_cast<uint32_t*>(sKa + i * ldK + c) = pack2(ka[0], ka[1]);
    *reinterpret_cast<uint32_t*>(sQa + i * ldK + c) = pack2(qa[0], qa[1]);
    if (i < len) {
      G[i * pk_stride + c] = sG[i * ldG + c];
      G[i * pk_stride + c + 1] = sG[i * ldG + c + 1];
      *reinterpret_cast<uint32_t*>(Qg + i * pk_stride + c) = pack2(qg[0], qg[1]);
      *reinterpret_cast<uint32_t*>(Kd + i * pk_stride + c) = pack2(kd[0], kd[1]);
    }
  }
  uint16_t* P = A.P + (e.t0 * d.HV + hv) * kChunk;
  const int64_t p_stride = int64_t(d.HV) * kChunk;
  // the diagonal block of warp w, elementwise: lane (i = 16w + lane % 16, par = lane / 16)
  // sums every channel of (i, j) for the eight j = 16w + 2jj + par at once (eight independent
  // chains per lane, q_i, k_i, G_i read once per channel for all of them). Pairs j > i take
  // e^-inf = 0, so their sums stay 0 whatever the gate.
  float ldiag[8];
  {
    const int i = 16 * w + lane % 16, par = lane / 16;
    float l[8] = {}, p[8] = {};
    for (int c = 0; c < KP; c += 2) {
      const uint32_t kiw = word_at(sK + i * ldK + c), qiw = word_at(sQ + i * ldK + c);
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const float gi = sG[i * ldG + c + x];
        const float ki = bits_to_float<kind>(uint16_t(kiw >> (16 * x)));
        const float qi = bits_to_float<kind>(uint16_t(qiw >> (16 * x)));
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const int j = 16 * w + 2 * jj + par;
          const float kj = bits_to_float<kind>(sK[j * ldK + c + x]);
          const float f = exp(j <= i ? gi - sG[j * ldG + c + x] : -INFINITY) * kj;
          l[jj] += ki * f;
          p[jj] += qi * f;
        }
      }
    }
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int j = 16 * w + 2 * jj + par;
      ldiag[jj] = j < i ? l[jj] : 0.f;  // (M's diagonal block: once sKa and sQa are read)
      if (A.L != nullptr && i < len) A.L[i * p_stride + j + (e.t0 * d.HV + hv) * kChunk] = j < i ? l[jj] : 0.f;
      if (i < len) P[i * p_stride + j] = float_to_bits<kind>(j <= i ? p[jj] : 0.f);
    }
    for (int idx = lane; idx < 16 * (kChunk - 16 * w - 16); idx += kWarp) {  // above the block
      const int ii = 16 * w + idx / (kChunk - 16 * w - 16);
      const int j = 16 * w + 16 + idx % (kChunk - 16 * w - 16);
      if (ii < len) P[ii * p_stride + j] = 0;
      if (A.L != nullptr && ii < len) A.L[ii * p_stride + j + (e.t0 * d.HV + hv) * kChunk] = 0.f;
    }
  }
  // the blocks b < a = w on tensor cores, with r = 16w: L and P columns 16b .. 16b + 15
  float Lacc[6][4] = {}, Pacc[6][4] = {};
  uint16_t* myB = sB + 16 * w * ldK;
#pragma unroll
  for (int b = 0; b < 3; ++b) {
    __syncthreads();  // (first: the factors are in; then: this warp's previous block is read)
    if (b < w) {
      for (int idx = lane; idx < 16 * (KP / 2); idx += kWarp) {
        const int jj = idx / (KP / 2), c = 2 * (idx % (KP / 2)), j = 16 * b + jj;
        uint16_t kb[2];
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const float f = exp(sG[16 * w * ldG + c + x] - sG[j * ldG + c + x]);
          kb[x] = float_to_bits<kind>(bits_to_float<kind>(sK[j * ldK + c + x]) * f);
        }
        *reinterpret_cast<uint32_t*>(myB + jj * ldK + c) = pack2(kb[0], kb[1]);
      }
    }
    __syncthreads();
    if (b < w) {
      for (int k0 = 0; k0 < KP; k0 += 16) {
        uint32_t ak[4], aq[4], bf[4];
        frag_a(ak, sKa, ldK, 16 * w, k0, lane);
        frag_a(aq, sQa, ldK, 16 * w, k0, lane);
        frag_b2(bf, myB, ldK, 0, k0, lane);
        const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
        mma_16816<kind>(Lacc[2 * b], ak, b0);
        mma_16816<kind>(Lacc[2 * b + 1], ak, b1);
        mma_16816<kind>(Pacc[2 * b], aq, b0);
        mma_16816<kind>(Pacc[2 * b + 1], aq, b1);
      }
    }
  }
  __syncthreads();  // every warp is done with sKa and sQa: R takes M and V
  if (A.U != nullptr) {  // (the backward's prep needs no U')
    load_tile_async<kind>(sV, ldV, A.v + e.t0 * v_stride + int64_t(hv) * d.V, v_stride, kChunk,
                          VP, len, d.V);
  }
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    const int i = 16 * w + lane % 16, j = 16 * w + 2 * jj + lane / 16;
    sM[i * (kChunk + 1) + j] = ldiag[jj] * sBeta[j];
  }
#pragma unroll
  for (int nt = 0; nt < 6; ++nt) {
    if (nt >= 2 * w) continue;
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const int i = acc_row(16 * w, 2 * r2, lane), j = acc_col(nt, 0, lane);
      sM[i * (kChunk + 1) + j] = Lacc[nt][2 * r2] * sBeta[j];
      sM[i * (kChunk + 1) + j + 1] = Lacc[nt][2 * r2 + 1] * sBeta[j + 1];
      if (A.L != nullptr && i < len) {
        float* Lrow = A.L + (e.t0 * d.HV + hv) * kChunk + i * p_stride;
        Lrow[j] = Lacc[nt][2 * r2];
        Lrow[j + 1] = Lacc[nt][2 * r2 + 1];
      }
      if (i < len) {
        *reinterpret_cast<uint32_t*>(P + i * p_stride + j) =
            pack2(float_to_bits<kind>(Pacc[nt][2 * r2]), float_to_bits<kind>(Pacc[nt][2 * r2 + 1]));
      }
    }
  }
  __syncthreads();
  solve_unit_lower<kind>(sM, sT, A.Tinv != nullptr ? A.Tinv + (e.t0 * d.HV + hv) * kChunk : nullptr,
                         int64_t(d.HV) * kChunk, len);
  // K o e^G into sQ (Q is no longer read)
  for (int idx = threadIdx.x; idx < kChunk * KP; idx += blockDim.x) {
    const int i = idx / KP, c = idx % KP;
    sQ[i * ldK + c] = float_to_bits<kind>(bits_to_float<kind>(sK[i * ldK + c]) * exp(sG[i * ldG + c]));
  }
  tiles_landed();  // (and V)
  // W' = T' (K o e^G), U' = T' V
  store_t_product<kind>(sT, sQ, ldK, KP, A.W + e.t0 * pk_stride + int64_t(hv) * KP, pk_stride, len);
  if (A.U != nullptr) {
    const int64_t pv_stride = int64_t(d.HV) * VP;
    store_t_product<kind>(sT, sV, ldV, VP, A.U + e.t0 * pv_stride + int64_t(hv) * VP, pv_stride, len);
  }
}

}  // namespace rlx::gdn::cuda
