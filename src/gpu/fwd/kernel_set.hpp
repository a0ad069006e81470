// The forward kernels as the host dispatcher (attention.cu) sees them: one function per
// (dtype, head dim, KV tile width, proxy policy, kind), each defined in a translation unit of its
// own that src/gpu/CMakeLists.txt generates (instantiate.cuh), so that a build compiles them in
// parallel and a quick build (one dtype and head dim) waits for a few kernels per unit rather than
// for a whole family in one unit (about 5 min on the GPU machine's 16 cores, 2026-12-02).
#pragma once
#include <cuda_runtime.h>

#include "bsattn/attention_params.hpp"
#include "gpu/attention.hpp"

namespace bsattn::gpu::fwd {

// decode: the decode kernel (decode.cuh); rows64: tile_m 64, one query head or two packed;
// rows128: tile_m 128 (two consumer warpgroups), with the CTA pair where the width is 128.
enum class KernelKind { decode, rows64, rows128 };

// With `a` null (plan time) every kernel of the kind is configured (shared-memory limit, resident
// CTA pairs); else the kernel for `a` is launched (`decode`: the decode kernel's shape).
template <ElementType kType, int kHeadDim, int kBlockN, bool kProxy, KernelKind kKind>
cudaError_t run_kernels(const AttentionParams* a, const TokenExtents& extents, const int* overflow,
                        cudaStream_t stream, const DecodeShape* decode);

// CTAs per multiprocessor of the kind's kernel (rows64: the one for tiles of one query head).
template <ElementType kType, int kHeadDim, int kBlockN, bool kProxy, KernelKind kKind>
int kernel_ctas_per_sm();

}  // namespace bsattn::gpu::fwd
