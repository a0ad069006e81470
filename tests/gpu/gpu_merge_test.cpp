// merge_state / merge_states on the GPU against the CPU merge (tests/cpu/merge_test.cpp checks the
// CPU merge against float64): random parts with empty (-inf) parts and rows, a few NaN LSEs, odd
// D and row counts, batched and varlen, every dtype, padded and head-major layouts, addresses that
// force the narrow pack widths, in place; outputs poisoned and their padding checked untouched.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_case.hpp"

namespace bsattn_gpu_test {
namespace {

constexpr unsigned char kPoison = 0xff;  // NaN in every float dtype

// A strided tensor mirrored on the host and the device: the same bytes, the same element offsets.
struct Mirrored {
  Buffer buffer;
  TensorView host, device;
  std::int64_t shift = 0;

  // `order`: dimensions from outermost to innermost in memory; `pad` spare elements per step of
  // each but the innermost; `shift` elements before the first one (misaligns the base).
  Mirrored(DType dtype, const std::vector<std::int64_t>& shape, const std::vector<int>& order,
           const std::vector<std::int64_t>& pad, std::int64_t shift) {
    const int rank = static_cast<int>(shape.size());
    std::vector<std::int64_t> stride(rank);
    stride[order.back()] = 1;
    for (int i = rank - 2; i >= 0; --i) stride[order[i]] = stride[order[i + 1]] * shape[order[i + 1]] + pad[i];
    std::int64_t span = 1;
    for (int i = 0; i < rank; ++i) span += (shape[i] - 1) * stride[i];
    buffer.dtype = dtype;
    buffer.host.assign(static_cast<std::size_t>((shift + span) * element_size(dtype)), kPoison);
    buffer.upload();
    for (TensorView* t : {&host, &device}) {
      t->dtype = dtype;
      t->rank = rank;
      for (int i = 0; i < rank; ++i) t->shape[i] = shape[i], t->stride[i] = stride[i];
    }
    host.data = buffer.host.data() + shift * element_size(dtype);
    device.data = static_cast<char*>(buffer.device) + shift * element_size(dtype);
    device.device = Device::cuda;
    this->shift = shift;
  }

  // Calls fn(offset) for every element of the tensor, in row-major index order.
  template <class Fn>
  void for_each_offset(const Fn& fn) const {
    const int rank = host.rank;
    std::int64_t total = 1;
    for (int i = 0; i < rank; ++i) total *= host.shape[i];
    std::vector<std::int64_t> index(rank, 0);
    for (std::int64_t n = 0; n < total; ++n) {
      std::int64_t offset = shift;
      for (int i = 0; i < rank; ++i) offset += index[i] * host.stride[i];
      fn(offset);
      for (int i = rank - 1; i >= 0 && ++index[i] == host.shape[i]; --i) index[i] = 0;
    }
  }

  void set(std::int64_t offset, float value) {
    if (buffer.dtype == DType::f32)
      reinterpret_cast<float*>(buffer.host.data())[offset] = value;
    else
      reinterpret_cast<std::uint16_t*>(buffer.host.data())[offset] = to_bits(value, buffer.dtype);
  }
  void poison() {
    std::fill(buffer.host.begin(), buffer.host.end(), kPoison);
    cudaMemset(buffer.device, kPoison, buffer.bytes());
  }
};

struct Spec {
  DType dtype = DType::bf16;
  bool varlen = false;
  int batch = 2, tokens = 33, heads = 4, head_dim = 128, parts = 2;
  bool stacked = true;      // merge_states; else merge_state (parts = 2)
  bool head_major = false;  // parts' O with heads outside tokens
  std::int64_t pad = 0;     // spare elements per step of every dimension
  std::int64_t shift = 0;   // elements before the output (and the second part): narrow packs
  bool in_place = false;    // the output is part 0 (O and LSE)
  bool with_lse = true;     // the output LSE is given
  std::uint64_t seed = 1;

  std::string name() const {
    return std::string(to_string(dtype)) + (varlen ? " varlen" : " batched") + " B=" + std::to_string(batch) +
           " S=" + std::to_string(tokens) + " H=" + std::to_string(heads) + " D=" + std::to_string(head_dim) +
           " N=" + std::to_string(parts) + (stacked ? " merge_states" : " merge_state") +
           (head_major ? " head-major" : "") + " pad=" + std::to_string(pad) + " shift=" + std::to_string(shift) +
           (in_place ? " in-place" : "") + (with_lse ? "" : " no-lse") + " seed=" + std::to_string(seed);
  }
};

// O shape and memory order, LSE shape, with an optional leading N.
std::vector<std::int64_t> out_shape(const Spec& s, int lead) {
  std::vector<std::int64_t> shape = s.varlen ? std::vector<std::int64_t>{s.tokens, s.heads, s.head_dim}
                                             : std::vector<std::int64_t>{s.batch, s.tokens, s.heads, s.head_dim};
  if (lead) shape.insert(shape.begin(), lead);
  return shape;
}
std::vector<int> out_order(const Spec& s, int lead, bool head_major) {
  std::vector<int> order = s.varlen ? std::vector<int>{0, 1, 2} : std::vector<int>{0, 1, 2, 3};
  const int token = s.varlen ? 0 : 1;
  if (head_major) std::swap(order[token], order[token + 1]);
  if (lead) {
    for (int& d : order) ++d;
    order.insert(order.begin(), 0);
  }
  return order;
}
std::vector<std::int64_t> lse_shape(const Spec& s, int lead) {
  std::vector<std::int64_t> shape =
      s.varlen ? std::vector<std::int64_t>{s.heads, s.tokens} : std::vector<std::int64_t>{s.batch, s.heads, s.tokens};
  if (lead) shape.insert(shape.begin(), lead);
  return shape;
}
std::vector<int> identity(std::size_t rank) {
  std::vector<int> order(rank);
  for (std::size_t i = 0; i < rank; ++i) order[i] = static_cast<int>(i);
  return order;
}

// Fills every logical element: O normal, LSE normal * 4 with empty parts (-inf), some rows empty
// in every part, and a few NaN LSEs.
void fill(Mirrored& outs, Mirrored& lses, int parts, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  outs.for_each_offset([&](std::int64_t o) { outs.set(o, normal(rng)); });
  std::vector<std::int64_t> lse_offsets;  // part-major: the stacked N is the outermost index
  lses.for_each_offset([&](std::int64_t o) { lse_offsets.push_back(o); });
  const std::size_t per_part = lse_offsets.size() / parts;
  for (std::size_t r = 0; r < per_part; ++r) {
    const bool empty_row = rng() % 10 == 0;
    for (int i = 0; i < parts; ++i) {
      const std::uint64_t u = rng() % 100;
      const float lse = empty_row || u < 15 ? -INFINITY : u == 99 ? NAN : 4.0f * normal(rng);
      lses.set(lse_offsets[i * per_part + r], lse);
    }
  }
  outs.buffer.upload();
  lses.buffer.upload();
}

float value(const std::vector<unsigned char>& bytes, DType dtype, std::int64_t offset) {
  if (dtype == DType::f32) {
    float x;
    std::memcpy(&x, bytes.data() + offset * 4, 4);
    return x;
  }
  std::uint16_t bits;
  std::memcpy(&bits, bytes.data() + offset * 2, 2);
  return dtype == DType::bf16 ? cpu::bf16_to_float(bits) : cpu::half_to_float(bits);
}

// Element by element: the GPU result (downloaded into `gpu`) against the bytes the CPU merge
// wrote in the same layout; everything outside the tensor still poison.
void expect_same(const Mirrored& gpu, const std::vector<unsigned char>& cpu, const std::string& what, double rel,
                 double abs) {
  const DType dtype = gpu.buffer.dtype;
  const std::size_t elem = element_size(dtype);
  std::vector<char> logical(gpu.buffer.bytes() / elem, 0);
  int bad = 0;
  std::string first;
  gpu.for_each_offset([&](std::int64_t o) {
    logical[o] = 1;
    const float g = value(gpu.buffer.host, dtype, o), c = value(cpu, dtype, o);
    const bool ok = std::isnan(c)   ? std::isnan(g)
                    : std::isinf(c) ? g == c
                                    : std::isfinite(g) && std::fabs(g - c) <= abs + rel * std::fabs(c);
    if (!ok && bad++ == 0)
      first = "offset " + std::to_string(o) + ": gpu " + std::to_string(g) + " cpu " + std::to_string(c);
  });
  EXPECT_EQ(bad, 0) << what << ": " << bad << " mismatches, first " << first;
  std::int64_t written = 0;
  for (std::size_t i = 0; i < gpu.buffer.bytes(); ++i) written += !logical[i / elem] && gpu.buffer.host[i] != kPoison;
  EXPECT_EQ(written, 0) << what << ": bytes outside the tensor written";
}

void run_case(const Spec& s) {
  std::mt19937_64 rng(s.seed);
  const int N = s.parts;
  const std::vector<std::int64_t> pad(5, s.pad);
  // Parts: stacked [N, ...], or two tensors in different layouts for merge_state.
  Mirrored outs(s.dtype, out_shape(s, N), out_order(s, N, s.head_major), pad, 0);
  Mirrored lses(DType::f32, lse_shape(s, N), identity(lse_shape(s, N).size()), pad, 0);
  fill(outs, lses, N, rng);
  Mirrored other(s.dtype, out_shape(s, 0), out_order(s, 0, !s.head_major), pad, s.shift);
  Mirrored other_lse(DType::f32, lse_shape(s, 0), identity(lse_shape(s, 0).size()), pad, 0);
  fill(other, other_lse, 1, rng);
  Mirrored out(s.dtype, out_shape(s, 0), out_order(s, 0, false), pad, s.shift);
  Mirrored out_lse(DType::f32, lse_shape(s, 0), identity(lse_shape(s, 0).size()), pad, 0);
  out.poison();
  out_lse.poison();

  const auto part = [](const TensorView& stacked, std::int64_t i) {
    TensorView t = stacked;
    t.rank = stacked.rank - 1;
    for (int d = 0; d < t.rank; ++d) t.shape[d] = stacked.shape[d + 1], t.stride[d] = stacked.stride[d + 1];
    t.data = static_cast<char*>(stacked.data) + i * stacked.stride[0] * element_size(stacked.dtype);
    return t;
  };
  // Runs the merge on one side; returns the (out, lse) it wrote.
  const auto merge = [&](bool device, cudaStream_t stream) {
    const auto v = [&](const Mirrored& m) { return device ? m.device : m.host; };
    TensorView o = v(out), l = s.with_lse ? v(out_lse) : TensorView{};
    if (s.in_place) o = part(v(outs), 0), l = part(v(lses), 0);
    if (s.stacked)
      merge_states(v(outs), v(lses), o, l, stream);
    else
      merge_state(part(v(outs), 0), part(v(lses), 0), v(other), v(other_lse), o, l, stream);
  };
  merge(false, nullptr);
  Mirrored& result = s.in_place ? outs : out;
  Mirrored& result_lse = s.in_place ? lses : out_lse;
  const std::vector<unsigned char> cpu_out = result.buffer.host, cpu_lse = result_lse.buffer.host;

  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  merge(true, stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));
  result.buffer.download();
  result_lse.buffer.download();
  // fp32 arithmetic in the same order on both sides: the exp/log implementations differ by a few
  // ulps; 16-bit outputs may then round one ulp apart.
  const double rel = s.dtype == DType::f32 ? 2e-6 : s.dtype == DType::f16 ? 1.0 / 1024 : 1.0 / 128;
  expect_same(result, cpu_out, s.name() + " O", rel, 1e-6);
  if (s.with_lse || s.in_place) expect_same(result_lse, cpu_lse, s.name() + " LSE", 2e-6, 2e-6);
}

TEST(GpuMerge, MatchesCpuOnRandomShapes) {
  REQUIRE_SM90();
  std::mt19937_64 rng(12);
  const int dims[] = {128, 64, 256, 1, 3, 8, 40, 72, 130};
  const int token_counts[] = {1, 7, 33, 257};
  int n = 0;
  for (DType dtype : {DType::bf16, DType::f16, DType::f32})
    for (int d : dims)
      for (bool varlen : {false, true}) {
        Spec s;
        s.dtype = dtype;
        s.head_dim = d;
        s.varlen = varlen;
        s.batch = varlen ? 1 : 1 + static_cast<int>(rng() % 3);
        s.tokens = varlen ? 1 + static_cast<int>(rng() % 1001) : token_counts[rng() % 4];
        s.heads = 1 + static_cast<int>(rng() % 5);
        s.parts = std::vector<int>{1, 2, 2, 3, 4, 5, 8}[rng() % 7];
        s.stacked = s.parts != 2 || rng() % 2;
        s.head_major = rng() % 3 == 0;
        s.pad = std::vector<int>{0, 0, 8, 3}[rng() % 4];
        s.shift = rng() % 4 == 0 ? 1 : 0;
        s.in_place = rng() % 5 == 0;
        s.with_lse = rng() % 6 != 0;
        s.seed = 100 + n++;
        run_case(s);
      }
}

// Decode-like and long-prefill-like shapes on the 16-byte path.
TEST(GpuMerge, ServingShapes) {
  REQUIRE_SM90();
  Spec decode;
  decode.batch = 32, decode.tokens = 1, decode.heads = 32, decode.parts = 16;
  run_case(decode);
  Spec prefill;
  prefill.varlen = true, prefill.tokens = 4099, prefill.heads = 8, prefill.parts = 2, prefill.stacked = false;
  run_case(prefill);
  Spec folded = prefill;
  folded.in_place = true;
  folded.dtype = DType::f16;
  run_case(folded);
}

// Merges large enough that a lane holds several packs of an item (src/gpu/merge_states.cu: at
// least one wave of resident threads; not D 64 at 16-byte packs, whose 2 lanes per item need twice
// the items): odd D (packs a lane only partly has), narrow packs, chunks of parts cut short,
// head-major parts, in place.
TEST(GpuMerge, WideShapes) {
  REQUIRE_SM90();
  std::mt19937_64 rng(21);
  int n = 0;
  for (DType dtype : {DType::bf16, DType::f16, DType::f32})
    for (int d : {128, 64, 256, 72, 130}) {
      Spec s;
      s.dtype = dtype;
      s.head_dim = d;
      s.varlen = true;
      s.tokens = 4500 + static_cast<int>(rng() % 999);  // 18,000+ items: 4 lanes each fill 132 SMs
      s.heads = 4;
      s.parts = std::vector<int>{2, 3, 5}[n % 3];
      s.stacked = s.parts != 2 || rng() % 2;
      s.head_major = n % 4 == 1;
      s.shift = n % 5 == 2 ? 1 : 0;
      s.in_place = n % 6 == 3;
      s.seed = 500 + n++;
      run_case(s);
    }
}

}  // namespace
}  // namespace bsattn_gpu_test
