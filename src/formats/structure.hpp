// Structural rules for tensors (rank, shape, dtype, device, strides, alignment, overlap), shared
// by the validators of the forward (validate_*.cpp) and the backward (backward.cpp). Every
// check throws bsattn::Error naming the argument; messages are built only on failure.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bsattn/problem.hpp"

namespace bsattn::formats {

inline constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();
// Q/K/V/O rows and summaries are read as 16-byte vectors by the GPU kernels.
inline constexpr std::int64_t kVectorAlignment = 16;

inline std::string str(std::int64_t v) { return std::to_string(v); }

// Messages are built only on failure: the structural checks run on every call.
template <class Name, class Message>
void expect(bool ok, const Name& argument, const Message& message) {
  if (!ok) throw Error(argument, message());
}

inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// An extent the kernels index with int32 (`what` says which).
inline void expect_int32_extent(const char* name, std::int64_t extent, const std::string& what) {
  expect(extent <= kInt32Max, name, [&] {
    return what + " = " + str(extent) + " exceeds the int32 range the kernels index with (" + str(kInt32Max) + ")";
  });
}

inline bool is_varlen(const Problem& pb) { return pb.q_layout == QLayout::varlen; }
inline bool is_paged(const Problem& pb) { return pb.kv_layout == KVLayout::paged; }
inline bool is_varlen_kv(const Problem& pb) { return is_varlen(pb) && !is_paged(pb); }
// Formats whose rows are enumerated per sequence (SPEC §3.2 order) rather than [Bs, Hs, nQB].
inline bool has_varlen_rows(const Problem& pb) {
  return pb.format == Format::varlen_block_lists ||
         (is_varlen(pb) && (pb.format == Format::bsr || pb.format == Format::bitmask));
}

// One dimension of an expected shape: an extent in [lowest, highest], named for messages.
struct Dim {
  const char* label;
  std::int64_t lowest, highest;
  std::string describe() const {
    if (lowest == highest) return std::string(label) + "=" + str(lowest);
    if (highest == kInt32Max) return std::string(label) + ">=" + str(lowest);
    return std::string(label) + " in [" + str(lowest) + ", " + str(highest) + "]";
  }
};
inline Dim exactly(const char* label, std::int64_t n) { return {label, n, n}; }
inline Dim at_least(const char* label, std::int64_t n) { return {label, n, kInt32Max}; }
inline Dim any_extent(const char* label) { return {label, 0, kInt32Max}; }
inline Dim between(const char* label, std::int64_t lowest, std::int64_t highest) { return {label, lowest, highest}; }

inline std::string describe(const std::vector<Dim>& dims) {
  std::string s = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + dims[i].describe();
  return s + "]";
}

// How the engines address a tensor, which decides its stride and alignment rules.
enum class Access {
  strided,         // every stride is read from the view (block lists, bitmask words, LSE)
  row_contiguous,  // raw pointer along the last dimension (cu_*, bsr, block_table, doc ids, kv_valid)
  vectors,         // D-vectors loaded 16 bytes at a time (Q, K, V, O, summaries)
};

struct ByteRange {
  std::uintptr_t begin = 0, end = 0;
  std::size_t size() const { return end - begin; }
};

// Bytes a view can touch; strides are non-negative once structure is checked.
inline ByteRange byte_range(const TensorView& t) {
  ByteRange r;
  r.begin = r.end = reinterpret_cast<std::uintptr_t>(t.data);
  if (t.numel() == 0) return r;
  std::int64_t last = 0;
  for (int i = 0; i < t.rank; ++i) last += (t.shape[i] - 1) * t.stride[i];
  r.end = r.begin + static_cast<std::uintptr_t>((last + 1) * static_cast<std::int64_t>(element_size(t.dtype)));
  return r;
}

inline bool overlap(const ByteRange& a, const ByteRange& b) {
  return a.size() > 0 && b.size() > 0 && a.begin < b.end && b.begin < a.end;
}

inline void expect_device(const std::string& name, const TensorView& t, const Problem& pb) {
  const bool same = t.device == pb.device && (pb.device == Device::cpu || t.device_index == pb.device_index);
  expect(same, name, [&] {
    return std::string("is on ") + to_string(t.device) + ":" + str(t.device_index) + ", but the problem runs on " +
           to_string(pb.device) + ":" + str(pb.device_index);
  });
}

inline void expect_shape(const std::string& name, const TensorView& t, const std::vector<Dim>& dims) {
  expect(t.rank == static_cast<int>(dims.size()), name, [&] {
    return "has rank " + str(t.rank) + " (shape " + t.shape_string() + "), expected rank " + str(dims.size()) + " " +
           describe(dims);
  });
  for (int i = 0; i < t.rank; ++i)
    expect(t.shape[i] >= dims[i].lowest && t.shape[i] <= dims[i].highest, name, [&] {
      return "has shape " + t.shape_string() + ", expected " + describe(dims) + ": dimension " + str(i) + " (" +
             dims[i].label + ") is " + str(t.shape[i]);
    });
}

inline void expect_dtype(const std::string& name, const TensorView& t, DType dtype) {
  expect(t.dtype == dtype, name,
         [&] { return std::string("has dtype ") + to_string(t.dtype) + ", expected " + to_string(dtype); });
}

inline void expect_strides(const std::string& name, const TensorView& t, Access access) {
  for (int i = 0; i < t.rank; ++i)
    expect(t.stride[i] >= 0, name,
           [&] { return "stride " + str(i) + " = " + str(t.stride[i]) + " is negative; expected strides >= 0"; });
  const int last = t.rank - 1;
  if (access != Access::strided && t.rank > 0)
    expect(t.stride[last] == 1 || t.shape[last] <= 1, name,
           [&] { return "last dimension has stride " + str(t.stride[last]) + ", expected 1 (contiguous)"; });
  const std::int64_t elem = static_cast<std::int64_t>(element_size(t.dtype));
  const std::int64_t alignment = access == Access::vectors ? kVectorAlignment : elem;
  const auto misalignment = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(t.data) % alignment);
  expect(misalignment == 0, name, [&] {
    return "base address is " + str(misalignment) + " bytes past a " + str(alignment) + "-byte boundary, expected " +
           str(alignment) + "-byte alignment";
  });
  if (access != Access::vectors) return;
  // Dimensions of extent 1 are never stepped over, so their strides do not matter.
  for (int i = 0; i < last; ++i)
    expect(t.shape[i] <= 1 || (t.stride[i] * elem) % alignment == 0, name, [&] {
      return "stride " + str(i) + " = " + str(t.stride[i]) + " elements (" + str(t.stride[i] * elem) +
             " bytes) is not a multiple of " + str(alignment) + " bytes";
    });
}

// Two output elements sharing an address would be written by two workers.
inline void expect_no_self_overlap(const std::string& name, const TensorView& t) {
  std::vector<int> dims;
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] > 1) dims.push_back(i);
  std::sort(dims.begin(), dims.end(), [&](int a, int b) { return t.stride[a] < t.stride[b]; });
  std::int64_t span = 1;  // elements covered by the dimensions inside the current one
  for (int i : dims) {
    expect(t.stride[i] >= span, name, [&] {
      return "dimension " + str(i) + " has stride " + str(t.stride[i]) + " but the dimensions inside it span " +
             str(span) + " elements: distinct elements would share memory";
    });
    span = t.stride[i] * (t.shape[i] - 1) + span;
  }
}

inline void expect_tensor(const Problem& pb, const std::string& name, const TensorView& t,
                          const std::vector<Dim>& dims, DType dtype, Access access) {
  expect_device(name, t, pb);
  expect_shape(name, t, dims);
  expect_dtype(name, t, dtype);
  expect_strides(name, t, access);
}

// expect_tensor() for a tensor the problem requires.
inline void expect_given(const Problem& pb, const char* name, const TensorView& t, const std::vector<Dim>& dims,
                         DType dtype, Access access) {
  expect(t.defined(), name, [] { return "is required but not given"; });
  expect_tensor(pb, name, t, dims, dtype, access);
}

// Extents every structural rule is written in.
struct Extents {
  std::int64_t B, Sq, Skv, Hq, Hkv, D, Hs, Bs, nQB, nKB, words;
  explicit Extents(const Problem& pb)
      : B(pb.batch),
        Sq(pb.max_seqlen_q),
        Skv(pb.max_seqlen_kv),
        Hq(pb.heads_q),
        Hkv(pb.heads_kv),
        D(pb.head_dim),
        Hs(pb.sparsity_heads),
        Bs(pb.sparsity_batch),
        nQB(ceil_div(pb.max_seqlen_q, pb.block.q)),
        nKB(ceil_div(pb.max_seqlen_kv, pb.block.kv)),
        words(ceil_div(nKB, 32)) {}
};

// Q and O.
inline std::vector<Dim> q_dims(const Problem& pb, const Extents& e) {
  if (is_varlen(pb)) return {exactly("total_q", pb.total_q), exactly("Hq", e.Hq), exactly("D", e.D)};
  return {exactly("B", e.B), exactly("Sq", e.Sq), exactly("Hq", e.Hq), exactly("D", e.D)};
}

inline std::vector<Dim> kv_dims(const Problem& pb, const Extents& e) {
  if (is_paged(pb))
    return {exactly("num_pages", pb.num_pages), exactly("page_size", pb.page_size), exactly("Hkv", e.Hkv),
            exactly("D", e.D)};
  if (is_varlen_kv(pb)) return {exactly("total_kv", pb.total_kv), exactly("Hkv", e.Hkv), exactly("D", e.D)};
  return {exactly("B", e.B), exactly("Skv", e.Skv), exactly("Hkv", e.Hkv), exactly("D", e.D)};
}

// LSE: batched [B, Hq, Sq]; varlen [Hq, total_q].
inline std::vector<Dim> lse_dims(const Problem& pb, const Extents& e) {
  if (is_varlen(pb)) return {exactly("Hq", e.Hq), exactly("total_q", pb.total_q)};
  return {exactly("B", e.B), exactly("Hq", e.Hq), exactly("Sq", e.Sq)};
}

}  // namespace bsattn::formats
