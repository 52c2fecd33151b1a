// The mok program's commands.
#pragma once

#include <string>
#include <vector>

namespace mok::cli {

int run_command(const std::vector<std::string>& args);  // mok run
int plan_command(const std::vector<std::string>& args);  // mok plan
int presets_command(const std::vector<std::string>& args);  // mok presets

}  // namespace mok::cli
