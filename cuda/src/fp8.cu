#include "mok/cuda/fp8.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "mok/cuda/detail/fp8_quantize.cuh"

namespace mok::cuda {
namespace {

using detail::fp8_code;
using detail::fp8_scale_exponent;

constexpr int kBlock = 128;                 // columns a scale covers (mok/core/fp8.h: kBlock)
constexpr int kPerLane = kBlock / 32;       // a warp quantizes one block: 4 columns a lane
constexpr int kWarpsPerCta = 8;

// k_major: scales [col_blocks, rows], else [rows, col_blocks]. rows_used (device, may be null):
// rows at or past it are left alone.
__global__ void quantize_rows_kernel(const __nv_bfloat16* __restrict__ x, int64_t rows, int64_t cols,
                                     uint8_t* __restrict__ codes, float* __restrict__ scales, bool k_major,
                                     const int32_t* __restrict__ rows_used) {
  const int lane = threadIdx.x % 32;
  const int64_t col_blocks = (cols + kBlock - 1) / kBlock;
  const int64_t block = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (block >= rows * col_blocks) return;
  const int64_t row = block / col_blocks, c0 = (block % col_blocks) * kBlock + lane * kPerLane;
  if (rows_used != nullptr && row >= *rows_used) return;
  float v[kPerLane];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    v[i] = c0 + i < cols ? __bfloat162float(x[row * cols + c0 + i]) : 0.0f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const int e = fp8_scale_exponent(amax);
  if (lane == 0) scales[k_major ? (block % col_blocks) * rows + row : block] = ldexpf(1.0f, e);
  const float inv = ldexpf(1.0f, -e);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    if (c0 + i < cols)
      codes[row * cols + c0 + i] = fp8_code(v[i], inv);
  }
}

// The fast form of quantize_rows_kernel, for cols % 8 == 0 with x 16-byte and codes 8-byte
// aligned (the other forms take quantize_rows_kernel). 16 lanes take one 128-column block of a row,
// 8 columns each (one 16-byte load, one 8-byte store); a CTA's 256 threads take 16 blocks at a
// time, kRowsUnroll rounds of loads in flight, and the grid (a few CTAs per SM) strides over the
// blocks in row-major order, so HBM is read as one stream. The same arithmetic as
// quantize_rows_kernel, so the same bits. (Session 22 measured the one-warp-per-block form at
// ~1.45 TB/s: 4 two-byte loads and 4 one-byte stores a lane, 8 blocks per CTA.)
constexpr int kVecCols = 8;
constexpr int kLanesPerBlock = kBlock / kVecCols;
constexpr int kVecThreads = 256;
constexpr int kVecGroups = kVecThreads / kLanesPerBlock;
constexpr int kRowsUnroll = 4;

__global__ void __launch_bounds__(kVecThreads)
    quantize_rows_vec_kernel(const __nv_bfloat16* __restrict__ x, int64_t rows, int64_t cols,
                             uint8_t* __restrict__ codes, float* __restrict__ scales, bool k_major,
                             const int32_t* __restrict__ rows_used) {
  const int64_t col_blocks = (cols + kBlock - 1) / kBlock;
  int64_t row_limit = rows;
  if (rows_used != nullptr) row_limit = min(rows, max(int64_t{0}, int64_t{*rows_used}));
  const int sub = threadIdx.x % kLanesPerBlock;
  // A block is (row, cb), stepped by the grid's stride without dividing (64-bit divisions per
  // 16 bytes would cost more issue slots than the loads).
  const int64_t stride = int64_t(gridDim.x) * kVecGroups;
  const int64_t stride_rows = stride / col_blocks, stride_cbs = stride % col_blocks;
  auto step = [&](int64_t& row, int64_t& cb) {
    row += stride_rows;
    cb += stride_cbs;
    if (cb >= col_blocks) {
      cb -= col_blocks;
      ++row;
    }
  };
  const int64_t first = int64_t(blockIdx.x) * kVecGroups + threadIdx.x / kLanesPerBlock;
  int64_t row0 = first / col_blocks, cb0 = first % col_blocks;
  // The CTA's first block bounds the loop (every lane of a warp stays for the shuffles); a block
  // past the end is loaded as zeros and not stored.
  int64_t cta_row = int64_t(blockIdx.x) * kVecGroups / col_blocks;
  int64_t cta_cb = int64_t(blockIdx.x) * kVecGroups % col_blocks;
  while (cta_row < row_limit) {
    uint4 raw[kRowsUnroll];
    int64_t row = row0, cb = cb0;
#pragma unroll
    for (int u = 0; u < kRowsUnroll; ++u) {
      const int64_t c0 = cb * kBlock + sub * kVecCols;
      raw[u] = row < row_limit && c0 < cols ? __ldg(reinterpret_cast<const uint4*>(x + row * cols + c0))
                                            : make_uint4(0, 0, 0, 0);
      step(row, cb);
    }
    row = row0;
    cb = cb0;
#pragma unroll
    for (int u = 0; u < kRowsUnroll; ++u, step(row, cb)) {
      const int64_t c0 = cb * kBlock + sub * kVecCols;
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw[u]);
      float v[kVecCols];
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < kVecCols / 2; ++i) {
        const float2 f = __bfloat1622float2(pairs[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
#pragma unroll
      for (int offset = kLanesPerBlock / 2; offset > 0; offset /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      if (row >= row_limit) continue;
      const int e = fp8_scale_exponent(amax);
      if (sub == 0) scales[k_major ? cb * rows + row : row * col_blocks + cb] = ldexpf(1.0f, e);
      if (c0 >= cols) continue;
      const float inv = ldexpf(1.0f, -e);
      uint32_t packed[2] = {0, 0};
#pragma unroll
      for (int i = 0; i < kVecCols; ++i) packed[i / 4] |= uint32_t(fp8_code(v[i], inv)) << (8 * (i % 4));
      *reinterpret_cast<uint2*>(codes + row * cols + c0) = make_uint2(packed[0], packed[1]);
    }
    row0 = row;
    cb0 = cb;
    for (int u = 0; u < kRowsUnroll; ++u) step(cta_row, cta_cb);
  }
}

// One 128 x 128 block of a plane per CTA of 256 threads: thread t takes column t % 128 of rows
// t / 128, t / 128 + 2, ... of the block (a warp reads 32 consecutive columns), 64 values.
constexpr int kBlockThreads = 256;
constexpr int kPerThread = kBlock * kBlock / kBlockThreads;
constexpr int kRowStep = kBlockThreads / kBlock;

// The transposed copy (quantize_blocks_e4m3_transposed): where it goes, null codes_t for none.
struct TransposedTarget {
  uint8_t* codes_t;
  float* scales_t;
  int64_t ld_t, offset_t;
};

__global__ void __launch_bounds__(kBlockThreads)
    quantize_blocks_kernel(const __nv_bfloat16* __restrict__ x, int64_t rows, int64_t cols, int64_t row_blocks,
                           int64_t col_blocks, uint8_t* __restrict__ codes, float* __restrict__ scales,
                           TransposedTarget t) {
  __shared__ float warp_max[kBlockThreads / 32];
  // The block's codes for the transposed copy: [row][column], rows padded to 132 bytes so that
  // reading a column (consecutive rows in consecutive threads) hits 32 banks.
  constexpr int kTileStride = kBlock + 4;
  __shared__ uint8_t tile[kBlock * kTileStride];
  const int64_t block = blockIdx.x;  // (plane, row block, column block), row-major
  const int64_t plane = block / (row_blocks * col_blocks);
  const int64_t rb = block / col_blocks % row_blocks, cb = block % col_blocks;
  const int64_t r0 = rb * kBlock + threadIdx.x / kBlock, c = cb * kBlock + threadIdx.x % kBlock;
  const bool in_cols = c < cols;
  // The rows r0, r0 + kRowStep, ... that exist: rows_here of them (0 past the matrix).
  const int64_t left = rows - r0 > 0 ? (rows - r0 + kRowStep - 1) / kRowStep : 0;
  const int rows_here = int(left < kPerThread ? left : kPerThread);
  const int64_t first = (plane * rows + r0) * cols + c;  // element (r0, c) of the plane
  float v[kPerThread];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    v[i] = in_cols && i < rows_here ? __bfloat162float(x[first + int64_t(i) * kRowStep * cols]) : 0.0f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int w = 1; w < kBlockThreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
  const int e = fp8_scale_exponent(amax);
  if (threadIdx.x == 0 && scales != nullptr) scales[block] = ldexpf(1.0f, e);
  const float inv = ldexpf(1.0f, -e);
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const uint8_t code = fp8_code(v[i], inv);
    if (in_cols && i < rows_here && codes != nullptr) codes[first + int64_t(i) * kRowStep * cols] = code;
    if (t.codes_t != nullptr) tile[(threadIdx.x / kBlock + i * kRowStep) * kTileStride + threadIdx.x % kBlock] = code;
  }
  if (t.codes_t == nullptr) return;
  // W^T's block (cb, rb): its row j is the block's column j; thread k of a 128-thread half writes
  // byte k of a row (consecutive threads, consecutive bytes).
  __syncthreads();
  const int64_t cols_t = t.ld_t, r_here = rows - rb * kBlock, c_here = cols - cb * kBlock;
  const int k = threadIdx.x % kBlock;
  if (threadIdx.x == 0) t.scales_t[(plane * col_blocks + cb) * (cols_t / kBlock) + t.offset_t / kBlock + rb] = ldexpf(1.0f, e);
  for (int j = threadIdx.x / kBlock; j < kBlock; j += kRowStep) {
    if (j < c_here && k < r_here)
      t.codes_t[(plane * cols + cb * kBlock + j) * cols_t + t.offset_t + rb * kBlock + k] = tile[k * kTileStride + j];
  }
}

}  // namespace

void preload_fp8_kernels() {
  cudaFuncAttributes attr;
  for (const void* kernel : {reinterpret_cast<const void*>(quantize_rows_kernel),
                             reinterpret_cast<const void*>(quantize_blocks_kernel)}) {
    const cudaError_t e = cudaFuncGetAttributes(&attr, kernel);
    if (e != cudaSuccess) throw std::runtime_error(std::string("mok: load the fp8 quantizers: ") + cudaGetErrorString(e));
  }
}

void quantize_blocks_e4m3(const void* x, int64_t planes, int64_t rows, int64_t cols, uint8_t* codes, float* scales,
                          cudaStream_t stream) {
  if (planes < 0 || rows < 0 || cols < 0)
    throw std::invalid_argument("mok quantize_blocks_e4m3: planes, rows and cols must be >= 0, got " +
                                std::to_string(planes) + " x " + std::to_string(rows) + " x " + std::to_string(cols));
  const int64_t row_blocks = (rows + kBlock - 1) / kBlock, col_blocks = (cols + kBlock - 1) / kBlock;
  const int64_t blocks = planes * row_blocks * col_blocks;
  if (blocks == 0) return;
  if (x == nullptr || codes == nullptr || scales == nullptr)
    throw std::invalid_argument("mok quantize_blocks_e4m3: x, codes and scales must not be null");
  if (blocks > int64_t{0x7fffffff})
    throw std::invalid_argument("mok quantize_blocks_e4m3: " + std::to_string(blocks) + " blocks are too many");
  quantize_blocks_kernel<<<unsigned(blocks), kBlockThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), rows, cols, row_blocks, col_blocks, codes, scales, TransposedTarget{});
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("mok quantize_blocks_e4m3: launch: ") + cudaGetErrorString(e));
}

void quantize_blocks_e4m3_transposed(const void* x, int64_t planes, int64_t rows, int64_t cols, uint8_t* codes,
                                     float* scales, uint8_t* codes_t, float* scales_t, int64_t ld_t, int64_t offset_t,
                                     cudaStream_t stream) {
  const std::string what = "mok quantize_blocks_e4m3_transposed: ";
  if (planes < 0 || rows < 0 || cols < 0)
    throw std::invalid_argument(what + "planes, rows and cols must be >= 0, got " + std::to_string(planes) + " x " +
                                std::to_string(rows) + " x " + std::to_string(cols));
  if (ld_t % kBlock != 0 || offset_t % kBlock != 0 || offset_t < 0 || offset_t + rows > ld_t)
    throw std::invalid_argument(what + "the transposes' row length " + std::to_string(ld_t) + " and column offset " +
                                std::to_string(offset_t) + " must be multiples of 128 holding " +
                                std::to_string(rows) + " columns");
  const int64_t row_blocks = (rows + kBlock - 1) / kBlock, col_blocks = (cols + kBlock - 1) / kBlock;
  const int64_t blocks = planes * row_blocks * col_blocks;
  if (blocks == 0) return;
  if (x == nullptr || codes_t == nullptr || scales_t == nullptr || (codes == nullptr) != (scales == nullptr))
    throw std::invalid_argument(what + "x, codes_t and scales_t must not be null, and codes and scales both or neither");
  if (blocks > int64_t{0x7fffffff})
    throw std::invalid_argument(what + std::to_string(blocks) + " blocks are too many");
  quantize_blocks_kernel<<<unsigned(blocks), kBlockThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), rows, cols, row_blocks, col_blocks, codes, scales,
      TransposedTarget{codes_t, scales_t, ld_t, offset_t});
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(what + "launch: " + cudaGetErrorString(e));
}

static void quantize_rows(const char* name, const void* x, int64_t rows, int64_t cols, uint8_t* codes, float* scales,
                          bool k_major, const int32_t* rows_used, cudaStream_t stream) {
  if (rows < 0 || cols < 0)
    throw std::invalid_argument(std::string("mok ") + name + ": rows and cols must be >= 0, got " +
                                std::to_string(rows) + " x " + std::to_string(cols));
  const int64_t blocks = rows * ((cols + kBlock - 1) / kBlock);
  if (blocks == 0) return;
  if (x == nullptr || codes == nullptr || scales == nullptr)
    throw std::invalid_argument(std::string("mok ") + name + ": x, codes and scales must not be null");
  const int64_t ctas = (blocks + kWarpsPerCta - 1) / kWarpsPerCta;
  if (ctas > int64_t{0x7fffffff})
    throw std::invalid_argument(std::string("mok ") + name + ": " + std::to_string(blocks) + " blocks are too many");
  const bool vector = cols % kVecCols == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(codes) % 8 == 0;
  if (vector) {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      throw std::runtime_error(std::string("mok ") + name + ": cannot read the device's SM count");
    // Enough CTAs to fill every SM (8 of 256 threads each), fewer for small inputs.
    const int64_t needed = (blocks + kVecGroups - 1) / kVecGroups;
    const unsigned grid = unsigned(std::min<int64_t>(needed, int64_t{sms} * 8));
    quantize_rows_vec_kernel<<<grid, kVecThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), rows, cols,
                                                               codes, scales, k_major, rows_used);
  } else {
    quantize_rows_kernel<<<unsigned(ctas), 32 * kWarpsPerCta, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), rows,
                                                                          cols, codes, scales, k_major, rows_used);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("mok ") + name + ": launch: " + cudaGetErrorString(e));
}

void quantize_rows_e4m3(const void* x, int64_t rows, int64_t cols, uint8_t* codes, float* scales,
                        cudaStream_t stream) {
  quantize_rows("quantize_rows_e4m3", x, rows, cols, codes, scales, false, nullptr, stream);
}

void quantize_rows_e4m3_k_major(const void* x, int64_t rows, int64_t cols, uint8_t* codes, float* scales,
                                const int32_t* rows_used, cudaStream_t stream) {
  quantize_rows("quantize_rows_e4m3_k_major", x, rows, cols, codes, scales, true, rows_used, stream);
}

}  // namespace mok::cuda
