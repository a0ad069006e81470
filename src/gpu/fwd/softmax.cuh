// Online softmax on the accumulator fragments of one warpgroup (64 rows; each thread holds 2 rows,
// a row is spread over the 4 threads of a quad). Scores stay in raw units; exp2 with a folded
// log2(e) * scale. A row that has seen nothing keeps max = -inf and sum = 0 (empty row: O = 0,
// LSE = -inf, never NaN).
// The row max is lazy: it is raised only when a step's max exceeds it by more than 2^kStaleMaxLog2
// in exp2 units, so most steps after the first leave it, and the factor of O, unchanged (factor
// exactly 1, and the caller skips O's rescale where no row of a warp moved: `rescale_output`).
// Exact, not an approximation: O, the sum and LSE all use the kept max, and p <= 2^8 stays far
// inside fp32 and bf16/fp16 range (the sum of 2^17 such p is 2^25).
#pragma once
#include <cmath>

#include "gpu/fwd/utils.cuh"

namespace bsattn::gpu::fwd {

// 2^x on the SFU, flushing denormal results to zero: exp2f without -ftz adds a range test and
// two multiplies per element around MUFU.EX2, a tenth of the softmax's instructions.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Row-sum weight of every column 1 (token columns): the plain softmax.
struct UnitColumnWeight {
  static constexpr bool kUnit = true;
};

constexpr float kStaleMaxLog2 = 8.0f;

// Max of row i of a rowcol fragment and `init`, in kPartials independent chains combined at the
// end: one chain was 32 dependent FMNMX (128-wide tiles) ahead of every exp of the row, with
// nothing else for the warp to issue (FlashAttention-4's SM90 softmax keeps 4 partial maxima).
// Order does not change a max (fmaxf skips NaN in any order): the result is the serial chain's.
template <class TS>
__device__ __forceinline__ float fragment_row_max(const TS& s, int i, float init) {
  constexpr int kCols = decltype(size<1>(s))::value;
  constexpr int kPartials = kCols % 4 == 0 ? 4 : 1;
  float part[kPartials];
  CUTE_UNROLL
  for (int p = 0; p < kPartials; ++p) part[p] = s(i, p);
  CUTE_UNROLL
  for (int j = kPartials; j < kCols; j += kPartials) {
    CUTE_UNROLL
    for (int p = 0; p < kPartials; ++p) part[p] = fmaxf(part[p], s(i, j + p));
  }
  CUTE_UNROLL
  for (int width = kPartials / 2; width > 0; width /= 2) {
    CUTE_UNROLL
    for (int p = 0; p < width; ++p) part[p] = fmaxf(part[p], part[p + width]);
  }
  return fmaxf(init, part[0]);
}

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];  // thread-partial sums; reduced over the quad at the end
  float scale_log2;

  __device__ __forceinline__ explicit OnlineSoftmax(float scale) : scale_log2(scale * float(M_LOG2E)) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.0f;
    }
  }

  // Turns the scores S (rowcol view) into unnormalised probabilities and returns, per row, the
  // factor by which the output accumulator must be rescaled. `weight(j)` is the row-sum weight of
  // fragment column j: 1 for a token; n_j for a proxy column (SPEC §6), whose V row is a sum of
  // n_j tokens' V, so P stays p for the PV GEMM and only the denominator counts n_j.
  template <class TS, class ColumnWeight = UnitColumnWeight>
  __device__ __forceinline__ void step(TS& s, float (&rescale)[kRows], const ColumnWeight& weight = {}) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const float mx = quad_max(fragment_row_max(s, i, row_max[i]));
      // False for equal infinities (NaN difference): the kept +inf max already made the row NaN.
      const bool raise = (mx - row_max[i]) * scale_log2 > kStaleMaxLog2;
      rescale[i] = raise ? exp2_ftz((row_max[i] - mx) * scale_log2) : 1.0f;
      if (raise) row_max[i] = mx;
      const float offset = row_max[i] == -INFINITY ? 0.0f : row_max[i] * scale_log2;
      float sum = 0.0f;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(s); ++j) {
        const float p = exp2_ftz(s(i, j) * scale_log2 - offset);
        s(i, j) = p;
        if constexpr (ColumnWeight::kUnit) sum += p;
        else sum = fmaf(p, weight(j), sum);
      }
      row_sum[i] = row_sum[i] * rescale[i] + sum;
    }
  }

  // Final 1 / sum per row (0 for an empty row) and the natural-log LSE (-inf for an empty row).
  // fmaxf in step() skips NaN scores, but their exp2 is NaN, so the sum carries them here.
  __device__ __forceinline__ void finish(float (&inv)[kRows], float (&lse)[kRows], float scale) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const float sum = quad_sum(row_sum[i]);
      const bool empty = sum == 0.0f;  // a NaN sum (NaN or +inf scores) is not empty: it shows as NaN
      inv[i] = empty ? 0.0f : 1.0f / sum;
      lse[i] = empty ? -INFINITY : row_max[i] * scale + logf(sum);
    }
  }
};

// Multiplies each row of an accumulator (rowcol view) by its factor.
template <int kRows, class TO>
__device__ __forceinline__ void scale_rows(TO& o, const float (&f)[kRows]) {
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    CUTE_UNROLL
    for (int j = 0; j < size<1>(o); ++j) o(i, j) *= f[i];
  }
}

// O's rescale after a softmax step, skipped by a whole warp when none of its rows' max moved (the
// lazy max leaves most factors exactly 1): a warp-uniform branch around kRows x D multiplies.
template <int kRows, class TO>
__device__ __forceinline__ void rescale_output(TO& o, const float (&f)[kRows]) {
  bool moved = false;
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) moved |= f[i] != 1.0f;
  if (__any_sync(0xffffffffu, moved)) scale_rows(o, f);
}

}  // namespace bsattn::gpu::fwd
