// The CUDA backend of `mok run`: the layer's forward and backward for all R emulated ranks on one
// GPU.
//
// Each rank has its own device buffers (x, topk_idx, topk_w, dy, its experts' weights, its schedule
// and row buffers, its combine and dispatch-gradient slots); the kernels reach the other ranks'
// buffers through tables of per-rank pointers, as they will reach peers' symmetric memory.
// Forward, per destination rank: device schedule -> dispatch gather -> routed experts -> combine
// scatter into every source rank's slots; then per source rank: shared expert -> combine epilogue.
// Backward (keeps the forward's schedule, x rows, g|u and h), per destination rank: gather dy rows
// and router weights -> routed experts backward -> scatter dx rows and d topk_w into every source
// rank's slots; then per source rank: shared expert backward -> dispatch-gradient epilogue.
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

// "" when every kernel of the forward and backward accepts this problem's shapes; otherwise the reasons.
std::string cuda_cannot_run(const MoeDesc& desc);

struct CudaLayer {
  std::string device;                      // e.g. "NVIDIA H200, 132 SMs"
  std::vector<std::vector<float>> y;       // [R][T*H] of the first timed run (bf16 values)
  ref::LayerGrads<float> grads;            // of the first timed run, laid out as the reference's:
                                           // d_routed over all E experts (each destination rank's El
                                           // in expert order), d_shared per rank (its own tokens)
  std::vector<double> forward_ms;          // per timed run, the whole forward (cudaEvents)
  std::vector<double> backward_ms;         // per timed run, the whole backward (cudaEvents)
  std::vector<std::pair<std::string, double>> forward_stage_ms;   // per stage, median over runs
  std::vector<std::pair<std::string, double>> backward_stage_ms;  // per stage, median over runs
  int64_t identical_runs = 1;              // timed runs whose y and gradients are bitwise the first's
  std::string first_difference;            // where the first differing run differs
  // The fused forward (the megakernel): every rank on its own stream, sharing the device's SMs.
  std::string fused_skipped;               // why it did not run ("" = it ran)
  std::vector<double> fused_forward_ms;    // per timed run, first launch to last rank done
  int64_t fused_identical_runs = 0;        // runs whose y is bitwise the staged forward's
  std::string fused_difference;            // the first difference, or a rank's status message
  std::string fused_plan;                  // minibatch, ring and comm CTAs it ran with
  // The fused backward (the backward megakernel) after each fused forward, checked bitwise against
  // the staged backward's dx, d topk_w and routed weight gradients.
  std::string fused_backward_skipped;      // why it did not run ("" = it ran)
  std::vector<double> fused_backward_ms;   // per timed run, first launch to last rank done
  int64_t fused_backward_identical_runs = 0;
  std::string fused_backward_difference;
};

// Runs forward then backward (dy [R][T*H], bf16 values) `runs` times after one untimed warm-up,
// then (fused) the fused forward and the backward megakernel `runs` times, checked bitwise against
// the staged forward's y and the staged backward's gradients, outputs poisoned before every run. Throws NotSupported (no device, shapes the kernels do not
// take) or std::runtime_error (a CUDA error, a kernel status) with a message that starts with
// "backend cuda: ".
CudaLayer cuda_layer(const ref::LayerInputs<float>& in, const std::vector<std::vector<float>>& dy, int64_t runs,
                     bool fused);

}  // namespace mok::cli
