// Host code shared by the chunked gated delta forward (gated_delta_forward.cu) and backward
// (gated_delta_backward.cu): when the chunked kernels apply, the chunk table, the
// intermediates of the forward's prep and state kernels, and their launches.
#pragma once

#ifndef RLX_CUDA_EMULATION
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gated_delta_chunk.cuh"
#include "gated_delta_chunk_kda.cuh"
#include "gated_delta_chunk_state.cuh"
#include "gated_delta_cuda.cuh"

namespace rlx::gdn::cuda {

// The chunked kernels take 16-bit inputs (their products run on 16-bit operands), K, V <= 256
// and checkpoints every multiple of 64 tokens (the states they keep are those at 64-token
// chunk starts); a per-channel gate K <= 128 (its prep keeps G in float32 shared memory).
// (The backward adds its own limits: gated_delta_backward.cu.) They are the default wherever
// they apply; RLX_CUDA_GATED_DELTA_CHUNKED=0 selects the token recurrence instead, for the
// forward and the backward alike (the tests and bench_gdn_cuda.py compare the two paths that
// way).
inline bool chunked_applies(const GdnProblem& p) {
  const char* flag = std::getenv("RLX_CUDA_GATED_DELTA_CHUNKED");
  if (flag != nullptr && flag[0] == '0' && flag[1] == '\0') return false;
  const bool bits16 = p.input_dtype == at::kHalf || p.input_dtype == at::kBFloat16;
  const bool gate_ok = !p.gate_per_channel || p.head_k_dim <= 128;
  return bits16 && gate_ok && p.head_k_dim <= 256 && p.head_v_dim <= 256 &&
         p.chunk % kChunk == 0;
}

inline uint16_t* bits_of(const at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr());
}

// The 64-token chunks of every sequence (ChunkEntry), on the device, and the intermediates
// of prep_kernel and state_kernel, filled into A (with the inputs); without with_U, no U'
// (A.U = nullptr: prep_kernel skips it, and state_kernel, which reads it, must not run).
struct ChunkPlan {
  at::Tensor table, G, W, U, u, hT;
  at::Tensor Qg, Kd, P;  // a per-channel gate's (ChunkArgs)
  int64_t chunks = 0;
};

inline ChunkPlan plan_chunks(const GdnProblem& p, const SeqLens& cu, double scale,
                             const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta,
                             const std::optional<at::Tensor>& h0, ChunkArgs& A,
                             bool with_U = true) {
  const int64_t N = p.num_seqs, HV = p.num_v_heads;
  const int64_t KP = ceil_div(p.head_k_dim, 64) * 64, VP = ceil_div(p.head_v_dim, 64) * 64;
  std::vector<ChunkEntry> entries;
  for (int64_t n = 0; n < N; ++n) {
    int64_t bos, eos;
    gdn_sequence_bounds(p, cu.host_ptr(), n, &bos, &eos);
    const int64_t base = gdn_checkpoint_base(n, bos, kChunk);
    for (int64_t j = 0; bos + j * kChunk < eos; ++j) {
      entries.push_back({bos + j * kChunk, std::min<int64_t>(kChunk, eos - bos - j * kChunk), n,
                         base + j});
    }
  }
  ChunkPlan P;
  P.chunks = int64_t(entries.size());
  P.table = at::empty({P.chunks * 4}, at::TensorOptions().dtype(at::kLong));
  if (P.chunks > 0) {
    std::memcpy(P.table.data_ptr<int64_t>(), entries.data(), sizeof(ChunkEntry) * entries.size());
  }
  P.table = P.table.to(q.device());
  if (p.gate_per_channel) {
    P.G = at::empty({p.tokens(), HV, KP}, q.options().dtype(at::kFloat));
    P.Qg = at::empty({p.tokens(), HV, KP}, v.options());
    P.Kd = at::empty({p.tokens(), HV, KP}, v.options());
    P.P = at::empty({p.tokens(), HV, kChunk}, v.options());
    A.Qg = bits_of(P.Qg);
    A.Kd = bits_of(P.Kd);
    A.P = bits_of(P.P);
  } else {
    P.G = at::empty({p.tokens(), HV}, q.options().dtype(at::kFloat));
  }
  P.W = at::empty({p.tokens(), HV, KP}, v.options());
  if (with_U) P.U = at::empty({p.tokens(), HV, VP}, v.options());
  P.u = at::empty({p.tokens(), HV, VP}, v.options());
  P.hT = at::empty({gdn_checkpoint_slots(N, p.tokens(), kChunk), HV, VP, KP}, v.options());
  A.d = make_dims<float>(p, cu.device_ptr(), scale);
  A.KP = int(KP);
  A.VP = int(VP);
  A.chunks = reinterpret_cast<const ChunkEntry*>(P.table.data_ptr<int64_t>());
  A.num_chunks = P.chunks;
  A.q = bits_of(q);
  A.k = bits_of(k);
  A.v = bits_of(v);
  A.g = g.data_ptr<float>();
  A.beta = beta.data_ptr<float>();
  A.h0 = data_or_null<float>(h0);
  A.G = P.G.data_ptr<float>();
  A.W = bits_of(P.W);
  A.U = with_U ? bits_of(P.U) : nullptr;
  A.u = bits_of(P.u);
  A.hT = bits_of(P.hT);
  return P;
}

// 16-column state tiles when 32-column ones would leave SMs idle (the recurrences are serial):
// fewer 32-column blocks than SMs. (Two waves of 16-column blocks were slower than one of
// 32-column blocks at B=4 H=16 V=128: docs/cuda.md.)
inline bool narrow_state_tiles(int64_t num_seqs, int64_t HV, int64_t VP) {
  int dev = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return num_seqs * HV * (VP / 32) < int64_t(sms);
}

template <Bits16 kind, int MT, int NT>
void launch_state(const ChunkArgs& A, int64_t num_seqs, cudaStream_t stream) {
  const int64_t blocks = num_seqs * A.d.HV * (A.VP / (8 * NT));
  if (blocks == 0) return;
  const size_t smem = state_smem(64 * MT, 8 * NT);
  auto kernel = A.Kd != nullptr ? state_kernel<kind, MT, NT, true> : state_kernel<kind, MT, NT>;
  allow_shared_memory(kernel, smem);
  kernel<<<dim3(unsigned(blocks)), dim3(kChunkThreads), smem, stream>>>(A);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// (the per-channel gate's prep where A.Kd is set: plan_chunks sets it for that gate)
template <Bits16 kind>
void launch_prep(const ChunkArgs& A, cudaStream_t stream) {
  if (A.num_chunks == 0) return;
  const bool per_channel = A.Kd != nullptr;
  const size_t smem = per_channel ? kda_prep_smem(A.KP, A.VP) : prep_smem(A.KP, A.VP);
  auto kernel = per_channel ? kda_prep_kernel<kind> : prep_kernel<kind>;
  allow_shared_memory(kernel, smem);
  kernel<<<dim3(unsigned(A.num_chunks * A.d.HV)), dim3(kChunkThreads), smem, stream>>>(A);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// prep_kernel, then state_kernel (the serial loop over chunks).
template <Bits16 kind>
void launch_prep_and_state(const ChunkArgs& A, int64_t num_seqs, cudaStream_t stream) {
  launch_prep<kind>(A, stream);
  const bool narrow = narrow_state_tiles(num_seqs, A.d.HV, A.VP);
  switch (A.KP / 64) {
    case 1: narrow ? launch_state<kind, 1, 2>(A, num_seqs, stream) : launch_state<kind, 1, 4>(A, num_seqs, stream); break;
    case 2: narrow ? launch_state<kind, 2, 2>(A, num_seqs, stream) : launch_state<kind, 2, 4>(A, num_seqs, stream); break;
    case 3: narrow ? launch_state<kind, 3, 2>(A, num_seqs, stream) : launch_state<kind, 3, 4>(A, num_seqs, stream); break;
    default: narrow ? launch_state<kind, 4, 2>(A, num_seqs, stream) : launch_state<kind, 4, 4>(A, num_seqs, stream); break;
  }
}

}  // namespace rlx::gdn::cuda
#endif  // RLX_CUDA_EMULATION
