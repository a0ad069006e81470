// Internals of Workload shared by its two translation units: workload.cpp (sequences, block
// pattern, tensors, density) and workload_reference.cpp (the float64 reference of verify()).
// Not part of the tools' interface (workload.hpp): included by those two files only.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "bsattn/cpu/numeric.hpp"
#include "workload.hpp"

namespace bsattn::tools {

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// An owned, zero-initialised, row-major host tensor. operator new[] aligns to 16 bytes, which
// the SPEC asks of every base pointer.
struct HostTensor {
  std::unique_ptr<std::byte[]> bytes;
  TensorView view;

  HostTensor() = default;
  HostTensor(DType dtype, const std::vector<std::int64_t>& shape) {
    view.dtype = dtype;
    view.rank = static_cast<int>(shape.size());
    std::int64_t n = 1;
    for (int i = view.rank - 1; i >= 0; --i) {
      view.shape[i] = shape[i];
      view.stride[i] = n;
      n *= shape[i];
    }
    bytes.reset(new std::byte[std::max<std::int64_t>(1, n) * element_size(dtype)]());
    view.data = bytes.get();
  }
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(bytes.get());
  }
};

inline void fill_normal(HostTensor& t, std::mt19937_64& rng) {
  std::normal_distribution<float> normal;
  const std::int64_t n = t.view.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = normal(rng);
    switch (t.view.dtype) {
      case DType::f16: t.as<std::uint16_t>()[i] = cpu::float_to_half(x); break;
      case DType::bf16: t.as<std::uint16_t>()[i] = cpu::float_to_bf16(x); break;
      default: t.as<float>()[i] = x; break;
    }
  }
}

struct Interval {  // [lo, hi)
  long long lo, hi;
  Interval operator&(Interval o) const { return {std::max(lo, o.lo), std::min(hi, o.hi)}; }
  long long size() const { return std::max(0LL, hi - lo); }
};
constexpr long long kUnbounded = 1LL << 40;

struct Sequence {
  int seqlen_q = 0, seqlen_kv = 0;
  std::int64_t q_base = 0, kv_base = 0;  // first row in the packed (varlen) tensors
  int q_blocks = 0, kv_blocks = 0;
  int m_block_base = 0;         // exclusive prefix sum of q_blocks
  std::int64_t idx_base = 0;    // exclusive prefix sum of q_blocks * kv_blocks
  int first_page = 0;           // paged: first column of the page permutation it owns
  std::vector<int> document;    // per token (Sq == Skv): local document id
  std::vector<int> doc_start, doc_end;  // per token: the [start, end) of its document
};

// The SPEC §4 mask, written independently of the library: per query row the visible KV tokens
// are ([0, sinks) U window) n causal n document n [0, Skv), all intervals.
class MaskModel {
 public:
  MaskModel(const MaskOptions& m, const std::vector<Sequence>& seqs) : m_(m), seqs_(seqs) {}

  // Visible KV tokens of row q within [k0, k1).
  long long count(int b, int q, int k0, int k1) const {
    const Sequence& s = seqs_[b];
    const long long diag = q + (m_.alignment == Alignment::top_left ? 0 : s.seqlen_kv - s.seqlen_q);
    Interval a{std::max(0, k0), std::min(k1, s.seqlen_kv)};
    if (m_.causal) a = a & Interval{-kUnbounded, diag + 1};
    if (!s.document.empty()) a = a & Interval{s.doc_start[q], s.doc_end[q]};
    if (m_.window_left < 0 && m_.window_right < 0) return a.size();
    const Interval window{m_.window_left < 0 ? -kUnbounded : diag - m_.window_left,
                          m_.window_right < 0 ? kUnbounded : diag + m_.window_right + 1};
    const Interval sinks{0, m_.sink_tokens};
    return (a & window).size() + (a & sinks).size() - (a & window & sinks).size();
  }
  bool visible(int b, int q, int kv) const { return count(b, q, kv, kv + 1) == 1; }

  // Visible pairs in the block rectangle (clipped to the sequence).
  long long count_block(int b, int qb, int kb, const BlockSize& bs) const {
    const Sequence& s = seqs_[b];
    const int q1 = std::min((qb + 1) * bs.q, s.seqlen_q), k0 = kb * bs.kv, k1 = std::min(k0 + bs.kv, s.seqlen_kv);
    long long n = 0;
    for (int q = qb * bs.q; q < q1; ++q) n += count(b, q, k0, k1);
    return n;
  }

 private:
  const MaskOptions& m_;
  const std::vector<Sequence>& seqs_;
};

inline long long block_area(const Sequence& s, int qb, int kb, const BlockSize& bs) {
  return static_cast<long long>(std::min(bs.q, s.seqlen_q - qb * bs.q)) * std::min(bs.kv, s.seqlen_kv - kb * bs.kv);
}

struct Workload::State {
  WorkloadSpec spec;
  std::vector<Sequence> seqs;
  int max_q_blocks = 0, max_kv_blocks = 0, total_m_blocks = 0;
  std::int64_t total_n_blocks = 0, total_q = 0, total_kv = 0;
  int pages_per_seq = 0, num_pages = 0;
  // Block pattern: row (b, hs, qb) at (b * Hs + hs) * max_q_blocks + qb, ascending block lists.
  std::vector<std::vector<int>> partial, full;
  bool has_partial = false, has_full = false;

  HostTensor q, k, v, out, lse;
  HostTensor cu_seqlens_q, cu_seqlens_k, block_table, seq_lens_kv, cu_total_m_blocks, cu_block_idx_offsets;
  HostTensor doc_q, doc_kv, k_summary, v_summary;
  struct SetTensors {
    HostTensor counts, indices, indptr, bits;
  } partial_set, full_set;
  Inputs inputs;
  Outputs outputs;

  explicit State(const WorkloadSpec& s) : spec(s) {}
  bool varlen() const { return spec.q_layout == QLayout::varlen; }
  std::size_t row(int b, int hs, int qb) const {
    return (static_cast<std::size_t>(b) * spec.sparsity_heads + hs) * max_q_blocks + qb;
  }

  void check_spec();
  void lay_out_sequences();
  void choose_pattern();
  void fill_tensors();
  void fill_block_set(const std::vector<std::vector<int>>& lists, SetTensors& t, BlockSet& set);
  Problem problem(Device device, int threads) const;
  std::int64_t kv_row(int b, int kv, int hkv) const;  // element offset of K/V row (b, kv, hkv)
};

}  // namespace bsattn::tools
