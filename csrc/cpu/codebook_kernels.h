// The codebook matmul's CPU kernels: their entry points, which each ISA copy defines
// (cpu_isa.h), and the host code's parts that both the 8-bit ops (codebook.cpp,
// codebook_backward.cpp) and the 16-bit ones (codebook_gather.cpp) use: the path choices,
// the codebook in the accumulation type, the dense path (dequantized tiles + at::mm) and the
// index check. Included before the ISA region, so that nothing here is compiled for AVX2.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <rlx/codebook.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

#include "cpu_isa.h"

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace rlx::codebook::cpu {

inline constexpr int64_t kLutBlockBytes = 256 * 1024;       // table block per work item: stays in L2
inline constexpr int64_t kLutBlockBytesOneRow = 32 * 1024;  // one-row tables (see below)
inline constexpr int64_t kDenseTileBytes = 4 << 20;    // dequantized weight tile (dense path)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The forward's batch-tile table block: a quarter of the core's L2 where that is more than
// kLutBlockBytes. With 2 MiB of L2 (Sapphire Rapids) 512 KiB blocks ran the 16- and 256-row
// forwards 6-15% and 19-25% faster than 256 KiB ones (1 MiB: between the two, 2 MiB: slower
// than both; N = K = 4096, one thread); with 1 MiB or less it stays at kLutBlockBytes. The
// block size sets the K chunks of a call, so sums are grouped alike on machines with the same
// L2 size (and, as before, for any thread count).
inline int64_t forward_lut_block_bytes() {
  static const int64_t bytes = [] {
    int64_t l2 = 0;
#if defined(_SC_LEVEL2_CACHE_SIZE)
    l2 = std::max<int64_t>(0, sysconf(_SC_LEVEL2_CACHE_SIZE));
#endif
    return std::max<int64_t>(kLutBlockBytes, l2 / 4);
  }();
  return bytes;
}

// Groups per table block: the block [groups][M][E][BT] of acc_t stays near `block_bytes`.
inline int64_t groups_per_block(const Dims& d, int64_t bt, int64_t acc_size,
                                int64_t block_bytes = kLutBlockBytes) {
  const int64_t per_group = d.num_codebooks * d.num_entries * bt * acc_size;
  // (The forward's one-row tiles have their own blocking, codebook_one_row.h; the one-row
  // block below is the backward's.)
  // One batch row reads 4 bytes of a table line per lookup: an L1-sized block (32 groups for
  // E = 256 float entries). Each pass over the rows then reads half of each 64-byte index
  // line, the other half comes from L2 on the next pass; with the index rows prefetched ahead
  // this measured fastest (1 row, 1 thread, N = K = 4096: 0.72 ms against 0.77 for 24 KiB,
  // 0.85-1.04 for 16 KiB and 0.88-0.95 for 64 KiB).
  const int64_t bytes = bt == 1 ? kLutBlockBytesOneRow : block_bytes;
  return std::clamp<int64_t>(bytes / per_group, 1, std::max<int64_t>(d.groups, 1));
}

// Fixed (thread-count independent) partition of the groups into blocks for the lookup-table
// backward: each block's dcodebook partial is summed in block order, so results never depend
// on scheduling.
inline int64_t backward_groups_per_block(const Dims& d, int64_t bt, int64_t acc_size) {
  return std::min(groups_per_block(d, bt, acc_size), std::max<int64_t>(1, ceil_div(d.groups, 16)));
}

// Calls f(BT, JT), each a std::integral_constant<int, ...>, with the tile shape suited to B rows.
template <typename F>
void with_tile_shape(int64_t B, F&& f) {
  if (B <= 2) {
    f(std::integral_constant<int, 1>{}, std::integral_constant<int, 8>{});
  } else if (B <= 8) {
    f(std::integral_constant<int, 8>{}, std::integral_constant<int, 4>{});
  } else if (B <= 24) {
    f(std::integral_constant<int, 16>{}, std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 32>{}, std::integral_constant<int, 1>{});
  }
}

// The tile rows (BT) with_tile_shape picks for B rows.
inline int64_t tile_rows(int64_t B) {
  int64_t bt = 0;
  with_tile_shape(B, [&](auto BT, auto) { bt = BT; });
  return bt;
}

// The LUT costs about E*M table FMAs plus N*M/D gathered adds per (row, input feature);
// the dense path N FMAs at GEMM speed plus dequantizing the weight once. Weights measured on
// an AVX2 machine: a table FMA ~1/16, a gathered add ~1/8, a GEMM FMA ~1/24 cycle.
inline bool use_dense(const Dims& d) {
  if (d.rows < 64) return false;
  const double M = static_cast<double>(d.num_codebooks);
  const double lut = d.num_entries * M / 16.0 + d.out_features * M / (8.0 * d.entry_dim);
  const double dense = d.out_features / 24.0 + d.out_features * M / (4.0 * d.rows);
  return lut > dense;
}

inline int64_t dense_tile_rows(const Dims& d, int64_t acc_size) {
  return std::max<int64_t>(64, kDenseTileBytes / std::max<int64_t>(d.in_features * acc_size, 1));
}

RLX_ISA_DECLARE(
    // The lookup-table forward (codebook.cpp) for B = d.rows rows, in the tile shape
    // with_tile_shape picks: out[b, j] = s_j * raw[b, j] + bias_j (scales, bias may be null;
    // out_t is scalar_t, or acc_t for raw sums). cb: [M][E][D] in acc_t, cbT: [M][D][E]
    // (unread, and may be null, for one-row tiles: tile_rows(B) == 1).
    template <typename scalar_t, typename acc_t, typename out_t>
    void lut_forward_rows(const Dims& d, const scalar_t* x, const uint8_t* idx, const acc_t* cb,
                          const acc_t* cbT, const scalar_t* scales, const scalar_t* bias,
                          out_t* out);

    // The lookup-table backward (codebook_backward.cpp): dx (or null) and per-block
    // dcodebook partials dc_parts (or null; gpb = backward_groups_per_block(d, tile_rows(B),
    // sizeof(acc_t)) groups a block); mask_dx / mask_dc: skip the entries no index selects.
    template <typename scalar_t, typename acc_t>
    void lut_backward_rows(const Dims& d, const scalar_t* grad, const scalar_t* x,
                           const uint8_t* idx, const acc_t* cbT, const scalar_t* scales,
                           scalar_t* dx, acc_t* dc_parts, int64_t gpb, bool mask_dx,
                           bool mask_dc);

    // W[j - j0, g*D + t] = sum_m C[m, idx[j, g, m], t] for rows [j0, j1) (W: [j1 - j0, K]).
    // index_t: uint8_t, or uint16_t for 16-bit indices (range-checked by the caller).
    template <typename acc_t, typename index_t>
    void dequantize_rows(const Dims& d, const index_t* idx, const acc_t* cb, int64_t j0,
                         int64_t j1, acc_t* W);

    // The dense backward's dcodebook: rows [j0, j1) of dW ([j1 - j0, K]) scattered into the
    // partials of blocks of gpb groups (dc_parts: [blocks][M][E][D]).
    template <typename acc_t, typename index_t>
    void scatter_weight_grad(const Dims& d, const acc_t* dw, const index_t* idx, int64_t j0,
                             int64_t j1, int64_t gpb, acc_t* dc_parts);

    // The gather kernels for 16-bit indices (codebook_gather.cpp) for d.rows <=
    // kMaxGatherBatch rows; each returns the largest index >= E it skipped, or -1.
    // raw [B, N] = the unscaled forward sums; x [B, K], cb [M, E, D], all acc_t, contiguous.
    template <typename acc_t>
    int64_t gather_forward_rows(const Dims& d, const acc_t* x, const uint16_t* idx,
                                const acc_t* cb, acc_t* raw);
    // The same from a float16 (bf16 false) or bfloat16 codebook's bits read as they are
    // (D = 8, float32 x and raw), where half_gather_supported(bf16).
    bool half_gather_supported(bool bf16);
    int64_t gather_forward_half_rows(const Dims& d, const float* x, const uint16_t* idx,
                                     const uint16_t* cb, bool bf16, float* raw);
    // dx ([B, K], or null) and dcodebook partials ([chunks][M*E*D], zeroed, or null), chunks
    // = gather_backward_chunks(d, sizeof(acc_t), dc_parts != null); gs = dout * s [B, N].
    template <typename acc_t>
    int64_t gather_backward_rows(const Dims& d, const acc_t* gs, const acc_t* x,
                                 const uint16_t* idx, const acc_t* cb, acc_t* dx,
                                 acc_t* dc_parts, int64_t chunks);)

// Codebook in the accumulation type, as [M][E][D] and transposed [M][D][E].
template <typename acc_t>
struct CodebookAcc {
  at::Tensor cb, cbT;
  // transposed: also build cbT (the lookup-table kernels use it; the gather kernels do not).
  CodebookAcc(const at::Tensor& codebook, const Dims& d, bool transposed = true) {
    if (!transposed && codebook.scalar_type() == c10::CppTypeToScalarType<acc_t>::value &&
        codebook.is_contiguous()) {
      // Already [M][E][D] in memory ([E][D] for M = 1): no torch calls, which are a visible
      // part of a one-row forward right after a large GEMM has evicted their code and data.
      cb = codebook;
      return;
    }
    auto c = codebook.reshape({d.num_codebooks, d.num_entries, d.entry_dim})
                 .to(c10::CppTypeToScalarType<acc_t>::value);
    cb = c.contiguous();
    if (transposed) cbT = c.transpose(1, 2).contiguous();
  }
  const acc_t* data() const { return cb.data_ptr<acc_t>(); }
  const acc_t* dataT() const { return cbT.data_ptr<acc_t>(); }
};

// Rows [j0, j1) of the dequantized weight, in acc_t.
template <typename acc_t, typename index_t>
at::Tensor dequantized_rows(const Dims& d, const index_t* idx, const acc_t* cb, int64_t j0,
                            int64_t j1) {
  at::Tensor W =
      at::empty({j1 - j0, d.in_features}, at::dtype(c10::CppTypeToScalarType<acc_t>::value));
  RLX_ISA_CALL(dequantize_rows<acc_t, index_t>)(d, idx, cb, j0, j1, W.data_ptr<acc_t>());
  return W;
}

// raw[b, j] = sum_k x[b, k] W[j, k] in the accumulation dtype, one weight tile at a time.
template <typename acc_t, typename index_t>
at::Tensor dense_raw(const Dims& d, const at::Tensor& x_acc, const index_t* idx, const acc_t* cb) {
  auto rawT = at::empty({d.out_features, d.rows}, x_acc.options());
  const int64_t tile = dense_tile_rows(d, sizeof(acc_t));
  for (int64_t j0 = 0; j0 < d.out_features; j0 += tile) {
    const int64_t j1 = std::min(d.out_features, j0 + tile);
    auto dst = rawT.narrow(0, j0, j1 - j0);
    at::mm_out(dst, dequantized_rows<acc_t>(d, idx, cb, j0, j1), x_acc.t());
  }
  return rawT.t();
}

// Dense backward for large batches: per weight tile, dx += gs @ W and dW = gs^T @ x, whose
// rows are scattered into per-block dcodebook partials.
template <typename acc_t, typename index_t>
void dense_backward(const Dims& d, const at::Tensor& gs, const at::Tensor& x_acc,
                    const index_t* idx, const acc_t* cb, at::Tensor* dx_acc, acc_t* dc_parts,
                    int64_t gpb) {
  const int64_t tile = dense_tile_rows(d, sizeof(acc_t));
  for (int64_t j0 = 0; j0 < d.out_features; j0 += tile) {
    const int64_t j1 = std::min(d.out_features, j0 + tile);
    const at::Tensor g_tile = gs.narrow(1, j0, j1 - j0);
    if (dx_acc) dx_acc->addmm_(g_tile, dequantized_rows<acc_t>(d, idx, cb, j0, j1));
    if (!dc_parts) continue;
    const at::Tensor dW = at::mm(g_tile.t(), x_acc);
    RLX_ISA_CALL(scatter_weight_grad<acc_t, index_t>)(d, dW.data_ptr<acc_t>(), idx, j0, j1, gpb,
                                                      dc_parts);
  }
}

inline constexpr int64_t kMaxGatherBatch = 16;  // the gather path's batch limit (else dense)

// 16-bit indices: the gather kernels up to kMaxGatherBatch rows, the dense path above.
inline bool use_gather_dense(const Dims& d) { return d.rows > kMaxGatherBatch; }

// Group chunks of the gather backward: each owns its dx columns and one dC partial. The count
// depends on the shape alone (deterministic); partials are capped at 64 MiB in all.
inline int64_t gather_backward_chunks(const Dims& d, int64_t acc_size, bool want_dc) {
  const int64_t by_groups = std::max<int64_t>(1, std::min<int64_t>(4, ceil_div(d.groups, 16)));
  if (!want_dc) return std::max<int64_t>(1, std::min<int64_t>(d.groups, 64));
  const int64_t med_bytes = d.num_codebooks * d.num_entries * d.entry_dim * acc_size;
  const int64_t by_memory = std::max<int64_t>(1, (int64_t(64) << 20) / std::max<int64_t>(med_bytes, 1));
  return std::min(by_groups, by_memory);
}

// Raises for bad_index >= 0, the largest index >= E a kernel found.
inline void raise_if_bad_index(int64_t bad_index, const Dims& d) {
  TORCH_CHECK_VALUE(bad_index < 0, "codebook_matmul: indices must be < E=", d.num_entries,
                    " (the number of codebook entries), found ", bad_index);
}

// The ops for 16-bit indices (codebook_gather.cpp), after the checks.
at::Tensor gather_forward_op(const at::Tensor& x, const at::Tensor& indices,
                             const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
                             const std::optional<at::Tensor>& bias, const Dims& d);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gather_backward_op(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& indices,
    const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
    std::array<bool, 4> mask, const Dims& d);

// t in float32 (the host code's copies of 16-bit inputs), or nullopt.
inline std::optional<at::Tensor> to_float(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return t;
  return t->to(at::kFloat);
}

// E < 256 leaves uint8 values that would read past the codebook; 256 entries cannot overflow.
inline void check_index_range(const at::Tensor& indices, const Dims& d) {
  if (d.num_entries >= 256 || indices.numel() == 0) return;
  const int64_t top = indices.max().item<uint8_t>();
  TORCH_CHECK_VALUE(top < d.num_entries, "codebook_matmul: indices must be < E=", d.num_entries,
                    " (the number of codebook entries), found ", top);
}

}  // namespace rlx::codebook::cpu
