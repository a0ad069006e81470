// SPEC §3 and §5: every input format is prepared into one route stream, so the same selection
// written as block lists, varlen block lists, BSR or a bitmask gives bitwise identical outputs.
// Bitmask bits at or beyond nKB change nothing, nor does the thread count; a partial block the
// mask keeps whole gives the same bits as a full block; an all_blocks problem gives the same
// result under any block size. Also the varlen offset helper.
#include <gtest/gtest.h>

#include <vector>

#include "bsattn/varlen.hpp"
#include "random_problem.hpp"

namespace bsattn_test {
namespace {

using bsattn::Format;

constexpr int kCases = 120;

std::string run_bytes(RandomCase& c, std::vector<std::uint8_t>& bytes) {
  try {
    c.run_library();
  } catch (const std::exception& e) {
    return std::string("library threw: ") + e.what();
  }
  bytes = c.output_bytes();
  return "";
}

class FormatEquivalenceTest : public ::testing::TestWithParam<int> {};

TEST_P(FormatEquivalenceTest, EveryFormatGivesTheSameBits) {
  CaseOptions options;
  options.format = Format::block_lists;  // a selection every format can express
  const auto c = make_random_case(2000000 + static_cast<std::uint64_t>(GetParam()), options);
  const std::string failure = check_against_oracle(*c);
  ASSERT_TRUE(failure.empty()) << failure;
  const std::vector<std::uint8_t> reference = c->output_bytes();

  std::vector<Format> formats{Format::bsr, Format::bitmask};
  if (c->problem.q_layout == bsattn::QLayout::varlen) formats.push_back(Format::varlen_block_lists);
  for (Format f : formats)
    for (bool padding_bits : {false, true}) {
      if (padding_bits && f != Format::bitmask) continue;
      c->encode(f, padding_bits);
      std::vector<std::uint8_t> bytes;
      const std::string error = run_bytes(*c, bytes);
      ASSERT_TRUE(error.empty()) << c->describe() << "\n" << error;
      EXPECT_TRUE(bytes == reference) << c->describe() << (padding_bits ? " (with padding bits)" : "");
    }
  // Work items are independent: the thread count changes no bit either.
  c->problem.num_threads = 1;
  c->encode(Format::block_lists);
  std::vector<std::uint8_t> bytes;
  const std::string error = run_bytes(*c, bytes);
  ASSERT_TRUE(error.empty()) << c->describe() << "\n" << error;
  EXPECT_TRUE(bytes == reference) << c->describe() << " (one thread)";
}
INSTANTIATE_TEST_SUITE_P(Random, FormatEquivalenceTest, ::testing::Range(0, kCases));

// Partial blocks the built-in mask keeps whole, moved to the full set: same bits.
class WholeBlocksAsFullTest : public ::testing::TestWithParam<int> {};

TEST_P(WholeBlocksAsFullTest, SameOutputAsPartial) {
  CaseOptions options;
  options.format = Format::block_lists;
  options.has_partial = true;
  options.has_full = false;
  options.custom_mask = false;
  options.builtin_mask = true;
  const auto c = make_random_case(3000000 + static_cast<std::uint64_t>(GetParam()), options);
  const std::string failure = check_against_oracle(*c);
  ASSERT_TRUE(failure.empty()) << failure;
  const std::vector<std::uint8_t> reference = c->output_bytes();

  const Oracle oracle(c->problem, c->inputs);
  SparsityPattern& pattern = c->pattern;
  int moved = 0;
  for (int pb = 0; pb < pattern.batch; ++pb)
    for (int hs = 0; hs < pattern.heads; ++hs)
      for (int qb = 0; qb < pattern.q_blocks; ++qb) {
        std::vector<int>& partial = pattern.partial[pattern.row(pb, hs, qb)];
        std::vector<int>& full = pattern.full[pattern.row(pb, hs, qb)];
        std::vector<int> keep;
        for (int kb : partial) {
          // Every sequence reading this row must see the block whole.
          bool whole = true;
          for (int b = 0; b < c->problem.batch; ++b)
            if ((pattern.batch == 1 || b == pb) && qb < c->q_blocks(b))
              whole = whole && oracle.mask_keeps_whole(b, hs, qb, kb);
          (whole ? full : keep).push_back(kb);
          moved += whole;
        }
        partial = keep;
      }
  c->problem.has_full = true;
  c->encode(Format::block_lists);
  std::vector<std::uint8_t> bytes;
  const std::string error = run_bytes(*c, bytes);
  ASSERT_TRUE(error.empty()) << c->describe() << "\n" << error;
  EXPECT_TRUE(bytes == reference) << c->describe() << " (" << moved << " blocks moved to the full set)";
}
INSTANTIATE_TEST_SUITE_P(Random, WholeBlocksAsFullTest, ::testing::Range(0, 60));

// Format all_blocks keeps every block and masks per token, so its block size does not change what
// is computed: a GPU plan of that format for the backward builds its routes from blocks of
// 128 x 128 whatever block it names (plan.cpp, gpu_route_blocks_of_128). The same inputs and masks
// under the drawn blocks and under blocks of 128 both match the float64 oracle (batched, varlen,
// paged; every built-in mask).
class AllBlocksBlockSizeTest : public ::testing::TestWithParam<int> {};

TEST_P(AllBlocksBlockSizeTest, BlocksOf128GiveTheSameResult) {
  CaseOptions options;
  options.format = Format::all_blocks;
  options.custom_mask = false;
  const auto c = make_random_case(3500000 + static_cast<std::uint64_t>(GetParam()), options);
  const std::string drawn = check_against_oracle(*c);
  ASSERT_TRUE(drawn.empty()) << drawn;
  c->problem.block = bsattn::BlockSize{128, 128};
  c->problem.tile_m = c->problem.tile_n = 0;
  c->poison_outputs();
  const std::string of_128 = check_against_oracle(*c);
  EXPECT_TRUE(of_128.empty()) << "blocks of 128: " << of_128;
}
INSTANTIATE_TEST_SUITE_P(Random, AllBlocksBlockSizeTest, ::testing::Range(0, 60));

// bsattn::varlen_block_offsets (SPEC §3.2) against the prefix sums of nQB(b) and nQB(b) * nKB(b),
// for packed and paged KV, with and without seqused_k.
class VarlenOffsetsTest : public ::testing::TestWithParam<int> {};

TEST_P(VarlenOffsetsTest, MatchPrefixSums) {
  CaseOptions options;
  options.varlen = true;
  options.format = Format::varlen_block_lists;
  const auto c = make_random_case(3500000 + static_cast<std::uint64_t>(GetParam()), options);
  const int B = c->problem.batch;
  std::vector<std::int32_t> cu_m(B + 1, -1), cu_idx(B + 1, -1);
  bsattn::varlen_block_offsets(c->problem, c->inputs,
                               bsattn::TensorView::contiguous(cu_m.data(), bsattn::DType::i32, {B + 1}),
                               bsattn::TensorView::contiguous(cu_idx.data(), bsattn::DType::i32, {B + 1}));
  std::vector<std::int32_t> want_m{0}, want_idx{0};
  for (int b = 0; b < B; ++b) {
    want_m.push_back(want_m.back() + c->q_blocks(b));
    want_idx.push_back(want_idx.back() + c->q_blocks(b) * c->kv_blocks(b));
  }
  EXPECT_EQ(cu_m, want_m) << c->describe();
  EXPECT_EQ(cu_idx, want_idx) << c->describe();
}
INSTANTIATE_TEST_SUITE_P(Random, VarlenOffsetsTest, ::testing::Range(0, 30));

}  // namespace
}  // namespace bsattn_test
