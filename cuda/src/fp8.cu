#include "mok/cuda/fp8.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "device_cache.h"
#include "mok/cuda/detail/fp8_quantize.cuh"

namespace mok::cuda {
namespace {

using detail::bf16x8_amax;
using detail::bf16x8_codes;
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
// aligned (the other forms take quantize_rows_kernel). A warp takes whole rows (the grid strides
// over them): each half-warp one 128-column block at a time, 8 columns a lane (one 16-byte load,
// one 8-byte store), kVecUnroll blocks' loads in flight; no division, so few registers and full
// occupancy. The same arithmetic as quantize_rows_kernel, so the same bits. (Session 22 measured
// the one-warp-per-block form at ~1.45 TB/s: 4 two-byte loads and 4 one-byte stores a lane.)
constexpr int kVecCols = 8;
constexpr int kLanesPerBlock = kBlock / kVecCols;
constexpr int kVecThreads = 256;
constexpr int kVecUnroll = 4;

__global__ void __launch_bounds__(kVecThreads)
    quantize_rows_vec_kernel(const __nv_bfloat16* __restrict__ x, int64_t rows, int64_t cols,
                             uint8_t* __restrict__ codes, float* __restrict__ scales, bool k_major,
                             const int32_t* __restrict__ rows_used) {
  const int col_blocks = int((cols + kBlock - 1) / kBlock);
  const int pairs = (col_blocks + 1) / 2;  // a warp's steps along a row
  int64_t row_limit = rows;
  if (rows_used != nullptr) row_limit = min(rows, max(int64_t{0}, int64_t{*rows_used}));
  const int half = threadIdx.x / kLanesPerBlock % 2, sub = threadIdx.x % kLanesPerBlock;
  const int64_t warps = int64_t(gridDim.x) * (kVecThreads / 32);
  // Every bound below is the warp's, so all its lanes reach the shuffles.
  for (int64_t row = (int64_t(blockIdx.x) * kVecThreads + threadIdx.x) / 32; row < row_limit; row += warps) {
    const __nv_bfloat16* xr = x + row * cols;
    uint8_t* cr = codes + row * cols;
    for (int p0 = 0; p0 < pairs; p0 += kVecUnroll) {
      uint4 raw[kVecUnroll];
#pragma unroll
      for (int u = 0; u < kVecUnroll; ++u) {
        const int64_t c0 = int64_t(2 * (p0 + u) + half) * kBlock + sub * kVecCols;
        raw[u] = p0 + u < pairs && c0 < cols ? __ldg(reinterpret_cast<const uint4*>(xr + c0)) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kVecUnroll; ++u) {
        if (p0 + u >= pairs) break;
        const int cb = 2 * (p0 + u) + half;
        const int64_t c0 = int64_t(cb) * kBlock + sub * kVecCols;
        float amax = bf16x8_amax(raw[u], 0.0f);
#pragma unroll
        for (int offset = kLanesPerBlock / 2; offset > 0; offset /= 2)
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        if (cb >= col_blocks) continue;
        const int e = fp8_scale_exponent(amax);
        if (sub == 0) scales[k_major ? cb * rows + row : row * col_blocks + cb] = ldexpf(1.0f, e);
        if (c0 >= cols) continue;
        *reinterpret_cast<uint2*>(cr + c0) = bf16x8_codes(raw[u], ldexpf(1.0f, -e));
      }
    }
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

// A CTA's 128 x 128 block of the block quantizers: blockIdx.x = (plane, row block, column block),
// row-major.
struct BlockCoords {
  int64_t plane, rb, cb;
};

__device__ __forceinline__ BlockCoords block_coords(int64_t row_blocks, int64_t col_blocks) {
  const int64_t block = blockIdx.x;
  return {block / (row_blocks * col_blocks), block / col_blocks % row_blocks, block % col_blocks};
}

// Where block b's scale goes in the transposed copy's scales: W^T's block (cb, rb) of the plane,
// offset_t / 128 block columns in.
__device__ __forceinline__ int64_t transposed_scale_index(const TransposedTarget& t, const BlockCoords& b,
                                                          int64_t col_blocks) {
  return (b.plane * col_blocks + b.cb) * (t.ld_t / kBlock) + t.offset_t / kBlock + b.rb;
}

// The scale exponent of a CTA's block from each thread's partial amax (every thread gets it): a
// warp's shuffles, then the warps' maxima through warp_max (shared, kBlockThreads / 32 floats).
__device__ __forceinline__ int cta_scale_exponent(float amax, float* warp_max) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int w = 1; w < kBlockThreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
  return fp8_scale_exponent(amax);
}

__global__ void __launch_bounds__(kBlockThreads)
    quantize_blocks_kernel(const __nv_bfloat16* __restrict__ x, int64_t rows, int64_t cols, int64_t row_blocks,
                           int64_t col_blocks, uint8_t* __restrict__ codes, float* __restrict__ scales,
                           TransposedTarget t) {
  __shared__ float warp_max[kBlockThreads / 32];
  // The block's codes for the transposed copy: [row][column], rows padded to 132 bytes so that
  // reading a column (consecutive rows in consecutive threads) hits 32 banks.
  constexpr int kTileStride = kBlock + 4;
  __shared__ uint8_t tile[kBlock * kTileStride];
  const BlockCoords b = block_coords(row_blocks, col_blocks);
  const int64_t plane = b.plane, rb = b.rb, cb = b.cb;
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
  const int e = cta_scale_exponent(amax, warp_max);
  if (threadIdx.x == 0 && scales != nullptr) scales[blockIdx.x] = ldexpf(1.0f, e);
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
  if (threadIdx.x == 0) t.scales_t[transposed_scale_index(t, b, col_blocks)] = ldexpf(1.0f, e);
  for (int j = threadIdx.x / kBlock; j < kBlock; j += kRowStep) {
    if (j < c_here && k < r_here)
      t.codes_t[(plane * cols + cb * kBlock + j) * cols_t + t.offset_t + rb * kBlock + k] = tile[k * kTileStride + j];
  }
}

// The fast form of quantize_blocks_kernel, for cols % 8 == 0 with x 16-byte and codes 8-byte
// aligned, and with a transposed copy rows % 4 == 0 and codes_t 4-byte aligned (the other forms
// take quantize_blocks_kernel). The same block per CTA and the same arithmetic, so the same bits;
// thread t takes the 8 columns (t % 16) * 8, ... of rows t / 16, t / 16 + 16, ... of the block
// (one 16-byte load and one 8-byte store a row: a warp reads two whole block rows), 8 rows' loads
// in flight. The transposed copy leaves through a shared tile of 32-bit words, word w of row r
// stored at column w ^ (r / 4) (XOR swizzle): lane q of a warp reads word jw of rows 4q .. 4q + 3
// from 32 different banks, transposes the 4 x 4 bytes in registers, and writes 4 bytes of each of
// W^T's rows 4jw .. 4jw + 3 (a warp, 128 consecutive bytes of a row). Session 25 measured
// quantize_blocks_kernel, 2-byte loads and 1-byte stores, at ~1.2 TB/s on an H200.
constexpr int kVecRowStep = kBlockThreads / kLanesPerBlock;  // 16 rows a pass
constexpr int kVecRows = kBlock / kVecRowStep;               // 8 rows a thread
constexpr int kTileWords = kBlock / 4;                       // 32-bit words in a block row

__device__ __forceinline__ int swizzled_word(int row, int word) { return row * kTileWords + (word ^ (row / 4 % kTileWords)); }

__global__ void __launch_bounds__(kBlockThreads)
    quantize_blocks_vec_kernel(const __nv_bfloat16* __restrict__ x, int64_t rows, int64_t cols, int64_t row_blocks,
                               int64_t col_blocks, uint8_t* __restrict__ codes, float* __restrict__ scales,
                               TransposedTarget t) {
  __shared__ float warp_max[kBlockThreads / 32];
  __shared__ uint32_t tile[kBlock * kTileWords];
  const BlockCoords b = block_coords(row_blocks, col_blocks);
  const int64_t plane = b.plane, rb = b.rb, cb = b.cb;
  const int sub = threadIdx.x % kLanesPerBlock, r = threadIdx.x / kLanesPerBlock;
  const int64_t r0 = rb * kBlock + r, c = cb * kBlock + sub * kVecCols;
  const bool in_cols = c < cols;  // all 8 columns or none (cols % 8 == 0)
  const int64_t left = rows - r0 > 0 ? (rows - r0 + kVecRowStep - 1) / kVecRowStep : 0;
  const int rows_here = int(left < kVecRows ? left : kVecRows);
  const int64_t first = (plane * rows + r0) * cols + c;  // element (r0, c) of the plane
  uint4 raw[kVecRows];
#pragma unroll
  for (int i = 0; i < kVecRows; ++i)
    raw[i] = in_cols && i < rows_here ? __ldg(reinterpret_cast<const uint4*>(x + first + int64_t(i) * kVecRowStep * cols))
                                      : make_uint4(0, 0, 0, 0);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kVecRows; ++i) amax = bf16x8_amax(raw[i], amax);
  const int e = cta_scale_exponent(amax, warp_max);
  if (threadIdx.x == 0 && scales != nullptr) scales[blockIdx.x] = ldexpf(1.0f, e);
  const float inv = ldexpf(1.0f, -e);
#pragma unroll
  for (int i = 0; i < kVecRows; ++i) {
    const uint2 packed = bf16x8_codes(raw[i], inv);
    if (in_cols && i < rows_here && codes != nullptr)
      *reinterpret_cast<uint2*>(codes + first + int64_t(i) * kVecRowStep * cols) = packed;
    if (t.codes_t != nullptr) {
      const int row = r + i * kVecRowStep;
      tile[swizzled_word(row, 2 * sub)] = packed.x;
      tile[swizzled_word(row, 2 * sub + 1)] = packed.y;
    }
  }
  if (t.codes_t == nullptr) return;
  __syncthreads();
  const int64_t r_here = rows - rb * kBlock, c_here = cols - cb * kBlock;  // r_here % 4 == 0, c_here % 8 == 0
  const int q = threadIdx.x % 32;
  if (threadIdx.x == 0) t.scales_t[transposed_scale_index(t, b, col_blocks)] = ldexpf(1.0f, e);
  for (int jw = threadIdx.x / 32; jw < kTileWords; jw += kBlockThreads / 32) {
    if (4 * jw >= c_here || 4 * q >= r_here) continue;
    uint32_t a[4];  // a[m] byte n: the code of block row 4q + m, column 4jw + n
#pragma unroll
    for (int m = 0; m < 4; ++m) a[m] = tile[swizzled_word(4 * q + m, jw)];
    const uint32_t t01 = __byte_perm(a[0], a[1], 0x5140), t23 = __byte_perm(a[2], a[3], 0x5140);
    const uint32_t u01 = __byte_perm(a[0], a[1], 0x7362), u23 = __byte_perm(a[2], a[3], 0x7362);
    const uint32_t out[4] = {__byte_perm(t01, t23, 0x5410), __byte_perm(t01, t23, 0x7632),
                             __byte_perm(u01, u23, 0x5410), __byte_perm(u01, u23, 0x7632)};
#pragma unroll
    for (int n = 0; n < 4; ++n)  // W^T's row 4jw + n (the block's column), bytes 4q .. 4q + 3
      *reinterpret_cast<uint32_t*>(t.codes_t + (plane * cols + cb * kBlock + 4 * jw + n) * t.ld_t + t.offset_t +
                                   rb * kBlock + 4 * q) = out[n];
  }
}

// quantize_blocks_kernel or, where its conditions hold, quantize_blocks_vec_kernel. The callers
// have checked the shapes, and t's ld_t and offset_t (multiples of 128, which keeps codes_t's
// 4-byte stores aligned).
void launch_quantize_blocks(const void* x, int64_t rows, int64_t cols, int64_t row_blocks, int64_t col_blocks,
                            int64_t blocks, uint8_t* codes, float* scales, TransposedTarget t, cudaStream_t stream) {
  const auto aligned = [](const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; };
  const bool vec = cols % kVecCols == 0 && aligned(x, 16) && (codes == nullptr || aligned(codes, 8)) &&
                   (t.codes_t == nullptr || (rows % 4 == 0 && aligned(t.codes_t, 4)));
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  if (vec)
    quantize_blocks_vec_kernel<<<unsigned(blocks), kBlockThreads, 0, stream>>>(xb, rows, cols, row_blocks, col_blocks,
                                                                               codes, scales, t);
  else
    quantize_blocks_kernel<<<unsigned(blocks), kBlockThreads, 0, stream>>>(xb, rows, cols, row_blocks, col_blocks,
                                                                           codes, scales, t);
}

// One 128 x 128 tile of x per CTA of 256 threads, quantized per column (128 rows x 1 column a
// block) and written transposed: thread t takes column t % 128 of rows t / 128, t / 128 + 2, ...
// of the tile (a warp reads 32 consecutive columns), the two threads of a column meet in shared
// memory for its amax, and the codes leave through a padded shared tile, a row of x^T (a column of
// the tile) per 128 consecutive threads.
__global__ void __launch_bounds__(kBlockThreads)
    quantize_columns_transposed_kernel(const __nv_bfloat16* __restrict__ x, int64_t rows, int64_t cols,
                                       int64_t col_blocks, uint8_t* __restrict__ codes_t, float* __restrict__ scales_t,
                                       int64_t ld_t, const int32_t* __restrict__ rows_used) {
  constexpr int kTileStride = kBlock + 4;
  __shared__ uint8_t tile[kBlock * kTileStride];
  __shared__ float column_max[kRowStep][kBlock];
  const int64_t rb = blockIdx.x / col_blocks, cb = blockIdx.x % col_blocks;
  const int64_t limit = rows_used == nullptr ? rows : min(rows, max(int64_t{0}, int64_t{*rows_used}));
  if (rb * kBlock >= limit) return;  // (the whole CTA: rows_used is a multiple of 128)
  const int j = threadIdx.x % kBlock, half = threadIdx.x / kBlock;
  const int64_t r0 = rb * kBlock + half, c = cb * kBlock + j;
  const bool in_cols = c < cols;
  const int64_t left = limit - r0 > 0 ? (limit - r0 + kRowStep - 1) / kRowStep : 0;
  const int rows_here = int(left < kPerThread ? left : kPerThread);
  float v[kPerThread];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    v[i] = in_cols && i < rows_here ? __bfloat162float(x[(r0 + int64_t(i) * kRowStep) * cols + c]) : 0.0f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
  column_max[half][j] = amax;
  __syncthreads();
#pragma unroll
  for (int h = 0; h < kRowStep; ++h) amax = fmaxf(amax, column_max[h][j]);
  const int e = fp8_scale_exponent(amax);
  if (half == 0 && in_cols) scales_t[rb * cols + c] = ldexpf(1.0f, e);
  const float inv = ldexpf(1.0f, -e);
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) tile[(half + i * kRowStep) * kTileStride + j] = fp8_code(v[i], inv);
  __syncthreads();
  // x^T's rows c = cb * 128 + jj: byte k of each is the tile's row k (consecutive threads,
  // consecutive bytes of a row).
  const int64_t r_here = limit - rb * kBlock, c_here = cols - cb * kBlock;
  for (int jj = half; jj < kBlock; jj += kRowStep) {
    if (jj < c_here && j < r_here) codes_t[(cb * kBlock + jj) * ld_t + rb * kBlock + j] = tile[j * kTileStride + jj];
  }
}

}  // namespace

namespace detail {
void preload_fp8_gemms();  // fp8_experts.cu: the block-scaled GEMM's three forms
}  // namespace detail

void preload_fp8_kernels() {
  cudaFuncAttributes attr;
  for (const void* kernel : {reinterpret_cast<const void*>(quantize_rows_kernel),
                             reinterpret_cast<const void*>(quantize_rows_vec_kernel),
                             reinterpret_cast<const void*>(quantize_blocks_kernel),
                             reinterpret_cast<const void*>(quantize_blocks_vec_kernel),
                             reinterpret_cast<const void*>(quantize_columns_transposed_kernel)}) {
    const cudaError_t e = cudaFuncGetAttributes(&attr, kernel);
    if (e != cudaSuccess) throw std::runtime_error(std::string("mok: load the fp8 quantizers: ") + cudaGetErrorString(e));
  }
  detail::preload_fp8_gemms();
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
  launch_quantize_blocks(x, rows, cols, row_blocks, col_blocks, blocks, codes, scales, TransposedTarget{}, stream);
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
  launch_quantize_blocks(x, rows, cols, row_blocks, col_blocks, blocks, codes, scales,
                         TransposedTarget{codes_t, scales_t, ld_t, offset_t}, stream);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(what + "launch: " + cudaGetErrorString(e));
}

void quantize_columns_e4m3_transposed(const void* x, int64_t rows, int64_t cols, uint8_t* codes_t, float* scales_t,
                                      int64_t ld_t, const int32_t* rows_used, cudaStream_t stream) {
  const std::string what = "mok quantize_columns_e4m3_transposed: ";
  if (rows < 0 || cols < 0)
    throw std::invalid_argument(what + "rows and cols must be >= 0, got " + std::to_string(rows) + " x " +
                                std::to_string(cols));
  if (ld_t < rows || ld_t % 16 != 0)
    throw std::invalid_argument(what + "the transpose's row length " + std::to_string(ld_t) +
                                " must be a multiple of 16 holding the " + std::to_string(rows) + " rows");
  const int64_t row_blocks = (rows + kBlock - 1) / kBlock, col_blocks = (cols + kBlock - 1) / kBlock;
  const int64_t blocks = row_blocks * col_blocks;
  if (blocks == 0) return;
  if (x == nullptr || codes_t == nullptr || scales_t == nullptr)
    throw std::invalid_argument(what + "x, codes_t and scales_t must not be null");
  if (blocks > int64_t{0x7fffffff}) throw std::invalid_argument(what + std::to_string(blocks) + " blocks are too many");
  quantize_columns_transposed_kernel<<<unsigned(blocks), kBlockThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), rows, cols, col_blocks, codes_t, scales_t, ld_t, rows_used);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(what + "launch: " + cudaGetErrorString(e));
}

void quantize_dgrad_weights(const void* w_gate, const void* w_up, const void* w_down, int64_t experts, int64_t hidden,
                            int64_t intermediate, uint8_t* w_down_t, float* w_down_t_scales, uint8_t* w_gate_up_t,
                            float* w_gate_up_t_scales, cudaStream_t stream) {
  const int64_t El = experts, H = hidden, I = intermediate;
  quantize_blocks_e4m3_transposed(w_down, El, H, I, nullptr, nullptr, w_down_t, w_down_t_scales, H, 0, stream);
  quantize_blocks_e4m3_transposed(w_gate, El, I, H, nullptr, nullptr, w_gate_up_t, w_gate_up_t_scales, 2 * I, 0, stream);
  quantize_blocks_e4m3_transposed(w_up, El, I, H, nullptr, nullptr, w_gate_up_t, w_gate_up_t_scales, 2 * I, I, stream);
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
    // CTAs of one full wave, asked of the driver once per device.
    static host_util::PerDevice wave_cache;
    const int wave = host_util::per_device(wave_cache, [&] {
      int device = 0, sms = 0, per_sm = 0;
      if (cudaGetDevice(&device) != cudaSuccess ||
          cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, quantize_rows_vec_kernel, kVecThreads, 0) != cudaSuccess)
        throw std::runtime_error(std::string("mok ") + name + ": cannot read the device's SM count and occupancy");
      return sms * std::max(1, per_sm);
    });
    // One wave of as many CTAs as fit (a second, partial wave would double the time), fewer for few rows.
    const int64_t needed = (rows + kVecThreads / 32 - 1) / (kVecThreads / 32);
    const unsigned grid = unsigned(std::max<int64_t>(1, std::min<int64_t>(needed, int64_t{wave})));
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
