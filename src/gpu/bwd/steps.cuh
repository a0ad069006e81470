// The walk of one backward CTA (batch b, KV head hkv, KV tile): for each query head of the KV
// head's group, the column of its sparsity head, and in each column entry (a Q tile that takes
// this KV tile) the 64-row steps whose units take the route. Every thread walks it alike.
#pragma once
#include "bsattn/attention_params.hpp"
#include "gpu/backward.hpp"

namespace bsattn::gpu::bwd {

struct Step {
  int head;    // query head
  int record;  // entry of the head's column
  int sub;     // 64-row step of the Q tile
  ColumnRoute route;
  int q0;      // first query row of the step (sequence-local)
};

struct StepWalk {
  const ColumnRoute* columns;
  const std::int32_t* counts;
  std::int64_t column0;  // column of sparsity head 0: (b * Hs) * max_kv_tiles + kv_tile
  int max_kv_tiles, capacity;
  int head_begin, head_end, heads_per_sparsity_head;
  int tile_m, unit_m, seqlen_q;

  // Units of the Q tile (unit_m rows each) that overlap step `sub`'s 64 rows.
  __device__ __forceinline__ unsigned step_units(int sub) const {
    const int first = sub * 64 / unit_m, last = (sub * 64 + 63) / unit_m;
    return ((2u << last) - 1u) & ~((1u << first) - 1u);
  }

  // Moves s to the first step at or after (head, record, sub) whose rows lie in the sequence
  // and take the route; false at the end.
  __device__ bool seek(Step& s) const {
    for (; s.head < head_end; ++s.head, s.record = 0, s.sub = 0) {
      const std::int64_t column = column0 + static_cast<std::int64_t>(s.head / heads_per_sparsity_head) * max_kv_tiles;
      const int count = counts[column];
      for (; s.record < count; ++s.record, s.sub = 0) {
        const ColumnRoute r = columns[column * capacity + s.record];
        for (; s.sub * 64 < tile_m; ++s.sub) {
          const int q0 = r.q_tile * tile_m + s.sub * 64;
          if (q0 >= seqlen_q) break;
          if (r.rows & step_units(s.sub)) {
            s.route = r;
            s.q0 = q0;
            return true;
          }
        }
      }
    }
    return false;
  }
  __device__ bool first(Step& s) const {
    s.head = head_begin;
    s.record = 0;
    s.sub = 0;
    return seek(s);
  }
  __device__ bool next(Step& s) const {
    ++s.sub;
    return seek(s);
  }
};

}  // namespace bsattn::gpu::bwd
