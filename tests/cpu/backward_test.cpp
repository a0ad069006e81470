// The CPU backward (issue 13) against the float64 oracle's backward, on seeded random problems:
// every format, fixed-length and varlen, GQA/MQA, built-in masks and custom functors, tails, empty
// rows and sequences, each dtype. Gradients are poisoned first and must be written everywhere
// (and nowhere else). The oracle's backward is itself checked by finite differences of its
// forward. Reproduce one case with --gtest_filter='*BackwardOracleTest*/<seed>'.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "bsattn/bsattn.hpp"
#include "bsattn/custom_mask.hpp"
#include "random_problem.hpp"

namespace bsattn_test {
namespace {

using bsattn::DType;
using bsattn::TensorView;

constexpr std::uint32_t kPoison32 = 0x7fc0beefu;
constexpr std::uint16_t kPoison16 = 0x7e6bu;  // a NaN in both f16 and bf16

std::int64_t extent(const TensorView& t) {
  std::int64_t e = 1;
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] == 0) return 0;
    e += (t.shape[i] - 1) * t.stride[i];
  }
  return e;
}

void poison(const TensorView& t) {
  if (t.dtype == DType::f32) std::fill_n(static_cast<std::uint32_t*>(t.data), extent(t), kPoison32);
  else std::fill_n(static_cast<std::uint16_t*>(t.data), extent(t), kPoison16);
}

bool is_poison(const TensorView& t, std::int64_t offset) {
  if (t.dtype == DType::f32) return static_cast<const std::uint32_t*>(t.data)[offset] == kPoison32;
  return static_cast<const std::uint16_t*>(t.data)[offset] == kPoison16;
}

void store(const TensorView& t, std::int64_t offset, double value) {
  switch (t.dtype) {
    case DType::f32: static_cast<float*>(t.data)[offset] = static_cast<float>(value); break;
    case DType::f16: static_cast<std::uint16_t*>(t.data)[offset] = double_to_half_bits(value); break;
    default: static_cast<std::uint16_t*>(t.data)[offset] = double_to_bf16_bits(value); break;
  }
}

// Calls fn(offset) for every logical element of t (row-major order of its indices).
void for_each_offset(const TensorView& t, const std::function<void(std::int64_t)>& fn) {
  if (t.numel() == 0) return;
  std::vector<std::int64_t> index(t.rank, 0);
  for (;;) {
    std::int64_t offset = 0;
    for (int i = 0; i < t.rank; ++i) offset += index[i] * t.stride[i];
    fn(offset);
    int i = t.rank - 1;
    while (i >= 0 && ++index[i] == t.shape[i]) index[i--] = 0;
    if (i < 0) return;
  }
}

// A tensor of `shape` with padding after each step of every dimension but the last (so that
// strides are not the contiguous ones), poisoned, owned by the case.
TensorView padded_tensor(RandomCase& c, DType dtype, const std::vector<std::int64_t>& shape) {
  std::uniform_int_distribution<int> pad(0, 2);
  std::vector<std::int64_t> stride(shape.size());
  stride.back() = 1;
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i)
    stride[i] = stride[i + 1] * shape[i + 1] + 8 * pad(c.rng);  // 8 elements keep 16-byte rows
  TensorView t;
  t.dtype = dtype;
  t.rank = static_cast<int>(shape.size());
  std::int64_t n = 1;
  for (int i = 0; i < t.rank; ++i) {
    t.shape[i] = shape[i];
    t.stride[i] = stride[i];
    n += (shape[i] - 1) * stride[i];
  }
  t.data = c.allocate<std::uint32_t>(std::max<std::int64_t>(n, 1));
  poison(t);
  return t;
}

std::vector<std::int64_t> shape_of(const TensorView& t) { return {t.shape.begin(), t.shape.begin() + t.rank}; }

// A random case with a backward: the forward run by the library (its O and LSE are what the
// backward reads), a random dO, half of the time a random dLSE, and poisoned gradients in the
// input dtype or f32.
struct BackwardCase {
  std::unique_ptr<RandomCase> c;
  bsattn::BackwardInputs backward;
  bsattn::Gradients gradients;

  std::string describe() const {
    return c->describe() + " grads=" + bsattn::to_string(gradients.dq.dtype) + "/" +
           bsattn::to_string(gradients.dk.dtype) + "/" + bsattn::to_string(gradients.dv.dtype) +
           (backward.dlse.defined() ? " dlse" : "");
  }

  void poison_gradients() const {
    for (const TensorView* t : {&gradients.dq, &gradients.dk, &gradients.dv}) poison(*t);
  }

  // The backward as the case's forward ran: one-shot (validated) or a trusted plan; with the
  // custom functor through custom_mask.hpp.
  void run(int num_threads = 0) const {
    poison_gradients();
    bsattn::Problem p = c->problem;
    if (num_threads) p.num_threads = num_threads;
    if (c->one_shot) {
      if (c->custom_mask) bsattn::attention_backward_with_mask(p, c->inputs, backward, gradients, c->custom_mask);
      else bsattn::attention_backward(p, c->inputs, backward, gradients);
      return;
    }
    p.validate = false;
    bsattn::Plan plan(p);
    if (c->custom_mask) bsattn::run_backward_with_mask(plan, c->inputs, backward, gradients, c->custom_mask);
    else plan.run_backward(c->inputs, backward, gradients);
  }

  std::vector<std::uint8_t> gradient_bytes() const {
    std::vector<std::uint8_t> bytes;
    for (const TensorView* t : {&gradients.dq, &gradients.dk, &gradients.dv}) {
      const auto* data = static_cast<const std::uint8_t*>(t->data);
      bytes.insert(bytes.end(), data, data + extent(*t) * bsattn::element_size(t->dtype));
    }
    return bytes;
  }
};

std::unique_ptr<BackwardCase> make_backward_case(std::uint64_t seed, CaseOptions options = {}) {
  options.paged = false;                 // no backward for paged KV
  options.proxy = bsattn::Proxy::off;    // nor for proxy routes
  auto bc = std::make_unique<BackwardCase>();
  bc->c = make_random_case(seed, options);
  RandomCase& c = *bc->c;
  const bsattn::Problem& p = c.problem;
  if (!c.outputs.lse.defined()) {
    const bool varlen = p.q_layout == bsattn::QLayout::varlen;
    c.outputs.lse = padded_tensor(c, DType::f32,
                                  varlen ? std::vector<std::int64_t>{p.heads_q, p.total_q}
                                         : std::vector<std::int64_t>{p.batch, p.heads_q, p.max_seqlen_q});
  }
  c.run_library();
  bc->backward.out = c.outputs.out;
  bc->backward.lse = c.outputs.lse;
  bc->backward.dout = padded_tensor(c, p.out_dtype, shape_of(c.outputs.out));
  std::normal_distribution<double> normal(0, 1);
  for_each_offset(bc->backward.dout, [&](std::int64_t o) { store(bc->backward.dout, o, normal(c.rng)); });
  if (std::bernoulli_distribution(0.5)(c.rng)) {
    bc->backward.dlse = padded_tensor(c, DType::f32, shape_of(c.outputs.lse));
    for_each_offset(bc->backward.dlse, [&](std::int64_t o) { store(bc->backward.dlse, o, normal(c.rng)); });
  }
  std::bernoulli_distribution f32(0.4);
  bc->gradients.dq = padded_tensor(c, f32(c.rng) ? DType::f32 : p.dtype, shape_of(c.inputs.q));
  bc->gradients.dk = padded_tensor(c, f32(c.rng) ? DType::f32 : p.dtype, shape_of(c.inputs.k));
  bc->gradients.dv = padded_tensor(c, f32(c.rng) ? DType::f32 : p.dtype, shape_of(c.inputs.v));
  return bc;
}

// Error allowed on a gradient element (about 3x what the suite measures): the gradient's own
// rounding (relative), plus what the rounding of O and dO (out_dtype) carries through
// delta = rowsum(dO * O), relative to the largest element of that gradient tensor, or to 1 (the
// size of one term with unit-normal inputs) where every element is smaller: a row attending one
// token has dS = P * (dP - dO.O) = 0 exactly, which fp32 gets to about 1e-7. fp32 accumulation
// alone is far below both.
struct GradientTolerance {
  double rel, of_max;
};
GradientTolerance gradient_tolerance(DType out_dtype, DType gradient_dtype) {
  const double rel = gradient_dtype == DType::bf16 ? 8e-3 : gradient_dtype == DType::f16 ? 1e-3 : 2e-5;
  const double of_max = out_dtype == DType::bf16 ? 2e-2 : out_dtype == DType::f16 ? 3e-3 : 1e-4;
  return {rel, of_max};
}

// Compares one gradient tensor (laid out like `like_q` ? Q : K) element by element; every logical
// element must be written with the right value and no element outside it touched.
std::string compare_gradient(const char* name, const TensorView& got, const std::vector<double>& want,
                             DType out_dtype, const std::function<std::int64_t(std::int64_t)>& offset_of) {
  const GradientTolerance tol = gradient_tolerance(out_dtype, got.dtype);
  double largest = 1;
  for (double w : want) largest = std::max(largest, std::fabs(w));
  const std::int64_t d = got.shape[got.rank - 1];
  std::ostringstream report;
  int failures = 0;
  double worst = 0;
  std::vector<std::uint8_t> logical(static_cast<std::size_t>(extent(got)), 0);
  for (std::size_t i = 0; i < want.size(); ++i) {
    const std::int64_t offset = offset_of(static_cast<std::int64_t>(i / d)) + static_cast<std::int64_t>(i % d);
    logical[offset] = 1;
    double g;
    if (got.dtype == DType::f32) g = static_cast<const float*>(got.data)[offset];
    else if (got.dtype == DType::f16) g = half_bits_to_double(static_cast<const std::uint16_t*>(got.data)[offset]);
    else g = bf16_bits_to_double(static_cast<const std::uint16_t*>(got.data)[offset]);
    const double err = std::fabs(g - want[i]);
    if (err == err) worst = std::max(worst, err / std::max(largest, 1e-30));
    if (!(err <= tol.rel * std::fabs(want[i]) + tol.of_max * largest))
      if (failures++ < 5)
        report << "  " << name << " element " << i / d << "," << i % d << ": got " << g << " want " << want[i]
               << " (largest " << largest << ")\n";
  }
  std::int64_t outside = 0;
  for (std::size_t o = 0; o < logical.size(); ++o) outside += !logical[o] && !is_poison(got, static_cast<std::int64_t>(o));
  if (outside) report << "  " << name << ": " << outside << " elements outside the tensor written\n";
  if (failures) report << "  " << name << ": " << failures << " mismatches, worst error / largest = " << worst << "\n";
  return report.str();
}

// "" when the library's gradients match the oracle's.
std::string check_backward(const BackwardCase& bc) {
  try {
    bc.run();
  } catch (const std::exception& e) {
    return bc.describe() + "\n  library threw: " + e.what() + "\n";
  }
  const RandomCase& c = *bc.c;
  const bsattn::Problem& p = c.problem;
  const Oracle oracle(p, c.inputs, c.custom_mask);
  const OracleGradients want = oracle.backward(bc.backward.dout, bc.backward.dlse);
  const bool varlen = p.q_layout == bsattn::QLayout::varlen;
  const int H = p.heads_q, Hkv = p.heads_kv;
  // Row index (row * heads + head) -> element offset of the row's first element.
  const auto q_offset = [&](const TensorView& t) {
    return [&t, varlen, H, &p](std::int64_t i) {
      const std::int64_t row = i / H, h = i % H;
      if (varlen) return row * t.stride[0] + h * t.stride[1];
      return (row / p.max_seqlen_q) * t.stride[0] + (row % p.max_seqlen_q) * t.stride[1] + h * t.stride[2];
    };
  };
  const auto kv_offset = [&](const TensorView& t) {
    return [&t, varlen, Hkv, &p](std::int64_t i) {
      const std::int64_t row = i / Hkv, h = i % Hkv;
      if (varlen) return row * t.stride[0] + h * t.stride[1];
      return (row / p.max_seqlen_kv) * t.stride[0] + (row % p.max_seqlen_kv) * t.stride[1] + h * t.stride[2];
    };
  };
  const std::string report =
      compare_gradient("dQ", bc.gradients.dq, want.dq, p.out_dtype, q_offset(bc.gradients.dq)) +
      compare_gradient("dK", bc.gradients.dk, want.dk, p.out_dtype, kv_offset(bc.gradients.dk)) +
      compare_gradient("dV", bc.gradients.dv, want.dv, p.out_dtype, kv_offset(bc.gradients.dv));
  return report.empty() ? "" : bc.describe() + "\n" + report;
}

constexpr int kRandomCases = 300;

class BackwardOracleTest : public ::testing::TestWithParam<int> {};

TEST_P(BackwardOracleTest, MatchesReference) {
  const auto bc = make_backward_case(20000000 + static_cast<std::uint64_t>(GetParam()));
  const std::string failure = check_backward(*bc);
  EXPECT_TRUE(failure.empty()) << failure;
}
INSTANTIATE_TEST_SUITE_P(Random, BackwardOracleTest, ::testing::Range(0, kRandomCases));

class BackwardCustomMaskTest : public ::testing::TestWithParam<int> {};

TEST_P(BackwardCustomMaskTest, MatchesReference) {
  CaseOptions options;
  options.custom_mask = true;
  const auto bc = make_backward_case(21000000 + static_cast<std::uint64_t>(GetParam()), options);
  const std::string failure = check_backward(*bc);
  EXPECT_TRUE(failure.empty()) << failure;
}
INSTANTIATE_TEST_SUITE_P(Random, BackwardCustomMaskTest, ::testing::Range(0, 40));

// The random cases reach every feature the suite claims.
TEST(BackwardGenerator, CoversEveryFeature) {
  using bsattn::Format;
  std::map<std::string, int> seen;
  for (int seed = 0; seed < kRandomCases; ++seed) {
    CaseOptions options;
    options.paged = false;
    options.proxy = bsattn::Proxy::off;
    const auto c = make_random_case(20000000 + static_cast<std::uint64_t>(seed), options);
    const bsattn::Problem& p = c->problem;
    const auto tally = [&](const std::string& feature, bool present) { seen[feature] += present; };
    tally("varlen", p.q_layout == bsattn::QLayout::varlen);
    tally("batched", p.q_layout == bsattn::QLayout::batched);
    tally("seqused_k", c->inputs.seqused_k.defined());
    tally("format " + std::to_string(static_cast<int>(p.format)), true);
    tally("dtype " + std::string(bsattn::to_string(p.dtype)), true);
    tally("GQA", p.heads_q > p.heads_kv && p.heads_kv > 1);
    tally("MQA", p.heads_q > 1 && p.heads_kv == 1);
    tally("partial+full", p.has_partial && p.has_full);
    tally("full only", !p.has_partial && p.has_full);
    tally("causal", p.mask.causal);
    tally("window", p.mask.window_left >= 0 || p.mask.window_right >= 0);
    tally("sinks", p.mask.sink_tokens > 0);
    tally("document ids", p.mask.document_ids);
    tally("kv valid bits", p.mask.kv_valid_bits);
    tally("merged Q units", bsattn::choose_tiles(p).tile_m > p.block.q);
    tally("KV block split into tiles", bsattn::choose_tiles(p).tile_n < p.block.kv);
    tally("plan with validate=false", !c->one_shot);
    bool empty_q = false, empty_kv = false, tail = false;
    for (int b = 0; b < p.batch; ++b) {
      empty_q = empty_q || c->seqlen_q[b] == 0;
      empty_kv = empty_kv || c->seqlen_kv[b] == 0;
      tail = tail || c->seqlen_kv[b] % p.block.kv != 0 || c->seqlen_q[b] % p.block.q != 0;
    }
    tally("empty Q sequence", empty_q);
    tally("empty KV sequence", empty_kv);
    tally("tails", tail);
  }
  for (const auto& [feature, count] : seen) EXPECT_GE(count, 3) << feature;
  for (int f = 0; f <= static_cast<int>(Format::bitmask); ++f) EXPECT_GE(seen["format " + std::to_string(f)], 3);
  for (const char* feature : {"varlen", "batched", "seqused_k", "GQA", "MQA", "partial+full", "full only", "causal",
                              "window", "sinks", "document ids", "kv valid bits", "merged Q units",
                              "KV block split into tiles", "plan with validate=false", "empty Q sequence",
                              "empty KV sequence", "tails", "dtype f32", "dtype f16", "dtype bf16"})
    EXPECT_GE(seen[feature], 3) << feature;
}

// Disjoint outputs per work item and a fixed summation order: the same bits for any thread count.
TEST(Backward, DeterministicAcrossThreadCounts) {
  for (std::uint64_t seed = 22000000; seed < 22000012; ++seed) {
    const auto bc = make_backward_case(seed);
    bc->run(1);
    const std::vector<std::uint8_t> one = bc->gradient_bytes();
    bc->run(3);
    EXPECT_TRUE(one == bc->gradient_bytes()) << bc->describe();
    bc->run(3);
    EXPECT_TRUE(one == bc->gradient_bytes()) << bc->describe();
  }
}

// One plan runs the forward and the backward in turn (the scratch is sized for both): the same
// bits as separate one-shot calls.
TEST(Backward, OnePlanRunsForwardAndBackward) {
  CaseOptions options;
  options.custom_mask = false;
  for (std::uint64_t seed = 22100000; seed < 22100006; ++seed) {
    const auto bc = make_backward_case(seed, options);
    bc->run();
    const std::vector<std::uint8_t> separate = bc->gradient_bytes();
    bsattn::Problem p = bc->c->problem;
    p.validate = false;
    bsattn::Plan plan(p);
    for (int repeat = 0; repeat < 2; ++repeat) {
      plan.run(bc->c->inputs, bc->c->outputs);
      bc->poison_gradients();
      plan.run_backward(bc->c->inputs, bc->backward, bc->gradients);
      EXPECT_TRUE(separate == bc->gradient_bytes()) << bc->describe() << " repeat " << repeat;
    }
  }
}

// The oracle's backward against central finite differences of the oracle's forward, for the loss
// sum(dO * O) (+ sum(dLSE * LSE) over the rows that attend something), on small f32 cases (a random sample of the elements of Q, K and V is perturbed).
TEST(OracleBackward, MatchesFiniteDifferences) {
  CaseOptions options;
  options.max_seqlen = 40;
  int checked = 0, perturbed = 0;
  for (std::uint64_t seed = 23000000; checked < 4; ++seed) {
    const auto bc = make_backward_case(seed, options);
    RandomCase& c = *bc->c;
    const bsattn::Problem& p = c.problem;
    if (p.dtype != DType::f32 || p.out_dtype != DType::f32 || p.head_dim > 40 || p.heads_q > 4) continue;
    if (bc->backward.dlse.defined() != (checked % 2 == 1)) continue;  // with and without dLSE
    ++checked;
    const Oracle oracle(p, c.inputs, c.custom_mask);
    const OracleGradients g = oracle.backward(bc->backward.dout, bc->backward.dlse);
    const bool varlen = p.q_layout == bsattn::QLayout::varlen;
    const int H = p.heads_q, D = p.head_dim;
    const auto loss = [&] {
      const OracleResult r = Oracle(p, c.inputs, c.custom_mask).compute();
      double l = 0;
      for (int b = 0; b < p.batch; ++b)
        for (int q = 0; q < c.seqlen_q[b]; ++q)
          for (int h = 0; h < H; ++h)
            for (int d = 0; d < D; ++d) {
              const std::int64_t row = oracle.q_row(b, q);
              const double dout = varlen ? read_real(bc->backward.dout, {row, h, d})
                                         : read_real(bc->backward.dout, {b, q, h, d});
              l += dout * r.out[static_cast<std::size_t>((row * H + h) * D + d)];
            }
      const TensorView& dlse = bc->backward.dlse;
      for (int b = 0; b < p.batch && dlse.defined(); ++b)
        for (int q = 0; q < c.seqlen_q[b]; ++q)
          for (int h = 0; h < H; ++h) {
            const double lse = r.lse[static_cast<std::size_t>(oracle.q_row(b, q) * H + h)];
            if (std::isfinite(lse))
              l += lse * (varlen ? read_real(dlse, {oracle.q_row(b, q), h}) : read_real(dlse, {b, h, q}));
          }
      return l;
    };
    // Perturbs sampled elements of `t` and compares (L(x+e) - L(x-e)) / (2e) with `grad`.
    const auto check = [&](const char* name, const TensorView& t, const std::vector<double>& grad) {
      std::size_t i = 0;
      double largest = 0;
      for (double x : grad) largest = std::max(largest, std::fabs(x));
      std::bernoulli_distribution sample(24.0 / static_cast<double>(grad.size()));
      for_each_offset(t, [&](std::int64_t offset) {
        if (!sample(c.rng)) {
          ++i;
          return;
        }
        float& x = static_cast<float*>(t.data)[offset];
        const float original = x;
        const float plus = original + 1e-2f, minus = original - 1e-2f;
        x = plus;
        const double up = loss();
        x = minus;
        const double down = loss();
        x = original;
        const double fd = (up - down) / (static_cast<double>(plus) - minus);
        EXPECT_NEAR(fd, grad[i], 1e-4 * std::max(1.0, largest)) << name << " element " << i << " " << bc->describe();
        ++i;
        ++perturbed;
      });
    };
    check("dQ", c.inputs.q, g.dq);
    check("dK", c.inputs.k, g.dk);
    check("dV", c.inputs.v, g.dv);
  }
  EXPECT_GE(perturbed, 150);
}

// ---- Bad input: a clear error naming the argument, and nothing written -----------------------

struct RejectCase {
  std::unique_ptr<BackwardCase> bc;
  RejectCase() {
    CaseOptions options;
    options.varlen = false;
    options.custom_mask = false;
    bc = make_backward_case(24000000, options);
  }
  // Runs the one-shot backward with the given changes; returns the error's argument.
  std::string argument(const std::function<void(bsattn::Problem&, bsattn::Inputs&, bsattn::BackwardInputs&,
                                                bsattn::Gradients&)>& change) const {
    bsattn::Problem p = bc->c->problem;
    bsattn::Inputs in = bc->c->inputs;
    bsattn::BackwardInputs bw = bc->backward;
    bsattn::Gradients g = bc->gradients;
    change(p, in, bw, g);
    bc->poison_gradients();
    const std::vector<std::uint8_t> before = bc->gradient_bytes();
    std::string name = "(no error)";
    try {
      bsattn::attention_backward(p, in, bw, g);
    } catch (const bsattn::Error& e) {
      name = e.argument();
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos);
      EXPECT_TRUE(before == bc->gradient_bytes()) << "gradients written despite the error on " << name;
    }
    return name;
  }
};

TEST(BackwardValidation, NamesTheArgumentAndWritesNothing) {
  const RejectCase r;
  using P = bsattn::Problem;
  using I = bsattn::Inputs;
  using B = bsattn::BackwardInputs;
  using G = bsattn::Gradients;
  EXPECT_EQ(r.argument([](P&, I&, B&, G&) {}), "(no error)");
  EXPECT_EQ(r.argument([](P& p, I&, B&, G&) { p.proxy = bsattn::Proxy::eligible; }), "problem.proxy");
  EXPECT_EQ(r.argument([](P&, I&, B& b, G&) { b.lse = TensorView(); }), "backward.lse");
  EXPECT_EQ(r.argument([](P&, I&, B& b, G&) { b.out = TensorView(); }), "backward.out");
  EXPECT_EQ(r.argument([](P&, I&, B& b, G&) { b.dout.shape[b.dout.rank - 2] += 1; }), "backward.dout");
  EXPECT_EQ(r.argument([](P&, I&, B& b, G&) { b.out.dtype = b.out.dtype == DType::f32 ? DType::f16 : DType::f32; }),
            "backward.out");
  EXPECT_EQ(r.argument([](P&, I&, B& b, G&) { b.lse.shape[0] += 1; }), "backward.lse");
  EXPECT_EQ(r.argument([](P&, I&, B& b, G&) {
              b.dlse = b.lse;
              b.dlse.shape[2] -= 1;
            }),
            "backward.dlse");
  EXPECT_EQ(r.argument([](P&, I&, B& b, G&) { b.dlse = b.lse; }), "(no error)");  // inputs may alias
  EXPECT_EQ(r.argument([](P&, I&, B&, G& g) { g.dq.dtype = DType::i32; }), "gradients.dq");
  EXPECT_EQ(r.argument([](P&, I&, B&, G& g) { g.dk.shape[1] += 1; }), "gradients.dk");
  EXPECT_EQ(r.argument([](P&, I&, B&, G& g) { g.dv.stride[3] = 2; }), "gradients.dv");  // last dim not contiguous
  EXPECT_EQ(r.argument([](P&, I&, B&, G& g) { g.dv = TensorView(); }), "gradients.dv");
  EXPECT_EQ(r.argument([](P&, I& in, B&, G& g) { g.dk = in.k; }), "gradients.dk");  // aliases an input
  EXPECT_EQ(r.argument([](P&, I&, B&, G& g) { g.dv = g.dk; }), "gradients.dk");     // aliases another gradient
  EXPECT_EQ(r.argument([](P&, I& in, B&, G&) { in.q.shape[0] += 1; }), "q");          // the forward's own rules
}

// A GPU plan has a backward (tests/gpu/gpu_backward_test.cpp); given host tensors it refuses
// them, naming the first one it checks, before anything is read or written. Skipped where no GPU
// plan can be made (a CPU-only build, no device).
TEST(BackwardValidation, GpuPlansRefuseHostTensors) {
  CaseOptions options;
  options.varlen = false;
  options.custom_mask = false;
  std::unique_ptr<BackwardCase> bc;
  for (std::uint64_t seed = 24200000;; ++seed) {
    bc = make_backward_case(seed, options);
    const bsattn::Problem& p = bc->c->problem;
    if (p.dtype == DType::bf16 && (p.head_dim == 64 || p.head_dim == 128)) break;
  }
  bsattn::Problem p = bc->c->problem;
  p.device = bsattn::Device::cuda;
  bsattn::Plan plan;
  try {
    plan.plan(p);
  } catch (const bsattn::Error& e) {
    GTEST_SKIP() << "no GPU plan here: " << e.what();
  }
  try {
    plan.run_backward(bc->c->inputs, bc->backward, bc->gradients);
    FAIL() << "host tensors were accepted by a GPU plan";
  } catch (const bsattn::Error& e) {
    EXPECT_EQ(e.argument(), "backward.out") << e.what();
    EXPECT_NE(std::string(e.what()).find("is on cpu"), std::string::npos) << e.what();
  }
}

TEST(BackwardValidation, PagedKVIsRejected) {
  CaseOptions options;
  options.paged = true;
  options.proxy = bsattn::Proxy::off;
  const auto c = make_random_case(24100000, options);
  bsattn::Gradients g;
  bsattn::BackwardInputs b;
  try {
    bsattn::attention_backward(c->problem, c->inputs, b, g);
    FAIL() << "paged KV accepted";
  } catch (const bsattn::Error& e) {
    EXPECT_EQ(e.argument(), "problem.kv_layout");
  }
}

}  // namespace
}  // namespace bsattn_test
