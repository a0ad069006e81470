// Host check of the GPU route preparation kernel (src/gpu/prepare_routes.cu on cuda_emulation.hpp:
// a warp per row, with and without the proxy pass, lane collectives included) against
// route::prepare_row, record for record: counts, the trailing proxy-record counts, and the
// overflow flag, on random block lists and bitmasks (junk entries, short counts), full sets, proxy
// modes 0 / 1 / 2, causal / window / sinks, Bq and Bk 16-128, up to 250 KV blocks, capacities large
// and small; then decode-like cases of 1 to 16 rows of 100 to 2000 KV blocks (the all-blocks and
// bitmask ones take the split launch, a block of warps per row: the check counts them; lists
// stay a warp per row, read 32 entries a step).
// BSATTN_EMULATION_REVERSE=1 runs the lanes in reverse order.
//   g++ -std=c++20 -O2 -w -DBSATTN_GPU_HOST_EMULATION=1 -I tests/gpu/emulation/stub_cub -I tests/gpu/emulation \
//     -I include -I src -I /usr/local/cuda/include tests/gpu/emulation/prepare_routes_check.cpp -o /tmp/prep_check \
//     && /tmp/prep_check
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>

#include "cuda_emulation.hpp"

#define cudaGetLastError() cudaSuccess
#define blockDim (dim3(static_cast<unsigned>(cuda_emulation::block()->threads.size()), 1, 1))
inline int __shfl_up_sync(unsigned, int v, int d) {
  const int lane = cuda_emulation::block()->current & 31;
  return static_cast<int>(cuda_emulation::collective(static_cast<std::uint32_t>(v), [&](const std::uint32_t* lanes) {
    return lanes[lane >= d ? lane - d : lane];
  }));
}
inline int __shfl_sync(unsigned, int v, int src) {
  return static_cast<int>(cuda_emulation::collective(static_cast<std::uint32_t>(v),
                                                     [&](const std::uint32_t* lanes) { return lanes[src]; }));
}
inline unsigned __reduce_or_sync(unsigned, unsigned v) {
  return cuda_emulation::collective(v, [](const std::uint32_t* lanes) {
    std::uint32_t bits = 0;
    for (int i = 0; i < 32; ++i) bits |= lanes[i];
    return bits;
  });
}
inline int atomicCAS(int* p, int expected, int value) {
  const int old = *p;
  if (old == expected) *p = value;
  return old;
}
inline int atomicExch(int* p, int v) {
  const int old = *p;
  *p = v;
  return old;
}
inline void __threadfence() {}
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p += v;
  return old;
}
namespace bsattn::gpu {
namespace {
alignas(16) std::int32_t part_counts[64];  // the split kernel's extern __shared__ array
const bool registered =
    (cuda_emulation::shared_array() = {reinterpret_cast<unsigned char*>(part_counts), sizeof part_counts}, true);
}  // namespace
}  // namespace bsattn::gpu
// Counts the launches of a block of warps per row (more than the 128 threads of 4 rows a block).
long split_launches = 0;
template <class Kernel, class... Args>
void counted_launch(Kernel kernel, dim3 grid, int threads, std::size_t shared_bytes, Args... args) {
  split_launches += threads > 128;
  emulate_launch(kernel, grid, threads, shared_bytes, args...);
}
#define emulate_launch counted_launch
#include "../../../src/gpu/prepare_routes.cu"

using namespace bsattn::route;

// argv[1]: a divisor of the number of random cases (ctest runs a sixteenth of them).
int main(int argc, char** argv) {
  const int divisor = argc > 1 ? std::max(1, std::atoi(argv[1])) : 1;
  const int short_cases = 400 / divisor, cases = short_cases + 120 / divisor;
  // The plan's flags, kept from launch to launch as in a plan (gpu/prepare_routes.hpp).
  std::vector<std::int32_t> flag(bsattn::gpu::kRouteFlagWords, 0);
  std::mt19937 rng(7);
  const auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  long rows_checked = 0, records = 0, proxies = 0, bad = 0;
  for (int it = 0; it < cases; ++it) {
    const bool long_rows = it >= short_cases;  // few rows of many blocks (a decode step)
    RouteParams p;
    p.batch = uni(1, 2);
    p.heads_q = p.heads_kv = p.sparsity_heads = uni(1, 2);
    p.sparsity_batch = uni(0, 1) ? 1 : p.batch;
    const int sizes[] = {16, 32, 64, 128};
    p.block_q = sizes[uni(0, 3)];
    p.block_kv = sizes[uni(0, 3)];
    p.tile_m = p.block_q % 128 == 0 ? 128 : 64;
    p.unit_m = std::min(p.block_q, p.tile_m);
    do p.tile_n = 16 * uni(1, 8);
    while (p.block_kv % p.tile_n);
    p.max_seqlen_q = long_rows ? uni(1, 200) : uni(1, 2000);
    p.max_seqlen_kv = long_rows ? uni(100, 2000) * p.block_kv - uni(0, p.block_kv - 1) : uni(1, 4000);
    p.max_q_tiles = ceil_div(p.max_seqlen_q, p.tile_m);
    p.max_q_blocks = ceil_div(p.max_seqlen_q, p.block_q);
    p.max_kv_blocks = ceil_div(p.max_seqlen_kv, p.block_kv);
    const int format = uni(0, 2);
    p.format = format == 0 ? SetFormat::all_blocks : format == 1 ? SetFormat::block_lists : SetFormat::bitmask;
    p.has_full = format != 0 && uni(0, 1);
    p.proxy_mode = uni(0, 3) ? uni(1, format == 0 ? 1 : 2) : 0;
    p.causal = uni(0, 1);
    p.top_left = uni(0, 1);
    p.window_left = uni(0, 2) ? -1 : uni(0, long_rows ? p.max_seqlen_kv : 3000);
    p.window_right = uni(0, 2) ? -1 : uni(0, long_rows ? p.max_seqlen_kv : 3000);
    p.sink_tokens = uni(0, 1) ? 0 : uni(0, 500);
    // Partial, full and proxy sets of random density as lists and bitmasks [Bs, Hs, nQB, nKB | words].
    const int sets_rows = p.sparsity_batch * p.sparsity_heads * p.max_q_blocks, nkb = p.max_kv_blocks;
    const int words = (nkb + 31) / 32;
    std::vector<int> counts[3], lists[3];
    std::vector<std::uint32_t> bits[3];
    BlockSetParams* sets[3] = {&p.partial, &p.full, &p.proxy};
    const double density = uni(1, 100) / 100.0;
    for (int k = 0; k < 3; ++k) {
      counts[k].assign(sets_rows, 0);
      lists[k].assign(static_cast<std::size_t>(sets_rows) * nkb, -1);
      bits[k].assign(static_cast<std::size_t>(sets_rows) * words, 0);
      for (int r = 0; r < sets_rows; ++r) {
        int n = 0;
        for (int j = 0; j < nkb; ++j)
          if (std::uniform_real_distribution<double>(0, 1)(rng) < density) {
            lists[k][static_cast<std::size_t>(r) * nkb + n++] = j;
            bits[k][static_cast<std::size_t>(r) * words + j / 32] |= 1u << (j % 32);
          }
        if (uni(0, long_rows ? 3 : 20) == 0 && n > 1)  // junk: out of range, repeated, descending
          for (int j = long_rows ? uni(1, 40) : 1; j > 0; --j)
            lists[k][static_cast<std::size_t>(r) * nkb + uni(0, n - 1)] = uni(-3, nkb + 3);
        counts[k][r] = uni(0, 15) == 0 ? uni(-2, nkb + 2) : n;
      }
      BlockSetParams& s = *sets[k];
      if (format == 1) {
        s.counts = counts[k].data();
        s.indices = lists[k].data();
      } else if (format == 2) {
        s.bits = bits[k].data();
      }
      const std::int64_t qb = p.max_q_blocks, hs = p.sparsity_heads;
      s.count_stride[0] = hs * qb, s.count_stride[1] = qb, s.count_stride[2] = 1;
      s.index_stride[0] = hs * qb * nkb, s.index_stride[1] = qb * nkb, s.index_stride[2] = nkb, s.index_stride[3] = 1;
      s.bits_stride[0] = hs * qb * words, s.bits_stride[1] = qb * words, s.bits_stride[2] = words, s.bits_stride[3] = 1;
      s.list_length = nkb;
    }
    const int rows = p.batch * p.sparsity_heads * p.max_q_tiles;
    const int most = nkb * (p.block_kv / p.tile_n) + nkb;
    for (int capacity : {most, uni(1, 30), long_rows ? uni(1, most) : 0}) {
      if (capacity == 0) continue;
      p.capacity = capacity;
      bsattn::AttentionParams a;
      a.route = p;
      a.route_rows = rows;
      std::vector<Route> got(static_cast<std::size_t>(rows) * capacity), want(capacity);
      std::vector<std::int32_t> got_counts(rows, -1), got_proxies(rows, -1);
      bsattn::gpu::prepare_routes(a, got.data(), got_counts.data(), flag.data(), nullptr,
                                  p.proxy_mode ? got_proxies.data() : nullptr);
      bool overflow = false;
      for (int row = 0; row < rows; ++row) {
        const int needed = prepare_row(p, row, want.data());
        const int stored = std::min(needed, capacity);
        int trailing = 0;
        while (trailing < stored && want[stored - 1 - trailing].kind == static_cast<std::uint8_t>(RouteKind::proxy))
          ++trailing;
        overflow |= needed > capacity;
        ++rows_checked;
        records += stored;
        proxies += trailing;
        const bool same = got_counts[row] == stored &&
                          std::memcmp(&got[static_cast<std::size_t>(row) * capacity], want.data(), stored * sizeof(Route)) == 0 &&
                          (!p.proxy_mode || got_proxies[row] == trailing);
        if (!same && bad < 5)
          for (int i = 0; i < stored; ++i) {
            const Route& g = got[static_cast<std::size_t>(row) * capacity + i];
            if (std::memcmp(&g, &want[i], sizeof(Route))) {
              std::printf("  record %d: got %d/%d/%d/%d want %d/%d/%d/%d (cap %d)\n", i, g.index, g.kind, g.rows, g.masked,
                          want[i].index, want[i].kind, want[i].rows, want[i].masked, capacity);
              break;
            }
          }
        if (!same && bad++ < 5)
          std::printf("case %d row %d: %d records (want %d), %d proxy (want %d); format %d, proxy mode %d, units %d\n", it,
                      row, got_counts[row], stored, got_proxies[row], trailing, format, p.proxy_mode,
                      p.tile_m / p.unit_m);
      }
      if ((flag[0] != 0) != overflow || (flag[0] && flag[1] != prepare_row(p, flag[0] - 1, want.data()))) {
        if (bad++ < 5) std::printf("case %d: overflow flag {%d, %d}, overflow expected: %d\n", it, flag[0], flag[1], overflow);
      }
      // No memset between launches: the kernel must leave its own words zero for the next one.
      if (flag[3] != 0 || flag[4] != 0 || flag[5] != 0) {
        if (bad++ < 5) std::printf("case %d: flags left {%d, %d, %d}\n", it, flag[3], flag[4], flag[5]);
      }
    }
  }
  std::printf("%ld route rows checked (%ld records, %ld proxy), %ld bad; %ld split launches\n", rows_checked, records,
              proxies, bad, split_launches);
  return bad != 0 || split_launches == 0;
}
