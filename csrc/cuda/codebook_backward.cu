// CUDA kernel for rlx::codebook_matmul_backward. With gs[b, j] = grad_out[b, j] * s_j:
//   dx[b, g*D + t] = sum_j gs[b, j] * sum_m C[m, idx[j, g, m], t]
//   dC[m, c, t]    = sum_{(j, g): idx[j, g, m] = c} dW[j, g*D + t],   dW = gs^T x
// Small batches (up to 16 rows): dx and dC from histograms of gs per (group, codebook)
// (codebook_histogram.cuh); dW is never built. Large batches: dx and dW through cuBLAS, then a
// scatter kernel adds dW's rows into dC.
// 16-bit codes take codebook_codes16.cu after the checks and the empty-input case.
//
// Determinism without float atomics: in the scatter, a warp walks its rows j in a fixed order;
// lanes whose codes collide (found with __match_any_sync) add in lane order, one rank at a
// time, into the warp's own shared-memory accumulator; the warps' accumulators are summed in
// warp order, and the per-block partials by at::sum in a fixed order.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <tuple>
#include <utility>

#include "codebook_cuda.cuh"
#include "codebook_histogram.cuh"

namespace rlx::codebook::cuda {
namespace {

constexpr int kWarps = 4;  // warps per block of the scatter kernel
constexpr int kTC = 8;     // entry coordinates t handled per pass
constexpr int kU = 4;      // rows in flight per lane and step
static_assert(kHistMaxRows == 16, "use_dense_backward's threshold is the histogram's batch");

// parts[blk][m][c][t] = sum over the block's groups g, rows j with idx[j, g, m] = c, of
// dW[j, g*D + t] (dW contiguous [N, K], accumulation type).
template <typename acc_t>
__global__ void __launch_bounds__(kWarps * kWarp)
    dcodebook_kernel(const uint8_t* __restrict__ idx, const acc_t* __restrict__ dW,
                     acc_t* __restrict__ parts, int64_t N, int64_t G, int M, int E, int D,
                     int64_t groups_per_block) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  acc_t* acc = reinterpret_cast<acc_t*>(smem_raw);  // [kWarps][kTC][E]
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int m = blockIdx.y;
  const int64_t g_begin = static_cast<int64_t>(blockIdx.x) * groups_per_block;
  const int64_t g_end = g_begin + groups_per_block < G ? g_begin + groups_per_block : G;
  const int64_t K = G * D;
  acc_t* mine = acc + warp * kTC * E;
  for (int t0 = 0; t0 < D; t0 += kTC) {
    const int nt = D - t0 < kTC ? D - t0 : kTC;
    for (int i = threadIdx.x; i < kWarps * kTC * E; i += blockDim.x) acc[i] = acc_t(0);
    __syncthreads();
    for (int64_t g = g_begin; g < g_end; ++g) {
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
          for (int tt = 0; tt < kTC; ++tt)
            v[u][tt] = valid && tt < nt ? dW[j * K + g * D + t0 + tt] : acc_t(0);
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

// dC from dW ([N, K] contiguous, accumulation type), [M * E * D].
template <typename acc_t>
at::Tensor dcodebook_from_dw(const Dims& d, const at::Tensor& idx, const at::Tensor& dW,
                             cudaStream_t stream) {
  const int64_t gpb = std::max<int64_t>(1, d.groups * d.num_codebooks / 512);
  const int64_t blocks = ceil_div(d.groups, gpb);
  const int64_t med = d.num_codebooks * d.num_entries * d.entry_dim;
  at::Tensor parts = at::empty({blocks, med}, dW.options());
  const size_t smem = kWarps * kTC * d.num_entries * sizeof(acc_t);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(d.num_codebooks));
  auto kernel = dcodebook_kernel<acc_t>;
  set_smem(reinterpret_cast<const void*>(kernel), smem);
  kernel<<<grid, kWarps * kWarp, smem, stream>>>(
      idx.data_ptr<uint8_t>(), dW.data_ptr<acc_t>(), parts.data_ptr<acc_t>(), d.out_features,
      d.groups, static_cast<int>(d.num_codebooks), static_cast<int>(d.num_entries),
      static_cast<int>(d.entry_dim), gpb);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return blocks == 1 ? parts[0] : parts.sum(0);
}

// dx [B, K] and dC [M * E * D] (accumulation type) of at most kHistMaxRows batch rows, from
// the histograms of gs (codebook_histogram.cuh); cb_acc is the codebook in the accumulation type.
template <typename scalar_t>
std::pair<at::Tensor, at::Tensor> histogram_backward(const Dims& d, const at::Tensor& idx,
                                                     const at::Tensor& cb_acc,
                                                     const at::Tensor& gs,
                                                     const at::Tensor& x2d, cudaStream_t stream) {
  constexpr Elem e = ElemOf<scalar_t>::value;
  using acc = acc_t<e>;
  const int64_t M = d.num_codebooks, E = d.num_entries, D = d.entry_dim;
  const int64_t steps = d.groups * M;
  const int64_t step_chunks = ceil_div(steps, kHistSteps);
  // As many batch rows per block as there are, at most kHistBatch, and as the device's shared
  // memory holds (4 on Hopper; float64 takes 2 on the A100 and where a block has 99 KiB).
  const size_t smem_limit = max_block_smem();
  int bpb = static_cast<int>(std::min<int64_t>(kHistBatch, d.rows));
  while (bpb > 1 && histogram_backward_smem(bpb, E, sizeof(acc)) > smem_limit) --bpb;
  const size_t smem = histogram_backward_smem(bpb, E, sizeof(acc));
  TORCH_CHECK(smem <= smem_limit, "codebook_matmul_backward: the histogram backward needs ",
              smem, " bytes of shared memory per block, the device has ", smem_limit);
  auto kernel = histogram_backward_kernel<e>;
  set_smem(reinterpret_cast<const void*>(kernel), smem);
  // Row splits where the steps and batch rows give fewer blocks than the device holds at once
  // (one row at N = K = 4096: 32 blocks): as many splits as fill it, at least one chunk each.
  // Each split adds its own dx and dC passes, so there are none where one wave of blocks is
  // already full. The kernel is bound to 64 registers a thread so that a multiprocessor holds
  // two blocks where the shared memory allows (Hopper: up to 4 batch rows a block in float32).
  int resident = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &resident, reinterpret_cast<const void*>(kernel), kHistThreads, smem));
  const int64_t chunks = ceil_div(d.out_features, kHistChunk);
  const int64_t base_blocks = step_chunks * ceil_div(d.rows, bpb);
  const int64_t want_splits =
      static_cast<int64_t>(device_sms()) * std::max(resident, 1) / base_blocks;
  const int64_t split_chunks = ceil_div(chunks, std::clamp<int64_t>(want_splits, 1, chunks));
  const int64_t splits = ceil_div(chunks, split_chunks);  // none empty
  const int64_t blocks = base_blocks * splits;
  at::Tensor dx_parts = at::empty({splits * M, d.rows, d.in_features}, gs.options());
  at::Tensor dc_parts = at::empty({blocks, M * E * D}, gs.options());
  const bool vec_codes = steps % 16 == 0 && reinterpret_cast<uintptr_t>(idx.data_ptr()) % 16 == 0;
  const bool vec_gs = (d.out_features * static_cast<int64_t>(sizeof(acc))) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(gs.data_ptr()) % 16 == 0;
  kernel<<<static_cast<unsigned>(blocks), kHistThreads, smem, stream>>>(
      idx.data_ptr<uint8_t>(), gs.data_ptr<acc>(),
      reinterpret_cast<const storage_t<e>*>(x2d.data_ptr()), cb_acc.data_ptr<acc>(),
      dx_parts.data_ptr<acc>(), dc_parts.data_ptr<acc>(), static_cast<int>(d.rows),
      d.out_features, d.groups, static_cast<int>(M), static_cast<int>(E), static_cast<int>(D), bpb,
      static_cast<int>(step_chunks), static_cast<int>(split_chunks), vec_codes, vec_gs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {splits * M == 1 ? dx_parts[0] : dx_parts.sum(0),
          blocks == 1 ? dc_parts[0] : dc_parts.sum(0)};
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
        dC = dcodebook_from_dw<acc_t>(d, idx, dW.contiguous(), stream)
                 .view(codebook.sizes())
                 .to(dtype);
      }
      return;
    }
    auto [hx, hc] = histogram_backward<scalar_t>(d, idx, cb.to(acc_type).contiguous(), gs, x2d,
                                                 stream);
    if (mask[0]) dx = hx.to(dtype).view(x.sizes());
    if (mask[1]) dC = hc.view(codebook.sizes()).to(dtype);
  });
  return {dx, dC, ds, db};
}

}  // namespace
}  // namespace rlx::codebook::cuda

TORCH_LIBRARY_IMPL(rlx, CUDA, m) {
  m.impl("codebook_matmul_backward", &rlx::codebook::cuda::backward_cuda);
}
