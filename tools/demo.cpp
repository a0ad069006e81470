// `bsattn demo`: a long-context pattern as serving systems use it — causal attention over a
// sliding window plus attention-sink tokens, with a few extra blocks anywhere below the diagonal
// (retrieval-style), given as block lists with full blocks marked full.
#include "args.hpp"
#include "commands.hpp"
#include "measure.hpp"

namespace bsattn::tools {
namespace {

constexpr int kCpuSeq = 4096;   // the CPU demo, dense baseline included, stays well under a minute
constexpr int kGpuSeq = 32768;  // long enough for the GPU time not to be launch overhead

WorkloadSpec demo_spec(int seq, std::uint64_t seed) {
  WorkloadSpec spec;
  spec.batch = 1;
  spec.heads_q = 8;
  spec.heads_kv = 2;
  spec.head_dim = 128;
  spec.seqlens_q = {seq};
  spec.seqlens_kv = {seq};
  spec.dtype = spec.out_dtype = DType::bf16;
  spec.block = {64, 64};
  spec.format = Format::block_lists;
  spec.mask.causal = true;
  spec.mask.window_left = seq / 8;
  spec.mask.sink_tokens = 64;
  spec.pattern.random_density = 0.03;
  spec.pattern.random_full = true;
  spec.seed = seed;
  return spec;
}

}  // namespace

int demo_command(const std::vector<std::string>& args) {
  Options o("bsattn demo [options]",
            "Runs an embedded long-context pattern (B=1, Hq=8, Hkv=2, D=128, bf16, block 64: causal sliding\n"
            "window of seq/8 tokens + 64 sink tokens + 3% extra random blocks) on the GPU when one is present and\n"
            "supported, else on the CPU; prints density, time, the dense time of the same engine, the speedup\n"
            "and the error against a float64 reference on sampled rows. Exit code 3 when the error exceeds\n"
            "the bf16 tolerance.");
  o.flag("json", "print one JSON object on stdout");
  o.value("seq", "N", "sequence length (query and key/value); auto: " + std::to_string(kCpuSeq) + " on the CPU, " +
                          std::to_string(kGpuSeq) + " on the GPU",
          "auto");
  o.value("threads", "N", "CPU worker threads (0: all cores)", "0");
  o.value("repeats", "N", "timed repetitions (the median is reported)", "3");
  o.value("device", "DEV", "auto, cpu or cuda", "auto");
  o.value("seed", "N", "seed of the inputs and of the random blocks", "0");
  o.value("verify-rows", "N", "sampled rows checked against the float64 reference (0: none)", "256");
  o.flag("quiet", "no progress on stderr");
  if (!o.parse(args)) return 0;

  MeasureOptions m;
  m.run.device = o.get("device");
  m.run.threads = o.get_int("threads");
  m.run.repeats = o.get_int("repeats");
  if (m.run.repeats < 1) throw UsageError("--repeats must be at least 1");
  m.verify_rows = o.get_int("verify-rows");
  m.json = o.has("json");
  m.quiet = o.has("quiet");
  const auto seed = static_cast<std::uint64_t>(o.get_int("seed"));

  int seq;
  if (o.get("seq") == "auto") {
    // Where the demo runs depends on the pattern's features, not its length: ask on a short one.
    const Device device = choose_device(Workload(demo_spec(256, seed)), m.run).device;
    seq = device == Device::cuda ? kGpuSeq : kCpuSeq;
  } else {
    seq = o.get_int("seq");
  }
  if (seq < 64) throw UsageError("--seq must be at least 64");
  m.title = "bsattn demo: causal sliding window (" + std::to_string(seq / 8) +
            " tokens) + 64 sink tokens + 3% random full blocks";
  return measure_and_report(demo_spec(seq, seed), m);
}

}  // namespace bsattn::tools
