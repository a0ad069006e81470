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
#include "workload_state.hpp"

namespace bsattn::tools {

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

}  // namespace bsattn::tools
