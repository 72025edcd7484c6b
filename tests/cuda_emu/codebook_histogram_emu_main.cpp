// Runs the small-batch backward of the 8-bit-code codebook matmul
// (csrc/cuda/codebook_histogram.cuh) on the CPU through cuda_shim.h.
// tests/test_codebook_histogram_cuda_emulator.py drives it:
//   codebook_histogram_emu DIR kind B N G M E D vec bpb split_chunks
// kind 0: float32, 1: float16, 2: bfloat16, 3: float64. vec 1: the kernel's cp.async copies
// where the shapes allow them (as on the GPU); 0: element loads only. bpb: batch rows per block
// (1 to kHistBatch). split_chunks: chunks of output rows per row split. Reads DIR/codes.bin
// (uint8 [N][G][M]), DIR/x.bin (x's type [B][G*D]), DIR/gs.bin and DIR/cb.bin (accumulation
// type: [B][N] and [M][E][D]). Writes DIR/dx.bin ([splits][M][B][G*D]) and DIR/dc.bin
// ([blocks][M][E][D]), the kernel's parts in the accumulation type.
#include "cuda_shim.h"

#define RLX_CUDA_EMULATION 1
#include "codebook_histogram.cuh"

#include "emu_io.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using namespace rlx::codebook::cuda;

namespace {

template <typename T>
void save(const std::string& path, const std::vector<T>& v) {
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(v.data(), sizeof(T), v.size(), f);
  std::fclose(f);
}

template <Elem e>
void run(const std::string& dir, int B, int64_t N, int64_t G, int M, int E, int D, bool vec,
         int bpb, int split_chunks) {
  using acc = acc_t<e>;
  const int64_t K = G * D, S = G * M;
  const int64_t step_chunks = (S + kHistSteps - 1) / kHistSteps;
  const int64_t chunks = (N + kHistChunk - 1) / kHistChunk;
  const int64_t splits = (chunks + split_chunks - 1) / split_chunks;
  const int64_t blocks = step_chunks * ((B + bpb - 1) / bpb) * splits;
  auto codes = emu::read<uint8_t>(dir + "/codes.bin", size_t(N * G * M));
  auto x = emu::read<storage_t<e>>(dir + "/x.bin", size_t(B * K));
  auto gs = emu::read<acc>(dir + "/gs.bin", size_t(B * N));
  auto cb = emu::read<acc>(dir + "/cb.bin", size_t(M) * E * D);
  std::vector<acc> dx(size_t(splits) * M * B * K), dc(size_t(blocks) * M * E * D);
  // 16-byte aligned copies of the codes and gradients, as the GPU's allocations are
  std::vector<uint4> codes16((codes.size() + 15) / 16 + 1);
  std::vector<uint4> gs16((gs.size() * sizeof(acc) + 15) / 16 + 1);
  std::memcpy(codes16.data(), codes.data(), codes.size());
  std::memcpy(gs16.data(), gs.data(), gs.size() * sizeof(acc));
  const auto* codes_p = reinterpret_cast<const uint8_t*>(codes16.data());
  const auto* gs_p = reinterpret_cast<const acc*>(gs16.data());
  const bool vec_codes = vec && S % 16 == 0;
  const bool vec_gs = vec && (N * int64_t(sizeof(acc))) % 16 == 0;
  emu::launch(unsigned(blocks), kHistThreads, histogram_backward_smem(bpb, E, sizeof(acc)), [&] {
    histogram_backward_kernel<e>(codes_p, gs_p, x.data(), cb.data(), dx.data(), dc.data(), B, N,
                                 G, M, E, D, bpb, int(step_chunks), split_chunks, vec_codes,
                                 vec_gs);
  });
  save(dir + "/dx.bin", dx);
  save(dir + "/dc.bin", dc);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 12) {
    std::fprintf(stderr, "usage: %s DIR kind B N G M E D vec bpb split_chunks\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const int kind = std::atoi(argv[2]), B = std::atoi(argv[3]);
  const int64_t N = std::atoll(argv[4]), G = std::atoll(argv[5]);
  const int M = std::atoi(argv[6]), E = std::atoi(argv[7]), D = std::atoi(argv[8]);
  const bool vec = std::atoi(argv[9]) != 0;
  const int bpb = std::atoi(argv[10]), split_chunks = std::atoi(argv[11]);
  if (B < 1 || B > kHistMaxRows || E < 1 || E > 256 || bpb < 1 || bpb > kHistBatch ||
      split_chunks < 1) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  if (kind == 0) run<Elem::kFloat>(dir, B, N, G, M, E, D, vec, bpb, split_chunks);
  if (kind == 1) run<Elem::kHalf>(dir, B, N, G, M, E, D, vec, bpb, split_chunks);
  if (kind == 2) run<Elem::kBFloat16>(dir, B, N, G, M, E, D, vec, bpb, split_chunks);
  if (kind == 3) run<Elem::kDouble>(dir, B, N, G, M, E, D, vec, bpb, split_chunks);
  return kind >= 0 && kind <= 3 ? 0 : 2;
}
