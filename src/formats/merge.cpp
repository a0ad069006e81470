#include "formats/merge.hpp"

#include <string>

#include "formats/bind.hpp"
#include "formats/structure.hpp"

namespace bsattn::formats {
namespace {

std::string device_label(const TensorView& t) { return std::string(to_string(t.device)) + ":" + str(t.device_index); }

void expect_same_device(const char* name, const TensorView& t, const char* reference_name,
                        const TensorView& reference) {
  const bool same =
      t.device == reference.device && (t.device == Device::cpu || t.device_index == reference.device_index);
  expect(same, name, [&] {
    return "is on " + device_label(t) + ", but " + reference_name + " is on " + device_label(reference) +
           "; every tensor of a merge must be on one device";
  });
}

// A part's O is batched [B, S, H, D] or varlen [total, H, D]; its LSE [B, H, S] or [H, total].
struct PartShapes {
  std::vector<Dim> out, lse;
};

// The shapes every part and the output must have, read from the first part's O (minus the
// stacked N). Stacked shapes get N in front.
PartShapes part_shapes(const MergePart& first, bool stacked) {
  const TensorView& t = *first.out;
  const int lead = stacked ? 1 : 0;
  expect(t.rank == 4 + lead || t.rank == 3 + lead, first.out_name, [&] {
    return "has rank " + str(t.rank) + " (shape " + t.shape_string() + "), expected " +
           (stacked ? "[N, B, S, H, D] or [N, total, H, D]" : "[B, S, H, D] (batched) or [total, H, D] (varlen)");
  });
  const auto extent = [&](int i) { return t.shape[lead + i]; };
  PartShapes s;
  if (t.rank == 4 + lead) {
    s.out = {exactly("B", extent(0)), exactly("S", extent(1)), exactly("H", extent(2)), exactly("D", extent(3))};
    s.lse = {exactly("B", extent(0)), exactly("H", extent(2)), exactly("S", extent(1))};
  } else {
    s.out = {exactly("total", extent(0)), exactly("H", extent(1)), exactly("D", extent(2))};
    s.lse = {exactly("H", extent(1)), exactly("total", extent(0))};
  }
  return s;
}

bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.rank != b.rank) return false;
  for (int i = 0; i < a.rank; ++i)
    if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.stride[i] != b.stride[i])) return false;
  return true;
}

// `output` is `input` itself, or (stacked) one of its parts: the in-place use merge.hpp allows.
bool is_part_of(const TensorView& output, const TensorView& input, bool stacked) {
  if (!stacked) return same_view(output, input);
  TensorView part = input;
  part.rank = input.rank - 1;
  for (int i = 0; i < part.rank; ++i) {
    part.shape[i] = input.shape[i + 1];
    part.stride[i] = input.stride[i + 1];
  }
  const std::int64_t step = input.stride[0] * static_cast<std::int64_t>(element_size(input.dtype));
  const std::int64_t distance = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(output.data) -
                                                          reinterpret_cast<std::uintptr_t>(input.data));
  const std::int64_t k = step > 0 && distance % step == 0 ? distance / step : 0;
  if (k < 0 || k >= input.shape[0]) return false;
  part.data = static_cast<char*>(input.data) + k * step;
  return same_view(output, part);
}

}  // namespace

void validate_merge(const std::vector<MergePart>& parts, bool stacked, const TensorView& out, const TensorView& lse) {
  for (const MergePart& p : parts) {
    expect(p.out->defined(), p.out_name, [] { return "is required but not given"; });
    expect(p.lse->defined(), p.lse_name, [] { return "is required but not given (merging needs every part's LSE)"; });
  }
  expect(out.defined(), "out", [] { return "is required but not given"; });
  const MergePart& first = parts.front();
  const PartShapes shapes = part_shapes(first, stacked);
  const DType dtype = first.out->dtype;
  expect(dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16, first.out_name,
         [&] { return std::string("has dtype ") + to_string(dtype) + ", expected f32, f16 or bf16"; });
  PartShapes part = shapes;
  if (stacked) {
    const std::int64_t n = first.out->shape[0];
    expect(n >= 1 && n <= kInt32Max, first.out_name, [&] {
      return "has shape " + first.out->shape_string() + ": N = " + str(n) +
             " partial results on the leading dimension, expected 1 to " + str(kInt32Max);
    });
    part.out.insert(part.out.begin(), exactly("N", n));
    part.lse.insert(part.lse.begin(), exactly("N", n));
  }

  const auto check = [&](const char* name, const TensorView& t, const std::vector<Dim>& dims, DType want,
                         Access access) {
    expect_same_device(name, t, first.out_name, *first.out);
    expect_shape(name, t, dims);
    expect_dtype(name, t, want);
    expect_strides(name, t, access);
  };
  for (const MergePart& p : parts) {
    check(p.out_name, *p.out, part.out, dtype, Access::row_contiguous);
    check(p.lse_name, *p.lse, part.lse, DType::f32, Access::strided);
  }
  check("out", out, shapes.out, dtype, Access::row_contiguous);
  expect_no_self_overlap("out", out);
  if (lse.defined()) {
    check("lse", lse, shapes.lse, DType::f32, Access::strided);
    expect_no_self_overlap("lse", lse);
    expect(!overlap(byte_range(out), byte_range(lse)), "lse", [] { return "overlaps out in memory"; });
  }

  // In place is safe only as the very same view: each (row, head) then reads its own elements
  // before writing them, and no other one reads them.
  for (const auto& [name, output] : {std::pair<const char*, const TensorView*>{"out", &out}, {"lse", &lse}}) {
    if (!output->defined()) continue;
    for (const MergePart& p : parts)
      for (const auto& [input_name, input] :
           {std::pair<const char*, const TensorView*>{p.out_name, p.out}, {p.lse_name, p.lse}})
        expect(!overlap(byte_range(*output), byte_range(*input)) || is_part_of(*output, *input, stacked), name, [&] {
          return std::string("overlaps input ") + input_name +
                 " in memory; an output may alias an input only as exactly one of the parts (same address, shape and "
                 "strides)";
        });
  }
}

namespace {

merge::Layout layout_of(const TensorView& out, const TensorView& lse, int lead) {
  merge::Layout l;
  l.out = out.data;
  l.lse = static_cast<float*>(lse.data);
  const std::int64_t* o = out.stride.data() + lead;
  const std::int64_t* s = lse.stride.data() + lead;
  if (out.rank - lead == 4) {
    l.out_batch_stride = o[0], l.out_token_stride = o[1], l.out_head_stride = o[2];
    if (lse.defined()) l.lse_batch_stride = s[0], l.lse_head_stride = s[1], l.lse_token_stride = s[2];
  } else {
    l.out_token_stride = o[0], l.out_head_stride = o[1];
    if (lse.defined()) l.lse_head_stride = s[0], l.lse_token_stride = s[1];
  }
  return l;
}

}  // namespace

merge::MergeParams bind_merge(const std::vector<MergePart>& parts, bool stacked, const TensorView& out,
                              const TensorView& lse) {
  merge::MergeParams p;
  p.type = element_type(out.dtype);
  const int lead = stacked ? 1 : 0;
  const TensorView& o = *parts.front().out;
  p.parts = stacked ? static_cast<int>(o.shape[0]) : static_cast<int>(parts.size());
  if (o.rank - lead == 4) {
    p.batch = o.shape[lead], p.tokens = o.shape[lead + 1], p.heads = o.shape[lead + 2];
    p.head_dim = static_cast<int>(o.shape[lead + 3]);
  } else {
    p.batch = 1, p.tokens = o.shape[lead], p.heads = o.shape[lead + 1];
    p.head_dim = static_cast<int>(o.shape[lead + 2]);
  }
  p.first = layout_of(o, *parts.front().lse, lead);
  p.second = stacked ? p.first : layout_of(*parts[1].out, *parts[1].lse, 0);
  if (stacked) p.out_part_step = o.stride[0], p.lse_part_step = parts.front().lse->stride[0];
  p.result = layout_of(out, lse, 0);
  return p;
}

}  // namespace bsattn::formats
