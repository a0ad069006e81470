// GPU results against the CPU engine's on the same case: outputs and LSE read back, the CPU
// engine run on the host copies, every element compared (shared by the forward and proxy tests).
#pragma once
#include <cmath>
#include <vector>

#include "gpu_case.hpp"

namespace bsattn_gpu_test {

struct Result {
  std::vector<float> out, lse;
};

inline Result download(Case& c) {
  Result r;
  c.out->download();
  const std::size_t n = c.out->bytes() / element_size(c.out->dtype);
  r.out.resize(n);
  for (std::size_t i = 0; i < n; ++i) r.out[i] = load_out(c.out, i);
  if (c.lse) {
    c.lse->download();
    r.lse.assign(c.lse->as<float>(), c.lse->as<float>() + c.lse->bytes() / 4);
  }
  return r;
}

inline Result run_cpu(Case& c) {
  Problem p = c.problem;
  p.device = Device::cpu;
  p.validate = true;
  std::fill(c.out->host.begin(), c.out->host.end(), 0xff);
  if (c.lse) std::fill(c.lse->host.begin(), c.lse->host.end(), 0xff);
  Plan plan(p);
  plan.run(c.in_host, c.out_host);
  Result r;
  const std::size_t n = c.out->bytes() / element_size(c.out->dtype);
  r.out.resize(n);
  for (std::size_t i = 0; i < n; ++i) r.out[i] = load_out(c.out, i);
  if (c.lse) r.lse.assign(c.lse->as<float>(), c.lse->as<float>() + c.lse->bytes() / 4);
  return r;
}

// A run of `plan` on the case's poisoned outputs reports a route overflow and writes nothing.
inline void expect_overflow_writes_nothing(Plan& plan, Case& c) {
  c.poison_outputs();
  plan.run(c.in_device, c.out_device, nullptr);
  EXPECT_THROW(plan.check(nullptr), Error);
  CUDA_OK(cudaDeviceSynchronize());
  c.out->download();
  for (unsigned char x : c.out->host) ASSERT_EQ(x, 0xff);
  if (c.lse) {
    c.lse->download();
    for (unsigned char x : c.lse->host) ASSERT_EQ(x, 0xff);
  }
}

// Rows of a varlen layout past total_q (the 1-row placeholder of an empty batch) are not outputs.
inline void expect_close(const Case& c, const Result& gpu, const Result& ref) {
  const bool varlen = c.problem.q_layout == QLayout::varlen;
  const std::size_t valid_rows = varlen ? static_cast<std::size_t>(c.problem.total_q) : ~std::size_t(0);
  const std::size_t row_elems = static_cast<std::size_t>(c.problem.heads_q) * c.problem.head_dim;
  double err2 = 0, ref2 = 0, max_err = 0;
  std::size_t bad = 0, first_bad = 0;
  for (std::size_t i = 0; i < ref.out.size(); ++i) {
    if (i / row_elems >= valid_rows) break;
    const float g = gpu.out[i], r = ref.out[i];
    const double e = std::fabs(double(g) - r);
    if (!std::isfinite(g) || e > 0.03 + 0.02 * std::fabs(r)) {
      if (!bad) first_bad = i;
      ++bad;
    }
    if (std::isfinite(g)) max_err = std::max(max_err, e);
    err2 += e * e;
    ref2 += double(r) * r;
  }
  EXPECT_EQ(bad, 0u) << c.name << ": " << bad << " bad outputs; first at " << first_bad << " gpu "
                     << gpu.out[first_bad] << " ref " << ref.out[first_bad] << "; max err " << max_err;
  EXPECT_LT(std::sqrt(err2 / std::max(ref2, 1e-30)), 1e-2) << c.name;
  std::size_t lse_bad = 0, first_lse = 0;
  for (std::size_t i = 0; i < ref.lse.size(); ++i) {
    if (varlen && (i % std::max<std::int64_t>(c.problem.total_q, 1)) >= valid_rows) continue;
    const float g = gpu.lse[i], r = ref.lse[i];
    const bool ok = (std::isinf(r) && r < 0) ? (std::isinf(g) && g < 0)
                                             : (std::isfinite(g) && std::fabs(g - r) <= 2e-3 + 1e-4 * std::fabs(r));
    if (!ok) {
      if (!lse_bad) first_lse = i;
      ++lse_bad;
    }
  }
  EXPECT_EQ(lse_bad, 0u) << c.name << ": " << lse_bad << " bad LSE values; first at " << first_lse << " gpu "
                         << gpu.lse[first_lse] << " ref " << ref.lse[first_lse];
}

// Outputs with non-finite inputs (issue 14): where the CPU engine's O is NaN the GPU's is NaN,
// where it is infinite the GPU's is not finite, elsewhere they agree within expect_close's
// tolerance; LSE likewise. Returns the number of non-finite reference outputs.
inline std::size_t expect_same_non_finite(const Case& c, const Result& gpu, const Result& ref) {
  const bool varlen = c.problem.q_layout == QLayout::varlen;
  const std::size_t rows = varlen ? static_cast<std::size_t>(c.problem.total_q) : ref.lse.size() / c.problem.heads_q;
  const std::size_t out_elems = rows * c.problem.heads_q * c.problem.head_dim;
  std::size_t bad = 0, non_finite = 0, first = 0;
  for (std::size_t i = 0; i < out_elems; ++i) {
    const float g = gpu.out[i], r = ref.out[i];
    const bool ok = std::isfinite(r) ? std::isfinite(g) && std::fabs(g - r) <= 0.03f + 0.02f * std::fabs(r)
                                     : (std::isnan(r) ? std::isnan(g) : !std::isfinite(g));
    non_finite += !std::isfinite(r);
    if (!ok && !bad++) first = i;
  }
  EXPECT_EQ(bad, 0u) << c.name << ": first at " << first << " gpu " << gpu.out[first] << " cpu " << ref.out[first];
  std::size_t lse_bad = 0;
  for (std::size_t i = 0; i < ref.lse.size(); ++i) {
    if (varlen && (i % std::max<std::int64_t>(c.problem.total_q, 1)) >= rows) continue;
    const float g = gpu.lse[i], r = ref.lse[i];
    const bool ok = std::isnan(r) ? std::isnan(g) : std::isinf(r) ? g == r : std::fabs(g - r) <= 2e-3f + 1e-4f * std::fabs(r);
    lse_bad += !ok;
  }
  EXPECT_EQ(lse_bad, 0u) << c.name;
  return non_finite;
}

// One random case planned and run on the GPU (outputs poisoned by make_case), against the CPU
// engine on the same inputs.
inline void check_against_cpu(const CaseSpec& spec) {
  auto c = make_case(spec);
  SCOPED_TRACE(c->name);
  {
    Plan plan(c->problem);
    plan.run(c->in_device, c->out_device, nullptr);
    plan.check(nullptr);
    CUDA_OK(cudaDeviceSynchronize());
  }
  expect_close(*c, download(*c), run_cpu(*c));
}

}  // namespace bsattn_gpu_test
