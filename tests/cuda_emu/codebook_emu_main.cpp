// Runs the tensor-core codebook forward (csrc/cuda/codebook_mma.cuh) on the CPU through
// cuda_shim.h. tests/test_codebook_cuda_emulator.py drives it:
//   codebook_emu DIR kind B N G M E has_scales has_bias fast_codes row_tiles warps
// kind 0: float16, 1: bfloat16. Reads DIR/{x,cb,scales,bias}.bin (16-bit patterns) and
// DIR/idx.bin (uint8 [N][G][M]); writes DIR/out.bin (16-bit patterns, [B][N]).
#include "cuda_shim.h"

#define RLX_CUDA_EMULATION 1
#include "codebook_mma.cuh"

#include "emu_io.h"

#include <cstdio>
#include <cstdlib>
#include <string>

using namespace rlx::codebook::cuda;

template <Bits16 kind, int NT, int M, int RT, int WARPS>
static void run(const std::string& dir, int64_t B, int64_t N, int64_t G, int E, bool scales,
                bool bias, bool fast) {
  auto x = emu::read<uint16_t>(dir + "/x.bin", size_t(B * G * 8));
  auto idx = emu::read<uint8_t>(dir + "/idx.bin", size_t(N * G * M));
  auto cb = emu::read<uint16_t>(dir + "/cb.bin", size_t(M * E * 8));
  std::vector<uint16_t> s = scales ? emu::read<uint16_t>(dir + "/scales.bin", size_t(N))
                                   : std::vector<uint16_t>();
  std::vector<uint16_t> b = bias ? emu::read<uint16_t>(dir + "/bias.bin", size_t(N))
                                 : std::vector<uint16_t>();
  std::vector<uint16_t> out(size_t(B * N), uint16_t(0x7e00));  // NaN where nothing is written
  const unsigned blocks = unsigned((N + kMmaTileRows * RT - 1) / (kMmaTileRows * RT));
  emu::launch(blocks, WARPS * 32, mma_forward_smem(M, E, NT, RT, WARPS, G), [&] {
    mma_forward_kernel<kind, NT, M, RT, WARPS>(x.data(), idx.data(), cb.data(),
                                               scales ? s.data() : nullptr,
                                               bias ? b.data() : nullptr, out.data(), B, N, G,
                                               E, fast && mma_async_codes(G, M, idx.data()),
                                               true);
  });
  FILE* f = std::fopen((dir + "/out.bin").c_str(), "wb");
  std::fwrite(out.data(), 2, out.size(), f);
  std::fclose(f);
}

// The launch shapes codebook_forward.cu uses, (row tiles, warps) = (2, 16), (4, 16) and (4, 8),
// and (1, 4), whose few warps take several rounds of windows.
template <Bits16 kind, int NT, int M>
static void with_shape(const std::string& dir, int64_t B, int64_t N, int64_t G, int E, bool s,
                       bool b, bool fast, int rt, int warps) {
  if (rt == 2 && warps == 16) {
    run<kind, NT, M, 2, 16>(dir, B, N, G, E, s, b, fast);
  } else if (rt == 4 && warps == 16) {
    run<kind, NT, M, 4, 16>(dir, B, N, G, E, s, b, fast);
  } else if (rt == 4 && warps == 8) {
    run<kind, NT, M, 4, 8>(dir, B, N, G, E, s, b, fast);
  } else if (rt == 1 && warps == 4) {
    run<kind, NT, M, 1, 4>(dir, B, N, G, E, s, b, fast);
  } else {
    std::fprintf(stderr, "unsupported launch shape %d x %d\n", rt, warps);
    std::exit(2);
  }
}

template <Bits16 kind>
static void dispatch(const std::string& dir, int64_t B, int64_t N, int64_t G, int M, int E,
                     bool s, bool b, bool fast, int rt, int warps) {
  if (B <= 8) {
    M == 1 ? with_shape<kind, 1, 1>(dir, B, N, G, E, s, b, fast, rt, warps)
           : with_shape<kind, 1, 2>(dir, B, N, G, E, s, b, fast, rt, warps);
  } else {
    M == 1 ? with_shape<kind, 2, 1>(dir, B, N, G, E, s, b, fast, rt, warps)
           : with_shape<kind, 2, 2>(dir, B, N, G, E, s, b, fast, rt, warps);
  }
}

int main(int argc, char** argv) {
  if (argc != 13) {
    std::fprintf(stderr, "usage: %s DIR kind B N G M E has_scales has_bias fast_codes rt warps\n",
                 argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const int kind = std::atoi(argv[2]);
  const int64_t B = std::atoll(argv[3]), N = std::atoll(argv[4]), G = std::atoll(argv[5]);
  const int M = std::atoi(argv[6]), E = std::atoi(argv[7]);
  const bool s = std::atoi(argv[8]), b = std::atoi(argv[9]), fast = std::atoi(argv[10]);
  const int rt = std::atoi(argv[11]), warps = std::atoi(argv[12]);
  if (kind == 0) {
    dispatch<Bits16::kHalf>(dir, B, N, G, M, E, s, b, fast, rt, warps);
  } else {
    dispatch<Bits16::kBFloat16>(dir, B, N, G, M, E, s, b, fast, rt, warps);
  }
  return 0;
}
