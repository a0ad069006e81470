// A fixed pool of worker threads for the CPU engine: created by plan(), reused by every run().
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace bsattn::cpu {

class ThreadPool {
 public:
  explicit ThreadPool(int threads) {
    const int n = std::max(1, threads);
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { worker(i); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(item, thread) for item in [0, n), items handed out dynamically; the caller's thread
  // works too. The first exception thrown by fn is rethrown here after all threads stop.
  template <class Fn>
  void parallel_for(std::int64_t n, const Fn& fn) {
    Job job;
    job.n = n;
    job.context = &fn;
    job.call = [](const void* ctx, std::int64_t item, int thread) { (*static_cast<const Fn*>(ctx))(item, thread); };
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      ++generation_;
      active_ = static_cast<int>(workers_.size());
    }
    wake_.notify_all();
    work(job, 0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return active_ == 0; });
    job_ = nullptr;
    if (job.error) std::rethrow_exception(job.error);
  }

 private:
  struct Job {
    std::int64_t n = 0;
    const void* context = nullptr;
    void (*call)(const void*, std::int64_t, int) = nullptr;
    std::atomic<std::int64_t> next{0};
    std::mutex error_mutex;
    std::exception_ptr error;
  };

  static void work(Job& job, int thread) {
    for (;;) {
      const std::int64_t item = job.next.fetch_add(1, std::memory_order_relaxed);
      if (item >= job.n) return;
      try {
        job.call(job.context, item, thread);
      } catch (...) {
        std::lock_guard<std::mutex> lock(job.error_mutex);
        if (!job.error) job.error = std::current_exception();
        job.next.store(job.n);
      }
    }
  }

  void worker(int thread) {
    std::uint64_t seen = 0;
    for (;;) {
      Job* job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      work(*job, thread);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (--active_ == 0) done_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  Job* job_ = nullptr;
  std::uint64_t generation_ = 0;
  int active_ = 0;
  bool stop_ = false;
};

}  // namespace bsattn::cpu
