// Running a workload: choosing the device (GPU when present and supported, else CPU), timing
// repetitions, progress on stderr.
#pragma once
#include <chrono>
#include <string>
#include <vector>

#include "workload.hpp"

namespace bsattn::tools {

// Progress lines on stderr ("[   1.2 s] message"); stdout stays clean for --json.
class Progress {
 public:
  explicit Progress(bool enabled) : enabled_(enabled), start_(std::chrono::steady_clock::now()) {}
  void note(const std::string& message) const;

 private:
  bool enabled_;
  std::chrono::steady_clock::time_point start_;
};

struct RunOptions {
  std::string device = "auto";  // auto, cpu or cuda
  int threads = 0;              // CPU worker threads; 0: all cores
  int repeats = 3;
  int warmup = 1;  // >= 1: the first warm-up run validates the inputs
};

struct DeviceChoice {
  Device device = Device::cpu;
  int threads = 0;   // CPU threads the plan uses
  std::string note;  // why the GPU was not used, when it was asked for or present
};

// Resolves RunOptions::device for `w`: "auto" takes the GPU when one is present and the library
// plans the problem there, else the CPU (with a note); "cuda" fails with the library's error.
DeviceChoice choose_device(const Workload& w, const RunOptions& options);

// Milliseconds of each timed repetition (after the warm-up ones, the first of which validates
// the inputs; the others run with validate = false). The outputs of the last run are left in
// w.outputs().
std::vector<double> time_runs(const Workload& w, const DeviceChoice& device, const RunOptions& options,
                              const Progress& progress, const std::string& label);

double median(std::vector<double> values);

int cuda_device_count();

}  // namespace bsattn::tools
