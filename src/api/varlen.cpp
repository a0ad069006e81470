#include "bsattn/varlen.hpp"

#include <string>

#include "formats/bind.hpp"
#include "formats/validate.hpp"
#if BSATTN_WITH_CUDA
#include "gpu/prepare_routes.hpp"
#endif

namespace bsattn {
namespace {

void expect_offsets(const char* name, const TensorView& t, const Problem& p) {
  if (!t.defined() || t.rank != 1 || t.shape[0] != p.batch + 1 || t.stride[0] != 1 || t.dtype != DType::i32)
    throw Error(name, "expected a contiguous int32 [" + std::to_string(p.batch + 1) + "] tensor, got " +
                          std::string(to_string(t.dtype)) + " " + t.shape_string());
  if (t.device != p.device) throw Error(name, std::string("on ") + to_string(t.device) + ", problem is on " + to_string(p.device));
}

}  // namespace

void varlen_block_offsets(const Problem& problem, const Inputs& inputs, const TensorView& cu_total_m_blocks,
                          const TensorView& cu_block_idx_offsets, Stream stream) {
  if (problem.q_layout != QLayout::varlen) throw Error("problem.q_layout", "varlen_block_offsets needs a varlen problem");
  expect_offsets("cu_total_m_blocks", cu_total_m_blocks, problem);
  expect_offsets("cu_block_idx_offsets", cu_block_idx_offsets, problem);
  const TileShape tiles = choose_tiles(problem);
  Problem structure_only = problem;
  structure_only.validate = false;  // value checks read the metadata on the host; this never syncs
  formats::validate_lengths(structure_only, tiles, inputs);
  route::RouteParams p = formats::bind(problem, tiles, 0, inputs, Outputs{}).route;
  auto* m = static_cast<std::int32_t*>(cu_total_m_blocks.data);
  auto* o = static_cast<std::int32_t*>(cu_block_idx_offsets.data);
  if (problem.device == Device::cuda) {
#if BSATTN_WITH_CUDA
    const cudaError_t e = gpu::derive_varlen_block_offsets(p, m, o, static_cast<cudaStream_t>(stream));
    if (e != cudaSuccess) throw Error("varlen_block_offsets", cudaGetErrorString(e));
    return;
#else
    (void)stream;
    throw Error("problem.device", "cuda: this build has no GPU code");
#endif
  }
  route::varlen_block_offsets(p, m, o);
}

}  // namespace bsattn
