// A grouped GEMM with fp8 (e4m3) operands and no scales, through the same persistent kernel as the
// bf16 expert GEMMs: the check that the precision template parameter is real (ForwardMainloopOf
// instantiated at e4m3); and the block-scaled form (1x128 activation and 128x128 weight scales,
// promoted into the fp32 accumulator per k-block). Test-only: the library does not expose fp8 yet.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mok::test {

// out[r, :] = a[r, :] * b[e]^T for the rows r of expert e's segment [offsets[e], offsets[e+1]):
// a [rows, k] e4m3, b [experts, n, k] e4m3, out [rows, n] bf16, fp32 accumulation in k order.
// k a multiple of 16 (TMA row strides), offsets 128-row aligned on the device.
void fp8_grouped_gemm(const void* a, const void* b, void* out, const int32_t* offsets, int rows, int k, int n,
                      int experts, int32_t* status, cudaStream_t stream);

// The block-scaled form (detail/fp8_scaled_gemm_kernel.cuh): out[r, :] = sum over k-blocks kb of
// (a[r, kb] b[e, :, kb]^T) * a_scales[kb, r] * b_scales[e, n / 128, kb], promoted per k-block in k
// order. a_scales k-block major [ceil(k / 128), rows]; b_scales [experts, ceil(n / 128), ceil(k / 128)];
// rows a multiple of 4 (the scales' 16-byte rows), k a multiple of 16, n of 8.
void fp8_scaled_grouped_gemm(const void* a, const float* a_scales, const void* b, const float* b_scales, void* out,
                             const int32_t* offsets, int rows, int k, int n, int experts, int32_t* status,
                             cudaStream_t stream);

}  // namespace mok::test
