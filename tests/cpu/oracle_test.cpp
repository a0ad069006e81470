// The oracle suite (issue 2, item 7): seeded random problems against the float64 reference.
// Reproduce one case with --gtest_filter='*OracleTest*/<seed>' or BSATTN_ORACLE_SEED=<seed>.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>

#include "bsattn/bsattn.hpp"

#include "random_problem.hpp"

namespace bsattn_test {
namespace {

constexpr int kRandomCases = 600;
constexpr int kCustomMaskCases = 80;

class OracleTest : public ::testing::TestWithParam<int> {};

TEST_P(OracleTest, MatchesReference) {
  const auto c = make_random_case(static_cast<std::uint64_t>(GetParam()));
  const std::string failure = check_against_oracle(*c);
  EXPECT_TRUE(failure.empty()) << failure;
}
INSTANTIATE_TEST_SUITE_P(Random, OracleTest, ::testing::Range(0, kRandomCases));

// Custom functors through bsattn::attention_with_mask (custom_mask.hpp), every format and proxy mode.
class CustomMaskOracleTest : public ::testing::TestWithParam<int> {};

TEST_P(CustomMaskOracleTest, MatchesReference) {
  CaseOptions options;
  options.custom_mask = true;
  const auto c = make_random_case(1000000 + static_cast<std::uint64_t>(GetParam()), options);
  const std::string failure = check_against_oracle(*c);
  EXPECT_TRUE(failure.empty()) << failure;
}
INSTANTIATE_TEST_SUITE_P(Random, CustomMaskOracleTest, ::testing::Range(0, kCustomMaskCases));

// The generator reaches every feature the suite claims to cover, so that a change to it cannot
// silently narrow the suite.
TEST(OracleGenerator, CoversEveryFeature) {
  using bsattn::DType;
  using bsattn::Format;
  std::map<std::string, int> seen;
  for (int seed = 0; seed < kRandomCases; ++seed) {
    const auto c = make_random_case(static_cast<std::uint64_t>(seed));
    const bsattn::Problem& p = c->problem;
    const bsattn::MaskSpec& m = p.mask;
    const auto tally = [&](const std::string& feature, bool present) { seen[feature] += present; };
    tally("varlen", p.q_layout == bsattn::QLayout::varlen);
    tally("batched", p.q_layout == bsattn::QLayout::batched);
    tally("paged", p.kv_layout == bsattn::KVLayout::paged);
    tally("seqused_k", c->inputs.seqused_k.defined());
    tally("format " + std::to_string(static_cast<int>(p.format)), true);
    tally("dtype " + std::string(bsattn::to_string(p.dtype)) + "->" + bsattn::to_string(p.out_dtype), true);
    tally("D " + std::to_string(p.head_dim), true);
    tally("Bq " + std::to_string(p.block.q), true);
    tally("Bk " + std::to_string(p.block.kv), true);
    const bsattn::TileShape tiles = bsattn::choose_tiles(p);
    tally("merged Q units", tiles.tile_m > p.block.q);
    tally("Q block over several tiles", tiles.tile_m < p.block.q);
    tally("KV block split into tiles", tiles.tile_n < p.block.kv);
    tally("GQA", p.heads_q > p.heads_kv && p.heads_kv > 1);
    tally("MQA", p.heads_q > 1 && p.heads_kv == 1);
    tally("Hs=1 shared", p.format != Format::all_blocks && p.sparsity_heads == 1 && p.heads_q > 1);
    tally("Hs=Hkv<Hq", p.format != Format::all_blocks && p.sparsity_heads == p.heads_kv && p.heads_kv < p.heads_q && p.heads_kv > 1);
    tally("Hs=Hq>1", p.format != Format::all_blocks && p.sparsity_heads == p.heads_q && p.heads_q > 1);
    tally("Bs=B>1", p.sparsity_batch > 1);
    tally("partial only", p.format != Format::all_blocks && p.has_partial && !p.has_full);
    tally("full only", !p.has_partial && p.has_full);
    tally("partial+full", p.has_partial && p.has_full);
    tally("no mask", !m.any() && !c->custom_mask);
    tally("causal bottom-right", m.causal && m.alignment == bsattn::Alignment::bottom_right);
    tally("causal top-left", m.causal && m.alignment == bsattn::Alignment::top_left);
    tally("window", m.window_left >= 0 || m.window_right >= 0);
    tally("window + sinks", (m.window_left >= 0 || m.window_right >= 0) && m.sink_tokens > 0);
    tally("document ids", m.document_ids);
    tally("kv valid bits", m.kv_valid_bits);
    tally("custom mask", static_cast<bool>(c->custom_mask));
    tally("proxy eligible", p.proxy == bsattn::Proxy::eligible);
    tally("proxy explicit", p.proxy == bsattn::Proxy::explicit_set);
    tally("plan with validate=false", !c->one_shot && !c->custom_mask);
    tally("run_with_mask", !c->one_shot && c->custom_mask);
    tally("no LSE", !c->outputs.lse.defined());
    bool empty_q = false, empty_kv = false, tail = false;
    for (int b = 0; b < p.batch; ++b) {
      empty_q = empty_q || c->seqlen_q[b] == 0;
      empty_kv = empty_kv || c->seqlen_kv[b] == 0;
      tail = tail || c->seqlen_kv[b] % p.block.kv != 0 || c->seqlen_q[b] % p.block.q != 0;
    }
    tally("empty Q sequence", empty_q);
    tally("empty KV sequence", empty_kv);
    tally("tails", tail);
  }
  std::vector<std::string> required{"varlen", "batched", "paged", "seqused_k", "merged Q units",
                                    "Q block over several tiles", "KV block split into tiles", "GQA", "MQA",
                                    "Hs=1 shared", "Hs=Hkv<Hq", "Hs=Hq>1", "Bs=B>1", "partial only", "full only",
                                    "partial+full", "no mask", "causal bottom-right", "causal top-left", "window",
                                    "window + sinks", "document ids", "kv valid bits", "custom mask", "proxy eligible",
                                    "proxy explicit", "plan with validate=false", "run_with_mask", "no LSE", "empty Q sequence",
                                    "empty KV sequence", "tails"};
  for (int f = 0; f <= static_cast<int>(Format::bitmask); ++f) required.push_back("format " + std::to_string(f));
  for (const char* d : {"f32->f32", "f16->f32", "f16->f16", "bf16->f32", "bf16->bf16"}) required.push_back(std::string("dtype ") + d);
  for (int d : {8, 40, 64, 128, 256}) required.push_back("D " + std::to_string(d));
  for (int b : {16, 32, 64, 128, 192, 256}) required.push_back("Bq " + std::to_string(b));
  for (int b : {16, 32, 48, 64, 128, 256}) required.push_back("Bk " + std::to_string(b));
  for (const std::string& feature : required) EXPECT_GE(seen[feature], 5) << feature;
}

// One plan, several runs whose metadata values change in between (SPEC §8): no state of an
// earlier run may leak into a later one.
class PlanReuseTest : public ::testing::TestWithParam<int> {};

TEST_P(PlanReuseTest, NewSelectionEachRun) {
  CaseOptions options;
  options.format = bsattn::Format::bitmask;
  options.custom_mask = false;
  const auto c = make_random_case(9000000 + static_cast<std::uint64_t>(GetParam()), options);
  bsattn::Problem trusted = c->problem;
  trusted.validate = false;
  bsattn::Plan plan(trusted);
  std::bernoulli_distribution keep(0.4);
  for (int run = 0; run < 3; ++run) {
    if (run > 0) {  // a fresh selection over the same blocks
      SparsityPattern& pattern = c->pattern;
      for (std::size_t r = 0; r < pattern.partial.size(); ++r) {
        std::vector<int> blocks = pattern.partial[r];
        blocks.insert(blocks.end(), pattern.full[r].begin(), pattern.full[r].end());
        std::sort(blocks.begin(), blocks.end());
        pattern.partial[r].clear();
        pattern.full[r].clear();
        for (int kb = 0; kb <= (blocks.empty() ? -1 : blocks.back()); ++kb)
          if (keep(c->rng)) (c->problem.has_full && (!c->problem.has_partial || keep(c->rng)) ? pattern.full[r] : pattern.partial[r]).push_back(kb);
      }
      c->encode(bsattn::Format::bitmask);
    }
    c->poison_outputs();
    try {
      plan.run(c->inputs, c->outputs);
    } catch (const std::exception& e) {
      FAIL() << c->describe() << " run " << run << ": " << e.what();
    }
    const Oracle oracle(c->problem, c->inputs);
    const std::string failure = compare_outputs(c->problem, oracle, oracle.compute(), c->outputs,
                                                tolerance_for(c->problem.out_dtype)) +
                                c->check_padding_untouched();
    EXPECT_TRUE(failure.empty()) << c->describe() << " run " << run << "\n" << failure;
  }
}
INSTANTIATE_TEST_SUITE_P(Random, PlanReuseTest, ::testing::Range(0, 30));

// Route-capacity overflow is an error raised before any output is written (SPEC §5, §8).
TEST(OracleEngine, RouteOverflowThrowsBeforeWritingOutputs) {
  CaseOptions options;
  options.format = bsattn::Format::all_blocks;
  options.builtin_mask = false;
  options.custom_mask = false;
  for (std::uint64_t seed = 8000000;; ++seed) {
    const auto c = make_random_case(seed, options);
    if (c->seqlen_kv[0] <= 128) continue;  // at least two KV tiles in the first row
    c->problem.max_routes_per_row = 1;
    c->poison_outputs();
    const std::vector<std::uint8_t> poisoned = c->output_bytes();
    EXPECT_THROW(c->run_library(), bsattn::Error) << c->describe();
    EXPECT_TRUE(c->output_bytes() == poisoned) << c->describe();
    break;
  }
}

// Any seed from the environment, e.g. one printed by a failing run of another suite.
TEST(OracleSeed, FromEnvironment) {
  const char* seed = std::getenv("BSATTN_ORACLE_SEED");
  if (!seed) GTEST_SKIP() << "set BSATTN_ORACLE_SEED to run one seed";
  const auto c = make_random_case(std::strtoull(seed, nullptr, 10));
  std::printf("%s\n", c->describe().c_str());
  const std::string failure = check_against_oracle(*c);
  EXPECT_TRUE(failure.empty()) << failure;
}

}  // namespace
}  // namespace bsattn_test
