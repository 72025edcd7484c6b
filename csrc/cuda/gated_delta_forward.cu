// rlx::gated_delta_fwd on CUDA: the chunked tensor-core formulation (gated_delta_chunk.cuh)
// where it applies (chunked_applies), else the token recurrence (gated_delta_cuda.cuh). Same
// contract as the
// CPU kernel (rlx_torch/ops/gated_delta.py): o, final state, the checkpoints every chunk_size
// tokens in the shared slot layout (gdn_backward_layout.h) with the same tag, and vw (v - P^T k
// per token) under the same rule (gdn_keeps_vw), so that every backend returns the same shapes.
#ifndef RLX_CUDA_EMULATION
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>
#endif

#include "gated_delta_chunk.cuh"
#include "gated_delta_chunk_host.cuh"
#include "gated_delta_chunk_state.cuh"
#include "gated_delta_cuda.cuh"
#include "gated_delta_l2norm.cuh"

namespace rlx::gdn::cuda {
namespace {

template <typename qk_t, typename v_t, typename acc_t>
struct FwdArgs {
  Dims<acc_t> d;
  const qk_t *q, *k;
  const v_t* v;
  const acc_t *g, *beta, *h0;
  v_t* out;
  acc_t *ht, *ckpt;
  acc_t* vw = nullptr;  // [B*T, HV, V], or nullptr: not kept
};

template <typename qk_t, typename v_t, typename acc_t, bool kPerChannel>
__global__ void __launch_bounds__(kMaxWarps * kWarp)
    forward_kernel(const FwdArgs<qk_t, v_t, acc_t> A) {
  const Dims<acc_t>& d = A.d;
  const int warps = blockDim.x / kWarp, Kp = warps * kRows;
  const auto s = Stage<acc_t, kPerChannel>::carve(dynamic_smem<acc_t>(), Kp, warps);
  const BlockPos b = block_pos(d);
  const int64_t KV = int64_t(d.K) * d.V;
  const int64_t base = checkpoint_base(b.n, b.bos, d.chunk);
  acc_t S[kRows];
  load_tile(S, A.h0 != nullptr ? A.h0 + (b.n * d.HV + b.hv) * KV : nullptr, d, b);
  int buf = 0;
  for (int64_t t0 = b.bos; t0 < b.eos; t0 += kStage) {
    const int len = int(min(int64_t(kStage), b.eos - t0));
    __syncthreads();  // the previous stage's tokens are done
    stage_tokens<qk_t, v_t, acc_t, kPerChannel>(s, d, b, t0, len, Kp, A.q, A.k, A.v, A.g,
                                                A.beta, nullptr);
    __syncthreads();
    for (int i = b.w; i < len; i += warps) {  // k.q of each token, for o
      acc_t kq = 0;
      for (int r = b.lane; r < Kp; r += kWarp) kq += s.k[i * Kp + r] * s.q[i * Kp + r];
      kq = warp_sum(kq);
      if (b.lane == 0) s.kq[i] = kq;
    }
    __syncthreads();
    for (int i = 0; i < len; ++i) {
      const int64_t tok = t0 + i;
      if (d.chunk > 0 && (tok - b.bos) % d.chunk == 0) {
        const int64_t slot = base + (tok - b.bos) / d.chunk;
        store_tile(S, A.ckpt + (slot * d.HV + b.hv) * KV, d, b);
      }
      acc_t y;
      const acc_t x = decay_and_project<true>(S, s, i, Kp, warps, b, buf, &y);
      const acc_t w = s.v[i * kCols + b.lane] - x;  // v - P^T k
      const acc_t u = s.beta[i] * w;
      if (b.w == 0 && b.col < d.V) {
        A.out[(tok * d.HV + b.hv) * d.V + b.col] = static_cast<v_t>(d.scale * (y + s.kq[i] * u));
        if (A.vw != nullptr) A.vw[(tok * d.HV + b.hv) * d.V + b.col] = w;
      }
      rank1_update(S, s, i, Kp, b, u);
    }
  }
  store_tile(S, A.ht + (b.n * d.HV + b.hv) * KV, d, b);
}

#ifndef RLX_CUDA_EMULATION
template <typename qk_t, typename v_t, typename acc_t, bool kPerChannel>
void launch_forward(const FwdArgs<qk_t, v_t, acc_t>& A, int64_t num_seqs, cudaStream_t stream) {
  const int warps = num_warps(A.d.K);
  const int64_t blocks = num_seqs * A.d.HV * A.d.nvt;
  if (blocks == 0) return;
  const size_t smem = Stage<acc_t, kPerChannel>::elements(warps * kRows, warps) * sizeof(acc_t);
  auto kernel = forward_kernel<qk_t, v_t, acc_t, kPerChannel>;
  allow_shared_memory(kernel, smem);
  kernel<<<dim3(unsigned(blocks)), dim3(warps * kWarp), smem, stream>>>(A);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <Bits16 kind>
void chunked_forward(const GdnProblem& p, const SeqLens& cu, double scale, const at::Tensor& q,
                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                     const at::Tensor& beta, const std::optional<at::Tensor>& h0, at::Tensor& o,
                     at::Tensor& ht, at::Tensor& ckpt, at::Tensor& vw, cudaStream_t stream) {
  ChunkArgs A;
  const ChunkPlan plan = plan_chunks(p, cu, scale, q, k, v, g, beta, h0, A);
  A.vw = vw.numel() > 0 ? vw.data_ptr<float>() : nullptr;
  A.ht = ht.data_ptr<float>();
  A.ckpt = ckpt.numel() > 0 ? ckpt.data_ptr<float>() : nullptr;
  A.out = bits_of(o);
  launch_prep_and_state<kind>(A, p.num_seqs, stream);
  if (plan.chunks > 0) {
    const size_t smem = output_smem(A.KP);
    auto kernel = p.gate_per_channel ? output_kernel<kind, true> : output_kernel<kind>;
    allow_shared_memory(kernel, smem);
    kernel<<<dim3(unsigned(plan.chunks * A.d.HV * (A.VP / kOutCols))), dim3(kChunkThreads), smem,
             stream>>>(A);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Slots no sequence uses are zero (as on the CPU), so the output is fully defined.
void zero_unused_slots(const GdnProblem& p, const int64_t* cu, at::Tensor& ckpt) {
  if (p.chunk == 0) return;
  std::vector<char> used(size_t(ckpt.size(0)), 0);
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    int64_t bos, eos;
    gdn_sequence_bounds(p, cu, n, &bos, &eos);
    const int64_t base = gdn_checkpoint_base(n, bos, p.chunk);
    for (int64_t j = 0; j < gdn_num_chunks(eos - bos, p.chunk); ++j) used[size_t(base + j)] = 1;
  }
  for (int64_t s = 0; s < ckpt.size(0);) {
    if (used[size_t(s)]) {
      ++s;
      continue;
    }
    int64_t e = s;
    while (e < ckpt.size(0) && !used[size_t(e)]) ++e;
    ckpt.narrow(0, s, e - s).zero_();
    s = e;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_delta_fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& g_in, const at::Tensor& beta_in, double scale,
    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
    int64_t chunk_size, std::optional<double> l2norm_eps) {
  const char* op = "rlx::gated_delta_fwd";
  const GdnProblem p =
      gdn_check_inputs(op, q_in, k_in, v_in, g_in, beta_in, initial_state, cu_seqlens, chunk_size);
  gdn_check_l2norm_eps(op, l2norm_eps);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const SeqLens cu = seq_lens(cu_seqlens, q_in.device());
  at::Tensor q = q_in.contiguous(), k = k_in.contiguous();
  const at::Tensor v = v_in.contiguous(), g = g_in.contiguous(), beta = beta_in.contiguous();
  const std::optional<at::Tensor> h0 =
      initial_state.has_value() ? std::optional<at::Tensor>(initial_state->contiguous())
                                : std::nullopt;
  const bool chunked = chunked_applies(p);
  if (l2norm_eps.has_value()) {  // the chunked path's products read q and k in v's dtype
    q = l2norm_rows(q, *l2norm_eps, /*out_acc=*/!chunked, /*want_rstd=*/false).first;
    k = l2norm_rows(k, *l2norm_eps, /*out_acc=*/!chunked, /*want_rstd=*/false).first;
  }
  const int64_t K = p.head_k_dim, V = p.head_v_dim, HV = p.num_v_heads;
  const auto acc_opts = q_in.options().dtype(p.acc_dtype);
  at::Tensor o = at::empty_like(v);
  at::Tensor ht = at::empty({p.num_seqs, HV, K, V}, acc_opts);
  at::Tensor ckpt =
      at::empty({gdn_checkpoint_slots(p.num_seqs, p.tokens(), p.chunk), HV, K, V}, acc_opts);
  const bool keeps_vw = gdn_keeps_vw(p.chunk, p.gate_per_channel);
  at::Tensor vw = at::empty(keeps_vw ? v.sizes() : at::IntArrayRef{0}, acc_opts);
  zero_unused_slots(p, cu.host_ptr(), ckpt);
  if (chunked && p.input_dtype == at::kBFloat16) {
    chunked_forward<Bits16::kBFloat16>(p, cu, scale, q, k, v, g, beta, h0, o, ht, ckpt, vw,
                                       stream);
  } else if (chunked) {
    chunked_forward<Bits16::kHalf>(p, cu, scale, q, k, v, g, beta, h0, o, ht, ckpt, vw, stream);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "gated_delta_fwd", [&] {
      using v_t = scalar_t;
      using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      auto run = [&](auto qk_tag) {
        using qk_t = decltype(qk_tag);
        FwdArgs<qk_t, v_t, acc_t> A;
        A.d = make_dims<acc_t>(p, cu.device_ptr(), scale);
        A.q = q.data_ptr<qk_t>();
        A.k = k.data_ptr<qk_t>();
        A.v = v.data_ptr<v_t>();
        A.g = g.data_ptr<acc_t>();
        A.beta = beta.data_ptr<acc_t>();
        A.h0 = data_or_null<acc_t>(h0);
        A.out = o.data_ptr<v_t>();
        A.ht = ht.data_ptr<acc_t>();
        A.ckpt = ckpt.numel() > 0 ? ckpt.data_ptr<acc_t>() : nullptr;
        A.vw = vw.numel() > 0 ? vw.data_ptr<acc_t>() : nullptr;
        if (p.gate_per_channel) {
          launch_forward<qk_t, v_t, acc_t, true>(A, p.num_seqs, stream);
        } else {
          launch_forward<qk_t, v_t, acc_t, false>(A, p.num_seqs, stream);
        }
      };
      if (q.scalar_type() == p.acc_dtype) {
        run(acc_t{});
      } else {
        run(scalar_t{});
      }
    });
  }
  if (ckpt.numel() > 0) {  // the tag: first 4 bytes of the last slot (gdn_checks.h)
    const uint32_t tag = gdn_checkpoint_tag(p.chunk, l2norm_eps, keeps_vw);
    int32_t as_int;
    std::memcpy(&as_int, &tag, sizeof(as_int));
    ckpt.select(0, ckpt.size(0) - 1).view(at::kInt).view(-1).select(0, 0).fill_(as_int);
  }
  return {o, ht, ckpt, vw};
}

#endif  // RLX_CUDA_EMULATION

}  // namespace
}  // namespace rlx::gdn::cuda

#ifndef RLX_CUDA_EMULATION
TORCH_LIBRARY_IMPL(rlx, CUDA, m) {
  m.impl("gated_delta_fwd", &rlx::gdn::cuda::gated_delta_fwd_cuda);
}
#endif
