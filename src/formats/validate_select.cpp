#include "formats/validate_select.hpp"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "formats/structure.hpp"
#include "formats/validate.hpp"

namespace bsattn::formats {

void validate_select_options(const SelectOptions& o) {
  const int policy = static_cast<int>(o.policy);
  expect(policy >= 0 && policy <= static_cast<int>(SelectPolicy::mass), "options.policy",
         [&] { return "= " + str(policy) + " is not a known value"; });
  const int heads = static_cast<int>(o.heads);
  expect(heads >= 0 && heads <= static_cast<int>(SelectHeads::kv), "options.heads",
         [&] { return "= " + str(heads) + " is not a known value"; });
  const int alignment = static_cast<int>(o.alignment);
  expect(alignment >= 0 && alignment <= static_cast<int>(Alignment::top_left), "options.alignment",
         [&] { return "= " + str(alignment) + " is not a known value"; });
  if (o.policy == SelectPolicy::top_k)
    expect(o.top_k >= 1, "options.top_k", [&] { return "= " + str(o.top_k) + ", expected at least 1"; });
  if (o.policy == SelectPolicy::tau)
    expect(std::isfinite(o.tau), "options.tau", [&] { return "= " + std::to_string(o.tau) + ", expected a finite value"; });
  if (o.policy == SelectPolicy::mass)
    expect(o.mass > 0.0f && o.mass <= 1.0f, "options.mass",
           [&] { return "= " + std::to_string(o.mass) + ", expected a fraction in (0, 1]"; });
  expect(o.sinks >= 0, "options.sinks", [&] { return "= " + str(o.sinks) + ", expected at least 0"; });
  expect(o.local >= 0, "options.local", [&] { return "= " + str(o.local) + ", expected at least 0"; });
}

Problem selection_geometry(const Problem& problem) {
  Problem g = problem;
  g.format = Format::all_blocks;
  g.has_partial = true;
  g.has_full = false;
  g.proxy = Proxy::off;
  g.mask = MaskSpec{};
  g.sparsity_heads = 1;
  g.sparsity_batch = 1;
  return g;
}

void validate_select(const Problem& problem, const TileShape& tiles, const Inputs& in, const SelectOptions& o,
                     const TensorView& bits) {
  const Problem pb = selection_geometry(problem);
  validate_problem(pb, tiles);
  validate_select_options(o);
  const Extents e(pb);
  const auto given = [&](const char* name, const TensorView& t, const std::vector<Dim>& dims, DType dtype,
                         Access access) {
    expect(t.defined(), name, [] { return "is required but not given"; });
    expect_tensor(pb, name, t, dims, dtype, access);
  };
  given("q", in.q, q_dims(pb, e), pb.dtype, Access::vectors);
  given("k_summary", in.k_summary, {exactly("B", e.B), exactly("nKB", e.nKB), exactly("Hkv", e.Hkv), exactly("D", e.D)},
        pb.dtype, Access::vectors);

  const std::int64_t hs = o.heads == SelectHeads::kv ? e.Hkv : e.Hq;
  if (is_varlen(pb))
    given("bits", bits, {exactly("Hs", hs), any_extent("M"), at_least("W", e.words)}, DType::u32, Access::strided);
  else
    given("bits", bits, {exactly("B", e.B), exactly("Hs", hs), exactly("nQB", e.nQB), at_least("W", e.words)},
          DType::u32, Access::strided);
  expect_no_self_overlap("bits", bits);
  const std::pair<const char*, const TensorView*> inputs[] = {
      {"q", &in.q},           {"k_summary", &in.k_summary}, {"cu_seqlens_q", &in.cu_seqlens_q},
      {"cu_seqlens_k", &in.cu_seqlens_k}, {"seqused_k", &in.seqused_k}, {"seq_lens_kv", &in.seq_lens_kv}};
  for (const auto& [name, input] : inputs)
    expect(!input->defined() || !overlap(byte_range(bits), byte_range(*input)), "bits",
           [&] { return std::string("overlaps input ") + name + " in memory; outputs must not alias inputs"; });

  if (!pb.validate) {
    validate_lengths(pb, tiles, in);
    return;
  }
  const std::vector<std::int64_t> m_blocks = checked_m_block_offsets(pb, tiles, in);
  if (is_varlen(pb))
    expect(bits.shape[1] >= m_blocks[pb.batch], "bits", [&] {
      return "has " + str(bits.shape[1]) + " rows (dimension 1), but the sequences have total_m_blocks = " +
             str(m_blocks[pb.batch]);
    });
}

}  // namespace bsattn::formats
