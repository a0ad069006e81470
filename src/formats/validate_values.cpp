// Validation of metadata values (problem.validate): sequence lengths and offsets, page ids, and
// each block set's entries (in range, ascending, unique, partial and full disjoint), read from host
// copies of the metadata tensors (device tensors are copied after a device sync). See validate.hpp.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "bsattn/route/params.hpp"
#include "formats/bind.hpp"
#include "formats/structure.hpp"
#include "formats/validate.hpp"
#include "formats/value_checks.hpp"
#if BSATTN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace bsattn::formats {
namespace {

// Dense row-major host copy of an int32 / uint32 tensor.
struct HostInts {
  std::vector<std::int32_t> values;
  std::array<std::int64_t, TensorView::kMaxRank> shape{};

  std::int32_t at(std::initializer_list<std::int64_t> index) const {
    std::int64_t offset = 0;
    int d = 0;
    for (std::int64_t i : index) offset = offset * shape[d++] + i;
    return values[static_cast<std::size_t>(offset)];
  }
  std::int64_t size() const { return static_cast<std::int64_t>(values.size()); }
};

// Reads metadata for the value checks. Before the first read of a device tensor the whole device
// is synchronised once, so that metadata written by earlier work on any stream is complete
// (validate = true is the synchronous path; validate = false never gets here). A problem without
// device metadata (dense batched attention) reads nothing and does not synchronise.
class MetadataReader {
 public:
  explicit MetadataReader(const Problem& pb) : device_index_(pb.device_index) {}

  HostInts read(const std::string& name, const TensorView& t) const {
    const unsigned char* base = static_cast<const unsigned char*>(t.data);
    std::vector<unsigned char> staging;
    if (t.device == Device::cuda) {
#if BSATTN_WITH_CUDA
      synchronise_once();
      const ByteRange range = byte_range(t);
      staging.resize(range.size());
      cuda_check(name, "copying it to the host for validation",
                 cudaMemcpy(staging.data(), t.data, range.size(), cudaMemcpyDefault));
      base = staging.data();
#else
      throw Error(name, "is on cuda, but this build has no GPU support");
#endif
    }
    HostInts h;
    for (int i = 0; i < t.rank; ++i) h.shape[i] = t.shape[i];
    h.values.resize(static_cast<std::size_t>(t.numel()));
    std::array<std::int64_t, TensorView::kMaxRank> index{};
    for (std::size_t n = 0; n < h.values.size(); ++n) {
      std::int64_t offset = 0;
      for (int i = 0; i < t.rank; ++i) offset += index[i] * t.stride[i];
      std::memcpy(&h.values[n], base + offset * 4, 4);
      for (int i = t.rank - 1; i >= 0 && ++index[i] == t.shape[i]; --i) index[i] = 0;
    }
    return h;
  }

 private:
  int device_index_;
  mutable bool synchronised_ = false;

#if BSATTN_WITH_CUDA
  void synchronise_once() const {
    if (synchronised_) return;
    int current = 0;
    cuda_check("problem.device_index", "cudaGetDevice", cudaGetDevice(&current));
    cuda_check("problem.device_index", "cudaSetDevice", cudaSetDevice(device_index_));
    const cudaError_t synced = cudaDeviceSynchronize();
    cuda_check("problem.device_index", "cudaSetDevice", cudaSetDevice(current));
    cuda_check("problem.validate", "synchronising the device before reading metadata", synced);
    synchronised_ = true;
  }

  static void cuda_check(const std::string& argument, const char* action, cudaError_t e) {
    if (e == cudaSuccess) return;
    cudaGetLastError();  // not sticky: leave no stale error for the caller's next check
    std::string message = std::string(action) + " failed: " + cudaGetErrorString(e);
    if (e == cudaErrorStreamCaptureUnsupported || e == cudaErrorStreamCaptureImplicit ||
        e == cudaErrorStreamCaptureInvalidated)
      message +=
          " (value checks read metadata on the host, which CUDA graph capture forbids: capture with validate = false)";
    throw Error(argument, message);
  }
#endif
};

// Per-sequence lengths and block counts, computed the way the engine computes them.
struct Sequences {
  std::vector<route::SeqInfo> seq;
  std::vector<std::int64_t> cu_m_blocks, cu_idx_offsets;  // implied prefix sums (SPEC §3.2), B+1
  int max_q_blocks = 0;                                   // the longest sequence's nQB
  int stored_q_blocks = 0;                                // ceil(max_seqlen_q / Bq): the qb extent of batched rows
};

void check_cu_seqlens(const std::string& name, const HostInts& cu, std::int64_t total, const char* total_name,
                      int max_seqlen, const char* max_name) {
  const std::int64_t batch = cu.size() - 1;
  expect(cu.at({0}) == 0, name, [&] { return name + "[0] = " + str(cu.at({0})) + ", expected 0"; });
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t lo = cu.at({b}), hi = cu.at({b + 1});
    expect(hi >= lo, name, [&] {
      return name + "[" + str(b + 1) + "] = " + str(hi) + " is below " + name + "[" + str(b) + "] = " + str(lo) +
             " (not monotone)";
    });
    expect(hi - lo <= max_seqlen, name, [&] {
      return "sequence b=" + str(b) + " has length " + str(hi - lo) + ", above " + max_name + " = " + str(max_seqlen);
    });
  }
  expect(cu.at({batch}) == total, name, [&] {
    return name + "[" + str(batch) + "] = " + str(cu.at({batch})) + ", expected " + total_name + " = " + str(total);
  });
}

void expect_in_range(const std::string& name, const std::string& what, std::int64_t value, std::int64_t lowest,
                     std::int64_t highest, const std::string& bound) {
  expect(value >= lowest && value <= highest, name,
         [&] { return what + " = " + str(value) + " is outside [" + str(lowest) + ", " + str(highest) + "]" + bound; });
}

// Lengths and page tables; returns what the engine will derive from them.
Sequences check_lengths(const Problem& pb, const TileShape& tiles, const Inputs& in, const MetadataReader& reader) {
  route::RouteParams geo = route_geometry(pb, tiles, 0);
  HostInts cu_q, cu_k, used, lens;
  if (is_varlen(pb)) {
    cu_q = reader.read("cu_seqlens_q", in.cu_seqlens_q);
    check_cu_seqlens("cu_seqlens_q", cu_q, pb.total_q, "total_q", pb.max_seqlen_q, "max_seqlen_q");
    geo.cu_seqlens_q = cu_q.values.data();
  }
  if (is_varlen_kv(pb)) {
    cu_k = reader.read("cu_seqlens_k", in.cu_seqlens_k);
    check_cu_seqlens("cu_seqlens_k", cu_k, pb.total_kv, "total_kv", pb.max_seqlen_kv, "max_seqlen_kv");
    geo.cu_seqlens_k = cu_k.values.data();
    if (in.seqused_k.defined()) {
      used = reader.read("seqused_k", in.seqused_k);
      for (int b = 0; b < pb.batch; ++b)
        expect_in_range("seqused_k", "seqused_k[" + str(b) + "]", used.at({b}), 0, cu_k.at({b + 1}) - cu_k.at({b}),
                        " (the length of sequence " + str(b) + " in cu_seqlens_k)");
      geo.seqused_k = used.values.data();
    }
  }
  if (is_paged(pb)) {
    lens = reader.read("seq_lens_kv", in.seq_lens_kv);
    const HostInts table = reader.read("block_table", in.block_table);
    const std::int64_t readable = static_cast<std::int64_t>(pb.pages_per_seq) * pb.page_size;
    for (int b = 0; b < pb.batch; ++b) {
      const std::int64_t len = lens.at({b});
      const std::string what = "seq_lens_kv[" + str(b) + "]";
      expect(len >= 0, "seq_lens_kv", [&] { return what + " = " + str(len) + " is negative"; });
      expect(len <= readable, "seq_lens_kv", [&] {
        return what + " = " + str(len) + " needs " + str(ceil_div(len, pb.page_size)) +
               " pages, but only the first pages_per_seq = " + str(pb.pages_per_seq) +
               " entries of a block_table row are readable (the rest of the row is padding)";
      });
      expect(len <= pb.max_seqlen_kv, "seq_lens_kv", [&] {
        return what + " = " + str(len) + " is above max_seqlen_kv = " + str(pb.max_seqlen_kv) +
               ", the cache length planned for";
      });
      for (std::int64_t j = 0; j < ceil_div(len, pb.page_size); ++j)
        expect_in_range("block_table", "row b=" + str(b) + " entry " + str(j), table.at({b, j}), 0, pb.num_pages - 1,
                        " (page ids must be below num_pages = " + str(pb.num_pages) + ")");
    }
    geo.seq_lens_kv = lens.values.data();
  }

  Sequences s;
  s.stored_q_blocks = geo.max_q_blocks;
  s.cu_m_blocks.assign(pb.batch + 1, 0);
  s.cu_idx_offsets.assign(pb.batch + 1, 0);
  for (int b = 0; b < pb.batch; ++b) {
    s.seq.push_back(route::seq_info(geo, b));
    const route::SeqInfo& q = s.seq.back();
    s.cu_m_blocks[b + 1] = s.cu_m_blocks[b] + q.q_blocks;
    s.cu_idx_offsets[b + 1] = s.cu_idx_offsets[b] + static_cast<std::int64_t>(q.q_blocks) * q.kv_blocks;
    s.max_q_blocks = std::max(s.max_q_blocks, q.q_blocks);
  }
  return s;
}

void check_block_offsets(const Problem& pb, const Inputs& in, const Sequences& s, const MetadataReader& reader) {
  if (!is_varlen(pb) || !has_varlen_rows(pb)) return;
  if (pb.format == Format::varlen_block_lists)
    expect_int32_extent("cu_block_idx_offsets", s.cu_idx_offsets[pb.batch], "total_n_blocks = sum of nQB(b) * nKB(b)");
  const std::pair<const char*, const std::vector<std::int64_t>*> offsets[] = {
      {"cu_total_m_blocks", &s.cu_m_blocks}, {"cu_block_idx_offsets", &s.cu_idx_offsets}};
  const TensorView* given[] = {&in.cu_total_m_blocks, &in.cu_block_idx_offsets};
  const char* meaning[] = {"nQB(b)", "nQB(b) * nKB(b)"};
  for (int i = 0; i < 2; ++i) {
    if (!given[i]->defined()) continue;
    const std::string name = offsets[i].first;
    const HostInts h = reader.read(name, *given[i]);
    const std::vector<std::int64_t>& implied = *offsets[i].second;
    for (int b = 0; b <= pb.batch; ++b)
      expect(h.at({b}) == implied[b], name, [&] {
        return name + "[" + str(b) + "] = " + str(h.at({b})) + ", but the exclusive prefix sum of " + meaning[i] +
               " implied by the sequence lengths is " + str(implied[b]);
      });
  }
}

// One row of a block set: the (b, hs, qb) it is read for, and the KV blocks it may name.
struct Row {
  int b;  // -1: a broadcast row (sparsity_batch == 1) read by every sequence long enough
  int hs, qb;
  int kv_blocks;
  std::string label() const {
    return "row (b=" + (b < 0 ? std::string("all") : str(b)) + ", hs=" + str(hs) + ", qb=" + str(qb) + ")";
  }
};

// Calls fn(row) for every row the engine reads. Broadcast rows are checked once, against the
// longest KV sequence among those that read them (shorter ones ignore blocks past their end).
template <class Fn>
void for_each_row(const Problem& pb, const Sequences& s, Fn fn) {
  const int hs_count = pb.sparsity_heads;
  if (has_varlen_rows(pb)) {
    for (int b = 0; b < pb.batch; ++b)
      for (int hs = 0; hs < hs_count; ++hs)
        for (int qb = 0; qb < s.seq[b].q_blocks; ++qb) fn(Row{b, hs, qb, s.seq[b].kv_blocks});
    return;
  }
  const bool broadcast = pb.sparsity_batch == 1 && pb.batch > 1;
  for (int bs = 0; bs < pb.sparsity_batch; ++bs)
    for (int hs = 0; hs < hs_count; ++hs)
      for (int qb = 0; qb < s.max_q_blocks; ++qb) {
        int kv_blocks = -1;
        for (int b = 0; b < pb.batch; ++b)
          if ((pb.sparsity_batch == 1 || b == bs) && s.seq[b].q_blocks > qb)
            kv_blocks = std::max(kv_blocks, s.seq[b].kv_blocks);
        if (kv_blocks >= 0) fn(Row{broadcast ? -1 : bs, hs, qb, kv_blocks});
      }
}

// Host copy of one block set, and its rows as ascending-by-contract lists of KV blocks.
class SetReader {
 public:
  SetReader(const Problem& pb, const Sequences& s, const BlockSet& set, const std::string& set_name,
            const MetadataReader& reader)
      : pb_(pb), s_(s), name_(set_name) {
    const std::int64_t total_m = s.cu_m_blocks[pb.batch];
    switch (pb.format) {
      case Format::all_blocks: break;
      case Format::block_lists:
        counts_ = reader.read(name_ + ".counts", set.counts);
        indices_ = reader.read(name_ + ".indices", set.indices);
        break;
      case Format::varlen_block_lists:
        counts_ = reader.read(name_ + ".counts", set.counts);
        indices_ = reader.read(name_ + ".indices", set.indices);
        expect(counts_.shape[1] >= total_m, name_ + ".counts", [&] {
          return "has " + str(counts_.shape[1]) + " columns, but the sequences have total_m_blocks = " + str(total_m);
        });
        expect(indices_.shape[1] >= s.cu_idx_offsets[pb.batch], name_ + ".indices", [&] {
          return "has " + str(indices_.shape[1]) +
                 " columns, but the sequences need total_n_blocks = " + str(s.cu_idx_offsets[pb.batch]);
        });
        break;
      case Format::bsr:
        indptr_ = reader.read(name_ + ".indptr", set.indptr);
        indices_ = reader.read(name_ + ".indices", set.indices);
        check_indptr(has_varlen_rows(pb) ? pb.sparsity_heads * total_m : indptr_.size() - 1);
        break;
      case Format::bitmask:
        bits_ = reader.read(name_ + ".bits", set.bits);
        if (has_varlen_rows(pb))
          expect(bits_.shape[1] >= total_m, name_ + ".bits", [&] {
            return "has " + str(bits_.shape[1]) +
                   " rows (dimension 1), but the sequences have total_m_blocks = " + str(total_m);
          });
        break;
    }
  }

  // The argument named when a row's entries are wrong.
  std::string entries_name() const { return name_ + (pb_.format == Format::bitmask ? ".bits" : ".indices"); }

  std::vector<int> entries(const Row& row) const {
    std::vector<int> e;
    const int bs = row.b < 0 ? 0 : row.b;
    switch (pb_.format) {
      case Format::all_blocks: break;
      case Format::block_lists: {
        const std::int64_t count = counts_.at({bs, row.hs, row.qb});
        expect_in_range(name_ + ".counts", row.label() + " count", count, 0, indices_.shape[3],
                        " (L = " + str(indices_.shape[3]) + ", the last dimension of " + name_ + ".indices)");
        for (std::int64_t i = 0; i < count; ++i) e.push_back(indices_.at({bs, row.hs, row.qb, i}));
        break;
      }
      case Format::varlen_block_lists: {
        const std::int64_t count = counts_.at({row.hs, s_.cu_m_blocks[row.b] + row.qb});
        expect_in_range(name_ + ".counts", row.label() + " count", count, 0, row.kv_blocks,
                        " (nKB(b) = " + str(row.kv_blocks) + ")");
        const std::int64_t start = s_.cu_idx_offsets[row.b] + static_cast<std::int64_t>(row.qb) * row.kv_blocks;
        for (std::int64_t i = 0; i < count; ++i) e.push_back(indices_.at({row.hs, start + i}));
        break;
      }
      case Format::bsr: {
        const std::int64_t r =
            has_varlen_rows(pb_)
                ? static_cast<std::int64_t>(row.hs) * s_.cu_m_blocks[pb_.batch] + s_.cu_m_blocks[row.b] + row.qb
                : (static_cast<std::int64_t>(bs) * pb_.sparsity_heads + row.hs) * s_.stored_q_blocks + row.qb;
        for (std::int64_t i = indptr_.at({r}); i < indptr_.at({r + 1}); ++i) e.push_back(indices_.at({i}));
        break;
      }
      case Format::bitmask: {
        // Bits at or beyond nKB(b) are ignored by contract, so only the blocks below are listed.
        for (int block = 0; block < row.kv_blocks; ++block) {
          const std::int64_t w = block / 32;
          const std::uint32_t word =
              static_cast<std::uint32_t>(has_varlen_rows(pb_) ? bits_.at({row.hs, s_.cu_m_blocks[row.b] + row.qb, w})
                                                              : bits_.at({bs, row.hs, row.qb, w}));
          if ((word >> (block % 32)) & 1u) e.push_back(block);
        }
        break;
      }
    }
    return e;
  }

 private:
  void check_indptr(std::int64_t rows) {
    const std::string name = name_ + ".indptr";
    expect(indptr_.size() == rows + 1, name, [&] {
      return "has " + str(indptr_.size()) + " entries, expected R + 1 = " + str(rows + 1) +
             " (R = sparsity_heads * total_m_blocks)";
    });
    expect(indptr_.at({0}) == 0, name, [&] { return name + "[0] = " + str(indptr_.at({0})) + ", expected 0"; });
    for (std::int64_t r = 0; r < rows; ++r)
      expect(indptr_.at({r + 1}) >= indptr_.at({r}), name, [&] {
        return name + "[" + str(r + 1) + "] = " + str(indptr_.at({r + 1})) + " is below " + name + "[" + str(r) +
               "] = " + str(indptr_.at({r})) + " (not monotone)";
      });
    expect(indptr_.at({rows}) <= indices_.size(), name, [&] {
      return name + "[" + str(rows) + "] = " + str(indptr_.at({rows})) + " is above nnz = " + str(indices_.size()) +
             ", the length of " + name_ + ".indices";
    });
  }

  const Problem& pb_;
  const Sequences& s_;
  std::string name_;
  HostInts counts_, indices_, indptr_, bits_;
};

void check_entries(const std::string& name, const Row& row, const std::vector<int>& entries) {
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const std::string what = row.label() + " entry " + str(static_cast<std::int64_t>(i));
    expect(entries[i] >= 0 && entries[i] < row.kv_blocks, name,
           [&] { return what + " = " + str(entries[i]) + " is outside [0, nKB(b) = " + str(row.kv_blocks) + ")"; });
    if (i == 0) continue;
    expect(entries[i] > entries[i - 1], name, [&] {
      return what + " = " + str(entries[i]) + " is not above the previous entry " + str(entries[i - 1]) +
             (entries[i] == entries[i - 1] ? " (duplicate)" : " (descending)");
    });
  }
}

}  // namespace

void validate_lengths(const Problem& pb, const TileShape& tiles, const Inputs& in) {
  const Extents e(pb);
  if (is_varlen(pb))
    expect_given(pb, "cu_seqlens_q", in.cu_seqlens_q, {exactly("B+1", e.B + 1)}, DType::i32, Access::row_contiguous);
  if (is_paged(pb)) {
    expect_given(pb, "seq_lens_kv", in.seq_lens_kv, {exactly("B", e.B)}, DType::i32, Access::row_contiguous);
    // Value checks follow the page ids of each sequence's live prefix.
    if (pb.validate)
      expect_given(pb, "block_table", in.block_table, {exactly("B", e.B), at_least("C", pb.pages_per_seq)},
                   DType::i32, Access::row_contiguous);
  } else if (is_varlen_kv(pb)) {
    expect_given(pb, "cu_seqlens_k", in.cu_seqlens_k, {exactly("B+1", e.B + 1)}, DType::i32, Access::row_contiguous);
    if (in.seqused_k.defined())
      expect_tensor(pb, "seqused_k", in.seqused_k, {exactly("B", e.B)}, DType::i32, Access::row_contiguous);
  }
  if (pb.validate) check_lengths(pb, tiles, in, MetadataReader(pb));
}

void validate_summary_build(const Problem& pb, const TileShape& tiles, const Inputs& in, const TensorView& k_summary,
                            const TensorView& v_summary) {
  const Extents e(pb);
  if (is_paged(pb))
    expect_given(pb, "block_table", in.block_table, {exactly("B", e.B), at_least("C", pb.pages_per_seq)}, DType::i32,
                 Access::row_contiguous);
  const std::vector<Dim> kv = kv_dims(pb, e);
  expect_given(pb, "k", in.k, kv, pb.dtype, Access::vectors);
  expect_given(pb, "v", in.v, kv, pb.dtype, Access::vectors);
  const std::vector<Dim> summary = {exactly("B", e.B), exactly("nKB", e.nKB), exactly("Hkv", e.Hkv), exactly("D", e.D)};
  expect_given(pb, "k_summary", k_summary, summary, pb.dtype, Access::vectors);
  expect_given(pb, "v_summary", v_summary, summary, pb.dtype, Access::vectors);
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"k_summary", &k_summary}, {"v_summary", &v_summary}}) {
    expect_no_self_overlap(name, *t);
    for (const TensorView* input : {&in.k, &in.v})
      expect(!overlap(byte_range(*t), byte_range(*input)), name,
             [&] { return std::string("overlaps input ") + (input == &in.k ? "k" : "v") + " in memory"; });
  }
  expect(!overlap(byte_range(k_summary), byte_range(v_summary)), "v_summary",
         [] { return "overlaps k_summary in memory"; });
  validate_lengths(pb, tiles, in);
}

void validate_values(const Problem& pb, const TileShape& tiles, const Inputs& inputs) {
  const MetadataReader reader(pb);
  const Sequences s = check_lengths(pb, tiles, inputs, reader);
  check_block_offsets(pb, inputs, s, reader);
  if (pb.format == Format::all_blocks) return;

  std::vector<std::pair<const char*, const BlockSet*>> sets;
  if (pb.has_partial) sets.push_back({"partial", &inputs.partial});
  if (pb.has_full) sets.push_back({"full", &inputs.full});
  if (pb.proxy == Proxy::explicit_set) sets.push_back({"proxy", &inputs.proxy});
  std::vector<SetReader> readers;
  for (const auto& set : sets) readers.emplace_back(pb, s, *set.second, set.first, reader);

  for_each_row(pb, s, [&](const Row& row) {
    std::vector<std::vector<int>> entries;
    for (const SetReader& r : readers) {
      entries.push_back(r.entries(row));
      check_entries(r.entries_name(), row, entries.back());
    }
    if (!pb.has_partial || !pb.has_full) return;
    std::vector<int> both;
    std::set_intersection(entries[0].begin(), entries[0].end(), entries[1].begin(), entries[1].end(),
                          std::back_inserter(both));
    expect(both.empty(), readers[1].entries_name(), [&] {
      return row.label() + ": KV block " + (both.empty() ? std::string() : str(both.front())) +
             " is in both the partial and the full set";
    });
  });
}

namespace {

IntTensor int_tensor(const TensorView& t) {
  IntTensor v;
  if (!t.defined()) return v;
  v.data = static_cast<const std::int32_t*>(t.data);
  for (int i = 0; i < t.rank && i < 4; ++i) {
    v.shape[i] = t.shape[i];
    v.stride[i] = t.stride[i];
  }
  return v;
}

}  // namespace

ValueCheckParams value_check_params(const Problem& pb, const TileShape& tiles, const Inputs& in) {
  ValueCheckParams c;
  c.geo = route_geometry(pb, tiles, 0);
  c.geo.cu_seqlens_q = static_cast<const std::int32_t*>(in.cu_seqlens_q.data);
  c.geo.cu_seqlens_k = static_cast<const std::int32_t*>(in.cu_seqlens_k.data);
  c.geo.seqused_k = static_cast<const std::int32_t*>(in.seqused_k.data);
  c.geo.seq_lens_kv = static_cast<const std::int32_t*>(in.seq_lens_kv.data);
  c.geo.cu_total_m_blocks = nullptr;
  c.geo.cu_block_idx_offsets = nullptr;
  c.varlen_rows = has_varlen_rows(pb);
  c.total_q = pb.total_q;
  c.total_kv = pb.total_kv;
  c.page_size = pb.page_size;
  c.pages_per_seq = pb.pages_per_seq;
  c.num_pages = pb.num_pages;
  c.cu_seqlens_q = int_tensor(in.cu_seqlens_q);
  c.cu_seqlens_k = int_tensor(in.cu_seqlens_k);
  c.seqused_k = int_tensor(in.seqused_k);
  c.seq_lens_kv = int_tensor(in.seq_lens_kv);
  c.block_table = int_tensor(in.block_table);
  if (is_varlen(pb) && c.varlen_rows) {  // check_block_offsets()
    c.cu_total_m_blocks = int_tensor(in.cu_total_m_blocks);
    c.cu_block_idx_offsets = int_tensor(in.cu_block_idx_offsets);
  }
  if (pb.format != Format::all_blocks) {
    const BlockSet* sets[3] = {pb.has_partial ? &in.partial : nullptr, pb.has_full ? &in.full : nullptr,
                               pb.proxy == Proxy::explicit_set ? &in.proxy : nullptr};
    for (int i = 0; i < 3; ++i)
      if (sets[i]) c.sets[i] = {int_tensor(sets[i]->counts), int_tensor(sets[i]->indices), int_tensor(sets[i]->indptr),
                                int_tensor(sets[i]->bits)};
    c.check_disjoint = pb.has_partial && pb.has_full;
  }
  return c;
}

std::vector<std::int64_t> checked_m_block_offsets(const Problem& pb, const TileShape& tiles, const Inputs& inputs) {
  Problem structure = pb;
  structure.validate = false;
  validate_lengths(structure, tiles, inputs);
  return check_lengths(pb, tiles, inputs, MetadataReader(pb)).cu_m_blocks;
}

}  // namespace bsattn::formats
