#include "formats/backward.hpp"

#include <string>
#include <utility>
#include <vector>

#include "formats/bind.hpp"
#include "formats/structure.hpp"
#include "formats/validate.hpp"

namespace bsattn::formats {
namespace {

using Named = std::pair<const char*, const TensorView*>;

void expect_required(const Problem& pb, const char* name, const TensorView& t, const std::vector<Dim>& dims,
                     DType dtype, Access access, const char* why) {
  expect(t.defined(), name, [&] { return std::string("is required but not given: ") + why; });
  expect_tensor(pb, name, t, dims, dtype, access);
}

// A gradient: the shape of the tensor it differentiates, in the input dtype or f32.
void expect_gradient(const Problem& pb, const char* name, const TensorView& t, const std::vector<Dim>& dims) {
  expect(t.defined(), name, [] { return "is required but not given"; });
  expect(t.dtype == pb.dtype || t.dtype == DType::f32, name, [&] {
    return std::string("has dtype ") + to_string(t.dtype) + ", expected the input dtype " + to_string(pb.dtype) +
           " or f32";
  });
  expect_tensor(pb, name, t, dims, t.dtype, Access::vectors);
  expect_no_self_overlap(name, t);
}

// Every tensor of the forward's Inputs the backward may read.
std::vector<Named> read_inputs(const Inputs& in) {
  std::vector<Named> f = {{"q", &in.q},
                          {"k", &in.k},
                          {"v", &in.v},
                          {"cu_seqlens_q", &in.cu_seqlens_q},
                          {"cu_seqlens_k", &in.cu_seqlens_k},
                          {"seqused_k", &in.seqused_k},
                          {"cu_total_m_blocks", &in.cu_total_m_blocks},
                          {"cu_block_idx_offsets", &in.cu_block_idx_offsets},
                          {"doc_q", &in.doc_q},
                          {"doc_kv", &in.doc_kv},
                          {"kv_valid", &in.kv_valid}};
  for (const BlockSet* set : {&in.partial, &in.full})
    for (const TensorView* t : {&set->counts, &set->indices, &set->indptr, &set->bits})
      f.push_back({set == &in.partial ? "partial" : "full", t});
  return f;
}

TokenStrides q_like_strides(const Problem& pb, const TensorView& t) {
  if (is_varlen(pb)) return {0, t.stride[0], t.stride[1]};
  return {t.stride[0], t.stride[1], t.stride[2]};
}

TokenStrides kv_like_strides(const Problem& pb, const TensorView& t) {
  if (is_varlen_kv(pb)) return {0, t.stride[0], t.stride[1]};
  return {t.stride[0], t.stride[1], t.stride[2]};
}

ElementType element_type(const AttentionParams& a, DType t) { return t == DType::f32 ? ElementType::f32 : a.in_type; }

}  // namespace

void validate_backward(const Problem& pb, const Inputs& in, const BackwardInputs& bw, const Gradients& grads) {
  expect(pb.proxy == Proxy::off, "problem.proxy", [&] {
    return std::string("= ") + to_string(pb.proxy) + ": backward of proxy routes is not supported; use proxy off";
  });
  expect(!is_paged(pb), "problem.kv_layout", [] {
    return "paged: the backward does not take paged KV (its gradients have no page layout); use contiguous or varlen "
           "K/V";
  });

  const Extents e(pb);
  const std::vector<Dim> q = q_dims(pb, e), kv = kv_dims(pb, e);
  expect_required(pb, "backward.out", bw.out, q, pb.out_dtype, Access::vectors, "the forward's output O");
  expect_required(pb, "backward.lse", bw.lse, lse_dims(pb, e), DType::f32, Access::strided,
                  "the forward's LSE (P is recomputed from it)");
  expect_required(pb, "backward.dout", bw.dout, q, pb.out_dtype, Access::vectors, "the gradient of O");
  if (bw.dlse.defined()) expect_tensor(pb, "backward.dlse", bw.dlse, lse_dims(pb, e), DType::f32, Access::strided);
  expect_gradient(pb, "gradients.dq", grads.dq, q);
  expect_gradient(pb, "gradients.dk", grads.dk, kv);
  expect_gradient(pb, "gradients.dv", grads.dv, kv);

  std::vector<Named> read = read_inputs(in);
  read.insert(read.end(), {{"backward.out", &bw.out},
                           {"backward.lse", &bw.lse},
                           {"backward.dout", &bw.dout},
                           {"backward.dlse", &bw.dlse}});
  const Named written[] = {{"gradients.dq", &grads.dq}, {"gradients.dk", &grads.dk}, {"gradients.dv", &grads.dv}};
  for (const Named& w : written) {
    const ByteRange r = byte_range(*w.second);
    for (const Named& i : read)
      expect(!i.second->defined() || !overlap(r, byte_range(*i.second)), w.first,
             [&] { return std::string("overlaps ") + i.first + " in memory; gradients must not alias inputs"; });
    for (const Named& other : written)
      expect(&other == &w || !overlap(r, byte_range(*other.second)), w.first,
             [&] { return std::string("overlaps ") + other.first + " in memory"; });
  }

  // The forward's inputs, with O and LSE in the places of its outputs (they pass: checked above).
  Outputs as_forward;
  as_forward.out = bw.out;
  as_forward.lse = bw.lse;
  validate_structure(pb, in, as_forward);
}

BackwardParams bind_backward(const Problem& pb, const TileShape& tiles, int capacity, const Inputs& in,
                             const BackwardInputs& bw, const Gradients& grads) {
  Outputs as_forward;
  as_forward.out = bw.out;
  as_forward.lse = bw.lse;
  BackwardParams g;
  g.fwd = bind(pb, tiles, capacity, in, as_forward);
  g.dout = bw.dout.data;
  g.dout_strides = q_like_strides(pb, bw.dout);
  if (bw.dlse.defined()) {
    const bool varlen = is_varlen(pb);
    g.dlse = static_cast<const float*>(bw.dlse.data);
    g.dlse_batch_stride = varlen ? 0 : bw.dlse.stride[0];
    g.dlse_head_stride = bw.dlse.stride[varlen ? 0 : 1];
    g.dlse_token_stride = bw.dlse.stride[varlen ? 1 : 2];
  }
  g.dq = grads.dq.data;
  g.dq_strides = q_like_strides(pb, grads.dq);
  g.dq_type = element_type(g.fwd, grads.dq.dtype);
  g.dk = grads.dk.data;
  g.dk_strides = kv_like_strides(pb, grads.dk);
  g.dk_type = element_type(g.fwd, grads.dk.dtype);
  g.dv = grads.dv.data;
  g.dv_strides = kv_like_strides(pb, grads.dv);
  g.dv_type = element_type(g.fwd, grads.dv.dtype);
  return g;
}

}  // namespace bsattn::formats
