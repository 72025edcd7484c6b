// Small-batch backward of the codebook matmul with 8-bit codes (at most kHistMaxRows batch
// rows), through histograms of the output gradient. With gs[b, j] = grad_out[b, j] * s_j and
// step s = g * M + m (group g, codebook m):
//   H_s[b][c]       = the sum of gs[b, j] over the output rows j with idx[j, g, m] = c
//   dx[b, g*D + t]  = sum_m sum_c H_{g*M+m}[b][c] * C[m, c, t]
//   dC[m, c, t]     = sum_g sum_b H_{g*M+m}[b][c] * x[b, g*D + t]
// Both gradients come from the same histograms, and building them costs at most one
// shared-memory add per (output row, step, batch row): no products per code and no dense dW. The products left
// are per step and entry (E * D * B of each kind), a small share of the work.
//
// Block k takes kHistSteps consecutive steps (one warp each), `bpb` (at most kHistBatch) batch
// rows, as many as the device's shared memory allows, and one of R row splits: consecutive
// runs of chunks of output rows, so that there are blocks enough for the device when the steps
// and batch rows alone give few (dx and dC are linear in H, so each split's histograms give
// their own parts of both). The rows go by in chunks of kHistChunk: the chunk's code bytes of
// the block's steps (16 bytes a row) and its gradients are staged in shared memory, the next
// chunk's copies (cp.async) in flight while a chunk is added. Warp w adds its step's histogram
// in rounds of 32 rows, one row a lane; lanes whose codes collide are found with
// __match_any_sync, and the lowest of them adds their gradients in lane order (shuffles) and
// then that sum to the bin, so every H_s[b][c] is a sum of its rows in a fixed order, and a
// round costs one shared-memory add per distinct code and batch row. After the split's last
// chunk the block's threads compute from its histograms
//   dx_parts[r][m][b][g*D + t]  for each of its steps and batch rows (a sum over c in order,
//                               r the block's row split), and
//   dc_parts[k][m][c][t]        the sum over its steps of codebook m (in step order) and its
//                               batch rows (in order);
// the host adds dx_parts over r and m and dc_parts over k with at::sum. No atomics: results are
// bitwise reproducible.
//
// Compiled on the CPU by tests/cuda_emu (RLX_CUDA_EMULATION) as codebook_mma.cuh is (1-D grid).
#pragma once

#include <cstddef>
#include <cstdint>

#include "codebook_elem.cuh"
#include "codebook_mma.cuh"

namespace rlx::codebook::cuda {

constexpr int kHistMaxRows = 16;  // batch rows of the histogram backward
constexpr int kHistSteps = 16;    // steps per block, one warp each
constexpr int kHistBatch = 4;     // batch rows per block, at most
constexpr int kHistChunk = 512;   // output rows per staged chunk
constexpr int kHistThreads = kHistSteps * 32;

// Shared memory of histogram_backward_kernel with `bpb` batch rows per block: the histograms
// [kHistSteps][bpb][E + 1] (a padded row, so that the dx pass's threads of different b read
// different banks), then two chunk buffers, each codes [kHistChunk][16] bytes and gradients
// [bpb][kHistChunk]. With 4 rows and E = 256: 66 KiB + 32 KiB in float32, 130 KiB + 48 KiB in
// float64; with 1 row, 16 KiB + 20 KiB and 33 KiB + 24 KiB.
inline size_t histogram_backward_smem(int bpb, int64_t E, size_t acc_bytes) {
  return static_cast<size_t>(kHistSteps * bpb * (E + 1)) * acc_bytes +
         2 * (static_cast<size_t>(kHistChunk) * 16 +
              static_cast<size_t>(bpb * kHistChunk) * acc_bytes);
}

// Blocks: ceil(S / kHistSteps) step chunks times ceil(B / bpb) batch chunks times R row
// splits of `split_chunks` chunks each (the last may have fewer, none is empty), step chunk
// fastest, then batch chunk. `vec_codes`: every row's G*M code bytes are whole 16-byte vectors
// at 16-byte addresses; `vec_gs`: N is a multiple of 16 bytes' worth of gs (cp.async copies,
// else element loads).
// idx [N][G][M] uint8; gs [B][N] and cb [M][E][D] in the accumulation type; x [B][K] in its
// own. dx_parts [R][M][B][K], dc_parts [blocks][M][E][D] (accumulation type).
template <Elem e>
__global__ void __launch_bounds__(kHistThreads, 2)
    histogram_backward_kernel(const uint8_t* __restrict__ idx, const acc_t<e>* __restrict__ gs,
                              const storage_t<e>* __restrict__ x,
                              const acc_t<e>* __restrict__ cb, acc_t<e>* __restrict__ dx_parts,
                              acc_t<e>* __restrict__ dc_parts, int B, int64_t N, int64_t G,
                              int M, int E, int D, int bpb, int step_chunks, int split_chunks,
                              bool vec_codes, bool vec_gs) {
  using acc = acc_t<e>;
  constexpr unsigned kAll = 0xffffffffu;
  constexpr int kGsVec = static_cast<int>(16 / sizeof(acc));  // gradients per 16 bytes
  RLX_MMA_SMEM(smem_raw);
  const int HS = E + 1;  // histogram row stride
  acc* hist = reinterpret_cast<acc*>(smem_raw);  // [kHistSteps][bpb][HS]
  unsigned char* bufs = smem_raw + static_cast<size_t>(kHistSteps * bpb * HS) * sizeof(acc);
  const size_t buf_bytes = kHistChunk * 16 + bpb * kHistChunk * sizeof(acc);
  auto codes_buf = [&](int i) { return bufs + i * buf_bytes; };
  auto gs_buf = [&](int i) { return reinterpret_cast<acc*>(codes_buf(i) + kHistChunk * 16); };

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t S = G * M, K = G * D;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x % step_chunks) * kHistSteps;
  const int batch_chunks = (B + bpb - 1) / bpb;
  const int b0 = static_cast<int>(blockIdx.x / step_chunks % batch_chunks) * bpb;
  const int split = static_cast<int>(blockIdx.x / step_chunks / batch_chunks);
  const int steps = S - s0 < kHistSteps ? static_cast<int>(S - s0) : kHistSteps;
  const int nb = B - b0 < bpb ? B - b0 : bpb;
  // the split's chunks [c_begin, c_end)
  const int64_t chunks = (N + kHistChunk - 1) / kHistChunk;
  const int64_t c_begin = static_cast<int64_t>(split) * split_chunks;
  const int64_t c_end = chunks < c_begin + split_chunks ? chunks : c_begin + split_chunks;

  for (int i = threadIdx.x; i < kHistSteps * bpb * HS; i += kHistThreads) hist[i] = acc(0);

  // Chunk c into buffer c % 2: row r's 16 code bytes at 16 r (bytes of steps past S and rows
  // past N are 0), the gradients of batch row b at b * kHistChunk + r (0 past B and N).
  auto stage = [&](int64_t c) {
    unsigned char* cs = codes_buf(static_cast<int>(c % 2));
    acc* gsb = gs_buf(static_cast<int>(c % 2));
    const int64_t j0 = c * kHistChunk;
    const int rows = N - j0 < kHistChunk ? static_cast<int>(N - j0) : kHistChunk;
    if (vec_codes && steps == kHistSteps) {
      for (int r = threadIdx.x; r < rows; r += kHistThreads)
        copy16_async(cs + 16 * r, idx + (j0 + r) * S + s0);
    } else {
      for (int i = threadIdx.x; i < rows * 16; i += kHistThreads) {
        const int r = i / 16, k = i % 16;
        cs[i] = k < steps ? idx[(j0 + r) * S + s0 + k] : uint8_t(0);
      }
    }
    for (int i = rows * 16 + threadIdx.x; i < kHistChunk * 16; i += kHistThreads) cs[i] = 0;
    if (vec_gs && rows == kHistChunk) {
      for (int i = threadIdx.x; i < nb * (kHistChunk / kGsVec); i += kHistThreads) {
        const int b = i / (kHistChunk / kGsVec), r = (i % (kHistChunk / kGsVec)) * kGsVec;
        copy16_async(gsb + b * kHistChunk + r, gs + (b0 + b) * N + j0 + r);
      }
    } else {
      for (int i = threadIdx.x; i < nb * kHistChunk; i += kHistThreads) {
        const int b = i / kHistChunk, r = i % kHistChunk;
        gsb[i] = r < rows ? gs[(b0 + b) * N + j0 + r] : acc(0);
      }
    }
    async_commit();
  };

  stage(c_begin);
  for (int64_t c = c_begin; c < c_end; ++c) {
    if (c + 1 < c_end) {
      stage(c + 1);
      async_wait<1>();
    } else {
      async_wait<0>();
    }
    __syncthreads();  // chunk c's copies (every thread's) have landed; the histograms are zero
    if (warp < steps) {  // the same branch for the whole warp
      const unsigned char* cs = codes_buf(static_cast<int>(c % 2));
      const acc* gsb = gs_buf(static_cast<int>(c % 2));
      acc* h = hist + warp * bpb * HS;
      const int64_t j0 = c * kHistChunk;
      for (int r0 = 0; r0 < kHistChunk && j0 + r0 < N; r0 += 32) {
        const int r = r0 + lane;
        const bool valid = j0 + r < N;
        const int code = cs[16 * r + warp];
        acc v[kHistBatch];
#pragma unroll
        for (int b = 0; b < kHistBatch; ++b) v[b] = b < nb ? gsb[b * kHistChunk + r] : acc(0);
        // Rows past N get keys no code has, so they match no other lane. The lowest lane of
        // each code's lanes (its leader) adds their values in lane order, fetched by shuffles,
        // then adds that sum to the bin: the leaders' codes differ, so their adds never collide.
        const unsigned key =
            valid ? static_cast<unsigned>(code) : 256u + static_cast<unsigned>(lane);
        const unsigned peers = __match_any_sync(kAll, key);
        const bool leader = (peers & ((1u << lane) - 1u)) == 0u;
        unsigned rest = leader ? peers & (peers - 1u) : 0u;  // the leader's peers, lane order
        const unsigned top = __reduce_max_sync(kAll, static_cast<unsigned>(__popc(rest)));
        acc sum[kHistBatch];
#pragma unroll
        for (int b = 0; b < kHistBatch; ++b) sum[b] = v[b];
        for (unsigned k = 0; k < top; ++k) {
          const int src = rest != 0u ? __ffs(rest) - 1 : lane;
          rest &= rest - 1u;
#pragma unroll
          for (int b = 0; b < kHistBatch; ++b) {
            const acc other = __shfl_sync(kAll, v[b], src);
            if (src != lane) sum[b] += other;
          }
        }
        if (valid && leader) {
          acc* hc = h + code;
#pragma unroll
          for (int b = 0; b < kHistBatch; ++b)
            if (b < nb) hc[b * HS] += sum[b];
        }
        __syncwarp();  // this round's adds are visible to the next round's lanes
      }
    }
    __syncthreads();  // buffer c % 2 is free for chunk c + 2
  }

  // dx of the block's steps and batch rows: thread i takes (step w, batch row b, coordinate t).
  for (int i = threadIdx.x; i < steps * nb * D; i += kHistThreads) {
    const int w = i / (nb * D), b = (i / D) % nb, t = i % D;
    const int64_t s = s0 + w, g = s / M;
    const int m = static_cast<int>(s % M);
    const acc* hb = hist + (w * bpb + b) * HS;
    const acc* col = cb + static_cast<int64_t>(m) * E * D + t;
    acc sum = acc(0);
    for (int c = 0; c < E; ++c) sum += hb[c] * RLX_LDG(col + c * D);
    dx_parts[((static_cast<int64_t>(split) * M + m) * B + b0 + b) * K + g * D + t] = sum;
  }
  // dC over the block's steps and batch rows: thread i takes (codebook m, entry c, coordinate t).
  for (int i = threadIdx.x; i < M * E * D; i += kHistThreads) {
    const int m = i / (E * D), c = (i / D) % E, t = i % D;
    acc sum = acc(0);
    for (int w = 0; w < steps; ++w) {
      if ((s0 + w) % M != m) continue;
      const acc* hc = hist + w * bpb * HS + c;
      const storage_t<e>* xw = x + b0 * K + (s0 + w) / M * D + t;
      for (int b = 0; b < nb; ++b) sum += hc[b * HS] * elem_to_acc<e>(RLX_LDG(xw + b * K));
    }
    dc_parts[static_cast<int64_t>(blockIdx.x) * M * E * D + i] = sum;
  }
}

}  // namespace rlx::codebook::cuda
