#include "args.hpp"

#include <algorithm>
#include <iostream>
#include <sstream>

namespace bsattn::tools {

Options::Options(std::string usage, std::string summary) : usage_(std::move(usage)), summary_(std::move(summary)) {
  flag("help", "show this help and exit");
}

void Options::flag(const std::string& name, const std::string& help) { options_.push_back({name, "", help, "", false}); }

void Options::value(const std::string& name, const std::string& metavar, const std::string& help,
                    const std::string& default_value) {
  options_.push_back({name, metavar, help, default_value, true});
}

const Options::Option& Options::find(const std::string& name) const {
  for (const Option& o : options_)
    if (o.name == name) return o;
  throw UsageError("unknown option --" + name + " (see --help)");
}

bool Options::parse(const std::vector<std::string>& args) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + arg + "' (see --help)");
    const std::size_t eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const Option& o = find(name);
    if (name == "help") {
      std::cout << help();
      return false;
    }
    if (!o.takes_value) {
      if (eq != std::string::npos) throw UsageError("--" + name + " takes no value");
      given_[name] = "1";
    } else if (eq != std::string::npos) {
      given_[name] = arg.substr(eq + 1);
    } else {
      if (i + 1 >= args.size()) throw UsageError("--" + name + " needs a value " + o.metavar);
      given_[name] = args[++i];
    }
  }
  return true;
}

bool Options::has(const std::string& name) const { return given_.count(name) || !find(name).default_value.empty(); }

std::string Options::get(const std::string& name) const {
  const auto it = given_.find(name);
  return it != given_.end() ? it->second : find(name).default_value;
}

int Options::get_int(const std::string& name) const {
  const std::string text = get(name);
  try {
    std::size_t used = 0;
    const int v = std::stoi(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  throw UsageError("--" + name + " expects an integer, got '" + text + "'");
}

double Options::get_double(const std::string& name) const {
  const std::string text = get(name);
  try {
    std::size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  throw UsageError("--" + name + " expects a number, got '" + text + "'");
}

std::string Options::help() const {
  std::ostringstream o;
  o << "usage: " << usage_ << "\n\n" << summary_ << "\n\noptions:\n";
  std::size_t width = 0;
  for (const Option& opt : options_) width = std::max(width, opt.name.size() + opt.metavar.size() + 1);
  for (const Option& opt : options_) {
    const std::string left = opt.name + (opt.takes_value ? " " + opt.metavar : "");
    o << "  --" << left << std::string(width - left.size() + 2, ' ') << opt.help;
    if (!opt.default_value.empty()) o << " (default " << opt.default_value << ")";
    o << "\n";
  }
  return o.str();
}

}  // namespace bsattn::tools
