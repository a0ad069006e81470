// The oracle suite (issue 2, item 7): seeded random problems against the float64 reference.
// Reproduce one case with --gtest_filter='*OracleTest*/<seed>' or BSATTN_ORACLE_SEED=<seed>.
#include <gtest/gtest.h>

#include <cstdlib>

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
