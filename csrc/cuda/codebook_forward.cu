// CUDA kernel registration for rlx::codebook_matmul (the kernels are in codebook_cuda.cuh,
// codebook_gemv.cuh, codebook_lut.cuh and codebook_mma.cuh; the backward in
// codebook_backward.cu; 16-bit codes in codebook_codes16.cu).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "codebook_cuda.cuh"
#include "codebook_gemv.cuh"
#include "codebook_lut.cuh"
#include "codebook_mma.cuh"

namespace rlx::codebook::cuda {
namespace {

// Launch shape of the tensor-core forward: 16 RT output rows and `warps` warps per block.
// Chosen from H200 timings at N = K = 4096 and 8192 (docs/benchmarks.md): more row tiles per
// block re-read x fewer times and give each warp independent products to overlap; past
// K = 4096 four tiles win, and with two n8 tiles of x (more than 8 rows) 8 warps keep their
// registers.
struct MmaShape {
  int row_tiles, warps;
};

MmaShape mma_shape(const Dims& d) {
  if (d.in_features <= 4096) return {2, 16};
  return d.rows <= 8 ? MmaShape{4, 16} : MmaShape{4, 8};
}

size_t mma_smem(const Dims& d, const MmaShape& shape) {
  return mma_forward_smem(d.num_codebooks, d.num_entries, d.rows <= 8 ? 1 : 2, shape.row_tiles,
                          shape.warps, d.groups);
}

// The tensor-core path (codebook_mma.cuh): 16-bit x, D = 8, one or two codebooks, 1-16 rows,
// and the block's codes (16 RT rows of G*M bytes) within the device's shared memory.
bool use_mma_forward(const Dims& d, at::ScalarType dtype) {
  return (dtype == at::kHalf || dtype == at::kBFloat16) && d.entry_dim == 8 &&
         (d.num_codebooks == 1 || d.num_codebooks == 2) && d.rows >= 1 &&
         d.rows <= kMmaMaxRows && mma_smem(d, mma_shape(d)) <= max_block_smem();
}

template <typename scalar_t>
void launch_mma_forward(const Dims& d, at::Tensor x2d, const at::Tensor& idx,
                        const at::Tensor& cb, const scalar_t* scales, const scalar_t* bias,
                        at::Tensor& out2d, cudaStream_t stream) {
  constexpr Bits16 kind = std::is_same_v<scalar_t, at::Half> ? Bits16::kHalf : Bits16::kBFloat16;
  const MmaShape shape = mma_shape(d);
  // x is read with 8-byte loads: a view starting off an 8-byte boundary is copied (<= 16 rows)
  if (reinterpret_cast<uintptr_t>(x2d.data_ptr()) % 8 != 0) x2d = x2d.clone();
  const bool async_codes = mma_async_codes(d.groups, static_cast<int>(d.num_codebooks),
                                           idx.data_ptr());
  const bool async_cb = reinterpret_cast<uintptr_t>(cb.data_ptr()) % 16 == 0;
  auto bits = [](const void* p) { return reinterpret_cast<const uint16_t*>(p); };
  const size_t smem = mma_smem(d, shape);
  auto run = [&](auto nt_tag, auto m_tag, auto rt_tag, auto warps_tag) {
    constexpr int NT = decltype(nt_tag)::value, M = decltype(m_tag)::value;
    constexpr int RT = decltype(rt_tag)::value, WARPS = decltype(warps_tag)::value;
    auto kernel = mma_forward_kernel<kind, NT, M, RT, WARPS>;
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    const dim3 grid(static_cast<unsigned>(ceil_div(d.out_features, kMmaTileRows * RT)));
    kernel<<<grid, WARPS * 32, smem, stream>>>(
        bits(x2d.data_ptr()), idx.data_ptr<uint8_t>(), bits(cb.data_ptr()), bits(scales),
        bits(bias), reinterpret_cast<uint16_t*>(out2d.data_ptr()), d.rows, d.out_features,
        d.groups, static_cast<int>(d.num_entries), async_codes, async_cb);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  using I8 = std::integral_constant<int, 8>;
  using I16 = std::integral_constant<int, 16>;
  const bool one = d.num_codebooks == 1;
  if (d.rows <= 8) {  // one n8 tile of x
    if (shape.row_tiles == 2) {
      one ? run(I1{}, I1{}, I2{}, I16{}) : run(I1{}, I2{}, I2{}, I16{});
    } else {
      one ? run(I1{}, I1{}, I4{}, I16{}) : run(I1{}, I2{}, I4{}, I16{});
    }
  } else {
    if (shape.row_tiles == 2) {
      one ? run(I2{}, I1{}, I2{}, I16{}) : run(I2{}, I2{}, I2{}, I16{});
    } else {
      one ? run(I2{}, I1{}, I4{}, I8{}) : run(I2{}, I2{}, I4{}, I8{});
    }
  }
}

// The one-row path (codebook_gemv.cuh): 16-bit x, D = 8, one or two codebooks, one row, the
// codebook copies and partial sums within the device's shared memory. On an H100 it measured
// faster than the tensor-core forward and the lookup-table forward at N = K = 4096 and 8192,
// one and two codebooks (docs/benchmarks.md), so it takes every such call; the lookup-table
// path below is left for one-row calls whose partial sums would not fit.
GemvShape gemv_launch_shape(const Dims& d) {
  return gemv_shape(d.out_features, d.groups, static_cast<int>(d.num_codebooks),
                    static_cast<int>(d.num_entries), device_sms(), max_block_smem());
}

bool use_gemv_forward(const Dims& d, at::ScalarType dtype) {
  return (dtype == at::kHalf || dtype == at::kBFloat16) && d.entry_dim == 8 &&
         (d.num_codebooks == 1 || d.num_codebooks == 2) && d.rows == 1 &&
         gemv_launch_shape(d).rows > 0;
}

template <typename scalar_t>
void launch_gemv_forward(const Dims& d, at::Tensor x2d, const at::Tensor& idx,
                         const at::Tensor& cb, const scalar_t* scales, const scalar_t* bias,
                         at::Tensor& out2d, cudaStream_t stream) {
  constexpr Bits16 kind = std::is_same_v<scalar_t, at::Half> ? Bits16::kHalf : Bits16::kBFloat16;
  // x is read with 16-byte loads: a view starting off a 16-byte boundary is copied (one row)
  if (reinterpret_cast<uintptr_t>(x2d.data_ptr()) % 16 != 0) x2d = x2d.clone();
  const int M = static_cast<int>(d.num_codebooks), E = static_cast<int>(d.num_entries);
  const GemvShape shape = gemv_launch_shape(d);
  const bool wide = d.groups % kGemvLaneGroups == 0 &&
                    reinterpret_cast<uintptr_t>(idx.data_ptr()) % (4 * M) == 0;
  const size_t smem = gemv_smem(M, E, shape.parts, shape.rows);
  auto bits = [](const void* p) { return reinterpret_cast<const uint16_t*>(p); };
  auto run = [&](auto kernel) {
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    kernel<<<static_cast<unsigned>(shape.blocks), kGemvWarps * 32, smem, stream>>>(
        bits(x2d.data_ptr()), idx.data_ptr<uint8_t>(), bits(cb.data_ptr()), bits(scales),
        bits(bias), reinterpret_cast<uint16_t*>(out2d.data_ptr()), d.out_features, d.groups, E,
        shape.rows, shape.parts, shape.part_warps, wide);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  M == 1 ? run(gemv_forward_kernel<kind, 1>) : run(gemv_forward_kernel<kind, 2>);
}

// The lookup-table path (codebook_lut.cuh) where it measured faster than the tensor-core
// forward on the H200 (docs/benchmarks.md): 16-bit x, D = 8, one codebook, one row, K > 4096
// (17.0 against 19.1 us at N = K = 8192). At K = 4096, with two codebooks or with 2-4 rows the
// tensor-core forward was faster, so those stay there (and float32 on the direct forward).
bool use_lut_forward(const Dims& d, at::ScalarType dtype) {
  return (dtype == at::kHalf || dtype == at::kBFloat16) && d.entry_dim == 8 &&
         d.num_codebooks == 1 && d.rows == 1 && d.in_features > 4096;
}

template <LutIn kind>
void launch_lut_forward(const Dims& d, const at::Tensor& x2d, const at::Tensor& idx,
                        const at::Tensor& cb, const void* scales, const void* bias,
                        at::Tensor& out2d, cudaStream_t stream) {
  using elem_t = lut_elem_t<kind>;
  const int M = static_cast<int>(d.num_codebooks), E = static_cast<int>(d.num_entries);
  const LutShape shape = lut_shape(d.rows, d.out_features, d.groups, M, device_sms());
  const int64_t nb = d.rows;
  at::Tensor partial =
      at::empty({shape.slices, nb, d.out_features}, x2d.options().dtype(at::kFloat));
  const bool wide =
      (d.groups * M) % 16 == 0 && reinterpret_cast<uintptr_t>(idx.data_ptr()) % 16 == 0;
  auto ptr = [](const at::Tensor& t) { return reinterpret_cast<const elem_t*>(t.data_ptr()); };
  // The routed case only (use_lut_forward): one codebook, one row, 32 code bytes per slice.
  // The kernel's other instantiations (2-4 rows, two codebooks, float32) are checked by
  // tests/test_codebook_cuda_emulator.py.
  TORCH_INTERNAL_ASSERT(M == 1 && shape.bt == 1 && shape.sb == 32);
  auto kernel = lut_partial_kernel<kind, 1, 1, 32>;
  const size_t smem = lut_partial_smem(1, E, 1, 32);
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  kernel<<<static_cast<unsigned>(shape.slices * shape.chunks), kLutThreads, smem, stream>>>(
      ptr(x2d), idx.data_ptr<uint8_t>(), ptr(cb), partial.data_ptr<float>(), d.rows,
      d.out_features, d.groups, E, shape.rpt, shape.chunks, wide);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t total = nb * d.out_features;
  lut_reduce_kernel<kind><<<static_cast<unsigned>(ceil_div(total, kLutThreads)), kLutThreads, 0,
                            stream>>>(partial.data_ptr<float>(),
                                      static_cast<const elem_t*>(scales),
                                      static_cast<const elem_t*>(bias),
                                      reinterpret_cast<elem_t*>(out2d.data_ptr()), nb,
                                      d.out_features, shape.slices);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor forward_cuda(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& codebook,
                        const std::optional<at::Tensor>& scales,
                        const std::optional<at::Tensor>& bias) {
  const Dims d = check_inputs(x, indices, codebook, scales, bias);
  check_cuda_inputs(x, indices, d);
  const c10::cuda::CUDAGuard guard(x.device());
  check_index_range(indices, d);
  if (d.index_bytes == 2) return forward_codes16(x, indices, codebook, scales, bias, d);
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
      if (use_gemv_forward(d, x.scalar_type())) {
        launch_gemv_forward<scalar_t>(d, x2d, idx, cb, sp,
                                      bs.defined() ? bs.data_ptr<scalar_t>() : nullptr, out2d,
                                      stream);
        return;
      }
      if (use_lut_forward(d, x.scalar_type())) {
        constexpr LutIn kind =
            std::is_same_v<scalar_t, at::Half> ? LutIn::kHalf : LutIn::kBFloat16;
        launch_lut_forward<kind>(d, x2d, idx, cb, sp,
                                 bs.defined() ? bs.data_ptr<scalar_t>() : nullptr, out2d, stream);
        return;
      }
    }
    if constexpr (std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::BFloat16>) {
      if (use_mma_forward(d, x.scalar_type())) {
        launch_mma_forward<scalar_t>(d, x2d, idx, cb, sp,
                                     bs.defined() ? bs.data_ptr<scalar_t>() : nullptr, out2d,
                                     stream);
        return;
      }
    }
    if (use_dense(d)) {
      dense_forward(x2d, s, bs, out2d, [&](const at::Tensor& w_scales) {
        return dequantize<scalar_t>(d, idx, cb,
                                    w_scales.defined() ? w_scales.data_ptr<scalar_t>() : nullptr,
                                    x.scalar_type(), stream);
      });
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
