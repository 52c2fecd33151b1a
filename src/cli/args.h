// A small command-line parser: `--name value`, `--name=value` and boolean `--flag`.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace mok::cli {

class Args {
 public:
  // Throws InvalidArgument for an option not in `known` or a missing value. Names in `flags`
  // take no value.
  Args(const std::vector<std::string>& argv, const std::set<std::string>& known,
       const std::set<std::string>& flags = {});

  bool has(const std::string& name) const { return values_.count(name) != 0; }
  std::string str(const std::string& name, const std::string& fallback) const;
  int64_t integer(const std::string& name, int64_t fallback) const;
  std::optional<int64_t> optional_integer(const std::string& name) const;

 private:
  std::map<std::string, std::string> values_;
};

}  // namespace mok::cli
