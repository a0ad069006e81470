// A rank's block pattern (distributed::Pattern) in any batched format, read on the host into
// bitmask words over the global key blocks: what decides the chunks its rows use and each chunk
// pair's own bitmask (context_parallel.cpp).
#pragma once
#include <cstdint>
#include <vector>

#include "bsattn/distributed.hpp"
#include "distributed/scratch.hpp"

namespace bsattn::distributed {

// Bitmask words of a pattern, [Bs, Hs, rows, words] contiguous.
struct PatternBits {
  std::int64_t Bs = 1, Hs = 1, rows = 0, key_blocks = 0, words = 0;
  std::vector<std::uint32_t> bits;
  bool kept(std::int64_t bs, std::int64_t hs, std::int64_t row, std::int64_t col) const {
    return (bits[static_cast<std::size_t>(((bs * Hs + hs) * rows + row) * words + col / 32)] >> (col % 32)) & 1u;
  }
};

// The union of the partial set and, with local.has_full, the full set, in local.format, of
// `rows` query blocks over `key_blocks` key blocks. Checks the tensors and their values as a
// single-process call does (SPEC §3, §8: lists no wider than key_blocks, counts within [0, L],
// a row's entries ascending and unique within [0, key_blocks), indptr non-decreasing from 0 and
// ending within the indices, no block in both sets), naming them pattern.<set>.<tensor>.
PatternBits read_pattern(const Pattern& pattern, const Problem& local, std::int64_t rows, std::int64_t key_blocks,
                         Scratch& scratch);

}  // namespace bsattn::distributed
