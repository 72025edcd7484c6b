// CUDA kernel registration for rlx::codebook_matmul (the kernels are in codebook_cuda.cuh,
// the backward in codebook_backward.cu).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "codebook_cuda.cuh"

namespace rlx::codebook::cuda {
namespace {

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
