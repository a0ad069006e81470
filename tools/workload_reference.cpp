// Workload::verify(): an independent float64 reference on sampled rows, written from SPEC §4-§6
// (token mask, full and partial blocks, proxy terms of unselected eligible blocks) without the
// library's route code, compared with the computed O and LSE.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "workload.hpp"
#include "workload_state.hpp"

namespace bsattn::tools {

VerifyResult Workload::verify(int rows, std::uint64_t seed) const {
  const State& st = *state_;
  const WorkloadSpec& s = st.spec;
  const MaskModel mask(s.mask, st.seqs);
  const int D = s.head_dim;
  const double scale = s.scale != 0.0f ? s.scale : 1.0 / std::sqrt(static_cast<double>(D));
  const double neg_inf = -std::numeric_limits<double>::infinity();

  struct Sample {
    int b, h, q;
  };
  std::vector<Sample> samples;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pick_h(0, s.heads_q - 1);
  for (int b = 0; b < s.batch; ++b)
    if (st.seqs[b].seqlen_q > 0) {
      samples.push_back({b, pick_h(rng), 0});
      samples.push_back({b, pick_h(rng), st.seqs[b].seqlen_q - 1});
    }
  std::uniform_int_distribution<int> pick_b(0, s.batch - 1);
  while (static_cast<int>(samples.size()) < rows) {
    const int b = pick_b(rng);
    if (st.seqs[b].seqlen_q == 0) continue;
    samples.push_back({b, pick_h(rng), std::uniform_int_distribution<int>(0, st.seqs[b].seqlen_q - 1)(rng)});
  }

  VerifyResult r = tolerances_for(s.out_dtype);
  r.rows = static_cast<int>(samples.size());
  double err2 = 0.0, ref2 = 0.0;
  std::vector<double> qv(D), acc(D), score;
  std::vector<std::int64_t> rows_kv;  // K/V element offsets of the attended tokens
  for (const Sample& smp : samples) {
    const Sequence& seq = st.seqs[smp.b];
    const int hkv = smp.h / (s.heads_q / s.heads_kv), hs = smp.h / (s.heads_q / s.sparsity_heads);
    const int qb = smp.q / s.block.q;
    const std::int64_t q_off = ((seq.q_base + smp.q) * s.heads_q + smp.h) * D;  // batched: q_base = b * Sq
    for (int i = 0; i < D; ++i) qv[i] = element_as_float(st.q.view, q_off + i) * scale;
    auto dot = [&](const TensorView& t, std::int64_t off) {
      double x = 0.0;
      for (int i = 0; i < D; ++i) x += qv[i] * element_as_float(t, off + i);
      return x;
    };

    // Exact terms: full blocks whole, partial blocks through the mask.
    score.clear();
    rows_kv.clear();
    const std::size_t row = st.row(smp.b, hs, qb);
    auto attend_block = [&](int kb, bool whole) {
      for (int kv = kb * s.block.kv; kv < std::min((kb + 1) * s.block.kv, seq.seqlen_kv); ++kv)
        if (whole || !s.mask.any() || mask.visible(smp.b, smp.q, kv)) {
          rows_kv.push_back(st.kv_row(smp.b, kv, hkv));
          score.push_back(dot(st.k.view, rows_kv.back()));
        }
    };
    for (int kb : st.partial[row]) attend_block(kb, false);
    for (int kb : st.full[row]) attend_block(kb, true);

    // Proxy terms: unselected blocks the mask keeps whole for the whole Q block (SPEC §6).
    struct ProxyTerm {
      double score;  // s + ln n_j: the block's n_j tokens of mean V
      int tokens;    // n_j
      std::int64_t summary_offset;
    };
    std::vector<ProxyTerm> proxies;
    if (s.proxy == Proxy::eligible) {
      const auto& pl = st.partial[row];
      const auto& fl = st.full[row];
      for (int kb = 0; kb < seq.kv_blocks; ++kb) {
        if (std::binary_search(pl.begin(), pl.end(), kb) || std::binary_search(fl.begin(), fl.end(), kb)) continue;
        const long long area = block_area(seq, qb, kb, s.block);
        if (s.mask.any() && mask.count_block(smp.b, qb, kb, s.block) != area) continue;
        const std::int64_t off = ((static_cast<std::int64_t>(smp.b) * st.max_kv_blocks + kb) * s.heads_kv + hkv) * D;
        const int n_j = std::min(s.block.kv, seq.seqlen_kv - kb * s.block.kv);
        proxies.push_back({dot(st.k_summary.view, off) + std::log(static_cast<double>(n_j)), n_j, off});
      }
    }

    double m = neg_inf;
    for (double x : score) m = std::max(m, x);
    for (const ProxyTerm& p : proxies) m = std::max(m, p.score);
    std::fill(acc.begin(), acc.end(), 0.0);
    double l = 0.0;
    if (m != neg_inf) {
      for (std::size_t j = 0; j < score.size(); ++j) {
        const double w = std::exp(score[j] - m);
        l += w;
        for (int i = 0; i < D; ++i) acc[i] += w * element_as_float(st.v.view, rows_kv[j] + i);
      }
      for (const ProxyTerm& p : proxies) {
        const double w = std::exp(p.score - m);
        l += w;  // v_summary is the sum of V: its mean carries weight w
        for (int i = 0; i < D; ++i) acc[i] += w / p.tokens * element_as_float(st.v_summary.view, p.summary_offset + i);
      }
    }
    const double ref_lse = l > 0.0 ? m + std::log(l) : neg_inf;

    const std::int64_t o_off = q_off;  // O has Q's layout
    for (int i = 0; i < D; ++i) {
      const double ref = l > 0.0 ? acc[i] / l : 0.0;
      const double got = element_as_float(st.out.view, o_off + i);
      const double e = std::isfinite(got) ? std::abs(got - ref) : std::numeric_limits<double>::infinity();
      r.max_abs_err = std::max(r.max_abs_err, e);
      err2 += e * e;
      ref2 += ref * ref;
    }
    const std::int64_t lse_off = st.varlen() ? static_cast<std::int64_t>(smp.h) * st.total_q + seq.q_base + smp.q
                                             : (static_cast<std::int64_t>(smp.b) * s.heads_q + smp.h) * s.max_seqlen_q() + smp.q;
    const double got_lse = st.lse.as<float>()[lse_off];
    if (!(got_lse == ref_lse))  // equal infinities are exact
      r.max_lse_err = std::max(r.max_lse_err, std::isfinite(got_lse) && std::isfinite(ref_lse)
                                                  ? std::abs(got_lse - ref_lse)
                                                  : std::numeric_limits<double>::infinity());
  }
  r.rel_l2_err = ref2 > 0.0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  return r;
}

}  // namespace bsattn::tools
