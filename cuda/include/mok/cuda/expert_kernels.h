// Host API of the sm_90a expert kernels: the routed SwiGLU MLP as persistent grouped GEMMs over
// rows grouped by expert. Plain pointers and sizes only (no CUDA or CuTe types), so any host code
// (the mok program, the Python extension, tests) can call it.
//
// Row layout: rows are grouped by expert; expert e's rows are [offsets[e], offsets[e+1]) of the
// row buffers, with every offset a multiple of kRowAlign (the schedule pads each expert; padding
// rows are zero). The offsets live on the device and are read by the kernels: no host sync.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <cuda_runtime_api.h>

namespace mok::cuda {

// Each expert's segment starts at a multiple of this many rows (the row tile of the GEMMs).
inline constexpr int64_t kRowAlign = 128;

struct ExpertsForwardArgs {
  int64_t row_capacity = 0;    // rows the row buffers hold (>= offsets[El])
  int64_t hidden = 0;          // H
  int64_t intermediate = 0;    // I
  int64_t local_experts = 0;   // El
  const int32_t* expert_offsets = nullptr;  // device [El+1], multiples of kRowAlign
  const void* x = nullptr;       // [row_capacity, H] bf16
  const void* w_gate = nullptr;  // [El, I, H] bf16
  const void* w_up = nullptr;    // [El, I, H] bf16
  const void* w_down = nullptr;  // [El, H, I] bf16
  void* gu = nullptr;            // [row_capacity, 2I] bf16 out: g | u saved for the backward; may be null
  void* h = nullptr;             // [row_capacity, I] bf16 out
  void* y = nullptr;             // [row_capacity, H] bf16 out
  std::optional<float> swiglu_limit;
  int32_t* status = nullptr;     // device word; a kernel that finds bad offsets writes a code here
  int num_sms = 0;               // 0 = all of the device's
};

// Why the kernels cannot run these arguments, or an empty string when they can.
std::string can_implement(const ExpertsForwardArgs& args);
// Device workspace the launch needs (none today: the tile schedule lives in shared memory).
inline int64_t workspace_bytes(const ExpertsForwardArgs&) { return 0; }

// h = act(x W_gate^T, x W_up^T) (and gu), then y = h W_down^T, per expert. Asynchronous on stream.
void experts_forward(const ExpertsForwardArgs& args, cudaStream_t stream);
// The two GEMMs separately (for benchmarks and tests).
void gate_up_swiglu(const ExpertsForwardArgs& args, cudaStream_t stream);
void down_projection(const ExpertsForwardArgs& args, cudaStream_t stream);

// The backward on the same grouped rows (reference.h: experts_backward). dy holds each row's
// output gradient, unscaled; row_weight each row's router weight (0 for padding rows). Row
// outputs (dx, d_row_weight, the scratch rows) are written for rows [0, offsets[El]) only.
// The element type of the weight gradients: fp32 (the default) or bf16, the parameters' type
// (half the bytes written, and no conversion after; each element is rounded once from its fp32
// tile, so the bits are as deterministic as fp32's).
enum class GradType : int32_t { fp32 = 0, bf16 = 1 };

// Where the backward's dx rows go instead of dx (the layer's stage backward: the scatter into the
// source ranks' (token, j) slots, fused into the dx GEMM's epilogue): row r of the grouped rows to
// slots_of[src_rank[r]] + src_slot[r] * hidden; padding rows (src_rank -1) are not written.
struct DxPush {
  int64_t ranks = 0;                        // R, in [1, 128]
  int64_t slots = 0;                        // T*k of each rank, < 2^24
  void* const* slots_of = nullptr;          // host array of R device pointers (peers' mapped), each [slots, H] bf16
  const int32_t* src_rank = nullptr;        // device [row_capacity]
  const int32_t* src_slot = nullptr;        // device [row_capacity]
  const int32_t* given_up_words = nullptr;  // optional: a call given up (megakernel.h's status) pushes nothing
};

struct ExpertsBackwardArgs {
  int64_t row_capacity = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t local_experts = 0;
  const int32_t* expert_offsets = nullptr;  // device [El+1], multiples of kRowAlign
  const void* x = nullptr;           // [row_capacity, H] bf16, the forward's input rows
  const void* gu = nullptr;          // [row_capacity, 2I] bf16, saved by the forward
  const void* h = nullptr;           // [row_capacity, I] bf16, saved by the forward
  const void* dy = nullptr;          // [row_capacity, H] bf16
  const float* row_weight = nullptr; // [row_capacity]
  const void* w_gate = nullptr;      // [El, I, H] bf16
  const void* w_up = nullptr;        // [El, I, H] bf16
  const void* w_down = nullptr;      // [El, H, I] bf16
  void* dgu = nullptr;               // [row_capacity, 2I] bf16 scratch: dg | du
  void* hw = nullptr;                // [row_capacity, I] bf16 scratch: w * h
  float* dw_partial = nullptr;       // [row_capacity, dw_partial_blocks(I)] fp32 scratch
  void* dx = nullptr;                // [row_capacity, H] bf16 out (unused with dx_push)
  const DxPush* dx_push = nullptr;   // optional: the dx rows pushed into their slots instead
  float* d_row_weight = nullptr;     // [row_capacity] out
  void* d_w_gate = nullptr;          // [El, I, H] d_w_type out (overwritten; zero for empty experts)
  void* d_w_up = nullptr;            // [El, I, H] d_w_type out
  void* d_w_down = nullptr;          // [El, H, I] d_w_type out
  GradType d_w_type = GradType::fp32;
  std::optional<float> swiglu_limit;
  int32_t* status = nullptr;
  int num_sms = 0;
};

// Bytes of one weight-gradient element.
inline int64_t grad_bytes(GradType t) { return t == GradType::bf16 ? 2 : 4; }

// Column blocks of I whose partial sums of d topk_w the backward keeps per row.
inline int64_t dw_partial_blocks(int64_t intermediate) { return (intermediate + 255) / 256; }

std::string can_implement(const ExpertsBackwardArgs& args);
// dx rows, d row weight and weight gradients (fp32 or bf16); reductions in a fixed order (no atomics).
// experts_dgrad then experts_wgrad.
void experts_backward(const ExpertsBackwardArgs& args, cudaStream_t stream);
// Its first steps alone: dh = dy W_down with the SwiGLU backward (dg|du, w*h, d row weight), then
// dx = dg W_gate + du W_up (the weight gradients are not written).
void experts_dgrad(const ExpertsBackwardArgs& args, cudaStream_t stream);
// experts_dgrad's two launches alone (what the benchmark times apart): dh with the SwiGLU backward
// and d row weight; dx from the dg|du rows the first left.
void experts_dh_swiglu_backward(const ExpertsBackwardArgs& args, cudaStream_t stream);
void experts_dx(const ExpertsBackwardArgs& args, cudaStream_t stream);
// Its last step alone: the weight gradients from x, dy and the dg|du, w*h rows of the dgrad
// (dx, d_row_weight, dw_partial and the weights are not read; the weights may be null).
void experts_wgrad(const ExpertsBackwardArgs& args, cudaStream_t stream);

// Loads every expert kernel on the current device now (routing.h: preload_routing_kernels says
// why: a first launch under lazy loading can wait for spinning kernels).
void preload_expert_kernels();

// Status codes written to ExpertsForwardArgs::status.
enum StatusCode : int32_t {
  kStatusOk = 0,
  kStatusMisalignedOffsets = 1,  // an expert offset is not a multiple of kRowAlign
  kStatusOffsetsOutOfRange = 2,  // offsets decrease or exceed row_capacity
};
const char* status_message(int32_t code);

}  // namespace mok::cuda
