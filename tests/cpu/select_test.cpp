// Block selection (SPEC §7) on the CPU engine: the selection semantics against an independent
// float64 brute force (float64 scores are not bit-identical to the library's float32 ones, so the
// checks are the policies' defining properties with small margins), attention() on the emitted
// bitmask, and the rejection of bad input with nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>
#include <vector>

#include "bsattn/bsattn.hpp"
#include "select_case.hpp"

namespace bsattn_test {
namespace {

using bsattn::DType;
using bsattn::SelectPolicy;
using bsattn::TensorView;

// One row of the reference: float64 scores of the visible blocks and the forced set.
struct ReferenceRow {
  int kv_blocks = 0, visible = 0;
  std::vector<double> score;
  std::vector<bool> forced;
};

ReferenceRow reference_row(const SelectCase& c, int b, int hs, int qb) {
  const bsattn::Problem& p = c.problem;
  const bsattn::SelectOptions& o = c.options;
  ReferenceRow r;
  r.kv_blocks = c.kv_blocks(b);
  const int sq = c.seqlen_q[b], skv = c.seqlen_kv[b];
  const int q_first = qb * p.block.q, q_last = std::min(sq, q_first + p.block.q) - 1;
  const long long diag = q_last + (o.alignment == bsattn::Alignment::bottom_right ? skv - sq : 0);
  const long long diag_block = static_cast<long long>(std::floor(static_cast<double>(diag) / p.block.kv));
  for (int j = 0; j < r.kv_blocks; ++j)
    if (!o.causal || static_cast<long long>(j) * p.block.kv <= diag) r.visible = j + 1;
  const long long clamped = std::clamp<long long>(diag_block, 0, std::max(0, r.kv_blocks - 1));
  const int group = p.heads_q / c.heads(), per_kv = p.heads_q / p.heads_kv;
  const int hkv = hs * group / per_kv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  std::vector<double> pooled(p.head_dim, 0.0);
  for (int h = hs * group; h < (hs + 1) * group; ++h)
    for (int d = 0; d < p.head_dim; ++d) {
      double sum = 0.0;
      for (int t = q_first; t <= q_last; ++t) sum += c.q_value(b, t, h, d);
      pooled[d] += sum / (q_last - q_first + 1);
    }
  for (int j = 0; j < r.visible; ++j) {
    double s = 0.0;
    for (int d = 0; d < p.head_dim; ++d) s += pooled[d] * c.summary_value(b, j, hkv, d);
    r.score.push_back(scale * s);
    const long long distance = std::llabs(j - clamped);
    r.forced.push_back(j < o.sinks || (distance == 0 ? o.diagonal : distance <= o.local));
  }
  return r;
}

// The defining property of the row's policy, given the row's selection; "" when it holds.
std::string check_policy(const SelectCase& c, const ReferenceRow& r, const std::vector<bool>& sel) {
  const bsattn::SelectOptions& o = c.options;
  const int n = r.visible;
  double max_abs = 0.0;
  for (double s : r.score) max_abs = std::max(max_abs, std::abs(s));
  const double margin = 1e-4 * (1.0 + max_abs);
  std::ostringstream e;
  int count = 0, forced = 0;
  for (int j = 0; j < n; ++j) {
    count += sel[j];
    forced += r.forced[j];
    if (r.forced[j] && !sel[j]) e << " forced block " << j << " not selected;";
  }
  // Non-forced: every selected block scores at least every unselected one (ties: lower index).
  const auto ordered = [&](int x, int y) {  // x selected, y not
    if (r.score[x] == r.score[y]) return x < y;
    return r.score[x] >= r.score[y] - margin;
  };
  const bool ranked = o.policy != SelectPolicy::tau;
  if (ranked)
    for (int x = 0; x < n; ++x)
      for (int y = 0; y < n; ++y)
        if (sel[x] && !r.forced[x] && !sel[y] && !ordered(x, y))
          e << " selected " << x << " (" << r.score[x] << ") below unselected " << y << " (" << r.score[y] << ");";
  switch (o.policy) {
    case SelectPolicy::top_k: {
      const int expected = std::max(forced, std::min(o.top_k, n));
      if (count != expected) e << " top_k selected " << count << " blocks, expected " << expected << ";";
      break;
    }
    case SelectPolicy::tau: {
      double mean = 0.0, var = 0.0;
      for (double s : r.score) mean += s / n;
      for (double s : r.score) var += (s - mean) * (s - mean) / n;
      const double threshold = mean + o.tau * std::sqrt(var);
      for (int j = 0; j < n; ++j) {
        if (sel[j] && !r.forced[j] && r.score[j] < threshold - margin)
          e << " block " << j << " selected below the threshold " << threshold << ";";
        if (!sel[j] && r.score[j] >= threshold + margin) e << " block " << j << " not selected above the threshold;";
      }
      break;
    }
    case SelectPolicy::mass: {
      const double top = *std::max_element(r.score.begin(), r.score.end());
      double total = 0.0, kept = 0.0;
      for (int j = 0; j < n; ++j) {
        total += std::exp(r.score[j] - top);
        if (sel[j]) kept += std::exp(r.score[j] - top);
      }
      const double target = o.mass * total;
      if (kept < target * (1 - 1e-4)) e << " selected mass " << kept << " below the target " << target << ";";
      // Minimal: the blocks ranked above the policy's lowest pick hold less than the target.
      int lowest = -1;
      for (int j = 0; j < n; ++j)
        if (sel[j] && !r.forced[j] && (lowest < 0 || r.score[j] < r.score[lowest])) lowest = j;
      if (lowest >= 0) {
        double above = 0.0;
        for (int j = 0; j < n; ++j)
          if (r.score[j] > r.score[lowest] + margin) above += std::exp(r.score[j] - top);
        if (above >= target * (1 + 1e-4))
          e << " not minimal: blocks above block " << lowest << " already hold " << above << " of " << target << ";";
      }
      break;
    }
  }
  return e.str();
}

// Every word of the bitmask against the reference; "" when all hold.
std::string check_selection(const SelectCase& c) {
  std::ostringstream e;
  const int hs_count = c.heads();
  for (int b = 0; b < c.problem.batch; ++b)
    for (int hs = 0; hs < hs_count; ++hs)
      for (int qb = 0; qb < c.bit_rows && (c.varlen() ? qb < c.q_blocks(b) : true); ++qb) {
        const bool in_range = qb < c.q_blocks(b);
        ReferenceRow r;
        if (in_range) r = reference_row(c, b, hs, qb);
        std::vector<bool> sel(r.visible);
        for (int j = 0; j < 32 * c.words; ++j) {
          const bool bit = c.selected(b, hs, qb, j);
          if (j < r.visible) sel[j] = bit;
          else if (bit) e << " row (b=" << b << ", hs=" << hs << ", qb=" << qb << "): block " << j << " beyond the visible "
                          << r.visible << " is set;";
        }
        if (r.visible > 0) {
          const std::string failure = check_policy(c, r, sel);
          if (!failure.empty()) e << " row (b=" << b << ", hs=" << hs << ", qb=" << qb << "):" << failure;
        }
      }
  if (c.varlen())  // rows past the last sequence's blocks are zero
    for (int hs = 0; hs < hs_count; ++hs)
      for (std::int64_t m = c.m_base(c.problem.batch); m < c.bit_rows; ++m)
        for (int w = 0; w < c.words; ++w)
          if (c.bits[static_cast<std::size_t>((hs * c.bit_rows + m) * c.words + w)] != 0)
            e << " padding row " << m << " word " << w << " is not zero;";
  const std::string s = e.str();
  return s.empty() ? s : c.describe() + ":" + s.substr(0, 2000);
}

class SelectReferenceTest : public ::testing::TestWithParam<int> {};

TEST_P(SelectReferenceTest, PolicySemantics) {
  SelectCase c;
  make_select_case(c, 7100000 + static_cast<std::uint64_t>(GetParam()), GetParam() % 3);
  bsattn::select_blocks(c.problem, c.inputs, c.options, c.bits_view);
  const std::string failure = check_selection(c);
  EXPECT_TRUE(failure.empty()) << failure;
}
INSTANTIATE_TEST_SUITE_P(Random, SelectReferenceTest, ::testing::Range(0, 240));

// The reference notices a wrong bit: one more block for top_k, one forced block missing.
TEST(SelectReferenceSelfTest, CatchesAWrongBit) {
  int corrupted = 0;
  for (std::uint64_t seed = 7150000; seed < 7150040; ++seed) {
    SelectCase c;
    make_select_case(c, seed, 0);
    bsattn::select_blocks(c.problem, c.inputs, c.options, c.bits_view);
    ASSERT_TRUE(check_selection(c).empty()) << check_selection(c);
    const ReferenceRow r = reference_row(c, 0, 0, 0);
    for (int j = 0; j < r.visible; ++j)
      if (r.forced[j] || !c.selected(0, 0, 0, j)) {
        c.bits[c.word_index(0, 0, 0, j / 32)] ^= 1u << (j % 32);
        EXPECT_FALSE(check_selection(c).empty()) << c.describe() << ": flipped block " << j;
        ++corrupted;
        break;
      }
  }
  EXPECT_GT(corrupted, 20);
}

// Paged KV: the lengths come from seq_lens_kv (the cache itself is not read); batched Q.
TEST(SelectPagedTest, LengthsFromSeqLensKv) {
  int checked = 0;
  for (std::uint64_t seed = 7500000; checked < 12; ++seed) {
    SelectCase c;
    make_select_case(c, seed);
    if (c.varlen()) continue;
    make_paged(c, seed);
    bsattn::select_blocks(c.problem, c.inputs, c.options, c.bits_view);
    const std::string failure = check_selection(c);
    EXPECT_TRUE(failure.empty()) << failure;
    ++checked;
  }
}

// attention() takes the bitmask as is; it gives the same bits as the block lists it encodes.
class SelectAttentionTest : public ::testing::TestWithParam<int> {};

TEST_P(SelectAttentionTest, BitmaskEqualsBlockLists) {
  SelectCase c;
  make_select_case(c, 7200000 + static_cast<std::uint64_t>(GetParam()));
  bsattn::select_blocks(c.problem, c.inputs, c.options, c.bits_view);
  bsattn::Problem p = c.problem;
  p.format = bsattn::Format::bitmask;
  p.sparsity_heads = c.heads();
  p.sparsity_batch = c.varlen() ? 1 : p.batch;
  p.mask.causal = c.options.causal;
  p.mask.alignment = c.options.alignment;
  bsattn::Inputs in = c.inputs;
  in.k_summary = TensorView{};
  in.partial.bits = c.bits_view;
  const std::int64_t q_elems = c.inputs.q.numel();
  std::vector<float> by_bits(q_elems, -1.0f), by_lists(q_elems, -2.0f);
  bsattn::Outputs out;
  out.out = c.inputs.q;  // Q's shape, contiguous
  out.out.data = by_bits.data();
  out.out.dtype = p.out_dtype = DType::f32;
  bsattn::attention(p, in, out);

  // The same selection as block lists [B, Hs, max nQB, nKB].
  const int nqb = (p.max_seqlen_q + p.block.q - 1) / p.block.q, nkb = (p.max_seqlen_kv + p.block.kv - 1) / p.block.kv;
  std::vector<std::int32_t> counts(static_cast<std::size_t>(p.batch) * p.sparsity_heads * nqb, 0);
  std::vector<std::int32_t> indices(counts.size() * nkb, 0);
  for (int b = 0; b < p.batch; ++b)
    for (int hs = 0; hs < p.sparsity_heads; ++hs)
      for (int qb = 0; qb < c.q_blocks(b); ++qb) {
        const std::size_t row = (static_cast<std::size_t>(b) * p.sparsity_heads + hs) * nqb + qb;
        for (int j = 0; j < c.kv_blocks(b); ++j)
          if (c.selected(b, hs, qb, j)) indices[row * nkb + counts[row]++] = j;
      }
  bsattn::Problem lists = p;
  lists.format = bsattn::Format::block_lists;
  lists.sparsity_batch = p.batch;
  in.partial = bsattn::BlockSet{};
  in.partial.counts = TensorView::contiguous(counts.data(), DType::i32, {p.batch, p.sparsity_heads, nqb});
  in.partial.indices = TensorView::contiguous(indices.data(), DType::i32, {p.batch, p.sparsity_heads, nqb, nkb});
  out.out.data = by_lists.data();
  bsattn::attention(lists, in, out);
  EXPECT_TRUE(std::memcmp(by_bits.data(), by_lists.data(), by_bits.size() * sizeof(float)) == 0) << c.describe();
}
INSTANTIATE_TEST_SUITE_P(Random, SelectAttentionTest, ::testing::Range(0, 40));

// Hand-built rows: ties go to the lower index, forced blocks beyond k are all kept, and a causal
// bottom-right row before the KV sequence starts selects nothing.
struct TinyCase {
  static constexpr int kD = 8;
  bsattn::Problem problem;
  std::vector<float> q, ks;
  std::vector<std::uint32_t> bits;
  bsattn::Inputs in;
  TinyCase(int sq, int skv, int bq, int bk) {
    problem.heads_q = problem.heads_kv = 1;
    problem.head_dim = kD;
    problem.max_seqlen_q = sq;
    problem.max_seqlen_kv = skv;
    problem.dtype = problem.out_dtype = DType::f32;
    problem.block = {bq, bk};
    const int nqb = (sq + bq - 1) / bq, nkb = (skv + bk - 1) / bk;
    q.assign(static_cast<std::size_t>(sq) * kD, 0.0f);
    ks.assign(static_cast<std::size_t>(nkb) * kD, 0.0f);
    bits.assign(static_cast<std::size_t>(nqb) * ((nkb + 31) / 32), SelectCase::kPoison);
    in.q = TensorView::contiguous(q.data(), DType::f32, {1, sq, 1, kD});
    in.k_summary = TensorView::contiguous(ks.data(), DType::f32, {1, nkb, 1, kD});
  }
  TensorView bits_view() {
    const int nqb = static_cast<int>(in.q.shape[1] + problem.block.q - 1) / problem.block.q;
    return TensorView::contiguous(bits.data(), DType::u32, {1, 1, nqb, static_cast<std::int64_t>(bits.size()) / nqb});
  }
};

TEST(SelectRulesTest, TiesGoToTheLowerIndex) {
  TinyCase t(16, 16 * 40, 16, 16);  // every score 0
  bsattn::SelectOptions o;
  o.top_k = 5;
  o.diagonal = false;
  bsattn::select_blocks(t.problem, t.in, o, t.bits_view());
  EXPECT_EQ(t.bits[0], 0x1fu);
  EXPECT_EQ(t.bits[1], 0u);
  o.policy = SelectPolicy::mass;
  o.mass = 0.1f;  // 4 of 40 equal blocks hold exactly 0.1 of the mass
  bsattn::select_blocks(t.problem, t.in, o, t.bits_view());
  EXPECT_EQ(t.bits[0], 0xfu);
  o.policy = SelectPolicy::tau;  // every score equals the mean: all selected
  bsattn::select_blocks(t.problem, t.in, o, t.bits_view());
  EXPECT_EQ(t.bits[0], 0xffffffffu);
  EXPECT_EQ(t.bits[1], 0xffu);
}

TEST(SelectRulesTest, ForcedBlocksBeyondTopKAreKept) {
  TinyCase t(64, 64 * 8, 64, 64);  // one Q block; its diagonal (bottom-right) is block 7
  for (int d = 0; d < TinyCase::kD; ++d) t.ks[3 * TinyCase::kD + d] = 1.0f;  // block 3 scores best
  for (float& x : t.q) x = 1.0f;
  bsattn::SelectOptions o;
  o.top_k = 1;
  o.sinks = 2;
  o.local = 1;
  bsattn::select_blocks(t.problem, t.in, o, t.bits_view());
  EXPECT_EQ(t.bits[0], (1u << 0) | (1u << 1) | (1u << 6) | (1u << 7));  // sinks, neighbour, diagonal
  o.top_k = 5;  // one pick left after the 4 forced: the best block
  bsattn::select_blocks(t.problem, t.in, o, t.bits_view());
  EXPECT_EQ(t.bits[0], (1u << 0) | (1u << 1) | (1u << 3) | (1u << 6) | (1u << 7));
  o.diagonal = false;  // the neighbour stays forced, the diagonal block does not
  o.top_k = 1;
  bsattn::select_blocks(t.problem, t.in, o, t.bits_view());
  EXPECT_EQ(t.bits[0], (1u << 0) | (1u << 1) | (1u << 6));
}

TEST(SelectRulesTest, CausalRowsBeforeTheKVStartSelectNothing) {
  TinyCase t(64, 32, 16, 16);  // bottom-right: query q sees kv <= q - 32
  bsattn::SelectOptions o;
  o.causal = true;
  o.top_k = 2;
  o.sinks = 1;
  bsattn::select_blocks(t.problem, t.in, o, t.bits_view());
  EXPECT_EQ(t.bits[0], 0u);  // rows 0..15: nothing visible
  EXPECT_EQ(t.bits[1], 0u);  // rows 16..31: nothing visible
  EXPECT_EQ(t.bits[2], 1u);  // rows 32..47: block 0 only (row 47 sees kv <= 15)
  EXPECT_EQ(t.bits[3], 3u);  // rows 48..63: blocks 0 and 1
}

// Bad input: an error naming the argument, and not one word written.
class SelectValidationTest : public ::testing::Test {
 protected:
  void SetUp() override { make_select_case(c, 7300001, 0); }
  void expect_rejected(const std::string& argument, const bsattn::Inputs& in, const bsattn::SelectOptions& o,
                       const TensorView& bits) {
    c.poison();
    try {
      bsattn::select_blocks(c.problem, in, o, bits);
      ADD_FAILURE() << "accepted; expected an error naming " << argument;
    } catch (const bsattn::Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    EXPECT_TRUE(std::all_of(c.bits.begin(), c.bits.end(), [](std::uint32_t w) { return w == SelectCase::kPoison; }));
  }
  SelectCase c;
};

TEST_F(SelectValidationTest, Options) {
  bsattn::SelectOptions o = c.options;
  o.policy = SelectPolicy::top_k;
  o.top_k = 0;
  expect_rejected("options.top_k", c.inputs, o, c.bits_view);
  o.policy = SelectPolicy::tau;
  o.tau = std::nanf("");
  expect_rejected("options.tau", c.inputs, o, c.bits_view);
  o.tau = INFINITY;
  expect_rejected("options.tau", c.inputs, o, c.bits_view);
  o.policy = SelectPolicy::mass;
  for (float bad : {0.0f, -0.5f, 1.5f, std::nanf("")}) {
    o.mass = bad;
    expect_rejected("options.mass", c.inputs, o, c.bits_view);
  }
  o = c.options;
  o.sinks = -1;
  expect_rejected("options.sinks", c.inputs, o, c.bits_view);
  o = c.options;
  o.local = -2;
  expect_rejected("options.local", c.inputs, o, c.bits_view);
  o = c.options;
  o.policy = static_cast<SelectPolicy>(7);
  expect_rejected("options.policy", c.inputs, o, c.bits_view);
}

TEST_F(SelectValidationTest, Summaries) {
  bsattn::Inputs in = c.inputs;
  in.k_summary = TensorView{};
  expect_rejected("k_summary", in, c.options, c.bits_view);
  in.k_summary = c.inputs.k_summary;
  in.k_summary.shape[1] += 1;
  expect_rejected("k_summary", in, c.options, c.bits_view);
  in.k_summary = c.inputs.k_summary;
  in.k_summary.dtype = c.problem.dtype == DType::f32 ? DType::bf16 : DType::f32;
  expect_rejected("k_summary", in, c.options, c.bits_view);
  in.k_summary = c.inputs.k_summary;
  in.k_summary.shape[2] += 1;
  expect_rejected("k_summary", in, c.options, c.bits_view);
}

TEST_F(SelectValidationTest, Bitmask) {
  TensorView bits = c.bits_view;
  bits.dtype = DType::i32;
  expect_rejected("bits", c.inputs, c.options, bits);
  bits = c.bits_view;
  bits.shape[bits.rank - 1] = 0;  // fewer words than ceil(nKB / 32)
  expect_rejected("bits", c.inputs, c.options, bits);
  bits = c.bits_view;
  bits.shape[1] += 1;  // Hs
  expect_rejected("bits", c.inputs, c.options, bits);
  bits = c.bits_view;
  bits.stride[bits.rank - 2] = 0;  // rows share words
  if (bits.shape[bits.rank - 2] > 1) expect_rejected("bits", c.inputs, c.options, bits);
  bsattn::Inputs in = c.inputs;  // the output over an input
  bits = c.bits_view;
  in.q.data = c.bits.data();
  in.q.dtype = c.problem.dtype;
  expect_rejected("bits", in, c.options, bits);
}

TEST(SelectVarlenValidationTest, TooFewRowsAndBadLengths) {
  for (std::uint64_t seed = 7400000;; ++seed) {
    SelectCase c;
    make_select_case(c, seed);
    if (!c.varlen()) continue;
    const std::int64_t total_m = c.m_base(c.problem.batch);
    TensorView bits = c.bits_view;
    bits.shape[1] = total_m - 1;
    try {
      bsattn::select_blocks(c.problem, c.inputs, c.options, bits);
      ADD_FAILURE() << "accepted a bitmask of " << total_m - 1 << " rows for " << total_m;
    } catch (const bsattn::Error& e) {
      EXPECT_EQ(e.argument(), "bits") << e.what();
    }
    c.cu_q[1] = c.cu_q[0] - 1;  // not monotone
    try {
      bsattn::select_blocks(c.problem, c.inputs, c.options, c.bits_view);
      ADD_FAILURE() << "accepted a descending cu_seqlens_q";
    } catch (const bsattn::Error& e) {
      EXPECT_EQ(e.argument(), "cu_seqlens_q") << e.what();
    }
    EXPECT_TRUE(std::all_of(c.bits.begin(), c.bits.end(), [](std::uint32_t w) { return w == SelectCase::kPoison; }));
    break;
  }
}

}  // namespace
}  // namespace bsattn_test
