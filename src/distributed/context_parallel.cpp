// Context parallelism (include/bsattn/distributed.hpp): the chunks a rank's rows use, their
// exchange, one Plan per (query chunk, key chunk) pair and the merge by LSE, on the tensors'
// device (scratch.hpp holds what differs between the CPU and a GPU).
#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <limits>
#include <string>

#include "bsattn/backward.hpp"
#include "bsattn/distributed.hpp"
#include "bsattn/merge.hpp"
#include "bsattn/plan.hpp"
#include "distributed/checks.hpp"
#include "distributed/pattern.hpp"
#include "distributed/scratch.hpp"

namespace bsattn::distributed {
namespace {

// Which chunks of the global sequence a rank holds.
struct Chunks {
  int per_rank = 1, world = 1, count = 1;
  std::int64_t size = 0;  // tokens per chunk
  int owner(int chunk) const { return chunk < world ? chunk : count - 1 - chunk; }
  std::vector<int> of_rank(int rank) const {
    return per_rank == 1 ? std::vector<int>{rank} : std::vector<int>{rank, count - 1 - rank};
  }
};

// A view of `t` with dimension `dim` cut to [begin, begin + length).
TensorView slice(TensorView t, int dim, std::int64_t begin, std::int64_t length) {
  t.data =
      static_cast<unsigned char*>(t.data) + begin * t.stride[dim] * static_cast<std::int64_t>(element_size(t.dtype));
  t.shape[dim] = length;
  return t;
}

}  // namespace

// ------------------------------------------------------------------ the plan
// The checked problem and sharding, the chunk geometry, the documents and the pair plans: one
// plan serves every (query chunk, key chunk) pair, and with the causal mask a second one the
// diagonal pairs (causal within the chunk); the forward's write fp32 parts, the backward's (with
// local.backward) read O in local.out_dtype.
struct ShardedPlan::Impl {
  // Makes the forward's pair plans and/or the backward's.
  Impl(const Problem& problem, const Sharding& how, int world, bool forward, bool backward)
      : local(problem), sharding(how) {
    B = local.batch, S = local.max_seqlen_q, Hq = local.heads_q, Hkv = local.heads_kv, D = local.head_dim;
    if (world < 1) throw Error("world", "at least one rank, got " + std::to_string(world));
    if (local.max_seqlen_kv != local.max_seqlen_q)
      throw Error("problem.max_seqlen_kv", "a rank holds the same tokens of Q, K and V: expected " + std::to_string(S) +
                                               ", got " + std::to_string(local.max_seqlen_kv));
    if (local.q_layout != QLayout::batched || local.kv_layout != KVLayout::contiguous || local.mask.any() ||
        local.proxy != Proxy::off || local.tile_m != 0 || local.tile_n != 0)
      throw Error("problem", "batched Q, contiguous K/V, no mask (Sharding::causal), no proxy and no tile override");
    if (local.format == Format::varlen_block_lists)
      throw Error("problem.format", "a batched pattern: all_blocks, block_lists, bsr or bitmask (the rank's query "
                                    "blocks over the global key blocks)");
    if (local.format != Format::all_blocks && !local.has_partial)
      throw Error("problem.has_partial", "a pattern has its partial set (and optionally a full one)");
    chunks.per_rank = sharding.layout == Layout::zigzag ? 2 : 1;
    chunks.world = world;
    chunks.count = world * chunks.per_rank;
    if (S % chunks.per_rank != 0)
      throw Error("problem.max_seqlen_q", "a zigzag shard holds two equal chunks: " + std::to_string(S) + " tokens");
    chunks.size = S / chunks.per_rank;
    const int bq = local.block.q, bk = local.block.kv;
    if (chunks.size == 0 || chunks.size % bq != 0 || chunks.size % bk != 0)
      throw Error("problem.block", "a chunk of " + std::to_string(chunks.size) +
                                       " tokens is not a whole number of blocks (" + std::to_string(bq) + ", " +
                                       std::to_string(bk) + ")");
    q_blocks = chunks.size / bq;
    k_blocks = chunks.size / bk;
    chunk_elems = B * chunks.size * Hkv * D;
    if (!sharding.cu_seqlens.empty()) read_documents(sharding.cu_seqlens);
    sparse = local.format != Format::all_blocks;
    Bs = sparse ? local.sparsity_batch : 1;
    Hs = sparse ? local.sparsity_heads : 1;

    Problem pair = local;
    pair.max_seqlen_q = pair.max_seqlen_kv = static_cast<int>(chunks.size);
    pair.mask.alignment = Alignment::top_left;
    pair.mask.document_ids = documents;
    // The pairs' metadata is made here from a checked pattern: re-validating it would only add,
    // on a GPU, a wait for each pair's flags before the next is enqueued.
    pair.validate = false;
    if (sparse) pair.format = Format::bitmask, pair.has_partial = true, pair.has_full = false;  // the pair's bits
    for (const bool pass : {false, true}) {  // false: the forward
      if (!(pass ? backward : forward)) continue;
      pair.backward = pass;
      pair.out_dtype = pass ? local.out_dtype : DType::f32;  // the forward's parts, merged in fp32
      pair.mask.causal = false;
      plans[pass][0] = std::make_unique<Plan>(pair);
      pair.mask.causal = true;
      if (sharding.causal) plans[pass][1] = std::make_unique<Plan>(pair);
    }
  }

  // Throws for the backward when its plans were not made (ShardedPlan without local.backward).
  Plan& pair_plan(bool backward, int qc, int kc) const {
    if (!plans[backward][0])
      throw Error("problem.backward", "run_backward() needs a ShardedPlan made with local.backward = true");
    return *plans[backward][kc == qc && plans[backward][1] ? 1 : 0];
  }
  // Documents are contiguous: a chunk holds those from its first token's to its last token's.
  std::int32_t first_doc(int chunk) const { return doc_of_token[static_cast<std::size_t>(chunk * chunks.size)]; }
  std::int32_t last_doc(int chunk) const {
    return doc_of_token[static_cast<std::size_t>((chunk + 1) * chunks.size - 1)];
  }

  Problem local;
  Sharding sharding;
  std::int64_t B = 0, S = 0, Hq = 0, Hkv = 0, D = 0;
  Chunks chunks;
  std::int64_t q_blocks = 0, k_blocks = 0, Bs = 1, Hs = 1;
  std::int64_t chunk_elems = 0;  // elements of one K or V chunk, all batches
  bool sparse = false, documents = false;
  std::vector<std::int32_t> doc_of_token;  // with documents: every global token's
  std::unique_ptr<Plan> plans[2][2];       // [backward][diagonal]

 private:
  // The document of every global token, from Sharding::cu_seqlens (checked).
  void read_documents(const std::vector<std::int64_t>& offsets) {
    const std::int64_t total = chunks.size * chunks.count;
    if (B != 1) throw Error("sharding.cu_seqlens", "packed documents take batch 1, got " + std::to_string(B));
    bool ok = offsets.front() == 0 && offsets.back() == total && offsets.size() - 1 <= std::size_t(INT32_MAX);
    for (std::size_t i = 1; i < offsets.size() && ok; ++i) ok = offsets[i] >= offsets[i - 1];
    if (!ok)
      throw Error("sharding.cu_seqlens", "expected non-decreasing offsets from 0 to the sequence's " +
                                             std::to_string(total) + " tokens, got " + std::to_string(offsets.size()) +
                                             " offsets from " + std::to_string(offsets.front()) + " to " +
                                             std::to_string(offsets.back()));
    documents = true;
    doc_of_token.resize(static_cast<std::size_t>(total));
    for (std::size_t d = 0; d + 1 < offsets.size(); ++d)
      std::fill(doc_of_token.begin() + offsets[d], doc_of_token.begin() + offsets[d + 1], static_cast<std::int32_t>(d));
  }
};

namespace {

// ------------------------------------------------------------------ shards
// What the forward and the backward share in one call: the rank's chunks and the key chunks their
// rows use (agreed with the other ranks by an all-gather), the pairs' block masks and document
// ids, and the exchange of the used K/V chunks, posted so that the caller attends the chunks it
// holds while the others travel. Buffers come from `scratch`, on the problem's device.
class Shards {
 public:
  // Checks the tensors and finds the chunks this rank's rows use; nothing is sent (agree()).
  Shards(const ShardedPlan::Impl& plan, Scratch& scratch, Transport& transport, const TensorView& q,
         const TensorView& k, const TensorView& v, const Pattern& pattern, const TensorView& out, const TensorView& lse,
         bool backward)
      : plan(plan), scratch_(scratch), transport_(transport), q_(q), k_(k), v_(v) {
    const Problem& local = plan.local;
    world_ = transport.world();
    rank_ = transport.rank();
    if (world_ != plan.chunks.world)
      throw Error("transport", "has " + std::to_string(world_) + " ranks, the plan was made for " +
                                   std::to_string(plan.chunks.world));
    const std::int64_t B = plan.B, S = plan.S, Hq = plan.Hq, Hkv = plan.Hkv, D = plan.D;
    expect_shape(q, "q", {B, S, Hq, D}, local.dtype, local);
    expect_shape(k, "k", {B, S, Hkv, D}, local.dtype, local);
    expect_shape(v, "v", {B, S, Hkv, D}, local.dtype, local);
    expect_shape(out, "out", {B, S, Hq, D}, local.out_dtype, local);
    if (lse.defined() || backward) expect_shape(lse, "lse", {B, Hq, S}, DType::f32, local);
    if (local.device == Device::cuda)
      for (const auto& [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}})
        if (t->stride[3] != 1 || t->stride[2] != D)
          throw Error(name, "on a GPU a token's heads must be contiguous (strides [.., .., " + std::to_string(D) +
                                ", 1]), got " + t->shape_string() + " with strides [.., .., " +
                                std::to_string(t->stride[2]) + ", " + std::to_string(t->stride[3]) + "]");
    if (backward) plan.pair_plan(true, 0, 0);  // throws without the backward's plans
    if (plan.sparse)
      pattern_ = read_pattern(pattern, local, plan.q_blocks * plan.chunks.per_rank, plan.k_blocks * plan.chunks.count,
                              scratch_);
    mine = plan.chunks.of_rank(rank_);
    keys.resize(mine.size());
    for (int kc = 0; kc < plan.chunks.count; ++kc) {
      bool needed = false;
      for (std::size_t i = 0; i < mine.size(); ++i)
        if (used(mine[i], kc)) keys[i].push_back(kc), needed = true;
      if (needed) needs.push_back(kc);
    }
    if (plan.sparse) upload_pair_masks();
    if (plan.documents) {
      doc_ids_ = static_cast<std::int32_t*>(scratch_.allocate(plan.doc_of_token.size() * sizeof(std::int32_t)));
      scratch_.upload(doc_ids_, plan.doc_of_token.data(), plan.doc_of_token.size() * sizeof(std::int32_t));
    }
  }

  // The first collective call: every rank's needed chunks (after the caller's last check, so that
  // bad arguments throw before anything is sent).
  void agree() { all_needs = transport_.all_gather(needs); }

  int rank() const { return rank_; }
  int world() const { return world_; }
  int local_index(int chunk) const {
    return static_cast<int>(std::find(mine.begin(), mine.end(), chunk) - mine.begin());
  }
  bool holds(int chunk) const { return plan.chunks.owner(chunk) == rank_; }
  Transport::Memory memory() const { return scratch_.memory(); }

  // Posts the exchange of the used K/V chunks: this rank's to the ranks that use them (each chunk
  // packed once), the others from their owners (K, then V of each chunk, in chunk order on both
  // sides), into received_.
  std::unique_ptr<Transport::Exchange> post_key_chunks(Stats& stats) {
    const std::size_t bytes = static_cast<std::size_t>(plan.chunk_elems) * element_size(plan.local.dtype);
    std::vector<std::array<void*, 2>> packed(mine.size(), {nullptr, nullptr});
    std::vector<Transport::Send> sends;
    for (int peer = 0; peer < world_; ++peer) {
      if (peer == rank_) continue;
      for (const int c : all_needs[peer]) {
        if (!holds(c)) continue;
        std::array<void*, 2>& kv = packed[static_cast<std::size_t>(local_index(c))];
        if (!kv[0])
          for (int i = 0; i < 2; ++i) {
            kv[i] = scratch_.allocate(bytes);
            scratch_.pack(i == 0 ? k_ : v_, local_index(c) * plan.chunks.size, plan.chunks.size, kv[i]);
          }
        for (void* data : kv) sends.push_back({peer, data, bytes});
      }
    }
    received_.assign(2 * needs.size(), nullptr);
    receive_of_.assign(needs.size(), -1);
    std::vector<Transport::Receive> receives;
    for (std::size_t i = 0; i < needs.size(); ++i) {
      if (holds(needs[i])) continue;
      receive_of_[i] = static_cast<int>(receives.size());
      for (int kv = 0; kv < 2; ++kv) {
        received_[2 * i + kv] = scratch_.allocate(bytes);
        receives.push_back({plan.chunks.owner(needs[i]), received_[2 * i + kv], bytes});
      }
      ++stats.chunks_received;
      stats.bytes_received += 2 * bytes;
    }
    stats.bytes_all_gather = static_cast<std::size_t>(plan.chunks.count - plan.chunks.per_rank) * 2 * bytes;
    return transport_.post(sends, receives, scratch_.memory());
  }

  // Runs visit(query chunk index, part, key chunk, K, V) for every used pair: the key chunks this
  // rank holds first, then each received one once it has landed. `part`: the key chunk's position
  // in keys[query chunk index].
  template <class Visit>
  void for_each_pair(Transport::Exchange& exchange, Stats& stats, const Visit& visit) {
    const auto pairs_of = [&](std::size_t slot) {
      const int kc = needs[slot];
      TensorView kk, vv;
      if (holds(kc)) {
        kk = slice(k_, 1, local_index(kc) * plan.chunks.size, plan.chunks.size);
        vv = slice(v_, 1, local_index(kc) * plan.chunks.size, plan.chunks.size);
      } else {
        kk = view(received_[2 * slot], plan.local.dtype, {plan.B, plan.chunks.size, plan.Hkv, plan.D});
        vv = view(received_[2 * slot + 1], plan.local.dtype, {plan.B, plan.chunks.size, plan.Hkv, plan.D});
      }
      for (std::size_t qi = 0; qi < mine.size(); ++qi) {
        const auto at = std::find(keys[qi].begin(), keys[qi].end(), kc);
        if (at == keys[qi].end()) continue;
        visit(qi, static_cast<std::size_t>(at - keys[qi].begin()), kc, kk, vv);
        ++stats.pairs_attended;
      }
    };
    for (std::size_t slot = 0; slot < needs.size(); ++slot)
      if (receive_of_[slot] < 0) pairs_of(slot);
    stats.pairs_before_first_wait = stats.pairs_attended;  // unless a received chunk follows
    bool waited = false;
    for (std::size_t slot = 0; slot < needs.size(); ++slot) {
      if (receive_of_[slot] < 0) continue;
      if (!waited) stats.pairs_before_first_wait = stats.pairs_attended, waited = true;
      exchange.wait(static_cast<std::size_t>(receive_of_[slot]) + 1);  // K, then V
      pairs_of(slot);
    }
  }

  // The inputs of pair (local chunk qi, its key chunk number `part`): the query chunk's rows and,
  // with a bitmask, the pair's bits over the key chunk's blocks.
  Inputs pair_inputs(std::size_t qi, std::size_t part, const TensorView& kk, const TensorView& vv) const {
    Inputs in;
    in.q = rows(q_, mine[qi]);
    in.k = kk;
    in.v = vv;
    if (plan.documents) {  // the two chunks' document ids, [1, chunk] each
      in.doc_q = view(doc_ids_ + mine[qi] * plan.chunks.size, DType::i32, {1, plan.chunks.size});
      in.doc_kv = view(doc_ids_ + keys[qi][part] * plan.chunks.size, DType::i32, {1, plan.chunks.size});
    }
    if (plan.sparse)
      in.partial.bits = view(pair_bits_ + (first_pair_[qi] + part) * pair_mask_words(), DType::u32,
                             {plan.Bs, plan.Hs, plan.q_blocks, pair_words()});
    return in;
  }

  // The rows of local chunk `chunk` in a [B, S, H, D] tensor, or in an LSE [B, H, S].
  TensorView rows(const TensorView& t, int chunk) const {
    return slice(t, 1, local_index(chunk) * plan.chunks.size, plan.chunks.size);
  }
  TensorView lse_rows(const TensorView& lse, int chunk) const {
    return lse.defined() ? slice(lse, 2, local_index(chunk) * plan.chunks.size, plan.chunks.size) : lse;
  }
  // A contiguous tensor of the problem's device at `data`.
  TensorView view(const void* data, DType dtype, std::initializer_list<std::int64_t> shape) const {
    return TensorView::contiguous(data, dtype, shape, plan.local.device, plan.local.device_index);
  }

  const ShardedPlan::Impl& plan;             // the geometry and the pair plans
  std::vector<int> mine;                     // this rank's chunks, in its local order
  std::vector<std::vector<int>> keys;        // keys[i]: the key chunks local chunk i's rows use
  std::vector<int> needs;                    // their union, ascending
  std::vector<std::vector<int>> all_needs;   // every rank's needs

 private:
  std::int64_t pair_words() const { return (plan.k_blocks + 31) / 32; }
  std::int64_t pair_mask_words() const { return plan.Bs * plan.Hs * plan.q_blocks * pair_words(); }
  bool bit(std::int64_t bs, std::int64_t hs, std::int64_t row, std::int64_t col) const {
    return pattern_.kept(bs, hs, row, col);
  }
  // Key chunk kc is used by query chunk qc: not in its causal future, and some block kept.
  bool used(int qc, int kc) const {
    if (plan.sharding.causal && kc > qc) return false;
    if (plan.documents && (plan.last_doc(qc) < plan.first_doc(kc) || plan.last_doc(kc) < plan.first_doc(qc)))
      return false;  // no document in common
    if (!plan.sparse) return true;
    const std::int64_t row0 = local_index(qc) * plan.q_blocks;
    for (std::int64_t bs = 0; bs < plan.Bs; ++bs)
      for (std::int64_t hs = 0; hs < plan.Hs; ++hs)
        for (std::int64_t r = row0; r < row0 + plan.q_blocks; ++r)
          for (std::int64_t c = kc * plan.k_blocks; c < (kc + 1) * plan.k_blocks; ++c)
            if (bit(bs, hs, r, c)) return true;
    return false;
  }
  // Every used pair's bits over its key chunk's blocks, in one buffer on the problem's device
  // (pair (qi, part) at first_pair_[qi] + part).
  void upload_pair_masks() {
    std::size_t pairs = 0;
    for (const std::vector<int>& k : keys) first_pair_.push_back(pairs), pairs += k.size();
    const std::int64_t words = pair_words(), per_pair = pair_mask_words();
    std::vector<std::uint32_t> bits(pairs * static_cast<std::size_t>(per_pair), 0u);
    for (std::size_t qi = 0; qi < mine.size(); ++qi)
      for (std::size_t part = 0; part < keys[qi].size(); ++part) {
        std::uint32_t* pair = bits.data() + (first_pair_[qi] + part) * per_pair;
        const std::int64_t row0 = local_index(mine[qi]) * plan.q_blocks, col0 = keys[qi][part] * plan.k_blocks;
        for (std::int64_t bs = 0; bs < plan.Bs; ++bs)
          for (std::int64_t hs = 0; hs < plan.Hs; ++hs)
            for (std::int64_t r = 0; r < plan.q_blocks; ++r)
              for (std::int64_t c = 0; c < plan.k_blocks; ++c)
                if (bit(bs, hs, row0 + r, col0 + c))
                  pair[((bs * plan.Hs + hs) * plan.q_blocks + r) * words + c / 32] |= 1u << (c % 32);
      }
    pair_bits_ = static_cast<std::uint32_t*>(scratch_.allocate(bits.size() * sizeof(std::uint32_t)));
    scratch_.upload(pair_bits_, bits.data(), bits.size() * sizeof(std::uint32_t));
  }

  Scratch& scratch_;
  Transport& transport_;
  TensorView q_, k_, v_;
  PatternBits pattern_;  // with a pattern: the rank's rows over the global key blocks, on the host
  int world_ = 1, rank_ = 0;
  std::uint32_t* pair_bits_ = nullptr;
  std::int32_t* doc_ids_ = nullptr;  // the plan's documents of every global token, on the device
  std::vector<std::size_t> first_pair_;
  std::vector<void*> received_;  // per needed chunk: its received K and V (held chunks: none)
  std::vector<int> receive_of_;  // per needed chunk: its K receive's index (V follows), -1 if held
};

// ------------------------------------------------------------------ forward
Stats run_forward(const ShardedPlan::Impl& plan, Transport& transport, const TensorView& q, const TensorView& k,
                  const TensorView& v, const Pattern& pattern, const TensorView& out, const TensorView& lse,
                  Stream stream) {
  Scratch scratch(plan.local.device, plan.local.device_index, stream);
  Shards sh(plan, scratch, transport, q, k, v, pattern, out, lse, false);
  sh.agree();
  Stats stats;
  const std::unique_ptr<Transport::Exchange> exchange = sh.post_key_chunks(stats);
  // Every pair into its fp32 part; a query chunk's parts are merged once all are in. A chunk
  // whose rows use no key chunk merges one empty part (O = 0, LSE = -inf).
  const std::int64_t B = plan.B, Hq = plan.Hq, D = plan.D, size = plan.chunks.size;
  const std::int64_t out_elems = B * size * Hq * D, lse_elems = B * Hq * size;
  std::vector<float*> part_out(sh.mine.size()), part_lse(sh.mine.size());
  for (std::size_t i = 0; i < sh.mine.size(); ++i) {
    const std::size_t n = sh.keys[i].size();
    part_out[i] = n ? scratch.floats(n * out_elems) : scratch.filled(out_elems, 0.0f);
    part_lse[i] =
        n ? scratch.floats(n * lse_elems) : scratch.filled(lse_elems, -std::numeric_limits<float>::infinity());
  }
  sh.for_each_pair(*exchange, stats, [&](std::size_t qi, std::size_t part, int kc, const TensorView& kk,
                                         const TensorView& vv) {
    Outputs o;
    o.out = sh.view(part_out[qi] + part * out_elems, DType::f32, {B, size, Hq, D});
    o.lse = sh.view(part_lse[qi] + part * lse_elems, DType::f32, {B, Hq, size});
    plan.pair_plan(false, sh.mine[qi], kc).run(sh.pair_inputs(qi, part, kk, vv), o, stream);
  });
  // merge_states writes O in its parts' dtype: an f16 / bf16 O is merged into fp32 rows first and
  // rounded once into the caller's.
  float* merged = out.dtype == DType::f32 ? nullptr : scratch.floats(out_elems);
  for (std::size_t qi = 0; qi < sh.mine.size(); ++qi) {
    const std::int64_t n = std::max<std::int64_t>(static_cast<std::int64_t>(sh.keys[qi].size()), 1);
    const TensorView rows = sh.rows(out, sh.mine[qi]);
    merge_states(sh.view(part_out[qi], DType::f32, {n, B, size, Hq, D}),
                 sh.view(part_lse[qi], DType::f32, {n, B, Hq, size}),
                 merged ? sh.view(merged, DType::f32, {B, size, Hq, D}) : rows, sh.lse_rows(lse, sh.mine[qi]),
                 stream);
    if (merged) scratch.store(merged, rows);
  }
  return stats;
}

// ------------------------------------------------------------------ backward
Stats run_backward(const ShardedPlan::Impl& plan, Transport& transport, const TensorView& q, const TensorView& k,
                   const TensorView& v, const Pattern& pattern, const TensorView& out, const TensorView& lse,
                   const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                   Stream stream) {
  const Problem& local = plan.local;
  const auto gradient_of = [&](const TensorView& g, const char* name, const TensorView& like) {
    if (g.dtype != DType::f32 && g.dtype != local.dtype)
      throw Error(name, "expected f32 or the inputs' " + std::string(to_string(local.dtype)) + ", got " +
                            std::string(to_string(g.dtype)));
    expect_shape(g, name, {like.shape[0], like.shape[1], like.shape[2], like.shape[3]}, g.dtype, local);
    if (g.stride[3] != 1) throw Error(name, "the last dimension must be contiguous");
  };
  Scratch scratch(local.device, local.device_index, stream);
  Shards sh(plan, scratch, transport, q, k, v, pattern, out, lse, true);
  expect_shape(dout, "dout", {plan.B, plan.S, plan.Hq, plan.D}, local.out_dtype, local);
  gradient_of(dq, "dq", q);
  gradient_of(dk, "dk", k);
  gradient_of(dv, "dv", v);
  sh.agree();
  Stats stats;
  const std::unique_ptr<Transport::Exchange> exchange = sh.post_key_chunks(stats);
  // fp32 sums: dQ of each local chunk; dK, dV of every used key chunk (slot of `needs`).
  const std::int64_t B = plan.B, Hq = plan.Hq, Hkv = plan.Hkv, D = plan.D, size = plan.chunks.size;
  const std::int64_t q_elems = B * size * Hq * D, kv_elems = plan.chunk_elems;
  const std::size_t local_chunks = sh.mine.size();
  float* dq_sum = scratch.filled(local_chunks * q_elems, 0.0f);
  std::vector<float*> dk_sum(sh.needs.size()), dv_sum(sh.needs.size());
  for (std::size_t slot = 0; slot < sh.needs.size(); ++slot)
    dk_sum[slot] = scratch.filled(kv_elems, 0.0f), dv_sum[slot] = scratch.filled(kv_elems, 0.0f);
  float* gq = scratch.floats(q_elems);
  float* gk = scratch.floats(kv_elems);
  float* gv = scratch.floats(kv_elems);
  sh.for_each_pair(*exchange, stats, [&](std::size_t qi, std::size_t part, int kc, const TensorView& kk,
                                         const TensorView& vv) {
    const int qc = sh.mine[qi];
    // The whole rows' O and LSE make the pair's share of each gradient exact.
    BackwardInputs bin;
    bin.out = sh.rows(out, qc);
    bin.lse = sh.lse_rows(lse, qc);
    bin.dout = sh.rows(dout, qc);
    Gradients g;
    g.dq = sh.view(gq, DType::f32, {B, size, Hq, D});
    g.dk = sh.view(gk, DType::f32, {B, size, Hkv, D});
    g.dv = sh.view(gv, DType::f32, {B, size, Hkv, D});
    plan.pair_plan(true, qc, kc).run_backward(sh.pair_inputs(qi, part, kk, vv), bin, g, stream);
    const std::size_t slot =
        static_cast<std::size_t>(std::find(sh.needs.begin(), sh.needs.end(), kc) - sh.needs.begin());
    scratch.add(dq_sum + qi * q_elems, gq, q_elems);
    scratch.add(dk_sum[slot], gk, kv_elems);
    scratch.add(dv_sum[slot], gv, kv_elems);
  });

  // The key chunks' gradients go home: to each owner the sums of its chunks this rank used; from
  // each rank that used one of this rank's chunks, its sum (chunk order on both sides).
  const std::size_t kv_bytes = static_cast<std::size_t>(kv_elems) * sizeof(float);
  std::vector<Transport::Send> sends;
  for (std::size_t slot = 0; slot < sh.needs.size(); ++slot)
    if (!sh.holds(sh.needs[slot]))
      for (const float* sum : {dk_sum[slot], dv_sum[slot]})
        sends.push_back({plan.chunks.owner(sh.needs[slot]), sum, kv_bytes});
  float* dk_local = scratch.filled(local_chunks * kv_elems, 0.0f);
  float* dv_local = scratch.filled(local_chunks * kv_elems, 0.0f);
  for (std::size_t slot = 0; slot < sh.needs.size(); ++slot)
    if (sh.holds(sh.needs[slot])) {
      scratch.add(dk_local + sh.local_index(sh.needs[slot]) * kv_elems, dk_sum[slot], kv_elems);
      scratch.add(dv_local + sh.local_index(sh.needs[slot]) * kv_elems, dv_sum[slot], kv_elems);
    }
  // From each other rank, in rank order, the sums of the chunks held here that it used.
  std::vector<int> back_chunk, back_peer;
  for (int peer = 0; peer < sh.world(); ++peer)
    if (peer != sh.rank())
      for (const int c : sh.all_needs[peer])
        if (sh.holds(c)) back_chunk.push_back(c), back_peer.push_back(peer);
  std::vector<Transport::Receive> receives;
  for (std::size_t i = 0; i < 2 * back_chunk.size(); ++i)
    receives.push_back({back_peer[i / 2], scratch.floats(kv_elems), kv_bytes});
  {
    const std::unique_ptr<Transport::Exchange> home = transport.post(sends, receives, sh.memory());
    for (std::size_t i = 0; i < back_chunk.size(); ++i) {
      home->wait(2 * i + 1);
      const std::int64_t at = sh.local_index(back_chunk[i]) * kv_elems;
      scratch.add(dk_local + at, static_cast<const float*>(receives[2 * i].data), kv_elems);
      scratch.add(dv_local + at, static_cast<const float*>(receives[2 * i + 1].data), kv_elems);
    }
  }
  for (std::size_t i = 0; i < local_chunks; ++i) {
    scratch.store(dq_sum + i * q_elems, sh.rows(dq, sh.mine[i]));
    scratch.store(dk_local + i * kv_elems, sh.rows(dk, sh.mine[i]));
    scratch.store(dv_local + i * kv_elems, sh.rows(dv, sh.mine[i]));
  }
  return stats;
}

}  // namespace

// ------------------------------------------------------------------ entry points
ShardedPlan::ShardedPlan(const Problem& local, const Sharding& sharding, int world)
    : impl_(std::make_unique<Impl>(local, sharding, world, true, local.backward)) {}
ShardedPlan::~ShardedPlan() = default;
ShardedPlan::ShardedPlan(ShardedPlan&&) noexcept = default;
ShardedPlan& ShardedPlan::operator=(ShardedPlan&&) noexcept = default;

Stats ShardedPlan::run(Transport& transport, const TensorView& q, const TensorView& k, const TensorView& v,
                       const Pattern& pattern, const TensorView& out, const TensorView& lse, Stream stream) {
  return run_forward(*impl_, transport, q, k, v, pattern, out, lse, stream);
}

Stats ShardedPlan::run_backward(Transport& transport, const TensorView& q, const TensorView& k, const TensorView& v,
                                const Pattern& pattern, const TensorView& out, const TensorView& lse,
                                const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                const TensorView& dv, Stream stream) {
  return distributed::run_backward(*impl_, transport, q, k, v, pattern, out, lse, dout, dq, dk, dv, stream);
}

Stats attention(Transport& transport, const Problem& local, const Sharding& sharding, const TensorView& q,
                const TensorView& k, const TensorView& v, const Pattern& pattern, const TensorView& out,
                const TensorView& lse, Stream stream) {
  const ShardedPlan::Impl plan(local, sharding, transport.world(), true, false);
  return run_forward(plan, transport, q, k, v, pattern, out, lse, stream);
}

Stats attention_backward(Transport& transport, const Problem& local, const Sharding& sharding, const TensorView& q,
                         const TensorView& k, const TensorView& v, const Pattern& pattern,
                         const TensorView& out, const TensorView& lse, const TensorView& dout, const TensorView& dq,
                         const TensorView& dk, const TensorView& dv, Stream stream) {
  Problem backward = local;
  backward.backward = true;
  const ShardedPlan::Impl plan(backward, sharding, transport.world(), false, true);
  return run_backward(plan, transport, q, k, v, pattern, out, lse, dout, dq, dk, dv, stream);
}

}  // namespace bsattn::distributed
