#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "bsattn/bsattn.hpp"

TEST(Smoke, DenseMatchesNaive) {
  using namespace bsattn;
  const int B = 1, S = 100, H = 2, D = 64;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> q(B * S * H * D), k(q.size()), v(q.size()), o(q.size(), NAN), lse(B * H * S, NAN);
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = nd(rng);
  Problem p;
  p.batch = B; p.heads_q = H; p.heads_kv = H; p.head_dim = D;
  p.max_seqlen_q = S; p.max_seqlen_kv = S;
  p.dtype = DType::f32; p.out_dtype = DType::f32;
  p.block = {64, 32};
  p.format = Format::all_blocks;
  p.mask.causal = true;
  Inputs in;
  in.q = TensorView::contiguous(q.data(), DType::f32, {B, S, H, D});
  in.k = TensorView::contiguous(k.data(), DType::f32, {B, S, H, D});
  in.v = TensorView::contiguous(v.data(), DType::f32, {B, S, H, D});
  Outputs out;
  out.out = TensorView::contiguous(o.data(), DType::f32, {B, S, H, D});
  out.lse = TensorView::contiguous(lse.data(), DType::f32, {B, H, S});
  attention(p, in, out);
  double maxerr = 0;
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < S; ++i) {
      std::vector<double> s(i + 1);
      double m = -1e300;
      for (int j = 0; j <= i; ++j) {
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += q[(i * H + h) * D + d] * k[(j * H + h) * D + d];
        s[j] = dot / std::sqrt(double(D));
        m = std::max(m, s[j]);
      }
      double l = 0;
      for (int j = 0; j <= i; ++j) l += std::exp(s[j] - m);
      for (int d = 0; d < D; ++d) {
        double acc = 0;
        for (int j = 0; j <= i; ++j) acc += std::exp(s[j] - m) * v[(j * H + h) * D + d];
        maxerr = std::max(maxerr, std::abs(acc / l - o[(i * H + h) * D + d]));
      }
      maxerr = std::max(maxerr, std::abs(m + std::log(l) - lse[h * S + i]));
    }
  EXPECT_LT(maxerr, 1e-4);
}
