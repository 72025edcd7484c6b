// Runs the CUDA gated delta kernels (csrc/cuda/gated_delta_{forward,backward}.cu, device code
// only) on the CPU through cuda_shim.h, float32, with the host code's reductions of the
// backward's partial sums done here. tests/test_gated_delta_cuda_emulator.py drives it:
//   gdn_emu DIR B T H HV K V per_channel has_h0 chunk scale N cu_0 .. cu_N
// reads DIR/{q,k,v,g,beta,h0,do,dht}.bin (float32; h0 only with has_h0), writes
// DIR/{o,ht,vw,dq,dk,dv,dg,dbeta,dh0}.bin (float32; vw when kept: rlx::gdn_keeps_vw). RLX_EMU_DOUBLE=1 runs the float64 kernels.
#include "cuda_shim.h"

#define RLX_CUDA_EMULATION 1
#include "gated_delta_backward.cu"
#include "gated_delta_forward.cu"

#include <cstdio>
#include <cstdlib>
#include <string>

using namespace rlx::gdn::cuda;

template <typename R = float>
static std::vector<R> read(const std::string& path, size_t n) {
  std::vector<float> x(n);
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f || std::fread(x.data(), sizeof(float), n, f) != n) {
    std::fprintf(stderr, "cannot read %zu floats from %s\n", n, path.c_str());
    std::exit(2);
  }
  std::fclose(f);
  return std::vector<R>(x.begin(), x.end());
}

template <typename R>
static void write(const std::string& path, const std::vector<R>& x) {
  const std::vector<float> y(x.begin(), x.end());
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(y.data(), sizeof(float), y.size(), f);
  std::fclose(f);
}

template <bool PC, typename R>
static void run(const std::string& dir, Dims<R> d, int64_t B, int64_t N, bool has_h0) {
  const int64_t T = d.seq_len, tokens = d.tokens, H = d.H, HV = d.HV, K = d.K, V = d.V;
  const int64_t G = d.group, nvt = d.nvt;
  const size_t qk = size_t(tokens * H * K), vv = size_t(tokens * HV * V);
  const size_t gn = size_t(tokens * HV * (PC ? K : 1)), bn = size_t(tokens * HV);
  const size_t sn = size_t(N * HV * K * V);
  auto q = read<R>(dir + "/q.bin", qk), k = read<R>(dir + "/k.bin", qk), v = read<R>(dir + "/v.bin", vv);
  auto g = read<R>(dir + "/g.bin", gn), beta = read<R>(dir + "/beta.bin", bn);
  auto dout = read<R>(dir + "/do.bin", vv), dht = read<R>(dir + "/dht.bin", sn);
  std::vector<R> h0 = has_h0 ? read<R>(dir + "/h0.bin", sn) : std::vector<R>();
  const int64_t slots = rlx::gdn_checkpoint_slots(N, tokens, d.chunk);
  std::vector<R> o(vv, R(NAN)), ht(sn, R(NAN)), ckpt(size_t(slots * HV * K * V), R(0));
  const int warps = num_warps(d.K), Kp = warps * kRows;
  const int64_t blocks = N * HV * nvt;
  const size_t smem = Stage<R, PC>::elements(Kp, warps) * sizeof(R);
  FwdArgs<R, R, R> F{d, q.data(), k.data(), v.data(), g.data(), beta.data(),
                                 has_h0 ? h0.data() : nullptr, o.data(), ht.data(),
                                 ckpt.data()};
  const bool keeps_vw = rlx::gdn_keeps_vw(d.chunk, PC);
  std::vector<R> vw(keeps_vw ? vv : 0, R(NAN));
  F.vw = keeps_vw ? vw.data() : nullptr;
  emu::launch(unsigned(blocks), unsigned(warps * 32), smem,
              [&] { forward_kernel<R, R, R, PC>(F); });
  write(dir + "/o.bin", o);
  write(dir + "/ht.bin", ht);
  if (keeps_vw) write(dir + "/vw.bin", vw);
  if (d.chunk == 0) return;
  int64_t longest = 0;
  for (int64_t n = 0; n < N; ++n) {
    longest = std::max(longest, d.cu ? d.cu[n + 1] - d.cu[n] : T);
  }
  const int64_t sub_slots = ceil_div(std::min<int64_t>(d.chunk, std::max<int64_t>(longest, 1)), sub_len<R>());
  const size_t part = size_t(nvt * tokens * HV * K);
  std::vector<R> dq_p(part, R(NAN)), dk_p(part, R(NAN)), dg_p(part, R(NAN));
  std::vector<R> db_p(size_t(nvt * tokens * HV), R(NAN)), dv(vv, R(NAN)), dh0(sn, R(NAN));
  std::vector<R> scratch(size_t(blocks * sub_slots * Kp * 32), R(NAN));
  BwdArgs<R, R, R> A{d, q.data(), k.data(), v.data(), dout.data(), g.data(),
                                 beta.data(), ckpt.data(), dht.data(), dq_p.data(), dk_p.data(),
                                 dg_p.data(), db_p.data(), dv.data(),
                                 has_h0 ? dh0.data() : nullptr, scratch.data(), sub_slots};
  emu::launch(unsigned(blocks), unsigned(warps * 32), smem,
              [&] { backward_kernel<R, R, R, PC>(A); });
  std::vector<R> dq(qk, R(0)), dk(qk, R(0)), dg(gn, R(0)), db(bn, R(0));
  for (int64_t t = 0; t < nvt; ++t) {
    for (int64_t tok = 0; tok < tokens; ++tok) {
      for (int64_t hv = 0; hv < HV; ++hv) {
        const int64_t h = hv / G;
        db[size_t(tok * HV + hv)] += db_p[size_t((t * tokens + tok) * HV + hv)];
        for (int64_t r = 0; r < K; ++r) {
          const size_t at = size_t(((t * tokens + tok) * HV + hv) * K + r);
          dq[size_t((tok * H + h) * K + r)] += dq_p[at];
          dk[size_t((tok * H + h) * K + r)] += dk_p[at];
          dg[size_t(PC ? (tok * HV + hv) * K + r : tok * HV + hv)] += dg_p[at];
        }
      }
    }
  }
  write(dir + "/dq.bin", dq);
  write(dir + "/dk.bin", dk);
  write(dir + "/dv.bin", dv);
  write(dir + "/dg.bin", dg);
  write(dir + "/dbeta.bin", db);
  if (has_h0) write(dir + "/dh0.bin", dh0);
}

int main(int argc, char** argv) {
  if (argc < 13) return 2;
  const std::string dir = argv[1];
  const int64_t B = std::atoll(argv[2]), T = std::atoll(argv[3]);
  Dims<float> d;
  d.seq_len = T;
  d.tokens = B * T;
  d.H = std::atoi(argv[4]);
  d.HV = std::atoi(argv[5]);
  d.K = std::atoi(argv[6]);
  d.V = std::atoi(argv[7]);
  const bool pc = std::atoi(argv[8]) != 0, has_h0 = std::atoi(argv[9]) != 0;
  d.chunk = std::atoll(argv[10]);
  d.scale = float(std::atof(argv[11]));
  d.group = d.HV / d.H;
  d.nvt = int(ceil_div(d.V, kCols));
  const int64_t ncu = std::atoll(argv[12]);
  std::vector<int64_t> cu;
  for (int64_t i = 0; i < ncu; ++i) cu.push_back(std::atoll(argv[13 + i]));
  d.cu = ncu > 0 ? cu.data() : nullptr;
  const int64_t N = ncu > 0 ? ncu - 1 : B;
  if (std::getenv("RLX_EMU_DOUBLE") != nullptr) {  // float64: the 2-token sub-chunks
    Dims<double> dd;
    dd.seq_len = d.seq_len, dd.tokens = d.tokens, dd.H = d.H, dd.HV = d.HV, dd.K = d.K;
    dd.V = d.V, dd.group = d.group, dd.nvt = d.nvt, dd.chunk = d.chunk, dd.cu = d.cu;
    dd.scale = d.scale;
    pc ? run<true>(dir, dd, B, N, has_h0) : run<false>(dir, dd, B, N, has_h0);
  } else {
    pc ? run<true>(dir, d, B, N, has_h0) : run<false>(dir, d, B, N, has_h0);
  }
  return 0;
}
