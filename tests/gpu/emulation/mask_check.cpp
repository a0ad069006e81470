// Host check of the kernels' route mask (src/gpu/fwd/mask.cuh, compiled by the host compiler):
// every thread of a consumer warpgroup masks its part of a score tile, in the layouts the kernels
// hold it (the forward's wgmma accumulator of 64 x 64 and 64 x 128 tiles, one route or a route pair
// side by side, by element bits and by compares; the backward's transposed 64 x 64 tile viewed
// query-major), and each element is compared with the mask's definition evaluated on its own:
// the route unit's bits, the query and KV tails, and for masked units route::token_visible (causal,
// windows, sinks, document ids, KV validity bits; batched and varlen). Both kernel policies run:
// positional only, and with the per-token tensors.
//   ctest -R gpu_route_mask_model
#include "cuda_emulation.hpp"

#include <array>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "gpu/fwd/fragment_views.cuh"
#include "gpu/fwd/mask.cuh"

using namespace cute;
using bsattn::gpu::fwd::acc_rowcol;
using bsattn::gpu::fwd::RouteMask;

namespace {

std::mt19937 rng(7);
int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
bool chance(double p) { return std::bernoulli_distribution(p)(rng); }

// One random problem around a 64-row warpgroup tile: the mask, the per-token tensors, a sequence.
struct Case {
  bsattn::AttentionParams a;
  bsattn::route::SeqInfo si;
  int b = 0;
  std::vector<std::int32_t> doc_q, doc_kv;
  std::vector<std::uint32_t> kv_valid;

  explicit Case(bool token_tensors) {
    auto& p = a.route;
    p.causal = chance(0.5);
    p.window_left = chance(0.4) ? uniform(0, 96) : -1;
    p.window_right = chance(0.3) ? uniform(0, 96) : -1;
    p.sink_tokens = chance(0.3) ? uniform(1, 40) : 0;
    p.varlen_q = chance(0.5);
    p.varlen_kv = chance(0.5);
    b = uniform(0, 2);
    si.seqlen_q = uniform(1, 400);
    si.seqlen_kv = uniform(1, 400);
    si.diag_offset = uniform(-200, 200);
    si.q_base = p.varlen_q ? uniform(0, 300) : 0;
    si.kv_base = p.varlen_kv ? uniform(0, 300) : 0;
    if (!token_tensors) return;
    const int batches = 3, q_extent = 1200, kv_extent = 1200;
    if (chance(0.7)) {  // document ids in runs, so that rows and tiles straddle boundaries
      const auto runs = [&](int n) {
        std::vector<std::int32_t> d(n);
        int doc = 0;
        for (int i = 0; i < n; ++i) d[i] = doc += chance(0.03);
        return d;
      };
      doc_q = runs(batches * q_extent);
      doc_kv = chance(0.5) ? doc_q : runs(batches * kv_extent);
      p.doc_q = doc_q.data();
      p.doc_kv = doc_kv.data();
      p.doc_q_batch_stride = q_extent;
      p.doc_kv_batch_stride = kv_extent;
    }
    if (chance(0.6) || !p.doc_q) {
      p.kv_valid_batch_stride = kv_extent / 32 + 1;
      kv_valid.resize(batches * p.kv_valid_batch_stride);
      for (auto& w : kv_valid) w = static_cast<std::uint32_t>(rng()) | (chance(0.5) ? 0xffff0000u : 0u);
      p.kv_valid = kv_valid.data();
    }
  }
};

RouteMask random_route(int tile_n) {
  RouteMask m;
  m.unit_m = std::array<int, 3>{16, 32, 64}[uniform(0, 2)];
  m.tile_row0 = uniform(0, 1) * 64;
  m.q_begin = uniform(0, 5) * 64;
  m.k0 = uniform(0, 5) * tile_n;
  m.n_valid = chance(0.5) ? tile_n : uniform(1, tile_n);
  const unsigned units = (1u << (128 / m.unit_m)) - 1;
  m.rows = chance(0.3) ? units : static_cast<unsigned>(rng()) & units;
  m.masked = chance(0.2) ? units : static_cast<unsigned>(rng()) & units;
  return m;
}

// The mask's definition for one element: (r, col) in the tile, `m` the route that holds column col.
bool expected_visible(const RouteMask& m, const Case& c, int r, int col) {
  r &= m.token_mask;
  const int q = m.q_begin + r, unit = (m.tile_row0 + r) / m.unit_m;
  if (!((m.rows >> unit) & 1u) || q >= c.si.seqlen_q || col >= m.n_valid) return false;
  if (!((m.masked >> unit) & 1u)) return true;
  return bsattn::route::token_visible(c.a.route, c.si, c.b, q, m.k0 + col);
}

long checked = 0, wrong = 0;

// Every thread's fragment of the 64 x N tile: `coordinates(thread)` gives its (query row, KV
// column) view. A route pair splits the columns at N / 2, as the kernels do: the right route's k0
// is its first token minus N / 2 and its n_valid counts from column 0.
template <bool kTokenTensors, bool kPairColumns, bool kRoutePair, class Coordinates>
void check_tile(Coordinates coordinates, int tile_n, const char* what) {
  constexpr int kCols = decltype(size<1>(coordinates(0)))::value;
  constexpr int kSplit = kRoutePair ? kCols / 2 : kCols;
  const Case c(kTokenTensors);
  RouteMask left = random_route(kRoutePair ? tile_n / 2 : tile_n), right = left;
  if (kRoutePair) {
    right = random_route(tile_n / 2);
    right.q_begin = left.q_begin;
    right.tile_row0 = left.tile_row0;
    right.unit_m = left.unit_m;
    right.k0 -= tile_n / 2;
    right.n_valid += tile_n / 2;
  }
  for (int t = 0; t < 128; ++t) {
    auto cs = coordinates(t);
    auto s = make_tensor<float>(cs.layout().shape());
    for (int i = 0; i < size(s); ++i) s(i) = 1.0f + static_cast<float>(i);
    RouteMask::apply_split<kTokenTensors, kPairColumns, kSplit>(left, right, s, cs, c.a, c.si, c.b);
    for (int i = 0; i < size<0>(s); ++i)
      for (int j = 0; j < size<1>(s); ++j) {
        const int r = get<0>(cs(i, j)), col = get<1>(cs(i, j));
        const RouteMask& m = kRoutePair && col >= tile_n / 2 ? right : left;
        const float want = expected_visible(m, c, r, col) ? 1.0f + static_cast<float>(s.layout()(i, j)) : -INFINITY;
        ++checked;
        if (s(i, j) != want && wrong++ < 10)
          std::printf("%s: thread %d element (%d, %d) at (%d, %d): %g, expected %g\n", what, t, i, j, r, col,
                      s(i, j), want);
      }
  }
}

// The forward's S fragment: the wgmma accumulator of a 64 x N tile as (rows, columns).
template <int kN>
auto forward_coordinates(int thread) {
  using Atom = std::conditional_t<kN == 64, SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>,
                                  SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>>;
  auto mma = make_tiled_mma(Atom{});
  auto c = mma.get_thread_slice(thread).partition_C(make_identity_tensor(Shape<_64, Int<kN>>{}));
  return make_tensor(c.data(), acc_rowcol(c.layout()));
}

// The backward's transposed S tile (KV rows x query columns), viewed query-major, as
// bwd/kernel.cuh's score_coordinates and query_major_of build it.
auto backward_transposed_coordinates(int thread) {
  auto mma = make_tiled_mma(SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{});
  auto coords = make_coord_tensor(make_layout(Shape<_64, _64>{}, make_stride(E<1>{}, E<0>{})));
  auto c = mma.get_thread_slice(thread).partition_C(coords);
  auto rc = make_tensor(c.data(), acc_rowcol(c.layout()));
  return make_tensor(rc.data(), make_layout(layout<1>(rc), layout<0>(rc)));
}

template <bool kTokenTensors>
void check_all(int rounds) {
  for (int n = 0; n < rounds; ++n) {
    check_tile<kTokenTensors, true, false>(forward_coordinates<128>, 128, "forward 64 x 128, element bits");
    check_tile<kTokenTensors, false, false>(forward_coordinates<128>, 128, "forward 64 x 128, compares");
    check_tile<kTokenTensors, true, true>(forward_coordinates<128>, 128, "forward 64 x 128, route pair");
    check_tile<kTokenTensors, true, false>(forward_coordinates<64>, 64, "forward 64 x 64, element bits");
    check_tile<kTokenTensors, false, false>(backward_transposed_coordinates, 64, "backward transposed 64 x 64");
  }
}

}  // namespace

int main() {
  check_all<false>(300);
  check_all<true>(300);
  std::printf("%ld elements checked, %ld wrong\n", checked, wrong);
  return wrong == 0 && checked > 0 ? 0 : 1;
}
