// Gated delta rule on CUDA: the pieces the forward (gated_delta_forward.cu) and the backward
// (gated_delta_backward.cu) share.
//
// Formulation: the token recurrence itself, one thread block per (sequence, value head,
// 32-column tile of the state). The state tile S [K, 32] lives in registers: lane j owns
// column j, warp w owns rows 32w .. 32w + 31 (so K = 256 takes 8 warps). A token costs
//   P = diag(a) S,  x = P^T k,  y = P^T q      (in-thread over the warp's rows, then across
//                                              warps through shared memory: one barrier)
//   u = beta (v - x),  S = P + k u^T,  o = scale (y + (k.q) u)
// with a = exp(g) one factor per key channel (KDA) or per head. Every factor is exp(g_t) of
// one token, never of a cumulative sum, so any g (down to -30 per step and below) is safe.
// q, k, g, beta, v (and grad_o) of kStage tokens are staged in shared memory at a time.
//
// The backward walks the checkpoints of the forward from the last chunk to the first. Per
// chunk: pass A re-runs the forward from the chunk's checkpoint, storing the state every
// kSub tokens in a per-block global scratch (L2-resident at the usual sizes) and computing
// dq = scale S_t dO_t (a reduction over the tile's columns, then over tiles: see below).
// Pass B takes the sub-chunks in reverse: it re-runs kSub tokens from the scratch state,
// keeping each P_t in registers, then runs the reverse recurrence over them:
//   D += scale q dO^T;  du = D^T k;  dv = beta du;  dbeta = du . (v - x);  dw = -beta du
//   dk = D u + P dw;  dP = D + k dw^T;  dg = rowsum(dP o P);  D = diag(a) dP
// dq, dk and dg are sums over all V columns: each tile writes its partial sums, and the host
// adds the tiles (and the value heads of a GVA group) with at::sum in a fixed order.
//
// Determinism: no atomics; every sum has a fixed order, so identical inputs give bitwise
// identical outputs.
//
// RLX_CUDA_EMULATION (tests/cuda_emu/): only the device code, compiled as C++ against a
// shim of the CUDA built-ins, so that the kernels run on a CPU.
#pragma once

#ifndef RLX_CUDA_EMULATION
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <optional>
#include <vector>

#include "rlx/gdn_checks.h"
#endif

#include <cmath>
#include <cstdint>

#include "rlx/gdn_backward_layout.h"

namespace rlx::gdn::cuda {

constexpr int kWarp = 32;
constexpr int kRows = 32;   // state rows per warp
constexpr int kCols = 32;   // state columns per block (one per lane)
constexpr int kStage = 16;  // tokens staged in shared memory at a time
constexpr int kMaxWarps = 256 / kRows;
constexpr unsigned kFull = 0xffffffffu;

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// What a kernel needs to know about the problem (GdnProblem, flattened for the device).
template <typename acc_t>
struct Dims {
  int64_t seq_len = 0, tokens = 0;  // T; B*T
  int H = 0, HV = 0, K = 0, V = 0, group = 1, nvt = 1;
  int64_t chunk = 0;
  const int64_t* cu = nullptr;  // device cu_seqlens, or nullptr
  acc_t scale = 1;
};

#ifndef RLX_CUDA_EMULATION
template <typename acc_t>
Dims<acc_t> make_dims(const GdnProblem& p, const int64_t* cu, double scale) {
  Dims<acc_t> d;
  d.seq_len = p.seq_len;
  d.tokens = p.tokens();
  d.H = int(p.num_qk_heads);
  d.HV = int(p.num_v_heads);
  d.K = int(p.head_k_dim);
  d.V = int(p.head_v_dim);
  d.group = int(p.group());
  d.nvt = int(ceil_div(p.head_v_dim, kCols));
  d.chunk = p.chunk;
  d.cu = cu;
  d.scale = acc_t(scale);
  return d;
}
#endif

#ifndef RLX_CUDA_EMULATION
// The kernels' dynamic shared memory (the emulation's shim defines its own).
template <typename T>
__device__ __forceinline__ T* dynamic_smem() {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  return reinterpret_cast<T*>(smem_raw);
}
#endif

// gdn_checkpoint_base and gdn_num_chunks (gdn_backward_layout.h), for device code.
__host__ __device__ inline int64_t checkpoint_base(int64_t seq, int64_t bos, int64_t chunk) {
  return chunk > 0 ? seq + bos / chunk : 0;
}
__host__ __device__ inline int64_t num_chunks(int64_t seq_tokens, int64_t chunk) {
  return chunk > 0 ? (seq_tokens + chunk - 1) / chunk : 0;
}

inline int num_warps(int K) { return int(ceil_div(K, kRows)); }

// The block's (column tile, value head, sequence) and the sequence's token range.
struct BlockPos {
  int vt, hv, h, lane, w, col;
  int64_t n, bos, eos;
};

template <typename acc_t>
__device__ __forceinline__ BlockPos block_pos(const Dims<acc_t>& d) {
  BlockPos b;
  int64_t blk = blockIdx.x;
  b.vt = int(blk % d.nvt);
  blk /= d.nvt;
  b.hv = int(blk % d.HV);
  b.n = blk / d.HV;
  b.h = b.hv / d.group;
  b.w = threadIdx.x / kWarp;
  b.lane = threadIdx.x % kWarp;
  b.col = b.vt * kCols + b.lane;
  if (d.cu != nullptr) {
    b.bos = d.cu[b.n];
    b.eos = d.cu[b.n + 1];
  } else {
    b.bos = b.n * d.seq_len;
    b.eos = b.bos + d.seq_len;
  }
  return b;
}

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t x) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) x += __shfl_xor_sync(kFull, x, off);
  return x;
}

// Reduce-scatter over the warp: v[N] per lane (N = 32 M); afterwards lane l holds in
// v[0 .. M) the sums over all lanes of v[M l .. M l + M). Recursive halving: 31 M shuffles.
template <int OFF, int M, typename acc_t, int N>
__device__ __forceinline__ void reduce_scatter_step(acc_t (&v)[N], int lane) {
  constexpr int half = OFF * M;
  const bool upper = (lane & OFF) != 0;
#pragma unroll
  for (int i = 0; i < half; ++i) {
    const acc_t send = upper ? v[i] : v[i + half];
    const acc_t keep = upper ? v[i + half] : v[i];
    v[i] = keep + __shfl_xor_sync(kFull, send, OFF);
  }
}
template <int M, typename acc_t, int N>
__device__ __forceinline__ void reduce_scatter(acc_t (&v)[N], int lane) {
  static_assert(N == 32 * M, "reduce_scatter: N must be 32 M");
  reduce_scatter_step<16, M>(v, lane);
  reduce_scatter_step<8, M>(v, lane);
  reduce_scatter_step<4, M>(v, lane);
  reduce_scatter_step<2, M>(v, lane);
  reduce_scatter_step<1, M>(v, lane);
}

// Shared-memory staging of kStage tokens, in the accumulation type. Rows are padded to
// Kp = 32 * warps with zeros (decay 1), columns to 32 with zeros.
template <typename acc_t, bool kPerChannel>
struct Stage {
  acc_t* k;     // [kStage, Kp]
  acc_t* q;     // [kStage, Kp]
  acc_t* a;     // [kStage, Kp] per channel, [kStage] per head: exp(g)
  acc_t* v;     // [kStage, 32]
  acc_t* dout;  // [kStage, 32] (backward only)
  acc_t* beta;  // [kStage]
  acc_t* kq;    // [kStage] k.q (forward only)
  acc_t* red;   // [2, 2, warps, 32] cross-warp partial sums, double-buffered

  __host__ __device__ static size_t elements(int Kp, int warps) {
    return size_t(kStage) * (2 * Kp + (kPerChannel ? Kp : 1) + 2 * kCols + 2) +
           size_t(4) * warps * kCols;
  }
  __device__ static Stage carve(acc_t* sm, int Kp, int warps) {
    Stage s;
    s.k = sm;
    s.q = s.k + kStage * Kp;
    s.a = s.q + kStage * Kp;
    s.v = s.a + (kPerChannel ? kStage * Kp : kStage);
    s.dout = s.v + kStage * kCols;
    s.beta = s.dout + kStage * kCols;
    s.kq = s.beta + kStage;
    s.red = s.kq + kStage;
    return s;
  }
};

template <typename acc_t, typename T>
__device__ __forceinline__ acc_t to_acc(T x) {
  return static_cast<acc_t>(x);
}

// Stages tokens [t0, t0 + len) of (h, hv). dout may be nullptr.
template <typename qk_t, typename v_t, typename acc_t, bool kPerChannel>
__device__ __forceinline__ void stage_tokens(const Stage<acc_t, kPerChannel>& s,
                                             const Dims<acc_t>& d, const BlockPos& b,
                                             int64_t t0, int len, int Kp, const qk_t* q,
                                             const qk_t* k, const v_t* v, const acc_t* g,
                                             const acc_t* beta, const v_t* dout) {
  const int nt = blockDim.x;
  for (int idx = threadIdx.x; idx < len * Kp; idx += nt) {
    const int i = idx / Kp, r = idx % Kp;
    const int64_t tok = t0 + i;
    const bool ok = r < d.K;
    const int64_t qk = (tok * d.H + b.h) * d.K + r;
    s.k[idx] = ok ? to_acc<acc_t>(k[qk]) : acc_t(0);
    s.q[idx] = ok ? to_acc<acc_t>(q[qk]) : acc_t(0);
    if constexpr (kPerChannel) {
      s.a[idx] = ok ? exp(g[(tok * d.HV + b.hv) * d.K + r]) : acc_t(1);
    }
  }
  for (int idx = threadIdx.x; idx < len * kCols; idx += nt) {
    const int i = idx / kCols, c = idx % kCols;
    const int64_t tok = t0 + i;
    const int col = b.vt * kCols + c;
    const bool ok = col < d.V;
    const int64_t at = (tok * d.HV + b.hv) * d.V + col;
    s.v[idx] = ok ? to_acc<acc_t>(v[at]) : acc_t(0);
    if (dout != nullptr) s.dout[idx] = ok ? to_acc<acc_t>(dout[at]) : acc_t(0);
  }
  for (int i = threadIdx.x; i < len; i += nt) {
    const int64_t tok = t0 + i;
    if constexpr (!kPerChannel) s.a[i] = exp(g[tok * d.HV + b.hv]);
    s.beta[i] = beta[tok * d.HV + b.hv];
  }
}

// The decay and the projections of one token: S <- P = diag(a) S; x = P^T k (and y = P^T q)
// over this warp's rows, then over the warps. Returns x (y in *y) for the lane's column.
template <bool kWantY, typename acc_t, bool kPerChannel>
__device__ __forceinline__ acc_t decay_and_project(acc_t (&S)[kRows],
                                                   const Stage<acc_t, kPerChannel>& s, int i,
                                                   int Kp, int warps, const BlockPos& b,
                                                   int& buf, acc_t* y) {
  const acc_t* kr = s.k + i * Kp + b.w * kRows;
  const acc_t* qr = s.q + i * Kp + b.w * kRows;
  const acc_t* ar = s.a + (kPerChannel ? i * Kp + b.w * kRows : i);
  acc_t x = 0, yy = 0;
#pragma unroll
  for (int ii = 0; ii < kRows; ++ii) {
    const acc_t a = kPerChannel ? ar[ii] : ar[0];
    const acc_t P = a * S[ii];
    S[ii] = P;
    x += P * kr[ii];
    if (kWantY) yy += P * qr[ii];
  }
  acc_t* rb = s.red + buf * 2 * warps * kCols;
  rb[b.w * kCols + b.lane] = x;
  if (kWantY) rb[(warps + b.w) * kCols + b.lane] = yy;
  __syncthreads();
  acc_t X = 0, Y = 0;
  for (int ww = 0; ww < warps; ++ww) {
    X += rb[ww * kCols + b.lane];
    if (kWantY) Y += rb[(warps + ww) * kCols + b.lane];
  }
  buf ^= 1;
  if (kWantY) *y = Y;
  return X;
}

// S += k u^T over this warp's rows.
template <typename acc_t, bool kPerChannel>
__device__ __forceinline__ void rank1_update(acc_t (&S)[kRows],
                                             const Stage<acc_t, kPerChannel>& s, int i, int Kp,
                                             const BlockPos& b, acc_t u) {
  const acc_t* kr = s.k + i * Kp + b.w * kRows;
#pragma unroll
  for (int ii = 0; ii < kRows; ++ii) S[ii] += kr[ii] * u;
}

// A state tile [K, V] row-major (states, checkpoints) <-> registers.
template <typename acc_t>
__device__ __forceinline__ void load_tile(acc_t (&S)[kRows], const acc_t* src,
                                          const Dims<acc_t>& d, const BlockPos& b) {
#pragma unroll
  for (int ii = 0; ii < kRows; ++ii) {
    const int r = b.w * kRows + ii;
    S[ii] = (src != nullptr && r < d.K && b.col < d.V) ? src[int64_t(r) * d.V + b.col] : acc_t(0);
  }
}
template <typename acc_t>
__device__ __forceinline__ void store_tile(const acc_t (&S)[kRows], acc_t* dst,
                                           const Dims<acc_t>& d, const BlockPos& b) {
#pragma unroll
  for (int ii = 0; ii < kRows; ++ii) {
    const int r = b.w * kRows + ii;
    if (r < d.K && b.col < d.V) dst[int64_t(r) * d.V + b.col] = S[ii];
  }
}

#ifndef RLX_CUDA_EMULATION
template <typename acc_t>
inline acc_t* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<acc_t>() : nullptr;
}

// Kernels taking more than the default 48 KiB of dynamic shared memory must say so.
template <typename Kernel>
inline void allow_shared_memory(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(bytes)));
  }
}

// cu_seqlens on the device (it may be given on the CPU) and on the host.
struct SeqLens {
  at::Tensor device, host;
  const int64_t* device_ptr() const { return device.defined() ? device.data_ptr<int64_t>() : nullptr; }
  const int64_t* host_ptr() const { return host.defined() ? host.data_ptr<int64_t>() : nullptr; }
};

inline SeqLens seq_lens(const std::optional<at::Tensor>& cu, const at::Device& device) {
  SeqLens s;
  if (cu.has_value()) {
    s.device = cu->to(device).contiguous();
    s.host = cu->to(at::kCPU).contiguous();
  }
  return s;
}
#endif  // RLX_CUDA_EMULATION

}  // namespace rlx::gdn::cuda
