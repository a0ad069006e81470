// Command-line options of the tools: declared once with their help text, parsed, and printed
// by --help.
#pragma once
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace bsattn::tools {

// Bad command-line usage (exit code 1).
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Options {
 public:
  // `usage` is the synopsis line ("bsattn demo [options]"), `summary` what the command does.
  Options(std::string usage, std::string summary);

  void flag(const std::string& name, const std::string& help);  // --name
  void value(const std::string& name, const std::string& metavar, const std::string& help,
             const std::string& default_value = "");  // --name VALUE or --name=VALUE

  // Parses args (without the program and command names). Returns false when --help was given
  // (the help is then printed on stdout). Throws UsageError.
  bool parse(const std::vector<std::string>& args);

  bool has(const std::string& name) const;  // a flag given, or a value given or defaulted
  std::string get(const std::string& name) const;
  int get_int(const std::string& name) const;
  double get_double(const std::string& name) const;
  std::string help() const;

 private:
  struct Option {
    std::string name, metavar, help, default_value;
    bool takes_value = false;
  };
  const Option& find(const std::string& name) const;

  std::string usage_, summary_;
  std::vector<Option> options_;
  std::map<std::string, std::string> given_;
};

}  // namespace bsattn::tools
