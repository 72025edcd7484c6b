// Runs the chunked CUDA gated delta backward (csrc/cuda/gated_delta_chunk_bwd.cuh and
// _grads.cuh; device code only) on the CPU through cuda_shim.h, bf16 products, float32 inputs
// and outputs, in the host code's launch order (gated_delta_backward.cu): first the forward's
// prep and state kernels for its 64-token checkpoints and vw, then the backward: prep again
// (without U'), S0 and u from those checkpoints and vw (from_forward_kernel), dv_local, dh,
// dqk, wy. RLX_EMU_RERUN_STATE: S0 and u from a re-run of the state kernel instead (the path
// of sparser checkpoints). tests/test_gated_delta_cuda_emulator.py drives it:
//   gdn_chunk_bwd_emu DIR B T H HV K V has_h0 has_dht scale N cu_0 .. cu_N
// reads DIR/{q,k,v,g,beta,do,h0,dht}.bin (float32; h0, dht only when given), writes
// DIR/{dq,dk,dv,dg,dbeta,dh0}.bin (dh0 with has_h0). RLX_EMU_NARROW: 16-column dh tiles.
// RLX_EMU_L2NORM_EPS=eps (H = HV): q and k are raw rows, L2-normalized here as the host code's
// l2norm kernel does (float32, written in bf16) for every kernel, and wy_kernel<.., true>
// applies the l2norm backward: dq and dk are the raw rows' gradients.
// RLX_EMU_PER_CHANNEL: g is [tokens, HV, K] (KDA) and dg too; the backward re-runs the
// per-channel prep (gated_delta_chunk_kda.cuh) and state kernel (the forward keeps no vw),
// then the per-channel dv_local, dh and dqk and kda_wy_kernel (gated_delta_chunk_kda_bwd.cuh).
#include "cuda_shim.h"

#define RLX_CUDA_EMULATION 1
#include "gated_delta_chunk_bwd_grads.cuh"
#include "gated_delta_chunk_kda.cuh"
#include "gated_delta_chunk_kda_bwd.cuh"
#include "emu_io.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

using namespace rlx::gdn::cuda;
constexpr Bits16 kBf = Bits16::kBFloat16;

// (the per-channel variants where A.Kd is set)
template <int MT, int NT>
static void run_state(ChunkArgs& A, int64_t N) {
  const int64_t blocks = N * A.d.HV * (A.VP / (8 * NT));
  emu::launch(unsigned(blocks), kChunkThreads, state_smem(64 * MT, 8 * NT), [&] {
    if (A.Kd != nullptr) {
      state_kernel<kBf, MT, NT, true>(A);
    } else {
      state_kernel<kBf, MT, NT>(A);
    }
  });
}

static void run_prep(ChunkArgs& A) {
  if (A.Kd != nullptr) {
    emu::launch(unsigned(A.num_chunks * A.d.HV), kChunkThreads, kda_prep_smem(A.KP, A.VP),
                [&] { kda_prep_kernel<kBf>(A); });
  } else {
    emu::launch(unsigned(A.num_chunks * A.d.HV), kChunkThreads, prep_smem(A.KP, A.VP),
                [&] { prep_kernel<kBf>(A); });
  }
}

template <int MT, int NT>
static void run_dh(ChunkBwdArgs& B, int64_t N) {
  const int64_t blocks = N * B.f.d.HV * (B.f.VP / (8 * NT));
  const unsigned chunks = unsigned(B.f.num_chunks), HV = unsigned(B.f.d.HV);
  const bool pc = B.f.Kd != nullptr;
  emu::launch(chunks * HV * unsigned(B.f.VP / kBwdTile), kChunkThreads, dv_local_smem(B.f.KP),
              [&] { pc ? dv_local_kernel<kBf, true>(B) : dv_local_kernel<kBf>(B); });
  B.dbeta_tiles = B.f.VP / (8 * NT);
  emu::launch(unsigned(blocks), kChunkThreads, dh_smem(64 * MT, 8 * NT),
              [&] { pc ? dh_kernel<kBf, MT, NT, true>(B) : dh_kernel<kBf, MT, NT>(B); });
}

int main(int argc, char** argv) {
  if (argc < 12) return 2;
  const std::string dir = argv[1];
  const int64_t Bn = std::atoll(argv[2]), T = std::atoll(argv[3]);
  Dims<float> d;
  d.seq_len = T;
  d.tokens = Bn * T;
  d.H = std::atoi(argv[4]);
  d.HV = std::atoi(argv[5]);
  d.K = std::atoi(argv[6]);
  d.V = std::atoi(argv[7]);
  const bool has_h0 = std::atoi(argv[8]) != 0, has_dht = std::atoi(argv[9]) != 0;
  d.chunk = kChunk;
  d.scale = float(std::atof(argv[10]));
  d.group = d.HV / d.H;
  const int64_t ncu = std::atoll(argv[11]);
  std::vector<int64_t> cu;
  for (int64_t i = 0; i < ncu; ++i) cu.push_back(std::atoll(argv[12 + i]));
  d.cu = ncu > 0 ? cu.data() : nullptr;
  const int64_t N = ncu > 0 ? ncu - 1 : Bn;
  const int64_t tokens = d.tokens, H = d.H, HV = d.HV, K = d.K, V = d.V;
  const size_t qk = size_t(tokens * H * K), vv = size_t(tokens * HV * V);
  const size_t sn = size_t(N * HV * K * V), th = size_t(tokens * HV);
  auto q = emu::read(dir + "/q.bin", qk), k = emu::read(dir + "/k.bin", qk);
  auto v = emu::read(dir + "/v.bin", vv), dout = emu::read(dir + "/do.bin", vv);
  const bool per_channel = std::getenv("RLX_EMU_PER_CHANNEL") != nullptr;
  const size_t gn = th * size_t(per_channel ? K : 1);
  auto g = emu::read(dir + "/g.bin", gn), beta = emu::read(dir + "/beta.bin", th);
  std::vector<float> h0 = has_h0 ? emu::read(dir + "/h0.bin", sn) : std::vector<float>();
  std::vector<float> dht = has_dht ? emu::read(dir + "/dht.bin", sn) : std::vector<float>();
  std::vector<ChunkEntry> chunks;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t bos = d.cu ? d.cu[n] : n * T, eos = d.cu ? d.cu[n + 1] : bos + T;
    for (int64_t j = 0; bos + j * kChunk < eos; ++j) {
      chunks.push_back({bos + j * kChunk, std::min<int64_t>(kChunk, eos - bos - j * kChunk), n,
                        checkpoint_base(n, bos, kChunk) + j});
    }
  }
  const int64_t slots64 = rlx::gdn_checkpoint_slots(N, tokens, kChunk);
  const int64_t KP = ceil_div(K, 64) * 64, VP = ceil_div(V, 64) * 64;
  // what no kernel writes stays NaN (bf16 0x7fc0), so a read of it shows in the results
  const uint16_t nan16 = 0x7fc0;
  std::vector<float> G(th * size_t(per_channel ? KP : 1), NAN), vw(vv, NAN);
  std::vector<float> duL(size_t(tokens * HV * VP), NAN), L(per_channel ? th * kChunk : 0, NAN);
  std::vector<uint16_t> Qg(per_channel ? th * size_t(KP) : 0, nan16), Kd(Qg.size(), nan16);
  std::vector<uint16_t> P(per_channel ? th * kChunk : 0, nan16);
  std::vector<uint16_t> W(size_t(tokens * HV * KP), nan16), U(size_t(tokens * HV * VP), nan16);
  std::vector<uint16_t> u(U.size(), nan16), dvw(U.size(), nan16), dW(W.size(), nan16);
  std::vector<uint16_t> Tinv(size_t(tokens * HV * kChunk), nan16);
  std::vector<uint16_t> hT(size_t(slots64 * HV * VP * KP), nan16), dS(hT.size(), nan16);
  std::vector<float> dbeta_part(size_t(VP / 16) * th, NAN);
  std::vector<float> dg_part((per_channel ? size_t(KP) : size_t(KP / 64)) * th, NAN);
  std::vector<float> dq_hv(size_t(tokens * HV * K), NAN), dk_hv(dq_hv.size(), NAN);
  std::vector<float> dv(vv, NAN), dg(gn, NAN), dbeta(th, NAN), dh0(has_h0 ? sn : 0, NAN);
  const char* l2_env = std::getenv("RLX_EMU_L2NORM_EPS");
  const bool l2norm = l2_env != nullptr;
  const float l2_eps = l2norm ? float(std::atof(l2_env)) : 0.f;
  if (l2norm && (H != HV || per_channel)) {
    std::fprintf(stderr, "the fused l2norm backward takes H = HV and one gate per head\n");
    return 2;
  }
  const std::vector<uint16_t> q_raw = emu::to_bf16(q), k_raw = emu::to_bf16(k);
  std::vector<float> q_rstd(size_t(tokens * H)), k_rstd(q_rstd.size());
  auto normalized = [&](const std::vector<uint16_t>& x, std::vector<float>& rstd) {
    std::vector<uint16_t> y(x);
    for (size_t row = 0; l2norm && row < x.size() / size_t(K); ++row) {
      const uint16_t* xr = x.data() + row * size_t(K);
      float s = 0.f;
      for (int64_t c = 0; c < K; ++c) s += bits_to_float<kBf>(xr[c]) * bits_to_float<kBf>(xr[c]);
      const float r = rstd[row] = 1.f / std::sqrt(s + l2_eps);
      for (int64_t c = 0; c < K; ++c) {
        y[row * size_t(K) + c] = emu::float_to_bf16(bits_to_float<kBf>(xr[c]) * r);
      }
    }
    return y;
  };
  const std::vector<uint16_t> qb = normalized(q_raw, q_rstd), kb = normalized(k_raw, k_rstd);
  const std::vector<uint16_t> vb = emu::to_bf16(v);
  const std::vector<uint16_t> dob = emu::to_bf16(dout);
  ChunkBwdArgs B;
  ChunkArgs& A = B.f;
  A.d = d;
  A.KP = int(KP);
  A.VP = int(VP);
  A.chunks = chunks.data();
  A.num_chunks = int64_t(chunks.size());
  A.q = qb.data(), A.k = kb.data(), A.v = vb.data(), A.g = g.data(), A.beta = beta.data();
  A.h0 = has_h0 ? h0.data() : nullptr;
  A.G = G.data(), A.W = W.data(), A.U = U.data(), A.u = u.data(), A.hT = hT.data();
  if (per_channel) A.Qg = Qg.data(), A.Kd = Kd.data(), A.P = P.data();
  std::vector<float> ckpt(size_t(slots64 * HV * K * V), NAN);
  const bool narrow = std::getenv("RLX_EMU_NARROW") != nullptr;
  const bool rerun_state = std::getenv("RLX_EMU_RERUN_STATE") != nullptr;
  if (A.KP > 128) {
    std::fprintf(stderr, "K > 128 is not emulated\n");
    return 2;
  }
  auto state = [&] {
    if (A.KP == 64) {
      narrow ? run_state<1, 2>(A, N) : run_state<1, 4>(A, N);
    } else {
      narrow ? run_state<2, 2>(A, N) : run_state<2, 4>(A, N);
    }
  };
  // the forward: its checkpoints every 64 tokens and vw (per channel: none kept)
  if (!per_channel) {
    A.ckpt = ckpt.data(), A.vw = vw.data();
    run_prep(A);
    state();
    A.ckpt = nullptr, A.vw = nullptr;
  }
  // the backward: what its kernels write starts as NaN again
  for (auto* buf : {&W, &U, &u, &hT, &Tinv}) std::fill(buf->begin(), buf->end(), nan16);
  std::fill(G.begin(), G.end(), NAN);
  A.Tinv = Tinv.data();
  if (per_channel) A.L = L.data();
  B.dout = dob.data();
  B.dht = has_dht ? dht.data() : nullptr;
  B.vw = vw.data();
  B.duL = duL.data(), B.dvw = dvw.data(), B.dS = dS.data(), B.dW = dW.data();
  B.dbeta_part = dbeta_part.data(), B.dg_part = dg_part.data();
  B.dq = dq_hv.data(), B.dk = dk_hv.data();
  B.dv = dv.data(), B.dg = dg.data(), B.dbeta = dbeta.data();
  B.dh0 = has_h0 ? dh0.data() : nullptr;
  const unsigned nch = unsigned(chunks.size());
  if (per_channel) {  // (vw from the re-run, for dh_kernel)
    std::fill(vw.begin(), vw.end(), NAN);
    A.vw = vw.data();
    run_prep(A);
    state();
    A.vw = nullptr;
  } else if (rerun_state) {
    run_prep(A);
    state();
  } else {
    A.U = nullptr;
    run_prep(A);
    B.ckpt = ckpt.data();
    emu::launch(nch * unsigned(HV), kChunkThreads, from_forward_smem(),
                [&] { from_forward_kernel<kBf>(B); });
  }
  if (A.KP == 64) {
    narrow ? run_dh<1, 2>(B, N) : run_dh<1, 4>(B, N);
  } else {
    narrow ? run_dh<2, 2>(B, N) : run_dh<2, 4>(B, N);
  }
  emu::launch(nch * unsigned(HV * (KP / kBwdTile)), kChunkThreads, dqk_smem(),
              [&] { per_channel ? dqk_kernel<kBf, true>(B) : dqk_kernel<kBf>(B); });
  if (per_channel) {
    emu::launch(nch * unsigned(HV), kChunkThreads, kda_wy_smem(A.KP),
                [&] { kda_wy_kernel<kBf>(B); });
  } else if (l2norm) {
    B.q_raw = q_raw.data(), B.k_raw = k_raw.data();
    B.q_rstd = q_rstd.data(), B.k_rstd = k_rstd.data();
    emu::launch(nch * unsigned(HV), kChunkThreads, wy_smem(), [&] { wy_kernel<kBf, true>(B); });
  } else {
    emu::launch(nch * unsigned(HV), kChunkThreads, wy_smem(), [&] { wy_kernel<kBf>(B); });
  }
  // a GVA group's value heads, in order (the host code's at::sum)
  std::vector<float> dq(qk, 0.f), dk(qk, 0.f);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t hv = 0; hv < HV; ++hv)
      for (int64_t c = 0; c < K; ++c) {
        const size_t to = size_t((t * H + hv / d.group) * K + c), from = size_t((t * HV + hv) * K + c);
        dq[to] += dq_hv[from];
        dk[to] += dk_hv[from];
      }
  emu::write(dir + "/dq.bin", dq);
  emu::write(dir + "/dk.bin", dk);
  emu::write(dir + "/dv.bin", dv);
  emu::write(dir + "/dg.bin", dg);
  emu::write(dir + "/dbeta.bin", dbeta);
  if (has_h0) emu::write(dir + "/dh0.bin", dh0);
  return 0;
}
