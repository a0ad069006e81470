// Per-run validation of tensor structure: ranks, shapes, dtypes, strides, alignment, devices,
// the tensors each feature needs, outputs not aliasing inputs; no metadata value is read. The
// generic rules are in structure.hpp. See validate.hpp.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "formats/structure.hpp"
#include "formats/validate.hpp"

namespace bsattn::formats {
namespace {

// Named input fields, so that messages and the "given but not read" rule share one table.
struct Field {
  const char* name;
  const TensorView* view;
};

std::vector<Field> input_fields(const Inputs& in) {
  std::vector<Field> f = {
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
  };
  static const char* const kSetFields[3][4] = {{"partial.counts", "partial.indices", "partial.indptr", "partial.bits"},
                                               {"full.counts", "full.indices", "full.indptr", "full.bits"},
                                               {"proxy.counts", "proxy.indices", "proxy.indptr", "proxy.bits"}};
  const BlockSet* sets[3] = {&in.partial, &in.full, &in.proxy};
  for (int s = 0; s < 3; ++s)
    f.insert(f.end(), {{kSetFields[s][0], &sets[s]->counts},
                       {kSetFields[s][1], &sets[s]->indices},
                       {kSetFields[s][2], &sets[s]->indptr},
                       {kSetFields[s][3], &sets[s]->bits}});
  return f;
}

// Checks the input tensors one by one and remembers which were read, so that any other
// tensor given is reported rather than silently ignored.
class InputChecker {
 public:
  InputChecker(const Problem& pb, const Inputs& in) : pb_(pb), fields_(input_fields(in)) {}

  void require(const TensorView& t, const std::vector<Dim>& dims, DType dtype, Access access) {
    const std::string name = name_of(t);
    expect(t.defined(), name, [&] { return "is required by this problem (" + summary() + ") but not given"; });
    expect_tensor(pb_, name, t, dims, dtype, access);
    read_.push_back(&t);
  }
  void optional(const TensorView& t, const std::vector<Dim>& dims, DType dtype, Access access) {
    if (t.defined()) require(t, dims, dtype, access);
  }

  // Every defined input not required or allowed above.
  void reject_unread() const {
    for (const Field& f : fields_)
      expect(!f.view->defined() || std::find(read_.begin(), read_.end(), f.view) != read_.end(), f.name,
             [&] { return "is given, but this problem (" + summary() + ") does not read it; leave it undefined"; });
  }

  const std::vector<Field>& fields() const { return fields_; }

 private:
  std::string name_of(const TensorView& t) const {
    for (const Field& f : fields_)
      if (f.view == &t) return f.name;
    return "inputs";
  }

  std::string summary() const {
    return std::string("format ") + to_string(pb_.format) + ", q_layout " + (is_varlen(pb_) ? "varlen" : "batched") +
           ", kv_layout " + (is_paged(pb_) ? "paged" : "contiguous") + ", has_partial " +
           (pb_.has_partial ? "true" : "false") + ", has_full " + (pb_.has_full ? "true" : "false") + ", proxy " +
           to_string(pb_.proxy) + ", document_ids " + (pb_.mask.document_ids ? "true" : "false") + ", kv_valid_bits " +
           (pb_.mask.kv_valid_bits ? "true" : "false");
  }

  const Problem& pb_;
  std::vector<Field> fields_;
  std::vector<const TensorView*> read_;
};


void check_block_set(InputChecker& c, const Problem& pb, const Extents& e, const BlockSet& set) {
  const bool varlen_rows = has_varlen_rows(pb);
  switch (pb.format) {
    case Format::all_blocks: return;
    case Format::block_lists:
      c.require(set.counts, {exactly("Bs", e.Bs), exactly("Hs", e.Hs), exactly("nQB", e.nQB)}, DType::i32,
                Access::strided);
      c.require(set.indices, {exactly("Bs", e.Bs), exactly("Hs", e.Hs), exactly("nQB", e.nQB), between("L", 0, e.nKB)},
                DType::i32, Access::strided);
      return;
    case Format::varlen_block_lists:
      c.require(set.counts, {exactly("Hs", e.Hs), any_extent("total_m_blocks")}, DType::i32, Access::strided);
      c.require(set.indices, {exactly("Hs", e.Hs), any_extent("total_n_blocks")}, DType::i32, Access::strided);
      return;
    case Format::bsr: {
      // Varlen rows: R = Hs * total_m_blocks depends on cu_seqlens_q, checked with the values.
      const Dim rows = varlen_rows ? at_least("R+1", 1) : exactly("R+1", e.Bs * e.Hs * e.nQB + 1);
      c.require(set.indptr, {rows}, DType::i32, Access::row_contiguous);
      c.require(set.indices, {any_extent("nnz")}, DType::i32, Access::row_contiguous);
      return;
    }
    case Format::bitmask:
      if (varlen_rows)
        c.require(set.bits, {exactly("Hs", e.Hs), any_extent("total_m_blocks"), at_least("W", e.words)}, DType::u32,
                  Access::strided);
      else
        c.require(set.bits, {exactly("Bs", e.Bs), exactly("Hs", e.Hs), exactly("nQB", e.nQB), at_least("W", e.words)},
                  DType::u32, Access::strided);
      return;
  }
}


void check_inputs(InputChecker& c, const Problem& pb, const Inputs& in) {
  const Extents e(pb);
  const DType dt = pb.dtype;
  c.require(in.q, q_dims(pb, e), dt, Access::vectors);
  if (is_varlen(pb)) c.require(in.cu_seqlens_q, {exactly("B+1", e.B + 1)}, DType::i32, Access::row_contiguous);

  if (is_paged(pb)) {
    c.require(in.block_table, {exactly("B", e.B), at_least("C", pb.pages_per_seq)}, DType::i32, Access::row_contiguous);
    c.require(in.seq_lens_kv, {exactly("B", e.B)}, DType::i32, Access::row_contiguous);
  } else if (is_varlen_kv(pb)) {
    c.require(in.cu_seqlens_k, {exactly("B+1", e.B + 1)}, DType::i32, Access::row_contiguous);
    c.optional(in.seqused_k, {exactly("B", e.B)}, DType::i32, Access::row_contiguous);
  }
  const std::vector<Dim> kv = kv_dims(pb, e);
  c.require(in.k, kv, dt, Access::vectors);
  c.require(in.v, kv, dt, Access::vectors);

  if (pb.format != Format::all_blocks) {
    if (pb.has_partial) check_block_set(c, pb, e, in.partial);
    if (pb.has_full) check_block_set(c, pb, e, in.full);
  }
  if (pb.proxy == Proxy::explicit_set) check_block_set(c, pb, e, in.proxy);
  if (is_varlen(pb) && has_varlen_rows(pb)) {
    c.optional(in.cu_total_m_blocks, {exactly("B+1", e.B + 1)}, DType::i32, Access::row_contiguous);
    if (pb.format == Format::varlen_block_lists)
      c.optional(in.cu_block_idx_offsets, {exactly("B+1", e.B + 1)}, DType::i32, Access::row_contiguous);
  }

  if (pb.mask.document_ids) {
    if (is_varlen(pb))
      c.require(in.doc_q, {exactly("total_q", pb.total_q)}, DType::i32, Access::row_contiguous);
    else
      c.require(in.doc_q, {exactly("B", e.B), exactly("Sq", e.Sq)}, DType::i32, Access::row_contiguous);
    if (is_varlen_kv(pb))
      c.require(in.doc_kv, {exactly("total_kv", pb.total_kv)}, DType::i32, Access::row_contiguous);
    else if (is_paged(pb))
      c.require(in.doc_kv,
                {exactly("B", e.B), exactly("C*page_size", static_cast<std::int64_t>(pb.pages_per_seq) * pb.page_size)},
                DType::i32, Access::row_contiguous);
    else
      c.require(in.doc_kv, {exactly("B", e.B), exactly("Skv", e.Skv)}, DType::i32, Access::row_contiguous);
  }
  if (pb.mask.kv_valid_bits)
    c.require(in.kv_valid, {exactly("B", e.B), exactly("ceil(Skv/32)", ceil_div(e.Skv, 32))}, DType::u32,
              Access::row_contiguous);
  if (pb.proxy != Proxy::off) {
    const std::vector<Dim> summary = {exactly("B", e.B), exactly("nKB", e.nKB), exactly("Hkv", e.Hkv),
                                      exactly("D", e.D)};
    c.require(in.k_summary, summary, dt, Access::vectors);
    c.require(in.v_summary, summary, dt, Access::vectors);
  }
  c.reject_unread();
}

void check_outputs(const Problem& pb, const Outputs& out, const std::vector<Field>& inputs) {
  const Extents e(pb);
  expect(out.out.defined(), "outputs.out", [&] { return "is required but not given"; });
  expect_tensor(pb, "outputs.out", out.out, q_dims(pb, e), pb.out_dtype, Access::vectors);
  expect_no_self_overlap("outputs.out", out.out);
  if (out.lse.defined()) {
    expect_tensor(pb, "outputs.lse", out.lse, lse_dims(pb, e), DType::f32, Access::strided);
    expect_no_self_overlap("outputs.lse", out.lse);
  }

  const Field outputs[] = {{"outputs.out", &out.out}, {"outputs.lse", &out.lse}};
  for (const Field& o : outputs) {
    if (!o.view->defined()) continue;
    const ByteRange r = byte_range(*o.view);
    for (const Field& i : inputs)
      expect(!i.view->defined() || !overlap(r, byte_range(*i.view)), o.name,
             [&] { return std::string("overlaps input ") + i.name + " in memory; outputs must not alias inputs"; });
  }
  expect(!out.lse.defined() || !overlap(byte_range(out.out), byte_range(out.lse)), "outputs.lse",
         [&] { return "overlaps outputs.out in memory"; });
}

}  // namespace

void validate_structure(const Problem& pb, const Inputs& inputs, const Outputs& outputs) {
  InputChecker checker(pb, inputs);
  check_inputs(checker, pb, inputs);
  check_outputs(pb, outputs, checker.fields());
}

}  // namespace bsattn::formats
