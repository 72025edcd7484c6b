// The chunked gated delta kernels' shared pieces (gated_delta_chunk.cuh and the headers that
// include it): the chunk size and block shape, the kernels' arguments, mma.sync fragments
// and a warp's tile product, tile copies into shared memory (plain, cp.async, float32 rows),
// the unit lower triangular solve for T' and the T' products written to global memory.
//
// Shared-memory tiles are 16-bit, row-major with rows padded by 8 elements (conflict-free
// fragment reads by ldmatrix). An mma's A operand is read from a [m][k] tile (or a [k][m]
// one: frag_a_t), its B operand from a [n][k] tile (or a [k][n] one: frag_b_t).
// The intermediates (W', U', u, the chunk states) live in global buffers padded to KP and VP
// columns (multiples of 64), so that their rows move as 16-byte vectors.
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

// What the chunk kernels read and write ([tokens, HV, X] unless said); 16-bit values are
// bit patterns of the input dtype.
struct ChunkArgs {
  Dims<float> d;
  int KP = 0, VP = 0;            // K and V padded to multiples of 64
  const ChunkEntry* chunks = nullptr;
  int64_t num_chunks = 0;
  const uint16_t *q = nullptr, *k = nullptr;  // [tokens, H, K]
  const uint16_t* v = nullptr;
  const float *g = nullptr, *beta = nullptr, *h0 = nullptr;
  float* G = nullptr;            // [tokens, HV] chunk-local cumulative gate ([tokens, HV, KP]
                                 // for a per-channel gate)
  uint16_t* W = nullptr;         // [tokens, HV, KP] W'
  uint16_t* U = nullptr;         // [tokens, HV, VP] U' (nullptr: prep_kernel skips it)
  uint16_t* u = nullptr;         // [tokens, HV, VP] beta vw
  uint16_t* hT = nullptr;        // [slots64, HV, VP, KP] state before each chunk, transposed
  uint16_t* Tinv = nullptr;      // optional (the backward's), [tokens, HV, 64] T' rows
  // per-channel gate only (gated_delta_chunk_kda.cuh): [tokens, HV, KP] Q o e^G and
  // K o e^(G_last - G), [tokens, HV, 64] the rows of P
  uint16_t *Qg = nullptr, *Kd = nullptr, *P = nullptr;
  float* L = nullptr;            // optional (the backward's, per-channel gate): [tokens, HV, 64]
  float* vw = nullptr;           // optional, [tokens, HV, V]
  float *ht = nullptr, *ckpt = nullptr;
  uint16_t* out = nullptr;       // [tokens, HV, V]
};

__device__ __forceinline__ uint32_t pack2(uint16_t lo, uint16_t hi) {
  return uint32_t(lo) | (uint32_t(hi) << 16);
}
__device__ __forceinline__ uint32_t word_at(const uint16_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// Fragments are read with ldmatrix (m8n8 16-bit matrices, 16 bytes a row): lane 8j + r gives
// the address of row r of matrix j, and lane (g = lane / 4, t = lane % 4) receives elements
// 2t, 2t+1 of row g of matrix j (with .trans: rows 2t, 2t+1 of column g), which is the mma's
// fragment layout. One instruction reads what took 4 (untransposed) or 16 (transposed) 2-byte
// loads. Every row address must be 16-byte aligned: tiles start 16-byte aligned, and their
// leading dimensions and column offsets are multiples of 8 elements. Rows padded by 8
// elements (a 16-byte shift per row, mod 128) keep the 8 rows of a matrix on distinct banks.
template <int N, bool kTrans>
__device__ __forceinline__ void ldsm(uint32_t (&r)[N], const uint16_t* row) {
#ifndef RLX_CUDA_EMULATION
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (N == 4 && !kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
  } else if constexpr (N == 4) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
  } else if constexpr (!kTrans) {
    static_assert(N == 2, "ldsm: 2 or 4 matrices");
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(a) : "memory");
  } else {
    static_assert(N == 2, "ldsm: 2 or 4 matrices");
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(a) : "memory");
  }
#else
  emu::ldmatrix<N, kTrans>(r, row);
#endif
}

// A fragment of rows m0.., k0.. of a [m][k] tile (matrices: rows m0 / m0 + 8, columns k0 /
// k0 + 8); of A = X^T, X a [k][m] tile (transposed matrices of X: rows k0 / k0 + 8).
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const uint16_t* t, int ld, int m0,
                                       int k0, int lane) {
  const int j = lane / 8, r = lane % 8;
  ldsm<4, false>(a, t + (m0 + r + 8 * (j % 2)) * ld + k0 + 8 * (j / 2));
}
__device__ __forceinline__ void frag_a_t(uint32_t (&a)[4], const uint16_t* t, int ld, int m0,
                                         int k0, int lane) {
  const int j = lane / 8, r = lane % 8;
  ldsm<4, true>(a, t + (k0 + r + 8 * (j / 2)) * ld + m0 + 8 * (j % 2));
}
// B fragment of n0.., k0.. of a [n][k] tile (B transposed); of B = X, X a [k][n] tile.
__device__ __forceinline__ void frag_b(uint32_t (&b)[2], const uint16_t* t, int ld, int n0,
                                       int k0, int lane) {
  const int j = lane % 16 / 8, r = lane % 8;  // (lanes 16.. give no address)
  ldsm<2, false>(b, t + (n0 + r) * ld + k0 + 8 * j);
}
__device__ __forceinline__ void frag_b_t(uint32_t (&b)[2], const uint16_t* t, int ld, int n0,
                                         int k0, int lane) {
  const int j = lane % 16 / 8, r = lane % 8;
  ldsm<2, true>(b, t + (k0 + r + 8 * j) * ld + n0);
}
// The B fragments of n0.. (b[0], b[1]) and n0 + 8.. (b[2], b[3]) at once.
__device__ __forceinline__ void frag_b2(uint32_t (&b)[4], const uint16_t* t, int ld, int n0,
                                        int k0, int lane) {
  const int j = lane / 8, r = lane % 8;
  ldsm<4, false>(b, t + (n0 + r + 8 * (j / 2)) * ld + k0 + 8 * (j % 2));
}
__device__ __forceinline__ void frag_b2_t(uint32_t (&b)[4], const uint16_t* t, int ld, int n0,
                                          int k0, int lane) {
  const int j = lane / 8, r = lane % 8;
  ldsm<4, true>(b, t + (k0 + r + 8 * (j % 2)) * ld + n0 + 8 * (j / 2));
}
// acc[0] += A B[n0..], acc[1] += A B[n0 + 8..] (B as in frag_b2 / frag_b2_t)
template <Bits16 kind, bool kBT>
__device__ __forceinline__ void mma_pair(float (&acc0)[4], float (&acc1)[4],
                                         const uint32_t (&a)[4], const uint16_t* b, int ldb,
                                         int n0, int k0, int lane) {
  uint32_t bf[4];
  if constexpr (kBT) {
    frag_b2_t(bf, b, ldb, n0, k0, lane);
  } else {
    frag_b2(bf, b, ldb, n0, k0, lane);
  }
  const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
  mma_16816<kind>(acc0, a, b0);
  mma_16816<kind>(acc1, a, b1);
}

// One warp's acc (16 rows from m0, 8 NT columns from n0) += A B over k in [k_begin, k_end)
// (multiples of 16). A is read from a [m][k] tile, or a [k][m] one (kAT); B from a [n][k]
// tile, or a [k][n] one (kBT). Accumulator r of column tile nt is element
// (m0 + lane / 4 + 8 (r / 2), n0 + 8 nt + 2 (lane % 4) + r % 2): acc_row, acc_col.
template <Bits16 kind, bool kAT, bool kBT, int NT>
__device__ __forceinline__ void warp_mma(float (&acc)[NT][4], const uint16_t* a, int lda,
                                         int m0, const uint16_t* b, int ldb, int n0,
                                         int k_begin, int k_end, int lane) {
  for (int k0 = k_begin; k0 < k_end; k0 += 16) {
    uint32_t af[4];
    if constexpr (kAT) {
      frag_a_t(af, a, lda, m0, k0, lane);
    } else {
      frag_a(af, a, lda, m0, k0, lane);
    }
#pragma unroll
    for (int nt = 0; nt + 1 < NT; nt += 2) {
      mma_pair<kind, kBT>(acc[nt], acc[nt + 1], af, b, ldb, n0 + 8 * nt, k0, lane);
    }
    if constexpr (NT % 2 == 1) {
      uint32_t bf[2];
      if constexpr (kBT) {
        frag_b_t(bf, b, ldb, n0 + 8 * (NT - 1), k0, lane);
      } else {
        frag_b(bf, b, ldb, n0 + 8 * (NT - 1), k0, lane);
      }
      mma_16816<kind>(acc[NT - 1], af, bf);
    }
  }
}
__device__ __forceinline__ int acc_row(int m0, int r, int lane) {
  return m0 + lane / 4 + 8 * (r / 2);
}
__device__ __forceinline__ int acc_col(int nt, int r, int lane) {
  return 8 * nt + 2 * (lane % 4) + (r % 2);
}

// dst (16-bit tile, leading dim ld) <- src rows [0, rows) x cols [0, cols) (row r, column c
// at src[r * stride + c]), times scale(r) when given; zero outside rows_ok x cols_ok.
// Transposed: element (r, c) goes to dst[c * ld + r]. Rows move as 16-byte vectors where
// src allows (cols_ok and stride multiples of 8, src 16-byte aligned), several loads in flight
// per thread before their stores.
struct NoScale {
  __device__ __forceinline__ float operator()(int) const { return 1.f; }
};
template <Bits16 kind, bool kTranspose, typename Scale = NoScale>
__device__ __forceinline__ void load_tile(uint16_t* dst, int ld, const uint16_t* src,
                                          int64_t stride, int rows, int cols, int rows_ok,
                                          int cols_ok, Scale scale = Scale()) {
  constexpr bool kScaled = !std::is_same_v<Scale, NoScale>;
  constexpr int kBatch = 4;
  const bool vec = cols_ok % 8 == 0 && stride % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(src) % 16 == 0 && cols % 8 == 0;
  if (vec) {
    const int c8 = cols / 8, n = rows * c8;
    for (int base = threadIdx.x; base < n; base += kBatch * blockDim.x) {
      uint32_t buf[kBatch][4];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int idx = base + b * blockDim.x, r = idx / c8, c = 8 * (idx % c8);
        if (idx < n && r < rows_ok && c < cols_ok) {
          const rlx::codebook::cuda::Bytes16 x = rlx::codebook::cuda::load16(src + r * stride + c);
#pragma unroll
          for (int e = 0; e < 4; ++e) buf[b][e] = x.w[e];
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) buf[b][e] = 0;
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int idx = base + b * blockDim.x, r = idx / c8, c = 8 * (idx % c8);
        if (idx >= n) continue;
        if constexpr (kScaled) {
          const float f = r < rows_ok ? scale(r) : 0.f;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const uint16_t lo = float_to_bits<kind>(bits_to_float<kind>(uint16_t(buf[b][e])) * f);
            const uint16_t hi = float_to_bits<kind>(bits_to_float<kind>(uint16_t(buf[b][e] >> 16)) * f);
            buf[b][e] = pack2(lo, hi);
          }
        }
        if constexpr (kTranspose) {
#pragma unroll
          for (int e = 0; e < 8; ++e) dst[(c + e) * ld + r] = uint16_t(buf[b][e / 2] >> (16 * (e % 2)));
        } else {
          uint32_t* to = reinterpret_cast<uint32_t*>(dst + r * ld + c);
#pragma unroll
          for (int e = 0; e < 4; ++e) to[e] = buf[b][e];
        }
      }
    }
    return;
  }
  const int n = rows * cols;
  for (int base = threadIdx.x; base < n; base += 8 * blockDim.x) {
    uint16_t buf[8];
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      const int idx = base + b * blockDim.x, r = idx / cols, c = idx % cols;
      buf[b] = idx < n && r < rows_ok && c < cols_ok ? src[r * stride + c] : uint16_t(0);
    }
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      const int idx = base + b * blockDim.x, r = idx / cols, c = idx % cols;
      if (idx >= n) continue;
      uint16_t bits = buf[b];
      if constexpr (kScaled) {
        bits = r < rows_ok ? float_to_bits<kind>(bits_to_float<kind>(bits) * scale(r)) : uint16_t(0);
      }
      dst[kTranspose ? c * ld + r : r * ld + c] = bits;
    }
  }
}

__device__ __forceinline__ void zero16(uint16_t* p) {
  uint32_t* q = reinterpret_cast<uint32_t*>(p);
  q[0] = q[1] = q[2] = q[3] = 0;
}

// load_tile (unscaled, not transposed) with cp.async where rows move as 16-byte vectors, so
// that the copies of several tiles are in flight at once; elsewhere load_tile itself. The
// caller commits, waits and syncs the block before reading dst.
template <Bits16 kind>
__device__ __forceinline__ void load_tile_async(uint16_t* dst, int ld, const uint16_t* src,
                                                int64_t stride, int rows, int cols, int rows_ok,
                                                int cols_ok) {
  const bool vec = cols_ok % 8 == 0 && stride % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(src) % 16 == 0 && cols % 8 == 0;
  if (!vec) {
    load_tile<kind, false>(dst, ld, src, stride, rows, cols, rows_ok, cols_ok);
    return;
  }
  const int c8 = cols / 8;
  for (int idx = threadIdx.x; idx < rows * c8; idx += blockDim.x) {
    const int r = idx / c8, c = 8 * (idx % c8);
    if (r < rows_ok && c < cols_ok) {
      rlx::codebook::cuda::copy16_async(dst + r * ld + c, src + r * stride + c);
    } else {
      zero16(dst + r * ld + c);
    }
  }
}

// Waits for this thread's copies, then for the block's.
__device__ __forceinline__ void tiles_landed() {
  rlx::codebook::cuda::async_commit();
  rlx::codebook::cuda::async_wait<0>();
  __syncthreads();
}

// Float32 rows [rows][cols] (source row stride `stride`) into shared memory (row stride ld),
// with 16-byte cp.async where rows move as 4-float vectors, else with plain loads. Columns at or
// past cols_ok are zero; rows at or past rows_ok are zero, or with kRepeatLast copies of row
// rows_ok - 1 (rows_ok >= 1). The caller commits, waits and syncs the block before reading dst.
template <bool kRepeatLast = false>
__device__ __forceinline__ void load_rows_async(float* dst, int ld, const float* src,
                                                int64_t stride, int rows, int cols, int rows_ok,
                                                int cols_ok) {
  const bool vec = cols_ok % 4 == 0 && cols % 4 == 0 && stride % 4 == 0 && ld % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(src) % 16 == 0;
  const int step = vec ? 4 : 1, per_row = cols / step;
  for (int idx = threadIdx.x; idx < rows * per_row; idx += blockDim.x) {
    const int r = idx / per_row, c = step * (idx % per_row);
    const int from = kRepeatLast ? min(r, rows_ok - 1) : r;
    const bool ok = (kRepeatLast || r < rows_ok) && c < cols_ok;
    if (vec && ok) {
      rlx::codebook::cuda::copy16_async(dst + r * ld + c, src + from * stride + c);
    } else {
      for (int x = 0; x < step; ++x) dst[r * ld + c + x] = ok ? src[from * stride + c + x] : 0.f;
    }
  }
}

// T' = (I + M)^-1 (M strictly lower, float32 [64][65]) into sT (16-bit, [64][72]) by forward
// substitution, one column c per thread (x in registers): x_i = delta_ic - sum_{j < i} M_ij x_j
// (x_j = 0 for j < c). Also T' rows 0 .. len - 1 to Tinv (row stride tinv_stride) when given.
template <Bits16 kind>
__device__ __forceinline__ void solve_unit_lower(const float* sM, uint16_t* sT, uint16_t* Tinv,
                                                 int64_t tinv_stride, int len) {
  constexpr int ldC = kChunk + kPad;
  if (threadIdx.x < kChunk) {
    const int c = threadIdx.x;
    float x[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      float s0 = i == c ? 1.f : 0.f, s1 = 0.f;  // two partial sums: half the dependent chain
#pragma unroll
      for (int j = 0; j + 1 < i; j += 2) {
        s0 -= sM[i * (kChunk + 1) + j] * x[j];
        s1 -= sM[i * (kChunk + 1) + j + 1] * x[j + 1];
      }
      if (i % 2 == 1) s0 -= sM[i * (kChunk + 1) + i - 1] * x[i - 1];
      x[i] = s0 + s1;
    }
    for (int i = 0; i < kChunk; ++i) sT[i * ldC + c] = float_to_bits<kind>(x[i]);
    if (Tinv != nullptr) {  // (column c of the rows the chunk has)
      for (int i = 0; i < len; ++i) Tinv[i * tinv_stride + c] = sT[i * ldC + c];
    }
  }
}

// dst rows 0 .. len - 1 (row stride dst_stride) <- T' rhs (rhs [64][cols], leading dim ld),
// 16-bit: warp w rows 16w.., 64 columns at a time, pads included.
template <Bits16 kind>
__device__ __forceinline__ void store_t_product(const uint16_t* sT, const uint16_t* rhs, int ld,
                                                int cols, uint16_t* dst, int64_t dst_stride,
                                                int len) {
  constexpr int ldC = kChunk + kPad;
  const int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  for (int n0 = 0; n0 < cols; n0 += 64) {
    float acc[8][4] = {};  // (T' is lower triangular: k up to the warp's rows)
    warp_mma<kind, false, true, 8>(acc, sT, ldC, 16 * w, rhs, ld, n0, 0, 16 * w + 16, lane);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        const int i = 16 * w + lane / 4 + 8 * r2, c = n0 + 8 * nt + 2 * (lane % 4);
        if (i < len) {
          *reinterpret_cast<uint32_t*>(dst + i * dst_stride + c) =
              pack2(float_to_bits<kind>(acc[nt][2 * r2]), float_to_bits<kind>(acc[nt][2 * r2 + 1]));
        }
      }
    }
  }
}

}  // namespace rlx::gdn::cuda
