// Proxy compensation on the GPU (SPEC §6, issue 11.3) against the CPU engine on the same inputs
// (which the oracle suite checks against float64): eligible blocks and explicit proxy sets, every
// format, batched and varlen (empty sequences), GQA with and without head packing, 128- and
// 64-row tiles, D 64 / 128 / 256, KV tiles narrower than the kernel's (Bk 48, 96) and split blocks (Bk 256), short
// last KV blocks, sparse explicit sets across the kernel's proxy windows, built-in masks (causal eligibility, windows, sinks, documents, KV bits), empty
// rows (every block proxied), dense rows (nothing proxied). Outputs and LSE are poisoned before
// the run and every element is compared.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>

#include "gpu_case.hpp"
#include "gpu_compare.hpp"

namespace bsattn_gpu_test {
namespace {

struct Sweep {
  Format format;
  bool varlen;
};

// Every format with sets (all_blocks computes every block exactly: plan() refuses proxy routes).
const Sweep kSweeps[] = {{Format::block_lists, false}, {Format::varlen_block_lists, true}, {Format::bsr, false},
                         {Format::bsr, true},          {Format::bitmask, false},           {Format::bitmask, true},
                         {Format::block_lists, true}};
constexpr int kNumSweeps = sizeof(kSweeps) / sizeof(kSweeps[0]);

// Eligible blocks: every format, both dtypes, the block shapes of the forward tests, random masks
// (-1: drawn, so causal rows make upper blocks ineligible and diagonal ones partial).
TEST(GpuProxy, EligibleEveryFormatAndBlock) {
  REQUIRE_SM90();
  const int blocks[][2] = {{128, 128}, {64, 64}, {128, 64}, {64, 128}, {256, 128},
                           {32, 64},   {16, 32}, {128, 96}, {64, 48},  {128, 256}};
  std::uint64_t seed = 7000;
  for (DType dt : {DType::bf16, DType::f16})
    for (const auto& bl : blocks) {
      CaseSpec spec;
      spec.proxy = Proxy::eligible;
      spec.dtype = dt;
      spec.bq = bl[0];
      spec.bk = bl[1];
      const Sweep& s = kSweeps[seed % kNumSweeps];
      spec.format = s.format;
      spec.varlen = s.varlen;
      spec.density = 0.3;
      spec.out_f32 = seed % 3 == 0;
      spec.seed = seed++;
      check_against_cpu(spec);
    }
}

TEST(GpuProxy, ExplicitSetEveryFormat) {
  REQUIRE_SM90();
  std::uint64_t seed = 7100;
  for (const Sweep& s : kSweeps) {
    for (int rep = 0; rep < 3; ++rep) {
      CaseSpec spec;
      spec.proxy = Proxy::explicit_set;
      spec.format = s.format;
      spec.varlen = s.varlen;
      spec.bq = rep == 1 ? 64 : 128;
      spec.bk = rep == 2 ? 64 : 128;
      spec.density = 0.25;
      spec.seed = seed++;
      check_against_cpu(spec);
    }
  }
}

// Query-head groups: packed head pairs (64-row tiles), odd groups, MQA, and the sparsity head
// shared by the whole group or per query head.
TEST(GpuProxy, GqaAndMasks) {
  REQUIRE_SM90();
  const int heads[][2] = {{4, 2}, {8, 1}, {4, 4}, {6, 3}, {6, 2}};
  std::uint64_t seed = 7200;
  for (const auto& h : heads)
    for (int mask = 0; mask <= 5; ++mask) {
      CaseSpec spec;
      spec.proxy = seed % 2 ? Proxy::eligible : Proxy::explicit_set;
      spec.hq = h[0];
      spec.hkv = h[1];
      spec.mask = mask;
      spec.bq = seed % 3 == 0 ? 64 : 128;
      spec.bk = 64;
      spec.format = kSweeps[seed % kNumSweeps].format;
      spec.varlen = kSweeps[seed % kNumSweeps].varlen;
      spec.density = 0.2;
      spec.seed = seed++;
      check_against_cpu(spec);
    }
}

// Long rows: several proxy steps per row (more than kBlockN proxy records), the last block short.
TEST(GpuProxy, ManyProxyStepsAndShortLastBlock) {
  REQUIRE_SM90();
  std::uint64_t seed = 7300;
  for (int bk : {16, 32, 64})
    for (bool causal : {false, true}) {
      CaseSpec spec;
      spec.proxy = Proxy::eligible;
      spec.bq = 128;
      spec.bk = bk;
      spec.mask = causal ? 1 : 0;
      spec.max_seqlen = 150 * bk + 37;  // 151 blocks: 3 proxy steps of 64 or 2 of 128
      spec.batch = 1;
      spec.density = 0.1;
      spec.seed = seed++;
      check_against_cpu(spec);
    }
}

// Sparse explicit sets on long rows: a row's proxy records lie far apart, so the kernel's windows
// (kBlockN blocks each, from the first record's to the last's) include windows with no record,
// and records sit at both ends of a window; pair kernels (128-row tiles, blocks of 128, packed
// head pairs), route pairs (128-row tiles over blocks of 32: windows of 128) and 64-row tiles.
TEST(GpuProxy, SparseExplicitSetsAcrossWindows) {
  REQUIRE_SM90();
  std::uint64_t seed = 7350;
  const int blocks[][2] = {{64, 16}, {128, 32}, {128, 128}};
  for (const auto& bl : blocks)
    for (double fraction : {0.02, 0.3}) {
      CaseSpec spec;
      spec.proxy = Proxy::explicit_set;
      spec.explicit_fraction = fraction;
      spec.bq = bl[0];
      spec.bk = bl[1];
      spec.mask = seed % 2 ? 1 : 0;
      // 300 blocks (5 windows of 64 or 3 of 128 blocks), or 157 of 128 tokens (2 windows)
      spec.max_seqlen = bl[1] == 128 ? 20000 : 300 * bl[1] + 5;
      spec.batch = 1;
      spec.hq = 2;
      spec.hkv = 1;
      spec.density = bl[1] == 128 ? 0.02 : 0.05;
      spec.format = seed % 3 == 0 ? Format::bitmask : Format::block_lists;
      spec.seed = seed++;
      check_against_cpu(spec);
    }
}

// Every selected block is all there is (density 1: no proxy record) and no block selected (every
// eligible block proxied).
TEST(GpuProxy, DenseAndEmptySelections) {
  REQUIRE_SM90();
  std::uint64_t seed = 7400;
  for (double density : {1.0, 0.0})
    for (Proxy proxy : {Proxy::eligible, Proxy::explicit_set}) {
      CaseSpec spec;
      spec.proxy = proxy;
      spec.density = density;
      spec.bk = 64;
      spec.seed = seed++;
      check_against_cpu(spec);
    }
}

// D 64 and 256 (the other tests run D 128): every kernel kind of those head dims (D 64 takes
// 128-wide KV tiles in the 64-row kernel of two CTAs per multiprocessor, D 256 only 64-wide ones),
// eligible and explicit sets, both dtypes, f32 outputs, short last blocks, rows of two windows.
TEST(GpuProxy, HeadDims64And256) {
  REQUIRE_SM90();
  const int blocks[][2] = {{128, 128}, {64, 64}, {128, 64}, {64, 128}, {32, 48}};
  std::uint64_t seed = 7500;
  for (int head_dim : {64, 256})
    for (const auto& bl : blocks)
      for (Proxy proxy : {Proxy::eligible, Proxy::explicit_set}) {
        CaseSpec spec;
        spec.proxy = proxy;
        spec.head_dim = head_dim;
        spec.dtype = seed % 2 ? DType::f16 : DType::bf16;
        spec.bq = bl[0];
        spec.bk = bl[1];
        const Sweep& s = kSweeps[seed % kNumSweeps];
        spec.format = s.format;
        spec.varlen = s.varlen;
        spec.hq = seed % 3 == 0 ? 4 : 2;  // 4 / 2: packed head pairs in 64-row tiles
        spec.hkv = 2;
        spec.max_seqlen = 70 * 32 + 29;  // blocks of 32 / 48: windows of 64 blocks and more; short last blocks
        spec.density = 0.15;
        spec.out_f32 = seed % 4 == 0;
        spec.seed = seed++;
        check_against_cpu(spec);
      }
}

}  // namespace
}  // namespace bsattn_gpu_test
