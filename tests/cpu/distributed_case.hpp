// Context-parallel test cases (include/bsattn/distributed.hpp), shared by the CPU test
// (tests/cpu/distributed_test.cpp) and the GPU one (tests/gpu/gpu_distributed_test.cpp): a random
// sequence cut into chunks, its single-process result on the CPU engine (the reference), and the
// sharded run with each rank a thread whose call the test supplies.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bsattn/bsattn.hpp"
#include "bsattn/cpu/numeric.hpp"

namespace distributed_case {

using bsattn::DType;
using bsattn::TensorView;
namespace dist = bsattn::distributed;

struct Spec {
  int world = 2;
  dist::Layout layout = dist::Layout::contiguous;
  bool causal = false;
  bool sparse = true;
  int batch = 1, sparsity_batch = 1, sparsity_heads = 1;
  int hq = 4, hkv = 2, d = 32, bq = 16, bk = 16;
  int chunk = 32;  // tokens per chunk
  DType dtype = DType::f32;
  double density = 0.4;
  bool band = false;  // keep only blocks within one chunk of the diagonal (instead of random)
  // Packed documents (batch 1): this many with random boundaries (some empty, some spanning
  // chunks), or with chunk_documents one per chunk. 0: none.
  int documents = 0;
  bool chunk_documents = false;
  std::uint64_t seed = 1;
};

// The case grid of the sharded-against-single-process tests: `pattern` 0 attends every block, 1 a
// random bitmask shared by all, 2 one per batch and KV head, 3 one per query head; batch 1 or 2.
inline Spec grid_case(int world, dist::Layout layout, bool causal, int pattern, std::uint64_t seed) {
  Spec s;
  s.world = world;
  s.layout = layout;
  s.causal = causal;
  s.sparse = pattern > 0;
  s.batch = 1 + seed % 2;
  s.sparsity_batch = pattern == 2 ? s.batch : 1;
  s.sparsity_heads = pattern == 2 ? s.hkv : pattern == 3 ? s.hq : 1;
  s.seed = seed;
  return s;
}

inline std::string describe(const Spec& s) {
  const std::string pattern = !s.sparse                  ? "every block"
                              : s.sparsity_heads == 1      ? "shared bitmask"
                              : s.sparsity_heads == s.hkv  ? "bitmask per batch and KV head"
                                                           : "bitmask per query head";
  return "world " + std::to_string(s.world) + (s.layout == dist::Layout::zigzag ? " zigzag" : " contiguous") +
         (s.causal ? " causal " : " ") + pattern + ", batch " + std::to_string(s.batch) + ", blocks " +
         std::to_string(s.bq) + "x" + std::to_string(s.bk) + ", " + bsattn::to_string(s.dtype);
}

inline float round_to(float x, DType t) {
  if (t != DType::bf16) return x;
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

// Elements of dtype t from floats (f32 or bf16 bit patterns).
inline std::vector<std::uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<std::uint16_t> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::uint32_t u;
    std::memcpy(&u, &x[i], 4);
    out[i] = static_cast<std::uint16_t>(u >> 16);
  }
  return out;
}

struct Data {
  std::vector<float> values;
  std::vector<std::uint16_t> half;
  void* ptr(DType t) { return t == DType::bf16 ? static_cast<void*>(half.data()) : values.data(); }
};

struct Result {
  std::vector<float> out, lse;  // f32 results, [B, S, Hq, D] and [B, Hq, S] (global token order)
  std::vector<float> dq, dk, dv;  // backward: [B, S, H, D] (global token order)
  std::vector<dist::Stats> stats, stats_backward;
};

// One rank's inputs, in its local token order: Q, K, V, dO, its block mask rows (words of shape
// mask_shape) and its single-process problem (out_dtype f32) and sharding.
struct RankData {
  Spec spec;
  int rank = 0;
  std::int64_t local = 0;  // tokens
  Data q, k, v, dout;
  std::vector<std::uint32_t> mask;
  std::vector<std::int64_t> mask_shape;
  bsattn::Problem problem;
  bsattn::distributed::Sharding sharding;
};

// What a rank's calls gave, as floats in its local token order.
struct RankResult {
  std::vector<float> out, lse, dq, dk, dv;
  bsattn::distributed::Stats stats, stats_backward;
};

class Sequence {
 public:
  explicit Sequence(const Spec& s) : s_(s) {
    per_rank_ = s.layout == dist::Layout::zigzag ? 2 : 1;
    chunks_ = s.world * per_rank_;
    S_ = chunks_ * s.chunk;
    std::mt19937_64 rng(s.seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const auto fill = [&](Data& t, std::int64_t n) {
      t.values.resize(n);
      for (auto& x : t.values) x = round_to(normal(rng), s.dtype);
      t.half = to_bf16(t.values);
    };
    fill(q_, std::int64_t(s.batch) * S_ * s.hq * s.d);
    fill(k_, std::int64_t(s.batch) * S_ * s.hkv * s.d);
    fill(v_, std::int64_t(s.batch) * S_ * s.hkv * s.d);
    fill(dout_, std::int64_t(s.batch) * S_ * s.hq * s.d);
    qb_ = S_ / s.bq;
    kb_ = S_ / s.bk;
    words_ = (kb_ + 31) / 32;
    if (s.chunk_documents)
      for (int c = 0; c <= chunks_; ++c) cu_seqlens_.push_back(std::int64_t(c) * s.chunk);
    else if (s.documents > 0) {
      std::uniform_int_distribution<std::int64_t> cut(0, S_);
      cu_seqlens_ = {0, S_};
      for (int i = 1; i < s.documents; ++i) cu_seqlens_.push_back(cut(rng));
      std::sort(cu_seqlens_.begin(), cu_seqlens_.end());
    }
    for (std::size_t d = 0; d + 1 < cu_seqlens_.size(); ++d)
      doc_ids_.insert(doc_ids_.end(), cu_seqlens_[d + 1] - cu_seqlens_[d], static_cast<std::int32_t>(d));
    keep_.assign(std::size_t(s.sparsity_batch) * s.sparsity_heads * qb_ * kb_, 0);
    std::bernoulli_distribution coin(s.density);
    for (int bs = 0; bs < s.sparsity_batch; ++bs)
      for (int hs = 0; hs < s.sparsity_heads; ++hs)
        for (int r = 0; r < qb_; ++r) {
          const bool empty_row = !s.band && r % 7 == 3;  // rows that keep no block
          for (int c = 0; c < kb_; ++c) {
            const int qchunk = r * s.bq / s.chunk, kchunk = c * s.bk / s.chunk;
            const bool kept = s.band ? std::abs(qchunk - kchunk) <= 1 : coin(rng);
            keep_[((std::size_t(bs) * s.sparsity_heads + hs) * qb_ + r) * kb_ + c] = kept && !empty_row;
          }
        }
  }

  bsattn::Problem problem(std::int64_t tokens) const {
    bsattn::Problem p;
    p.batch = s_.batch;
    p.heads_q = s_.hq;
    p.heads_kv = s_.hkv;
    p.head_dim = s_.d;
    p.max_seqlen_q = p.max_seqlen_kv = static_cast<int>(tokens);
    p.dtype = s_.dtype;
    p.out_dtype = DType::f32;
    p.block = {s_.bq, s_.bk};
    p.format = s_.sparse ? bsattn::Format::bitmask : bsattn::Format::all_blocks;
    p.sparsity_batch = s_.sparsity_batch;
    p.sparsity_heads = s_.sparsity_heads;
    p.num_threads = 1;
    return p;
  }

  // Global token of a rank's local token.
  std::int64_t global_token(int rank, std::int64_t t) const {
    const int i = static_cast<int>(t / s_.chunk);
    const int chunk = i == 0 ? rank : chunks_ - 1 - rank;
    return std::int64_t(chunk) * s_.chunk + t % s_.chunk;
  }

  // Bitmask words of the given query block rows (global order), [Bs, Hs, rows, words].
  std::vector<std::uint32_t> bits(const std::vector<int>& rows) const {
    std::vector<std::uint32_t> w(std::size_t(s_.sparsity_batch) * s_.sparsity_heads * rows.size() * words_, 0u);
    for (int bs = 0; bs < s_.sparsity_batch; ++bs)
      for (int hs = 0; hs < s_.sparsity_heads; ++hs)
        for (std::size_t i = 0; i < rows.size(); ++i)
          for (int c = 0; c < kb_; ++c)
            if (keep_[((std::size_t(bs) * s_.sparsity_heads + hs) * qb_ + rows[i]) * kb_ + c])
              w[((std::size_t(bs) * s_.sparsity_heads + hs) * rows.size() + i) * words_ + c / 32] |= 1u << (c % 32);
    return w;
  }

  // The single-process call over the whole sequence.
  Result reference() const {
    Result r;
    r.out.assign(std::size_t(s_.batch) * S_ * s_.hq * s_.d, NAN);
    r.lse.assign(std::size_t(s_.batch) * s_.hq * S_, NAN);
    bsattn::Problem p = problem(S_);
    p.num_threads = 0;  // every core: the ranks' calls run one thread each, concurrently
    p.mask.causal = s_.causal;
    bsattn::Inputs in;
    Sequence& self = const_cast<Sequence&>(*this);
    in.q = TensorView::contiguous(self.q_.ptr(s_.dtype), s_.dtype, {s_.batch, S_, s_.hq, s_.d});
    in.k = TensorView::contiguous(self.k_.ptr(s_.dtype), s_.dtype, {s_.batch, S_, s_.hkv, s_.d});
    in.v = TensorView::contiguous(self.v_.ptr(s_.dtype), s_.dtype, {s_.batch, S_, s_.hkv, s_.d});
    std::vector<int> rows(qb_);
    for (int i = 0; i < qb_; ++i) rows[i] = i;
    std::vector<std::uint32_t> w = bits(rows);
    if (s_.sparse)
      in.partial.bits =
          TensorView::contiguous(w.data(), DType::u32, {s_.sparsity_batch, s_.sparsity_heads, qb_, words_});
    if (!doc_ids_.empty()) {
      p.mask.document_ids = true;
      in.doc_q = in.doc_kv = TensorView::contiguous(self.doc_ids_.data(), DType::i32, {1, S_});
    }
    bsattn::Outputs o;
    o.out = TensorView::contiguous(r.out.data(), DType::f32, {s_.batch, S_, s_.hq, s_.d});
    o.lse = TensorView::contiguous(r.lse.data(), DType::f32, {s_.batch, s_.hq, S_});
    p.backward = true;
    bsattn::Plan plan(p);
    plan.run(in, o);
    // The gradients for dout_ (f32, as O).
    r.dq.assign(r.out.size(), NAN);
    r.dk.assign(std::size_t(s_.batch) * S_ * s_.hkv * s_.d, NAN);
    r.dv.assign(r.dk.size(), NAN);
    bsattn::BackwardInputs bin;
    bin.out = o.out;
    bin.lse = o.lse;
    bin.dout = TensorView::contiguous(self.dout_.values.data(), DType::f32, {s_.batch, S_, s_.hq, s_.d});
    bsattn::Gradients g;
    g.dq = TensorView::contiguous(r.dq.data(), DType::f32, {s_.batch, S_, s_.hq, s_.d});
    g.dk = TensorView::contiguous(r.dk.data(), DType::f32, {s_.batch, S_, s_.hkv, s_.d});
    g.dv = TensorView::contiguous(r.dv.data(), DType::f32, {s_.batch, S_, s_.hkv, s_.d});
    plan.run_backward(in, bin, g);
    return r;
  }

  // Every rank as a thread running run(const RankData&) -> RankResult; results scattered back
  // to the global token order.
  template <class RunRank>
  Result sharded(const RunRank& run) const {
    Result r;
    r.out.assign(std::size_t(s_.batch) * S_ * s_.hq * s_.d, NAN);
    r.lse.assign(std::size_t(s_.batch) * s_.hq * S_, NAN);
    r.stats.resize(s_.world);
    r.stats_backward.resize(s_.world);
    r.dq.assign(r.out.size(), NAN);
    r.dk.assign(std::size_t(s_.batch) * S_ * s_.hkv * s_.d, NAN);
    r.dv.assign(r.dk.size(), NAN);
    std::vector<std::thread> threads;
    std::vector<std::string> errors(s_.world);
    const std::int64_t local = std::int64_t(per_rank_) * s_.chunk;
    for (int rank = 0; rank < s_.world; ++rank) {
      threads.emplace_back([&, rank] {
        try {
          RankData d;
          d.spec = s_;
          d.rank = rank;
          d.local = local;
          // This rank's tokens of Q, K, V and dO in its local order.
          const auto take = [&](const Data& t, int heads) {
            Data x;
            x.values.resize(std::size_t(s_.batch) * local * heads * s_.d);
            for (int b = 0; b < s_.batch; ++b)
              for (std::int64_t i = 0; i < local; ++i)
                std::memcpy(&x.values[((b * local + i) * heads) * s_.d],
                            &t.values[((b * S_ + global_token(rank, i)) * heads) * s_.d], sizeof(float) * heads * s_.d);
            x.half = to_bf16(x.values);
            return x;
          };
          d.q = take(q_, s_.hq), d.k = take(k_, s_.hkv), d.v = take(v_, s_.hkv), d.dout = take(dout_, s_.hq);
          std::vector<int> rows;
          for (std::int64_t i = 0; i < local; i += s_.bq)
            rows.push_back(static_cast<int>(global_token(rank, i) / s_.bq));
          d.mask = bits(rows);
          d.mask_shape = {s_.sparsity_batch, s_.sparsity_heads, std::int64_t(rows.size()), words_};
          d.problem = problem(local);
          d.sharding.layout = s_.layout;
          d.sharding.causal = s_.causal;
          d.sharding.cu_seqlens = cu_seqlens_;
          const RankResult got = run(d);
          r.stats[rank] = got.stats;
          r.stats_backward[rank] = got.stats_backward;
          for (int b = 0; b < s_.batch; ++b)
            for (std::int64_t i = 0; i < local; ++i) {
              const std::int64_t g = global_token(rank, i);
              const std::size_t q_row = std::size_t(s_.hq) * s_.d, kv_row = std::size_t(s_.hkv) * s_.d;
              std::memcpy(&r.out[(b * S_ + g) * q_row], &got.out[(b * local + i) * q_row], sizeof(float) * q_row);
              std::memcpy(&r.dq[(b * S_ + g) * q_row], &got.dq[(b * local + i) * q_row], sizeof(float) * q_row);
              std::memcpy(&r.dk[(b * S_ + g) * kv_row], &got.dk[(b * local + i) * kv_row], sizeof(float) * kv_row);
              std::memcpy(&r.dv[(b * S_ + g) * kv_row], &got.dv[(b * local + i) * kv_row], sizeof(float) * kv_row);
              for (int h = 0; h < s_.hq; ++h) r.lse[(b * s_.hq + h) * S_ + g] = got.lse[(b * s_.hq + h) * local + i];
            }
        } catch (const std::exception& e) {
          errors[rank] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int rank = 0; rank < s_.world; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
    return r;
  }

  std::int64_t tokens() const { return S_; }

 private:
  Spec s_;
  int per_rank_ = 1, chunks_ = 1;
  std::int64_t S_ = 0;
  int qb_ = 0, kb_ = 0;
  std::int64_t words_ = 0;
  Data q_, k_, v_, dout_;
  std::vector<std::uint8_t> keep_;
  std::vector<std::int64_t> cu_seqlens_;  // packed documents' offsets (empty: none)
  std::vector<std::int32_t> doc_ids_;     // their id per token
};

// Every element of O and LSE of the sharded run against the single-process one: equal non-finite
// values (an empty row is O = 0, LSE = -inf in both), finite ones within `tol` (the sharded run
// merges fp32 parts; the single pass adds in another order), O's within tol + rel x |reference|
// (rel: an output rounded to a 16-bit dtype).
inline void expect_same(const Result& got, const Result& want, float tol, const std::string& what, float rel = 0.0f) {
  ASSERT_EQ(got.out.size(), want.out.size());
  std::size_t bad = 0, infinite_lse = 0;
  for (std::size_t i = 0; i < want.out.size(); ++i)
    if (!(std::fabs(got.out[i] - want.out[i]) <= tol + rel * std::fabs(want.out[i])) && bad++ < 5)
      ADD_FAILURE() << what << ": out[" << i << "] " << got.out[i] << " vs " << want.out[i];
  for (std::size_t i = 0; i < want.lse.size(); ++i) {
    if (std::isinf(want.lse[i])) {
      ++infinite_lse;
      if (!(got.lse[i] == want.lse[i]) && bad++ < 5)
        ADD_FAILURE() << what << ": lse[" << i << "] " << got.lse[i] << " vs -inf";
    } else if (!(std::fabs(got.lse[i] - want.lse[i]) <= tol) && bad++ < 5) {
      ADD_FAILURE() << what << ": lse[" << i << "] " << got.lse[i] << " vs " << want.lse[i];
    }
  }
  EXPECT_EQ(bad, 0u) << what;
  (void)infinite_lse;
}

// dQ, dK, dV of the sharded backward against the single-process one: within `tol` plus, for dQ
// rounded to bf16 once, `rel` of its size.
inline void expect_same_gradients(const Result& got, const Result& want, float tol, float rel,
                                  const std::string& what) {
  std::size_t bad = 0;
  const auto compare = [&](const std::vector<float>& g, const std::vector<float>& w, float r, const char* name) {
    ASSERT_EQ(g.size(), w.size());
    for (std::size_t i = 0; i < w.size(); ++i)
      if (!(std::fabs(g[i] - w[i]) <= tol + r * std::fabs(w[i])) && bad++ < 5)
        ADD_FAILURE() << what << ": " << name << "[" << i << "] " << g[i] << " vs " << w[i];
  };
  compare(got.dq, want.dq, rel, "dq");
  compare(got.dk, want.dk, 0.0f, "dk");
  compare(got.dv, want.dv, 0.0f, "dv");
  EXPECT_EQ(bad, 0u) << what;
}

// A ShardedPlan per rank for `s`'s geometry, with backward, its problem adjusted by `adjust`
// (e.g. to a GPU's).
template <class Adjust>
std::vector<dist::ShardedPlan> plans_for(const Spec& s, const Adjust& adjust) {
  std::vector<dist::ShardedPlan> plans;
  const std::int64_t local = std::int64_t(s.chunk) * (s.layout == dist::Layout::zigzag ? 2 : 1);
  for (int rank = 0; rank < s.world; ++rank) {
    bsattn::Problem p = Sequence(s).problem(local);
    p.backward = true;
    adjust(p);
    dist::Sharding sharding;
    sharding.layout = s.layout;
    sharding.causal = s.causal;
    plans.emplace_back(p, sharding, s.world);
  }
  return plans;
}

// The stats of a causal band of one chunk on 4 contiguous ranks (Spec::band): a rank receives only
// the previous chunk (rank 0 nothing), a quarter of what an all-gather would bring (3 chunks per
// rank), and attends its own diagonal pair while that chunk travels.
inline void expect_band_stats(const Result& got) {
  ASSERT_EQ(got.stats.size(), 4u);
  std::size_t received = 0, all_gather = 0;
  for (int rank = 0; rank < 4; ++rank) {
    const dist::Stats& st = got.stats[rank];
    EXPECT_EQ(st.chunks_received, rank == 0 ? 0 : 1) << "rank " << rank;
    EXPECT_EQ(st.pairs_attended, rank == 0 ? 1 : 2) << "rank " << rank;
    EXPECT_EQ(st.pairs_before_first_wait, 1) << "rank " << rank;
    received += st.bytes_received;
    all_gather += st.bytes_all_gather;
  }
  EXPECT_EQ(4 * received, all_gather);
}

}  // namespace distributed_case
