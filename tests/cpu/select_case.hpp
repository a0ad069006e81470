// Seeded random block-selection problems (select_blocks, SPEC §7) on host tensors, shared by the
// CPU suite and the GPU bit-identity test: batched or varlen Q, contiguous or varlen K lengths,
// GQA, f32 / f16 / bf16, odd lengths and block sizes, every policy and forced option, score ties
// (duplicated summary rows) and a bitmask with padding words and rows, poisoned before each run.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bsattn/bsattn.hpp"
#include "oracle.hpp"

namespace bsattn_test {

struct SelectCase {
  static constexpr std::uint32_t kPoison = 0xdeadbeefu;

  std::uint64_t seed = 0;
  bsattn::Problem problem;
  bsattn::SelectOptions options;
  std::vector<int> seqlen_q, seqlen_kv;
  std::vector<std::int32_t> cu_q, cu_k;
  std::vector<std::uint8_t> q, k, v, k_summary, v_summary;
  std::vector<std::int32_t> block_table, seq_lens_kv;  // paged (make_paged)
  std::vector<float> cache;
  bsattn::Inputs inputs;
  std::vector<std::uint32_t> bits;
  std::int64_t bit_rows = 0;  // M (varlen) or nQB (batched)
  int words = 0;             // W, one more than needed
  bsattn::TensorView bits_view;

  int q_blocks(int b) const { return (seqlen_q[b] + problem.block.q - 1) / problem.block.q; }
  int kv_blocks(int b) const { return (seqlen_kv[b] + problem.block.kv - 1) / problem.block.kv; }
  int heads() const { return bsattn::select_sparsity_heads(problem, options); }
  bool varlen() const { return problem.q_layout == bsattn::QLayout::varlen; }
  std::int64_t m_base(int b) const {
    std::int64_t m = 0;
    for (int i = 0; i < b; ++i) m += q_blocks(i);
    return m;
  }
  // Word w of row (b, hs, qb).
  std::uint32_t word(int b, int hs, int qb, int w) const {
    return bits[word_index(b, hs, qb, w)];
  }
  std::size_t word_index(int b, int hs, int qb, int w) const {
    if (varlen()) return static_cast<std::size_t>((hs * bit_rows + m_base(b) + qb) * words + w);
    return static_cast<std::size_t>(((static_cast<std::int64_t>(b) * heads() + hs) * bit_rows + qb) * words + w);
  }
  bool selected(int b, int hs, int qb, int j) const { return (word(b, hs, qb, j / 32) >> (j % 32)) & 1u; }
  double q_value(int b, int t, int h, int d) const {
    if (varlen()) return read_real(inputs.q, {cu_q[b] + t, h, d});
    return read_real(inputs.q, {b, t, h, d});
  }
  double summary_value(int b, int j, int hkv, int d) const { return read_real(inputs.k_summary, {b, j, hkv, d}); }

  std::string describe() const {
    const char* policies[] = {"top_k", "tau", "mass"};
    std::string s = "seed " + std::to_string(seed) + ": B=" + std::to_string(problem.batch) +
                    " Hq=" + std::to_string(problem.heads_q) + " Hkv=" + std::to_string(problem.heads_kv) +
                    " D=" + std::to_string(problem.head_dim) + " block=" + std::to_string(problem.block.q) + "x" +
                    std::to_string(problem.block.kv) + (varlen() ? " varlen" : " batched") + " dtype " +
                    bsattn::to_string(problem.dtype) + " policy " + policies[static_cast<int>(options.policy)] +
                    " top_k=" + std::to_string(options.top_k) + " tau=" + std::to_string(options.tau) +
                    " mass=" + std::to_string(options.mass) + " sinks=" + std::to_string(options.sinks) +
                    " local=" + std::to_string(options.local) + " diagonal=" + std::to_string(options.diagonal) +
                    " causal=" + std::to_string(options.causal) +
                    (options.alignment == bsattn::Alignment::top_left ? " top_left" : " bottom_right") +
                    (options.heads == bsattn::SelectHeads::kv ? " heads=kv" : " heads=q") + " seqlens";
    for (std::size_t b = 0; b < seqlen_q.size(); ++b)
      s += " " + std::to_string(seqlen_q[b]) + "/" + std::to_string(seqlen_kv[b]);
    return s;
  }

  void poison() { std::fill(bits.begin(), bits.end(), kPoison); }
};

inline void fill_random(std::vector<std::uint8_t>& bytes, std::int64_t count, bsattn::DType dtype, std::mt19937_64& rng,
                        double offset) {
  std::normal_distribution<double> normal(offset, 1.0);
  bytes.resize(static_cast<std::size_t>(count * bsattn::element_size(dtype)));
  for (std::int64_t i = 0; i < count; ++i) {
    const double x = normal(rng);
    if (dtype == bsattn::DType::f32) {
      const float f = static_cast<float>(x);
      std::memcpy(bytes.data() + 4 * i, &f, 4);
    } else {
      const std::uint16_t h = dtype == bsattn::DType::f16 ? double_to_half_bits(x) : double_to_bf16_bits(x);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
}

// A random case; `policy` < 0 draws the policy too; `long_length` > 0 makes sequences up to that
// long (hundreds to thousands of KV blocks). Summaries come from the library's CPU
// build_summaries(), then some rows are copied over others so that scores tie exactly.
inline void make_select_case(SelectCase& c, std::uint64_t seed, int policy = -1, int long_length = 0) {
  using namespace bsattn;
  std::mt19937_64 rng(seed);
  const auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  c.seed = seed;
  Problem& p = c.problem;
  p = Problem{};
  p.batch = pick(1, 3);
  p.heads_kv = pick(1, 2);
  p.heads_q = p.heads_kv * pick(1, 3);
  p.head_dim = 8 * pick(1, 5);
  const int bq_choices[] = {16, 32, 64, 128};
  p.block.q = bq_choices[pick(0, 3)];
  p.block.kv = 16 * pick(1, 5);
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  p.dtype = p.out_dtype = dtypes[pick(0, 2)];
  p.num_threads = 2;
  const bool varlen = pick(0, 1) == 1;
  p.q_layout = varlen ? QLayout::varlen : QLayout::batched;
  const int max_len = long_length > 0 ? long_length : (pick(1, 4) == 1 ? 40 : 700);
  if (long_length > 0) p.block.kv = 16;
  c.seqlen_q.assign(p.batch, 0);
  c.seqlen_kv.assign(p.batch, 0);
  if (varlen) {
    for (int b = 0; b < p.batch; ++b) {
      c.seqlen_q[b] = pick(b == 0 ? 1 : 0, max_len);
      c.seqlen_kv[b] = pick(0, 2) == 0 ? c.seqlen_q[b] : pick(b == 0 ? 1 : 0, max_len);  // b = 0 keeps total_kv > 0
      if (b == 0) c.seqlen_kv[b] = std::max(1, c.seqlen_kv[b]);
    }
  } else {
    const int sq = pick(1, max_len), skv = pick(0, 1) ? sq : pick(1, max_len);
    c.seqlen_q.assign(p.batch, sq);
    c.seqlen_kv.assign(p.batch, skv);
  }
  p.max_seqlen_q = std::max(1, *std::max_element(c.seqlen_q.begin(), c.seqlen_q.end()));
  p.max_seqlen_kv = std::max(1, *std::max_element(c.seqlen_kv.begin(), c.seqlen_kv.end()));
  if (!varlen) p.max_seqlen_kv = c.seqlen_kv[0];
  c.cu_q.assign(p.batch + 1, 0);
  c.cu_k.assign(p.batch + 1, 0);
  for (int b = 0; b < p.batch; ++b) {
    c.cu_q[b + 1] = c.cu_q[b] + c.seqlen_q[b];
    c.cu_k[b + 1] = c.cu_k[b] + c.seqlen_kv[b];
  }
  p.total_q = c.cu_q[p.batch];
  p.total_kv = c.cu_k[p.batch];

  SelectOptions& o = c.options;
  o = SelectOptions{};
  o.policy = static_cast<SelectPolicy>(policy >= 0 ? policy : pick(0, 2));
  o.top_k = pick(1, 12);
  o.tau = std::uniform_real_distribution<float>(-1.5f, 1.5f)(rng);
  const float masses[] = {0.1f, 0.5f, 0.9f, 0.99f, 1.0f};
  o.mass = masses[pick(0, 4)];
  o.sinks = pick(0, 3) == 0 ? pick(1, 2) : 0;
  o.local = pick(0, 3) == 0 ? pick(1, 2) : 0;
  o.diagonal = pick(0, 3) != 0;
  o.causal = pick(0, 1) == 1;
  o.alignment = pick(0, 3) == 0 ? Alignment::top_left : Alignment::bottom_right;
  o.heads = pick(0, 1) ? SelectHeads::kv : SelectHeads::query;

  // Q and K: an offset makes scores of one row spread rather than centre on 0.
  const std::int64_t q_rows = varlen ? p.total_q : static_cast<std::int64_t>(p.batch) * p.max_seqlen_q;
  const std::int64_t kv_rows = varlen ? p.total_kv : static_cast<std::int64_t>(p.batch) * p.max_seqlen_kv;
  fill_random(c.q, q_rows * p.heads_q * p.head_dim, p.dtype, rng, 0.3);
  fill_random(c.k, kv_rows * p.heads_kv * p.head_dim, p.dtype, rng, 0.3);
  c.v = c.k;
  const int nkb = (p.max_seqlen_kv + p.block.kv - 1) / p.block.kv;
  const std::int64_t summary_elems = static_cast<std::int64_t>(p.batch) * nkb * p.heads_kv * p.head_dim;
  const std::size_t elem = element_size(p.dtype);
  c.k_summary.assign(static_cast<std::size_t>(summary_elems) * elem, 0);
  c.v_summary.assign(static_cast<std::size_t>(summary_elems) * elem, 0);

  Inputs& in = c.inputs;
  in = Inputs{};
  if (varlen) {
    in.q = TensorView::contiguous(c.q.data(), p.dtype, {p.total_q, p.heads_q, p.head_dim});
    in.k = TensorView::contiguous(c.k.data(), p.dtype, {p.total_kv, p.heads_kv, p.head_dim});
    in.v = TensorView::contiguous(c.v.data(), p.dtype, {p.total_kv, p.heads_kv, p.head_dim});
    in.cu_seqlens_q = TensorView::contiguous(c.cu_q.data(), DType::i32, {p.batch + 1});
    in.cu_seqlens_k = TensorView::contiguous(c.cu_k.data(), DType::i32, {p.batch + 1});
  } else {
    in.q = TensorView::contiguous(c.q.data(), p.dtype, {p.batch, p.max_seqlen_q, p.heads_q, p.head_dim});
    in.k = TensorView::contiguous(c.k.data(), p.dtype, {p.batch, p.max_seqlen_kv, p.heads_kv, p.head_dim});
    in.v = TensorView::contiguous(c.v.data(), p.dtype, {p.batch, p.max_seqlen_kv, p.heads_kv, p.head_dim});
  }
  const TensorView ks = TensorView::contiguous(c.k_summary.data(), p.dtype, {p.batch, nkb, p.heads_kv, p.head_dim});
  const TensorView vs = TensorView::contiguous(c.v_summary.data(), p.dtype, {p.batch, nkb, p.heads_kv, p.head_dim});
  build_summaries(p, in, ks, vs);
  // Ties: copy summary rows over others of the same (b, head).
  const std::size_t row_bytes = static_cast<std::size_t>(p.head_dim) * elem;
  for (int b = 0; b < p.batch; ++b)
    for (int h = 0; h < p.heads_kv; ++h)
      for (int j = 1; j < nkb; ++j)
        if (pick(0, 5) == 0) {
          const int from = pick(0, j - 1);
          std::memcpy(c.k_summary.data() + ((static_cast<std::size_t>(b) * nkb + j) * p.heads_kv + h) * row_bytes,
                      c.k_summary.data() + ((static_cast<std::size_t>(b) * nkb + from) * p.heads_kv + h) * row_bytes,
                      row_bytes);
        }
  in.k_summary = ks;  // k and v stay for attention(); select_blocks() does not read them

  c.words = (nkb + 31) / 32 + 1;
  const int hs = c.heads();
  if (varlen) {
    c.bit_rows = c.m_base(p.batch) + pick(0, 2);
    c.bits.assign(static_cast<std::size_t>(hs * c.bit_rows * c.words), SelectCase::kPoison);
    c.bits_view = TensorView::contiguous(c.bits.data(), DType::u32, {hs, c.bit_rows, c.words});
  } else {
    c.bit_rows = (p.max_seqlen_q + p.block.q - 1) / p.block.q;
    c.bits.assign(static_cast<std::size_t>(p.batch * hs * c.bit_rows * c.words), SelectCase::kPoison);
    c.bits_view = TensorView::contiguous(c.bits.data(), DType::u32, {p.batch, hs, c.bit_rows, c.words});
  }
}

// A long case (3000-10000 tokens in KV blocks of 16: about 190-630 blocks per row) with the given
// policy and top_k drawn from [1, nKB]: the k-th largest key falls anywhere in a long row, ties
// included, and rows of more than 512 blocks take the GPU kernel's other top_k path.
inline void make_long_select_case(SelectCase& c, std::uint64_t seed, int policy) {
  make_select_case(c, seed, policy, 3000 + static_cast<int>(seed % 8) * 1000);
  const int nkb = (c.problem.max_seqlen_kv + c.problem.block.kv - 1) / c.problem.block.kv;
  c.options.top_k = 1 + static_cast<int>(std::mt19937_64(seed ^ 0x5bd1e995u)() % static_cast<std::uint64_t>(nkb));
}

// Turns a batched case into batched Q over a paged KV cache of 16-token pages whose lengths
// (seq_lens_kv) are drawn at random up to max_seqlen_kv; selection reads only the lengths.
inline void make_paged(SelectCase& c, std::uint64_t seed) {
  using namespace bsattn;
  Problem& p = c.problem;
  p.kv_layout = KVLayout::paged;
  p.page_size = 16;
  p.pages_per_seq = (p.max_seqlen_kv + 15) / 16;
  p.num_pages = p.batch * p.pages_per_seq;
  c.block_table.resize(static_cast<std::size_t>(p.num_pages));
  for (std::size_t i = 0; i < c.block_table.size(); ++i) c.block_table[i] = static_cast<std::int32_t>(i);
  std::mt19937_64 rng(seed);
  c.seq_lens_kv.resize(p.batch);
  for (int b = 0; b < p.batch; ++b)
    c.seqlen_kv[b] = c.seq_lens_kv[b] = std::uniform_int_distribution<int>(0, p.max_seqlen_kv)(rng);
  c.cache.assign(static_cast<std::size_t>(p.num_pages) * 16 * p.heads_kv * p.head_dim, 0.0f);
  c.inputs.k = c.inputs.v = TensorView::contiguous(c.cache.data(), DType::f32, {p.num_pages, 16, p.heads_kv, p.head_dim});
  c.inputs.block_table = TensorView::contiguous(c.block_table.data(), DType::i32, {p.batch, p.pages_per_seq});
  c.inputs.seq_lens_kv = TensorView::contiguous(c.seq_lens_kv.data(), DType::i32, {p.batch});
}

}  // namespace bsattn_test
