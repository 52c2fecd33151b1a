// The planner: from a problem (MoeDesc) and device facts to a MoeConfig, with its reasons.
//
// Pure host functions, unit-tested. Sizes here are the plan's defaults; the kernels' own
// can_implement / workspace_bytes have the last word on what they accept.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "mok/core/desc.h"

namespace mok {

// What the planner needs to know about a GPU (or the CPU backend). Rates are measured ceilings
// where the harness has them, datasheet-derived leads otherwise.
struct DeviceFacts {
  std::string name;
  int sm_count = 0;
  int64_t memory_bytes = 0;
  double bf16_tflops = 0;   // dense bf16 matrix rate
  double hbm_gbps = 0;      // device memory copy rate (bytes read + written per second)
  double nvlink_gbps = 0;   // peer read rate per GPU and direction; 0 = no peers

  static DeviceFacts h200();  // rates measured on this project's H200s (bench/results)
  static DeviceFacts h100();
  static DeviceFacts cpu();   // nominal, for the CPU backend's plan
};
DeviceFacts find_device(const std::string& name);  // "h200", "h100", "cpu"; throws InvalidArgument
// Facts for a GPU as its driver names it ("NVIDIA H200", "NVIDIA H100 80GB HBM3", ...): an H200
// (or GH200) or H100 gets the rates known for it with the SMs and memory this part has (the known
// facts are an SXM part's); any other GPU its own SMs and memory and no rates: the planner then
// plans by shape alone (no floors, and the backward as stage kernels unless a MoeConfig says
// otherwise). The C API, the Python package and `mok run` plan with it.
DeviceFacts facts_for_gpu(const std::string& device_name, int sm_count, int64_t memory_bytes);

// The tiles the sm_90a expert kernels are planned around.
struct TileShape {
  int64_t block_m = 128;           // rows (tokens) per tile
  int64_t block_n_gate_up = 256;   // columns of the [2I] gate|up output per tile (128 gate + 128 up)
  int64_t block_n_down = 256;      // columns of the [H] down output per tile
  int64_t block_k = 64;
};

struct PlanOverrides {
  std::optional<int> comm_sms;  // 0: comm warps in every CTA; N >= 1: N comm CTAs
  std::optional<int64_t> minibatch_rows;
  std::optional<int64_t> ring_rows;
  std::optional<int64_t> ring_budget_bytes;
  std::optional<bool> fused_backward;  // the backward megakernel (true) or the stage kernels (false)
};

// FLOPs and bytes of one pass on one rank under balanced routing, and the floor they imply.
struct PassCost {
  double flops = 0;
  double hbm_bytes = 0;
  double nvlink_bytes = 0;  // bytes this rank reads or writes on peers
  double gemm_ms = 0, hbm_ms = 0, nvlink_ms = 0;
  double floor_ms = 0;      // max of the three
  const char* bound_by = "";
};

struct WorkspaceBytes {
  int64_t symmetric = 0;  // per rank, in symmetric memory (peers address it)
  int64_t schedule = 0;   // per rank, local: the routing schedule table sized for any skew
  int64_t ring = 0;       // per rank, local: the ring token buffer
  int64_t total() const { return symmetric + schedule + ring; }
};

struct MoeConfig {
  MoeDesc desc;
  DeviceFacts device;
  TileShape tiles;
  int comm_sms = 0;              // CTAs that only pull rows; 0: 3 warps of every CTA pull them
  int compute_sms = 0;
  int64_t minibatch_rows = 0;      // rows per minibatch (the overlap granularity)
  int64_t ring_rows = 0;           // rows the ring token buffer holds (a multiple of the minibatch)
  int64_t ring_row_bytes = 0;      // bytes the ring keeps per row (its x and h rows)
  int64_t expected_rows = 0;       // rows per rank under balanced routing (T*k)
  int64_t schedule_capacity_rows = 0;
  // Rows per expert under balanced routing (R*T*k/E, a mean) and what the expert GEMMs compute for
  // them: each expert's rows padded to whole row tiles (block_m). padding_share is the part of
  // that work on padding rows, which no FLOP count credits (64 rows per expert in 128-row tiles:
  // 0.5).
  double rows_per_expert = 0;
  int64_t padded_rows_per_expert = 0;
  double padding_share = 0;
  bool keeps_forward_context = false;  // all expected rows fit the ring (as built the training forward
                                       // keeps every row's context outside the ring either way)
  bool fused_backward = false;     // the backward as one megakernel launch, else as stage kernels
  WorkspaceBytes workspace;
  PassCost forward, backward;
  std::string explanation;  // why, in plain text
};

MoeConfig plan(const MoeDesc& desc, const DeviceFacts& device, const PlanOverrides& overrides = {});

// Pieces of the plan, exposed for tests and for the kernels' launchers.
// Comm CTAs that would carry the pull alone (the default is none: comm warps, see plan()).
int comm_ctas_for_peer_reads(const MoeDesc& desc, const DeviceFacts& device);
int64_t minibatch_rows_for_two_waves(const MoeDesc& desc, const TileShape& tiles, int compute_sms);
int64_t ring_row_bytes(const MoeDesc& desc);
int64_t symmetric_bytes(const MoeDesc& desc);
PassCost forward_cost(const MoeDesc& desc, const DeviceFacts& device);
PassCost backward_cost(const MoeDesc& desc, const DeviceFacts& device, bool replays);
// The backward's NVLink time over its GEMM time (the planner's floors) from which the backward
// megakernel is chosen over the stage kernels. Measured on 2 H200s at 2048 and 8192 tokens per
// rank (bench/results/2026-11-30-h200-session6): qwen3-30b (0.46) ran 8-12% faster as one launch;
// kimi-k2 (0.15), deepseek-v4 (0.10) and mixtral (0.025) ran 2-4% slower. 0.25 is between them,
// where a straight line through those gains crosses zero (~0.2) plus a margin; qwen3.5 (0.31) is
// on the megakernel's side and was not measured.
inline constexpr double kFusedBackwardCommShare = 0.25;

// Human-readable byte count ("1.50 GiB").
std::string format_bytes(double bytes);

}  // namespace mok
