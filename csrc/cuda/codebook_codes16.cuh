// Device kernels of the codebook matmul with 16-bit codes (AQLM's 1x16 and 2x16 schemes:
// E up to 65536 entries, int16 or uint16 indices read as their uint16 bit pattern). The host
// code is in codebook_codes16.cu.
//
// A 16-bit codebook does not fit in shared memory (65536 entries of D = 8 float16 values are
// 1 MiB per codebook), so these kernels read the entries from global memory, where the
// codebook stays in L2, with 16-byte loads where D = 8 and the entries are aligned:
//   forward_small_kernel   one warp per output row, lanes striding over the groups, up to
//                          kMaxSmallBatch batch rows; a butterfly of shuffles adds the lanes.
//   dequantize_kernel      the dense weight, one thread per (row, group), for the large-batch
//                          forward and for dx (then cuBLAS through ATen).
//   dcodebook_kernel       dC[m, e, :] by sorted segments: the host sorts the keys m * E + code
//                          (stably, so the order is fixed) and gives each (m, e) one warp,
//                          whose lanes add the segment's dW[j, g*D .. g*D + D) in order and
//                          a butterfly adds the lanes.
// Every sum has a fixed order and there are no atomics, so results are bitwise reproducible.
//
// Compiled on the CPU by tests/cuda_emu (RLX_CUDA_EMULATION) as codebook_mma.cuh is: no ATen,
// 16-bit floats as uint16_t bit patterns, 1-D grids, no gridDim.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "codebook_elem.cuh"
#include "codebook_mma.cuh"

namespace rlx::codebook::cuda::codes16 {

constexpr int kLanes = 32;
constexpr unsigned kAllLanes = 0xffffffffu;
constexpr int kWarps = 8;             // warps per block of every kernel here
constexpr int kThreads = kWarps * kLanes;
constexpr int kMaxSmallBatch = 8;     // batch rows of forward_small_kernel (else dense)
constexpr int kMaxFromXBatch = 16;    // batch rows up to which dC is computed from x
constexpr int kSegmentCoords = 8;     // entry coordinates t a dcodebook_kernel pass adds

// The element types (codebook_elem.cuh), by their names here.
using cuda::acc_t;
using cuda::acc_to_elem;
using cuda::Elem;
using cuda::elem_to_acc;
using cuda::storage_t;

// Eight consecutive elements at p (16-byte aligned) in the accumulation type: one 16-byte load
// for 16-bit elements, two for float32, four for float64.
template <Elem e>
__device__ __forceinline__ void load8_vec(const storage_t<e>* p, acc_t<e> (&v)[8]) {
  constexpr int kVecs = static_cast<int>(8 * sizeof(storage_t<e>) / 16);
  uint4 raw[kVecs];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) raw[i] = RLX_LDG(reinterpret_cast<const uint4*>(p) + i);
  storage_t<e> s[8];
  memcpy(s, raw, sizeof(s));
#pragma unroll
  for (int t = 0; t < 8; ++t) v[t] = elem_to_acc<e>(s[t]);
}

// The same eight elements with element loads (p not 16-byte aligned).
template <Elem e>
__device__ __forceinline__ void load8_scalar(const storage_t<e>* p, acc_t<e> (&v)[8]) {
#pragma unroll
  for (int t = 0; t < 8; ++t) v[t] = elem_to_acc<e>(RLX_LDG(p + t));
}

// w[t] = sum_m C[m, code[m], t] for one group (D = 8), in the accumulation type; the entries
// are read with 16-byte loads when `vec_cb` (the codebook starts 16-byte aligned).
template <Elem e>
__device__ __forceinline__ void sum_entries8(const storage_t<e>* __restrict__ cb,
                                             const uint16_t* code, int M, int E, bool vec_cb,
                                             acc_t<e> (&w)[8]) {
#pragma unroll
  for (int t = 0; t < 8; ++t) w[t] = acc_t<e>(0);
  for (int m = 0; m < M; ++m) {
    const storage_t<e>* entry = cb + (static_cast<int64_t>(m) * E + code[m]) * 8;
    acc_t<e> v[8];
    if (vec_cb) {
      load8_vec<e>(entry, v);
    } else {
      load8_scalar<e>(entry, v);
    }
#pragma unroll
    for (int t = 0; t < 8; ++t) w[t] += v[t];
  }
}

// Sum over the warp's lanes by a fixed butterfly: every lane ends with the same total, added
// in the same order on every run.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) v += __shfl_xor_sync(kAllLanes, v, off);
  return v;
}

// What forward_small_kernel writes: x's dtype, or (OUT_ACC) the accumulation type.
template <Elem e, bool OUT_ACC>
using out_elem_t = std::conditional_t<OUT_ACC, acc_t<e>, storage_t<e>>;

// out[b, j] = s_j * sum_{g, m, t} x[b, g*D + t] * C[m, codes[j, g, m], t] + bias_j for the
// B <= BT batch rows (scales and bias may be null). Warp w of block k takes output row
// j = k * kWarps + w; lane l the groups l, l + 32, ...: per group it reads the M codes, adds
// the M entries into the group's D weights (accumulation type), and multiplies them into the
// batch rows' x values. x is read from global memory (consecutive lanes, consecutive groups:
// coalesced; it stays in L1/L2 for the block's rows), as are the entries (the codebook stays
// in L2). DV = 8 fixes D = 8: `vec_cb` / `vec_x` say the codebook / x start 16-byte aligned,
// so an entry (a group of x) is one to four 16-byte loads. DV = 0 takes D at run time.
template <Elem e, int BT, int DV, bool OUT_ACC>
__global__ void __launch_bounds__(kThreads)
    forward_small_kernel(const storage_t<e>* __restrict__ x, const uint16_t* __restrict__ codes,
                         const storage_t<e>* __restrict__ cb,
                         const storage_t<e>* __restrict__ scales,
                         const storage_t<e>* __restrict__ bias,
                         out_elem_t<e, OUT_ACC>* __restrict__ out, int64_t B, int64_t N,
                         int64_t G, int M, int E, int d_runtime, bool vec_cb, bool vec_x) {
  using acc = acc_t<e>;
  const int lane = threadIdx.x % kLanes;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kLanes;
  if (j >= N) return;  // j is the same for the whole warp: no lane is left in a shuffle
  const int D = DV > 0 ? DV : d_runtime;
  const int64_t K = G * D;
  const int nb = static_cast<int>(B < BT ? B : BT);
  const uint16_t* row_codes = codes + j * G * M;
  acc sum[BT];
#pragma unroll
  for (int b = 0; b < BT; ++b) sum[b] = acc(0);
  for (int64_t g = lane; g < G; g += kLanes) {
    const uint16_t* code = row_codes + g * M;
    if constexpr (DV == 8) {
      acc w[8];
      sum_entries8<e>(cb, code, M, E, vec_cb, w);
#pragma unroll
      for (int b = 0; b < BT; ++b) {
        if (b >= nb) break;
        acc xv[8];
        if (vec_x) {
          load8_vec<e>(x + b * K + g * 8, xv);
        } else {
          load8_scalar<e>(x + b * K + g * 8, xv);
        }
#pragma unroll
        for (int t = 0; t < 8; ++t) sum[b] += w[t] * xv[t];
      }
    } else {
      for (int t = 0; t < D; ++t) {
        acc w = acc(0);
        for (int m = 0; m < M; ++m)
          w += elem_to_acc<e>(RLX_LDG(cb + (static_cast<int64_t>(m) * E + code[m]) * D + t));
#pragma unroll
        for (int b = 0; b < BT; ++b) {
          if (b >= nb) break;
          sum[b] += w * elem_to_acc<e>(RLX_LDG(x + b * K + g * D + t));
        }
      }
    }
  }
#pragma unroll
  for (int b = 0; b < BT; ++b) sum[b] = warp_sum(sum[b]);
  if (lane != 0) return;
  for (int b = 0; b < nb; ++b) {
    acc v = sum[b];
    if (scales) v *= elem_to_acc<e>(scales[j]);
    if (bias) v += elem_to_acc<e>(bias[j]);
    if constexpr (OUT_ACC) {
      out[b * N + j] = v;
    } else {
      out[b * N + j] = acc_to_elem<e>(v);
    }
  }
}

// W[j, g*D + t] = s_j * sum_m C[m, codes[j, g, m], t] in x's dtype (s_j = 1 without scales):
// thread p = j * G + g writes the group's D values (DV = 8: 16-byte stores when `vec_w`, i.e.
// W 16-byte aligned; the entries summed by sum_entries8).
template <Elem e, int DV>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint16_t* __restrict__ codes, const storage_t<e>* __restrict__ cb,
                      const storage_t<e>* __restrict__ scales, storage_t<e>* __restrict__ W,
                      int64_t N, int64_t G, int M, int E, int d_runtime, bool vec_cb,
                      bool vec_w) {
  using acc = acc_t<e>;
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (p >= N * G) return;
  const int D = DV > 0 ? DV : d_runtime;
  const int64_t j = p / G;
  const acc s = scales ? elem_to_acc<e>(scales[j]) : acc(1);
  const uint16_t* code = codes + p * M;
  storage_t<e>* dst = W + p * D;
  if constexpr (DV == 8) {
    acc w[8];
    sum_entries8<e>(cb, code, M, E, vec_cb, w);
    storage_t<e> o[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) o[t] = acc_to_elem<e>(w[t] * s);
    if (vec_w) {
      constexpr int kVecs = static_cast<int>(8 * sizeof(storage_t<e>) / 16);
      uint4 raw[kVecs];
      memcpy(raw, o, sizeof(o));
#pragma unroll
      for (int i = 0; i < kVecs; ++i) reinterpret_cast<uint4*>(dst)[i] = raw[i];
    } else {
#pragma unroll
      for (int t = 0; t < 8; ++t) dst[t] = o[t];
    }
  } else {
    for (int t = 0; t < D; ++t) {
      acc w = acc(0);
      for (int m = 0; m < M; ++m)
        w += elem_to_acc<e>(RLX_LDG(cb + (static_cast<int64_t>(m) * E + code[m]) * D + t));
      dst[t] = acc_to_elem<e>(w * s);
    }
  }
}

// dC[m, c, t] = sum over the (j, g) with codes[j, g, m] = c of dW[j, g*D + t], in the
// accumulation type ([M, E, D]; 0 where no code is c). `order` lists the flat positions
// f = (j * G + g) * M + m of the codes sorted stably by the key m * E + code, and `offsets`
// [M * E + 1] where each key's segment of `order` starts. Warp w takes the segments w,
// w + total_warps, ... (total_warps = the launch's blocks x kWarps); its lanes take the
// segment's positions lane, lane + 32, ... in order, kSegmentCoords coordinates t per pass,
// and a butterfly adds the lanes. FROM_X: dW[j, g*D + t] = sum_b gs[b, j] x[b, g*D + t] is
// computed from x ([B, K], x's dtype) and gs = grad_out * scales ([B, N], accumulation type)
// for the few batch rows there are; else dW is read ([N, K], accumulation type).
template <Elem e, bool FROM_X>
__global__ void __launch_bounds__(kThreads)
    dcodebook_kernel(const int64_t* __restrict__ order, const int32_t* __restrict__ offsets,
                     const acc_t<e>* __restrict__ gs, const storage_t<e>* __restrict__ x,
                     const acc_t<e>* __restrict__ dW, acc_t<e>* __restrict__ dC, int64_t B,
                     int64_t N, int64_t G, int M, int E, int D, int64_t total_warps) {
  using acc = acc_t<e>;
  constexpr int TC = kSegmentCoords;
  const int lane = threadIdx.x % kLanes;
  const int64_t K = G * D;
  const int64_t segments = static_cast<int64_t>(M) * E;
  for (int64_t seg = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kLanes;
       seg < segments; seg += total_warps) {
    const int64_t begin = offsets[seg], end = offsets[seg + 1];
    acc* dst = dC + seg * D;
    if (begin == end) {  // no code is this entry (the same branch for the whole warp)
      for (int t = lane; t < D; t += kLanes) dst[t] = acc(0);
      continue;
    }
    for (int t0 = 0; t0 < D; t0 += TC) {
      const int nt = D - t0 < TC ? D - t0 : TC;
      acc v[TC];
#pragma unroll
      for (int tt = 0; tt < TC; ++tt) v[tt] = acc(0);
      for (int64_t i = begin + lane; i < end; i += kLanes) {
        const int64_t p = order[i] / M;  // j * G + g
        const int64_t j = p / G, g = p - j * G;
        if constexpr (FROM_X) {
          for (int64_t b = 0; b < B; ++b) {
            const acc gv = gs[b * N + j];
            const storage_t<e>* xr = x + b * K + g * D + t0;
#pragma unroll
            for (int tt = 0; tt < TC; ++tt)
              if (tt < nt) v[tt] += gv * elem_to_acc<e>(RLX_LDG(xr + tt));
          }
        } else {
          const acc* src = dW + j * K + g * D + t0;
#pragma unroll
          for (int tt = 0; tt < TC; ++tt)
            if (tt < nt) v[tt] += src[tt];
        }
      }
#pragma unroll
      for (int tt = 0; tt < TC; ++tt) v[tt] = warp_sum(v[tt]);
      if (lane == 0) {
#pragma unroll
        for (int tt = 0; tt < TC; ++tt)
          if (tt < nt) dst[t0 + tt] = v[tt];
      }
    }
  }
}

}  // namespace rlx::codebook::cuda::codes16
