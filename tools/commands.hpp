// The subcommands of `bsattn`. Each parses its own options (args exclude the program and the
// command name) and returns the process exit code; they throw UsageError (exit 1) and
// bsattn::Error (exit 2).
#pragma once
#include <string>
#include <vector>

namespace bsattn::tools {

int demo_command(const std::vector<std::string>& args);
int run_command(const std::vector<std::string>& args);

}  // namespace bsattn::tools
