// bsattn: the command-line front end of the library (docs/CLI.md).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "args.hpp"
#include "bsattn/bsattn.hpp"
#include "commands.hpp"
#include "execute.hpp"
#include "workload.hpp"

namespace {

constexpr const char* kHelp =
    "usage: bsattn <command> [options]\n"
    "\n"
    "Block-sparse attention: run the built-in demo or a problem described in JSON.\n"
    "\n"
    "commands:\n"
    "  demo      long-context causal + sliding window + sinks + random blocks, against the dense time\n"
    "  run       a problem from a JSON file (docs/CLI.md: sizes, layout, format, pattern, mask, ...)\n"
    "\n"
    "options:\n"
    "  --help     show this help (also after a command: bsattn demo --help)\n"
    "  --version  print the version and the build's features\n"
    "\n"
    "exit codes: 0 ok, 1 bad usage, 2 library error, 3 result outside the tolerance\n";

void print_version() {
  std::printf("bsattn %s\n", BSATTN_VERSION);
#ifdef BSATTN_WITH_CUDA
  std::printf("CUDA support: built in; %d GPU(s) visible\n", bsattn::tools::cuda_device_count());
#else
  std::printf("CUDA support: not built\n");
#endif
}

}  // namespace

int main(int argc, char** argv) {
  using namespace bsattn::tools;
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty()) throw UsageError("missing command (see bsattn --help)");
    const std::string& command = args[0];
    const std::vector<std::string> rest(args.begin() + 1, args.end());
    if (command == "--help" || command == "-h" || command == "help") {
      std::fputs(kHelp, stdout);
      return 0;
    }
    if (command == "--version") {
      print_version();
      return 0;
    }
    if (command == "demo") return demo_command(rest);
    if (command == "run") return run_command(rest);
    throw UsageError("unknown command '" + command + "' (see bsattn --help)");
  } catch (const UsageError& e) {
    std::fprintf(stderr, "bsattn: %s\n", e.what());
    return 1;
  } catch (const SpecError& e) {
    std::fprintf(stderr, "bsattn: %s\n", e.what());
    return 1;
  } catch (const bsattn::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {  // out of memory, or a failure outside the library's checks
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
