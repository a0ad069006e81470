#include "bsattn/merge.hpp"

#include <algorithm>
#include <string>
#include <thread>

#include "bsattn/cpu/engine.hpp"
#include "formats/merge.hpp"
#if BSATTN_WITH_CUDA
#include "gpu/device_guard.hpp"
#include "gpu/merge_states.hpp"
#endif

namespace bsattn {
namespace {

// Below this many elements read and written, starting worker threads costs more than it saves.
constexpr std::int64_t kParallelElements = std::int64_t(1) << 20;

// All heads of one token row (b, s), D in chunks: each part's LSE, then its O if it counts.
void merge_token_row(const merge::MergeParams& p, std::int64_t row) {
  constexpr int kChunk = 256;
  float acc[kChunk], part[kChunk];
  const std::int64_t b = row / p.tokens, s = row % p.tokens;
  for (std::int64_t h = 0; h < p.heads; ++h) {
    merge::Accumulator a;
    for (int d0 = 0; d0 < std::max(p.head_dim, 1); d0 += kChunk) {  // once at D = 0: the LSE
      const int n = std::min(kChunk, p.head_dim - d0);
      std::fill_n(acc, n, 0.0f);
      a = merge::Accumulator{};
      for (int i = 0; i < p.parts; ++i) {
        float weight;
        const float rescale = a.add(p.part_lse(i, b, s, h), weight);
        if (rescale != 1.0f)
          for (int d = 0; d < n; ++d) acc[d] *= rescale;
        if (weight == 0.0f) continue;  // an empty part: its O is not even read
        cpu::detail::load_row(p.part(i).out, p.part_out_offset(i, b, s, h) + d0, n, p.type, part);
        for (int d = 0; d < n; ++d) acc[d] += weight * part[d];
      }
      const float inv_sum = a.inv_sum();
      for (int d = 0; d < n; ++d) acc[d] *= inv_sum;
      cpu::detail::store_row(p.result.out, p.result.out_offset(b, s, h) + d0, n, p.type, acc);
    }
    if (p.result.lse) p.result.lse[p.result.lse_offset(b, s, h)] = a.lse();
  }
}

void merge_on_host(const merge::MergeParams& p) {
  const std::int64_t rows = p.batch * p.tokens;
  const std::int64_t elements = rows * p.heads * std::max(p.head_dim, 1) * (p.parts + 1);
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (elements < kParallelElements || threads == 1) {
    for (std::int64_t row = 0; row < rows; ++row) merge_token_row(p, row);
    return;
  }
  cpu::ThreadPool pool(threads);
  pool.parallel_for(rows, [&](std::int64_t row, int) { merge_token_row(p, row); });
}

void merge_parts(const std::vector<formats::MergePart>& parts, bool stacked, const TensorView& out,
                 const TensorView& lse, Stream stream) {
  formats::validate_merge(parts, stacked, out, lse);
  const merge::MergeParams p = formats::bind_merge(parts, stacked, out, lse);
  if (out.device == Device::cpu) {
    merge_on_host(p);
    return;
  }
#if BSATTN_WITH_CUDA
  gpu::DeviceGuard guard(out.device_index);
  gpu::cuda_check(gpu::merge_states(p, static_cast<cudaStream_t>(stream)), "merge_states kernel launch");
#else
  (void)stream;
  throw Error("out", "is on cuda:" + std::to_string(out.device_index) +
                         ", but this build has no GPU code (BSATTN_ENABLE_CUDA=OFF); use CPU tensors");
#endif
}

}  // namespace

void merge_state(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b, const TensorView& lse_b,
                 const TensorView& out, const TensorView& lse, Stream stream) {
  merge_parts({{"out_a", &out_a, "lse_a", &lse_a}, {"out_b", &out_b, "lse_b", &lse_b}}, false, out, lse, stream);
}

void merge_states(const TensorView& outs, const TensorView& lses, const TensorView& out, const TensorView& lse,
                  Stream stream) {
  merge_parts({{"outs", &outs, "lses", &lses}}, true, out, lse, stream);
}

}  // namespace bsattn
