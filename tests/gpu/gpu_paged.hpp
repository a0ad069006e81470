// A case's K/V moved into a page cache (scattered pages, padded block-table rows, NaN in cache
// tokens no sequence owns, table entries past a sequence's pages far outside the cache, so a stray
// read shows), shared by the paged and decode GPU tests.
#pragma once
#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_case.hpp"

namespace bsattn_gpu_test {

// The buffers page_kv adds: block table [B, row_stride], seq_lens_kv, K and V caches.
struct PagedBuffers {
  Buffer *table, *lens, *k_cache, *v_cache;
  int row_stride;
};

// Moves the case's K/V into a page cache of `page_size` tokens per page.
inline PagedBuffers page_kv(Case& c, int page_size, std::mt19937_64& rng) {
  Problem& p = c.problem;
  const int B = p.batch, hkv = p.heads_kv, D = p.head_dim;
  const int C = (p.max_seqlen_kv + page_size - 1) / page_size;
  const int row_stride = C + 3;  // padded rows: the columns past C are never read
  std::vector<int> pages_of(B);
  int used = 0;
  for (int b = 0; b < B; ++b) used += pages_of[b] = (c.seqlen_kv[b] + page_size - 1) / page_size;
  const int num_pages = used + 5;  // spare pages that no sequence owns
  std::vector<int> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);

  Buffer* table = c.add(DType::i32, {B, row_stride});
  std::fill(table->as<std::int32_t>(), table->as<std::int32_t>() + B * row_stride, 1 << 30);
  Buffer* lens = c.add_values(DType::i32, c.seqlen_kv, {B});
  Buffer* kc = c.add(p.dtype, {num_pages, page_size, hkv, D});
  Buffer* vc = c.add(p.dtype, {num_pages, page_size, hkv, D});
  std::fill(kc->host.begin(), kc->host.end(), 0xff);  // NaN in f16 and bf16
  std::fill(vc->host.begin(), vc->host.end(), 0xff);
  const bool varlen = c.varlen();
  std::int64_t kv_base = 0;
  int next = 0;
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < pages_of[b]; ++i) table->as<std::int32_t>()[b * row_stride + i] = perm[next++];
    for (int t = 0; t < c.seqlen_kv[b]; ++t) {
      const std::int64_t page = table->as<std::int32_t>()[b * row_stride + t / page_size];
      const std::int64_t src = (varlen ? kv_base + t : static_cast<std::int64_t>(b) * p.max_seqlen_kv + t) * hkv * D;
      const std::int64_t dst = (page * page_size + t % page_size) * hkv * D;
      std::copy_n(c.k->as<std::uint16_t>() + src, hkv * D, kc->as<std::uint16_t>() + dst);
      std::copy_n(c.v->as<std::uint16_t>() + src, hkv * D, vc->as<std::uint16_t>() + dst);
    }
    kv_base += c.seqlen_kv[b];
  }
  for (Buffer* buf : {table, lens, kc, vc}) buf->upload();

  p.kv_layout = KVLayout::paged;
  p.page_size = page_size;
  p.num_pages = num_pages;
  p.pages_per_seq = C;
  for (Inputs* in : {&c.in_host, &c.in_device}) {
    const Device where = in == &c.in_host ? Device::cpu : Device::cuda;
    in->k = kc->view(where);
    in->v = vc->view(where);
    in->seq_lens_kv = lens->view(where);
    in->block_table = table->view(where);
    in->block_table.shape[1] = C;  // [B, C] with the padded row stride
    in->cu_seqlens_k = {};
    in->seqused_k = {};
  }
  return {table, lens, kc, vc, row_stride};
}

// New values at the same addresses, for graph replays: each sequence keeps a random prefix of at
// least half its tokens (seq_lens_kv), in freshly shuffled pages (block_table, K/V caches).
inline void shorten_and_move_pages(const Problem& p, const PagedBuffers& pb, int page_size, std::mt19937_64& rng) {
  const std::int64_t page_elems = static_cast<std::int64_t>(page_size) * p.heads_kv * p.head_dim;
  std::vector<int> perm(p.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::int32_t> table(pb.table->as<std::int32_t>(), pb.table->as<std::int32_t>() + p.batch * pb.row_stride);
  std::vector<unsigned char> k_old = pb.k_cache->host, v_old = pb.v_cache->host;
  std::fill(pb.k_cache->host.begin(), pb.k_cache->host.end(), 0xff);
  std::fill(pb.v_cache->host.begin(), pb.v_cache->host.end(), 0xff);
  std::fill(pb.table->as<std::int32_t>(), pb.table->as<std::int32_t>() + p.batch * pb.row_stride, 1 << 30);
  int next = 0;
  for (int b = 0; b < p.batch; ++b) {
    const int len = pb.lens->as<std::int32_t>()[b];
    const int kept = len ? std::uniform_int_distribution<int>(len / 2, len)(rng) : 0;
    pb.lens->as<std::int32_t>()[b] = kept;
    for (int i = 0; i < (kept + page_size - 1) / page_size; ++i) {
      const int from = table[b * pb.row_stride + i], to = perm[next++];
      pb.table->as<std::int32_t>()[b * pb.row_stride + i] = to;
      for (auto [dst, src] : {std::pair{pb.k_cache, &k_old}, std::pair{pb.v_cache, &v_old}})
        std::copy_n(src->data() + from * page_elems * 2, page_elems * 2, dst->host.data() + to * page_elems * 2);
    }
  }
  for (Buffer* buf : {pb.table, pb.lens, pb.k_cache, pb.v_cache}) buf->upload();
}

}  // namespace bsattn_gpu_test
