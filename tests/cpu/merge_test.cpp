// merge_state / merge_states (bsattn/merge.hpp). Random problems: every row's KV blocks are split
// into N disjoint parts, attention() runs on each part with its LSE, and the merge must match the
// float64 oracle over the union, one library pass over the union and a float64 merge of the same
// parts; merge_states writes into the case's strided, poisoned output layout, merge_state folds
// the parts in place. Then the -inf / NaN rules on hand-made rows, a merge large enough for the
// worker threads, and validation (clear errors, nothing written).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "api/merge_params.hpp"
#include "bsattn/merge.hpp"
#include "random_problem.hpp"

namespace bsattn_test {
namespace {

using bsattn::DType;
using bsattn::Format;
using bsattn::QLayout;
using bsattn::TensorView;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Elements a strided view spans.
std::int64_t span(const TensorView& t) {
  std::int64_t e = 1;
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] == 0) return 0;
    e += (t.shape[i] - 1) * t.stride[i];
  }
  return e;
}

// `count` tensors of `like`'s shape and strides stacked on a new leading dimension, `gap`
// elements apart, in storage owned by the case.
TensorView stack(RandomCase& c, const TensorView& like, int count, std::int64_t gap) {
  TensorView t;
  const std::int64_t step = span(like) + gap;
  t.data = c.allocate<std::uint32_t>(step * count);
  t.dtype = like.dtype;
  t.rank = like.rank + 1;
  t.shape[0] = count;
  t.stride[0] = step;
  for (int i = 0; i < like.rank; ++i) {
    t.shape[i + 1] = like.shape[i];
    t.stride[i + 1] = like.stride[i];
  }
  return t;
}

// Part i of a stacked tensor.
TensorView slice(const TensorView& stacked, std::int64_t i) {
  TensorView t = stacked;
  t.rank = stacked.rank - 1;
  for (int d = 0; d < t.rank; ++d) {
    t.shape[d] = stacked.shape[d + 1];
    t.stride[d] = stacked.stride[d + 1];
  }
  t.data = static_cast<char*>(stacked.data) +
           i * stacked.stride[0] * static_cast<std::int64_t>(bsattn::element_size(stacked.dtype));
  return t;
}

// A row-major tensor of `shape` in storage owned by the case.
TensorView contiguous(RandomCase& c, DType dtype, std::initializer_list<std::int64_t> shape) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= s;
  return TensorView::contiguous(c.allocate<std::uint32_t>(n), dtype, shape);
}

// Row-major O and LSE for the case's problem.
bsattn::Outputs contiguous_outputs(RandomCase& c) {
  const bsattn::Problem& pb = c.problem;
  if (pb.q_layout == QLayout::varlen)
    return {contiguous(c, pb.out_dtype, {pb.total_q, pb.heads_q, pb.head_dim}),
            contiguous(c, DType::f32, {pb.heads_q, pb.total_q})};
  return {contiguous(c, pb.out_dtype, {pb.batch, pb.max_seqlen_q, pb.heads_q, pb.head_dim}),
          contiguous(c, DType::f32, {pb.batch, pb.heads_q, pb.max_seqlen_q})};
}

// The attention outputs of one query row: batched O {b, q, h, d} and LSE {b, h, q}; varlen O
// {row, h, d} and LSE {h, row}.
struct QueryRow {
  bool varlen;
  int b, q;
  std::int64_t row;
  double out(const TensorView& o, int h, int d) const {
    return varlen ? read_real(o, {row, h, d}) : read_real(o, {b, q, h, d});
  }
  double lse(const TensorView& l, int h) const { return varlen ? read_real(l, {h, row}) : read_real(l, {b, h, q}); }
};

void for_each_row(const bsattn::Problem& pb, const Oracle& oracle, const std::function<void(const QueryRow&)>& fn) {
  for (int b = 0; b < pb.batch; ++b)
    for (int q = 0; q < oracle.seqlen_q(b); ++q) fn(QueryRow{pb.q_layout == QLayout::varlen, b, q, oracle.q_row(b, q)});
}

// Expected outputs in the oracle's order ([row, H, D] and [row, H]) and, per element, the scale
// of the parts' rounding errors: sum_i w_i |o_i| (a merge of rounded parts is off by a fraction
// of that, not of |out|, where the parts cancel).
struct Expected {
  std::vector<double> out, lse, magnitude;
};

// The float64 merge of the parts (an independent rendering of merge.hpp's formula).
Expected reference_merge(const bsattn::Problem& pb, const Oracle& oracle, const TensorView& outs,
                         const TensorView& lses) {
  const int H = pb.heads_q, D = pb.head_dim, N = static_cast<int>(outs.shape[0]);
  Expected e;
  e.out.assign(static_cast<std::size_t>(oracle.total_q_rows()) * H * D, 0.0);
  e.magnitude.assign(e.out.size(), 0.0);
  e.lse.assign(static_cast<std::size_t>(oracle.total_q_rows()) * H, -kInf);
  for_each_row(pb, oracle, [&](const QueryRow& r) {
    for (int h = 0; h < H; ++h) {
      std::vector<double> lse(N);
      double m = -kInf;
      for (int i = 0; i < N; ++i) m = std::max(m, lse[i] = r.lse(slice(lses, i), h));
      if (m == -kInf) continue;
      double sum = 0;
      for (int i = 0; i < N; ++i) sum += std::exp(lse[i] - m);
      const std::size_t at = static_cast<std::size_t>(r.row * H + h);
      e.lse[at] = m + std::log(sum);
      for (int i = 0; i < N; ++i) {
        const double w = std::exp(lse[i] - m) / sum;
        if (w == 0) continue;
        for (int d = 0; d < D; ++d) {
          const double o = r.out(slice(outs, i), h, d);
          e.out[at * D + d] += w * o;
          e.magnitude[at * D + d] += w * std::fabs(o);
        }
      }
    }
  });
  return e;
}

// Reads the library's outputs in the oracle's order (LSE empty when not given).
Expected read_outputs(const bsattn::Problem& pb, const Oracle& oracle, const bsattn::Outputs& o) {
  const int H = pb.heads_q, D = pb.head_dim;
  Expected e;
  e.out.resize(static_cast<std::size_t>(oracle.total_q_rows()) * H * D);
  if (o.lse.defined()) e.lse.resize(static_cast<std::size_t>(oracle.total_q_rows()) * H);
  for_each_row(pb, oracle, [&](const QueryRow& r) {
    for (int h = 0; h < H; ++h) {
      const std::size_t at = static_cast<std::size_t>(r.row * H + h);
      for (int d = 0; d < D; ++d) e.out[at * D + d] = r.out(o.out, h, d);
      if (o.lse.defined()) e.lse[at] = r.lse(o.lse, h);
    }
  });
  return e;
}

struct Bound {
  double abs, rel, lse_abs;
  Bound scaled(double f) const { return {abs * f, rel * f, lse_abs * f}; }
};

// "" when every element of `got` is within abs + rel * (|want| + magnitude) of `want` (LSE within
// lse_abs), rows whose expected LSE is -inf hold exactly O = 0 and LSE = -inf, and NaN is NaN.
std::string compare(const Expected& got, const Expected& want, const std::vector<double>& magnitude, const Bound& bound,
                    int head_dim) {
  std::ostringstream report;
  int failures = 0;
  const auto fail = [&](const std::string& what, std::size_t i, double g, double w) {
    if (failures++ < 5) report << "  " << what << "[" << i << "]: got " << g << " want " << w << "\n";
  };
  for (std::size_t i = 0; i < got.out.size(); ++i) {
    const double g = got.out[i], w = want.out[i];
    const bool empty_row = !want.lse.empty() && want.lse[i / head_dim] == -kInf;
    const bool ok = empty_row ? g == 0.0
                    : w != w  ? g != g
                              : std::fabs(g - w) <= bound.abs + bound.rel * (std::fabs(w) + magnitude[i]);
    if (!ok) fail("O", i, g, w);
  }
  if (!got.lse.empty() && !want.lse.empty())
    for (std::size_t i = 0; i < got.lse.size(); ++i) {
      const double g = got.lse[i], w = want.lse[i];
      const bool ok = w != w ? g != g : std::isinf(w) ? g == w : std::fabs(g - w) <= bound.lse_abs;
      if (!ok) fail("LSE", i, g, w);
    }
  return failures ? std::to_string(failures) + " mismatches:\n" + report.str() : "";
}

class MergeSplitTest : public ::testing::TestWithParam<int> {};

TEST_P(MergeSplitTest, PartsMergeIntoTheWhole) {
  CaseOptions options;
  options.format = Format::block_lists;  // the split is written as per-row block lists
  options.proxy = bsattn::Proxy::off;    // proxy terms belong to no subset of the exact blocks
  const auto owned = make_random_case(4000000 + static_cast<std::uint64_t>(GetParam()), options);
  RandomCase& c = *owned;
  const std::string single = check_against_oracle(c);
  ASSERT_TRUE(single.empty()) << single;
  const bsattn::Problem& pb = c.problem;
  const Oracle oracle(pb, c.inputs, c.custom_mask);
  const OracleResult exact = oracle.compute();
  const bsattn::Outputs whole = c.outputs;
  const Expected single_pass = read_outputs(pb, oracle, whole);

  // Every row's blocks go to random parts; sometimes one part gets nothing at all.
  std::mt19937_64& rng = c.rng;
  const int N = std::vector<int>{1, 2, 2, 3, 4, 7}[rng() % 6];
  const int empty_part = N > 1 && rng() % 4 == 0 ? static_cast<int>(rng() % N) : -1;
  const SparsityPattern all = c.pattern;
  std::vector<SparsityPattern> split(N, all);
  for (SparsityPattern& s : split)
    for (auto* lists : {&s.partial, &s.full})
      for (auto& list : *lists) list.clear();
  const auto deal = [&](std::vector<std::vector<int>> SparsityPattern::*lists) {
    for (std::size_t r = 0; r < (all.*lists).size(); ++r)
      for (int kb : (all.*lists)[r]) {
        int part = static_cast<int>(rng() % N);
        if (part == empty_part) part = (part + 1) % N;
        (split[part].*lists)[r].push_back(kb);
      }
  };
  deal(&SparsityPattern::partial);
  deal(&SparsityPattern::full);

  // The parts in the case's output layout (LSE contiguous when the case has none), stacked.
  const TensorView lse_like = whole.lse.defined() ? whole.lse : contiguous_outputs(c).lse;
  const TensorView outs = stack(c, whole.out, N, std::vector<int>{0, 8, 40}[rng() % 3]);
  const TensorView lses = stack(c, lse_like, N, std::vector<int>{0, 3}[rng() % 2]);
  for (int i = 0; i < N; ++i) {
    c.pattern = split[i];
    c.encode(Format::block_lists);
    c.outputs = {slice(outs, i), slice(lses, i)};
    ASSERT_NO_THROW(c.run_library()) << c.describe() << " part " << i;
  }
  const std::string what = c.describe() + " N=" + std::to_string(N) + " empty part " + std::to_string(empty_part);

  const Expected parts = reference_merge(pb, oracle, outs, lses);
  const Tolerance t = tolerance_for(pb.out_dtype);
  const Bound merge_bound{t.out_abs, t.out_rel, t.lse_abs};
  const Expected oracle_values{exact.out, exact.lse, {}};

  // merge_states into the case's own (strided, padded, poisoned) outputs; LSE only if it has one.
  c.outputs = whole;
  c.poison_outputs();
  ASSERT_NO_THROW(bsattn::merge_states(outs, lses, whole.out, whole.lse)) << what;
  EXPECT_EQ(c.check_padding_untouched(), "") << what;
  const Expected merged = read_outputs(pb, oracle, whole);
  EXPECT_EQ(compare(merged, parts, parts.magnitude, merge_bound, pb.head_dim), "") << what << " vs float64 merge";
  EXPECT_EQ(compare(merged, oracle_values, parts.magnitude, merge_bound.scaled(2), pb.head_dim), "")
      << what << " vs oracle";
  EXPECT_EQ(compare(merged, single_pass, parts.magnitude, merge_bound.scaled(2), pb.head_dim), "")
      << what << " vs one pass over the union";
  if (N < 2) return;

  // merge_state: parts 0 and 1 into a contiguous accumulator, then the others folded in place.
  const bsattn::Outputs accumulator = contiguous_outputs(c);
  const TensorView acc = accumulator.out, acc_lse = accumulator.lse;
  c.outputs = {acc, acc_lse};
  c.poison_outputs();
  ASSERT_NO_THROW(bsattn::merge_state(slice(outs, 0), slice(lses, 0), slice(outs, 1), slice(lses, 1), acc, acc_lse))
      << what;
  for (int i = 2; i < N; ++i)
    ASSERT_NO_THROW(bsattn::merge_state(acc, acc_lse, slice(outs, i), slice(lses, i), acc, acc_lse)) << what;
  EXPECT_EQ(c.check_padding_untouched(), "") << what;
  const Expected folded = read_outputs(pb, oracle, c.outputs);
  // Each fold rounds O to its dtype once more.
  EXPECT_EQ(compare(folded, oracle_values, parts.magnitude, merge_bound.scaled(N), pb.head_dim), "")
      << what << " merge_state folded in place vs oracle";
}
INSTANTIATE_TEST_SUITE_P(Random, MergeSplitTest, ::testing::Range(0, 80));

// ---- Hand-made rows ------------------------------------------------------------------------

// A host tensor filled with 0xff bytes (NaN in every float dtype).
struct HostTensor {
  std::vector<std::uint32_t> storage;
  TensorView view;
  HostTensor(DType dtype, std::initializer_list<std::int64_t> shape) {
    std::int64_t n = 1;
    for (std::int64_t s : shape) n *= s;
    storage.assign(static_cast<std::size_t>(n), 0xffffffffu);
    view = TensorView::contiguous(storage.data(), dtype, shape);
  }
  void set(std::initializer_list<std::int64_t> index, double value) {
    std::int64_t o = 0;
    int i = 0;
    for (std::int64_t x : index) o += x * view.stride[i++];
    switch (view.dtype) {
      case DType::f32: static_cast<float*>(view.data)[o] = static_cast<float>(value); break;
      case DType::f16: static_cast<std::uint16_t*>(view.data)[o] = double_to_half_bits(value); break;
      default: static_cast<std::uint16_t*>(view.data)[o] = double_to_bf16_bits(value); break;
    }
  }
  void poison() { std::fill(storage.begin(), storage.end(), 0xffffffffu); }
  bool untouched() const {
    return std::all_of(storage.begin(), storage.end(), [](std::uint32_t w) { return w == 0xffffffffu; });
  }
};

class MergeRulesTest : public ::testing::TestWithParam<DType> {};

// Three parts, one token row per rule (H = 1, D = 5), parts' O values exact in every dtype.
TEST_P(MergeRulesTest, EmptyNanAndExtremeRows) {
  const DType dt = GetParam();
  constexpr int N = 3, S = 6, D = 5;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Per token: the parts' LSEs. O of part i is (i + 1) * (d + 1) / 8 unless noted.
  const double lse[S][N] = {
      {-kInf, -kInf, -kInf},              // 0: every part empty
      {0.0, nan, 1.0},                    // 1: a NaN LSE
      {-kInf, 5.0, -kInf},                // 2: one part holds the row (the others' O stay NaN: never read)
      {0.5, 0.5, -kInf},                  // 3: two equal parts
      {0.0, 200.0, -kInf},                // 4: exp(-200) underflows: part 1 alone
      {-kInf, 3.0, 3.0 + std::log(3.0)},  // 5: weights 1/4 and 3/4
  };
  HostTensor outs(dt, {N, 1, S, 1, D}), lses(DType::f32, {N, 1, 1, S});
  for (int i = 0; i < N; ++i)
    for (int s = 0; s < S; ++s) {
      lses.set({i, 0, 0, s}, lse[s][i]);
      if (lse[s][i] == -kInf) continue;  // an empty part's O holds the NaN fill
      for (int d = 0; d < D; ++d) outs.set({i, 0, s, 0, d}, (i + 1) * (d + 1) / 8.0);
    }
  HostTensor out(dt, {1, S, 1, D}), out_lse(DType::f32, {1, 1, S});
  bsattn::merge_states(outs.view, lses.view, out.view, out_lse.view);
  const auto o = [&](int s, int d) { return read_real(out.view, {0, s, 0, d}); };
  const auto l = [&](int s) { return read_real(out_lse.view, {0, 0, s}); };
  for (int d = 0; d < D; ++d) {
    const double part1 = 2 * (d + 1) / 8.0, part2 = 3 * (d + 1) / 8.0, part0 = (d + 1) / 8.0;
    EXPECT_EQ(o(0, d), 0.0);
    EXPECT_TRUE(std::isnan(o(1, d)));
    EXPECT_EQ(o(2, d), part1);
    EXPECT_NEAR(o(3, d), (part0 + part1) / 2, 4e-3 * part1);
    EXPECT_EQ(o(4, d), part1);
    EXPECT_NEAR(o(5, d), 0.25 * part1 + 0.75 * part2, 4e-3 * part2);
  }
  EXPECT_EQ(l(0), -kInf);
  EXPECT_TRUE(std::isnan(l(1)));
  EXPECT_EQ(l(2), 5.0);
  EXPECT_NEAR(l(3), 0.5 + std::log(2.0), 1e-6);
  EXPECT_EQ(l(4), 200.0);
  EXPECT_NEAR(l(5), 3.0 + std::log(4.0), 1e-6);

  // One part merges to itself, bit for bit (weight exactly 1); its empty rows become O = 0.
  HostTensor one(dt, {1, 1, S, 1, D}), one_lse(DType::f32, {1, 1, 1, S});
  for (int s = 0; s < S; ++s) {
    one_lse.set({0, 0, 0, s}, s == 0 ? -kInf : s - 2.5);
    for (int d = 0; d < D; ++d) one.set({0, 0, s, 0, d}, (s * D + d - 7) / 16.0);
  }
  bsattn::merge_states(one.view, one_lse.view, out.view, out_lse.view);
  for (int s = 0; s < S; ++s) {
    EXPECT_EQ(l(s), s == 0 ? -kInf : s - 2.5);
    for (int d = 0; d < D; ++d) EXPECT_EQ(o(s, d), s == 0 ? 0.0 : (s * D + d - 7) / 16.0) << s << " " << d;
  }
}
INSTANTIATE_TEST_SUITE_P(Dtypes, MergeRulesTest, ::testing::Values(DType::f32, DType::f16, DType::bf16));

// Big enough for the worker threads (varlen, odd D, head-major parts), against the float64 merge.
TEST(MergeThreads, LargeMergeMatchesReference) {
  constexpr std::int64_t T = 3001, H = 6, D = 72;
  constexpr int N = 3;
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal(0, 1);
  std::vector<float> outs(static_cast<std::size_t>(N * T * H * D)), lses(static_cast<std::size_t>(N * H * T));
  for (float& x : outs) x = static_cast<float>(normal(rng));
  for (float& x : lses) x = rng() % 10 == 0 ? -INFINITY : static_cast<float>(3 * normal(rng));
  // Parts head-major: [N, T, H, D] viewed with strides of an [N, H, T, D] buffer.
  const TensorView outs_view = TensorView::strided(outs.data(), DType::f32, {N, T, H, D}, {T * H * D, D, T * D, 1});
  const TensorView lses_view = TensorView::contiguous(lses.data(), DType::f32, {N, H, T});
  std::vector<float> out(static_cast<std::size_t>(T * H * D), NAN), lse(static_cast<std::size_t>(H * T), NAN);
  bsattn::merge_states(outs_view, lses_view, TensorView::contiguous(out.data(), DType::f32, {T, H, D}),
                       TensorView::contiguous(lse.data(), DType::f32, {H, T}));
  int bad = 0;
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < H; ++h) {
      double m = -kInf, sum = 0;
      for (int i = 0; i < N; ++i) m = std::max(m, double(lses[(i * H + h) * T + t]));
      if (m == -kInf) {
        bad += lse[h * T + t] != -INFINITY;
        for (std::int64_t d = 0; d < D; ++d) bad += out[(t * H + h) * D + d] != 0.0f;
        continue;
      }
      for (int i = 0; i < N; ++i) sum += std::exp(lses[(i * H + h) * T + t] - m);
      bad += std::fabs(lse[h * T + t] - (m + std::log(sum))) > 1e-5 * (1 + std::fabs(m));
      for (std::int64_t d = 0; d < D; ++d) {
        double want = 0, magnitude = 0;
        for (int i = 0; i < N; ++i) {
          const double w = std::exp(lses[(i * H + h) * T + t] - m) / sum;
          const double o = outs[((i * H + h) * T + t) * D + d];
          want += w * o;
          magnitude += w * std::fabs(o);
        }
        bad += std::fabs(out[(t * H + h) * D + d] - want) > 1e-6 + 1e-5 * magnitude;
      }
    }
  EXPECT_EQ(bad, 0);
}

// ---- Validation ----------------------------------------------------------------------------

// Valid merge_state arguments (batched B 2, S 3, H 2, D 8, bf16) that a test breaks one at a time.
struct MergeArgs {
  HostTensor out_a{DType::bf16, {2, 3, 2, 8}}, out_b{DType::bf16, {2, 3, 2, 8}};
  HostTensor lse_a{DType::f32, {2, 2, 3}}, lse_b{DType::f32, {2, 2, 3}};
  HostTensor out{DType::bf16, {2, 3, 2, 8}}, lse{DType::f32, {2, 2, 3}};
  TensorView a, la, b, lb, o, l;
  MergeArgs() : a(out_a.view), la(lse_a.view), b(out_b.view), lb(lse_b.view), o(out.view), l(lse.view) {}
  void run() const { bsattn::merge_state(a, la, b, lb, o, l); }
};

// The call throws bsattn::Error naming `argument` with `fragment` in its message, and writes nothing.
void expect_rejected(const std::function<void()>& call, const std::string& argument, const std::string& fragment,
                     const std::vector<const HostTensor*>& outputs) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming " << argument;
  } catch (const bsattn::Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
  for (const HostTensor* t : outputs) EXPECT_TRUE(t->untouched()) << "an output was written before the error";
}

TEST(MergeValidation, MergeStateArguments) {
  const auto rejected = [](const std::function<void(MergeArgs&)>& edit, const std::string& argument,
                           const std::string& fragment) {
    MergeArgs m;
    edit(m);
    expect_rejected([&] { m.run(); }, argument, fragment, {&m.out, &m.lse});
  };
  MergeArgs ok;
  EXPECT_NO_THROW(ok.run());
  rejected(
      [](MergeArgs& m) {
        m.b = TensorView::contiguous(m.out_b.view.data, DType::bf16, {2, 3, 1, 8});
      },
      "out_b", "dimension 2 (H) is 1");
  rejected([](MergeArgs& m) { m.o.dtype = DType::f16; }, "out", "has dtype f16, expected bf16");
  rejected([](MergeArgs& m) { m.a.dtype = DType::i32; }, "out_a", "expected f32, f16 or bf16");
  rejected([](MergeArgs& m) { m.lb.dtype = DType::bf16; }, "lse_b", "expected f32");
  rejected(
      [](MergeArgs& m) {
        m.la = TensorView::contiguous(m.lse_a.view.data, DType::f32, {2, 3, 2});
      },
      "lse_a", "expected [B=2, H=2, S=3]");
  rejected(
      [](MergeArgs& m) {
        m.l = TensorView::contiguous(m.lse.view.data, DType::f32, {2, 2, 2});
      },
      "lse", "dimension 2 (S) is 2");
  rejected(
      [](MergeArgs& m) {
        m.a = TensorView::contiguous(m.out_a.view.data, DType::bf16, {6, 16});
      },
      "out_a", "has rank 2");
  rejected([](MergeArgs& m) { m.a.stride[3] = 2, m.a.stride[2] = 16; }, "out_a", "last dimension has stride 2");
  rejected([](MergeArgs& m) { m.b.stride[1] = -16; }, "out_b", "is negative");
  rejected([](MergeArgs& m) { m.o = TensorView{}; }, "out", "is required");
  rejected([](MergeArgs& m) { m.la = TensorView{}; }, "lse_a", "is required");
  rejected([](MergeArgs& m) { m.b.device = bsattn::Device::cuda; }, "out_b", "is on cuda:0, but out_a is on cpu:0");
  rejected([](MergeArgs& m) { m.o.stride[2] = 0; }, "out", "distinct elements would share memory");
  rejected([](MergeArgs& m) { m.o.data = static_cast<std::uint16_t*>(m.b.data) + 8; }, "out", "overlaps input out_b");
  rejected([](MergeArgs& m) { m.l.data = m.o.data; }, "lse", "overlaps");
  rejected(
      [](MergeArgs& m) {
        m.l.data = m.lb.data, m.l.stride[2] = 2, m.l.shape[2] = 2, m.lb.shape[2] = 2, m.la.shape[2] = 2,
        m.a.shape[1] = m.b.shape[1] = m.o.shape[1] = 2;
      },
      "lse", "overlaps input lse_b");
#if !BSATTN_WITH_CUDA
  rejected(
      [](MergeArgs& m) {
        m.a.device = m.la.device = m.b.device = m.lb.device = m.o.device = m.l.device = bsattn::Device::cuda;
      },
      "out", "is on cuda:0");
#endif
  // The output may be one of the parts exactly (in place), LSE too, and the LSE output is optional.
  MergeArgs in_place;
  EXPECT_NO_THROW(bsattn::merge_state(in_place.a, in_place.la, in_place.b, in_place.lb, in_place.b, in_place.lb));
  EXPECT_NO_THROW(bsattn::merge_state(in_place.a, in_place.la, in_place.b, in_place.lb, in_place.o, TensorView{}));
}

TEST(MergeValidation, MergeStatesArguments) {
  HostTensor outs(DType::f16, {3, 7, 2, 4}), lses(DType::f32, {3, 2, 7});
  HostTensor out(DType::f16, {7, 2, 4}), lse(DType::f32, {2, 7});
  const auto rejected = [&](TensorView os, TensorView ls, TensorView o, TensorView l, const std::string& argument,
                            const std::string& fragment) {
    expect_rejected([&] { bsattn::merge_states(os, ls, o, l); }, argument, fragment, {&out, &lse});
  };
  EXPECT_NO_THROW(bsattn::merge_states(outs.view, lses.view, out.view, lse.view));
  out.poison();
  lse.poison();
  TensorView none = outs.view;
  none.shape[0] = 0;
  TensorView no_lses = lses.view;
  no_lses.shape[0] = 0;
  rejected(none, no_lses, out.view, lse.view, "outs", "N = 0");
  rejected(outs.view, TensorView::contiguous(lses.view.data, DType::f32, {2, 2, 7}), out.view, lse.view, "lses",
           "dimension 0 (N) is 2");
  rejected(TensorView::contiguous(outs.view.data, DType::f16, {3, 14, 4}), lses.view, out.view, lse.view, "outs",
           "expected [N, B, S, H, D] or [N, total, H, D]");
  rejected(outs.view, lses.view, TensorView::contiguous(out.view.data, DType::f16, {7, 2, 8}), lse.view, "out",
           "dimension 2 (D) is 8");
  // The output may be exactly one stacked part, not a view straddling two.
  TensorView part1 = slice(outs.view, 1), straddling = slice(outs.view, 1);
  straddling.data = static_cast<std::uint16_t*>(straddling.data) + 4;
  EXPECT_NO_THROW(bsattn::merge_states(outs.view, lses.view, part1, slice(lses.view, 2)));
  rejected(outs.view, lses.view, straddling, lse.view, "out", "overlaps input outs");
}

// merge::Accumulator in batches (max_of, rebase, weight: the decode kernel's split merge) against
// add() one part at a time, on random parts with empty, NaN, infinite, equal and far-apart LSEs.
template <int N>
void batches_equal_single_parts(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.0f, 1.0f), lse_value(-40.0f, 40.0f), o_value(-2.0f, 2.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (int trial = 0; trial < 2000; ++trial) {
    const int parts = 1 + static_cast<int>(u(rng) * 40);
    const float special = u(rng);  // how often a part is empty, NaN or +inf in this trial
    std::vector<float> lse(parts), o(parts);
    for (int i = 0; i < parts; ++i) {
      const float r = u(rng);
      lse[i] = r < special * 0.5f     ? -inf
               : r < special * 0.52f ? nan
               : r < special * 0.54f ? inf
               : i > 0 && r > 0.9f   ? lse[i - 1]
                                     : lse_value(rng);
      o[i] = o_value(rng);
    }
    bsattn::merge::Accumulator one, batched;
    float o_one = 0.0f, o_batched = 0.0f;
    for (int i = 0; i < parts; ++i) {
      float w;
      const float rescale = one.add(lse[i], w);
      if (rescale != 1.0f) o_one *= rescale;
      if (w != 0.0f) o_one += w * o[i];
    }
    for (int i0 = 0; i0 < parts; i0 += N) {
      float m = batched.max_lse;
      for (int j = 0; j < N && i0 + j < parts; ++j) m = bsattn::merge::Accumulator::max_of(m, lse[i0 + j]);
      o_batched *= batched.rebase(m);
      for (int j = 0; j < N && i0 + j < parts; ++j) {
        const float w = batched.weight(lse[i0 + j]);
        batched.sum += w;
        if (w != 0.0f) o_batched += w * o[i0 + j];
      }
    }
    const float want_o = o_one * one.inv_sum(), got_o = o_batched * batched.inv_sum();
    const float want_lse = one.lse(), got_lse = batched.lse();
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ", " << parts << " parts, batch " << N);
    ASSERT_EQ(std::isnan(got_lse), std::isnan(want_lse));
    ASSERT_EQ(std::isnan(got_o), std::isnan(want_o));
    if (std::isnan(want_lse)) continue;
    if (std::isinf(want_lse)) {
      ASSERT_EQ(got_lse, want_lse);
    } else {
      ASSERT_NEAR(got_lse, want_lse, 1e-5f * (1.0f + std::fabs(want_lse)));
    }
    if (!std::isnan(want_o)) {
      ASSERT_NEAR(got_o, want_o, 1e-5f * (1.0f + std::fabs(want_o)));
    }
  }
}

TEST(MergeAccumulator, BatchesEqualOnePartAtATime) {
  std::mt19937 rng(std::random_device{}());
  batches_equal_single_parts<1>(rng);
  batches_equal_single_parts<4>(rng);
  batches_equal_single_parts<16>(rng);
}

}  // namespace
}  // namespace bsattn_test
