// Runs the chunked CUDA gated delta forward (csrc/cuda/gated_delta_chunk.cuh: prep, state and
// output kernels, device code only) on the CPU through cuda_shim.h, bf16 products, float32
// inputs and outputs. tests/test_gated_delta_cuda_emulator.py drives it:
//   gdn_chunk_emu DIR B T H HV K V has_h0 chunk scale N cu_0 .. cu_N
// reads DIR/{q,k,v,g,beta,h0}.bin (float32; h0 only with has_h0; g one per head, or one per
// key channel with RLX_EMU_PER_CHANNEL: then the prep is gated_delta_chunk_kda.cuh's and the
// state and output kernels take their per-channel variants), writes DIR/{o,ht,ckpt,vw}.bin
// (vw when kept: rlx::gdn_keeps_vw).
#include "cuda_shim.h"

#define RLX_CUDA_EMULATION 1
#include "gated_delta_chunk.cuh"
#include "gated_delta_chunk_kda.cuh"
#include "gated_delta_chunk_state.cuh"
#include "emu_io.h"

#include <cstdio>
#include <cstdlib>
#include <string>

using namespace rlx::gdn::cuda;

using emu::read;
using emu::to_bf16;
using emu::write;

template <int MT, int NT>
static void run_state(const ChunkArgs& A, int64_t N) {
  const int64_t blocks = N * A.d.HV * (A.VP / (8 * NT));
  emu::launch(unsigned(blocks), kChunkThreads, state_smem(64 * MT, 8 * NT), [&] {
    if (A.Kd != nullptr) {
      state_kernel<Bits16::kBFloat16, MT, NT, true>(A);
    } else {
      state_kernel<Bits16::kBFloat16, MT, NT>(A);
    }
  });
}

int main(int argc, char** argv) {
  if (argc < 12) return 2;
  const std::string dir = argv[1];
  const int64_t B = std::atoll(argv[2]), T = std::atoll(argv[3]);
  Dims<float> d;
  d.seq_len = T;
  d.tokens = B * T;
  d.H = std::atoi(argv[4]);
  d.HV = std::atoi(argv[5]);
  d.K = std::atoi(argv[6]);
  d.V = std::atoi(argv[7]);
  const bool has_h0 = std::atoi(argv[8]) != 0;
  d.chunk = std::atoll(argv[9]);
  d.scale = float(std::atof(argv[10]));
  d.group = d.HV / d.H;
  const int64_t ncu = std::atoll(argv[11]);
  std::vector<int64_t> cu;
  for (int64_t i = 0; i < ncu; ++i) cu.push_back(std::atoll(argv[12 + i]));
  d.cu = ncu > 0 ? cu.data() : nullptr;
  const int64_t N = ncu > 0 ? ncu - 1 : B;
  const int64_t tokens = d.tokens, H = d.H, HV = d.HV, K = d.K, V = d.V;
  const size_t qk = size_t(tokens * H * K), vv = size_t(tokens * HV * V);
  const size_t sn = size_t(N * HV * K * V);
  auto q = read(dir + "/q.bin", qk), k = read(dir + "/k.bin", qk), v = read(dir + "/v.bin", vv);
  const bool per_channel = std::getenv("RLX_EMU_PER_CHANNEL") != nullptr;
  auto g = read(dir + "/g.bin", size_t(tokens * HV * (per_channel ? K : 1)));
  auto beta = read(dir + "/beta.bin", size_t(tokens * HV));
  std::vector<float> h0 = has_h0 ? read(dir + "/h0.bin", sn) : std::vector<float>();
  std::vector<ChunkEntry> chunks;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t bos = d.cu ? d.cu[n] : n * T, eos = d.cu ? d.cu[n + 1] : bos + T;
    for (int64_t j = 0; bos + j * kChunk < eos; ++j) {
      chunks.push_back({bos + j * kChunk, std::min<int64_t>(kChunk, eos - bos - j * kChunk), n,
                        checkpoint_base(n, bos, kChunk) + j});
    }
  }
  const int64_t slots = rlx::gdn_checkpoint_slots(N, tokens, d.chunk);
  const int64_t slots64 = rlx::gdn_checkpoint_slots(N, tokens, kChunk);
  const bool keeps_vw = rlx::gdn_keeps_vw(d.chunk, per_channel);
  std::vector<float> o(vv, NAN), ht(sn, NAN), ckpt(size_t(slots * HV * K * V), 0.f);
  const int64_t KP = ceil_div(K, 64) * 64, VP = ceil_div(V, 64) * 64;
  std::vector<float> vw(keeps_vw ? vv : 0, NAN), G(size_t(tokens * HV * (per_channel ? KP : 1)), NAN);
  // intermediates start as bf16 NaN: a read of what no kernel wrote shows in the results
  std::vector<uint16_t> W(size_t(tokens * HV * KP), 0x7fc0), U(size_t(tokens * HV * VP), 0x7fc0);
  std::vector<uint16_t> u(size_t(tokens * HV * VP), 0x7fc0), ob(vv, 0x7fc0);
  std::vector<uint16_t> hT(size_t(slots64 * HV * VP * KP), 0x7fc0);
  std::vector<uint16_t> Qg(per_channel ? W.size() : 0, 0x7fc0), Kd(Qg.size(), 0x7fc0);
  std::vector<uint16_t> P(per_channel ? size_t(tokens * HV * kChunk) : 0, 0x7fc0);
  const std::vector<uint16_t> qb = to_bf16(q), kb = to_bf16(k), vb = to_bf16(v);
  ChunkArgs A;
  A.d = d;
  A.KP = int(KP);
  A.VP = int(VP);
  A.chunks = chunks.data();
  A.num_chunks = int64_t(chunks.size());
  A.q = qb.data(), A.k = kb.data(), A.v = vb.data(), A.g = g.data(), A.beta = beta.data();
  A.h0 = has_h0 ? h0.data() : nullptr;
  A.G = G.data(), A.W = W.data(), A.U = U.data(), A.u = u.data(), A.hT = hT.data();
  A.vw = keeps_vw ? vw.data() : nullptr;
  if (per_channel) A.Qg = Qg.data(), A.Kd = Kd.data(), A.P = P.data();
  A.ht = ht.data(), A.ckpt = slots > 0 ? ckpt.data() : nullptr, A.out = ob.data();
  const unsigned nch = unsigned(chunks.size());
  if (per_channel) {
    if (A.KP > 128) {
      std::fprintf(stderr, "a per-channel gate takes K <= 128\n");
      return 2;
    }
    emu::launch(nch * unsigned(HV), kChunkThreads, kda_prep_smem(A.KP, A.VP),
                [&] { kda_prep_kernel<Bits16::kBFloat16>(A); });
  } else {
    emu::launch(nch * unsigned(HV), kChunkThreads, prep_smem(A.KP, A.VP),
                [&] { prep_kernel<Bits16::kBFloat16>(A); });
  }
  const bool narrow = std::getenv("RLX_EMU_NARROW") != nullptr;  // 16-column state tiles
  switch (A.KP / 64) {
    case 1: narrow ? run_state<1, 2>(A, N) : run_state<1, 4>(A, N); break;
    case 2: narrow ? run_state<2, 2>(A, N) : run_state<2, 4>(A, N); break;
    default: std::fprintf(stderr, "K > 128 is not emulated\n"); return 2;
  }
  emu::launch(nch * unsigned(HV * (VP / kOutCols)), kChunkThreads, output_smem(A.KP), [&] {
    if (per_channel) {
      output_kernel<Bits16::kBFloat16, true>(A);
    } else {
      output_kernel<Bits16::kBFloat16>(A);
    }
  });
  for (size_t i = 0; i < vv; ++i) o[i] = emu::bf16_to_float(ob[i]);
  write(dir + "/o.bin", o);
  write(dir + "/ht.bin", ht);
  write(dir + "/ckpt.bin", ckpt);
  if (keeps_vw) write(dir + "/vw.bin", vw);
  return 0;
}
