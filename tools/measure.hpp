// What `bsattn demo` and `bsattn run` share: build a workload, time it, compare it with the
// dense baseline and the float64 reference, print a report (text or one JSON object).
#pragma once
#include <string>

#include "execute.hpp"
#include "workload.hpp"

namespace bsattn::tools {

struct MeasureOptions {
  std::string title;  // first line of the text report
  RunOptions run;
  int verify_rows = 256;  // 0: no verification
  std::uint64_t verify_seed = 1;
  bool dense_baseline = true;
  bool json = false;
  bool quiet = false;       // no progress on stderr
  std::string save_prefix;  // PREFIX_out.npy and PREFIX_lse.npy when not empty
};

// Exit code 0, or 3 when the verification fails (reported on stderr).
int measure_and_report(const WorkloadSpec& spec, const MeasureOptions& options);

constexpr int kExitVerificationFailed = 3;

}  // namespace bsattn::tools
