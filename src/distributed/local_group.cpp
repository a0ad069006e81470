// LocalGroup (include/bsattn/distributed.hpp): ranks as threads of one process, talking through
// host mailboxes; device memory is copied in and out of them on the post's stream.
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>

#include "bsattn/distributed.hpp"
#if BSATTN_WITH_CUDA
#include "gpu/device_guard.hpp"
#endif

namespace bsattn::distributed {

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

// Copies `bytes` between host memory and the memory a post describes (host or device).
void copy(void* dst, const void* src, std::size_t bytes, const Transport::Memory& memory, bool to_host) {
  if (memory.device == Device::cpu) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if BSATTN_WITH_CUDA
  // To pageable host memory the copy is done when the call returns; from it, once the bytes are
  // staged: the mailbox may drop them then. Both follow the work already on the stream.
  gpu::DeviceGuard guard(memory.device_index);
  gpu::cuda_check(cudaMemcpyAsync(dst, src, bytes, to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
                                  static_cast<cudaStream_t>(memory.stream)),
                  "cudaMemcpyAsync (LocalGroup message)");
#else
  (void)to_host;
  throw Error("transport", "device memory, but this build has no GPU code (BSATTN_ENABLE_CUDA=OFF)");
#endif
}

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
    LocalExchange(LocalTransport& t, std::vector<Receive> receives, const Memory& memory)
        : t_(t), receives_(std::move(receives)), done_(receives_.size(), false), memory_(memory) {}
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
        copy(m.data, box.front().data(), m.bytes, memory_, false);
        box.pop_front();
        done_[i] = true;
      }
    }

   private:
    LocalTransport& t_;
    std::vector<Receive> receives_;
    std::vector<bool> done_;
    Memory memory_;
  };

  std::unique_ptr<Exchange> post(const std::vector<Send>& sends, const std::vector<Receive>& receives,
                                 const Memory& memory) override {
    LocalGroup::State& s = *state_;
    for (const Send& m : sends) {
      std::vector<unsigned char> message(m.bytes);
      copy(message.data(), m.data, m.bytes, memory, true);
      std::lock_guard<std::mutex> lock(s.mutex);
      s.mailbox[static_cast<std::size_t>(rank_) * s.world + m.peer].push_back(std::move(message));
    }
    s.changed.notify_all();
    return std::make_unique<LocalExchange>(*this, receives, memory);
  }

 private:
  std::shared_ptr<LocalGroup::State> state_;
  int rank_;
};

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

}  // namespace bsattn::distributed
