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
// Shared-memory tiles are 16-bit, row-major with rows padded by 8 elements (conflict-free
// fragment reads). An mma's A operand is read from a [m][k] tile, its B operand from a [n][k]
// tile (B transposed): every product below stores its right factor transposed for that.
//
// Also compiled on the CPU by tests/cuda_emu (RLX_CUDA_EMULATION).
#pragma once

#include <cstdint>
#include <type_traits>

#include "codebook_mma.cuh"
#include "gated_delta_cuda.cuh"

namespace rlx::gdn::cuda {

using rlx::codebook::cuda::Bits16;
using rlx::codebook::cuda::bits_to_float;
using rlx::codebook::cuda::float_to_bits;
using rlx::codebook::cuda::mma_16816;

constexpr int kChunk = 64;
constexpr int kChunkWarps = 4;  // every chunk kernel runs 4 warps; warp w owns rows 16w..
constexpr int kChunkThreads = kChunkWarps * kWarp;
constexpr int kPad = 8;          // 16-bit elements of padding per shared-memory row
constexpr int kOutCols = 64;     // value columns per output_kernel block

// One chunk of one sequence: global token start, length (1..64), the sequence, its 64-token
// state slot (checkpoint_base(n, bos, 64) + chunk index).
struct ChunkEntry {
  int64_t t0, len, n, slot;
};

// What the chunk kernels read and write ([tokens, HV, X] unless said).
template <typename qk_t, typename v_t>
struct ChunkArgs {
  Dims<float> d;
  int KP = 0;                    // K padded to a multiple of 16
  const ChunkEntry* chunks = nullptr;
  int64_t num_chunks = 0;
  const qk_t *q = nullptr, *k = nullptr;  // [tokens, H, K]
  const v_t* v = nullptr;
  const float *g = nullptr, *beta = nullptr, *h0 = nullptr;
  float* G = nullptr;            // [tokens, HV] chunk-local cumulative gate
  uint16_t* W = nullptr;         // [tokens, HV, K] W'
  uint16_t* U = nullptr;         // [tokens, HV, V] U'
  uint16_t* u = nullptr;         // [tokens, HV, V] beta vw
  uint16_t* hT = nullptr;        // [slots64, HV, V, K] state before each chunk, transposed
  float* vw = nullptr;           // optional
  float *ht = nullptr, *ckpt = nullptr;
  v_t* out = nullptr;
};

__device__ __forceinline__ uint32_t pack2(uint16_t lo, uint16_t hi) {
  return uint32_t(lo) | (uint32_t(hi) << 16);
}
__device__ __forceinline__ uint32_t word_at(const uint16_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// A fragment of rows m0.., k0.. of a [m][k] tile; B fragment of n0.., k0.. of a [n][k] tile.
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const uint16_t* t, int ld, int m0,
                                       int k0, int lane) {
  const int g = lane / 4, c = 2 * (lane % 4);
  a[0] = word_at(t + (m0 + g) * ld + k0 + c);
  a[1] = word_at(t + (m0 + g + 8) * ld + k0 + c);
  a[2] = word_at(t + (m0 + g) * ld + k0 + c + 8);
  a[3] = word_at(t + (m0 + g + 8) * ld + k0 + c + 8);
}
__device__ __forceinline__ void frag_b(uint32_t (&b)[2], const uint16_t* t, int ld, int n0,
                                       int k0, int lane) {
  const int g = lane / 4, c = 2 * (lane % 4);
  b[0] = word_at(t + (n0 + g) * ld + k0 + c);
  b[1] = word_at(t + (n0 + g) * ld + k0 + c + 8);
}

template <typename src_t>
__device__ __forceinline__ float load_float(const src_t* p) {
  return static_cast<float>(*p);
}

// dst (16-bit tile, leading dim ld) <- src rows [0, rows) x cols [0, cols) (row r, column c
// at src[r * stride + c]), times scale(r); zero outside rows_ok x cols_ok. Transposed: element
// (r, c) goes to dst[c * ld + r]. uint16_t sources are copied as bits (scale unused).
struct NoScale {
  __device__ __forceinline__ float operator()(int) const { return 1.f; }
};
template <Bits16 kind, bool kTranspose, typename src_t, typename Scale = NoScale>
__device__ __forceinline__ void load_tile(uint16_t* dst, int ld, const src_t* src,
                                          int64_t stride, int rows, int cols, int rows_ok,
                                          int cols_ok, Scale scale = Scale()) {
  for (int idx = threadIdx.x; idx < rows * cols; idx += blockDim.x) {
    const int r = idx / cols, c = idx % cols;
    uint16_t bits = 0;
    if (r < rows_ok && c < cols_ok) {
      if constexpr (std::is_same_v<src_t, uint16_t>) {
        bits = src[r * stride + c];
      } else {
        bits = float_to_bits<kind>(load_float(src + r * stride + c) * scale(r));
      }
    }
    dst[kTranspose ? c * ld + r : r * ld + c] = bits;
  }
}

// ---- prep: G, W' and U' of one chunk and value head ---------------------------------------
template <Bits16 kind, typename qk_t, typename v_t>
__global__ void __launch_bounds__(kChunkThreads) prep_kernel(const ChunkArgs<qk_t, v_t> A) {
  const Dims<float>& d = A.d;
  const int KP = A.KP, VP = (d.V + 15) / 16 * 16, lane = threadIdx.x % kWarp;
  const int w = threadIdx.x / kWarp;
  const int hv = int(blockIdx.x % d.HV), h = hv / d.group;
  const ChunkEntry e = A.chunks[blockIdx.x / d.HV];
  const int len = int(e.len);
  float* sG = dynamic_smem<float>();
  float* sBeta = sG + kChunk;
  float* sM = sBeta + kChunk;              // [64][65] M, then T' (float32)
  uint16_t* sK = reinterpret_cast<uint16_t*>(sM + kChunk * (kChunk + 1));  // [64][KP+8]
  const int ldK = KP + kPad, ldC = kChunk + kPad;
  uint16_t* sKgT = sK + kChunk * ldK;      // [KP][72]
  uint16_t* sVT = sKgT + KP * ldC;         // [VP][72]
  uint16_t* sT = sVT + VP * ldC;           // [64][72] T'
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
    sG[i] = i < len ? A.g[(e.t0 + i) * d.HV + hv] : 0.f;
    sBeta[i] = i < len ? A.beta[(e.t0 + i) * d.HV + hv] : 0.f;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float acc = 0.f;
    for (int i = 0; i < kChunk; ++i) sG[i] = acc += sG[i];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < len; i += blockDim.x) A.G[(e.t0 + i) * d.HV + hv] = sG[i];
  const int64_t qk_stride = int64_t(d.H) * d.K, v_stride = int64_t(d.HV) * d.V;
  const qk_t* k = A.k + e.t0 * qk_stride + int64_t(h) * d.K;
  load_tile<kind, false>(sK, ldK, k, qk_stride, kChunk, KP, len, d.K);
  load_tile<kind, true>(sKgT, ldC, k, qk_stride, kChunk, KP, len, d.K,
                        [sG](int r) { return exp(sG[r]); });
  load_tile<kind, true>(sVT, ldC, A.v + e.t0 * v_stride + int64_t(hv) * d.V, v_stride, kChunk,
                        VP, len, d.V);
  __syncthreads();
  // M = strictly-lower(K K^T o e^(G_i - G_j)) diag(beta); warp w: rows 16w .. 16w + 15
  {
    float acc[8][4] = {};
    for (int k0 = 0; k0 < KP; k0 += 16) {
      uint32_t a[4];
      frag_a(a, sK, ldK, 16 * w, k0, lane);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        if (nt > 2 * w + 1) continue;  // above the diagonal
        uint32_t b[2];
        frag_b(b, sK, ldK, 8 * nt, k0, lane);
        mma_16816<kind>(acc[nt], a, b);
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
  // T' = (I + M)^-1 by forward substitution, one column c per thread (x in registers):
  // x_i = delta_ic - sum_{j < i} M_ij x_j (x_j = 0 for j < c).
  if (threadIdx.x < kChunk) {
    const int c = threadIdx.x;
    float x[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      float s = i == c ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < i; ++j) s -= sM[i * (kChunk + 1) + j] * x[j];
      x[i] = s;
    }
    for (int i = 0; i < kChunk; ++i) sT[i * ldC + c] = float_to_bits<kind>(x[i]);
  }
  __syncthreads();
  // W' = T' (K o e^G), U' = T' V: warp w rows 16w.., 64 columns at a time
  auto product = [&](const uint16_t* rhsT, int cols, int cols_ok, uint16_t* dst, int64_t stride) {
    for (int n0 = 0; n0 < cols; n0 += 64) {
      float acc[8][4] = {};
#pragma unroll
      for (int k0 = 0; k0 < kChunk; k0 += 16) {
        if (k0 > 16 * w) continue;  // T' is lower triangular
        uint32_t a[4];
        frag_a(a, sT, ldC, 16 * w, k0, lane);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          if (n0 + 8 * nt >= cols) continue;
          uint32_t b[2];
          frag_b(b, rhsT, ldC, n0 + 8 * nt, k0, lane);
          mma_16816<kind>(acc[nt], a, b);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 16 * w + lane / 4 + 8 * (r / 2);
          const int c = n0 + 8 * nt + 2 * (lane % 4) + (r % 2);
          if (i < len && c < cols_ok) dst[(e.t0 + i) * stride + c] = float_to_bits<kind>(acc[nt][r]);
        }
      }
    }
  };
  product(sKgT, KP, d.K, A.W + int64_t(hv) * d.K, int64_t(d.HV) * d.K);
  product(sVT, VP, d.V, A.U + int64_t(hv) * d.V, v_stride);
}

__host__ __device__ inline size_t prep_smem(int KP, int VP) {
  return sizeof(float) * (2 * kChunk + kChunk * (kChunk + 1)) +
         sizeof(uint16_t) * (size_t(kChunk) * (KP + kPad) + size_t(KP + VP + kChunk) *
                                                                 (kChunk + kPad));
}

// ---- state: the recurrence over the chunks of one sequence, value head, BV-column tile --
// S [KP][BV] float32 in mma accumulators: warp w owns rows 16 (MT w + mt) .. + 15.
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

template <Bits16 kind, typename qk_t, typename v_t, int MT, int NT>
__global__ void __launch_bounds__(kChunkThreads) state_kernel(const ChunkArgs<qk_t, v_t> A) {
  using Tile = StateTile<MT, NT>;
  constexpr int BV = 8 * NT;
  const Dims<float>& d = A.d;
  const int KP = 64 * MT, lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const int nvt = int(ceil_div(d.V, BV));
  const int vt = int(blockIdx.x % nvt), hv = int(blockIdx.x / nvt % d.HV), h = hv / d.group;
  const int64_t n = blockIdx.x / nvt / d.HV;
  const int64_t bos = d.cu != nullptr ? d.cu[n] : n * d.seq_len;
  const int64_t eos = d.cu != nullptr ? d.cu[n + 1] : bos + d.seq_len;
  const int ldK = KP + kPad, ldC = kChunk + kPad, v0 = vt * BV;
  float* sG = dynamic_smem<float>();
  float* sBeta = sG + kChunk;
  uint16_t* sST = reinterpret_cast<uint16_t*>(sBeta + kChunk);  // [BV][KP+8] S^T
  uint16_t* sW = sST + BV * ldK;                                 // [64][KP+8] W'
  uint16_t* sKdT = sW + kChunk * ldK;                            // [KP][72]
  uint16_t* sUT = sKdT + KP * ldC;                               // [BV][72] u^T
  const int64_t KV = int64_t(d.K) * d.V, qk_stride = int64_t(d.H) * d.K;
  const int64_t v_stride = int64_t(d.HV) * d.V, w_stride = int64_t(d.HV) * d.K;
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
  for (int64_t t0 = bos, j = 0; t0 < eos; t0 += kChunk, ++j) {
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
          const uint16_t bits = float_to_bits<kind>(S.s[mt][nt][r]);
          sST[cl * ldK + row] = bits;
          if (row < d.K && col < d.V) {
            A.hT[((base64 + j) * d.HV + hv) * KV + int64_t(col) * d.K + row] = bits;
            if (ckpt) A.ckpt[(slot * d.HV + hv) * KV + int64_t(row) * d.V + col] = S.s[mt][nt][r];
          }
        }
    for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
      sG[i] = i < len ? A.G[(t0 + i) * d.HV + hv] : 0.f;
      sBeta[i] = i < len ? A.beta[(t0 + i) * d.HV + hv] : 0.f;
    }
    load_tile<kind, false>(sW, ldK, A.W + t0 * w_stride + int64_t(hv) * d.K, w_stride, kChunk,
                           KP, len, d.K);
    __syncthreads();
    const float g_last = sG[len - 1];
    load_tile<kind, true>(sKdT, ldC, A.k + t0 * qk_stride + int64_t(h) * d.K, qk_stride, kChunk,
                          KP, len, d.K, [sG, g_last](int r) { return exp(g_last - sG[r]); });
    // vw = U' - W' S0: warp w rows 16w .. 16w + 15
    {
      float acc[NT][4] = {};
      for (int k0 = 0; k0 < KP; k0 += 16) {
        uint32_t a[4];
        frag_a(a, sW, ldK, 16 * w, k0, lane);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint32_t b[2];
          frag_b(b, sST, ldK, 8 * nt, k0, lane);
          mma_16816<kind>(acc[nt], a, b);
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 16 * w + lane / 4 + 8 * (r / 2), cl = Tile::col(nt, r, lane);
          const int col = v0 + cl;
          uint16_t bits = 0;
          if (i < len && col < d.V) {
            const int64_t at = (t0 + i) * v_stride + int64_t(hv) * d.V + col;
            const float x = bits_to_float<kind>(A.U[at]) - acc[nt][r];
            if (A.vw != nullptr) A.vw[at] = x;
            bits = float_to_bits<kind>(sBeta[i] * x);
            A.u[at] = bits;
          }
          sUT[cl * ldC + i] = bits;
        }
    }
    __syncthreads();
    // S = e^(G_last) S + (K o e^(G_last - G))^T u
    const float decay = exp(g_last);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) S.s[mt][nt][r] *= decay;
#pragma unroll
      for (int k0 = 0; k0 < kChunk; k0 += 16) {
        uint32_t a[4];
        frag_a(a, sKdT, ldC, 16 * (MT * w + mt), k0, lane);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint32_t b[2];
          frag_b(b, sUT, ldC, 8 * nt, k0, lane);
          mma_16816<kind>(S.s[mt][nt], a, b);
        }
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
        if (row < d.K && col < d.V) A.ht[(n * d.HV + hv) * KV + int64_t(row) * d.V + col] = S.s[mt][nt][r];
      }
}

__host__ __device__ inline size_t state_smem(int KP, int BV) {
  return sizeof(float) * 2 * kChunk +
         sizeof(uint16_t) * (size_t(BV + kChunk) * (KP + kPad) + size_t(KP + BV) * (kChunk + kPad));
}

// ---- output: o of one chunk, value head and 64-column tile ---------------------------------
template <Bits16 kind, typename qk_t, typename v_t>
__global__ void __launch_bounds__(kChunkThreads) output_kernel(const ChunkArgs<qk_t, v_t> A) {
  const Dims<float>& d = A.d;
  const int KP = A.KP, lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const int nvt = int(ceil_div(d.V, kOutCols));
  const int vt = int(blockIdx.x % nvt), hv = int(blockIdx.x / nvt % d.HV), h = hv / d.group;
  const ChunkEntry e = A.chunks[blockIdx.x / nvt / d.HV];
  const int len = int(e.len), v0 = vt * kOutCols;
  const int ldK = KP + kPad, ldC = kChunk + kPad;
  float* sG = dynamic_smem<float>();
  uint16_t* sQ = reinterpret_cast<uint16_t*>(sG + kChunk);  // [64][KP+8]
  uint16_t* sK = sQ + kChunk * ldK;                          // [64][KP+8]
  uint16_t* sST = sK + kChunk * ldK;                         // [64][KP+8] S0^T
  uint16_t* sUT = sST + kOutCols * ldK;                      // [64][72] u^T
  const int64_t KV = int64_t(d.K) * d.V, qk_stride = int64_t(d.H) * d.K;
  const int64_t v_stride = int64_t(d.HV) * d.V;
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
    sG[i] = i < len ? A.G[(e.t0 + i) * d.HV + hv] : 0.f;
  }
  load_tile<kind, false>(sQ, ldK, A.q + e.t0 * qk_stride + int64_t(h) * d.K, qk_stride, kChunk,
                         KP, len, d.K);
  load_tile<kind, false>(sK, ldK, A.k + e.t0 * qk_stride + int64_t(h) * d.K, qk_stride, kChunk,
                         KP, len, d.K);
  load_tile<kind, false>(sST, ldK, A.hT + (e.slot * d.HV + hv) * KV + int64_t(v0) * d.K,
                         int64_t(d.K), kOutCols, KP, d.V - v0, d.K);
  load_tile<kind, true>(sUT, ldC, A.u + e.t0 * v_stride + int64_t(hv) * d.V + v0, v_stride,
                        kChunk, kOutCols, len, d.V - v0);
  __syncthreads();
  const int g4 = lane / 4, t2 = 2 * (lane % 4);
  // P = [j <= i] (Q K^T) o e^(G_i - G_j), rows 16w .. 16w + 15
  float P[8][4] = {};
  for (int k0 = 0; k0 < KP; k0 += 16) {
    uint32_t a[4];
    frag_a(a, sQ, ldK, 16 * w, k0, lane);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt > 2 * w + 1) continue;
      uint32_t b[2];
      frag_b(b, sK, ldK, 8 * nt, k0, lane);
      mma_16816<kind>(P[nt], a, b);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
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
    a[0] = pack2(float_to_bits<kind>(P[2 * kk][0]), float_to_bits<kind>(P[2 * kk][1]));
    a[1] = pack2(float_to_bits<kind>(P[2 * kk][2]), float_to_bits<kind>(P[2 * kk][3]));
    a[2] = pack2(float_to_bits<kind>(P[2 * kk + 1][0]), float_to_bits<kind>(P[2 * kk + 1][1]));
    a[3] = pack2(float_to_bits<kind>(P[2 * kk + 1][2]), float_to_bits<kind>(P[2 * kk + 1][3]));
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      uint32_t b[2];
      frag_b(b, sUT, ldC, 8 * nt, 16 * kk, lane);
      mma_16816<kind>(O[nt], a, b);
    }
  }
  for (int k0 = 0; k0 < KP; k0 += 16) {  // Y = Q S0
    uint32_t a[4];
    frag_a(a, sQ, ldK, 16 * w, k0, lane);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      uint32_t b[2];
      frag_b(b, sST, ldK, 8 * nt, k0, lane);
      mma_16816<kind>(Y[nt], a, b);
    }
  }
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    const int i = 16 * w + g4 + 8 * r2;
    if (i >= len) continue;
    const float eg = exp(sG[i]);
    v_t* out = A.out + (e.t0 + i) * v_stride + int64_t(hv) * d.V;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = v0 + 8 * nt + t2 + c, r = 2 * r2 + c;
        if (col < d.V) out[col] = static_cast<v_t>(d.scale * (eg * Y[nt][r] + O[nt][r]));
      }
  }
}

__host__ __device__ inline size_t output_smem(int KP) {
  return sizeof(float) * kChunk + sizeof(uint16_t) * (size_t(2 * kChunk + kOutCols) * (KP + kPad) +
                                                      size_t(kOutCols) * (kChunk + kPad));
}

}  // namespace rlx::gdn::cuda
