// Plan-time validation: the problem alone (sizes, enumerations, block and tile sizes, feature
// combinations, int32 extents). See validate.hpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "bsattn/route/route.hpp"
#include "formats/structure.hpp"
#include "formats/validate.hpp"

namespace bsattn::formats {
namespace {

void expect_positive(const char* name, std::int64_t value) {
  expect(value > 0, name, [&] { return "= " + str(value) + ", expected a positive value"; });
}

void expect_at_least(const char* name, std::int64_t value, std::int64_t lowest) {
  expect(value >= lowest, name, [&] { return "= " + str(value) + ", expected at least " + str(lowest); });
}

// Enumerations arrive from bindings as plain integers; anything past the last enumerator is garbage.
template <class Enum>
void expect_known(const char* name, Enum value, Enum last) {
  const int v = static_cast<int>(value);
  expect(v >= 0 && v <= static_cast<int>(last), name, [&] { return "= " + str(v) + " is not a known value"; });
}

void expect_float_dtype(const char* name, DType dtype) {
  expect(dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16, name,
         [&] { return std::string("= ") + to_string(dtype) + ", expected f32, f16 or bf16"; });
}

void check_block_and_tiles(const Problem& pb, const TileShape& tiles) {
  const int bq = pb.block.q, bk = pb.block.kv;
  expect(bq == 16 || bq == 32 || (bq > 0 && bq % 64 == 0), "problem.block.q",
         [&] { return "Bq = " + str(bq) + " is not supported, expected 16, 32 or a positive multiple of 64"; });
  expect(bk > 0 && bk % 16 == 0, "problem.block.kv",
         [&] { return "Bk = " + str(bk) + " is not supported, expected a positive multiple of 16"; });
  expect_at_least("problem.tile_m", pb.tile_m, 0);
  expect_at_least("problem.tile_n", pb.tile_n, 0);

  // Valid block sizes always get valid automatic tiles; an error here names the override.
  const int tm = tiles.tile_m, tn = tiles.tile_n;
  expect(tm % 16 == 0, "problem.tile_m", [&] { return "tile_m = " + str(tm) + " is not a multiple of 16"; });
  expect(bq % tm == 0 || (tm % bq == 0 && tm / bq <= route::kMaxUnitsPerTile), "problem.tile_m", [&] {
    return "tile_m = " + str(tm) + " does not fit Bq = " + str(bq) +
           ": expected a divisor of Bq, or a multiple of Bq at most " + str(route::kMaxUnitsPerTile) + " times Bq";
  });
  expect(tn % 16 == 0 && bk % tn == 0, "problem.tile_n", [&] {
    return "tile_n = " + str(tn) + " does not fit Bk = " + str(bk) + ": expected a multiple of 16 that divides Bk";
  });
}

void check_layouts(const Problem& pb) {
  if (is_varlen(pb)) {
    expect_positive("problem.total_q", pb.total_q);
    expect_int32_extent("problem.total_q", pb.total_q, "total_q (cu_seqlens_q is int32)");
  }
  if (is_varlen_kv(pb)) {
    expect_positive("problem.total_kv", pb.total_kv);
    expect_int32_extent("problem.total_kv", pb.total_kv, "total_kv (cu_seqlens_k is int32)");
  }
  if (is_paged(pb)) {
    expect_positive("problem.page_size", pb.page_size);
    expect_positive("problem.num_pages", pb.num_pages);
    expect_positive("problem.pages_per_seq", pb.pages_per_seq);
    const std::int64_t readable = static_cast<std::int64_t>(pb.pages_per_seq) * pb.page_size;
    expect_int32_extent("problem.pages_per_seq", readable, "pages_per_seq * page_size");
    expect(pb.max_seqlen_kv <= readable, "problem.max_seqlen_kv", [&] {
      return "= " + str(pb.max_seqlen_kv) + " does not fit in pages_per_seq * page_size = " + str(pb.pages_per_seq) +
             " * " + str(pb.page_size) + " = " + str(readable);
    });
  }
}

void check_features(const Problem& pb) {
  expect_at_least("problem.mask.window_left", pb.mask.window_left, -1);
  expect_at_least("problem.mask.window_right", pb.mask.window_right, -1);
  expect_at_least("problem.mask.sink_tokens", pb.mask.sink_tokens, 0);
  expect(std::isfinite(pb.scale), "problem.scale",
         [&] { return "= " + std::to_string(pb.scale) + ", expected a finite value"; });

  const bool sets = pb.format != Format::all_blocks;
  expect(sets || !pb.has_full, "problem.has_full", [&] {
    return "format all_blocks has no sparsity tensors, so there is no full set; use block_lists or bitmask";
  });
  expect(sets || pb.proxy == Proxy::off, "problem.proxy", [&] {
    return "format all_blocks computes every block exactly, so nothing is left for proxies; use a format with sets";
  });
  expect(!sets || pb.has_partial || pb.has_full, "problem.has_partial", [&] {
    return std::string("format ") + to_string(pb.format) + " with neither a partial nor a full set selects nothing";
  });
  expect(pb.format != Format::varlen_block_lists || is_varlen(pb), "problem.format", [&] {
    return "varlen_block_lists needs q_layout varlen (its offsets come from cu_seqlens_q); use block_lists for batched "
           "Q";
  });

  const int hs = pb.sparsity_heads;
  expect(hs == 1 || hs == pb.heads_kv || hs == pb.heads_q, "problem.sparsity_heads", [&] {
    return "= " + str(hs) + ", expected 1, heads_kv = " + str(pb.heads_kv) + " or heads_q = " + str(pb.heads_q);
  });
  const int bs = pb.sparsity_batch;
  expect(bs == 1 || bs == pb.batch, "problem.sparsity_batch",
         [&] { return "= " + str(bs) + ", expected 1 (broadcast) or batch = " + str(pb.batch); });
  expect(bs == 1 || !has_varlen_rows(pb), "problem.sparsity_batch", [&] {
    return "= " + str(bs) + ", but format " + to_string(pb.format) +
           " with varlen Q enumerates rows per sequence; expected 1";
  });
}

void check_int32_extents(const Problem& pb, const TileShape& tiles) {
  // Token positions are ints: a tile or block may start at max_seqlen and run one size past it.
  expect_int32_extent("problem.max_seqlen_q",
                      static_cast<std::int64_t>(pb.max_seqlen_q) + std::max(pb.block.q, tiles.tile_m),
                      "max_seqlen_q + max(Bq, tile_m)");
  expect_int32_extent("problem.max_seqlen_kv", static_cast<std::int64_t>(pb.max_seqlen_kv) + pb.block.kv,
                      "max_seqlen_kv + Bk");
  // One work item per (route row, query head): a CUDA grid dimension and an int in the engines.
  // Route rows (batch * sparsity_heads * tiles) are at most as many.
  const std::int64_t work_items =
      static_cast<std::int64_t>(pb.batch) * pb.heads_q * ceil_div(pb.max_seqlen_q, tiles.tile_m);
  expect_int32_extent("problem.max_seqlen_q", work_items, "work items batch * heads_q * ceil(max_seqlen_q / tile_m)");
  const std::int64_t kv_blocks = ceil_div(pb.max_seqlen_kv, pb.block.kv);
  expect_int32_extent("problem.max_seqlen_kv", kv_blocks * (pb.block.kv / tiles.tile_n + 1),
                      "routes per row (KV tiles plus proxies)");
}

}  // namespace

void validate_problem(const Problem& pb, const TileShape& tiles) {
  expect_known("problem.q_layout", pb.q_layout, QLayout::varlen);
  expect_known("problem.kv_layout", pb.kv_layout, KVLayout::paged);
  expect_known("problem.format", pb.format, Format::bitmask);
  expect_known("problem.mask.alignment", pb.mask.alignment, Alignment::top_left);
  expect_known("problem.proxy", pb.proxy, Proxy::explicit_set);
  expect_known("problem.device", pb.device, Device::cuda);
  expect_float_dtype("problem.dtype", pb.dtype);
  expect_float_dtype("problem.out_dtype", pb.out_dtype);

  expect_positive("problem.batch", pb.batch);
  expect_positive("problem.heads_q", pb.heads_q);
  expect_positive("problem.heads_kv", pb.heads_kv);
  expect_positive("problem.max_seqlen_q", pb.max_seqlen_q);
  expect_positive("problem.max_seqlen_kv", pb.max_seqlen_kv);
  expect(pb.heads_q % pb.heads_kv == 0, "problem.heads_q",
         [&] { return "= " + str(pb.heads_q) + " is not divisible by heads_kv = " + str(pb.heads_kv); });
  expect(pb.head_dim >= 8 && pb.head_dim <= 512 && pb.head_dim % 8 == 0, "problem.head_dim",
         [&] { return "= " + str(pb.head_dim) + " is not supported, expected a multiple of 8 in [8, 512]"; });
  expect_at_least("problem.max_routes_per_row", pb.max_routes_per_row, 0);
  expect_at_least("problem.num_threads", pb.num_threads, 0);
  expect_at_least("problem.device_index", pb.device_index, 0);

  check_block_and_tiles(pb, tiles);
  check_layouts(pb);
  check_features(pb);
  check_int32_extents(pb, tiles);
}

}  // namespace bsattn::formats
