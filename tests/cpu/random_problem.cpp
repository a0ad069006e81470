#include "random_problem.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "bsattn/bsattn.hpp"
#include "bsattn/custom_mask.hpp"

namespace bsattn_test {

using bsattn::DType;
using bsattn::Format;
using bsattn::KVLayout;
using bsattn::Proxy;
using bsattn::QLayout;
using bsattn::TensorView;

namespace {

// NaN bit patterns: outputs are filled with them before a run, input padding holds them forever.
constexpr std::uint32_t kPoisonF32 = 0x7fc0deadu;
constexpr std::uint16_t kPoisonF16 = 0x7e5au;
constexpr std::uint16_t kPoisonBf16 = 0x7fdau;

int ceil_div(int a, int b) { return (a + b - 1) / b; }

TensorView view(void* data, DType dtype, const std::vector<std::int64_t>& shape,
                const std::vector<std::int64_t>& stride) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.rank = static_cast<int>(shape.size());
  for (int i = 0; i < t.rank; ++i) {
    t.shape[i] = shape[i];
    t.stride[i] = stride[i];
  }
  return t;
}

// Elements a strided view spans (its allocation size).
std::int64_t extent(const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& stride) {
  std::int64_t e = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) return 0;
    e += (shape[i] - 1) * stride[i];
  }
  return e;
}
std::int64_t extent(const TensorView& t) {
  return extent(std::vector<std::int64_t>(t.shape.begin(), t.shape.begin() + t.rank),
                std::vector<std::int64_t>(t.stride.begin(), t.stride.begin() + t.rank));
}

// Strides for `shape` with its dimensions nested in memory in `order` (outermost first; identity
// when empty: row-major), with pad[i] spare elements per step of dimension order[i].
std::vector<std::int64_t> padded_strides(const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& pad,
                                         std::vector<int> order = {}) {
  if (order.empty())
    for (int i = 0; i < static_cast<int>(shape.size()); ++i) order.push_back(i);
  std::vector<std::int64_t> stride(shape.size());
  stride[order.back()] = 1;
  for (int i = static_cast<int>(order.size()) - 2; i >= 0; --i)
    stride[order[i]] = stride[order[i + 1]] * shape[order[i + 1]] + pad[i];
  return stride;
}

void poison(void* data, DType dtype, std::int64_t count) {
  if (dtype == DType::f32) {
    std::fill_n(static_cast<std::uint32_t*>(data), count, kPoisonF32);
  } else {
    std::fill_n(static_cast<std::uint16_t*>(data), count, dtype == DType::f16 ? kPoisonF16 : kPoisonBf16);
  }
}

bool is_poison(const void* data, DType dtype, std::int64_t offset) {
  if (dtype == DType::f32) return static_cast<const std::uint32_t*>(data)[offset] == kPoisonF32;
  return static_cast<const std::uint16_t*>(data)[offset] == (dtype == DType::f16 ? kPoisonF16 : kPoisonBf16);
}

struct Draw {
  std::mt19937_64& rng;
  std::normal_distribution<double> gaussian{0, 1};  // kept: it makes values in pairs
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; }
  template <class T>
  T pick(std::initializer_list<T> options) {
    return *(options.begin() + uniform(0, static_cast<int>(options.size()) - 1));
  }
  double normal() { return gaussian(rng); }
  // Lengths skewed to small, with odd tails; `zero` allows empty sequences.
  int length(int max, bool zero) {
    if (zero && chance(0.1)) return 0;
    const double u = std::uniform_real_distribution<double>(0, 1)(rng);
    if (u < 0.35) return uniform(1, std::min(max, 40));
    if (u < 0.8) return uniform(std::min(max, 41), std::min(max, 160));
    return uniform(std::min(max, 161), max);
  }
};

const char* name(Format f) {
  switch (f) {
    case Format::all_blocks: return "all_blocks";
    case Format::block_lists: return "block_lists";
    case Format::varlen_block_lists: return "varlen_lists";
    case Format::bsr: return "bsr";
    case Format::bitmask: return "bitmask";
  }
  return "?";
}

template <class T>
std::string list(const std::vector<T>& v) {
  std::ostringstream s;
  s << "[";
  for (std::size_t i = 0; i < v.size(); ++i) s << (i ? "," : "") << v[i];
  return s.str() + "]";
}

// A 32-bit hash for the pseudo-random custom mask.
std::uint32_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<std::uint32_t>(x);
}

// The nearest value of `dtype` to x, never zero nor subnormal (test inputs must be nonzero).
double representable(DType dtype, double x) {
  const double tiny = 1.0 / 1024;  // keeps every input normal and nonzero in all three dtypes
  if (std::fabs(x) < tiny) x = x < 0 ? -tiny : tiny;
  switch (dtype) {
    case DType::f16: return half_bits_to_double(double_to_half_bits(x));
    case DType::bf16: return bf16_bits_to_double(double_to_bf16_bits(x));
    default: return static_cast<float>(x);
  }
}

// Writes `value` at element `offset` of a float tensor, rounded to its dtype.
void store_real(void* base, DType dtype, std::int64_t offset, double value) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(base)[offset] = static_cast<float>(value); break;
    case DType::f16: static_cast<std::uint16_t*>(base)[offset] = double_to_half_bits(value); break;
    case DType::bf16: static_cast<std::uint16_t*>(base)[offset] = double_to_bf16_bits(value); break;
    default: break;
  }
}

}  // namespace

int RandomCase::q_blocks(int b) const { return ceil_div(seqlen_q[b], problem.block.q); }
int RandomCase::kv_blocks(int b) const { return ceil_div(seqlen_kv[b], problem.block.kv); }

std::int64_t RandomCase::kv_offset(const TensorView& t, int b, int kv, int hkv) const {
  if (problem.kv_layout == KVLayout::paged) {
    const std::int32_t* table = static_cast<const std::int32_t*>(inputs.block_table.data);
    const std::int64_t page = table[b * inputs.block_table.stride[0] + kv / problem.page_size];
    return page * t.stride[0] + (kv % problem.page_size) * t.stride[1] + hkv * t.stride[2];
  }
  if (problem.q_layout == QLayout::varlen) {
    const std::int32_t* cu = static_cast<const std::int32_t*>(inputs.cu_seqlens_k.data);
    return (cu[b] + kv) * t.stride[0] + hkv * t.stride[1];
  }
  return b * t.stride[0] + kv * t.stride[1] + hkv * t.stride[2];
}

std::string RandomCase::describe() const {
  const bsattn::Problem& p = problem;
  std::ostringstream s;
  s << "seed=" << seed << " " << (p.q_layout == QLayout::varlen ? "varlen" : "batched");
  if (p.kv_layout == KVLayout::paged) s << "/paged(ps=" << p.page_size << ",C=" << p.pages_per_seq << ")";
  s << " B=" << p.batch << " Sq=" << list(seqlen_q) << " Skv=" << list(seqlen_kv) << " H=" << p.heads_q << "/"
    << p.heads_kv << " D=" << p.head_dim << " " << bsattn::to_string(p.dtype) << "->"
    << bsattn::to_string(p.out_dtype) << " block=" << p.block.q << "x" << p.block.kv;
  if (p.tile_m || p.tile_n) s << " tile=" << p.tile_m << "x" << p.tile_n;
  s << " " << name(p.format);
  if (p.format != Format::all_blocks)
    s << "(Hs=" << p.sparsity_heads << ",Bs=" << p.sparsity_batch << "," << (p.has_partial ? "P" : "")
      << (p.has_full ? "F" : "") << ")";
  const bsattn::MaskSpec& m = p.mask;
  s << " mask=";
  if (!m.any() && m.sink_tokens == 0) s << "none";
  if (m.causal) s << (m.alignment == bsattn::Alignment::top_left ? "causal-tl," : "causal-br,");
  if (!m.causal && (m.window_left >= 0 || m.window_right >= 0))
    s << (m.alignment == bsattn::Alignment::top_left ? "tl," : "br,");
  if (m.window_left >= 0 || m.window_right >= 0) s << "win(" << m.window_left << "," << m.window_right << "),";
  if (m.sink_tokens) s << "sink" << m.sink_tokens << ",";
  if (m.document_ids) s << "doc,";
  if (m.kv_valid_bits) s << "valid,";
  if (custom_mask) s << " custom=" << custom_mask_name;
  if (p.proxy != Proxy::off) s << " proxy=" << (p.proxy == Proxy::eligible ? "eligible" : "explicit");
  if (p.scale != 0.0f) s << " scale=" << p.scale;
  if (one_shot) s << (custom_mask ? " attention_with_mask" : " one-shot");
  else s << (custom_mask ? " run_with_mask" : " plan.run") << "(validate=false)";
  return s.str();
}

void RandomCase::encode(Format format, bool padding_bits) {
  Draw draw{rng};
  problem.format = format;
  const bool varlen = problem.q_layout == QLayout::varlen;
  const bool batch_dim = format == Format::block_lists || (!varlen && format != Format::varlen_block_lists);
  problem.sparsity_batch = batch_dim ? pattern.batch : 1;
  inputs.partial = inputs.full = inputs.proxy = bsattn::BlockSet{};
  inputs.cu_total_m_blocks = inputs.cu_block_idx_offsets = TensorView{};
  if (format == Format::all_blocks) return;

  const int B = problem.batch, Hs = pattern.heads, nqb_max = pattern.q_blocks;
  const int nkb_max = ceil_div(problem.max_seqlen_kv, problem.block.kv);
  std::vector<int> cu_m(B + 1, 0), cu_idx(B + 1, 0);
  for (int b = 0; b < B; ++b) {
    cu_m[b + 1] = cu_m[b] + q_blocks(b);
    cu_idx[b + 1] = cu_idx[b] + q_blocks(b) * kv_blocks(b);
  }

  // The rows in the format's order, each with the sequences that read it.
  struct Row {
    int b, hs, qb;  // b: the pattern's batch index (bs for batch_dim formats)
    int lo_kv_blocks = 0x7fffffff, hi_kv_blocks = 0;  // min / max nKB over its readers
  };
  std::vector<Row> rows;
  if (batch_dim) {
    for (int bs = 0; bs < problem.sparsity_batch; ++bs)
      for (int hs = 0; hs < Hs; ++hs)
        for (int qb = 0; qb < nqb_max; ++qb) {
          Row r{bs, hs, qb};
          for (int b = 0; b < B; ++b)
            if ((problem.sparsity_batch == 1 || b == bs) && qb < q_blocks(b)) {
              r.lo_kv_blocks = std::min(r.lo_kv_blocks, kv_blocks(b));
              r.hi_kv_blocks = std::max(r.hi_kv_blocks, kv_blocks(b));
            }
          rows.push_back(r);
        }
  } else {
    for (int hs = 0; hs < Hs; ++hs)
      for (int b = 0; b < B; ++b)
        for (int qb = 0; qb < q_blocks(b); ++qb) rows.push_back(Row{b, hs, qb, kv_blocks(b), kv_blocks(b)});
  }
  // Lists carry only blocks every reader has; a bitmask keeps the rest (bits >= nKB are ignored).
  const auto content = [&](const std::vector<std::vector<int>>& sets, const Row& r) {
    std::vector<int> out;
    if (r.hi_kv_blocks == 0) return out;  // nobody reads this row
    const int limit = format == Format::bitmask ? r.hi_kv_blocks : r.lo_kv_blocks;
    for (int kb : sets[pattern.row(r.b, r.hs, r.qb)])
      if (kb < limit) out.push_back(kb);
    return out;
  };
  const auto garbage_index = [&] { return draw.pick<std::int32_t>({-1, -7, nkb_max, 1 << 28, 0, 3}); };

  const auto encode_set = [&](const std::vector<std::vector<int>>& sets) {
    bsattn::BlockSet set;
    std::vector<std::vector<int>> lists;
    std::size_t longest = 0;
    for (const Row& r : rows) {
      lists.push_back(content(sets, r));
      longest = std::max(longest, lists.back().size());
    }
    switch (format) {
      case Format::block_lists: {
        const int Bs = problem.sparsity_batch;
        const int L = std::max(1, std::min(nkb_max, static_cast<int>(longest) + draw.uniform(0, 2)));
        const std::int64_t row_stride = L + draw.pick({0, 3});
        const std::int64_t count_stride = nqb_max + draw.pick({0, 2});  // padding holds garbage
        std::int32_t* counts = allocate<std::int32_t>(static_cast<std::int64_t>(Bs) * Hs * count_stride);
        std::int32_t* indices = allocate<std::int32_t>(static_cast<std::int64_t>(Bs) * Hs * nqb_max * row_stride);
        std::fill_n(counts, static_cast<std::int64_t>(Bs) * Hs * count_stride, 1 << 20);
        for (std::size_t i = 0; i < rows.size(); ++i) {
          counts[(i / nqb_max) * count_stride + i % nqb_max] = static_cast<std::int32_t>(lists[i].size());
          for (std::int64_t j = 0; j < row_stride; ++j)
            indices[i * row_stride + j] = j < static_cast<std::int64_t>(lists[i].size()) ? lists[i][j] : garbage_index();
        }
        set.counts = view(counts, DType::i32, {Bs, Hs, nqb_max}, {Hs * count_stride, count_stride, 1});
        set.indices = view(indices, DType::i32, {Bs, Hs, nqb_max, L},
                           {static_cast<std::int64_t>(Hs) * nqb_max * row_stride, nqb_max * row_stride, row_stride, 1});
        break;
      }
      case Format::varlen_block_lists: {
        std::int32_t* counts = allocate<std::int32_t>(static_cast<std::int64_t>(Hs) * cu_m[B]);
        std::int32_t* indices = allocate<std::int32_t>(static_cast<std::int64_t>(Hs) * cu_idx[B]);
        for (std::int64_t i = 0; i < static_cast<std::int64_t>(Hs) * cu_idx[B]; ++i) indices[i] = garbage_index();
        for (std::size_t i = 0; i < rows.size(); ++i) {
          const Row& r = rows[i];
          counts[static_cast<std::int64_t>(r.hs) * cu_m[B] + cu_m[r.b] + r.qb] = static_cast<std::int32_t>(lists[i].size());
          const std::int64_t base = static_cast<std::int64_t>(r.hs) * cu_idx[B] + cu_idx[r.b] +
                                    static_cast<std::int64_t>(r.qb) * kv_blocks(r.b);
          for (std::size_t j = 0; j < lists[i].size(); ++j) indices[base + j] = lists[i][j];
        }
        set.counts = view(counts, DType::i32, {Hs, cu_m[B]}, {cu_m[B], 1});
        set.indices = view(indices, DType::i32, {Hs, cu_idx[B]}, {cu_idx[B], 1});
        break;
      }
      case Format::bsr: {
        std::int32_t* indptr = allocate<std::int32_t>(static_cast<std::int64_t>(rows.size()) + 1);
        indptr[0] = 0;
        for (std::size_t i = 0; i < rows.size(); ++i) indptr[i + 1] = indptr[i] + static_cast<std::int32_t>(lists[i].size());
        std::int32_t* indices = allocate<std::int32_t>(indptr[rows.size()]);
        for (std::size_t i = 0; i < rows.size(); ++i) std::copy(lists[i].begin(), lists[i].end(), indices + indptr[i]);
        set.indptr = view(indptr, DType::i32, {static_cast<std::int64_t>(rows.size()) + 1}, {1});
        set.indices = view(indices, DType::i32, {indptr[rows.size()]}, {1});
        break;
      }
      case Format::bitmask: {
        const int W = std::max(1, ceil_div(nkb_max, 32)) + draw.pick({0, 0, 1});  // spare words are padding
        std::uint32_t* words = allocate<std::uint32_t>(static_cast<std::int64_t>(rows.size()) * W);
        for (std::size_t i = 0; i < rows.size(); ++i) {
          std::uint32_t* w = words + i * W;
          std::fill(w, w + W, 0u);
          for (int kb : lists[i]) w[kb / 32] |= 1u << (kb % 32);
          if (padding_bits)
            for (int bit = rows[i].hi_kv_blocks; bit < 32 * W; ++bit)
              if (draw.chance(0.4)) w[bit / 32] |= 1u << (bit % 32);
        }
        if (batch_dim) {
          const std::int64_t Bs = problem.sparsity_batch;
          set.bits = view(words, DType::u32, {Bs, Hs, nqb_max, W},
                          {static_cast<std::int64_t>(Hs) * nqb_max * W, static_cast<std::int64_t>(nqb_max) * W, W, 1});
        } else {
          set.bits = view(words, DType::u32, {Hs, cu_m[B], W}, {static_cast<std::int64_t>(cu_m[B]) * W, W, 1});
        }
        break;
      }
      case Format::all_blocks: break;
    }
    return set;
  };

  if (problem.has_partial) inputs.partial = encode_set(pattern.partial);
  if (problem.has_full) inputs.full = encode_set(pattern.full);
  if (problem.proxy == Proxy::explicit_set) inputs.proxy = encode_set(pattern.proxy);
  // Varlen row offsets (SPEC §3.2): given half of the time, derived by the library otherwise.
  // Rows enumerated per sequence read cu_total_m_blocks; varlen lists also cu_block_idx_offsets.
  if (!batch_dim && draw.chance(0.5)) {
    std::int32_t* m = allocate<std::int32_t>(B + 1);
    std::copy(cu_m.begin(), cu_m.end(), m);
    inputs.cu_total_m_blocks = view(m, DType::i32, {B + 1}, {1});
    if (format == Format::varlen_block_lists) {
      std::int32_t* idx = allocate<std::int32_t>(B + 1);
      std::copy(cu_idx.begin(), cu_idx.end(), idx);
      inputs.cu_block_idx_offsets = view(idx, DType::i32, {B + 1}, {1});
    }
  }
}

void RandomCase::write_summaries() {
  const int B = problem.batch, Hkv = problem.heads_kv, D = problem.head_dim;
  const int nkb_max = ceil_div(problem.max_seqlen_kv, problem.block.kv);
  const std::vector<std::int64_t> shape{B, nkb_max, Hkv, D};
  const std::vector<std::int64_t> stride = padded_strides(shape, {0, 0, 8, 0});
  const std::int64_t n = extent(shape, stride);
  void* ks = allocate<std::uint32_t>(n);
  void* vs = allocate<std::uint32_t>(n);
  poison(ks, problem.dtype, n);  // blocks past a sequence's end must never be read
  poison(vs, problem.dtype, n);
  inputs.k_summary = view(ks, problem.dtype, shape, stride);
  inputs.v_summary = view(vs, problem.dtype, shape, stride);
  const Oracle oracle(problem, inputs);
  std::vector<double> mean_k(D), sum_v(D);
  for (int b = 0; b < B; ++b)
    for (int kb = 0; kb < kv_blocks(b); ++kb)
      for (int h = 0; h < Hkv; ++h) {
        oracle.reference_summary(b, kb, h, mean_k.data(), sum_v.data());
        for (int d = 0; d < D; ++d) {
          const std::int64_t o = b * stride[0] + kb * stride[1] + h * stride[2] + d;
          store_real(ks, problem.dtype, o, mean_k[d]);
          store_real(vs, problem.dtype, o, sum_v[d]);
        }
      }
}

void RandomCase::poison_outputs() {
  poison(outputs.out.data, outputs.out.dtype, extent(outputs.out));
  if (outputs.lse.defined()) poison(outputs.lse.data, DType::f32, extent(outputs.lse));
}

std::string RandomCase::check_padding_untouched() const {
  const bool varlen = problem.q_layout == QLayout::varlen;
  std::string report;
  const auto check = [&](const TensorView& t, const char* what, auto&& for_each_logical) {
    std::vector<std::uint8_t> logical(static_cast<std::size_t>(extent(t)), 0);
    for_each_logical([&](std::int64_t offset) { logical[offset] = 1; });
    std::int64_t touched = 0;
    for (std::size_t i = 0; i < logical.size(); ++i)
      if (!logical[i] && !is_poison(t.data, t.dtype, static_cast<std::int64_t>(i))) ++touched;
    if (touched) report += std::string(what) + ": " + std::to_string(touched) + " elements outside the tensor written\n";
  };
  const TensorView& o = outputs.out;
  check(o, "O", [&](auto&& mark) {
    for (int b = 0; b < problem.batch; ++b)
      for (int q = 0; q < seqlen_q[b]; ++q)
        for (int h = 0; h < problem.heads_q; ++h)
          for (int d = 0; d < problem.head_dim; ++d) {
            const std::int32_t* cu = static_cast<const std::int32_t*>(inputs.cu_seqlens_q.data);
            mark(varlen ? (cu[b] + q) * o.stride[0] + h * o.stride[1] + d
                        : b * o.stride[0] + q * o.stride[1] + h * o.stride[2] + d);
          }
  });
  if (outputs.lse.defined()) {
    const TensorView& l = outputs.lse;
    check(l, "LSE", [&](auto&& mark) {
      for (int b = 0; b < problem.batch; ++b)
        for (int q = 0; q < seqlen_q[b]; ++q)
          for (int h = 0; h < problem.heads_q; ++h) {
            const std::int32_t* cu = static_cast<const std::int32_t*>(inputs.cu_seqlens_q.data);
            mark(varlen ? h * l.stride[0] + (cu[b] + q) * l.stride[1] : b * l.stride[0] + h * l.stride[1] + q * l.stride[2]);
          }
    });
  }
  return report;
}

std::vector<std::uint8_t> RandomCase::output_bytes() const {
  std::vector<std::uint8_t> bytes;
  for (const TensorView* t : {&outputs.out, &outputs.lse}) {
    if (!t->defined()) continue;
    const std::uint8_t* data = static_cast<const std::uint8_t*>(t->data);
    bytes.insert(bytes.end(), data, data + extent(*t) * bsattn::element_size(t->dtype));
  }
  return bytes;
}

void RandomCase::run_library() {
  poison_outputs();
  if (one_shot) {
    if (custom_mask) bsattn::attention_with_mask(problem, inputs, outputs, custom_mask);
    else bsattn::attention(problem, inputs, outputs);
    return;
  }
  bsattn::Problem trusted = problem;
  trusted.validate = false;
  bsattn::Plan plan(trusted);
  if (custom_mask) bsattn::run_with_mask(plan, inputs, outputs, custom_mask);
  else plan.run(inputs, outputs);
}

std::unique_ptr<RandomCase> make_random_case(std::uint64_t seed, const CaseOptions& options) {
  auto owned = std::make_unique<RandomCase>();
  RandomCase& c = *owned;
  c.seed = seed;
  c.rng.seed(seed * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL);
  Draw draw{c.rng};
  bsattn::Problem& p = c.problem;
  p.num_threads = 2;

  // ---- Layout, dtypes, heads -----------------------------------------------------------------
  const bool varlen = options.varlen.value_or(draw.chance(0.4));
  const bool paged = options.paged.value_or(draw.chance(0.35));
  p.q_layout = varlen ? QLayout::varlen : QLayout::batched;
  p.kv_layout = paged ? KVLayout::paged : KVLayout::contiguous;
  p.dtype = draw.pick({DType::f32, DType::f16, DType::bf16});
  p.out_dtype = draw.chance(0.5) ? DType::f32 : p.dtype;
  p.head_dim = draw.pick({64, 64, 64, 128, 128, 256, 8, 8, 40, 40});
  p.heads_kv = draw.pick({1, 1, 2, 2, 4});
  p.heads_q = p.heads_kv * draw.pick({1, 2, 4});
  while (p.heads_q > 8) p.heads_q /= 2;
  if (draw.chance(0.15)) p.scale = 0.3f;

  // ---- Block and tile sizes (both fitting paths of SPEC §5) ----------------------------------
  p.block.q = draw.pick({16, 32, 64, 64, 128, 128, 192, 256});
  p.block.kv = draw.pick({16, 32, 48, 64, 64, 128, 128, 256});
  if (draw.chance(0.45)) {
    std::vector<int> tm, tn;
    for (int t : {16, 32, 64, 128})
      if (p.block.q % t == 0 || (t % p.block.q == 0 && t / p.block.q <= 8)) tm.push_back(t);
    for (int t = 16; t <= std::min(128, p.block.kv); t += 16)
      if (p.block.kv % t == 0) tn.push_back(t);
    p.tile_m = tm[draw.uniform(0, static_cast<int>(tm.size()) - 1)];
    p.tile_n = tn[draw.uniform(0, static_cast<int>(tn.size()) - 1)];
  }

  // ---- Sequence lengths, kept small enough for hundreds of cases a minute --------------------
  p.batch = varlen ? draw.uniform(1, 4) : draw.uniform(1, 3);
  const int max_len = std::min(options.max_seqlen, p.head_dim >= 256 ? 160 : 300);
  const bool per_batch_kv = varlen || paged;
  c.seqlen_q.assign(p.batch, 0);
  c.seqlen_kv.assign(p.batch, 0);
  for (int b = 0; b < p.batch; ++b) {
    c.seqlen_q[b] = varlen || b == 0 ? draw.length(max_len, varlen) : c.seqlen_q[0];
    c.seqlen_kv[b] = per_batch_kv || b == 0 ? draw.length(max_len, per_batch_kv) : c.seqlen_kv[0];
  }
  // The validator wants at least one token in packed Q and packed K/V.
  if (varlen && *std::max_element(c.seqlen_q.begin(), c.seqlen_q.end()) == 0) c.seqlen_q[0] = draw.length(max_len, false);
  if (per_batch_kv && *std::max_element(c.seqlen_kv.begin(), c.seqlen_kv.end()) == 0)
    c.seqlen_kv[0] = draw.length(max_len, false);
  // Cost guard: the float64 oracle is the slow side.
  for (;;) {
    double cost = 0;
    for (int b = 0; b < p.batch; ++b) cost += double(c.seqlen_q[b]) * c.seqlen_kv[b];
    if (cost * p.heads_q * p.head_dim <= 2.5e7) break;
    for (int b = 0; b < p.batch; ++b) {
      c.seqlen_q[b] = (c.seqlen_q[b] + 1) / 2;
      c.seqlen_kv[b] = (c.seqlen_kv[b] + 1) / 2;
    }
  }
  // Varlen KV with seqused_k: the packed sequences are longer than the used lengths.
  const bool seqused = varlen && !paged && draw.chance(0.4);
  std::vector<int> packed_kv = c.seqlen_kv;
  if (seqused)
    for (int& n : packed_kv) n += draw.uniform(0, 5);
  const int longest_q = *std::max_element(c.seqlen_q.begin(), c.seqlen_q.end());
  const int longest_kv = *std::max_element(packed_kv.begin(), packed_kv.end());
  // Upper bounds may exceed every length (varlen, paged); batched Q / contiguous KV are exact.
  p.max_seqlen_q = std::max(1, longest_q + (varlen && draw.chance(0.3) ? draw.uniform(1, 20) : 0));
  p.max_seqlen_kv = std::max(1, longest_kv + (per_batch_kv && draw.chance(0.3) ? draw.uniform(1, 20) : 0));
  if (!varlen) std::fill(c.seqlen_q.begin(), c.seqlen_q.end(), p.max_seqlen_q);
  if (!per_batch_kv) std::fill(c.seqlen_kv.begin(), c.seqlen_kv.end(), p.max_seqlen_kv);

  const int B = p.batch, Hq = p.heads_q, Hkv = p.heads_kv, D = p.head_dim;
  bsattn::Inputs& in = c.inputs;
  // A contiguous int32 tensor: rank 1, or [rows, size / rows].
  const auto int_tensor = [&](const std::vector<std::int32_t>& values, std::int64_t rows = 0) {
    std::int32_t* data = c.allocate<std::int32_t>(static_cast<std::int64_t>(values.size()));
    std::copy(values.begin(), values.end(), data);
    const std::int64_t n = static_cast<std::int64_t>(values.size());
    return rows ? view(data, DType::i32, {rows, n / rows}, {n / rows, 1}) : view(data, DType::i32, {n}, {1});
  };
  std::vector<std::int32_t> cu_q(B + 1, 0), cu_k(B + 1, 0);
  for (int b = 0; b < B; ++b) cu_q[b + 1] = cu_q[b] + c.seqlen_q[b];
  if (varlen) {
    in.cu_seqlens_q = int_tensor(cu_q);
    p.total_q = cu_q[B];
  }
  // A float tensor whose padding holds NaN; the caller fills the live elements.
  const auto float_tensor = [&](DType dtype, const std::vector<std::int64_t>& shape,
                                const std::vector<std::int64_t>& stride) {
    const std::int64_t n = extent(shape, stride);
    void* data = c.allocate<std::uint32_t>(n);
    poison(data, dtype, n);
    return view(data, dtype, shape, stride);
  };
  const auto pad = [&] { return static_cast<std::int64_t>(draw.pick({0, 0, 8, 16})); };
  // Q/K/V/O strides: padded, and head-major (heads outside tokens) a third of the time.
  const auto token_head_strides = [&](const std::vector<std::int64_t>& shape) {
    const int token = static_cast<int>(shape.size()) - 3;  // [B,] tokens, heads, D
    std::vector<int> order{token, token + 1, token + 2};
    if (draw.chance(0.33)) std::swap(order[0], order[1]);
    if (token == 1) order.insert(order.begin(), 0);
    std::vector<std::int64_t> pads;
    for (std::size_t i = 0; i + 1 < shape.size(); ++i) pads.push_back(pad());
    return padded_strides(shape, pads, order);
  };

  // ---- Q, K, V --------------------------------------------------------------------------------
  in.q = varlen ? float_tensor(p.dtype, {p.total_q, Hq, D}, token_head_strides({p.total_q, Hq, D}))
                : float_tensor(p.dtype, {B, p.max_seqlen_q, Hq, D}, token_head_strides({B, p.max_seqlen_q, Hq, D}));
  for (int b = 0; b < B; ++b)
    for (int q = 0; q < c.seqlen_q[b]; ++q)
      for (int h = 0; h < Hq; ++h)
        for (int d = 0; d < D; ++d) {
          const std::int64_t o = varlen ? (cu_q[b] + q) * in.q.stride[0] + h * in.q.stride[1] + d
                                        : b * in.q.stride[0] + q * in.q.stride[1] + h * in.q.stride[2] + d;
          store_real(in.q.data, p.dtype, o, representable(p.dtype, draw.normal()));
        }

  if (paged) {
    p.page_size = draw.pick({7, 16, 16, 24, 64, 100});
    p.pages_per_seq = ceil_div(p.max_seqlen_kv, p.page_size) + draw.uniform(0, 2);
    std::vector<int> live(B);
    int pages = 0;
    for (int b = 0; b < B; ++b) pages += live[b] = ceil_div(c.seqlen_kv[b], p.page_size);
    p.num_pages = pages + draw.uniform(pages == 0 ? 1 : 0, 3);
    std::vector<std::int32_t> ids(p.num_pages);
    for (int i = 0; i < p.num_pages; ++i) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), c.rng);  // scattered pages
    const int row_stride = p.pages_per_seq + draw.pick({0, 0, 3, 5});
    std::int32_t* table = c.allocate<std::int32_t>(static_cast<std::int64_t>(B) * row_stride);
    int next = 0;
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < row_stride; ++j)  // unread entries and row padding hold garbage
        table[b * row_stride + j] = j < live[b] ? ids[next++] : draw.pick<std::int32_t>({-1, 1 << 30, p.num_pages});
    in.block_table = view(table, DType::i32, {B, p.pages_per_seq}, {row_stride, 1});
    in.seq_lens_kv = int_tensor(std::vector<std::int32_t>(c.seqlen_kv.begin(), c.seqlen_kv.end()));
    const std::vector<std::int64_t> shape{p.num_pages, p.page_size, Hkv, D};
    for (TensorView* t : {&in.k, &in.v}) {
      *t = float_tensor(p.dtype, shape, token_head_strides(shape));  // head-major caches too
    }
  } else if (varlen) {
    for (int b = 0; b < B; ++b) cu_k[b + 1] = cu_k[b] + packed_kv[b];
    in.cu_seqlens_k = int_tensor(cu_k);
    if (seqused) in.seqused_k = int_tensor(std::vector<std::int32_t>(c.seqlen_kv.begin(), c.seqlen_kv.end()));
    p.total_kv = cu_k[B];
    for (TensorView* t : {&in.k, &in.v})
      *t = float_tensor(p.dtype, {p.total_kv, Hkv, D}, token_head_strides({p.total_kv, Hkv, D}));
  } else {
    for (TensorView* t : {&in.k, &in.v})
      *t = float_tensor(p.dtype, {B, p.max_seqlen_kv, Hkv, D}, token_head_strides({B, p.max_seqlen_kv, Hkv, D}));
  }
  for (int b = 0; b < B; ++b)
    for (int kv = 0; kv < c.seqlen_kv[b]; ++kv)
      for (int h = 0; h < Hkv; ++h)
        for (int d = 0; d < D; ++d) {
          store_real(in.k.data, p.dtype, c.kv_offset(in.k, b, kv, h) + d, representable(p.dtype, draw.normal()));
          store_real(in.v.data, p.dtype, c.kv_offset(in.v, b, kv, h) + d, representable(p.dtype, draw.normal()));
        }

  // ---- Outputs ------------------------------------------------------------------------------
  bsattn::Outputs& out = c.outputs;
  if (varlen) {
    out.out = float_tensor(p.out_dtype, {p.total_q, Hq, D}, token_head_strides({p.total_q, Hq, D}));
    if (draw.chance(0.85))
      out.lse = float_tensor(DType::f32, {Hq, p.total_q}, padded_strides({Hq, p.total_q}, {pad()}));
  } else {
    out.out = float_tensor(p.out_dtype, {B, p.max_seqlen_q, Hq, D}, token_head_strides({B, p.max_seqlen_q, Hq, D}));
    if (draw.chance(0.85))
      out.lse = float_tensor(DType::f32, {B, Hq, p.max_seqlen_q}, padded_strides({B, Hq, p.max_seqlen_q}, {pad(), pad()}));
  }

  // ---- Token mask (SPEC §4) -----------------------------------------------------------------
  bsattn::MaskSpec& m = p.mask;
  if (options.builtin_mask.value_or(draw.chance(0.75))) {
    do {
      m.causal = draw.chance(0.5);
      m.alignment = draw.chance(0.5) ? bsattn::Alignment::bottom_right : bsattn::Alignment::top_left;
      if (draw.chance(0.35)) {
        m.window_left = draw.chance(0.8) ? draw.uniform(0, 96) : -1;
        m.window_right = draw.chance(0.6) ? draw.uniform(0, 64) : -1;
      }
      if (draw.chance(0.3)) m.sink_tokens = draw.uniform(1, 24);
      m.document_ids = draw.chance(0.2);
      m.kv_valid_bits = draw.chance(0.2);
    } while (!m.any());
  }
  if (m.document_ids) {
    // Packed documents: ids rise along each sequence (cut points independent in Q and KV), or
    // are scattered at random.
    const auto doc_ids = [&](int length) {
      std::vector<std::int32_t> ids(length);
      const bool scattered = draw.chance(0.25);
      const int docs = draw.uniform(1, 4);
      std::vector<int> cuts;
      for (int i = 1; i < docs; ++i) cuts.push_back(draw.uniform(0, std::max(0, length)));
      std::sort(cuts.begin(), cuts.end());
      for (int t = 0; t < length; ++t)
        ids[t] = scattered ? draw.uniform(0, 2)
                           : static_cast<std::int32_t>(std::upper_bound(cuts.begin(), cuts.end(), t) - cuts.begin());
      return ids;
    };
    if (varlen) {
      std::vector<std::int32_t> all(p.total_q, -5);
      for (int b = 0; b < B; ++b) {
        const std::vector<std::int32_t> ids = doc_ids(c.seqlen_q[b]);
        std::copy(ids.begin(), ids.end(), all.begin() + cu_q[b]);
      }
      in.doc_q = int_tensor(all);
    } else {
      std::vector<std::int32_t> all;
      for (int b = 0; b < B; ++b) {
        const std::vector<std::int32_t> ids = doc_ids(p.max_seqlen_q);
        all.insert(all.end(), ids.begin(), ids.end());
      }
      in.doc_q = int_tensor(all, B);
    }
    if (varlen && !paged) {
      std::vector<std::int32_t> all(p.total_kv, -5);
      for (int b = 0; b < B; ++b) {
        const std::vector<std::int32_t> ids = doc_ids(c.seqlen_kv[b]);
        std::copy(ids.begin(), ids.end(), all.begin() + cu_k[b]);
      }
      in.doc_kv = int_tensor(all);
    } else {
      const int width = paged ? p.pages_per_seq * p.page_size : p.max_seqlen_kv;
      std::vector<std::int32_t> all;
      for (int b = 0; b < B; ++b) {
        std::vector<std::int32_t> ids = doc_ids(c.seqlen_kv[b]);
        ids.resize(width, -5);
        all.insert(all.end(), ids.begin(), ids.end());
      }
      in.doc_kv = int_tensor(all, B);
    }
  }
  if (m.kv_valid_bits) {
    const int W = ceil_div(p.max_seqlen_kv, 32);
    std::uint32_t* words = c.allocate<std::uint32_t>(static_cast<std::int64_t>(B) * W);
    for (int i = 0; i < B * W; ++i) {
      std::uint32_t w = 0;
      const double density = draw.pick({0.0, 0.7, 0.9, 1.0});
      for (int bit = 0; bit < 32; ++bit) w |= (draw.chance(density) ? 1u : 0u) << bit;
      words[i] = w;
    }
    in.kv_valid = view(words, DType::u32, {B, W}, {W, 1});
  }

  // ---- Sparsity (SPEC §3) -------------------------------------------------------------------
  Format format = options.format.value_or(
      draw.pick({Format::all_blocks, Format::block_lists, Format::block_lists, Format::varlen_block_lists,
                 Format::varlen_block_lists, Format::bsr, Format::bsr, Format::bitmask, Format::bitmask}));
  if (format == Format::varlen_block_lists && !varlen) format = Format::block_lists;
  p.sparsity_heads = draw.pick({1, Hkv, Hq});
  const int selection_kinds = draw.uniform(0, 4);  // 0-1: partial, 2: full, 3-4: both
  p.has_partial = options.has_partial.value_or(selection_kinds != 2);
  p.has_full = options.has_full.value_or(selection_kinds >= 2);
  SparsityPattern& pat = c.pattern;
  pat.batch = B > 1 && draw.chance(0.5) ? B : 1;
  pat.heads = format == Format::all_blocks ? 1 : p.sparsity_heads;
  pat.q_blocks = ceil_div(p.max_seqlen_q, p.block.q);
  const std::size_t pattern_rows = static_cast<std::size_t>(pat.batch) * pat.heads * pat.q_blocks;
  pat.partial.assign(pattern_rows, {});
  pat.full.assign(pattern_rows, {});
  pat.proxy.assign(pattern_rows, {});
  const double density = draw.pick({0.15, 0.5, 0.9});
  int shared_lo = 0x7fffffff, shared_hi = 0;
  for (int b = 0; b < B; ++b)
    if (c.seqlen_q[b] > 0) {
      shared_lo = std::min(shared_lo, c.kv_blocks(b));
      shared_hi = std::max(shared_hi, c.kv_blocks(b));
    }
  shared_lo = std::min(shared_lo, shared_hi);  // no sequence with rows: nothing to select
  for (int b = 0; b < pat.batch; ++b)
    for (int hs = 0; hs < pat.heads; ++hs)
      for (int qb = 0; qb < pat.q_blocks; ++qb) {
        // A shared row must be valid for every sequence; a bitmask may name blocks some lack.
        const int limit = pat.batch > 1 ? c.kv_blocks(b) : format == Format::bitmask ? shared_hi : shared_lo;
        const double row_density = draw.chance(0.1) ? 0.0 : draw.chance(0.1) ? 1.0 : density;
        const std::size_t r = pat.row(b, hs, qb);
        for (int kb = 0; kb < limit; ++kb) {
          if (draw.chance(row_density)) {
            const bool full = p.has_full && (!p.has_partial || draw.chance(0.4));
            (full ? pat.full : pat.partial)[r].push_back(kb);
            if (draw.chance(0.3)) pat.proxy[r].push_back(kb);  // selected: must not count twice
          } else if (draw.chance(0.5)) {
            pat.proxy[r].push_back(kb);
          }
        }
      }
  if (format == Format::all_blocks) {
    p.has_partial = true;
    p.has_full = false;
  }

  // ---- Proxy (SPEC §6) ----------------------------------------------------------------------
  p.proxy = options.proxy.value_or(draw.pick({Proxy::off, Proxy::off, Proxy::eligible, Proxy::explicit_set}));
  if (format == Format::all_blocks) p.proxy = Proxy::off;  // every block is exact: nothing to proxy
  c.encode(format);
  if (p.proxy != Proxy::off) c.write_summaries();

  // ---- Custom mask functor (SPEC §4) --------------------------------------------------------
  if (options.custom_mask.value_or(draw.chance(0.15))) {
    const std::uint64_t salt = seed;
    switch (draw.uniform(0, 2)) {
      case 0:
        c.custom_mask_name = "hash70";
        c.custom_mask = [salt](int b, int h, int q, int kv) {
          return mix(salt ^ (std::uint64_t(b) << 48) ^ (std::uint64_t(h) << 40) ^ (std::uint64_t(q) << 20) ^ kv) % 10 < 7;
        };
        break;
      case 1:
        c.custom_mask_name = "stripes";
        c.custom_mask = [](int, int h, int q, int kv) { return (q + kv + h) % 4 != 0; };
        break;
      default:
        c.custom_mask_name = "prefix-lm";
        c.custom_mask = [](int, int, int q, int kv) { return kv < 20 || kv <= q + 10; };
        break;
    }
  }
  c.one_shot = draw.chance(0.5);
  return owned;
}

std::string check_against_oracle(RandomCase& c) {
  try {
    c.run_library();
  } catch (const std::exception& e) {
    return c.describe() + "\n  library threw: " + e.what() + "\n";
  }
  const Oracle oracle(c.problem, c.inputs, c.custom_mask);
  const std::string mismatches =
      compare_outputs(c.problem, oracle, oracle.compute(), c.outputs, tolerance_for(c.problem.out_dtype));
  const std::string padding = c.check_padding_untouched();
  if (mismatches.empty() && padding.empty()) return "";
  return c.describe() + "\n" + mismatches + padding;
}

}  // namespace bsattn_test
