// SelectedAttention on the GPU (issue 11.4): one run() equals build_summaries(), select_blocks() and
// Plan::run() called separately on the same stream, bit for bit (summaries, bitmask, O, LSE); its
// bitmask equals the CPU engine's selection on its summaries, and its output the float64 oracle on
// its bitmask and summaries (within a bf16 GEMM's error). A CUDA graph of run() (validate = false:
// a host sync or an allocation would break the capture) replayed after new Q/K/V values are written
// at the same addresses equals an eager run on the new values, and its bitmask follows them. Random
// cases from gpu_case.hpp: batched and varlen with empty sequences, GQA, D 64 / 128 / 256, every
// built-in mask, f32 output. Proxy (problem.proxy = eligible) is skipped with a message where plan()
// refuses it on the GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bsattn/bsattn.hpp"
#include "gpu_case.hpp"
#include "oracle.hpp"

namespace bsattn_gpu_test {
namespace {

// The GPU kernels round P to the input dtype before the PV product, so their error against
// float64 is that of a bf16 / f16 GEMM, not of the output rounding: gpu_compare.hpp's bounds.
const bsattn_test::Tolerance kGpuTolerance{0.03, 0.02, 4e-3};

std::vector<unsigned char> download(const TensorView& t) {
  std::vector<unsigned char> host(static_cast<std::size_t>(t.numel()) * element_size(t.dtype));
  cudaMemcpy(host.data(), t.data, host.size(), cudaMemcpyDeviceToHost);
  return host;
}

// Device memory shaped like `like`, filled with 0xff bytes (NaN in every float dtype).
struct DeviceTensor {
  TensorView view;
  explicit DeviceTensor(const TensorView& like) : view(like) {
    const std::size_t bytes = static_cast<std::size_t>(like.numel()) * element_size(like.dtype);
    cudaMalloc(&view.data, bytes);
    cudaMemset(view.data, 0xff, bytes);
  }
  ~DeviceTensor() { cudaFree(view.data); }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
};

// A host view over `bytes` with the shape of device view `t`.
TensorView host_view(const TensorView& t, std::vector<unsigned char>& bytes) {
  TensorView h = t;
  h.data = bytes.data();
  h.device = Device::cpu;
  return h;
}

SelectOptions random_options(std::mt19937_64& rng) {
  const auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  SelectOptions o;
  o.policy = static_cast<SelectPolicy>(pick(0, 2));
  o.top_k = pick(1, 6);
  o.tau = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
  const float masses[] = {0.3f, 0.6f, 0.9f};
  o.mass = masses[pick(0, 2)];
  o.sinks = pick(0, 2) == 0 ? 1 : 0;
  o.local = pick(0, 2) == 0 ? 1 : 0;
  o.diagonal = pick(0, 3) != 0;
  o.causal = pick(0, 1) == 1;
  o.alignment = pick(0, 3) == 0 ? Alignment::top_left : Alignment::bottom_right;
  o.heads = pick(0, 1) ? SelectHeads::kv : SelectHeads::query;
  return o;
}

std::string describe(const Case& c, const SelectOptions& o, const Problem& p) {
  const char* policies[] = {"top_k", "tau", "mass"};
  return std::string(c.varlen() ? "varlen" : "batched") + " B=" + std::to_string(p.batch) + " Hq=" +
         std::to_string(p.heads_q) + " Hkv=" + std::to_string(p.heads_kv) + " D=" + std::to_string(p.head_dim) +
         " block " + std::to_string(p.block.q) + "x" + std::to_string(p.block.kv) + " " + to_string(p.dtype) +
         " out " + to_string(p.out_dtype) + " Sq " + std::to_string(p.max_seqlen_q) + " Skv " +
         std::to_string(p.max_seqlen_kv) + " policy " + policies[static_cast<int>(o.policy)] +
         (o.heads == SelectHeads::kv ? " heads kv" : " heads q") + (o.causal ? " causal" : "") + " proxy " +
         to_string(p.proxy) + (p.validate ? " validate" : "");
}

// A random case without sparsity tensors (the object selects), GPU-sized.
CaseSpec pipeline_spec(int i, bool varlen, bool proxy) {
  CaseSpec spec;
  spec.format = Format::all_blocks;
  spec.varlen = varlen;
  spec.dtype = (i / 2) % 2 ? DType::bf16 : DType::f16;  // not tied to the layout (i % 2)
  const int dims[] = {64, 128, 256};
  spec.head_dim = dims[i % 3];
  const int bqs[] = {64, 128, 32, 64}, bks[] = {64, 128, 64, 48};
  spec.bq = bqs[i % 4];
  spec.bk = spec.head_dim == 256 && bks[(i / 4) % 4] == 48 ? 64 : bks[(i / 4) % 4];
  const int heads[][2] = {{4, 2}, {4, 4}, {8, 1}, {6, 2}};
  spec.hq = heads[i % 4][0];
  spec.hkv = heads[i % 4][1];
  spec.max_seqlen = 200 + 97 * (i % 5);
  spec.out_f32 = i % 5 == 0;
  spec.seed = 9100000 + static_cast<std::uint64_t>(i);
  return spec;
}

// Runs `selected` and the three calls separately on `stream`; compares them byte for byte, the
// bitmask with the CPU engine's selection, the output with the float64 oracle.
void expect_pipeline_matches(Case& c, SelectedAttention& selected, cudaStream_t stream, const std::string& what) {
  const Problem& p = selected.problem();
  c.poison_outputs();
  CUDA_OK(cudaDeviceSynchronize());  // the poison (legacy stream) lands before `stream` (non-blocking) runs
  selected.run(c.in_device, c.out_device, stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  c.out->download();
  if (c.lse) c.lse->download();

  DeviceTensor ks(selected.k_summary()), vs(selected.v_summary()), bits(selected.bits()), out(c.out_device.out),
      lse(c.out_device.lse);
  bsattn::Plan plan(p);
  CUDA_OK(cudaDeviceSynchronize());
  Inputs in = c.in_device;
  bsattn::build_summaries(p, in, ks.view, vs.view, stream);
  in.k_summary = ks.view;
  bsattn::select_blocks(p, in, selected.options(), bits.view, stream);
  in.partial.bits = bits.view;
  if (p.proxy == Proxy::off) in.k_summary = TensorView{};
  else in.v_summary = vs.view;
  Outputs apart;
  apart.out = out.view;
  apart.lse = lse.view;
  plan.run(in, apart, stream);
  CUDA_OK(cudaStreamSynchronize(stream));

  std::vector<unsigned char> k_summary = download(selected.k_summary()), v_summary = download(selected.v_summary()),
                             words = download(selected.bits());
  EXPECT_EQ(k_summary, download(ks.view)) << what;
  EXPECT_EQ(v_summary, download(vs.view)) << what;
  EXPECT_EQ(words, download(bits.view)) << what;
  EXPECT_EQ(c.out->host, download(out.view)) << what;
  EXPECT_EQ(c.lse->host, download(lse.view)) << what;

  // The selection stage against the CPU engine on the same summaries (bit identity, SPEC §7).
  Problem host = p;
  host.device = Device::cpu;
  host.num_threads = 0;
  Inputs host_in = c.in_host;
  host_in.k_summary = host_view(selected.k_summary(), k_summary);
  std::vector<unsigned char> cpu_words(words.size(), 0xab);
  bsattn::select_blocks(host, host_in, selected.options(), host_view(selected.bits(), cpu_words));
  EXPECT_EQ(words, cpu_words) << what << ": GPU and CPU selections differ";

  // The output against the float64 oracle on the bitmask and summaries the GPU used.
  host_in.partial.bits = host_view(selected.bits(), words);
  if (p.proxy == Proxy::off) host_in.k_summary = TensorView{};
  else host_in.v_summary = host_view(selected.v_summary(), v_summary);
  const bsattn_test::Oracle oracle(host, host_in);
  const std::string failure =
      bsattn_test::compare_outputs(host, oracle, oracle.compute(), c.out_host, kGpuTolerance);
  EXPECT_TRUE(failure.empty()) << what << "\n" << failure;
}

class GpuSelectedTest : public ::testing::TestWithParam<int> {};

TEST_P(GpuSelectedTest, EqualsTheSeparateCalls) {
  REQUIRE_SM90();
  const int i = GetParam();
  auto c = make_case(pipeline_spec(i, i % 2 == 1, false));
  std::mt19937_64 rng(9200000 + i);
  const SelectOptions options = random_options(rng);
  Problem p = c->problem;
  p.validate = i % 3 == 0;
  SelectedAttention selected(p, options);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  expect_pipeline_matches(*c, selected, stream, describe(*c, options, selected.problem()));
  CUDA_OK(cudaStreamDestroy(stream));
}
INSTANTIATE_TEST_SUITE_P(Random, GpuSelectedTest, ::testing::Range(0, 36));

// Proxy compensation of the unselected eligible blocks.
class GpuSelectedProxyTest : public ::testing::TestWithParam<int> {};

TEST_P(GpuSelectedProxyTest, EqualsTheSeparateCalls) {
  REQUIRE_SM90();
  const int i = GetParam();
  auto c = make_case(pipeline_spec(i, i % 2 == 1, true));
  std::mt19937_64 rng(9300000 + i);
  const SelectOptions options = random_options(rng);
  Problem p = c->problem;
  p.proxy = Proxy::eligible;
  p.validate = i % 3 == 0;
  SelectedAttention selected(p, options);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  expect_pipeline_matches(*c, selected, stream, describe(*c, options, selected.problem()));
  CUDA_OK(cudaStreamDestroy(stream));
}
INSTANTIATE_TEST_SUITE_P(Random, GpuSelectedProxyTest, ::testing::Range(0, 16));

// One run() captured in a CUDA graph; each replay after new Q/K/V values are written at the same
// addresses equals an eager run of a second object on those values (bitmask, summaries, O, LSE),
// and the bitmask changes with the values. Parameter: bit 0 varlen, bit 1 proxy.
class GpuSelectedGraphTest : public ::testing::TestWithParam<int> {};

TEST_P(GpuSelectedGraphTest, ReplayWithNewValuesEqualsEagerRun) {
  REQUIRE_SM90();
  const bool varlen = GetParam() & 1, proxy = GetParam() & 2;
  CaseSpec spec = pipeline_spec(5 + GetParam(), varlen, proxy);
  spec.bq = spec.bk = 64;
  spec.max_seqlen = 900;  // up to 15 KV blocks a row: the top 3 move with the values
  auto c = make_case(spec);
  SelectOptions options;
  options.policy = SelectPolicy::top_k;
  options.top_k = 3;
  options.causal = GetParam() % 3 == 0;
  options.sinks = 1;
  Problem p = c->problem;
  p.validate = false;
  p.proxy = proxy ? Proxy::eligible : Proxy::off;
  auto captured = std::make_unique<SelectedAttention>(p, options);
  auto eager = std::make_unique<SelectedAttention>(p, options);
  const std::string what = describe(*c, options, p);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  captured->run(c->in_device, c->out_device, stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  DeviceTensor out(c->out_device.out), lse(c->out_device.lse);
  Outputs eager_out;
  eager_out.out = out.view;
  eager_out.lse = lse.view;
  std::mt19937_64 rng(9400000 + GetParam());
  std::vector<std::vector<unsigned char>> bitmasks;
  for (int replay = 0; replay < 3; ++replay) {
    // New values at the same device addresses; a drifting offset moves the best blocks.
    std::normal_distribution<float> normal(0.4f * replay, 1.0f);
    for (Buffer* b : {c->q, c->k, c->v}) {
      auto* x = b->as<std::uint16_t>();
      for (std::size_t e = 0; e < b->bytes() / 2; ++e) x[e] = to_bits(normal(rng), p.dtype);
      b->upload();
    }
    ASSERT_EQ(c->q->view(Device::cuda).data, c->in_device.q.data);
    c->poison_outputs();
    for (const TensorView& owned : {captured->k_summary(), captured->v_summary(), captured->bits(), out.view, lse.view})
      CUDA_OK(cudaMemset(owned.data, 0xab, static_cast<std::size_t>(owned.numel()) * element_size(owned.dtype)));
    CUDA_OK(cudaDeviceSynchronize());  // uploads and poison (legacy stream) land first
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    eager->run(c->in_device, eager_out, stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    c->out->download();
    c->lse->download();
    const std::string at = what + ", replay " + std::to_string(replay);
    EXPECT_EQ(download(captured->bits()), download(eager->bits())) << at;
    EXPECT_EQ(download(captured->k_summary()), download(eager->k_summary())) << at;
    EXPECT_EQ(download(captured->v_summary()), download(eager->v_summary())) << at;
    EXPECT_EQ(c->out->host, download(out.view)) << at;
    EXPECT_EQ(c->lse->host, download(lse.view)) << at;
    bitmasks.push_back(download(captured->bits()));
  }
  EXPECT_TRUE(bitmasks[0] != bitmasks[1] || bitmasks[1] != bitmasks[2])
      << what << ": the replayed selection did not change with the values";
  // The last replay's values, checked against the CPU selection and the oracle too.
  expect_pipeline_matches(*c, *eager, stream, what + ", after the replays");
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(stream));
}
INSTANTIATE_TEST_SUITE_P(LayoutsAndProxy, GpuSelectedGraphTest, ::testing::Range(0, 4));

}  // namespace
}  // namespace bsattn_gpu_test
