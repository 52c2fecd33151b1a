#include "args.h"

#include <cstdlib>

#include "mok/core/error.h"

namespace mok::cli {

Args::Args(const std::vector<std::string>& argv, const std::set<std::string>& known,
           const std::set<std::string>& flags) {
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    MOK_REQUIRE(a.rfind("--", 0) == 0, "unexpected argument '", a, "' (options start with --)");
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (!known.count(name) && !flags.count(name)) {
      std::string list;
      for (const auto& k : known) list += " --" + k;
      for (const auto& f : flags) list += " --" + f;
      throw InvalidArgument("unknown option --" + name + "; options:" + list);
    }
    if (flags.count(name)) {
      MOK_REQUIRE(!inline_value, "option --", name, " takes no value");
      value.assign(1, '1');  // not = "1": GCC 12 warns falsely (-Wrestrict, PR 105329)
    } else if (!inline_value) {
      MOK_REQUIRE(i + 1 < argv.size(), "option --", name, " needs a value");
      value = argv[++i];
    }
    values_[name] = value;
  }
}

std::string Args::str(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

std::optional<int64_t> Args::optional_integer(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  char* end = nullptr;
  const long long v = std::strtoll(it->second.c_str(), &end, 10);
  MOK_REQUIRE(!it->second.empty() && end != nullptr && *end == '\0', "option --", name,
              " needs an integer, got '", it->second, "'");
  return v;
}

int64_t Args::integer(const std::string& name, int64_t fallback) const {
  return optional_integer(name).value_or(fallback);
}

}  // namespace mok::cli
