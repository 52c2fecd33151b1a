#include "mok/cuda/fp8.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace mok::cuda {
namespace {

constexpr int kBlock = 128;                 // columns a scale covers (mok/core/fp8.h: kBlock)
constexpr int kPerLane = kBlock / 32;       // a warp quantizes one block: 4 columns a lane
constexpr int kWarpsPerCta = 8;

// The smallest 2^e with amax <= 448 * 2^e, e in [-126, 127] (fp8::block_scale): amax = m * 2^E
// with m in [1, 2) and 448 = 1.75 * 2^8, so e = E - 8, plus one where m > 1.75.
__device__ __forceinline__ int scale_exponent(float amax) {
  if (amax == 0.0f) return 0;
  int e = ilogbf(amax) - 8;
  if (amax > ldexpf(448.0f, e)) ++e;
  return max(-126, min(127, e));
}

__global__ void quantize_rows_kernel(const __nv_bfloat16* __restrict__ x, int64_t rows, int64_t cols,
                                     uint8_t* __restrict__ codes, float* __restrict__ scales) {
  const int lane = threadIdx.x % 32;
  const int64_t col_blocks = (cols + kBlock - 1) / kBlock;
  const int64_t block = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (block >= rows * col_blocks) return;
  const int64_t row = block / col_blocks, c0 = (block % col_blocks) * kBlock + lane * kPerLane;
  float v[kPerLane];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    v[i] = c0 + i < cols ? __bfloat162float(x[row * cols + c0 + i]) : 0.0f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const int e = scale_exponent(amax);
  if (lane == 0) scales[block] = ldexpf(1.0f, e);
  // x / 2^e: a product with an exact power of two (2^-e is a float for e in [-126, 127]), rounded
  // once, as the CPU's quotient is; then the e4m3 conversion, nearest even and saturating.
  const float inv = ldexpf(1.0f, -e);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    if (c0 + i < cols)
      codes[row * cols + c0 + i] = __nv_cvt_float_to_fp8(__fmul_rn(v[i], inv), __NV_SATFINITE, __NV_E4M3);
  }
}

}  // namespace

void quantize_rows_e4m3(const void* x, int64_t rows, int64_t cols, uint8_t* codes, float* scales,
                        cudaStream_t stream) {
  if (rows < 0 || cols < 0)
    throw std::invalid_argument("mok quantize_rows_e4m3: rows and cols must be >= 0, got " + std::to_string(rows) +
                                " x " + std::to_string(cols));
  const int64_t blocks = rows * ((cols + kBlock - 1) / kBlock);
  if (blocks == 0) return;
  if (x == nullptr || codes == nullptr || scales == nullptr)
    throw std::invalid_argument("mok quantize_rows_e4m3: x, codes and scales must not be null");
  const int64_t ctas = (blocks + kWarpsPerCta - 1) / kWarpsPerCta;
  if (ctas > int64_t{0x7fffffff})
    throw std::invalid_argument("mok quantize_rows_e4m3: " + std::to_string(blocks) + " blocks are too many");
  quantize_rows_kernel<<<unsigned(ctas), 32 * kWarpsPerCta, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), rows,
                                                                        cols, codes, scales);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("mok quantize_rows_e4m3: launch: ") + cudaGetErrorString(e));
}

}  // namespace mok::cuda
