// The JSON problem description of `bsattn run --config FILE` (schema: docs/CLI.md).
#pragma once
#include <string>

#include "measure.hpp"
#include "workload.hpp"

namespace bsattn::tools {

struct RunConfig {
  WorkloadSpec spec;
  MeasureOptions measure;  // device, threads, repeats, warm-up, verification, dense baseline
};

// Throws SpecError naming the offending key.
RunConfig parse_run_config(const std::string& json_text);
RunConfig load_run_config(const std::string& path);

}  // namespace bsattn::tools
