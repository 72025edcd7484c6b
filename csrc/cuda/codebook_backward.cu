// CUDA kernel for rlx::codebook_matmul_backward. With gs[b, j] = grad_out[b, j] * s_j:
//   dx[b, g*D + t] = sum_j gs[b, j] * sum_m C[m, idx[j, g, m], t]
//   dC[m, c, t]    = sum_{(j, g): idx[j, g, m] = c} dW[j, g*D + t],   dW = gs^T x
// Small batches (up to 16 rows): dx by a direct kernel (lanes over groups, warps over output rows, per-block
// partials summed in a fixed order); dC by a scatter kernel that computes each dW[j, g, :] on
// the fly from x, never storing dW. Large batches: dx and dW through cuBLAS, then the same
// scatter kernel reads dW.
// 16-bit codes take codebook_codes16.cu after the checks and the empty-input case.
//
// Determinism without float atomics: in the scatter, a warp walks its rows j in a fixed order;
// lanes whose codes collide (found with __match_any_sync) add in lane order, one rank at a
// time, into the warp's own shared-memory accumulator; the warps' accumulators are summed in
// warp order, and the per-block partials by at::sum in a fixed order.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <array>
#include <tuple>

#include "codebook_cuda.cuh"

namespace rlx::codebook::cuda {
namespace {

constexpr int kWarps = 4;  // warps per block in both backward kernels
constexpr int kTC = 8;     // entry coordinates t handled per pass
constexpr int kBT = 8;     // batch rows per dx block
constexpr int kU = 4;      // rows in flight per lane and step

// parts[slice][b0 + b][g*D + t0 + tt] = sum over the slice's rows j of gs[b, j] * W[j, g, t].
template <typename acc_t>
__global__ void __launch_bounds__(kWarps * kWarp)
    dx_direct_kernel(const acc_t* __restrict__ gs, const uint8_t* __restrict__ idx,
                     const acc_t* __restrict__ cb_acc, acc_t* __restrict__ parts, int64_t B,
                     int64_t N, int64_t G, int M, int E, int D, int64_t rows_per_slice,
                     int t_chunks) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  acc_t* C = reinterpret_cast<acc_t*>(smem_raw);
  acc_t* red = C + M * E * D;  // [kWarps][kBT * kTC][kWarp]
  for (int i = threadIdx.x; i < M * E * D; i += blockDim.x) C[i] = cb_acc[i];
  __syncthreads();
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarp + lane;
  const bool valid = g < G;
  const int64_t j_begin = static_cast<int64_t>(blockIdx.y) * rows_per_slice;
  const int64_t j_end = j_begin + rows_per_slice < N ? j_begin + rows_per_slice : N;
  const int64_t b0 = static_cast<int64_t>(blockIdx.z / t_chunks) * kBT;
  const int t0 = static_cast<int>(blockIdx.z % t_chunks) * kTC;
  const int nb = static_cast<int>(B - b0 < kBT ? B - b0 : kBT);
  const int nt = D - t0 < kTC ? D - t0 : kTC;
  const int64_t K = G * D;
  acc_t acc[kBT][kTC];
#pragma unroll
  for (int b = 0; b < kBT; ++b)
#pragma unroll
    for (int tt = 0; tt < kTC; ++tt) acc[b][tt] = acc_t(0);
  if (valid) {
    // kU rows per step, their code bytes and gradients loaded before any is used.
    for (int64_t jb = j_begin + warp * kU; jb < j_end; jb += kWarps * kU) {
      uint8_t c0[kU];
      acc_t gv[kU][kBT];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t j = jb + u;
        c0[u] = j < j_end ? idx[(j * G + g) * M] : 0;
#pragma unroll
        for (int b = 0; b < kBT; ++b) gv[u][b] = j < j_end && b < nb ? gs[(b0 + b) * N + j] : acc_t(0);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t j = jb + u;
        if (j >= j_end) break;
        const uint8_t* code = idx + (j * G + g) * M;
        acc_t w[kTC];
        const acc_t* e0 = C + static_cast<int>(c0[u]) * D + t0;
#pragma unroll
        for (int tt = 0; tt < kTC; ++tt) w[tt] = tt < nt ? e0[tt] : acc_t(0);
        for (int m = 1; m < M; ++m) {
          const acc_t* e = C + (m * E + static_cast<int>(code[m])) * D + t0;
#pragma unroll
          for (int tt = 0; tt < kTC; ++tt)
            if (tt < nt) w[tt] += e[tt];
        }
#pragma unroll
        for (int b = 0; b < kBT; ++b)
#pragma unroll
          for (int tt = 0; tt < kTC; ++tt) acc[b][tt] += gv[u][b] * w[tt];
      }
    }
  }
#pragma unroll
  for (int b = 0; b < kBT; ++b)
#pragma unroll
    for (int tt = 0; tt < kTC; ++tt)
      red[(warp * kBT * kTC + b * kTC + tt) * kWarp + lane] = acc[b][tt];
  __syncthreads();
  for (int i = threadIdx.x; i < kBT * kTC * kWarp; i += blockDim.x) {
    const int l = i % kWarp, bt = i / kWarp, b = bt / kTC, tt = bt % kTC;
    const int64_t gg = static_cast<int64_t>(blockIdx.x) * kWarp + l;
    if (gg >= G || b >= nb || tt >= nt) continue;
    acc_t s = red[i];
    for (int w = 1; w < kWarps; ++w) s += red[w * kBT * kTC * kWarp + i];
    parts[(static_cast<int64_t>(blockIdx.y) * B + b0 + b) * K + gg * D + t0 + tt] = s;
  }
}

// parts[blk][m][c][t] = sum over the block's groups g, rows j with idx[j, g, m] = c, of
// dW[j, g*D + t]; dW[j, g*D + t] = sum_b gs[b, j] * x[b, g*D + t] when FROM_X (B <= 16),
// else read from dW (contiguous [N, K]).
template <typename scalar_t, typename acc_t, bool FROM_X>
__global__ void __launch_bounds__(kWarps * kWarp)
    dcodebook_kernel(const uint8_t* __restrict__ idx, const acc_t* __restrict__ gs,
                     const scalar_t* __restrict__ x, const acc_t* __restrict__ dW,
                     acc_t* __restrict__ parts, int64_t B, int64_t N, int64_t G, int M, int E,
                     int D, int64_t groups_per_block) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  acc_t* acc = reinterpret_cast<acc_t*>(smem_raw);  // [kWarps][kTC][E]
  acc_t* xs = acc + kWarps * kTC * E;               // [B][kTC] (FROM_X)
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int m = blockIdx.y;
  const int64_t g_begin = static_cast<int64_t>(blockIdx.x) * groups_per_block;
  const int64_t g_end = g_begin + groups_per_block < G ? g_begin + groups_per_block : G;
  const int64_t K = G * D;
  acc_t* mine = acc + warp * kTC * E;
  for (int t0 = 0; t0 < D; t0 += kTC) {
    const int nt = D - t0 < kTC ? D - t0 : kTC;
    for (int i = threadIdx.x; i < kWarps * kTC * E; i += blockDim.x) acc[i] = acc_t(0);
    for (int64_t g = g_begin; g < g_end; ++g) {
      __syncthreads();  // acc zeroed / the previous group's xs no longer read
      if constexpr (FROM_X) {
        for (int i = threadIdx.x; i < B * kTC; i += blockDim.x) {
          const int tt = i % kTC;
          xs[i] = tt < nt ? to_acc<acc_t>(x[(i / kTC) * K + g * D + t0 + tt]) : acc_t(0);
        }
        __syncthreads();
      }
      // kU rows per lane and step: all their codes and values are loaded first, then added
      // in a fixed order (u, then lane order within colliding codes).
      for (int64_t jb = static_cast<int64_t>(warp) * kWarp * kU; jb < N;
           jb += kWarps * kWarp * kU) {
        int code[kU];
        acc_t v[kU][kTC];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int64_t j = jb + u * kWarp + lane;
          const bool valid = j < N;
          code[u] = valid ? static_cast<int>(idx[(j * G + g) * M + m]) : -1;
#pragma unroll
          for (int tt = 0; tt < kTC; ++tt) v[u][tt] = acc_t(0);
          if (!valid) continue;
          if constexpr (FROM_X) {
            for (int64_t b = 0; b < B; ++b) {
              const acc_t gv = gs[b * N + j];
#pragma unroll
              for (int tt = 0; tt < kTC; ++tt) v[u][tt] += gv * xs[b * kTC + tt];
            }
          } else {
#pragma unroll
            for (int tt = 0; tt < kTC; ++tt)
              if (tt < nt) v[u][tt] = dW[j * K + g * D + t0 + tt];
          }
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int key = code[u] >= 0 ? code[u] : 256 + lane;  // rows past N match nothing
          const unsigned peers = __match_any_sync(kFullMask, key);
          const int rank = __popc(peers & ((1u << lane) - 1u));
          int top = rank;
#pragma unroll
          for (int off = kWarp / 2; off > 0; off /= 2)
            top = max(top, __shfl_xor_sync(kFullMask, top, off));
          for (int r = 0; r <= top; ++r) {
            if (code[u] >= 0 && rank == r) {
#pragma unroll
              for (int tt = 0; tt < kTC; ++tt)
                if (tt < nt) mine[tt * E + code[u]] += v[u][tt];
            }
            __syncwarp();
          }
        }
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nt * E; i += blockDim.x) {
      const int tt = i / E, c = i % E;
      acc_t s = acc[i];
      for (int w = 1; w < kWarps; ++w) s += acc[w * kTC * E + i];
      parts[((static_cast<int64_t>(blockIdx.x) * M + m) * E + c) * D + t0 + tt] = s;
    }
    __syncthreads();
  }
}

void set_smem(const void* kernel, size_t smem) {
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
}

template <typename scalar_t>
at::Tensor dcodebook(const Dims& d, const at::Tensor& idx, const at::Tensor& gs,
                     const at::Tensor& x2d, const at::Tensor& dW, cudaStream_t stream) {
  using acc_t = typename AccType<scalar_t>::type;
  const int64_t gpb = std::max<int64_t>(1, d.groups * d.num_codebooks / 512);
  const int64_t blocks = ceil_div(d.groups, gpb);
  const int64_t med = d.num_codebooks * d.num_entries * d.entry_dim;
  at::Tensor parts = at::empty({blocks, med}, gs.options());
  const bool from_x = !dW.defined();
  const size_t smem = (kWarps * kTC * d.num_entries + (from_x ? d.rows * kTC : 0)) * sizeof(acc_t);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(d.num_codebooks));
  auto launch = [&](auto kernel) {
    set_smem(reinterpret_cast<const void*>(kernel), smem);
    kernel<<<grid, kWarps * kWarp, smem, stream>>>(
        idx.data_ptr<uint8_t>(), gs.defined() ? gs.data_ptr<acc_t>() : nullptr,
        x2d.data_ptr<scalar_t>(), from_x ? nullptr : dW.data_ptr<acc_t>(),
        parts.data_ptr<acc_t>(), d.rows, d.out_features, d.groups,
        static_cast<int>(d.num_codebooks), static_cast<int>(d.num_entries),
        static_cast<int>(d.entry_dim), gpb);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (from_x) {
    launch(dcodebook_kernel<scalar_t, acc_t, true>);
  } else {
    launch(dcodebook_kernel<scalar_t, acc_t, false>);
  }
  return blocks == 1 ? parts[0] : parts.sum(0);
}

template <typename scalar_t>
at::Tensor dx_direct(const Dims& d, const at::Tensor& idx, const at::Tensor& cb_acc,
                     const at::Tensor& gs, cudaStream_t stream) {
  using acc_t = typename AccType<scalar_t>::type;
  const int64_t gx = ceil_div(d.groups, kWarp);
  const int t_chunks = static_cast<int>(ceil_div(d.entry_dim, kTC));
  const int64_t gz = ceil_div(d.rows, kBT) * t_chunks;
  // Enough blocks to fill the chip; the slices (and so the summation order) depend on the
  // shapes only.
  int64_t slices =
      std::clamp<int64_t>(ceil_div(1056, gx * gz), 1, std::max<int64_t>(1, d.out_features / 32));
  const int64_t rows_per_slice = ceil_div(d.out_features, slices);
  slices = ceil_div(d.out_features, rows_per_slice);
  at::Tensor parts = at::empty({slices, d.rows, d.in_features}, gs.options());
  const size_t smem =
      (d.num_codebooks * d.num_entries * d.entry_dim + kWarps * kBT * kTC * kWarp) * sizeof(acc_t);
  auto kernel = dx_direct_kernel<acc_t>;
  set_smem(reinterpret_cast<const void*>(kernel), smem);
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(slices),
                  static_cast<unsigned>(gz));
  kernel<<<grid, kWarps * kWarp, smem, stream>>>(
      gs.data_ptr<acc_t>(), idx.data_ptr<uint8_t>(), cb_acc.data_ptr<acc_t>(),
      parts.data_ptr<acc_t>(), d.rows, d.out_features, d.groups,
      static_cast<int>(d.num_codebooks), static_cast<int>(d.num_entries),
      static_cast<int>(d.entry_dim), rows_per_slice, t_chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return slices == 1 ? parts[0] : parts.sum(0);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& indices,
    const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
    std::array<bool, 4> mask) {
  const Dims d = check_backward_inputs(grad_out, x, indices, codebook, scales, mask);
  check_cuda_inputs(x, indices, d);
  const c10::cuda::CUDAGuard guard(x.device());
  check_index_range(indices, d);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Distinct empty tensors for the outputs not computed (outputs must not alias).
  const auto skipped = [&] { return at::empty({0}, x.options()); };
  const at::ScalarType dtype = x.scalar_type();
  const at::ScalarType acc_type = acc_dtype(dtype);
  at::Tensor dx = skipped(), dC = skipped(), ds = skipped(), db = skipped();
  auto g2d = grad_out.reshape({d.rows, d.out_features}).contiguous();
  if (d.rows == 0 || d.out_features == 0 || d.groups == 0) {
    // No products: zero gradients of the right shapes (grad_bias still sums grad_out).
    if (mask[0]) dx = at::zeros(x.sizes(), x.options());
    if (mask[1]) dC = at::zeros(codebook.sizes(), x.options());
    if (mask[2]) ds = at::zeros({d.out_features}, x.options());
    if (mask[3]) db = g2d.to(acc_type).sum(0).to(dtype);
    return {dx, dC, ds, db};
  }
  if (d.index_bytes == 2) return backward_codes16(grad_out, x, indices, codebook, scales, mask, d);
  auto x2d = x.reshape({d.rows, d.in_features}).contiguous();
  auto idx = indices.contiguous();
  auto cb = codebook.contiguous();
  auto s = scales.has_value() ? scales->contiguous() : at::Tensor();
  if (mask[3]) db = g2d.to(acc_type).sum(0).to(dtype);
  const bool dense = use_dense_backward(d);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "codebook_matmul_backward", [&] {
    using acc_t = typename AccType<scalar_t>::type;
    const scalar_t* sp = s.defined() ? s.data_ptr<scalar_t>() : nullptr;
    if (mask[2]) {
      at::Tensor raw;
      if (dense) {
        raw = mm_acc(x2d, dequantize<scalar_t>(d, idx, cb, nullptr, dtype, stream).t());
      } else {
        raw = at::empty({d.rows, d.out_features}, x.options().dtype(acc_type));
        launch_direct_forward<scalar_t, acc_t>(d, x2d.data_ptr<scalar_t>(), idx.data_ptr<uint8_t>(),
                                               cb.data_ptr<scalar_t>(), nullptr, nullptr,
                                               raw.data_ptr<acc_t>(), stream);
      }
      ds = (g2d.to(acc_type) * raw).sum(0).to(dtype);
    }
    if (!mask[0] && !mask[1]) return;
    at::Tensor gs = g2d.to(acc_type);
    if (s.defined()) gs = gs * s.to(acc_type);
    gs = gs.contiguous();
    if (dense) {
      if (mask[0]) {
        // The scales are folded into the dequantized weight, so grad_out multiplies as is.
        const at::Tensor W = dequantize<scalar_t>(d, idx, cb, sp, dtype, stream);
        dx = mm_acc(g2d, W).to(dtype).view(x.sizes());
      }
      if (mask[1]) {
        at::Tensor dW = mm_acc(g2d.t(), x2d);
        if (s.defined()) dW.mul_(s.to(acc_type).unsqueeze(1));
        dC = dcodebook<scalar_t>(d, idx, gs, x2d, dW.contiguous(), stream)
                 .view(codebook.sizes())
                 .to(dtype);
      }
      return;
    }
    if (mask[0]) {
      dx = dx_direct<scalar_t>(d, idx, cb.to(acc_type).contiguous(), gs, stream)
               .to(dtype)
               .view(x.sizes());
    }
    if (mask[1]) {
      dC = dcodebook<scalar_t>(d, idx, gs, x2d, at::Tensor(), stream)
               .view(codebook.sizes())
               .to(dtype);
    }
  });
  return {dx, dC, ds, db};
}

}  // namespace
}  // namespace rlx::codebook::cuda

TORCH_LIBRARY_IMPL(rlx, CUDA, m) {
  m.impl("codebook_matmul_backward", &rlx::codebook::cuda::backward_cuda);
}
