// Runs the CUDA l2norm kernels (csrc/cuda/gated_delta_l2norm.cuh, device code only) on the CPU
// through cuda_shim.h. tests/test_gated_delta_cuda_emulator.py drives it:
//   gdn_l2norm_emu DIR rows K parts group eps
// reads DIR/x.bin [rows, K] and DIR/dy.bin [parts, rows, group, K] (float32) and writes
//   y.bin, rstd.bin   forward, float32 in and out
//   y_bf16.bin        forward, x rounded to bf16, y written as bf16 (as the chunked kernels
//                     read it), widened to float32
//   dx_fused.bin      fused backward (float32 x, parts and groups summed)
//   dx_fused_bf16.bin fused backward from the bf16-rounded x
//   dx.bin            standalone backward: dy the first rows * K values of dy.bin, rstd.bin's r
#include "cuda_shim.h"

#define RLX_CUDA_EMULATION 1
#include "emu_io.h"
#include "gated_delta_l2norm.cuh"

#include <cstdio>
#include <cstdlib>
#include <string>

using namespace rlx::gdn::cuda;
using rlx::codebook::cuda::Bits16;

using F32 = PlainIo<float>;
using BF16 = BitsIo<Bits16::kBFloat16>;

template <typename In, bool kFused>
static void run_backward(const NormGrad<In, kFused>& a) {
  with_lanes(a.K, [&](auto lanes) {
    emu::launch(unsigned(norm_blocks(a.rows)), kNormThreads, 0,
                [&] { l2norm_rows_backward_kernel<In, kFused, decltype(lanes)::value>(a); });
  });
}

static std::vector<float> widen(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = emu::bf16_to_float(b[i]);
  return f;
}

int main(int argc, char** argv) {
  if (argc != 7) return 2;
  const std::string dir = argv[1];
  const int64_t rows = std::atoll(argv[2]);
  const int K = std::atoi(argv[3]), parts = std::atoi(argv[4]), group = std::atoi(argv[5]);
  const float eps = float(std::atof(argv[6]));
  const size_t n = size_t(rows * K);
  const auto x = emu::read(dir + "/x.bin", n);
  const auto dy = emu::read(dir + "/dy.bin", n * size_t(parts * group));
  const auto xb = emu::to_bf16(x);
  const unsigned blocks = unsigned(norm_blocks(rows));

  std::vector<float> y(n, NAN), rstd(size_t(rows), NAN);
  std::vector<uint16_t> yb(n, 0x7fc0);
  with_lanes(K, [&](auto lanes) {
    constexpr int kLanes = decltype(lanes)::value;
    emu::launch(blocks, kNormThreads, 0, [&] {
      l2norm_rows_kernel<F32, F32, kLanes>(x.data(), y.data(), rstd.data(), rows, K, eps);
    });
    emu::launch(blocks, kNormThreads, 0, [&] {
      l2norm_rows_kernel<BF16, BF16, kLanes>(xb.data(), yb.data(), nullptr, rows, K, eps);
    });
  });

  std::vector<float> dx_fused(n, NAN), dx_fused_b(n, NAN), dx(n, NAN);
  // the fused backward (partial gradients summed, r recomputed) from float32 and bf16 rows
  auto fused = [&](auto io, const auto* xs, float* out) {
    NormGrad<decltype(io), true> a;
    a.x = xs;
    a.dy = dy.data();
    a.rstd = nullptr;
    a.dx = out;
    a.rows = rows;
    a.K = K;
    a.parts = parts;
    a.group = group;
    a.part_stride = int64_t(n) * group;
    a.eps = eps;
    run_backward(a);
  };
  fused(F32{}, x.data(), dx_fused.data());
  fused(BF16{}, xb.data(), dx_fused_b.data());
  NormGrad<F32, false> s;
  s.x = x.data();
  s.dy = dy.data();
  s.rstd = rstd.data();
  s.dx = dx.data();
  s.rows = rows;
  s.K = K;
  run_backward(s);

  emu::write(dir + "/y.bin", y);
  emu::write(dir + "/rstd.bin", rstd);
  emu::write(dir + "/y_bf16.bin", widen(yb));
  emu::write(dir + "/dx_fused.bin", dx_fused);
  emu::write(dir + "/dx_fused_bf16.bin", dx_fused_b);
  emu::write(dir + "/dx.bin", dx);
  return 0;
}
