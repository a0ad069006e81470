// GPU proxy summaries (build_summaries on Device::cuda) against the CPU builder and a float64
// reference computed here, on random contiguous, varlen (empty sequences, seqused_k, tails) and
// paged K/V (scattered pages, padded block_table rows, pages smaller and larger than a block),
// f32 / f16 / bf16, D 64 / 128 / 256. K/V storage holds an extra head and NaN everywhere outside
// the in-range tokens, so a read of anything else poisons a summary; the summary outputs have an
// extra head too, which must keep its poison, and every element of the views must be written.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "bsattn/summary.hpp"
#include "gpu_case.hpp"

namespace bsattn_gpu_test {
namespace {

enum class Layout { contiguous, varlen, paged };

struct SummarySpec {
  Layout layout = Layout::contiguous;
  DType dtype = DType::bf16;
  int head_dim = 128;
  int heads_kv = 2;
  int block_kv = 64;
  int page_size = 64;
  int min_seqlen = 1;  // contiguous: S is drawn from [min_seqlen, max_seqlen]
  int max_seqlen = 700;
  int batch = 0;  // 0: drawn
  bool validate = true;
  std::uint64_t seed = 1;
};

// Bit patterns that are NaN in every dtype of the test (0xffff is a NaN in f16 and bf16).
constexpr unsigned char kPoison = 0xff;

// The first `shape` entries of each dimension of a buffer's (larger) storage.
TensorView sub_view(const Buffer* b, Device where, const std::vector<std::int64_t>& shape) {
  TensorView t = b->view(where);
  for (std::size_t i = 0; i < shape.size(); ++i) t.shape[i] = shape[i];
  return t;
}

struct SummaryCase {
  Problem problem;  // Device::cuda
  std::vector<int> seqlen;  // in-range KV tokens of each sequence
  int kv_blocks = 0;
  std::vector<std::unique_ptr<Buffer>> buffers;
  Buffer *k = nullptr, *v = nullptr, *k_summary = nullptr, *v_summary = nullptr;
  Inputs host, device;
  std::function<std::int64_t(int b, int t, int h)> row;  // element offset of a K/V row in the storage
  std::string name;

  Buffer* add(DType dt, std::vector<std::int64_t> shape) {
    auto b = std::make_unique<Buffer>();
    b->dtype = dt;
    b->shape = std::move(shape);
    std::int64_t n = 1;
    for (auto s : b->shape) n *= s;
    b->host.assign(static_cast<std::size_t>(n) * element_size(dt), kPoison);
    b->upload();  // the device storage exists before device views are taken (values follow later)
    buffers.push_back(std::move(b));
    return buffers.back().get();
  }
  Buffer* add_ints(const std::vector<std::int32_t>& values) {
    Buffer* b = add(DType::i32, {static_cast<std::int64_t>(values.size())});
    std::memcpy(b->host.data(), values.data(), b->host.size());
    return b;
  }
  std::vector<std::int64_t> summary_shape() const {
    return {problem.batch, kv_blocks, problem.heads_kv, problem.head_dim};
  }
  TensorView summary_view(const Buffer* b, Device where) const { return sub_view(b, where, summary_shape()); }
  void poison_summaries() {
    for (Buffer* b : {k_summary, v_summary}) {
      std::fill(b->host.begin(), b->host.end(), kPoison);
      b->upload();
    }
  }
};

void store(Buffer* b, std::int64_t i, float x) {
  if (b->dtype == DType::f32) {
    reinterpret_cast<float*>(b->host.data())[i] = x;
  } else {
    reinterpret_cast<std::uint16_t*>(b->host.data())[i] = to_bits(x, b->dtype);
  }
}

std::unique_ptr<SummaryCase> make_summary_case(const SummarySpec& spec) {
  auto c = std::make_unique<SummaryCase>();
  std::mt19937_64 rng(spec.seed);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Problem& p = c->problem;
  const int H = spec.heads_kv, D = spec.head_dim, stored_heads = H + 1;  // one padding head
  p.heads_q = p.heads_kv = H;
  p.head_dim = D;
  p.dtype = p.out_dtype = spec.dtype;
  p.block = {64, spec.block_kv};
  p.format = Format::all_blocks;
  p.device = Device::cuda;
  p.validate = spec.validate;
  p.max_seqlen_q = 1;

  if (spec.layout == Layout::contiguous) {
    p.batch = spec.batch > 0 ? spec.batch : uni(1, 3);
    const int S = uni(spec.min_seqlen, spec.max_seqlen);
    c->seqlen.assign(p.batch, S);
    p.max_seqlen_kv = S;
    c->k = c->add(p.dtype, {p.batch, S, stored_heads, D});
    c->v = c->add(p.dtype, {p.batch, S, stored_heads, D});
    c->row = [=](int b, int t, int h) { return ((std::int64_t(b) * S + t) * stored_heads + h) * D; };
    c->host.k = sub_view(c->k, Device::cpu, {p.batch, S, H, D});
    c->host.v = sub_view(c->v, Device::cpu, {p.batch, S, H, D});
    c->device.k = sub_view(c->k, Device::cuda, {p.batch, S, H, D});
    c->device.v = sub_view(c->v, Device::cuda, {p.batch, S, H, D});
  } else if (spec.layout == Layout::varlen) {
    p.batch = spec.batch > 0 ? spec.batch : uni(3, 5);
    p.q_layout = QLayout::varlen;
    std::vector<std::int32_t> cu{0}, used;
    for (int b = 0; b < p.batch; ++b) {
      const int len = (b == 1) ? 0 : uni(1, spec.max_seqlen);  // sequence 1 is empty
      cu.push_back(cu.back() + len);
      used.push_back(uni(0, 3) == 0 ? uni(0, len) : len);  // some tails cut by seqused_k
    }
    const bool with_used = uni(0, 1) == 1;
    for (int b = 0; b < p.batch; ++b) c->seqlen.push_back(with_used ? used[b] : cu[b + 1] - cu[b]);
    int longest = 1;
    for (int b = 0; b < p.batch; ++b) longest = std::max(longest, cu[b + 1] - cu[b]);
    p.max_seqlen_q = p.max_seqlen_kv = longest;
    p.total_q = p.total_kv = cu.back();
    const std::vector<std::int32_t> starts = cu;
    c->k = c->add(p.dtype, {p.total_kv, stored_heads, D});
    c->v = c->add(p.dtype, {p.total_kv, stored_heads, D});
    c->row = [=](int b, int t, int h) { return ((std::int64_t(starts[b]) + t) * stored_heads + h) * D; };
    Buffer* cu_buf = c->add_ints(cu);
    c->host.cu_seqlens_q = c->host.cu_seqlens_k = cu_buf->view(Device::cpu);
    c->device.cu_seqlens_q = c->device.cu_seqlens_k = cu_buf->view(Device::cuda);
    if (with_used) {
      Buffer* used_buf = c->add_ints(used);
      c->host.seqused_k = used_buf->view(Device::cpu);
      c->device.seqused_k = used_buf->view(Device::cuda);
    }
    c->host.k = sub_view(c->k, Device::cpu, {p.total_kv, H, D});
    c->host.v = sub_view(c->v, Device::cpu, {p.total_kv, H, D});
    c->device.k = sub_view(c->k, Device::cuda, {p.total_kv, H, D});
    c->device.v = sub_view(c->v, Device::cuda, {p.total_kv, H, D});
  } else {
    p.batch = spec.batch > 0 ? spec.batch : uni(2, 4);
    p.kv_layout = KVLayout::paged;
    const int ps = spec.page_size;
    p.page_size = ps;
    int longest = 1, pages_needed = 0;
    for (int b = 0; b < p.batch; ++b) {
      const int len = (b == 1) ? 0 : uni(1, spec.max_seqlen);
      c->seqlen.push_back(len);
      longest = std::max(longest, len);
      pages_needed += (len + ps - 1) / ps;
    }
    p.max_seqlen_kv = longest;
    p.pages_per_seq = (longest + ps - 1) / ps + uni(0, 1);  // readable entries, some unused
    const int columns = p.pages_per_seq + uni(0, 2);        // the row's padding past pages_per_seq
    p.num_pages = pages_needed + uni(1, 3);                  // spare pages, never read
    std::vector<std::int32_t> pages(p.num_pages);
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);           // scattered
    std::vector<std::int32_t> table(static_cast<std::size_t>(p.batch) * columns, -1);
    int next = 0;
    for (int b = 0; b < p.batch; ++b)
      for (int i = 0; i < (c->seqlen[b] + ps - 1) / ps; ++i) table[b * columns + i] = pages[next++];
    c->k = c->add(p.dtype, {p.num_pages, ps, stored_heads, D});
    c->v = c->add(p.dtype, {p.num_pages, ps, stored_heads, D});
    c->row = [=](int b, int t, int h) {
      return ((std::int64_t(table[b * columns + t / ps]) * ps + t % ps) * stored_heads + h) * D;
    };
    Buffer* table_buf = c->add_ints(table);
    table_buf->shape = {p.batch, columns};
    Buffer* lens_buf = c->add_ints(std::vector<std::int32_t>(c->seqlen.begin(), c->seqlen.end()));
    c->host.block_table = table_buf->view(Device::cpu);
    c->device.block_table = table_buf->view(Device::cuda);
    c->host.seq_lens_kv = lens_buf->view(Device::cpu);
    c->device.seq_lens_kv = lens_buf->view(Device::cuda);
    c->host.k = sub_view(c->k, Device::cpu, {p.num_pages, ps, H, D});
    c->host.v = sub_view(c->v, Device::cpu, {p.num_pages, ps, H, D});
    c->device.k = sub_view(c->k, Device::cuda, {p.num_pages, ps, H, D});
    c->device.v = sub_view(c->v, Device::cuda, {p.num_pages, ps, H, D});
  }

  // Values only in the in-range rows of the real heads; NaN everywhere else.
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int b = 0; b < p.batch; ++b)
    for (int t = 0; t < c->seqlen[b]; ++t)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          store(c->k, c->row(b, t, h) + d, nd(rng) + 0.5f);  // a mean away from zero
          store(c->v, c->row(b, t, h) + d, nd(rng));
        }
  c->kv_blocks = (p.max_seqlen_kv + spec.block_kv - 1) / spec.block_kv;
  c->k_summary = c->add(p.dtype, {p.batch, c->kv_blocks, stored_heads, D});
  c->v_summary = c->add(p.dtype, {p.batch, c->kv_blocks, stored_heads, D});
  for (auto& b : c->buffers) b->upload();

  static const char* layouts[] = {"contiguous", "varlen", "paged"};
  c->name = std::string(layouts[static_cast<int>(spec.layout)]) + " " + to_string(p.dtype) + " D=" +
            std::to_string(D) + " Hkv=" + std::to_string(H) + " Bk=" + std::to_string(spec.block_kv) +
            (spec.layout == Layout::paged ? " page=" + std::to_string(spec.page_size) : std::string()) +
            " B=" + std::to_string(p.batch) + " Skv=" + std::to_string(p.max_seqlen_kv) +
            " validate=" + std::to_string(spec.validate) + " seed=" + std::to_string(spec.seed);
  return c;
}

// One unit in the last place of the dtype at |x| (the rounding of either engine, plus fp32
// accumulation in another order, stays within it).
double ulp(DType dt, double x) {
  const int mantissa = dt == DType::bf16 ? 7 : dt == DType::f16 ? 10 : 23;
  const double magnitude = std::max(std::fabs(x), dt == DType::f16 ? 6.1e-5 : 1e-30);
  return std::ldexp(1.0, std::ilogb(magnitude) - mantissa);
}

// Element offset in a summary buffer (storage with the padding head) of (b, j, h, d).
std::int64_t summary_offset(const SummaryCase& c, int b, int j, int h, int d) {
  const int stored_heads = c.problem.heads_kv + 1;
  return ((std::int64_t(b) * c.kv_blocks + j) * stored_heads + h) * c.problem.head_dim + d;
}

// Runs the GPU builder (outputs poisoned first) and checks it against the float64 reference and
// the CPU builder; returns the GPU's summary bytes (K then V) for bitwise comparisons.
std::vector<unsigned char> check_case(SummaryCase& c, cudaStream_t stream = nullptr) {
  const Problem& p = c.problem;
  const int H = p.heads_kv, D = p.head_dim, bk = p.block.kv;

  Problem host_problem = p;
  host_problem.device = Device::cpu;
  Buffer* cpu_k = c.add(p.dtype, c.k_summary->shape);
  Buffer* cpu_v = c.add(p.dtype, c.v_summary->shape);
  build_summaries(host_problem, c.host, c.summary_view(cpu_k, Device::cpu), c.summary_view(cpu_v, Device::cpu));

  c.poison_summaries();
  build_summaries(p, c.device, c.summary_view(c.k_summary, Device::cuda), c.summary_view(c.v_summary, Device::cuda),
                  stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  c.k_summary->download();
  c.v_summary->download();

  int failures = 0;
  std::vector<double> mean_k(D), sum_v(D);
  for (int b = 0; b < p.batch; ++b)
    for (int j = 0; j < c.kv_blocks; ++j)
      for (int h = 0; h <= H; ++h) {
        const int first = j * bk, n = std::max(0, std::min(bk, c.seqlen[b] - first));
        std::fill(mean_k.begin(), mean_k.end(), 0.0);
        std::fill(sum_v.begin(), sum_v.end(), 0.0);
        for (int t = first; h < H && t < first + n; ++t)
          for (int d = 0; d < D; ++d) {
            mean_k[d] += load_out(c.k, c.row(b, t, h) + d);
            sum_v[d] += load_out(c.v, c.row(b, t, h) + d);
          }
        for (int d = 0; d < D; ++d) {
          if (n > 0) mean_k[d] /= n;
          const std::int64_t at = summary_offset(c, b, j, h, d);
          const float gk = load_out(c.k_summary, at), gv = load_out(c.v_summary, at);
          if (h == H) {  // the padding head keeps its poison
            if ((!std::isnan(gk) || !std::isnan(gv)) && failures++ < 5)
              ADD_FAILURE() << c.name << ": padding head written at b=" << b << " j=" << j << " d=" << d;
            continue;
          }
          const float ck = load_out(cpu_k, at), cv = load_out(cpu_v, at);
          // Reference: one rounding of the exact value; fp32 sums of <= Bk terms add far less.
          const bool ok = std::fabs(gk - mean_k[d]) <= ulp(p.dtype, mean_k[d]) + 1e-5 &&
                          std::fabs(gv - sum_v[d]) <= ulp(p.dtype, sum_v[d]) + 1e-4 &&
                          std::fabs(gk - ck) <= ulp(p.dtype, ck) + 1e-5 && std::fabs(gv - cv) <= ulp(p.dtype, cv) + 1e-4 &&
                          (n > 0 || (gk == 0.0f && gv == 0.0f));
          if (!ok && failures++ < 5)
            ADD_FAILURE() << c.name << "\n  b=" << b << " j=" << j << " h=" << h << " d=" << d << " n=" << n << ": gpu k "
                          << gk << " v " << gv << ", cpu k " << ck << " v " << cv << ", float64 k " << mean_k[d] << " v "
                          << sum_v[d];
        }
      }
  std::vector<unsigned char> bytes = c.k_summary->host;
  bytes.insert(bytes.end(), c.v_summary->host.begin(), c.v_summary->host.end());
  return bytes;
}

SummarySpec spec_for(int i) {
  SummarySpec s;
  std::mt19937_64 rng(9100000 + i);
  auto pick = [&](std::initializer_list<int> xs) {
    return *(xs.begin() + std::uniform_int_distribution<int>(0, static_cast<int>(xs.size()) - 1)(rng));
  };
  s.layout = static_cast<Layout>(i % 3);
  s.dtype = (i / 3) % 3 == 0 ? DType::bf16 : (i / 3) % 3 == 1 ? DType::f16 : DType::f32;
  s.head_dim = i / 9 % 3 == 0 ? 64 : i / 9 % 3 == 1 ? 128 : 256;
  s.heads_kv = pick({1, 2, 3});
  s.block_kv = pick({16, 32, 64, 128, 192});
  s.page_size = pick({16, 32, 48, 64, 128, 256});
  s.validate = i % 2 == 0;
  s.seed = 9200000 + i;
  return s;
}

class GpuSummaryTest : public ::testing::TestWithParam<int> {};

TEST_P(GpuSummaryTest, MatchesCpuAndFloat64) {
  REQUIRE_SM90();
  const auto c = make_summary_case(spec_for(GetParam()));
  SCOPED_TRACE(c->name);
  const std::vector<unsigned char> first = check_case(*c);
  // Deterministic: a second run writes the same bytes.
  c->poison_summaries();
  build_summaries(c->problem, c->device, c->summary_view(c->k_summary, Device::cuda),
                  c->summary_view(c->v_summary, Device::cuda));
  CUDA_OK(cudaDeviceSynchronize());
  c->k_summary->download();
  c->v_summary->download();
  std::vector<unsigned char> second = c->k_summary->host;
  second.insert(second.end(), c->v_summary->host.begin(), c->v_summary->host.end());
  EXPECT_TRUE(first == second) << "two runs differ";
}
INSTANTIATE_TEST_SUITE_P(Random, GpuSummaryTest, ::testing::Range(0, 54));

// Many CTAs: a long sequence at the benchmark's shape (scaled down), on a non-default stream.
TEST(GpuSummary, LongSequenceOnAStream) {
  REQUIRE_SM90();
  for (const int bk : {64, 128}) {
    SummarySpec s;
    s.layout = Layout::contiguous;
    s.batch = 1;
    s.heads_kv = 8;
    s.block_kv = bk;
    s.min_seqlen = 6000;  // with a tail: 8192 is a multiple of both block sizes
    s.max_seqlen = 8191;
    s.validate = false;
    s.seed = 9300000 + bk;
    const auto c = make_summary_case(s);
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    check_case(*c, stream);
    CUDA_OK(cudaStreamDestroy(stream));
  }
}

// validate = false: the builder only enqueues work, so it can be captured in a CUDA graph and
// replayed (a host sync or an allocation would break the capture).
TEST(GpuSummary, CapturedInAGraph) {
  REQUIRE_SM90();
  for (const Layout layout : {Layout::varlen, Layout::paged}) {
    SummarySpec s;
    s.layout = layout;
    s.page_size = 48;
    s.validate = false;
    s.seed = 9400000 + static_cast<int>(layout);
    const auto c = make_summary_case(s);
    SCOPED_TRACE(c->name);
    const std::vector<unsigned char> direct = check_case(*c);
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    c->poison_summaries();
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    build_summaries(c->problem, c->device, c->summary_view(c->k_summary, Device::cuda),
                    c->summary_view(c->v_summary, Device::cuda), stream);
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    c->k_summary->download();
    c->v_summary->download();
    std::vector<unsigned char> replayed = c->k_summary->host;
    replayed.insert(replayed.end(), c->v_summary->host.begin(), c->v_summary->host.end());
    EXPECT_TRUE(direct == replayed) << "graph replay differs from the direct run";
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(stream));
  }
}

// Bad input on the GPU path: a named error and nothing written.
TEST(GpuSummary, RejectsMalformedOutputsWithoutWriting) {
  REQUIRE_SM90();
  SummarySpec s;
  s.layout = Layout::paged;
  s.seed = 9500000;
  const auto c = make_summary_case(s);
  const auto expect_rejected = [&](const TensorView& ks, const TensorView& vs, const Inputs& in, const char* argument) {
    c->poison_summaries();
    try {
      build_summaries(c->problem, in, ks, vs);
      ADD_FAILURE() << "no error for " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    cudaDeviceSynchronize();
    for (Buffer* b : {c->k_summary, c->v_summary}) {
      b->download();
      EXPECT_TRUE(std::all_of(b->host.begin(), b->host.end(), [](unsigned char x) { return x == kPoison; }))
          << argument << ": a summary was written";
    }
  };
  const TensorView ks = c->summary_view(c->k_summary, Device::cuda), vs = c->summary_view(c->v_summary, Device::cuda);
  TensorView wrong_dtype = ks;
  wrong_dtype.dtype = DType::f16;
  expect_rejected(wrong_dtype, vs, c->device, "k_summary");
  TensorView short_v = vs;
  short_v.shape[1] -= 1;
  expect_rejected(ks, short_v, c->device, "v_summary");
  expect_rejected(ks, c->summary_view(c->v_summary, Device::cpu), c->device, "v_summary");  // host memory
  Inputs bad_table = c->device;  // a live page id out of range (validate = true reads it)
  Buffer* table = c->add(DType::i32, {c->problem.batch, static_cast<std::int64_t>(c->device.block_table.shape[1])});
  std::vector<std::int32_t> ids(table->host.size() / 4, c->problem.num_pages);
  std::memcpy(table->host.data(), ids.data(), table->host.size());
  table->upload();
  bad_table.block_table = table->view(Device::cuda);
  expect_rejected(ks, vs, bad_table, "block_table");
}

}  // namespace
}  // namespace bsattn_gpu_test
