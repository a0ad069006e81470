// Context parallelism in C++ (include/bsattn/distributed.hpp): ranks as threads of this process
// (LocalGroup), each holding its chunks of a random sequence, against the single-process Plan
// over the whole sequence on the same inputs: every row of O and LSE and every element of the
// backward's dQ, dK, dV, contiguous and zigzag
// shards, 1, 2 and 4 ranks, causal and not, every block or random bitmasks (shared, per batch, per
// KV head, per query head, with empty rows), GQA, batch 1 and 2, f32 and bf16. Then the bytes a
// banded pattern moves against an all-gather, and bad shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "bsattn/bsattn.hpp"
#include "bsattn/cpu/numeric.hpp"

namespace {

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
  std::uint64_t seed = 1;
};

float round_to(float x, DType t) {
  if (t != DType::bf16) return x;
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

// Elements of dtype t from floats (f32 or bf16 bit patterns).
std::vector<std::uint16_t> to_bf16(const std::vector<float>& x) {
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
    p.mask.causal = s_.causal;
    bsattn::Inputs in;
    Sequence& self = const_cast<Sequence&>(*this);
    in.q = TensorView::contiguous(self.q_.ptr(s_.dtype), s_.dtype, {s_.batch, S_, s_.hq, s_.d});
    in.k = TensorView::contiguous(self.k_.ptr(s_.dtype), s_.dtype, {s_.batch, S_, s_.hkv, s_.d});
    in.v = TensorView::contiguous(self.v_.ptr(s_.dtype), s_.dtype, {s_.batch, S_, s_.hkv, s_.d});
    std::vector<int> rows(qb_);
    for (int i = 0; i < qb_; ++i) rows[i] = i;
    std::vector<std::uint32_t> w = bits(rows);
    if (s_.sparse) in.partial.bits = TensorView::contiguous(w.data(), DType::u32, {s_.sparsity_batch, s_.sparsity_heads, qb_, words_});
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

  // Every rank as a thread; results scattered back to the global token order.
  Result sharded() const {
    Result r;
    r.out.assign(std::size_t(s_.batch) * S_ * s_.hq * s_.d, NAN);
    r.lse.assign(std::size_t(s_.batch) * s_.hq * S_, NAN);
    r.stats.resize(s_.world);
    r.stats_backward.resize(s_.world);
    r.dq.assign(r.out.size(), NAN);
    r.dk.assign(std::size_t(s_.batch) * S_ * s_.hkv * s_.d, NAN);
    r.dv.assign(r.dk.size(), NAN);
    dist::LocalGroup group(s_.world);
    std::vector<std::thread> threads;
    std::vector<std::string> errors(s_.world);
    const std::int64_t local = std::int64_t(per_rank_) * s_.chunk;
    for (int rank = 0; rank < s_.world; ++rank) {
      threads.emplace_back([&, rank] {
        try {
          auto transport = group.transport(rank);
          // This rank's tokens of Q, K, V in its local order.
          const auto take = [&](const Data& t, int heads) {
            Data d;
            d.values.resize(std::size_t(s_.batch) * local * heads * s_.d);
            for (int b = 0; b < s_.batch; ++b)
              for (std::int64_t i = 0; i < local; ++i)
                std::memcpy(&d.values[((b * local + i) * heads) * s_.d],
                            &t.values[((b * S_ + global_token(rank, i)) * heads) * s_.d], sizeof(float) * heads * s_.d);
            d.half = to_bf16(d.values);
            return d;
          };
          Data q = take(q_, s_.hq), k = take(k_, s_.hkv), v = take(v_, s_.hkv);
          std::vector<int> rows;
          for (std::int64_t i = 0; i < local; i += s_.bq) rows.push_back(static_cast<int>(global_token(rank, i) / s_.bq));
          std::vector<std::uint32_t> w = bits(rows);
          std::vector<float> out(std::size_t(s_.batch) * local * s_.hq * s_.d, NAN), lse(std::size_t(s_.batch) * s_.hq * local, NAN);
          dist::Sharding sharding;
          sharding.layout = s_.layout;
          sharding.causal = s_.causal;
          const TensorView mask = s_.sparse ? TensorView::contiguous(w.data(), DType::u32,
                                                                     {s_.sparsity_batch, s_.sparsity_heads,
                                                                      std::int64_t(rows.size()), words_})
                                            : TensorView{};
          r.stats[rank] = dist::attention(
              *transport, problem(local), sharding,
              TensorView::contiguous(q.ptr(s_.dtype), s_.dtype, {s_.batch, local, s_.hq, s_.d}),
              TensorView::contiguous(k.ptr(s_.dtype), s_.dtype, {s_.batch, local, s_.hkv, s_.d}),
              TensorView::contiguous(v.ptr(s_.dtype), s_.dtype, {s_.batch, local, s_.hkv, s_.d}), mask,
              TensorView::contiguous(out.data(), DType::f32, {s_.batch, local, s_.hq, s_.d}),
              TensorView::contiguous(lse.data(), DType::f32, {s_.batch, s_.hq, local}));
          // The backward on this rank's O and LSE; dq in the inputs' dtype for bf16 cases (rounded
          // once), dk and dv in f32.
          Data dout = take(dout_, s_.hq);
          const DType dq_type = s_.dtype;
          std::vector<float> dq(out.size(), NAN), dk(std::size_t(s_.batch) * local * s_.hkv * s_.d, NAN), dv(dk.size(), NAN);
          std::vector<std::uint16_t> dq_half(dq.size(), 0xffffu);
          const TensorView out_view = TensorView::contiguous(out.data(), DType::f32, {s_.batch, local, s_.hq, s_.d});
          r.stats_backward[rank] = dist::attention_backward(
              *transport, problem(local), sharding,
              TensorView::contiguous(q.ptr(s_.dtype), s_.dtype, {s_.batch, local, s_.hq, s_.d}),
              TensorView::contiguous(k.ptr(s_.dtype), s_.dtype, {s_.batch, local, s_.hkv, s_.d}),
              TensorView::contiguous(v.ptr(s_.dtype), s_.dtype, {s_.batch, local, s_.hkv, s_.d}), mask, out_view,
              TensorView::contiguous(lse.data(), DType::f32, {s_.batch, s_.hq, local}),
              TensorView::contiguous(dout.values.data(), DType::f32, {s_.batch, local, s_.hq, s_.d}),
              TensorView::contiguous(dq_type == DType::bf16 ? static_cast<void*>(dq_half.data()) : dq.data(), dq_type,
                                     {s_.batch, local, s_.hq, s_.d}),
              TensorView::contiguous(dk.data(), DType::f32, {s_.batch, local, s_.hkv, s_.d}),
              TensorView::contiguous(dv.data(), DType::f32, {s_.batch, local, s_.hkv, s_.d}));
          if (dq_type == DType::bf16)
            for (std::size_t i = 0; i < dq.size(); ++i) dq[i] = bsattn::cpu::bf16_to_float(dq_half[i]);
          for (int b = 0; b < s_.batch; ++b)
            for (std::int64_t i = 0; i < local; ++i) {
              const std::int64_t g = global_token(rank, i);
              const std::size_t q_row = std::size_t(s_.hq) * s_.d, kv_row = std::size_t(s_.hkv) * s_.d;
              std::memcpy(&r.out[(b * S_ + g) * q_row], &out[(b * local + i) * q_row], sizeof(float) * q_row);
              std::memcpy(&r.dq[(b * S_ + g) * q_row], &dq[(b * local + i) * q_row], sizeof(float) * q_row);
              std::memcpy(&r.dk[(b * S_ + g) * kv_row], &dk[(b * local + i) * kv_row], sizeof(float) * kv_row);
              std::memcpy(&r.dv[(b * S_ + g) * kv_row], &dv[(b * local + i) * kv_row], sizeof(float) * kv_row);
              for (int h = 0; h < s_.hq; ++h) r.lse[(b * s_.hq + h) * S_ + g] = lse[(b * s_.hq + h) * local + i];
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
};

// Every element of O and LSE of the sharded run against the single-process one: equal non-finite
// values (an empty row is O = 0, LSE = -inf in both), finite ones within `tol` (the sharded run
// merges fp32 parts; the single pass adds in another order).
void expect_same(const Result& got, const Result& want, float tol, const std::string& what) {
  ASSERT_EQ(got.out.size(), want.out.size());
  std::size_t bad = 0, infinite_lse = 0;
  for (std::size_t i = 0; i < want.out.size(); ++i)
    if (!(std::fabs(got.out[i] - want.out[i]) <= tol) && bad++ < 5)
      ADD_FAILURE() << what << ": out[" << i << "] " << got.out[i] << " vs " << want.out[i];
  for (std::size_t i = 0; i < want.lse.size(); ++i) {
    if (std::isinf(want.lse[i])) {
      ++infinite_lse;
      if (!(got.lse[i] == want.lse[i]) && bad++ < 5) ADD_FAILURE() << what << ": lse[" << i << "] " << got.lse[i] << " vs -inf";
    } else if (!(std::fabs(got.lse[i] - want.lse[i]) <= tol) && bad++ < 5) {
      ADD_FAILURE() << what << ": lse[" << i << "] " << got.lse[i] << " vs " << want.lse[i];
    }
  }
  EXPECT_EQ(bad, 0u) << what;
  (void)infinite_lse;
}

// dQ, dK, dV of the sharded backward against the single-process one: within `tol` plus, for dQ
// rounded to bf16 once, `rel` of its size.
void expect_same_gradients(const Result& got, const Result& want, float tol, float rel, const std::string& what) {
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

TEST(Distributed, ShardedEqualsSingleProcess) {
  std::uint64_t seed = 100;
  int cases = 0, with_empty_rows = 0;
  for (const int world : {1, 2, 4})
    for (const auto layout : {dist::Layout::contiguous, dist::Layout::zigzag})
      for (const bool causal : {false, true})
        for (int pattern = 0; pattern < 4; ++pattern) {  // every block; shared; per batch and KV head; per query head
          Spec s;
          s.world = world;
          s.layout = layout;
          s.causal = causal;
          s.sparse = pattern > 0;
          s.batch = 1 + seed % 2;
          s.sparsity_batch = pattern == 2 ? s.batch : 1;
          s.sparsity_heads = pattern == 2 ? s.hkv : pattern == 3 ? s.hq : 1;
          s.dtype = seed % 3 == 0 ? DType::bf16 : DType::f32;
          s.seed = seed++;
          const Sequence seq(s);
          const std::string what = "world " + std::to_string(world) + (layout == dist::Layout::zigzag ? " zigzag" : " contiguous") +
                                   (causal ? " causal" : "") + " pattern " + std::to_string(pattern) + " batch " +
                                   std::to_string(s.batch) + (s.dtype == DType::bf16 ? " bf16" : " f32");
          const Result want = seq.reference(), got = seq.sharded();
          expect_same(got, want, 2e-5f, what);
          expect_same_gradients(got, want, 1e-4f, s.dtype == DType::bf16 ? 8e-3f : 0.0f, what + " backward");
          ++cases;
          with_empty_rows += s.sparse && std::any_of(want.lse.begin(), want.lse.end(), [](float x) { return std::isinf(x); });
        }
  EXPECT_EQ(cases, 48);
  EXPECT_GT(with_empty_rows, 0) << "no case had an empty row";
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
  const Result got = seq.sharded(), want = seq.reference();
  expect_same(got, want, 2e-5f, "band");
  std::size_t received = 0, all_gather = 0;
  for (int rank = 0; rank < s.world; ++rank) {
    const dist::Stats& st = got.stats[rank];
    EXPECT_EQ(st.chunks_received, rank == 0 ? 0 : 1) << "rank " << rank;
    // Its own diagonal pair runs while the previous chunk travels (the exchange overlaps it).
    EXPECT_EQ(st.pairs_attended, rank == 0 ? 1 : 2) << "rank " << rank;
    EXPECT_EQ(st.pairs_before_first_wait, 1) << "rank " << rank;
    received += st.bytes_received;
    all_gather += st.bytes_all_gather;
  }
  EXPECT_EQ(4 * received, all_gather);
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
}

}  // namespace
