// CUDA kernel registration for rlx::codebook_matmul (the kernels are in codebook_cuda.cuh,
// the backward in codebook_backward.cu).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "codebook_cuda.cuh"
#include "codebook_mma.cuh"

namespace rlx::codebook::cuda {
namespace {

// The tensor-core path (codebook_mma.cuh): 16-bit x, D = 8, one or two codebooks, 1-16 rows.
bool use_mma_forward(const Dims& d, at::ScalarType dtype) {
  return (dtype == at::kHalf || dtype == at::kBFloat16) && d.entry_dim == 8 &&
         (d.num_codebooks == 1 || d.num_codebooks == 2) && d.rows >= 1 && d.rows <= kMmaMaxRows;
}

template <typename scalar_t>
void launch_mma_forward(const Dims& d, at::Tensor x2d, const at::Tensor& idx,
                        const at::Tensor& cb, const scalar_t* scales, const scalar_t* bias,
                        at::Tensor& out2d, cudaStream_t stream) {
  constexpr Bits16 kind = std::is_same_v<scalar_t, at::Half> ? Bits16::kHalf : Bits16::kBFloat16;
  // x is read with 8-byte loads: a view starting off an 8-byte boundary is copied (<= 16 rows)
  if (reinterpret_cast<uintptr_t>(x2d.data_ptr()) % 8 != 0) x2d = x2d.clone();
  const bool fast_codes =
      d.groups % 8 == 0 && reinterpret_cast<uintptr_t>(idx.data_ptr()) % 16 == 0;
  auto bits = [](const void* p) { return reinterpret_cast<const uint16_t*>(p); };
  auto run = [&](auto nt_tag, auto m_tag) {
    constexpr int NT = decltype(nt_tag)::value, M = decltype(m_tag)::value;
    const size_t smem = mma_forward_smem(M, d.num_entries, NT);
    const dim3 grid(static_cast<unsigned>(ceil_div(d.out_features, kMmaTileRows)));
    mma_forward_kernel<kind, NT, M><<<grid, kMmaWarps * 32, smem, stream>>>(
        bits(x2d.data_ptr()), idx.data_ptr<uint8_t>(), bits(cb.data_ptr()), bits(scales),
        bits(bias), reinterpret_cast<uint16_t*>(out2d.data_ptr()), d.rows, d.out_features,
        d.groups, static_cast<int>(d.num_entries), fast_codes);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  if (d.rows <= 8) {
    d.num_codebooks == 1 ? run(I1{}, I1{}) : run(I1{}, I2{});
  } else {
    d.num_codebooks == 1 ? run(I2{}, I1{}) : run(I2{}, I2{});
  }
}

at::Tensor forward_cuda(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& codebook,
                        const std::optional<at::Tensor>& scales,
                        const std::optional<at::Tensor>& bias) {
  const Dims d = check_inputs(x, indices, codebook, scales, bias);
  check_cuda_inputs(x, indices, d);
  const c10::cuda::CUDAGuard guard(x.device());
  check_index_range(indices, d);
  auto out = at::empty(output_shape(x, d), x.options());
  if (out.numel() == 0) return out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto x2d = x.reshape({d.rows, d.in_features}).contiguous();
  auto idx = indices.contiguous();
  auto cb = codebook.contiguous();
  auto s = scales.has_value() ? scales->contiguous() : at::Tensor();
  auto bs = bias.has_value() ? bias->contiguous() : at::Tensor();
  auto out2d = out.view({d.rows, d.out_features});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "codebook_matmul", [&] {
    const scalar_t* sp = s.defined() ? s.data_ptr<scalar_t>() : nullptr;
    if constexpr (std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::BFloat16>) {
      if (use_mma_forward(d, x.scalar_type())) {
        launch_mma_forward<scalar_t>(d, x2d, idx, cb, sp,
                                     bs.defined() ? bs.data_ptr<scalar_t>() : nullptr, out2d,
                                     stream);
        return;
      }
    }
    if (use_dense(d)) {
      // The scales are folded into the dequantized weight, the bias into cuBLAS's epilogue.
      const at::Tensor W = dequantize<scalar_t>(d, idx, cb, sp, x.scalar_type(), stream);
      if (bs.defined()) {
        at::addmm_out(out2d, bs, x2d, W.t());
      } else {
        at::mm_out(out2d, x2d, W.t());
      }
      return;
    }
    launch_direct_forward<scalar_t, scalar_t>(d, x2d.data_ptr<scalar_t>(),
                                              idx.data_ptr<uint8_t>(), cb.data_ptr<scalar_t>(),
                                              sp, bs.defined() ? bs.data_ptr<scalar_t>() : nullptr,
                                              out2d.data_ptr<scalar_t>(), stream);
  });
  return out;
}

}  // namespace
}  // namespace rlx::codebook::cuda

TORCH_LIBRARY_IMPL(rlx, CUDA, m) {
  m.impl("codebook_matmul", &rlx::codebook::cuda::forward_cuda);
}
