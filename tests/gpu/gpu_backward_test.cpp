// GPU backward tests (run on an SM90 device; skipped elsewhere): dQ, dK, dV of the GPU backward
// against the CPU engine's backward (itself checked against the float64 oracle) on random
// problems of every format (block lists, varlen block lists, BSR, bitmask, all blocks), batched
// and varlen (empty sequences), GQA/MQA, built-in masks, tails, empty rows, D 64/128/256, blocks
// of 16-128; O and LSE come from the CPU forward, dO (and dLSE in half the cases) are random.
// Gradients are poisoned before each GPU run and every element is checked. The deterministic
// mode repeats bit for bit. Bad input: an error naming the argument, gradients untouched.
// GpuBackwardHost.* runs without a GPU: the kernels' index logic (column stream, step walk, dQ
// order positions) on the host against the row-major routes.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "bsattn/backward.hpp"
#include "bsattn/route/prepare.hpp"
#include "formats/bind.hpp"
#include "gpu/bwd/columns.cuh"
#include "gpu/bwd/dq_tiles.hpp"
#include "gpu/bwd/steps.cuh"
#include "gpu_case.hpp"

namespace bsattn_gpu_test {
namespace {

struct BackwardSpec {
  CaseSpec forward;
  bool dlse = false;
  bool f32_gradients = false;  // dq, dk, dv in f32 (else the input dtype)
  bool deterministic = false;
};

// One random problem with its forward done on the CPU, dO (and dLSE) drawn, and gradient buffers
// on both sides (the CPU backward writes their host copies, the GPU their device copies).
struct BackwardCase {
  std::unique_ptr<Case> c;
  Buffer *dout = nullptr, *dlse = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
  BackwardInputs in_host, in_device;
  Gradients grads_host, grads_device;
};

std::unique_ptr<BackwardCase> make_backward_case(const BackwardSpec& spec) {
  auto bc = std::make_unique<BackwardCase>();
  bc->c = make_case(spec.forward);
  Case& c = *bc->c;
  c.problem.deterministic = spec.deterministic;
  c.problem.backward = true;
  c.name += std::string(spec.dlse ? " dlse" : "") + (spec.f32_gradients ? " f32-grads" : "") +
            (spec.deterministic ? " deterministic" : "");
  {  // O and LSE of the forward, by the CPU engine, on both sides.
    Problem p = c.problem;
    p.device = Device::cpu;
    p.validate = true;
    Plan(p).run(c.in_host, c.out_host);
    c.out->upload();
    c.lse->upload();
  }
  std::mt19937_64 rng(spec.forward.seed * 7919 + 1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  bc->dout = c.add(c.problem.out_dtype, c.out->shape);
  auto* bits = bc->dout->as<std::uint16_t>();
  for (std::size_t i = 0; i < bc->dout->bytes() / 2; ++i) bits[i] = to_bits(nd(rng), c.problem.out_dtype);
  bc->dout->upload();
  if (spec.dlse) {
    bc->dlse = c.add(DType::f32, c.lse->shape);
    for (std::size_t i = 0; i < bc->dlse->bytes() / 4; ++i) bc->dlse->as<float>()[i] = 0.5f * nd(rng);
    bc->dlse->upload();
  }
  const DType gt = spec.f32_gradients ? DType::f32 : c.problem.dtype;
  bc->dq = c.add(gt, c.q->shape);
  bc->dk = c.add(gt, c.k->shape);
  bc->dv = c.add(gt, c.v->shape);
  for (Buffer* b : {bc->dq, bc->dk, bc->dv}) b->upload();
  const auto side = [&](Device d, BackwardInputs& in, Gradients& g) {
    in.out = c.out->view(d);
    in.lse = c.lse->view(d);
    in.dout = bc->dout->view(d);
    if (bc->dlse) in.dlse = bc->dlse->view(d);
    g.dq = bc->dq->view(d);
    g.dk = bc->dk->view(d);
    g.dv = bc->dv->view(d);
  };
  side(Device::cpu, bc->in_host, bc->grads_host);
  side(Device::cuda, bc->in_device, bc->grads_device);
  return bc;
}

float element(const std::vector<unsigned char>& bytes, DType dt, std::size_t i) {
  const auto* h = reinterpret_cast<const std::uint16_t*>(bytes.data());
  switch (dt) {
    case DType::bf16: return cpu::bf16_to_float(h[i]);
    case DType::f16: return cpu::half_to_float(h[i]);
    default: return reinterpret_cast<const float*>(bytes.data())[i];
  }
}

std::vector<unsigned char> device_bytes(const Buffer* b) {
  std::vector<unsigned char> out(b->bytes());
  cudaMemcpy(out.data(), b->device, out.size(), cudaMemcpyDeviceToHost);
  return out;
}

void poison_gradients(BackwardCase& bc) {
  for (Buffer* b : {bc.dq, bc.dk, bc.dv}) cudaMemset(b->device, 0xff, b->bytes());
}

struct GpuGradients {
  std::vector<unsigned char> dq, dk, dv;
};

GpuGradients run_gpu_backward(BackwardCase& bc) {
  poison_gradients(bc);
  Plan plan(bc.c->problem);
  plan.run_backward(bc.c->in_device, bc.in_device, bc.grads_device, nullptr);
  plan.check(nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {device_bytes(bc.dq), device_bytes(bc.dk), device_bytes(bc.dv)};
}

void run_cpu_backward(BackwardCase& bc) {
  Problem p = bc.c->problem;
  p.device = Device::cpu;
  p.validate = true;
  for (Buffer* b : {bc.dq, bc.dk, bc.dv}) std::fill(b->host.begin(), b->host.end(), 0xff);
  Plan(p).run_backward(bc.c->in_host, bc.in_host, bc.grads_host);
}

// Every element of the first `valid_rows` token rows (varlen: the packed rows that belong to
// sequences; batched: all) against the reference, at bf16/f16 tolerance: the GPU rounds P and dS
// to the input dtype for its GEMMs, the CPU keeps them in fp32. An element's bound scales with the
// larger of the tensor's and its token row's RMS: a row whose softmax is concentrated has larger
// dS terms, so its rounding error is larger than the tensor's scale suggests (seen on the H200:
// one dQ element of 658432 at 0.06 x the tensor RMS, D = 256).
void expect_gradient_close(const char* name, const std::string& case_name, const Buffer* b,
                           const std::vector<unsigned char>& gpu, std::size_t valid_rows) {
  const std::size_t per_row = static_cast<std::size_t>(b->shape[b->shape.size() - 2] * b->shape.back());
  const std::size_t n = std::min(b->bytes() / element_size(b->dtype), valid_rows * per_row);
  double ref2 = 0;
  for (std::size_t i = 0; i < n; ++i) ref2 += double(element(b->host, b->dtype, i)) * element(b->host, b->dtype, i);
  const double rms = std::sqrt(ref2 / std::max<std::size_t>(n, 1));
  std::vector<double> row_rms(n / per_row + 1, 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    const double r = element(b->host, b->dtype, i);
    row_rms[i / per_row] += r * r;
  }
  for (double& x : row_rms) x = std::sqrt(x / per_row);
  double err2 = 0, max_err = 0;
  std::size_t bad = 0, first_bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float g = element(gpu, b->dtype, i), r = element(b->host, b->dtype, i);
    const double e = std::fabs(double(g) - r);
    if (!std::isfinite(g) || e > 0.05 * std::max(rms, row_rms[i / per_row]) + 0.03 * std::fabs(r) + 1e-6) {
      if (!bad) first_bad = i;
      ++bad;
    }
    if (std::isfinite(g)) max_err = std::max(max_err, e);
    err2 += e * e;
  }
  EXPECT_EQ(bad, 0u) << case_name << ": " << name << ": " << bad << " of " << n << " bad; first at " << first_bad
                     << " (row " << first_bad / per_row << ") gpu " << element(gpu, b->dtype, first_bad) << " ref "
                     << element(b->host, b->dtype, first_bad) << "; max err " << max_err << ", rms " << rms;
  EXPECT_LE(std::sqrt(err2 / std::max(ref2, 1e-30)), 2e-2) << case_name << ": " << name;
}

std::size_t q_rows(const Case& c) {
  return c.varlen() ? static_cast<std::size_t>(c.problem.total_q) : ~std::size_t(0);
}
std::size_t kv_rows(const Case& c) {
  return c.varlen() ? static_cast<std::size_t>(c.problem.total_kv) : ~std::size_t(0);
}

void check_backward(const BackwardSpec& spec) {
  auto bc = make_backward_case(spec);
  const Case& c = *bc->c;
  SCOPED_TRACE(c.name);
  const GpuGradients gpu = run_gpu_backward(*bc);
  run_cpu_backward(*bc);
  expect_gradient_close("dq", c.name, bc->dq, gpu.dq, q_rows(c));
  expect_gradient_close("dk", c.name, bc->dk, gpu.dk, kv_rows(c));
  expect_gradient_close("dv", c.name, bc->dv, gpu.dv, kv_rows(c));
}

struct Sweep {
  Format format;
  bool varlen;
};
const Sweep kSweeps[] = {{Format::all_blocks, false}, {Format::block_lists, false}, {Format::varlen_block_lists, true},
                         {Format::bsr, false},        {Format::bsr, true},          {Format::bitmask, false},
                         {Format::bitmask, true},     {Format::all_blocks, true},   {Format::block_lists, true}};

TEST(GpuBackward, EveryFormatBf16D128) {
  REQUIRE_SM90();
  std::uint64_t seed = 31000;
  for (const Sweep& s : kSweeps)
    for (int rep = 0; rep < 3; ++rep) {
      BackwardSpec spec;
      spec.forward.format = s.format;
      spec.forward.varlen = s.varlen;
      spec.forward.seed = seed++;
      spec.dlse = rep == 1;
      spec.f32_gradients = rep == 2;
      check_backward(spec);
    }
}

// Head dims, dtypes, Q/KV blocks of 16..128 (Q tiles of 64 and 128; 64- and 128-wide KV tiles,
// 48 -> a masked 64-wide tile), GQA / MQA / MHA, every mask drawn.
TEST(GpuBackward, DtypesHeadDimsBlocksAndGqa) {
  REQUIRE_SM90();
  struct Shape {
    int d, bq, bk, hq, hkv;
  };
  const Shape shapes[] = {{64, 64, 64, 4, 2},   {64, 128, 128, 4, 1}, {128, 64, 128, 2, 2}, {128, 128, 64, 8, 2},
                          {128, 32, 48, 4, 4},  {128, 16, 128, 6, 3}, {256, 64, 64, 2, 1},  {256, 128, 128, 4, 2},
                          {64, 128, 256, 4, 2}, {128, 256, 32, 2, 1}};
  std::uint64_t seed = 32000;
  for (const Shape& sh : shapes)
    for (DType dt : {DType::bf16, DType::f16})
      for (int rep = 0; rep < 2; ++rep) {
        BackwardSpec spec;
        spec.forward.format = rep ? Format::bsr : Format::block_lists;
        spec.forward.varlen = rep == 1;
        spec.forward.dtype = dt;
        spec.forward.head_dim = sh.d;
        spec.forward.bq = sh.bq;
        spec.forward.bk = sh.bk;
        spec.forward.hq = sh.hq;
        spec.forward.hkv = sh.hkv;
        spec.forward.seed = seed++;
        spec.dlse = (seed % 2) == 0;
        check_backward(spec);
      }
}

// Built-in mask `mask` (0 none, causal, causal + window, window + sinks, documents, KV validity
// bits) on a batched or varlen problem with tails; dense enough that masked tiles meet full ones.
BackwardSpec mask_spec(int mask, bool varlen, std::uint64_t seed) {
  BackwardSpec spec;
  spec.forward.format = varlen ? Format::varlen_block_lists : Format::bitmask;
  spec.forward.varlen = varlen;
  spec.forward.mask = mask;
  spec.forward.density = 0.8;
  spec.forward.max_seqlen = 500;
  spec.forward.seed = seed;
  return spec;
}

// Every built-in mask on batched and varlen problems.
TEST(GpuBackward, Masks) {
  REQUIRE_SM90();
  std::uint64_t seed = 33000;
  for (int mask = 0; mask <= 5; ++mask)
    for (int varlen = 0; varlen < 2; ++varlen) {
      BackwardSpec spec = mask_spec(mask, varlen, seed++);
      spec.forward.bq = mask % 2 ? 64 : 128;
      spec.forward.bk = mask % 3 ? 128 : 64;
      check_backward(spec);
    }
}

// Many KV tiles and Q tiles (long sequences, dense): the column walk over many entries, both
// warpgroups' dK/dV over many steps, the dQ accumulation from many CTAs.
TEST(GpuBackward, LongerSequences) {
  REQUIRE_SM90();
  for (int i = 0; i < 3; ++i) {
    BackwardSpec spec;
    spec.forward.format = i == 0 ? Format::all_blocks : Format::block_lists;
    spec.forward.density = 0.7;
    spec.forward.max_seqlen = 1500;
    spec.forward.mask = i == 1 ? 1 : 0;
    spec.forward.hq = 4;
    spec.forward.hkv = 1;
    spec.forward.seed = 34000 + i;
    check_backward(spec);
  }
}

// The deterministic mode: two runs give the same bits (and match the CPU like the default mode).
void check_deterministic(BackwardSpec spec) {
  spec.deterministic = true;
  auto bc = make_backward_case(spec);
  SCOPED_TRACE(bc->c->name);
  const GpuGradients first = run_gpu_backward(*bc);
  const GpuGradients second = run_gpu_backward(*bc);
  EXPECT_TRUE(first.dq == second.dq) << "dq differs between two deterministic runs";
  EXPECT_TRUE(first.dk == second.dk) << "dk differs between two deterministic runs";
  EXPECT_TRUE(first.dv == second.dv) << "dv differs between two deterministic runs";
  run_cpu_backward(*bc);
  expect_gradient_close("dq", bc->c->name, bc->dq, first.dq, q_rows(*bc->c));
  expect_gradient_close("dk", bc->c->name, bc->dk, first.dk, kv_rows(*bc->c));
  expect_gradient_close("dv", bc->c->name, bc->dv, first.dv, kv_rows(*bc->c));
}

// A format of the sweep with four query heads on one KV head (four heads' dQ rows from many KV
// tiles), for the deterministic order.
BackwardSpec deterministic_spec(const Sweep& s, std::uint64_t seed) {
  BackwardSpec spec;
  spec.forward.format = s.format;
  spec.forward.varlen = s.varlen;
  spec.forward.max_seqlen = 700;
  spec.forward.hq = 4;
  spec.forward.hkv = 1;
  spec.forward.seed = seed;
  spec.dlse = true;
  return spec;
}

TEST(GpuBackward, DeterministicRepeatsBitForBit) {
  REQUIRE_SM90();
  std::uint64_t seed = 35000;
  for (const Sweep& s : kSweeps) {
    BackwardSpec spec = deterministic_spec(s, seed);
    spec.forward.bq = seed++ % 2 ? 64 : 128;
    check_deterministic(spec);
  }
}

// The cases of a kernel variant that the route's tiles pick: every mask on batched and varlen
// problems (odd lengths, GQA, dLSE on half of them) with Q blocks of bq_even (masks 0, 2, 4) or
// bq_odd rows and KV blocks of bk, and the deterministic sweep with blocks bq_even x bk.
void check_variant(int head_dim, int bq_even, int bq_odd, int bk, std::uint64_t seed) {
  for (int mask = 0; mask <= 5; ++mask)
    for (int varlen = 0; varlen < 2; ++varlen) {
      BackwardSpec spec = mask_spec(mask, varlen, seed++);
      spec.forward.head_dim = head_dim;
      spec.forward.bq = mask % 2 ? bq_odd : bq_even;
      spec.forward.bk = bk;
      spec.forward.hq = 4;
      spec.forward.hkv = 2;
      spec.dlse = mask % 2 == 0;
      check_backward(spec);
    }
  for (const Sweep& s : kSweeps) {
    BackwardSpec spec = deterministic_spec(s, seed++);
    spec.forward.head_dim = head_dim;
    spec.forward.bq = bq_even;
    spec.forward.bk = bk;
    check_deterministic(spec);
  }
}

// D 64 with Q tiles of 128 and 256 rows: the kernel of 128-row steps (backward_step_rows), whose
// dQ warpgroups split the step's rows (a sequence's last step may leave the second warpgroup's
// rows past the sequence: nothing of them may be added); and its deterministic order bit for bit.
TEST(GpuBackward, HeadDim64StepsOf128Rows) {
  REQUIRE_SM90();
  check_variant(64, 128, 256, 128, 39000);
}

// KV tiles of 64 with Q tiles of 64 rows (blocks of 64, and of 32 x 48: units of the Q tile, KV
// columns past the block masked), D 64 and 128: the solo consumers (backward_solo_steps), each
// taking every other step with its own dQ, their dK / dV partials summed after the walk (a CTA
// with one step, or an odd count, leaves one consumer a step short); and the deterministic order.
// Blocks 128 x 64 (Q tiles of 128) beside them run the shared 64-wide kernel.
TEST(GpuBackward, SoloConsumersOn64WideTiles) {
  REQUIRE_SM90();
  check_variant(64, 64, 32, 48, 41000);
  check_variant(128, 64, 32, 64, 42000);
  check_variant(128, 128, 64, 64, 43000);
  check_variant(64, 128, 32, 64, 44000);
}

// all_blocks plans with blocks of 16 to 128 and a wide band (no mask, causal) build their routes
// from blocks of 128 x 128 (plan.cpp, gpu_route_blocks_of_128): the backward then runs the 128-wide
// kernels, the gradients those of the caller's problem (the CPU backward keeps its blocks);
// batched and varlen, GQA, D 64 and 128. A narrow window and document ids keep the caller's tiles.
TEST(GpuBackward, AllBlocksPlansTakeBlocksOf128) {
  REQUIRE_SM90();
  struct Shape {
    int bq, bk, mask;
    bool blocks_of_128;
  };
  const Shape shapes[] = {{64, 64, 0, true}, {32, 48, 1, true},  {128, 64, 1, true},
                          {64, 128, 0, true}, {16, 16, 1, true}, {64, 32, 0, true},
                          {64, 64, 3, false}, {64, 64, 4, false}};
  std::uint64_t seed = 45000;
  for (int i = 0; i < 8; ++i) {
    const Shape& shape = shapes[i];
    BackwardSpec spec = mask_spec(shape.mask, i % 2 == 1, seed++);
    spec.forward.format = Format::all_blocks;
    spec.forward.bq = shape.bq;
    spec.forward.bk = shape.bk;
    spec.forward.head_dim = i == 4 || i == 5 ? 64 : 128;
    spec.dlse = i % 3 == 0;
    Problem problem = make_case(spec.forward)->problem;
    problem.backward = true;
    const TileShape own = choose_tiles(problem);
    const Plan plan(problem);
    EXPECT_EQ(plan.tiles().tile_m, shape.blocks_of_128 ? 128 : own.tile_m);
    if (shape.blocks_of_128) EXPECT_EQ(plan.tiles().tile_n, 128);
    check_backward(spec);
  }
}

// One plan runs the forward and then the backward on its routes, as the Python autograd does.
TEST(GpuBackward, SamePlanForwardThenBackward) {
  REQUIRE_SM90();
  BackwardSpec spec;
  spec.forward.format = Format::bitmask;
  spec.forward.mask = 1;
  spec.forward.seed = 36000;
  auto bc = make_backward_case(spec);
  SCOPED_TRACE(bc->c->name);
  Plan plan(bc->c->problem);
  plan.run(bc->c->in_device, bc->c->out_device, nullptr);  // O and LSE again, on the GPU
  poison_gradients(*bc);
  plan.run_backward(bc->c->in_device, bc->in_device, bc->grads_device, nullptr);
  plan.check(nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  const GpuGradients gpu{device_bytes(bc->dq), device_bytes(bc->dk), device_bytes(bc->dv)};
  run_cpu_backward(*bc);
  expect_gradient_close("dq", bc->c->name, bc->dq, gpu.dq, q_rows(*bc->c));
  expect_gradient_close("dk", bc->c->name, bc->dk, gpu.dk, kv_rows(*bc->c));
  expect_gradient_close("dv", bc->c->name, bc->dv, gpu.dv, kv_rows(*bc->c));
}

// Bad input: a clear error naming the argument, and no gradient written.
TEST(GpuBackward, BadInputWritesNothing) {
  REQUIRE_SM90();
  BackwardSpec spec;
  spec.forward.seed = 37000;
  auto bc = make_backward_case(spec);
  Case& c = *bc->c;
  const auto untouched = [&](const char* what) {
    for (Buffer* b : {bc->dq, bc->dk, bc->dv}) {
      const std::vector<unsigned char> now = device_bytes(b);
      EXPECT_TRUE(std::all_of(now.begin(), now.end(), [](unsigned char x) { return x == 0xff; })) << what;
    }
  };
  const auto expect_error = [&](const Problem& problem, const BackwardInputs& in, const Gradients& g,
                                const std::string& argument) {
    poison_gradients(*bc);
    try {
      Plan plan(problem);
      plan.run_backward(c.in_device, in, g, nullptr);
      ADD_FAILURE() << "no error for " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    CUDA_OK(cudaDeviceSynchronize());
    untouched(argument.c_str());
  };
  {  // dO of the wrong shape
    BackwardInputs in = bc->in_device;
    in.dout.shape[in.dout.rank - 1] /= 2;
    expect_error(c.problem, in, bc->grads_device, "backward.dout");
  }
  {  // LSE missing
    BackwardInputs in = bc->in_device;
    in.lse = TensorView{};
    expect_error(c.problem, in, bc->grads_device, "backward.lse");
  }
  {  // dk of the wrong dtype
    Buffer* wrong = c.add(DType::u32, bc->dk->shape);
    wrong->upload();
    Gradients g = bc->grads_device;
    g.dk = wrong->view(Device::cuda);
    expect_error(c.problem, bc->in_device, g, "gradients.dk");
  }
  {  // f32 output: the GPU backward reads O and dO in the input dtype
    Problem p = c.problem;
    p.out_dtype = DType::f32;
    Buffer* out32 = c.add(DType::f32, c.out->shape);
    Buffer* dout32 = c.add(DType::f32, c.out->shape);
    out32->upload();
    dout32->upload();
    BackwardInputs in = bc->in_device;
    in.out = out32->view(Device::cuda);
    in.dout = dout32->view(Device::cuda);
    expect_error(p, in, bc->grads_device, "problem.out_dtype");
  }
}

// The backward kernels' index logic, on the host: the column stream built by column_entry() in
// ascending Q-tile order (what the warp ballot of build_columns_kernel appends), every CTA's
// StepWalk (with the kernel's early exit), against the steps the row-major routes imply: each
// (route, step whose units take the route; steps of 64 rows, and of 128 where route tiles are
// multiples of 128, as D 64's kernel walks them) walked exactly once by the CTA of its KV tile
// and KV head, every route position of a row seen (so the deterministic dQ semaphores reach
// the route count), and the last step of each column entry recognised without the next one.
TEST(GpuBackwardHost, ColumnWalkCoversEveryRouteOnce) {
  using bsattn::gpu::ColumnRoute;
  using bsattn::gpu::bwd::StepWalk;
  struct Shape {
    int bq, bk, hq, hkv;
  };
  const Shape shapes[] = {{128, 128, 4, 2}, {64, 64, 4, 1}, {32, 48, 6, 3}, {16, 128, 2, 2}, {256, 256, 8, 2},
                          {128, 32, 2, 1}};
  std::uint64_t seed = 38000;
  std::size_t total_steps = 0;
  for (const Sweep& sw : kSweeps)
    for (const Shape& sh : shapes) {
      CaseSpec spec;
      spec.format = sw.format;
      spec.varlen = sw.varlen;
      spec.bq = sh.bq;
      spec.bk = sh.bk;
      spec.hq = sh.hq;
      spec.hkv = sh.hkv;
      spec.max_seqlen = 400;
      spec.seed = seed++;
      auto c = make_case(spec);
      SCOPED_TRACE(c->name);
      const TileShape tiles = choose_tiles(c->problem);  // the GPU plan's tiles
      const int capacity = std::max(1, c->max_kv_blocks() * tiles.kv_split);
      AttentionParams a = formats::bind(c->problem, tiles, capacity, c->in_host, c->out_host);
      route::RouteParams& p = a.route;
      std::vector<std::int32_t> cu_m(c->batch() + 1), cu_i(c->batch() + 1);
      if (p.varlen_q && p.format != route::SetFormat::all_blocks && p.format != route::SetFormat::block_lists) {
        route::varlen_block_offsets(p, cu_m.data(), cu_i.data());
        p.cu_total_m_blocks = cu_m.data();
        p.cu_block_idx_offsets = cu_i.data();
      }
      std::vector<route::Route> routes(static_cast<std::size_t>(a.route_rows) * capacity);
      std::vector<std::int32_t> counts(a.route_rows);
      for (int r = 0; r < a.route_rows; ++r)
        counts[r] = std::min(capacity, route::prepare_row(p, r, routes.data() + static_cast<std::size_t>(r) * capacity));
      a.routes = routes.data();
      a.route_counts = counts.data();

      const int kv_tiles = route::ceil_div(p.max_seqlen_kv, p.tile_n);
      const std::size_t columns = static_cast<std::size_t>(p.batch) * p.sparsity_heads * kv_tiles;
      std::vector<ColumnRoute> column_entries(columns * p.max_q_tiles);
      std::vector<std::int32_t> column_counts(columns, 0);
      for (std::size_t col = 0; col < columns; ++col) {
        const int kv_tile = static_cast<int>(col % kv_tiles), bh = static_cast<int>(col / kv_tiles);
        const route::SeqInfo si = route::seq_info(p, bh / p.sparsity_heads);
        if (kv_tile * p.tile_n >= si.seqlen_kv) continue;
        for (int q_tile = 0; q_tile * p.tile_m < si.seqlen_q; ++q_tile) {
          ColumnRoute e;
          if (bsattn::gpu::bwd::column_entry(a, bh, si, kv_tile, q_tile, e))
            column_entries[col * p.max_q_tiles + column_counts[col]++] = e;
        }
      }

      for (const int step_rows : {64, 128}) {
        if (p.tile_m % step_rows != 0) continue;
        SCOPED_TRACE(step_rows);
        // (b, head, q_tile, kv_tile, sub, rows, masked, position)
        using StepKey = std::tuple<int, int, int, int, int, int, int, int>;
        std::multiset<StepKey> walked, expected;
        for (int b = 0; b < p.batch; ++b) {
          const route::SeqInfo si = route::seq_info(p, b);
          const int owned = p.varlen_kv ? p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b] : si.seqlen_kv;
          for (int hkv = 0; hkv < p.heads_kv; ++hkv)
            for (int kv_tile = 0; kv_tile < kv_tiles; ++kv_tile) {
              const int k0 = kv_tile * p.tile_n, n_valid = std::max(0, std::min(p.tile_n, si.seqlen_kv - k0));
              if (k0 >= owned && n_valid == 0) continue;  // the kernel's early exit
              if (n_valid == 0) continue;                  // it walks nothing then (stores zeros)
              const StepWalk walk = StepWalk::for_cta(p, column_entries.data(), column_counts.data(), kv_tiles, b, hkv,
                                                      kv_tile, si.seqlen_q, step_rows);
              // The launch order's block -> CTA mapping and its work: the column entries walked.
              const int item = (b * p.heads_kv + hkv) * kv_tiles + kv_tile;
              const bsattn::gpu::bwd::Cta cta = bsattn::gpu::bwd::Cta::of(item, kv_tiles, p.heads_kv);
              EXPECT_TRUE(cta.b == b && cta.hkv == hkv && cta.kv_tile == kv_tile) << "item " << item;
              std::set<std::pair<int, int>> entries;  // (head, record)
              bsattn::gpu::bwd::Step s;
              for (bool ok = walk.first(s); ok;) {
                entries.insert({s.head, s.record});
                EXPECT_EQ(s.q0, s.route.q_tile * p.tile_m + s.sub * step_rows);
                EXPECT_EQ(s.units, walk.step_units(s.sub));
                walked.insert({b, s.head, s.route.q_tile, kv_tile, s.sub, s.route.rows, s.route.masked, s.route.position});
                // The consumers' own test for the end of a column entry (the deterministic dQ
                // order) against the walk's next step.
                bsattn::gpu::bwd::Step next = s;
                const bool more = walk.next(next);
                EXPECT_EQ(walk.last_of_record(s), !more || next.head != s.head || next.record != s.record);
                s = next;
                ok = more;
              }
              const auto work = bsattn::gpu::bwd::CtaWork::of(p, kv_tiles, column_counts.data());
              EXPECT_EQ(work(item), static_cast<int>(entries.size())) << "CTA work of item " << item;
              EXPECT_LE(work(item), work.order_groups().max_count);
            }
          const StepWalk units = StepWalk::for_cta(p, nullptr, nullptr, kv_tiles, b, 0, 0, si.seqlen_q, step_rows);
          for (int h = 0; h < p.heads_q; ++h) {
            const int hs = h / (p.heads_q / p.sparsity_heads);
            for (int q_tile = 0; q_tile * p.tile_m < si.seqlen_q; ++q_tile) {
              const int row = (b * p.sparsity_heads + hs) * p.max_q_tiles + q_tile;
              for (int i = 0; i < counts[row]; ++i) {
                const route::Route& r = routes[static_cast<std::size_t>(row) * capacity + i];
                bool any = false;
                for (int sub = 0; sub * step_rows < p.tile_m; ++sub) {
                  const int q0 = q_tile * p.tile_m + sub * step_rows;
                  if (q0 >= si.seqlen_q || !(r.rows & units.step_units(sub))) continue;
                  expected.insert({b, h, q_tile, r.index, sub, r.rows, r.masked, i});
                  any = true;
                }
                EXPECT_TRUE(any) << "route " << i << " of row " << row << " has no step: its dQ position would never be released";
              }
            }
          }
        }
        EXPECT_EQ(walked.size(), expected.size());
        EXPECT_TRUE(walked == expected) << "the column walk differs from the row-major routes";
        total_steps += walked.size();
      }
    }
  EXPECT_GT(total_steps, 0u);
}

// The tiled dQ accumulator (gpu/bwd/dq_tiles.hpp) on the host: within a tile, (row, column) ->
// position is a bijection onto [0, 64 D), and it is the order the kernel adds in (value e of
// thread t of region w of the SM90 accumulator at ((e / 4) * 128 + t) * 4 + e % 4; the kernel
// checks the fragment's value layout at compile time). Sequences' padded tile ranges are
// disjoint and inside the tiles a head has, varlen with random lengths included.
TEST(GpuBackwardHost, TiledDqLayout) {
  using namespace bsattn::gpu::bwd;
  for (int d : {64, 128, 256}) {
    SCOPED_TRACE(d);
    const int regions = dq_warpgroups(d), n = d / regions;
    std::vector<int> seen(64 * d, 0);
    for (int w = 0; w < regions; ++w)
      for (int t = 0; t < 128; ++t)
        for (int e = 0; e < n / 2; ++e) {
          const int row = 16 * (t / 32) + (t % 32) / 4 + 8 * ((e / 2) % 2);
          const int col = w * n + 2 * (t % 4) + 8 * (e / 4) + e % 2;
          const int pos = dq_tile_position(row, col, d);
          // Warp t / 32's values: one block of 16 n floats; in it, per 4 values, the 32 lanes in order.
          ASSERT_EQ(pos, w * 64 * n + (t / 32) * 16 * n + ((e / 4) * 32 + t % 32) * 4 + e % 4)
              << "row " << row << " col " << col;
          ++seen[pos];
        }
    for (int i = 0; i < 64 * d; ++i) ASSERT_EQ(seen[i], 1) << "position " << i;
    // The conversion's reads: 8 columns of a row pair (r0, r0 + 8) from four 16-byte slots.
    for (int r0 = 0; r0 < 64; r0 += r0 % 8 == 7 ? 9 : 1)
      for (int col = 0; col < d; col += 8)
        for (int i = 0; i < 4; ++i)
          for (int e = 0; e < 4; ++e)
            ASSERT_EQ(dq_row_pair_slots(r0, col, d) + 4 * i + e, dq_tile_position(r0 + 8 * (e / 2), col + 2 * i + e % 2, d))
                << "rows " << r0 << " col " << col;
  }
  std::mt19937 rng(4711);
  for (int trial = 0; trial < 200; ++trial) {
    bsattn::route::RouteParams p;
    p.batch = 1 + static_cast<int>(rng() % 9);
    p.varlen_q = trial % 2 == 0;
    std::vector<std::int32_t> cu(p.batch + 1, 0);
    for (int b = 0; b < p.batch; ++b) cu[b + 1] = cu[b] + static_cast<int>(rng() % 300);
    p.cu_seqlens_q = cu.data();
    p.max_seqlen_q = 1 + static_cast<int>(rng() % 300);
    const std::int64_t tiles = dq_tiles_per_head(64, p.varlen_q, p.batch, p.max_seqlen_q, cu[p.batch]);
    ASSERT_EQ(dq_tiles_per_head(32, p.varlen_q, p.batch, p.max_seqlen_q, cu[p.batch]), 0);
    std::int64_t previous_end = 0;
    for (int b = 0; b < p.batch; ++b) {
      const std::int64_t start = dq_padded_start(p, b), len = p.varlen_q ? cu[b + 1] - cu[b] : p.max_seqlen_q;
      ASSERT_EQ(start % 64, 0);
      ASSERT_GE(start, previous_end) << "sequence " << b << " overlaps the previous one";
      previous_end = start + (len + 63) / 64 * 64;
      ASSERT_LE(previous_end, tiles * 64);
    }
    // Every padded row back to its (sequence, row), or to padding: each (b, q) exactly once.
    std::vector<int> rows_seen(cu[p.batch] + static_cast<std::size_t>(p.batch) * p.max_seqlen_q, 0);
    for (std::int64_t padded = 0; padded < tiles * 64; ++padded) {
      int b = -1, q = -2;
      dq_padded_row(p, padded, b, q);
      if (q < 0) continue;
      ASSERT_EQ(dq_padded_start(p, b) + q, padded);
      ++rows_seen[bsattn::route::seq_info(p, b).q_base + q];
    }
    const std::int64_t q_rows = p.varlen_q ? cu[p.batch] : static_cast<std::int64_t>(p.batch) * p.max_seqlen_q;
    for (std::int64_t r = 0; r < q_rows; ++r) ASSERT_EQ(rows_seen[r], 1) << "packed row " << r;
  }
}

}  // namespace
}  // namespace bsattn_gpu_test
