// Runs the lookup-table codebook forward (csrc/cuda/codebook_lut.cuh: the partial-sum kernel,
// then the reduction) on the CPU through cuda_shim.h. tests/test_codebook_cuda_emulator.py
// drives it:
//   codebook_lut_emu DIR kind B N G M E has_scales has_bias wide_codes rpt sms
// kind 0: float16, 1: bfloat16, 2: float32. Reads DIR/{x,cb,scales,bias}.bin (16-bit patterns
// or float32) and DIR/idx.bin (uint8 [N][G][M]); writes DIR/out.bin ([B][N], x's type).
#include "cuda_shim.h"

#define RLX_CUDA_EMULATION 1
#include "codebook_lut.cuh"

#include "emu_io.h"

#include <cstdio>
#include <cstdlib>
#include <string>

using namespace rlx::codebook::cuda;

template <LutIn kind, int M, int BT, int SB>
static void run(const std::string& dir, int64_t B, int64_t N, int64_t G, int E, bool scales,
                bool bias, bool wide, const LutShape& shape) {
  using T = lut_elem_t<kind>;
  auto x = emu::read<T>(dir + "/x.bin", size_t(B * G * 8));
  auto idx = emu::read<uint8_t>(dir + "/idx.bin", size_t(N * G * M));
  auto cb = emu::read<T>(dir + "/cb.bin", size_t(M * E * 8));
  std::vector<T> s = scales ? emu::read<T>(dir + "/scales.bin", size_t(N)) : std::vector<T>();
  std::vector<T> b = bias ? emu::read<T>(dir + "/bias.bin", size_t(N)) : std::vector<T>();
  // NaN where nothing is written
  std::vector<float> partial(size_t(shape.slices * B * N), std::nanf(""));
  std::vector<T> out(size_t(B * N), lut_from_float<kind>(std::nanf("")));
  emu::launch(unsigned(shape.slices * shape.chunks), kLutThreads, lut_partial_smem(M, E, BT, SB),
              [&] {
                lut_partial_kernel<kind, M, BT, SB>(x.data(), idx.data(), cb.data(),
                                                    partial.data(), B, N, G, E, shape.rpt,
                                                    shape.chunks, wide);
              });
  emu::launch(unsigned((B * N + kLutThreads - 1) / kLutThreads), kLutThreads, 0, [&] {
    lut_reduce_kernel<kind>(partial.data(), scales ? s.data() : nullptr,
                            bias ? b.data() : nullptr, out.data(), B, N, shape.slices);
  });
  FILE* f = std::fopen((dir + "/out.bin").c_str(), "wb");
  std::fwrite(out.data(), sizeof(T), out.size(), f);
  std::fclose(f);
}

// The instantiations codebook_forward.cu launches: (BT, SB) = (1, 32), (2, 32), (4, 16).
template <LutIn kind, int M>
static void with_rows(const std::string& dir, int64_t B, int64_t N, int64_t G, int E, bool s,
                      bool b, bool wide, const LutShape& shape) {
  if (shape.bt == 1) {
    run<kind, M, 1, 32>(dir, B, N, G, E, s, b, wide, shape);
  } else if (shape.bt == 2) {
    run<kind, M, 2, 32>(dir, B, N, G, E, s, b, wide, shape);
  } else {
    run<kind, M, 4, 16>(dir, B, N, G, E, s, b, wide, shape);
  }
}

template <LutIn kind>
static void dispatch(const std::string& dir, int64_t B, int64_t N, int64_t G, int M, int E,
                     bool s, bool b, bool wide, const LutShape& shape) {
  M == 1 ? with_rows<kind, 1>(dir, B, N, G, E, s, b, wide, shape)
         : with_rows<kind, 2>(dir, B, N, G, E, s, b, wide, shape);
}

int main(int argc, char** argv) {
  if (argc != 13) {
    std::fprintf(stderr, "usage: %s DIR kind B N G M E has_scales has_bias wide rpt sms\n",
                 argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const int kind = std::atoi(argv[2]);
  const int64_t B = std::atoll(argv[3]), N = std::atoll(argv[4]), G = std::atoll(argv[5]);
  const int M = std::atoi(argv[6]), E = std::atoi(argv[7]);
  const bool s = std::atoi(argv[8]), b = std::atoi(argv[9]), wide = std::atoi(argv[10]);
  const int rpt = std::atoi(argv[11]), sms = std::atoi(argv[12]);
  if (B < 1 || B > kLutMaxRows || (M != 1 && M != 2)) {
    std::fprintf(stderr, "unsupported B = %lld or M = %d\n", static_cast<long long>(B), M);
    return 2;
  }
  const LutShape shape = lut_shape(B, N, G, M, sms, rpt);
  const bool wide_codes = wide && (G * M) % 16 == 0;
  if (kind == 0) {
    dispatch<LutIn::kHalf>(dir, B, N, G, M, E, s, b, wide_codes, shape);
  } else if (kind == 1) {
    dispatch<LutIn::kBFloat16>(dir, B, N, G, M, E, s, b, wide_codes, shape);
  } else {
    dispatch<LutIn::kFloat>(dir, B, N, G, M, E, s, b, wide_codes, shape);
  }
  return 0;
}
