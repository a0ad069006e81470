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

#include "bsattn/backward.hpp"
#include "bsattn/cpu/numeric.hpp"
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

// ------------------------------------------------------------------ shards
namespace {

// What the forward and the backward share: the rank's chunks and the key chunks their rows use
// (agreed with the other ranks by an all-gather), the plans of a chunk pair, and the exchange of
// the used K/V chunks, posted so that the caller attends the chunks it holds while the others
// travel.
class Shards {
 public:
  // Checks the shapes, makes the pair plans (backward: plans for run_backward, O given in
  // local.out_dtype) and finds the chunks this rank's rows use; nothing is sent (agree()).
  Shards(Transport& transport, const Problem& local, const Sharding& sharding, const TensorView& q,
         const TensorView& k, const TensorView& v, const TensorView& block_mask, const TensorView& out,
         const TensorView& lse, bool backward)
      : transport_(transport), local_(local), q_(q), k_(k), v_(v), block_mask_(block_mask) {
    world_ = transport.world();
    rank_ = transport.rank();
    B = local.batch, S = local.max_seqlen_q, Hq = local.heads_q, Hkv = local.heads_kv, D = local.head_dim;
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
    chunks.per_rank = sharding.layout == Layout::zigzag ? 2 : 1;
    chunks.world = world_;
    chunks.count = world_ * chunks.per_rank;
    if (S % chunks.per_rank != 0)
      throw Error("problem.max_seqlen_q", "a zigzag shard holds two equal chunks: " + std::to_string(S) + " tokens");
    chunks.size = S / chunks.per_rank;
    const int bq = local.block.q, bk = local.block.kv;
    if (chunks.size == 0 || chunks.size % bq != 0 || chunks.size % bk != 0)
      throw Error("problem.block", "a chunk of " + std::to_string(chunks.size) +
                                       " tokens is not a whole number of blocks (" + std::to_string(bq) + ", " +
                                       std::to_string(bk) + ")");
    q_blocks_ = chunks.size / bq;
    k_blocks_ = chunks.size / bk;
    const std::int64_t words = (k_blocks_ * chunks.count + 31) / 32;
    expect_shape(q, "q", {B, S, Hq, D}, local.dtype);
    expect_shape(k, "k", {B, S, Hkv, D}, local.dtype);
    expect_shape(v, "v", {B, S, Hkv, D}, local.dtype);
    expect_shape(out, "out", {B, S, Hq, D}, local.out_dtype);
    if (lse.defined() || backward) expect_shape(lse, "lse", {B, Hq, S}, DType::f32);
    sparse_ = local.format == Format::bitmask;
    Bs_ = sparse_ ? local.sparsity_batch : 1;
    Hs_ = sparse_ ? local.sparsity_heads : 1;
    if (sparse_) expect_shape(block_mask, "block_mask", {Bs_, Hs_, q_blocks_ * chunks.per_rank, words}, DType::u32);

    // A (query chunk, key chunk) pair: one plan serves every pair, and with the causal mask a
    // second one the diagonal pairs (causal within the chunk).
    Problem pair = local;
    pair.max_seqlen_q = pair.max_seqlen_kv = static_cast<int>(chunks.size);
    if (!backward) pair.out_dtype = DType::f32;  // the forward's parts, merged in fp32
    pair.backward = backward;
    pair.mask.alignment = Alignment::top_left;
    off_diagonal_ = std::make_unique<Plan>(pair);
    pair.mask.causal = true;
    if (sharding.causal) diagonal_ = std::make_unique<Plan>(pair);

    mine = chunks.of_rank(rank_);
    keys.resize(mine.size());
    for (int kc = 0; kc < chunks.count; ++kc) {
      bool needed = false;
      for (std::size_t i = 0; i < mine.size(); ++i)
        if (used(mine[i], kc, sharding.causal)) keys[i].push_back(kc), needed = true;
      if (needed) needs.push_back(kc);
    }
    chunk_elems = B * chunks.size * Hkv * D;
  }

  // The first collective call: every rank's needed chunks (after the caller's last check, so that
  // bad arguments throw before anything is sent).
  void agree() { all_needs = transport_.all_gather(needs); }

  int rank() const { return rank_; }
  int world() const { return world_; }
  int local_index(int chunk) const {
    return static_cast<int>(std::find(mine.begin(), mine.end(), chunk) - mine.begin());
  }
  bool holds(int chunk) const { return chunks.owner(chunk) == rank_; }

  // Posts the exchange of the used K/V chunks: this rank's to the ranks that use them, the others
  // from their owners (K, then V of each chunk, in chunk order on both sides), into received_.
  std::unique_ptr<Transport::Exchange> post_key_chunks(Stats& stats) {
    const std::size_t bytes = static_cast<std::size_t>(chunk_elems) * element_size(local_.dtype);
    std::vector<Transport::Send> sends;
    for (int peer = 0; peer < world_; ++peer) {
      if (peer == rank_) continue;
      for (const int c : all_needs[peer]) {
        if (!holds(c)) continue;
        for (const TensorView* kv : {&k_, &v_}) {
          packed_.push_back(pack_chunk(*kv, local_index(c) * chunks.size, chunks.size));
          sends.push_back({peer, packed_.back().data(), bytes});
        }
      }
    }
    received_.assign(2 * needs.size(), {});
    receive_of_.assign(needs.size(), -1);
    std::vector<Transport::Receive> receives;
    for (std::size_t i = 0; i < needs.size(); ++i) {
      if (holds(needs[i])) continue;
      receive_of_[i] = static_cast<int>(receives.size());
      for (int kv = 0; kv < 2; ++kv) {
        received_[2 * i + kv].resize(bytes);
        receives.push_back({chunks.owner(needs[i]), received_[2 * i + kv].data(), bytes});
      }
      ++stats.chunks_received;
      stats.bytes_received += 2 * bytes;
    }
    stats.bytes_all_gather = static_cast<std::size_t>(chunks.count - chunks.per_rank) * 2 * bytes;
    return transport_.post(sends, receives);
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
        kk = slice(k_, 1, local_index(kc) * chunks.size, chunks.size);
        vv = slice(v_, 1, local_index(kc) * chunks.size, chunks.size);
      } else {
        kk = TensorView::contiguous(received_[2 * slot].data(), local_.dtype, {B, chunks.size, Hkv, D});
        vv = TensorView::contiguous(received_[2 * slot + 1].data(), local_.dtype, {B, chunks.size, Hkv, D});
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

  // The pair's inputs: the query chunk's rows and, with a bitmask, its bits over the key chunk's
  // blocks (kept alive in `bits`).
  Inputs pair_inputs(int qc, int kc, const TensorView& kk, const TensorView& vv, std::vector<std::uint32_t>& bits) const {
    Inputs in;
    in.q = rows(q_, qc);
    in.k = kk;
    in.v = vv;
    if (sparse_) {
      const std::int64_t pair_words = (k_blocks_ + 31) / 32, row0 = local_index(qc) * q_blocks_;
      bits.assign(static_cast<std::size_t>(Bs_ * Hs_ * q_blocks_ * pair_words), 0u);
      for (std::int64_t bs = 0; bs < Bs_; ++bs)
        for (std::int64_t hs = 0; hs < Hs_; ++hs)
          for (std::int64_t r = 0; r < q_blocks_; ++r)
            for (std::int64_t c = 0; c < k_blocks_; ++c)
              if (bit(bs, hs, row0 + r, kc * k_blocks_ + c))
                bits[static_cast<std::size_t>(((bs * Hs_ + hs) * q_blocks_ + r) * pair_words + c / 32)] |= 1u << (c % 32);
      in.partial.bits = TensorView::contiguous(bits.data(), DType::u32, {Bs_, Hs_, q_blocks_, pair_words});
    }
    return in;
  }
  Plan& plan(int qc, int kc) { return diagonal_ && kc == qc ? *diagonal_ : *off_diagonal_; }

  // The rows of local chunk `chunk` in a [B, S, H, D] tensor, or in an LSE [B, H, S].
  TensorView rows(const TensorView& t, int chunk) const { return slice(t, 1, local_index(chunk) * chunks.size, chunks.size); }
  TensorView lse_rows(const TensorView& lse, int chunk) const {
    return lse.defined() ? slice(lse, 2, local_index(chunk) * chunks.size, chunks.size) : lse;
  }

  std::int64_t B = 0, S = 0, Hq = 0, Hkv = 0, D = 0;
  Chunks chunks;
  std::vector<int> mine;                     // this rank's chunks, in its local order
  std::vector<std::vector<int>> keys;        // keys[i]: the key chunks local chunk i's rows use
  std::vector<int> needs;                    // their union, ascending
  std::vector<std::vector<int>> all_needs;   // every rank's needs
  std::int64_t chunk_elems = 0;              // elements of one K or V chunk, all batches

 private:
  bool bit(std::int64_t bs, std::int64_t hs, std::int64_t row, std::int64_t col) const {
    const auto* w = static_cast<const std::uint32_t*>(block_mask_.data) + bs * block_mask_.stride[0] +
                    hs * block_mask_.stride[1] + row * block_mask_.stride[2] + (col / 32) * block_mask_.stride[3];
    return (*w >> (col % 32)) & 1u;
  }
  // Key chunk kc is used by query chunk qc: not in its causal future, and some block kept.
  bool used(int qc, int kc, bool causal) const {
    if (causal && kc > qc) return false;
    if (!sparse_) return true;
    const std::int64_t row0 = local_index(qc) * q_blocks_;
    for (std::int64_t bs = 0; bs < Bs_; ++bs)
      for (std::int64_t hs = 0; hs < Hs_; ++hs)
        for (std::int64_t r = row0; r < row0 + q_blocks_; ++r)
          for (std::int64_t c = kc * k_blocks_; c < (kc + 1) * k_blocks_; ++c)
            if (bit(bs, hs, r, c)) return true;
    return false;
  }

  Transport& transport_;
  const Problem& local_;
  TensorView q_, k_, v_, block_mask_;
  int world_ = 1, rank_ = 0;
  std::int64_t q_blocks_ = 0, k_blocks_ = 0, Bs_ = 1, Hs_ = 1;
  bool sparse_ = false;
  std::unique_ptr<Plan> off_diagonal_, diagonal_;
  std::vector<std::vector<unsigned char>> packed_, received_;  // sent and received K/V chunks
  std::vector<int> receive_of_;  // per needed chunk: its K receive's index (V follows), -1 if held
};

// Adds src into dst from element `offset` on (fp32 sums of gradients).
void add_into(std::vector<float>& dst, std::size_t offset, const std::vector<float>& src) {
  for (std::size_t i = 0; i < src.size(); ++i) dst[offset + i] += src[i];
}

// Writes fp32 values (contiguous [d0, d1, d2, d3]) into a rank-4 view of dtype f32, f16 or bf16
// with any strides but a contiguous last dimension.
void store(const std::vector<float>& src, std::size_t offset, const TensorView& dst) {
  const std::int64_t es = static_cast<std::int64_t>(element_size(dst.dtype)), n3 = dst.shape[3];
  const float* from = src.data() + offset;
  for (std::int64_t i0 = 0; i0 < dst.shape[0]; ++i0)
    for (std::int64_t i1 = 0; i1 < dst.shape[1]; ++i1)
      for (std::int64_t i2 = 0; i2 < dst.shape[2]; ++i2, from += n3) {
        auto* row = static_cast<unsigned char*>(dst.data) + (i0 * dst.stride[0] + i1 * dst.stride[1] + i2 * dst.stride[2]) * es;
        for (std::int64_t j = 0; j < n3; ++j) {
          if (dst.dtype == DType::f32) reinterpret_cast<float*>(row)[j] = from[j];
          else if (dst.dtype == DType::bf16) reinterpret_cast<std::uint16_t*>(row)[j] = cpu::float_to_bf16(from[j]);
          else reinterpret_cast<std::uint16_t*>(row)[j] = cpu::float_to_half(from[j]);
        }
      }
}

}  // namespace

// ------------------------------------------------------------------ attention
Stats attention(Transport& transport, const Problem& local, const Sharding& sharding, const TensorView& q,
                const TensorView& k, const TensorView& v, const TensorView& block_mask, const TensorView& out,
                const TensorView& lse) {
  Shards sh(transport, local, sharding, q, k, v, block_mask, out, lse, false);
  sh.agree();
  Stats stats;
  const std::unique_ptr<Transport::Exchange> exchange = sh.post_key_chunks(stats);
  // Every pair into its fp32 part; a query chunk's parts are merged once all are in.
  const std::int64_t out_elems = sh.B * sh.chunks.size * sh.Hq * sh.D, lse_elems = sh.B * sh.Hq * sh.chunks.size;
  std::vector<std::vector<float>> part_out(sh.mine.size()), part_lse(sh.mine.size());
  for (std::size_t i = 0; i < sh.mine.size(); ++i) {
    part_out[i].resize(static_cast<std::size_t>(sh.keys[i].size() * out_elems));
    part_lse[i].resize(static_cast<std::size_t>(sh.keys[i].size() * lse_elems));
  }
  sh.for_each_pair(*exchange, stats, [&](std::size_t qi, std::size_t part, int kc, const TensorView& kk,
                                         const TensorView& vv) {
    std::vector<std::uint32_t> bits;
    const Inputs in = sh.pair_inputs(sh.mine[qi], kc, kk, vv, bits);
    Outputs o;
    o.out = TensorView::contiguous(part_out[qi].data() + part * out_elems, DType::f32, {sh.B, sh.chunks.size, sh.Hq, sh.D});
    o.lse = TensorView::contiguous(part_lse[qi].data() + part * lse_elems, DType::f32, {sh.B, sh.Hq, sh.chunks.size});
    sh.plan(sh.mine[qi], kc).run(in, o);
  });
  for (std::size_t qi = 0; qi < sh.mine.size(); ++qi) {
    const TensorView out_rows = sh.rows(out, sh.mine[qi]), lse_rows = sh.lse_rows(lse, sh.mine[qi]);
    const std::int64_t n = static_cast<std::int64_t>(sh.keys[qi].size());
    if (n == 0) {  // no key chunk: every row is empty
      std::vector<float> empty_out(static_cast<std::size_t>(out_elems), 0.0f);
      std::vector<float> empty_lse(static_cast<std::size_t>(lse_elems), -std::numeric_limits<float>::infinity());
      merge_states(TensorView::contiguous(empty_out.data(), DType::f32, {1, sh.B, sh.chunks.size, sh.Hq, sh.D}),
                   TensorView::contiguous(empty_lse.data(), DType::f32, {1, sh.B, sh.Hq, sh.chunks.size}), out_rows,
                   lse_rows);
      continue;
    }
    merge_states(TensorView::contiguous(part_out[qi].data(), DType::f32, {n, sh.B, sh.chunks.size, sh.Hq, sh.D}),
                 TensorView::contiguous(part_lse[qi].data(), DType::f32, {n, sh.B, sh.Hq, sh.chunks.size}), out_rows,
                 lse_rows);
  }
  return stats;
}

// ------------------------------------------------------------------ attention_backward
Stats attention_backward(Transport& transport, const Problem& local, const Sharding& sharding, const TensorView& q,
                         const TensorView& k, const TensorView& v, const TensorView& block_mask,
                         const TensorView& out, const TensorView& lse, const TensorView& dout, const TensorView& dq,
                         const TensorView& dk, const TensorView& dv) {
  const auto gradient_of = [&](const TensorView& g, const char* name, const TensorView& like) {
    if (g.dtype != DType::f32 && g.dtype != local.dtype)
      throw Error(name, "expected f32 or the inputs' " + std::string(to_string(local.dtype)) + ", got " +
                            std::string(to_string(g.dtype)));
    expect_shape(g, name, {like.shape[0], like.shape[1], like.shape[2], like.shape[3]}, g.dtype);
    if (g.stride[3] != 1) throw Error(name, "the last dimension must be contiguous");
  };
  Shards sh(transport, local, sharding, q, k, v, block_mask, out, lse, true);
  expect_shape(dout, "dout", {sh.B, sh.S, sh.Hq, sh.D}, local.out_dtype);
  gradient_of(dq, "dq", q);
  gradient_of(dk, "dk", k);
  gradient_of(dv, "dv", v);
  sh.agree();
  Stats stats;
  const std::unique_ptr<Transport::Exchange> exchange = sh.post_key_chunks(stats);
  // fp32 sums: dQ of each local chunk; dK, dV of every used key chunk (slot of `needs`).
  const std::int64_t q_elems = sh.B * sh.chunks.size * sh.Hq * sh.D, kv_elems = sh.chunk_elems;
  std::vector<float> dq_sum(static_cast<std::size_t>(sh.mine.size() * q_elems), 0.0f);
  std::vector<std::vector<float>> dk_sum(sh.needs.size()), dv_sum(sh.needs.size());
  std::vector<float> gq(static_cast<std::size_t>(q_elems)), gk(static_cast<std::size_t>(kv_elems)),
      gv(static_cast<std::size_t>(kv_elems));
  sh.for_each_pair(*exchange, stats, [&](std::size_t qi, std::size_t, int kc, const TensorView& kk,
                                         const TensorView& vv) {
    const int qc = sh.mine[qi];
    std::vector<std::uint32_t> bits;
    const Inputs in = sh.pair_inputs(qc, kc, kk, vv, bits);
    // The whole rows' O and LSE make the pair's share of each gradient exact.
    BackwardInputs bin;
    bin.out = sh.rows(out, qc);
    bin.lse = sh.lse_rows(lse, qc);
    bin.dout = sh.rows(dout, qc);
    Gradients g;
    g.dq = TensorView::contiguous(gq.data(), DType::f32, {sh.B, sh.chunks.size, sh.Hq, sh.D});
    g.dk = TensorView::contiguous(gk.data(), DType::f32, {sh.B, sh.chunks.size, sh.Hkv, sh.D});
    g.dv = TensorView::contiguous(gv.data(), DType::f32, {sh.B, sh.chunks.size, sh.Hkv, sh.D});
    sh.plan(qc, kc).run_backward(in, bin, g);
    add_into(dq_sum, qi * q_elems, gq);
    const std::size_t slot = static_cast<std::size_t>(std::find(sh.needs.begin(), sh.needs.end(), kc) - sh.needs.begin());
    if (dk_sum[slot].empty()) {
      dk_sum[slot] = gk;
      dv_sum[slot] = gv;
    } else {
      add_into(dk_sum[slot], 0, gk);
      add_into(dv_sum[slot], 0, gv);
    }
  });

  // The key chunks' gradients go home: to each owner the sums of its chunks this rank used; from
  // each rank that used one of this rank's chunks, its sum (chunk order on both sides).
  const std::size_t kv_bytes = static_cast<std::size_t>(kv_elems) * sizeof(float);
  std::vector<Transport::Send> sends;
  for (std::size_t slot = 0; slot < sh.needs.size(); ++slot)
    if (!sh.holds(sh.needs[slot]))
      for (const std::vector<float>* sum : {&dk_sum[slot], &dv_sum[slot]})
        sends.push_back({sh.chunks.owner(sh.needs[slot]), sum->data(), kv_bytes});
  std::vector<float> dk_local(static_cast<std::size_t>(sh.mine.size() * kv_elems), 0.0f), dv_local(dk_local.size(), 0.0f);
  for (std::size_t slot = 0; slot < sh.needs.size(); ++slot)
    if (sh.holds(sh.needs[slot])) {
      add_into(dk_local, sh.local_index(sh.needs[slot]) * kv_elems, dk_sum[slot]);
      add_into(dv_local, sh.local_index(sh.needs[slot]) * kv_elems, dv_sum[slot]);
    }
  // From each other rank, in rank order, the sums of the chunks held here that it used.
  std::vector<int> back_chunk, back_peer;
  for (int peer = 0; peer < sh.world(); ++peer)
    if (peer != sh.rank())
      for (const int c : sh.all_needs[peer])
        if (sh.holds(c)) back_chunk.push_back(c), back_peer.push_back(peer);
  std::vector<std::vector<float>> back(2 * back_chunk.size(), std::vector<float>(static_cast<std::size_t>(kv_elems)));
  std::vector<Transport::Receive> receives;
  for (std::size_t i = 0; i < back.size(); ++i) receives.push_back({back_peer[i / 2], back[i].data(), kv_bytes});
  {
    const std::unique_ptr<Transport::Exchange> home = transport.post(sends, receives);
    for (std::size_t i = 0; i < back_chunk.size(); ++i) {
      home->wait(2 * i + 1);
      add_into(dk_local, sh.local_index(back_chunk[i]) * kv_elems, back[2 * i]);
      add_into(dv_local, sh.local_index(back_chunk[i]) * kv_elems, back[2 * i + 1]);
    }
  }
  for (std::size_t i = 0; i < sh.mine.size(); ++i) {
    store(dq_sum, i * q_elems, sh.rows(dq, sh.mine[i]));
    store(dk_local, i * kv_elems, sh.rows(dk, sh.mine[i]));
    store(dv_local, i * kv_elems, sh.rows(dv, sh.mine[i]));
  }
  return stats;
}

}  // namespace bsattn::distributed
