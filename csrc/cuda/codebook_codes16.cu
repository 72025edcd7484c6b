// Host code of rlx::codebook_matmul and its backward on CUDA for 16-bit codes (int16 / uint16
// indices, E up to 65536; the kernels are in codebook_codes16.cuh). forward_cuda and
// backward_cuda (codebook_forward.cu, codebook_backward.cu) route here after their checks.
//
// Forward: up to kMaxSmallBatch rows, forward_small_kernel (no dense weight); above, the
// dequantized weight through cuBLAS (dense_forward, codebook_cuda.cuh).
// Backward, with gs = grad_out * scales:
//   dx = grad_out @ W (W the scaled weight in x's dtype; cuBLAS with a float32 output for
//        16-bit inputs);
//   dC by sorted segments: the keys m * E + code sorted stably (a fixed order), one warp per
//        entry adding its dW[j, g*D + t] (computed from x and gs up to kMaxFromXBatch rows,
//        else dW = gs^T x through cuBLAS);
//   grad_scales = sum_b grad_out * (x @ W_raw^T) with the unscaled forward in the accumulation
//        type (forward_small_kernel, or cuBLAS), grad_bias a sum of grad_out.
// No float atomics: identical inputs give bitwise identical outputs.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include "codebook_cuda.cuh"  // first: the CUDA headers codebook_codes16.cuh relies on
#include "codebook_codes16.cuh"

namespace rlx::codebook::cuda {
namespace {

namespace c16 = codes16;

// A tensor of x's dtype as the kernels see it (16-bit types as bit patterns); null if undefined.
template <typename scalar_t>
auto elem_ptr(const at::Tensor& t) {
  using st = c16::storage_t<ElemOf<scalar_t>::value>;
  return t.defined() ? reinterpret_cast<const st*>(t.data_ptr()) : static_cast<const st*>(nullptr);
}

const uint16_t* code_ptr(const at::Tensor& idx16) {
  return reinterpret_cast<const uint16_t*>(idx16.data_ptr());
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// forward_small_kernel over x2d ([B, K] contiguous, B <= kMaxSmallBatch) into out ([B, N]):
// x's dtype, or the accumulation type when OUT_ACC (the raw products for grad_scales).
template <typename scalar_t, bool OUT_ACC>
void launch_forward_small(const Dims& d, const at::Tensor& x2d, const at::Tensor& idx16,
                          const at::Tensor& cb, const at::Tensor& s, const at::Tensor& bias,
                          void* out, cudaStream_t stream) {
  constexpr Elem e = ElemOf<scalar_t>::value;
  // float32 / float64 accumulate in their own type: one kernel serves both outputs
  constexpr bool kOutAcc = OUT_ACC && !std::is_same_v<c16::acc_t<e>, c16::storage_t<e>>;
  using out_t = c16::out_elem_t<e, kOutAcc>;
  TORCH_INTERNAL_ASSERT(d.rows >= 1 && d.rows <= c16::kMaxSmallBatch);
  const bool d8 = d.entry_dim == 8;
  const bool vec_cb = d8 && aligned16(cb.data_ptr());
  const bool vec_x = d8 && aligned16(x2d.data_ptr());
  auto run = [&](auto bt_tag, auto dv_tag) {
    constexpr int BT = decltype(bt_tag)::value, DV = decltype(dv_tag)::value;
    c16::forward_small_kernel<e, BT, DV, kOutAcc>
        <<<static_cast<unsigned>(ceil_div(d.out_features, c16::kWarps)), c16::kThreads, 0,
           stream>>>(elem_ptr<scalar_t>(x2d), code_ptr(idx16), elem_ptr<scalar_t>(cb),
                     elem_ptr<scalar_t>(s), elem_ptr<scalar_t>(bias), static_cast<out_t*>(out),
                     d.rows, d.out_features, d.groups, static_cast<int>(d.num_codebooks),
                     static_cast<int>(d.num_entries), static_cast<int>(d.entry_dim), vec_cb,
                     vec_x);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  auto with_d = [&](auto bt_tag) {
    if (d8) {
      run(bt_tag, std::integral_constant<int, 8>{});
    } else {
      run(bt_tag, std::integral_constant<int, 0>{});
    }
  };
  // The batch tile is the smallest of 1, 2, 4, 8 rows that holds the batch.
  if (d.rows == 1) {
    with_d(std::integral_constant<int, 1>{});
  } else if (d.rows == 2) {
    with_d(std::integral_constant<int, 2>{});
  } else if (d.rows <= 4) {
    with_d(std::integral_constant<int, 4>{});
  } else {
    with_d(std::integral_constant<int, 8>{});
  }
}

// The dense [N, K] weight in x's dtype, scaled by s when it is defined.
template <typename scalar_t>
at::Tensor dequantize16(const Dims& d, const at::Tensor& idx16, const at::Tensor& cb,
                        const at::Tensor& s, cudaStream_t stream) {
  constexpr Elem e = ElemOf<scalar_t>::value;
  at::Tensor W = at::empty({d.out_features, d.in_features}, cb.options());
  if (W.numel() == 0) return W;
  const bool d8 = d.entry_dim == 8;
  const bool vec_cb = d8 && aligned16(cb.data_ptr());
  const bool vec_w = d8 && aligned16(W.data_ptr());
  const unsigned blocks = static_cast<unsigned>(ceil_div(d.out_features * d.groups, c16::kThreads));
  auto run = [&](auto kernel) {
    kernel<<<blocks, c16::kThreads, 0, stream>>>(
        code_ptr(idx16), elem_ptr<scalar_t>(cb), elem_ptr<scalar_t>(s),
        reinterpret_cast<c16::storage_t<e>*>(W.data_ptr()), d.out_features, d.groups,
        static_cast<int>(d.num_codebooks), static_cast<int>(d.num_entries),
        static_cast<int>(d.entry_dim), vec_cb, vec_w);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  d8 ? run(c16::dequantize_kernel<e, 8>) : run(c16::dequantize_kernel<e, 0>);
  return W;
}

// dC [M, E, D] in the accumulation type. gs = grad_out * scales ([B, N], accumulation type)
// and x2d are read when dW is undefined (small batches), else dW ([N, K], accumulation type).
template <typename scalar_t>
at::Tensor dcodebook16(const Dims& d, const at::Tensor& idx16, const at::Tensor& gs,
                       const at::Tensor& x2d, const at::Tensor& dW, cudaStream_t stream) {
  constexpr Elem e = ElemOf<scalar_t>::value;
  using acc = c16::acc_t<e>;
  const int64_t M = d.num_codebooks, E = d.num_entries, codes = d.out_features * d.groups * M;
  // int32 keys and segment offsets
  TORCH_CHECK_VALUE(codes < (int64_t(1) << 31) && M * E < (int64_t(1) << 31),
                    "codebook_matmul_backward: on CUDA, 16-bit indices take fewer than 2^31 ",
                    "codes (N*K/D*M = ", codes, ") and codebook entries (M*E = ", M * E, ")");
  // key = m * E + code, the code as its uint16 value; positions f = (j * G + g) * M + m
  auto int_opts = idx16.options().dtype(at::kInt);
  at::Tensor keys = idx16.to(at::kInt).bitwise_and_(0xFFFF).view({-1, M});
  if (M > 1) keys.add_(at::arange(M, int_opts).mul_(E));
  // A stable sort: each segment lists its positions in increasing order, whatever the sort's
  // internals, so the kernel's sums have one order.
  const auto sorted = at::sort(keys.view({-1}), /*stable=*/std::optional<bool>(true), /*dim=*/0);
  const at::Tensor order = std::get<1>(sorted);
  const at::Tensor offsets = at::searchsorted(std::get<0>(sorted), at::arange(M * E + 1, int_opts),
                                              /*out_int32=*/true);
  at::Tensor dC = at::empty({M, E, d.entry_dim}, gs.options());
  const int64_t blocks = ceil_div(M * E, c16::kWarps);
  const bool from_x = !dW.defined();
  auto run = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(blocks), c16::kThreads, 0, stream>>>(
        order.data_ptr<int64_t>(), offsets.data_ptr<int32_t>(), gs.data_ptr<acc>(),
        elem_ptr<scalar_t>(x2d), from_x ? nullptr : dW.data_ptr<acc>(), dC.data_ptr<acc>(),
        d.rows, d.out_features, d.groups, static_cast<int>(M), static_cast<int>(E),
        static_cast<int>(d.entry_dim), blocks * c16::kWarps);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  from_x ? run(c16::dcodebook_kernel<e, true>) : run(c16::dcodebook_kernel<e, false>);
  return dC;
}

}  // namespace

at::Tensor forward_codes16(const at::Tensor& x, const at::Tensor& indices,
                           const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
                           const std::optional<at::Tensor>& bias, const Dims& d) {
  auto out = at::empty(output_shape(x, d), x.options());
  if (out.numel() == 0) return out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto x2d = x.reshape({d.rows, d.in_features}).contiguous();
  // int16 and uint16 codes are the same bits; int16 tensors have every ATen op
  auto idx16 = indices.view(at::kShort).contiguous();
  auto cb = codebook.contiguous();
  auto s = scales.has_value() ? scales->contiguous() : at::Tensor();
  auto bs = bias.has_value() ? bias->contiguous() : at::Tensor();
  auto out2d = out.view({d.rows, d.out_features});
  const at::ScalarType dtype = x.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "codebook_matmul", [&] {
    if (d.rows <= c16::kMaxSmallBatch) {
      launch_forward_small<scalar_t, false>(d, x2d, idx16, cb, s, bs, out2d.data_ptr(), stream);
      return;
    }
    dense_forward(x2d, s, bs, out2d, [&](const at::Tensor& w_scales) {
      return dequantize16<scalar_t>(d, idx16, cb, w_scales, stream);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_codes16(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& indices,
    const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
    std::array<bool, 4> mask, const Dims& d) {
  TORCH_INTERNAL_ASSERT(d.rows > 0 && d.out_features > 0 && d.groups > 0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto skipped = [&] { return at::empty({0}, x.options()); };
  const at::ScalarType dtype = x.scalar_type();
  const at::ScalarType acc_type = acc_dtype(dtype);
  at::Tensor dx = skipped(), dC = skipped(), ds = skipped(), db = skipped();
  auto g2d = grad_out.reshape({d.rows, d.out_features}).contiguous();
  auto x2d = x.reshape({d.rows, d.in_features}).contiguous();
  auto idx16 = indices.view(at::kShort).contiguous();
  auto cb = codebook.contiguous();
  auto s = scales.has_value() ? scales->contiguous() : at::Tensor();
  if (mask[3]) db = g2d.to(acc_type).sum(0).to(dtype);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "codebook_matmul_backward", [&] {
    at::Tensor w_raw;  // the unscaled weight, once dequantized
    if (mask[2]) {
      at::Tensor raw;
      if (d.rows <= c16::kMaxSmallBatch) {
        raw = at::empty({d.rows, d.out_features}, x.options().dtype(acc_type));
        launch_forward_small<scalar_t, true>(d, x2d, idx16, cb, at::Tensor(), at::Tensor(),
                                             raw.data_ptr(), stream);
      } else {
        w_raw = dequantize16<scalar_t>(d, idx16, cb, at::Tensor(), stream);
        raw = mm_acc(x2d, w_raw.t());
      }
      ds = (g2d.to(acc_type) * raw).sum(0).to(dtype);
    }
    if (mask[0]) {
      // The scales are folded into the weight, so grad_out multiplies as is.
      const at::Tensor W = s.defined() || !w_raw.defined()
                               ? dequantize16<scalar_t>(d, idx16, cb, s, stream)
                               : w_raw;
      dx = mm_acc(g2d, W).to(dtype).view(x.sizes());
    }
    if (mask[1]) {
      at::Tensor gs = g2d.to(acc_type);
      if (s.defined()) gs = gs * s.to(acc_type);
      gs = gs.contiguous();
      at::Tensor dW;
      if (d.rows > c16::kMaxFromXBatch) {
        dW = mm_acc(g2d.t(), x2d);
        if (s.defined()) dW.mul_(s.to(acc_type).unsqueeze(1));
        dW = dW.contiguous();
      }
      dC = dcodebook16<scalar_t>(d, idx16, gs, x2d, dW, stream).view(codebook.sizes()).to(dtype);
    }
  });
  return {dx, dC, ds, db};
}

}  // namespace rlx::codebook::cuda
