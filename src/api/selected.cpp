// SelectedAttention (selected.hpp): the summaries, the bitmask and the attention Plan allocated
// once; run() calls build_summaries(), select_blocks() and Plan::run() as they are, in order, on
// one stream. Each callee validates what it reads and, on the GPU without validation, only
// launches: the composition adds no sync and no allocation.
#include "bsattn/selected.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bsattn/summary.hpp"
#include "formats/validate_select.hpp"
#if BSATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "gpu/device_guard.hpp"
#endif

namespace bsattn {
namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }
std::size_t align_up(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

Problem attention_problem(const Problem& given, const SelectOptions& options) {
  if (given.proxy == Proxy::explicit_set)
    throw Error("problem.proxy", "explicit_set: SelectedAttention proxies the unselected blocks the mask keeps "
                                 "whole; use Proxy::eligible or Proxy::off");
  formats::validate_select_options(options);
  Problem p = given;
  p.format = Format::bitmask;
  p.sparsity_heads = select_sparsity_heads(given, options);
  p.sparsity_batch = given.q_layout == QLayout::varlen ? 1 : given.batch;
  p.has_partial = true;
  p.has_full = false;
  return p;
}

// A contiguous view of `shape` (rank 3 or 4) at `data`.
TensorView contiguous_view(void* data, DType dtype, const std::vector<std::int64_t>& shape, const Problem& p) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = p.device;
  t.device_index = p.device_index;
  t.rank = static_cast<int>(shape.size());
  std::int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.stride[i] = stride;
    stride *= shape[i];
  }
  return t;
}

std::size_t bytes_of(DType dtype, const std::vector<std::int64_t>& shape) {
  std::size_t n = element_size(dtype);
  for (std::int64_t extent : shape) n *= static_cast<std::size_t>(extent);
  return n;
}

// The bitmask select_blocks() writes for `p`: batched [B, Hs, nQB, W]; varlen [Hs, M, W] with M
// the bound on total_m_blocks = sum_b ceil(Sq_b / Bq) that the sizes give (rows past the
// sequences' blocks are written as zeros).
std::vector<std::int64_t> bits_shape(const Problem& p) {
  const std::int64_t words = ceil_div(ceil_div(p.max_seqlen_kv, p.block.kv), 32);
  const std::int64_t q_blocks = ceil_div(p.max_seqlen_q, p.block.q);
  if (p.q_layout == QLayout::varlen) {
    const std::int64_t rows =
        std::min<std::int64_t>(p.batch * q_blocks, (p.total_q + p.batch * std::int64_t{p.block.q - 1}) / p.block.q);
    return {p.sparsity_heads, std::max<std::int64_t>(1, rows), words};
  }
  return {p.batch, p.sparsity_heads, q_blocks, words};
}

// The inputs run() fills itself: a caller's tensor there would be ignored or contradict ours.
void expect_owned_slots_empty(const Inputs& in) {
  const std::pair<const char*, bool> owned[] = {
      {"partial", in.partial.defined()},       {"full", in.full.defined()},
      {"proxy", in.proxy.defined()},           {"k_summary", in.k_summary.defined()},
      {"v_summary", in.v_summary.defined()},   {"cu_total_m_blocks", in.cu_total_m_blocks.defined()},
      {"cu_block_idx_offsets", in.cu_block_idx_offsets.defined()}};
  for (const auto& [name, given] : owned)
    if (given) throw Error(name, "is computed by SelectedAttention::run(); leave it empty");
}

// The object's summaries and bitmask: one host or device allocation, 256-byte aligned parts.
class OwnedMemory {
 public:
  OwnedMemory(const Problem& p, std::size_t bytes) : device_(p.device), device_index_(p.device_index), bytes_(bytes) {
    if (device_ == Device::cpu) {
      host_.resize(ceil_div(static_cast<std::int64_t>(bytes), sizeof(Line)));
      return;
    }
#if BSATTN_WITH_CUDA
    gpu::DeviceGuard guard(device_index_);
    gpu::cuda_check(cudaMalloc(&device_data_, bytes), "cudaMalloc (SelectedAttention summaries and bitmask)");
#else
    throw Error("problem.device", "cuda: this build has no GPU code (BSATTN_ENABLE_CUDA=OFF); use Device::cpu");
#endif
  }
  ~OwnedMemory() {
#if BSATTN_WITH_CUDA
    if (!device_data_) return;
    // No DeviceGuard here: its errors throw, and a destructor must not.
    int now = 0;
    const bool switch_device = cudaGetDevice(&now) == cudaSuccess && now != device_index_;
    if (switch_device) cudaSetDevice(device_index_);
    cudaFree(device_data_);
    if (switch_device) cudaSetDevice(now);
#endif
  }
  OwnedMemory(const OwnedMemory&) = delete;
  OwnedMemory& operator=(const OwnedMemory&) = delete;

  char* data() {
    return device_ == Device::cpu ? reinterpret_cast<char*>(host_.data()) : static_cast<char*>(device_data_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  struct alignas(256) Line {
    unsigned char bytes[256];
  };
  Device device_;
  int device_index_;
  std::size_t bytes_;
  std::vector<Line> host_;
  void* device_data_ = nullptr;
};

}  // namespace

struct SelectedAttention::Impl {
  SelectOptions options;
  Plan plan;
  OwnedMemory memory;
  TensorView k_summary, v_summary, bits;

  Impl(Plan&& planned, const SelectOptions& o, std::size_t bytes)
      : options(o), plan(std::move(planned)), memory(plan.problem(), bytes) {}
};

static SelectedAttention::Impl& require(const std::unique_ptr<SelectedAttention::Impl>& impl) {
  if (!impl) throw Error("selected_attention", "used after being moved from");
  return *impl;
}

SelectedAttention::SelectedAttention(const Problem& given, const SelectOptions& options) {
  Plan plan(attention_problem(given, options));  // validates the problem before anything is sized
  const Problem& p = plan.problem();
  const std::vector<std::int64_t> summary_shape = {p.batch, ceil_div(p.max_seqlen_kv, p.block.kv), p.heads_kv,
                                                   p.head_dim};
  const std::vector<std::int64_t> word_shape = bits_shape(p);
  const std::size_t summary_bytes = align_up(bytes_of(p.dtype, summary_shape));
  impl_ = std::make_unique<Impl>(std::move(plan), options, 2 * summary_bytes + bytes_of(DType::u32, word_shape));
  char* base = impl_->memory.data();
  impl_->k_summary = contiguous_view(base, p.dtype, summary_shape, p);
  impl_->v_summary = contiguous_view(base + summary_bytes, p.dtype, summary_shape, p);
  impl_->bits = contiguous_view(base + 2 * summary_bytes, DType::u32, word_shape, p);
}

SelectedAttention::~SelectedAttention() = default;
SelectedAttention::SelectedAttention(SelectedAttention&&) noexcept = default;
SelectedAttention& SelectedAttention::operator=(SelectedAttention&&) noexcept = default;

void SelectedAttention::run(const Inputs& inputs, const Outputs& outputs, Stream stream) {
  Impl& s = require(impl_);
  expect_owned_slots_empty(inputs);
  Inputs in = inputs;
  const Problem& problem = s.plan.problem();
  build_summaries(problem, in, s.k_summary, s.v_summary, stream);
  in.k_summary = s.k_summary;
  select_blocks(problem, in, s.options, s.bits, stream);
  in.partial.bits = s.bits;
  if (problem.proxy == Proxy::off) in.k_summary = TensorView{};
  else in.v_summary = s.v_summary;
  s.plan.run(in, outputs, stream);
}

void SelectedAttention::check(Stream stream) { require(impl_).plan.check(stream); }

const Problem& SelectedAttention::problem() const { return require(impl_).plan.problem(); }
const SelectOptions& SelectedAttention::options() const { return require(impl_).options; }
const Plan& SelectedAttention::plan() const { return require(impl_).plan; }
const TensorView& SelectedAttention::k_summary() const { return require(impl_).k_summary; }
const TensorView& SelectedAttention::v_summary() const { return require(impl_).v_summary; }
const TensorView& SelectedAttention::bits() const { return require(impl_).bits; }
std::size_t SelectedAttention::workspace_bytes() const {
  const Impl& s = require(impl_);
  return s.memory.bytes() + s.plan.workspace_bytes();
}

}  // namespace bsattn
