// The CPU engine: route preparation and an online-softmax walk over the route stream, fp32
// accumulation, multithreaded over (route row, query head). Header-only so that a custom mask
// functor is inlined into it (custom_mask.hpp); the library instantiates it without one.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "bsattn/attention_params.hpp"
#include "bsattn/cpu/numeric.hpp"
#include "bsattn/cpu/thread_pool.hpp"
#include "bsattn/route/prepare.hpp"
#include "bsattn/tensor.hpp"

namespace bsattn::cpu {

// No custom functor: the built-in mask is the whole mask.
struct NoTokenMask {
  static constexpr bool kActive = false;
  bool operator()(int, int, int, int) const { return true; }
};

// Adapts a user functor bool(b, h, q, kv) to route preparation's whole-block question.
template <class TokenMask>
struct WholeBlockQuery {
  const TokenMask* mask;
  int heads_per_sparsity_head;
  bool keeps_whole(int b, int hs, int q0, int q1, int k0, int k1) const {
    if constexpr (!TokenMask::kActive) return true;
    for (int h = hs * heads_per_sparsity_head; h < (hs + 1) * heads_per_sparsity_head; ++h)
      for (int q = q0; q < q1; ++q)
        for (int kv = k0; kv < k1; ++kv)
          if (!(*mask)(b, h, q, kv)) return false;
    return true;
  }
};

// Floats of scratch each worker thread needs.
inline std::size_t scratch_floats(int tile_m, int tile_n, int head_dim) {
  const std::size_t m = tile_m, n = tile_n, d = head_dim;
  return m * d /*q*/ + m * d /*acc*/ + d * n /*k^T*/ + n * d /*v*/ + 4 * n /*scores of a row group*/ +
         2 * m /*max, sum*/ + d /*a staged row*/ + n /*proxy columns' log n_j*/;
}

struct RowOverflow {
  int row = -1;
  int needed = 0;
};

// Fills routes[row * capacity ...] and counts[row]; reports the first overflowing row, if any.
template <class TokenMask>
RowOverflow prepare_routes(const AttentionParams& a, route::Route* routes, std::int32_t* counts, ThreadPool& pool,
                           const TokenMask& mask) {
  const route::RouteParams& p = a.route;
  const WholeBlockQuery<TokenMask> whole{&mask, p.heads_q / p.sparsity_heads};
  std::atomic<std::int64_t> first_overflow{std::numeric_limits<std::int64_t>::max()};
  pool.parallel_for(a.route_rows, [&](std::int64_t row, int) {
    const int needed = route::prepare_row(p, static_cast<int>(row), routes + row * p.capacity, whole);
    counts[row] = std::min(needed, p.capacity);
    if (needed > p.capacity) {
      std::int64_t seen = first_overflow.load();
      const std::int64_t mine = (row << 32) | static_cast<std::uint32_t>(needed);
      while (mine < seen && !first_overflow.compare_exchange_weak(seen, mine)) {
      }
    }
  });
  RowOverflow o;
  const std::int64_t v = first_overflow.load();
  if (v != std::numeric_limits<std::int64_t>::max()) {
    o.row = static_cast<int>(v >> 32);
    o.needed = static_cast<int>(v & 0xffffffff);
  }
  return o;
}

namespace detail {

inline float load(const void* base, std::int64_t i, ElementType t) {
  switch (t) {
    case ElementType::f32: return static_cast<const float*>(base)[i];
    case ElementType::f16: return half_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case ElementType::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
  }
  return 0.0f;
}

inline void load_row(const void* base, std::int64_t offset, int n, ElementType t, float* dst) {
  switch (t) {
    case ElementType::f32: {
      const float* src = static_cast<const float*>(base) + offset;
      std::copy(src, src + n, dst);
      break;
    }
    case ElementType::f16: {
      const std::uint16_t* src = static_cast<const std::uint16_t*>(base) + offset;
      for (int i = 0; i < n; ++i) dst[i] = half_to_float(src[i]);
      break;
    }
    case ElementType::bf16: {
      const std::uint16_t* src = static_cast<const std::uint16_t*>(base) + offset;
      for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
      break;
    }
  }
}

inline void store_row(void* base, std::int64_t offset, int n, ElementType t, const float* src) {
  switch (t) {
    case ElementType::f32: std::copy(src, src + n, static_cast<float*>(base) + offset); break;
    case ElementType::f16: {
      std::uint16_t* dst = static_cast<std::uint16_t*>(base) + offset;
      for (int i = 0; i < n; ++i) dst[i] = float_to_half(src[i]);
      break;
    }
    case ElementType::bf16: {
      std::uint16_t* dst = static_cast<std::uint16_t*>(base) + offset;
      for (int i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
      break;
    }
  }
}

// Online softmax state of one query row: running max m, running sum l, accumulator acc[D].
struct RowState {
  float* acc;
  float& m;
  float& l;
};

// The largest of row[0, n), or NaN when one of them is NaN: a NaN score (from a NaN in Q or K)
// must reach the row's output, not be skipped by the comparison (std::max drops it).
inline float nan_propagating_max(const float* row, int n) {
  float mx = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int j = 0; j < n; ++j) {
    mx = std::max(mx, row[j]);
    nan |= row[j] != row[j];
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : mx;
}

// Rescales the state to a new running max (NaN makes every term NaN from here on).
inline void rescale(RowState s, float new_max, int d) {
  if (new_max <= s.m) return;
  const float c = s.m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(s.m - new_max);
  s.l *= c;
  for (int i = 0; i < d; ++i) s.acc[i] *= c;
  s.m = new_max;
}

// Rows are processed in groups of kRowGroup so that the two products keep a register block of
// accumulators (rows x 16 columns) instead of streaming one row through memory. Units are
// multiples of 16 rows, so a group never straddles two units.
constexpr int kRowGroup = 4;

// Eight floats as one value: GCC/Clang vector extensions lower to AVX2 where the build enables
// it and to SSE pairs elsewhere, and keep a block of accumulators in registers (plain loops here
// were vectorised 4 wide and spilled).
using Float8 = float __attribute__((vector_size(32)));
// By reference: a vector passed by value would change the ABI between AVX and non-AVX builds.
inline void load8(Float8& v, const float* p) { std::memcpy(&v, p, sizeof v); }
inline void store8(float* p, const Float8& v) { std::memcpy(p, &v, sizeof v); }

using Int8 = std::int32_t __attribute__((vector_size(32)));

// exp(x) for x <= 0, eight at a time: exp(x) = 2^n * exp(f), n = round(x / ln 2),
// f = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 split in two for an exact product), exp(f) by its
// degree-6 Taylor polynomial (truncation < 2e-7 relative). Below -87.3 (2^n subnormal) and at
// -inf the result is 0. Scalar expf was a quarter of the engine's time.
inline void exp8_nonpositive(Float8& x) {
  const Float8 zero = {};
  const Int8 underflow = x < -87.3f;
  const Float8 t = x * 1.44269504088896341f - 0.5f;  // x <= 0: truncation of t rounds x / ln 2
  Int8 n = __builtin_convertvector(t, Int8);
  n = underflow ? Int8{} : n;
  const Float8 nf = __builtin_convertvector(n, Float8);
  const Float8 xs = underflow ? zero : x;
  const Float8 f = xs - nf * 0.693145751953125f - nf * 1.42860682030941723212e-6f;
  Float8 p = 1.0f / 720 + zero;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const Int8 exponent_bits = (n + 127) << 23;
  Float8 scale;
  std::memcpy(&scale, &exponent_bits, sizeof scale);
  x = underflow ? zero : p * scale;
}

// row[j] = exp(row[j] - shift) for j < n (n a multiple of 8, every row[j] - shift <= 0);
// returns the sum.
inline float exp_shifted_in_place(float* row, int n, float shift) {
  Float8 sum = {};
  for (int j = 0; j < n; j += 8) {
    Float8 x;
    load8(x, row + j);
    x -= shift;
    exp8_nonpositive(x);
    store8(row + j, x);
    sum += x;
  }
  float total = 0.0f;
  for (int c = 0; c < 8; ++c) total += sum[c];
  return total;
}

// Sets to -inf the scores sr[j], j < nk, of query q (head h) against KV tokens k0 + j that the
// token mask hides: positional terms as two intervals (cheap, vectorisable), the per-token tensors
// and the custom functor only when present. Used on partial (masked) routes only.
template <class TokenMask>
inline void apply_token_mask(const route::RouteParams& p, const route::SeqInfo& s, int b, int h, int q, int k0,
                             int nk, float* sr, const TokenMask& mask) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const route::PositionalBounds bounds = route::positional_bounds(p, s, q);
  for (int j = 0; j < nk; ++j)
    if (!bounds.visible(k0 + j)) sr[j] = neg_inf;
  if (TokenMask::kActive || p.doc_q || p.kv_valid)
    for (int j = 0; j < nk; ++j)
      if (!route::token_tensors_visible(p, s, b, q, k0 + j) || !mask(b, h, q, k0 + j)) sr[j] = neg_inf;
}

enum class KVTensor { k, v };

// Tokens [k0, k0 + n) of KV head hkv of K or V in fp32, as rows (rows[j * d + i]) and/or
// transposed (transposed[i * tn + j]); either destination may be null. tmp holds d floats.
inline void load_kv_tile(const AttentionParams& a, KVTensor which, int b, const route::SeqInfo& s, int k0, int n,
                         int hkv, float* rows, float* transposed, int tn, float* tmp) {
  const bool k = which == KVTensor::k;
  const int d = a.head_dim;
  for (int j = 0; j < n; ++j) {
    float* row = rows ? rows + static_cast<std::size_t>(j) * d : tmp;
    load_row(k ? a.k : a.v,
             a.kv_offset(b, s, k0 + j, hkv, k ? a.k_batch_stride : a.v_batch_stride,
                         k ? a.k_token_stride : a.v_token_stride, k ? a.k_head_stride : a.v_head_stride),
             d, a.in_type, row);
    if (transposed)
      for (int i = 0; i < d; ++i) transposed[i * tn + j] = row[i];
  }
}

// score[r][j] = <q_r, k_j> for the group's rows and j < n (n a multiple of 16, k^T row stride tn).
inline void group_scores(const float* q, int d, const float* kt, int tn, int n, float* score) {
  for (int jb = 0; jb < n; jb += 16) {
    Float8 s[kRowGroup][2] = {};
    for (int i = 0; i < d; ++i) {
      Float8 k0, k1;
      load8(k0, kt + i * tn + jb);
      load8(k1, kt + i * tn + jb + 8);
      for (int r = 0; r < kRowGroup; ++r) {
        const float qv = q[r * d + i];
        s[r][0] += qv * k0;
        s[r][1] += qv * k1;
      }
    }
    for (int r = 0; r < kRowGroup; ++r) {
      store8(score + r * tn + jb, s[r][0]);
      store8(score + r * tn + jb + 8, s[r][1]);
    }
  }
}

// acc[r][ib, ib + 8 * V) += sum_{j < n} p[r][j] * v[j][ib, ib + 8 * V).
template <int V>
inline void group_pv_columns(const float* p, int tn, const float* v, int n, int d, int ib, float* acc) {
  Float8 o[kRowGroup][V];
  for (int r = 0; r < kRowGroup; ++r)
    for (int c = 0; c < V; ++c) load8(o[r][c], acc + r * d + ib + 8 * c);
  for (int j = 0; j < n; ++j) {
    Float8 vj[V];
    for (int c = 0; c < V; ++c) load8(vj[c], v + j * d + ib + 8 * c);
    for (int r = 0; r < kRowGroup; ++r) {
      const float pr = p[r * tn + j];
      for (int c = 0; c < V; ++c) o[r][c] += pr * vj[c];
    }
  }
  for (int r = 0; r < kRowGroup; ++r)
    for (int c = 0; c < V; ++c) store8(acc + r * d + ib + 8 * c, o[r][c]);
}

// head_dim is a multiple of 8 (validated).
inline void group_pv(const float* p, int tn, const float* v, int n, int d, float* acc) {
  int ib = 0;
  for (; ib + 16 <= d; ib += 16) group_pv_columns<2>(p, tn, v, n, d, ib, acc);
  for (; ib < d; ib += 8) group_pv_columns<1>(p, tn, v, n, d, ib, acc);
}

// The proxy terms of `n` (<= tn) consecutive proxy records of a route row for its `rows` query
// rows (q scaled, acc / row_max / row_sum their online-softmax state). Record j stands for KV
// block j' = records[j].index, n_j of its tokens in the sequence: its column scores
// <q, K mean of j'> + ln n_j, so exp(column - m) = exp(<q, K mean> - m) n_j is the block's weight
// in the denominator, and its value row is the V sum over n_j (the V mean), which that weight
// turns back into exp(<q, K mean> - m) V sum (SPEC §6). A row takes the columns whose records
// carry its unit. kt / v / score / log_n: scratch of tn columns; tmp: d floats.
inline void attend_proxy_tile(const AttentionParams& a, int b, const route::SeqInfo& s, int hkv,
                              const route::Route* records, int n, const float* q, int rows, float* kt, float* v,
                              float* score, float* log_n, float* tmp, float* acc, float* row_max, float* row_sum) {
  const route::RouteParams& p = a.route;
  const int d = a.head_dim, tn = p.tile_n;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < n; ++j) {
    const int block = records[j].index;
    const float n_j = static_cast<float>(std::min(p.block_kv, s.seqlen_kv - block * p.block_kv));
    load_row(a.k_summary, b * a.summary_batch_stride + block * a.summary_block_stride + hkv * a.summary_head_stride,
             d, a.in_type, tmp);
    for (int i = 0; i < d; ++i) kt[i * tn + j] = tmp[i];
    float* vj = v + static_cast<std::size_t>(j) * d;
    load_row(a.v_summary,
             b * a.v_summary_batch_stride + block * a.v_summary_block_stride + hkv * a.v_summary_head_stride, d,
             a.in_type, vj);
    const float inv_n = 1.0f / n_j;
    for (int i = 0; i < d; ++i) vj[i] *= inv_n;
    log_n[j] = std::log(n_j);
  }
  const int n_padded = (n + 15) / 16 * 16;  // <= tn; the padding columns' scores are set to -inf
  for (int r0 = 0; r0 < rows; r0 += kRowGroup) {
    const int unit = r0 / p.unit_m;
    bool any = false;
    for (int j = 0; j < n; ++j) any |= ((records[j].rows >> unit) & 1u) != 0;
    if (!any) continue;
    group_scores(q + r0 * d, d, kt, tn, n_padded, score);
    for (int g = 0; g < kRowGroup; ++g) {
      float* sr = score + g * tn;
      const int r = r0 + g;
      if (r >= rows) {  // past the sequence: contributes nothing
        std::fill(sr, sr + n, 0.0f);
        continue;
      }
      for (int j = 0; j < n; ++j) sr[j] = ((records[j].rows >> unit) & 1u) ? sr[j] + log_n[j] : neg_inf;
      const float mx = nan_propagating_max(sr, n);
      if (mx == neg_inf) {  // no term for this row (or an infinite Q or summary element: weight 0)
        std::fill(sr, sr + n, 0.0f);
        continue;
      }
      RowState st{acc + r * d, row_max[r], row_sum[r]};
      rescale(st, mx, d);
      std::fill(sr + n, sr + n_padded, neg_inf);
      st.l += exp_shifted_in_place(sr, n_padded, st.m);
    }
    group_pv(score, tn, v, n, d, acc + r0 * d);
  }
}

}  // namespace detail

// Attends one (route row, query head) work item and writes its O rows and LSE.
template <class TokenMask>
void attend_item(const AttentionParams& a, int row, int h, float* scratch, const TokenMask& mask) {
  using detail::RowState;
  const route::RouteParams& p = a.route;
  const route::RowCoordinates rc = route::row_coordinates(p, row);
  const route::SeqInfo s = route::seq_info(p, rc.b);
  const int q0 = rc.q_tile * p.tile_m;
  if (q0 >= s.seqlen_q) return;
  const int rows = std::min(p.tile_m, s.seqlen_q - q0);
  const int d = a.head_dim, tn = p.tile_n;
  const int hkv = h / (p.heads_q / p.heads_kv);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  float* q = scratch;
  float* acc = q + static_cast<std::size_t>(p.tile_m) * d;
  float* kt = acc + static_cast<std::size_t>(p.tile_m) * d;
  float* v = kt + static_cast<std::size_t>(d) * tn;
  float* score = v + static_cast<std::size_t>(tn) * d;
  float* row_max = score + detail::kRowGroup * tn;
  float* row_sum = row_max + p.tile_m;
  float* tmp = row_sum + p.tile_m;  // d
  float* log_n = tmp + d;           // tn

  for (int r = 0; r < rows; ++r) {
    detail::load_row(a.q, a.q_offset(rc.b, s, q0 + r, h), d, a.in_type, q + r * d);
    for (int i = 0; i < d; ++i) q[r * d + i] *= a.scale;
    std::fill(acc + r * d, acc + (r + 1) * d, 0.0f);
    row_max[r] = neg_inf;
    row_sum[r] = 0.0f;
  }

  const route::Route* routes = a.routes + static_cast<std::int64_t>(row) * p.capacity;
  const int count = a.route_counts[row];
  for (int ri = 0; ri < count; ++ri) {
    const route::Route rt = routes[ri];
    if (rt.kind == static_cast<std::uint8_t>(route::RouteKind::exact)) {
      const int k0 = rt.index * tn;
      const int nk = std::min(tn, s.seqlen_kv - k0);
      detail::load_kv_tile(a, detail::KVTensor::k, rc.b, s, k0, nk, hkv, nullptr, kt, tn, tmp);
      detail::load_kv_tile(a, detail::KVTensor::v, rc.b, s, k0, nk, hkv, v, nullptr, tn, tmp);
      const int n_padded = (nk + 15) / 16 * 16;  // <= tn: tile_n is a multiple of 16
      for (int r0 = 0; r0 < rows; r0 += detail::kRowGroup) {
        const int unit = r0 / p.unit_m;
        if (!((rt.rows >> unit) & 1u)) continue;
        detail::group_scores(q + r0 * d, d, kt, tn, n_padded, score);
        for (int g = 0; g < detail::kRowGroup; ++g) {
          float* sr = score + g * tn;
          const int r = r0 + g;
          if (r >= rows) {  // past the sequence: contributes nothing
            std::fill(sr, sr + nk, 0.0f);
            continue;
          }
          if ((rt.masked >> unit) & 1u) detail::apply_token_mask(p, s, rc.b, h, q0 + r, k0, nk, sr, mask);
          const float mx = detail::nan_propagating_max(sr, nk);
          if (mx == neg_inf) {  // nothing visible in this tile for this row
            std::fill(sr, sr + nk, 0.0f);
            continue;
          }
          RowState st{acc + r * d, row_max[r], row_sum[r]};
          detail::rescale(st, mx, d);
          std::fill(sr + nk, sr + n_padded, neg_inf);  // the padding columns weigh 0
          st.l += detail::exp_shifted_in_place(sr, n_padded, st.m);
        }
        detail::group_pv(score, tn, v, nk, d, acc + r0 * d);
      }
    } else {
      // Proxy records (SPEC §6; they close the row): up to tn of them as one tile, the summaries
      // as its keys and values, so that they take the exact path's vector products.
      int n = 1;
      while (n < tn && ri + n < count && routes[ri + n].kind == static_cast<std::uint8_t>(route::RouteKind::proxy)) ++n;
      detail::attend_proxy_tile(a, rc.b, s, hkv, routes + ri, n, q, rows, kt, v, score, log_n, tmp, acc, row_max,
                                  row_sum);
      ri += n - 1;
    }
  }

  for (int r = 0; r < rows; ++r) {
    float* o = acc + r * d;
    const bool empty = row_sum[r] == 0.0f;
    const float inv = empty ? 0.0f : 1.0f / row_sum[r];
    for (int i = 0; i < d; ++i) o[i] *= inv;
    detail::store_row(a.out, a.out_offset(rc.b, s, q0 + r, h), d, a.out_type, o);
    if (a.lse) a.lse[a.lse_offset(rc.b, s, q0 + r, h)] = empty ? neg_inf : row_max[r] + std::log(row_sum[r]);
  }
}

// Attends every route row for every query head of its sparsity head.
template <class TokenMask>
void attend(const AttentionParams& a, ThreadPool& pool, float* scratch, std::size_t scratch_per_thread,
            const TokenMask& mask) {
  const int group = a.route.heads_q / a.route.sparsity_heads;
  pool.parallel_for(static_cast<std::int64_t>(a.route_rows) * group, [&](std::int64_t item, int thread) {
    const int row = static_cast<int>(item / group);
    const int hs = route::row_coordinates(a.route, row).hs;
    attend_item(a, row, hs * group + static_cast<int>(item % group), scratch + thread * scratch_per_thread, mask);
  });
}

}  // namespace bsattn::cpu

namespace bsattn::cpu {

// What a plan hands the CPU engine: its preallocated workspace.
struct Workspace {
  route::Route* routes = nullptr;
  std::int32_t* counts = nullptr;
  ThreadPool* pool = nullptr;
  float* scratch = nullptr;
  std::size_t scratch_per_thread = 0;
};

// Prepares every route row into the workspace and points `a` at it. Throws bsattn::Error on
// route-capacity overflow (nothing has been written then).
template <class TokenMask>
void prepare_routes_or_throw(AttentionParams& a, const Workspace& ws, const TokenMask& mask) {
  a.routes = ws.routes;
  a.route_counts = ws.counts;
  const RowOverflow o = prepare_routes(a, ws.routes, ws.counts, *ws.pool, mask);
  if (o.row >= 0) {
    const route::RowCoordinates c = route::row_coordinates(a.route, o.row);
    throw Error("max_routes_per_row", "route row (b=" + std::to_string(c.b) + ", hs=" + std::to_string(c.hs) +
                                          ", q_tile=" + std::to_string(c.q_tile) + ") needs " +
                                          std::to_string(o.needed) + " routes; capacity is " +
                                          std::to_string(a.route.capacity));
  }
}

// Prepare routes, then attend. Throws bsattn::Error on route-capacity overflow, before any
// output is written.
template <class TokenMask>
void run(AttentionParams& a, const Workspace& ws, const TokenMask& mask) {
  prepare_routes_or_throw(a, ws, mask);
  attend(a, *ws.pool, ws.scratch, ws.scratch_per_thread, mask);
}

}  // namespace bsattn::cpu
