// The valid problem every validation test starts from (validation_test.cpp breaks one thing per
// test; validation_fuzz_test.cpp mutates metadata values at random): B = 2, Hq = 4, Hkv = Hs = 2,
// blocks of 16, every format and layout, with its host tensors, poisonable outputs and a view of
// every tensor by its argument name.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bsattn/bsattn.hpp"
#include "bsattn/cpu/numeric.hpp"

namespace validation_case {
using namespace bsattn;

// A NaN bit pattern no engine writes: an output element still holding it was never touched.
constexpr std::uint32_t kPoison = 0x7fc0dead;

struct Options {
  Format format = Format::block_lists;
  QLayout q_layout = QLayout::batched;
  KVLayout kv_layout = KVLayout::contiguous;
  bool full = true;        // a full set beside the partial one (formats with sets)
  bool features = false;   // document ids, kv_valid bits and an explicit proxy set with summaries
  bool broadcast = false;  // sparsity_batch 1 where B would be allowed
  bool gpu = false;        // a problem the GPU kernels take: bf16, D = 128 (tensors stay on the host)
};

// A valid problem and its tensors: B=2, Hq=4, Hkv=Hs=2, D=8 (GPU: 128), Bq=Bk=16, f32 (GPU: bf16). Batched sequences
// are 40 tokens (nQB = nKB = 3); varlen Q lengths {40, 20}, varlen / paged KV lengths {40, 24}.
// Paged: page_size 8, pages_per_seq 6, 12 pages (GPU, whose pages are multiples of 16: 16, 3, 6;
// 48 readable tokens either way), block_table rows padded by 2 columns holding garbage.
class Case {
 public:
  static constexpr int B = 2, Hq = 4, Hkv = 2, Hs = 2, Bq = 16, Bk = 16;
  const int page_size, pages_per_seq, table_stride, num_pages;

  explicit Case(const Options& o)
      : page_size(o.gpu ? 16 : 8),
        pages_per_seq(48 / page_size),
        table_stride(pages_per_seq + 2),
        num_pages(o.gpu ? 6 : 12),
        opt(o),
        D(o.gpu ? 128 : 8) {
    const bool varlen_q = o.q_layout == QLayout::varlen;
    const bool paged = o.kv_layout == KVLayout::paged;
    const bool varlen_kv = varlen_q && !paged;
    seq_q = varlen_q ? std::vector<int>{40, 20} : std::vector<int>{40, 40};
    seq_kv = (varlen_q || paged) ? std::vector<int>{40, 24} : std::vector<int>{40, 40};
    for (int b = 0; b < B; ++b) {
      cu_m.push_back(cu_m.back() + nqb(b));
      cu_idx.push_back(cu_idx.back() + nqb(b) * nkb(b));
    }

    p.batch = B;
    p.heads_q = Hq;
    p.heads_kv = Hkv;
    p.head_dim = D;
    p.max_seqlen_q = 40;
    p.max_seqlen_kv = 40;
    p.q_layout = o.q_layout;
    p.kv_layout = o.kv_layout;
    p.dtype = p.out_dtype = o.gpu ? DType::bf16 : DType::f32;
    p.block = {Bq, Bk};
    p.format = o.format;
    p.sparsity_heads = Hs;
    p.sparsity_batch = varlen_rows() || o.broadcast ? 1 : B;
    p.has_partial = true;
    p.has_full = o.full && o.format != Format::all_blocks;
    p.num_threads = 2;
    if (varlen_q) p.total_q = 60;
    if (varlen_kv) p.total_kv = 64;
    if (paged) {
      p.page_size = page_size;
      p.pages_per_seq = pages_per_seq;
      p.num_pages = num_pages;
    }

    in.q = values(varlen_q ? std::vector<std::int64_t>{60, Hq, D} : std::vector<std::int64_t>{B, 40, Hq, D}, p.dtype);
    const std::vector<std::int64_t> kv_shape = paged       ? std::vector<std::int64_t>{num_pages, page_size, Hkv, D}
                                               : varlen_kv ? std::vector<std::int64_t>{64, Hkv, D}
                                                           : std::vector<std::int64_t>{B, 40, Hkv, D};
    in.k = values(kv_shape, p.dtype);
    in.v = values(kv_shape, p.dtype);
    out.out =
        values(varlen_q ? std::vector<std::int64_t>{60, Hq, D} : std::vector<std::int64_t>{B, 40, Hq, D}, p.out_dtype);
    out.lse = values(varlen_q ? std::vector<std::int64_t>{Hq, 60} : std::vector<std::int64_t>{B, Hq, 40}, DType::f32);
    if (varlen_q) in.cu_seqlens_q = ints({B + 1}, {0, 40, 60});
    if (varlen_kv) in.cu_seqlens_k = ints({B + 1}, {0, 40, 64});
    if (paged) {
      // Row 0 reads pages 0..4, row 1 pages 5..7 (GPU: 0..2 and 3..4); unread entries and the
      // padding are garbage.
      std::int32_t* table = alloc<std::int32_t>(B * table_stride, 999);
      const int pages0 = (40 + page_size - 1) / page_size, pages1 = (24 + page_size - 1) / page_size;
      for (int j = 0; j < pages_per_seq; ++j) {
        table[j] = j < pages0 ? j : -1;
        table[table_stride + j] = j < pages1 ? pages0 + j : -1;
      }
      in.block_table = TensorView::strided(table, DType::i32, {B, pages_per_seq}, {table_stride, 1});
      in.seq_lens_kv = ints({B}, {40, 24});
    }
    if (o.format == Format::varlen_block_lists) {
      in.cu_total_m_blocks = ints({B + 1}, {0, cu_m[1], cu_m[2]});
      in.cu_block_idx_offsets = ints({B + 1}, {0, cu_idx[1], cu_idx[2]});
    } else if (varlen_rows() && o.format != Format::all_blocks) {
      in.cu_total_m_blocks = ints({B + 1}, {0, cu_m[1], cu_m[2]});
    }

    // Selection: (b + hs + qb + kb) % 3 is 1 for a partial block, 2 for a full one.
    const auto kind = [](int b, int hs, int qb, int kb) { return (b + hs + qb + kb) % 3; };
    if (o.format != Format::all_blocks) {
      in.partial = make_set([&](int b, int hs, int qb, int kb) { return kind(b, hs, qb, kb) == 1; });
      if (p.has_full) in.full = make_set([&](int b, int hs, int qb, int kb) { return kind(b, hs, qb, kb) == 2; });
    }
    if (o.features) enable_features(kind);
  }

  int nqb(int b) const { return (seq_q[b] + Bq - 1) / Bq; }
  int nkb(int b) const { return (seq_kv[b] + Bk - 1) / Bk; }
  bool varlen_rows() const {
    return opt.format == Format::varlen_block_lists ||
           (opt.q_layout == QLayout::varlen && (opt.format == Format::bsr || opt.format == Format::bitmask));
  }

  // Every tensor of the case by its argument name, defined or not.
  std::vector<std::pair<std::string, TensorView*>> fields() {
    std::vector<std::pair<std::string, TensorView*>> f = {
        {"q", &in.q},
        {"k", &in.k},
        {"v", &in.v},
        {"cu_seqlens_q", &in.cu_seqlens_q},
        {"cu_seqlens_k", &in.cu_seqlens_k},
        {"seqused_k", &in.seqused_k},
        {"block_table", &in.block_table},
        {"seq_lens_kv", &in.seq_lens_kv},
        {"cu_total_m_blocks", &in.cu_total_m_blocks},
        {"cu_block_idx_offsets", &in.cu_block_idx_offsets},
        {"doc_q", &in.doc_q},
        {"doc_kv", &in.doc_kv},
        {"kv_valid", &in.kv_valid},
        {"k_summary", &in.k_summary},
        {"v_summary", &in.v_summary},
        {"outputs.out", &out.out},
        {"outputs.lse", &out.lse},
    };
    for (auto [set_name, set] :
         {std::pair<const char*, BlockSet*>{"partial", &in.partial}, {"full", &in.full}, {"proxy", &in.proxy}}) {
      const std::string n = set_name;
      f.insert(f.end(), {{n + ".counts", &set->counts},
                         {n + ".indices", &set->indices},
                         {n + ".indptr", &set->indptr},
                         {n + ".bits", &set->bits}});
    }
    return f;
  }
  TensorView& view(const std::string& name) {
    for (const auto& f : fields())
      if (f.first == name) return *f.second;
    throw std::logic_error("no tensor " + name);
  }

  // Element of an int32 / uint32 tensor.
  std::int32_t& at(const std::string& name, std::initializer_list<std::int64_t> index) {
    const TensorView& t = view(name);
    std::int64_t offset = 0;
    int d = 0;
    for (std::int64_t i : index) offset += i * t.stride[d++];
    return static_cast<std::int32_t*>(t.data)[offset];
  }

  // Rewrites one row of a (varlen) block-list set.
  void set_row(const std::string& set, int b, int hs, int qb, const std::vector<int>& entries) {
    const bool varlen = opt.format == Format::varlen_block_lists;
    at(set + ".counts", varlen ? std::initializer_list<std::int64_t>{hs, cu_m[b] + qb}
                               : std::initializer_list<std::int64_t>{b, hs, qb}) = static_cast<int>(entries.size());
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const std::int64_t n = static_cast<std::int64_t>(i);
      at(set + ".indices", varlen ? std::initializer_list<std::int64_t>{hs, cu_idx[b] + qb * nkb(b) + n}
                                  : std::initializer_list<std::int64_t>{b, hs, qb, n}) = entries[i];
    }
  }

  // O and LSE as 32-bit words (bf16 elements pair up).
  static std::int64_t words(const TensorView& t) {
    return t.numel() * static_cast<std::int64_t>(element_size(t.dtype)) / 4;
  }
  void poison() {
    for (TensorView* t : {&out.out, &out.lse}) {
      auto* bits = static_cast<std::uint32_t*>(t->data);
      std::fill(bits, bits + words(*t), kPoison);
    }
  }
  // Words of O and LSE still holding the poison.
  std::int64_t poisoned() const {
    std::int64_t n = 0;
    for (const TensorView* t : {&out.out, &out.lse}) {
      const auto* bits = static_cast<const std::uint32_t*>(t->data);
      n += std::count(bits, bits + words(*t), kPoison);
    }
    return n;
  }
  std::int64_t output_elements() const { return words(out.out) + words(out.lse); }

  template <class T>
  T* alloc(std::size_t n, T fill) {
    const std::size_t bytes = n * sizeof(T) + 128;  // room to align, and slack for misaligned views
    storage_.push_back(std::make_unique<unsigned char[]>(bytes));
    auto address = reinterpret_cast<std::uintptr_t>(storage_.back().get());
    T* data = reinterpret_cast<T*>((address + 63) / 64 * 64);
    std::fill(data, data + n, fill);
    return data;
  }
  // A f32 or bf16 tensor of small values.
  TensorView values(const std::vector<std::int64_t>& shape, DType dtype) {
    std::int64_t n = 1;
    for (std::int64_t s : shape) n *= s;
    const auto value = [](std::int64_t i) { return static_cast<float>((i * 37) % 23) / 23.0f - 0.5f; };
    if (dtype == DType::bf16) {
      std::uint16_t* data = alloc<std::uint16_t>(static_cast<std::size_t>(n), 0);
      for (std::int64_t i = 0; i < n; ++i) data[i] = cpu::float_to_bf16(value(i));
      return with_shape(data, dtype, shape);
    }
    float* data = alloc<float>(static_cast<std::size_t>(n), 0.0f);
    for (std::int64_t i = 0; i < n; ++i) data[i] = value(i);
    return with_shape(data, dtype, shape);
  }
  TensorView ints(const std::vector<std::int64_t>& shape, const std::vector<std::int32_t>& values) {
    std::int32_t* data = alloc<std::int32_t>(values.size(), 0);
    std::copy(values.begin(), values.end(), data);
    return with_shape(data, DType::i32, shape);
  }
  static TensorView with_shape(void* data, DType dtype, const std::vector<std::int64_t>& shape) {
    TensorView t = TensorView::contiguous(data, dtype, {});
    t.rank = static_cast<int>(shape.size());
    std::int64_t stride = 1;
    for (int i = t.rank - 1; i >= 0; --i) {
      t.shape[i] = shape[i];
      t.stride[i] = stride;
      stride *= shape[i];
    }
    return t;
  }

  Options opt;
  const int D;
  Problem p;
  Inputs in;
  Outputs out;
  std::vector<int> seq_q, seq_kv;
  std::vector<int> cu_m{0}, cu_idx{0};  // SPEC §3.2 prefix sums of nQB(b) and nQB(b) * nKB(b)

 private:
  using Selector = std::function<bool(int b, int hs, int qb, int kb)>;

  // A stored row: its sequence, whether the engine reads it, and its KV blocks.
  struct StoredRow {
    int b, hs, qb;
    bool read;
    std::vector<int> blocks;
  };

  // Rows in storage order: [Bs, Hs, nQB] for batched rows, else hs-major over the sequences.
  std::vector<StoredRow> rows(const Selector& chosen) const {
    std::vector<StoredRow> r;
    const auto add = [&](int b, int hs, int qb, bool read) {
      StoredRow row{b, hs, qb, read, {}};
      for (int kb = 0; read && kb < nkb(b); ++kb)
        if (chosen(b, hs, qb, kb)) row.blocks.push_back(kb);
      r.push_back(row);
    };
    if (varlen_rows()) {
      for (int hs = 0; hs < Hs; ++hs)
        for (int b = 0; b < B; ++b)
          for (int qb = 0; qb < nqb(b); ++qb) add(b, hs, qb, true);
    } else {
      for (int bs = 0; bs < p.sparsity_batch; ++bs)
        for (int hs = 0; hs < Hs; ++hs)
          for (int qb = 0; qb < 3; ++qb) add(bs, hs, qb, qb < nqb(bs));
    }
    return r;
  }

  BlockSet make_set(const Selector& chosen) {
    const std::vector<StoredRow> stored = rows(chosen);
    const std::int64_t R = static_cast<std::int64_t>(stored.size()), L = 3;
    BlockSet set;
    switch (opt.format) {
      case Format::all_blocks: break;
      case Format::block_lists: {
        std::int32_t* counts = alloc<std::int32_t>(R, -7);  // unread rows keep garbage
        std::int32_t* idx = alloc<std::int32_t>(R * L, -1);
        for (std::int64_t i = 0; i < R; ++i) {
          if (!stored[i].read) continue;
          counts[i] = static_cast<int>(stored[i].blocks.size());
          std::copy(stored[i].blocks.begin(), stored[i].blocks.end(), idx + i * L);
        }
        set.counts = with_shape(counts, DType::i32, {p.sparsity_batch, Hs, 3});
        set.indices = with_shape(idx, DType::i32, {p.sparsity_batch, Hs, 3, L});
        break;
      }
      case Format::varlen_block_lists: {
        const std::int64_t total_m = cu_m.back(), total_n = cu_idx.back();
        std::int32_t* counts = alloc<std::int32_t>(Hs * total_m, 0);
        std::int32_t* idx = alloc<std::int32_t>(Hs * total_n, -1);
        for (const StoredRow& row : stored) {
          counts[row.hs * total_m + cu_m[row.b] + row.qb] = static_cast<int>(row.blocks.size());
          std::copy(row.blocks.begin(), row.blocks.end(), idx + row.hs * total_n + cu_idx[row.b] + row.qb * nkb(row.b));
        }
        set.counts = with_shape(counts, DType::i32, {Hs, total_m});
        set.indices = with_shape(idx, DType::i32, {Hs, total_n});
        break;
      }
      case Format::bsr: {
        std::vector<std::int32_t> indptr{0}, indices;
        for (const StoredRow& row : stored) {
          indices.insert(indices.end(), row.blocks.begin(), row.blocks.end());
          indptr.push_back(static_cast<std::int32_t>(indices.size()));
        }
        set.indptr = ints({R + 1}, indptr);
        set.indices = ints({static_cast<std::int64_t>(indices.size())}, indices);
        break;
      }
      case Format::bitmask: {
        // Bit 31 is beyond every nKB here: ignored by contract, so set it as garbage.
        std::uint32_t* words = alloc<std::uint32_t>(R, 0);
        for (std::int64_t i = 0; i < R; ++i) {
          words[i] = stored[i].read ? 0x80000000u : 0xffffffffu;
          for (int kb : stored[i].blocks) words[i] |= 1u << kb;
        }
        set.bits = varlen_rows() ? with_shape(words, DType::u32, {Hs, cu_m.back(), 1})
                                 : with_shape(words, DType::u32, {p.sparsity_batch, Hs, 3, 1});
        break;
      }
    }
    return set;
  }

  template <class Kind>
  void enable_features(const Kind& kind) {
    const bool varlen_q = opt.q_layout == QLayout::varlen;
    const bool paged = opt.kv_layout == KVLayout::paged;
    p.mask.document_ids = true;
    p.mask.kv_valid_bits = true;
    p.mask.causal = true;
    const auto documents = [&](std::vector<std::int64_t> shape, std::int64_t n) {
      std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) ids[i] = static_cast<std::int32_t>((i % 40) / 24);
      return ints(shape, ids);
    };
    in.doc_q = varlen_q ? documents({60}, 60) : documents({B, 40}, B * 40);
    in.doc_kv = paged      ? documents({B, pages_per_seq * page_size}, B * pages_per_seq * page_size)
                : varlen_q ? documents({64}, 64)
                           : documents({B, 40}, B * 40);
    std::uint32_t* valid = alloc<std::uint32_t>(B * 2, 0xffffffffu);
    valid[0] &= ~(1u << 5);
    in.kv_valid = with_shape(valid, DType::u32, {B, 2});
    if (opt.format == Format::all_blocks) return;
    p.proxy = Proxy::explicit_set;
    in.proxy = make_set([&](int b, int hs, int qb, int kb) { return kind(b, hs, qb, kb) == 0; });
    in.k_summary = values({B, 3, Hkv, D}, p.dtype);
    in.v_summary = values({B, 3, Hkv, D}, p.dtype);
  }

  std::vector<std::unique_ptr<unsigned char[]>> storage_;
};

inline Options with(Format format, QLayout q, KVLayout kv) {
  Options o;
  o.format = format;
  o.q_layout = q;
  o.kv_layout = kv;
  return o;
}

// The valid bases: every format and layout, with and without the optional features.
struct BaseParam {
  Format format;
  QLayout q;
  KVLayout kv;
  bool features;
};

inline std::vector<BaseParam> base_params() {
  std::vector<BaseParam> v;
  for (Format f : {Format::all_blocks, Format::block_lists, Format::varlen_block_lists, Format::bsr, Format::bitmask})
    for (QLayout q : {QLayout::batched, QLayout::varlen})
      for (KVLayout kv : {KVLayout::contiguous, KVLayout::paged})
        for (bool features : {false, true})
          if (f != Format::varlen_block_lists || q == QLayout::varlen) v.push_back({f, q, kv, features});
  return v;
}

inline std::string base_name(const ::testing::TestParamInfo<BaseParam>& info) {
  static const char* const formats[] = {"AllBlocks", "BlockLists", "VarlenBlockLists", "Bsr", "Bitmask"};
  const BaseParam& b = info.param;
  return std::string(formats[static_cast<int>(b.format)]) + (b.q == QLayout::varlen ? "VarlenQ" : "BatchedQ") +
         (b.kv == KVLayout::paged ? "PagedKV" : "ContiguousKV") + (b.features ? "AllFeatures" : "");
}

// An integer metadata tensor of the case, by its argument name.
struct Target {
  std::string name;
  TensorView* view;
};

inline std::vector<Target> integer_tensors(Case& c) {
  std::vector<Target> t;
  for (auto& [name, view] : c.fields())
    if (view->data && (view->dtype == DType::i32 || view->dtype == DType::u32) && name.rfind("outputs.", 0) != 0)
      t.push_back({name, view});
  return t;
}

// Overwrites one random element of a random integer tensor with a value on or beside the rules'
// bounds (validation_fuzz_test.cpp); returns what it did.
inline std::string mutate(Case& c, std::mt19937_64& rng) {
  const std::vector<Target> targets = integer_tensors(c);
  const Target& t = targets[rng() % targets.size()];
  std::int64_t offset = 0;
  std::ostringstream what;
  what << t.name << "[";
  for (int d = 0; d < t.view->rank; ++d) {
    const std::int64_t i = t.view->shape[d] > 0 ? static_cast<std::int64_t>(rng() % t.view->shape[d]) : 0;
    offset += i * t.view->stride[d];
    what << (d ? ", " : "") << i;
  }
  auto* element = static_cast<std::int32_t*>(t.view->data) + offset;
  const std::int32_t old = *element;
  std::int32_t value = old;
  // old + delta, wrapping (a previous mutation may have left an int32 extreme there).
  const auto step = [&](std::int32_t delta) {
    return static_cast<std::int32_t>(static_cast<std::uint32_t>(old) + static_cast<std::uint32_t>(delta));
  };
  if (t.view->dtype == DType::u32) {
    const unsigned r = rng() % 8;
    value = r == 0 ? 0 : r == 1 ? -1 : static_cast<std::int32_t>(static_cast<std::uint32_t>(old) ^ (1u << (rng() % 32)));
  } else {
    switch (rng() % 8) {
      case 0: value = step(rng() % 2 ? 1 : -1); break;
      case 1: value = step(rng() % 2 ? 2 : -2); break;
      case 2: value = static_cast<std::int32_t>(rng() % 3) - 1; break;  // -1, 0, 1
      case 3: value = std::numeric_limits<std::int32_t>::max(); break;
      case 4: value = std::numeric_limits<std::int32_t>::min(); break;
      case 5: value = step(rng() % 2 ? 16 : -16); break;  // a block of tokens
      default: value = static_cast<std::int32_t>(rng() % 80) - 4; break;
    }
  }
  *element = value;
  what << "] " << old << " -> " << value;
  return what.str();
}

// One to three mutations of c; what they did.
inline std::string mutate_some(Case& c, std::mt19937_64& rng) {
  std::string what;
  for (int m = 1 + static_cast<int>(rng() % 3); m > 0; --m) what += mutate(c, rng) + "; ";
  return what;
}

}  // namespace validation_case
