// Block selection (SPEC §7): the per-row rules and arithmetic, one body of code compiled by g++
// for the CPU engine (src/api/select.cpp) and by nvcc for the kernel (src/gpu/select_blocks.cu),
// so that both emit the same bitmask bit for bit. Bit identity rests on three rules:
//  * every floating-point operation goes through the *_rn helpers: on the device the correctly
//    rounded intrinsics, which nvcc never fuses or approximates whatever --fmad / --use_fast_math
//    say; on the host plain IEEE single precision (no -ffast-math in cmake/BsattnCpuFlags.cmake),
//    and no product ever feeds an addition except inside an explicit fma, so GCC's default
//    -ffp-contract=fast has nothing to fuse (select.cpp is also compiled with -ffp-contract=off);
//  * every sum has one order: sequential, or in chunks of kSelectChunk (chunk_fold), the same
//    partition on both sides;
//  * exp is select_exp below (fma polynomial), not expf / std::exp, whose last bits differ.
// Which blocks a policy picks follows from the scores alone (ties go to the lower block index), so
// the two sides may find them differently (a sort on the host, a bitonic network on the device).
#pragma once
#include <cstdint>

#include "bsattn/attention_params.hpp"
#include "bsattn/route/params.hpp"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#include <cstring>
#endif

namespace bsattn::route {

// ---- Correctly rounded single-precision operations --------------------------------------------

BSATTN_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
BSATTN_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
BSATTN_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
BSATTN_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
BSATTN_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
BSATTN_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
// Nearest integer, ties to even (the default rounding mode on the host).
BSATTN_HD float rint_rn(float a) {
#if defined(__CUDA_ARCH__)
  return rintf(a);
#else
  return std::rint(a);
#endif
}
BSATTN_HD std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
BSATTN_HD float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// exp(x) for x <= 0 (a score minus the row's maximum): x = k ln2 + r with |r| <= ln2 / 2, a
// degree-7 Taylor polynomial in r (error below 2^-24 relative), times 2^k. Below -87 (and NaN) the
// result is 0: such a block holds under 2^-125 of the row's mass.
BSATTN_HD float select_exp(float x) {
  if (!(x >= -87.0f)) return 0.0f;
  const float k = rint_rn(mul_rn(x, 1.44269504088896341f));
  float r = fma_rn(-k, 0.693145751953125f, x);  // ln 2, high part: k * it is exact for |k| <= 126
  r = fma_rn(-k, 1.42860682030941723212e-6f, r);  // ln 2, low part
  float p = 1.0f / 5040.0f;
  p = fma_rn(p, r, 1.0f / 720.0f);
  p = fma_rn(p, r, 1.0f / 120.0f);
  p = fma_rn(p, r, 1.0f / 24.0f);
  p = fma_rn(p, r, 1.0f / 6.0f);
  p = fma_rn(p, r, 0.5f);
  p = fma_rn(p, r, 1.0f);
  p = fma_rn(p, r, 1.0f);
  const int e = static_cast<int>(k);  // in [-126, 0]
  return mul_rn(p, bits_float(static_cast<std::uint32_t>(e + 127) << 23));
}

// ---- Fixed-order sums --------------------------------------------------------------------------

// Sums run over chunks of kSelectChunk consecutive terms: each chunk folds its terms in order from
// 0 (one GPU thread per chunk), then the chunk results are added in order from 0 (one thread).
constexpr int kSelectChunk = 32;

// step(acc, i) -> acc for i in [begin, end), from acc = 0.
template <class Step>
BSATTN_HD float chunk_fold(int begin, int end, const Step& step) {
  float acc = 0.0f;
  for (int i = begin; i < end; ++i) acc = step(acc, i);
  return acc;
}

// The chunks' results partial(c), c in [0, chunks), added in order.
template <class Partial>
BSATTN_HD float sum_chunks(int chunks, const Partial& partial) {
  float acc = 0.0f;
  for (int c = 0; c < chunks; ++c) acc = add_rn(acc, partial(c));
  return acc;
}

// ---- The rules of a row ------------------------------------------------------------------------

enum class SelectPolicyKind : std::uint8_t { top_k = 0, tau = 1, mass = 2 };

struct SelectRule {
  SelectPolicyKind policy = SelectPolicyKind::top_k;
  int top_k = 1;
  float tau = 0.0f;
  float mass = 1.0f;
  int sinks = 0;    // KV blocks [0, sinks) are forced
  int local = 0;    // KV blocks diag - local .. diag + local other than diag itself are forced
  bool diagonal = true;  // the diagonal block is forced
  bool causal = false;   // blocks entirely above the diagonal are not visible
};

// One row (b, hs, qb) of a sequence: which blocks it may select and where its diagonal is.
struct SelectRowShape {
  int visible = 0;   // blocks [0, visible) are visible: all nKB(b), or up to the diagonal when causal
  int diagonal = 0;  // KV block holding the aligned diagonal of the Q block's last in-range row,
                     // clamped to [0, nKB(b) - 1]
};

BSATTN_HD int floor_div(long long a, int b) {
  const long long q = a / b;
  return static_cast<int>((a % b != 0 && a < 0) ? q - 1 : q);
}

// `s` carries the alignment (s.diag_offset) of the rule's causal / diagonal, as for the mask.
BSATTN_HD SelectRowShape select_row_shape(const SelectRule& rule, const SeqInfo& s, int block_q, int block_kv, int qb) {
  SelectRowShape r;
  if (qb >= s.q_blocks || s.kv_blocks == 0) return r;
  const int q_end = (qb + 1) * block_q < s.seqlen_q ? (qb + 1) * block_q : s.seqlen_q;
  const int diag_block = floor_div(static_cast<long long>(q_end - 1) + s.diag_offset, block_kv);
  r.diagonal = diag_block < 0 ? 0 : (diag_block >= s.kv_blocks ? s.kv_blocks - 1 : diag_block);
  r.visible = s.kv_blocks;
  if (rule.causal) r.visible = diag_block < 0 ? 0 : (diag_block + 1 < s.kv_blocks ? diag_block + 1 : s.kv_blocks);
  return r;
}

BSATTN_HD bool select_forced(const SelectRule& rule, const SelectRowShape& r, int j) {
  if (j >= r.visible) return false;
  if (j < rule.sinks) return true;
  const int distance = j > r.diagonal ? j - r.diagonal : r.diagonal - j;
  return distance == 0 ? rule.diagonal : distance <= rule.local;
}

// The pooled query of a row: the sum of its Q elements (over the query heads the row covers, then
// the block's in-range tokens, in order) over the token count, times the softmax scale. A score
// is then fma_rn(pooled[d], k_summary[d], acc) for d = 0, 1, ... from acc = 0.
BSATTN_HD float pooled_query(float sum, int tokens, float scale) {
  return mul_rn(div_rn(sum, static_cast<float>(tokens)), scale);
}

// Descending order of (score, lower index first) as one unsigned key; NaN ranks as -inf and -0
// as +0. Every key of a block is above 0, the key of an empty slot.
BSATTN_HD std::uint64_t select_key(float score, int j) {
  if (score != score) score = -bits_float(0x7f800000u);
  if (score == 0.0f) score = 0.0f;
  std::uint32_t u = float_bits(score);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<std::uint64_t>(u) << 32) | (0xffffffffu - static_cast<std::uint32_t>(j));
}
BSATTN_HD int select_key_block(std::uint64_t key) {
  return static_cast<int>(0xffffffffu - static_cast<std::uint32_t>(key & 0xffffffffu));
}

// tau: blocks scoring at least mean + tau * std (population std over the visible scores).
BSATTN_HD float row_mean(float sum, int visible) { return div_rn(sum, static_cast<float>(visible)); }
BSATTN_HD float tau_threshold(float mean, float squared_deviations, int visible, float tau) {
  const float std_dev = sqrt_rn(div_rn(squared_deviations, static_cast<float>(visible)));
  return fma_rn(tau, std_dev, mean);
}
// The folds of the row sum (then row_mean) and of the squared deviations from the mean.
BSATTN_HD float fold_sum(float acc, float score) { return add_rn(acc, score); }
BSATTN_HD float fold_squared_deviation(float acc, float score, float mean) {
  const float deviation = sub_rn(score, mean);
  return fma_rn(deviation, deviation, acc);
}

// mass: with the visible scores in key order s_0 >= s_1 >= ..., p_i = select_exp(s_i - s_0) and
// prefix_i the fixed-order running sum (chunk offset + the chunk's own running sum), the policy
// keeps the first min(n, 1 + #{i : prefix_i < mass * total}) blocks; prefixes are monotone, so
// that is the smallest prefix whose mass reaches the fraction.
BSATTN_HD float fold_mass(float acc, float score, float row_max) { return add_rn(acc, select_exp(sub_rn(score, row_max))); }
BSATTN_HD float mass_target(float mass, float total) { return mul_rn(mass, total); }
// How many of the sorted positions [begin, end) of a chunk whose predecessors sum to `offset`
// have prefix_i < target; score(i) is the score at sorted position i.
template <class Score>
BSATTN_HD int mass_below_target(int begin, int end, float offset, float row_max, float target, const Score& score) {
  float running = 0.0f;
  int below = 0;
  for (int i = begin; i < end; ++i) {
    running = fold_mass(running, score(i), row_max);
    below += add_rn(offset, running) < target ? 1 : 0;
  }
  return below;
}

// Everything a selection call needs, by value (also the kernel's parameter).
struct SelectParams {
  AttentionParams tensors;  // Q, k_summary and the sequence lengths; route.top_left = the rule's alignment
  SelectRule rule;
  int heads = 1;   // sparsity heads Hs: Hq (a row per query head) or Hkv (a row per KV head)
  int group = 1;   // query heads pooled into a row: 1, or Hq / Hkv
  std::uint32_t* bits = nullptr;  // batched [B, Hs, nQB, W] (b, hs, qb, w); varlen [Hs, M, W] (hs, m, w)
  std::int64_t bits_stride[4] = {0, 0, 0, 0};
  int words = 0;        // W
  int rows = 0;         // rows per sparsity head: B * nQB (batched) or M (varlen)
  int max_kv_blocks = 0;

  BSATTN_HD std::uint32_t* row_words(int hs, int row) const {
    const RouteParams& p = tensors.route;
    if (p.varlen_q) return bits + hs * bits_stride[0] + row * bits_stride[1];
    return bits + (row / p.max_q_blocks) * bits_stride[0] + hs * bits_stride[1] + (row % p.max_q_blocks) * bits_stride[2];
  }
  BSATTN_HD std::int64_t word_stride() const { return tensors.route.varlen_q ? bits_stride[2] : bits_stride[3]; }
};

// The (b, qb) of output row `row`; false for a varlen row past the last sequence's blocks.
BSATTN_HD bool select_row_position(const RouteParams& p, int row, int& b, int& qb) {
  if (!p.varlen_q) {
    b = row / p.max_q_blocks;
    qb = row % p.max_q_blocks;
    return true;
  }
  int base = 0;
  for (b = 0; b < p.batch; ++b) {
    const int blocks = ceil_div(p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b], p.block_q);
    if (row < base + blocks) {
      qb = row - base;
      return true;
    }
    base += blocks;
  }
  return false;
}

}  // namespace bsattn::route
