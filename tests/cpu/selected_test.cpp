// SelectedAttention (selected.hpp) on the CPU engine: one run() equals build_summaries(),
// select_blocks() and Plan::run() called separately, bit for bit (summaries, bitmask, O, LSE),
// and the float64 oracle on the bitmask and summaries it used; a second run on new Q/K/V values
// at the same addresses selects again. Random cases (select_case.hpp: batched and varlen with
// empty sequences, GQA, per query or KV head, f32 / f16 / bf16, every policy, tails), paged KV,
// and bad input with nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bsattn/bsattn.hpp"
#include "select_case.hpp"

namespace bsattn_test {
namespace {

using bsattn::DType;
using bsattn::Problem;
using bsattn::Proxy;
using bsattn::SelectedAttention;
using bsattn::TensorView;

constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();

// Host bytes of a view the object owns (contiguous).
std::vector<std::uint8_t> bytes_of(const TensorView& t) {
  const auto* p = static_cast<const std::uint8_t*>(t.data);
  return {p, p + t.numel() * bsattn::element_size(t.dtype)};
}

// O (and LSE) of Q's layout in f32 or the input dtype, poisoned with NaN.
struct HostOutputs {
  std::vector<std::uint8_t> out;
  std::vector<float> lse;
  bsattn::Outputs view;

  HostOutputs(const Problem& p, const bsattn::Inputs& in) {
    view.out = in.q;
    view.out.dtype = p.out_dtype;
    out.resize(static_cast<std::size_t>(in.q.numel()) * bsattn::element_size(p.out_dtype));
    view.out.data = out.data();
    const bool varlen = p.q_layout == bsattn::QLayout::varlen;
    lse.resize(static_cast<std::size_t>(p.heads_q) * (varlen ? p.total_q : std::int64_t{p.batch} * p.max_seqlen_q));
    view.lse = varlen ? TensorView::contiguous(lse.data(), DType::f32, {p.heads_q, p.total_q})
                      : TensorView::contiguous(lse.data(), DType::f32, {p.batch, p.heads_q, p.max_seqlen_q});
    poison();
  }
  void poison() {
    if (view.out.dtype == DType::f32) {
      std::vector<float> nan(out.size() / 4, kPoison);
      std::memcpy(out.data(), nan.data(), out.size());
    } else {
      std::fill(out.begin(), out.end(), std::uint8_t{0xff});  // 0xffff: NaN in f16 and bf16
    }
    std::fill(lse.begin(), lse.end(), kPoison);
  }
};

// A random pipeline: select_case's problem and options plus an independent V, a causal token mask
// when the selection is causal (a random alignment otherwise), proxy eligible half the time.
struct PipelineCase {
  SelectCase c;
  std::vector<std::uint8_t> v;
  std::mt19937_64 rng;

  explicit PipelineCase(std::uint64_t seed, bool paged = false) : rng(seed * 7919 + 1) {
    make_select_case(c, seed);
    if (paged) make_paged(c, seed);
    Problem& p = c.problem;
    p.mask.causal = c.options.causal;
    p.mask.alignment = c.options.alignment;
    p.proxy = rng() % 2 ? Proxy::eligible : Proxy::off;
    p.out_dtype = rng() % 2 ? DType::f32 : p.dtype;
    p.num_threads = 2;
    c.inputs.k_summary = TensorView{};  // the object builds its own
    if (paged) {
      fill_random(c.q, c.inputs.q.numel(), p.dtype, rng, 0.3);
      std::normal_distribution<float> normal(0.3f, 1.0f);
      for (float& x : c.cache) x = normal(rng);
      return;
    }
    fill_random(v, c.inputs.v.numel(), p.dtype, rng, 0.0);
    c.inputs.v.data = v.data();
  }
  // New values at the same addresses.
  void refill() {
    const Problem& p = c.problem;
    if (p.kv_layout == bsattn::KVLayout::paged) {
      std::normal_distribution<float> normal(-0.2f, 1.0f);
      for (float& x : c.cache) x = normal(rng);
    } else {
      std::vector<std::uint8_t> fresh;
      fill_random(fresh, c.inputs.k.numel(), p.dtype, rng, -0.2);
      std::memcpy(c.k.data(), fresh.data(), fresh.size());
      fill_random(fresh, c.inputs.v.numel(), p.dtype, rng, 0.1);
      std::memcpy(v.data(), fresh.data(), fresh.size());
    }
    std::vector<std::uint8_t> fresh;
    fill_random(fresh, c.inputs.q.numel(), p.dtype, rng, 0.5);
    std::memcpy(c.q.data(), fresh.data(), fresh.size());
  }
};

// One run of the object against the three calls made separately and against the oracle.
void expect_pipeline_matches(SelectedAttention& selected, const PipelineCase& pc) {
  const Problem& p = selected.problem();
  const std::string what = pc.c.describe() + " proxy " + bsattn::to_string(p.proxy) + " out " +
                           bsattn::to_string(p.out_dtype);
  HostOutputs together(p, pc.c.inputs);
  selected.run(pc.c.inputs, together.view);

  // The same steps by hand, into buffers of the object's shapes, poisoned.
  TensorView ks = selected.k_summary(), vs = selected.v_summary(), bits = selected.bits();
  std::vector<std::uint8_t> ks_bytes(bytes_of(ks).size(), 0xff), vs_bytes(ks_bytes.size(), 0xff);
  std::vector<std::uint32_t> words(static_cast<std::size_t>(bits.numel()), SelectCase::kPoison);
  ks.data = ks_bytes.data();
  vs.data = vs_bytes.data();
  bits.data = words.data();
  bsattn::Inputs in = pc.c.inputs;
  bsattn::build_summaries(p, in, ks, vs);
  in.k_summary = ks;
  bsattn::select_blocks(p, in, selected.options(), bits);
  in.partial.bits = bits;
  if (p.proxy == Proxy::off) in.k_summary = TensorView{};
  else in.v_summary = vs;
  HostOutputs apart(p, pc.c.inputs);
  bsattn::Plan(p).run(in, apart.view);

  EXPECT_EQ(bytes_of(selected.k_summary()), ks_bytes) << what;
  EXPECT_EQ(bytes_of(selected.v_summary()), vs_bytes) << what;
  EXPECT_EQ(bytes_of(selected.bits()), bytes_of(bits)) << what;
  EXPECT_EQ(together.out, apart.out) << what;
  EXPECT_EQ(0, std::memcmp(together.lse.data(), apart.lse.data(), together.lse.size() * sizeof(float))) << what;

  // Independent of the library: the float64 oracle on the bitmask and summaries the object used.
  bsattn::Inputs used = pc.c.inputs;
  used.partial.bits = selected.bits();
  if (p.proxy != Proxy::off) {
    used.k_summary = selected.k_summary();
    used.v_summary = selected.v_summary();
  }
  const Oracle oracle(p, used);
  const std::string failure =
      compare_outputs(p, oracle, oracle.compute(), together.view, tolerance_for(p.out_dtype));
  EXPECT_TRUE(failure.empty()) << what << "\n" << failure;
}

class SelectedAttentionTest : public ::testing::TestWithParam<int> {};

TEST_P(SelectedAttentionTest, EqualsTheSeparateCallsAndFollowsNewValues) {
  PipelineCase pc(8100000 + static_cast<std::uint64_t>(GetParam()));
  SelectedAttention selected(pc.c.problem, pc.c.options);
  expect_pipeline_matches(selected, pc);
  pc.refill();
  expect_pipeline_matches(selected, pc);
}
INSTANTIATE_TEST_SUITE_P(Random, SelectedAttentionTest, ::testing::Range(0, 48));

TEST(SelectedAttentionPagedTest, EqualsTheSeparateCalls) {
  int checked = 0;
  for (std::uint64_t seed = 8200000; checked < 8; ++seed) {
    SelectCase probe;
    make_select_case(probe, seed);
    if (probe.varlen() || probe.problem.dtype != DType::f32) continue;  // make_paged's cache is f32
    PipelineCase pc(seed, /*paged=*/true);
    SelectedAttention selected(pc.c.problem, pc.c.options);
    expect_pipeline_matches(selected, pc);
    pc.refill();
    expect_pipeline_matches(selected, pc);
    ++checked;
  }
}

TEST(SelectedAttentionShapeTest, OwnedBuffers) {
  PipelineCase pc(8300000);
  pc.c.problem.q_layout = bsattn::QLayout::varlen;  // shape only: no run
  pc.c.problem.batch = 3;
  pc.c.problem.total_q = 200;
  pc.c.problem.max_seqlen_q = 150;
  pc.c.problem.block = {64, 32};
  pc.c.problem.max_seqlen_kv = 1000;
  pc.c.options.heads = bsattn::SelectHeads::kv;
  SelectedAttention selected(pc.c.problem, pc.c.options);
  const Problem& p = selected.problem();
  EXPECT_EQ(p.format, bsattn::Format::bitmask);
  EXPECT_EQ(p.sparsity_heads, p.heads_kv);
  EXPECT_EQ(p.sparsity_batch, 1);
  // total_m_blocks <= min(B * ceil(150 / 64), (200 + 3 * 63) / 64) = min(9, 6); 32 KV blocks, one word.
  EXPECT_EQ(selected.bits().shape_string(), "[" + std::to_string(p.heads_kv) + ", 6, 1]");
  EXPECT_EQ(selected.k_summary().shape_string(),
            "[3, 32, " + std::to_string(p.heads_kv) + ", " + std::to_string(p.head_dim) + "]");
  EXPECT_GT(selected.workspace_bytes(), selected.plan().workspace_bytes());
}

// Bad input: the error names the argument; outputs keep their poison.
class SelectedAttentionValidationTest : public ::testing::Test {
 protected:
  PipelineCase pc{8400003};

  std::string construction_error(const Problem& p, const bsattn::SelectOptions& o) {
    try {
      SelectedAttention selected(p, o);
    } catch (const bsattn::Error& e) {
      return e.argument();
    }
    return "(no error)";
  }
  std::string run_error(const bsattn::Inputs& in, HostOutputs& outputs) {
    SelectedAttention selected(pc.c.problem, pc.c.options);
    try {
      selected.run(in, outputs.view);
    } catch (const bsattn::Error& e) {
      return e.argument();
    }
    return "(no error)";
  }
  bool untouched(const HostOutputs& o) const {
    HostOutputs fresh(pc.c.problem, pc.c.inputs);
    return o.out == fresh.out && std::all_of(o.lse.begin(), o.lse.end(), [](float x) { return x != x; });
  }
};

TEST_F(SelectedAttentionValidationTest, Construction) {
  const Problem p = pc.c.problem;
  bsattn::SelectOptions o = pc.c.options;
  o.policy = bsattn::SelectPolicy::top_k;
  o.top_k = 0;
  EXPECT_EQ(construction_error(p, o), "options.top_k");
  o = pc.c.options;
  o.policy = bsattn::SelectPolicy::tau;
  o.tau = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(construction_error(p, o), "options.tau");
  o = pc.c.options;
  o.policy = bsattn::SelectPolicy::mass;
  o.mass = 1.5f;
  EXPECT_EQ(construction_error(p, o), "options.mass");
  o = pc.c.options;
  o.sinks = -1;
  EXPECT_EQ(construction_error(p, o), "options.sinks");
  Problem bad = p;
  bad.proxy = Proxy::explicit_set;
  EXPECT_EQ(construction_error(bad, pc.c.options), "problem.proxy");
  bad = p;
  bad.heads_q = 3;
  bad.heads_kv = 2;
  EXPECT_EQ(construction_error(bad, pc.c.options), "problem.heads_q");
  bad = p;
  bad.block.kv = 24;
  EXPECT_EQ(construction_error(bad, pc.c.options), "problem.block.kv");
}

TEST_F(SelectedAttentionValidationTest, Run) {
  HostOutputs outputs(pc.c.problem, pc.c.inputs);
  bsattn::Inputs in = pc.c.inputs;
  std::vector<std::uint8_t> other(pc.c.k.size());
  in.k_summary = TensorView::contiguous(other.data(), pc.c.problem.dtype, {1, 1, 1, 8});
  EXPECT_EQ(run_error(in, outputs), "k_summary");
  in = pc.c.inputs;
  std::vector<std::uint32_t> words(64);
  in.partial.bits = TensorView::contiguous(words.data(), DType::u32, {1, 1, 1, 64});
  EXPECT_EQ(run_error(in, outputs), "partial");
  in = pc.c.inputs;
  in.q.shape[in.q.rank - 2] += 1;  // one query head too many
  EXPECT_EQ(run_error(in, outputs), "q");
  in = pc.c.inputs;
  in.v.dtype = in.v.dtype == DType::f32 ? DType::f16 : DType::f32;
  EXPECT_EQ(run_error(in, outputs), "v");
  EXPECT_TRUE(untouched(outputs));
  HostOutputs wrong_out(pc.c.problem, pc.c.inputs);
  wrong_out.view.out.shape[wrong_out.view.out.rank - 1] += 8;  // D + 8
  EXPECT_NE(run_error(pc.c.inputs, wrong_out), "(no error)");
  EXPECT_TRUE(untouched(wrong_out));

  SelectedAttention moved(pc.c.problem, pc.c.options);
  SelectedAttention taker = std::move(moved);
  try {
    moved.run(pc.c.inputs, outputs.view);  // NOLINT(bugprone-use-after-move): the error is the point
    ADD_FAILURE() << "a moved-from object ran";
  } catch (const bsattn::Error& e) {
    EXPECT_EQ(e.argument(), "selected_attention");
  }
  EXPECT_TRUE(untouched(outputs));
}

}  // namespace
}  // namespace bsattn_test
