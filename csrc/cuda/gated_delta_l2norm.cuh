// fla's l2norm over the last dim on CUDA, as fused kernels: one warp per row.
//   forward:  y = x r,  r = (sum x^2 + eps)^-1/2          (in the accumulation dtype)
//   backward: dx = r (dy - y (y . dy))
// The gated delta ops use them for their fused q/k norm (l2norm_eps): the forward writes the
// normalized rows straight in the dtype the recurrence kernels read (the input dtype for the
// chunked kernels, the accumulation dtype for the token kernels), and the backward reads the
// raw rows, recomputes r and y, adds the kernels' partial dq (or dk) of every value-column
// tile and GVA group member in a fixed order, and writes the packed gradient. The standalone
// ops rlx::gated_delta_l2norm_fwd / _bwd (gated_delta_l2norm.cu) run the same kernels.
//
// A lane takes the row's elements lane, lane + 32, ...; its partial sum and then the warp's
// butterfly reduction have a fixed order, so results are bitwise reproducible.
//
// Also compiled on the CPU by tests/cuda_emu (RLX_CUDA_EMULATION).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "codebook_mma.cuh"
#include "gated_delta_cuda.cuh"

namespace rlx::gdn::cuda {

// Element access: float and double as themselves, 16-bit types as their bit patterns.
template <typename T>
struct PlainIo {
  using storage = T;
  using acc = T;
  __device__ __forceinline__ static acc get(T v) { return v; }
  __device__ __forceinline__ static T put(acc v) { return v; }
};
template <rlx::codebook::cuda::Bits16 kind>
struct BitsIo {
  using storage = uint16_t;
  using acc = float;
  __device__ __forceinline__ static float get(uint16_t v) {
    return rlx::codebook::cuda::bits_to_float<kind>(v);
  }
  __device__ __forceinline__ static uint16_t put(float v) {
    return rlx::codebook::cuda::float_to_bits<kind>(v);
  }
};

constexpr int kNormWarps = 8;  // rows per block
constexpr int kNormThreads = kNormWarps * kWarp;

__device__ __forceinline__ float norm_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double norm_sqrt(double v) { return sqrt(v); }

template <typename InIo>
__device__ __forceinline__ typename InIo::acc row_rstd(const typename InIo::storage* x, int K,
                                                      typename InIo::acc eps, int lane) {
  using acc_t = typename InIo::acc;
  acc_t s = 0;
  for (int c = lane; c < K; c += kWarp) {
    const acc_t v = InIo::get(x[c]);
    s += v * v;
  }
  return acc_t(1) / norm_sqrt(warp_sum(s) + eps);
}

// Rows of K <= 32 N elements keep them in registers (N per lane: one read of memory);
// N = 0 takes any K and reads the row again for each pass.
template <typename F>
void with_lanes(int K, F&& f) {
  if (K <= 32) {
    f(std::integral_constant<int, 1>{});
  } else if (K <= 64) {
    f(std::integral_constant<int, 2>{});
  } else if (K <= 128) {
    f(std::integral_constant<int, 4>{});
  } else if (K <= 256) {
    f(std::integral_constant<int, 8>{});
  } else {
    f(std::integral_constant<int, 0>{});
  }
}

// y[row] = x[row] r (OutIo: the input's own type or the accumulation dtype); rstd[row] = r
// unless rstd is null.
template <typename InIo, typename OutIo, int N>
__global__ void __launch_bounds__(kNormThreads)
    l2norm_rows_kernel(const typename InIo::storage* __restrict__ x,
                       typename OutIo::storage* __restrict__ y,
                       typename InIo::acc* __restrict__ rstd, int64_t rows, int K,
                       typename InIo::acc eps) {
  using acc_t = typename InIo::acc;
  static_assert(std::is_same_v<acc_t, typename OutIo::acc>, "one accumulation dtype");
  const int lane = int(threadIdx.x) % kWarp;
  const int64_t row = int64_t(blockIdx.x) * kNormWarps + int(threadIdx.x) / kWarp;
  if (row >= rows) return;  // the whole warp: rows are warp-uniform
  const typename InIo::storage* xr = x + row * K;
  typename OutIo::storage* yr = y + row * K;
  acc_t r;
  if constexpr (N > 0) {
    acc_t v[N], s = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int c = lane + kWarp * i;
      v[i] = c < K ? InIo::get(xr[c]) : acc_t(0);
      s += v[i] * v[i];
    }
    r = acc_t(1) / norm_sqrt(warp_sum(s) + eps);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int c = lane + kWarp * i;
      if (c < K) yr[c] = OutIo::put(v[i] * r);
    }
  } else {
    r = row_rstd<InIo>(xr, K, eps, lane);
    for (int c = lane; c < K; c += kWarp) yr[c] = OutIo::put(InIo::get(xr[c]) * r);
  }
  if (rstd != nullptr && lane == 0) rstd[row] = r;
}

// The gradient's rows. Fused (the gated delta backward): dy is the sum of `parts` blocks of
// partial gradients, part p of row `row` at dy + p * part_stride + row * group * K, each
// holding `group` rows of K (a GVA group's value heads), added p-major in a fixed order;
// r is recomputed from x and dx is written in the accumulation dtype. Standalone
// (rlx::gated_delta_l2norm_bwd): dy and dx in x's dtype, r the forward's rstd.
template <typename InIo, bool kFused>
struct NormGrad {
  using acc_t = typename InIo::acc;
  using dy_t = std::conditional_t<kFused, acc_t, typename InIo::storage>;
  using dx_t = std::conditional_t<kFused, acc_t, typename InIo::storage>;
  const typename InIo::storage* x;
  const dy_t* dy;
  const acc_t* rstd;  // standalone only
  dx_t* dx;
  int64_t rows, part_stride = 0;
  int K, parts = 1, group = 1;
  acc_t eps = 0;

  __device__ __forceinline__ acc_t grad_at(int64_t row, int c) const {
    if constexpr (kFused) {
      acc_t s = 0;
      const acc_t* base = dy + row * group * K + c;
      for (int p = 0; p < parts; ++p) {
        for (int j = 0; j < group; ++j) s += base[p * part_stride + int64_t(j) * K];
      }
      return s;
    } else {
      return InIo::get(dy[row * K + c]);
    }
  }
  __device__ __forceinline__ void put(int64_t i, acc_t v) const {
    if constexpr (kFused) {
      dx[i] = v;
    } else {
      dx[i] = InIo::put(v);
    }
  }
};

template <typename InIo, bool kFused, int N>
__global__ void __launch_bounds__(kNormThreads)
    l2norm_rows_backward_kernel(const NormGrad<InIo, kFused> a) {
  using acc_t = typename InIo::acc;
  const int lane = int(threadIdx.x) % kWarp;
  const int64_t row = int64_t(blockIdx.x) * kNormWarps + int(threadIdx.x) / kWarp;
  if (row >= a.rows) return;
  const typename InIo::storage* xr = a.x + row * a.K;
  if constexpr (N > 0) {
    acc_t xv[N], dy[N], s = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int c = lane + kWarp * i;
      xv[i] = c < a.K ? InIo::get(xr[c]) : acc_t(0);
      dy[i] = c < a.K ? a.grad_at(row, c) : acc_t(0);
      s += xv[i] * xv[i];
    }
    acc_t r;
    if constexpr (kFused) {
      r = acc_t(1) / norm_sqrt(warp_sum(s) + a.eps);
    } else {
      r = a.rstd[row];
    }
    acc_t dot = 0;  // y . dy
#pragma unroll
    for (int i = 0; i < N; ++i) dot += xv[i] * r * dy[i];
    dot = warp_sum(dot);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int c = lane + kWarp * i;
      if (c < a.K) a.put(row * a.K + c, r * (dy[i] - xv[i] * r * dot));
    }
  } else {
    acc_t r;
    if constexpr (kFused) {
      r = row_rstd<InIo>(xr, a.K, a.eps, lane);
    } else {
      r = a.rstd[row];
    }
    acc_t dot = 0;
    for (int c = lane; c < a.K; c += kWarp) dot += InIo::get(xr[c]) * r * a.grad_at(row, c);
    dot = warp_sum(dot);
    for (int c = lane; c < a.K; c += kWarp) {
      const acc_t y = InIo::get(xr[c]) * r;
      a.put(row * a.K + c, r * (a.grad_at(row, c) - y * dot));
    }
  }
}

inline int64_t norm_blocks(int64_t rows) { return ceil_div(rows, kNormWarps); }

#ifndef RLX_CUDA_EMULATION
// Calls f with the element access of dtype t.
template <typename F>
void with_io(at::ScalarType t, F&& f) {
  using rlx::codebook::cuda::Bits16;
  switch (t) {
    case at::kHalf: f(BitsIo<Bits16::kHalf>{}); break;
    case at::kBFloat16: f(BitsIo<Bits16::kBFloat16>{}); break;
    case at::kFloat: f(PlainIo<float>{}); break;
    case at::kDouble: f(PlainIo<double>{}); break;
    default: TORCH_CHECK(false, "l2norm: unsupported dtype ", t);
  }
}

// The rows of x (any shape, normalized over its last dim) L2-normalized in the accumulation
// dtype and written in x's dtype (out_acc false) or in the accumulation dtype (out_acc true);
// with want_rstd also the factors r, shaped as x without its last dim.
inline std::pair<at::Tensor, at::Tensor> l2norm_rows(const at::Tensor& x_in, double eps,
                                                     bool out_acc, bool want_rstd) {
  const at::Tensor x = x_in.contiguous();
  const auto acc = gdn_acc_dtype(x.scalar_type());
  const int64_t K = x.size(-1), rows = K > 0 ? x.numel() / K : 0;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_acc ? acc : x.scalar_type()));
  at::Tensor r = want_rstd ? at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(acc))
                           : at::Tensor();
  if (rows == 0) return {y, r};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_io(x.scalar_type(), [&](auto in_io) {
    using In = decltype(in_io);
    using acc_t = typename In::acc;
    auto launch = [&](auto out_io) {
      using Out = decltype(out_io);
      with_lanes(int(K), [&](auto lanes) {
        l2norm_rows_kernel<In, Out, decltype(lanes)::value>
            <<<unsigned(norm_blocks(rows)), kNormThreads, 0, stream>>>(
                reinterpret_cast<const typename In::storage*>(x.data_ptr()),
                reinterpret_cast<typename Out::storage*>(y.data_ptr()),
                want_rstd ? r.data_ptr<acc_t>() : nullptr, rows, int(K), acc_t(eps));
      });
    };
    if (out_acc) {
      launch(PlainIo<acc_t>{});
    } else {
      launch(In{});
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, r};
}

// The gated delta backward's dq (or dk) with the l2norm backward: x the raw rows
// [tokens, H, K]; parts the kernels' partial gradients [parts, tokens, H, group, K] in the
// accumulation dtype; dx (contiguous [tokens, H, K], accumulation dtype) receives the result.
inline void l2norm_rows_backward_fused(const at::Tensor& x_in, const at::Tensor& parts,
                                       double eps, at::Tensor& dx) {
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(-1), rows = K > 0 ? x.numel() / K : 0;
  TORCH_CHECK(parts.is_contiguous() && parts.dim() == 5 && parts.size(1) * parts.size(2) == rows &&
                  parts.size(4) == K && dx.is_contiguous() && dx.numel() == rows * K,
              "l2norm backward: unexpected partial-gradient layout ", parts.sizes());
  if (rows == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_io(x.scalar_type(), [&](auto in_io) {
    using In = decltype(in_io);
    using acc_t = typename In::acc;
    NormGrad<In, true> a;
    a.x = reinterpret_cast<const typename In::storage*>(x.data_ptr());
    a.dy = parts.data_ptr<acc_t>();
    a.rstd = nullptr;
    a.dx = dx.data_ptr<acc_t>();
    a.rows = rows;
    a.K = int(K);
    a.parts = int(parts.size(0));
    a.group = int(parts.size(3));
    a.part_stride = parts.stride(0);
    a.eps = acc_t(eps);
    with_lanes(int(K), [&](auto lanes) {
      l2norm_rows_backward_kernel<In, true, decltype(lanes)::value>
          <<<unsigned(norm_blocks(rows)), kNormThreads, 0, stream>>>(a);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// rlx::gated_delta_l2norm_bwd: dx = r (dy - y (y . dy)) with the forward's r, in x's dtype.
inline at::Tensor l2norm_rows_backward(const at::Tensor& x_in, const at::Tensor& dy_in,
                                       const at::Tensor& rstd_in) {
  const at::Tensor x = x_in.contiguous(), dy = dy_in.contiguous(), rstd = rstd_in.contiguous();
  const int64_t K = x.size(-1), rows = K > 0 ? x.numel() / K : 0;
  at::Tensor dx = at::empty(x.sizes(), x.options());
  if (rows == 0) return dx;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_io(x.scalar_type(), [&](auto in_io) {
    using In = decltype(in_io);
    using acc_t = typename In::acc;
    NormGrad<In, false> a;
    a.x = reinterpret_cast<const typename In::storage*>(x.data_ptr());
    a.dy = reinterpret_cast<const typename In::storage*>(dy.data_ptr());
    a.rstd = rstd.data_ptr<acc_t>();
    a.dx = reinterpret_cast<typename In::storage*>(dx.data_ptr());
    a.rows = rows;
    a.K = int(K);
    with_lanes(int(K), [&](auto lanes) {
      l2norm_rows_backward_kernel<In, false, decltype(lanes)::value>
          <<<unsigned(norm_blocks(rows)), kNormThreads, 0, stream>>>(a);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}
#endif  // RLX_CUDA_EMULATION

}  // namespace rlx::gdn::cuda
