// Runs the 16-bit-code codebook kernels (csrc/cuda/codebook_codes16.cuh) on the CPU through
// cuda_shim.h. tests/test_codebook_codes16_cuda_emulator.py drives it:
//   codebook_codes16_emu DIR forward   kind B N G M E D has_scales has_bias vec out_acc
//   codebook_codes16_emu DIR dequant   kind N G M E D has_scales vec
//   codebook_codes16_emu DIR dcodebook kind B N G M E D from_x blocks
// kind 0: float32, 1: float16, 2: bfloat16. vec 1: the codebook, x and W start 16-byte
// aligned and the kernels take their 16-byte paths (D = 8); 0: they start 2 or 4 bytes past a
// 16-byte boundary and the element loads run. Reads DIR/{x,cb,scales,bias}.bin (x's type),
// DIR/codes.bin (uint16 [N][G][M]); dcodebook also DIR/order.bin (int64 [N*G*M]),
// DIR/offsets.bin (int32 [M*E+1]), DIR/gs.bin (float32 [B][N]) or DIR/dw.bin (float32 [N][K]).
// Writes DIR/out.bin: forward [B][N] (x's type, or float32 with out_acc), dequant [N][K] (x's
// type), dcodebook [M][E][D] (float32).
#include "cuda_shim.h"

#define RLX_CUDA_EMULATION 1
#include "codebook_codes16.cuh"

#include "emu_io.h"

#include <cstdio>
#include <cstdlib>
#include <string>

using namespace rlx::codebook::cuda::codes16;

namespace {

// n elements of T from DIR/name.bin in a buffer that starts 16-byte aligned (aligned) or
// sizeof(T) bytes past a 16-byte boundary (as a misaligned tensor view would).
template <typename T>
struct Buf {
  std::vector<uint4> mem;
  size_t skip;  // elements before the first
  Buf(size_t n, bool aligned) : mem((n + 2) * sizeof(T) / 16 + 2), skip(aligned ? 0 : 1) {}
  T* p() { return reinterpret_cast<T*>(mem.data()) + skip; }
};
template <typename T>
Buf<T> load(const std::string& path, size_t n, bool aligned) {
  Buf<T> b(n, aligned);
  auto v = emu::read<T>(path, n);
  std::memcpy(b.p(), v.data(), n * sizeof(T));
  return b;
}
template <typename T>
void save(const std::string& path, const T* p, size_t n) {
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(p, sizeof(T), n, f);
  std::fclose(f);
}

template <Elem e, int BT, int DV, bool OUT_ACC>
void forward(const std::string& dir, int64_t B, int64_t N, int64_t G, int M, int E, int D,
             bool has_s, bool has_b, bool vec) {
  using st = storage_t<e>;
  using out_t = out_elem_t<e, OUT_ACC>;
  auto x = load<st>(dir + "/x.bin", size_t(B * G * D), vec);
  auto cb = load<st>(dir + "/cb.bin", size_t(M) * E * D, vec);
  auto codes = emu::read<uint16_t>(dir + "/codes.bin", size_t(N * G * M));
  auto s = load<st>(dir + "/scales.bin", size_t(N), true);
  auto b = load<st>(dir + "/bias.bin", size_t(N), true);
  std::vector<out_t> out(size_t(B * N));
  std::memset(out.data(), 0xff, out.size() * sizeof(out_t));  // NaN: unwritten shows
  emu::launch(unsigned((N + kWarps - 1) / kWarps), kThreads, 0, [&] {
    forward_small_kernel<e, BT, DV, OUT_ACC>(x.p(), codes.data(), cb.p(), has_s ? s.p() : nullptr,
                                             has_b ? b.p() : nullptr, out.data(), B, N, G, M, E, D,
                                             vec && D == 8, vec && D == 8);
  });
  save(dir + "/out.bin", out.data(), out.size());
}

template <Elem e, int BT, bool OUT_ACC>
void forward_d(const std::string& dir, int64_t B, int64_t N, int64_t G, int M, int E, int D,
               bool has_s, bool has_b, bool vec) {
  D == 8 ? forward<e, BT, 8, OUT_ACC>(dir, B, N, G, M, E, D, has_s, has_b, vec)
         : forward<e, BT, 0, OUT_ACC>(dir, B, N, G, M, E, D, has_s, has_b, vec);
}

// The batch tile as the host code picks it: the smallest of 1, 2, 4, 8 rows that holds B.
template <Elem e, bool OUT_ACC>
void forward_bt(const std::string& dir, int64_t B, int64_t N, int64_t G, int M, int E, int D,
                bool has_s, bool has_b, bool vec) {
  if (B == 1) {
    forward_d<e, 1, OUT_ACC>(dir, B, N, G, M, E, D, has_s, has_b, vec);
  } else if (B == 2) {
    forward_d<e, 2, OUT_ACC>(dir, B, N, G, M, E, D, has_s, has_b, vec);
  } else if (B <= 4) {
    forward_d<e, 4, OUT_ACC>(dir, B, N, G, M, E, D, has_s, has_b, vec);
  } else {
    forward_d<e, 8, OUT_ACC>(dir, B, N, G, M, E, D, has_s, has_b, vec);
  }
}

template <Elem e>
void dequant(const std::string& dir, int64_t N, int64_t G, int M, int E, int D, bool has_s,
             bool vec) {
  using st = storage_t<e>;
  auto cb = load<st>(dir + "/cb.bin", size_t(M) * E * D, vec);
  auto codes = emu::read<uint16_t>(dir + "/codes.bin", size_t(N * G * M));
  auto s = load<st>(dir + "/scales.bin", size_t(N), true);
  Buf<st> W(size_t(N * G * D), vec);
  std::memset(W.p(), 0xff, size_t(N * G * D) * sizeof(st));
  const unsigned blocks = unsigned((N * G + kThreads - 1) / kThreads);
  emu::launch(blocks, kThreads, 0, [&] {
    const st* scales = has_s ? s.p() : nullptr;
    if (D == 8) {
      dequantize_kernel<e, 8>(codes.data(), cb.p(), scales, W.p(), N, G, M, E, D, vec, vec);
    } else {
      dequantize_kernel<e, 0>(codes.data(), cb.p(), scales, W.p(), N, G, M, E, D, false, false);
    }
  });
  save(dir + "/out.bin", W.p(), size_t(N * G * D));
}

template <Elem e>
void dcodebook(const std::string& dir, int64_t B, int64_t N, int64_t G, int M, int E, int D,
               bool from_x, unsigned blocks) {
  using st = storage_t<e>;
  const size_t n_codes = size_t(N * G * M);
  auto order = emu::read<int64_t>(dir + "/order.bin", n_codes);
  auto offsets = emu::read<int32_t>(dir + "/offsets.bin", size_t(M) * E + 1);
  std::vector<float> gs, dw;
  Buf<st> x(1, true);
  if (from_x) {
    gs = emu::read<float>(dir + "/gs.bin", size_t(B * N));
    x = load<st>(dir + "/x.bin", size_t(B * G * D), true);
  } else {
    dw = emu::read<float>(dir + "/dw.bin", size_t(N * G * D));
  }
  std::vector<float> dC(size_t(M) * E * D, std::nanf(""));
  const int64_t total_warps = int64_t(blocks) * kWarps;
  emu::launch(blocks, kThreads, 0, [&] {
    if (from_x) {
      dcodebook_kernel<e, true>(order.data(), offsets.data(), gs.data(), x.p(), nullptr, dC.data(),
                                B, N, G, M, E, D, total_warps);
    } else {
      dcodebook_kernel<e, false>(order.data(), offsets.data(), nullptr, nullptr, dw.data(),
                                 dC.data(), B, N, G, M, E, D, total_warps);
    }
  });
  save(dir + "/out.bin", dC.data(), dC.size());
}

template <Elem e>
int run(const std::string& mode, const std::string& dir, char** a) {
  if (mode == "forward") {
    const int64_t B = std::atoll(a[0]), N = std::atoll(a[1]), G = std::atoll(a[2]);
    const int M = std::atoi(a[3]), E = std::atoi(a[4]), D = std::atoi(a[5]);
    const bool s = std::atoi(a[6]), b = std::atoi(a[7]), vec = std::atoi(a[8]);
    const bool out_acc = std::atoi(a[9]);
    if (B < 1 || B > kMaxSmallBatch) return 2;
    out_acc ? forward_bt<e, true>(dir, B, N, G, M, E, D, s, b, vec)
            : forward_bt<e, false>(dir, B, N, G, M, E, D, s, b, vec);
  } else if (mode == "dequant") {
    dequant<e>(dir, std::atoll(a[0]), std::atoll(a[1]), std::atoi(a[2]), std::atoi(a[3]),
               std::atoi(a[4]), std::atoi(a[5]), std::atoi(a[6]));
  } else if (mode == "dcodebook") {
    dcodebook<e>(dir, std::atoll(a[0]), std::atoll(a[1]), std::atoll(a[2]), std::atoi(a[3]),
                 std::atoi(a[4]), std::atoi(a[5]), std::atoi(a[6]), unsigned(std::atoi(a[7])));
  } else {
    return 2;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int want = argc > 2 ? (std::string(argv[2]) == "forward" ? 14
                               : std::string(argv[2]) == "dequant" ? 11 : 12)
                            : 0;
  if (argc < 3 || argc != want) {
    std::fprintf(stderr, "usage: %s DIR forward|dequant|dcodebook kind ... (see the source)\n",
                 argv[0]);
    return 2;
  }
  const std::string dir = argv[1], mode = argv[2];
  const int kind = std::atoi(argv[3]);
  char** rest = argv + 4;
  int rc = 2;
  if (kind == 0) rc = run<Elem::kFloat>(mode, dir, rest);
  if (kind == 1) rc = run<Elem::kHalf>(mode, dir, rest);
  if (kind == 2) rc = run<Elem::kBFloat16>(mode, dir, rest);
  if (rc != 0) std::fprintf(stderr, "bad arguments\n");
  return rc;
}
