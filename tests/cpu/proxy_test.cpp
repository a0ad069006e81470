// Proxy compensation (SPEC §6): the library against the formula, eligibility under masks, the
// explicit set, rows with proxies only, no double counting, and the summary builder.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "bsattn/bsattn.hpp"
#include "bsattn/summary.hpp"
#include "random_problem.hpp"

namespace bsattn_test {
namespace {

using bsattn::DType;
using bsattn::Format;
using bsattn::Proxy;
using bsattn::TensorView;

// Random problems with proxies on, against the oracle: short last blocks, every layout, format
// and mask (eligibility is decided by brute force over the materialised mask there).
class ProxyOracleTest : public ::testing::TestWithParam<int> {};

TEST_P(ProxyOracleTest, EligibleMatchesReference) {
  CaseOptions options;
  options.proxy = Proxy::eligible;
  options.format = GetParam() % 2 ? Format::bitmask : Format::bsr;
  const auto c = make_random_case(4000000 + static_cast<std::uint64_t>(GetParam()), options);
  const std::string failure = check_against_oracle(*c);
  EXPECT_TRUE(failure.empty()) << failure;
}

TEST_P(ProxyOracleTest, ExplicitSetMatchesReference) {
  CaseOptions options;
  options.proxy = Proxy::explicit_set;
  options.format = GetParam() % 2 ? Format::block_lists : Format::bitmask;
  const auto c = make_random_case(5000000 + static_cast<std::uint64_t>(GetParam()), options);
  const std::string failure = check_against_oracle(*c);
  EXPECT_TRUE(failure.empty()) << failure;
}
INSTANTIATE_TEST_SUITE_P(Random, ProxyOracleTest, ::testing::Range(0, 60));

// An explicit set naming selected blocks too gives the same bits as one naming only the others.
class ProxyNoDoubleCountTest : public ::testing::TestWithParam<int> {};

TEST_P(ProxyNoDoubleCountTest, SelectedBlocksInTheExplicitSetAreIgnored) {
  CaseOptions options;
  options.proxy = Proxy::explicit_set;
  options.format = Format::block_lists;
  const auto c = make_random_case(6000000 + static_cast<std::uint64_t>(GetParam()), options);
  SparsityPattern& pattern = c->pattern;
  int selected_in_set = 0;
  for (std::size_t r = 0; r < pattern.proxy.size(); ++r)  // name every selected block as a proxy
    for (const std::vector<int>* selected : {&pattern.partial[r], &pattern.full[r]}) {
      if (selected == &pattern.partial[r] ? !c->problem.has_partial : !c->problem.has_full) continue;
      std::vector<int>& proxy = pattern.proxy[r];
      for (int kb : *selected)
        if (std::find(proxy.begin(), proxy.end(), kb) == proxy.end()) {
          proxy.push_back(kb);
          ++selected_in_set;
        }
      std::sort(proxy.begin(), proxy.end());
    }
  c->encode(Format::block_lists);
  const std::string failure = check_against_oracle(*c);
  ASSERT_TRUE(failure.empty()) << failure;
  const std::vector<std::uint8_t> with_selected = c->output_bytes();

  for (std::size_t r = 0; r < pattern.proxy.size(); ++r) {
    std::vector<int> unselected;
    for (int kb : pattern.proxy[r]) {
      const bool in_partial = c->problem.has_partial &&
                              std::count(pattern.partial[r].begin(), pattern.partial[r].end(), kb);
      const bool in_full = c->problem.has_full && std::count(pattern.full[r].begin(), pattern.full[r].end(), kb);
      if (!in_partial && !in_full) unselected.push_back(kb);
    }
    pattern.proxy[r] = unselected;
  }
  c->encode(Format::block_lists);
  c->run_library();
  EXPECT_TRUE(c->output_bytes() == with_selected) << c->describe() << " (" << selected_in_set << " selected blocks named)";
}
INSTANTIATE_TEST_SUITE_P(Random, ProxyNoDoubleCountTest, ::testing::Range(0, 40));

// A hand-built problem checked against the SPEC §6 formula written out here: Skv tokens in
// blocks of Bk = 16 (the last one short); Q block 0 selects nothing (proxies only), Q block 1
// selects block 1 exactly and gets proxies for every other block. Both Q blocks share one route
// row (two units), whose proxy records the CPU engine takes tile_n = 16 at a time. Summaries come
// from the library's builder; f32 throughout.
void expect_proxy_formula(int Skv) {
  const int Sq = 20, H = 2, D = 16, Bq = 16, Bk = 16, nKB = (Skv + Bk - 1) / Bk;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> q(Sq * H * D), k(Skv * D), v(Skv * D), ks(nKB * D), vs(nKB * D), o(Sq * H * D), lse(H * Sq);
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = normal(rng);
  bsattn::Problem p;
  p.heads_q = H;
  p.heads_kv = 1;
  p.head_dim = D;
  p.max_seqlen_q = Sq;
  p.max_seqlen_kv = Skv;
  p.dtype = p.out_dtype = DType::f32;
  p.block = {Bq, Bk};
  p.format = Format::block_lists;
  p.proxy = Proxy::eligible;
  p.num_threads = 2;
  const std::vector<std::int32_t> counts{0, 1}, indices{-1, 1};  // [1, 1, 2, 1]
  bsattn::Inputs in;
  in.q = TensorView::contiguous(q.data(), DType::f32, {1, Sq, H, D});
  in.k = TensorView::contiguous(k.data(), DType::f32, {1, Skv, 1, D});
  in.v = TensorView::contiguous(v.data(), DType::f32, {1, Skv, 1, D});
  in.partial.counts = TensorView::contiguous(counts.data(), DType::i32, {1, 1, 2});
  in.partial.indices = TensorView::contiguous(indices.data(), DType::i32, {1, 1, 2, 1});
  in.k_summary = TensorView::contiguous(ks.data(), DType::f32, {1, nKB, 1, D});
  in.v_summary = TensorView::contiguous(vs.data(), DType::f32, {1, nKB, 1, D});
  bsattn::build_summaries(p, in, in.k_summary, in.v_summary);
  bsattn::Outputs out;
  out.out = TensorView::contiguous(o.data(), DType::f32, {1, Sq, H, D});
  out.lse = TensorView::contiguous(lse.data(), DType::f32, {1, H, Sq});
  bsattn::attention(p, in, out);

  const double scale = 1.0 / std::sqrt(double(D));
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < Sq; ++i) {
      const float* qi = &q[(i * H + h) * D];
      // Softmax terms: denominator weight, numerator factor and the V row it multiplies.
      struct Term {
        double weight, factor;
        const float* row;
      };
      std::vector<Term> terms;
      const auto score = [&](const float* x) {
        double s = 0;
        for (int d = 0; d < D; ++d) s += double(qi[d]) * x[d];
        return scale * s;
      };
      for (int j = 0; j < nKB; ++j) {
        const int n = std::min(Bk, Skv - j * Bk);
        if (i / Bq == 1 && j == 1) {  // the selected block: exact tokens
          for (int kv = j * Bk; kv < j * Bk + n; ++kv) {
            const double e = std::exp(score(&k[kv * D]));
            terms.push_back({e, e, &v[kv * D]});
          }
        } else {  // p = exp(<q, k_mean>): numerator += p * v_sum, denominator += p * n_j
          const double pj = std::exp(score(&ks[j * D]));
          terms.push_back({pj * n, pj, &vs[j * D]});
        }
      }
      double denominator = 0;
      std::vector<double> expected(D, 0.0);
      for (const Term& t : terms) {
        denominator += t.weight;
        for (int d = 0; d < D; ++d) expected[d] += t.factor * t.row[d];
      }
      for (int d = 0; d < D; ++d)
        EXPECT_NEAR(o[(i * H + h) * D + d], expected[d] / denominator, 2e-5) << "h=" << h << " q=" << i << " d=" << d;
      EXPECT_NEAR(lse[h * Sq + i], std::log(denominator), 5e-5) << "h=" << h << " q=" << i;
    }
}

// Skv 45: three blocks, the last of 13 tokens.
TEST(ProxyFormulaTest, ShortLastBlockAndProxyOnlyRow) { expect_proxy_formula(45); }

// Skv 645: 41 blocks, the last of 5 tokens; 41 and 40 proxy records, three tiles of 16 columns.
TEST(ProxyFormulaTest, SeveralProxyTilesPerRow) { expect_proxy_formula(645); }

// bsattn::build_summaries against float64 mean-K / sum-V, every KV layout; blocks past a
// sequence's end are zero.
class SummaryBuilderTest : public ::testing::TestWithParam<int> {};

TEST_P(SummaryBuilderTest, MatchesFloat64) {
  CaseOptions options;
  options.proxy = Proxy::eligible;
  options.format = Format::bitmask;
  const auto c = make_random_case(7000000 + static_cast<std::uint64_t>(GetParam()), options);
  const bsattn::Problem& p = c->problem;
  const int nkb_max = (p.max_seqlen_kv + p.block.kv - 1) / p.block.kv;
  const std::int64_t n = static_cast<std::int64_t>(p.batch) * nkb_max * p.heads_kv * p.head_dim;
  void* k_data = c->allocate<float>(n);
  void* v_data = c->allocate<float>(n);
  const TensorView ks = TensorView::contiguous(k_data, p.dtype, {p.batch, nkb_max, p.heads_kv, p.head_dim});
  const TensorView vs = TensorView::contiguous(v_data, p.dtype, {p.batch, nkb_max, p.heads_kv, p.head_dim});
  bsattn::build_summaries(p, c->inputs, ks, vs);

  const Oracle oracle(p, c->inputs);
  const double rel = p.dtype == DType::bf16 ? 4e-3 : p.dtype == DType::f16 ? 5e-4 : 1e-6;
  std::vector<double> mean_k(p.head_dim), sum_v(p.head_dim);
  int failures = 0;
  for (int b = 0; b < p.batch; ++b)
    for (int j = 0; j < nkb_max; ++j)
      for (int h = 0; h < p.heads_kv; ++h) {
        const bool live = j < c->kv_blocks(b);
        if (live) oracle.reference_summary(b, j, h, mean_k.data(), sum_v.data());
        for (int d = 0; d < p.head_dim; ++d) {
          const double want_k = live ? mean_k[d] : 0.0, want_v = live ? sum_v[d] : 0.0;
          const double got_k = read_real(ks, {b, j, h, d}), got_v = read_real(vs, {b, j, h, d});
          // fp32 accumulation of up to Bk terms, then one rounding to the dtype.
          const bool ok = std::fabs(got_k - want_k) <= 1e-5 + rel * std::fabs(want_k) &&
                          std::fabs(got_v - want_v) <= 1e-4 + rel * std::fabs(want_v);
          if (!ok && failures++ < 5)
            ADD_FAILURE() << c->describe() << "\n  b=" << b << " j=" << j << " h=" << h << " d=" << d << ": k " << got_k
                          << " want " << want_k << ", v " << got_v << " want " << want_v;
        }
      }
}
INSTANTIATE_TEST_SUITE_P(Random, SummaryBuilderTest, ::testing::Range(0, 40));

// Malformed summaries or K/V metadata: a named error, and the summaries keep their poison.
TEST(SummaryBuilder, RejectsMalformedInputsWithoutWriting) {
  CaseOptions options;
  options.proxy = Proxy::eligible;
  options.format = Format::bitmask;
  const auto c = make_random_case(7100000, options);
  const bsattn::Problem& p = c->problem;
  const int nkb_max = (p.max_seqlen_kv + p.block.kv - 1) / p.block.kv;
  const std::int64_t n = static_cast<std::int64_t>(p.batch) * nkb_max * p.heads_kv * p.head_dim;
  std::vector<float> k_data(n, std::nanf("")), v_data(n, std::nanf(""));
  const TensorView ks = TensorView::contiguous(k_data.data(), p.dtype, {p.batch, nkb_max, p.heads_kv, p.head_dim});
  const TensorView vs = TensorView::contiguous(v_data.data(), p.dtype, {p.batch, nkb_max, p.heads_kv, p.head_dim});
  const auto expect_rejected = [&](const bsattn::Inputs& in, const TensorView& k_out, const TensorView& v_out,
                                   const std::string& argument) {
    try {
      bsattn::build_summaries(p, in, k_out, v_out);
      ADD_FAILURE() << "no error for " << argument;
    } catch (const bsattn::Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    for (std::int64_t i = 0; i < n; ++i)
      if (!std::isnan(k_data[i]) || !std::isnan(v_data[i])) {
        ADD_FAILURE() << argument << ": element " << i << " was written";
        break;
      }
  };
  TensorView short_vs = vs;
  short_vs.shape[1] = nkb_max + 1;
  expect_rejected(c->inputs, ks, short_vs, "v_summary");
  expect_rejected(c->inputs, ks, ks, "v_summary");  // overlaps k_summary
  bsattn::Inputs no_k = c->inputs;
  no_k.k = TensorView();
  expect_rejected(no_k, ks, vs, "k");
}

}  // namespace
}  // namespace bsattn_test
