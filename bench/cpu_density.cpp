// CPU engine time against block density (issue 2): S = 8192, Hq = 8, Hkv = 2, D = 128, bf16,
// block 64, random block patterns; density 1.0 selects every block. Prints a Markdown table of
// the median times and time(d) / time(1.0), and checks density 0.1 <= 0.2 x the dense time.
#include <cstdio>
#include <ctime>
#include <fstream>
#include <string>
#include <thread>

#include "args.hpp"
#include "execute.hpp"
#include "workload.hpp"

namespace {

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

}  // namespace

int main(int argc, char** argv) {
  using namespace bsattn::tools;
  Options o("cpu_density [options]",
            "Times the CPU engine on random block patterns at several densities and reports time(d) / time(1.0).\n"
            "Exit code 4 when density 0.1 takes more than 0.2 x the density-1.0 time.");
  o.value("seq", "N", "sequence length", "8192");
  o.value("repeats", "N", "timed repetitions per density (median reported)", "5");
  o.value("threads", "N", "CPU worker threads (0: all cores)", "0");
  o.value("seed", "N", "seed of the inputs and patterns", "0");
  o.flag("quiet", "no progress on stderr");
  try {
    if (!o.parse(std::vector<std::string>(argv + 1, argv + argc))) return 0;
    const double densities[] = {0.1, 0.25, 0.5, 1.0};
    RunOptions run;
    run.device = "cpu";
    run.threads = o.get_int("threads");
    run.repeats = o.get_int("repeats");
    const Progress progress(!o.has("quiet"));

    double ms[4];
    std::string problem;
    int threads = 0;
    for (int i = 0; i < 4; ++i) {
      WorkloadSpec spec;
      spec.seqlens_q = spec.seqlens_kv = {o.get_int("seq")};
      spec.heads_q = 8;
      spec.heads_kv = 2;
      spec.head_dim = 128;
      spec.block = {64, 64};
      spec.format = bsattn::Format::block_lists;
      spec.pattern.random_density = densities[i];
      spec.seed = static_cast<std::uint64_t>(o.get_int("seed"));
      char label[32];
      std::snprintf(label, sizeof label, "density %.2f", densities[i]);
      progress.note(std::string("building ") + label);
      const Workload w(spec);
      const DeviceChoice device = choose_device(w, run);
      threads = device.threads;
      problem = spec.describe();
      ms[i] = median(time_runs(w, device, run, progress, label));
    }

    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
    std::printf("date: %s\nmachine: %s, %u hardware threads; engine threads: %d\nproblem: %s (random blocks; density 1.0 = every block)\n\n",
                date, cpu_model().c_str(), std::thread::hardware_concurrency(), threads, problem.c_str());
    std::printf("| density | time (ms, median of %d) | time / time(1.0) |\n| --- | --- | --- |\n", run.repeats);
    for (int i = 0; i < 4; ++i) std::printf("| %.2f | %.1f | %.3f |\n", densities[i], ms[i], ms[i] / ms[3]);
    const bool ok = ms[0] <= 0.2 * ms[3];
    std::printf("\ndensity 0.1 / 1.0 = %.3f: %s (requirement <= 0.2)\n", ms[0] / ms[3], ok ? "pass" : "FAIL");
    return ok ? 0 : 4;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "cpu_density: %s\n", e.what());
    return 1;
  } catch (const bsattn::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
