// rlx::gated_delta_bwd on CUDA: the chunked tensor-core formulation (gated_delta_chunk_bwd.cuh)
// where it applies (chunked_applies), else the token recurrence (gated_delta_cuda.cuh).
// Writes the packed gradient buffer of gdn_backward_layout.h.
#ifndef RLX_CUDA_EMULATION
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>
#endif

#include "gated_delta_chunk_bwd_grads.cuh"
#include "gated_delta_chunk_kda_bwd.cuh"
#include "gated_delta_chunk_host.cuh"
#include "gated_delta_cuda.cuh"
#include "gated_delta_l2norm.cuh"

namespace rlx::gdn::cuda {
namespace {

template <typename qk_t, typename v_t, typename acc_t>
struct BwdArgs {
  Dims<acc_t> d;
  const qk_t *q, *k;
  const v_t *v, *dout;
  const acc_t *g, *beta, *ckpt, *dht;
  // Per column tile (leading dim nvt): partial sums over the tile's columns.
  acc_t *dq_part, *dk_part, *dg_part;  // [nvt, tokens, HV, K]
  acc_t* dbeta_part;                   // [nvt, tokens, HV]
  acc_t *dv, *dh0;                     // packed slices (dh0 may be nullptr)
  acc_t* scratch;                      // [blocks, sub_slots, Kp, 32]
  int64_t sub_slots;
};

// Sub-chunk length of pass B: the states of one sub-chunk are kept in registers.
template <typename acc_t>
__host__ __device__ constexpr int sub_len() {
  return sizeof(acc_t) == 8 ? 2 : 4;
}

// Writes lane l's reduced row (warp rows + l) of a [nvt, tokens, HV, K] partial.
template <typename acc_t>
__device__ __forceinline__ void write_row_part(acc_t* part, const Dims<acc_t>& d,
                                               const BlockPos& b, int64_t tok, acc_t value) {
  const int r = b.w * kRows + b.lane;
  if (r < d.K) part[((b.vt * d.tokens + tok) * d.HV + b.hv) * d.K + r] = value;
}

template <typename qk_t, typename v_t, typename acc_t, bool kPerChannel>
__global__ void __launch_bounds__(kMaxWarps * kWarp)
    backward_kernel(const BwdArgs<qk_t, v_t, acc_t> A) {
  constexpr int L = sub_len<acc_t>();
  const Dims<acc_t>& d = A.d;
  const int warps = blockDim.x / kWarp, Kp = warps * kRows;
  const auto s = Stage<acc_t, kPerChannel>::carve(dynamic_smem<acc_t>(), Kp, warps);
  const BlockPos b = block_pos(d);
  const int64_t KV = int64_t(d.K) * d.V;
  const int64_t C = d.chunk;
  const int64_t base = checkpoint_base(b.n, b.bos, C);
  acc_t* scratch = A.scratch + int64_t(blockIdx.x) * A.sub_slots * Kp * kCols;
  auto scratch_at = [&](int64_t sub, int ii) {
    return scratch + (sub * Kp + b.w * kRows + ii) * kCols + b.lane;
  };
  acc_t D[kRows];  // dL/dS of the state after the current token
  load_tile(D, A.dht != nullptr ? A.dht + (b.n * d.HV + b.hv) * KV : nullptr, d, b);
  int buf = 0;
  const int64_t chunks = num_chunks(b.eos - b.bos, C);
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t cs = b.bos + c * C, ce = min(cs + C, b.eos);
    acc_t S[kRows];
    load_tile(S, A.ckpt + ((base + c) * d.HV + b.hv) * KV, d, b);
    // Pass A: the chunk forward; the state every L tokens to the scratch; dq.
    for (int64_t t0 = cs; t0 < ce; t0 += kStage) {
      const int len = int(min(int64_t(kStage), ce - t0));
      __syncthreads();
      stage_tokens<qk_t, v_t, acc_t, kPerChannel>(s, d, b, t0, len, Kp, A.q, A.k, A.v, A.g,
                                                  A.beta, A.dout);
      __syncthreads();
      for (int i = 0; i < len; ++i) {
        const int64_t tok = t0 + i;
        if ((tok - cs) % L == 0) {
#pragma unroll
          for (int ii = 0; ii < kRows; ++ii) *scratch_at((tok - cs) / L, ii) = S[ii];
        }
        const acc_t x = decay_and_project<false>(S, s, i, Kp, warps, b, buf, static_cast<acc_t*>(nullptr));
        rank1_update(S, s, i, Kp, b, s.beta[i] * (s.v[i * kCols + b.lane] - x));
        acc_t part[kRows];
        const acc_t dO = s.dout[i * kCols + b.lane];
#pragma unroll
        for (int ii = 0; ii < kRows; ++ii) part[ii] = S[ii] * dO;
        reduce_scatter<1>(part, b.lane);
        write_row_part(A.dq_part, d, b, tok, d.scale * part[0]);
      }
    }
    // Pass B: sub-chunks in reverse; each re-run forward (P_t kept), then reversed.
    const int64_t stages = ceil_div(ce - cs, kStage);
    for (int64_t st = stages - 1; st >= 0; --st) {
      const int64_t t0 = cs + st * kStage;
      const int len = int(min(int64_t(kStage), ce - t0));
      __syncthreads();
      stage_tokens<qk_t, v_t, acc_t, kPerChannel>(s, d, b, t0, len, Kp, A.q, A.k, A.v, A.g,
                                                  A.beta, A.dout);
      __syncthreads();
      for (int i0 = int(ceil_div(len, L) - 1) * L; i0 >= 0; i0 -= L) {
        const int64_t sub = (t0 + i0 - cs) / L;
#pragma unroll
        for (int ii = 0; ii < kRows; ++ii) S[ii] = *scratch_at(sub, ii);
        acc_t P[L][kRows];
        acc_t vw[L];
#pragma unroll
        for (int li = 0; li < L; ++li) {
          if (i0 + li < len) {  // (uniform over the block)
            const acc_t x = decay_and_project<false>(S, s, i0 + li, Kp, warps, b, buf, static_cast<acc_t*>(nullptr));
#pragma unroll
            for (int ii = 0; ii < kRows; ++ii) P[li][ii] = S[ii];
            vw[li] = s.v[(i0 + li) * kCols + b.lane] - x;
            rank1_update(S, s, i0 + li, Kp, b, s.beta[i0 + li] * vw[li]);
          }
        }
#pragma unroll
        for (int li = L - 1; li >= 0; --li) {
          if (i0 + li >= len) continue;
          const int i = i0 + li;
          const int64_t tok = t0 + i;
          const acc_t* kr = s.k + i * Kp + b.w * kRows;
          const acc_t* qr = s.q + i * Kp + b.w * kRows;
          const acc_t* ar = s.a + (kPerChannel ? i * Kp + b.w * kRows : i);
          const acc_t dO = s.dout[i * kCols + b.lane];
          const acc_t sdO = d.scale * dO;
          acc_t z = 0;
#pragma unroll
          for (int ii = 0; ii < kRows; ++ii) {
            D[ii] += qr[ii] * sdO;
            z += D[ii] * kr[ii];
          }
          acc_t* rb = s.red + buf * 2 * warps * kCols;
          rb[b.w * kCols + b.lane] = z;
          __syncthreads();
          acc_t du = 0;
          for (int ww = 0; ww < warps; ++ww) du += rb[ww * kCols + b.lane];
          buf ^= 1;
          const acc_t beta = s.beta[i], u = beta * vw[li], dw = -beta * du;
          if (b.w == 0) {
            if (b.col < d.V) A.dv[(tok * d.HV + b.hv) * d.V + b.col] = beta * du;
            const acc_t db = warp_sum(du * vw[li]);
            if (b.lane == 0) A.dbeta_part[(b.vt * d.tokens + tok) * d.HV + b.hv] = db;
          }
          acc_t part[kRows];
#pragma unroll
          for (int ii = 0; ii < kRows; ++ii) part[ii] = D[ii] * u + P[li][ii] * dw;
          reduce_scatter<1>(part, b.lane);
          write_row_part(A.dk_part, d, b, tok, part[0]);
#pragma unroll
          for (int ii = 0; ii < kRows; ++ii) {
            const acc_t dP = D[ii] + kr[ii] * dw;
            part[ii] = dP * P[li][ii];
            D[ii] = (kPerChannel ? ar[ii] : ar[0]) * dP;
          }
          reduce_scatter<1>(part, b.lane);
          write_row_part(A.dg_part, d, b, tok, part[0]);
        }
      }
    }
  }
  if (A.dh0 != nullptr) store_tile(D, A.dh0 + (b.n * d.HV + b.hv) * KV, d, b);
}

#ifndef RLX_CUDA_EMULATION
template <typename qk_t, typename v_t, typename acc_t, bool kPerChannel>
void launch_backward(const BwdArgs<qk_t, v_t, acc_t>& A, int64_t blocks, cudaStream_t stream) {
  if (blocks == 0) return;
  const int warps = num_warps(A.d.K);
  const size_t smem = Stage<acc_t, kPerChannel>::elements(warps * kRows, warps) * sizeof(acc_t);
  auto kernel = backward_kernel<qk_t, v_t, acc_t, kPerChannel>;
  allow_shared_memory(kernel, smem);
  kernel<<<dim3(unsigned(blocks)), dim3(warps * kWarp), smem, stream>>>(A);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <Bits16 kind, int MT, int NT>
void launch_dh(const ChunkBwdArgs& B, int64_t num_seqs, cudaStream_t stream) {
  const int64_t blocks = num_seqs * B.f.d.HV * (B.f.VP / (8 * NT));
  if (blocks == 0) return;
  const size_t smem = dh_smem(64 * MT, 8 * NT);
  auto kernel = B.f.Kd != nullptr ? dh_kernel<kind, MT, NT, true> : dh_kernel<kind, MT, NT>;
  allow_shared_memory(kernel, smem);
  kernel<<<dim3(unsigned(blocks)), dim3(kChunkThreads), smem, stream>>>(B);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Kernel>
void launch_chunk_parallel(Kernel kernel, int64_t blocks, size_t smem, const ChunkBwdArgs& B,
                           cudaStream_t stream) {
  if (blocks == 0) return;
  allow_shared_memory(kernel, smem);
  kernel<<<dim3(unsigned(blocks)), dim3(kChunkThreads), smem, stream>>>(B);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <Bits16 kind, int MT>
void launch_dh_tiles(const ChunkBwdArgs& B, int64_t num_seqs, bool narrow, cudaStream_t stream) {
  if (narrow) {
    launch_dh<kind, MT, 2>(B, num_seqs, stream);
  } else {
    launch_dh<kind, MT, 4>(B, num_seqs, stream);
  }
}

// The chunked backward (gated_delta_chunk_bwd.cuh): the forward's prep kernel re-runs for G,
// W' and T'; u and the chunk states come from the forward's vw and checkpoints where those
// are every 64 tokens (from_forward_kernel), else from a re-run of its state kernel; then
// dv_local, dh, dqk and wy. A per-channel gate (no vw from the forward) always re-runs the
// state kernel, which writes vw for dh_kernel, and ends with kda_wy_kernel
// (gated_delta_chunk_kda_bwd.cuh). dv, dg, dbeta and dh0 go straight into the packed buffer; dq and
// dk per value head into dq_hv, dk_hv. With raw rows (the fused l2norm, one value head per q/k
// head), wy_kernel finishes them with the l2norm backward: the raw rows' gradients.
struct RawRows {
  at::Tensor q, k, q_rstd, k_rstd;  // undefined: no l2norm backward in wy_kernel
};

template <Bits16 kind>
void chunked_backward(const GdnProblem& p, const SeqLens& cu, double scale, const at::Tensor& q,
                      const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, const std::optional<at::Tensor>& h0,
                      const at::Tensor& dout, const std::optional<at::Tensor>& dht,
                      const at::Tensor& vw, const at::Tensor& ckpt,
                      const GdnBackwardLayout& layout, at::Tensor& packed, at::Tensor& dq_hv,
                      at::Tensor& dk_hv, const RawRows& raw, cudaStream_t stream) {
  const int64_t N = p.num_seqs, HV = p.num_v_heads, tokens = p.tokens();
  const bool per_channel = p.gate_per_channel;
  // the checkpoints are the 64-token chunk states, and vw is kept (one gate per head)
  const bool states_kept = p.chunk == kChunk && !per_channel;
  ChunkBwdArgs B;
  ChunkArgs& A = B.f;
  const ChunkPlan plan = plan_chunks(p, cu, scale, q, k, v, g, beta, h0, A, !states_kept);
  const int64_t KP = A.KP, VP = A.VP, chunks = plan.chunks;
  const auto f32 = q.options().dtype(at::kFloat);
  const at::Tensor Tinv = at::empty({tokens, HV, kChunk}, v.options());
  A.Tinv = bits_of(Tinv);  // (no ht or checkpoints: the forward has them)
  at::Tensor vw_rerun, L;
  if (per_channel) {  // vw from the state kernel's re-run; L for dbeta
    vw_rerun = at::empty({tokens, HV, p.head_v_dim}, f32);
    L = at::empty({tokens, HV, kChunk}, f32);
    A.vw = vw_rerun.data_ptr<float>();
    A.L = L.data_ptr<float>();
    B.vw = A.vw;
  } else {
    B.vw = vw.data_ptr<float>();
  }
  if (states_kept) {
    B.ckpt = ckpt.data_ptr<float>();
    launch_prep<kind>(A, stream);
    launch_chunk_parallel(from_forward_kernel<kind>, chunks * HV, from_forward_smem(), B, stream);
  } else {
    launch_prep_and_state<kind>(A, N, stream);
  }
  const bool narrow = narrow_state_tiles(N, HV, VP);
  const at::Tensor duL = at::empty({tokens, HV, VP}, f32);
  const at::Tensor dvw = at::empty({tokens, HV, VP}, v.options());
  const at::Tensor dS = at::empty(plan.hT.sizes(), v.options());  // [slots64, HV, KP, VP]
  const at::Tensor dW = at::empty({tokens, HV, KP}, v.options());
  B.dbeta_tiles = int(VP / (narrow ? 16 : 32));
  const at::Tensor dbeta_part = at::empty({B.dbeta_tiles, tokens, HV}, f32);
  const at::Tensor dg_part = per_channel ? at::empty({tokens, HV, KP}, f32)
                                         : at::empty({KP / kBwdTile, tokens, HV}, f32);
  B.dout = bits_of(dout);
  B.dht = data_or_null<float>(dht);
  B.duL = duL.data_ptr<float>();
  B.dvw = bits_of(dvw);
  B.dS = bits_of(dS);
  B.dW = bits_of(dW);
  B.dbeta_part = dbeta_part.data_ptr<float>();
  B.dg_part = dg_part.data_ptr<float>();
  B.dq = dq_hv.data_ptr<float>();
  B.dk = dk_hv.data_ptr<float>();
  float* out = packed.data_ptr<float>();
  B.dv = out + layout.dv.offset;
  B.dg = out + layout.dg.offset;
  B.dbeta = out + layout.dbeta.offset;
  B.dh0 = p.has_initial_state ? out + layout.dstate.offset : nullptr;
  launch_chunk_parallel(per_channel ? dv_local_kernel<kind, true> : dv_local_kernel<kind>,
                        chunks * HV * (VP / kBwdTile), dv_local_smem(int(KP)), B, stream);
  TORCH_CHECK(KP <= 128, "rlx::gated_delta_bwd: the chunked backward takes K <= 128");
  if (KP == 64) {
    launch_dh_tiles<kind, 1>(B, N, narrow, stream);
  } else {
    launch_dh_tiles<kind, 2>(B, N, narrow, stream);
  }
  launch_chunk_parallel(per_channel ? dqk_kernel<kind, true> : dqk_kernel<kind>,
                        chunks * HV * (KP / kBwdTile), dqk_smem(), B, stream);
  if (per_channel) {
    launch_chunk_parallel(kda_wy_kernel<kind>, chunks * HV, kda_wy_smem(int(KP)), B, stream);
  } else if (raw.q.defined()) {
    B.q_raw = bits_of(raw.q);
    B.k_raw = bits_of(raw.k);
    B.q_rstd = raw.q_rstd.data_ptr<float>();
    B.k_rstd = raw.k_rstd.data_ptr<float>();
    launch_chunk_parallel(wy_kernel<kind, true>, chunks * HV, wy_smem(), B, stream);
  } else {
    launch_chunk_parallel(wy_kernel<kind>, chunks * HV, wy_smem(), B, stream);
  }
}

// The checkpoints' tag (gdn_checks.h), read from device memory: one 4-byte copy to the host.
void check_tag(const char* op, const at::Tensor& ckpt, uint32_t tag) {
  if (ckpt.numel() == 0) return;
  const int32_t got_int =
      ckpt.select(0, ckpt.size(0) - 1).view(at::kInt).view(-1).select(0, 0).item<int32_t>();
  uint32_t got;
  std::memcpy(&got, &got_int, sizeof(got));
  TORCH_CHECK(got == tag, op, ": checkpoints do not come from rlx::gated_delta_fwd with this ",
              "chunk_size, l2norm_eps and vw (their tag differs): pass the backward the ",
              "forward's own chunk_size, l2norm_eps and outputs (checkpoints, vw)");
}

at::Tensor gated_delta_bwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                const at::Tensor& v_in, const at::Tensor& g_in,
                                const at::Tensor& beta_in, double scale,
                                const std::optional<at::Tensor>& initial_state,
                                const std::optional<at::Tensor>& cu_seqlens,
                                const at::Tensor& checkpoints, const at::Tensor& grad_o_in,
                                const std::optional<at::Tensor>& grad_final_state,
                                int64_t chunk_size, std::optional<double> l2norm_eps,
                                const std::optional<at::Tensor>& vw) {
  const char* op = "rlx::gated_delta_bwd";
  gdn_check_l2norm_eps(op, l2norm_eps);
  const GdnProblem p =
      gdn_check_inputs(op, q_in, k_in, v_in, g_in, beta_in, initial_state, cu_seqlens, chunk_size);
  // (vw, when given, is checked as on every backend and not read: recomputed with the states)
  gdn_check_backward_inputs(op, p, q_in, v_in, checkpoints, grad_o_in, grad_final_state, vw);
  const c10::cuda::CUDAGuard guard(q_in.device());
  check_tag(op, checkpoints,
            gdn_checkpoint_tag(p.chunk, l2norm_eps, gdn_keeps_vw(p.chunk, p.gate_per_channel)));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const SeqLens cu = seq_lens(cu_seqlens, q_in.device());
  // the chunked kernels' products read q and k in v's dtype (as in the forward); it reads the
  // forward's vw, which it keeps in every case the chunked path covers (gdn_keeps_vw). K or V
  // above 128 stays on the token backward: the emulator does not reach those tiles, and their
  // GPU tests have not yet finished a run (the forward's have).
  // (a per-channel gate's forward keeps no vw: its chunked backward re-runs the state kernel)
  const bool chunked = chunked_applies(p) && p.head_k_dim <= 128 &&
                       p.head_v_dim <= 128 &&
                       (p.gate_per_channel || (vw.has_value() && vw->numel() > 0));
  // the chunked kernels' dq and dk go straight into the packed buffer when there is nothing
  // to add (one value head per q/k head); wy_kernel then also applies the l2norm backward
  // (kda_wy_kernel does not: with the l2norm, the per-channel gate's dq and dk go through
  // l2norm_rows_backward_fused below)
  const bool direct_dqk =
      chunked && p.group() == 1 && !(p.gate_per_channel && l2norm_eps.has_value());
  const bool fused_l2norm = direct_dqk && l2norm_eps.has_value();
  const at::Tensor q_raw = q_in.contiguous(), k_raw = k_in.contiguous();
  at::Tensor q = q_raw, k = k_raw;  // normalized when l2norm_eps is given
  RawRows raw;
  if (l2norm_eps.has_value()) {
    auto [qn, q_rstd] = l2norm_rows(q_raw, *l2norm_eps, /*out_acc=*/!chunked, fused_l2norm);
    auto [kn, k_rstd] = l2norm_rows(k_raw, *l2norm_eps, /*out_acc=*/!chunked, fused_l2norm);
    q = qn;
    k = kn;
    if (fused_l2norm) raw = RawRows{q_raw, k_raw, q_rstd, k_rstd};
  }
  const at::Tensor v = v_in.contiguous(), g = g_in.contiguous(), beta = beta_in.contiguous();
  const at::Tensor ckpt = checkpoints.contiguous(), dout = grad_o_in.contiguous();
  const std::optional<at::Tensor> dht =
      grad_final_state.has_value() ? std::optional<at::Tensor>(grad_final_state->contiguous())
                                   : std::nullopt;
  const std::optional<at::Tensor> h0 =
      initial_state.has_value() ? std::optional<at::Tensor>(initial_state->contiguous())
                                : std::nullopt;
  const int64_t B = p.batch, T = p.seq_len, H = p.num_qk_heads, HV = p.num_v_heads;
  const int64_t K = p.head_k_dim, V = p.head_v_dim, G = p.group();
  const GdnBackwardLayout layout = GdnBackwardLayout::make(
      B, T, H, HV, K, V, p.num_seqs, p.gate_per_channel, p.has_initial_state);
  const auto acc_opts = q_in.options().dtype(p.acc_dtype);
  at::Tensor packed = at::empty({layout.total}, acc_opts);
  auto slice = [&](const GdnSlice& sl) { return packed.narrow(0, sl.offset, sl.numel); };
  const int64_t tokens = p.tokens();
  const int64_t nvt = chunked ? 1 : ceil_div(V, kCols);  // (chunked: dq, dk per value head)
  at::Tensor dq_part = direct_dqk ? slice(layout.dq).view({1, tokens, H, 1, K})
                                  : at::empty({nvt, tokens, H, G, K}, acc_opts);
  at::Tensor dk_part = direct_dqk ? slice(layout.dk).view({1, tokens, H, 1, K})
                                  : at::empty({nvt, tokens, H, G, K}, acc_opts);
  if (chunked) {
    const at::Tensor vwc = vw->contiguous();
    if (p.input_dtype == at::kBFloat16) {
      chunked_backward<Bits16::kBFloat16>(p, cu, scale, q, k, v, g, beta, h0, dout, dht,
                                          vwc, ckpt, layout, packed, dq_part, dk_part, raw,
                                          stream);
    } else {
      chunked_backward<Bits16::kHalf>(p, cu, scale, q, k, v, g, beta, h0, dout, dht, vwc,
                                      ckpt, layout, packed, dq_part, dk_part, raw, stream);
    }
  } else {
    at::Tensor dg_part = at::empty({nvt, tokens, HV, K}, acc_opts);
    at::Tensor dbeta_part = at::empty({nvt, tokens, HV}, acc_opts);
    const int64_t blocks = p.num_seqs * HV * nvt;
    const int warps = num_warps(int(K));
    const int64_t longest_chunk = std::min<int64_t>(p.chunk, std::max<int64_t>(p.longest, 1));
    const int64_t sub_slots_f = ceil_div(longest_chunk, 4), sub_slots_d = ceil_div(longest_chunk, 2);
    const int64_t sub_slots = p.acc_dtype == at::kDouble ? sub_slots_d : sub_slots_f;
    at::Tensor scratch = at::empty({blocks * sub_slots * warps * kRows * kCols}, acc_opts);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "gated_delta_bwd", [&] {
      using v_t = scalar_t;
      using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      auto run = [&](auto qk_tag) {
        using qk_t = decltype(qk_tag);
        BwdArgs<qk_t, v_t, acc_t> A;
        A.d = make_dims<acc_t>(p, cu.device_ptr(), scale);
        A.q = q.data_ptr<qk_t>();
        A.k = k.data_ptr<qk_t>();
        A.v = v.data_ptr<v_t>();
        A.dout = dout.data_ptr<v_t>();
        A.g = g.data_ptr<acc_t>();
        A.beta = beta.data_ptr<acc_t>();
        A.ckpt = ckpt.numel() > 0 ? ckpt.data_ptr<acc_t>() : nullptr;
        A.dht = data_or_null<acc_t>(dht);
        A.dq_part = dq_part.data_ptr<acc_t>();
        A.dk_part = dk_part.data_ptr<acc_t>();
        A.dg_part = dg_part.data_ptr<acc_t>();
        A.dbeta_part = dbeta_part.data_ptr<acc_t>();
        A.dv = packed.data_ptr<acc_t>() + layout.dv.offset;
        A.dh0 = p.has_initial_state ? packed.data_ptr<acc_t>() + layout.dstate.offset : nullptr;
        A.scratch = scratch.data_ptr<acc_t>();
        A.sub_slots = sub_slots;
        if (p.gate_per_channel) {
          launch_backward<qk_t, v_t, acc_t, true>(A, blocks, stream);
        } else {
          launch_backward<qk_t, v_t, acc_t, false>(A, blocks, stream);
        }
      };
      if (q.scalar_type() == p.acc_dtype) {
        run(acc_t{});
      } else {
        run(scalar_t{});
      }
    });
    // the token kernel's dg, dbeta: sums over column tiles (and a GVA group's value heads)
    const std::vector<int64_t> tiles_dim{0}, tiles_group_dims{0, 3};
    const at::IntArrayRef tiles(tiles_dim), tiles_group(tiles_group_dims);
    if (p.gate_per_channel) {
      at::Tensor dg = slice(layout.dg).view({tokens, HV, K});
      at::sum_out(dg, dg_part, tiles);
    } else {
      at::Tensor dg = slice(layout.dg).view({tokens, HV});
      at::sum_out(dg, dg_part, tiles_group);
    }
    at::Tensor dbeta = slice(layout.dbeta).view({tokens, HV});
    at::sum_out(dbeta, dbeta_part, tiles);
  }
  // dq, dk: the sums over column tiles (and over a GVA group's value heads), in a fixed order.
  // (dims as IntArrayRef: a braced list is ambiguous with DimnameList in some torch versions)
  const std::vector<int64_t> tiles_group_dims{0, 3};
  const at::IntArrayRef tiles_group(tiles_group_dims);
  at::Tensor dq = slice(layout.dq).view({tokens, H, K});
  at::Tensor dk = slice(layout.dk).view({tokens, H, K});
  if (l2norm_eps.has_value() && !fused_l2norm) {  // the sums and the l2norm backward
    l2norm_rows_backward_fused(q_raw, dq_part, *l2norm_eps, dq);
    l2norm_rows_backward_fused(k_raw, dk_part, *l2norm_eps, dk);
  } else if (!direct_dqk) {
    at::sum_out(dq, dq_part, tiles_group);
    at::sum_out(dk, dk_part, tiles_group);
  }
  return packed;
}

#endif  // RLX_CUDA_EMULATION

}  // namespace
}  // namespace rlx::gdn::cuda

#ifndef RLX_CUDA_EMULATION
TORCH_LIBRARY_IMPL(rlx, CUDA, m) {
  m.impl("gated_delta_bwd", &rlx::gdn::cuda::gated_delta_bwd_cuda);
}
#endif
