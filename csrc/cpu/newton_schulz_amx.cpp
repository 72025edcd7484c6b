// Muon's bf16 Newton–Schulz iteration on AMX tiles (rlx_torch/optim/newton_schulz.py):
//   for each step (a, b, c):  A = X X^T,  P = a I + b A + c A A,  X <- P X,
// for batches of wide bf16 matrices X [N, m, n] (m <= n, both multiples of 32), every product
// computed from bf16 values with float32 sums and rounded to bf16 once, as in the bmm path of
// the iteration; P is formed in float32 and rounded once (the bmm path rounds b A + c A A,
// then adds a I in bf16).
//
// Why a kernel of its own: through torch ops a step is three bmm calls, a diagonal add and the
// operands' reorders per call, with the batch leaving the caches between ops; oneDNN's bf16
// bmm reaches about a third of the AMX peak at Muon's shapes (m = 256). Here one thread runs
// the whole iteration of one matrix, whose working set (X and A in tile order, their packed
// right-operand forms, P: 4 m n + 6 m^2 bytes, 1.4 MiB for 256 x 1024) stays in that core's
// caches, and each product is a loop of 32 x 32 output blocks over 2 x 2 tiles.
//
// AMX operands: tdpbf16ps multiplies a tile of 16 rows x 32 bf16 (A, k along the row) with a
// tile of 16 k pairs x 16 columns (B, "VNNI": each 32-bit element holds the bf16 values of
// k = 2p and 2p + 1 for one column) into 16 x 16 float32 sums. So before each product its
// right operand is packed:
//   X X^T: B[p][j] = (X[j][2p], X[j][2p+1]), the transpose of X viewed as 32-bit pairs;
//   A A:   B[p][j] = (A[2p][j], A[2p+1][j]), rows 2p and 2p + 1 interleaved (A symmetric);
//   P X:   B[p][j] = (X[2p][j], X[2p+1][j]), likewise.
//
// Only CPUs with AMX-BF16 (and AVX512-BF16 for the conversions) run it, on Linux (which hands
// a process the tile state only on request: arch_prctl(ARCH_REQ_XCOMP_PERM)); the functions
// marked RLX_AMX, in namespace isa_amx, hold all of its AMX and AVX-512 code. Elsewhere the op
// computes the same products with at::bmm in float32 (same meaning, no speed);
// `rlx::newton_schulz_amx_is_native` tells callers whether it pays. RLX_NO_AMX=1 forces that
// fallback.
#include "torch_headers.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
// GCC 12 reports a false "may be used uninitialized" inside its own AVX-512 intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define RLX_HAVE_AMX_PATH 1
#define RLX_AMX                                                                          \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#else
#define RLX_HAVE_AMX_PATH 0
#endif

namespace rlx {
namespace {

constexpr int64_t kBlock = 32;  // output block edge: 2 x 2 tiles of 16 x 16

#if RLX_HAVE_AMX_PATH
bool cpu_has_amx_bf16() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx = (edx >> 24 & 1) && (edx >> 22 & 1);  // AMX-TILE, AMX-BF16
  const bool avx512 = (ebx >> 16 & 1) && (ebx >> 30 & 1) && (ebx >> 31 & 1) &&
                      (ebx >> 17 & 1);  // AVX512 F, BW, VL, DQ
  if (!amx || !avx512 || eax < 1) return false;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  return eax >> 5 & 1;  // AVX512-BF16
}

// Linux grants the AMX tile data state per process, on request (kernel 5.16 and later).
bool request_tile_state() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif

bool amx_ready() {
#if RLX_HAVE_AMX_PATH
  static const bool ok = !(std::getenv("RLX_NO_AMX") &&
                           std::string(std::getenv("RLX_NO_AMX")) == "1") &&
                         cpu_has_amx_bf16() && request_tile_state();
  return ok;
#else
  return false;
#endif
}

#if RLX_HAVE_AMX_PATH
namespace isa_amx {  // the functions with AMX and AVX-512 code (tests/test_cpu_isa.py)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: the 2 x 2 float32 sums; 4, 5: A rows; 6, 7: B columns. All 16 x 64 bytes.
RLX_AMX void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  // GCC 12 does not count ldtilecfg as a read of `config` and drops the stores above
  // without this barrier (then every tile instruction faults).
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// Operands live in tile order, so that a block product reads two contiguous streams, each
// step 2 KiB of whole tiles (row-major operands put a tile's rows a few KiB apart, where they
// share L1 sets and defeat the prefetcher):
//   left operands and results, bf16 [R, C]: tile (t, u) = rows 16t .. 16t + 15, columns
//     32u .. 32u + 31; tiles 2t' and 2t' + 1 side by side for each u, u running fastest;
//   right operands, k pairs [K / 2, C] of 32-bit elements: tile (t, u) = pairs 16t .. 16t + 15,
//     columns 16u .. 16u + 15; tiles 2u' and 2u' + 1 side by side for each t, t running fastest.
// A tile is row-major inside (64-byte rows).
inline int64_t left_tile(int64_t t, int64_t u, int64_t cols) {
  return ((t / 2) * (cols / 32) + u) * 1024 + (t % 2) * 512;
}
inline int64_t right_tile(int64_t t, int64_t u, int64_t ktiles) {
  return ((u / 2) * ktiles + t) * 512 + (u % 2) * 256;
}

// acc[32][32] = rows 32 bi .. 32 bi + 31 of a (left, kdim columns) times columns
// 32 bj .. 32 bj + 31 of b (right, kdim / 2 pairs).
RLX_AMX void block_product(const uint16_t* a, const uint32_t* b, int64_t bi, int64_t bj,
                           int64_t kdim, float* acc) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < kdim / 32; ++k) {
    _tile_loadd(4, a + left_tile(2 * bi, k, kdim), 64);
    _tile_loadd(5, a + left_tile(2 * bi + 1, k, kdim), 64);
    _tile_loadd(6, b + right_tile(k, 2 * bj, kdim / 32), 64);
    _tile_loadd(7, b + right_tile(k, 2 * bj + 1, kdim / 32), 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc, kBlock * 4);
  _tile_stored(1, acc + 16, kBlock * 4);
  _tile_stored(2, acc + 16 * kBlock, kBlock * 4);
  _tile_stored(3, acc + 16 * kBlock + 16, kBlock * 4);
}

// 32 float32 values -> 32 bf16 (round to nearest even; float32 denormals read as zero).
RLX_AMX inline __m512i to_bf16(__m512 lo, __m512 hi) {
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

RLX_AMX inline __m512 from_bf16(__m256i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// Row r of output block (bi, bj) in a left-order matrix with `cols` columns.
inline int64_t block_row(int64_t bi, int64_t bj, int64_t r, int64_t cols) {
  return left_tile(2 * bi + r / 16, bj, cols) + (r % 16) * 32;
}

// Output block (bi, bj) of a left-order matrix with `cols` columns = round(acc).
RLX_AMX void store_block(const float* acc, uint16_t* out, int64_t bi, int64_t bj, int64_t cols) {
  for (int64_t r = 0; r < kBlock; ++r) {
    const __m512i v = to_bf16(_mm512_load_ps(acc + r * kBlock),
                              _mm512_load_ps(acc + r * kBlock + 16));
    _mm512_storeu_si512(out + block_row(bi, bj, r, cols), v);
  }
}

// Block (bi, bj) of P = round(c acc + b A + a I) (A and P left-order m x m).
RLX_AMX void store_polynomial(const float* acc, const uint16_t* A, uint16_t* P, int64_t m,
                              int64_t bi, int64_t bj, float a, float b, float c) {
  const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b), vc = _mm512_set1_ps(c);
  for (int64_t r = 0; r < kBlock; ++r) {
    const int64_t at = block_row(bi, bj, r, m);
    __m512 h[2];
    for (int64_t q = 0; q < 2; ++q) {
      const __m512 prev =
          from_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(A + at + 16 * q)));
      h[q] = _mm512_fmadd_ps(vc, _mm512_load_ps(acc + r * kBlock + 16 * q),
                             _mm512_mul_ps(vb, prev));
      const int64_t d = kBlock * bi + r - kBlock * bj - 16 * q;  // the diagonal's lane, if any
      if (d >= 0 && d < 16) h[q] = _mm512_mask_add_ps(h[q], __mmask16(1u << d), h[q], va);
    }
    _mm512_storeu_si512(P + at, to_bf16(h[0], h[1]));
  }
}

// Row-major [rows, cols] <-> left order (rows a multiple of 16, cols of 32).
RLX_AMX void to_left(const uint16_t* src, int64_t rows, int64_t cols, uint16_t* dst) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t u = 0; u < cols / 32; ++u) {
      _mm512_storeu_si512(dst + left_tile(i / 16, u, cols) + (i % 16) * 32,
                          _mm512_loadu_si512(src + i * cols + 32 * u));
    }
  }
}
RLX_AMX void from_left(const uint16_t* src, int64_t rows, int64_t cols, uint16_t* dst) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t u = 0; u < cols / 32; ++u) {
      _mm512_storeu_si512(dst + i * cols + 32 * u,
                          _mm512_loadu_si512(src + left_tile(i / 16, u, cols) + (i % 16) * 32));
    }
  }
}

// The right operand S as it stands, from S [rows, cols] in left order:
// pair (p, j) = (S[2p][j], S[2p + 1][j]).
RLX_AMX void interleave_rows(const uint16_t* src, int64_t rows, int64_t cols, uint32_t* dst) {
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int l = 0; l < 32; ++l) {  // result lane l: column l / 2 (+ 16 for hi), from row l % 2
    lo_idx[l] = static_cast<uint16_t>((l % 2) * 32 + l / 2);
    hi_idx[l] = static_cast<uint16_t>((l % 2) * 32 + 16 + l / 2);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t p = 0; p < rows / 2; ++p) {
    const int64_t i = 2 * p;  // rows i and i + 1 share a tile
    for (int64_t u = 0; u < cols / 32; ++u) {
      const uint16_t* r0 = src + left_tile(i / 16, u, cols) + (i % 16) * 32;
      const __m512i x0 = _mm512_loadu_si512(r0), x1 = _mm512_loadu_si512(r0 + 32);
      uint32_t* out = dst + right_tile(p / 16, 2 * u, rows / 32) + (p % 16) * 16;
      _mm512_storeu_si512(out, _mm512_permutex2var_epi16(x0, lo, x1));
      _mm512_storeu_si512(out + 256, _mm512_permutex2var_epi16(x0, hi, x1));  // tile 2u + 1
    }
  }
}

// The right operand S^T, from S [rows, cols] in left order: pair (p, j) = (S[j][2p],
// S[j][2p + 1]). Each left tile is 16 x 16 pairs, transposed in registers into one right tile.
RLX_AMX void transpose_pairs(const uint16_t* src, int64_t rows, int64_t cols, uint32_t* dst) {
  for (int64_t t = 0; t < rows / 16; ++t) {
    for (int64_t u = 0; u < cols / 32; ++u) {
      const uint16_t* in = src + left_tile(t, u, cols);
      uint32_t* out = dst + right_tile(u, t, cols / 32);
      __m512i r[16], a[16], b[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(in + 32 * i);
      for (int i = 0; i < 8; ++i) {  // per 128-bit lane: pairs of rows interleaved
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 4; ++i) {  // b[4i + s], lane L: column 4L + s, rows 4i .. 4i + 3
        b[4 * i + 0] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
      }
      for (int s = 0; s < 4; ++s) {  // column 4L + s: lane L of b[s], b[4 + s], b[8 + s], ...
        const __m512i c0 = _mm512_shuffle_i32x4(b[s], b[4 + s], 0x88);
        const __m512i c1 = _mm512_shuffle_i32x4(b[s], b[4 + s], 0xDD);
        const __m512i d0 = _mm512_shuffle_i32x4(b[8 + s], b[12 + s], 0x88);
        const __m512i d1 = _mm512_shuffle_i32x4(b[8 + s], b[12 + s], 0xDD);
        _mm512_storeu_si512(out + 16 * s, _mm512_shuffle_i32x4(c0, d0, 0x88));
        _mm512_storeu_si512(out + 16 * (4 + s), _mm512_shuffle_i32x4(c1, d1, 0x88));
        _mm512_storeu_si512(out + 16 * (8 + s), _mm512_shuffle_i32x4(c0, d0, 0xDD));
        _mm512_storeu_si512(out + 16 * (12 + s), _mm512_shuffle_i32x4(c1, d1, 0xDD));
      }
    }
  }
}

// A growable buffer whose data starts on a 64-byte boundary: tile rows that straddle two
// cache lines cost two line reads each (the products ran at under half speed from a
// std::vector's 16-byte alignment).
template <typename T>
struct Aligned64 {
  std::vector<unsigned char> raw;
  T* get(int64_t count) {
    raw.resize(count * sizeof(T) + 64);
    const auto at = reinterpret_cast<uintptr_t>(raw.data());
    return reinterpret_cast<T*>((at + 63) & ~uintptr_t(63));
  }
};

struct Scratch {
  Aligned64<uint16_t> X, A, P;  // left order: m x n, m x m, m x m
  Aligned64<uint32_t> right_x;  // X^T (for X X^T) or X (for P X) as right operand
  Aligned64<uint32_t> right_a;  // A as right operand
  alignas(64) float acc[kBlock * kBlock];
};

// The whole iteration for one row-major matrix x [m, n], in place.
RLX_AMX void iterate(uint16_t* x, int64_t m, int64_t n, const std::vector<double>& coefs,
                     Scratch& s) {
  uint16_t *X = s.X.get(m * n), *A = s.A.get(m * m), *P = s.P.get(m * m);
  uint32_t *right_x = s.right_x.get(m * n / 2), *right_a = s.right_a.get(m * m / 2);
  to_left(x, m, n, X);
  for (size_t step = 0; step + 2 < coefs.size(); step += 3) {
    const float a = static_cast<float>(coefs[step]), b = static_cast<float>(coefs[step + 1]),
                c = static_cast<float>(coefs[step + 2]);
    transpose_pairs(X, m, n, right_x);
    for (int64_t bi = 0; bi < m / kBlock; ++bi) {  // A = X X^T
      for (int64_t bj = 0; bj < m / kBlock; ++bj) {
        block_product(X, right_x, bi, bj, n, s.acc);
        store_block(s.acc, A, bi, bj, m);
      }
    }
    interleave_rows(A, m, m, right_a);
    for (int64_t bi = 0; bi < m / kBlock; ++bi) {  // P = a I + b A + c A A
      for (int64_t bj = 0; bj < m / kBlock; ++bj) {
        block_product(A, right_a, bi, bj, m, s.acc);
        store_polynomial(s.acc, A, P, m, bi, bj, a, b, c);
      }
    }
    interleave_rows(X, m, n, right_x);  // X is read only through it from here
    for (int64_t bi = 0; bi < m / kBlock; ++bi) {  // X <- P X
      for (int64_t bj = 0; bj < n / kBlock; ++bj) {
        block_product(P, right_x, bi, bj, m, s.acc);
        store_block(s.acc, X, bi, bj, n);
      }
    }
  }
  from_left(X, m, n, x);
}

RLX_AMX void release_tiles() { _tile_release(); }
}  // namespace isa_amx
#endif

at::Tensor newton_schulz_amx_cpu(const at::Tensor& X, at::ArrayRef<double> coefficients) {
  const char* op = "rlx::newton_schulz_amx";
  TORCH_CHECK(X.dim() == 3, op, ": X must be [N, m, n], got shape ", X.sizes());
  TORCH_CHECK(X.scalar_type() == at::kBFloat16 && X.device().is_cpu(), op,
              ": X must be a bfloat16 CPU tensor, got ", X.scalar_type(), " on ", X.device());
  const int64_t m = X.size(1), n = X.size(2);
  TORCH_CHECK(m <= n && m % kBlock == 0 && n % kBlock == 0, op,
              ": X's matrices must be wide (m <= n) with m and n multiples of ", kBlock,
              ", got m = ", m, ", n = ", n);
  TORCH_CHECK(coefficients.size() % 3 == 0, op,
              ": coefficients must hold (a, b, c) per step, got ", coefficients.size(),
              " numbers");
#if RLX_HAVE_AMX_PATH
  const int64_t N = X.size(0);
  if (amx_ready() && N > 0 && !coefficients.empty()) {
    at::Tensor out = X.clone(at::MemoryFormat::Contiguous);
    auto* po = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    const std::vector<double> coefs(coefficients.begin(), coefficients.end());
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      // Kept per thread: fresh buffers (1.4 MiB for 256 x 1024) would be page-faulted in on
      // every call.
      static thread_local isa_amx::Scratch s;
      isa_amx::configure_tiles();
      for (int64_t i = begin; i < end; ++i) isa_amx::iterate(po + i * m * n, m, n, coefs, s);
      isa_amx::release_tiles();
    });
    return out;
  }
#endif
  // The same arithmetic through bmm: bf16 operands, float32 sums, one rounding to bf16 per
  // product (for P after a I + b A + c A A is formed).
  at::Tensor x = X.clone(at::MemoryFormat::Contiguous);
  for (size_t step = 0; step < coefficients.size(); step += 3) {
    const at::Tensor xf = x.to(at::kFloat);
    const at::Tensor A = at::bmm(xf, xf.mT()).to(at::kBFloat16).to(at::kFloat);
    at::Tensor P = at::baddbmm(A, A, A, coefficients[step + 1], coefficients[step + 2]);
    P.diagonal(0, -2, -1).add_(coefficients[step]);
    x = at::bmm(P.to(at::kBFloat16).to(at::kFloat), xf).to(at::kBFloat16);
  }
  return x;
}

bool newton_schulz_amx_is_native() { return amx_ready(); }

}  // namespace
}  // namespace rlx

TORCH_LIBRARY_IMPL(rlx, CPU, m) { m.impl("newton_schulz_amx", &rlx::newton_schulz_amx_cpu); }

TORCH_LIBRARY_IMPL(rlx, CompositeImplicitAutograd, m) {
  m.impl("newton_schulz_amx_is_native", &rlx::newton_schulz_amx_is_native);
}
