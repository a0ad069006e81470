// Direct unit tests of route preparation (SPEC §5): route::prepare_row, BlockCursor and the
// built-in mask classification, on hand-built RouteParams.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "bsattn/route/prepare.hpp"

namespace bsattn_test {
namespace {

using bsattn::route::BlockCursor;
using bsattn::route::Route;
using bsattn::route::RouteKind;
using bsattn::route::RouteParams;
using bsattn::route::SetFormat;
using bsattn::route::Visibility;

// One batch entry, one head, batched lengths, every block partial unless a set is bound.
RouteParams geometry(int seqlen_q, int seqlen_kv, int block_q, int block_kv, int tile_m, int tile_n) {
  RouteParams p;
  p.block_q = block_q;
  p.block_kv = block_kv;
  p.tile_m = tile_m;
  p.tile_n = tile_n;
  p.unit_m = std::min(block_q, tile_m);
  p.max_seqlen_q = seqlen_q;
  p.max_seqlen_kv = seqlen_kv;
  p.max_q_tiles = (seqlen_q + tile_m - 1) / tile_m;
  p.max_q_blocks = (seqlen_q + block_q - 1) / block_q;
  p.max_kv_blocks = (seqlen_kv + block_kv - 1) / block_kv;
  p.format = SetFormat::all_blocks;
  p.capacity = 64;
  return p;
}

// Block lists [1, 1, nQB, L] bound as the partial set.
struct Lists {
  std::vector<std::int32_t> counts, indices;
  int width = 0;
  Lists(const std::vector<std::vector<std::int32_t>>& rows, int L) : width(L) {
    for (const auto& r : rows) {
      counts.push_back(static_cast<std::int32_t>(r.size()));
      for (int i = 0; i < L; ++i) indices.push_back(i < static_cast<int>(r.size()) ? r[i] : -1);
    }
  }
  void bind(RouteParams& p, bsattn::route::BlockSetParams& set) const {
    p.format = SetFormat::block_lists;
    set.counts = counts.data();
    set.indices = indices.data();
    const std::int64_t rows = static_cast<std::int64_t>(counts.size());
    set.count_stride[0] = rows;
    set.count_stride[1] = rows;
    set.count_stride[2] = 1;
    set.index_stride[0] = rows * width;
    set.index_stride[1] = rows * width;
    set.index_stride[2] = width;
    set.index_stride[3] = 1;
    set.list_length = width;
  }
};

std::vector<Route> prepare(const RouteParams& p, int row) {
  std::vector<Route> out(p.capacity);
  const int n = bsattn::route::prepare_row(p, row, out.data());
  EXPECT_LE(n, p.capacity);
  out.resize(std::min(n, p.capacity));
  return out;
}

struct Expected {
  int index;
  unsigned rows, masked;
  RouteKind kind = RouteKind::exact;
};

void expect_routes(const std::vector<Route>& got, const std::vector<Expected>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("route " + std::to_string(i));
    EXPECT_EQ(got[i].index, want[i].index);
    EXPECT_EQ(got[i].kind, static_cast<std::uint8_t>(want[i].kind));
    EXPECT_EQ(got[i].rows, want[i].rows);
    EXPECT_EQ(got[i].masked, want[i].masked);
  }
}

// routes_follow_lengths: what the GPU decode kernel makes from the lengths (the first
// prefix_tiles KV tiles, unit 0, masked where the positional mask cuts the tile:
// gpu/fwd/scheduler.cuh route_at) is what prepare_row writes, on random geometries, masks
// (none, causal in both alignments, right windows, sinks) and lengths, empty sequences included.
TEST(RouteTest, RoutesFollowingTheLengthsAreWhatPreparationWrites) {
  std::mt19937_64 rng(2024);
  const auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int trial = 0; trial < 3000; ++trial) {
    const int tile_m = 16 << uni(0, 2), block_q = tile_m << uni(0, 2), tile_n = 64 << uni(0, 1);
    const int block_kv = tile_n << uni(0, 1);
    RouteParams p = geometry(uni(0, tile_m), uni(0, 3000), block_q, block_kv, tile_m, tile_n);
    p.max_seqlen_q = std::max(p.max_seqlen_q, 1);
    p.max_q_tiles = 1;
    p.causal = uni(0, 1) == 1;
    p.top_left = uni(0, 2) == 0;
    p.window_right = uni(0, 2) == 0 ? uni(0, 300) : -1;
    p.sink_tokens = uni(0, 2) == 0 ? uni(0, 200) : 0;
    p.capacity = 64;
    ASSERT_TRUE(bsattn::route::routes_follow_lengths(p));
    const bsattn::route::SeqInfo si = bsattn::route::seq_info(p, 0);
    const std::vector<Route> want = prepare(p, 0);
    const int n = bsattn::route::prefix_tiles(p, si, 0);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": sq " + std::to_string(si.seqlen_q) + " skv " +
                 std::to_string(si.seqlen_kv) + " tile_n " + std::to_string(tile_n) + " causal " +
                 std::to_string(p.causal) + " top_left " + std::to_string(p.top_left) + " window_right " +
                 std::to_string(p.window_right) + " sinks " + std::to_string(p.sink_tokens));
    ASSERT_EQ(n, static_cast<int>(want.size()));
    for (int i = 0; i < n; ++i) {
      const int k0 = i * tile_n;
      const bool masked =
          bsattn::route::classify_builtin(p, si, 0, 0, p.unit_m, k0, k0 + tile_n) == Visibility::partial;
      EXPECT_EQ(want[i].index, i);
      EXPECT_EQ(want[i].rows, 1u);
      EXPECT_EQ(want[i].masked, masked ? 1u : 0u);
    }
  }
  RouteParams p = geometry(16, 300, 64, 64, 16, 64);
  p.window_left = 10;  // two-sided windows leave a row a band, not a prefix
  EXPECT_FALSE(bsattn::route::routes_follow_lengths(p));
  p = geometry(16, 300, 16, 64, 32, 64);  // two units per tile
  EXPECT_FALSE(bsattn::route::routes_follow_lengths(p));
}

TEST(RouteTest, SplitsKvBlockIntoTilesAndStopsAtTheSequenceEnd) {
  // Bk = 64 cut into 16-token tiles; Skv = 70 leaves block 1 with a single live tile.
  const RouteParams p = geometry(64, 70, 64, 64, 64, 16);
  expect_routes(prepare(p, 0), {{0, 1, 0}, {1, 1, 0}, {2, 1, 0}, {3, 1, 0}, {4, 1, 0}});
}

TEST(RouteTest, QBlockLargerThanTheTileIsReadByEveryTile) {
  // Bq = 128 over tile_m = 64: both Q tiles read block row 0's list.
  RouteParams p = geometry(128, 64, 128, 32, 64, 32);
  const Lists lists({{1}}, 2);
  lists.bind(p, p.partial);
  expect_routes(prepare(p, 0), {{1, 1, 0}});
  expect_routes(prepare(p, 1), {{1, 1, 0}});
}

TEST(RouteTest, MergesSmallQBlocksIntoUnitsWithPerUnitRows) {
  // Four 16-row Q blocks share a 64-row tile; each unit keeps its own selection.
  RouteParams p = geometry(64, 96, 16, 32, 64, 32);
  const Lists lists({{0}, {1}, {}, {0, 2}}, 3);
  lists.bind(p, p.partial);
  expect_routes(prepare(p, 0), {{0, 0b1001, 0}, {1, 0b0010, 0}, {2, 0b1000, 0}});
}

TEST(RouteTest, CausalUnitsGetPerUnitMaskedBitsAndEmptyTilesAreSkipped) {
  // Top-left causal on 16 x 16 blocks: unit u sees tile t fully when t < u, partially when t == u.
  RouteParams p = geometry(64, 64, 16, 16, 64, 16);
  p.causal = true;
  p.top_left = true;
  std::vector<Expected> want;
  for (unsigned t = 0; t < 4; ++t) want.push_back({static_cast<int>(t), (0xfu << t) & 0xfu, 1u << t});
  expect_routes(prepare(p, 0), want);
}

TEST(RouteTest, ProvablyEmptyTilesOfASelectedBlockAreNotEmitted) {
  // Causal top-left, q in [0, 64): of KV block 0 (tiles of 64) only tile 0 holds visible pairs.
  RouteParams p = geometry(64, 256, 64, 128, 64, 64);
  p.causal = true;
  p.top_left = true;
  expect_routes(prepare(p, 0), {{0, 1, 1}});
}

TEST(RouteTest, FullSetBlocksAreNeverMasked) {
  RouteParams p = geometry(64, 64, 64, 64, 64, 32);
  p.causal = true;
  p.top_left = true;
  const Lists lists({{0}}, 1);
  lists.bind(p, p.full);
  p.has_partial = false;
  p.has_full = true;
  expect_routes(prepare(p, 0), {{0, 1, 0}, {1, 1, 0}});  // tile 1 lies above the diagonal: the caller vouches
}

TEST(RouteTest, ProxyRoutesFollowExactRoutesAndSkipSelectedBlocks) {
  RouteParams p = geometry(32, 100, 32, 32, 32, 16);
  const Lists lists({{1}}, 1);
  lists.bind(p, p.partial);
  p.proxy_mode = 1;  // no mask: every unselected block is eligible
  expect_routes(prepare(p, 0), {{2, 1, 0}, {3, 1, 0}, {0, 1, 0, RouteKind::proxy}, {2, 1, 0, RouteKind::proxy},
                                {3, 1, 0, RouteKind::proxy}});
}

TEST(RouteTest, ProxyEligibilityNeedsTheWholeQBlockUnderTheMask) {
  // Causal bottom-right, Sq = Skv = 64, 16 x 16 blocks; Q block 2 (rows 32..47) keeps KV blocks 0
  // and 1 whole, block 2 partially (not eligible), block 3 not at all.
  RouteParams p = geometry(64, 64, 16, 16, 16, 16);
  p.causal = true;
  const Lists lists({{}, {}, {}, {}}, 1);
  lists.bind(p, p.partial);
  p.proxy_mode = 1;
  expect_routes(prepare(p, 2), {{0, 1, 0, RouteKind::proxy}, {1, 1, 0, RouteKind::proxy}});
}

TEST(RouteTest, CapacityOverflowReturnsTheNeedAndWritesNothingPastCapacity) {
  RouteParams p = geometry(64, 80, 64, 16, 64, 16);  // 5 tiles
  p.capacity = 2;
  std::vector<Route> out(8);
  const Route sentinel{-42, 7, 7, 7, 7};
  std::fill(out.begin(), out.end(), sentinel);
  EXPECT_EQ(bsattn::route::prepare_row(p, 0, out.data()), 5);
  EXPECT_EQ(out[0].index, 0);
  EXPECT_EQ(out[1].index, 1);
  for (int i = 2; i < 8; ++i) EXPECT_EQ(out[i].index, sentinel.index) << i;
}

TEST(RouteTest, RowPastTheSequenceHasNoRoutes) {
  RouteParams p = geometry(64, 64, 64, 64, 64, 64);
  p.max_q_tiles = 3;  // a launch sized for a longer sequence
  EXPECT_EQ(bsattn::route::prepare_row(p, 2, nullptr), 0);
}

TEST(RouteTest, MalformedListsNeverNameBlocksOutOfRange) {
  // nKB = 3. Malformed lists have no meaning, but whatever is kept must be in range and ascending.
  RouteParams p = geometry(16, 48, 16, 16, 16, 16);
  for (const std::vector<std::int32_t>& row : std::vector<std::vector<std::int32_t>>{
           {-3, 1, 1, 0, 7, 2, 1 << 30}, {2, 1, 0}, {5, 9, -1}, {0, 0, 0}, {1, 2, 3, 4, 5, 6, 7}}) {
    const Lists lists({row}, 7);
    lists.bind(p, p.partial);
    int last = -1;
    for (const Route& r : prepare(p, 0)) {
      EXPECT_GT(r.index, last);
      EXPECT_LT(r.index, 3);
      last = r.index;
    }
  }
  const Lists in_order({{1, 2}}, 2);
  in_order.bind(p, p.partial);
  expect_routes(prepare(p, 0), {{1, 1, 0}, {2, 1, 0}});
  Lists negative({{0}}, 1);
  negative.counts[0] = -5;
  negative.bind(p, p.partial);
  EXPECT_TRUE(prepare(p, 0).empty());
}

TEST(RouteTest, VarlenListCountBeyondTheRowIsClamped) {
  // Two sequences of nKB = 3; row (b=0, qb=0) claims 100 entries. Its own slots are [0, -1, -1];
  // reading on would reach b=1's entry 2.
  RouteParams p = geometry(16, 48, 16, 16, 16, 16);
  p.batch = 2;
  p.format = SetFormat::varlen_block_lists;
  p.varlen_q = p.varlen_kv = true;
  const std::vector<std::int32_t> cu_q{0, 16, 32}, cu_k{0, 48, 96}, cu_m{0, 1, 2}, cu_idx{0, 3, 6};
  p.cu_seqlens_q = cu_q.data();
  p.cu_seqlens_k = cu_k.data();
  p.cu_total_m_blocks = cu_m.data();
  p.cu_block_idx_offsets = cu_idx.data();
  const std::vector<std::int32_t> counts{100, 1}, indices{0, -1, -1, 2, -1, -1};
  p.partial.counts = counts.data();
  p.partial.indices = indices.data();
  p.partial.count_stride[0] = 2;
  p.partial.count_stride[1] = 1;
  p.partial.index_stride[0] = 6;
  p.partial.index_stride[1] = 1;
  expect_routes(prepare(p, 0), {{0, 1, 0}});
  expect_routes(prepare(p, 1), {{2, 1, 0}});
}

TEST(RouteTest, BlockListCountBeyondLIsClamped) {
  // Two Q blocks with L = 1: row qb=0 claims 3 entries; reading on would reach qb=1's entry 2.
  RouteParams p = geometry(32, 48, 16, 16, 16, 16);
  Lists lists({{0}, {2}}, 1);
  lists.counts[0] = 3;
  lists.bind(p, p.partial);
  expect_routes(prepare(p, 0), {{0, 1, 0}});
  expect_routes(prepare(p, 1), {{2, 1, 0}});
}

TEST(RouteTest, BitmaskBitsAtOrBeyondTheSequenceAreIgnored) {
  RouteParams p = geometry(16, 40, 16, 16, 16, 16);  // nKB = 3
  p.format = SetFormat::bitmask;
  const std::vector<std::uint32_t> words{0xfffffff9u, 0xffffffffu};  // bits 0, 3.. and the second word
  p.partial.bits = words.data();
  p.partial.bits_stride[3] = 1;
  expect_routes(prepare(p, 0), {{0, 1, 0}});
}

// classify_builtin against brute force over token_visible: `full` must be exact, `empty` sound,
// and for the positional terms alone (causal, window, sinks) `empty` is exact too.
TEST(RouteTest, ClassificationAgreesWithTheTokenMask) {
  std::mt19937 rng(7);
  const auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<std::int32_t> doc_q(64), doc_kv(64);
  std::vector<std::uint32_t> valid(2);
  for (int trial = 0; trial < 20000; ++trial) {
    RouteParams p = geometry(uniform(1, 64), uniform(1, 64), 16, 16, 16, 16);
    p.causal = uniform(0, 1);
    p.top_left = uniform(0, 1);
    p.window_left = uniform(0, 2) ? -1 : uniform(0, 20);
    p.window_right = uniform(0, 2) ? -1 : uniform(0, 20);
    p.sink_tokens = uniform(0, 2) ? 0 : uniform(1, 10);
    const bool positional_only = uniform(0, 2) != 0;
    if (!positional_only) {
      for (auto& d : doc_q) d = uniform(0, 1);
      for (auto& d : doc_kv) d = uniform(0, 1);
      p.doc_q = doc_q.data();
      p.doc_kv = doc_kv.data();
      for (auto& w : valid) w = uniform(0, 1) ? 0xffffffffu : static_cast<std::uint32_t>(rng());
      p.kv_valid = valid.data();
    }
    const bsattn::route::SeqInfo s = bsattn::route::seq_info(p, 0);
    const int q0 = uniform(0, s.seqlen_q - 1), q1 = uniform(q0 + 1, s.seqlen_q + 8);
    const int k0 = uniform(0, s.seqlen_kv - 1), k1 = uniform(k0 + 1, s.seqlen_kv + 8);
    int visible = 0, in_range = 0;
    for (int q = q0; q < std::min(q1, s.seqlen_q); ++q)
      for (int kv = k0; kv < std::min(k1, s.seqlen_kv); ++kv) {
        ++in_range;
        visible += bsattn::route::token_visible(p, s, 0, q, kv);
      }
    const Visibility v = bsattn::route::classify_builtin(p, s, 0, q0, q1, k0, k1);
    SCOPED_TRACE("trial " + std::to_string(trial));
    EXPECT_EQ(v == Visibility::full, visible == in_range);
    if (v == Visibility::empty) {
      EXPECT_EQ(visible, 0);
    }
    if (positional_only) {
      EXPECT_EQ(v == Visibility::empty, visible == 0);
    }
    if (HasFailure()) break;
  }
}

TEST(RouteTest, CursorWalksEveryFormatInAscendingOrder) {
  RouteParams p = geometry(16, 16 * 40, 16, 16, 16, 16);  // nKB = 40: two bitmask words
  const bsattn::route::SeqInfo s = bsattn::route::seq_info(p, 0);
  const std::vector<int> want{0, 5, 31, 32, 39};
  const auto walk = [&](const bsattn::route::BlockSetParams& set) {
    std::vector<int> got;
    for (BlockCursor c = BlockCursor::open(p, set, s, 0, 0, 0); c.current() != BlockCursor::kEnd; c.advance())
      got.push_back(c.current());
    return got;
  };
  bsattn::route::BlockSetParams set;
  p.format = SetFormat::bitmask;
  const std::vector<std::uint32_t> words{1u | (1u << 5) | (1u << 31), 1u | (1u << 7)};
  set.bits = words.data();
  set.bits_stride[3] = 1;
  EXPECT_EQ(walk(set), want);
  p.format = SetFormat::bsr;
  const std::vector<std::int32_t> indptr{0, 5}, indices{0, 5, 31, 32, 39};
  set = {};
  set.indptr = indptr.data();
  set.indices = indices.data();
  EXPECT_EQ(walk(set), want);
  p.format = SetFormat::all_blocks;
  EXPECT_EQ(walk(set).size(), 40u);
}

// take_word (a whole word at once for all blocks and bitmasks) and skip_to (one advance from the
// block before) against the cursor advanced one block at a time, on random sets with junk list
// entries and bad counts, at random ascending positions, aligned to 32 or not.
TEST(RouteTest, TakeWordAndSkipToMatchOneBlockAtATime) {
  std::mt19937 rng(11);
  const auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int trial = 0; trial < 3000; ++trial) {
    const int nkb = uni(1, 200), words = (nkb + 31) / 32 + 1;
    RouteParams p = geometry(16, 16 * nkb - uni(0, 15), 16, 16, 16, 16);
    const bsattn::route::SeqInfo s = bsattn::route::seq_info(p, 0);
    std::vector<std::int32_t> indptr{0, 0}, indices;
    std::vector<std::uint32_t> bits(words, 0);
    const int density = uni(0, 100);
    for (int b = 0; b < nkb + 40; ++b)
      if (uni(1, 100) <= density) {
        indices.push_back(uni(0, 10) == 0 ? uni(-3, nkb + 3) : b);
        bits[b / 32 % words] |= 1u << (b % 32);
      }
    if (uni(0, 3) == 0) std::shuffle(indices.begin(), indices.end(), rng);
    indptr[1] = uni(0, 5) == 0 ? uni(-2, static_cast<int>(indices.size())) : static_cast<int>(indices.size());
    indices.resize(indices.size() + 1);
    bsattn::route::BlockSetParams set;
    const int format = uni(0, 2);
    p.format = format == 0 ? SetFormat::all_blocks : format == 1 ? SetFormat::bsr : SetFormat::bitmask;
    set.indptr = indptr.data();
    set.indices = indices.data();
    set.bits = bits.data();
    set.bits_stride[3] = 1;
    std::vector<int> walked;  // the blocks of the set, one advance at a time
    for (BlockCursor c = BlockCursor::open(p, set, s, 0, 0, 0); c.current() != BlockCursor::kEnd; c.advance())
      walked.push_back(c.current());
    BlockCursor c = BlockCursor::open(p, set, s, 0, 0, 0);
    std::size_t k = 0;  // the walk's position matching c
    for (int at = 0; at < nkb + 40 && !HasFailure(); at += uni(0, 3) ? uni(1, 32) : 32) {
      SCOPED_TRACE("trial " + std::to_string(trial) + ", block " + std::to_string(at));
      const int op = uni(0, 4);
      if (op == 0) {
        c.skip_to(at);
        while (k < walked.size() && walked[k] < at) ++k;
      } else if (op == 1 && k < walked.size()) {
        c.advance();
        ++k;
      } else {
        std::uint32_t want = 0;
        while (k < walked.size() && walked[k] < at) ++k;
        for (; k < walked.size() && walked[k] < at + 32; ++k) want |= 1u << (walked[k] - at);
        EXPECT_EQ(c.take_word(at), want);
      }
      EXPECT_EQ(c.current(), k < walked.size() ? walked[k] : BlockCursor::kEnd);
    }
  }
}

}  // namespace
}  // namespace bsattn_test
