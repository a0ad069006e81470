// Context parallelism on the CPU engine (include/bsattn/distributed.hpp): the chunks a rank's rows
// use, their exchange, one Plan per (query chunk, key chunk) pair and the merge by LSE.
#include "bsattn/distributed.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <string>

#include "bsattn/merge.hpp"
#include "bsattn/plan.hpp"

namespace bsattn::distributed {

// ------------------------------------------------------------------ LocalGroup
struct LocalGroup::State {
  explicit State(int n) : world(n), gathered(n), mailbox(static_cast<std::size_t>(n) * n) {}
  int world;
  std::mutex mutex;
  std::condition_variable changed;
  // all_gather: ranks deposit in turn; the last one publishes the round and wakes the others.
  std::vector<std::vector<int>> gathered, published;
  int deposited = 0;
  std::uint64_t round = 0;
  // exchange: mailbox[from * world + to], messages in posting order.
  std::vector<std::deque<std::vector<unsigned char>>> mailbox;
};

namespace {

class LocalTransport final : public Transport {
 public:
  LocalTransport(std::shared_ptr<LocalGroup::State> state, int rank) : state_(std::move(state)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return state_->world; }

  std::vector<std::vector<int>> all_gather(const std::vector<int>& mine) override {
    LocalGroup::State& s = *state_;
    std::unique_lock<std::mutex> lock(s.mutex);
    const std::uint64_t round = s.round;
    s.gathered[rank_] = mine;
    if (++s.deposited == s.world) {
      s.published = s.gathered;
      s.deposited = 0;
      ++s.round;
      s.changed.notify_all();
    } else {
      s.changed.wait(lock, [&] { return s.round != round; });
    }
    return s.published;  // stays valid until every rank of the next round has deposited
  }

  // Sends are copied into the peers' mailboxes at once; receive i is taken from its mailbox when
  // waited for (the receives before it from the same peer first, which keeps posting order).
  class LocalExchange final : public Exchange {
   public:
    LocalExchange(LocalTransport& t, std::vector<Receive> receives)
        : t_(t), receives_(std::move(receives)), done_(receives_.size(), false) {}
    ~LocalExchange() override {  // the sends were copied at posting: only receives can be pending
      try {
        for (std::size_t i = 0; i < receives_.size(); ++i) wait(i);
      } catch (const Error&) {  // a size mismatch, already thrown to whoever waited for it
      }
    }
    void wait(std::size_t receive) override {
      LocalGroup::State& s = *t_.state_;
      std::unique_lock<std::mutex> lock(s.mutex);
      for (std::size_t i = 0; i <= receive && i < receives_.size(); ++i) {
        const Receive& m = receives_[i];
        if (done_[i] || (i != receive && m.peer != receives_[receive].peer)) continue;
        auto& box = s.mailbox[static_cast<std::size_t>(m.peer) * s.world + t_.rank_];
        s.changed.wait(lock, [&] { return !box.empty(); });
        if (box.front().size() != m.bytes)
          throw Error("transport", "rank " + std::to_string(t_.rank_) + " expected " + std::to_string(m.bytes) +
                                       " bytes from rank " + std::to_string(m.peer) + ", got " +
                                       std::to_string(box.front().size()));
        std::memcpy(m.data, box.front().data(), m.bytes);
        box.pop_front();
        done_[i] = true;
      }
    }

   private:
    LocalTransport& t_;
    std::vector<Receive> receives_;
    std::vector<bool> done_;
  };

  std::unique_ptr<Exchange> post(const std::vector<Send>& sends, const std::vector<Receive>& receives) override {
    LocalGroup::State& s = *state_;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      for (const Send& m : sends) {
        const auto* p = static_cast<const unsigned char*>(m.data);
        s.mailbox[static_cast<std::size_t>(rank_) * s.world + m.peer].emplace_back(p, p + m.bytes);
      }
    }
    s.changed.notify_all();
    return std::make_unique<LocalExchange>(*this, receives);
  }

 private:
  std::shared_ptr<LocalGroup::State> state_;
  int rank_;
};

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
  t.data = static_cast<unsigned char*>(t.data) + begin * t.stride[dim] * static_cast<std::int64_t>(element_size(t.dtype));
  t.shape[dim] = length;
  return t;
}

void expect_shape(const TensorView& t, const char* name, std::initializer_list<std::int64_t> shape, DType dtype) {
  const bool same_rank = t.rank == static_cast<int>(shape.size());
  bool same = same_rank && t.dtype == dtype && t.device == Device::cpu;
  int d = 0;
  for (const std::int64_t n : shape) same = same && t.shape[d++] == n;
  if (!same) {
    std::string want = "[";
    for (const std::int64_t n : shape) want += (want.size() > 1 ? ", " : "") + std::to_string(n);
    throw Error(name, "expected a CPU " + std::string(to_string(dtype)) + " tensor " + want + "], got " +
                          std::string(to_string(t.dtype)) + " " + t.shape_string() + " on " + to_string(t.device));
  }
}

// K or V of one chunk, all batches, packed contiguously (what travels).
std::vector<unsigned char> pack_chunk(const TensorView& kv, std::int64_t begin, std::int64_t tokens) {
  const std::size_t row = static_cast<std::size_t>(kv.shape[3]) * element_size(kv.dtype);
  std::vector<unsigned char> packed(static_cast<std::size_t>(kv.shape[0] * tokens * kv.shape[2]) * row);
  unsigned char* dst = packed.data();
  const std::int64_t es = static_cast<std::int64_t>(element_size(kv.dtype));
  for (std::int64_t b = 0; b < kv.shape[0]; ++b)
    for (std::int64_t t = begin; t < begin + tokens; ++t)
      for (std::int64_t h = 0; h < kv.shape[2]; ++h, dst += row)
        std::memcpy(dst, static_cast<const unsigned char*>(kv.data) + (b * kv.stride[0] + t * kv.stride[1] + h * kv.stride[2]) * es, row);
  return packed;
}

}  // namespace

LocalGroup::LocalGroup(int world) {
  if (world < 1) throw Error("world", "at least one rank, got " + std::to_string(world));
  state_ = std::make_shared<State>(world);
}
LocalGroup::~LocalGroup() = default;

std::unique_ptr<Transport> LocalGroup::transport(int rank) {
  if (rank < 0 || rank >= state_->world)
    throw Error("rank", "expected 0.." + std::to_string(state_->world - 1) + ", got " + std::to_string(rank));
  return std::make_unique<LocalTransport>(state_, rank);
}

// ------------------------------------------------------------------ attention
Stats attention(Transport& transport, const Problem& local, const Sharding& sharding, const TensorView& q,
                const TensorView& k, const TensorView& v, const TensorView& block_mask, const TensorView& out,
                const TensorView& lse) {
  const int world = transport.world(), rank = transport.rank();
  const std::int64_t B = local.batch, S = local.max_seqlen_q, Hq = local.heads_q, Hkv = local.heads_kv,
                     D = local.head_dim;
  if (local.device != Device::cpu)
    throw Error("problem.device", "the C++ context-parallel entry runs the CPU engine; on GPUs use Python's "
                                  "bsattn.distributed");
  if (local.max_seqlen_kv != local.max_seqlen_q)
    throw Error("problem.max_seqlen_kv", "a rank holds the same tokens of Q, K and V: expected " + std::to_string(S) +
                                             ", got " + std::to_string(local.max_seqlen_kv));
  if (local.q_layout != QLayout::batched || local.kv_layout != KVLayout::contiguous || local.mask.any() ||
      local.proxy != Proxy::off || local.tile_m != 0 || local.tile_n != 0)
    throw Error("problem", "batched Q, contiguous K/V, no mask (Sharding::causal), no proxy and no tile override");
  if (local.format != Format::all_blocks && local.format != Format::bitmask)
    throw Error("problem.format", "all_blocks or bitmask (the rank's rows over the global key blocks)");
  if (local.format == Format::bitmask && (!local.has_partial || local.has_full))
    throw Error("problem.has_full", "one bitmask of kept blocks (has_partial, no full set)");
  Chunks chunks;
  chunks.per_rank = sharding.layout == Layout::zigzag ? 2 : 1;
  chunks.world = world;
  chunks.count = world * chunks.per_rank;
  if (S % chunks.per_rank != 0)
    throw Error("problem.max_seqlen_q", "a zigzag shard holds two equal chunks: " + std::to_string(S) + " tokens");
  chunks.size = S / chunks.per_rank;
  const int bq = local.block.q, bk = local.block.kv;
  if (chunks.size == 0 || chunks.size % bq != 0 || chunks.size % bk != 0)
    throw Error("problem.block", "a chunk of " + std::to_string(chunks.size) + " tokens is not a whole number of blocks (" +
                                     std::to_string(bq) + ", " + std::to_string(bk) + ")");
  const std::int64_t q_blocks = chunks.size / bq, k_blocks = chunks.size / bk;  // per chunk
  const std::int64_t global_k_blocks = k_blocks * chunks.count, words = (global_k_blocks + 31) / 32;
  expect_shape(q, "q", {B, S, Hq, D}, local.dtype);
  expect_shape(k, "k", {B, S, Hkv, D}, local.dtype);
  expect_shape(v, "v", {B, S, Hkv, D}, local.dtype);
  expect_shape(out, "out", {B, S, Hq, D}, local.out_dtype);
  if (lse.defined()) expect_shape(lse, "lse", {B, Hq, S}, DType::f32);
  const bool sparse = local.format == Format::bitmask;
  const std::int64_t Bs = sparse ? local.sparsity_batch : 1, Hs = sparse ? local.sparsity_heads : 1;
  if (sparse) expect_shape(block_mask, "block_mask", {Bs, Hs, q_blocks * chunks.per_rank, words}, DType::u32);

  // The attention of a (query chunk, key chunk) pair into fp32 parts: one plan serves every pair,
  // and with the causal mask a second one the diagonal pairs (causal within the chunk). Made
  // before anything is sent, so that a problem the engine refuses throws here.
  Problem pair = local;
  pair.max_seqlen_q = pair.max_seqlen_kv = static_cast<int>(chunks.size);
  pair.out_dtype = DType::f32;
  pair.mask.alignment = Alignment::top_left;
  Plan off_diagonal(pair);
  pair.mask.causal = true;
  const std::unique_ptr<Plan> diagonal = sharding.causal ? std::make_unique<Plan>(pair) : nullptr;

  const std::vector<int> mine = chunks.of_rank(rank);
  const auto local_index = [&](int chunk) {
    return static_cast<int>(std::find(mine.begin(), mine.end(), chunk) - mine.begin());
  };
  const auto bit = [&](std::int64_t bs, std::int64_t hs, std::int64_t row, std::int64_t col) {
    const auto* w = static_cast<const std::uint32_t*>(block_mask.data) + bs * block_mask.stride[0] +
                    hs * block_mask.stride[1] + row * block_mask.stride[2] + (col / 32) * block_mask.stride[3];
    return (*w >> (col % 32)) & 1u;
  };
  // Key chunk kc is used by query chunk qc: not in its causal future, and some block kept.
  const auto used = [&](int qc, int kc) {
    if (sharding.causal && kc > qc) return false;
    if (!sparse) return true;
    const std::int64_t row0 = local_index(qc) * q_blocks;
    for (std::int64_t bs = 0; bs < Bs; ++bs)
      for (std::int64_t hs = 0; hs < Hs; ++hs)
        for (std::int64_t r = row0; r < row0 + q_blocks; ++r)
          for (std::int64_t c = kc * k_blocks; c < (kc + 1) * k_blocks; ++c)
            if (bit(bs, hs, r, c)) return true;
    return false;
  };
  // keys[i]: the key chunks local chunk i's rows use; needs: their union, ascending.
  std::vector<std::vector<int>> keys(mine.size());
  std::vector<int> needs;
  for (int kc = 0; kc < chunks.count; ++kc) {
    bool needed = false;
    for (std::size_t i = 0; i < mine.size(); ++i)
      if (used(mine[i], kc)) keys[i].push_back(kc), needed = true;
    if (needed) needs.push_back(kc);
  }
  const std::vector<std::vector<int>> all_needs = transport.all_gather(needs);

  // The exchange: this rank's chunks to the ranks that use them, the chunks it uses from their
  // owners (K, then V of each chunk, in chunk order on both sides).
  const std::size_t chunk_bytes = static_cast<std::size_t>(B * chunks.size * Hkv * D) * element_size(local.dtype);
  std::vector<std::vector<unsigned char>> packed;
  std::vector<Transport::Send> sends;
  for (int peer = 0; peer < world; ++peer) {
    if (peer == rank) continue;
    for (const int c : all_needs[peer]) {
      if (chunks.owner(c) != rank) continue;
      for (const TensorView* kv : {&k, &v}) {
        packed.push_back(pack_chunk(*kv, local_index(c) * chunks.size, chunks.size));
        sends.push_back({peer, packed.back().data(), chunk_bytes});
      }
    }
  }
  // Received chunks: [B, chunk, Hkv, D] contiguous, K then V.
  std::vector<std::vector<unsigned char>> received(2 * needs.size());
  std::vector<Transport::Receive> receives;
  Stats stats;
  for (std::size_t i = 0; i < needs.size(); ++i) {
    if (chunks.owner(needs[i]) == rank) continue;
    for (int kv = 0; kv < 2; ++kv) {
      received[2 * i + kv].resize(chunk_bytes);
      receives.push_back({chunks.owner(needs[i]), received[2 * i + kv].data(), chunk_bytes});
    }
    ++stats.chunks_received;
    stats.bytes_received += 2 * chunk_bytes;
  }
  stats.bytes_all_gather = static_cast<std::size_t>(chunks.count - chunks.per_rank) * 2 * chunk_bytes;
  // receive_of[slot]: the index of chunk needs[slot]'s K receive (V follows), -1 for a local chunk.
  std::vector<int> receive_of(needs.size(), -1);
  for (std::size_t i = 0, r = 0; i < needs.size(); ++i)
    if (chunks.owner(needs[i]) != rank) receive_of[i] = static_cast<int>(r), r += 2;
  const std::unique_ptr<Transport::Exchange> exchange = transport.post(sends, receives);

  // Every (query chunk, key chunk) pair into its fp32 part; a query chunk's parts are merged once
  // all are in. The pairs whose key chunk this rank holds run first, while the others travel; then
  // each received chunk's pairs as it lands.
  const std::int64_t pair_words = (k_blocks + 31) / 32;
  const std::int64_t out_elems = B * chunks.size * Hq * D, lse_elems = B * Hq * chunks.size;
  std::vector<std::vector<float>> part_out(mine.size()), part_lse(mine.size());
  for (std::size_t i = 0; i < mine.size(); ++i) {
    part_out[i].resize(static_cast<std::size_t>(keys[i].size() * out_elems));
    part_lse[i].resize(static_cast<std::size_t>(keys[i].size() * lse_elems));
  }
  const auto attend = [&](std::size_t qi, std::size_t part, int kc, std::size_t slot) {
    const int qc = mine[qi];
    TensorView k_chunk, v_chunk;
    if (chunks.owner(kc) == rank) {
      k_chunk = slice(k, 1, local_index(kc) * chunks.size, chunks.size);
      v_chunk = slice(v, 1, local_index(kc) * chunks.size, chunks.size);
    } else {
      k_chunk = TensorView::contiguous(received[2 * slot].data(), local.dtype, {B, chunks.size, Hkv, D});
      v_chunk = TensorView::contiguous(received[2 * slot + 1].data(), local.dtype, {B, chunks.size, Hkv, D});
    }
    Inputs in;
    in.q = slice(q, 1, local_index(qc) * chunks.size, chunks.size);
    in.k = k_chunk;
    in.v = v_chunk;
    std::vector<std::uint32_t> bits;
    if (sparse) {  // the pair's bitmask: the query chunk's rows, the key chunk's columns
      bits.assign(static_cast<std::size_t>(Bs * Hs * q_blocks * pair_words), 0u);
      const std::int64_t row0 = local_index(qc) * q_blocks;
      for (std::int64_t bs = 0; bs < Bs; ++bs)
        for (std::int64_t hs = 0; hs < Hs; ++hs)
          for (std::int64_t r = 0; r < q_blocks; ++r)
            for (std::int64_t c = 0; c < k_blocks; ++c)
              if (bit(bs, hs, row0 + r, kc * k_blocks + c))
                bits[static_cast<std::size_t>(((bs * Hs + hs) * q_blocks + r) * pair_words + c / 32)] |= 1u << (c % 32);
      in.partial.bits = TensorView::contiguous(bits.data(), DType::u32, {Bs, Hs, q_blocks, pair_words});
    }
    Outputs o;
    o.out = TensorView::contiguous(part_out[qi].data() + part * out_elems, DType::f32, {B, chunks.size, Hq, D});
    o.lse = TensorView::contiguous(part_lse[qi].data() + part * lse_elems, DType::f32, {B, Hq, chunks.size});
    (diagonal && kc == qc ? *diagonal : off_diagonal).run(in, o);
    ++stats.pairs_attended;
  };
  // The pairs of key chunk needs[slot], for every local query chunk that uses it.
  const auto attend_key_chunk = [&](std::size_t slot) {
    for (std::size_t qi = 0; qi < mine.size(); ++qi) {
      const auto at = std::find(keys[qi].begin(), keys[qi].end(), needs[slot]);
      if (at != keys[qi].end()) attend(qi, static_cast<std::size_t>(at - keys[qi].begin()), needs[slot], slot);
    }
  };
  for (std::size_t slot = 0; slot < needs.size(); ++slot)
    if (receive_of[slot] < 0) attend_key_chunk(slot);
  stats.pairs_before_first_wait = -1;
  for (std::size_t slot = 0; slot < needs.size(); ++slot) {
    if (receive_of[slot] < 0) continue;
    if (stats.pairs_before_first_wait < 0) stats.pairs_before_first_wait = stats.pairs_attended;
    exchange->wait(static_cast<std::size_t>(receive_of[slot]) + 1);  // K, then V
    attend_key_chunk(slot);
  }
  if (stats.pairs_before_first_wait < 0) stats.pairs_before_first_wait = stats.pairs_attended;  // nothing received

  for (std::size_t qi = 0; qi < mine.size(); ++qi) {
    const std::int64_t begin = local_index(mine[qi]) * chunks.size;
    const TensorView out_rows = slice(out, 1, begin, chunks.size);
    const TensorView lse_rows = lse.defined() ? slice(lse, 2, begin, chunks.size) : lse;
    const std::int64_t n = static_cast<std::int64_t>(keys[qi].size());
    if (n == 0) {  // no key chunk: every row is empty
      std::vector<float> empty_out(static_cast<std::size_t>(out_elems), 0.0f);
      std::vector<float> empty_lse(static_cast<std::size_t>(lse_elems), -std::numeric_limits<float>::infinity());
      merge_states(TensorView::contiguous(empty_out.data(), DType::f32, {1, B, chunks.size, Hq, D}),
                   TensorView::contiguous(empty_lse.data(), DType::f32, {1, B, Hq, chunks.size}), out_rows, lse_rows);
      continue;
    }
    merge_states(TensorView::contiguous(part_out[qi].data(), DType::f32, {n, B, chunks.size, Hq, D}),
                 TensorView::contiguous(part_lse[qi].data(), DType::f32, {n, B, Hq, chunks.size}), out_rows, lse_rows);
  }
  return stats;
}

}  // namespace bsattn::distributed
