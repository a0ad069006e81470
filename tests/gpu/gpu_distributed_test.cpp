// Context parallelism on the GPU (include/bsattn/distributed.hpp): the cases of
// tests/cpu/distributed_case.hpp with device tensors, each rank a thread on its own stream. With
// LocalGroup the ranks share this GPU (1, 2 and 4 ranks, contiguous and zigzag, causal and not,
// every pattern kind, the block mask on the host or the device, packed documents); with the NCCL
// transport there is a rank per GPU of the machine. Forward and backward are compared with the
// single-process call on the CPU engine, outputs poisoned (NaN) before the call. Then the stats
// of a banded pattern and the GPU's bad inputs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "distributed_case.hpp"
#include "gpu_case.hpp"
#if BSATTN_TEST_NCCL
#include "bsattn/distributed_nccl.hpp"
#endif

namespace bsattn_gpu_test {
namespace {

using namespace distributed_case;

// Device memory of a host array's bytes (or poisoned: every byte 0xff, NaN in every float dtype).
class DeviceArray {
 public:
  DeviceArray(const void* host, std::size_t bytes, int device) : bytes_(bytes) {
    cudaSetDevice(device);
    if (cudaMalloc(&data_, std::max<std::size_t>(bytes, 1)) != cudaSuccess) throw std::runtime_error("cudaMalloc");
    if (host) cudaMemcpy(data_, host, bytes, cudaMemcpyHostToDevice);
    else cudaMemset(data_, 0xff, bytes);
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  TensorView view(DType dtype, std::initializer_list<std::int64_t> shape, int device) const {
    return TensorView::contiguous(data_, dtype, shape, Device::cuda, device);
  }
  template <class T>
  std::vector<T> download() const {
    std::vector<T> host(bytes_ / sizeof(T));
    cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost);
    return host;
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_;
};

std::vector<float> to_float(const std::vector<std::uint16_t>& bf16) {
  std::vector<float> out(bf16.size());
  for (std::size_t i = 0; i < bf16.size(); ++i) out[i] = bsattn::cpu::bf16_to_float(bf16[i]);
  return out;
}

// A rank's problem on GPU `device`: O in the inputs' dtype, which the GPU backward reads.
void on_gpu(bsattn::Problem& p, int device) {
  p.out_dtype = p.dtype;
  p.device = Device::cuda;
  p.device_index = device;
}

// A rank's forward and backward on GPU `device` with bf16 device tensors on a stream of its own:
// O in bf16 (what the GPU backward reads), then the backward with dQ, dK, dV in f32.
// With `plan`, through it (made for this rank's GPU problem with backward set).
RankResult run_on_gpu(dist::Transport& transport, const RankData& d, int device, bool mask_on_device,
                      dist::ShardedPlan* plan = nullptr) {
  const Spec& s = d.spec;
  const std::int64_t local = d.local, q_elems = std::int64_t(s.batch) * local * s.hq * s.d,
                     kv_elems = std::int64_t(s.batch) * local * s.hkv * s.d;
  cudaSetDevice(device);
  cudaStream_t stream = nullptr;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  const DeviceArray q(d.q.half.data(), 2 * q_elems, device), k(d.k.half.data(), 2 * kv_elems, device),
      v(d.v.half.data(), 2 * kv_elems, device), dout(d.dout.half.data(), 2 * q_elems, device),
      mask(d.mask.data(), 4 * d.mask.size(), device);
  const DeviceArray out(nullptr, 2 * q_elems, device), lse(nullptr, 4 * s.batch * s.hq * local, device),
      dq(nullptr, 4 * q_elems, device), dk(nullptr, 4 * kv_elems, device), dv(nullptr, 4 * kv_elems, device);
  cudaDeviceSynchronize();  // the uploads (legacy stream) before the rank's stream reads them
  bsattn::Problem p = d.problem;
  on_gpu(p, device);
  const auto rows = [&](const DeviceArray& a, DType dtype, int heads) {  // [B, local, heads, D]
    return a.view(dtype, {s.batch, local, heads, s.d}, device);
  };
  const TensorView qv = rows(q, s.dtype, s.hq), kv = rows(k, s.dtype, s.hkv), vv = rows(v, s.dtype, s.hkv),
                   ov = rows(out, s.dtype, s.hq), lv = lse.view(DType::f32, {s.batch, s.hq, local}, device);
  const auto& m = d.mask_shape;
  dist::Pattern mv;
  if (s.sparse)
    mv.partial.bits = mask_on_device ? mask.view(DType::u32, {m[0], m[1], m[2], m[3]}, device)
                                     : TensorView::contiguous(d.mask.data(), DType::u32, {m[0], m[1], m[2], m[3]});
  RankResult r;
  const TensorView dov = rows(dout, s.dtype, s.hq), dqv = rows(dq, DType::f32, s.hq), dkv = rows(dk, DType::f32, s.hkv),
                   dvv = rows(dv, DType::f32, s.hkv);
  r.stats = plan ? plan->run(transport, qv, kv, vv, mv, ov, lv, stream)
                 : dist::attention(transport, p, d.sharding, qv, kv, vv, mv, ov, lv, stream);
  r.stats_backward = plan ? plan->run_backward(transport, qv, kv, vv, mv, ov, lv, dov, dqv, dkv, dvv, stream)
                          : dist::attention_backward(transport, p, d.sharding, qv, kv, vv, mv, ov, lv, dov, dqv, dkv,
                                                     dvv, stream);
  const cudaError_t done = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  if (done != cudaSuccess) throw std::runtime_error(std::string("rank stream: ") + cudaGetErrorString(done));
  r.out = to_float(out.download<std::uint16_t>());
  r.lse = lse.download<float>();
  r.dq = dq.download<float>();
  r.dk = dk.download<float>();
  r.dv = dv.download<float>();
  return r;
}

Result sharded_on_gpu(const Sequence& seq, int world, bool mask_on_device) {
  dist::LocalGroup group(world);
  return seq.sharded([&](const RankData& d) {
    auto transport = group.transport(d.rank);
    return run_on_gpu(*transport, d, 0, mask_on_device);
  });
}

// O in bf16 against the CPU reference's f32: one bf16 unit in the last place (2^-8) relative on
// top of the computation's 1e-2.
constexpr float kBf16Rel = 1.0f / 256;

// The gradients within 2 % of each tensor's largest reference value: the GPU reads O in bf16 where
// the CPU reference reads it in f32, and sums in another order.
void expect_close_gradients(const Result& got, const Result& want, const std::string& what) {
  const auto compare = [&](const std::vector<float>& g, const std::vector<float>& w, const char* name) {
    ASSERT_EQ(g.size(), w.size());
    float scale = 0.0f;
    for (const float x : w) scale = std::max(scale, std::fabs(x));
    const float tol = 2e-2f * scale + 1e-3f;
    std::size_t bad = 0;
    for (std::size_t i = 0; i < w.size(); ++i)
      if (!(std::fabs(g[i] - w[i]) <= tol) && bad++ < 5)
        ADD_FAILURE() << what << ": " << name << "[" << i << "] " << g[i] << " vs " << w[i] << " (tolerance " << tol
                      << ")";
    EXPECT_EQ(bad, 0u) << what << " " << name;
  };
  compare(got.dq, want.dq, "dq");
  compare(got.dk, want.dk, "dk");
  compare(got.dv, want.dv, "dv");
}

// The grid's cases at GPU sizes: D 128, blocks of 64 or 128, chunks of 128 tokens, bf16.
Spec gpu_spec(int world, dist::Layout layout, bool causal, int pattern, std::uint64_t seed) {
  Spec s = grid_case(world, layout, causal, pattern, seed);
  s.d = 128;
  s.bq = s.bk = seed % 2 ? 64 : 128;
  s.chunk = 128;
  s.dtype = DType::bf16;
  return s;
}

TEST(GpuDistributed, ShardedEqualsSingleProcess) {
  REQUIRE_SM90();
  std::uint64_t seed = 500;
  for (const int world : {1, 2, 4})
    for (const auto layout : {dist::Layout::contiguous, dist::Layout::zigzag})
      for (const bool causal : {false, true})
        for (int pattern = 0; pattern < 4; ++pattern) {
          const Spec s = gpu_spec(world, layout, causal, pattern, seed++);
          const Sequence seq(s);
          const std::string what = describe(s);
          const Result want = seq.reference(), got = sharded_on_gpu(seq, world, seed % 3 == 0);
          expect_same(got, want, 1e-2f, what, kBf16Rel);
          expect_close_gradients(got, want, what + " backward");
        }
}

// As the CPU test: a causal band of one chunk on 4 ranks moves a quarter of an all-gather, and
// each rank attends its own chunk before it waits for the previous one.
TEST(GpuDistributed, BandedPatternMovesOnlyItsChunks) {
  REQUIRE_SM90();
  Spec s = gpu_spec(4, dist::Layout::contiguous, true, 1, 7);
  s.band = true;
  const Sequence seq(s);
  const Result got = sharded_on_gpu(seq, s.world, true), want = seq.reference();
  expect_same(got, want, 1e-2f, "band", kBf16Rel);
  expect_band_stats(got);
}

// Packed documents (batch 1, random boundaries) against the single-process call with their
// document ids; then a document per chunk, which moves nothing.
TEST(GpuDistributed, PackedDocuments) {
  REQUIRE_SM90();
  std::uint64_t seed = 700;
  for (const int world : {2, 4})
    for (const auto layout : {dist::Layout::contiguous, dist::Layout::zigzag})
      for (const bool causal : {false, true}) {
        Spec s = gpu_spec(world, layout, causal, causal ? 1 : 0, seed++);
        s.batch = s.sparsity_batch = 1;
        s.documents = 5;
        const Sequence seq(s);
        const Result want = seq.reference(), got = sharded_on_gpu(seq, world, true);
        expect_same(got, want, 1e-2f, describe(s) + ", documents", kBf16Rel);
        expect_close_gradients(got, want, describe(s) + ", documents backward");
      }
  Spec s = gpu_spec(4, dist::Layout::zigzag, false, 0, 1);
  s.batch = 1;
  s.chunk_documents = true;
  const Sequence seq(s);
  const Result got = sharded_on_gpu(seq, s.world, true);
  expect_same(got, seq.reference(), 1e-2f, describe(s) + ", a document per chunk", kBf16Rel);
  for (int rank = 0; rank < s.world; ++rank) EXPECT_EQ(got.stats[rank].chunks_received, 0) << "rank " << rank;
}

// A ShardedPlan per rank serves calls on new inputs and patterns of the same geometry.
TEST(GpuDistributed, ShardedPlanServesRepeatedCalls) {
  REQUIRE_SM90();
  Spec s = gpu_spec(2, dist::Layout::zigzag, true, 3, 401);
  std::vector<dist::ShardedPlan> plans = plans_for(s, [](bsattn::Problem& p) { on_gpu(p, 0); });
  for (int call = 0; call < 3; ++call) {
    s.seed = 401 + 2 * call;  // new Q, K, V and pattern; blocks of 64 throughout
    const Sequence seq(s);
    dist::LocalGroup group(s.world);
    const Result got = seq.sharded([&](const RankData& d) {
      auto transport = group.transport(d.rank);
      return run_on_gpu(*transport, d, 0, call % 2 == 0, &plans[d.rank]);
    });
    const Result want = seq.reference();
    expect_same(got, want, 1e-2f, describe(s) + ", call " + std::to_string(call), kBf16Rel);
    expect_close_gradients(got, want, describe(s) + ", call " + std::to_string(call) + " backward");
  }
}

TEST(GpuDistributed, BadInputsNameTheArgument) {
  REQUIRE_SM90();
  dist::LocalGroup group(1);
  auto t = group.transport(0);
  // One rank's problem of 128 tokens (Hq 4, Hkv 2, D 128), every block.
  bsattn::Problem p = Sequence(gpu_spec(1, dist::Layout::contiguous, false, 0, 1)).problem(128);
  p.batch = 1;
  p.out_dtype = DType::bf16;
  p.device = Device::cuda;
  const std::int64_t q_elems = 128 * 4 * 128, kv_elems = 128 * 2 * 128;
  const DeviceArray q(nullptr, 2 * q_elems, 0), kv(nullptr, 4 * kv_elems, 0), out(nullptr, 2 * q_elems, 0),
      lse(nullptr, 4 * 4 * 128, 0);
  std::vector<std::uint16_t> host_q(q_elems);
  const TensorView qv = q.view(DType::bf16, {1, 128, 4, 128}, 0), kvv = kv.view(DType::bf16, {1, 128, 2, 128}, 0),
                   ov = out.view(DType::bf16, {1, 128, 4, 128}, 0), lv = lse.view(DType::f32, {1, 4, 128}, 0);
  const auto expect_refused = [&](const TensorView& q_in, const TensorView& k_in, const char* arg) {
    try {
      dist::attention(*t, p, {}, q_in, k_in, kvv, {}, ov, lv);
      ADD_FAILURE() << arg << ": accepted";
    } catch (const bsattn::Error& e) {
      EXPECT_EQ(e.argument(), arg) << e.what();
    }
  };
  // Q on the host for a GPU problem.
  expect_refused(TensorView::contiguous(host_q.data(), DType::bf16, {1, 128, 4, 128}), kvv, "q");
  // K whose heads are not contiguous within a token (every other head of a [1, 128, 4, 128] array).
  TensorView strided = kvv;
  strided.stride = {128 * 4 * 128, 4 * 128, 2 * 128, 1, 0};
  expect_refused(qv, strided, "k");
  std::vector<std::uint16_t> poisoned = out.download<std::uint16_t>();
  EXPECT_TRUE(std::all_of(poisoned.begin(), poisoned.end(), [](std::uint16_t x) { return x == 0xffffu; }))
      << "a refused call wrote its output";
}

#if BSATTN_TEST_NCCL
// A rank per GPU of this machine over NCCL (one GPU: one rank, whose all-gathers and empty
// exchange still go through NCCL), against the single-process CPU call.
TEST(GpuDistributed, NcclTransportMatchesSingleProcess) {
  REQUIRE_SM90();
  int devices = 0;
  cudaGetDeviceCount(&devices);
  const int world = std::min(devices, 4);
  std::vector<ncclComm_t> comms(static_cast<std::size_t>(world));
  std::vector<int> ids(static_cast<std::size_t>(world));
  for (int i = 0; i < world; ++i) ids[i] = i;
  ASSERT_EQ(ncclCommInitAll(comms.data(), world, ids.data()), ncclSuccess);
  std::uint64_t seed = 900;
  for (const auto layout : {dist::Layout::contiguous, dist::Layout::zigzag})
    for (const int pattern : {0, 3}) {
      const Spec s = gpu_spec(world, layout, pattern == 3, pattern, seed++);
      const Sequence seq(s);
      const Result got = seq.sharded([&](const RankData& d) {
        auto transport = dist::nccl_transport(comms[d.rank]);
        return run_on_gpu(*transport, d, d.rank, true);
      });
      const Result want = seq.reference();
      expect_same(got, want, 1e-2f, "nccl " + describe(s), kBf16Rel);
      expect_close_gradients(got, want, "nccl " + describe(s) + " backward");
    }
  // Host memory is refused by name.
  auto transport = dist::nccl_transport(comms[0]);
  int byte = 0;
  try {
    transport->post({}, {{0, &byte, 1}}, dist::Transport::Memory{});
    ADD_FAILURE() << "host memory accepted";
  } catch (const bsattn::Error& e) {
    EXPECT_EQ(e.argument(), "transport") << e.what();
  }
  transport.reset();
  for (ncclComm_t c : comms) ncclCommDestroy(c);
}
#endif

}  // namespace
}  // namespace bsattn_gpu_test
