#include "execute.hpp"

#include <algorithm>
#include <cstdio>
#include <thread>

#ifdef BSATTN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace bsattn::tools {

void Progress::note(const std::string& message) const {
  if (!enabled_) return;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::fprintf(stderr, "[%7.1f s] %s\n", s, message.c_str());
}

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

#ifdef BSATTN_WITH_CUDA

int cuda_device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error("cuda", std::string(what) + ": " + cudaGetErrorString(e));
}

std::size_t extent_bytes(const TensorView& t) {
  std::int64_t last = 0;
  for (int i = 0; i < t.rank; ++i) last += (t.shape[i] - 1) * t.stride[i];
  return static_cast<std::size_t>(last + 1) * element_size(t.dtype);
}

// Device copies of a workload's host tensors; outputs are copied back by copy_outputs_back().
class DeviceMirror {
 public:
  DeviceMirror(const Inputs& in, const Outputs& out) : host_out_(out) {
    inputs_ = in;
    for (TensorView* t : views(inputs_)) *t = copy(*t, true);
    outputs_.out = copy(out.out, false);
    outputs_.lse = copy(out.lse, false);
  }
  ~DeviceMirror() {
    for (void* p : allocations_) cudaFree(p);
  }
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;

  const Inputs& inputs() const { return inputs_; }
  const Outputs& outputs() const { return outputs_; }
  void copy_outputs_back() const {
    for (auto [dev, host] : {std::pair{outputs_.out, host_out_.out}, std::pair{outputs_.lse, host_out_.lse}})
      if (host.defined()) check(cudaMemcpy(host.data, dev.data, extent_bytes(host), cudaMemcpyDeviceToHost), "copy back");
  }

 private:
  static std::vector<TensorView*> views(Inputs& in) {
    std::vector<TensorView*> v = {&in.q, &in.k, &in.v, &in.cu_seqlens_q, &in.cu_seqlens_k, &in.seqused_k,
                                  &in.block_table, &in.seq_lens_kv, &in.cu_total_m_blocks, &in.cu_block_idx_offsets,
                                  &in.doc_q, &in.doc_kv, &in.kv_valid, &in.k_summary, &in.v_summary};
    for (BlockSet* s : {&in.partial, &in.full, &in.proxy})
      for (TensorView* t : {&s->counts, &s->indices, &s->indptr, &s->bits}) v.push_back(t);
    return v;
  }
  TensorView copy(const TensorView& host, bool upload) {
    if (!host.defined()) return host;
    TensorView d = host;
    void* p = nullptr;
    check(cudaMalloc(&p, extent_bytes(host)), "cudaMalloc");
    allocations_.push_back(p);
    if (upload) check(cudaMemcpy(p, host.data, extent_bytes(host), cudaMemcpyHostToDevice), "upload");
    d.data = p;
    d.device = Device::cuda;
    return d;
  }

  Inputs inputs_;
  Outputs outputs_, host_out_;
  std::vector<void*> allocations_;
};

}  // namespace

#else

int cuda_device_count() { return 0; }

#endif

DeviceChoice choose_device(const Workload& w, const RunOptions& options) {
  DeviceChoice c;
  const int hardware = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  c.threads = options.threads > 0 ? options.threads : hardware;
  if (options.device == "cpu") return c;
  if (options.device != "auto" && options.device != "cuda")
    throw Error("device", "'" + options.device + "' is not one of auto, cpu, cuda");
  const int gpus = cuda_device_count();
  if (options.device == "auto" && gpus == 0) {
#ifdef BSATTN_WITH_CUDA
    c.note = "no GPU found; running on the CPU";
#endif
    return c;
  }
  try {
    Plan probe(w.problem(Device::cuda));
    c.device = Device::cuda;
  } catch (const Error& e) {
    if (options.device == "cuda") throw;
    c.note = std::string("GPU present but not used (") + e.what() + "); running on the CPU";
  }
  return c;
}

std::vector<double> time_runs(const Workload& w, const DeviceChoice& device, const RunOptions& options,
                              const Progress& progress, const std::string& label) {
  progress.note(label + ": planning on " + to_string(device.device));
  // The first warm-up run validates the inputs; the others and the timed runs take the trusted
  // path (validate = false), as a caller that checked its metadata once would.
  Problem problem = w.problem(device.device, device.threads);
  Plan validating(problem);
  problem.validate = false;
  Plan trusted(problem);
#ifdef BSATTN_WITH_CUDA
  std::unique_ptr<DeviceMirror> mirror;
  if (device.device == Device::cuda) mirror = std::make_unique<DeviceMirror>(w.inputs(), w.outputs());
  const Inputs& inputs = mirror ? mirror->inputs() : w.inputs();
  const Outputs& outputs = mirror ? mirror->outputs() : w.outputs();
#else
  const Inputs& inputs = w.inputs();
  const Outputs& outputs = w.outputs();
#endif
  std::vector<double> ms;
  const int total = options.warmup + options.repeats;
  for (int i = 0; i < total; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    Plan& plan = i == 0 ? validating : trusted;
    plan.run(inputs, outputs);
    plan.check();  // GPU: waits for the run (and reports a route overflow); CPU: nothing
    const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const bool warm = i < options.warmup;
    if (!warm) ms.push_back(t);
    char line[96];
    std::snprintf(line, sizeof line, "%s: %s %d/%d: %.2f ms", label.c_str(), warm ? "warm-up" : "run",
                  warm ? i + 1 : i + 1 - options.warmup, warm ? options.warmup : options.repeats, t);
    progress.note(line);
  }
#ifdef BSATTN_WITH_CUDA
  if (mirror) mirror->copy_outputs_back();
#endif
  return ms;
}

}  // namespace bsattn::tools
