// select_blocks() (SPEC §7): validation and binding, the CPU engine (one row at a time on a thread
// pool), and the launch of the GPU kernel. The row arithmetic is route/selection.hpp's, shared
// with the kernel; this file is compiled with -ffp-contract=off (CMakeLists.txt).
#include "bsattn/select.hpp"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "bsattn/cpu/engine.hpp"
#include "bsattn/route/selection.hpp"
#include "formats/bind.hpp"
#include "formats/validate_select.hpp"
#if BSATTN_WITH_CUDA
#include "gpu/device_guard.hpp"
#include "gpu/select_blocks.hpp"
#endif

namespace bsattn {
namespace {

route::SelectRule select_rule(const SelectOptions& o) {
  route::SelectRule r;
  r.policy = static_cast<route::SelectPolicyKind>(o.policy);
  r.top_k = o.top_k;
  r.tau = o.tau;
  r.mass = o.mass;
  r.sinks = o.sinks;
  r.local = o.local;
  r.diagonal = o.diagonal;
  r.causal = o.causal;
  return r;
}

route::SelectParams bind_select(const Problem& geometry, const TileShape& tiles, const Inputs& in,
                                const SelectOptions& o, const TensorView& bits) {
  route::SelectParams sp;
  sp.tensors = formats::bind(geometry, tiles, 0, in, Outputs{});
  AttentionParams& a = sp.tensors;
  a.route.top_left = o.alignment == Alignment::top_left;
  a.k_summary = in.k_summary.data;
  a.summary_batch_stride = in.k_summary.stride[0];
  a.summary_block_stride = in.k_summary.stride[1];
  a.summary_head_stride = in.k_summary.stride[2];
  sp.rule = select_rule(o);
  sp.heads = select_sparsity_heads(geometry, o);
  sp.group = geometry.heads_q / sp.heads;
  sp.bits = static_cast<std::uint32_t*>(bits.data);
  for (int i = 0; i < bits.rank; ++i) sp.bits_stride[i] = bits.stride[i];
  sp.words = static_cast<int>(bits.shape[bits.rank - 1]);
  sp.rows = static_cast<int>(a.route.varlen_q ? bits.shape[1] : bits.shape[0] * bits.shape[2]);
  sp.max_kv_blocks = a.route.max_kv_blocks;
  return sp;
}

// One thread's buffers, sized for the longest row.
struct RowScratch {
  std::vector<float> sum, row, pooled, scores, chunk_totals;
  std::vector<std::uint64_t> keys;
  std::vector<char> selected;
  RowScratch(int d, int kv_blocks)
      : sum(d),
        row(d),
        pooled(d),
        scores(kv_blocks),
        chunk_totals(route::ceil_div(kv_blocks, route::kSelectChunk)),
        keys(kv_blocks),
        selected(kv_blocks) {}
};

// Blocks the policy picks (forced ones are added by the caller). keys / scores: the visible ones.
void apply_policy(const route::SelectRule& rule, const route::SelectRowShape& shape, RowScratch& x) {
  const int n = shape.visible;
  const float* scores = x.scores.data();
  const int chunks = route::ceil_div(n, route::kSelectChunk);
  const auto chunk_end = [&](int c) { return std::min(n, (c + 1) * route::kSelectChunk); };
  switch (rule.policy) {
    case route::SelectPolicyKind::top_k: {
      int forced = 0, candidates = 0;
      for (int j = 0; j < n; ++j) {
        if (route::select_forced(rule, shape, j)) ++forced;
        else x.keys[candidates++] = route::select_key(scores[j], j);
      }
      const int picks = std::min(candidates, std::max(0, rule.top_k - forced));
      std::partial_sort(x.keys.begin(), x.keys.begin() + picks, x.keys.begin() + candidates, std::greater<>());
      for (int i = 0; i < picks; ++i) x.selected[route::select_key_block(x.keys[i])] = 1;
      break;
    }
    case route::SelectPolicyKind::tau: {
      const float sum = route::sum_chunks(chunks, [&](int c) {
        return route::chunk_fold(c * route::kSelectChunk, chunk_end(c),
                                 [&](float acc, int j) { return route::fold_sum(acc, scores[j]); });
      });
      const float mean = route::row_mean(sum, n);
      const float squares = route::sum_chunks(chunks, [&](int c) {
        return route::chunk_fold(c * route::kSelectChunk, chunk_end(c),
                                 [&](float acc, int j) { return route::fold_squared_deviation(acc, scores[j], mean); });
      });
      const float threshold = route::tau_threshold(mean, squares, n, rule.tau);
      for (int j = 0; j < n; ++j)
        if (scores[j] >= threshold) x.selected[j] = 1;
      break;
    }
    case route::SelectPolicyKind::mass: {
      for (int j = 0; j < n; ++j) x.keys[j] = route::select_key(scores[j], j);
      std::sort(x.keys.begin(), x.keys.begin() + n, std::greater<>());
      const auto sorted_score = [&](int i) { return scores[route::select_key_block(x.keys[i])]; };
      const float row_max = sorted_score(0);
      std::vector<float>& totals = x.chunk_totals;
      for (int c = 0; c < chunks; ++c)
        totals[c] = route::chunk_fold(c * route::kSelectChunk, chunk_end(c), [&](float acc, int i) {
          return route::fold_mass(acc, sorted_score(i), row_max);
        });
      const float total = route::sum_chunks(chunks, [&](int c) { return totals[c]; });
      const float target = route::mass_target(rule.mass, total);
      int below = 0;
      float offset = 0.0f;
      for (int c = 0; c < chunks; ++c) {
        below += route::mass_below_target(c * route::kSelectChunk, chunk_end(c), offset, row_max, target, sorted_score);
        offset = route::add_rn(offset, totals[c]);
      }
      const int picks = std::min(n, below + 1);
      for (int i = 0; i < picks; ++i) x.selected[route::select_key_block(x.keys[i])] = 1;
      break;
    }
  }
}

void select_row(const route::SelectParams& sp, int hs, int row, RowScratch& x) {
  const AttentionParams& a = sp.tensors;
  const route::RouteParams& p = a.route;
  const int d = a.head_dim;
  route::SelectRowShape shape;
  int b = 0, qb = 0;
  route::SeqInfo s;
  if (route::select_row_position(p, row, b, qb)) {
    s = route::seq_info(p, b);
    shape = route::select_row_shape(sp.rule, s, p.block_q, p.block_kv, qb);
  }
  const int n = shape.visible;
  std::fill(x.selected.begin(), x.selected.begin() + n, 0);
  if (n > 0) {
    const int q0 = qb * p.block_q, q1 = std::min(q0 + p.block_q, s.seqlen_q);
    std::fill(x.sum.begin(), x.sum.end(), 0.0f);
    for (int h = hs * sp.group; h < (hs + 1) * sp.group; ++h)
      for (int q = q0; q < q1; ++q) {
        cpu::detail::load_row(a.q, a.q_offset(b, s, q, h), d, a.in_type, x.row.data());
        for (int i = 0; i < d; ++i) x.sum[i] = route::add_rn(x.sum[i], x.row[i]);
      }
    for (int i = 0; i < d; ++i) x.pooled[i] = route::pooled_query(x.sum[i], q1 - q0, a.scale);
    const int hkv = hs * sp.group / (p.heads_q / p.heads_kv);
    for (int j = 0; j < n; ++j) {
      cpu::detail::load_row(a.k_summary, b * a.summary_batch_stride + j * a.summary_block_stride + hkv * a.summary_head_stride,
                            d, a.in_type, x.row.data());
      float acc = 0.0f;
      for (int i = 0; i < d; ++i) acc = route::fma_rn(x.pooled[i], x.row[i], acc);
      x.scores[j] = acc;
    }
    apply_policy(sp.rule, shape, x);
    for (int j = 0; j < n; ++j)
      if (route::select_forced(sp.rule, shape, j)) x.selected[j] = 1;
  }
  std::uint32_t* words = sp.row_words(hs, row);
  const std::int64_t stride = sp.word_stride();
  for (int w = 0; w < sp.words; ++w) {
    std::uint32_t word = 0;
    for (int r = 0; r < 32 && 32 * w + r < n; ++r)
      if (x.selected[32 * w + r]) word |= 1u << r;
    words[w * stride] = word;
  }
}

void select_cpu(const route::SelectParams& sp, int num_threads) {
  const int threads =
      num_threads > 0 ? num_threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu::ThreadPool pool(threads);
  std::vector<RowScratch> scratch(pool.size(), RowScratch(sp.tensors.head_dim, std::max(1, sp.max_kv_blocks)));
  pool.parallel_for(static_cast<std::int64_t>(sp.heads) * sp.rows, [&](std::int64_t item, int thread) {
    select_row(sp, static_cast<int>(item / sp.rows), static_cast<int>(item % sp.rows), scratch[thread]);
  });
}

}  // namespace

int select_sparsity_heads(const Problem& problem, const SelectOptions& options) {
  return options.heads == SelectHeads::kv ? problem.heads_kv : problem.heads_q;
}

void select_blocks(const Problem& problem, const Inputs& inputs, const SelectOptions& options, const TensorView& bits,
                   Stream stream) {
  const Problem geometry = formats::selection_geometry(problem);
  const TileShape tiles = choose_tiles(geometry);
  formats::validate_select(problem, tiles, inputs, options, bits);
  const route::SelectParams sp = bind_select(geometry, tiles, inputs, options, bits);
  if (sp.rows == 0 || sp.words == 0) return;
  if (problem.device == Device::cuda) {
#if BSATTN_WITH_CUDA
    if (sp.max_kv_blocks > gpu::kSelectMaxKvBlocks)
      throw Error("problem.max_seqlen_kv", "gives " + std::to_string(sp.max_kv_blocks) +
                                               " KV blocks per sequence; the GPU selection kernel sorts at most " +
                                               std::to_string(gpu::kSelectMaxKvBlocks) + " (use a larger block.kv)");
    gpu::DeviceGuard guard(problem.device_index);
    gpu::cuda_check(gpu::select_blocks(sp, static_cast<cudaStream_t>(stream)), "select_blocks kernel launch");
    return;
#else
    throw Error("problem.device", "cuda: this build has no GPU code (BSATTN_ENABLE_CUDA=OFF); use Device::cpu");
#endif
  }
  (void)stream;
  select_cpu(sp, problem.num_threads);
}

}  // namespace bsattn
