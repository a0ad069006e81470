// Context parallelism in C++ (include/bsattn/distributed.hpp): ranks as threads of this process
// (LocalGroup), each holding its chunks of a random sequence, against the single-process Plan
// over the whole sequence on the same inputs: every row of O and LSE and every element of the
// backward's dQ, dK, dV, contiguous and zigzag
// shards, 1, 2 and 4 ranks, causal and not, every block or random bitmasks (shared, per batch, per
// KV head, per query head, with empty rows), GQA, batch 1 and 2, f32 and bf16. Then the bytes a
// banded pattern moves against an all-gather, bad shapes, and random values in a rank's pattern
// refused exactly where a single-process call refuses them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "distributed_case.hpp"

namespace {

using namespace distributed_case;

// A rank's pattern (its bitmask rows, RankData::mask) in another batched format, the kept blocks
// split between the partial set and, with `split_full`, the full set by column parity; the
// tensors live in `keep` (a deque: references to its vectors survive its growth).
struct PatternIn {
  bsattn::Format format = bsattn::Format::bitmask;
  bool split_full = false;
};

// Key blocks of the whole sequence (the block lists' width).
std::int64_t key_blocks_of(const Spec& s) {
  const std::int64_t tokens = std::int64_t(s.world) * (s.layout == dist::Layout::zigzag ? 2 : 1) * s.chunk;
  return (tokens + s.bk - 1) / s.bk;
}

dist::Pattern pattern_in(const PatternIn& how, RankData& d, std::deque<std::vector<std::int32_t>>& keep) {
  const std::int64_t Bs = d.mask_shape[0], Hs = d.mask_shape[1], rows = d.mask_shape[2], words = d.mask_shape[3];
  const std::int64_t key_blocks = key_blocks_of(d.spec), all_rows = Bs * Hs * rows;
  d.problem.format = how.format;
  d.problem.has_full = how.split_full;
  dist::Pattern pattern;
  for (const bool full : {false, true}) {
    if (full && !how.split_full) break;
    std::vector<std::vector<std::int32_t>> lists(static_cast<std::size_t>(all_rows));
    for (std::int64_t row = 0; row < all_rows; ++row)
      for (std::int64_t c = 0; c < key_blocks; ++c)
        if ((d.mask[row * words + c / 32] >> (c % 32)) & 1u && (!how.split_full || (c % 2 == 1) == full))
          lists[row].push_back(static_cast<std::int32_t>(c));
    bsattn::BlockSet& set = full ? pattern.full : pattern.partial;
    if (how.format == bsattn::Format::block_lists) {
      std::vector<std::int32_t>& counts = keep.emplace_back();
      std::vector<std::int32_t>& indices = keep.emplace_back(static_cast<std::size_t>(all_rows * key_blocks), -7);
      for (std::int64_t row = 0; row < all_rows; ++row) {
        counts.push_back(static_cast<std::int32_t>(lists[row].size()));
        std::copy(lists[row].begin(), lists[row].end(), indices.begin() + row * key_blocks);
      }
      set.counts = TensorView::contiguous(counts.data(), DType::i32, {Bs, Hs, rows});
      set.indices = TensorView::contiguous(indices.data(), DType::i32, {Bs, Hs, rows, key_blocks});
    } else if (how.format == bsattn::Format::bsr) {
      std::vector<std::int32_t>& indptr = keep.emplace_back(1, 0);
      std::vector<std::int32_t>& indices = keep.emplace_back();
      for (const auto& list : lists) {
        indices.insert(indices.end(), list.begin(), list.end());
        indptr.push_back(static_cast<std::int32_t>(indices.size()));
      }
      set.indptr = TensorView::contiguous(indptr.data(), DType::i32, {all_rows + 1});
      set.indices = TensorView::contiguous(indices.data(), DType::i32, {std::int64_t(indices.size())});
    } else {
      std::vector<std::int32_t>& bits = keep.emplace_back(static_cast<std::size_t>(all_rows * words), 0);
      for (std::int64_t row = 0; row < all_rows; ++row)
        for (const std::int32_t c : lists[row]) bits[row * words + c / 32] |= static_cast<std::int32_t>(1u << (c % 32));
      set.bits = TensorView::contiguous(bits.data(), DType::u32, {Bs, Hs, rows, words});
    }
  }
  return pattern;
}

// A rank's forward and backward on the CPU engine with host tensors: O in f32, then the backward
// on it with dQ in the inputs' dtype (rounded once for bf16 cases), dK and dV in f32. With
// `plan`, through it (made for this rank's problem and sharding with backward set); the pattern
// in the format `how` says.
RankResult run_on_host(dist::Transport& transport, RankData d, dist::ShardedPlan* plan = nullptr,
                       const PatternIn& how = {}) {
  const Spec& s = d.spec;
  const std::int64_t local = d.local;
  RankResult r;
  r.out.assign(std::size_t(s.batch) * local * s.hq * s.d, NAN);
  r.lse.assign(std::size_t(s.batch) * s.hq * local, NAN);
  const TensorView q = TensorView::contiguous(d.q.ptr(s.dtype), s.dtype, {s.batch, local, s.hq, s.d});
  const TensorView k = TensorView::contiguous(d.k.ptr(s.dtype), s.dtype, {s.batch, local, s.hkv, s.d});
  const TensorView v = TensorView::contiguous(d.v.ptr(s.dtype), s.dtype, {s.batch, local, s.hkv, s.d});
  std::deque<std::vector<std::int32_t>> pattern_tensors;  // references stay valid as it grows
  const dist::Pattern mask = s.sparse ? pattern_in(how, d, pattern_tensors) : dist::Pattern{};
  // O in the problem's out_dtype: f32, or bf16 (poisoned, read back as floats).
  const bool out_half = d.problem.out_dtype == DType::bf16;
  std::vector<std::uint16_t> out_bf16(out_half ? r.out.size() : 0, 0xffffu);
  const TensorView out =
      TensorView::contiguous(out_half ? static_cast<void*>(out_bf16.data()) : r.out.data(), d.problem.out_dtype,
                             {s.batch, local, s.hq, s.d});
  const TensorView lse = TensorView::contiguous(r.lse.data(), DType::f32, {s.batch, s.hq, local});
  r.stats = plan ? plan->run(transport, q, k, v, mask, out, lse)
                 : dist::attention(transport, d.problem, d.sharding, q, k, v, mask, out, lse);
  for (std::size_t i = 0; i < out_bf16.size(); ++i) r.out[i] = bsattn::cpu::bf16_to_float(out_bf16[i]);
  r.dq.assign(r.out.size(), NAN);
  r.dk.assign(std::size_t(s.batch) * local * s.hkv * s.d, NAN);
  r.dv.assign(r.dk.size(), NAN);
  std::vector<std::uint16_t> dq_half(r.dq.size(), 0xffffu);
  const bool dq_half_wanted = s.dtype == DType::bf16;
  const TensorView dout =
      TensorView::contiguous(d.dout.ptr(d.problem.out_dtype), d.problem.out_dtype, {s.batch, local, s.hq, s.d});
  const TensorView dq = TensorView::contiguous(dq_half_wanted ? static_cast<void*>(dq_half.data()) : r.dq.data(),
                                               s.dtype, {s.batch, local, s.hq, s.d});
  const TensorView dk = TensorView::contiguous(r.dk.data(), DType::f32, {s.batch, local, s.hkv, s.d});
  const TensorView dv = TensorView::contiguous(r.dv.data(), DType::f32, {s.batch, local, s.hkv, s.d});
  r.stats_backward = plan ? plan->run_backward(transport, q, k, v, mask, out, lse, dout, dq, dk, dv)
                          : dist::attention_backward(transport, d.problem, d.sharding, q, k, v, mask, out, lse, dout,
                                                     dq, dk, dv);
  if (dq_half_wanted)
    for (std::size_t i = 0; i < r.dq.size(); ++i) r.dq[i] = bsattn::cpu::bf16_to_float(dq_half[i]);
  return r;
}

Result sharded_on_host(const Sequence& seq, int world) {
  dist::LocalGroup group(world);
  return seq.sharded([&](const RankData& d) {
    auto transport = group.transport(d.rank);
    return run_on_host(*transport, d);
  });
}

TEST(Distributed, ShardedEqualsSingleProcess) {
  std::uint64_t seed = 100;
  int cases = 0, with_empty_rows = 0;
  for (const int world : {1, 2, 4})
    for (const auto layout : {dist::Layout::contiguous, dist::Layout::zigzag})
      for (const bool causal : {false, true})
        for (int pattern = 0; pattern < 4; ++pattern) {  // every block; shared; per batch and KV head; per query head
          Spec s = grid_case(world, layout, causal, pattern, seed);
          s.dtype = seed++ % 3 == 0 ? DType::bf16 : DType::f32;
          const Sequence seq(s);
          const std::string what = describe(s);
          const Result want = seq.reference(), got = sharded_on_host(seq, s.world);
          expect_same(got, want, 2e-5f, what);
          expect_same_gradients(got, want, 1e-4f, s.dtype == DType::bf16 ? 8e-3f : 0.0f, what + " backward");
          ++cases;
          with_empty_rows +=
              s.sparse && std::any_of(want.lse.begin(), want.lse.end(), [](float x) { return std::isinf(x); });
        }
  EXPECT_EQ(cases, 48);
  EXPECT_GT(with_empty_rows, 0) << "no case had an empty row";
}

// O in the inputs' dtype (bf16), as a GPU rank writes it: the fp32 parts are merged, then rounded
// once; the backward reads that O.
TEST(Distributed, OutputInTheInputsDtype) {
  std::uint64_t seed = 700;
  for (const int world : {1, 2, 4})
    for (const bool causal : {false, true}) {
      Spec s = grid_case(world, world == 2 ? dist::Layout::zigzag : dist::Layout::contiguous, causal, 3, seed++);
      s.dtype = DType::bf16;
      const Sequence seq(s);
      dist::LocalGroup group(world);
      const Result got = seq.sharded([&](RankData d) {
        d.problem.out_dtype = DType::bf16;
        return run_on_host(*group.transport(d.rank), d);
      });
      const Result want = seq.reference();
      expect_same(got, want, 1e-4f, describe(s) + ", O in bf16", 1.0f / 256);  // rounded once: half a bf16 ulp
      expect_same_gradients(got, want, 2e-2f, 8e-3f, describe(s) + ", O in bf16, backward");
    }
}

// A causal band of one chunk (each query chunk keeps its own and the previous key chunk) on 4
// ranks: a rank receives only the previous chunk (rank 0 nothing), a quarter of what an
// all-gather would bring (3 chunks per rank), and attends its own chunk before it waits for it.
TEST(Distributed, BandedPatternMovesOnlyItsChunks) {
  Spec s;
  s.world = 4;
  s.band = true;
  s.causal = true;
  const Sequence seq(s);
  const Result got = sharded_on_host(seq, s.world), want = seq.reference();
  expect_same(got, want, 2e-5f, "band");
  expect_band_stats(got);
}

// Packed documents (batch 1, five documents with random boundaries, some empty, some spanning
// chunks) against the single-process call with their document ids, which is the varlen call.
TEST(Distributed, PackedDocumentsEqualTheVarlenCall) {
  std::uint64_t seed = 300;
  for (const int world : {2, 4})
    for (const auto layout : {dist::Layout::contiguous, dist::Layout::zigzag})
      for (const bool causal : {false, true})
        for (const int pattern : {0, 1}) {
          Spec s = grid_case(world, layout, causal, pattern, seed);
          s.batch = s.sparsity_batch = 1;
          s.documents = 5;
          s.dtype = seed++ % 2 ? DType::bf16 : DType::f32;
          const Sequence seq(s);
          const Result want = seq.reference(), got = sharded_on_host(seq, s.world);
          expect_same(got, want, 2e-5f, describe(s) + ", documents");
          expect_same_gradients(got, want, 1e-4f, s.dtype == DType::bf16 ? 8e-3f : 0.0f,
                                describe(s) + ", documents backward");
        }
}

// A document per chunk: no query chunk shares a document with another rank's key chunk, so
// nothing travels and each query chunk attends only its own chunk.
TEST(Distributed, DocumentsWithinChunksMoveNothing) {
  for (const auto layout : {dist::Layout::contiguous, dist::Layout::zigzag}) {
    Spec s = grid_case(4, layout, false, 0, 11);
    s.batch = 1;
    s.chunk_documents = true;
    const Sequence seq(s);
    const Result got = sharded_on_host(seq, s.world), want = seq.reference();
    expect_same(got, want, 2e-5f, describe(s) + ", a document per chunk");
    for (int rank = 0; rank < s.world; ++rank) {
      EXPECT_EQ(got.stats[rank].chunks_received, 0) << describe(s) << ", rank " << rank;
      EXPECT_EQ(got.stats[rank].pairs_attended, layout == dist::Layout::zigzag ? 2 : 1)
          << describe(s) << ", rank " << rank;
    }
  }
}

// A ShardedPlan per rank serves calls on new inputs and new patterns of the same geometry, each
// equal to the single-process call; it refuses a transport of another size, and a backward when
// it was made without local.backward.
TEST(Distributed, ShardedPlanServesRepeatedCalls) {
  Spec s = grid_case(2, dist::Layout::zigzag, true, 3, 400);
  std::vector<dist::ShardedPlan> plans = plans_for(s, [](bsattn::Problem&) {});
  for (int call = 0; call < 3; ++call) {
    s.seed = 400 + call;  // new Q, K, V and pattern
    const Sequence seq(s);
    dist::LocalGroup group(s.world);
    const Result got = seq.sharded([&](const RankData& d) {
      auto transport = group.transport(d.rank);
      return run_on_host(*transport, d, &plans[d.rank]);
    });
    const Result want = seq.reference();
    expect_same(got, want, 2e-5f, "call " + std::to_string(call));
    expect_same_gradients(got, want, 1e-4f, 0.0f, "call " + std::to_string(call) + " backward");
  }
  bsattn::Problem forward_only = Sequence(s).problem(2 * s.chunk);
  dist::ShardedPlan plan(forward_only, dist::Sharding{dist::Layout::zigzag, true, {}}, 1);
  dist::LocalGroup one(1);
  auto solo = one.transport(0);
  std::vector<float> x(std::size_t(2 * s.chunk) * s.hq * s.d), y(std::size_t(2 * s.chunk) * s.hkv * s.d),
      l(2 * s.chunk * s.hq);
  const auto q = TensorView::contiguous(x.data(), DType::f32, {1, 2 * s.chunk, s.hq, s.d});
  const auto kv = TensorView::contiguous(y.data(), DType::f32, {1, 2 * s.chunk, s.hkv, s.d});
  const auto lse = TensorView::contiguous(l.data(), DType::f32, {1, s.hq, 2 * s.chunk});
  std::vector<std::uint32_t> bits(std::size_t(s.hq) * (2 * s.chunk / s.bq) * 1, ~0u);
  dist::Pattern mask;
  mask.partial.bits = TensorView::contiguous(bits.data(), DType::u32, {1, s.hq, 2 * s.chunk / s.bq, 1});
  try {
    plan.run_backward(*solo, q, kv, kv, mask, q, lse, q, q, kv, kv);
    ADD_FAILURE() << "a backward without its plans was accepted";
  } catch (const bsattn::Error& e) {
    EXPECT_EQ(e.argument(), "problem.backward") << e.what();
  }
  dist::LocalGroup three(3);
  auto transport = three.transport(0);
  try {
    plans[0].run(*transport, q, kv, kv, mask, q, lse);
    ADD_FAILURE() << "a transport of 3 ranks was accepted by a plan for 2";
  } catch (const bsattn::Error& e) {
    EXPECT_EQ(e.argument(), "transport") << e.what();
  }
}

// The pattern in block lists and BSR, and split between partial and full sets (bitmask and
// lists), gives the bitmask's result; bad list values are refused by name before anything moves.
TEST(Distributed, PatternsInEveryBatchedFormat) {
  std::uint64_t seed = 600;
  const PatternIn formats[] = {{bsattn::Format::block_lists, false}, {bsattn::Format::bsr, false},
                               {bsattn::Format::bitmask, true}, {bsattn::Format::block_lists, true}};
  for (const PatternIn& how : formats)
    for (const int pattern : {1, 2, 3}) {
      const Spec s = grid_case(2, dist::Layout::zigzag, false, pattern, seed++);
      const Sequence seq(s);
      dist::LocalGroup group(s.world);
      const Result got = seq.sharded([&](const RankData& d) {
        auto transport = group.transport(d.rank);
        return run_on_host(*transport, d, nullptr, how);
      });
      const std::string what =
          describe(s) + ", format " + std::to_string(int(how.format)) + (how.split_full ? " split" : "");
      const Result want = seq.reference();
      expect_same(got, want, 2e-5f, what);
      expect_same_gradients(got, want, 1e-4f, 0.0f, what + " backward");
    }
  // A list entry past the global key blocks, and a count past the lists' width.
  const Spec s = grid_case(1, dist::Layout::contiguous, false, 1, 2);  // batch 1
  const Sequence seq(s);
  for (const int bad : {0, 1}) {
    seq.sharded([&](const RankData& rank) {
      RankData d = rank;
      dist::LocalGroup group(1);
      auto transport = group.transport(0);
      std::deque<std::vector<std::int32_t>> keep;
      dist::Pattern pattern = pattern_in({bsattn::Format::block_lists, false}, d, keep);
      keep[0][1] = bad ? 1000 : 1;  // counts
      keep[1][static_cast<std::size_t>(key_blocks_of(s))] = bad ? 0 : 99;  // row 1's first index
      std::vector<float> out(std::size_t(d.local) * s.hq * s.d, 7.0f);
      try {
        dist::attention(*transport, d.problem, d.sharding,
                        TensorView::contiguous(d.q.values.data(), DType::f32, {1, d.local, s.hq, s.d}),
                        TensorView::contiguous(d.k.values.data(), DType::f32, {1, d.local, s.hkv, s.d}),
                        TensorView::contiguous(d.v.values.data(), DType::f32, {1, d.local, s.hkv, s.d}), pattern,
                        TensorView::contiguous(out.data(), DType::f32, {1, d.local, s.hq, s.d}), TensorView{});
        ADD_FAILURE() << (bad ? "a count past the width" : "an index past the key blocks") << " was accepted";
      } catch (const bsattn::Error& e) {
        EXPECT_EQ(e.argument(), bad ? "pattern.partial.counts" : "pattern.partial.indices") << e.what();
      }
      EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; }));
      return RankResult{std::vector<float>(out.size()), std::vector<float>(std::size_t(d.local) * s.hq),
                        std::vector<float>(out.size()), std::vector<float>(std::size_t(d.local) * s.hkv * s.d),
                        std::vector<float>(std::size_t(d.local) * s.hkv * s.d), {}, {}};
    });
  }
}

// Random values in a rank's pattern (one or two elements, as validation_fuzz_test mutates, on one
// rank, whose pattern is the single-process call's): the sharded call refuses exactly what
// bsattn::attention refuses, naming pattern.<the same argument> (one wrong value), and writes
// nothing; otherwise it gives the same O and LSE.
TEST(Distributed, MutatedPatternsAreRefusedAsTheSingleProcessCall) {
  std::mt19937_64 rng(77);
  const PatternIn formats[] = {{bsattn::Format::block_lists, false}, {bsattn::Format::block_lists, true},
                               {bsattn::Format::bsr, false}, {bsattn::Format::bsr, true},
                               {bsattn::Format::bitmask, true}};
  int refused = 0, cases = 0;
  for (int i = 0; i < 250; ++i) {
    Spec s = grid_case(1, dist::Layout::contiguous, false, 1 + i % 3, 900 + i);
    s.chunk = 64;  // 4 key blocks
    const Sequence seq(s);
    seq.sharded([&](const RankData& rank) {
      RankData d = rank;
      std::deque<std::vector<std::int32_t>> keep;
      const dist::Pattern pattern = pattern_in(formats[i % 5], d, keep);
      std::string what;
      const int mutations = 1 + static_cast<int>(rng() % 2);
      for (int m = mutations; m > 0; --m) {
        std::vector<std::int32_t>& t = keep[rng() % keep.size()];
        if (t.empty()) continue;
        std::int32_t& x = t[rng() % t.size()];
        const std::int32_t old = x;
        switch (rng() % 5) {
          case 0: x = static_cast<std::int32_t>(static_cast<std::uint32_t>(old) + (rng() % 2 ? 1u : ~0u)); break;
          case 1: x = static_cast<std::int32_t>(rng() % 3) - 1; break;
          case 2: x = static_cast<std::int32_t>(rng() % 2 ? 0x7fffffffu : 0x80000000u); break;
          case 3: x = static_cast<std::int32_t>(static_cast<std::uint32_t>(old) ^ (1u << (rng() % 32))); break;
          default: x = static_cast<std::int32_t>(rng() % 40) - 4; break;
        }
        what += std::to_string(old) + " -> " + std::to_string(x) + "; ";
      }
      SCOPED_TRACE("case " + std::to_string(i) + ", format " + std::to_string(int(d.problem.format)) + ": " + what);
      const std::int64_t n = std::int64_t(s.batch) * d.local;
      const auto view = [&](std::vector<float>& data, int heads) {
        return TensorView::contiguous(data.data(), DType::f32, {s.batch, d.local, heads, s.d});
      };
      std::vector<float> q = d.q.values, k = d.k.values, v = d.v.values;
      std::vector<float> out(std::size_t(n) * s.hq * s.d, 7.0f), lse(std::size_t(n) * s.hq, 7.0f);
      std::vector<float> want_out(out.size()), want_lse(lse.size());
      std::string single_refusal, sharded_refusal;
      bsattn::Inputs in;
      in.q = view(q, s.hq);
      in.k = view(k, s.hkv);
      in.v = view(v, s.hkv);
      in.partial = pattern.partial;
      in.full = pattern.full;
      bsattn::Outputs o;
      o.out = view(want_out, s.hq);
      o.lse = TensorView::contiguous(want_lse.data(), DType::f32, {s.batch, s.hq, d.local});
      try {
        bsattn::attention(d.problem, in, o);
      } catch (const bsattn::Error& e) {
        single_refusal = e.argument();
        what += std::string("single: ") + e.what();
      }
      dist::LocalGroup group(1);
      auto transport = group.transport(0);
      try {
        dist::attention(*transport, d.problem, d.sharding, in.q, in.k, in.v, pattern, view(out, s.hq),
                        TensorView::contiguous(lse.data(), DType::f32, {s.batch, s.hq, d.local}));
      } catch (const bsattn::Error& e) {
        sharded_refusal = e.argument();
        what += std::string(" sharded: ") + e.what();
      }
      ++cases;
      SCOPED_TRACE(what);
      if (!single_refusal.empty()) {
        ++refused;
        // With two wrong values the calls may check them in another order.
        if (mutations == 1) {
          EXPECT_EQ(sharded_refusal, "pattern." + single_refusal);
        } else {
          EXPECT_EQ(sharded_refusal.rfind("pattern.", 0), 0u) << "accepted, or refused naming " << sharded_refusal;
        }
        EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; })) << "O written";
        EXPECT_TRUE(std::all_of(lse.begin(), lse.end(), [](float x) { return x == 7.0f; })) << "LSE written";
      } else {
        EXPECT_EQ(sharded_refusal, "") << "refused what the single-process call accepts";
        for (std::size_t j = 0; sharded_refusal.empty() && j < lse.size(); ++j)
          if (!(std::abs(lse[j] - want_lse[j]) <= 2e-5f * (1 + std::abs(want_lse[j])) || lse[j] == want_lse[j])) {
            ADD_FAILURE() << "LSE[" << j << "] " << lse[j] << " against " << want_lse[j];
            break;
          }
        for (std::size_t j = 0; sharded_refusal.empty() && j < out.size(); ++j)
          if (!(std::abs(out[j] - want_out[j]) <= 2e-5f * (1 + std::abs(want_out[j])))) {
            ADD_FAILURE() << "O[" << j << "] " << out[j] << " against " << want_out[j];
            break;
          }
      }
      const std::size_t kv = std::size_t(n) * s.hkv * s.d;
      return RankResult{out, lse, std::vector<float>(out.size()), std::vector<float>(kv), std::vector<float>(kv), {}, {}};
    });
    if (HasFailure()) return;
  }
  EXPECT_GT(refused, 0);
  EXPECT_LT(refused, cases);
  RecordProperty("refused", refused);
}

TEST(Distributed, BadShardsNameTheArgument) {
  dist::LocalGroup group(1);
  auto t = group.transport(0);
  std::vector<float> x(std::size_t(1) * 48 * 4 * 32), y(std::size_t(1) * 48 * 2 * 32), o(x.size()), l(48 * 4);
  bsattn::Problem p;
  p.heads_q = 4;
  p.heads_kv = 2;
  p.head_dim = 32;
  p.max_seqlen_q = p.max_seqlen_kv = 48;
  p.dtype = p.out_dtype = DType::f32;
  p.block = {32, 32};  // 48 tokens are not whole blocks of 32
  p.format = bsattn::Format::all_blocks;
  const auto q = TensorView::contiguous(x.data(), DType::f32, {1, 48, 4, 32});
  const auto kv = TensorView::contiguous(y.data(), DType::f32, {1, 48, 2, 32});
  const auto out = TensorView::contiguous(o.data(), DType::f32, {1, 48, 4, 32});
  const auto lse = TensorView::contiguous(l.data(), DType::f32, {1, 4, 48});
  try {
    dist::attention(*t, p, {}, q, kv, kv, {}, out, lse);
    ADD_FAILURE() << "48 tokens in blocks of 32 were accepted";
  } catch (const bsattn::Error& e) {
    EXPECT_EQ(e.argument(), "problem.block");
  }
  p.block = {16, 16};
  try {
    dist::attention(*t, p, {}, q, kv, kv, {}, TensorView::contiguous(o.data(), DType::f32, {1, 48, 4, 16}), lse);
    ADD_FAILURE() << "a wrong out shape was accepted";
  } catch (const bsattn::Error& e) {
    EXPECT_EQ(e.argument(), "out");
  }
  // A problem the engine refuses (3 query heads over 2 KV heads) throws from its plan, before the
  // ranks exchange anything.
  {
    bsattn::Problem bad = p;
    bad.heads_q = 3;
    std::vector<float> x3(std::size_t(48) * 3 * 32), o3(x3.size()), l3(3 * 48);
    try {
      dist::attention(*t, bad, {}, TensorView::contiguous(x3.data(), DType::f32, {1, 48, 3, 32}), kv, kv, {},
                      TensorView::contiguous(o3.data(), DType::f32, {1, 48, 3, 32}),
                      TensorView::contiguous(l3.data(), DType::f32, {1, 3, 48}));
      ADD_FAILURE() << "3 query heads over 2 KV heads were accepted";
    } catch (const bsattn::Error& e) {
      EXPECT_EQ(e.argument().rfind("problem.", 0), 0u) << e.what();
    }
  }
  // The backward: LSE is required, the gradients are f32 or the inputs' dtype, in their shapes;
  // nothing is written before the error.
  {
    std::vector<float> dq(x.size(), 7.0f), dkv(y.size(), 7.0f);
    std::vector<std::uint16_t> dq16(x.size());
    const auto dq_view = TensorView::contiguous(dq.data(), DType::f32, {1, 48, 4, 32});
    const auto dkv_view = TensorView::contiguous(dkv.data(), DType::f32, {1, 48, 2, 32});
    const auto expect_refused = [&](const TensorView& l, const TensorView& gq, const TensorView& gk, const char* arg) {
      try {
        dist::attention_backward(*t, p, {}, q, kv, kv, {}, out, l, out, gq, gk, dkv_view);
        ADD_FAILURE() << arg << ": accepted";
      } catch (const bsattn::Error& e) {
        EXPECT_EQ(e.argument(), arg) << e.what();
      }
      EXPECT_TRUE(std::all_of(dq.begin(), dq.end(), [](float g) { return g == 7.0f; })) << arg;
    };
    expect_refused(TensorView{}, dq_view, dkv_view, "lse");
    expect_refused(lse, TensorView::contiguous(dq16.data(), DType::f16, {1, 48, 4, 32}), dkv_view, "dq");
    expect_refused(lse, dq_view, TensorView::contiguous(dkv.data(), DType::f32, {1, 48, 4, 16}), "dk");
  }
  p.max_seqlen_q = p.max_seqlen_kv = 47;
  dist::Sharding zigzag;
  zigzag.layout = dist::Layout::zigzag;
  try {
    dist::attention(*t, p, zigzag, q, kv, kv, {}, out, lse);
    ADD_FAILURE() << "47 tokens in two zigzag chunks were accepted";
  } catch (const bsattn::Error& e) {
    EXPECT_EQ(e.argument(), "problem.max_seqlen_q");
  }
  // Packed documents: offsets must run from 0 to the sequence's tokens, non-decreasing.
  p.max_seqlen_q = p.max_seqlen_kv = 48;
  p.block = {16, 16};
  for (const std::vector<std::int64_t>& offsets :
       std::vector<std::vector<std::int64_t>>{{0, 40}, {0, 30, 20, 48}, {1, 48}}) {
    dist::Sharding documents;
    documents.cu_seqlens = offsets;
    try {
      dist::attention(*t, p, documents, q, kv, kv, {}, out, lse);
      ADD_FAILURE() << "offsets " << offsets[1] << " accepted";
    } catch (const bsattn::Error& e) {
      EXPECT_EQ(e.argument(), "sharding.cu_seqlens") << e.what();
    }
  }
}

}  // namespace
