// Host API of the fp8 kernels: bf16 activations to block-scaled e4m3 on the device, the same codes
// and scales as the CPU oracle (mok/core/fp8.h: quantize_activations) bit for bit. The first piece
// of the block-scaled fp8 path (a rank quantizes its x before the dispatch: half the NVLink bytes).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mok::cuda {

// x [rows, cols] bf16 (row stride `cols`, finite values: the layer's finiteness scan runs first)
// -> codes [rows, cols] e4m3 and scales [rows, ceil(cols / 128)] fp32: one power-of-two scale per
// row and 128 columns, the smallest 2^e with the block's largest magnitude <= 448 * 2^e (e in
// [-126, 127]; 1 for an all-zero block). Asynchronous on `stream`; throws std::invalid_argument
// for bad sizes or null pointers, std::runtime_error for a launch error.
void quantize_rows_e4m3(const void* x, int64_t rows, int64_t cols, uint8_t* codes, float* scales,
                        cudaStream_t stream);

// Weights: x [planes, rows, cols] bf16 (an expert's matrix a plane) -> codes [planes, rows, cols]
// e4m3 and scales [planes, ceil(rows / 128), ceil(cols / 128)] fp32: one power-of-two scale per
// 128 x 128 block of a plane (partial at the edges), as mok/core/fp8.h: quantize_weights per plane.
// Asynchronous on `stream`; the same errors as quantize_rows_e4m3.
void quantize_blocks_e4m3(const void* x, int64_t planes, int64_t rows, int64_t cols, uint8_t* codes, float* scales,
                          cudaStream_t stream);

}  // namespace mok::cuda
