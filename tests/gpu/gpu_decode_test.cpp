// The decode kernel (issue 12.2; src/gpu/fwd/decode.cuh): a few queries per sequence, the query
// heads of a KV group packed into a tile's rows, split-KV merged on the device. Random cases
// against the CPU engine on the same inputs: every format, the built-in masks (causal aligned
// bottom-right over several queries), KV groups of 1 to 8, sparsity per query head (no packing),
// per KV head and shared, batched and varlen Q, contiguous and paged K/V, f16 / bf16 / f32 outputs,
// D 64 / 128 / 256. The plan's choice (heads per tile, splits) is asserted, so a case that fell
// back to the prefill kernels fails rather than passing on the wrong kernel.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "gpu_compare.hpp"
#include "gpu_paged.hpp"

namespace bsattn_gpu_test {
namespace {

// The heads per tile plan() should pick (0: the prefill kernels).
int expected_packed_heads(const Problem& p) {
  const int group = p.heads_q / p.heads_kv;
  const int per_sparsity_head = p.heads_q / (p.format == Format::all_blocks ? 1 : p.sparsity_heads);
  int heads = 1;
  while (heads < 4 && group % (2 * heads) == 0 && per_sparsity_head % (2 * heads) == 0) heads *= 2;
  return p.max_seqlen_q <= 64 / heads ? heads : 0;
}

int multiprocessors() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  return sms;
}

// The plan took the decode kernel with the expected packing, and split the KV routes whenever the
// work items (sequences x head groups) leave multiprocessors idle and the rows are long enough.
void expect_decode_plan(const Plan& plan) {
  const Problem& p = plan.problem();
  const TileShape& t = plan.tiles();
  const int heads = expected_packed_heads(p);
  ASSERT_GT(heads, 0) << "not a decode shape";
  EXPECT_EQ(t.packed_heads, heads);
  EXPECT_EQ(t.tile_m, 64 / heads);
  const int items = p.batch * (p.heads_q / heads);
  const int routes = (p.max_seqlen_kv + p.block.kv - 1) / p.block.kv * t.kv_split;
  if (items * 2 <= multiprocessors() && routes >= 8) EXPECT_GT(t.kv_splits, 1);
}

void run_gpu(Case& c) {
  Plan plan(c.problem);
  expect_decode_plan(plan);
  plan.run(c.in_device, c.out_device, nullptr);
  plan.check(nullptr);
  CUDA_OK(cudaDeviceSynchronize());
}

// One element of KV head `head` of `kv` (the case's K or V, batch 1 or varlen: [tokens, Hkv, D]) at
// a random token of sequence 0 set to `value`.
void poison_kv_element(Case& c, Buffer* kv, int head, float value, std::mt19937_64& rng) {
  const Problem& p = c.problem;
  const std::int64_t token = std::uniform_int_distribution<std::int64_t>(0, c.seqlen_kv[0] - 1)(rng);
  const int d = std::uniform_int_distribution<int>(0, p.head_dim - 1)(rng);
  kv->as<std::uint16_t>()[(token * p.heads_kv + head) * p.head_dim + d] = to_bits(value, p.dtype);
  kv->upload();
}

// Runs a planned split-KV case on the GPU against the CPU engine: every element close, or with a
// poisoned input the same non-finite rows (returned: how many non-finite elements it compared).
std::size_t run_and_compare(Case& c, bool poisoned) {
  run_gpu(c);
  const Result gpu = download(c), ref = run_cpu(c);
  if (!poisoned) {
    expect_close(c, gpu, ref);
    return 0;
  }
  return expect_same_non_finite(c, gpu, ref);
}

struct DecodeSweep {
  Format format;
  bool varlen;
  int hq, hkv;
  int max_q;  // queries per sequence, at most
  int page_size;  // 0: contiguous K/V
  bool full_tile = false;  // batched: exactly max_q queries (a tile of T = max_q tokens: O by bulk stores)
};

TEST(GpuDecode, EveryFormatGroupAndLayout) {
  REQUIRE_SM90();
  const DecodeSweep sweeps[] = {
      {Format::all_blocks, false, 8, 2, 1, 0},          {Format::block_lists, false, 8, 2, 4, 0},
      {Format::bsr, false, 16, 2, 8, 0},                {Format::bitmask, false, 8, 4, 16, 0},
      {Format::block_lists, false, 4, 4, 33, 0},        {Format::all_blocks, false, 32, 8, 1, 64},
      {Format::bitmask, false, 8, 2, 4, 16},            {Format::block_lists, true, 8, 2, 3, 0},
      {Format::varlen_block_lists, true, 8, 2, 2, 0},   {Format::bsr, true, 4, 4, 40, 0},
      {Format::bitmask, true, 8, 1, 1, 32},             {Format::all_blocks, true, 6, 2, 5, 0},
      {Format::block_lists, false, 8, 2, 16, 0, true},  {Format::all_blocks, false, 4, 2, 32, 64, true},
  };
  std::mt19937_64 rng(71);
  std::uint64_t seed = 7100;
  for (const DecodeSweep& s : sweeps)
    for (int rep = 0; rep < 3; ++rep) {  // bf16 D 128; f16 D 64 blocks of 64 (f32 out); bf16 D 256
      CaseSpec spec;
      spec.format = s.format;
      spec.varlen = s.varlen;
      spec.hq = s.hq;
      spec.hkv = s.hkv;
      spec.max_seqlen_q = s.max_q;
      spec.exact_seqlen_q = s.full_tile;
      if (s.full_tile) spec.sparsity_heads = s.hkv;  // packs the whole group: T = 64 / P tokens = max_q
      spec.max_seqlen = 2600;
      spec.batch = rep == 0 && !s.varlen ? 1 : 0;  // one sequence: split-KV
      spec.seed = seed++;
      spec.mask = std::uniform_int_distribution<int>(0, 5)(rng);
      if (s.page_size > 0 && spec.mask == 4) spec.mask = 1;  // document ids of a paged cache: not drawn here
      spec.dtype = rep == 1 ? DType::f16 : DType::bf16;
      spec.out_f32 = rep == 1;
      spec.head_dim = rep == 0 ? 128 : rep == 1 ? 64 : 256;
      if (rep == 1) spec.bq = spec.bk = 64;
      if (rep == 2) spec.bk = 64;  // the D = 256 kernels take KV tiles of 64
      auto c = make_case(spec);
      if (s.page_size > 0) page_kv(*c, s.page_size, rng);
      SCOPED_TRACE(c->name + " hq " + std::to_string(s.hq) + " hkv " + std::to_string(s.hkv) + " page " +
                   std::to_string(s.page_size));
      if (expected_packed_heads(c->problem) == 0) {  // e.g. 33 queries of a group of 2: prefill kernels
        Plan plan(c->problem);
        EXPECT_EQ(plan.tiles().packed_heads, 0);
        continue;
      }
      c->poison_outputs();
      run_gpu(*c);
      expect_close(*c, download(*c), run_cpu(*c));
    }
}

// Decode steps whose routes follow from the sequence lengths (every block; a mask that leaves each
// row a prefix of its keys: none, causal in both alignments, a right window, sinks) make their
// routes in the kernel, with no route preparation: a route capacity of one record per row, which
// route preparation would overflow, still gives the CPU engine's result. Split and unsplit,
// batched, varlen and paged, one query and several (a partly masked last tile).
TEST(GpuDecode, StepWithRoutesFromLengths) {
  REQUIRE_SM90();
  std::mt19937_64 rng(73);
  std::uint64_t seed = 7300;
  for (const PrefixMask& v : kPrefixMasks)
    for (int layout = 0; layout < 4; ++layout) {  // 0 one sequence (split), 1 batch 3, 2 varlen, 3 paged 16
      CaseSpec spec;
      spec.format = Format::all_blocks;
      spec.varlen = layout == 2;
      spec.hq = 8;
      spec.hkv = 2;
      spec.max_seqlen_q = layout == 1 ? 5 : 1;
      spec.max_seqlen = 2600;
      spec.batch = layout == 2 ? 0 : layout == 1 ? 3 : 1;
      spec.mask = v.mask;
      spec.seed = seed++;
      auto c = make_case(spec);
      if (layout == 3) page_kv(*c, 16, rng);
      SCOPED_TRACE(c->name + " layout " + std::to_string(layout) + apply_prefix_mask(*c, v));
      c->poison_outputs();
      run_gpu(*c);
      c->problem.max_routes_per_row = 0;  // the CPU engine prepares routes
      expect_close(*c, download(*c), run_cpu(*c));
    }
}

// The split merge (split_merge.cuh merge_splits) takes the splits in batches of 16, a warp per row:
// one sequence long enough for 30 to 66 splits (two to five batches, the last one partial), every
// block (routes from the lengths) and block lists (route preparation), D 64 / 128 / 256, f32 and
// 16-bit outputs. Then a NaN or an infinity in one K element of KV head 0: the CPU engine's
// non-finite rows (issue 14: the rows it touches) must be NaN / non-finite through the merge,
// LSE included, and every other row must match.
TEST(GpuDecode, ManySplitsMergeInBatches) {
  REQUIRE_SM90();
  std::mt19937_64 rng(1207);
  std::uint64_t seed = 12070;
  std::size_t non_finite = 0;
  for (int rep = 0; rep < 6; ++rep) {
    const int shape = rep % 3;  // 0 bf16 D 128 every block; 1 f16 D 64 lists, f32 out; 2 bf16 D 256 lists
    const bool poisoned = rep >= 3;
    CaseSpec spec;
    spec.format = shape == 0 ? Format::all_blocks : Format::block_lists;
    spec.density = 0.8;
    spec.hq = 8;
    spec.hkv = 2;
    spec.sparsity_heads = 2;  // per KV head: the group's 4 query heads share a tile
    spec.max_seqlen_q = 1;
    spec.batch = 1;
    spec.mask = 0;
    spec.dtype = shape == 1 ? DType::f16 : DType::bf16;
    spec.out_f32 = shape == 1;
    spec.head_dim = shape == 0 ? 128 : shape == 1 ? 64 : 256;
    spec.bq = spec.bk = shape == 0 ? 128 : 64;
    spec.max_seqlen = shape == 0 ? 60000 : 30000;
    spec.seed = seed++;
    auto c = make_case(spec);
    if (poisoned) poison_kv_element(*c, c->k, 0, rep == 4 ? INFINITY : NAN, rng);
    SCOPED_TRACE(c->name + " rep " + std::to_string(rep));
    c->poison_outputs();
    Plan plan(c->problem);
    expect_decode_plan(plan);
    EXPECT_GT(plan.tiles().kv_splits, 16) << "one batch of splits only";
    non_finite += run_and_compare(*c, poisoned);
  }
  EXPECT_GT(non_finite, 0u) << "no poisoned element reached a row";
}

// Splits that merge in a cluster (split_merge.cuh push_partial / merge_cluster_splits: 2 to 16 splits
// whose clusters all fit at once; on the H200 up to 7 clusters of 16 CTAs of one per SM): one
// sequence of 2 head groups, so every split count up to 16 fits. These short steps (4-5 routes of
// 128 per split) run 64-wide routes on the decode kernel of two CTAs per SM. Row counts 4 (1 query
// of 4 packed heads: one row per owner at most), 16 (4 queries: several rows per owner, a warp
// each) and 64 (16 queries: more parts than the two-CTA kernel's inbox holds, so the launch falls
// back to the workspace merge), D 64 / 128 / 256, f32 and 16-bit outputs, and a NaN in one V
// element, which must reach the rows that read it through the merge as in the CPU engine.
// BSATTN_GPU_DECODE_CLUSTER=0 runs the same cases through the workspace merge
// (tests/gpu/device_check.sh, variants).
TEST(GpuDecode, SplitsMergeInClusters) {
  REQUIRE_SM90();
  std::mt19937_64 rng(1301);
  std::uint64_t seed = 13010;
  std::size_t non_finite = 0;
  for (int rep = 0; rep < 8; ++rep) {
    const int shape = rep % 4;
    // 0 bf16 D 128; 1 f16 D 64, f32 out; 2 bf16 D 256; 3 bf16 D 128, 4 queries (rep 3) or 16 (rep 7)
    const bool poisoned = rep >= 6;
    CaseSpec spec;
    spec.format = rep % 2 ? Format::block_lists : Format::all_blocks;
    spec.density = 0.9;
    spec.hq = 8;
    spec.hkv = 2;
    spec.sparsity_heads = 2;
    spec.max_seqlen_q = shape == 3 ? (rep == 3 ? 4 : 16) : 1;
    spec.exact_seqlen_q = shape == 3;
    spec.batch = 1;
    spec.mask = rep % 3 == 0 ? 1 : 0;
    spec.dtype = shape == 1 ? DType::f16 : DType::bf16;
    spec.out_f32 = shape == 1;
    spec.head_dim = shape == 1 ? 64 : shape == 2 ? 256 : 128;
    spec.bq = spec.bk = shape == 1 ? 64 : 128;
    if (shape == 2) spec.bk = 64;
    // Keys: 9 to 63 KV tiles (2 to 15 splits of at least 4 routes each).
    spec.max_seqlen = std::uniform_int_distribution<int>(2300, shape == 1 || shape == 2 ? 4000 : 8100)(rng);
    spec.seed = seed++;
    auto c = make_case(spec);
    if (poisoned) poison_kv_element(*c, c->v, 1, NAN, rng);
    SCOPED_TRACE(c->name + " rep " + std::to_string(rep));
    c->poison_outputs();
    Plan plan(c->problem);
    EXPECT_GE(plan.tiles().kv_splits, 2);
    EXPECT_LE(plan.tiles().kv_splits, 16);
    // At most 8 routes per split: a short step, on the decode kernel of two CTAs per SM (64 wide).
    if (spec.head_dim <= 128) EXPECT_EQ(plan.tiles().tile_n, 64);
    non_finite += run_and_compare(*c, poisoned);
  }
  EXPECT_GT(non_finite, 0u) << "no poisoned element reached a row";
}

// A decode step whose routes overflow the workspace writes nothing, split-KV or not: its tile
// warp loads the first tile's Q before route preparation has finished (kernel_ws.cuh) and leaves
// once Q has landed; the next runs on the same plan overflow again (the split arrival counts were
// not advanced), and a plan with room gives the CPU engine's result.
TEST(GpuDecode, RouteOverflowWritesNothing) {
  REQUIRE_SM90();
  for (const int batch : {1, 3}) {  // one sequence: split-KV; three: no split
    CaseSpec spec;
    spec.format = Format::bitmask;  // every block selected; all_blocks would make its routes (no overflow)
    spec.full_set = false;
    spec.density = 1.0;
    spec.hq = 8;
    spec.hkv = 2;
    spec.max_seqlen_q = 1;
    spec.max_seqlen = 2600;
    spec.batch = batch;
    spec.seed = 7200 + batch;
    spec.mask = 1;  // causal: one query sees every block
    auto c = make_case(spec);
    SCOPED_TRACE(c->name);
    c->problem.max_routes_per_row = 2;
    {
      Plan plan(c->problem);
      expect_decode_plan(plan);
      for (int run = 0; run < 2; ++run) expect_overflow_writes_nothing(plan, *c);
    }
    c->problem.max_routes_per_row = 0;
    c->poison_outputs();
    run_gpu(*c);
    expect_close(*c, download(*c), run_cpu(*c));
  }
}

// Clears about half of the set bits of a bitmask set (a subset stays a valid pattern), on the host
// and at the same device address.
void thin_bitmask(const TensorView& host, const TensorView& device, std::mt19937_64& rng) {
  std::int64_t words = 1;
  for (int i = 0; i < host.rank; ++i) words *= host.shape[i];
  auto* bits = static_cast<std::uint32_t*>(host.data);
  for (std::int64_t i = 0; i < words; ++i) bits[i] &= static_cast<std::uint32_t>(rng());
  CUDA_OK(cudaMemcpy(device.data, bits, words * 4, cudaMemcpyHostToDevice));
}

// A captured split-KV decode step replayed after new values were written at the same addresses:
// shorter sequences (seq_lens_kv), pages moved (block_table, caches) and fewer selected blocks
// (bitmask). The replay must equal an eager run on the new values and the CPU engine.
TEST(GpuDecode, GraphReplayWithNewLengthsTablesAndBlocks) {
  REQUIRE_SM90();
  CaseSpec spec;
  spec.format = Format::bitmask;
  spec.hq = 8;
  spec.hkv = 2;
  spec.sparsity_heads = 2;
  spec.batch = 2;
  spec.max_seqlen_q = 4;
  spec.max_seqlen = 3000;
  spec.bq = spec.bk = 64;
  spec.density = 0.7;
  spec.mask = 1;  // causal, bottom-right unless drawn top-left: a shorter KV sequence moves the diagonal
  spec.seed = 9191;
  auto c = make_case(spec);
  std::mt19937_64 rng(17);
  constexpr int kPage = 32;
  const PagedBuffers pb = page_kv(*c, kPage, rng);
  SCOPED_TRACE(c->name);

  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Plan plan(c->problem);
  expect_decode_plan(plan);
  EXPECT_GT(plan.tiles().kv_splits, 1);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  plan.run(c->in_device, c->out_device, stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  c->poison_outputs();
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  const Result before = download(*c);
  expect_close(*c, before, run_cpu(*c));

  shorten_and_move_pages(c->problem, pb, kPage, rng);
  thin_bitmask(c->in_host.partial.bits, c->in_device.partial.bits, rng);
  if (c->problem.has_full) thin_bitmask(c->in_host.full.bits, c->in_device.full.bits, rng);

  c->poison_outputs();
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  const Result replay = download(*c);
  c->poison_outputs();
  plan.run(c->in_device, c->out_device, stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  const Result eager = download(*c);
  EXPECT_EQ(replay.out, eager.out);
  EXPECT_EQ(0, std::memcmp(replay.lse.data(), eager.lse.data(), replay.lse.size() * 4));
  EXPECT_NE(before.lse, replay.lse);  // the new values mattered
  expect_close(*c, replay, run_cpu(*c));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace bsattn_gpu_test
