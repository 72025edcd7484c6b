// Gated delta rule on Apple GPUs: forward, backward, and the backward's fixed-order
// reduction. Same recurrence, checkpoints and packed gradient layout as the CPU op
// (csrc/cpu/gated_delta_common.h, csrc/include/rlx/gdn_backward_layout.h). Per (sequence n,
// value head hv), state S in R^{K x V} (float32), q/k head h = hv / (HV / H):
//   P = diag(a_t) S_{t-1}, a_t = exp(g_t);  u = beta_t (v_t - P^T k_t);  S_t = P + k_t u^T;
//   o_t = scale S_t^T q_t
// The columns of S evolve independently, so every simdgroup owns one column (one value
// channel) and keeps it in registers, lane l holding rows l, l + 32, ... (K <= 256: at most
// 8 per lane). Dot products over K are one simd_sum. Threadgroups cover
// (V-block, hv, n); launch plans: csrc/include/rlx/mps_gated_delta_plan.h. With
// p.qk_l2norm (the op's l2norm_eps), q and k rows are L2-normalized as they are read, in
// float as the CPU kernels do (x / sqrt(sum x^2 + eps)); gated_delta_bwd_l2norm then turns
// the gradients of the normalized rows into those of the raw ones.
#include <metal_stdlib>
using namespace metal;

#include "rlx/mps_gated_delta_params.h"  // GdnParams, shared with the host code
using rlx::mps::GdnParams;

constant constexpr uint kMaxKPerLane = 8;  // K <= 256

struct SeqBounds {
  ulong bos, eos;
};

inline SeqBounds sequence_bounds(constant GdnParams& p, device const long* cu_seqlens, uint n) {
  SeqBounds b;
  if (p.varlen != 0) {
    b.bos = ulong(cu_seqlens[n]);
    b.eos = ulong(cu_seqlens[n + 1]);
  } else {
    b.bos = ulong(n) * p.seq_len;
    b.eos = b.bos + p.seq_len;
  }
  return b;
}

// Loads this lane's rows (lane + 32 j) of a length-K input row as float; 0 past K.
template <typename T>
inline void load_lane_rows(device const T* row, uint K, uint nk, uint lane, thread float* out) {
  for (uint j = 0; j < kMaxKPerLane; ++j) {
    const uint r = lane + 32 * j;
    out[j] = (j < nk && r < K) ? float(row[r]) : 0.0f;
  }
}

// With p.qk_l2norm, scales this lane's rows of a q or k row (zeros past K) to unit length:
// x / sqrt(sum x^2 + eps). One simd_sum: every lane of the simdgroup calls it (a uniform flag).
inline void l2norm_lane_rows(constant GdnParams& p, thread float* x) {
  if (p.qk_l2norm == 0) return;
  float ss = 0.0f;
  for (uint j = 0; j < kMaxKPerLane; ++j) ss += x[j] * x[j];
  const float r = 1.0f / precise::sqrt(simd_sum(ss) + p.l2norm_eps);
  for (uint j = 0; j < kMaxKPerLane; ++j) x[j] *= r;
}

// Decay factors exp(g_t) for this lane's rows: one per key channel, or one per head. The
// decay compounds over every token, so it is precise::exp whatever the library's math mode.
inline void load_decay(constant GdnParams& p, device const float* g, ulong tok, uint hv,
                       uint lane, thread float* a) {
  const uint K = p.head_k_dim;
  if (p.gate_per_channel != 0) {
    device const float* row = g + (tok * p.num_v_heads + hv) * K;
    for (uint j = 0; j < kMaxKPerLane; ++j) {
      const uint r = lane + 32 * j;
      a[j] = (j < p.k_per_lane && r < K) ? precise::exp(row[r]) : 0.0f;
    }
  } else {
    const float e = precise::exp(g[tok * p.num_v_heads + hv]);
    for (uint j = 0; j < kMaxKPerLane; ++j) a[j] = e;
  }
}

// Index of S[row r, column col] of (n, hv) in a [.., HV, K, V] state buffer.
inline ulong state_index(constant GdnParams& p, ulong slot, uint hv, uint r, uint col) {
  return ((slot * p.num_v_heads + hv) * p.head_k_dim + r) * p.head_v_dim + col;
}

// Forward. Grid (V-blocks, HV, N) x (32 * simdgroups); simdgroup sg owns column
// vblock * simdgroups + sg. No threadgroup memory, no barriers: a simdgroup past V leaves.
// Writes o, the final state, every checkpoint slot (unused ones as zeros) and, with
// p.keeps_vw, vw = v - P^T k per token (u = beta vw), the CPU forward's vw output.
template <typename T>
kernel void gated_delta_fwd(device const T* q [[buffer(0)]],
                            device const T* k [[buffer(1)]],
                            device const T* v [[buffer(2)]],
                            device const float* g [[buffer(3)]],
                            device const float* beta [[buffer(4)]],
                            device const float* initial_state [[buffer(5)]],
                            device const long* cu_seqlens [[buffer(6)]],
                            device T* o [[buffer(7)]],
                            device float* final_state [[buffer(8)]],
                            device float* checkpoints [[buffer(9)]],
                            constant GdnParams& p [[buffer(10)]],
                            device float* vw [[buffer(11)]],
                            uint3 tgpos [[threadgroup_position_in_grid]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  const uint n = tgpos.z, hv = tgpos.y, col = tgpos.x * p.simdgroups + sg;
  if (col >= p.head_v_dim) return;
  const uint K = p.head_k_dim, V = p.head_v_dim, HV = p.num_v_heads, H = p.num_qk_heads;
  const uint h = hv / p.group, nk = p.k_per_lane, C = p.chunk;
  const SeqBounds sb = sequence_bounds(p, cu_seqlens, n);
  // rlx::gdn_checkpoint_base; chunk_size 0 keeps no checkpoints
  const ulong ckpt_base = C > 0 ? ulong(n) + sb.bos / C : 0;

  float s[kMaxKPerLane];
  for (uint j = 0; j < kMaxKPerLane; ++j) {
    const uint r = lane + 32 * j;
    s[j] = (p.has_initial_state != 0 && j < nk && r < K)
               ? initial_state[state_index(p, n, hv, r, col)]
               : 0.0f;
  }
  float kk[kMaxKPerLane], qq[kMaxKPerLane], a[kMaxKPerLane];
  ulong slot = ckpt_base;
  uint to_checkpoint = 0;  // counts down instead of a 64-bit modulo per token
  for (ulong tok = sb.bos; tok < sb.eos; ++tok) {
    if (C > 0 && to_checkpoint == 0) {  // the state before token j*C of this sequence: slot
      to_checkpoint = C;                // base + j
      for (uint j = 0; j < kMaxKPerLane; ++j) {
        const uint r = lane + 32 * j;
        if (j < nk && r < K) checkpoints[state_index(p, slot, hv, r, col)] = s[j];
      }
      ++slot;
    }
    if (C > 0) --to_checkpoint;
    load_lane_rows(k + (tok * H + h) * K, K, nk, lane, kk);
    load_lane_rows(q + (tok * H + h) * K, K, nk, lane, qq);
    l2norm_lane_rows(p, kk);
    l2norm_lane_rows(p, qq);
    load_decay(p, g, tok, hv, lane, a);
    // One collective for k.P, q.P and q.k: o = scale q.(P + k u) = scale (q.P + (q.k) u).
    float3 part = float3(0.0f);
    for (uint j = 0; j < kMaxKPerLane; ++j) {
      s[j] *= a[j];
      part += float3(kk[j] * s[j], qq[j] * s[j], qq[j] * kk[j]);
    }
    const float3 dots = simd_sum(part);
    const float w = float(v[(tok * HV + hv) * V + col]) - dots.x;  // v - P^T k
    const float u = beta[tok * HV + hv] * w;
    for (uint j = 0; j < kMaxKPerLane; ++j) s[j] += kk[j] * u;
    if (lane == 0) {
      o[(tok * HV + hv) * V + col] = T(p.scale * (dots.y + dots.z * u));
      if (p.keeps_vw != 0) vw[(tok * HV + hv) * V + col] = w;
    }
  }
  for (uint j = 0; j < kMaxKPerLane; ++j) {
    const uint r = lane + 32 * j;
    if (j < nk && r < K) final_state[state_index(p, n, hv, r, col)] = s[j];
  }
  // Slots no sequence uses are zero: those between this sequence's last slot and the next
  // sequence's base n + 1 + eos / C (after the last sequence: the slot count N + ceil(B*T / C)).
  const ulong end = C == 0                ? 0
                    : n + 1 == p.num_seqs ? ulong(p.num_seqs) + (p.tokens + C - 1) / C
                                          : ulong(n) + 1 + sb.eos / C;
  for (; slot < end; ++slot) {
    for (uint j = 0; j < kMaxKPerLane; ++j) {
      const uint r = lane + 32 * j;
      if (j < nk && r < K) checkpoints[state_index(p, slot, hv, r, col)] = 0.0f;
    }
  }
}

// One forward step without the output (backward recomputation).
template <typename T>
inline void advance(constant GdnParams& p, device const T* k, device const T* v,
                    device const float* g, device const float* beta, ulong tok, uint h,
                    uint hv, uint col, uint lane, thread float* s) {
  const uint K = p.head_k_dim;
  float kk[kMaxKPerLane], a[kMaxKPerLane];
  load_lane_rows(k + (tok * p.num_qk_heads + h) * K, K, p.k_per_lane, lane, kk);
  l2norm_lane_rows(p, kk);
  load_decay(p, g, tok, hv, lane, a);
  float part = 0.0f;
  for (uint j = 0; j < kMaxKPerLane; ++j) {
    s[j] *= a[j];
    part += kk[j] * s[j];
  }
  const float kp = simd_sum(part);
  const ulong vat = (tok * p.num_v_heads + hv) * p.head_v_dim + col;
  const float vv = col < p.head_v_dim ? float(v[vat]) : 0.0f;  // 0: a column past V
  const float u = beta[tok * p.num_v_heads + hv] * (vv - kp);
  for (uint j = 0; j < kMaxKPerLane; ++j) s[j] += kk[j] * u;
}

// Backward over the chunks [window_lo, window_hi) of every sequence (the host encodes the
// windows from the last one down to 0; dS crosses windows through `carry`). Grid
// (V-blocks, HV, N) x (32 * simdgroups). Per chunk and sub-chunk (from the last), the states
// are recomputed from the chunk's checkpoint, those of the sub-chunk kept in threadgroup
// memory, then the reverse recurrence runs. dv is one value channel: written directly. dq,
// dk, dg and dbeta sum over the columns: the simdgroups' contributions meet in threadgroup
// memory and are added in simdgroup order into one partial row per V-block; the reduction
// kernel then adds V-blocks and the value heads of a group in a fixed order.
// Threadgroup memory: hist [sub][simdgroups][32 * k_per_lane], then red [simdgroups][RW]
// with RW = 2 Kp + (per-channel gate ? Kp : 1) + 1, Kp = 32 * k_per_lane.
template <typename T>
kernel void gated_delta_bwd(device const T* q [[buffer(0)]],
                            device const T* k [[buffer(1)]],
                            device const T* v [[buffer(2)]],
                            device const float* g [[buffer(3)]],
                            device const float* beta [[buffer(4)]],
                            device const long* cu_seqlens [[buffer(5)]],
                            device const float* checkpoints [[buffer(6)]],
                            device const T* grad_o [[buffer(7)]],
                            device const float* grad_final_state [[buffer(8)]],
                            device float* packed [[buffer(9)]],
                            device float* partials [[buffer(10)]],
                            device float* carry [[buffer(11)]],
                            constant GdnParams& p [[buffer(12)]],
                            threadgroup float* tgmem [[threadgroup(0)]],
                            uint3 tgpos [[threadgroup_position_in_grid]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint tid [[thread_index_in_threadgroup]]) {
  const uint n = tgpos.z, hv = tgpos.y, vb = tgpos.x;
  const uint col = vb * p.simdgroups + sg;
  const bool active = col < p.head_v_dim;  // inactive simdgroups add zeros, keep barriers
  const uint K = p.head_k_dim, V = p.head_v_dim, HV = p.num_v_heads, H = p.num_qk_heads;
  const uint h = hv / p.group, nk = p.k_per_lane, C = p.chunk, NSG = p.simdgroups;
  const uint Kp = 32 * nk, gw = p.gate_per_channel != 0 ? Kp : 1u;
  const uint RW = 2 * Kp + gw + 1;
  const SeqBounds sb = sequence_bounds(p, cu_seqlens, n);
  const uint nchunks = uint((sb.eos - sb.bos + C - 1) / C);
  if (p.window_lo > 0 && p.window_lo >= nchunks) return;  // whole threadgroup: uniform
  const uint j_top = min(p.window_hi, nchunks);
  const ulong ckpt_base = ulong(n) + sb.bos / C;
  const ulong rows = ulong(p.num_seqs) * p.window_chunks * C;  // partial rows per V-block
  threadgroup float* hist = tgmem;
  threadgroup float* red = tgmem + p.sub * NSG * Kp;

  float dS[kMaxKPerLane];
  const bool first_window = p.window_hi >= nchunks;
  for (uint j = 0; j < kMaxKPerLane; ++j) {
    const uint r = lane + 32 * j;
    float x = 0.0f;
    if (active && j < nk && r < K) {
      const ulong at = state_index(p, n, hv, r, col);
      if (!first_window) x = carry[at];
      else if (p.has_grad_final != 0) x = grad_final_state[at];
    }
    dS[j] = x;
  }

  float s[kMaxKPerLane], kk[kMaxKPerLane], qq[kMaxKPerLane], a[kMaxKPerLane];
  for (int jc = int(j_top) - 1; jc >= int(p.window_lo); --jc) {
    const ulong t0 = sb.bos + ulong(jc) * C;
    const ulong left = sb.eos - t0;  // > 0
    const uint len = left < C ? uint(left) : C;
    const int nsub = int((len + p.sub - 1) / p.sub);
    for (int sc = nsub - 1; sc >= 0; --sc) {
      const uint s0 = uint(sc) * p.sub, s1 = min(len, s0 + p.sub);
      for (uint j = 0; j < kMaxKPerLane; ++j) {
        const uint r = lane + 32 * j;
        s[j] = (active && j < nk && r < K)
                   ? checkpoints[state_index(p, ckpt_base + ulong(jc), hv, r, col)]
                   : 0.0f;
      }
      for (uint i = 0; i < s1; ++i) {  // recompute up to the sub-chunk, keep its states
        if (i >= s0) {
          for (uint j = 0; j < kMaxKPerLane; ++j) {
            if (j < nk) hist[((i - s0) * NSG + sg) * Kp + lane + 32 * j] = s[j];
          }
        }
        if (i + 1 < s1) advance(p, k, v, g, beta, t0 + i, h, hv, col, lane, s);
      }
      for (int i = int(s1) - 1; i >= int(s0); --i) {  // reverse recurrence
        const ulong tok = t0 + ulong(i);
        load_lane_rows(k + (tok * H + h) * K, K, nk, lane, kk);
        load_lane_rows(q + (tok * H + h) * K, K, nk, lane, qq);
        l2norm_lane_rows(p, kk);
        l2norm_lane_rows(p, qq);
        load_decay(p, g, tok, hv, lane, a);
        const float b = beta[tok * HV + hv];
        const ulong vat = (tok * HV + hv) * V + col;
        const float vv = active ? float(v[vat]) : 0.0f;
        const float go = active ? float(grad_o[vat]) * p.scale : 0.0f;
        // o = scale S^T q: dS += scale q do. Then one collective for k.P, k.dS, dS.P.
        float3 part = float3(0.0f);
        for (uint j = 0; j < kMaxKPerLane; ++j) {
          s[j] = j < nk ? a[j] * hist[((uint(i) - s0) * NSG + sg) * Kp + lane + 32 * j] : 0.0f;
          dS[j] += qq[j] * go;
          part += float3(kk[j] * s[j], kk[j] * dS[j], dS[j] * s[j]);
        }
        const float3 dots = simd_sum(part);
        const float w = vv - dots.x;  // v - P^T k
        const float u = b * w, du = dots.y, bdu = b * du;
        // S_t = P + k u: dq += scale S_t do, dk += u dS; u = b (v - P^T k): dv = b du,
        // dbeta = du w, dk -= b du P, dP = dS - b du k; P = diag(a) S_prev: dg = <dP, P>.
        threadgroup float* mine = red + sg * RW;
        for (uint j = 0; j < kMaxKPerLane; ++j) {
          if (j >= nk) break;
          const uint r = lane + 32 * j;
          const float st = s[j] + kk[j] * u;
          mine[r] = go * st;
          mine[Kp + r] = u * dS[j] - bdu * s[j];
          const float dp = dS[j] - bdu * kk[j];
          if (p.gate_per_channel != 0) mine[2 * Kp + r] = dp * s[j];
          dS[j] = a[j] * dp;
        }
        if (lane == 0) {
          if (p.gate_per_channel == 0) mine[2 * Kp] = dots.z - bdu * dots.x;
          mine[2 * Kp + gw] = du * w;
          if (active) packed[p.dv_offset + vat] = bdu;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const ulong row = (ulong(n) * p.window_chunks + ulong(uint(jc) - p.window_lo)) * C +
                          uint(i);
        for (uint e = tid; e < RW; e += 32 * NSG) {
          float acc = 0.0f;
          for (uint m = 0; m < NSG; ++m) acc += red[m * RW + e];
          const ulong prow = ulong(vb) * rows + row;
          if (e < Kp) {
            if (e < K) partials[(prow * HV + hv) * K + e] = acc;
          } else if (e < 2 * Kp) {
            if (e - Kp < K) partials[p.part_dk_offset + (prow * HV + hv) * K + (e - Kp)] = acc;
          } else if (e < 2 * Kp + gw) {
            const uint r = e - 2 * Kp;
            if (p.gate_per_channel == 0) partials[p.part_dg_offset + prow * HV + hv] = acc;
            else if (r < K) partials[p.part_dg_offset + (prow * HV + hv) * K + r] = acc;
          } else {
            partials[p.part_dbeta_offset + prow * HV + hv] = acc;
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);  // red is rewritten next step
      }
    }
  }
  for (uint j = 0; j < kMaxKPerLane; ++j) {
    const uint r = lane + 32 * j;
    if (j >= nk || !active || r >= K) continue;
    const ulong at = state_index(p, n, hv, r, col);
    if (p.window_lo > 0) carry[at] = dS[j];
    else if (p.has_initial_state != 0) packed[p.dstate_offset + at] = dS[j];
  }
}

// Sums the backward's partial rows of one window in a fixed order (V-blocks, then the value
// heads of a group) into the packed buffer. Grid (ceil(rows / reduce_simdgroups), H) x
// (32 * reduce_simdgroups); one simdgroup per (row, q/k head), lanes over K.
kernel void gated_delta_bwd_reduce(device const long* cu_seqlens [[buffer(0)]],
                                   device const float* partials [[buffer(1)]],
                                   device float* packed [[buffer(2)]],
                                   constant GdnParams& p [[buffer(3)]],
                                   uint3 tgpos [[threadgroup_position_in_grid]],
                                   uint sg [[simdgroup_index_in_threadgroup]],
                                   uint lane [[thread_index_in_simdgroup]]) {
  const uint C = p.chunk, W = p.window_chunks;
  const ulong rows = ulong(p.num_seqs) * W * C;
  const ulong row = ulong(tgpos.x) * p.reduce_simdgroups + sg;
  if (row >= rows) return;
  const uint n = uint(row / (ulong(W) * C)), jc = p.window_lo + uint((row / C) % W);
  const uint i = uint(row % C);
  const SeqBounds sb = sequence_bounds(p, cu_seqlens, n);
  const ulong tok = sb.bos + ulong(jc) * C + i;
  if (tok >= sb.eos || jc >= p.window_hi) return;
  const uint h = tgpos.y, K = p.head_k_dim, HV = p.num_v_heads, G = p.group;
  const uint NVB = p.num_vblocks;
  for (uint j = 0; j < p.k_per_lane; ++j) {
    const uint r = lane + 32 * j;
    if (r >= K) continue;
    float dq = 0.0f, dk = 0.0f;
    for (uint hv = h * G; hv < (h + 1) * G; ++hv) {
      float dg = 0.0f;
      for (uint vb = 0; vb < NVB; ++vb) {
        const ulong at = ((ulong(vb) * rows + row) * HV + hv) * K + r;
        dq += partials[at];
        dk += partials[p.part_dk_offset + at];
        if (p.gate_per_channel != 0) dg += partials[p.part_dg_offset + at];
      }
      if (p.gate_per_channel != 0) packed[p.dg_offset + (tok * HV + hv) * K + r] = dg;
    }
    packed[p.dq_offset + (tok * p.num_qk_heads + h) * K + r] = dq;
    packed[p.dk_offset + (tok * p.num_qk_heads + h) * K + r] = dk;
  }
  if (lane == 0) {
    for (uint hv = h * G; hv < (h + 1) * G; ++hv) {
      float dg = 0.0f, db = 0.0f;
      for (uint vb = 0; vb < NVB; ++vb) {
        const ulong at = (ulong(vb) * rows + row) * HV + hv;
        if (p.gate_per_channel == 0) dg += partials[p.part_dg_offset + at];
        db += partials[p.part_dbeta_offset + at];
      }
      if (p.gate_per_channel == 0) packed[p.dg_offset + tok * HV + hv] = dg;
      packed[p.dbeta_offset + tok * HV + hv] = db;
    }
  }
}

// With l2norm_eps: the packed dq and dk hold the gradients of the normalized rows y = x r,
// r = (sum x^2 + eps)^-1/2; this turns each into the raw row's, dx = r (dy - y (y . dy)), in
// place. Grid (ceil(B*T*H / reduce_simdgroups), 2) x (32 * reduce_simdgroups): one simdgroup
// per (token, q/k head) row, tgpos.y = 0 for q, 1 for k; lanes over K.
template <typename T>
kernel void gated_delta_bwd_l2norm(device const T* q [[buffer(0)]],
                                   device const T* k [[buffer(1)]],
                                   device float* packed [[buffer(2)]],
                                   constant GdnParams& p [[buffer(3)]],
                                   uint3 tgpos [[threadgroup_position_in_grid]],
                                   uint sg [[simdgroup_index_in_threadgroup]],
                                   uint lane [[thread_index_in_simdgroup]]) {
  const ulong row = ulong(tgpos.x) * p.reduce_simdgroups + sg;
  if (row >= p.tokens * p.num_qk_heads) return;  // the whole simdgroup
  const uint K = p.head_k_dim, nk = p.k_per_lane;
  device const T* x = (tgpos.y == 0 ? q : k) + row * K;
  device float* d = packed + (tgpos.y == 0 ? p.dq_offset : p.dk_offset) + row * K;
  float xs[kMaxKPerLane], dy[kMaxKPerLane];
  load_lane_rows(x, K, nk, lane, xs);
  load_lane_rows<float>(d, K, nk, lane, dy);
  float2 part = float2(0.0f);
  for (uint j = 0; j < kMaxKPerLane; ++j) part += float2(xs[j] * xs[j], xs[j] * dy[j]);
  const float2 sums = simd_sum(part);
  const float r = 1.0f / precise::sqrt(sums.x + p.l2norm_eps);
  const float ydy = r * sums.y;  // y . dy
  for (uint j = 0; j < kMaxKPerLane; ++j) {
    const uint i = lane + 32 * j;
    if (j < nk && i < K) d[i] = r * (dy[j] - r * xs[j] * ydy);
  }
}

// decltype keeps the instantiations in step with the signatures (parameter attributes and
// all).
template [[host_name("gated_delta_fwd_f32")]] [[kernel]] decltype(gated_delta_fwd<float>) gated_delta_fwd<float>;
template [[host_name("gated_delta_fwd_f16")]] [[kernel]] decltype(gated_delta_fwd<half>) gated_delta_fwd<half>;
template [[host_name("gated_delta_bwd_f32")]] [[kernel]] decltype(gated_delta_bwd<float>) gated_delta_bwd<float>;
template [[host_name("gated_delta_bwd_f16")]] [[kernel]] decltype(gated_delta_bwd<half>) gated_delta_bwd<half>;
template [[host_name("gated_delta_bwd_l2norm_f32")]] [[kernel]] decltype(gated_delta_bwd_l2norm<float>) gated_delta_bwd_l2norm<float>;
template [[host_name("gated_delta_bwd_l2norm_f16")]] [[kernel]] decltype(gated_delta_bwd_l2norm<half>) gated_delta_bwd_l2norm<half>;
// bfloat: Metal 3.1 (macOS 14) and the emulator (which defines no __METAL_VERSION__).
#if !defined(__METAL_VERSION__) || __METAL_VERSION__ >= 310
template [[host_name("gated_delta_fwd_bf16")]] [[kernel]] decltype(gated_delta_fwd<bfloat>) gated_delta_fwd<bfloat>;
template [[host_name("gated_delta_bwd_bf16")]] [[kernel]] decltype(gated_delta_bwd<bfloat>) gated_delta_bwd<bfloat>;
template [[host_name("gated_delta_bwd_l2norm_bf16")]] [[kernel]] decltype(gated_delta_bwd_l2norm<bfloat>) gated_delta_bwd_l2norm<bfloat>;
#endif
