// Runs a small causal attention with block lists through the installed library and checks that
// every output is finite.
#include <bsattn/bsattn.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  using namespace bsattn;
  constexpr int S = 200, H = 2, D = 64, Bk = 64, nQB = (S + Bk - 1) / Bk;
  std::vector<float> q(S * H * D), k(q.size()), v(q.size()), out(q.size()), lse(H * S);
  for (std::size_t i = 0; i < q.size(); ++i) {
    q[i] = std::sin(0.37f * i);
    k[i] = std::cos(0.11f * i);
    v[i] = std::sin(0.05f * i + 1.0f);
  }
  // Query block qb attends KV blocks 0..qb (lower triangle); the causal mask trims the diagonal.
  std::vector<int> counts(nQB), indices(nQB * nQB);
  for (int qb = 0; qb < nQB; ++qb) {
    counts[qb] = qb + 1;
    for (int kb = 0; kb <= qb; ++kb) indices[qb * nQB + kb] = kb;
  }

  Problem p;
  p.heads_q = p.heads_kv = H;
  p.head_dim = D;
  p.max_seqlen_q = p.max_seqlen_kv = S;
  p.dtype = p.out_dtype = DType::f32;
  p.block = {Bk, Bk};
  p.format = Format::block_lists;
  p.mask.causal = true;
  Inputs in;
  in.q = TensorView::contiguous(q.data(), DType::f32, {1, S, H, D});
  in.k = TensorView::contiguous(k.data(), DType::f32, {1, S, H, D});
  in.v = TensorView::contiguous(v.data(), DType::f32, {1, S, H, D});
  in.partial.counts = TensorView::contiguous(counts.data(), DType::i32, {1, 1, nQB});
  in.partial.indices = TensorView::contiguous(indices.data(), DType::i32, {1, 1, nQB, nQB});
  Outputs o;
  o.out = TensorView::contiguous(out.data(), DType::f32, {1, S, H, D});
  o.lse = TensorView::contiguous(lse.data(), DType::f32, {1, H, S});
  attention(p, in, o);

  for (float x : out)
    if (!std::isfinite(x)) return std::puts("consumer: non-finite output"), 1;
  for (float x : lse)
    if (!std::isfinite(x)) return std::puts("consumer: non-finite LSE"), 1;
  std::puts("consumer: ok");
  return 0;
}
