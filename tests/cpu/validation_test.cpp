// Validation (SPEC §8, docs/VALIDATION.md): one test per rule. Each case starts from a small valid
// problem with its tensors and breaks one thing; the call must throw bsattn::Error naming the
// argument and the bad value, and leave every output element as it was (poisoned).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "bsattn/bsattn.hpp"
#include "bsattn/cpu/numeric.hpp"
#include "validation_case.hpp"
#if BSATTN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {
using namespace bsattn;
using namespace validation_case;

// The call must throw an Error naming `argument` with `text` in its message.
void expect_error(const Case& c, const std::string& argument, const std::string& text) {
  try {
    attention(c.p, c.in, c.out);
    ADD_FAILURE() << "accepted; expected an error on " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << "message: " << e.what() << "\nexpected: " << text;
  }
}

// ... and write nothing.
void expect_rejected(Case& c, const std::string& argument, const std::string& text) {
  c.poison();
  expect_error(c, argument, text);
  EXPECT_EQ(c.poisoned(), c.output_elements()) << "an output element was written";
}

Options lists() { return Options{}; }
Options lists_without_full() {
  Options o;
  o.full = false;
  return o;
}
Options varlen_lists() {
  Options o;
  o.format = Format::varlen_block_lists;
  o.q_layout = QLayout::varlen;
  o.full = false;
  return o;
}

// ---- The valid bases pass, for every format and layout ------------------------------------

class ValidBase : public ::testing::TestWithParam<BaseParam> {};

TEST_P(ValidBase, IsAcceptedAndWritesEveryOutput) {
  const BaseParam& b = GetParam();
  Options o = with(b.format, b.q, b.kv);
  o.features = b.features;
  Case c(o);
  c.poison();
  ASSERT_NO_THROW(attention(c.p, c.in, c.out));
  EXPECT_EQ(c.poisoned(), 0);
}

INSTANTIATE_TEST_SUITE_P(EveryFormatAndLayout, ValidBase, ::testing::ValuesIn(base_params()), base_name);

TEST(Validation, BroadcastRowsAcceptBlocksOfTheLongestSequence) {
  // Bs = 1 over sequences with nKB {3, 2}: block 2 exists for b=0 only, and b=1 ignores it.
  Options o = with(Format::block_lists, QLayout::varlen, KVLayout::contiguous);
  o.broadcast = true;
  o.full = false;
  Case c(o);
  c.set_row("partial", 0, 0, 0, {0, 2});
  c.poison();
  EXPECT_NO_THROW(attention(c.p, c.in, c.out));
  c.set_row("partial", 0, 0, 0, {0, 3});
  expect_rejected(c, "partial.indices", "row (b=all, hs=0, qb=0) entry 1 = 3 is outside [0, nKB(b) = 3)");
}

// ---- Plan-time rules -------------------------------------------------------------------------

TEST(Validation, UnknownEnumValue) {
  Case c(lists());
  c.p.format = static_cast<Format>(9);  // e.g. an unchecked integer from a binding
  expect_rejected(c, "problem.format", "= 9 is not a known value");
}

TEST(Validation, HeadsNotDivisible) {
  Case c(lists());
  c.p.heads_kv = 3;
  expect_rejected(c, "problem.heads_q", "= 4 is not divisible by heads_kv = 3");
}

TEST(Validation, BadSparsityHeads) {
  Case c(lists());
  c.p.sparsity_heads = 3;
  expect_rejected(c, "problem.sparsity_heads", "= 3, expected 1, heads_kv = 2 or heads_q = 4");
}

TEST(Validation, BadSparsityBatch) {
  Case c(lists());
  c.p.sparsity_batch = 3;
  expect_rejected(c, "problem.sparsity_batch", "= 3, expected 1 (broadcast) or batch = 2");
}

TEST(Validation, SparsityBatchOnVarlenRows) {
  Case c(with(Format::bitmask, QLayout::varlen, KVLayout::contiguous));
  c.p.sparsity_batch = 2;
  expect_rejected(c, "problem.sparsity_batch", "enumerates rows per sequence; expected 1");
}

TEST(Validation, UnsupportedHeadDim) {
  Case c(lists());
  c.p.head_dim = 12;
  expect_rejected(c, "problem.head_dim", "= 12 is not supported");
}

TEST(Validation, UnsupportedBlockSize) {
  Case q(lists());
  q.p.block.q = 48;
  expect_rejected(q, "problem.block.q", "Bq = 48 is not supported");
  Case kv(lists());
  kv.p.block.kv = 24;
  expect_rejected(kv, "problem.block.kv", "Bk = 24 is not supported");
}

TEST(Validation, BadTileOverride) {
  Case m(lists());
  m.p.tile_m = 256;  // 16 Q blocks of 16 in one tile: more units than a route record holds
  expect_rejected(m, "problem.tile_m", "tile_m = 256 does not fit Bq = 16");
  Case n(lists());
  n.p.tile_n = 32;
  expect_rejected(n, "problem.tile_n", "tile_n = 32 does not fit Bk = 16");
  Case odd(lists());
  odd.p.tile_m = 24;
  expect_rejected(odd, "problem.tile_m", "tile_m = 24 is not a multiple of 16");
}

TEST(Validation, UnsupportedDtype) {
  Case c(lists());
  c.p.out_dtype = DType::i32;
  expect_rejected(c, "problem.out_dtype", "= i32, expected f32, f16 or bf16");
}

TEST(Validation, WindowBelowMinusOne) {
  Case c(lists());
  c.p.mask.window_left = -2;
  expect_rejected(c, "problem.mask.window_left", "= -2, expected at least -1");
}

TEST(Validation, NegativeSinkTokens) {
  Case c(lists());
  c.p.mask.sink_tokens = -1;
  expect_rejected(c, "problem.mask.sink_tokens", "= -1, expected at least 0");
}

TEST(Validation, NonFiniteScale) {
  Case nan(lists());
  nan.p.scale = std::numeric_limits<float>::quiet_NaN();
  expect_rejected(nan, "problem.scale", "expected a finite value");
  Case inf(lists());
  inf.p.scale = std::numeric_limits<float>::infinity();
  expect_rejected(inf, "problem.scale", "expected a finite value");
}

TEST(Validation, FullSetWithAllBlocks) {
  Case c(with(Format::all_blocks, QLayout::batched, KVLayout::contiguous));
  c.p.has_full = true;
  expect_rejected(c, "problem.has_full", "format all_blocks has no sparsity tensors");
}

TEST(Validation, ProxyNeedsAFormatWithSets) {
  Case c(with(Format::all_blocks, QLayout::batched, KVLayout::contiguous));
  c.p.proxy = Proxy::eligible;
  expect_rejected(c, "problem.proxy", "nothing is left for proxies");
}

TEST(Validation, NoSetSelected) {
  Case c(lists());
  c.p.has_partial = false;
  c.p.has_full = false;
  expect_rejected(c, "problem.has_partial", "with neither a partial nor a full set selects nothing");
}

TEST(Validation, VarlenListsNeedVarlenQ) {
  Case c(lists());
  c.p.format = Format::varlen_block_lists;
  c.p.sparsity_batch = 1;
  expect_rejected(c, "problem.format", "varlen_block_lists needs q_layout varlen");
}

TEST(Validation, VarlenNeedsTotals) {
  Case c(varlen_lists());
  c.p.total_kv = 0;
  expect_rejected(c, "problem.total_kv", "= 0, expected a positive value");
}

TEST(Validation, PagedCacheTooShortForMaxSeqlen) {
  Case c(with(Format::block_lists, QLayout::batched, KVLayout::paged));
  c.p.pages_per_seq = 4;  // 32 tokens readable, max_seqlen_kv 40
  expect_rejected(c, "problem.max_seqlen_kv", "= 40 does not fit in pages_per_seq * page_size = 4 * 8 = 32");
}

TEST(Validation, Int32Extent) {
  Case c(lists());
  c.p.max_seqlen_q = std::numeric_limits<std::int32_t>::max() - 8;
  expect_rejected(c, "problem.max_seqlen_q", "exceeds the int32 range the kernels index with");
}

TEST(Validation, Int32WorkItems) {
  Case c(lists());
  c.p.batch = 1 << 20;  // 2^20 sequences * 4 heads * 2^10 tiles of 64 rows (the plan fails first)
  c.p.sparsity_batch = 1;
  c.p.max_seqlen_q = 1 << 16;
  expect_rejected(c, "problem.max_seqlen_q", "work items batch * heads_q * ceil(max_seqlen_q / tile_m) = 4294967296");
}

TEST(Validation, NegativeRouteCapacity) {
  Case c(lists());
  c.p.max_routes_per_row = -1;
  expect_rejected(c, "problem.max_routes_per_row", "= -1, expected at least 0");
}

TEST(Validation, PlanFailureLeavesThePreviousPlanUsable) {
  Case c(lists());
  Plan plan(c.p);
  Problem bad = c.p;
  bad.block.kv = 24;
  EXPECT_THROW(plan.plan(bad), Error);
  ASSERT_TRUE(plan.planned());
  EXPECT_EQ(plan.problem().block.kv, 16);
  c.poison();
  EXPECT_NO_THROW(plan.run(c.in, c.out));
  EXPECT_EQ(c.poisoned(), 0);
}

// ---- Structural rules (every run) ------------------------------------------------------------

TEST(Validation, MissingRequiredTensor) {
  Case c(lists());
  c.in.full = BlockSet{};
  expect_rejected(c, "full.counts", "is required by this problem");
}

TEST(Validation, EmptySetWithANullPointerIsGiven) {
  // A BSR full set with no entries, its indices an empty vector's data() (null): given, as the
  // factories point zero-element views at an aligned placeholder; the partial set is attended.
  Case c(with(Format::bsr, QLayout::batched, KVLayout::contiguous));
  const std::int64_t rows = c.in.full.indptr.shape[0];
  std::vector<std::int32_t> zeros(static_cast<std::size_t>(rows), 0), none;
  c.in.full.indptr = TensorView::contiguous(zeros.data(), DType::i32, {rows});
  c.in.full.indices = TensorView::contiguous(none.data(), DType::i32, {0});
  ASSERT_TRUE(c.in.full.indices.defined());
  c.poison();
  EXPECT_NO_THROW(attention(c.p, c.in, c.out));
  EXPECT_EQ(c.poisoned(), 0);
}

TEST(Validation, MissingOutput) {
  Case c(lists());
  Outputs none;
  none.lse = c.out.lse;
  c.poison();
  try {
    attention(c.p, c.in, none);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "outputs.out");
  }
  EXPECT_EQ(c.poisoned(), c.output_elements());
}

TEST(Validation, ForbiddenTensorPresent) {
  Case c(lists());
  c.p.has_full = false;  // the full set is still given: it would be silently ignored
  expect_rejected(c, "full.counts", "is given, but this problem");
}

TEST(Validation, TensorOfAnotherLayoutPresent) {
  Case c(lists());
  c.in.seqused_k = c.ints({2}, {40, 40});
  expect_rejected(c, "seqused_k", "is given, but this problem (format block_lists, q_layout batched");
}

TEST(Validation, WrongDtype) {
  Case c(lists());
  c.in.q.dtype = DType::f16;
  expect_rejected(c, "q", "has dtype f16, expected f32");
}

TEST(Validation, WrongMetadataDtype) {
  Case c(lists());
  c.in.partial.counts.dtype = DType::u32;
  expect_rejected(c, "partial.counts", "has dtype u32, expected i32");
}

TEST(Validation, WrongRank) {
  Case c(lists());
  c.in.partial.indices.rank = 3;
  expect_rejected(c, "partial.indices", "has rank 3 (shape [2, 2, 3]), expected rank 4");
}

TEST(Validation, WrongShape) {
  Case c(lists());
  c.in.k.shape[2] = 1;
  expect_rejected(c, "k", "dimension 2 (Hkv) is 1");
}

TEST(Validation, BlockListLongerThanKvBlocks) {
  Case c(lists());
  TensorView& idx = c.in.partial.indices;
  idx = Case::with_shape(c.alloc<std::int32_t>(2 * 2 * 3 * 4, 0), DType::i32, {2, 2, 3, 4});
  expect_rejected(c, "partial.indices", "dimension 3 (L) is 4");
}

TEST(Validation, BlockTableNarrowerThanPagesPerSeq) {
  Case c(with(Format::block_lists, QLayout::batched, KVLayout::paged));
  c.in.block_table.shape[1] = 5;
  expect_rejected(c, "block_table", "dimension 1 (C) is 5");
}

TEST(Validation, BitmaskWordsTooFew) {
  Case c(with(Format::bitmask, QLayout::batched, KVLayout::contiguous));
  c.in.partial.bits.shape[3] = 0;
  expect_rejected(c, "partial.bits", "expected [Bs=2, Hs=2, nQB=3, W>=1]: dimension 3 (W) is 0");
}

TEST(Validation, BadSummaryShape) {
  Options o = lists();
  o.features = true;
  Case c(o);
  c.in.k_summary.shape[1] = 4;
  expect_rejected(c, "k_summary", "dimension 1 (nKB) is 4");
}

TEST(Validation, DeviceMismatch) {
  Case c(lists());
  c.in.v.device = Device::cuda;
  expect_rejected(c, "v", "is on cuda:0, but the problem runs on cpu:0");
}

TEST(Validation, MisalignedQPointer) {
  Case c(lists());
  c.in.q.data = static_cast<float*>(c.in.q.data) + 1;
  expect_rejected(c, "q", "base address is 4 bytes past a 16-byte boundary");
}

TEST(Validation, MisalignedRowStride) {
  Case c(lists());
  // Heads 10 floats (40 bytes) apart: every other head row starts off a 16-byte boundary.
  float* data = c.alloc<float>(2 * 40 * 4 * 10, 0.0f);
  c.in.q = TensorView::strided(data, DType::f32, {2, 40, 4, 8}, {40 * 4 * 10, 4 * 10, 10, 1});
  expect_rejected(c, "q", "stride 2 = 10 elements (40 bytes) is not a multiple of 16 bytes");
}

TEST(Validation, NonContiguousLastDim) {
  Case c(lists());
  float* data = c.alloc<float>(2 * 40 * 2 * 16, 0.0f);
  c.in.k = TensorView::strided(data, DType::f32, {2, 40, 2, 8}, {40 * 2 * 16, 2 * 16, 16, 2});
  expect_rejected(c, "k", "last dimension has stride 2, expected 1 (contiguous)");
}

TEST(Validation, NegativeStride) {
  Case c(lists());
  c.in.partial.counts.stride[0] = -6;
  expect_rejected(c, "partial.counts", "stride 0 = -6 is negative");
}

TEST(Validation, OutputOverlapsInput) {
  Case c(lists());
  c.out.out.data = c.in.q.data;  // O has Q's shape and dtype
  c.poison();                    // the poison lands in Q; the rejection must leave it there
  expect_rejected(c, "outputs.out", "overlaps input q in memory");
}

TEST(Validation, OutputOverlapsMetadata) {
  Case c(lists());
  c.in.partial.indices.data = c.out.lse.data;  // metadata inside the LSE buffer
  expect_rejected(c, "outputs.lse", "overlaps input partial.indices in memory");
}

TEST(Validation, OutputOverlapsLse) {
  Case c(lists());
  c.out.lse.data = static_cast<float*>(c.out.out.data) + 64;
  expect_rejected(c, "outputs.lse", "overlaps outputs.out in memory");
}

TEST(Validation, OutputElementsShareMemory) {
  Case c(lists());
  c.out.out.stride[1] = 0;  // every token of a sequence would land on the same row
  expect_rejected(c, "outputs.out", "distinct elements would share memory");
}

// ---- Value rules (validate = true) -----------------------------------------------------------
// One rule per entry; each runs on the CPU engine (ValueRule.*) and, with the metadata in device
// memory, on a GPU plan (GpuValidation.EveryValueRuleOnDeviceMetadata), where the rules run as
// device kernels and only a raised flag brings the metadata to the host to be named.

struct ValueRule {
  const char* name;
  Options options;
  const char* argument;
  std::function<std::string(Case&)> breaks;  // breaks one value; returns the expected message text
};

Options features(Options o) {
  o.features = true;
  return o;
}

std::vector<ValueRule> value_rules() {
  const Options bsr = with(Format::bsr, QLayout::batched, KVLayout::contiguous);
  const Options paged = with(Format::block_lists, QLayout::batched, KVLayout::paged);
  return {
      {"VarlenBitmaskRowsTooFew", with(Format::bitmask, QLayout::varlen, KVLayout::contiguous), "partial.bits",
       [](Case& c) {
         c.in.partial.bits.shape[1] = 4;
         return std::string("has 4 rows (dimension 1), but the sequences have total_m_blocks = 5");
       }},
      {"IndexOutOfRange", lists_without_full(), "partial.indices",
       [](Case& c) {
         c.set_row("partial", 1, 0, 2, {0, 3});
         return std::string("row (b=1, hs=0, qb=2) entry 1 = 3 is outside [0, nKB(b) = 3)");
       }},
      // b=1 has 24 KV tokens: blocks 0..1. Block 2 exists only for b=0 (indices are sequence-local).
      {"IndexOutsideItsSequence", varlen_lists(), "partial.indices",
       [](Case& c) {
         c.set_row("partial", 1, 1, 0, {2});
         return std::string("row (b=1, hs=1, qb=0) entry 0 = 2 is outside [0, nKB(b) = 2)");
       }},
      {"DuplicateIndex", lists_without_full(), "partial.indices",
       [](Case& c) {
         c.set_row("partial", 1, 0, 1, {0, 1, 1});
         return std::string("row (b=1, hs=0, qb=1) entry 2 = 1 is not above the previous entry 1 (duplicate)");
       }},
      {"DescendingIndices", lists_without_full(), "partial.indices",
       [](Case& c) {
         c.set_row("partial", 0, 1, 0, {2, 0});
         return std::string("row (b=0, hs=1, qb=0) entry 1 = 0 is not above the previous entry 2 (descending)");
       }},
      {"CountAboveL", lists_without_full(), "partial.counts",
       [](Case& c) {
         c.at("partial.counts", {0, 1, 1}) = 4;
         return std::string("row (b=0, hs=1, qb=1) count = 4 is outside [0, 3]");
       }},
      {"NegativeCount", lists_without_full(), "partial.counts",
       [](Case& c) {
         c.at("partial.counts", {1, 0, 0}) = -1;
         return std::string("row (b=1, hs=0, qb=0) count = -1 is outside [0, 3]");
       }},
      {"VarlenCountAboveSequenceBlocks", varlen_lists(), "partial.counts",
       [](Case& c) {
         c.at("partial.counts", {0, c.cu_m[1] + 1}) = 3;
         return std::string("row (b=1, hs=0, qb=1) count = 3 is outside [0, 2] (nKB(b) = 2)");
       }},
      {"BsrIndptrFirstNotZero", bsr, "partial.indptr",
       [](Case& c) {
         c.at("partial.indptr", {0}) = 1;
         return std::string("partial.indptr[0] = 1, expected 0");
       }},
      {"BsrIndptrNotMonotone", bsr, "partial.indptr",
       [](Case& c) {
         const std::int32_t next = c.at("partial.indptr", {5});
         c.at("partial.indptr", {4}) = next + 1;
         return "partial.indptr[5] = " + std::to_string(next) + " is below partial.indptr[4] = " +
                std::to_string(next + 1) + " (not monotone)";
       }},
      {"BsrIndptrLastAboveNnz", bsr, "partial.indptr",
       [](Case& c) {
         const std::int64_t nnz = c.in.partial.indices.shape[0];
         c.at("partial.indptr", {12}) = static_cast<std::int32_t>(nnz + 1);
         return "partial.indptr[12] = " + std::to_string(nnz + 1) + " is above nnz = " + std::to_string(nnz);
       }},
      // Varlen rows: R = Hs * total_m_blocks = 2 * 5 is known from cu_seqlens_q only.
      {"BsrRowCountMismatch", with(Format::bsr, QLayout::varlen, KVLayout::contiguous), "partial.indptr",
       [](Case& c) {
         c.in.partial.indptr.shape[0] = 10;
         return std::string("has 10 entries, expected R + 1 = 11");
       }},
      // Row 0 = (b=0, hs=0, qb=0) selects block 1 (partial) and 2 (full); make it {1, 1}.
      {"BsrDuplicateIndex", bsr, "partial.indices",
       [](Case& c) {
         EXPECT_EQ(c.at("partial.indptr", {1}), 1);
         c.at("partial.indptr", {1}) = 2;  // row 0 now also reads row 1's first entry
         c.at("partial.indices", {1}) = c.at("partial.indices", {0});
         return std::string("row (b=0, hs=0, qb=0) entry 1 = 1 is not above the previous entry 1 (duplicate)");
       }},
      {"CuSeqlensStartAboveZero", varlen_lists(), "cu_seqlens_q",
       [](Case& c) {
         c.at("cu_seqlens_q", {0}) = 4;
         return std::string("cu_seqlens_q[0] = 4, expected 0");
       }},
      {"CuSeqlensNotMonotone", varlen_lists(), "cu_seqlens_q",
       [](Case& c) {
         c.at("cu_seqlens_q", {2}) = 30;
         return std::string("cu_seqlens_q[2] = 30 is below cu_seqlens_q[1] = 40 (not monotone)");
       }},
      {"CuSeqlensWrongEnd", varlen_lists(), "cu_seqlens_k",
       [](Case& c) {
         c.at("cu_seqlens_k", {2}) = 60;
         return std::string("cu_seqlens_k[2] = 60, expected total_kv = 64");
       }},
      {"SequenceLongerThanMaxSeqlen", varlen_lists(), "cu_seqlens_q",
       [](Case& c) {
         c.at("cu_seqlens_q", {1}) = 10;
         return std::string("sequence b=1 has length 50, above max_seqlen_q = 40");
       }},
      {"SequsedKAboveSequenceLength", varlen_lists(), "seqused_k",
       [](Case& c) {
         c.in.seqused_k = c.ints({2}, {40, 30});
         return std::string("seqused_k[1] = 30 is outside [0, 24]");
       }},
      {"CuTotalMBlocksInconsistent", varlen_lists(), "cu_total_m_blocks",
       [](Case& c) {
         c.at("cu_total_m_blocks", {1}) = 2;
         return std::string(
             "cu_total_m_blocks[1] = 2, but the exclusive prefix sum of nQB(b) implied by the sequence lengths is 3");
       }},
      {"CuBlockIdxOffsetsInconsistent", varlen_lists(), "cu_block_idx_offsets",
       [](Case& c) {
         c.at("cu_block_idx_offsets", {2}) = 12;
         return std::string(
             "cu_block_idx_offsets[2] = 12, but the exclusive prefix sum of nQB(b) * nKB(b) implied by the sequence "
             "lengths is 13");
       }},
      {"VarlenIndicesTooShort", varlen_lists(), "partial.indices",
       [](Case& c) {
         c.in.partial.indices.shape[1] = 12;
         return std::string("has 12 columns, but the sequences need total_n_blocks = 13");
       }},
      {"PageIdOutOfRange", paged, "block_table",
       [](Case& c) {
         c.at("block_table", {1, 1}) = c.num_pages;  // row 1 reads its entries 0 and 1 in both page sizes
         return "row b=1 entry 1 = " + std::to_string(c.num_pages) + " is outside [0, " +
                std::to_string(c.num_pages - 1) + "]";
       }},
      // Row 1 would need more pages than a row has readable entries before its padding.
      {"UnreadablePaddedRow", paged, "seq_lens_kv",
       [](Case& c) {
         c.at("seq_lens_kv", {1}) = 50;
         return "seq_lens_kv[1] = 50 needs " + std::to_string((50 + c.page_size - 1) / c.page_size) +
                " pages, but only the first pages_per_seq = " + std::to_string(c.pages_per_seq) + " entries";
       }},
      {"SeqLensKvAboveCache", with(Format::block_lists, QLayout::varlen, KVLayout::paged), "seq_lens_kv",
       [](Case& c) {
         c.at("seq_lens_kv", {0}) = 44;
         return std::string("seq_lens_kv[0] = 44 is above max_seqlen_kv = 40");
       }},
      {"NegativeSeqLensKv", paged, "seq_lens_kv",
       [](Case& c) {
         c.at("seq_lens_kv", {1}) = -3;
         return std::string("seq_lens_kv[1] = -3 is negative");
       }},
      {"BlockInPartialAndFull", lists(), "full.indices",
       [](Case& c) {
         c.set_row("partial", 1, 1, 2, {0, 1});
         c.set_row("full", 1, 1, 2, {1, 2});
         return std::string("row (b=1, hs=1, qb=2): KV block 1 is in both the partial and the full set");
       }},
      {"BitmaskBlockInPartialAndFull", with(Format::bitmask, QLayout::batched, KVLayout::contiguous), "full.bits",
       [](Case& c) {
         c.at("partial.bits", {0, 0, 0, 0}) |= 1 << 2;  // block 2 of this row is full in the base
         return std::string("row (b=0, hs=0, qb=0): KV block 2 is in both the partial and the full set");
       }},
      {"ExplicitProxySetIndexOutOfRange", features(lists()), "proxy.indices",
       [](Case& c) {
         c.at("proxy.indices", {0, 0, 0, 0}) = 5;
         c.at("proxy.counts", {0, 0, 0}) = 1;
         return std::string("row (b=0, hs=0, qb=0) entry 0 = 5 is outside [0, nKB(b) = 3)");
       }},
  };
}

class ValueRuleTest : public ::testing::TestWithParam<ValueRule> {};

TEST_P(ValueRuleTest, RejectsAndWritesNothing) {
  const ValueRule& rule = GetParam();
  Case c(rule.options);
  const std::string text = rule.breaks(c);
  expect_rejected(c, rule.argument, text);
}

INSTANTIATE_TEST_SUITE_P(Validation, ValueRuleTest, ::testing::ValuesIn(value_rules()),
                         [](const ::testing::TestParamInfo<ValueRule>& info) { return std::string(info.param.name); });

TEST(Validation, ExplicitProxySetMayNameSelectedBlocks) {
  // Selected blocks are computed exactly and skipped by the proxy set: not an error.
  Options o = lists();
  o.features = true;
  Case c(o);
  c.set_row("partial", 0, 0, 0, {1});
  c.set_row("proxy", 0, 0, 0, {0, 1, 2});
  c.poison();
  EXPECT_NO_THROW(attention(c.p, c.in, c.out));
  EXPECT_EQ(c.poisoned(), 0);
}

TEST(Validation, CapacityOverflowWritesNothing) {
  Case c(lists());
  c.p.max_routes_per_row = 1;
  expect_rejected(c, "max_routes_per_row", "needs");
}

TEST(Validation, ValuesUncheckedWhenValidateIsOffButStructureIsChecked) {
  Case c(lists_without_full());
  c.set_row("partial", 1, 0, 2, {0, 7});  // out of range: dropped by route preparation, never read
  c.p.validate = false;
  Plan plan(c.p);
  EXPECT_NO_THROW(plan.run(c.in, c.out));
  c.in.q.dtype = DType::bf16;
  EXPECT_THROW(plan.run(c.in, c.out), Error);
}

#if BSATTN_WITH_CUDA
// ---- Metadata on the GPU: value checks read device copies ------------------------------------

bool have_sm90() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp prop{};
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9;
}

void expect_cuda(cudaError_t e) { EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

// For its lifetime, the case runs on GPU 0 with its tensors (all but `kept_on_host`) in device
// memory; afterwards the outputs are copied back and the views point at the host again.
class OnDevice {
 public:
  explicit OnDevice(Case& c, const std::vector<std::string>& kept_on_host = {}) : c_(c) {
    c.p.device = Device::cuda;
    for (const auto& [name, view] : c.fields()) {
      if (!view->defined() || std::find(kept_on_host.begin(), kept_on_host.end(), name) != kept_on_host.end()) continue;
      Moved m{view, view->data, nullptr, bytes(*view)};
      expect_cuda(cudaMalloc(&m.device, m.bytes));
      expect_cuda(cudaMemcpy(m.device, m.host, m.bytes, cudaMemcpyHostToDevice));
      view->data = m.device;
      view->device = Device::cuda;
      moved_.push_back(m);
    }
  }
  ~OnDevice() {
    expect_cuda(cudaDeviceSynchronize());
    for (const Moved& m : moved_) {
      expect_cuda(cudaMemcpy(m.host, m.device, m.bytes, cudaMemcpyDeviceToHost));
      expect_cuda(cudaFree(m.device));
      m.view->data = m.host;
      m.view->device = Device::cpu;
    }
    c_.p.device = Device::cpu;
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  struct Moved {
    TensorView* view;
    void* host;
    void* device;
    std::size_t bytes;
  };
  static std::size_t bytes(const TensorView& t) {
    std::int64_t last = 0;
    for (int i = 0; i < t.rank; ++i) last += (t.shape[i] - 1) * t.stride[i];
    return static_cast<std::size_t>((last + 1) * static_cast<std::int64_t>(element_size(t.dtype)));
  }
  Case& c_;
  std::vector<Moved> moved_;
};

Options on_gpu(Options o) {
  o.gpu = true;
  return o;
}

// Every valid base passes the device value checks and is computed.
TEST(GpuValidation, ValidBasesAreAccepted) {
  if (!have_sm90()) GTEST_SKIP() << "no SM90 GPU";
  for (const BaseParam& b : base_params()) {
    Options o = with(b.format, b.q, b.kv);
    o.features = b.features;
    SCOPED_TRACE(base_name(::testing::TestParamInfo<BaseParam>(b, 0)));
    Case c(on_gpu(o));
    c.poison();
    {
      OnDevice device(c);
      EXPECT_NO_THROW(attention(c.p, c.in, c.out));
    }
    EXPECT_EQ(c.poisoned(), 0);
  }
}

// Each value rule with its metadata in device memory: the device checks raise their flag, the host
// then names the same argument and value as the CPU engine, and nothing is written.
TEST(GpuValidation, EveryValueRuleOnDeviceMetadata) {
  if (!have_sm90()) GTEST_SKIP() << "no SM90 GPU";
  for (const ValueRule& rule : value_rules()) {
    SCOPED_TRACE(rule.name);
    Case c(on_gpu(rule.options));
    const std::string text = rule.breaks(c);
    c.poison();
    {
      OnDevice device(c);
      expect_error(c, rule.argument, text);
    }
    EXPECT_EQ(c.poisoned(), c.output_elements());
  }
}

// Random metadata values (validation_fuzz_test.cpp's mutations) on the GPU bases: the device value
// checks refuse exactly what the CPU engine refuses, naming the same argument, and write nothing;
// what both accept gives the CPU engine's O and LSE (bf16 inputs, f32 accumulation on both).
TEST(GpuValidation, RandomMetadataAsTheCpuEngine) {
  if (!have_sm90()) GTEST_SKIP() << "no SM90 GPU";
  std::mt19937_64 rng(2026);
  int refused = 0, cases = 0;
  for (const BaseParam& b : base_params()) {
    Options o = with(b.format, b.q, b.kv);
    o.features = b.features;
    SCOPED_TRACE(base_name(::testing::TestParamInfo<BaseParam>(b, 0)));
    for (int i = 0; i < 12; ++i) {
      Case c(on_gpu(o));
      if (integer_tensors(c).empty()) break;
      SCOPED_TRACE("mutation " + std::to_string(i) + ": " + mutate_some(c, rng));
      ++cases;
      std::string cpu_refusal, gpu_refusal;
      c.poison();
      try {
        attention(c.p, c.in, c.out);
      } catch (const Error& e) {
        cpu_refusal = e.argument();
      }
      const auto words = [](const TensorView& t) {
        const auto* w = static_cast<const std::uint32_t*>(t.data);
        return std::vector<std::uint32_t>(w, w + Case::words(t));
      };
      const std::vector<std::uint32_t> cpu_out = words(c.out.out), cpu_lse = words(c.out.lse);
      c.poison();
      {
        OnDevice device(c);
        try {
          attention(c.p, c.in, c.out);
        } catch (const Error& e) {
          gpu_refusal = e.argument();
        }
      }
      EXPECT_EQ(gpu_refusal, cpu_refusal);
      if (!cpu_refusal.empty() || !gpu_refusal.empty()) {
        ++refused;
        if (!gpu_refusal.empty()) EXPECT_EQ(c.poisoned(), c.output_elements()) << "refused, but written";
        continue;
      }
      ASSERT_EQ(c.poisoned(), 0);
      // O in bf16 (two per word), LSE in f32: within bf16's rounding of O and 1e-3 of the LSE.
      const auto bf16 = [](std::uint32_t w, int half) { return cpu::bf16_to_float(static_cast<std::uint16_t>(w >> (16 * half))); };
      const std::vector<std::uint32_t> gpu_out = words(c.out.out), gpu_lse = words(c.out.lse);
      for (std::size_t j = 0; j < cpu_out.size(); ++j)
        for (int half = 0; half < 2; ++half) {
          const float want = bf16(cpu_out[j], half), got = bf16(gpu_out[j], half);
          if (!(std::abs(got - want) <= 1e-2f + 1e-2f * std::abs(want))) {
            ADD_FAILURE() << "O word " << j << ": " << got << " against the CPU engine's " << want;
            j = cpu_out.size();
            break;
          }
        }
      for (std::size_t j = 0; j < cpu_lse.size(); ++j) {
        float want, got;
        std::memcpy(&want, &cpu_lse[j], 4);
        std::memcpy(&got, &gpu_lse[j], 4);
        if (!(got == want || std::abs(got - want) <= 1e-3f * (1 + std::abs(want)))) {
          ADD_FAILURE() << "LSE " << j << ": " << got << " against the CPU engine's " << want;
          break;
        }
      }
      if (HasFailure()) return;
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_LT(refused, cases);
}

TEST(GpuValidation, HostMetadataOnAGpuProblem) {
  if (!have_sm90()) GTEST_SKIP() << "no SM90 GPU";
  Case c(on_gpu(lists()));
  c.poison();
  {
    OnDevice device(c, {"partial.counts"});
    expect_error(c, "partial.counts", "is on cpu:0, but the problem runs on cuda:0");
  }
  EXPECT_EQ(c.poisoned(), c.output_elements());
}
TEST(GpuValidation, ValueChecksInsideGraphCaptureFailCleanly) {
  if (!have_sm90()) GTEST_SKIP() << "no SM90 GPU";
  Case c(on_gpu(lists()));
  c.poison();
  {
    OnDevice device(c);
    Plan plan(c.p);  // validate = true: run() reads the value checks' flag on the host
    cudaStream_t stream = nullptr;
    expect_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    expect_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    try {
      plan.run(c.in, c.out, stream);
      ADD_FAILURE() << "run() with validate = true succeeded inside a capture";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "problem.validate") << e.what();
      EXPECT_NE(std::string(e.what()).find("capture with validate = false"), std::string::npos) << e.what();
    }
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(stream, &graph);  // the capture was invalidated; nothing to keep
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    expect_cuda(cudaStreamDestroy(stream));
  }
  EXPECT_EQ(c.poisoned(), c.output_elements());
}
#endif  // BSATTN_WITH_CUDA

}  // namespace
