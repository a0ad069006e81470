// Host emulation of a CUDA thread block, for checking a kernel's logic on a machine without a GPU:
// the kernel's source is compiled by the host compiler, each CUDA thread runs as a fiber
// (ucontext) of one OS thread, and __syncthreads / __syncwarp / warp collectives switch fibers.
// A barrier releases when every live thread of its scope (block, warp) waits on it; a fiber that
// waits while the others wait elsewhere (divergent barriers, a lane missing from a collective) is
// reported as a deadlock. Fibers run in thread order between barriers, or in reverse order
// (BSATTN_EMULATION_REVERSE=1), so a missing barrier shows up as a difference between the two.
// Not emulated: memory ordering, warp-synchronous code without a barrier, atomics' contention.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __shared__
#define __shared__
#undef __align__
#define __align__(n) __attribute__((aligned(n)))

// The high word of (hi:lo) << min(shift, 32), as the device intrinsic.
inline unsigned __funnelshift_lc(unsigned lo, unsigned hi, unsigned shift) {
  const std::uint64_t v = (static_cast<std::uint64_t>(hi) << 32 | lo) << std::min(shift, 32u);
  return static_cast<unsigned>(v >> 32);
}

namespace cuda_emulation {

struct Thread {
  ucontext_t context;
  char* stack = nullptr;
  dim3 index;
  enum State { runnable, at_block_barrier, at_warp_barrier, done } state = runnable;
};

struct Block {
  std::vector<Thread> threads;
  ucontext_t scheduler;
  int current = 0;
  dim3 index;
  std::vector<std::uint32_t> exchange;  // one slot per thread for warp collectives
  std::function<void()> body;
};

inline Block*& block() {
  static Block* b = nullptr;
  return b;
}

// The grid of the launch being emulated.
inline dim3& grid() {
  static dim3 g;
  return g;
}
// Fiber stacks, allocated once for the largest block seen.
constexpr std::size_t kStackBytes = 64 * 1024;
inline char* stacks(int threads) {
  static std::vector<char> memory;
  if (memory.size() < threads * kStackBytes) memory.resize(threads * kStackBytes);
  return memory.data();
}
// Fibers run in reverse thread order when BSATTN_EMULATION_REVERSE=1.
inline bool reverse_order() {
  static const bool reverse = [] {
    const char* v = std::getenv("BSATTN_EMULATION_REVERSE");
    return v && v[0] == '1';
  }();
  return reverse;
}

inline void wait(Thread::State state) {
  Block* b = block();
  b->threads[b->current].state = state;
  swapcontext(&b->threads[b->current].context, &b->scheduler);
}

inline void entry() {
  Block* b = block();
  b->body();
  b->threads[b->current].state = Thread::done;
  swapcontext(&b->threads[b->current].context, &b->scheduler);
}

// Releases the barriers whose scope has fully arrived; false when nothing can run (deadlock or done).
inline bool release(Block& b) {
  const int n = static_cast<int>(b.threads.size());
  bool any_runnable = false, all_at_block = true, any_live = false;
  for (auto& t : b.threads) {
    any_runnable |= t.state == Thread::runnable;
    if (t.state != Thread::done) any_live = true;
    if (t.state != Thread::done && t.state != Thread::at_block_barrier) all_at_block = false;
  }
  if (any_runnable) return true;
  if (!any_live) return false;
  if (all_at_block) {
    for (auto& t : b.threads)
      if (t.state == Thread::at_block_barrier) t.state = Thread::runnable;
    return true;
  }
  bool released = false;
  for (int w0 = 0; w0 < n; w0 += 32) {
    bool complete = true, waiting = false;
    for (int i = w0; i < std::min(n, w0 + 32); ++i) {
      if (b.threads[i].state == Thread::at_warp_barrier) waiting = true;
      else if (b.threads[i].state != Thread::done) complete = false;
    }
    if (waiting && complete) {
      for (int i = w0; i < std::min(n, w0 + 32); ++i)
        if (b.threads[i].state == Thread::at_warp_barrier) b.threads[i].state = Thread::runnable;
      released = true;
    }
  }
  if (!released) {
    std::fprintf(stderr, "cuda_emulation: deadlock in block (%u, %u)\n", b.index.x, b.index.y);
    std::abort();
  }
  return true;
}

// Runs block `index` of a launch of `threads` threads to completion.
template <class Kernel, class... Args>
void launch_block(Kernel kernel, dim3 index, int threads, Args... args) {
  Block b;
  b.index = index;
  b.threads.resize(threads);
  b.exchange.assign(threads, 0);
  b.body = [&] { kernel(args...); };
  block() = &b;
  char* stack = stacks(threads);
  for (int i = 0; i < threads; ++i) {
    Thread& t = b.threads[i];
    t.index = dim3(i, 0, 0);
    t.stack = stack + i * kStackBytes;
    getcontext(&t.context);
    t.context.uc_stack.ss_sp = t.stack;
    t.context.uc_stack.ss_size = kStackBytes;
    t.context.uc_link = nullptr;
    makecontext(&t.context, entry, 0);
  }
  while (release(b))
    for (int k = 0; k < threads; ++k) {
      const int i = reverse_order() ? threads - 1 - k : k;
      if (b.threads[i].state != Thread::runnable) continue;
      b.current = i;
      swapcontext(&b.scheduler, &b.threads[i].context);
    }
  block() = nullptr;
}

// The translation unit's `extern __shared__` array (null when its kernels use none).
struct SharedArray {
  unsigned char* data = nullptr;
  std::size_t bytes = 0;
};
inline SharedArray& shared_array() {
  static SharedArray a;
  return a;
}

inline Thread& self() { return block()->threads[block()->current]; }

// A warp collective: every lane publishes `value`, waits for the warp, reads, waits again.
template <class Combine>
std::uint32_t collective(std::uint32_t value, const Combine& combine) {
  Block* b = block();
  const int lane0 = b->current & ~31;
  b->exchange[b->current] = value;
  wait(Thread::at_warp_barrier);
  const std::uint32_t result = combine(&b->exchange[lane0]);
  wait(Thread::at_warp_barrier);
  return result;
}

}  // namespace cuda_emulation

#define threadIdx (cuda_emulation::self().index)
#define blockIdx (cuda_emulation::block()->index)
#define gridDim (cuda_emulation::grid())

inline void __syncthreads() { cuda_emulation::wait(cuda_emulation::Thread::at_block_barrier); }
inline void __syncwarp(unsigned = 0xffffffffu) { cuda_emulation::wait(cuda_emulation::Thread::at_warp_barrier); }
inline unsigned __ballot_sync(unsigned, bool predicate) {
  return cuda_emulation::collective(predicate ? 1u : 0u, [](const std::uint32_t* lanes) {
    unsigned bits = 0;
    for (int i = 0; i < 32; ++i) bits |= lanes[i] << i;
    return bits;
  });
}
inline int __reduce_add_sync(unsigned, int value) {
  return static_cast<int>(cuda_emulation::collective(static_cast<std::uint32_t>(value), [](const std::uint32_t* lanes) {
    std::uint32_t sum = 0;
    for (int i = 0; i < 32; ++i) sum += lanes[i];
    return sum;
  }));
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline float __uint_as_float(unsigned v) {
  float f;
  std::memcpy(&f, &v, sizeof f);
  return f;
}
using std::max;
using std::min;

// Stands for kernel<<<grid, threads, shared_bytes>>>(args...) in a kernel source compiled with
// BSATTN_GPU_HOST_EMULATION: the blocks run one after another, dynamic shared memory starting as
// NaN bytes in each (a read before a write shows).
template <class Kernel, class... Args>
void emulate_launch(Kernel kernel, dim3 grid, int threads, std::size_t shared_bytes, Args... args) {
  cuda_emulation::SharedArray& shared = cuda_emulation::shared_array();
  if (shared_bytes > shared.bytes) {
    std::fprintf(stderr, "emulate_launch: %zu bytes of shared memory, %zu available\n", shared_bytes, shared.bytes);
    std::abort();
  }
  cuda_emulation::grid() = grid;
  for (unsigned y = 0; y < grid.y; ++y)
    for (unsigned x = 0; x < grid.x; ++x) {
      if (shared_bytes > 0) std::memset(shared.data, 0xff, shared_bytes);
      cuda_emulation::launch_block(kernel, dim3(x, y, 1), threads, args...);
    }
}
