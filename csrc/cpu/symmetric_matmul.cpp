// Symmetric bf16 products for the Newton–Schulz iteration of Muon (rlx_torch/optim):
//   out = upper triangle of (beta * c + alpha * a @ b^T + diag * I), mirrored to the lower one,
// for batches of bf16 matrices a, b [N, m, k] and c [N, m, m] (read on and above the
// diagonal only), or a^T b for a, b [N, k, m] (`transposed`, the Gram matrix of tall
// matrices). Every product of the iteration whose result is symmetric has this form: X X^T,
// and, for polynomials in one symmetric matrix (which commute), A A = A A^T and P R = P R^T.
// Only the tiles holding upper-triangle entries are computed (8 rows x 32 columns, 16 on
// the diagonal's lower half): 53% of a full product's work for m = 256.
//
// The fast path needs AVX512-BF16 (vdpbf16ps: pairs of bf16 products summed into float32
// lanes), chosen at run time (the extension's baseline is plain x86-64), so only the
// functions marked RLX_AVX512_BF16, in namespace isa_avx512bf16, use those instructions. Elsewhere the op computes the
// full product with at::baddbmm in float32 and mirrors its upper triangle, so results have
// the same meaning on every CPU (float32 sums, one rounding to bf16);
// `rlx::symmetric_matmul_is_native` tells callers whether it pays.
// Accumulation is float32 (as in oneDNN's bf16 GEMM); each output is rounded to bf16 once.
#include "torch_headers.h"

#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
// GCC 12 reports a false "may be used uninitialized" inside its own vpmovzxwd intrinsic.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define RLX_HAVE_AVX512_BF16_PATH 1
#define RLX_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#else
#define RLX_HAVE_AVX512_BF16_PATH 0
#endif

namespace rlx {
namespace {

[[maybe_unused]] constexpr int64_t kRows = 8;   // MR: rows of a tile (one broadcast each per k pair)
constexpr int64_t kCols = 32;  // NR: columns of a tile, two 16-lane float32 vectors
// k values per pass over a tile: up to this k its float32 sums stay in registers and b's
// packed panel (64 KiB) streams from L2; longer k is summed in passes through Scratch::acc.
[[maybe_unused]] constexpr int64_t kBlockK = 1024;
constexpr size_t kKeepPacked = size_t(1) << 20;  // uint32 pairs: 4 MiB per operand

// RLX_NO_AVX512_BF16=1 forces the fallback (tests of it; a way around a suspected CPU issue).
bool cpu_has_avx512_bf16() {
#if RLX_HAVE_AVX512_BF16_PATH
  static const bool ok = !(std::getenv("RLX_NO_AVX512_BF16") &&
                           std::string(std::getenv("RLX_NO_AVX512_BF16")) == "1") &&
                         __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

#if RLX_HAVE_AVX512_BF16_PATH
namespace isa_avx512bf16 {  // the functions with AVX512 code (tests/test_cpu_isa.py)
inline uint32_t load_pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// One k pair of a tile: c[r][v] += a_pair[r] * b[v] for the 8 rows and kVecs vectors; the
// a pairs are broadcast straight from memory (ap[r]).
template <int kVecs>
RLX_AVX512_BF16 inline __attribute__((always_inline)) void tile_step(
    __m512 (&c)[kRows][2], const uint32_t* ap, const uint32_t* bp) {
  __m512bh bv[kVecs];
  for (int v = 0; v < kVecs; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(bp + 16 * v);
  for (int64_t r = 0; r < kRows; ++r) {
    const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(ap[r]));
    for (int v = 0; v < kVecs; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], av, bv[v]);
  }
}

// acc[r][col0 .. col0 + 16 kVecs) (+)= sum over the k pairs p < pairs of a_pair(r, p) .
// b_pair(j, p) for the tile's 8 rows, from packed panels (ap[p * kCols + r] and
// bp[p * kCols + j], see pack_rows); kVecs = 1 serves the tiles left of the diagonal's lower
// half, which only need the panel's right 16 columns (col0 = 16).
template <int kVecs>
RLX_AVX512_BF16 void tile(const uint32_t* ap, const uint32_t* bp, int64_t pairs, float* acc,
                          bool accumulate) {
  constexpr int64_t col0 = kCols - 16 * kVecs;
  __m512 c[kRows][2];
  for (int64_t r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      c[r][v] = accumulate ? _mm512_loadu_ps(acc + r * kCols + col0 + 16 * v)
                           : _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < pairs; ++p) tile_step<kVecs>(c, ap + p * kCols, bp + p * kCols + col0);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(acc + r * kCols + col0 + 16 * v, c[r][v]);
  }
}

// The tile of rows [i0, i0 + 8) of the panel starting at column j0: only the right half when
// every row lies at or below the panel's column j0 + 16 (its left half is below the diagonal).
RLX_AVX512_BF16 void any_tile(int64_t i0, int64_t j0, const uint32_t* ap, const uint32_t* bp,
                              int64_t pairs, float* acc, bool accumulate) {
  if (i0 >= j0 + 16) {
    tile<1>(ap, bp, pairs, acc, accumulate);
  } else {
    tile<2>(ap, bp, pairs, acc, accumulate);
  }
}

// Packs rows j0 .. j0+nr-1 of b (bf16 bits, row stride ldb) over k in [k0, k0 + kc) as
// k pairs: dst[p * kCols + j] = (b[j][k0 + 2p], b[j][k0 + 2p + 1]), the layout vdpbf16ps
// reads (16 columns per vector). Columns past nr and the k past kdim are zero. Whole 8 x 8
// blocks of pairs are transposed in registers.
RLX_AVX512_BF16 void pack_rows(const uint16_t* b, int64_t ldb, int64_t nr, int64_t k0,
                               int64_t kc, int64_t kdim, uint32_t* dst) {
  const int64_t pairs = (kc + 1) / 2, full = std::min(kc, kdim - k0) / 2;
  const int64_t full8 = full / 8 * 8, nr8 = nr / 8 * 8;
  for (int64_t j = 0; j < nr8; j += 8) {
    for (int64_t p = 0; p < full8; p += 8) {
      __m256i x[8];
      for (int r = 0; r < 8; ++r) {
        x[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (j + r) * ldb + k0 + 2 * p));
      }
      // 8 x 8 transpose of 32-bit pairs.
      __m256i t[8], u[8];
      for (int r = 0; r < 4; ++r) {
        t[2 * r] = _mm256_unpacklo_epi32(x[2 * r], x[2 * r + 1]);
        t[2 * r + 1] = _mm256_unpackhi_epi32(x[2 * r], x[2 * r + 1]);
      }
      for (int h = 0; h < 2; ++h) {
        u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h + 0], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h + 0], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
      }
      for (int q = 0; q < 4; ++q) {  // pairs p + q (low 128-bit lanes) and p + q + 4 (high)
        const __m256i lo = _mm256_permute2x128_si256(u[q], u[4 + q], 0x20);
        const __m256i hi = _mm256_permute2x128_si256(u[q], u[4 + q], 0x31);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (p + q) * kCols + j), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (p + q + 4) * kCols + j), hi);
      }
    }
  }
  for (int64_t j = 0; j < kCols; ++j) {  // what the blocks left: tails in p and in j
    const uint16_t* row = b + j * ldb + k0;
    for (int64_t p = j < nr8 ? full8 : 0; p < pairs; ++p) {
      uint32_t v = 0;
      if (j < nr && p < full) {
        v = load_pair(row + 2 * p);
      } else if (j < nr && k0 + 2 * p < kdim) {
        v = row[2 * p];  // an odd tail: (last value, 0)
      }
      dst[p * kCols + j] = v;
    }
  }
}

// For a^T b (the operands' rows run over k): packs columns x0 .. x0+n-1 of src ([kdim, ld]
// bf16 bits) over k in [k0, k0 + kc) as k pairs, dst[p * width + x] = (src[k0 + 2p][x0 + x],
// src[k0 + 2p + 1][x0 + x]); columns in [n, width) and k past kdim are zero. width is a
// multiple of 32.
RLX_AVX512_BF16 void pack_columns(const uint16_t* src, int64_t ld, int64_t x0, int64_t n,
                                  int64_t width, int64_t k0, int64_t kc, int64_t kdim,
                                  uint32_t* dst) {
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int l = 0; l < 32; ++l) {  // result lane l: pair l / 2, from row l % 2
    lo_idx[l] = static_cast<uint16_t>((l % 2) * 32 + l / 2);
    hi_idx[l] = static_cast<uint16_t>((l % 2) * 32 + 16 + l / 2);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t p = 0; p < (kc + 1) / 2; ++p) {
    const int64_t k = k0 + 2 * p;
    const uint16_t* row0 = src + k * ld + x0;
    for (int64_t x = 0; x < width; x += 32) {
      const int64_t left = std::clamp<int64_t>(n - x, 0, 32);
      const __mmask32 mask = left == 32 ? ~0u : (1u << left) - 1;
      const __m512i r0 = _mm512_maskz_loadu_epi16(mask, row0 + x);
      const __m512i r1 =
          k + 1 < kdim ? _mm512_maskz_loadu_epi16(mask, row0 + ld + x) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + p * width + x, _mm512_permutex2var_epi16(r0, lo, r1));
      _mm512_storeu_si512(dst + p * width + x + 16, _mm512_permutex2var_epi16(r0, hi, r1));
    }
  }
}
}  // namespace isa_avx512bf16
#endif

#if RLX_HAVE_AVX512_BF16_PATH
namespace isa_avx512bf16 {
// Transposes the 8 x 8 block x (8 rows of 8 bf16) in place: x[j] becomes column j.
RLX_AVX512_BF16 inline __attribute__((always_inline)) void transpose_8x8(__m128i (&x)[8]) {
  __m128i a[8], b[8];
  for (int r = 0; r < 4; ++r) {
    a[2 * r] = _mm_unpacklo_epi16(x[2 * r], x[2 * r + 1]);
    a[2 * r + 1] = _mm_unpackhi_epi16(x[2 * r], x[2 * r + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3 (h = 0) and 4-7 (h = 1)
    b[4 * h + 0] = _mm_unpacklo_epi32(a[4 * h + 0], a[4 * h + 2]);
    b[4 * h + 1] = _mm_unpackhi_epi32(a[4 * h + 0], a[4 * h + 2]);
    b[4 * h + 2] = _mm_unpacklo_epi32(a[4 * h + 1], a[4 * h + 3]);
    b[4 * h + 3] = _mm_unpackhi_epi32(a[4 * h + 1], a[4 * h + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    x[2 * q] = _mm_unpacklo_epi64(b[q], b[4 + q]);
    x[2 * q + 1] = _mm_unpackhi_epi64(b[q], b[4 + q]);
  }
}

// transpose_8x8 on each of the four 128-bit lanes of x at once.
RLX_AVX512_BF16 inline __attribute__((always_inline)) void transpose_8x8_lanes(__m512i (&x)[8]) {
  __m512i a[8], b[8];
  for (int r = 0; r < 4; ++r) {
    a[2 * r] = _mm512_unpacklo_epi16(x[2 * r], x[2 * r + 1]);
    a[2 * r + 1] = _mm512_unpackhi_epi16(x[2 * r], x[2 * r + 1]);
  }
  for (int h = 0; h < 2; ++h) {
    b[4 * h + 0] = _mm512_unpacklo_epi32(a[4 * h + 0], a[4 * h + 2]);
    b[4 * h + 1] = _mm512_unpackhi_epi32(a[4 * h + 0], a[4 * h + 2]);
    b[4 * h + 2] = _mm512_unpacklo_epi32(a[4 * h + 1], a[4 * h + 3]);
    b[4 * h + 3] = _mm512_unpackhi_epi32(a[4 * h + 1], a[4 * h + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    x[2 * q] = _mm512_unpacklo_epi64(b[q], b[4 + q]);
    x[2 * q + 1] = _mm512_unpackhi_epi64(b[q], b[4 + q]);
  }
}

// Writes the panel's entries on and above the diagonal, out[i][j] = alpha acc + beta c
// (rounded to nearest even; the bf16 conversion treats float32 denormals as zero), and
// their mirror images out[j][i], the latter as transposed 8 x 8 blocks.
RLX_AVX512_BF16 void epilogue(const float* acc, const uint16_t* c, uint16_t* out, int64_t m,
                              int64_t j0, int64_t nr, float alpha, float beta, float diag) {
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  const int64_t i_end = j0 + nr;
  const uint32_t panel_mask = nr == kCols ? ~0u : (1u << nr) - 1;
  alignas(64) uint16_t tile[kRows][kCols] = {};
  for (int64_t i0 = 0; i0 < i_end; i0 += kRows) {
    const int64_t rows = std::min(kRows, i_end - i0);
    if (nr == kCols && i0 + kRows <= j0) {
      // Every entry of these rows lies above the diagonal and mirrors into a whole 8 x 8
      // block: no masks, no diagonal.
      __m512i rows_bits[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t i = i0 + r;
        __m512 v[2];
        for (int64_t h = 0; h < 2; ++h) {
          v[h] = _mm512_mul_ps(va, _mm512_loadu_ps(acc + i * kCols + 16 * h));
          if (c) {
            const __m256i cb =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i * m + j0 + 16 * h));
            const __m512 cf =
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(cb), 16));
            v[h] = _mm512_fmadd_ps(vb, cf, v[h]);
          }
        }
        rows_bits[r] = _mm512_inserti64x4(
            _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v[0])),
            (__m256i)_mm512_cvtneps_pbh(v[1]), 1);
        _mm512_storeu_si512(out + i * m + j0, rows_bits[r]);
      }
      // Each 128-bit lane L of row_bits[r] holds columns 8 L .. 8 L + 7 of row r: transposing
      // the four 8 x 8 blocks at once leaves column 8 L + jj of the 8 rows in lane L of
      // rows_bits[jj].
      transpose_8x8_lanes(rows_bits);
      for (int64_t jj = 0; jj < 8; ++jj) {
        uint16_t* o = out + (j0 + jj) * m + i0;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm512_castsi512_si128(rows_bits[jj]));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 8 * m),
                         _mm512_extracti32x4_epi32(rows_bits[jj], 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16 * m),
                         _mm512_extracti32x4_epi32(rows_bits[jj], 2));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 24 * m),
                         _mm512_extracti32x4_epi32(rows_bits[jj], 3));
      }
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      __m256i half[2];
      for (int64_t h = 0; h < 2; ++h) {
        __m512 v = _mm512_mul_ps(va, _mm512_loadu_ps(acc + i * kCols + 16 * h));
        if (c) {
          const __mmask16 cm = static_cast<__mmask16>(panel_mask >> (16 * h));
          const __m256i cb = _mm256_maskz_loadu_epi16(cm, c + i * m + j0 + 16 * h);
          const __m512 cf =
              _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(cb), 16));
          v = _mm512_fmadd_ps(vb, cf, v);
        }
        const int64_t d = i - j0 - 16 * h;  // the diagonal's lane in this half, if any
        if (d >= 0 && d < 16) {
          v = _mm512_mask_add_ps(v, static_cast<__mmask16>(1u << d), v, _mm512_set1_ps(diag));
        }
        half[h] = (__m256i)_mm512_cvtneps_pbh(v);
      }
      const __m512i bits = _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1);
      _mm512_store_si512(tile[r], bits);
      const int64_t first = std::max<int64_t>(i - j0, 0);  // columns j >= i
      const uint32_t upper = first >= kCols ? 0u : panel_mask & (~0u << first);
      _mm512_mask_storeu_epi16(out + i * m + j0, upper, bits);
    }
    // Mirror: out[j][i] for i < j, one 8 x 8 block of columns at a time.
    for (int64_t jb = 0; jb < nr; jb += 8) {
      if (j0 + jb + 7 <= i0) continue;  // every j of the block is <= every i of the rows
      __m128i x[8];
      for (int r = 0; r < 8; ++r) x[r] = _mm_load_si128(reinterpret_cast<__m128i*>(&tile[r][jb]));
      transpose_8x8(x);
      for (int64_t jj = 0; jj < 8 && jb + jj < nr; ++jj) {
        const int64_t j = j0 + jb + jj;
        // rows r < rows with i0 + r < j
        const int64_t below = std::clamp<int64_t>(j - i0, 0, rows);
        if (below > 0) {
          _mm_mask_storeu_epi16(out + j * m + i0, static_cast<__mmask8>((1u << below) - 1),
                                x[jj]);
        }
      }
    }
  }
}
}  // namespace isa_avx512bf16
#endif

// Operands are packed once per matrix and thread, a panel of kCols rows (of a, b; columns
// for `transposed`, where a and b are [kdim, m] and the product is a^T b) at a time, over the
// whole k: panel q holds pairs (p, x) at [q][p][x] (pack_rows / pack_columns), zero past m and
// past kdim. The same layout serves both sides of a tile: b's panel gives the tile's vectors
// and a's panel the broadcast pairs of its rows, so neither needs masking or odd-k care. For
// X X^T (a and b the same data) one packed copy serves both.
struct Scratch {
  std::vector<float> acc;        // the panel's float32 sums, [rows, kCols]
  std::vector<uint32_t> pa, pb;  // packed a and b, [panels][pairs][kCols]
  std::vector<char> have_a, have_b;
  int64_t n = -1;                // the matrix whose panels pa, pb hold
};

struct Problem {
  const uint16_t *a, *b, *c;
  uint16_t* out;
  int64_t m, kdim, panels, pairs;
  bool transposed, same;  // same: a and b hold the same data
  float alpha, beta, diag;
};

#if RLX_HAVE_AVX512_BF16_PATH
// Makes panel q of operand src (matrix n) present in dst.
void ensure_packed(const Problem& pr, const uint16_t* src, std::vector<uint32_t>& dst,
                   std::vector<char>& have, int64_t q) {
  using namespace isa_avx512bf16;
  if (have[q]) return;
  const int64_t x0 = q * kCols, nr = std::min(kCols, pr.m - x0);
  uint32_t* d = dst.data() + q * pr.pairs * kCols;
  if (pr.transposed) {
    pack_columns(src, pr.m, x0, nr, kCols, 0, pr.kdim, pr.kdim, d);
  } else {
    pack_rows(src + x0 * pr.kdim, pr.kdim, nr, 0, pr.kdim, pr.kdim, d);
  }
  have[q] = 1;
}
#endif

// One column panel [j0, j0 + nr) of matrix n: the rows i < j0 + nr (all tiles that hold an
// upper-triangle entry of the panel), then the epilogue writes out[i][j] and out[j][i] for
// i <= j. Panels write disjoint entries, so they run in parallel.
void panel(const Problem& pr, int64_t n, int64_t pj, Scratch& s) {
#if RLX_HAVE_AVX512_BF16_PATH
  using namespace isa_avx512bf16;
  const int64_t m = pr.m, j0 = pj * kCols, nr = std::min(kCols, m - j0), i_end = j0 + nr;
  const uint16_t* a = pr.a + n * m * pr.kdim;
  const uint16_t* b = pr.b + n * m * pr.kdim;
  if (s.n != n) {
    std::fill(s.have_a.begin(), s.have_a.end(), 0);
    std::fill(s.have_b.begin(), s.have_b.end(), 0);
    s.n = n;
  }
  std::vector<uint32_t>& pa = pr.same ? s.pb : s.pa;
  std::vector<char>& have_a = pr.same ? s.have_b : s.have_a;
  ensure_packed(pr, b, s.pb, s.have_b, pj);
  for (int64_t q = 0; q <= pj; ++q) ensure_packed(pr, a, pa, have_a, q);
  const int64_t P = pr.pairs, panel_size = P * kCols;
  const uint32_t* bp = s.pb.data() + pj * panel_size;
  for (int64_t p0 = 0; p0 < P; p0 += kBlockK / 2) {
    const int64_t np = std::min(kBlockK / 2, P - p0);
    for (int64_t i0 = 0; i0 < i_end; i0 += kRows) {
      const uint32_t* ap = pa.data() + (i0 / kCols) * panel_size + i0 % kCols;
      any_tile(i0, j0, ap + p0 * kCols, bp + p0 * kCols, np, &s.acc[i0 * kCols], p0 > 0);
    }
  }
  epilogue(s.acc.data(), pr.c ? pr.c + n * m * m : nullptr, pr.out + n * m * m, m, j0, nr,
           pr.alpha, pr.beta, pr.diag);
#endif
}

// Tasks [begin, end) of the N * panels (matrix, panel) pairs, on one thread.
void run_tasks(const Problem& pr, int64_t begin, int64_t end) {
  // Kept per thread: fresh buffers were page-faulted in on every call.
  static thread_local Scratch s;
  const int64_t m_pad = pr.panels * kCols, packed = pr.panels * pr.pairs * kCols;
  if (s.acc.size() < size_t(m_pad * kCols)) s.acc.resize(m_pad * kCols);
  if (s.pb.size() < size_t(packed)) s.pb.resize(packed);
  if (!pr.same && s.pa.size() < size_t(packed)) s.pa.resize(packed);
  s.have_a.assign(pr.panels, 0);
  s.have_b.assign(pr.panels, 0);
  s.n = -1;
  for (int64_t t = begin; t < end; ++t) {
    // Panels far right hold the most tiles: interleave small and large ones so that the
    // contiguous task ranges of the threads get similar work even for one matrix.
    const int64_t n = t / pr.panels, r = t % pr.panels;
    const int64_t pj = r % 2 == 0 ? r / 2 : pr.panels - 1 - r / 2;
    panel(pr, n, pj, s);
  }
  // Packed operands are copies of whole matrices: keep them between calls only when small
  // (Muon's m = 256, k = 1024 needs 512 KiB each).
  if (size_t(packed) > kKeepPacked) {
    std::vector<uint32_t>().swap(s.pa);
    std::vector<uint32_t>().swap(s.pb);
  }
}

void check_operands(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& c,
                    bool transposed) {
  const char* op = "rlx::symmetric_matmul";
  TORCH_CHECK(a.dim() == 3, op, ": a must be ", transposed ? "[N, k, m]" : "[N, m, k]",
              ", got shape ", a.sizes());
  TORCH_CHECK(b.sizes() == a.sizes(), op, ": b must have a's shape ", a.sizes(), ", got ",
              b.sizes());
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16, op,
              ": a and b must be bfloat16, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), op, ": a and b must be CPU tensors");
  if (c.has_value()) {
    const int64_t m = a.size(transposed ? 2 : 1);
    TORCH_CHECK(c->dim() == 3 && c->size(0) == a.size(0) && c->size(1) == m && c->size(2) == m,
                op, ": c must be [N, m, m] = [", a.size(0), ", ", m, ", ", m, "], got shape ",
                c->sizes());
    TORCH_CHECK(c->scalar_type() == at::kBFloat16 && c->device().is_cpu(), op,
                ": c must be a bfloat16 CPU tensor, got ", c->scalar_type(), " on ",
                c->device());
  }
}

// The upper triangle of x, mirrored.
at::Tensor symmetrize_upper(const at::Tensor& x) { return x.triu().add_(x.triu(1).mT()); }

// out must be a contiguous bf16 CPU tensor of the result's shape that shares no memory with
// a, b or c (the kernel reads a and b's rows while it writes mirrored tiles of out).
void check_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
               const std::optional<at::Tensor>& c, int64_t N, int64_t m) {
  const char* op = "rlx::symmetric_matmul";
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.device().is_cpu(), op,
              ": out must be a bfloat16 CPU tensor, got ", out.scalar_type(), " on ",
              out.device());
  TORCH_CHECK(out.dim() == 3 && out.size(0) == N && out.size(1) == m && out.size(2) == m, op,
              ": out must be [N, m, m] = [", N, ", ", m, ", ", m, "], got shape ", out.sizes());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  for (const at::Tensor* t : {&a, &b, c ? &*c : nullptr}) {
    if (t == nullptr) continue;
    // (TooHard: a strided operand; then any shared storage counts as sharing)
    const at::MemOverlapStatus status = at::get_overlap_status(out, *t);
    TORCH_CHECK(status == at::MemOverlapStatus::No ||
                    (status == at::MemOverlapStatus::TooHard &&
                     !out.storage().is_alias_of(t->storage())),
                op, ": out must not share memory with a, b or c");
  }
}

void symmetric_matmul_out_cpu(const at::Tensor& a_in, const at::Tensor& b_in,
                              const std::optional<at::Tensor>& c_in, double alpha, double beta,
                              bool transposed, double diag, const at::Tensor& out) {
  check_operands(a_in, b_in, c_in, transposed);
  const int64_t N = a_in.size(0), m = a_in.size(transposed ? 2 : 1);
  const int64_t kdim = a_in.size(transposed ? 1 : 2);
  check_out(out, a_in, b_in, c_in, N, m);
  if (!cpu_has_avx512_bf16()) {
    // The same arithmetic as the native path: products of bf16 values summed in float32,
    // beta c and diag added in float32, one rounding to bf16 at the end (a bf16 baddbmm
    // followed by a bf16 diagonal add would round the diagonal twice).
    const at::Tensor a = a_in.to(at::kFloat), b = b_in.to(at::kFloat);
    const at::Tensor lhs = transposed ? a.mT() : a, rhs = transposed ? b : b.mT();
    at::Tensor full = c_in.has_value() ? at::baddbmm(c_in->to(at::kFloat), lhs, rhs, beta, alpha)
                                       : at::bmm(lhs, rhs).mul_(alpha);
    full.diagonal(0, -2, -1).add_(diag);
    out.copy_(symmetrize_upper(full));
    return;
  }
  if (N == 0 || m == 0) return;
  if (kdim == 0) {  // a b^T = 0
    at::Tensor full = c_in ? symmetrize_upper(c_in->to(at::kFloat)).mul_(beta)
                           : at::zeros({N, m, m}, a_in.options().dtype(at::kFloat));
    full.diagonal(0, -2, -1).add_(diag);
    out.copy_(full);  // one rounding, as in the epilogue
    return;
  }
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  const std::optional<at::Tensor> c =
      c_in.has_value() ? std::optional<at::Tensor>(c_in->contiguous()) : std::nullopt;
  const auto* pa = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  const auto* pb = reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>());
  const auto* pc = c ? reinterpret_cast<const uint16_t*>(c->data_ptr<at::BFloat16>()) : nullptr;
  auto* po = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t panels = (m + kCols - 1) / kCols;
  const Problem pr{pa, pb, pc, po, m, kdim, panels, (kdim + 1) / 2, transposed,
                   pa == pb, static_cast<float>(alpha), static_cast<float>(beta),
                   static_cast<float>(diag)};
  at::parallel_for(0, N * panels, 1,
                   [&](int64_t begin, int64_t end) { run_tasks(pr, begin, end); });
}

at::Tensor symmetric_matmul_cpu(const at::Tensor& a, const at::Tensor& b,
                                const std::optional<at::Tensor>& c, double alpha, double beta,
                                bool transposed, double diag) {
  check_operands(a, b, c, transposed);
  const int64_t m = a.size(transposed ? 2 : 1);
  at::Tensor out = at::empty({a.size(0), m, m}, a.options());
  symmetric_matmul_out_cpu(a, b, c, alpha, beta, transposed, diag, out);
  return out;
}

bool symmetric_matmul_is_native() { return cpu_has_avx512_bf16(); }

}  // namespace
}  // namespace rlx

TORCH_LIBRARY_IMPL(rlx, CPU, m) {
  m.impl("symmetric_matmul", &rlx::symmetric_matmul_cpu);
  m.impl("symmetric_matmul_out", &rlx::symmetric_matmul_out_cpu);
}

TORCH_LIBRARY_IMPL(rlx, CompositeImplicitAutograd, m) {
  m.impl("symmetric_matmul_is_native", &rlx::symmetric_matmul_is_native);
}
