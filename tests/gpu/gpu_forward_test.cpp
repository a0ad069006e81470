// GPU tests (run on an SM90 device; reported as skipped elsewhere): device route preparation
// against the host, the forward kernel against the CPU engine on random problems of every
// format, CUDA-graph replay with changed metadata, route-capacity overflow.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "bsattn/route/prepare.hpp"
#include "formats/bind.hpp"
#include "gpu/fwd/work_items.hpp"
#include "gpu/prepare_routes.hpp"
#include "gpu_case.hpp"
#include "gpu_compare.hpp"
#include "gpu_paged.hpp"

namespace bsattn_gpu_test {
namespace {

struct Sweep {
  Format format;
  bool varlen;
};

const Sweep kSweeps[] = {{Format::all_blocks, false}, {Format::block_lists, false}, {Format::varlen_block_lists, true},
                         {Format::bsr, false},        {Format::bsr, true},          {Format::bitmask, false},
                         {Format::bitmask, true},     {Format::all_blocks, true}};

TEST(GpuForward, EveryFormatBf16D128) {
  REQUIRE_SM90();
  std::uint64_t seed = 100;
  for (const Sweep& s : kSweeps)
    for (int rep = 0; rep < 3; ++rep) {
      CaseSpec spec;
      spec.format = s.format;
      spec.varlen = s.varlen;
      spec.seed = seed++;
      check_against_cpu(spec);
    }
}

TEST(GpuForward, DtypesHeadDimsAndBlocks) {
  REQUIRE_SM90();
  const int blocks[][2] = {{128, 128}, {64, 64}, {128, 64}, {64, 128}, {256, 128}, {32, 64}, {16, 32}, {128, 96}, {64, 48}};
  std::uint64_t seed = 1000;
  for (DType dt : {DType::bf16, DType::f16})
    for (int d : {64, 128, 256})
      for (const auto& bl : blocks) {
        CaseSpec spec;
        spec.dtype = dt;
        spec.head_dim = d;
        spec.bq = bl[0];
        spec.bk = bl[1];
        const Sweep& s = kSweeps[seed % 8];
        spec.format = s.format;
        spec.varlen = s.varlen;
        spec.out_f32 = seed % 3 == 0;
        spec.seed = seed++;
        check_against_cpu(spec);
      }
}

// Many more work items than multiprocessors, with route counts that differ from row to row:
// persistent CTAs walk several tiles each (pipeline state and the Q / output staging buffer carry
// over from tile to tile), in the longest-first order. Cases 0-3: 64-row tiles (GQA packing);
// 4-5: 128 x 128 blocks with query-head pairs sharing routes and KV head, i.e. the CTA-pair
// kernel walking its static per-cluster share (hundreds of pair items for ~66 clusters).
TEST(GpuForward, PersistentManyTiles) {
  REQUIRE_SM90();
  std::uint64_t seed = 7000;
  for (int i = 0; i < 6; ++i) {
    CaseSpec spec;
    spec.format = kSweeps[1 + i].format;
    spec.varlen = kSweeps[1 + i].varlen;
    spec.batch = 4;
    spec.hq = 16;
    spec.hkv = 4;
    spec.head_dim = i % 2 ? 64 : 128;
    spec.bq = i < 4 ? 64 : 128;
    spec.bk = i < 4 ? 64 : 128;
    if (i >= 4) spec.sparsity_heads = 4;  // Hq / Hs = 4: head pairs share their routes
    spec.max_seqlen = i < 4 ? 900 : 1800;
    spec.density = 0.3;
    spec.mask = i < 4 ? i : (i == 4 ? 1 : 4);  // the pair with the positional and the token-tensor mask
    spec.out_f32 = i == 3;
    spec.seed = seed++;
    check_against_cpu(spec);
  }
}

// all_blocks with a token-level mask: the block size does not change what is computed, so a GPU
// prefill plan for the backward builds its routes from blocks of 128 x 128 (plan.cpp,
// gpu_route_blocks_of_128) where the mask's band is wide (no left window, or one of 1024 tokens or
// more; no document ids or KV validity bits), whatever block the caller named, and its forward runs
// on them; Plan::problem() stays the caller's. A forward-only plan keeps the caller's tiles, and so
// do the other masks, explicit tiles, block lists and D 256. Blocks of 16 to 128 (units of a tile,
// KV blocks cut by tiles), batched and varlen, GQA and MHA.
TEST(GpuForward, AllBlocksBackwardPlansTakeBlocksOf128) {
  REQUIRE_SM90();
  struct Shape {
    int bq, bk, mask, window_left;  // window_left >= 0 replaces the drawn one
    bool blocks_of_128;
  };
  const Shape shapes[] = {{64, 64, 0, -1, true},   {32, 48, 1, -1, true},    {128, 64, 2, 1100, true},
                          {64, 128, 2, -1, false}, {16, 16, 4, -1, false},   {64, 32, 5, -1, false},
                          {64, 64, 3, -1, false},  {16, 16, 1, -1, true}};
  std::uint64_t seed = 9700;
  for (int i = 0; i < 8; ++i) {
    const Shape& shape = shapes[i];
    CaseSpec spec;
    spec.format = Format::all_blocks;
    spec.varlen = i % 2 == 1;
    spec.bq = shape.bq;
    spec.bk = shape.bk;
    spec.mask = shape.mask;
    spec.max_seqlen = shape.window_left >= 0 ? 1700 : 333 + 41 * i;
    spec.hq = 4;
    spec.hkv = i < 4 ? 2 : 4;
    spec.seed = seed++;
    auto c = make_case(spec);
    if (shape.window_left >= 0) c->problem.mask.window_left = shape.window_left;
    SCOPED_TRACE(c->name);
    {
      const TileShape own = choose_tiles(c->problem);
      EXPECT_EQ(Plan(c->problem).tiles().unit_m, own.unit_m);  // forward only: the caller's blocks
      c->problem.backward = true;
      Plan plan(c->problem);
      EXPECT_EQ(plan.tiles().tile_m, shape.blocks_of_128 ? 128 : own.tile_m);
      EXPECT_EQ(plan.tiles().unit_m, shape.blocks_of_128 ? 128 : own.unit_m);
      if (shape.blocks_of_128) EXPECT_EQ(plan.tiles().tile_n, 128);
      EXPECT_EQ(plan.problem().block.q, spec.bq);
      EXPECT_EQ(plan.problem().block.kv, spec.bk);
      plan.run(c->in_device, c->out_device, nullptr);
      plan.check(nullptr);
      CUDA_OK(cudaDeviceSynchronize());
    }
    expect_close(*c, download(*c), run_cpu(*c));
  }
  const auto problem_of = [](Format format, int head_dim) {
    CaseSpec spec;
    spec.format = format;
    spec.head_dim = head_dim;
    spec.bq = spec.bk = 64;
    spec.mask = 1;
    spec.max_seqlen = 300;
    Problem problem = make_case(spec)->problem;
    problem.backward = true;
    return problem;
  };
  Problem explicit_tiles = problem_of(Format::all_blocks, 128);
  explicit_tiles.tile_n = 64;
  EXPECT_EQ(Plan(explicit_tiles).tiles().tile_m, 64);
  EXPECT_EQ(Plan(problem_of(Format::block_lists, 128)).tiles().tile_m, 64);
  EXPECT_EQ(Plan(problem_of(Format::all_blocks, 256)).tiles().tile_m, 64);
}

// Q blocks of 64 and KV blocks of 128 at D 128: a tile of one query head (heads not packable)
// runs 64-wide routes, two per KV block, so that two CTAs share a multiprocessor; packable heads,
// an explicit tile_n and a plan for the backward keep the KV block's width. Every format, masks,
// varlen, tails; results against the CPU engine.
TEST(GpuForward, UnpackedRows64TilesTakeTwoRoutesPerBlock) {
  REQUIRE_SM90();
  std::uint64_t seed = 9500;
  for (int i = 0; i < 10; ++i) {
    CaseSpec spec;
    const Sweep& s = kSweeps[i < 8 ? i : i - 6];  // with a pattern per query head: lists and BSR
    spec.format = s.format;
    spec.varlen = s.varlen;
    spec.bq = 64;
    spec.bk = 128;
    spec.hq = i < 8 ? 3 : 4;  // 3 / 3: MHA with an odd head count; 4 / 2 with a pattern per query head
    spec.hkv = i < 8 ? 3 : 2;
    spec.sparsity_heads = i < 8 ? 0 : 4;
    spec.mask = i % 6;
    spec.max_seqlen = 300 + 37 * i;
    spec.out_f32 = i == 5;
    spec.seed = seed++;
    auto c = make_case(spec);
    SCOPED_TRACE(c->name);
    {
      Plan plan(c->problem);
      EXPECT_EQ(plan.tiles().tile_n, 64);
      EXPECT_EQ(plan.tiles().kv_split, 2);
      plan.run(c->in_device, c->out_device, nullptr);
      plan.check(nullptr);
      CUDA_OK(cudaDeviceSynchronize());
    }
    expect_close(*c, download(*c), run_cpu(*c));
  }
  const auto problem_of = [](int hq, int hkv, int sparsity_heads) {
    CaseSpec spec;
    spec.bq = 64;
    spec.bk = 128;
    spec.hq = hq;
    spec.hkv = hkv;
    spec.sparsity_heads = sparsity_heads;
    return make_case(spec)->problem;
  };
  EXPECT_EQ(Plan(problem_of(4, 2, 2)).tiles().tile_n, 128) << "query-head pairs share routes and K/V";
  Problem explicit_width = problem_of(3, 3, 3);
  explicit_width.tile_n = 128;
  EXPECT_EQ(Plan(explicit_width).tiles().tile_n, 128);
  Problem for_backward = problem_of(3, 3, 3);
  for_backward.backward = true;
  EXPECT_EQ(Plan(for_backward).tiles().tile_n, 128);
}

// One random element of `b` (of its first valid_elems) set to `value`, on the device too.
void poison_element(Buffer* b, std::size_t valid_elems, float value, std::mt19937_64& rng) {
  const std::size_t i = std::uniform_int_distribution<std::size_t>(0, valid_elems - 1)(rng);
  b->as<std::uint16_t>()[i] = to_bits(value, b->dtype);
  b->upload();
}

// KV blocks of at most 64 (D <= 128) under two consumer warpgroups (Q blocks of 128, or 64-row
// tiles of two query heads): the kernel takes the row's routes in pairs, any two KV tiles side by
// side in one 128-wide step, the second half of a row's last step empty (odd route counts) and
// zero-filled. Every format, each built-in mask, varlen, tails, GQA and MHA, KV blocks of 64, 48
// and 32 (routes narrower than the half); then NaN / inf in V, which must reach exactly the rows
// that attend it (an empty half must not carry a stale stage's NaN).
TEST(GpuForward, TwoWarpgroupTilesPairTheirRoutes) {
  REQUIRE_SM90();
  std::uint64_t seed = 9700;
  for (int i = 0; i < 20; ++i) {
    CaseSpec spec;
    const Sweep& s = kSweeps[i % 8];
    spec.format = s.format;
    spec.varlen = s.varlen;
    const bool packed = i >= 14;  // 64-row tiles, query-head pairs sharing routes and KV head
    spec.bq = packed ? 64 : 128;
    spec.bk = i < 10 || i == 14 || i == 16 ? 64 : (i % 2 ? 32 : 48);
    spec.hq = packed ? 8 : i % 3 == 0 ? 3 : 4;
    spec.hkv = packed ? 2 : i % 3 == 0 ? 3 : i % 3 == 1 ? 2 : 1;
    if (packed) spec.sparsity_heads = i % 2 ? 2 : 1;
    spec.mask = i % 6;
    spec.head_dim = i % 4 == 3 ? 64 : 128;
    spec.dtype = i % 5 == 4 ? DType::f16 : DType::bf16;
    spec.density = i % 2 ? 0.3 : 0.6;
    spec.max_seqlen = 300 + 61 * i;
    spec.out_f32 = i == 6;
    spec.seed = seed++;
    check_against_cpu(spec);
  }
  const float kValues[] = {NAN, INFINITY, -INFINITY};
  std::mt19937_64 rng(11);
  std::size_t non_finite = 0;
  for (int i = 0; i < 4; ++i) {
    CaseSpec spec;
    spec.format = i % 2 ? Format::bsr : Format::block_lists;
    spec.bq = 128;
    spec.bk = 64;
    spec.mask = 0;
    spec.density = 0.3;
    spec.max_seqlen = 500 + 37 * i;
    spec.seed = seed++;
    auto c = make_case(spec);
    SCOPED_TRACE(c->name + " (V)");
    Buffer* v = c->v;
    const std::int64_t tokens = v->shape[0] * v->shape[1];
    const std::size_t per_token = static_cast<std::size_t>(v->shape[2] * v->shape[3]);
    for (int n = 0; n < 2; ++n) poison_element(v, tokens * per_token, kValues[(i + n) % 3], rng);
    {
      Plan plan(c->problem);
      plan.run(c->in_device, c->out_device, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
    }
    non_finite += expect_same_non_finite(*c, download(*c), run_cpu(*c));
  }
  EXPECT_GT(non_finite, 0u) << "no poisoned element reached a row";
}

TEST(GpuForward, GqaAndMasks) {
  REQUIRE_SM90();
  const int heads[][2] = {{4, 4}, {4, 1}, {8, 2}};
  std::uint64_t seed = 5000;
  for (const auto& hh : heads)
    for (int mask = 0; mask <= 5; ++mask) {
      CaseSpec spec;
      spec.hq = hh[0];
      spec.hkv = hh[1];
      spec.mask = mask;
      spec.bq = 64;
      spec.bk = 64;
      const Sweep& s = kSweeps[seed % 8];
      spec.format = s.format;
      spec.varlen = s.varlen;
      spec.seed = seed++;
      check_against_cpu(spec);
    }
}

TEST(GpuForward, LongerSequencesDense) {
  REQUIRE_SM90();
  for (int i = 0; i < 2; ++i) {
    CaseSpec spec;
    spec.format = i ? Format::all_blocks : Format::block_lists;
    spec.density = 0.8;
    spec.max_seqlen = 1100;
    spec.mask = i ? 1 : 0;
    spec.hq = 2;
    spec.hkv = 1;
    spec.seed = 9000 + i;
    check_against_cpu(spec);
  }
}

// Device-prepared routes equal host-prepared ones, for every format.
TEST(GpuRoutes, DeviceMatchesHost) {
  REQUIRE_SM90();
  std::uint64_t seed = 7000;
  for (const Sweep& s : kSweeps)
    for (int rep = 0; rep < 2; ++rep) {
      CaseSpec spec;
      spec.format = s.format;
      spec.varlen = s.varlen;
      spec.bq = rep ? 32 : 128;
      spec.bk = rep ? 256 : 64;
      spec.seed = seed++;
      auto c = make_case(spec);
      SCOPED_TRACE(c->name);
      const TileShape tiles = choose_tiles(c->problem);
      const int capacity = c->max_kv_blocks() * tiles.kv_split;
      AttentionParams host = formats::bind(c->problem, tiles, capacity, c->in_host, c->out_host);
      AttentionParams dev = formats::bind(c->problem, tiles, capacity, c->in_device, c->out_device);
      const bool derive = host.route.varlen_q && host.route.format != route::SetFormat::all_blocks &&
                          host.route.format != route::SetFormat::block_lists;
      std::vector<std::int32_t> cu_m(c->batch() + 1), cu_i(c->batch() + 1);
      std::int32_t* d_cu = nullptr;
      std::int32_t* d_flag = nullptr;
      route::Route* d_routes = nullptr;
      std::int32_t* d_counts = nullptr;
      const std::size_t rows = host.route_rows;
      CUDA_OK(cudaMalloc(&d_cu, 2 * (c->batch() + 1) * sizeof(std::int32_t)));
      CUDA_OK(cudaMalloc(&d_flag, bsattn::gpu::kRouteFlagWords * sizeof(std::int32_t)));
      CUDA_OK(cudaMalloc(&d_routes, rows * capacity * sizeof(route::Route)));
      CUDA_OK(cudaMalloc(&d_counts, rows * sizeof(std::int32_t)));
      CUDA_OK(cudaMemset(d_flag, 0, bsattn::gpu::kRouteFlagWords * sizeof(std::int32_t)));
      if (derive) {
        route::varlen_block_offsets(host.route, cu_m.data(), cu_i.data());
        host.route.cu_total_m_blocks = cu_m.data();
        host.route.cu_block_idx_offsets = cu_i.data();
        CUDA_OK(bsattn::gpu::derive_varlen_block_offsets(dev.route, d_cu, d_cu + c->batch() + 1, nullptr));
        dev.route.cu_total_m_blocks = d_cu;
        dev.route.cu_block_idx_offsets = d_cu + c->batch() + 1;
      }
      CUDA_OK(bsattn::gpu::prepare_routes(dev, d_routes, d_counts, d_flag, nullptr));
      std::vector<route::Route> got(rows * capacity);
      std::vector<std::int32_t> got_counts(rows), flag(2);
      CUDA_OK(cudaMemcpy(got.data(), d_routes, got.size() * sizeof(route::Route), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(got_counts.data(), d_counts, rows * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(flag.data(), d_flag, 2 * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
      EXPECT_EQ(flag[0], 0);
      std::vector<route::Route> want(capacity);
      std::size_t mismatches = 0, total = 0;
      for (std::size_t r = 0; r < rows; ++r) {
        const int n = route::prepare_row(host.route, static_cast<int>(r), want.data());
        total += n;
        if (got_counts[r] != n) {
          ++mismatches;
          continue;
        }
        for (int i = 0; i < n; ++i) {
          const route::Route& a = got[r * capacity + i];
          const route::Route& b = want[i];
          if (a.index != b.index || a.kind != b.kind || a.rows != b.rows || a.masked != b.masked) ++mismatches;
        }
      }
      EXPECT_EQ(mismatches, 0u);
      EXPECT_GT(total, 0u);
      cudaFree(d_cu);
      cudaFree(d_flag);
      cudaFree(d_routes);
      cudaFree(d_counts);
    }
}

// The persistent kernel's item numbering, on the host: the live items of a launch (whole rows of
// the work order, any split count) reach every (row position, head group) exactly once, each head
// group inside its row's sparsity head, whichever windows go KV head by KV head. Rows go in work
// order; where a sparsity head spans several KV heads, the windows hold at least `concurrent`
// items of each KV head (all rows in the last), and a window numbered KV head by KV head takes
// its rows in order within each KV head.
TEST(GpuRoutesHost, WorkItemsReachEveryRowAndHeadOnce) {
  struct Shape {
    int hq, hkv, hs, heads_per_tile;
  };
  const Shape shapes[] = {{32, 8, 32, 1}, {32, 8, 32, 2}, {32, 8, 8, 2}, {32, 8, 1, 2}, {32, 8, 1, 1},
                          {32, 8, 1, 4}, {40, 40, 1, 1}, {40, 40, 40, 1}, {32, 8, 2, 2}, {12, 4, 3, 1},
                          {12, 4, 1, 3}, {6, 3, 1, 2}, {16, 16, 4, 2}, {8, 1, 1, 2}};
  for (const Shape& sh : shapes)
    for (const int live_rows : {1, 3, 64, 257})
      for (const int concurrent : {1, 2, 7, 66, 132, 100000})
        for (const int kv_major_windows : {0, 1, 2}) {  // none, every window, every other window
          SCOPED_TRACE("hq " + std::to_string(sh.hq) + " hkv " + std::to_string(sh.hkv) + " hs " +
                       std::to_string(sh.hs) + " heads per tile " + std::to_string(sh.heads_per_tile) + " rows " +
                       std::to_string(live_rows) + " concurrent " + std::to_string(concurrent) + " kv-major windows " +
                       std::to_string(kv_major_windows));
          bsattn::route::RouteParams p;
          p.heads_q = sh.hq;
          p.heads_kv = sh.hkv;
          p.sparsity_heads = sh.hs;
          const int group = sh.hq / sh.hs, per_row = group / sh.heads_per_tile, kv_group = sh.hq / sh.hkv;
          if (per_row == 0) continue;  // heads_per_tile above the sparsity head's: not a packing
          const int units = live_rows * per_row;
          // A sparsity head spans several KV heads whole items cover: windows that may go KV head by KV head.
          const bool spans = group > kv_group && group % kv_group == 0 && kv_group % sh.heads_per_tile == 0;
          const int per_kv = spans ? kv_group / sh.heads_per_tile : per_row;
          const int window_rows = std::max(1, (concurrent + per_kv - 1) / per_kv);
          std::vector<int> seen(static_cast<std::size_t>(units), 0);
          std::array<int, 3> last{-1, -1, -1};  // (window, KV head, row) of the previous item
          bool ordered = true;
          for (int unit = 0; unit < units; ++unit) {
            const bsattn::gpu::fwd::ItemWindow w =
                bsattn::gpu::fwd::item_window(p, sh.heads_per_tile, unit, units, concurrent);
            ASSERT_EQ(w.per_row, per_row);
            ASSERT_EQ(w.per_kv, per_kv);
            ASSERT_EQ(w.first_row % window_rows, 0);
            ASSERT_EQ(w.rows, std::min(window_rows, live_rows - w.first_row));
            ASSERT_GE(unit, w.first_row * per_row);
            ASSERT_LT(unit, (w.first_row + w.rows) * per_row);
            const int window = w.first_row / window_rows;
            const bool kv_major = kv_major_windows == 1 || (kv_major_windows == 2 && window % 2 == 1);
            const bsattn::gpu::fwd::ItemPlace at = bsattn::gpu::fwd::item_place(w, sh.heads_per_tile, unit, kv_major);
            ASSERT_GE(at.order_index, w.first_row);
            ASSERT_LT(at.order_index, w.first_row + w.rows);
            ASSERT_GE(at.head_offset, 0);
            ASSERT_LT(at.head_offset, group);
            ASSERT_EQ(at.head_offset % sh.heads_per_tile, 0);
            ++seen[static_cast<std::size_t>(at.order_index) * per_row + at.head_offset / sh.heads_per_tile];
            const int kv = kv_major && spans ? at.head_offset / kv_group : 0;  // KV head within the sparsity head's
            const std::array<int, 3> key{window, kv, at.order_index};
            if (key[0] != last[0]) last = {key[0], -1, -1};
            ordered &= key >= last;
            last = key;
          }
          for (int v : seen) ASSERT_EQ(v, 1);
          EXPECT_TRUE(ordered);
        }
}

// Which windows go KV head by KV head (of a sorted work order): with the CTA pairs' static share,
// full windows inside one group of the order (one sequence and sparsity head) and windows whose
// rows are as long as each other; not a window across two sequences' rows of unequal length, nor
// a partial one of unequal rows (its runs would not line up with the share's groups). Items
// claimed from the counter: only windows of equal rows.
TEST(GpuRoutesHost, KvMajorWindowsAreThoseTheShareBalances) {
  bsattn::route::RouteParams p;
  p.heads_q = 32;
  p.heads_kv = 8;
  p.sparsity_heads = 1;
  p.max_q_tiles = 40;
  const int per_row = 16, concurrent = 66, rows = 80;  // two sequences of 40 route rows
  std::vector<std::int32_t> counts(rows), order(rows);
  bsattn::AttentionParams a;
  a.route = p;
  a.route_counts = counts.data();
  const auto by_order = [&](int i) { return order[static_cast<std::size_t>(i)]; };
  const auto window_at = [&](int row) {
    return bsattn::gpu::fwd::item_window(p, 2, row * per_row, rows * per_row, concurrent);
  };
  const auto kv_major = [&](int row) {
    return bsattn::gpu::fwd::kv_major_window<true>(a, window_at(row), concurrent, by_order);
  };
  ASSERT_EQ(window_at(0).rows, 33);
  ASSERT_EQ(window_at(79).first_row, 66);
  ASSERT_EQ(window_at(79).rows, 14);
  // Causal rows, sorted longest first within each sequence (rows 0-39: sequence 0, 40-79: 1).
  for (int i = 0; i < rows; ++i) {
    order[static_cast<std::size_t>(i)] = i < 40 ? 39 - i : 40 + 79 - i;
    counts[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] = i < 40 ? 40 - i : 80 - i;
  }
  EXPECT_TRUE(kv_major(0));    // positions 0-32: sequence 0
  EXPECT_FALSE(kv_major(33));  // positions 33-65: both sequences
  EXPECT_FALSE(kv_major(66));  // a partial window of unequal rows
  // Equal rows: every window, the partial one and the one across both sequences too.
  for (auto& c : counts) c = 7;
  for (int row : {0, 33, 66}) EXPECT_TRUE(kv_major(row));
  // Rows of two sequences sorted together (one range of the order), counts falling across the
  // boundary: taken only where first and last are of one sequence.
  a.route.max_q_tiles = 25;
  for (int i = 0; i < rows; ++i) {
    order[static_cast<std::size_t>(i)] = i;
    counts[static_cast<std::size_t>(i)] = 100 - i;
  }
  EXPECT_FALSE(kv_major(0));  // rows 0-32: sequences 0 and 1
  a.route.max_q_tiles = 40;
  EXPECT_TRUE(kv_major(0));
  EXPECT_FALSE(bsattn::gpu::fwd::kv_major_window<false>(a, window_at(0), concurrent, by_order));
  for (auto& c : counts) c = 7;
  EXPECT_TRUE(bsattn::gpu::fwd::kv_major_window<false>(a, window_at(0), concurrent, by_order));
}

// The work order: a permutation of the rows, grouped by KV group (rows_per_group consecutive rows;
// more groups than the sort's bins share a range, in order), longest first inside a group up to
// the count scaling (counts within max_count / bins of each other may swap). Given the route
// parameters, the rows whose Q tile starts past their sequence's end (varlen sequences shorter
// than the longest, some empty) come after all others, and the live-rows word counts the rest.
TEST(GpuRoutes, WorkOrderGroupsByKvThenLongestFirst) {
  REQUIRE_SM90();
  std::mt19937 rng(31);
  const auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int shapes[][3] = {{4096, 1024, 40}, {8192, 256, 256}, {777, 37, 1000}, {50000, 100, 64}, {5, 5, 3}};
  for (const auto& shape : shapes)
    for (const bool with_route : {false, true}) {
      int rows = shape[0];
      bsattn::gpu::RowOrder groups;
      groups.rows_per_group = shape[1];
      groups.max_count = shape[2];
      // with_route: varlen sequences of 1-6 x 64 tokens (or none) under tile_m 64, max_q_tiles = rows_per_group.
      bsattn::route::RouteParams p;
      std::vector<std::int32_t> cu;
      if (with_route) {
        p.batch = std::max(1, rows / groups.rows_per_group);
        p.heads_q = p.heads_kv = p.sparsity_heads = 1;
        p.tile_m = 64;
        p.varlen_q = true;
        p.max_q_tiles = groups.rows_per_group;
        cu.assign(p.batch + 1, 0);
        for (int b = 0; b < p.batch; ++b)
          cu[b + 1] = cu[b] + (uni(0, 4) == 0 ? 0 : uni(1, 64 * groups.rows_per_group));
        p.max_seqlen_q = 64 * groups.rows_per_group;
        rows = p.batch * p.max_q_tiles;
      }
      SCOPED_TRACE("rows " + std::to_string(rows) + " per group " + std::to_string(shape[1]) +
                   (with_route ? ", live rows" : ""));
      std::vector<std::int32_t> counts(rows), order(rows, -1);
      for (auto& c : counts) c = uni(0, groups.max_count);
      std::int32_t *d_counts = nullptr, *d_order = nullptr, *d_cu = nullptr, *d_live = nullptr;
      CUDA_OK(cudaMalloc(&d_counts, rows * sizeof(std::int32_t)));
      CUDA_OK(cudaMalloc(&d_order, rows * sizeof(std::int32_t)));
      CUDA_OK(cudaMalloc(&d_live, sizeof(std::int32_t)));
      CUDA_OK(cudaMemcpy(d_counts, counts.data(), rows * sizeof(std::int32_t), cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemset(d_order, 0xff, rows * sizeof(std::int32_t)));
      CUDA_OK(cudaMemset(d_live, 0xff, sizeof(std::int32_t)));
      if (with_route) {
        CUDA_OK(cudaMalloc(&d_cu, cu.size() * sizeof(std::int32_t)));
        CUDA_OK(cudaMemcpy(d_cu, cu.data(), cu.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));
        p.cu_seqlens_q = d_cu;
        CUDA_OK(bsattn::gpu::order_rows(d_counts, rows, groups, d_order, nullptr, &p, d_live));
      } else {
        CUDA_OK(bsattn::gpu::order_rows(d_counts, rows, groups, d_order, nullptr));
      }
      std::int32_t live_word = -1;
      CUDA_OK(cudaMemcpy(order.data(), d_order, rows * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(&live_word, d_live, sizeof(std::int32_t), cudaMemcpyDeviceToHost));
      for (std::int32_t* d : {d_counts, d_order, d_cu, d_live}) CUDA_OK(cudaFree(d));
      const auto live = [&](int row) {
        return !with_route || (row % p.max_q_tiles) * p.tile_m < cu[row / p.max_q_tiles + 1] - cu[row / p.max_q_tiles];
      };
      int live_rows = 0;
      for (int r = 0; r < rows; ++r) live_rows += live(r) ? 1 : 0;
      if (with_route) EXPECT_EQ(live_word, live_rows);
      else EXPECT_EQ(live_word, -1) << "the live-rows word written without being asked for";
      std::vector<int> seen(rows, 0);
      for (int i = 0; i < rows; ++i) {
        const int r = order[i];
        ASSERT_TRUE(r >= 0 && r < rows) << r;
        ++seen[r];
        ASSERT_EQ(live(r), i < live_rows) << "position " << i << ": row " << r;
      }
      for (int r = 0; r < rows; ++r) ASSERT_EQ(seen[r], 1) << "row " << r;
      const int group_count = (rows + groups.rows_per_group - 1) / groups.rows_per_group;
      const int bins = std::min(group_count, bsattn::gpu::kOrderGroups);
      // One count bin of the sort: counts this close may come in either order.
      const double tolerance = static_cast<double>(groups.max_count + 1) / bsattn::gpu::order_count_bins(bins);
      for (int i = 1; i < live_rows; ++i) {
        const int a = order[i - 1], b = order[i];
        const long long range_a = static_cast<long long>(a / groups.rows_per_group) * bins / group_count;
        const long long range_b = static_cast<long long>(b / groups.rows_per_group) * bins / group_count;
        ASSERT_LE(range_a, range_b) << "position " << i;
        if (range_a == range_b) ASSERT_GE(counts[a] + tolerance, counts[b]) << "position " << i;
      }
    }
}

// run() captured in a CUDA graph, replayed after the metadata values changed in place, gives
// the eager result for the new values.
TEST(GpuForward, GraphReplayWithChangedMetadata) {
  REQUIRE_SM90();
  for (Format f : {Format::block_lists, Format::bitmask}) {
    CaseSpec spec;
    spec.format = f;
    spec.varlen = f == Format::bitmask;
    spec.seed = 4242;
    spec.density = 0.3;
    auto a = make_case(spec);
    spec.density = 0.7;
    auto b = make_case(spec);  // same seed: same shapes and Q/K/V, other metadata sizes match
    SCOPED_TRACE(a->name);
    ASSERT_EQ(a->buffers.size(), b->buffers.size());

    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    Plan plan(a->problem);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    plan.run(a->in_device, a->out_device, stream);
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    // Replay with a's metadata.
    a->poison_outputs();
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const Result ga = download(*a);
    // Overwrite a's metadata buffers with b's values (same addresses), replay.
    for (std::size_t i = 0; i < a->buffers.size(); ++i) {
      Buffer& x = *a->buffers[i];
      const Buffer& y = *b->buffers[i];
      if (&x == a->out || &x == a->lse || x.bytes() != y.bytes()) continue;
      CUDA_OK(cudaMemcpy(x.device, y.host.data(), y.bytes(), cudaMemcpyHostToDevice));
      x.host = y.host;
    }
    a->poison_outputs();
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const Result gb = download(*a);
    // Eager run on the new values.
    a->poison_outputs();
    plan.run(a->in_device, a->out_device, stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    const Result eb = download(*a);
    EXPECT_EQ(gb.out, eb.out);
    EXPECT_EQ(0, std::memcmp(gb.lse.data(), eb.lse.data(), gb.lse.size() * 4));
    EXPECT_NE(ga.out, gb.out);  // the metadata change mattered
    expect_close(*a, gb, run_cpu(*a));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

// Prefill runs whose routes follow from the sequence lengths (every block; a mask that leaves each
// row a prefix of its keys: none, causal in both alignments, a right window, sinks) and whose work
// items fit the multiprocessors make their routes in the kernel, with no route preparation: a
// capacity of one record per row, which route preparation would overflow, still gives the CPU
// engine's result. Batched, varlen and paged K/V; 128- and 64-row tiles, 128- and 64-wide K/V.
TEST(GpuForward, PrefillWithRoutesFromLengths) {
  REQUIRE_SM90();
  const int blocks[][2] = {{128, 128}, {64, 64}, {128, 64}};
  std::mt19937_64 rng(91);
  std::uint64_t seed = 9100;
  for (const PrefixMask& v : kPrefixMasks)
    for (int layout = 0; layout < 3; ++layout)  // 0 batched, 1 varlen, 2 paged pages of 16
      for (const auto& bl : blocks) {
        CaseSpec spec;
        spec.format = Format::all_blocks;
        spec.varlen = layout == 1;
        spec.bq = bl[0];
        spec.bk = bl[1];
        spec.mask = v.mask;
        spec.seed = seed++;
        auto c = make_case(spec);
        if (layout == 2) page_kv(*c, 16, rng);
        SCOPED_TRACE(c->name + " layout " + std::to_string(layout) + apply_prefix_mask(*c, v));
        c->poison_outputs();
        {
          Plan plan(c->problem);
          plan.run(c->in_device, c->out_device, nullptr);
          plan.check(nullptr);  // throws on an overflow: none, as no route is stored
          CUDA_OK(cudaDeviceSynchronize());
        }
        c->problem.max_routes_per_row = 0;  // the CPU engine prepares routes
        expect_close(*c, download(*c), run_cpu(*c));
      }
}

// A route capacity too small: with validation run() throws before writing; without, the kernel
// writes nothing and check() reports the overflow.
TEST(GpuForward, RouteOverflow) {
  REQUIRE_SM90();
  CaseSpec spec;
  // Block lists keeping every block: stored routes (all blocks with a positional mask and few
  // rows would make their routes in the kernel, where nothing overflows).
  spec.format = Format::block_lists;
  spec.density = 1.0;
  spec.seed = 77;
  auto c = make_case(spec);
  c->problem.max_routes_per_row = 1;
  {
    Plan plan(c->problem);
    expect_overflow_writes_nothing(plan, *c);
  }
  c->problem.validate = true;
  Plan plan(c->problem);
  EXPECT_THROW(plan.run(c->in_device, c->out_device, nullptr), Error);
}

// The flags need no clearing between runs (gpu/prepare_routes.hpp): on one plan, a run that
// overflows, then a run whose pattern fits (each 32-block word of the bitmask cut to its lowest
// set block, at the same addresses) and a run that overflows again. Each is reported for itself,
// and the fitting run equals the CPU engine; the next overflowing run again writes nothing.
TEST(GpuForward, RouteOverflowThenFitOnOnePlan) {
  REQUIRE_SM90();
  CaseSpec spec;
  spec.format = Format::bitmask;
  spec.full_set = false;
  spec.density = 1.0;
  spec.mask = 0;
  spec.bq = spec.bk = 64;
  spec.max_seqlen = 1500;  // up to 24 blocks of 64, at most one a 32-block word after the cut
  spec.seed = 78;
  auto c = make_case(spec);
  c->problem.max_routes_per_row = 2;
  Plan plan(c->problem);
  expect_overflow_writes_nothing(plan, *c);
  const TensorView& host = c->in_host.partial.bits;
  std::int64_t words = 1;
  for (int i = 0; i < host.rank; ++i) words *= host.shape[i];
  auto* bits = static_cast<std::uint32_t*>(host.data);
  std::vector<std::uint32_t> dense(bits, bits + words);
  for (std::int64_t i = 0; i < words; ++i) bits[i] &= ~bits[i] + 1u;  // the lowest set bit
  CUDA_OK(cudaMemcpy(c->in_device.partial.bits.data, bits, words * 4, cudaMemcpyHostToDevice));
  c->poison_outputs();
  plan.run(c->in_device, c->out_device, nullptr);
  EXPECT_NO_THROW(plan.check(nullptr));
  expect_close(*c, download(*c), run_cpu(*c));
  std::copy(dense.begin(), dense.end(), bits);
  CUDA_OK(cudaMemcpy(c->in_device.partial.bits.data, bits, words * 4, cudaMemcpyHostToDevice));
  expect_overflow_writes_nothing(plan, *c);
}

TEST(GpuPlan, RejectsUnsupported) {
  REQUIRE_SM90();
  Problem p;
  p.device = Device::cuda;
  p.max_seqlen_q = p.max_seqlen_kv = 128;
  p.dtype = DType::f32;
  EXPECT_THROW(Plan{p}, Error);
  p.dtype = DType::bf16;
  p.scale = -0.125f;  // the row max and the -inf mask assume a positive scale
  try {
    Plan{p};
    ADD_FAILURE() << "a negative scale was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("problem.scale"), std::string::npos) << e.what();
  }
}

// Non-finite inputs (issue 14): the GPU shows a NaN or infinity in Q, K or V in exactly the rows
// where the CPU engine (checked against the float64 oracle by bsattn_nonfinite_test) shows it,
// NaN as NaN, and leaves every other row as it is. V only where no row weighs a loaded V row by
// zero (no mask, batched: TMA zero-fills past the sequence), as in the CPU suite.
TEST(GpuForward, NonFiniteInputsReachTheirRows) {
  REQUIRE_SM90();
  const float kValues[] = {NAN, INFINITY, -INFINITY};
  std::mt19937_64 rng(7);
  std::uint64_t seed = 900;
  std::size_t non_finite = 0;
  for (const Sweep& s : kSweeps)
    for (int target = 0; target < 3; ++target) {  // Q, K, V
      if (target == 2 && (s.varlen || s.format == Format::varlen_block_lists)) continue;
      CaseSpec spec;
      spec.format = s.format;
      spec.varlen = s.varlen;
      spec.mask = target == 2 ? 0 : -1;
      spec.dtype = seed % 2 ? DType::bf16 : DType::f16;
      spec.seed = seed++;
      auto c = make_case(spec);
      if (c->varlen() && (c->problem.total_q == 0 || c->problem.total_kv == 0)) continue;
      SCOPED_TRACE(c->name + (target == 0 ? " (Q)" : target == 1 ? " (K)" : " (V)"));
      Buffer* b = target == 0 ? c->q : target == 1 ? c->k : c->v;
      const std::int64_t tokens = target == 0 ? (c->varlen() ? c->problem.total_q : b->shape[0] * b->shape[1])
                                              : (c->varlen() ? c->problem.total_kv : b->shape[0] * b->shape[1]);
      const std::size_t per_token = static_cast<std::size_t>(b->shape[b->shape.size() - 2] * b->shape.back());
      for (int n = 0; n < 2; ++n) poison_element(b, tokens * per_token, kValues[(seed + n) % 3], rng);
      {
        Plan plan(c->problem);
        plan.run(c->in_device, c->out_device, nullptr);
        CUDA_OK(cudaDeviceSynchronize());
      }
      const Result gpu = download(*c);
      const Result ref = run_cpu(*c);
      non_finite += expect_same_non_finite(*c, gpu, ref);
    }
  EXPECT_GT(non_finite, 0u) << "no poisoned element reached a row";
}

}  // namespace
}  // namespace bsattn_gpu_test
