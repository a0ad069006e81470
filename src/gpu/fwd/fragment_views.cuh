// Views of a wgmma accumulator fragment: as (rows, columns), and as the register A operand of
// the next GEMM. Host and device, so that host checks (tests/gpu/emulation) see the kernels'
// own layouts.
#pragma once
#include <cute/tensor.hpp>

namespace bsattn::gpu::fwd {

using namespace cute;

// Accumulator ((2 cols, 2 rows, N/8), MMA_M, MMA_N) viewed as (rows (2, MMA_M), cols (2, N/8, MMA_N)).
template <class L>
CUTE_HOST_DEVICE auto acc_rowcol(L acc) {
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

// Accumulator of the QK GEMM viewed as the register A operand of the PV GEMM (k blocks of 16):
// ((2, 2, N/8), M, N) -> ((2, 2, 2), M, (N/16, N)).
template <class L>
CUTE_HOST_DEVICE auto acc_as_a_operand(L acc) {
  auto v = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(v), get<1>(v), get<2, 0>(v)), get<1>(acc),
                     make_layout(get<2, 1>(v), get<2>(acc)));
}

}  // namespace bsattn::gpu::fwd
