// mok: plan an MoE layer for a model and device, or run it on a backend and check it.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "commands.h"
#include "mok/core/error.h"

namespace {

const char* kUsage =
    "usage: mok <command> [options]\n"
    "  mok plan    --preset NAME [--ranks R] [--tokens T] [--device h200|h100|cpu]\n"
    "              [--comm-sms N] [--minibatch ROWS] [--ring-rows ROWS] [--ring-budget-mib MIB]\n"
    "              [--backward fused|stages]\n"
    "              print the plan (minibatch, ring, backward path, workspace, floors) and why\n"
    "  mok run     [--preset NAME] [--ranks R] [--tokens T] [--routing balanced|uniform|zipf|one_expert|masked]\n"
    "              [--backend auto|cpu|cuda] [--threads N] [--runs N] [--seed S] [--limit L]\n"
    "              [--fused on|off]   (cuda: also run the fused forward, the megakernel)\n"
    "              [--precision bf16|fp8|fp8_dgrad]   (fp8: the experts' forward GEMMs on block-scaled e4m3;\n"
    "                                          fp8_dgrad: and the backward's data-gradient GEMMs)\n"
    "              run forward+backward, check against the fp64 reference, print timings\n"
    "  mok presets [--json]   list the model presets\n";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  try {
    if (command == "run") return mok::cli::run_command(args);
    if (command == "plan") return mok::cli::plan_command(args);
    if (command == "presets") return mok::cli::presets_command(args);
    std::fprintf(stderr, "mok: unknown command '%s'\n%s", command.c_str(), kUsage);
    return 2;
  } catch (const mok::InvalidArgument& e) {
    std::fprintf(stderr, "mok %s: error: %s\n", command.c_str(), e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mok %s: error: %s\n", command.c_str(), e.what());
    return 1;
  }
}
