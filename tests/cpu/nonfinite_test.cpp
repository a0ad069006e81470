// Non-finite inputs (issue 14): a NaN or infinity in Q, K or V reaches exactly the rows that touch
// it, with the IEEE semantics of a plain softmax (the oracle's): a NaN score or an infinite one
// (inf - inf) makes the row's O and LSE NaN, an infinite V element makes the O columns of the
// rows that weigh it non-finite (LSE does not depend on V). Rows that do not touch it are
// unchanged. Random cases of every format, layout and mask, checked against the float64 oracle.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>

#include "oracle.hpp"
#include "random_problem.hpp"

namespace bsattn_test {
namespace {

using bsattn::DType;
using bsattn::TensorView;

enum class NonFinite { nan, pos_inf, neg_inf };

void store_non_finite(const TensorView& t, std::int64_t offset, NonFinite what) {
  const float f = what == NonFinite::nan       ? std::numeric_limits<float>::quiet_NaN()
                  : what == NonFinite::pos_inf ? std::numeric_limits<float>::infinity()
                                               : -std::numeric_limits<float>::infinity();
  const std::uint16_t half = what == NonFinite::nan ? 0x7e00 : what == NonFinite::pos_inf ? 0x7c00 : 0xfc00;
  const std::uint16_t bf16 = what == NonFinite::nan ? 0x7fc0 : what == NonFinite::pos_inf ? 0x7f80 : 0xff80;
  switch (t.dtype) {
    case DType::f32: static_cast<float*>(t.data)[offset] = f; break;
    case DType::f16: static_cast<std::uint16_t*>(t.data)[offset] = half; break;
    case DType::bf16: static_cast<std::uint16_t*>(t.data)[offset] = bf16; break;
    default: FAIL() << "not a float tensor";
  }
}

struct Token {
  int b = -1, pos = -1;
};

// A random in-range token of a sequence that has one (every sequence may be empty: then none).
Token random_token(RandomCase& c, const std::vector<int>& seqlen) {
  std::vector<int> live;
  for (int b = 0; b < static_cast<int>(seqlen.size()); ++b)
    if (seqlen[b] > 0) live.push_back(b);
  if (live.empty()) return {};
  const int b = live[std::uniform_int_distribution<int>(0, static_cast<int>(live.size()) - 1)(c.rng)];
  return {b, std::uniform_int_distribution<int>(0, seqlen[b] - 1)(c.rng)};
}

NonFinite random_kind(RandomCase& c) { return static_cast<NonFinite>(std::uniform_int_distribution<int>(0, 2)(c.rng)); }

std::int64_t q_offset(const RandomCase& c, int b, int q, int h, int d) {
  const TensorView& t = c.inputs.q;
  if (c.problem.q_layout == bsattn::QLayout::varlen) {
    const auto* cu = static_cast<const std::int32_t*>(c.inputs.cu_seqlens_q.data);
    return (cu[b] + q) * t.stride[0] + h * t.stride[1] + d;
  }
  return b * t.stride[0] + q * t.stride[1] + h * t.stride[2] + d;
}

int uniform(RandomCase& c, int hi) { return std::uniform_int_distribution<int>(0, hi - 1)(c.rng); }

// One non-finite element in Q and one in K (NaN, +inf or -inf each), anywhere.
void poison_q_and_k(RandomCase& c) {
  const bsattn::Problem& p = c.problem;
  if (const Token t = random_token(c, c.seqlen_q); t.b >= 0)
    store_non_finite(c.inputs.q, q_offset(c, t.b, t.pos, uniform(c, p.heads_q), uniform(c, p.head_dim)),
                     random_kind(c));
  if (const Token t = random_token(c, c.seqlen_kv); t.b >= 0)
    store_non_finite(c.inputs.k, c.kv_offset(c.inputs.k, t.b, t.pos, uniform(c, p.heads_kv)) + uniform(c, p.head_dim),
                     random_kind(c));
}

constexpr int kCases = 120;

class NonFiniteQK : public ::testing::TestWithParam<int> {};

// Every format, layout, mask and proxy mode: Q and K non-finites are never multiplied by a zero
// weight (a masked score is replaced, not scaled), so the engine is exact against the oracle.
TEST_P(NonFiniteQK, ReachExactlyTheRowsThatTouchThem) {
  auto c = make_random_case(0x9e3779b97f4a7c15ull ^ static_cast<std::uint64_t>(GetParam()));
  poison_q_and_k(*c);
  EXPECT_EQ(check_against_oracle(*c), "");
}
INSTANTIATE_TEST_SUITE_P(Random, NonFiniteQK, ::testing::Range(0, kCases));

class NonFiniteV : public ::testing::TestWithParam<int> {};

// V: selected blocks are attended whole (full sets, no token mask), so no row weighs a V row by
// an exact zero. (A masked token inside a loaded tile is weighed by zero, and 0 x inf is NaN on
// both engines, as in FlashAttention: docs/ARCHITECTURE.md.)
TEST_P(NonFiniteV, ReachExactlyTheRowsThatTouchThem) {
  CaseOptions o;
  o.builtin_mask = false;
  o.custom_mask = false;
  o.has_partial = false;
  o.has_full = true;
  o.proxy = bsattn::Proxy::off;
  auto c = make_random_case(0x51ed270b27ull ^ static_cast<std::uint64_t>(GetParam()), o);
  for (int i = 0; i < 2; ++i)
    if (const Token t = random_token(*c, c->seqlen_kv); t.b >= 0)
      store_non_finite(c->inputs.v,
                       c->kv_offset(c->inputs.v, t.b, t.pos, uniform(*c, c->problem.heads_kv)) +
                           uniform(*c, c->problem.head_dim),
                       random_kind(*c));
  EXPECT_EQ(check_against_oracle(*c), "");
}
INSTANTIATE_TEST_SUITE_P(Random, NonFiniteV, ::testing::Range(0, kCases / 2));

}  // namespace
}  // namespace bsattn_test
