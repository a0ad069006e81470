#include "distributed/pattern.hpp"

#include <algorithm>
#include <string>

#include "distributed/checks.hpp"

namespace bsattn::distributed {
namespace {

// An int32 tensor's element on the host view (any strides).
std::int32_t at(const TensorView& t, std::initializer_list<std::int64_t> index) {
  std::int64_t offset = 0;
  int d = 0;
  for (const std::int64_t i : index) offset += i * t.stride[d++];
  return static_cast<const std::int32_t*>(t.data)[offset];
}

std::string field(bool full, const char* name) {
  return std::string(full ? "pattern.full." : "pattern.partial.") + name;
}

void add_bitmask(const BlockSet& set, bool full, const Problem& local, PatternBits& p, Scratch& scratch) {
  const std::string name = field(full, "bits");
  expect_shape(set.bits, name.c_str(), {p.Bs, p.Hs, p.rows, p.words}, DType::u32, local, true);
  std::vector<unsigned char> keep;
  const TensorView w = scratch.to_host(set.bits, keep);
  // Bits past the last key block name blocks that do not exist: ignored (SPEC §3.4).
  const std::uint32_t last_word = p.key_blocks % 32 != 0 ? (1u << (p.key_blocks % 32)) - 1u : ~0u;
  std::size_t i = 0;
  for (std::int64_t bs = 0; bs < p.Bs; ++bs)
    for (std::int64_t hs = 0; hs < p.Hs; ++hs)
      for (std::int64_t r = 0; r < p.rows; ++r)
        for (std::int64_t j = 0; j < p.words; ++j, ++i)
          p.bits[i] |= static_cast<const std::uint32_t*>(
                           w.data)[bs * w.stride[0] + hs * w.stride[1] + r * w.stride[2] + j * w.stride[3]] &
                       (j + 1 == p.words ? last_word : ~0u);
}

// A row's entries (block lists, BSR), in order: each a global key block, above the one before it
// (SPEC §3: ascending, unique). Sets their bits in `p`.
class RowEntries {
 public:
  RowEntries(PatternBits& p, std::int64_t row, const std::string& name) : p_(p), row_(row), name_(name) {}
  void add(std::int32_t col) {
    if (col < 0 || col >= p_.key_blocks)
      throw Error(name_, "key block " + std::to_string(col) + " in " + where() + ": expected 0.." +
                             std::to_string(p_.key_blocks - 1) + " (the global key blocks)");
    if (previous_ >= col)
      throw Error(name_, "key block " + std::to_string(col) + " in " + where() + " is not above the previous entry " +
                             std::to_string(previous_) + (previous_ == col ? " (duplicate)" : " (descending)"));
    previous_ = col;
    ++count_;
    p_.bits[static_cast<std::size_t>(row_ * p_.words + col / 32)] |= 1u << (col % 32);
  }

 private:
  std::string where() const { return "pattern row " + std::to_string(row_) + " entry " + std::to_string(count_); }

  PatternBits& p_;
  std::int64_t row_;
  const std::string& name_;
  std::int32_t previous_ = -1;
  int count_ = 0;
};

void add_block_lists(const BlockSet& set, bool full, const Problem& local, PatternBits& p, Scratch& scratch) {
  const std::string counts_name = field(full, "counts"), indices_name = field(full, "indices");
  expect_shape(set.counts, counts_name.c_str(), {p.Bs, p.Hs, p.rows}, DType::i32, local, true);
  if (set.indices.rank != 4)
    throw Error(indices_name, "expected int32 [Bs, Hs, nQB, L] lists, got " + set.indices.shape_string());
  const std::int64_t width = set.indices.shape[3];
  if (width > p.key_blocks)
    throw Error(indices_name, "lists of width L = " + std::to_string(width) + ": expected L in [0, " +
                                  std::to_string(p.key_blocks) + "] (the global key blocks)");
  expect_shape(set.indices, indices_name.c_str(), {p.Bs, p.Hs, p.rows, width}, DType::i32, local, true);
  std::vector<unsigned char> counts_copy, indices_copy;
  const TensorView counts = scratch.to_host(set.counts, counts_copy),
                   indices = scratch.to_host(set.indices, indices_copy);
  for (std::int64_t bs = 0, row = 0; bs < p.Bs; ++bs)
    for (std::int64_t hs = 0; hs < p.Hs; ++hs)
      for (std::int64_t r = 0; r < p.rows; ++r, ++row) {
        const std::int32_t n = at(counts, {bs, hs, r});
        if (n < 0 || n > width)
          throw Error(counts_name, "count " + std::to_string(n) + " in pattern row " + std::to_string(row) +
                                       ": expected 0.." + std::to_string(width) + " (the lists' width)");
        RowEntries entries(p, row, indices_name);
        for (std::int32_t i = 0; i < n; ++i) entries.add(at(indices, {bs, hs, r, i}));
      }
}

void add_bsr(const BlockSet& set, bool full, const Problem& local, PatternBits& p, Scratch& scratch) {
  const std::string indptr_name = field(full, "indptr"), indices_name = field(full, "indices");
  const std::int64_t rows = p.Bs * p.Hs * p.rows;
  expect_shape(set.indptr, indptr_name.c_str(), {rows + 1}, DType::i32, local, true);
  if (set.indices.rank != 1)
    throw Error(indices_name, "expected int32 [nnz] indices, got " + set.indices.shape_string());
  expect_shape(set.indices, indices_name.c_str(), {set.indices.shape[0]}, DType::i32, local, true);
  std::vector<unsigned char> indptr_copy, indices_copy;
  const TensorView indptr = scratch.to_host(set.indptr, indptr_copy);
  const std::int64_t nnz = set.indices.shape[0];
  for (std::int64_t row = 0; row < rows; ++row)
    if (at(indptr, {0}) != 0 || at(indptr, {row + 1}) < at(indptr, {row}))
      throw Error(indptr_name, "expected non-decreasing offsets from 0, got " + std::to_string(at(indptr, {row})) +
                                   " then " + std::to_string(at(indptr, {row + 1})) + " at row " + std::to_string(row));
  if (at(indptr, {rows}) > nnz)
    throw Error(indptr_name, "the last offset " + std::to_string(at(indptr, {rows})) + " is above nnz = " +
                                 std::to_string(nnz) + " (the indices' length)");
  const TensorView indices = scratch.to_host(set.indices, indices_copy);
  for (std::int64_t row = 0; row < rows; ++row) {
    RowEntries entries(p, row, indices_name);
    for (std::int32_t i = at(indptr, {row}); i < at(indptr, {row + 1}); ++i) entries.add(at(indices, {i}));
  }
}

}  // namespace

PatternBits read_pattern(const Pattern& pattern, const Problem& local, std::int64_t rows, std::int64_t key_blocks,
                         Scratch& scratch) {
  PatternBits p;
  p.Bs = local.sparsity_batch, p.Hs = local.sparsity_heads, p.rows = rows, p.key_blocks = key_blocks;
  p.words = (key_blocks + 31) / 32;
  p.bits.assign(static_cast<std::size_t>(p.Bs * p.Hs * rows * p.words), 0u);
  const auto read = [&](const BlockSet& set, bool full, PatternBits& into) {
    switch (local.format) {
      case Format::bitmask: add_bitmask(set, full, local, into, scratch); break;
      case Format::block_lists: add_block_lists(set, full, local, into, scratch); break;
      case Format::bsr: add_bsr(set, full, local, into, scratch); break;
      default: throw Error("problem.format", "all_blocks, block_lists, bsr or bitmask");
    }
  };
  read(pattern.partial, false, p);
  if (!local.has_full) return p;
  PatternBits full = p;
  std::fill(full.bits.begin(), full.bits.end(), 0u);
  read(pattern.full, true, full);
  for (std::size_t i = 0; i < p.bits.size(); ++i) {
    if (const std::uint32_t both = p.bits[i] & full.bits[i])
      throw Error(field(true, local.format == Format::bitmask ? "bits" : "indices"),
                  "key block " + std::to_string((i % p.words) * 32 + __builtin_ctz(both)) + " of pattern row " +
                      std::to_string(i / p.words) + " is in both the partial and the full set");
    p.bits[i] |= full.bits[i];
  }
  return p;
}

}  // namespace bsattn::distributed
