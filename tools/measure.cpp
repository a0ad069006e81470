#include "measure.hpp"

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "npy.hpp"

namespace bsattn::tools {

int measure_and_report(const WorkloadSpec& spec, const MeasureOptions& options) {
  const Progress progress(!options.quiet);
  progress.note("building inputs: " + spec.describe());
  Workload sparse(spec);
  const DeviceChoice device = choose_device(sparse, options.run);
  if (!device.note.empty()) progress.note(device.note);
  const Density density = sparse.density();
  const double time_ms = median(time_runs(sparse, device, options.run, progress, "sparse"));

  VerifyResult check;
  if (options.verify_rows > 0) {
    progress.note("verifying " + std::to_string(options.verify_rows) + " sampled rows against a float64 reference");
    check = sparse.verify(options.verify_rows, options.verify_seed);
  }
  if (!options.save_prefix.empty()) {
    save_npy_f32(options.save_prefix + "_out.npy", sparse.outputs().out);
    save_npy_f32(options.save_prefix + "_lse.npy", sparse.outputs().lse);
    progress.note("saved " + options.save_prefix + "_out.npy and " + options.save_prefix + "_lse.npy");
  }

  double dense_ms = 0.0;
  if (options.dense_baseline) {
    progress.note("building the dense baseline (every block, no mask)");
    const Workload dense(spec.dense());
    dense_ms = median(time_runs(dense, device, options.run, progress, "dense"));
  }
  const double speedup = dense_ms > 0.0 && time_ms > 0.0 ? dense_ms / time_ms : 0.0;
  // Effective rate: only the kept (q, kv) pairs count, 4 * D flops each (QK^T and PV).
  const auto tflops = [&](double pairs, double ms) { return ms > 0.0 ? 4.0 * spec.head_dim * pairs / (ms * 1e9) : 0.0; };

  if (options.json) {
    nlohmann::ordered_json j;
    j["problem"] = spec.describe();
    j["device"] = to_string(device.device);
    if (device.device == Device::cpu) j["threads"] = device.threads;
    if (!device.note.empty()) j["note"] = device.note;
    j["density"] = density.pairs;
    j["block_density"] = density.blocks;
    j["kept_pairs"] = density.kept_pairs;
    j["total_pairs"] = density.total_pairs;
    j["kept_blocks"] = density.kept_blocks;
    j["total_blocks"] = density.total_blocks;
    j["repeats"] = options.run.repeats;
    j["time_ms"] = time_ms;
    j["effective_tflops"] = tflops(static_cast<double>(density.kept_pairs), time_ms);
    if (options.dense_baseline) {
      j["dense_time_ms"] = dense_ms;
      j["dense_tflops"] = tflops(static_cast<double>(density.total_pairs), dense_ms);
      j["speedup"] = speedup;
    }
    if (options.verify_rows > 0) {
      j["verify_rows"] = check.rows;
      j["max_abs_err"] = check.max_abs_err;
      j["rel_l2_err"] = check.rel_l2_err;
      j["max_lse_err"] = check.max_lse_err;
      j["tolerance"] = {{"max_abs_err", check.max_abs_err_tolerance},
                        {"rel_l2_err", check.rel_l2_err_tolerance},
                        {"max_lse_err", check.lse_tolerance}};
      j["passed"] = check.passed();
    }
    std::cout << j.dump(2) << "\n";
  } else {
    std::printf("%s\n", options.title.c_str());
    std::printf("  problem   %s\n", spec.describe().c_str());
    std::printf("  device    %s", to_string(device.device));
    if (device.device == Device::cpu) std::printf(" (%d threads)", device.threads);
    std::printf("%s%s\n", device.note.empty() ? "" : "; ", device.note.c_str());
    std::printf("  density   %.4f of (q, kv) pairs; %.4f of blocks (%lld of %lld)\n", density.pairs, density.blocks,
                static_cast<long long>(density.kept_blocks), static_cast<long long>(density.total_blocks));
    std::printf("  time      %.3f ms (median of %d; %.3g effective TFLOP/s)\n", time_ms, options.run.repeats,
                tflops(static_cast<double>(density.kept_pairs), time_ms));
    if (options.dense_baseline) {
      std::printf("  dense     %.3f ms (same engine, every block, no mask; %.3g TFLOP/s)\n", dense_ms,
                  tflops(static_cast<double>(density.total_pairs), dense_ms));
      std::printf("  speedup   %.2fx\n", speedup);
    }
    if (options.verify_rows > 0)
      std::printf("  error     max_abs_err %.3g, rel_l2_err %.3g, max_lse_err %.3g on %d sampled rows: %s\n",
                  check.max_abs_err, check.rel_l2_err, check.max_lse_err, check.rows, check.passed() ? "ok" : "FAILED");
  }
  if (options.verify_rows > 0 && !check.passed()) {
    std::fprintf(stderr,
                 "error: verification failed: max_abs_err %.3g (tolerance %.3g), rel_l2_err %.3g (tolerance %.3g), "
                 "max_lse_err %.3g (tolerance %.3g)\n",
                 check.max_abs_err, check.max_abs_err_tolerance, check.rel_l2_err, check.rel_l2_err_tolerance,
                 check.max_lse_err, check.lse_tolerance);
    return kExitVerificationFailed;
  }
  return 0;
}

}  // namespace bsattn::tools
