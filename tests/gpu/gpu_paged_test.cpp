// Paged KV on the GPU (issue 12): random cases of every format with K/V moved into a page cache
// (scattered pages, padded block-table rows, pages smaller and larger than the KV blocks and
// tiles, batched and varlen Q, empty sequences), against the CPU engine on the same paged inputs
// (which the oracle suite checks against float64). Cache tokens that no sequence owns are NaN and
// block-table entries past a sequence's pages point far outside the cache, so a stray read shows.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_paged.hpp"

namespace bsattn_gpu_test {
namespace {

struct Result {
  std::vector<float> out, lse;
};

Result read_outputs(Case& c, Device where) {
  if (where == Device::cuda) {
    c.out->download();
    c.lse->download();
  }
  Result r;
  const std::size_t n = c.out->bytes() / element_size(c.out->dtype);
  r.out.resize(n);
  for (std::size_t i = 0; i < n; ++i) r.out[i] = load_out(c.out, i);
  r.lse.assign(c.lse->as<float>(), c.lse->as<float>() + c.lse->bytes() / 4);
  return r;
}

void expect_match(const Case& c, const Result& gpu, const Result& cpu) {
  const bool varlen = c.varlen();
  const std::size_t rows = varlen ? static_cast<std::size_t>(c.problem.total_q)
                                  : static_cast<std::size_t>(c.problem.batch) * c.problem.max_seqlen_q;
  const std::size_t n = rows * c.problem.heads_q * c.problem.head_dim;
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float g = gpu.out[i], r = cpu.out[i];
    if (!(std::isfinite(g) && std::fabs(g - r) <= 0.03f + 0.02f * std::fabs(r)) && !bad++) first = i;
  }
  EXPECT_EQ(bad, 0u) << c.name << ": first at " << first << " gpu " << gpu.out[first] << " cpu " << cpu.out[first];
  std::size_t lse_bad = 0;
  for (std::size_t i = 0; i < cpu.lse.size(); ++i) {
    if (varlen && i % std::max<std::int64_t>(c.problem.total_q, 1) >= rows) continue;
    const float g = gpu.lse[i], r = cpu.lse[i];
    lse_bad += !(std::isinf(r) ? g == r : std::fabs(g - r) <= 2e-3f + 1e-4f * std::fabs(r));
  }
  EXPECT_EQ(lse_bad, 0u) << c.name;
}

// The CPU engine on the same paged inputs (host copies), outputs poisoned first.
Result run_cpu_engine(Case& c) {
  Problem cpu_problem = c.problem;
  cpu_problem.device = Device::cpu;
  std::fill(c.out->host.begin(), c.out->host.end(), 0xff);
  std::fill(c.lse->host.begin(), c.lse->host.end(), 0xff);
  Plan(cpu_problem).run(c.in_host, c.out_host);
  return read_outputs(c, Device::cpu);
}

// The case of `spec` with its K/V in a page cache of `page_size`: the GPU plan's outputs
// (poisoned first) against the CPU engine on the same paged inputs.
void check_paged_case(const CaseSpec& spec, int page_size, std::mt19937_64& rng) {
  auto c = make_case(spec);
  page_kv(*c, page_size, rng);
  SCOPED_TRACE(c->name + " page " + std::to_string(page_size));
  c->poison_outputs();
  {
    Plan plan(c->problem);
    plan.run(c->in_device, c->out_device, nullptr);
    plan.check(nullptr);
    CUDA_OK(cudaDeviceSynchronize());
  }
  const Result gpu = read_outputs(*c, Device::cuda);
  expect_match(*c, gpu, run_cpu_engine(*c));
}

struct PagedSweep {
  Format format;
  bool varlen;
  int page_size;
};

TEST(GpuPaged, EveryFormatAndPageSize) {
  REQUIRE_SM90();
  const PagedSweep sweeps[] = {
      {Format::all_blocks, false, 16}, {Format::block_lists, false, 64},        {Format::block_lists, true, 48},
      {Format::varlen_block_lists, true, 16}, {Format::bsr, false, 256},        {Format::bsr, true, 128},
      {Format::bitmask, false, 32},    {Format::bitmask, true, 64},             {Format::all_blocks, true, 112},
  };
  std::mt19937_64 rng(11);
  std::uint64_t seed = 1200;
  for (const PagedSweep& s : sweeps)
    for (int rep = 0; rep < 3; ++rep) {  // bf16 D 128; f16 D 64 blocks of 64; bf16 D 256
      CaseSpec spec;
      spec.format = s.format;
      spec.varlen = s.varlen;
      spec.seed = seed++;
      spec.mask = std::uniform_int_distribution<int>(0, 4)(rng);
      if (spec.mask == 4) spec.mask = 5;  // document ids of a paged cache are [B, C * page_size]: not drawn here
      spec.dtype = rep == 1 ? DType::f16 : DType::bf16;
      spec.head_dim = rep == 0 ? 128 : rep == 1 ? 64 : 256;
      if (rep == 1) spec.bq = spec.bk = 64;
      if (rep == 2) spec.bk = 64;  // the D = 256 kernels take KV tiles of 64
      check_paged_case(spec, s.page_size, rng);
    }
}

// Proxy compensation over a page cache (the summaries are the contiguous case's: build_summaries
// reads the same tokens either way): eligible blocks and explicit sets, pages smaller and larger
// than the blocks, batched and varlen.
TEST(GpuPaged, ProxyCompensation) {
  REQUIRE_SM90();
  const PagedSweep sweeps[] = {{Format::block_lists, false, 16}, {Format::bitmask, true, 64},
                               {Format::bsr, false, 256},        {Format::varlen_block_lists, true, 48}};
  std::mt19937_64 rng(13);
  std::uint64_t seed = 1300;
  for (const PagedSweep& s : sweeps)
    for (Proxy proxy : {Proxy::eligible, Proxy::explicit_set}) {
      CaseSpec spec;
      spec.format = s.format;
      spec.varlen = s.varlen;
      spec.proxy = proxy;
      spec.bk = seed % 2 ? 64 : 128;
      spec.mask = std::uniform_int_distribution<int>(0, 3)(rng);
      spec.max_seqlen = 700;
      spec.density = 0.25;
      spec.seed = seed++;
      check_paged_case(spec, s.page_size, rng);
    }
}

// A captured run replayed after new values were written at the same addresses: shorter
// sequences (seq_lens_kv) whose pages moved elsewhere in the cache (block_table, K/V caches).
// The replay must equal an eager run on the new values and the CPU engine.
TEST(GpuPaged, GraphReplayWithNewTablesAndLengths) {
  REQUIRE_SM90();
  for (bool varlen : {false, true}) {
    CaseSpec spec;
    spec.format = Format::all_blocks;
    spec.varlen = varlen;
    spec.mask = 1;  // causal (bottom-right): a shorter KV sequence moves the diagonal
    spec.seed = 4343 + varlen;
    auto c = make_case(spec);
    std::mt19937_64 rng(5 + varlen);
    constexpr int kPage = 64;
    const PagedBuffers pb = page_kv(*c, kPage, rng);
    SCOPED_TRACE(c->name);

    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    Plan plan(c->problem);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    plan.run(c->in_device, c->out_device, stream);
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    c->poison_outputs();
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const Result before = read_outputs(*c, Device::cuda);

    shorten_and_move_pages(c->problem, pb, kPage, rng);

    c->poison_outputs();
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const Result replay = read_outputs(*c, Device::cuda);
    c->poison_outputs();
    plan.run(c->in_device, c->out_device, stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    const Result eager = read_outputs(*c, Device::cuda);
    EXPECT_EQ(replay.out, eager.out);
    EXPECT_EQ(0, std::memcmp(replay.lse.data(), eager.lse.data(), replay.lse.size() * 4));
    EXPECT_NE(before.lse, replay.lse);  // the new lengths mattered

    expect_match(*c, replay, run_cpu_engine(*c));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

TEST(GpuPaged, PagesOfAMultipleOf16Tokens) {
  REQUIRE_SM90();
  CaseSpec spec;
  auto c = make_case(spec);
  std::mt19937_64 rng(3);
  page_kv(*c, 24, rng);
  try {
    Plan plan(c->problem);
    FAIL() << "a page of 24 tokens was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "problem.page_size");
  }
}

}  // namespace
}  // namespace bsattn_gpu_test
