// The metadata value rules of validate_values.cpp as plain data, for checking metadata where it
// lies. On a GPU plan, validate = true runs these rules as device kernels (gpu/check_values.cu)
// that raise one flag word, read back with the route-overflow flag by the run's one small copy;
// only a raised flag brings the metadata to the host, where validate_values() finds the first bad
// value and names it. So a valid call copies a few bytes, and a bad one still gets the exact
// message (docs/VALIDATION.md).
#pragma once
#include <cstdint>

#include "bsattn/plan.hpp"
#include "bsattn/route/params.hpp"

namespace bsattn::formats {

// An int32 / uint32 metadata tensor of rank <= 4 (data null: absent).
struct IntTensor {
  const std::int32_t* data = nullptr;
  std::int64_t shape[4] = {0, 0, 0, 0};
  std::int64_t stride[4] = {0, 0, 0, 0};

  BSATTN_HD std::int32_t at(std::int64_t i0, std::int64_t i1 = 0, std::int64_t i2 = 0, std::int64_t i3 = 0) const {
    return data[i0 * stride[0] + i1 * stride[1] + i2 * stride[2] + i3 * stride[3]];
  }
};

// One block set's tensors (those of its format).
struct SetTensors {
  IntTensor counts, indices, indptr, bits;
};

struct ValueCheckParams {
  // Geometry and the caller's sequence-length pointers (its varlen offsets are left null: the
  // checks derive the offsets the lengths imply and compare the given ones with them).
  route::RouteParams geo;
  bool varlen_rows = false;  // rows per sequence (has_varlen_rows), else [Bs, Hs, nQB]
  std::int64_t total_q = 0, total_kv = 0;
  int page_size = 0, pages_per_seq = 0, num_pages = 0;
  IntTensor cu_seqlens_q, cu_seqlens_k, seqused_k, seq_lens_kv, block_table;
  IntTensor cu_total_m_blocks, cu_block_idx_offsets;  // given offsets, if any
  // partial, full, proxy (explicit set); a set whose format tensors are absent is not checked.
  SetTensors sets[3];
  bool check_disjoint = false;  // partial and full both given: no block in both
};

// The value checks of `inputs` (structure already checked) for `problem`.
ValueCheckParams value_check_params(const Problem& problem, const TileShape& tiles, const Inputs& inputs);

}  // namespace bsattn::formats
