// Context parallelism (issue 15): block-sparse attention over a sequence sharded across ranks,
// the C++ counterpart of Python's bsattn.distributed (docs/PYTHON.md).
//
// The global sequence of S tokens is cut into chunks of whole Q and KV blocks: Layout::contiguous
// gives rank r chunk r of `world`; Layout::zigzag cuts 2 * world chunks and gives rank r chunks r
// and 2 * world - 1 - r, in that order in its tensors (balanced causal work). A rank holds its
// chunks' Q, K and V and the block pattern of its own query rows over the whole key sequence. The
// pattern says which key chunks its rows use: the ranks agree on that (an all-gather of small
// lists), each rank sends its chunks only to the ranks that use them, attends every used key chunk
// with the single-process Plan (a causal mask only on its own diagonal chunk: with whole chunks a
// key chunk is in the past, on the diagonal or in the future of a query chunk) and merges the
// partial results by LSE (merge_states). Output and LSE are this rank's rows of the single-process
// call over the whole sequence; rows that attend nothing get O = 0, LSE = -inf.
//
// The exchange overlaps the attention: the transfers are posted, the pairs whose key chunk the
// rank holds run while they travel, then the received chunks' pairs, each chunk once it landed.
//
// attention_backward() gives the gradients of the same scheme.
//
// Devices. The tensors' device (problem.device) decides where a call runs. Device::cpu: the CPU
// engine, and the call returns when done. Device::cuda: the GPU kernels on `stream`. The call
// waits for the GPU to read the block pattern (which chunks are used is host knowledge), in the
// transport's all_gather, and, for attention() and attention_backward(), at its end, when the
// pair plans free their workspaces (a ShardedPlan keeps them); the rest is enqueued on `stream`
// in order. Its buffers are stream-ordered allocations on `stream`, freed in stream order. The
// transport moves the memory of the tensors' device: LocalGroup either kind (threads of one
// process, e.g. ranks sharing one GPU in tests), nccl_transport() (distributed_nccl.hpp, library
// bsattn::nccl) device memory over NCCL, one rank per GPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "bsattn/plan.hpp"

namespace bsattn::distributed {

// How a rank talks to the others. Every call is collective: all ranks make it, in the same order.
class Transport {
 public:
  struct Send {
    int peer;
    const void* data;
    std::size_t bytes;
  };
  struct Receive {
    int peer;
    void* data;
    std::size_t bytes;
  };
  // Where a post's buffers live: host memory, or device memory of GPU `device_index` whose
  // contents are ready in the order of `stream` (a cudaStream_t) when post() is called.
  struct Memory {
    Device device = Device::cpu;
    int device_index = 0;
    Stream stream = nullptr;
  };
  // Posted transfers. Host memory: wait(i) returns once receive i has landed in its buffer, and
  // the destructor once every send and receive has completed. Device memory: after wait(i), work
  // enqueued on the post's stream sees receive i (the call may return before it landed); after
  // the destructor, that stream is ordered after every send and receive (buffers may be reused or
  // freed in stream order).
  class Exchange {
   public:
    virtual ~Exchange() = default;
    virtual void wait(std::size_t receive) = 0;
  };
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // Every rank's `mine` (a short list), in rank order.
  virtual std::vector<std::vector<int>> all_gather(const std::vector<int>& mine) = 0;
  // Posts every send and receive and returns without waiting for them. The messages from one rank
  // to another are matched in the order both post them. The buffers stay valid until the
  // Exchange is destroyed.
  virtual std::unique_ptr<Exchange> post(const std::vector<Send>& sends, const std::vector<Receive>& receives,
                                         const Memory& memory) = 0;
};

// `world` ranks that are threads of one process: transport(r) is rank r's (each transport is used
// by one thread at a time). Messages are copied into a host mailbox when sent (device memory: once
// the sender's stream has reached the post) and out of it when waited for.
class LocalGroup {
 public:
  explicit LocalGroup(int world);
  ~LocalGroup();
  std::unique_ptr<Transport> transport(int rank);
  struct State;  // the mailboxes, shared with the transports (defined in the library)

 private:
  std::shared_ptr<State> state_;
};

enum class Layout { contiguous, zigzag };

struct Sharding {
  Layout layout = Layout::contiguous;
  bool causal = false;  // the causal mask of the whole sequence
  // Packed documents (batch 1): offsets 0 = o_0 <= o_1 <= ... <= o_n = S over the whole sequence;
  // a query sees only the keys of its own document, as the varlen single-process call with these
  // offsets computes. A key chunk that shares no document with a query chunk is not used by it
  // (not sent, not attended). Empty: no documents.
  std::vector<std::int64_t> cu_seqlens;
};

// What one call moved and computed, for this rank.
struct Stats {
  int chunks_received = 0;
  std::size_t bytes_received = 0;  // K and V of the received chunks
  std::size_t bytes_all_gather = 0;  // K and V an all-gather of every chunk would have brought
  int pairs_attended = 0;  // (query chunk, key chunk) pairs run
  int pairs_before_first_wait = 0;  // of those, run before the first wait for a received chunk (all: none received)
};

// A rank's block pattern: its query blocks (in its local order) over the global key blocks, in
// the problem's batched format (SPEC §3: block_lists cnt [Bs, Hs, nQB] / idx [Bs, Hs, nQB, L];
// bsr over those rows; bitmask uint32 [Bs, Hs, nQB, ceil(nKB / 32)], bit j % 32 of word j / 32
// keeping key block j), nQB = S_local / Bq and nKB = S / Bk. On the host or the problem's device:
// it is read on the host. With has_full the full set is attended like the partial one (the
// chunk pairs' masks are the sharding's). all_blocks takes none.
struct Pattern {
  BlockSet partial, full;
};

// This rank's rows. `local` describes them as a single-process problem over the rank's tokens:
// batch, heads, head_dim, dtypes, block sizes, scale, num_threads (max_seqlen_q and
// max_seqlen_kv: the rank's token count; layouts batched and contiguous; no mask, proxy, tiles);
// format all_blocks (every block), block_lists, bsr or bitmask, whose sparsity_batch /
// sparsity_heads give the pattern's Bs and Hs. q [B, S_local, Hq, D], k and v
// [B, S_local, Hkv, D]; out [B, S_local, Hq, D] of local.out_dtype (the pairs' fp32 parts are
// merged in fp32 and rounded once into it), lse f32 [B, Hq, S_local] (may be left undefined).
// Every tensor on local.device; on a GPU each token's heads are contiguous in K and V
// (stride[2] == D: a chunk travels as one copy per batch). The pattern's
// values are always checked (it is read on the host), by the rules of a single-process call (SPEC
// §3, §8: L <= nKB, counts within [0, L], a row's entries ascending and unique in [0, nKB), BSR
// offsets from 0, non-decreasing, ending within the indices, no block in both sets; errors name
// pattern.<set>.<tensor>), and the chunk pairs, whose metadata is made
// from it, run without validation (local.validate is not read). Throws bsattn::Error naming the
// argument before anything is sent when the shapes, the layout or the pattern's values do not fit.
Stats attention(Transport& transport, const Problem& local, const Sharding& sharding, const TensorView& q,
                const TensorView& k, const TensorView& v, const Pattern& pattern, const TensorView& out,
                const TensorView& lse, Stream stream = nullptr);

// This rank's gradients of attention() for the loss gradient `dout` ([B, S_local, Hq, D], O's
// dtype): dq [B, S_local, Hq, D], dk and dv [B, S_local, Hkv, D], each f32 or the inputs' dtype,
// every element written. `out` and `lse` (required) are what attention() returned on this rank,
// the other arguments as given to it. The same key chunks travel as in the forward; each chunk
// pair's single-process backward (Plan::run_backward on the pair, with the whole rows' O and LSE,
// which makes the pair's share of every gradient exact) adds to dQ here and to the key chunk's
// dK, dV, which go back to the chunk's owner and are summed there (fp32 throughout, rounded once).
// On a GPU the backward's own rules hold (backward.hpp: f16 / bf16, out_dtype = dtype).
Stats attention_backward(Transport& transport, const Problem& local, const Sharding& sharding, const TensorView& q,
                         const TensorView& k, const TensorView& v, const Pattern& pattern,
                         const TensorView& out, const TensorView& lse, const TensorView& dout, const TensorView& dq,
                         const TensorView& dk, const TensorView& dv, Stream stream = nullptr);

// attention() and attention_backward() as a plan for repeated calls on one problem and sharding:
// the chunk pairs' plans are made once (on a GPU their workspaces stay allocated, so a call frees
// nothing and does not wait for the GPU at its end), and each run() checks only its tensors. The
// backward's pair plans are made when local.backward is set. `world`: the transports' rank count.
// The calls' own costs remain: the pattern read on the host, the all-gather of the used
// chunks, the pair masks (and document ids) copied to the device, stream-ordered buffers.
class ShardedPlan {
 public:
  ShardedPlan(const Problem& local, const Sharding& sharding, int world);
  ~ShardedPlan();
  ShardedPlan(ShardedPlan&&) noexcept;
  ShardedPlan& operator=(ShardedPlan&&) noexcept;

  Stats run(Transport& transport, const TensorView& q, const TensorView& k, const TensorView& v,
            const Pattern& pattern, const TensorView& out, const TensorView& lse, Stream stream = nullptr);
  Stats run_backward(Transport& transport, const TensorView& q, const TensorView& k, const TensorView& v,
                     const Pattern& pattern, const TensorView& out, const TensorView& lse,
                     const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                     Stream stream = nullptr);

  struct Impl;  // the checked geometry and the pair plans (defined in the library)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace bsattn::distributed
