// The inter-chunk state recurrence of the chunked gated delta forward (the formulation:
// gated_delta_chunk.cuh): one block per (sequence, value head, BV-column tile), the state
// S [KP][BV] float32 in mma accumulators (warp w owns rows 16 (MT w + mt) .. + 15). Per chunk:
//   vw = U' - W' S;  u = beta vw;  S = e^(G_last) S + K^T (e^(G_last - G) o u)
// storing S (16-bit, transposed) for output_kernel, S (float32) at the checkpoints, u and vw.
// The chunk's W', K and U' tiles are copied (cp.async) into the second of two shared-memory
// buffers while the first is in use, so the serial loop waits on no global load.
// kPerChannel (a gate per key channel, gated_delta_chunk_kda.cuh): the K tile is the prep's
// K o e^(G_last - G) and u is not scaled; S's rows decay by e^(G_last) of their channel.
#pragma once

#include "gated_delta_chunk.cuh"

namespace rlx::gdn::cuda {

template <int MT, int NT>
struct StateTile {
  float s[MT][NT][4];
  __device__ __forceinline__ static int row(int w, int mt, int r, int lane) {
    return 16 * (MT * w + mt) + lane / 4 + 8 * (r / 2);
  }
  __device__ __forceinline__ static int col(int nt, int r, int lane) {
    return 8 * nt + 2 * (lane % 4) + (r % 2);
  }
};

template <Bits16 kind, int MT, int NT, bool kPerChannel = false>
__global__ void __launch_bounds__(kChunkThreads) state_kernel(const ChunkArgs A) {
  using Tile = StateTile<MT, NT>;
  using rlx::codebook::cuda::async_commit;
  using rlx::codebook::cuda::async_wait;
  using rlx::codebook::cuda::copy16_async;
  constexpr int BV = 8 * NT, KP = 64 * MT;
  constexpr int ldK = KP + kPad, ldC = kChunk + kPad, ldU = BV + kPad;
  const Dims<float>& d = A.d;
  const int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp, VP = A.VP;
  const int nvt = VP / BV;
  const int vt = int(blockIdx.x % nvt), hv = int(blockIdx.x / nvt % d.HV), h = hv / d.group;
  const int64_t n = blockIdx.x / nvt / d.HV;
  const int64_t bos = d.cu != nullptr ? d.cu[n] : n * d.seq_len;
  const int64_t eos = d.cu != nullptr ? d.cu[n + 1] : bos + d.seq_len;
  const int v0 = vt * BV;
  float* sG = dynamic_smem<float>();                             // [2][64]
  float* sBeta = sG + 2 * kChunk;                                // [2][64]
  uint16_t* sST = reinterpret_cast<uint16_t*>(sBeta + 2 * kChunk);  // [BV][KP+8] S^T
  uint16_t* sW = sST + BV * ldK;                                 // [2][64][KP+8] W'
  uint16_t* sK = sW + 2 * kChunk * ldK;                          // [2][64][KP+8] K
  uint16_t* sU = sK + 2 * kChunk * ldK;                          // [2][64][BV+8] U'
  uint16_t* sUT = sU + 2 * kChunk * ldU;                         // [BV][72] (e^(G_last-G) u)^T
  const int64_t KV = int64_t(d.K) * d.V, qk_stride = int64_t(d.H) * d.K;
  const int64_t v_stride = int64_t(d.HV) * d.V, pv_stride = int64_t(d.HV) * VP;
  const int64_t pk_stride = int64_t(d.HV) * KP;
  const bool k_async =
      kPerChannel || (d.K % 8 == 0 && reinterpret_cast<uintptr_t>(A.k) % 16 == 0);
  // chunk (t0, len)'s W', K (when k_async) and U' tiles into buffer buf, as one copy group
  auto issue = [&](int64_t t0, int len, int buf) {
    uint16_t* dW = sW + buf * kChunk * ldK;
    uint16_t* dK = sK + buf * kChunk * ldK;
    uint16_t* dU = sU + buf * kChunk * ldU;
    for (int idx = threadIdx.x; idx < kChunk * (KP / 8); idx += blockDim.x) {
      const int r = idx / (KP / 8), c = 8 * (idx % (KP / 8));
      if (r < len) {
        copy16_async(dW + r * ldK + c, A.W + (t0 + r) * pk_stride + int64_t(hv) * KP + c);
      } else {
        zero16(dW + r * ldK + c);
      }
      if constexpr (kPerChannel) {
        if (r < len) {
          copy16_async(dK + r * ldK + c, A.Kd + (t0 + r) * pk_stride + int64_t(hv) * KP + c);
        } else {
          zero16(dK + r * ldK + c);
        }
      } else if (k_async) {
        if (r < len && c < d.K) {
          copy16_async(dK + r * ldK + c, A.k + (t0 + r) * qk_stride + int64_t(h) * d.K + c);
        } else {
          zero16(dK + r * ldK + c);
        }
      }
    }
    for (int idx = threadIdx.x; idx < kChunk * (BV / 8); idx += blockDim.x) {
      const int r = idx / (BV / 8), c = 8 * (idx % (BV / 8));
      if (r < len) {
        copy16_async(dU + r * ldU + c, A.U + (t0 + r) * pv_stride + int64_t(hv) * VP + v0 + c);
      } else {
        zero16(dU + r * ldU + c);
      }
    }
    async_commit();
  };
  Tile S;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = Tile::row(w, mt, r, lane), col = v0 + Tile::col(nt, r, lane);
        S.s[mt][nt][r] = A.h0 != nullptr && row < d.K && col < d.V
                             ? A.h0[(n * d.HV + hv) * KV + int64_t(row) * d.V + col]
                             : 0.f;
      }
  const int64_t base64 = checkpoint_base(n, bos, kChunk);
  const int64_t base = checkpoint_base(n, bos, d.chunk);
  const int64_t nc = num_chunks(eos - bos, kChunk);
  // kPerChannel: e^(G_last) of this thread's rows (r / 2) for the current and the next chunk
  float row_decay[MT][2] = {}, row_decay_next[MT][2] = {};
  auto load_row_decay = [&](int64_t last, float (&dst)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        dst[mt][r2] = exp(A.G[last * pk_stride + int64_t(hv) * KP + Tile::row(w, mt, 2 * r2, lane)]);
      }
  };
  if (nc > 0) {
    const int len0 = int(min(int64_t(kChunk), eos - bos));
    issue(bos, len0, 0);
    if constexpr (kPerChannel) load_row_decay(bos + len0 - 1, row_decay);
    for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
      sG[i] = i < len0 && !kPerChannel ? A.G[(bos + i) * d.HV + hv] : 0.f;
      sBeta[i] = i < len0 ? A.beta[(bos + i) * d.HV + hv] : 0.f;
    }
  }
  for (int64_t j = 0; j < nc; ++j) {
    const int buf = int(j & 1);
    const int64_t t0 = bos + j * kChunk;
    const int len = int(min(int64_t(kChunk), eos - t0));
    __syncthreads();  // the previous chunk's readers are done
    const bool ckpt = A.ckpt != nullptr && (t0 - bos) % d.chunk == 0;
    const int64_t slot = base + (t0 - bos) / (d.chunk > 0 ? d.chunk : 1);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int row = Tile::row(w, mt, r, lane), cl = Tile::col(nt, r, lane), col = v0 + cl;
          sST[cl * ldK + row] = float_to_bits<kind>(S.s[mt][nt][r]);
          if (ckpt && row < d.K && col < d.V) {
            A.ckpt[(slot * d.HV + hv) * KV + int64_t(row) * d.V + col] = S.s[mt][nt][r];
          }
        }
    const int len_next = j + 1 < nc ? int(min(int64_t(kChunk), eos - t0 - kChunk)) : 0;
    if (len_next > 0) {
      issue(t0 + kChunk, len_next, buf ^ 1);
    } else {
      async_commit();  // an empty group: the wait below always leaves one in flight
    }
    float g_next = 0.f, beta_next = 0.f;
    if constexpr (kPerChannel) {
      if (len_next > 0) load_row_decay(t0 + kChunk + len_next - 1, row_decay_next);
    }
    if (int(threadIdx.x) < len_next) {
      if constexpr (!kPerChannel) g_next = A.G[(t0 + kChunk + threadIdx.x) * d.HV + hv];
      beta_next = A.beta[(t0 + kChunk + threadIdx.x) * d.HV + hv];
    }
    const uint16_t* cK = sK + buf * kChunk * ldK;
    if (!kPerChannel && !k_async) {
      load_tile<kind, false>(sK + buf * kChunk * ldK, ldK, A.k + t0 * qk_stride + int64_t(h) * d.K,
                             qk_stride, kChunk, KP, len, d.K);
    }
    async_wait<1>();
    __syncthreads();
    const float* cG = sG + buf * kChunk;
    const float* cBeta = sBeta + buf * kChunk;
    const float g_last = cG[len - 1];
    for (int idx = threadIdx.x; idx < BV * (KP / 8); idx += blockDim.x) {  // S^T for output_kernel
      const int cl = idx / (KP / 8), c = 8 * (idx % (KP / 8));
      const uint32_t* from = reinterpret_cast<const uint32_t*>(sST + cl * ldK + c);
      uint32_t* to = reinterpret_cast<uint32_t*>(
          A.hT + (((base64 + j) * d.HV + hv) * VP + v0 + cl) * KP + c);
      to[0] = from[0], to[1] = from[1], to[2] = from[2], to[3] = from[3];
    }
    // vw = U' - W' S: warp w rows 16w .. 16w + 15
    {
      const uint16_t* cW = sW + buf * kChunk * ldK;
      const uint16_t* cU = sU + buf * kChunk * ldU;
      float acc[NT][4] = {};
      warp_mma<kind, false, false, NT>(acc, cW, ldK, 16 * w, sST, ldK, 0, 0, KP, lane);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r2 = 0; r2 < 2; ++r2) {
          const int i = 16 * w + lane / 4 + 8 * r2, cl = 8 * nt + 2 * (lane % 4);
          const bool ok = i < len;
          const float decay_to_end = !ok ? 0.f : kPerChannel ? 1.f : exp(g_last - cG[i]);
          uint16_t ub[2];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float x = bits_to_float<kind>(cU[i * ldU + cl + c]) - acc[nt][2 * r2 + c];
            const int64_t at = (t0 + i) * v_stride + int64_t(hv) * d.V + v0 + cl + c;
            if (A.vw != nullptr && ok && v0 + cl + c < d.V) A.vw[at] = x;
            const float uu = ok ? cBeta[i] * x : 0.f;
            ub[c] = float_to_bits<kind>(uu);
            sUT[(cl + c) * ldC + i] = float_to_bits<kind>(decay_to_end * uu);
          }
          if (ok) {
            *reinterpret_cast<uint32_t*>(A.u + (t0 + i) * pv_stride + int64_t(hv) * VP + v0 + cl) =
                pack2(ub[0], ub[1]);
          }
        }
    }
    __syncthreads();
    // S = e^(G_last) S + K^T (e^(G_last - G) o u)  (kPerChannel: (K o e^(G_last - G))^T u)
    const float decay = exp(g_last);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) S.s[mt][nt][r] *= kPerChannel ? row_decay[mt][r / 2] : decay;
      warp_mma<kind, true, false, NT>(S.s[mt], cK, ldK, 16 * (MT * w + mt), sUT, ldC, 0, 0,
                                      kChunk, lane);
    }
    if (int(threadIdx.x) < kChunk) {  // the next chunk's gates (its buffer is free)
      sG[(buf ^ 1) * kChunk + threadIdx.x] = g_next;
      sBeta[(buf ^ 1) * kChunk + threadIdx.x] = beta_next;
    }
    if constexpr (kPerChannel) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        row_decay[mt][0] = row_decay_next[mt][0];
        row_decay[mt][1] = row_decay_next[mt][1];
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = Tile::row(w, mt, r, lane), col = v0 + Tile::col(nt, r, lane);
        if (A.ht != nullptr && row < d.K && col < d.V) {  // (the backward's re-run: none)
          A.ht[(n * d.HV + hv) * KV + int64_t(row) * d.V + col] = S.s[mt][nt][r];
        }
      }
}

__host__ __device__ inline size_t state_smem(int KP, int BV) {
  return sizeof(float) * 4 * kChunk +
         sizeof(uint16_t) * (size_t(BV + 4 * kChunk) * (KP + kPad) + size_t(2 * kChunk) * (BV + kPad) +
                             size_t(BV) * (kChunk + kPad));
}

}  // namespace rlx::gdn::cuda
