#include "bsattn/summary.hpp"

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "bsattn/cpu/engine.hpp"
#include "formats/bind.hpp"
#include "formats/validate.hpp"
#include "formats/validate_summary.hpp"
#if BSATTN_WITH_CUDA
#include "gpu/device_guard.hpp"
#include "gpu/summaries.hpp"
#endif

namespace bsattn {

namespace {

#if BSATTN_WITH_CUDA
void build_on_gpu(const Problem& problem, const AttentionParams& a, int kv_blocks, const TensorView& k_summary,
                  const TensorView& v_summary, Stream stream) {
  formats::validate_summary_launch(problem);
  gpu::SummaryOutputs o;
  o.k = k_summary.data;
  o.v = v_summary.data;
  o.k_batch_stride = k_summary.stride[0];
  o.k_block_stride = k_summary.stride[1];
  o.k_head_stride = k_summary.stride[2];
  o.v_batch_stride = v_summary.stride[0];
  o.v_block_stride = v_summary.stride[1];
  o.v_head_stride = v_summary.stride[2];
  o.kv_blocks = kv_blocks;
  gpu::DeviceGuard guard(problem.device_index);
  gpu::cuda_check(gpu::build_summaries(a, o, static_cast<cudaStream_t>(stream)), "summary kernel launch");
}
#endif

}  // namespace

void build_summaries(const Problem& problem, const Inputs& inputs, const TensorView& k_summary,
                     const TensorView& v_summary, Stream stream) {
  const TileShape tiles = choose_tiles(problem);
  formats::validate_problem(problem, tiles);
  formats::validate_summary_build(problem, tiles, inputs, k_summary, v_summary);
  const int kv_blocks = route::ceil_div(problem.max_seqlen_kv, problem.block.kv);

  // Bind with the summaries as the only "output": the KV addressing is the engines' own.
  Problem kv_only = problem;
  kv_only.proxy = Proxy::off;
  AttentionParams a = formats::bind(kv_only, tiles, 0, inputs, Outputs{});
  if (problem.device == Device::cuda) {
#if BSATTN_WITH_CUDA
    build_on_gpu(problem, a, kv_blocks, k_summary, v_summary, stream);
    return;
#else
    throw Error("problem.device", "cuda: this build has no GPU code (BSATTN_ENABLE_CUDA=OFF); use Device::cpu");
#endif
  }
  (void)stream;
  const ElementType type = a.in_type;
  const int d = problem.head_dim, bk = problem.block.kv;

  const std::int64_t items = static_cast<std::int64_t>(problem.batch) * kv_blocks * problem.heads_kv;
  const int threads = problem.num_threads > 0 ? problem.num_threads
                                              : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu::ThreadPool pool(threads);
  std::vector<float> scratch(static_cast<std::size_t>(pool.size()) * 3 * d);
  pool.parallel_for(items, [&](std::int64_t item, int thread) {
    const int h = static_cast<int>(item % problem.heads_kv);
    const int j = static_cast<int>((item / problem.heads_kv) % kv_blocks);
    const int b = static_cast<int>(item / (static_cast<std::int64_t>(problem.heads_kv) * kv_blocks));
    const route::SeqInfo s = route::seq_info(a.route, b);
    float* k_acc = scratch.data() + static_cast<std::size_t>(thread) * 3 * d;
    float* v_acc = k_acc + d;
    float* row = v_acc + d;
    std::fill(k_acc, k_acc + 2 * d, 0.0f);
    const int k0 = j * bk, k1 = std::min(k0 + bk, s.seqlen_kv);
    for (int kv = k0; kv < k1; ++kv) {
      cpu::detail::load_row(a.k, a.kv_offset(b, s, kv, h, a.k_batch_stride, a.k_token_stride, a.k_head_stride), d, type, row);
      for (int i = 0; i < d; ++i) k_acc[i] += row[i];
      cpu::detail::load_row(a.v, a.kv_offset(b, s, kv, h, a.v_batch_stride, a.v_token_stride, a.v_head_stride), d, type, row);
      for (int i = 0; i < d; ++i) v_acc[i] += row[i];
    }
    const float inv_n = k1 > k0 ? 1.0f / static_cast<float>(k1 - k0) : 0.0f;
    for (int i = 0; i < d; ++i) k_acc[i] *= inv_n;
    cpu::detail::store_row(k_summary.data, b * k_summary.stride[0] + j * k_summary.stride[1] + h * k_summary.stride[2], d,
                           type, k_acc);
    cpu::detail::store_row(v_summary.data, b * v_summary.stride[0] + j * v_summary.stride[1] + h * v_summary.stride[2], d,
                           type, v_acc);
  });
}

}  // namespace bsattn
