// Host check of the GPU proxy kernel's index arithmetic (src/gpu/fwd/proxy.cuh, scheduler.cuh:
// the trailing proxy-record count of prepare_routes_kernel, the windows of kBlockN blocks from the
// first proxy record's to the last's (128 with route pairs), a window's visibility built from the records by the
// kernel's cursor walk (kBlockN records read per window), the short last block's column and
// weight) against the CPU engine's per-record loop (cpu/engine.hpp: every record the unit takes,
// weight min(Bk, Skv - j Bk)), on route rows made by the real route::prepare_row (random block
// lists, tails, causal / window, Bq 16-256, Bk 16-256). Scores are all 0 so that only which
// columns count, and with what weight, is compared.
//   ctest -R gpu_proxy_windows_model, or: g++ -std=c++17 -O2 -I include tests/gpu/emulation/proxy_index_check.cpp
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>
#include "bsattn/route/prepare.hpp"
using namespace bsattn::route;
int main() {
  std::mt19937 rng(1);
  auto uni = [&](int a, int b) { return std::uniform_int_distribution<int>(a, b)(rng); };
  long checked = 0, bad = 0, rows_all_proxy = 0, rows_none = 0, multi_step = 0, short_hits = 0;
  for (int it = 0; it < 3000; ++it) {
    RouteParams p;
    const int bqs[] = {16, 32, 64, 128, 256}, bks[] = {16, 32, 48, 64, 96, 128, 256};
    p.block_q = bqs[uni(0, 4)];
    p.block_kv = bks[uni(0, 6)];
    p.tile_m = p.block_q % 128 == 0 ? 128 : 64;
    p.tile_n = 16; for (int t = 16; t <= 128; t += 16) if (p.block_kv % t == 0) p.tile_n = t;
    p.unit_m = std::min(p.block_q, p.tile_m);
    // Route pairs (128-row tiles, routes of at most 64 tokens): 128-wide steps, windows of 128.
    const bool route_pairs = p.tile_n <= 64 && p.tile_m == 128 && uni(0, 1);
    const int kBlockN = p.tile_n <= 64 && !route_pairs ? 64 : 128;
    p.max_seqlen_q = uni(1, 3000); p.max_seqlen_kv = uni(1, 9000);
    p.causal = uni(0, 1); p.top_left = uni(0, 1);
    if (uni(0, 3) == 0) { p.window_left = uni(0, 500); }
    p.max_q_tiles = ceil_div(p.max_seqlen_q, p.tile_m);
    p.max_q_blocks = ceil_div(p.max_seqlen_q, p.block_q);
    p.max_kv_blocks = ceil_div(p.max_seqlen_kv, p.block_kv);
    p.format = SetFormat::block_lists;
    const int nq = p.max_q_blocks, nk = p.max_kv_blocks;
    std::vector<int> cnt(nq), idx(size_t(nq) * nk);
    const double dens = uni(0, 4) * 0.25;
    for (int qb = 0; qb < nq; ++qb) { int c = 0; for (int kb = 0; kb < nk; ++kb) if (std::uniform_real_distribution<>(0,1)(rng) < dens) idx[size_t(qb) * nk + c++] = kb; cnt[qb] = c; }
    p.partial.counts = cnt.data(); p.partial.indices = idx.data();
    p.partial.count_stride[2] = 1; p.partial.index_stride[2] = nk; p.partial.index_stride[3] = 1; p.partial.list_length = nk;
    p.proxy_mode = 1;
    p.capacity = nk * (p.block_kv / p.tile_n) + nk;
    std::vector<Route> rec(p.capacity);
    const SeqInfo s = seq_info(p, 0);
    for (int row = 0; row < p.max_q_tiles; ++row) {
      const int count = prepare_row(p, row, rec.data());
      int proxies = 0;  // as prepare_routes_kernel
      while (proxies < count && rec[count - 1 - proxies].kind == 1) ++proxies;
      const int exact = count - proxies;
      // As tile_routes: the windows from the first proxy record's to the last's.
      const int window0 = proxies ? rec[exact].index / kBlockN : 0;
      const int steps = proxies ? rec[count - 1].index / kBlockN - window0 + 1 : 0;
      for (int i = 0; i < exact; ++i) if (rec[i].kind != 0) { ++bad; printf("proxy record among exact ones\n"); }
      for (int i = exact + 1; i < count; ++i) if (rec[i].index <= rec[i - 1].index) { ++bad; printf("proxy records not in block order\n"); }
      if (exact == 0 && proxies) ++rows_all_proxy;
      if (!proxies) ++rows_none;
      if (steps > 1) ++multi_step;
      for (int r = 0; r < p.tile_m; ++r) {  // tile rows (kernel: tile_row0 + warpgroup row)
        const int unit = r / p.unit_m;
        // CPU engine: weight sum of n_j over the records the unit takes (scores all 0: p = 1).
        double cpu_den = 0, cpu_num = 0;
        for (int i = exact; i < count; ++i) if ((rec[i].rows >> unit) & 1u) {
          const int nj = std::min(p.block_kv, s.seqlen_kv - rec[i].index * p.block_kv);
          cpu_den += nj; cpu_num += rec[i].index + 1;  // V summary of block j: j + 1
        }
        // Kernel (proxy_softmax): per window, kBlockN records from the cursor; those inside the
        // window set their column's bit for the units they name; the cursor moves past them.
        double gpu_den = 0, gpu_num = 0;
        int cursor = exact;
        for (int k = 0; k < steps; ++k) {
          const int row0 = (window0 + k) * kBlockN;
          std::vector<bool> visible(kBlockN, false);
          int taken = 0;
          for (int l = 0; l < kBlockN; ++l) {
            const int i = cursor + l;
            const int col = i < count ? rec[i].index - row0 : kBlockN;
            if (col < 0) { ++bad; printf("record before its window\n"); continue; }
            if (col >= kBlockN) continue;
            ++taken;
            if ((rec[i].rows >> unit) & 1u) visible[col] = true;
          }
          cursor += taken;
          const int last_block = s.kv_blocks - 1, tokens = s.seqlen_kv - last_block * p.block_kv;
          const int short_col = tokens < p.block_kv ? last_block - row0 : -1;
          for (int c = 0; c < kBlockN; ++c) {
            if (!visible[c]) continue;
            const double w = c == short_col ? tokens : p.block_kv;
            if (c == short_col) ++short_hits;
            gpu_den += w; gpu_num += row0 + c + 1;  // the window's row c is block row0 + c
          }
        }
        if (cursor != count) { ++bad; printf("cursor %d != %d\n", cursor, count); }
        ++checked;
        if (cpu_den != gpu_den || cpu_num != gpu_num) { if (bad++ < 5) printf("mismatch it %d row %d r %d: %g/%g vs %g/%g\n", it, row, r, cpu_num, cpu_den, gpu_num, gpu_den); }
      }
    }
  }
  printf("%ld tile rows checked, %ld bad; rows all proxy %ld, without proxy %ld, with >1 proxy step %ld, short-column hits %ld\n", checked, bad, rows_all_proxy, rows_none, multi_step, short_hits);
  return bad != 0;
}
