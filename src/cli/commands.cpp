#include "commands.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "args.h"
#include "mok/core/compare.h"
#include "mok/core/error.h"
#include "mok/core/parallel.h"
#include "mok/core/planner.h"
#include "mok/core/presets.h"
#include "mok/core/problem.h"
#include "mok/core/reference.h"
#include "progress.h"
#ifdef MOK_WITH_CUDA
#include "cuda_backend.h"
#endif

namespace mok::cli {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

template <class T>
std::vector<T> flatten(const std::vector<std::vector<T>>& v) {
  std::vector<T> out;
  for (const auto& part : v) out.insert(out.end(), part.begin(), part.end());
  return out;
}

// Every output of the layer, flattened, in a fixed order (for checks and bitwise comparisons).
struct NamedOutputs {
  std::vector<std::string> names;
  std::vector<std::vector<double>> values;
};

template <class Real>
NamedOutputs collect(const ref::LayerForward<Real>& f, const ref::LayerGrads<Real>& g) {
  NamedOutputs o;
  auto add = [&](const std::string& name, const std::vector<Real>& v) {
    o.names.push_back(name);
    o.values.emplace_back(v.begin(), v.end());
  };
  add("y", flatten(f.y));
  add("dx", flatten(g.dx));
  add("d_topk_w", flatten(g.d_topk_w));
  add("dW_gate", g.d_routed.gate);
  add("dW_up", g.d_routed.up);
  add("dW_down", g.d_routed.down);
  std::vector<Real> sg, su, sd;
  for (const auto& s : g.d_shared) {
    sg.insert(sg.end(), s.gate.begin(), s.gate.end());
    su.insert(su.end(), s.up.begin(), s.up.end());
    sd.insert(sd.end(), s.down.begin(), s.down.end());
  }
  if (!sg.empty()) {
    add("shared dW_gate", sg);
    add("shared dW_up", su);
    add("shared dW_down", sd);
  }
  return o;
}

struct Backend {
  std::string name;  // "cpu" or "cuda"
  std::string note;  // why auto did not pick cuda, or empty
};

// auto: cuda when this build has it, a Hopper GPU is present and the kernels take the shapes; else
// cpu. A machine with nvcc but no GPU (CI) builds the CUDA backend and still runs on the CPU.
Backend backend_for(const std::string& requested, const MoeDesc& desc) {
  if (requested == "cpu") return {"cpu", ""};
  if (requested != "auto" && requested != "cuda") {
    throw InvalidArgument("backend '" + requested + "' is not one of: auto, cpu, cuda");
  }
#ifdef MOK_WITH_CUDA
  std::string why = cuda_unavailable_reason();
  if (why.empty()) why = cuda_cannot_run(desc);
  if (why.empty()) return {"cuda", ""};
  if (requested == "cuda") throw NotSupported("backend cuda: " + why);
  return {"cpu", "cuda not used: " + why};
#else
  (void)desc;
  if (requested == "cuda") {
    throw NotSupported("backend cuda: this mok was built without CUDA (no nvcc at build time)");
  }
  return {"cpu", ""};
#endif
}

// The check's oracle: the same layer in fp64 with no rounding (an exact function of the inputs).
NamedOutputs exact_outputs(const ref::LayerInputs<float>& inputs, const std::vector<std::vector<float>>& dy,
                           Progress& progress) {
  ref::LayerInputs<double> exact;
  exact.desc = inputs.desc;
  exact.desc.precision = Precision::bf16;  // the layer in exact arithmetic, whatever precision the run has
  for (const auto& v : inputs.x) exact.x.emplace_back(v.begin(), v.end());
  for (const auto& v : inputs.topk_w) exact.topk_w.emplace_back(v.begin(), v.end());
  exact.topk_idx = inputs.topk_idx;
  exact.routed.gate.assign(inputs.routed.gate.begin(), inputs.routed.gate.end());
  exact.routed.up.assign(inputs.routed.up.begin(), inputs.routed.up.end());
  exact.routed.down.assign(inputs.routed.down.begin(), inputs.routed.down.end());
  exact.shared.gate.assign(inputs.shared.gate.begin(), inputs.shared.gate.end());
  exact.shared.up.assign(inputs.shared.up.begin(), inputs.shared.up.end());
  exact.shared.down.assign(inputs.shared.down.begin(), inputs.shared.down.end());
  std::vector<std::vector<double>> dy_exact;
  for (const auto& v : dy) dy_exact.emplace_back(v.begin(), v.end());
  const auto fwd_exact = ref::layer_forward(exact, ref::Rounding::none);
  progress.step("fp64 forward");
  const auto grads_exact = ref::layer_backward(exact, fwd_exact.context, dy_exact, ref::Rounding::none);
  progress.step("fp64 backward");
  return collect(fwd_exact, grads_exact);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The bound of a run's check against the fp64 layer: bf16's, or with fp8_block and fp8_dgrad
// e4m3's (3 mantissa bits on x, the weights and h: about 7% on y, and on the gradients from its
// saved rows; fp8_dgrad's also on dy and dg|du).
double exact_bound(const MoeDesc& desc) { return fp8_forward(desc.precision) ? 0.12 : kBf16RelTolerance; }

// What the fused run's backward is: the backward megakernel, or at fp8_dgrad moe_backward's stage
// kernels (the megakernel's backward is bf16).
const char* fused_backward_name(const MoeDesc& desc) {
  return fp8_dgrad(desc.precision) ? "moe_backward's stage kernels, fp8_dgrad" : "the backward megakernel";
}

// Prints each output's relative error against the fp64 reference; true when all are within bound.
bool check_against_exact(const NamedOutputs& out, const NamedOutputs& expected, double bound = kBf16RelTolerance) {
  bool ok = true;
  std::printf("\ncheck against the fp64 reference (bound %.2g on ||out-ref||/||ref||):\n", bound);
  for (size_t i = 0; i < out.values.size(); ++i) {
    const Comparison c = compare(out.values[i], expected.values[i]);
    const bool pass = c.within(bound);
    ok = ok && pass;
    std::printf("  %-16s %s %s\n", out.names[i].c_str(), pass ? "ok  " : "FAIL", c.describe("").c_str() + 2);
  }
  return ok;
}

#ifdef MOK_WITH_CUDA
// Prints each output's relative error against the CPU reference at the run's precision (the same
// rounding points; fp8_block: the same quantization); the shared expert's gradients per rank
// (each rank's are its own), the worst rank shown.
bool check_against_cpu_reference(const ref::LayerForward<float>& gpu_fwd, const ref::LayerGrads<float>& gpu,
                                 const ref::LayerForward<float>& cpu_fwd, const ref::LayerGrads<float>& cpu,
                                 Precision precision) {
  bool ok = true;
  std::printf("check of the GPU forward and backward against the CPU reference at %s (bound %.0e):\n",
              to_string(precision), kBf16RelTolerance);
  auto line = [&ok](const std::string& name, const Comparison& c) {
    const bool pass = c.within(kBf16RelTolerance);
    ok = ok && pass;
    std::printf("  %-16s %s %s\n", name.c_str(), pass ? "ok  " : "FAIL", c.describe("").c_str() + 2);
  };
  line("y", compare(flatten(gpu_fwd.y), flatten(cpu_fwd.y)));
  line("dx", compare(flatten(gpu.dx), flatten(cpu.dx)));
  line("d_topk_w", compare(flatten(gpu.d_topk_w), flatten(cpu.d_topk_w)));
  line("dW_gate", compare(gpu.d_routed.gate, cpu.d_routed.gate));
  line("dW_up", compare(gpu.d_routed.up, cpu.d_routed.up));
  line("dW_down", compare(gpu.d_routed.down, cpu.d_routed.down));
  if (!cpu.d_shared.empty() && !cpu.d_shared.front().gate.empty()) {
    using Part = std::vector<float> ref::SharedWeights<float>::*;
    const std::pair<const char*, Part> parts[] = {{"shared dW_gate", &ref::SharedWeights<float>::gate},
                                                  {"shared dW_up", &ref::SharedWeights<float>::up},
                                                  {"shared dW_down", &ref::SharedWeights<float>::down}};
    for (const auto& [name, part] : parts) {
      Comparison worst;
      size_t worst_rank = 0;
      for (size_t r = 0; r < cpu.d_shared.size(); ++r) {
        const Comparison c = r < gpu.d_shared.size() ? compare(gpu.d_shared[r].*part, cpu.d_shared[r].*part)
                                                     : compare(std::vector<float>{}, cpu.d_shared[r].*part);
        auto badness = [](const Comparison& x) { return std::make_pair(!x.within(kBf16RelTolerance), x.rel_error); };
        if (r == 0 || badness(c) > badness(worst)) {
          worst = c;
          worst_rank = r;
        }
      }
      line(std::string(name) + " r" + std::to_string(worst_rank), worst);
    }
  }
  return ok;
}

// The forward and backward on the GPU (all ranks on one device), checked against the CPU bf16
// reference and the fp64 one.
int run_on_cuda(const ref::LayerInputs<float>& inputs, const std::vector<std::vector<float>>& dy,
                int64_t runs, bool fused) {
  const MoeDesc& desc = inputs.desc;
  Progress progress(5, "mok run");
  const CudaLayer gpu = cuda_layer(inputs, dy, runs, fused);
  progress.step("forward and backward (cuda)");
  auto start = Clock::now();
  const auto fwd_cpu = ref::layer_forward(inputs, ref::Rounding::bf16);
  const double cpu_fwd_ms = ms_since(start);
  progress.step("forward (cpu bf16 reference)");
  start = Clock::now();
  const auto grads_cpu = ref::layer_backward(inputs, fwd_cpu.context, dy, ref::Rounding::bf16);
  const double cpu_bwd_ms = ms_since(start);
  progress.step("backward (cpu bf16 reference)");
  const NamedOutputs expected = exact_outputs(inputs, dy, progress);
  progress.finish();

  ref::LayerForward<float> gpu_fwd;
  gpu_fwd.y = gpu.y;
  const NamedOutputs out = collect(gpu_fwd, gpu.grads);

  const double routed = 6.0 * desc.ranks * desc.routed_slots() * desc.hidden * desc.intermediate;
  const double shared = 6.0 * desc.ranks * desc.tokens_per_rank * desc.hidden * desc.shared_intermediate;
  const double fwd_flops = routed + shared;
  std::printf("backend cuda: %s, all %lld ranks on one device\n", gpu.device.c_str(),
              static_cast<long long>(desc.ranks));
  std::printf("backward: cuda\n");
  std::printf("\n%-12s %-8s %12s %12s   (cuda: median of %lld runs, cudaEvent time, all %lld ranks)\n",
              "pass", "device", "time (ms)", "GFLOP/s", static_cast<long long>(runs),
              static_cast<long long>(desc.ranks));
  std::printf("%-12s %-8s %12.3f %12.1f\n", "forward", "cuda", median(gpu.forward_ms),
              fwd_flops / median(gpu.forward_ms) / 1e6);
  for (const auto& [stage, ms] : gpu.forward_stage_ms) std::printf("  %-10s %-8s %12.3f\n", stage.c_str(), "", ms);
  std::printf("%-12s %-8s %12.3f %12.1f\n", "backward", "cuda", median(gpu.backward_ms),
              2 * fwd_flops / median(gpu.backward_ms) / 1e6);
  for (const auto& [stage, ms] : gpu.backward_stage_ms) std::printf("  %-10s %-8s %12.3f\n", stage.c_str(), "", ms);
  if (gpu.fused_skipped.empty()) {
    std::printf("%-12s %-8s %12.3f %12.1f   (routed experts only; %s)\n", "forward", "fused", median(gpu.fused_forward_ms),
                routed / median(gpu.fused_forward_ms) / 1e6, gpu.fused_plan.c_str());
    if (gpu.fused_backward_skipped.empty())
      std::printf("%-12s %-8s %12.3f %12.1f   (routed experts only; %s)\n", "backward", "fused",
                  median(gpu.fused_backward_ms), 2 * routed / median(gpu.fused_backward_ms) / 1e6,
                  fused_backward_name(desc));
  }
  std::printf("%-12s %-8s %12.2f %12.2f\n", "forward", "cpu ref", cpu_fwd_ms, fwd_flops / cpu_fwd_ms / 1e6);
  std::printf("%-12s %-8s %12.2f %12.2f\n", "backward", "cpu ref", cpu_bwd_ms, 2 * fwd_flops / cpu_bwd_ms / 1e6);

  std::printf("\ny and gradients from the GPU\n");
  bool ok = check_against_exact(out, expected, exact_bound(desc));
  ok = check_against_cpu_reference(gpu_fwd, gpu.grads, fwd_cpu, grads_cpu, desc.precision) && ok;
  std::printf("determinism: %lld of %lld runs bitwise identical to the first (GPU forward and backward)%s%s\n",
              static_cast<long long>(gpu.identical_runs), static_cast<long long>(runs),
              gpu.first_difference.empty() ? "" : "; ", gpu.first_difference.c_str());
  ok = ok && gpu.identical_runs == runs;
  if (gpu.fused_skipped.empty()) {
    std::printf("fused forward (megakernel): %lld of %lld runs bitwise equal to the staged forward%s%s\n",
                static_cast<long long>(gpu.fused_identical_runs), static_cast<long long>(runs),
                gpu.fused_difference.empty() ? "" : "; ", gpu.fused_difference.c_str());
    ok = ok && gpu.fused_identical_runs == runs;
    if (gpu.fused_backward_skipped.empty()) {
      std::printf("fused backward (%s): %lld of %lld runs bitwise equal to the staged backward%s%s\n",
                  fused_backward_name(desc), static_cast<long long>(gpu.fused_backward_identical_runs),
                  static_cast<long long>(runs),
                  gpu.fused_backward_difference.empty() ? "" : "; ", gpu.fused_backward_difference.c_str());
      ok = ok && gpu.fused_backward_identical_runs == runs;
    } else {
      std::printf("fused backward (%s): not run: %s\n", fused_backward_name(desc), gpu.fused_backward_skipped.c_str());
    }
  } else {
    std::printf("fused forward (megakernel): not run: %s\n", gpu.fused_skipped.c_str());
  }
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
#endif

}  // namespace

int run_command(const std::vector<std::string>& argv) {
  const Args args(argv, {"preset", "ranks", "tokens", "routing", "backend", "threads", "runs", "seed", "limit", "fused",
                         "precision"});
  const ModelPreset& preset = find_preset(args.str("preset", "small"));
  MoeDesc desc = preset.desc(args.integer("ranks", 2), args.integer("tokens", 256));
  const std::string fused = args.str("fused", "on");
  MOK_REQUIRE(fused == "on" || fused == "off", "option --fused must be on or off, got '", fused, "'");
  if (args.has("limit")) {
    const std::string v = args.str("limit", "");
    char* end = nullptr;
    const float limit = std::strtof(v.c_str(), &end);
    MOK_REQUIRE(!v.empty() && *end == '\0', "option --limit needs a number, got '", v, "'");
    desc.swiglu_limit = limit;
  }
  desc.precision = parse_precision(args.str("precision", "bf16"));
  desc.validate();
  // The CPU backend holds every rank's experts (and an fp64 copy for the check) in host memory.
  const double host_bytes = 12.0 * 3.0 * static_cast<double>(desc.num_experts * desc.intermediate * desc.hidden);
  MOK_REQUIRE(host_bytes < 8e9, "preset ", preset.name, " needs about ", format_bytes(host_bytes),
              " of host memory on the CPU backend; use a smaller preset (small, tiny)");
  const RoutingKind routing = parse_routing(args.str("routing", "zipf"));
  const Backend backend = backend_for(args.str("backend", "auto"), desc);
  const int64_t runs = args.integer("runs", 2);
  MOK_REQUIRE(runs >= 1 && runs <= 100, "runs must be in [1, 100], got ", runs);
  const int64_t threads = args.integer("threads", 0);
  set_cpu_threads(static_cast<int>(threads));
  const uint64_t seed = static_cast<uint64_t>(args.integer("seed", 1));

  std::printf("mok run: preset %s, %s, routing %s, backend %s (%d threads%s%s), seed %llu\n",
              preset.name.c_str(), desc.to_string().c_str(), to_string(routing), backend.name.c_str(),
              cpu_threads(), backend.note.empty() ? "" : "; ", backend.note.c_str(),
              static_cast<unsigned long long>(seed));

  const auto inputs = make_inputs<float>(desc, routing, seed, /*bf16_values=*/true);
  const auto dy = make_output_grad<float>(desc, seed, /*bf16_values=*/true);
#ifdef MOK_WITH_CUDA
  if (backend.name == "cuda") return run_on_cuda(inputs, dy, runs, fused == "on");
#endif
  Progress progress(2 * runs + 2, "mok run");

  std::vector<double> fwd_ms, bwd_ms;
  NamedOutputs first;
  int64_t identical_runs = 1;
  std::string first_difference;
  for (int64_t run = 0; run < runs; ++run) {
    auto start = Clock::now();
    const auto fwd = ref::layer_forward(inputs, ref::Rounding::bf16);
    fwd_ms.push_back(ms_since(start));
    progress.step("forward " + std::to_string(run + 1));
    start = Clock::now();
    const auto grads = ref::layer_backward(inputs, fwd.context, dy, ref::Rounding::bf16);
    bwd_ms.push_back(ms_since(start));
    progress.step("backward " + std::to_string(run + 1));
    NamedOutputs out = collect(fwd, grads);
    if (run == 0) {
      first = std::move(out);
      continue;
    }
    bool same = true;
    for (size_t i = 0; i < out.values.size() && same; ++i) {
      const int64_t at = first_bit_difference(out.values[i], first.values[i]);
      if (at >= 0) {
        same = false;
        if (first_difference.empty()) {
          first_difference = out.names[i] + " differs at index " + std::to_string(at) + " in run " +
                             std::to_string(run + 1);
        }
      }
    }
    identical_runs += same ? 1 : 0;
  }

  const NamedOutputs expected = exact_outputs(inputs, dy, progress);
  progress.finish();

  const double routed = 6.0 * desc.ranks * desc.routed_slots() * desc.hidden * desc.intermediate;
  const double shared = 6.0 * desc.ranks * desc.tokens_per_rank * desc.hidden * desc.shared_intermediate;
  const double fwd_flops = routed + shared;
  std::printf("\n%-10s %12s %12s   (median of %lld runs, all %lld ranks)\n", "pass", "time (ms)",
              "GFLOP/s", static_cast<long long>(runs), static_cast<long long>(desc.ranks));
  std::printf("%-10s %12.2f %12.2f\n", "forward", median(fwd_ms), fwd_flops / median(fwd_ms) / 1e6);
  std::printf("%-10s %12.2f %12.2f\n", "backward", median(bwd_ms), 2 * fwd_flops / median(bwd_ms) / 1e6);

  bool ok = check_against_exact(first, expected, exact_bound(desc));
  if (runs > 1) {
    std::printf("determinism: %lld of %lld runs bitwise identical to the first%s%s\n",
                static_cast<long long>(identical_runs), static_cast<long long>(runs),
                first_difference.empty() ? "" : "; ", first_difference.c_str());
    ok = ok && identical_runs == runs;
  }
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

int plan_command(const std::vector<std::string>& argv) {
  const Args args(argv, {"preset", "ranks", "tokens", "device", "comm-sms", "minibatch", "ring-rows",
                         "ring-budget-mib", "backward"});
  MOK_REQUIRE(args.has("preset"), "mok plan needs --preset NAME (see `mok presets`)");
  const ModelPreset& preset = find_preset(args.str("preset", ""));
  const MoeDesc desc = preset.desc(args.integer("ranks", 2), args.integer("tokens", 8192));
  PlanOverrides ov;
  if (auto v = args.optional_integer("comm-sms")) ov.comm_sms = static_cast<int>(*v);
  ov.minibatch_rows = args.optional_integer("minibatch");
  ov.ring_rows = args.optional_integer("ring-rows");
  if (auto v = args.optional_integer("ring-budget-mib")) ov.ring_budget_bytes = *v << 20;
  if (args.has("backward")) {
    const std::string path = args.str("backward", "");
    MOK_REQUIRE(path == "fused" || path == "stages", "--backward must be fused or stages, got '", path, "'");
    ov.fused_backward = path == "fused";
  }
  const MoeConfig cfg = plan(desc, find_device(args.str("device", "h200")), ov);
  std::printf("preset %s\n%s", preset.name.c_str(), cfg.explanation.c_str());
  return 0;
}

int presets_command(const std::vector<std::string>& argv) {
  const Args args(argv, {}, {"json"});
  const bool json = args.has("json");
  if (json) std::printf("[\n");
  const auto& presets = model_presets();
  for (size_t i = 0; i < presets.size(); ++i) {
    const ModelPreset& p = presets[i];
    if (json) {
      std::printf("  {\"name\": \"%s\", \"E\": %lld, \"H\": %lld, \"I\": %lld, \"topk\": %lld, "
                  "\"shared_I\": %lld, \"swiglu_limit\": ",
                  p.name.c_str(), static_cast<long long>(p.num_experts), static_cast<long long>(p.hidden),
                  static_cast<long long>(p.intermediate), static_cast<long long>(p.topk),
                  static_cast<long long>(p.shared_intermediate));
      if (p.swiglu_limit) {
        std::printf("%g}", *p.swiglu_limit);
      } else {
        std::printf("null}");
      }
      std::printf("%s\n", i + 1 < presets.size() ? "," : "");
    } else {
      std::printf("%-16s E=%-4lld H=%-5lld I=%-5lld k=%-2lld shared=%-5lld limit=%s\n", p.name.c_str(),
                  static_cast<long long>(p.num_experts), static_cast<long long>(p.hidden),
                  static_cast<long long>(p.intermediate), static_cast<long long>(p.topk),
                  static_cast<long long>(p.shared_intermediate),
                  p.swiglu_limit ? std::to_string(*p.swiglu_limit).c_str() : "none");
    }
  }
  if (json) std::printf("]\n");
  return 0;
}

}  // namespace mok::cli
