#include "formats/bind.hpp"

#include <cmath>

namespace bsattn::formats {

ElementType element_type(DType t) {
  switch (t) {
    case DType::f16: return ElementType::f16;
    case DType::bf16: return ElementType::bf16;
    default: return ElementType::f32;
  }
}

namespace {

template <class T>
const T* typed(const TensorView& t) {
  return static_cast<const T*>(t.data);
}

// Strides of a block set's tensors, by format. Batched: (bs, hs, qb, i); varlen: (hs, m, i).
route::BlockSetParams bind_set(const BlockSet& set, Format format) {
  route::BlockSetParams s;
  s.counts = typed<std::int32_t>(set.counts);
  s.indices = typed<std::int32_t>(set.indices);
  s.indptr = typed<std::int32_t>(set.indptr);
  s.bits = typed<std::uint32_t>(set.bits);
  if (format == Format::block_lists) {
    for (int i = 0; i < 3; ++i) s.count_stride[i] = set.counts.stride[i];
    for (int i = 0; i < 4; ++i) s.index_stride[i] = set.indices.stride[i];
    s.list_length = static_cast<int>(set.indices.shape[3]);
  } else if (format == Format::varlen_block_lists) {
    for (int i = 0; i < 2; ++i) s.count_stride[i] = set.counts.stride[i];
    for (int i = 0; i < 2; ++i) s.index_stride[i] = set.indices.stride[i];
  } else if (format == Format::bitmask) {
    for (int i = 0; i < set.bits.rank; ++i) s.bits_stride[i] = set.bits.stride[i];
  }
  return s;
}

}  // namespace

route::RouteParams route_geometry(const Problem& pb, const TileShape& tiles, int capacity) {
  route::RouteParams p;
  p.batch = pb.batch;
  p.heads_q = pb.heads_q;
  p.heads_kv = pb.heads_kv;
  p.sparsity_heads = pb.format == Format::all_blocks ? 1 : pb.sparsity_heads;
  p.sparsity_batch = pb.sparsity_batch;
  p.block_q = pb.block.q;
  p.block_kv = pb.block.kv;
  p.tile_m = tiles.tile_m;
  p.tile_n = tiles.tile_n;
  p.unit_m = tiles.unit_m;
  p.max_seqlen_q = pb.max_seqlen_q;
  p.max_seqlen_kv = pb.max_seqlen_kv;
  p.max_q_tiles = route::ceil_div(pb.max_seqlen_q, tiles.tile_m);
  p.max_q_blocks = route::ceil_div(pb.max_seqlen_q, pb.block.q);
  p.max_kv_blocks = route::ceil_div(pb.max_seqlen_kv, pb.block.kv);
  p.varlen_q = pb.q_layout == QLayout::varlen;
  p.paged = pb.kv_layout == KVLayout::paged;
  p.varlen_kv = p.varlen_q && !p.paged;
  p.format = static_cast<route::SetFormat>(pb.format);
  p.has_partial = pb.format == Format::all_blocks || pb.has_partial;
  p.has_full = pb.format != Format::all_blocks && pb.has_full;
  p.proxy_mode = static_cast<int>(pb.proxy);
  p.causal = pb.mask.causal;
  p.top_left = pb.mask.alignment == Alignment::top_left;
  p.window_left = pb.mask.window_left;
  p.window_right = pb.mask.window_right;
  p.sink_tokens = pb.mask.sink_tokens;
  p.capacity = capacity;
  return p;
}

AttentionParams bind(const Problem& pb, const TileShape& tiles, int capacity, const Inputs& in, const Outputs& out) {
  AttentionParams a;
  a.route = route_geometry(pb, tiles, capacity);
  route::RouteParams& p = a.route;
  p.cu_seqlens_q = typed<std::int32_t>(in.cu_seqlens_q);
  p.cu_seqlens_k = typed<std::int32_t>(in.cu_seqlens_k);
  p.seqused_k = typed<std::int32_t>(in.seqused_k);
  p.seq_lens_kv = typed<std::int32_t>(in.seq_lens_kv);
  p.cu_total_m_blocks = typed<std::int32_t>(in.cu_total_m_blocks);
  p.cu_block_idx_offsets = typed<std::int32_t>(in.cu_block_idx_offsets);
  if (p.has_partial && pb.format != Format::all_blocks) p.partial = bind_set(in.partial, pb.format);
  if (p.has_full) p.full = bind_set(in.full, pb.format);
  if (pb.proxy == Proxy::explicit_set) p.proxy = bind_set(in.proxy, pb.format);
  if (pb.mask.document_ids) {
    p.doc_q = typed<std::int32_t>(in.doc_q);
    p.doc_kv = typed<std::int32_t>(in.doc_kv);
    p.doc_q_batch_stride = in.doc_q.rank == 2 ? in.doc_q.stride[0] : 0;
    p.doc_kv_batch_stride = in.doc_kv.rank == 2 ? in.doc_kv.stride[0] : 0;
  }
  if (pb.mask.kv_valid_bits) {
    p.kv_valid = typed<std::uint32_t>(in.kv_valid);
    p.kv_valid_batch_stride = in.kv_valid.stride[0];
  }

  a.head_dim = pb.head_dim;
  a.scale = pb.scale != 0.0f ? pb.scale : 1.0f / std::sqrt(static_cast<float>(pb.head_dim));
  a.in_type = element_type(pb.dtype);
  a.out_type = element_type(pb.out_dtype);

  const bool varlen_q = pb.q_layout == QLayout::varlen;
  const int t = varlen_q ? 0 : 1;  // index of the token dimension
  a.q = in.q.data;
  a.q_batch_stride = varlen_q ? 0 : in.q.stride[0];
  a.q_token_stride = in.q.stride[t];
  a.q_head_stride = in.q.stride[t + 1];
  a.out = out.out.data;
  a.out_batch_stride = varlen_q ? 0 : out.out.stride[0];
  a.out_token_stride = out.out.stride[t];
  a.out_head_stride = out.out.stride[t + 1];
  if (out.lse.defined()) {
    a.lse = static_cast<float*>(out.lse.data);
    a.lse_batch_stride = varlen_q ? 0 : out.lse.stride[0];
    a.lse_head_stride = out.lse.stride[varlen_q ? 0 : 1];
    a.lse_token_stride = out.lse.stride[varlen_q ? 1 : 2];
  }

  const bool packed_kv = p.varlen_kv;
  const int kt = packed_kv ? 0 : 1;
  a.k = in.k.data;
  a.v = in.v.data;
  a.k_batch_stride = packed_kv ? 0 : in.k.stride[0];
  a.k_token_stride = in.k.stride[kt];
  a.k_head_stride = in.k.stride[kt + 1];
  a.v_batch_stride = packed_kv ? 0 : in.v.stride[0];
  a.v_token_stride = in.v.stride[kt];
  a.v_head_stride = in.v.stride[kt + 1];
  if (p.paged) {
    a.block_table = typed<std::int32_t>(in.block_table);
    a.block_table_stride = in.block_table.stride[0];
    a.page_size = pb.page_size;
  }
  if (pb.proxy != Proxy::off) {
    a.k_summary = in.k_summary.data;
    a.v_summary = in.v_summary.data;
    a.summary_batch_stride = in.k_summary.stride[0];
    a.summary_block_stride = in.k_summary.stride[1];
    a.summary_head_stride = in.k_summary.stride[2];
    a.v_summary_batch_stride = in.v_summary.stride[0];
    a.v_summary_block_stride = in.v_summary.stride[1];
    a.v_summary_head_stride = in.v_summary.stride[2];
  }
  a.route_rows = pb.batch * p.sparsity_heads * p.max_q_tiles;
  return a;
}

}  // namespace bsattn::formats
