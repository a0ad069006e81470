// The float64 reference ("oracle") for SPEC §1–§6. It is deliberately independent of the library:
// it reads the same host tensors through their TensorViews, decodes every sparsity format itself,
// materialises the token-level attend set and computes plain (two-pass) softmax attention in
// double. Nothing from bsattn/route or bsattn/cpu is included.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bsattn/problem.hpp"

namespace bsattn_test {

// fp16 / bf16 bit patterns <-> double, written independently of the library's conversions.
double half_bits_to_double(std::uint16_t bits);
double bf16_bits_to_double(std::uint16_t bits);
// Round to nearest (ties away from zero is enough for test data) and encode. Finite inputs only.
std::uint16_t double_to_half_bits(double x);
std::uint16_t double_to_bf16_bits(double x);

// Reads element `index` (per-dimension indices) of a float tensor (f32/f16/bf16) as double, and of
// an int32 / uint32 tensor as an integer.
double read_real(const bsattn::TensorView& t, std::initializer_list<std::int64_t> index);
std::int64_t read_int(const bsattn::TensorView& t, std::initializer_list<std::int64_t> index);

enum class BlockKind : std::uint8_t { skip, partial, full };

// A custom token mask bool(b, h, q, kv), sequence-local indices; empty: none.
using TokenMaskFn = std::function<bool(int, int, int, int)>;

struct OracleResult {
  // Query rows in the order of the packed Q (varlen) or b * Sq + q (batched).
  std::vector<double> out;  // [row, Hq, D]
  std::vector<double> lse;  // [row, Hq]; -inf for a row with nothing attended
  std::vector<int> attended;  // [row, Hq]: exact tokens plus proxy blocks that entered the softmax
};

// Gradients of the attention for a given dO (no proxy routes).
struct OracleGradients {
  std::vector<double> dq;      // [q row, Hq, D], rows as in OracleResult
  std::vector<double> dk, dv;  // [kv row, Hkv, D]: kv_row(b, kv) order, zero for rows nothing attends
};

class Oracle {
 public:
  Oracle(const bsattn::Problem& problem, const bsattn::Inputs& inputs, TokenMaskFn custom_mask = {});

  int seqlen_q(int b) const { return seqlen_q_[b]; }
  int q_blocks(int b) const;
  int kv_blocks(int b) const;
  int sparsity_head(int h) const { return h / (problem_.heads_q / sparsity_heads_); }
  std::int64_t q_row(int b, int q) const { return q_row_base_[b] + q; }
  std::int64_t total_q_rows() const { return q_row_base_.back(); }

  // The selection decoded from the problem's format. A block in both sets is full.
  BlockKind kind(int b, int hs, int qb, int kb) const;
  // Explicit proxy set (Proxy::explicit_set only).
  bool in_proxy_set(int b, int hs, int qb, int kb) const;
  // Built-in mask (MaskSpec) of one in-range token pair.
  bool builtin_visible(int b, int q, int kv) const;
  // Built-in mask AND the custom functor.
  bool mask_visible(int b, int h, int q, int kv) const;
  // Every in-range (q, kv) of Q block qb x KV block kb is visible under the token mask for every
  // query head of sparsity head hs (the route row is per sparsity head, so is eligibility).
  bool mask_keeps_whole(int b, int hs, int qb, int kb) const;
  // SPEC §6: the block contributes one summary term to every row of qb.
  bool proxy_contributes(int b, int hs, int qb, int kb) const;
  // Token attended exactly (SPEC §3–§4).
  bool attended(int b, int h, int q, int kv) const;

  OracleResult compute() const;

  // Row of token kv of sequence b in the packed K/V (varlen) or b * Skv + kv (batched), and the
  // number of rows (contiguous K/V only).
  std::int64_t kv_row(int b, int kv) const;
  std::int64_t total_kv_rows() const;
  // float64 backward (SPEC §9) of the attention compute() evaluates, for the loss
  // sum(dO * O) + sum(dLSE * LSE): P = softmax(S) over the attended tokens, dV = P^T dO,
  // dP = dO V^T, dS = P * (dP - rowsum(dO * O) + dLSE), dQ = scale * dS K, dK = scale * dS^T Q.
  // `dout` is laid out like O, `dlse` (optional) like the LSE. Contiguous or varlen K/V, no proxy.
  OracleGradients backward(const bsattn::TensorView& dout, const bsattn::TensorView& dlse = {}) const;

  // float64 summaries of the given K/V (SPEC §6): mean K and sum V over the in-range tokens of
  // KV block kb, written to dst[D] each.
  void reference_summary(int b, int kb, int hkv, double* mean_k, double* sum_v) const;

 private:
  void decode_set(const bsattn::BlockSet& set, std::vector<std::uint8_t>& dst) const;
  std::int64_t mask_index(int b, int hs, int qb, int kb) const;
  double k_element(int b, int kv, int hkv, int d) const;
  double v_element(int b, int kv, int hkv, int d) const;

  bsattn::Problem problem_;
  bsattn::Inputs inputs_;
  TokenMaskFn custom_mask_;
  int sparsity_heads_ = 1;
  std::vector<int> seqlen_q_, seqlen_kv_;
  std::vector<std::int64_t> q_row_base_;   // [B+1]
  std::vector<std::int64_t> kv_row_base_;  // varlen contiguous KV: cu_seqlens_k
  std::vector<std::int64_t> cu_m_blocks_, cu_idx_offsets_;  // derived here (SPEC §3.2)
  std::vector<std::int64_t> row_base_;     // [B+1]: first (b, qb, kb) slot of each sequence
  // Per (b, hs, qb, kb): membership in the partial / full / proxy sets.
  std::vector<std::uint8_t> partial_, full_, proxy_;
  mutable std::vector<std::int8_t> whole_cache_;  // -1 unknown, 0/1
};

// Tolerances by output dtype (SPEC §1: fp32 accumulation; low-precision outputs are rounded once).
struct Tolerance {
  double out_abs, out_rel, lse_abs;
};
Tolerance tolerance_for(bsattn::DType out_dtype);

// Compares the library's outputs with the oracle. Returns "" on success, else a description of the
// first mismatches (and of any element left unwritten).
std::string compare_outputs(const bsattn::Problem& problem, const Oracle& oracle, const OracleResult& expected,
                            const bsattn::Outputs& outputs, const Tolerance& tolerance);

}  // namespace bsattn_test
