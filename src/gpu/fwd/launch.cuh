// Host side of the forward kernel: the launch of one kernel of a family (grid, cluster, shared
// memory, tensor maps), and the plan-time configuration (shared-memory limit, resident CTA pairs).
#pragma once

#include <array>
#include <atomic>
#include <cstdlib>

#include "gpu/device_info.hpp"
#include "gpu/fwd/kernel_ws.cuh"

namespace bsattn::gpu::fwd {

// Launch configuration of a CTA-pair kernel (cluster dimension 2) with `ctas` blocks.
template <class T>
struct PairLaunch {
  cudaLaunchAttribute cluster{};
  cudaLaunchConfig_t config{};
  PairLaunch(const PairLaunch&) = delete;  // config.attrs points into this object
  PairLaunch(int ctas, cudaStream_t stream) {
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 2;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.gridDim = dim3(ctas);
    config.blockDim = dim3(WsConfig<T>::kThreads);
    config.dynamicSmemBytes = WsConfig<T>::kSmemBytes;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
  }
};

// CTA pairs of kernel T that fit on `device` at once (both mask policies use the same resources).
// Items are assigned statically per cluster, and a cluster waiting for a free pair of
// multiprocessors would run its whole share after the others, so the grid holds this many. A
// host-side occupancy query, made at plan time and kept per device (66 on the H200).
template <class T, bool kProxy>
int resident_pairs(int device, int sms) {
  static std::atomic<int> known[kMaxDevices] = {};  // 0: not queried yet
  if (device < kMaxDevices && known[device].load(std::memory_order_relaxed) > 0)
    return known[device].load(std::memory_order_relaxed);
  PairLaunch<T> launch(sms, nullptr);
  int pairs = 0;
  if (cudaOccupancyMaxActiveClusters(&pairs, forward_kernel_ws<T, false, kProxy>, &launch.config) != cudaSuccess ||
      pairs < 1) {
    cudaGetLastError();  // not sticky: fall back to one pair per two multiprocessors
    pairs = sms / 2;
  }
  if (device < kMaxDevices) known[device].store(pairs, std::memory_order_relaxed);
  return pairs;
}

// Decode split-KV merged in clusters (split_merge.cuh, push_partial / merge_cluster_splits): a cluster holds the
// kv_splits CTAs of a (route row, head group), up to 16 (above 8 a non-portable size, where the
// device allows it). How many such clusters of kernel T fit on `device` at once, by cluster size:
// a host-side occupancy query per size, made at plan time and kept per device. A launch merges
// in clusters only when all of its clusters fit (they would otherwise run one after another).
constexpr int kMaxClusterSplits = 16;
template <class T>
int resident_decode_clusters(int device, int splits) {
  static std::atomic<int> known[kMaxDevices][kMaxClusterSplits + 1] = {};  // clusters + 1; 0: not queried
  if (splits < 2 || splits > kMaxClusterSplits || device >= kMaxDevices) return 0;
  const int cached = known[device][splits].load(std::memory_order_relaxed);
  if (cached > 0) return cached - 1;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = splits;
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(splits);
  config.blockDim = dim3(WsConfig<T>::kThreads);
  config.dynamicSmemBytes = WsConfig<T>::kSmemBytes;
  config.attrs = &cluster;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, forward_kernel_ws<T, false, false, true>, &config) != cudaSuccess) {
    cudaGetLastError();  // not sticky: merge through the workspace
    clusters = 0;
  }
  known[device][splits].store(clusters + 1, std::memory_order_relaxed);
  return clusters;
}

// The instances of a (traits, proxy policy) family: token tensors (document ids, kv_valid bits) or
// not; routes made from the lengths (the decode kernel's non-token instance; a prefill instance of
// its own, launched when AttentionParams::routes_from_lengths). Null: no such instance.
// Spelled out, not decltype(&forward_kernel_ws<T, false>): naming an instance that the unit never
// launches (a proxy or decode family's exact one) draws nvcc's warning 20280 (static stubs).
using ForwardKernel = void (*)(AttentionParams, const int*, LaunchDescriptors);
template <class T, bool kProxy>
std::array<ForwardKernel, 3> kernels_of() {
  if constexpr (T::kDecode) return {forward_kernel_ws<T, true>, forward_kernel_ws<T, false, false, true>, nullptr};
  else if constexpr (kProxy) return {forward_kernel_ws<T, true, true>, forward_kernel_ws<T, false, true>, nullptr};
  else return {forward_kernel_ws<T, true>, forward_kernel_ws<T, false>, forward_kernel_ws<T, false, false, true>};
}
template <class T, bool kProxy>
ForwardKernel kernel_for(const AttentionParams& a) {
  const std::array<ForwardKernel, 3> k = kernels_of<T, kProxy>();
  if (a.route.doc_q || a.route.kv_valid) return k[0];
  return a.routes_from_lengths && k[2] ? k[2] : k[1];
}

// a == nullptr: only raises the kernel's shared-memory limit and, for a pair kernel, queries how
// many pairs fit (plan time, outside any graph capture).
// A pair-multicast kernel needs TMA: where the tensors cannot be mapped it returns
// cudaErrorNotSupported and launches nothing (the caller takes the single-CTA kernel).
// A decode kernel (T::kDecode) takes its shape from `decode` (decode.cuh); with splits, `a` must
// point O and LSE at the fp32 partial results.
template <class T, bool kProxy = false>
cudaError_t launch_forward_ws(const AttentionParams* a, const TokenExtents& extents, const int* overflow,
                              cudaStream_t stream, const DecodeGeometry& decode = DecodeGeometry{}) {
  using C = WsConfig<T>;
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess || (sms = multiprocessors(device)) == 0) return cudaGetLastError();
  if (!a) {
    for (auto kernel : kernels_of<T, kProxy>()) {
      if (!kernel) continue;
      const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
      if (e != cudaSuccess) return e;
    }
    if constexpr (T::kPairMulticast) (void)resident_pairs<T, kProxy>(device, sms);
    if constexpr (T::kDecode) {
      for (auto kernel : kernels_of<T, false>()) {
        if (kernel && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess)
          cudaGetLastError();  // clusters of up to 8 only
      }
      for (int splits = 2; splits <= kMaxClusterSplits; ++splits) (void)resident_decode_clusters<T>(device, splits);
    }
    return cudaSuccess;
  }
  const auto kernel = kernel_for<T, kProxy>(*a);
  const int items = T::kDecode ? work_items(*a, decode.packed_heads, decode.kv_splits) : work_items(*a, T::kItemHeads);
  if (items == 0) return cudaSuccess;
  LaunchDescriptors desc{};
  desc.decode = decode;
  // Measurement switch (environment, read once): BSATTN_GPU_DECODE_CLUSTER=0 merges every split-KV
  // launch through the workspace.
  static const bool cluster_switch = [] {
    const char* v = std::getenv("BSATTN_GPU_DECODE_CLUSTER");
    return !(v && v[0] == '0');
  }();
  if constexpr (T::kDecode) {
    // A cluster merge also needs each owner's parts (its rows x the splits) to fit its inbox
    // (split_merge.cuh): one-query steps always do, a 64-row tile of many queries not on every kernel.
    const int splits = std::max(1, decode.kv_splits), units = items / splits;
    const int tokens = 1 << desc.decode.tokens_log2;
    const int rows = std::min(tokens, a->route.max_seqlen_q) * (64 / tokens);
    const int parts = (rows + splits - 1) / splits * splits;
    desc.decode.cluster_merge = cluster_switch && splits > 1 && parts <= C::kInboxParts &&
                                resident_decode_clusters<T>(device, splits) >= units;
  }
  desc.timeline = timeline_buffer();
  static const bool no_tma = std::getenv("BSATTN_GPU_NO_TMA") != nullptr;
  desc.tma = !no_tma && encode_maps<T>(*a, extents, desc) ? 1 : 0;
  // Persistent: T::kCtasPerSm CTAs per multiprocessor (shared memory and registers allow no more).
  // BSATTN_GPU_CTA_PER_TILE=1 launches one CTA per work item instead, BSATTN_GPU_ONE_CTA_PER_SM=1
  // one CTA per multiprocessor whatever the kernel (measurement switches). A
  // split-KV decode launch always has one CTA per item: its merge runs after the tile loop from a
  // single job (split_merge.cuh, merge_splits); the plan chooses splits so that the items fit the SMs.
  static const bool cta_per_tile_switch = std::getenv("BSATTN_GPU_CTA_PER_TILE") != nullptr;
  static const bool one_cta_per_sm = std::getenv("BSATTN_GPU_ONE_CTA_PER_SM") != nullptr;
  const int resident = one_cta_per_sm ? sms : sms * T::kCtasPerSm;
  const bool cta_per_tile = cta_per_tile_switch || (T::kDecode && decode.kv_splits > 1);
  if constexpr (T::kPairMulticast) {
    if (!desc.tma) return cudaErrorNotSupported;
    PairLaunch<T> launch(2 * (cta_per_tile ? items : std::min(items, resident_pairs<T, kProxy>(device, sms))), stream);
    return cudaLaunchKernelEx(&launch.config, kernel, *a, overflow, desc);
  } else if constexpr (T::kDecode) {
    // Programmatic dependent launch: the CTAs are placed while route preparation (a few blocks
    // for a decode step) still runs, and wait for it in the kernel (griddepcontrol.wait), so the
    // launch latency of a ~20 us step overlaps the preparation. Routes made from the lengths:
    // no preparation precedes the kernel, an ordinary launch.
    cudaLaunchAttribute attrs[2] = {};
    attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[0].val.programmaticStreamSerializationAllowed = a->routes_from_lengths ? 0 : 1;
    attrs[1].id = cudaLaunchAttributeClusterDimension;  // the splits of an item: adjacent CTAs
    attrs[1].val.clusterDim.x = desc.decode.cluster_merge ? decode.kv_splits : 1;
    attrs[1].val.clusterDim.y = attrs[1].val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(cta_per_tile ? items : std::min(items, sms));
    config.blockDim = dim3(C::kThreads);
    config.dynamicSmemBytes = C::kSmemBytes;
    config.stream = stream;
    config.attrs = attrs;
    config.numAttrs = desc.decode.cluster_merge ? 2 : 1;
    return cudaLaunchKernelEx(&config, kernel, *a, overflow, desc);
  } else {
    kernel<<<cta_per_tile ? items : std::min(items, resident), C::kThreads, C::kSmemBytes, stream>>>(*a, overflow,
                                                                                                   desc);
    return cudaGetLastError();
  }
}

}  // namespace bsattn::gpu::fwd
