// Metadata values at random (SPEC §8: with validate = true the checks are a complete guard). Each
// case starts from a valid base (validation_case.hpp: every format and layout, with and without
// document ids, kv_valid bits and an explicit proxy set) and overwrites one to three random
// elements of its integer tensors (block sets, sequence offsets and lengths, the block table, the
// document ids, the bits) with values on and beside the rules' bounds. The call must then either
//  * throw bsattn::Error naming a tensor or problem field, and write no output element, or
//  * attend as the float64 oracle does on the same, mutated, tensors, writing every element.
// Under scripts/test-sanitizers a read outside a tensor that validation let through fails too.
// Mutations per base: BSATTN_FUZZ_CASES (default 150); BSATTN_FUZZ_SEED changes the sequence.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "oracle.hpp"
#include "validation_case.hpp"

namespace {
using namespace bsattn;
using namespace validation_case;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

// O and LSE of an accepted call against the oracle on the same tensors (f32 inputs, D = 8).
void expect_oracle(const Case& c) {
  const bsattn_test::Oracle oracle(c.p, c.in);
  const bsattn_test::OracleResult ref = oracle.compute();
  const bool varlen = c.p.q_layout == QLayout::varlen;
  const auto* out = static_cast<const float*>(c.out.out.data);
  const auto* lse = static_cast<const float*>(c.out.lse.data);
  int bad = 0;
  for (int b = 0; b < c.p.batch; ++b)
    for (int q = 0; q < oracle.seqlen_q(b); ++q)
      for (int h = 0; h < c.p.heads_q; ++h) {
        const std::int64_t row = oracle.q_row(b, q);
        const double want = ref.lse[row * c.p.heads_q + h];
        const float got = lse[varlen ? h * c.out.lse.stride[0] + row : b * c.out.lse.stride[0] + h * c.out.lse.stride[1] + q];
        const bool lse_ok = std::isinf(want) ? (std::isinf(got) && got < 0) : std::abs(got - want) <= 1e-4 * (1 + std::abs(want));
        bool out_ok = true;
        for (int d = 0; d < c.p.head_dim; ++d) {
          const double o = ref.out[(row * c.p.heads_q + h) * c.p.head_dim + d];
          out_ok = out_ok && std::abs(out[(row * c.p.heads_q + h) * c.p.head_dim + d] - o) <= 1e-4 * (1 + std::abs(o));
        }
        if ((!lse_ok || !out_ok) && ++bad <= 3)
          ADD_FAILURE() << "b=" << b << " q=" << q << " h=" << h << ": LSE " << got << " against " << want
                        << (out_ok ? "" : ", O differs");
      }
}

// The base, the number of mutations, a random sequence of its own, and whether any mutated value
// has a rule (document ids and kv_valid bits take any value: a base with nothing else is never
// refused).
class MutatedMetadata : public ::testing::TestWithParam<BaseParam> {
 protected:
  void SetUp() override {
    const BaseParam& base = GetParam();
    options = with(base.format, base.q, base.kv);
    options.features = base.features;
    rng.seed(static_cast<std::uint64_t>(env_int("BSATTN_FUZZ_SEED", 0)) * 1000003u +
             static_cast<std::uint64_t>(base.format) * 16 + static_cast<std::uint64_t>(base.q) * 8 +
             static_cast<std::uint64_t>(base.kv) * 2 + (base.features ? 1 : 0));
    Case probe(options);
    for (const Target& t : integer_tensors(probe))
      constrained = constrained || (t.name != "doc_q" && t.name != "doc_kv" && t.name != "kv_valid");
  }
  void expect_both_outcomes(int refused) const {
    if (cases < 50) return;
    if (constrained) {
      EXPECT_GT(refused, 0);
    }
    EXPECT_LT(refused, cases);
  }

  const int cases = env_int("BSATTN_FUZZ_CASES", 150);
  Options options;
  std::mt19937_64 rng;
  bool constrained = false;
};

TEST_P(MutatedMetadata, IsRefusedWithNothingWrittenOrAttendsAsTheOracle) {
  int refused = 0;
  for (int i = 0; i < cases; ++i) {
    Case c(options);
    SCOPED_TRACE("mutation " + std::to_string(i) + ": " + mutate_some(c, rng));
    c.poison();
    try {
      attention(c.p, c.in, c.out);
    } catch (const Error& e) {
      ++refused;
      EXPECT_FALSE(e.argument().empty()) << e.what();
      EXPECT_EQ(c.poisoned(), c.output_elements()) << "refused (" << e.what() << ") but an output element was written";
      continue;
    }
    ASSERT_EQ(c.poisoned(), 0) << "accepted, but an output element was not written";
    expect_oracle(c);
    if (HasFailure()) return;
  }
  expect_both_outcomes(refused);
  RecordProperty("refused", refused);
}

// f32 tensors of a case's backward: dO like O, and the gradients like Q, K and V.
struct BackwardTensors {
  std::vector<float> dout, dq, dk, dv;
  TensorView dout_view, dq_view, dk_view, dv_view;

  explicit BackwardTensors(const Case& c) {
    const auto like = [](std::vector<float>& data, const TensorView& t) {
      data.assign(static_cast<std::size_t>(t.numel()), 0.0f);
      TensorView v = t;
      v.data = data.data();
      v.dtype = DType::f32;
      return v;
    };
    dout_view = like(dout, c.out.out);
    for (std::size_t i = 0; i < dout.size(); ++i) dout[i] = static_cast<float>((i * 53) % 29) / 29.0f - 0.5f;
    dq_view = like(dq, c.in.q);
    dk_view = like(dk, c.in.k);
    dv_view = like(dv, c.in.v);
  }
  void poison() {
    for (std::vector<float>* g : {&dq, &dk, &dv})
      for (float& x : *g) std::memcpy(&x, &kPoison, sizeof x);
  }
  std::int64_t poisoned() const {
    std::int64_t n = 0;
    for (const std::vector<float>* g : {&dq, &dk, &dv})
      for (const float& x : *g) n += std::memcmp(&x, &kPoison, sizeof x) == 0;
    return n;
  }
  std::int64_t elements() const { return static_cast<std::int64_t>(dq.size() + dk.size() + dv.size()); }
};

// dQ, dK, dV against the oracle's float64 backward (rows in the same order as the tensors: the
// case's Q, K and V are contiguous, batched or packed).
void expect_oracle_gradients(const Case& c, const BackwardTensors& t) {
  const bsattn_test::OracleGradients ref = bsattn_test::Oracle(c.p, c.in).backward(t.dout_view);
  const auto compare = [](const std::vector<float>& got, const std::vector<double>& want, const char* name) {
    ASSERT_EQ(got.size(), want.size()) << name;
    double scale = 0;
    for (double w : want) scale = std::max(scale, std::abs(w));
    for (std::size_t i = 0; i < got.size(); ++i)
      if (std::abs(got[i] - want[i]) > 1e-5 + 1e-4 * scale) {
        ADD_FAILURE() << name << "[" << i << "] = " << got[i] << " against " << want[i];
        return;
      }
  };
  compare(t.dq, ref.dq, "dq");
  compare(t.dk, ref.dk, "dk");
  compare(t.dv, ref.dv, "dv");
}

// The backward with the same mutated metadata: refused (by the argument the forward names, with no
// gradient element written) exactly where the forward is, else dQ, dK and dV as the oracle's.
class MutatedMetadataBackward : public MutatedMetadata {};

TEST_P(MutatedMetadataBackward, IsRefusedAsTheForwardOrDifferentiatesAsTheOracle) {
  int refused = 0;
  for (int i = 0; i < cases; ++i) {
    Case c(options);
    c.p.proxy = Proxy::off;  // no backward of proxy routes: the base's other features stay
    c.in.proxy = {};
    c.in.k_summary = c.in.v_summary = {};
    SCOPED_TRACE("mutation " + std::to_string(i) + ": " + mutate_some(c, rng));
    BackwardTensors t(c);
    t.poison();
    const BackwardInputs backward{c.out.out, c.out.lse, t.dout_view, {}};
    const Gradients gradients{t.dq_view, t.dk_view, t.dv_view};
    std::string forward_refusal;
    try {
      attention(c.p, c.in, c.out);
    } catch (const Error& e) {
      forward_refusal = e.argument();
    }
    try {
      attention_backward(c.p, c.in, backward, gradients);
    } catch (const Error& e) {
      ++refused;
      EXPECT_EQ(e.argument(), forward_refusal) << e.what();
      EXPECT_EQ(t.poisoned(), t.elements()) << "refused (" << e.what() << ") but a gradient element was written";
      continue;
    }
    ASSERT_EQ(forward_refusal, "") << "the backward accepted what the forward refused";
    ASSERT_EQ(t.poisoned(), 0) << "accepted, but a gradient element was not written";
    expect_oracle_gradients(c, t);
    if (HasFailure()) return;
  }
  expect_both_outcomes(refused);
  RecordProperty("refused", refused);
}

// The bases with integer metadata (all blocks over batched, contiguous tensors has none); the
// backward's without paged K/V (it has no backward).
std::vector<BaseParam> fuzz_bases(bool backward) {
  std::vector<BaseParam> v;
  for (const BaseParam& b : base_params()) {
    Options o = with(b.format, b.q, b.kv);
    o.features = b.features;
    Case probe(o);
    if (!integer_tensors(probe).empty() && !(backward && b.kv == KVLayout::paged)) v.push_back(b);
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(EveryFormatAndLayout, MutatedMetadata, ::testing::ValuesIn(fuzz_bases(false)), base_name);
INSTANTIATE_TEST_SUITE_P(ContiguousKV, MutatedMetadataBackward, ::testing::ValuesIn(fuzz_bases(true)), base_name);

}  // namespace
