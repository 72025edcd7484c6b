// Runs the one-row codebook forward (csrc/cuda/codebook_gemv.cuh) on the CPU through
// cuda_shim.h. tests/test_codebook_cuda_emulator.py drives it:
//   codebook_gemv_emu DIR kind N G M E has_scales has_bias wide_codes rows sms
// kind 0: float16, 1: bfloat16; rows: output rows per block (0: the rule for `sms` SMs).
// Reads DIR/{x,cb,scales,bias}.bin (16-bit patterns) and DIR/idx.bin (uint8 [N][G][M]);
// writes DIR/out.bin ([N], x's type).
#include "cuda_shim.h"

#define RLX_CUDA_EMULATION 1
#include "codebook_gemv.cuh"

#include "emu_io.h"

#include <cstdio>
#include <cstdlib>
#include <string>

using namespace rlx::codebook::cuda;

template <Bits16 kind, int M>
static void run(const std::string& dir, int64_t N, int64_t G, int E, bool scales, bool bias,
                bool wide, const GemvShape& shape) {
  // x read with 16-byte loads: a 16-byte aligned copy
  auto xv = emu::read<uint16_t>(dir + "/x.bin", size_t(G * 8));
  std::vector<uint4> xbuf((xv.size() * 2 + 15) / 16 + 1);
  std::memcpy(xbuf.data(), xv.data(), xv.size() * 2);
  const uint16_t* x = reinterpret_cast<const uint16_t*>(xbuf.data());
  auto idx = emu::read<uint8_t>(dir + "/idx.bin", size_t(N * G * M));
  auto cb = emu::read<uint16_t>(dir + "/cb.bin", size_t(M * E * 8));
  std::vector<uint16_t> s = scales ? emu::read<uint16_t>(dir + "/scales.bin", size_t(N))
                                   : std::vector<uint16_t>();
  std::vector<uint16_t> b = bias ? emu::read<uint16_t>(dir + "/bias.bin", size_t(N))
                                 : std::vector<uint16_t>();
  std::vector<uint16_t> out(size_t(N), float_to_bits<kind>(std::nanf("")));
  emu::launch(unsigned(shape.blocks), kGemvWarps * 32, gemv_smem(M, E, shape.parts, shape.rows),
              [&] {
                gemv_forward_kernel<kind, M>(x, idx.data(), cb.data(),
                                             scales ? s.data() : nullptr,
                                             bias ? b.data() : nullptr, out.data(), N, G, E,
                                             shape.rows, shape.parts, shape.part_warps, wide);
              });
  FILE* f = std::fopen((dir + "/out.bin").c_str(), "wb");
  std::fwrite(out.data(), sizeof(uint16_t), out.size(), f);
  std::fclose(f);
}

template <Bits16 kind>
static void dispatch(const std::string& dir, int64_t N, int64_t G, int M, int E, bool s, bool b,
                     bool wide, const GemvShape& shape) {
  M == 1 ? run<kind, 1>(dir, N, G, E, s, b, wide, shape)
         : run<kind, 2>(dir, N, G, E, s, b, wide, shape);
}

int main(int argc, char** argv) {
  if (argc != 12) {
    std::fprintf(stderr, "usage: %s DIR kind N G M E has_scales has_bias wide rows sms\n",
                 argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const int kind = std::atoi(argv[2]);
  const int64_t N = std::atoll(argv[3]), G = std::atoll(argv[4]);
  const int M = std::atoi(argv[5]), E = std::atoi(argv[6]);
  const bool s = std::atoi(argv[7]), b = std::atoi(argv[8]), wide = std::atoi(argv[9]);
  const int rows = std::atoi(argv[10]), sms = std::atoi(argv[11]);
  if (M != 1 && M != 2) {
    std::fprintf(stderr, "unsupported M = %d\n", M);
    return 2;
  }
  const GemvShape shape = gemv_shape(N, G, M, E, sms, 227 * 1024, rows);
  std::fprintf(stdout, "rows %d parts %d part_warps %d blocks %lld\n", shape.rows, shape.parts,
               shape.part_warps, static_cast<long long>(shape.blocks));
  // the kernel's vector loads of codes need every row's bytes at a multiple of 4 M
  const bool wide_codes = wide && G % kGemvLaneGroups == 0;
  if (kind == 0) {
    dispatch<Bits16::kHalf>(dir, N, G, M, E, s, b, wide_codes, shape);
  } else {
    dispatch<Bits16::kBFloat16>(dir, N, G, M, E, s, b, wide_codes, shape);
  }
  return 0;
}
