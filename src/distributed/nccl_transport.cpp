#include "bsattn/distributed_nccl.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "gpu/device_guard.hpp"

namespace bsattn::distributed {
namespace {

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw Error("nccl", std::string(what) + ": " + ncclGetErrorString(r));
}

class NcclTransport final : public Transport {
 public:
  explicit NcclTransport(ncclComm_t comm) : comm_(comm) {
    nccl_check(ncclCommUserRank(comm, &rank_), "ncclCommUserRank");
    nccl_check(ncclCommCount(comm, &world_), "ncclCommCount");
    nccl_check(ncclCommCuDevice(comm, &device_), "ncclCommCuDevice");
    gpu::DeviceGuard guard(device_);
    gpu::cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate (NCCL transport)");
  }
  ~NcclTransport() override {
    gpu::DeviceGuard guard(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }

  std::vector<std::vector<int>> all_gather(const std::vector<int>& mine) override {
    gpu::DeviceGuard guard(device_);
    const int count = static_cast<int>(mine.size());
    const std::vector<int> counts = gather(&count, 1);
    const int longest = *std::max_element(counts.begin(), counts.end());
    std::vector<std::vector<int>> all(static_cast<std::size_t>(world_));
    if (longest == 0) return all;
    std::vector<int> padded(mine);
    padded.resize(static_cast<std::size_t>(longest), -1);
    const std::vector<int> lists = gather(padded.data(), longest);
    for (int r = 0; r < world_; ++r)
      all[r].assign(lists.begin() + static_cast<std::ptrdiff_t>(r) * longest,
                    lists.begin() + static_cast<std::ptrdiff_t>(r) * longest + counts[r]);
    return all;
  }

  // One group of sends and receives on the transport's stream; `done` marks its end.
  class NcclExchange final : public Exchange {
   public:
    NcclExchange(cudaEvent_t done, cudaStream_t caller, int device) : done_(done), caller_(caller), device_(device) {}
    ~NcclExchange() override {
      gpu::DeviceGuard guard(device_);
      cudaStreamWaitEvent(caller_, done_, 0);  // the caller's buffers are free in its stream order
      cudaEventDestroy(done_);                 // released once it has completed
    }
    void wait(std::size_t) override {
      if (waited_) return;
      gpu::DeviceGuard guard(device_);
      gpu::cuda_check(cudaStreamWaitEvent(caller_, done_, 0), "cudaStreamWaitEvent (NCCL exchange)");
      waited_ = true;
    }

   private:
    cudaEvent_t done_;
    cudaStream_t caller_;
    int device_;
    bool waited_ = false;
  };

  std::unique_ptr<Exchange> post(const std::vector<Send>& sends, const std::vector<Receive>& receives,
                                 const Memory& memory) override {
    if (memory.device != Device::cuda || memory.device_index != device_)
      throw Error("transport", "the NCCL transport moves memory of its communicator's GPU (cuda:" +
                                   std::to_string(device_) + "), got " +
                                   (memory.device == Device::cpu ? std::string("host memory")
                                                                 : "cuda:" + std::to_string(memory.device_index)));
    gpu::DeviceGuard guard(device_);
    const auto caller = static_cast<cudaStream_t>(memory.stream);
    cudaEvent_t ready = nullptr, done = nullptr;
    gpu::cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    gpu::cuda_check(cudaEventRecord(ready, caller), "cudaEventRecord (sends ready)");
    gpu::cuda_check(cudaStreamWaitEvent(stream_, ready, 0), "cudaStreamWaitEvent (sends ready)");
    cudaEventDestroy(ready);
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (const Send& m : sends) nccl_check(ncclSend(m.data, m.bytes, ncclUint8, m.peer, comm_, stream_), "ncclSend");
    for (const Receive& m : receives)
      nccl_check(ncclRecv(m.data, m.bytes, ncclUint8, m.peer, comm_, stream_), "ncclRecv");
    nccl_check(ncclGroupEnd(), "ncclGroupEnd");
    gpu::cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    gpu::cuda_check(cudaEventRecord(done, stream_), "cudaEventRecord (exchange done)");
    return std::make_unique<NcclExchange>(done, caller, device_);
  }

 private:
  // Every rank's `n` ints, in rank order (waits for them).
  std::vector<int> gather(const int* mine, int n) {
    int* buffer = nullptr;  // this rank's n ints, then everyone's
    const std::size_t bytes = sizeof(int) * static_cast<std::size_t>(n);
    gpu::cuda_check(cudaMallocAsync(reinterpret_cast<void**>(&buffer), bytes * (1 + world_), stream_),
                    "cudaMallocAsync");
    std::vector<int> all(static_cast<std::size_t>(n) * world_);
    gpu::cuda_check(cudaMemcpyAsync(buffer, mine, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
    nccl_check(ncclAllGather(buffer, buffer + n, static_cast<std::size_t>(n), ncclInt32, comm_, stream_),
               "ncclAllGather");
    gpu::cuda_check(cudaMemcpyAsync(all.data(), buffer + n, bytes * world_, cudaMemcpyDeviceToHost, stream_),
                    "cudaMemcpyAsync");
    gpu::cuda_check(cudaFreeAsync(buffer, stream_), "cudaFreeAsync");
    gpu::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (all_gather)");
    return all;
  }

  ncclComm_t comm_;
  int rank_ = 0, world_ = 1, device_ = 0;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<Transport> nccl_transport(ncclComm_t comm) {
  if (!comm) throw Error("comm", "a null NCCL communicator");
  return std::make_unique<NcclTransport>(comm);
}

}  // namespace bsattn::distributed
