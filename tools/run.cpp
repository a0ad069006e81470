// `bsattn run --config FILE`: a problem described in JSON (docs/CLI.md).
#include "args.hpp"
#include "commands.hpp"
#include "config.hpp"

namespace bsattn::tools {

int run_command(const std::vector<std::string>& args) {
  Options o("bsattn run --config FILE [options]",
            "Builds the problem FILE describes (sizes, layout, dtype, block size, format, block pattern, mask,\n"
            "proxy; schema in docs/CLI.md, examples in tools/examples/), times it on the chosen device and\n"
            "checks sampled rows against a float64 reference. Exit code 3 when the error exceeds the tolerance.");
  o.value("config", "FILE", "the JSON problem description (required)");
  o.value("save-outputs", "PREFIX", "write PREFIX_out.npy (O as float32) and PREFIX_lse.npy");
  o.flag("json", "print one JSON object on stdout");
  o.flag("quiet", "no progress on stderr");
  if (!o.parse(args)) return 0;
  if (!o.has("config")) throw UsageError("run needs --config FILE (see bsattn run --help)");

  RunConfig c = load_run_config(o.get("config"));
  c.measure.title = "bsattn run " + o.get("config");
  c.measure.json = o.has("json");
  c.measure.quiet = o.has("quiet");
  c.measure.save_prefix = o.get("save-outputs");
  return measure_and_report(c.spec, c.measure);
}

}  // namespace bsattn::tools
