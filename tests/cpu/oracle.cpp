#include "oracle.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace bsattn_test {

using bsattn::DType;
using bsattn::Format;
using bsattn::KVLayout;
using bsattn::QLayout;
using bsattn::TensorView;

double half_bits_to_double(std::uint16_t bits) {
  const int sign = bits >> 15, exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  double magnitude;
  if (exponent == 0) magnitude = std::ldexp(mantissa, -24);
  else if (exponent == 31) magnitude = mantissa ? std::numeric_limits<double>::quiet_NaN() : HUGE_VAL;
  else magnitude = std::ldexp(1024 + mantissa, exponent - 25);
  return sign ? -magnitude : magnitude;
}

double bf16_bits_to_double(std::uint16_t bits) {
  const std::uint32_t widened = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &widened, sizeof f);
  return f;
}

std::uint16_t double_to_half_bits(double x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  if (a < std::ldexp(1.0, -14)) {  // subnormal: units of 2^-24 (1024 units carries into the exponent)
    return sign | static_cast<std::uint16_t>(std::lround(std::ldexp(a, 24)));
  }
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  long significand = std::lround(std::ldexp(a, 11 - e));  // 11 significant bits
  if (significand == 2048) {
    significand = 1024;
    ++e;
  }
  if (e - 1 + 15 >= 31) throw std::range_error("double_to_half_bits: overflow");
  return sign | static_cast<std::uint16_t>(((e - 1 + 15) << 10) | (significand - 1024));
}

std::uint16_t double_to_bf16_bits(double x) {
  int e;
  std::frexp(x, &e);
  const double rounded = std::ldexp(std::round(std::ldexp(x, 8 - e)), e - 8);  // 8 significant bits
  const float f = static_cast<float>(rounded);                                 // exact
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<std::uint16_t>(bits >> 16);
}

namespace {

std::int64_t element_offset(const TensorView& t, std::initializer_list<std::int64_t> index) {
  if (static_cast<int>(index.size()) != t.rank) throw std::logic_error("oracle: index rank mismatch");
  std::int64_t offset = 0;
  int dim = 0;
  for (std::int64_t i : index) {
    if (i < 0 || i >= t.shape[dim]) {
      std::ostringstream m;
      m << "oracle: index " << i << " out of range in dim " << dim << " of " << t.shape_string();
      throw std::out_of_range(m.str());
    }
    offset += i * t.stride[dim++];
  }
  return offset;
}

double nan() { return std::numeric_limits<double>::quiet_NaN(); }

}  // namespace

double read_real(const TensorView& t, std::initializer_list<std::int64_t> index) {
  const std::int64_t o = element_offset(t, index);
  switch (t.dtype) {
    case DType::f32: return static_cast<const float*>(t.data)[o];
    case DType::f16: return half_bits_to_double(static_cast<const std::uint16_t*>(t.data)[o]);
    case DType::bf16: return bf16_bits_to_double(static_cast<const std::uint16_t*>(t.data)[o]);
    default: throw std::logic_error("oracle: read_real on an integer tensor");
  }
}

std::int64_t read_int(const TensorView& t, std::initializer_list<std::int64_t> index) {
  const std::int64_t o = element_offset(t, index);
  if (t.dtype == DType::i32) return static_cast<const std::int32_t*>(t.data)[o];
  if (t.dtype == DType::u32) return static_cast<const std::uint32_t*>(t.data)[o];
  throw std::logic_error("oracle: read_int on a float tensor");
}

namespace {
int ceil_div(int a, int b) { return (a + b - 1) / b; }
}  // namespace

Oracle::Oracle(const bsattn::Problem& problem, const bsattn::Inputs& inputs, TokenMaskFn custom_mask)
    : problem_(problem), inputs_(inputs), custom_mask_(std::move(custom_mask)) {
  const int B = problem_.batch;
  sparsity_heads_ = problem_.format == Format::all_blocks ? 1 : problem_.sparsity_heads;
  seqlen_q_.resize(B);
  seqlen_kv_.resize(B);
  q_row_base_.assign(B + 1, 0);
  kv_row_base_.assign(B + 1, 0);
  const bool varlen = problem_.q_layout == QLayout::varlen;
  const bool paged = problem_.kv_layout == KVLayout::paged;
  for (int b = 0; b < B; ++b) {
    if (varlen) {
      q_row_base_[b] = read_int(inputs_.cu_seqlens_q, {b});
      seqlen_q_[b] = static_cast<int>(read_int(inputs_.cu_seqlens_q, {b + 1}) - q_row_base_[b]);
    } else {
      q_row_base_[b] = static_cast<std::int64_t>(b) * problem_.max_seqlen_q;
      seqlen_q_[b] = problem_.max_seqlen_q;
    }
    if (paged) {
      seqlen_kv_[b] = static_cast<int>(read_int(inputs_.seq_lens_kv, {b}));
    } else if (varlen) {
      kv_row_base_[b] = read_int(inputs_.cu_seqlens_k, {b});
      seqlen_kv_[b] = static_cast<int>(inputs_.seqused_k.defined() ? read_int(inputs_.seqused_k, {b})
                                                                   : read_int(inputs_.cu_seqlens_k, {b + 1}) -
                                                                         kv_row_base_[b]);
    } else {
      seqlen_kv_[b] = problem_.max_seqlen_kv;
    }
  }
  q_row_base_[B] = varlen ? read_int(inputs_.cu_seqlens_q, {B}) : static_cast<std::int64_t>(B) * problem_.max_seqlen_q;

  cu_m_blocks_.assign(B + 1, 0);
  cu_idx_offsets_.assign(B + 1, 0);
  row_base_.assign(B + 1, 0);
  for (int b = 0; b < B; ++b) {
    cu_m_blocks_[b + 1] = cu_m_blocks_[b] + q_blocks(b);
    cu_idx_offsets_[b + 1] = cu_idx_offsets_[b] + static_cast<std::int64_t>(q_blocks(b)) * kv_blocks(b);
    row_base_[b + 1] = row_base_[b] + static_cast<std::int64_t>(sparsity_heads_) * q_blocks(b) * kv_blocks(b);
  }
  const std::size_t slots = static_cast<std::size_t>(row_base_[B]);
  if (problem_.format == Format::all_blocks) {
    partial_.assign(slots, 1);
    full_.assign(slots, 0);
  } else {
    partial_.assign(slots, 0);
    full_.assign(slots, 0);
    if (problem_.has_partial) decode_set(inputs_.partial, partial_);
    if (problem_.has_full) decode_set(inputs_.full, full_);
  }
  proxy_.assign(slots, 0);
  if (problem_.proxy == bsattn::Proxy::explicit_set) decode_set(inputs_.proxy, proxy_);
  whole_cache_.assign(slots, -1);
}

int Oracle::q_blocks(int b) const { return ceil_div(seqlen_q_[b], problem_.block.q); }
int Oracle::kv_blocks(int b) const { return ceil_div(seqlen_kv_[b], problem_.block.kv); }

std::int64_t Oracle::mask_index(int b, int hs, int qb, int kb) const {
  return row_base_[b] + (static_cast<std::int64_t>(hs) * q_blocks(b) + qb) * kv_blocks(b) + kb;
}

// SPEC §3: decodes one block set of the problem's format into per-(b, hs, qb, kb) membership.
// Lists must be well formed (the oracle only ever sees valid inputs; a malformed list is a bug in
// the test's generator and is reported as such).
void Oracle::decode_set(const bsattn::BlockSet& set, std::vector<std::uint8_t>& dst) const {
  const bool varlen = problem_.q_layout == QLayout::varlen;
  const int bs_of_b = problem_.sparsity_batch;
  for (int b = 0; b < problem_.batch; ++b) {
    const int bs = bs_of_b == 1 ? 0 : b;
    const int nkb = kv_blocks(b);
    for (int hs = 0; hs < sparsity_heads_; ++hs) {
      for (int qb = 0; qb < q_blocks(b); ++qb) {
        std::vector<std::int64_t> list;
        switch (problem_.format) {
          case Format::all_blocks: break;
          case Format::block_lists: {
            const std::int64_t count = read_int(set.counts, {bs, hs, qb});
            if (count > set.indices.shape[3]) throw std::runtime_error("oracle: block-list count exceeds L");
            for (std::int64_t i = 0; i < count; ++i) list.push_back(read_int(set.indices, {bs, hs, qb, i}));
            break;
          }
          case Format::varlen_block_lists: {
            const std::int64_t count = read_int(set.counts, {hs, cu_m_blocks_[b] + qb});
            if (count > nkb) throw std::runtime_error("oracle: varlen block-list count exceeds nKB");
            const std::int64_t base = cu_idx_offsets_[b] + static_cast<std::int64_t>(qb) * nkb;
            for (std::int64_t i = 0; i < count; ++i) list.push_back(read_int(set.indices, {hs, base + i}));
            break;
          }
          case Format::bsr: {
            const std::int64_t r =
                varlen ? hs * cu_m_blocks_[problem_.batch] + cu_m_blocks_[b] + qb
                       : (static_cast<std::int64_t>(bs) * sparsity_heads_ + hs) *
                                 ceil_div(problem_.max_seqlen_q, problem_.block.q) +
                             qb;
            const std::int64_t begin = read_int(set.indptr, {r}), end = read_int(set.indptr, {r + 1});
            for (std::int64_t i = begin; i < end; ++i) list.push_back(read_int(set.indices, {i}));
            break;
          }
          case Format::bitmask:
            for (int kb = 0; kb < nkb; ++kb) {
              const std::uint32_t word = static_cast<std::uint32_t>(
                  varlen ? read_int(set.bits, {hs, cu_m_blocks_[b] + qb, kb / 32})
                         : read_int(set.bits, {bs, hs, qb, kb / 32}));
              if ((word >> (kb % 32)) & 1u) list.push_back(kb);
            }
            break;
        }
        for (std::size_t i = 0; i < list.size(); ++i) {
          if (list[i] < 0 || list[i] >= nkb || (i > 0 && list[i] <= list[i - 1]))
            throw std::runtime_error("oracle: malformed block list (generator bug)");
          dst[mask_index(b, hs, qb, static_cast<int>(list[i]))] = 1;
        }
      }
    }
  }
}

BlockKind Oracle::kind(int b, int hs, int qb, int kb) const {
  const std::int64_t i = mask_index(b, hs, qb, kb);
  if (full_[i]) return BlockKind::full;
  return partial_[i] ? BlockKind::partial : BlockKind::skip;
}

bool Oracle::in_proxy_set(int b, int hs, int qb, int kb) const { return proxy_[mask_index(b, hs, qb, kb)] != 0; }

bool Oracle::builtin_visible(int b, int q, int kv) const {
  const bsattn::MaskSpec& m = problem_.mask;
  const long long diag = q + (m.alignment == bsattn::Alignment::top_left ? 0 : seqlen_kv_[b] - seqlen_q_[b]);
  if (m.causal && kv > diag) return false;
  const bool in_window = (m.window_left < 0 || kv >= diag - m.window_left) &&
                         (m.window_right < 0 || kv <= diag + m.window_right);
  if (!in_window && kv >= m.sink_tokens) return false;
  if (m.document_ids) {
    const std::int64_t dq = inputs_.doc_q.rank == 2 ? read_int(inputs_.doc_q, {b, q})
                                                    : read_int(inputs_.doc_q, {q_row_base_[b] + q});
    const std::int64_t dk = inputs_.doc_kv.rank == 2 ? read_int(inputs_.doc_kv, {b, kv})
                                                     : read_int(inputs_.doc_kv, {kv_row_base_[b] + kv});
    if (dq != dk) return false;
  }
  if (m.kv_valid_bits) {
    const std::uint32_t word = static_cast<std::uint32_t>(read_int(inputs_.kv_valid, {b, kv / 32}));
    if (!((word >> (kv % 32)) & 1u)) return false;
  }
  return true;
}

bool Oracle::mask_visible(int b, int h, int q, int kv) const {
  return builtin_visible(b, q, kv) && (!custom_mask_ || custom_mask_(b, h, q, kv));
}

bool Oracle::mask_keeps_whole(int b, int hs, int qb, int kb) const {
  std::int8_t& cached = whole_cache_[mask_index(b, hs, qb, kb)];
  if (cached >= 0) return cached != 0;
  const int group = problem_.heads_q / sparsity_heads_;
  const int q1 = std::min(seqlen_q_[b], (qb + 1) * problem_.block.q);
  const int k1 = std::min(seqlen_kv_[b], (kb + 1) * problem_.block.kv);
  bool whole = true;
  for (int h = hs * group; h < (hs + 1) * group && whole; ++h)
    for (int q = qb * problem_.block.q; q < q1 && whole; ++q)
      for (int kv = kb * problem_.block.kv; kv < k1 && whole; ++kv) whole = mask_visible(b, h, q, kv);
  cached = whole ? 1 : 0;
  return whole;
}

bool Oracle::proxy_contributes(int b, int hs, int qb, int kb) const {
  if (kind(b, hs, qb, kb) != BlockKind::skip) return false;  // computed exactly: never twice
  switch (problem_.proxy) {
    case bsattn::Proxy::off: return false;
    case bsattn::Proxy::explicit_set: return in_proxy_set(b, hs, qb, kb);
    case bsattn::Proxy::eligible: return mask_keeps_whole(b, hs, qb, kb);
  }
  return false;
}

bool Oracle::attended(int b, int h, int q, int kv) const {
  if (q < 0 || q >= seqlen_q_[b] || kv < 0 || kv >= seqlen_kv_[b]) return false;
  switch (kind(b, sparsity_head(h), q / problem_.block.q, kv / problem_.block.kv)) {
    case BlockKind::skip: return false;
    case BlockKind::full: return true;
    case BlockKind::partial: return mask_visible(b, h, q, kv);
  }
  return false;
}

double Oracle::k_element(int b, int kv, int hkv, int d) const {
  if (problem_.kv_layout == KVLayout::paged) {
    const std::int64_t page = read_int(inputs_.block_table, {b, kv / problem_.page_size});
    return read_real(inputs_.k, {page, kv % problem_.page_size, hkv, d});
  }
  if (problem_.q_layout == QLayout::varlen) return read_real(inputs_.k, {kv_row_base_[b] + kv, hkv, d});
  return read_real(inputs_.k, {b, kv, hkv, d});
}

double Oracle::v_element(int b, int kv, int hkv, int d) const {
  if (problem_.kv_layout == KVLayout::paged) {
    const std::int64_t page = read_int(inputs_.block_table, {b, kv / problem_.page_size});
    return read_real(inputs_.v, {page, kv % problem_.page_size, hkv, d});
  }
  if (problem_.q_layout == QLayout::varlen) return read_real(inputs_.v, {kv_row_base_[b] + kv, hkv, d});
  return read_real(inputs_.v, {b, kv, hkv, d});
}

void Oracle::reference_summary(int b, int kb, int hkv, double* mean_k, double* sum_v) const {
  const int D = problem_.head_dim;
  const int k0 = kb * problem_.block.kv, k1 = std::min(seqlen_kv_[b], k0 + problem_.block.kv);
  std::fill(mean_k, mean_k + D, 0.0);
  std::fill(sum_v, sum_v + D, 0.0);
  for (int kv = k0; kv < k1; ++kv)
    for (int d = 0; d < D; ++d) {
      mean_k[d] += k_element(b, kv, hkv, d);
      sum_v[d] += v_element(b, kv, hkv, d);
    }
  for (int d = 0; d < D; ++d) mean_k[d] /= (k1 - k0);
}

OracleResult Oracle::compute() const {
  const int H = problem_.heads_q, D = problem_.head_dim, Bq = problem_.block.q, Bk = problem_.block.kv;
  const int group = H / problem_.heads_kv;
  const double scale = problem_.scale != 0.0f ? static_cast<double>(problem_.scale) : 1.0 / std::sqrt(double(D));
  const bool varlen = problem_.q_layout == QLayout::varlen;
  OracleResult r;
  const std::int64_t rows = total_q_rows();
  r.out.assign(static_cast<std::size_t>(rows * H * D), nan());
  r.lse.assign(static_cast<std::size_t>(rows * H), nan());
  r.attended.assign(static_cast<std::size_t>(rows * H), 0);

  std::vector<double> k, v, k_summary, v_summary, q(D), scores, weights;
  std::vector<int> keys;
  for (int b = 0; b < problem_.batch; ++b) {
    const int skv = seqlen_kv_[b], nkb = kv_blocks(b);
    for (int hkv = 0; hkv < problem_.heads_kv; ++hkv) {
      k.assign(static_cast<std::size_t>(skv) * D, 0.0);
      v.assign(k.size(), 0.0);
      for (int kv = 0; kv < skv; ++kv)
        for (int d = 0; d < D; ++d) {
          k[kv * D + d] = k_element(b, kv, hkv, d);
          v[kv * D + d] = v_element(b, kv, hkv, d);
        }
      if (problem_.proxy != bsattn::Proxy::off) {
        k_summary.assign(static_cast<std::size_t>(nkb) * D, 0.0);
        v_summary.assign(k_summary.size(), 0.0);
        for (int kb = 0; kb < nkb; ++kb)
          for (int d = 0; d < D; ++d) {
            k_summary[kb * D + d] = read_real(inputs_.k_summary, {b, kb, hkv, d});
            v_summary[kb * D + d] = read_real(inputs_.v_summary, {b, kb, hkv, d});
          }
      }
      for (int h = hkv * group; h < (hkv + 1) * group; ++h) {
        const int hs = sparsity_head(h);
        for (int qi = 0; qi < seqlen_q_[b]; ++qi) {
          const std::int64_t row = q_row_base_[b] + qi;
          for (int d = 0; d < D; ++d)
            q[d] = varlen ? read_real(inputs_.q, {row, h, d}) : read_real(inputs_.q, {b, qi, h, d});
          // Every softmax term: log-weight (score, or score + ln n_j for a proxy) and its V (or V sum).
          scores.clear();
          keys.clear();  // >= 0: exact token; < 0: proxy block -(kb + 1)
          for (int kv = 0; kv < skv; ++kv) {
            if (!attended(b, h, qi, kv)) continue;
            double dot = 0;
            for (int d = 0; d < D; ++d) dot += q[d] * k[kv * D + d];
            scores.push_back(scale * dot);
            keys.push_back(kv);
          }
          for (int kb = 0; kb < nkb; ++kb) {
            if (!proxy_contributes(b, hs, qi / Bq, kb)) continue;
            double dot = 0;
            for (int d = 0; d < D; ++d) dot += q[d] * k_summary[kb * D + d];
            const int n = std::min(Bk, skv - kb * Bk);
            scores.push_back(scale * dot + std::log(static_cast<double>(n)));
            keys.push_back(-(kb + 1));
          }
          double* o = &r.out[static_cast<std::size_t>((row * H + h) * D)];
          r.attended[row * H + h] = static_cast<int>(scores.size());
          // IEEE semantics for non-finite inputs: a NaN score makes the row NaN (max_element would
          // skip it); an infinite score gives inf - inf = NaN weights, as in any plain softmax; a
          // -inf score weighs 0, like a masked token, so a row of only -inf scores is empty.
          double m = -std::numeric_limits<double>::infinity();
          for (double s : scores) m = (s != s || m != m) ? nan() : std::max(m, s);
          if (m == -std::numeric_limits<double>::infinity()) {
            std::fill(o, o + D, 0.0);
            r.lse[row * H + h] = m;
            continue;
          }
          weights.resize(scores.size());
          double denominator = 0;
          for (std::size_t i = 0; i < scores.size(); ++i) denominator += weights[i] = std::exp(scores[i] - m);
          std::fill(o, o + D, 0.0);
          for (std::size_t i = 0; i < scores.size(); ++i) {
            // A proxy's weight p * n_j multiplies the mean V, i.e. p times the summed V.
            const double* vec;
            double w = weights[i] / denominator;
            if (keys[i] >= 0) {
              vec = &v[keys[i] * D];
            } else {
              const int kb = -keys[i] - 1;
              vec = &v_summary[kb * D];
              w /= std::min(Bk, skv - kb * Bk);
            }
            for (int d = 0; d < D; ++d) o[d] += w * vec[d];
          }
          r.lse[row * H + h] = m + std::log(denominator);
        }
      }
    }
  }
  return r;
}

std::int64_t Oracle::kv_row(int b, int kv) const {
  return problem_.q_layout == QLayout::varlen ? kv_row_base_[b] + kv
                                              : static_cast<std::int64_t>(b) * problem_.max_seqlen_kv + kv;
}

std::int64_t Oracle::total_kv_rows() const {
  return problem_.q_layout == QLayout::varlen ? inputs_.k.shape[0]
                                              : static_cast<std::int64_t>(problem_.batch) * problem_.max_seqlen_kv;
}

OracleGradients Oracle::backward(const TensorView& dout, const TensorView& dlse) const {
  if (problem_.proxy != bsattn::Proxy::off || problem_.kv_layout == KVLayout::paged)
    throw std::logic_error("oracle: backward of proxy routes or paged KV");
  const int H = problem_.heads_q, Hkv = problem_.heads_kv, D = problem_.head_dim;
  const int group = H / Hkv;
  const double scale = problem_.scale != 0.0f ? static_cast<double>(problem_.scale) : 1.0 / std::sqrt(double(D));
  const bool varlen = problem_.q_layout == QLayout::varlen;
  OracleGradients g;
  g.dq.assign(static_cast<std::size_t>(total_q_rows() * H * D), 0.0);
  g.dk.assign(static_cast<std::size_t>(total_kv_rows() * Hkv * D), 0.0);
  g.dv.assign(g.dk.size(), 0.0);

  std::vector<double> k, v, q(D), dO(D), o(D), p, dp;
  std::vector<int> keys;
  for (int b = 0; b < problem_.batch; ++b) {
    const int skv = seqlen_kv_[b];
    for (int hkv = 0; hkv < Hkv; ++hkv) {
      k.assign(static_cast<std::size_t>(skv) * D, 0.0);
      v.assign(k.size(), 0.0);
      for (int kv = 0; kv < skv; ++kv)
        for (int d = 0; d < D; ++d) {
          k[kv * D + d] = k_element(b, kv, hkv, d);
          v[kv * D + d] = v_element(b, kv, hkv, d);
        }
      for (int h = hkv * group; h < (hkv + 1) * group; ++h)
        for (int qi = 0; qi < seqlen_q_[b]; ++qi) {
          const std::int64_t row = q_row_base_[b] + qi;
          for (int d = 0; d < D; ++d) {
            q[d] = varlen ? read_real(inputs_.q, {row, h, d}) : read_real(inputs_.q, {b, qi, h, d});
            dO[d] = varlen ? read_real(dout, {row, h, d}) : read_real(dout, {b, qi, h, d});
          }
          keys.clear();
          p.clear();
          for (int kv = 0; kv < skv; ++kv) {
            if (!attended(b, h, qi, kv)) continue;
            double dot = 0;
            for (int d = 0; d < D; ++d) dot += q[d] * k[kv * D + d];
            keys.push_back(kv);
            p.push_back(scale * dot);
          }
          if (keys.empty()) continue;  // nothing attended: no gradient flows through this row
          const double m = *std::max_element(p.begin(), p.end());
          double sum = 0;
          for (double& x : p) sum += x = std::exp(x - m);
          std::fill(o.begin(), o.end(), 0.0);
          for (std::size_t i = 0; i < keys.size(); ++i) {
            p[i] /= sum;
            for (int d = 0; d < D; ++d) o[d] += p[i] * v[keys[i] * D + d];
          }
          double delta = 0;  // rowsum(dO * O) - dLSE (dLSE / dS = P)
          for (int d = 0; d < D; ++d) delta += dO[d] * o[d];
          if (dlse.defined()) delta -= varlen ? read_real(dlse, {h, row}) : read_real(dlse, {b, h, qi});
          double* dq = &g.dq[static_cast<std::size_t>((row * H + h) * D)];
          for (std::size_t i = 0; i < keys.size(); ++i) {
            const int kv = keys[i];
            double dP = 0;
            for (int d = 0; d < D; ++d) dP += dO[d] * v[kv * D + d];
            const double dS = p[i] * (dP - delta);
            const std::size_t kv_at = static_cast<std::size_t>((kv_row(b, kv) * Hkv + hkv) * D);
            for (int d = 0; d < D; ++d) {
              dq[d] += scale * dS * k[kv * D + d];
              g.dk[kv_at + d] += scale * dS * q[d];
              g.dv[kv_at + d] += p[i] * dO[d];
            }
          }
        }
    }
  }
  return g;
}

Tolerance tolerance_for(DType out_dtype) {
  switch (out_dtype) {
    case DType::f16: return {1e-5, 1.5e-3, 5e-5};   // output rounding: half an ulp is 2^-11 relative
    case DType::bf16: return {1e-5, 8e-3, 5e-5};    // half an ulp is 2^-8 relative
    default: return {2e-5, 2e-5, 5e-5};             // fp32 accumulation against float64
  }
}

std::string compare_outputs(const bsattn::Problem& problem, const Oracle& oracle, const OracleResult& expected,
                            const bsattn::Outputs& outputs, const Tolerance& tol) {
  const int H = problem.heads_q, D = problem.head_dim;
  const bool varlen = problem.q_layout == QLayout::varlen;
  std::ostringstream report;
  int failures = 0;
  double worst_out = 0, worst_lse = 0;
  const auto fail = [&](const std::string& what) {
    if (failures++ < 6) report << "  " << what << "\n";
  };
  for (int b = 0; b < problem.batch; ++b)
    for (int qi = 0; qi < oracle.seqlen_q(b); ++qi) {
      const std::int64_t row = oracle.q_row(b, qi);
      for (int h = 0; h < H; ++h) {
        const auto where = [&] {
          std::ostringstream w;
          w << "(b=" << b << " q=" << qi << " h=" << h << ", " << expected.attended[row * H + h] << " terms)";
          return w.str();
        };
        for (int d = 0; d < D; ++d) {
          const double got = varlen ? read_real(outputs.out, {row, h, d}) : read_real(outputs.out, {b, qi, h, d});
          const double want = expected.out[static_cast<std::size_t>((row * H + h) * D + d)];
          const double err = std::fabs(got - want);
          // Non-finite references (NaN / inf inputs): the row must show it, NaN as NaN.
          const bool ok = std::isfinite(want) ? err <= tol.out_abs + tol.out_rel * std::fabs(want)
                                              : (want != want ? got != got : !std::isfinite(got));
          if (!ok) {
            std::ostringstream m;
            m << "O" << where() << " d=" << d << ": got " << got << " want " << want;
            fail(m.str());
          }
          if (err == err) worst_out = std::max(worst_out, err);
        }
        if (!outputs.lse.defined()) continue;
        const double got = varlen ? read_real(outputs.lse, {h, row}) : read_real(outputs.lse, {b, h, qi});
        const double want = expected.lse[row * H + h];
        const bool ok = want != want ? got != got : std::isinf(want) ? got == want : std::fabs(got - want) <= tol.lse_abs;
        if (!ok) {
          std::ostringstream m;
          m << "LSE" << where() << ": got " << got << " want " << want;
          fail(m.str());
        }
        if (!std::isinf(want) && got == got) worst_lse = std::max(worst_lse, std::fabs(got - want));
      }
    }
  if (failures == 0) return "";
  std::ostringstream head;
  head << failures << " mismatching elements (max |dO| " << worst_out << ", max |dLSE| " << worst_lse << "):\n";
  return head.str() + report.str();
}

}  // namespace bsattn_test
