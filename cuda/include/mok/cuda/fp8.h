// Host API of the fp8 kernels: bf16 activations to block-scaled e4m3 on the device, the same codes
// and scales as the CPU oracle (mok/core/fp8.h: quantize_activations) bit for bit. The first piece
// of the block-scaled fp8 path (a rank quantizes its x before the dispatch: half the NVLink bytes);
// and the experts' forward on e4m3 operands.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string>

#include "mok/cuda/expert_kernels.h"

namespace mok::cuda {

// x [rows, cols] bf16 (row stride `cols`, finite values: the layer's finiteness scan runs first)
// -> codes [rows, cols] e4m3 and scales [rows, ceil(cols / 128)] fp32: one power-of-two scale per
// row and 128 columns, the smallest 2^e with the block's largest magnitude <= 448 * 2^e (e in
// [-126, 127]; 1 for an all-zero block). Asynchronous on `stream`; throws std::invalid_argument
// for bad sizes or null pointers, std::runtime_error for a launch error.
void quantize_rows_e4m3(const void* x, int64_t rows, int64_t cols, uint8_t* codes, float* scales,
                        cudaStream_t stream);

// quantize_rows_e4m3 with the scales k-block major: scales [ceil(cols / 128), rows], the layout the
// fp8 expert GEMMs read (a row tile's scales of one k-block are contiguous). With rows_used (a
// device int32, e.g. an expert offsets table's last entry), rows at or past *rows_used are not
// touched. The same codes and scales, bit for bit.
void quantize_rows_e4m3_k_major(const void* x, int64_t rows, int64_t cols, uint8_t* codes, float* scales,
                                const int32_t* rows_used, cudaStream_t stream);

// Loads the quantizers and the block-scaled GEMMs on the current device (megakernel.h:
// preload_kernels says why: moe_backward's fp8 replay and fp8_dgrad launch them after its barrier).
void preload_fp8_kernels();

// Weights: x [planes, rows, cols] bf16 (an expert's matrix a plane) -> codes [planes, rows, cols]
// e4m3 and scales [planes, ceil(rows / 128), ceil(cols / 128)] fp32: one power-of-two scale per
// 128 x 128 block of a plane (partial at the edges), as mok/core/fp8.h: quantize_weights per plane.
// Asynchronous on `stream`; the same errors as quantize_rows_e4m3.
void quantize_blocks_e4m3(const void* x, int64_t planes, int64_t rows, int64_t cols, uint8_t* codes, float* scales,
                          cudaStream_t stream);
// quantize_blocks_e4m3 that also writes each plane's transpose (the fp8 dgrad's B operands: a
// 128 x 128 block's scale is its transpose's, so W^T's codes are W's, moved; mok/core/fp8.h:
// transpose): codes_t [planes, cols, ld_t] with plane p's W^T in columns [offset_t, offset_t + rows)
// of each of its rows, scales_t [planes, ceil(cols / 128), ld_t / 128] with its blocks from column
// block offset_t / 128. Two calls with offset_t 0 and I into one [El, H, 2I] buffer write
// [W_gate^T | W_up^T] (mok/core/fp8.h: concat_cols). ld_t and offset_t are multiples of 128,
// offset_t + rows <= ld_t; columns past a plane's rows are not written. codes and scales as
// quantize_blocks_e4m3 (both null: not written).
void quantize_blocks_e4m3_transposed(const void* x, int64_t planes, int64_t rows, int64_t cols, uint8_t* codes,
                                     float* scales, uint8_t* codes_t, float* scales_t, int64_t ld_t, int64_t offset_t,
                                     cudaStream_t stream);
// The fp8 dgrad's weight operands (ExpertsDgradFp8Args) from the bf16 weights W_gate, W_up
// [El, I, H] and W_down [El, H, I]: W_down^T [El, I, H] with scales [El, I / 128, H / 128], and
// [W_gate^T | W_up^T] [El, H, 2I] with scales [El, H / 128, 2I / 128] (three
// quantize_blocks_e4m3_transposed calls).
void quantize_dgrad_weights(const void* w_gate, const void* w_up, const void* w_down, int64_t experts, int64_t hidden,
                            int64_t intermediate, uint8_t* w_down_t, float* w_down_t_scales, uint8_t* w_gate_up_t,
                            float* w_gate_up_t_scales, cudaStream_t stream);

// Activations quantized along their rows, the fp8 weight gradients' operands (their reduction runs
// over an expert's rows; mok/core/reference.h: experts_backward_fp8): x [rows, cols] bf16 ->
// x^T's e4m3 codes [cols, ld_t] (row c holds column c of x, x's row r at column r) and scales
// [ceil(rows / 128), cols] fp32, one power-of-two scale per 128 rows x 1 column of x (k-block
// major: a tile's 128 column scales of one k-block are contiguous). Bit for bit
// fp8::quantize(x, rows, cols, 128, 1), its codes transposed. Blocks at or past *rows_used (a
// device int32 that is a multiple of 128, e.g. an expert offsets table's last entry; may be null)
// are not touched; an expert's segment of 128-aligned rows is whole blocks, so each block is one
// expert's rows. ld_t >= rows, a multiple of 16. Asynchronous; the same errors as quantize_rows_e4m3.
void quantize_columns_e4m3_transposed(const void* x, int64_t rows, int64_t cols, uint8_t* codes_t, float* scales_t,
                                      int64_t ld_t, const int32_t* rows_used, cudaStream_t stream);

// The routed experts' forward with block-scaled e4m3 GEMMs (Precision::fp8_block), on rows
// grouped by expert as ExpertsForwardArgs (expert_kernels.h): g|u = x W_gate^T | x W_up^T with each
// k-block's product promoted into fp32 with its scales, h = act(g, u) (bf16, and g|u saved as the
// bf16 path saves them), h quantized as rows (1 x 128), y = h W_down^T the same way (bf16). The
// CPU oracle is mok/core/reference.h: experts_forward_fp8; within a k-block the tensor cores' sum
// is not the oracle's exact one, so results match it within a tolerance, and rerun bit for bit.
// hidden and intermediate are multiples of 128 (whole scale blocks), row_capacity of 4.
struct ExpertsForwardFp8Args {
  int64_t row_capacity = 0;    // rows the row buffers hold (>= offsets[El])
  int64_t hidden = 0;          // H
  int64_t intermediate = 0;    // I
  int64_t local_experts = 0;   // El
  const int32_t* expert_offsets = nullptr;  // device [El+1], multiples of 128
  const uint8_t* x = nullptr;          // [row_capacity, H] e4m3 (quantize_rows_e4m3_k_major)
  const float* x_scales = nullptr;     // [H / 128, row_capacity]
  const uint8_t* w_gate = nullptr;     // [El, I, H] e4m3 (quantize_blocks_e4m3)
  const float* w_gate_scales = nullptr;  // [El, I / 128, H / 128]
  const uint8_t* w_up = nullptr;       // [El, I, H] e4m3
  const float* w_up_scales = nullptr;  // [El, I / 128, H / 128]
  const uint8_t* w_down = nullptr;     // [El, H, I] e4m3
  const float* w_down_scales = nullptr;  // [El, H / 128, I / 128]
  void* gu = nullptr;                  // [row_capacity, 2I] bf16 out, may be null
  void* h = nullptr;                   // [row_capacity, I] bf16 out
  uint8_t* h_codes = nullptr;          // [row_capacity, I] e4m3 out: h quantized, down's input
  float* h_scales = nullptr;           // [I / 128, row_capacity] out
  void* y = nullptr;                   // [row_capacity, H] bf16 out
  std::optional<float> swiglu_limit;
  int32_t* status = nullptr;           // as ExpertsForwardArgs::status
  int num_sms = 0;                     // 0 = all of the device's
};

// Why the fp8 kernels cannot run these arguments, or an empty string when they can. gate_up_only:
// for experts_gate_up_fp8, which reads neither w_down nor h_codes, h_scales and y.
std::string can_implement(const ExpertsForwardFp8Args& args, bool gate_up_only = false);
// Asynchronous on stream; throws std::invalid_argument naming what can_implement reports. Rows
// at or past offsets[El] of h, h_codes, gu and y are not touched.
void experts_forward_fp8(const ExpertsForwardFp8Args& args, cudaStream_t stream);
// Its first GEMM alone: g|u (when gu is set) and h, the same bits as experts_forward_fp8 writes
// them (the fp8 forward's replay: MoeBackwardArgs::replay with fp8_forward).
void experts_gate_up_fp8(const ExpertsForwardFp8Args& args, cudaStream_t stream);

// The fp8 dgrad (Precision::fp8_dgrad; its oracle is mok/core/reference.h:
// experts_backward_fp8_dgrad): dy's rows quantized 1 x 128, dh = dy W_down on block-scaled e4m3
// (W_down^T's codes) with the SwiGLU backward in the epilogue (dg|du, w*h and d row weight, as the
// bf16 kernels compute them from dh, with one d topk_w partial per 128 columns), then dg|du's
// rows quantized 1 x 128 and dx = [dg|du] [W_gate; W_up] on e4m3 ([W_gate^T | W_up^T]'s codes).
// The weight gradients stay bf16: experts_wgrad(base) after it reads dg|du and w*h from base.
// With base.dx_push the dx rows go into their (token, j) slots as the bf16 dx GEMM pushes them
// (base.dx may then be null). hidden and intermediate are multiples of 128, row_capacity of 4.
struct ExpertsDgradFp8Args {
  // Its bf16 weights are not read; dw_partial has I / 128 columns here; d_w_* are experts_wgrad's.
  ExpertsBackwardArgs base;
  const uint8_t* w_down_t = nullptr;          // [El, I, H] e4m3 (quantize_blocks_e4m3_transposed of W_down)
  const float* w_down_t_scales = nullptr;     // [El, I / 128, H / 128]
  const uint8_t* w_gate_up_t = nullptr;       // [El, H, 2I] e4m3: [W_gate^T | W_up^T]
  const float* w_gate_up_t_scales = nullptr;  // [El, H / 128, 2I / 128]
  uint8_t* dy_codes = nullptr;                // [row_capacity, H] scratch
  float* dy_scales = nullptr;                 // [H / 128, row_capacity] scratch
  uint8_t* dgu_codes = nullptr;               // [row_capacity, 2I] scratch
  float* dgu_scales = nullptr;                // [2I / 128, row_capacity] scratch
};
std::string can_implement(const ExpertsDgradFp8Args& args);
// Asynchronous on stream; throws std::invalid_argument naming what can_implement reports. Rows
// at or past offsets[El] are not touched.
void experts_dgrad_fp8(const ExpertsDgradFp8Args& args, cudaStream_t stream);
// The whole expert backward at Precision::fp8_dgrad: experts_dgrad_fp8, then experts_wgrad(base).
void experts_backward_fp8_dgrad(const ExpertsDgradFp8Args& args, cudaStream_t stream);
// The fp8 dgrad's scratch in one buffer: dy's and dg|du's codes and scales, and the d row
// weight partials (I / 128 columns, more than the bf16 kernels' dw_partial_blocks(I)).
// fp8_dgrad_scratch_bytes is its size; wire_fp8_dgrad_scratch points args' scratch fields
// (dy_codes, dy_scales, dgu_codes, dgu_scales, base.dw_partial) into it, each 256-byte aligned.
int64_t fp8_dgrad_scratch_bytes(int64_t row_capacity, int64_t hidden, int64_t intermediate);
void wire_fp8_dgrad_scratch(ExpertsDgradFp8Args& args, void* scratch);
// The fp8 dgrad's arguments from the bf16 backward's (base), the weights' e4m3 transposes
// (quantize_dgrad_weights' outputs) and fp8_dgrad_scratch_bytes of scratch (wired in).
ExpertsDgradFp8Args fp8_dgrad_args(const ExpertsBackwardArgs& base, const void* w_down_t, const float* w_down_t_scales,
                                   const void* w_gate_up_t, const float* w_gate_up_t_scales, void* scratch);

}  // namespace mok::cuda
