#include "workload.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>

#include <unistd.h>

#include "bsattn/cpu/numeric.hpp"
#include "bsattn/summary.hpp"

namespace bsattn::tools {
namespace {

int ceil_div(int a, int b) { return (a + b - 1) / b; }

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

void fill_normal(HostTensor& t, std::mt19937_64& rng) {
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

long long block_area(const Sequence& s, int qb, int kb, const BlockSize& bs) {
  return static_cast<long long>(std::min(bs.q, s.seqlen_q - qb * bs.q)) * std::min(bs.kv, s.seqlen_kv - kb * bs.kv);
}

}  // namespace

float element_as_float(const TensorView& t, std::int64_t i) {
  switch (t.dtype) {
    case DType::f16: return cpu::half_to_float(static_cast<const std::uint16_t*>(t.data)[i]);
    case DType::bf16: return cpu::bf16_to_float(static_cast<const std::uint16_t*>(t.data)[i]);
    default: return static_cast<const float*>(t.data)[i];
  }
}

// ---- WorkloadSpec ----------------------------------------------------------------------------

int WorkloadSpec::max_seqlen_q() const { return seqlens_q.empty() ? 0 : *std::max_element(seqlens_q.begin(), seqlens_q.end()); }
int WorkloadSpec::max_seqlen_kv() const { return seqlens_kv.empty() ? 0 : *std::max_element(seqlens_kv.begin(), seqlens_kv.end()); }

WorkloadSpec WorkloadSpec::dense() const {
  WorkloadSpec d = *this;
  d.format = Format::all_blocks;
  d.mask = MaskOptions{};
  d.pattern = PatternOptions{};
  d.proxy = Proxy::off;
  return d;
}


std::string WorkloadSpec::describe() const {
  std::ostringstream o;
  o << "B=" << batch << " Hq=" << heads_q << " Hkv=" << heads_kv << " D=" << head_dim;
  if (q_layout == QLayout::varlen) o << " varlen max_Sq=" << max_seqlen_q() << " max_Skv=" << max_seqlen_kv();
  else o << " Sq=" << max_seqlen_q() << " Skv=" << max_seqlen_kv();
  if (kv_layout == KVLayout::paged) o << " paged(page " << page_size << ")";
  o << " " << to_string(dtype) << " block " << block.q << "x" << block.kv << " " << to_string(format);
  if (sparsity_heads != 1) o << " Hs=" << sparsity_heads;
  if (mask.causal) o << " causal";
  if (mask.window_left >= 0 || mask.window_right >= 0) o << " window(" << mask.window_left << "," << mask.window_right << ")";
  if (mask.sink_tokens > 0) o << " sinks=" << mask.sink_tokens;
  if (!mask.document_lengths.empty()) o << " documents";
  if (pattern.random_density > 0) o << " +random " << pattern.random_density << (pattern.random_full ? " full" : "");
  if (!pattern.blocks.empty()) o << " +" << pattern.blocks.size() << " explicit";
  if (proxy != Proxy::off) o << " proxy";
  return o.str();
}

// ---- Verification tolerances -----------------------------------------------------------------

VerifyResult tolerances_for(DType out_dtype) {
  VerifyResult r;
  switch (out_dtype) {
    case DType::bf16: r.max_abs_err_tolerance = 2e-2; r.rel_l2_err_tolerance = 1e-2; break;
    case DType::f16: r.max_abs_err_tolerance = 4e-3; r.rel_l2_err_tolerance = 2e-3; break;
    default: r.max_abs_err_tolerance = 1e-4; r.rel_l2_err_tolerance = 1e-5; break;
  }
  r.lse_tolerance = 1e-3;
  return r;
}

bool VerifyResult::passed() const {
  return max_abs_err <= max_abs_err_tolerance && rel_l2_err <= rel_l2_err_tolerance && max_lse_err <= lse_tolerance;
}

// ---- Workload state --------------------------------------------------------------------------

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

void Workload::State::check_spec() {
  const WorkloadSpec& s = spec;
  auto require = [](bool ok, const std::string& what) {
    if (!ok) throw SpecError(what);
  };
  require(s.batch >= 1, "batch must be >= 1");
  require(s.heads_q >= 1 && s.heads_kv >= 1 && s.head_dim >= 1, "heads_q, heads_kv and head_dim must be >= 1");
  require(static_cast<int>(s.seqlens_q.size()) == s.batch && static_cast<int>(s.seqlens_kv.size()) == s.batch,
          "need one Q and one KV sequence length per batch entry");
  for (int b = 0; b < s.batch; ++b)
    require(s.seqlens_q[b] >= 0 && s.seqlens_kv[b] >= 0, "sequence lengths must be >= 0");
  require(s.max_seqlen_q() >= 1 && s.max_seqlen_kv() >= 1, "the longest sequences must have a token");
  if (s.q_layout == QLayout::batched)
    for (int b = 1; b < s.batch; ++b)
      require(s.seqlens_q[b] == s.seqlens_q[0] && s.seqlens_kv[b] == s.seqlens_kv[0],
              "the batched layout has one Q and one KV length; use the varlen layout for ragged sequences");
  require(s.kv_layout != KVLayout::paged || s.page_size >= 1, "page_size must be >= 1");
  require(s.block.q >= 1 && s.block.kv >= 1, "block sizes must be >= 1");
  require(s.sparsity_heads >= 1 && s.heads_q % s.sparsity_heads == 0, "sparsity_heads must divide heads_q");
  require(s.format != Format::block_lists || s.q_layout == QLayout::batched,
          "format block_lists needs the batched layout (varlen_block_lists is its varlen form)");
  require(s.format != Format::varlen_block_lists || s.q_layout == QLayout::varlen,
          "format varlen_block_lists needs the varlen layout");
  require(s.format != Format::all_blocks || (s.pattern.random_density == 0 && s.pattern.blocks.empty()),
          "format all_blocks attends every block: it takes no random or explicit blocks");
  require(s.pattern.random_density >= 0 && s.pattern.random_density <= 1, "random_density must be in [0, 1]");
  require(s.proxy != Proxy::explicit_set, "proxy: only off and eligible are generated");
  require(s.mask.window_left >= -1 && s.mask.window_right >= -1 && s.mask.sink_tokens >= 0,
          "window sizes must be >= -1 (unlimited) and sink_tokens >= 0");
  if (!s.mask.document_lengths.empty()) {
    require(s.seqlens_q == s.seqlens_kv, "documents need equal Q and KV lengths");
    for (int len : s.mask.document_lengths) require(len >= 1, "document lengths must be >= 1");
  }
  // Refuse what this machine cannot hold rather than dying in an allocation: Q, K, V, O and the
  // block lists (partial and full, [B, Hs, nQB, nKB] int32) dominate.
  double tokens_q = 0, tokens_kv = 0;
  for (int b = 0; b < s.batch; ++b) {
    tokens_q += s.seqlens_q[b];
    tokens_kv += s.seqlens_kv[b];
  }
  const double blocks = static_cast<double>(s.batch) * s.sparsity_heads * ceil_div(s.max_seqlen_q(), s.block.q) *
                        ceil_div(s.max_seqlen_kv(), s.block.kv);
  const double gib = static_cast<double>(1 << 30);
  const double need = (static_cast<double>(element_size(s.dtype)) * 2.0 *
                           (tokens_q * s.heads_q + tokens_kv * s.heads_kv) * s.head_dim +
                       8.0 * blocks) / gib;
  const double have = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE)) / gib;
  require(need < 0.75 * have, "the problem needs about " + std::to_string(static_cast<long long>(need + 0.5)) +
                                  " GiB of host memory for its tensors; this machine has " +
                                  std::to_string(static_cast<long long>(have)) + " GiB");
}

void Workload::State::lay_out_sequences() {
  if (spec.kv_layout == KVLayout::paged) {
    pages_per_seq = ceil_div(spec.max_seqlen_kv(), spec.page_size);
    num_pages = spec.batch * pages_per_seq + 1;  // one page no sequence owns
  }
  seqs.resize(spec.batch);
  for (int b = 0; b < spec.batch; ++b) {
    Sequence& s = seqs[b];
    s.seqlen_q = spec.seqlens_q[b];
    s.seqlen_kv = spec.seqlens_kv[b];
    s.q_blocks = ceil_div(s.seqlen_q, spec.block.q);
    s.kv_blocks = ceil_div(s.seqlen_kv, spec.block.kv);
    s.q_base = total_q;
    s.kv_base = total_kv;
    s.m_block_base = total_m_blocks;
    s.idx_base = total_n_blocks;
    s.first_page = b * pages_per_seq;
    total_q += s.seqlen_q;
    total_kv += s.seqlen_kv;
    total_m_blocks += s.q_blocks;
    total_n_blocks += static_cast<std::int64_t>(s.q_blocks) * s.kv_blocks;
    if (!spec.mask.document_lengths.empty()) {
      s.document.resize(s.seqlen_q);
      s.doc_start.resize(s.seqlen_q);
      s.doc_end.resize(s.seqlen_q);
      int start = 0;
      for (int id = 0; start < s.seqlen_q; ++id) {
        const int end = std::min(s.seqlen_q, start + spec.mask.document_lengths[id % spec.mask.document_lengths.size()]);
        for (int t = start; t < end; ++t) {
          s.document[t] = id;
          s.doc_start[t] = start;
          s.doc_end[t] = end;
        }
        start = end;
      }
    }
  }
  max_q_blocks = ceil_div(spec.max_seqlen_q(), spec.block.q);
  max_kv_blocks = ceil_div(spec.max_seqlen_kv(), spec.block.kv);
}

void Workload::State::choose_pattern() {
  const int hs_count = spec.sparsity_heads;
  partial.assign(static_cast<std::size_t>(spec.batch) * hs_count * max_q_blocks, {});
  full.assign(partial.size(), {});
  const MaskModel mask(spec.mask, seqs);
  const PatternOptions& pat = spec.pattern;
  std::mt19937_64 rng(spec.seed ^ 0x9e3779b97f4a7c15ULL);
  enum Kind : std::uint8_t { none, partial_block, full_block };
  std::vector<std::uint8_t> kind, mask_kind;
  std::vector<int> candidates;

  for (const ExplicitBlock& e : pat.blocks)
    if (e.q_block < 0 || e.q_block >= max_q_blocks || e.kv_block < 0 || e.kv_block >= max_kv_blocks)
      throw SpecError("explicit block (" + std::to_string(e.q_block) + ", " + std::to_string(e.kv_block) +
                      ") is outside the " + std::to_string(max_q_blocks) + " x " + std::to_string(max_kv_blocks) +
                      " block grid");

  for (int b = 0; b < spec.batch; ++b) {
    const Sequence& s = seqs[b];
    for (int qb = 0; qb < s.q_blocks; ++qb) {
      // The mask's blocks do not depend on the head: classify once per (b, qb).
      mask_kind.assign(s.kv_blocks, spec.format == Format::all_blocks ? partial_block : none);
      if (spec.format != Format::all_blocks && pat.mask_blocks && spec.mask.any())
        for (int kb = 0; kb < s.kv_blocks; ++kb) {
          const long long visible = mask.count_block(b, qb, kb, spec.block);
          if (visible > 0) mask_kind[kb] = visible == block_area(s, qb, kb, spec.block) ? full_block : partial_block;
        }
      const int diag = qb * spec.block.q + (spec.mask.alignment == Alignment::top_left ? 0 : s.seqlen_kv - s.seqlen_q);
      for (int hs = 0; hs < hs_count; ++hs) {
        kind = mask_kind;
        const int extra = static_cast<int>(std::lround(pat.random_density * s.kv_blocks));
        if (extra > 0) {
          candidates.clear();
          for (int kb = 0; kb < s.kv_blocks; ++kb) {
            const int last_kv = std::min((kb + 1) * spec.block.kv, s.seqlen_kv) - 1;
            if (kind[kb] == none && (!spec.mask.causal || last_kv <= diag)) candidates.push_back(kb);
          }
          const int n = std::min<int>(extra, static_cast<int>(candidates.size()));
          for (int i = 0; i < n; ++i) {  // partial Fisher-Yates: the first n are a uniform sample
            std::uniform_int_distribution<int> pick(i, static_cast<int>(candidates.size()) - 1);
            std::swap(candidates[i], candidates[pick(rng)]);
            kind[candidates[i]] = pat.random_full ? full_block : partial_block;
          }
        }
        for (const ExplicitBlock& e : pat.blocks)
          if (e.q_block == qb && e.kv_block < s.kv_blocks)
            kind[e.kv_block] = std::max<std::uint8_t>(kind[e.kv_block], e.full ? full_block : partial_block);
        const std::size_t r = row(b, hs, qb);
        for (int kb = 0; kb < s.kv_blocks; ++kb) {
          if (kind[kb] == partial_block) partial[r].push_back(kb);
          if (kind[kb] == full_block) full[r].push_back(kb);
        }
        has_partial = has_partial || !partial[r].empty();
        has_full = has_full || !full[r].empty();
      }
    }
  }
  if (!has_full) has_partial = true;  // an empty pattern still needs one (empty) set
}

// Writes one block set in the problem's format. Rows are enumerated in the order of the format's
// counts: batched (b, hs, qb < max_q_blocks); varlen (hs, cu_total_m_blocks[b] + qb).
void Workload::State::fill_block_set(const std::vector<std::vector<int>>& lists, SetTensors& t, BlockSet& set) {
  const int hs_count = spec.sparsity_heads;
  const std::int64_t rows = varlen() ? static_cast<std::int64_t>(hs_count) * total_m_blocks
                                     : static_cast<std::int64_t>(spec.batch) * hs_count * max_q_blocks;
  auto for_each_row = [&](const std::function<void(std::int64_t flat, int b, int qb, const std::vector<int>&)>& fn) {
    static const std::vector<int> none;
    for (std::int64_t flat = 0; flat < rows; ++flat) {
      int b, hs, qb;
      if (varlen()) {
        hs = static_cast<int>(flat / total_m_blocks);
        const int m = static_cast<int>(flat % total_m_blocks);
        b = 0;
        while (seqs[b].m_block_base + seqs[b].q_blocks <= m) ++b;
        qb = m - seqs[b].m_block_base;
      } else {
        qb = static_cast<int>(flat % max_q_blocks);
        hs = static_cast<int>(flat / max_q_blocks % hs_count);
        b = static_cast<int>(flat / max_q_blocks / hs_count);
      }
      fn(flat, b, qb, qb < seqs[b].q_blocks ? lists[row(b, hs, qb)] : none);
    }
  };
  const int words = ceil_div(max_kv_blocks, 32);
  switch (spec.format) {
    case Format::all_blocks: return;
    case Format::block_lists:
    case Format::varlen_block_lists: {
      if (varlen()) {
        t.counts = HostTensor(DType::i32, {hs_count, total_m_blocks});
        t.indices = HostTensor(DType::i32, {hs_count, std::max<std::int64_t>(1, total_n_blocks)});
      } else {
        t.counts = HostTensor(DType::i32, {spec.batch, hs_count, max_q_blocks});
        t.indices = HostTensor(DType::i32, {spec.batch, hs_count, max_q_blocks, max_kv_blocks});
      }
      for_each_row([&](std::int64_t flat, int b, int qb, const std::vector<int>& list) {
        t.counts.as<std::int32_t>()[flat] = static_cast<std::int32_t>(list.size());
        const std::int64_t start = varlen() ? flat / total_m_blocks * total_n_blocks + seqs[b].idx_base +
                                                  static_cast<std::int64_t>(qb) * seqs[b].kv_blocks
                                            : flat * max_kv_blocks;
        std::copy(list.begin(), list.end(), t.indices.as<std::int32_t>() + start);
      });
      set.counts = t.counts.view;
      set.indices = t.indices.view;
      return;
    }
    case Format::bsr: {
      std::int64_t nnz = 0;
      for (const auto& l : lists) nnz += static_cast<std::int64_t>(l.size());
      t.indptr = HostTensor(DType::i32, {rows + 1});
      t.indices = HostTensor(DType::i32, {std::max<std::int64_t>(1, nnz)});
      std::int64_t next = 0;
      for_each_row([&](std::int64_t flat, int, int, const std::vector<int>& list) {
        t.indptr.as<std::int32_t>()[flat] = static_cast<std::int32_t>(next);
        std::copy(list.begin(), list.end(), t.indices.as<std::int32_t>() + next);
        next += static_cast<std::int64_t>(list.size());
      });
      t.indptr.as<std::int32_t>()[rows] = static_cast<std::int32_t>(next);
      set.indptr = t.indptr.view;
      set.indices = t.indices.view;
      return;
    }
    case Format::bitmask: {
      t.bits = varlen() ? HostTensor(DType::u32, {hs_count, total_m_blocks, words})
                        : HostTensor(DType::u32, {spec.batch, hs_count, max_q_blocks, words});
      for_each_row([&](std::int64_t flat, int, int, const std::vector<int>& list) {
        for (int kb : list) t.bits.as<std::uint32_t>()[flat * words + kb / 32] |= 1u << (kb % 32);
      });
      set.bits = t.bits.view;
      return;
    }
  }
}

std::int64_t Workload::State::kv_row(int b, int kv, int hkv) const {
  const std::int64_t d = spec.head_dim, h = spec.heads_kv;
  if (spec.kv_layout == KVLayout::paged) {
    const std::int64_t page = block_table.as<std::int32_t>()[static_cast<std::int64_t>(b) * pages_per_seq + kv / spec.page_size];
    return ((page * spec.page_size + kv % spec.page_size) * h + hkv) * d;
  }
  return ((seqs[b].kv_base + kv) * h + hkv) * d;  // batched rows are packed the same way
}

void Workload::State::fill_tensors() {
  const WorkloadSpec& s = spec;
  std::mt19937_64 rng(s.seed);
  const std::int64_t B = s.batch, Sq = s.max_seqlen_q(), Skv = s.max_seqlen_kv(), D = s.head_dim;
  const bool paged = s.kv_layout == KVLayout::paged;
  const std::vector<std::int64_t> q_shape = varlen() ? std::vector<std::int64_t>{total_q, s.heads_q, D}
                                                     : std::vector<std::int64_t>{B, Sq, s.heads_q, D};
  q = HostTensor(s.dtype, q_shape);
  out = HostTensor(s.out_dtype, q_shape);
  lse = varlen() ? HostTensor(DType::f32, {s.heads_q, total_q}) : HostTensor(DType::f32, {B, s.heads_q, Sq});
  std::vector<std::int64_t> kv_shape;
  if (paged) {
    kv_shape = {num_pages, s.page_size, s.heads_kv, D};
  } else {
    kv_shape = varlen() ? std::vector<std::int64_t>{total_kv, s.heads_kv, D} : std::vector<std::int64_t>{B, Skv, s.heads_kv, D};
  }
  k = HostTensor(s.dtype, kv_shape);
  v = HostTensor(s.dtype, kv_shape);
  fill_normal(q, rng);
  fill_normal(k, rng);
  fill_normal(v, rng);
  inputs.q = q.view;
  inputs.k = k.view;
  inputs.v = v.view;
  outputs.out = out.view;
  outputs.lse = lse.view;

  if (varlen()) {
    cu_seqlens_q = HostTensor(DType::i32, {B + 1});
    cu_total_m_blocks = HostTensor(DType::i32, {B + 1});
    cu_block_idx_offsets = HostTensor(DType::i32, {B + 1});
    for (int b = 0; b <= s.batch; ++b) {
      const bool end = b == s.batch;
      cu_seqlens_q.as<std::int32_t>()[b] = static_cast<std::int32_t>(end ? total_q : seqs[b].q_base);
      cu_total_m_blocks.as<std::int32_t>()[b] = end ? total_m_blocks : seqs[b].m_block_base;
      cu_block_idx_offsets.as<std::int32_t>()[b] = static_cast<std::int32_t>(end ? total_n_blocks : seqs[b].idx_base);
    }
    inputs.cu_seqlens_q = cu_seqlens_q.view;
    // Given rather than derived by the plan, so that the tensor path is exercised: every varlen
    // format but all_blocks indexes rows through cu_total_m_blocks, only lists need the offsets.
    if (s.format != Format::all_blocks) inputs.cu_total_m_blocks = cu_total_m_blocks.view;
    if (s.format == Format::varlen_block_lists) inputs.cu_block_idx_offsets = cu_block_idx_offsets.view;
    if (!paged) {
      cu_seqlens_k = HostTensor(DType::i32, {B + 1});
      for (int b = 0; b <= s.batch; ++b)
        cu_seqlens_k.as<std::int32_t>()[b] = static_cast<std::int32_t>(b == s.batch ? total_kv : seqs[b].kv_base);
      inputs.cu_seqlens_k = cu_seqlens_k.view;
    }
  }
  if (paged) {
    // Pages in a random order, so that logical and physical order differ.
    std::vector<std::int32_t> pages(num_pages);
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    block_table = HostTensor(DType::i32, {B, pages_per_seq});
    seq_lens_kv = HostTensor(DType::i32, {B});
    for (int b = 0; b < s.batch; ++b) {
      seq_lens_kv.as<std::int32_t>()[b] = seqs[b].seqlen_kv;
      std::copy_n(pages.begin() + seqs[b].first_page, pages_per_seq,
                  block_table.as<std::int32_t>() + static_cast<std::int64_t>(b) * pages_per_seq);
    }
    inputs.block_table = block_table.view;
    inputs.seq_lens_kv = seq_lens_kv.view;
  }

  if (!s.mask.document_lengths.empty()) {
    // Batched [B, S]; varlen [total]; paged doc_kv [B, C * page_size] (logical positions).
    doc_q = varlen() ? HostTensor(DType::i32, {total_q}) : HostTensor(DType::i32, {B, Sq});
    const std::int64_t kv_row_len = paged ? static_cast<std::int64_t>(pages_per_seq) * s.page_size : Skv;
    doc_kv = paged || !varlen() ? HostTensor(DType::i32, {B, kv_row_len}) : HostTensor(DType::i32, {total_kv});
    for (int b = 0; b < s.batch; ++b) {
      const Sequence& seq = seqs[b];
      std::copy(seq.document.begin(), seq.document.end(), doc_q.as<std::int32_t>() + (varlen() ? seq.q_base : b * Sq));
      const std::int64_t kv_base = paged || !varlen() ? b * kv_row_len : seq.kv_base;
      std::copy(seq.document.begin(), seq.document.end(), doc_kv.as<std::int32_t>() + kv_base);
    }
    inputs.doc_q = doc_q.view;
    inputs.doc_kv = doc_kv.view;
  }

  fill_block_set(partial, partial_set, inputs.partial);
  if (has_full) fill_block_set(full, full_set, inputs.full);

  if (s.proxy == Proxy::eligible) {
    k_summary = HostTensor(s.dtype, {B, max_kv_blocks, s.heads_kv, D});
    v_summary = HostTensor(s.dtype, {B, max_kv_blocks, s.heads_kv, D});
    build_summaries(problem(Device::cpu, 0), inputs, k_summary.view, v_summary.view);
    inputs.k_summary = k_summary.view;
    inputs.v_summary = v_summary.view;
  }
}

Problem Workload::State::problem(Device device, int threads) const {
  const WorkloadSpec& s = spec;
  Problem p;
  p.batch = s.batch;
  p.heads_q = s.heads_q;
  p.heads_kv = s.heads_kv;
  p.head_dim = s.head_dim;
  p.max_seqlen_q = s.max_seqlen_q();
  p.max_seqlen_kv = s.max_seqlen_kv();
  p.q_layout = s.q_layout;
  p.kv_layout = s.kv_layout;
  p.total_q = varlen() ? total_q : 0;
  p.total_kv = varlen() && s.kv_layout == KVLayout::contiguous ? total_kv : 0;
  if (s.kv_layout == KVLayout::paged) {
    p.page_size = s.page_size;
    p.num_pages = num_pages;
    p.pages_per_seq = pages_per_seq;
  }
  p.dtype = s.dtype;
  p.out_dtype = s.out_dtype;
  p.block = s.block;
  p.format = s.format;
  p.sparsity_heads = s.format == Format::all_blocks ? 1 : s.sparsity_heads;
  p.sparsity_batch = !varlen() && s.format != Format::all_blocks ? s.batch : 1;  // one pattern per sequence
  p.has_partial = has_partial;
  p.has_full = has_full;
  p.mask = s.mask;  // the built-in terms
  p.mask.document_ids = !s.mask.document_lengths.empty();
  p.proxy = s.proxy;
  p.scale = s.scale;
  p.device = device;
  p.num_threads = threads;
  return p;
}

// ---- Workload --------------------------------------------------------------------------------

Workload::Workload(const WorkloadSpec& spec) : state_(std::make_unique<State>(spec)) {
  state_->check_spec();
  state_->lay_out_sequences();
  state_->choose_pattern();
  state_->fill_tensors();
}
Workload::~Workload() = default;
Workload::Workload(Workload&&) noexcept = default;
Workload& Workload::operator=(Workload&&) noexcept = default;

const WorkloadSpec& Workload::spec() const { return state_->spec; }
Problem Workload::problem(Device device, int threads) const { return state_->problem(device, threads); }
const Inputs& Workload::inputs() const { return state_->inputs; }
const Outputs& Workload::outputs() const { return state_->outputs; }

Density Workload::density() const {
  const State& st = *state_;
  const WorkloadSpec& s = st.spec;
  const MaskModel mask(s.mask, st.seqs);
  const int heads_per_hs = s.heads_q / s.sparsity_heads;
  Density d;
  for (int b = 0; b < s.batch; ++b) {
    const Sequence& seq = st.seqs[b];
    d.total_pairs += static_cast<std::int64_t>(seq.seqlen_q) * seq.seqlen_kv * s.heads_q;
    d.total_blocks += static_cast<std::int64_t>(seq.q_blocks) * seq.kv_blocks * s.sparsity_heads;
    for (int hs = 0; hs < s.sparsity_heads; ++hs)
      for (int qb = 0; qb < seq.q_blocks; ++qb) {
        const std::size_t r = st.row(b, hs, qb);
        for (int kb : st.full[r]) d.kept_pairs += block_area(seq, qb, kb, s.block) * heads_per_hs;
        for (int kb : st.partial[r]) {
          const long long kept = s.mask.any() ? mask.count_block(b, qb, kb, s.block) : block_area(seq, qb, kb, s.block);
          d.kept_pairs += kept * heads_per_hs;
        }
        d.kept_blocks += static_cast<std::int64_t>(st.full[r].size() + st.partial[r].size());
      }
  }
  d.pairs = d.total_pairs ? static_cast<double>(d.kept_pairs) / d.total_pairs : 0.0;
  d.blocks = d.total_blocks ? static_cast<double>(d.kept_blocks) / d.total_blocks : 0.0;
  return d;
}

VerifyResult Workload::verify(int rows, std::uint64_t seed) const {
  const State& st = *state_;
  const WorkloadSpec& s = st.spec;
  const MaskModel mask(s.mask, st.seqs);
  const int D = s.head_dim;
  const double scale = s.scale != 0.0f ? s.scale : 1.0 / std::sqrt(static_cast<double>(D));
  const double neg_inf = -std::numeric_limits<double>::infinity();

  struct Sample {
    int b, h, q;
  };
  std::vector<Sample> samples;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pick_h(0, s.heads_q - 1);
  for (int b = 0; b < s.batch; ++b)
    if (st.seqs[b].seqlen_q > 0) {
      samples.push_back({b, pick_h(rng), 0});
      samples.push_back({b, pick_h(rng), st.seqs[b].seqlen_q - 1});
    }
  std::uniform_int_distribution<int> pick_b(0, s.batch - 1);
  while (static_cast<int>(samples.size()) < rows) {
    const int b = pick_b(rng);
    if (st.seqs[b].seqlen_q == 0) continue;
    samples.push_back({b, pick_h(rng), std::uniform_int_distribution<int>(0, st.seqs[b].seqlen_q - 1)(rng)});
  }

  VerifyResult r = tolerances_for(s.out_dtype);
  r.rows = static_cast<int>(samples.size());
  double err2 = 0.0, ref2 = 0.0;
  std::vector<double> qv(D), acc(D), score;
  std::vector<std::int64_t> rows_kv;  // K/V element offsets of the attended tokens
  for (const Sample& smp : samples) {
    const Sequence& seq = st.seqs[smp.b];
    const int hkv = smp.h / (s.heads_q / s.heads_kv), hs = smp.h / (s.heads_q / s.sparsity_heads);
    const int qb = smp.q / s.block.q;
    const std::int64_t q_off = ((seq.q_base + smp.q) * s.heads_q + smp.h) * D;  // batched: q_base = b * Sq
    for (int i = 0; i < D; ++i) qv[i] = element_as_float(st.q.view, q_off + i) * scale;
    auto dot = [&](const TensorView& t, std::int64_t off) {
      double x = 0.0;
      for (int i = 0; i < D; ++i) x += qv[i] * element_as_float(t, off + i);
      return x;
    };

    // Exact terms: full blocks whole, partial blocks through the mask.
    score.clear();
    rows_kv.clear();
    const std::size_t row = st.row(smp.b, hs, qb);
    auto attend_block = [&](int kb, bool whole) {
      for (int kv = kb * s.block.kv; kv < std::min((kb + 1) * s.block.kv, seq.seqlen_kv); ++kv)
        if (whole || !s.mask.any() || mask.visible(smp.b, smp.q, kv)) {
          rows_kv.push_back(st.kv_row(smp.b, kv, hkv));
          score.push_back(dot(st.k.view, rows_kv.back()));
        }
    };
    for (int kb : st.partial[row]) attend_block(kb, false);
    for (int kb : st.full[row]) attend_block(kb, true);

    // Proxy terms: unselected blocks the mask keeps whole for the whole Q block (SPEC §6).
    struct ProxyTerm {
      double score;  // s + ln n_j: the block's n_j tokens of mean V
      int tokens;    // n_j
      std::int64_t summary_offset;
    };
    std::vector<ProxyTerm> proxies;
    if (s.proxy == Proxy::eligible) {
      const auto& pl = st.partial[row];
      const auto& fl = st.full[row];
      for (int kb = 0; kb < seq.kv_blocks; ++kb) {
        if (std::binary_search(pl.begin(), pl.end(), kb) || std::binary_search(fl.begin(), fl.end(), kb)) continue;
        const long long area = block_area(seq, qb, kb, s.block);
        if (s.mask.any() && mask.count_block(smp.b, qb, kb, s.block) != area) continue;
        const std::int64_t off = ((static_cast<std::int64_t>(smp.b) * st.max_kv_blocks + kb) * s.heads_kv + hkv) * D;
        const int n_j = std::min(s.block.kv, seq.seqlen_kv - kb * s.block.kv);
        proxies.push_back({dot(st.k_summary.view, off) + std::log(static_cast<double>(n_j)), n_j, off});
      }
    }

    double m = neg_inf;
    for (double x : score) m = std::max(m, x);
    for (const ProxyTerm& p : proxies) m = std::max(m, p.score);
    std::fill(acc.begin(), acc.end(), 0.0);
    double l = 0.0;
    if (m != neg_inf) {
      for (std::size_t j = 0; j < score.size(); ++j) {
        const double w = std::exp(score[j] - m);
        l += w;
        for (int i = 0; i < D; ++i) acc[i] += w * element_as_float(st.v.view, rows_kv[j] + i);
      }
      for (const ProxyTerm& p : proxies) {
        const double w = std::exp(p.score - m);
        l += w;  // v_summary is the sum of V: its mean carries weight w
        for (int i = 0; i < D; ++i) acc[i] += w / p.tokens * element_as_float(st.v_summary.view, p.summary_offset + i);
      }
    }
    const double ref_lse = l > 0.0 ? m + std::log(l) : neg_inf;

    const std::int64_t o_off = q_off;  // O has Q's layout
    for (int i = 0; i < D; ++i) {
      const double ref = l > 0.0 ? acc[i] / l : 0.0;
      const double got = element_as_float(st.out.view, o_off + i);
      const double e = std::isfinite(got) ? std::abs(got - ref) : std::numeric_limits<double>::infinity();
      r.max_abs_err = std::max(r.max_abs_err, e);
      err2 += e * e;
      ref2 += ref * ref;
    }
    const std::int64_t lse_off = st.varlen() ? static_cast<std::int64_t>(smp.h) * st.total_q + seq.q_base + smp.q
                                             : (static_cast<std::int64_t>(smp.b) * s.heads_q + smp.h) * s.max_seqlen_q() + smp.q;
    const double got_lse = st.lse.as<float>()[lse_off];
    if (!(got_lse == ref_lse))  // equal infinities are exact
      r.max_lse_err = std::max(r.max_lse_err, std::isfinite(got_lse) && std::isfinite(ref_lse)
                                                  ? std::abs(got_lse - ref_lse)
                                                  : std::numeric_limits<double>::infinity());
  }
  r.rel_l2_err = ref2 > 0.0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  return r;
}

}  // namespace bsattn::tools
