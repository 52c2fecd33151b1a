// The CUDA backend of `mok run`: the layer's forward for all R emulated ranks on one GPU.
//
// Each rank has its own device buffers (x, topk_idx, topk_w, its experts' weights, its schedule
// and row buffers, its combine slots); the kernels reach the other ranks' buffers through tables
// of per-rank pointers, as they will reach peers' symmetric memory. Per destination rank: device
// schedule -> dispatch gather -> routed experts -> combine scatter into every source rank's slots;
// then per source rank: shared expert -> combine epilogue. The backward kernels have not landed:
// `mok run` runs the backward on the CPU reference and says so.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mok/core/desc.h"
#include "mok/core/reference.h"

namespace mok::cli {

// "" when a device the sm_90a kernels run on is present; otherwise why not (no driver, no device,
// not Hopper). Never throws, so `--backend auto` can ask on any machine.
std::string cuda_unavailable_reason();

// "" when every kernel of the forward accepts this problem's shapes; otherwise the reasons.
std::string cuda_cannot_run(const MoeDesc& desc);

struct CudaForward {
  std::string device;                                    // e.g. "NVIDIA H200, 132 SMs"
  std::vector<std::vector<float>> y;                     // [R][T*H] of the first timed run (bf16 values)
  std::vector<double> forward_ms;                        // per timed run, the whole forward (cudaEvents)
  std::vector<std::pair<std::string, double>> stage_ms;  // per stage, median over the timed runs
  int64_t identical_runs = 1;                            // timed runs whose y is bitwise the first's
  std::string first_difference;                          // where the first differing run differs
};

// Runs the forward `runs` times (after one untimed warm-up), outputs poisoned before every run.
// Throws NotSupported (no device, shapes the kernels do not take) or std::runtime_error (a CUDA
// error, a kernel status) with a message that starts with "backend cuda: ".
CudaForward cuda_layer_forward(const ref::LayerInputs<float>& in, int64_t runs);

}  // namespace mok::cli
