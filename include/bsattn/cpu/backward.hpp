// The CPU engine's backward pass: dQ, dK, dV from Q, K, V, O, LSE and dO, through the same route
// stream as the forward (so every format, mask, custom functor, GQA and varlen layout behaves as
// there), fp32 accumulation. Header-only, like the forward, so a custom mask functor inlines.
//
// With P = exp(S - LSE) (S = scale * Q K^T on the attended pairs, the forward's LSE), dP = dO V^T,
// delta = rowsum(dO * O) - dLSE (dLSE, the LSE's own gradient, 0 unless given: dLSE/dS = P) and
// dS = P * (dP - delta):
//   dV = P^T dO,   dK = scale * dS^T Q,   dQ = scale * dS K.
// Rows with LSE = -inf attended nothing and contribute nothing.
//
// Two passes, each writing disjoint outputs, so there are no races and no atomics, and every
// gradient element is summed in one fixed order: repeated runs are bit-identical whatever the
// thread count or scheduling.
//   1. dQ: one item per (route row, query head), exactly as the forward walks its routes.
//   2. dK, dV: one item per (batch, KV head, KV tile), the column view of the same stream: for
//      each query head of the KV head's group (GQA/MQA sum over the group here) and each Q tile,
//      the route to this KV tile is found by binary search in the row (exact routes ascend by KV
//      tile), so no transposed copy of the stream is stored.
// S, P and dP are recomputed in the second pass (7 tile products per attended pair instead of 5);
// the simplicity and determinism are worth more here than the flops (this is the reference).
#pragma once
#include <algorithm>
#include <cstddef>
#include <limits>

#include "bsattn/backward_params.hpp"
#include "bsattn/cpu/engine.hpp"

namespace bsattn::cpu {

namespace detail {

// The query side of one (Q tile, query head) pair, in fp32: Q with the scale folded in, dO,
// LSE and delta = rowsum(dO * O) - dLSE per row.
struct QTileGrad {
  float* q;
  float* dout;
  float* lse;
  float* delta;

  static std::size_t floats(int tile_m, int d) {
    return 2 * static_cast<std::size_t>(tile_m) * d + 2 * static_cast<std::size_t>(tile_m);
  }
  static QTileGrad carve(float* scratch, int tile_m, int d) {
    const std::size_t md = static_cast<std::size_t>(tile_m) * d;
    return QTileGrad{scratch, scratch + md, scratch + 2 * md, scratch + 2 * md + tile_m};
  }
};

// Rows [q0, q0 + rows) of query head h. tmp holds d floats.
inline void load_q_tile_grad(const BackwardParams& g, int b, const route::SeqInfo& s, int q0, int rows, int h,
                             const QTileGrad& t, float* tmp) {
  const AttentionParams& a = g.fwd;
  const int d = a.head_dim;
  for (int r = 0; r < rows; ++r) {
    float* q = t.q + static_cast<std::size_t>(r) * d;
    float* dout = t.dout + static_cast<std::size_t>(r) * d;
    load_row(a.q, a.q_offset(b, s, q0 + r, h), d, a.in_type, q);
    for (int i = 0; i < d; ++i) q[i] *= a.scale;
    load_row(g.dout, g.q_like_offset(g.dout_strides, b, s, q0 + r, h), d, a.out_type, dout);
    load_row(a.out, a.out_offset(b, s, q0 + r, h), d, a.out_type, tmp);
    float delta = 0.0f;
    for (int i = 0; i < d; ++i) delta += dout[i] * tmp[i];
    t.delta[r] = g.dlse ? delta - g.dlse[g.dlse_offset(b, s, q0 + r, h)] : delta;
    t.lse[r] = a.lse[a.lse_offset(b, s, q0 + r, h)];
  }
}

// One row group against one KV tile (columns j < nk live, n_padded a multiple of 16). On entry
// score holds S and dp holds dP; on return score holds P and dp holds dS, both zero in the
// padding columns and in rows that contribute nothing (past the sequence, or LSE = -inf).
template <class TokenMask>
inline void group_probabilities_and_dscores(const route::RouteParams& p, const route::SeqInfo& s, int b, int h,
                                            int q0, int r0, int rows, bool masked, int k0, int nk, int n_padded,
                                            const QTileGrad& t, float* score, float* dp, const TokenMask& mask) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int tn = p.tile_n;
  for (int g = 0; g < kRowGroup; ++g) {
    float* sr = score + g * tn;
    float* dr = dp + g * tn;
    const int r = r0 + g;
    if (r >= rows || t.lse[r] == neg_inf) {
      std::fill(sr, sr + n_padded, 0.0f);
      std::fill(dr, dr + n_padded, 0.0f);
      continue;
    }
    if (masked) apply_token_mask(p, s, b, h, q0 + r, k0, nk, sr, mask);
    std::fill(sr + nk, sr + n_padded, neg_inf);  // the padding columns weigh 0
    exp_shifted_in_place(sr, n_padded, t.lse[r]);
    for (int j = 0; j < nk; ++j) dr[j] = sr[j] * (dr[j] - t.delta[r]);
    std::fill(dr + nk, dr + n_padded, 0.0f);
  }
}

// The route to KV tile `tile` in one route row, or null. Exact routes ascend by KV tile
// (prepare_row emits blocks in order and the tiles of a block in order).
inline const route::Route* find_exact_route(const route::Route* routes, int count, int tile) {
  const route::Route* end = routes + count;
  const route::Route* it =
      std::lower_bound(routes, end, tile, [](const route::Route& r, int t) { return r.index < t; });
  return it != end && it->index == tile ? it : nullptr;
}

}  // namespace detail

// Floats of scratch per worker thread for the larger of the two backward passes.
inline std::size_t backward_scratch_floats(int tile_m, int tile_n, int head_dim) {
  const std::size_t m = tile_m, n = tile_n, d = head_dim, g = detail::kRowGroup;
  const std::size_t common = detail::QTileGrad::floats(tile_m, head_dim) + 2 * g * n /*S, dP of a row group*/ + d;
  const std::size_t dq_pass = common + m * d /*dQ*/ + 3 * d * n /*K^T, K, V^T*/;
  const std::size_t dkv_pass = common + 2 * d * n /*K^T, V^T*/ + 2 * n * d /*dK, dV*/ + 2 * n * m /*P^T, dS^T*/;
  return std::max(dq_pass, dkv_pass);
}

// Pass 1: dQ of one (route row, query head) item.
template <class TokenMask>
void backward_dq_item(const BackwardParams& g, int row, int h, float* scratch, const TokenMask& mask) {
  const AttentionParams& a = g.fwd;
  const route::RouteParams& p = a.route;
  const route::RowCoordinates rc = route::row_coordinates(p, row);
  const route::SeqInfo s = route::seq_info(p, rc.b);
  const int q0 = rc.q_tile * p.tile_m;
  if (q0 >= s.seqlen_q) return;
  const int rows = std::min(p.tile_m, s.seqlen_q - q0);
  const int d = a.head_dim, tn = p.tile_n;
  const int hkv = h / (p.heads_q / p.heads_kv);

  const detail::QTileGrad t = detail::QTileGrad::carve(scratch, p.tile_m, d);
  float* dq = scratch + detail::QTileGrad::floats(p.tile_m, d);
  float* kt = dq + static_cast<std::size_t>(p.tile_m) * d;
  float* k = kt + static_cast<std::size_t>(d) * tn;
  float* vt = k + static_cast<std::size_t>(tn) * d;
  float* score = vt + static_cast<std::size_t>(d) * tn;
  float* dp = score + detail::kRowGroup * tn;
  float* tmp = dp + detail::kRowGroup * tn;

  detail::load_q_tile_grad(g, rc.b, s, q0, rows, h, t, tmp);
  std::fill(dq, dq + static_cast<std::size_t>(rows) * d, 0.0f);

  const route::Route* routes = a.routes + static_cast<std::int64_t>(row) * p.capacity;
  const int count = a.route_counts[row];
  for (int ri = 0; ri < count; ++ri) {  // exact routes only: backward plans have no proxies
    const route::Route rt = routes[ri];
    const int k0 = rt.index * tn;
    const int nk = std::min(tn, s.seqlen_kv - k0);
    const int n_padded = (nk + 15) / 16 * 16;
    detail::load_kv_tile(a, detail::KVTensor::k, rc.b, s, k0, nk, hkv, k, kt, tn, tmp);
    detail::load_kv_tile(a, detail::KVTensor::v, rc.b, s, k0, nk, hkv, nullptr, vt, tn, tmp);
    for (int r0 = 0; r0 < rows; r0 += detail::kRowGroup) {
      const int unit = r0 / p.unit_m;
      if (!((rt.rows >> unit) & 1u)) continue;
      detail::group_scores(t.q + r0 * d, d, kt, tn, n_padded, score);
      detail::group_scores(t.dout + r0 * d, d, vt, tn, n_padded, dp);
      detail::group_probabilities_and_dscores(p, s, rc.b, h, q0, r0, rows, (rt.masked >> unit) & 1u, k0, nk, n_padded,
                                              t, score, dp, mask);
      detail::group_pv(dp, tn, k, nk, d, dq + r0 * d);
    }
  }

  for (int r = 0; r < rows; ++r) {
    float* out = dq + static_cast<std::size_t>(r) * d;
    for (int i = 0; i < d; ++i) out[i] *= a.scale;
    detail::store_row(g.dq, g.q_like_offset(g.dq_strides, rc.b, s, q0 + r, h), d, g.dq_type, out);
  }
}

// Pass 2: dK and dV of one (batch, KV head, KV tile) item.
template <class TokenMask>
void backward_dkv_item(const BackwardParams& g, int b, int hkv, int kv_tile, float* scratch, const TokenMask& mask) {
  const AttentionParams& a = g.fwd;
  const route::RouteParams& p = a.route;
  const route::SeqInfo s = route::seq_info(p, b);
  const int d = a.head_dim, tn = p.tile_n, tm = p.tile_m;
  const int k0 = kv_tile * tn;
  // K/V rows the sequence owns: with seqused_k a packed sequence is longer than the attended
  // part, and its tail gets zero gradients.
  const int owned = p.varlen_kv ? p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b] : s.seqlen_kv;
  if (k0 >= owned) return;
  const int n_store = std::min(tn, owned - k0);
  const int nk = std::max(0, std::min(tn, s.seqlen_kv - k0));
  const int n_padded = (nk + 15) / 16 * 16;

  const detail::QTileGrad t = detail::QTileGrad::carve(scratch, tm, d);
  float* kt = scratch + detail::QTileGrad::floats(tm, d);
  float* vt = kt + static_cast<std::size_t>(d) * tn;
  float* dk = vt + static_cast<std::size_t>(d) * tn;
  float* dv = dk + static_cast<std::size_t>(tn) * d;
  float* pt = dv + static_cast<std::size_t>(tn) * d;  // P^T [tn][tm]
  float* dst = pt + static_cast<std::size_t>(tn) * tm;  // dS^T [tn][tm]
  float* score = dst + static_cast<std::size_t>(tn) * tm;
  float* dp = score + detail::kRowGroup * tn;
  float* tmp = dp + detail::kRowGroup * tn;

  std::fill(dk, dk + static_cast<std::size_t>(tn) * d, 0.0f);
  std::fill(dv, dv + static_cast<std::size_t>(tn) * d, 0.0f);
  if (nk > 0) {
    detail::load_kv_tile(a, detail::KVTensor::k, b, s, k0, nk, hkv, nullptr, kt, tn, tmp);
    detail::load_kv_tile(a, detail::KVTensor::v, b, s, k0, nk, hkv, nullptr, vt, tn, tmp);
    const int group = p.heads_q / p.heads_kv, heads_per_sparsity_head = p.heads_q / p.sparsity_heads;
    for (int h = hkv * group; h < (hkv + 1) * group; ++h) {
      const int hs = h / heads_per_sparsity_head;
      for (int q_tile = 0; q_tile < p.max_q_tiles; ++q_tile) {
        const int q0 = q_tile * tm;
        if (q0 >= s.seqlen_q) break;
        const int row = (b * p.sparsity_heads + hs) * p.max_q_tiles + q_tile;
        const route::Route* rt =
            detail::find_exact_route(a.routes + static_cast<std::int64_t>(row) * p.capacity, a.route_counts[row], kv_tile);
        if (!rt) continue;
        const int rows = std::min(tm, s.seqlen_q - q0);
        detail::load_q_tile_grad(g, b, s, q0, rows, h, t, tmp);
        for (int r0 = 0; r0 < rows; r0 += detail::kRowGroup) {
          const int unit = r0 / p.unit_m;
          if ((rt->rows >> unit) & 1u) {
            detail::group_scores(t.q + r0 * d, d, kt, tn, n_padded, score);
            detail::group_scores(t.dout + r0 * d, d, vt, tn, n_padded, dp);
            detail::group_probabilities_and_dscores(p, s, b, h, q0, r0, rows, (rt->masked >> unit) & 1u, k0, nk,
                                                    n_padded, t, score, dp, mask);
          } else {
            std::fill(score, score + detail::kRowGroup * tn, 0.0f);
            std::fill(dp, dp + detail::kRowGroup * tn, 0.0f);
          }
          for (int gr = 0; gr < detail::kRowGroup; ++gr)
            for (int j = 0; j < n_padded; ++j) {
              pt[j * tm + r0 + gr] = score[gr * tn + j];
              dst[j * tm + r0 + gr] = dp[gr * tn + j];
            }
        }
        // Groups of KV rows take the rank-`rows` update: dV += P^T dO, dK += dS^T (scale Q).
        for (int j0 = 0; j0 < n_padded; j0 += detail::kRowGroup) {
          detail::group_pv(pt + j0 * tm, tm, t.dout, rows, d, dv + j0 * d);
          detail::group_pv(dst + j0 * tm, tm, t.q, rows, d, dk + j0 * d);
        }
      }
    }
  }
  for (int j = 0; j < n_store; ++j) {
    detail::store_row(g.dk, g.kv_like_offset(g.dk_strides, b, s, k0 + j, hkv), d, g.dk_type, dk + j * d);
    detail::store_row(g.dv, g.kv_like_offset(g.dv_strides, b, s, k0 + j, hkv), d, g.dv_type, dv + j * d);
  }
}

// Prepare routes (throws on overflow before writing anything), then the two passes.
template <class TokenMask>
void run_backward(BackwardParams& g, const Workspace& ws, const TokenMask& mask) {
  prepare_routes_or_throw(g.fwd, ws, mask);
  const route::RouteParams& p = g.fwd.route;
  const int group = p.heads_q / p.sparsity_heads;
  ws.pool->parallel_for(static_cast<std::int64_t>(g.fwd.route_rows) * group, [&](std::int64_t item, int thread) {
    const int row = static_cast<int>(item / group);
    const int hs = route::row_coordinates(p, row).hs;
    backward_dq_item(g, row, hs * group + static_cast<int>(item % group), ws.scratch + thread * ws.scratch_per_thread,
                     mask);
  });
  const int kv_tiles = route::ceil_div(p.max_seqlen_kv, p.tile_n);
  ws.pool->parallel_for(static_cast<std::int64_t>(p.batch) * p.heads_kv * kv_tiles, [&](std::int64_t item, int thread) {
    const int kv_tile = static_cast<int>(item % kv_tiles);
    const int bh = static_cast<int>(item / kv_tiles);
    backward_dkv_item(g, bh / p.heads_kv, bh % p.heads_kv, kv_tile, ws.scratch + thread * ws.scratch_per_thread, mask);
  });
}

}  // namespace bsattn::cpu
