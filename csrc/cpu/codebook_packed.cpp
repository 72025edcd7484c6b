// rlx::codebook_pack_indices and rlx::codebook_matmul_packed on CPU: the 16-bit codebook
// forward through an index layout built once per weight (codebook_packed.h describes it).
// The packed op covers float32 x, D = 8, one codebook and up to kPackedMaxRows batch rows;
// any other call of it (float64 or 16-bit x, more rows) runs rlx::codebook_matmul, so the
// op gives the plain op's result in every case. Its backward is the plain op's backward
// (rlx_torch/ops/_codebook_packed.py).
#include "cpu_kernel_deps.h"
#include "codebook_kernels.h"
#include "codebook_packed.h"

#include <ATen/core/dispatch/Dispatcher.h>

#if defined(__x86_64__) && RLX_ISA_AVX && (defined(__GNUC__) || defined(__clang__))
#define RLX_PACKED_HALF 1
#define RLX_PACKED_HALF_TARGET __attribute__((target("avx2,fma,f16c")))
#define RLX_PACKED_TILE_TARGET RLX_PACKED_HALF_TARGET
#endif

RLX_ISA_BEGIN
#include "codebook_packed_kernel.h"

namespace rlx::codebook::cpu::RLX_ISA_NS {
namespace {

// make_load(first entry) -> the slice's loader; next_slice(s), slice_bytes(s): the bytes of
// slice s, for the kernel's prefetches.
template <typename Entry, typename Load>
struct SliceLoads {
  const Entry* cb;
  int64_t slice, entries;
  Load operator()(int64_t base) const { return Load{cb + base * 8}; }
  const char* next_slice(int64_t s) const {
    return reinterpret_cast<const char*>(cb + s * slice * 8);
  }
  int64_t slice_bytes(int64_t s) const {
    return (std::min(entries, (s + 1) * slice) - s * slice) * 8 * int64_t(sizeof(Entry));
  }
};

#ifdef RLX_PACKED_HALF
// A float16 (vcvtph2ps) or bfloat16 (16-bit shift) entry widened to float32: exact, and the
// slice a block reads is half the bytes of a float32 copy.
template <bool Bf16>
struct LoadHalf {
  const uint16_t* cb;
  RLX_PACKED_HALF_TARGET V8 operator()(uint32_t code) const {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + int64_t(code) * 8));
    const __m256 c = Bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                          : _mm256_cvtph_ps(h);
    V8 out;
    std::memcpy(&out, &c, sizeof(out));
    return out;
  }
};

template <int BT, bool Bf16>
RLX_PACKED_HALF_TARGET void tile_half(const PackedView& v, const float* xt, float* dst,
                                      const uint16_t* cb) {
  packed_forward_tile<BT>(
      v, xt, dst, v.rows,
      SliceLoads<uint16_t, LoadHalf<Bf16>>{cb, v.slice_entries, v.entries});
}
#endif

}  // namespace

bool packed_reads_half(int cb_half) {
#ifdef RLX_PACKED_HALF
  return cb_half == 2 || (cb_half == 1 && rlx::cpu_has_f16c());
#else
  (void)cb_half;
  return false;
#endif
}

void packed_forward(const int32_t* packed, const float* x, int64_t B, const void* cb,
                    int cb_half, float* raw) {
  const PackedView v = packed_view(packed);
  (void)cb_half;  // read only where this copy has the float16/bfloat16 loaders
  if (B == 0 || v.rows == 0) return;
  packed_forward_tiles(v, x, B, raw, [&](auto bt, const float* xt, float* dst) {
    constexpr int BT = decltype(bt)::value;
#ifdef RLX_PACKED_HALF
    const auto* h = static_cast<const uint16_t*>(cb);
    if (cb_half == 1) return tile_half<BT, false>(v, xt, dst, h);
    if (cb_half == 2) return tile_half<BT, true>(v, xt, dst, h);
#endif
    const auto* f = static_cast<const float*>(cb);
    packed_forward_tile<BT>(v, xt, dst, v.rows,
                            SliceLoads<float, LoadFloat>{f, v.slice_entries, v.entries});
  });
}

}  // namespace rlx::codebook::cpu::RLX_ISA_NS
RLX_ISA_END

#if !defined(RLX_ISA_AVX2_COPY)
// The ops: host code, compiled once.
namespace rlx::codebook::cpu {
namespace {

// Slices of 8192 entries (128 KiB of float16, 256 KiB of float32) stay in a 512 KiB L2 while a
// block reads them at random; longer slices mean longer runs (less padding, fewer horizontal
// sums). Blocks of 512 rows: each block reads the whole table once, and 8 blocks at N = 4096
// still let a free thread take over the work of a busy one.
constexpr int64_t kDefaultSliceEntries = 8192;
constexpr int64_t kDefaultBlockRows = 512;

// One block's runs and entries, slice by slice.
struct BlockParts {
  std::vector<uint32_t> runs, codes;
  std::vector<int32_t> seg_runs, seg_codes;  // per slice
};

BlockParts pack_block(const uint16_t* idx, int64_t n0, int64_t n1, int64_t G, int64_t slice,
                      int64_t slices) {
  BlockParts p;
  std::vector<std::vector<uint32_t>> buckets(slices);  // g << 16 | local code, by (n, g)
  std::vector<std::vector<int32_t>> row_ends(slices);  // bucket end of each row
  for (auto& r : row_ends) r.reserve(n1 - n0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = idx + n * G;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t s = row[g] / slice;
      buckets[s].push_back(uint32_t(g) << 16 | uint32_t(row[g] - s * slice));
    }
    for (int64_t s = 0; s < slices; ++s) row_ends[s].push_back(int32_t(buckets[s].size()));
  }
  for (int64_t s = 0; s < slices; ++s) {
    p.seg_runs.push_back(int32_t(p.runs.size()));
    p.seg_codes.push_back(int32_t(p.codes.size()));
    int32_t begin = 0;
    for (int64_t n = n0; n < n1; ++n) {
      const int32_t end = row_ends[s][n - n0];
      if (end == begin) continue;
      const uint32_t pad = uint32_t(G) << 16 | (buckets[s][begin] & 0xffff);
      int64_t count = end - begin;
      p.codes.insert(p.codes.end(), buckets[s].begin() + begin, buckets[s].begin() + end);
      for (; count % 8; ++count) p.codes.push_back(pad);
      for (int64_t groups = count / 8; groups > 0; groups -= 0xffff)
        p.runs.push_back(uint32_t(n - n0) << 16 | uint32_t(std::min<int64_t>(groups, 0xffff)));
      begin = end;
    }
  }
  return p;
}

at::Tensor pack_indices_cpu(const at::Tensor& indices, int64_t num_entries,
                            int64_t slice_entries, int64_t block_rows) {
  const auto it = indices.scalar_type();
  TORCH_CHECK_VALUE(it == at::kShort || it == at::kUInt16,
                    "codebook_pack_indices: indices must be int16 or uint16, got ", it);
  TORCH_CHECK_VALUE(indices.dim() == 2,
                    "codebook_pack_indices: indices must have shape [N, K/D] (one codebook), got ",
                    indices.sizes());
  TORCH_CHECK_VALUE(num_entries >= 1 && num_entries <= 65536,
                    "codebook_pack_indices: num_entries must be in [1, 65536], got ", num_entries);
  const int64_t N = indices.size(0), G = indices.size(1);
  TORCH_CHECK_VALUE(G < 65536, "codebook_pack_indices: indices must have fewer than 65536 "
                    "groups K/D, got ", G);
  if (slice_entries == 0) slice_entries = kDefaultSliceEntries;
  if (block_rows == 0) block_rows = kDefaultBlockRows;
  TORCH_CHECK_VALUE(slice_entries >= 1 && slice_entries <= 65536,
                    "codebook_pack_indices: slice_entries must be in [1, 65536], got ",
                    slice_entries);
  TORCH_CHECK_VALUE(block_rows >= 1 && block_rows <= 65536,
                    "codebook_pack_indices: block_rows must be in [1, 65536], got ", block_rows);
  const int64_t slice = std::min(slice_entries, num_entries);
  const int64_t slices = ceil_div(num_entries, slice), blocks = ceil_div(N, block_rows);
  const auto idx = indices.contiguous();
  const auto* ip = static_cast<const uint16_t*>(idx.const_data_ptr());
  // Indices >= E would select entries past the codebook: refused here, once.
  uint16_t top = 0;
  for (int64_t i = 0; i < idx.numel(); ++i) top = std::max(top, ip[i]);
  TORCH_CHECK_VALUE(idx.numel() == 0 || top < num_entries, "codebook_pack_indices: indices "
                    "must be < num_entries=", num_entries, ", found ", top);
  std::vector<BlockParts> parts(blocks);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      parts[b] = pack_block(ip, b * block_rows, std::min(N, (b + 1) * block_rows), G, slice,
                            slices);
  });
  int64_t runs = 0, codes = 0;
  for (const auto& p : parts) runs += p.runs.size(), codes += p.codes.size();
  const int64_t segs = blocks * slices;
  const int64_t total = kPackedHeader + 2 * (segs + 1) + runs + codes;
  TORCH_CHECK_VALUE(codes < (int64_t(1) << 31) && total < (int64_t(1) << 31),
                    "codebook_pack_indices: the layout of ", N, " x ", G,
                    " codes exceeds 2^31 words");
  auto out = at::zeros({total}, at::dtype(at::kInt));
  int32_t* o = out.data_ptr<int32_t>();
  o[kPackedMagic] = kPackedMagicValue;
  o[kPackedRows] = int32_t(N);
  o[kPackedGroups] = int32_t(G);
  o[kPackedEntries] = int32_t(num_entries);
  o[kPackedSliceEntries] = int32_t(slice);
  o[kPackedBlockRows] = int32_t(block_rows);
  o[kPackedBlocks] = int32_t(blocks);
  o[kPackedSlices] = int32_t(slices);
  o[kPackedRuns] = int32_t(runs);
  o[kPackedEntryCount] = int32_t(codes);
  int32_t* run_off = o + kPackedHeader;
  int32_t* code_off = run_off + segs + 1;
  auto* run_dst = reinterpret_cast<uint32_t*>(code_off + segs + 1);
  uint32_t* code_dst = run_dst + runs;
  int64_t r = 0, c = 0, seg = 0;
  for (const auto& p : parts) {
    for (int64_t s = 0; s < slices; ++s, ++seg) {
      run_off[seg] = int32_t(r + p.seg_runs[s]);
      code_off[seg] = int32_t(c + p.seg_codes[s]);
    }
    std::copy(p.runs.begin(), p.runs.end(), run_dst + r);
    std::copy(p.codes.begin(), p.codes.end(), code_dst + c);
    r += p.runs.size();
    c += p.codes.size();
  }
  run_off[segs] = int32_t(r);
  code_off[segs] = int32_t(c);
  return out;
}

// Raises unless packed is a layout of indices' shape and E (its header and its size).
void check_packed(const at::Tensor& packed, const at::Tensor& indices, const Dims& d) {
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kInt && packed.dim() == 1 &&
                        packed.device().is_cpu() && packed.numel() >= kPackedHeader,
                    "codebook_matmul_packed: packed must be a 1-d int32 CPU tensor from "
                    "codebook_pack_indices");
  const auto p = packed.contiguous();
  const int32_t* h = p.const_data_ptr<int32_t>();
  const int64_t segs = int64_t(h[kPackedBlocks]) * h[kPackedSlices];
  const bool ok = h[kPackedMagic] == kPackedMagicValue && h[kPackedRows] == d.out_features &&
                  h[kPackedGroups] == d.groups && h[kPackedEntries] == d.num_entries &&
                  segs >= 0 &&
                  packed.numel() == kPackedHeader + 2 * (segs + 1) + int64_t(h[kPackedRuns]) +
                                        h[kPackedEntryCount];
  TORCH_CHECK_VALUE(ok, "codebook_matmul_packed: packed is not the layout of these indices "
                    "(shape ", indices.sizes(), ", E=", d.num_entries,
                    "); rebuild it with codebook_pack_indices");
}

at::Tensor plain_forward(const at::Tensor& x, const at::Tensor& indices,
                         const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("rlx::codebook_matmul", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  return op.call(x, indices, codebook, scales, bias);
}

at::Tensor matmul_packed_cpu(const at::Tensor& x, const at::Tensor& packed,
                             const at::Tensor& indices, const at::Tensor& codebook,
                             const std::optional<at::Tensor>& scales,
                             const std::optional<at::Tensor>& bias) {
  const Dims d = check_inputs(x, indices, codebook, scales, bias);
  TORCH_CHECK_VALUE(d.index_bytes == 2 && d.num_codebooks == 1 && indices.dim() == 2,
                    "codebook_matmul_packed: indices must be 16-bit with one codebook "
                    "([N, K/D] int16 or uint16)");
  check_packed(packed, indices, d);
  if (x.scalar_type() != at::kFloat || d.entry_dim != 8 || d.rows > kPackedMaxRows)
    return plain_forward(x, indices, codebook, scales, bias);
  auto out = at::empty(output_shape(x, d), x.options());
  if (out.numel() == 0) return out;
  const auto x2d = x.reshape({d.rows, d.in_features}).contiguous();
  const at::ScalarType ct = codebook.scalar_type();
  const int half = ct == at::kHalf ? 1 : ct == at::kBFloat16 ? 2 : 0;
  const bool reads_half = half != 0 && RLX_ISA_CALL(packed_reads_half)(half);
  const auto cb = reads_half ? codebook.contiguous() : codebook.to(at::kFloat).contiguous();
  auto raw = at::empty({d.rows, d.out_features}, x.options());
  const auto p = packed.contiguous();
  RLX_ISA_CALL(packed_forward)(p.const_data_ptr<int32_t>(), x2d.const_data_ptr<float>(), d.rows,
                               cb.const_data_ptr(), reads_half ? half : 0,
                               raw.data_ptr<float>());
  if (scales.has_value()) raw.mul_(*scales);
  if (bias.has_value()) raw.add_(*bias);
  out.view({d.rows, d.out_features}).copy_(raw);
  return out;
}

}  // namespace
}  // namespace rlx::codebook::cpu

TORCH_LIBRARY_IMPL(rlx, CPU, m) {
  m.impl("codebook_pack_indices", &rlx::codebook::cpu::pack_indices_cpu);
  m.impl("codebook_matmul_packed", &rlx::codebook::cpu::matmul_packed_cpu);
}
#endif
