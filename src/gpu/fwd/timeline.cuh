// Per-CTA event times of the forward kernel and of route preparation, for finding where a short
// kernel's time goes (a decode step's fixed cost): one thread per role writes %globaltimer (ns)
// and clock64 at a few points of its first tile into `LaunchDescriptors::timeline`. Compiled only
// in a measurement build (CMake -DBSATTN_GPU_TIMELINE=ON); the buffer's device address comes from
// the environment variable BSATTN_GPU_TIMELINE_BUFFER (read at the first launch;
// bench/gpu/decode_timeline.py, forward_timeline.py): two regions of kTimelineCtas x
// kTimelineSlots x {globaltimer, clock64}, the forward kernel's CTAs, then route preparation's
// blocks; then a third of kTimelineCtas x kTimelineTiles x {start, end, item | count << 32}, each
// CTA's tiles (consumer warpgroup 0), for load balance and tails; then a fourth for the backward
// kernel (bwd/kernel.cuh): kBwdTimelineCtas x 2 consumer warpgroups x 4 warps x kBwdTimelineSteps
// x kBwdEvents clock64 values, the phases of each of a CTA's first steps
// (bench/gpu/backward_timeline.py). In a normal build the marks are no code.
#pragma once
#include <cstdint>
#include <cstdlib>

namespace bsattn::gpu::fwd {

enum TimelineEvent : int {
  kAtEntry = 0,        // thread 0, first instruction
  kBarriersReady,      // thread 0, after the mbarrier setup's __syncthreads
  kDependencyMet,      // thread 0, after griddepcontrol.wait and the overflow flag
  kTileDecoded,        // tile warp, first tile written to its slot
  kQIssued,            // tile warp, first tile's Q load issued
  kLoaderHasTile,      // loader, first tile taken
  kLoaderIssued,       // loader, first tile's K/V loads issued
  kConsumerHasTile,    // consumer warpgroup 0, first tile taken
  kConsumerHasQ,       // its Q has landed
  kConsumerFirstS,     // the first S GEMM issued (its K has landed)
  kConsumerLoopDone,   // the tile's last PV done and the next tile taken
  kConsumerStored,     // the epilogue's stores issued
  kSplitArrived,       // decode split-KV: arrival counted
  kSplitMerged,        // the last split's merge done
  kConsumerExit,       // consumer warpgroup 0, before it returns
  kTimelineSlots = 16
};
// Route preparation's block marks (thread 0), in the second region.
enum PrepareEvent : int { kPrepareEntry = 0, kPrepareRowOpen, kPrepareCounted, kPrepareWritten, kPreparePublished };
constexpr int kTimelineCtas = 1024;
constexpr int kTimelineTiles = 64;  // tiles recorded per CTA
constexpr std::size_t kTimelineRegionWords = static_cast<std::size_t>(kTimelineCtas) * kTimelineSlots * 2;
// The backward's step phases (each consumer warp's first lane), in the order a step passes them.
enum BackwardEvent : int {
  kBwdStageFull = 0,   // the step's stage has landed and its record is read
  kBwdSetupDone,       // the step's views and flags computed: the first S wgmma is next
  kBwdSIssued,         // S GEMM issued
  kBwdDpIssued,        // dP GEMM issued
  kBwdScoresDone,      // S complete
  kBwdDvIssued,        // P computed (mask, exp2) and dV issued (or P stored)
  kBwdDpDone,          // dP complete
  kBwdDsStored,        // dS computed and stored, proxy fence passed
  kBwdStepBarrier,     // both consumers' dS stored (the step barrier passed)
  kBwdDqDone,          // dQ complete (dK issued)
  kBwdDqAdded,         // dQ staged and handed to the bulk reduction (or added)
  kBwdStepDone,        // dK / dV complete, the stage about to be released
  kBwdEvents
};
constexpr int kBwdTimelineCtas = 256;  // by linear block index: the first CTAs of the launch order
constexpr int kBwdTimelineSteps = 64;  // first steps of a CTA
constexpr std::size_t kTimelineBackwardOffset = 2 * kTimelineRegionWords + static_cast<std::size_t>(kTimelineCtas) * kTimelineTiles * 3;

#if BSATTN_GPU_TIMELINE
// Blocks past kTimelineCtas (route preparation of many rows) are not recorded: they would write
// into the next region.
__device__ __forceinline__ void timeline_mark(std::uint64_t* buffer, int event) {
  if (!buffer || blockIdx.x >= kTimelineCtas) return;
  std::uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  std::uint64_t* at = buffer + (static_cast<std::size_t>(blockIdx.x) * kTimelineSlots + event) * 2;
  at[0] = ns;
  at[1] = static_cast<std::uint64_t>(clock64());
}
// Tile t of this CTA: its start (`end` false) or its end with its work item and route count.
__device__ __forceinline__ void timeline_tile(std::uint64_t* buffer, int t, bool end, int item = 0, int count = 0) {
  if (!buffer || t >= kTimelineTiles || blockIdx.x >= kTimelineCtas) return;
  std::uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  std::uint64_t* at = buffer + 2 * kTimelineRegionWords + (static_cast<std::size_t>(blockIdx.x) * kTimelineTiles + t) * 3;
  if (!end) {
    at[0] = ns;
  } else {
    at[1] = ns;
    at[2] = static_cast<std::uint32_t>(item) | (static_cast<std::uint64_t>(count) << 32);
  }
}
// Event `event` of step `step` of a backward consumer warp (its first lane records).
__device__ __forceinline__ void timeline_step(std::uint64_t* buffer, int step, int warpgroup, int event) {
  if (!buffer || step >= kBwdTimelineSteps || threadIdx.x % 32 != 0) return;
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta >= kBwdTimelineCtas) return;
  const std::size_t warp = (static_cast<std::size_t>(cta) * 2 + warpgroup) * 4 + (threadIdx.x / 32) % 4;
  buffer[(warp * kBwdTimelineSteps + step) * kBwdEvents + event] = static_cast<std::uint64_t>(clock64());
}
// region 0: the forward kernel; 1: route preparation (the tiles follow both: timeline_tile).
inline std::uint64_t* timeline_buffer(int region = 0) {
  static std::uint64_t* const buffer = [] {
    const char* s = std::getenv("BSATTN_GPU_TIMELINE_BUFFER");
    return s ? reinterpret_cast<std::uint64_t*>(std::strtoull(s, nullptr, 0)) : nullptr;
  }();
  return buffer ? buffer + region * kTimelineRegionWords : nullptr;
}
inline std::uint64_t* timeline_backward_buffer() {
  std::uint64_t* const base = timeline_buffer();
  return base ? base + kTimelineBackwardOffset : nullptr;
}
#else
__device__ __forceinline__ void timeline_mark(std::uint64_t*, int) {}
__device__ __forceinline__ void timeline_tile(std::uint64_t*, int, bool, int = 0, int = 0) {}
__device__ __forceinline__ void timeline_step(std::uint64_t*, int, int, int) {}
inline std::uint64_t* timeline_buffer(int = 0) { return nullptr; }
inline std::uint64_t* timeline_backward_buffer() { return nullptr; }
#endif

}  // namespace bsattn::gpu::fwd
