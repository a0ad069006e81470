// Seeded random attention problems for the oracle suite: every layout, format, mask, proxy mode,
// dtype and block/tile fitting the CPU engine supports, with poisoned outputs and NaN-filled
// padding so that a stray read or a missing write shows up. The same seed gives the same case.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bsattn/problem.hpp"
#include "oracle.hpp"

namespace bsattn_test {

// Constraints a test may put on the random draw; unset fields are drawn.
struct CaseOptions {
  std::optional<bsattn::Format> format;
  std::optional<bsattn::Proxy> proxy;
  std::optional<bool> custom_mask;
  std::optional<bool> builtin_mask;  // false: no built-in mask term at all
  std::optional<bool> varlen;
  std::optional<bool> paged;
  std::optional<bool> has_partial, has_full;  // the selection kinds (ignored by all_blocks)
  int max_seqlen = 300;
};

// The block selection before it is written in a format: sorted KV block lists per row.
struct SparsityPattern {
  int batch = 1;     // 1: one pattern shared by the whole batch (Bs = 1), else B
  int heads = 1;     // Hs
  int q_blocks = 0;  // rows per (b, hs): ceil(max_seqlen_q / Bq)
  std::vector<std::vector<int>> partial, full, proxy;  // [(b * heads + hs) * q_blocks + qb]

  std::size_t row(int b, int hs, int qb) const {
    return (static_cast<std::size_t>(batch == 1 ? 0 : b) * heads + hs) * q_blocks + qb;
  }
};

class RandomCase {
 public:
  RandomCase() = default;
  RandomCase(const RandomCase&) = delete;
  RandomCase& operator=(const RandomCase&) = delete;

  std::uint64_t seed = 0;
  bsattn::Problem problem;
  bsattn::Inputs inputs;
  bsattn::Outputs outputs;
  std::vector<int> seqlen_q, seqlen_kv;
  SparsityPattern pattern;
  TokenMaskFn custom_mask;  // empty: none
  std::string custom_mask_name;
  // attention() / attention_with_mask() (validate forced on); else a Plan with validate = false
  // and Plan::run() / run_with_mask().
  bool one_shot = true;

  int q_blocks(int b) const;
  int kv_blocks(int b) const;

  // One line: everything needed to recognise the case (the seed reproduces it).
  std::string describe() const;

  // (Re)writes the pattern's sets in `format` (problem.format and sparsity_batch follow).
  // `padding_bits`: bitmask bits at or beyond nKB(b) are set at random (they must be ignored).
  void encode(bsattn::Format format, bool padding_bits = true);
  // Recomputes k_summary / v_summary from K and V (float64, rounded once to the dtype).
  void write_summaries();

  // Fills every output byte (padding included) with a NaN pattern.
  void poison_outputs();
  // Runs the library on the case (a custom mask through custom_mask.hpp).
  void run_library();
  // "" when every output element outside the logical tensors still holds the poison.
  std::string check_padding_untouched() const;
  // Every byte of O and LSE, padding included, for bitwise comparisons between runs.
  std::vector<std::uint8_t> output_bytes() const;

  // Element offset of token kv (sequence-local) of head hkv in K or V (`t` is inputs.k or inputs.v).
  std::int64_t kv_offset(const bsattn::TensorView& t, int b, int kv, int hkv) const;

  template <class T>
  T* allocate(std::int64_t count) {
    blobs_.emplace_back(static_cast<std::size_t>(std::max<std::int64_t>(count, 1)) * sizeof(T));
    return reinterpret_cast<T*>(blobs_.back().data());
  }

  std::mt19937_64 rng;

 private:
  std::vector<std::vector<std::uint8_t>> blobs_;
};

std::unique_ptr<RandomCase> make_random_case(std::uint64_t seed, const CaseOptions& options = {});

// Runs the library and compares it with the oracle; "" on success, else the seed, the
// description and the mismatches.
std::string check_against_oracle(RandomCase& c);

}  // namespace bsattn_test
