#include "gpu/backward.hpp"

#include <algorithm>

#include "gpu/bwd/columns.cuh"
#include "gpu/bwd/rows.cuh"
#include "gpu/bwd/steps.cuh"
#include "gpu/work_order.cuh"

namespace bsattn::gpu {
namespace bwd {
#define BSATTN_DECLARE_FAMILY(NAME)                                                                            \
  cudaError_t run_##NAME(const BackwardParams* g, int block_n, const BackwardWorkspace& ws, const int* overflow, \
                         bool deterministic, cudaStream_t s);
BSATTN_DECLARE_FAMILY(bf16_d64)
BSATTN_DECLARE_FAMILY(bf16_d128)
BSATTN_DECLARE_FAMILY(bf16_d256)
BSATTN_DECLARE_FAMILY(f16_d64)
BSATTN_DECLARE_FAMILY(f16_d128)
BSATTN_DECLARE_FAMILY(f16_d256)
#undef BSATTN_DECLARE_FAMILY
}  // namespace bwd

namespace {

using Family = cudaError_t (*)(const BackwardParams*, int, const BackwardWorkspace&, const int*, bool, cudaStream_t);

// The compiled family for (dtype, head dim); null when the build left it out (the same switches
// as the forward: BSATTN_GPU_DTYPES / BSATTN_GPU_HEAD_DIMS).
Family family(ElementType t, int d) {
  const bool bf16 = t == ElementType::bf16, f16 = t == ElementType::f16;
  (void)bf16;
  (void)f16;
#ifdef BSATTN_FWD_BF16_D64
  if (bf16 && d == 64) return &bwd::run_bf16_d64;
#endif
#ifdef BSATTN_FWD_BF16_D128
  if (bf16 && d == 128) return &bwd::run_bf16_d128;
#endif
#ifdef BSATTN_FWD_BF16_D256
  if (bf16 && d == 256) return &bwd::run_bf16_d256;
#endif
#ifdef BSATTN_FWD_F16_D64
  if (f16 && d == 64) return &bwd::run_f16_d64;
#endif
#ifdef BSATTN_FWD_F16_D128
  if (f16 && d == 128) return &bwd::run_f16_d128;
#endif
#ifdef BSATTN_FWD_F16_D256
  if (f16 && d == 256) return &bwd::run_f16_d256;
#endif
  (void)d;
  return nullptr;
}

constexpr std::size_t align256(std::size_t x) { return (x + 255) / 256 * 256; }

struct Offsets {
  std::size_t lse, delta, semaphores, counts, columns, cta_order, end;
};
Offsets offsets(const BackwardGeometry& g) {
  Offsets o;
  const std::size_t row_values = static_cast<std::size_t>(g.q_rows) * g.heads_q * sizeof(float);
  o.lse = align256(static_cast<std::size_t>(g.dq_accum_floats()) * sizeof(float));
  o.delta = o.lse + align256(row_values);
  o.semaphores = o.delta + align256(row_values);
  o.counts = o.semaphores + align256(static_cast<std::size_t>(g.semaphores) * sizeof(std::int32_t));
  o.columns = o.counts + align256(static_cast<std::size_t>(g.columns) * sizeof(std::int32_t));
  o.cta_order = o.columns + align256(static_cast<std::size_t>(g.columns) * g.column_capacity * sizeof(ColumnRoute));
  o.end = o.cta_order + static_cast<std::size_t>(g.ctas) * sizeof(std::int32_t);
  return o;
}

}  // namespace

std::size_t BackwardWorkspace::bytes(const BackwardGeometry& g) { return offsets(g).end; }

void BackwardWorkspace::carve(void* base, const BackwardGeometry& g) {
  const Offsets o = offsets(g);
  char* p = static_cast<char*>(base);
  dq_accum = reinterpret_cast<float*>(p);
  lse_log2 = reinterpret_cast<float*>(p + o.lse);
  delta = reinterpret_cast<float*>(p + o.delta);
  semaphores = reinterpret_cast<std::int32_t*>(p + o.semaphores);
  column_counts = reinterpret_cast<std::int32_t*>(p + o.counts);
  columns = reinterpret_cast<ColumnRoute*>(p + o.columns);
  cta_order = reinterpret_cast<std::int32_t*>(p + o.cta_order);
  geometry = g;
}

int backward_kernel_block_n(ElementType dtype, int head_dim, int tile_n) {
  if (!family(dtype, head_dim) || tile_n <= 0 || tile_n % 16 != 0) return 0;
  if (tile_n <= 64) return 64;
  if (head_dim <= 128 && tile_n <= 128) return 128;
  return 0;
}

cudaError_t configure_backward(ElementType dtype, int head_dim, int tile_n) {
  const Family f = family(dtype, head_dim);
  const int block_n = backward_kernel_block_n(dtype, head_dim, tile_n);
  if (!f || block_n == 0) return cudaErrorInvalidValue;
  return f(nullptr, block_n, BackwardWorkspace{}, nullptr, false, nullptr);
}

cudaError_t run_backward(const BackwardParams& g, const BackwardWorkspace& ws, const int* overflow,
                         bool deterministic, cudaStream_t stream) {
  const AttentionParams& a = g.fwd;
  const Family f = family(a.in_type, a.head_dim);
  const int block_n = backward_kernel_block_n(a.in_type, a.head_dim, a.route.tile_n);
  if (!f || block_n == 0) return cudaErrorInvalidValue;
  const BackwardGeometry& geo = ws.geometry;
  const std::int64_t q_values = geo.q_rows * geo.heads_q;
  cudaError_t e = cudaSuccess;
  if (deterministic &&
      (e = cudaMemsetAsync(ws.semaphores, 0, static_cast<std::size_t>(geo.semaphores) * sizeof(std::int32_t), stream)) !=
          cudaSuccess)
    return e;
  if (q_values > 0) {  // without Q rows nothing reads the accumulator
    const std::int64_t rows_per_block = 32 * bwd::kRowWarps / bwd::preprocess_lanes(geo.head_dim);
    bwd::preprocess_kernel<<<static_cast<unsigned>((q_values + rows_per_block - 1) / rows_per_block),
                             32 * bwd::kRowWarps, 0, stream>>>(g, geo.q_rows, ws.lse_log2, ws.delta,
                                                               reinterpret_cast<float4*>(ws.dq_accum),
                                                               geo.dq_accum_floats() / 4);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  if (geo.columns > 0) {
    const int max_kv_tiles = route::ceil_div(a.route.max_seqlen_kv, a.route.tile_n);
    bwd::build_columns_kernel<<<static_cast<unsigned>((geo.columns + bwd::kColumnWarps - 1) / bwd::kColumnWarps),
                                32 * bwd::kColumnWarps, 0, stream>>>(a, max_kv_tiles, geo.columns, ws.columns,
                                                                     ws.column_counts, overflow);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    // The CTAs longest walk first within each (b, KV head) (work_order.cuh): random patterns give
    // columns of binomial length, and in block order the longest could start last. Not in
    // deterministic mode, whose dQ order has a CTA wait for the lower KV tiles of its (b, KV head):
    // started no later there, so no cycle of waits can form.
    if (!deterministic) {
      const bwd::CtaWork work = bwd::CtaWork::of(a.route, max_kv_tiles, ws.column_counts);
      order_by_work_kernel<<<1, kOrderThreads, 0, stream>>>(work, static_cast<int>(geo.ctas), work.order_groups(),
                                                             ws.cta_order, nullptr);
      if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    if ((e = f(&g, block_n, ws, overflow, deterministic, stream)) != cudaSuccess) return e;
  }
  if (q_values > 0) {
    constexpr int kThreads = 256;
    const std::int64_t chunks = q_values * (geo.head_dim / 8);
    const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((chunks + kThreads - 1) / kThreads, 1 << 16));
    bwd::convert_dq_kernel<<<blocks, kThreads, 0, stream>>>(g, geo.q_rows, geo.dq_tiles, ws.dq_accum, overflow);
    e = cudaGetLastError();
  }
  return e;
}

}  // namespace bsattn::gpu
