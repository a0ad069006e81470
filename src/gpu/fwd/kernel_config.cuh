// Launch configuration of the persistent warp-specialised forward kernel (kernel_ws.cuh): its
// threads, the register split between the producer warpgroup and the consumers (setmaxnreg), and
// its shared memory (operand tiles, pipeline barriers, tile slots, a decode kernel's merge inbox).
#pragma once
#include "gpu/fwd/producer.cuh"
#include "gpu/fwd/scheduler.cuh"
#include "gpu/fwd/split_merge.cuh"
#include "gpu/fwd/traits.cuh"

namespace bsattn::gpu::fwd {

template <class T>
struct WsConfig {
  static constexpr int kProducerThreads = 128;
  static constexpr int kTileWarp = 3;  // producer warp that decodes tiles and loads Q
  static constexpr int kThreads = T::kThreads + kProducerThreads;
  static constexpr int kConsumerWarps = T::kThreads / 32;
  // Register split (setmaxnreg): 64K registers per SM, one CTA (or 32K each for two). The producer
  // keeps 40: with 24 its route loop spilled and the kernel ran 5-15 % slower (bench/RESULTS.md).
  // Two CTAs of one consumer warpgroup: 40 / 208 (a split that takes every register hung in
  // setmaxnreg). kProxy: the producer also streams the summary windows, and at 40 / 56 spilled
  // 4-92 bytes (the tile handoff's count, the TMA flag, the cp.async rows' bases); it takes 64
  // beside two consumer warpgroups (216 each: no spill there either), 96 beside one in a CTA of
  // its own, where the exact split leaves registers unused, and 56 / 192 in two CTAs of one
  // warpgroup (the same total as 40 / 208: at 192 the consumers spill nothing, at 40 the D 64
  // producers spilled 8-172 bytes). Same proxy times for each (bench/RESULTS.md).
  template <bool kProxy>
  struct Registers {
    static constexpr int kProducer =
        T::kWarpgroups == 2 ? (kProxy ? 64 : 40) : T::kCtasPerSm == 2 ? (kProxy ? 56 : 40) : (kProxy ? 96 : 56);
    static constexpr int kConsumer =
        T::kWarpgroups == 2 ? (kProxy ? 216 : 232) : T::kCtasPerSm == 2 ? (kProxy ? 192 : 208) : 240;
    static_assert(register_split_fits(kProducerThreads, kProducer, T::kThreads, kConsumer, T::kCtasPerSm),
                  "the consumers' registers exceed the CTA's allocation");
  };
  struct SmemOperands {
    typename T::SharedStorage tiles;
    PipelineBarriers<T::kStages, T::kWarpgroups> bars;
    Tile tile[2];  // work tiles handed from the tile warp to the loader and consumers (slot t % 2: tile t)
    SplitMerge split_merge;  // decode split-KV: the tile's merge job (merge_splits)
    float softmax_pin[kConsumerWarps];  // written (D > 64), never read: keeps the softmax ahead of the PV wait (steady_step)
  };
  static constexpr int kSmemLimit = (T::kCtasPerSm == 2 ? 112 : 226) * 1024;  // sizeof(Smem); + 1024 alignment
  // O's staging buffer, 64 x D per consumer warpgroup (consumer.cuh, epilogue.cuh), where shared
  // memory has room (not in a decode kernel, whose merge inbox takes what is left): the last
  // route's K and V stages then go back to the loader when the last PV is done, rather than after
  // the epilogue staged O in them (the two stages of a 128-row tile at D 128: 160 KB + 32 KB).
  struct OutputBuffer {
    alignas(1024) typename T::Element o[T::kWarpgroups][64 * T::kHeadDim];
  };
  static constexpr bool kOutputBuffer =
      !T::kDecode && sizeof(SmemOperands) + sizeof(OutputBuffer) + 1024 <= static_cast<std::size_t>(kSmemLimit);
  struct SmemWithOutputBuffer : SmemOperands {
    OutputBuffer out;
  };
  using SmemCore = std::conditional_t<kOutputBuffer, SmemWithOutputBuffer, SmemOperands>;
  // Decode kernels: the inbox of the split merge in a cluster (split_merge.cuh), as many (row, split)
  // parts as the shared memory left allows (per CTA 227 KB, or 112 KB with two per SM), at most 64.
  static constexpr int kInboxParts =
      T::kDecode ? cute::min(64, static_cast<int>((kSmemLimit - sizeof(SmemCore) - 64) / ((T::kHeadDim + 1) * 4)))
                 : 1;
  struct NoInbox {};
  struct Smem : SmemCore {
    std::conditional_t<T::kDecode, MergeInbox<T::kHeadDim, kInboxParts>, NoInbox> inbox;
  };
  static_assert(!T::kDecode || kInboxParts >= 16, "a one-query step's parts fit the inbox (launch.cuh)");
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Smem)) + 1024;
  static_assert(T::kCtasPerSm == 1 || 2 * (kSmemBytes + 1024) <= 228 * 1024, "two CTAs' shared memory per SM");
};

}  // namespace bsattn::gpu::fwd
