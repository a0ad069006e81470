// Metadata value checks on the GPU (check_values.hpp): two launches, the lengths first (one
// block: they decide every row's extent and the varlen offsets), then the block-set rows (a
// thread per row). Each rule is the one of formats/validate_values.cpp; a broken one raises the
// flag word and the host names it. Every read stays inside its tensor's extents whatever the
// values are: a row is read only through offsets the first launch found valid.
#include "gpu/check_values.hpp"

#include <cub/block/block_scan.cuh>

#include "gpu/prepare_routes.hpp"

namespace bsattn::gpu {
namespace {

using formats::IntTensor;
using formats::SetTensors;
using formats::ValueCheckParams;

constexpr int kLengthThreads = 256;
constexpr int kRowThreads = 128;
constexpr std::int64_t kInt32Max = 0x7fffffff;

__device__ bool present(const ValueCheckParams& c, const SetTensors& t) {
  switch (c.geo.format) {
    case route::SetFormat::block_lists:
    case route::SetFormat::varlen_block_lists: return t.counts.data != nullptr;
    case route::SetFormat::bsr: return t.indptr.data != nullptr;
    case route::SetFormat::bitmask: return t.bits.data != nullptr;
    default: return false;
  }
}

// Lengths, page ids, the varlen offsets the lengths imply (written to cu_m / cu_idx), the given
// offsets against them, and the set extents and BSR indptr that depend on them.
__global__ void __launch_bounds__(kLengthThreads)
    check_lengths_kernel(const ValueCheckParams c, std::int32_t* flags, std::int32_t* cu_m, std::int32_t* cu_idx) {
  using Scan = cub::BlockScan<long long, kLengthThreads>;
  __shared__ typename Scan::TempStorage scan_m, scan_idx;
  __shared__ int bad;
  __shared__ long long total_m, total_idx;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) bad = 0, total_m = 0, total_idx = 0;
  __syncthreads();
  const route::RouteParams& g = c.geo;
  const int B = g.batch;
  const auto fail = [&] { bad = 1; };  // every writer stores 1

  const auto check_cu = [&](const IntTensor& cu, std::int64_t total, int max_len) {
    for (int b = tid; b <= B; b += kLengthThreads) {
      const std::int64_t at = cu.at(b);
      if ((b == 0 && at != 0) || (b == B && at != total)) fail();
      if (b < B) {
        const std::int64_t next = cu.at(b + 1);
        if (next < at || next - at > max_len) fail();
      }
    }
  };
  if (g.varlen_q) check_cu(c.cu_seqlens_q, c.total_q, g.max_seqlen_q);
  if (g.varlen_kv) {
    check_cu(c.cu_seqlens_k, c.total_kv, g.max_seqlen_kv);
    if (c.seqused_k.data)
      for (int b = tid; b < B; b += kLengthThreads) {
        const std::int64_t used = c.seqused_k.at(b);
        if (used < 0 || used > static_cast<std::int64_t>(c.cu_seqlens_k.at(b + 1)) - c.cu_seqlens_k.at(b)) fail();
      }
  }
  if (g.paged) {
    const std::int64_t readable = static_cast<std::int64_t>(c.pages_per_seq) * c.page_size;
    const auto length_ok = [&](std::int64_t len) { return len >= 0 && len <= readable && len <= g.max_seqlen_kv; };
    for (int b = tid; b < B; b += kLengthThreads)
      if (!length_ok(c.seq_lens_kv.at(b))) fail();
    // The live prefix of each row: its page ids must name pages of the cache.
    const std::int64_t entries = static_cast<std::int64_t>(B) * c.pages_per_seq;
    for (std::int64_t i = tid; i < entries; i += kLengthThreads) {
      const std::int64_t b = i / c.pages_per_seq, j = i % c.pages_per_seq;
      const std::int64_t len = c.seq_lens_kv.at(b);
      if (!length_ok(len) || j >= (len + c.page_size - 1) / c.page_size) continue;
      const std::int32_t page = c.block_table.at(b, j);
      if (page < 0 || page >= c.num_pages) fail();
    }
  }
  __syncthreads();
  if (bad) {  // the offsets below would follow bad lengths
    if (tid == 0) flags[kValuesInvalidWord] = 1;
    return;
  }

  // Exclusive prefix sums of nQB(b) and nQB(b) * nKB(b) (SPEC §3.2), a block of sequences at a time.
  for (int b0 = 0; b0 < B; b0 += kLengthThreads) {
    const int b = b0 + tid;
    long long m = 0, idx = 0;
    if (b < B) {
      const route::SeqInfo s = route::seq_info(g, b);
      m = s.q_blocks;
      idx = static_cast<long long>(s.q_blocks) * s.kv_blocks;
    }
    long long m_end, idx_end, m_sum, idx_sum;
    Scan(scan_m).InclusiveSum(m, m_end, m_sum);
    Scan(scan_idx).InclusiveSum(idx, idx_end, idx_sum);
    if (b < B) {
      cu_m[b + 1] = static_cast<std::int32_t>(total_m + m_end);
      cu_idx[b + 1] = static_cast<std::int32_t>(total_idx + idx_end);
    }
    __syncthreads();
    if (tid == 0) total_m += m_sum, total_idx += idx_sum;
    __syncthreads();
  }
  if (tid == 0) cu_m[0] = 0, cu_idx[0] = 0;
  __syncthreads();  // the block's global writes are visible to the block after this

  // The int32 range of the offsets the kernels index with, and the given offsets.
  if (tid == 0 && total_idx > kInt32Max &&
      (g.format == route::SetFormat::varlen_block_lists || c.cu_block_idx_offsets.data))
    fail();
  for (int b = tid; b <= B; b += kLengthThreads) {
    if (c.cu_total_m_blocks.data && c.cu_total_m_blocks.at(b) != cu_m[b]) fail();
    if (c.cu_block_idx_offsets.data && c.cu_block_idx_offsets.at(b) != cu_idx[b]) fail();
  }
  // Extents the sequences decide: varlen rows, and each BSR set's indptr.
#pragma unroll
  for (int set = 0; set < 3; ++set) {  // unrolled: a dynamic index would copy the parameters to the stack
    const SetTensors& t = c.sets[set];
    if (!present(c, t)) continue;
    switch (g.format) {
      case route::SetFormat::varlen_block_lists:
        if (tid == 0 && (t.counts.shape[1] < total_m || t.indices.shape[1] < total_idx)) fail();
        break;
      case route::SetFormat::bitmask:
        if (tid == 0 && c.varlen_rows && t.bits.shape[1] < total_m) fail();
        break;
      case route::SetFormat::bsr: {
        const std::int64_t size = t.indptr.shape[0];
        const std::int64_t rows = c.varlen_rows ? g.sparsity_heads * total_m : size - 1;
        if (size != rows + 1) {
          if (tid == 0) fail();
          break;
        }
        if (tid == 0 && (t.indptr.at(0) != 0 || t.indptr.at(rows) > t.indices.shape[0])) fail();
        for (std::int64_t r = tid; r < rows; r += kLengthThreads)
          if (t.indptr.at(r + 1) < t.indptr.at(r)) fail();
        break;
      }
      default: break;
    }
  }
  __syncthreads();
  if (tid == 0) flags[kValuesInvalidWord] = bad;
}

// One row's entries of a list or BSR set: first[i * step], i < count.
struct Entries {
  const std::int32_t* first = nullptr;
  std::int64_t step = 0;
  std::int64_t count = 0;
  __device__ std::int32_t operator[](std::int64_t i) const { return first[i * step]; }
};

// Where a row (sequence b, stored row bs, hs, qb) reads one block set.
struct RowAt {
  int b, bs, hs, qb, kv_blocks;
  std::int64_t total_m;
};

// The row's entries of a list or BSR set; false where its count is out of range.
__device__ bool row_entries(const ValueCheckParams& c, const SetTensors& t, const RowAt& row, const std::int32_t* cu_m,
                            const std::int32_t* cu_idx, Entries& e) {
  const route::RouteParams& g = c.geo;
  switch (g.format) {
    case route::SetFormat::block_lists: {
      e.count = t.counts.at(row.bs, row.hs, row.qb);
      if (e.count < 0 || e.count > t.indices.shape[3]) return false;
      const IntTensor& x = t.indices;
      e.first = x.data + row.bs * x.stride[0] + row.hs * x.stride[1] + row.qb * x.stride[2];
      e.step = x.stride[3];
      return true;
    }
    case route::SetFormat::varlen_block_lists: {
      e.count = t.counts.at(row.hs, static_cast<std::int64_t>(cu_m[row.b]) + row.qb);
      if (e.count < 0 || e.count > row.kv_blocks) return false;
      const std::int64_t start = static_cast<std::int64_t>(cu_idx[row.b]) + static_cast<std::int64_t>(row.qb) * row.kv_blocks;
      e.first = t.indices.data + row.hs * t.indices.stride[0] + start * t.indices.stride[1];
      e.step = t.indices.stride[1];
      return true;
    }
    case route::SetFormat::bsr: {
      const std::int64_t r =
          c.varlen_rows ? row.hs * row.total_m + cu_m[row.b] + row.qb
                        : (static_cast<std::int64_t>(row.bs) * g.sparsity_heads + row.hs) * g.max_q_blocks + row.qb;
      if (r + 1 >= t.indptr.shape[0]) return false;
      const std::int64_t lo = t.indptr.at(r);
      e.count = t.indptr.at(r + 1) - lo;
      e.first = t.indices.data + lo * t.indices.stride[0];
      e.step = t.indices.stride[0];
      return true;
    }
    default: return false;
  }
}

__device__ bool ascending_in_range(const Entries& e, int kv_blocks) {
  int previous = -1;
  for (std::int64_t i = 0; i < e.count; ++i) {
    const int block = e[i];
    if (block <= previous || block >= kv_blocks) return false;  // previous >= -1: negatives fail too
    previous = block;
  }
  return true;
}

__device__ bool disjoint(const Entries& a, const Entries& b) {
  std::int64_t i = 0, j = 0;
  while (i < a.count && j < b.count) {
    const int x = a[i], y = b[j];
    if (x == y) return false;
    if (x < y) ++i;
    else ++j;
  }
  return true;
}

// A thread per row the engine reads: entries in [0, nKB(b)), strictly ascending, counts in range,
// partial and full disjoint. Rows are those of for_each_row() in validate_values.cpp.
__global__ void __launch_bounds__(kRowThreads)
    check_rows_kernel(const ValueCheckParams c, std::int32_t* flags, const std::int32_t* cu_m,
                      const std::int32_t* cu_idx) {
  if (*static_cast<volatile std::int32_t*>(&flags[kValuesInvalidWord]) != 0) return;  // extents unknown
  const route::RouteParams& g = c.geo;
  const int B = g.batch, hs_count = g.sparsity_heads;
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kRowThreads + threadIdx.x;
  RowAt row;
  row.total_m = cu_m[B];
  if (c.varlen_rows) {
    if (r >= hs_count * row.total_m) return;
    row.hs = static_cast<int>(r / row.total_m);
    const std::int64_t m = r % row.total_m;
    int lo = 0, hi = B - 1;  // the sequence b with cu_m[b] <= m < cu_m[b + 1]
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (cu_m[mid] <= m) lo = mid;
      else hi = mid - 1;
    }
    row.b = row.bs = lo;
    row.qb = static_cast<int>(m - cu_m[lo]);
    row.kv_blocks = route::seq_info(g, lo).kv_blocks;
  } else {
    const int q_blocks = g.max_q_blocks;
    if (r >= static_cast<std::int64_t>(g.sparsity_batch) * hs_count * q_blocks) return;
    row.qb = static_cast<int>(r % q_blocks);
    row.hs = static_cast<int>(r / q_blocks % hs_count);
    row.b = row.bs = static_cast<int>(r / (static_cast<std::int64_t>(q_blocks) * hs_count));
    // A broadcast row (Bs = 1) is read by every sequence long enough, up to the longest one's nKB.
    row.kv_blocks = -1;
    for (int b = 0; b < B; ++b)
      if (g.sparsity_batch == 1 || b == row.bs) {
        const route::SeqInfo s = route::seq_info(g, b);
        if (s.q_blocks > row.qb) row.kv_blocks = max(row.kv_blocks, s.kv_blocks);
      }
    if (row.kv_blocks < 0) return;  // no sequence reads this row
  }

  bool ok = true;
  if (g.format == route::SetFormat::bitmask) {
    if (c.check_disjoint) {
      const IntTensor &p = c.sets[0].bits, &f = c.sets[1].bits;
      const std::int64_t line = static_cast<std::int64_t>(cu_m[row.b]) + row.qb;  // varlen rows
      for (int w = 0; w * 32 < row.kv_blocks && ok; ++w) {
        const int tail = row.kv_blocks - 32 * w;
        const unsigned live = tail >= 32 ? 0xffffffffu : (1u << tail) - 1u;  // bits past nKB are ignored
        const unsigned both = c.varlen_rows ? unsigned(p.at(row.hs, line, w)) & unsigned(f.at(row.hs, line, w))
                                            : unsigned(p.at(row.bs, row.hs, row.qb, w)) &
                                                  unsigned(f.at(row.bs, row.hs, row.qb, w));
        ok = (both & live) == 0u;
      }
    }
  } else {
    Entries e[3];
    for (int s = 0; s < 3 && ok; ++s)
      if (present(c, c.sets[s]))
        ok = row_entries(c, c.sets[s], row, cu_m, cu_idx, e[s]) && ascending_in_range(e[s], row.kv_blocks);
    if (ok && c.check_disjoint) ok = disjoint(e[0], e[1]);
  }
  if (!ok) flags[kValuesInvalidWord] = 1;
}

}  // namespace

cudaError_t check_values(const formats::ValueCheckParams& c, std::int32_t* flags, std::int32_t* cu_m,
                         std::int32_t* cu_idx, cudaStream_t stream) {
  const route::RouteParams& g = c.geo;
  // Batched dense attention has no metadata: nothing to launch, and the flag (never raised for
  // such a plan) stays 0.
  if (!g.varlen_q && !g.varlen_kv && !g.paged && g.format == route::SetFormat::all_blocks) return cudaSuccess;
  check_lengths_kernel<<<1, kLengthThreads, 0, stream>>>(c, flags, cu_m, cu_idx);
  if (g.format == route::SetFormat::all_blocks) return cudaGetLastError();
  // Varlen rows: Hs * total_m_blocks, and total_m_blocks <= total_q / Bq + B.
  const std::int64_t rows = c.varlen_rows
                                ? static_cast<std::int64_t>(g.sparsity_heads) * (c.total_q / g.block_q + g.batch)
                                : static_cast<std::int64_t>(g.sparsity_batch) * g.sparsity_heads * g.max_q_blocks;
  if (rows > 0) {
    const auto blocks = static_cast<unsigned>((rows + kRowThreads - 1) / kRowThreads);
    check_rows_kernel<<<blocks, kRowThreads, 0, stream>>>(c, flags, cu_m, cu_idx);
  }
  return cudaGetLastError();
}

}  // namespace bsattn::gpu
