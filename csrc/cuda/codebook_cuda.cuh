// CUDA building blocks shared by the codebook matmul forward (codebook_forward.cu) and
// backward (codebook_backward.cu). The algorithm:
//
// Small batches (direct path): one warp per output row, its lanes striding over the K/D
// groups. A lane reads the group's code bytes, sums the M codebook entries (staged in shared
// memory, accumulation type) into the D weights of that group, and multiplies them into the
// batch rows of its tile; a fixed butterfly of shuffles reduces the lanes. The dense N x K
// weight is never built.
//
// Large batches (dense path): one kernel dequantizes the weight into x's dtype and cuBLAS
// multiplies it (dense_forward).
//
// Determinism: every output element is the result of one fixed sequence of operations (no
// float atomics anywhere), so identical inputs give bitwise identical outputs.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <array>
#include <cstdint>
#include <optional>
#include <tuple>

#include "codebook_elem.cuh"
#include "rlx/acc_type.h"
#include "rlx/codebook.h"

namespace rlx::codebook::cuda {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Shared memory one block may take on the current device (the opt-in maximum: 227 KiB on
// Hopper, 163 KiB on the A100).
inline size_t max_block_smem() {
  int device = 0, bytes = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return static_cast<size_t>(bytes);
}

// Multiprocessors of the current device.
inline int device_sms() {
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// The kernels' element type of an ATen scalar type (codebook_elem.cuh).
template <typename scalar_t>
struct ElemOf;
template <>
struct ElemOf<float> {
  static constexpr Elem value = Elem::kFloat;
};
template <>
struct ElemOf<double> {
  static constexpr Elem value = Elem::kDouble;
};
template <>
struct ElemOf<at::Half> {
  static constexpr Elem value = Elem::kHalf;
};
template <>
struct ElemOf<at::BFloat16> {
  static constexpr Elem value = Elem::kBFloat16;
};

template <typename acc_t, typename T>
__device__ __forceinline__ acc_t to_acc(T v) {
  return static_cast<acc_t>(v);
}

// The codebook [M, E, D] in the accumulation type, in dynamic shared memory.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void stage_codebook(const scalar_t* __restrict__ cb, int count,
                                               acc_t* __restrict__ dst) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) dst[i] = to_acc<acc_t>(cb[i]);
}

// Eight consecutive values of a 16-byte-aligned shared-memory row as float.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int t = 0; t < 8; ++t) v[t] = static_cast<float>(h[t]);
  }
}

// What the direct forward stages x and the codebook as: 16-bit inputs with D = 8 stay 16-bit
// (one 16-byte shared-memory load per entry, exact: they are converted to float on use), the
// rest in the accumulation type.
template <typename scalar_t, typename acc_t, int DT>
struct SmemType {
  using type = std::conditional_t<DT == 8 && sizeof(scalar_t) == 2, scalar_t, acc_t>;
};

// Byte offset of the code buffer that follows `count` accumulators in shared memory.
__host__ __device__ inline size_t codes_offset(int64_t count, size_t acc_size) {
  return (static_cast<size_t>(count) * acc_size + 15) / 16 * 16;
}

// out[b0 + b, j] = scales[j] * sum_{g,m,t} x[b0 + b, g*D + t] * C[m, idx[j, g, m], t] + bias[j]
// for the block's RW rows per warp and batch rows b < BT. K is walked in chunks of `chunk`
// groups: the block stages the chunk of x (accumulation type) in shared memory, each warp
// copies its rows' codes for the chunk to shared memory with 16-byte loads where aligned (all
// of them in flight at once), then lane l takes the chunk's groups l, l + 32, ... (consecutive
// lanes, consecutive shared-memory words). DT > 0 fixes D = DT; DT = 0 takes it at run time.
template <typename scalar_t, typename acc_t, typename out_t, int BT, int RW, int DT>
__global__ void __launch_bounds__(256)
    direct_forward_kernel(const scalar_t* __restrict__ x, const uint8_t* __restrict__ idx,
                          const scalar_t* __restrict__ cb, const scalar_t* __restrict__ scales,
                          const scalar_t* __restrict__ bias, out_t* __restrict__ out, int64_t B,
                          int64_t N, int64_t G, int M, int E, int d_runtime, int chunk,
                          bool wide_codes, bool wide_x) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using st_t = typename SmemType<scalar_t, acc_t, DT>::type;
  const int D = DT > 0 ? DT : d_runtime;
  const int64_t K = G * D;
  st_t* C = reinterpret_cast<st_t*>(smem_raw);
  st_t* xs = C + M * E * D;  // [BT][chunk * D]
  // [warps][RW][chunk * M], 16-byte aligned
  uint8_t* codes = smem_raw + codes_offset(M * E * D + BT * chunk * D, sizeof(st_t));
  for (int i = threadIdx.x; i < M * E * D; i += blockDim.x) C[i] = static_cast<st_t>(cb[i]);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  uint8_t* my_codes = codes + warp * RW * chunk * M;
  const int64_t j0 = (static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp) * RW;
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * BT;
  const int nb = static_cast<int>(B - b0 < BT ? B - b0 : BT);
  const int64_t row_codes = G * M;
  acc_t acc[RW][BT];
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int b = 0; b < BT; ++b) acc[r][b] = acc_t(0);

  for (int64_t g0 = 0; g0 < G; g0 += chunk) {
    const int kc = static_cast<int>(G - g0 < chunk ? G - g0 : chunk);
    __syncthreads();  // the previous chunk is consumed (and, the first time, C is staged)
    const int span = kc * D;
    if (wide_x) {  // x's rows and the chunk start are 16-byte aligned: 16-byte copies
      constexpr int per = 16 / sizeof(scalar_t);
      const int vecs = span / per;
#pragma unroll
      for (int b = 0; b < BT; ++b) {
        const uint4* src = reinterpret_cast<const uint4*>(x + (b0 + b) * K + g0 * D);
        st_t* dst = xs + b * chunk * D;
        for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
          if (b < nb) {
            const uint4 raw = __ldg(src + v);
            const scalar_t* e = reinterpret_cast<const scalar_t*>(&raw);
#pragma unroll
            for (int q = 0; q < per; ++q) dst[v * per + q] = static_cast<st_t>(e[q]);
          } else {
#pragma unroll
            for (int q = 0; q < per; ++q) dst[v * per + q] = st_t(0);
          }
        }
      }
    } else {
#pragma unroll
      for (int b = 0; b < BT; ++b) {
        const scalar_t* src = x + (b0 + b) * K + g0 * D;
        st_t* dst = xs + b * chunk * D;
        for (int k = threadIdx.x; k < span; k += blockDim.x)
          dst[k] = b < nb ? static_cast<st_t>(src[k]) : st_t(0);
      }
    }
    const int bytes = kc * M;
    if (wide_codes) {  // rows and chunk offsets are 16-byte aligned, bytes a multiple of 16
      const int vecs = bytes / 16;
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        if (j0 + r >= N) break;
        const uint4* src = reinterpret_cast<const uint4*>(idx + (j0 + r) * row_codes + g0 * M);
        uint4* dst = reinterpret_cast<uint4*>(my_codes + r * chunk * M);
        for (int v = lane; v < vecs; v += kWarp) dst[v] = __ldg(src + v);
      }
    } else {
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        if (j0 + r >= N) break;
        const uint8_t* src = idx + (j0 + r) * row_codes + g0 * M;
#pragma unroll 4
        for (int v = lane; v < bytes; v += kWarp) my_codes[r * chunk * M + v] = src[v];
      }
    }
    __syncthreads();
    if (j0 >= N) continue;
    for (int gi = lane; gi < kc; gi += kWarp) {
      if constexpr (DT == 8 && sizeof(acc_t) == 4) {
        float xv[BT][8];
#pragma unroll
        for (int b = 0; b < BT; ++b) load8(xs + b * chunk * 8 + gi * 8, xv[b]);
#pragma unroll
        for (int r = 0; r < RW; ++r) {
          if (j0 + r >= N) break;
          const uint8_t* code = my_codes + r * chunk * M + gi * M;
          float w[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
          for (int m = 0; m < M; ++m) {
            float e[8];
            load8(C + (m * E + static_cast<int>(code[m])) * 8, e);
#pragma unroll
            for (int t = 0; t < 8; ++t) w[t] += e[t];
          }
#pragma unroll
          for (int b = 0; b < BT; ++b)
#pragma unroll
            for (int t = 0; t < 8; ++t) acc[r][b] = fmaf(w[t], xv[b][t], acc[r][b]);
        }
      } else {
        for (int t = 0; t < D; ++t) {
          acc_t xb[BT];
#pragma unroll
          for (int b = 0; b < BT; ++b) xb[b] = to_acc<acc_t>(xs[b * chunk * D + gi * D + t]);
#pragma unroll
          for (int r = 0; r < RW; ++r) {
            if (j0 + r >= N) break;
            const uint8_t* code = my_codes + r * chunk * M + gi * M;
            acc_t w = acc_t(0);
            for (int m = 0; m < M; ++m)
              w += to_acc<acc_t>(C[(m * E + static_cast<int>(code[m])) * D + t]);
#pragma unroll
            for (int b = 0; b < BT; ++b) acc[r][b] += w * xb[b];
          }
        }
      }
    }
  }
  if (j0 >= N) return;
  // Butterfly reduction: every lane ends with every total, in the same order.
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int b = 0; b < BT; ++b)
#pragma unroll
      for (int off = kWarp / 2; off > 0; off /= 2)
        acc[r][b] += __shfl_xor_sync(kFullMask, acc[r][b], off);
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int64_t j = j0 + r;
#pragma unroll
    for (int b = 0; b < BT; ++b) {
      if (lane == (r * BT + b) % kWarp && j < N && b < nb) {
        acc_t v = acc[r][b];
        if (scales) v *= to_acc<acc_t>(scales[j]);
        if (bias) v += to_acc<acc_t>(bias[j]);
        out[(b0 + b) * N + j] = static_cast<out_t>(v);
      }
    }
  }
}

constexpr int kDirectThreads = 256;
constexpr int kDirectRows = 2;  // output rows per warp

// Runs direct_forward_kernel over all of x (contiguous [B, K]), writing out [B, N] (out_t).
// scales/bias may be null.
template <typename scalar_t, typename out_t>
void launch_direct_forward(const Dims& d, const scalar_t* x, const uint8_t* idx,
                           const scalar_t* cb, const scalar_t* scales, const scalar_t* bias,
                           out_t* out, cudaStream_t stream) {
  using acc_t = typename AccType<scalar_t>::type;
  const int64_t M = d.num_codebooks, D = d.entry_dim, warps = kDirectThreads / kWarp;
  auto run = [&](auto bt_tag, auto dt_tag) {
    constexpr int BT = decltype(bt_tag)::value, DT = decltype(dt_tag)::value;
    using st_t = typename SmemType<scalar_t, acc_t, DT>::type;
    // x's chunk takes up to 32 KiB; whole multiples of 32 groups keep the lanes in step.
    int64_t chunk = std::max<int64_t>(32, (32 * 1024 / (BT * D * sizeof(st_t))) / 32 * 32);
    chunk = std::min(chunk, ceil_div(d.groups, 32) * 32);
    const bool wide = (d.groups * M) % 16 == 0 && (chunk * M) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(idx) % 16 == 0;
    // 16-byte copies of x need its rows, chunk starts and chunk lengths in whole vectors.
    const int64_t vec_bytes = 16;
    const bool wide_x = (d.in_features * static_cast<int64_t>(sizeof(scalar_t))) % vec_bytes == 0 &&
                        (chunk * D * static_cast<int64_t>(sizeof(scalar_t))) % vec_bytes == 0 &&
                        (D * static_cast<int64_t>(sizeof(scalar_t))) % vec_bytes == 0 &&
                        reinterpret_cast<uintptr_t>(x) % 16 == 0;
    const size_t smem = codes_offset(M * d.num_entries * D + BT * chunk * D, sizeof(st_t)) +
                        static_cast<size_t>(warps * kDirectRows * chunk * M);
    auto kernel = direct_forward_kernel<scalar_t, acc_t, out_t, BT, kDirectRows, DT>;
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    const dim3 grid(static_cast<unsigned>(ceil_div(d.out_features, warps * kDirectRows)),
                    static_cast<unsigned>(ceil_div(d.rows, BT)));
    kernel<<<grid, kDirectThreads, smem, stream>>>(
        x, idx, cb, scales, bias, out, d.rows, d.out_features, d.groups, static_cast<int>(M),
        static_cast<int>(d.num_entries), static_cast<int>(D), static_cast<int>(chunk), wide,
        wide_x);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  using I1 = std::integral_constant<int, 1>;
  using I4 = std::integral_constant<int, 4>;
  using I8 = std::integral_constant<int, 8>;  // D = 8
  using I0 = std::integral_constant<int, 0>;
  if constexpr (std::is_same_v<scalar_t, double>) {
    run(I4{}, I0{});
  } else {
    auto with_bt = [&](auto dt_tag) {
      // Any batch runs (in tiles of 4 rows); above 4 rows the callers take the dense path.
      if (d.rows == 1) {
        run(I1{}, dt_tag);
      } else {
        run(I4{}, dt_tag);
      }
    };
    if (d.entry_dim == 8) {
      with_bt(I8{});
    } else {
      with_bt(I0{});
    }
  }
}

// W[j, g*D + t] = scale_j * sum_m C[m, idx[j, g, m], t] (scale_j = 1 without scales), in
// out_t; one block per row j (grid-stride), one thread per group, codebook in shared memory.
template <typename scalar_t, typename acc_t, typename out_t>
__global__ void __launch_bounds__(256)
    dequantize_kernel(const uint8_t* __restrict__ idx, const scalar_t* __restrict__ cb,
                      const scalar_t* __restrict__ scales, out_t* __restrict__ W, int64_t N,
                      int64_t G, int M, int E, int D) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  acc_t* C = reinterpret_cast<acc_t*>(smem_raw);
  stage_codebook(cb, M * E * D, C);
  __syncthreads();
  for (int64_t j = blockIdx.x; j < N; j += gridDim.x) {
    const acc_t s = scales ? to_acc<acc_t>(scales[j]) : acc_t(1);
    for (int64_t g = threadIdx.x; g < G; g += blockDim.x) {
      const uint8_t* code = idx + (j * G + g) * M;
      out_t* dst = W + (j * G + g) * D;
      if (D == 8 && sizeof(out_t) * 8 % 16 == 0) {
        acc_t w[8] = {};
        for (int m = 0; m < M; ++m) {
          const acc_t* e = C + (m * E + static_cast<int>(code[m])) * 8;
#pragma unroll
          for (int t = 0; t < 8; ++t) w[t] += e[t];
        }
        out_t o[8];
#pragma unroll
        for (int t = 0; t < 8; ++t) o[t] = static_cast<out_t>(w[t] * s);
        constexpr int vecs = static_cast<int>(sizeof(out_t) * 8 / 16);
#pragma unroll
        for (int v = 0; v < vecs; ++v)
          reinterpret_cast<uint4*>(dst)[v] = reinterpret_cast<const uint4*>(o)[v];
      } else {
        for (int t = 0; t < D; ++t) {
          acc_t w = acc_t(0);
          for (int m = 0; m < M; ++m) w += C[(m * E + static_cast<int>(code[m])) * D + t];
          dst[t] = static_cast<out_t>(w * s);
        }
      }
    }
  }
}

// The dense [N, K] weight (scaled when scales is given) in out_dtype.
template <typename scalar_t>
at::Tensor dequantize(const Dims& d, const at::Tensor& idx, const at::Tensor& cb,
                      const scalar_t* scales, at::ScalarType out_dtype, cudaStream_t stream) {
  using acc_t = typename AccType<scalar_t>::type;
  at::Tensor W = at::empty({d.out_features, d.in_features}, cb.options().dtype(out_dtype));
  if (W.numel() == 0) return W;
  const size_t smem = static_cast<size_t>(d.num_codebooks * d.num_entries * d.entry_dim) *
                      sizeof(acc_t);
  const int64_t blocks = std::min<int64_t>(d.out_features, 65535);
  auto run = [&](auto* out) {
    using out_t = std::remove_pointer_t<decltype(out)>;
    auto kernel = dequantize_kernel<scalar_t, acc_t, out_t>;
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    kernel<<<static_cast<unsigned>(blocks), 256, smem, stream>>>(
        idx.data_ptr<uint8_t>(), cb.data_ptr<scalar_t>(), scales, out, d.out_features, d.groups,
        static_cast<int>(d.num_codebooks), static_cast<int>(d.num_entries),
        static_cast<int>(d.entry_dim));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (out_dtype == cb.scalar_type()) {
    run(W.data_ptr<scalar_t>());
  } else {
    TORCH_INTERNAL_ASSERT(out_dtype == c10::CppTypeToScalarType<acc_t>::value);
    run(W.data_ptr<acc_t>());
  }
  return W;
}

// Checks that are CUDA's own, after the shared check_inputs: 8-bit codes with a codebook that
// fits in shared memory, or 16-bit codes (codebook_codes16.cu: read from global memory, any
// size), every tensor on one CUDA device.
inline void check_cuda_inputs(const at::Tensor& x, const at::Tensor& indices, const Dims& d) {
  if (d.index_bytes == 2) return;
  TORCH_CHECK_VALUE(indices.scalar_type() == at::kByte,
                    "codebook_matmul: indices must be uint8 on CUDA, got ", indices.scalar_type());
  const int64_t bytes = d.num_codebooks * d.num_entries * d.entry_dim *
                        (x.scalar_type() == at::kDouble ? 8 : 4);
  TORCH_CHECK_VALUE(bytes <= 96 * 1024, "codebook_matmul: on CUDA the codebook (M*E*D = ",
                    d.num_codebooks * d.num_entries * d.entry_dim,
                    " entries) must fit in 96 KiB of shared memory in the accumulation type");
}

// Codes at or past E would read past the codebook. With every code value valid (E = 256 for
// uint8, E = 65536 for 16-bit codes, the usual AQLM layouts) nothing is checked. Otherwise
// the largest code is read back to the host, so the check synchronizes. 16-bit codes are
// compared as their uint16 value (int16 read modulo 2^16), as on the CPU.
inline void check_index_range(const at::Tensor& indices, const Dims& d) {
  if (d.index_bytes == 2) {
    if (d.num_entries >= 65536 || indices.numel() == 0) return;
    const int64_t top =
        indices.view(at::kShort).to(at::kInt).bitwise_and(0xFFFF).max().item<int32_t>();
    TORCH_CHECK_VALUE(top < d.num_entries, "codebook_matmul: indices must be < E=",
                      d.num_entries, " (the number of codebook entries), found ", top);
    return;
  }
  if (d.num_entries >= 256 || indices.numel() == 0) return;
  const int64_t top = indices.max().item<uint8_t>();
  TORCH_CHECK_VALUE(top < d.num_entries, "codebook_matmul: indices must be < E=", d.num_entries,
                    " (the number of codebook entries), found ", top);
}

// a @ b with the result in the accumulation type (fp32 for half inputs, through cuBLAS's
// fp32 output).
inline at::Tensor mm_acc(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16)
    return at::mm(a, b, at::kFloat);
  return at::mm(a, b);
}

// out2d = (x2d W^T) * scales + bias for the dense (dequantize + cuBLAS) forwards, where
// dequant(scales or an undefined tensor) returns W in x's dtype. For 16-bit x the scales stay
// out of W and the product is summed, scaled and biased in float32, then rounded once: a W
// scaled in 16 bits would round every weight once more, an error the math does not have that
// grows with sqrt(K) (it exceeded the tests' tolerance at K = 1040). float32 and float64 fold
// the scales into W (rounded in that dtype) and take the bias in cuBLAS's epilogue.
template <typename Dequant>
void dense_forward(const at::Tensor& x2d, const at::Tensor& scales, const at::Tensor& bias,
                   at::Tensor& out2d, Dequant dequant) {
  const at::ScalarType dtype = x2d.scalar_type();
  if (dtype == at::kHalf || dtype == at::kBFloat16) {
    at::Tensor acc = mm_acc(x2d, dequant(at::Tensor()).t());
    if (scales.defined()) acc.mul_(scales.to(at::kFloat));
    if (bias.defined()) acc.add_(bias.to(at::kFloat));
    out2d.copy_(acc);
    return;
  }
  const at::Tensor W = dequant(scales);
  if (bias.defined()) {
    at::addmm_out(out2d, bias, x2d, W.t());
  } else {
    at::mm_out(out2d, x2d, W.t());
  }
}

// The 16-bit-code path (codebook_codes16.cu), after the checks above and check_index_range,
// on x's device: the forward, and the backward of inputs with at least one row, output and
// group.
at::Tensor forward_codes16(const at::Tensor& x, const at::Tensor& indices,
                           const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
                           const std::optional<at::Tensor>& bias, const Dims& d);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_codes16(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& indices,
    const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
    std::array<bool, 4> mask, const Dims& d);

// Batches above this many rows take the dense (dequantize + cuBLAS) path: forward above 4 rows
// (the 16-bit D = 8 forward with M <= 2 takes codebook_mma.cuh's kernel up to 16 rows),
// backward above 16 (the histogram backward's kHistMaxRows, codebook_histogram.cuh). uint8 codes
// only: 16-bit codes have their own (codebook_codes16.cu).
inline bool use_dense(const Dims& d) { return d.rows > 4; }
inline bool use_dense_backward(const Dims& d) { return d.rows > 16; }

}  // namespace rlx::codebook::cuda
