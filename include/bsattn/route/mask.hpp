// The built-in token mask (SPEC §4): per-element evaluation, and exact classification of a
// rectangle of in-range (q, kv) pairs as empty, partial or full.
#pragma once
#include <cstdint>

#include "bsattn/route/params.hpp"

namespace bsattn::route {

enum class Visibility : std::uint8_t { empty, partial, full };

// The causal / window / sink part of the mask for one query row q: kv is visible iff
// window_lo <= kv <= window_hi or kv < sink_end (at most two intervals), that is
// causal_ok && (in_window || kv < sink_tokens).
struct PositionalBounds {
  int window_lo, window_hi, sink_end;
  BSATTN_HD bool visible(int kv) const { return (kv >= window_lo && kv <= window_hi) || kv < sink_end; }
};

BSATTN_HD PositionalBounds positional_bounds(const RouteParams& p, const SeqInfo& s, int q) {
  const long long unbounded = 0x3fffffff, diag = static_cast<long long>(q) + s.diag_offset;
  long long lo = p.window_left < 0 ? -unbounded : diag - p.window_left;
  long long hi = p.window_right < 0 ? unbounded : diag + p.window_right;
  long long sink_end = p.sink_tokens;
  if (p.causal) {
    hi = hi < diag ? hi : diag;
    sink_end = sink_end < diag + 1 ? sink_end : diag + 1;
  }
  const auto clamp = [=](long long v) { return static_cast<int>(v < -unbounded ? -unbounded : (v > unbounded ? unbounded : v)); };
  return PositionalBounds{clamp(lo), clamp(hi), clamp(sink_end)};
}

// The per-token tensors of sequence b, indexed by sequence-local position: its queries' and KV
// tokens' document ids, and its KV validity bits (one word per 32 tokens).
BSATTN_HD const std::int32_t* query_documents(const RouteParams& p, const SeqInfo& s, int b) {
  return p.doc_q + (p.varlen_q ? s.q_base : b * p.doc_q_batch_stride);
}
BSATTN_HD const std::int32_t* kv_documents(const RouteParams& p, const SeqInfo& s, int b) {
  return p.doc_kv + (p.varlen_kv ? s.kv_base : b * p.doc_kv_batch_stride);
}
BSATTN_HD const std::uint32_t* kv_valid_words(const RouteParams& p, int b) { return p.kv_valid + b * p.kv_valid_batch_stride; }

BSATTN_HD bool token_tensors_visible(const RouteParams& p, const SeqInfo& s, int b, int q, int kv) {
  if (p.doc_q && query_documents(p, s, b)[q] != kv_documents(p, s, b)[kv]) return false;
  if (p.kv_valid && !((kv_valid_words(p, b)[kv / 32] >> (kv % 32)) & 1u)) return false;
  return true;
}

// The whole built-in mask. Sequence-local indices; q < seqlen_q and kv < seqlen_kv are the
// caller's business.
BSATTN_HD bool token_visible(const RouteParams& p, const SeqInfo& s, int b, int q, int kv) {
  return positional_bounds(p, s, q).visible(kv) && token_tensors_visible(p, s, b, q, kv);
}

namespace detail {

BSATTN_HD long long max_ll(long long a, long long b) { return a > b ? a : b; }
BSATTN_HD long long min_ll(long long a, long long b) { return a < b ? a : b; }

// Causal, window and sinks only. Exact for both empty and full: every (q, kv) in the rectangle
// depends on kv - diag(q), and that difference covers a contiguous integer range.
BSATTN_HD Visibility positional(const RouteParams& p, const SeqInfo& s, int q0, int q1, int k0, int k1) {
  const long long dmin = q0 + s.diag_offset, dmax = q1 - 1 + s.diag_offset;
  const long long unlimited = 1LL << 40;
  const long long lo = p.window_left < 0 ? -unlimited : -p.window_left;  // bounds on kv - diag
  long long hi = p.window_right < 0 ? unlimited : p.window_right;
  if (p.causal) hi = min_ll(hi, 0);
  const long long causal_hi = p.causal ? 0 : unlimited;
  // Full: each pair is causal-ok and either in the window or a sink.
  const bool causal_full = (k1 - 1) - dmin <= causal_hi;
  const int first_non_sink = static_cast<int>(max_ll(k0, p.sink_tokens));
  const bool window_full = first_non_sink >= k1 ||
                           (first_non_sink - dmax >= lo && (k1 - 1) - dmin <= (p.window_right < 0 ? unlimited : p.window_right));
  if (causal_full && window_full) return Visibility::full;
  // Empty: no pair in the window (with causality), and no causal-ok sink.
  const bool window_any = max_ll(lo, k0 - dmax) <= min_ll(hi, (k1 - 1) - dmin);
  const bool sink_any = k0 < p.sink_tokens && (!p.causal || k0 <= dmax);
  return (window_any || sink_any) ? Visibility::partial : Visibility::empty;
}

BSATTN_HD Visibility documents(const RouteParams& p, const SeqInfo& s, int b, int q0, int q1, int k0, int k1) {
  const std::int32_t* dq = query_documents(p, s, b);
  const std::int32_t* dk = kv_documents(p, s, b);
  const std::int32_t first = dq[q0];
  bool q_uniform = true;
  for (int q = q0 + 1; q < q1 && q_uniform; ++q) q_uniform = dq[q] == first;
  bool all_same = q_uniform, any_same = false;
  for (int kv = k0; kv < k1; ++kv) {
    const bool same = dk[kv] == first;
    all_same = all_same && same;
    any_same = any_same || same;
  }
  if (all_same) return Visibility::full;
  return (q_uniform && !any_same) ? Visibility::empty : Visibility::partial;
}

BSATTN_HD Visibility valid_bits(const RouteParams& p, int b, int k0, int k1) {
  const std::uint32_t* words = kv_valid_words(p, b);
  bool all = true, any = false;
  for (int kv = k0; kv < k1; ++kv) {
    const bool bit = (words[kv / 32] >> (kv % 32)) & 1u;
    all = all && bit;
    any = any || bit;
  }
  return all ? Visibility::full : (any ? Visibility::partial : Visibility::empty);
}

BSATTN_HD Visibility combine(Visibility a, Visibility b) {
  if (a == Visibility::empty || b == Visibility::empty) return Visibility::empty;
  return (a == Visibility::full && b == Visibility::full) ? Visibility::full : Visibility::partial;
}

}  // namespace detail

// Classifies the rectangle [q0, q1) x [k0, k1), clipped to the sequence, under the built-in mask.
// `full` is exact (proxy eligibility depends on it); `empty` may be conservative (it only saves work).
BSATTN_HD Visibility classify_builtin(const RouteParams& p, const SeqInfo& s, int b, int q0, int q1, int k0, int k1) {
  q1 = q1 < s.seqlen_q ? q1 : s.seqlen_q;
  k1 = k1 < s.seqlen_kv ? k1 : s.seqlen_kv;
  if (q0 >= q1 || k0 >= k1) return Visibility::empty;
  Visibility v = detail::positional(p, s, q0, q1, k0, k1);
  if (v != Visibility::empty && p.doc_q) v = detail::combine(v, detail::documents(p, s, b, q0, q1, k0, k1));
  if (v != Visibility::empty && p.kv_valid) v = detail::combine(v, detail::valid_bits(p, b, k0, k1));
  return v;
}

// As classify_builtin, for deciding whether a tile needs the per-element mask: a custom functor
// is unknown here, so with one nothing is `full`.
BSATTN_HD Visibility classify(const RouteParams& p, const SeqInfo& s, int b, int q0, int q1, int k0, int k1) {
  const Visibility v = classify_builtin(p, s, b, q0, q1, k0, k1);
  return (v == Visibility::full && p.custom_mask) ? Visibility::partial : v;
}

}  // namespace bsattn::route
