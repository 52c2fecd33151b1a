// Block-scaled e4m3 (fp8), as the GPU path is to store it: the CPU oracle of its rounding points.
//
// Format: e4m3 as Hopper's tensor cores read it (1 sign, 4 exponent bits with bias 7, 3 mantissa
// bits; no infinities; 0x7f and 0xff are NaN; the largest finite value is 448). Conversion rounds
// to nearest, ties to even, and saturates finite values beyond 448 to +-448 (PTX
// cvt.rn.satfinite.e4m3x2.f32).
//
// Scales: one per block, 1 x 128 for activations (a row's 128 columns: what one k-block of the
// GEMM reads) and 128 x 128 for weights. A scale is the smallest power of two 2^e with
// amax / 2^e <= 448, e in [-126, 127]. Power-of-two scales (the choice of the published system's
// MXFP8, whose scales are 8-bit exponents) make scaling and unscaling exact in fp32: the only
// rounding is the e4m3 conversion itself, so a GPU kernel can reproduce the codes and scales bit
// for bit. (An fp32 scale amax / 448 uses the range up to one more bit, but its reciprocal is
// inexact, and CPU and GPU would have to agree on how it is applied.)
//
// The block-scaled GEMM (gemm_nt) promotes each k-block's product into an fp32 accumulator with
// its two scales, in k order, as the GPU does after each k-block's wgmma. Within a k-block the
// reference sum is exact where the tensor cores' is not, so GPU results match it within a
// tolerance, not bitwise.
#pragma once

#include <cstdint>
#include <vector>

namespace mok::fp8 {

inline constexpr float kMax = 448.0f;      // the largest finite e4m3 value
inline constexpr int64_t kBlock = 128;     // scale block edge (1 x 128 activations, 128 x 128 weights)
inline constexpr uint8_t kNaN = 0x7f;      // the code a NaN converts to

// float -> e4m3 (round to nearest even, saturating); NaN -> kNaN.
uint8_t encode(float v);
// e4m3 -> float (exact).
float decode(uint8_t code);

// The scale of a block whose largest magnitude is amax (finite, >= 0): the smallest 2^e with
// amax <= 448 * 2^e, e clamped to [-126, 127]; 1 for amax == 0.
float block_scale(float amax);

// A [rows, cols] matrix as e4m3 codes with one scale per block of block_rows x block_cols (the
// last blocks of a row or column may be partial).
struct Quantized {
  int64_t rows = 0, cols = 0;
  int64_t block_rows = 1, block_cols = kBlock;
  std::vector<uint8_t> codes;  // [rows, cols], row-major
  std::vector<float> scales;   // [row blocks, column blocks], row-major

  int64_t row_blocks() const { return (rows + block_rows - 1) / block_rows; }
  int64_t col_blocks() const { return (cols + block_cols - 1) / block_cols; }
  float scale(int64_t r, int64_t c) const { return scales[(r / block_rows) * col_blocks() + c / block_cols]; }
  // The value the code stands for: decode(code) * scale (exact).
  float value(int64_t r, int64_t c) const { return decode(codes[r * cols + c]) * scale(r, c); }
};

// Quantizes x [rows, cols] (finite values; throws InvalidArgument naming the first that is not).
Quantized quantize(const float* x, int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols);
inline Quantized quantize_activations(const float* x, int64_t rows, int64_t cols) {
  return quantize(x, rows, cols, 1, kBlock);
}
inline Quantized quantize_weights(const float* w, int64_t rows, int64_t cols) {
  return quantize(w, rows, cols, kBlock, kBlock);
}

// q^T: codes [cols, rows] and each block's scale at its transposed place. A block's scale
// depends only on the set of values in it, so quantize(x^T) with transposed blocks is transpose(
// quantize(x)) exactly: the backward's W^T operands are the forward's weight codes, moved.
Quantized transpose(const Quantized& q);
// [a | b]: the columns of b after a's (the same rows and block shape; a's columns whole blocks).
Quantized concat_cols(const Quantized& a, const Quantized& b);

// c [a.rows, b.rows] = a b^T of two quantized matrices with the same cols, blocked along k by
// kBlock (a's and b's column blocks must both be kBlock wide): for each k-block in order,
// acc = acc + (float(exact sum of the block's code products) * a's scale) * b's scale, in fp32.
void gemm_nt(const Quantized& a, const Quantized& b, float* c);

}  // namespace mok::fp8
