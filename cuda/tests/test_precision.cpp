// The precision template parameter of the expert GEMMs, at fp8: the persistent grouped GEMM with
// e4m3 operands (fp8_gemm.h) against a CPU product of the same values, on fresh random inputs,
// with an empty expert, a row count and a K and N that are not multiples of the tile, outputs
// poisoned first, and reruns compared bit for bit; and the activations' block-scaled e4m3
// quantization (mok/cuda/fp8.h) against the CPU oracle, bit for bit. Runs only where a GPU is
// (tools/gpu.sh).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <optional>
#include <string>
#include <functional>
#include <vector>

#include "fp8_gemm.h"
#include "gpu_test_util.h"
#include "mok/core/bf16.h"
#include "mok/core/fp8.h"
#include "mok/core/reference.h"
#include "mok/core/compare.h"
#include "mok/core/problem.h"
#include "mok/cuda/fp8.h"

namespace mok {
namespace {

using test::DeviceBuffer;
using test::from_bits;

// A random code of magnitude in [1/4, 4): exponents 5..8, any mantissa and sign.
uint8_t random_e4m3(Rng& rng) {
  const uint64_t r = rng.next();
  return static_cast<uint8_t>(((r & 1) << 7) | ((5 + (r >> 1) % 4) << 3) | ((r >> 8) & 7));
}

TEST(Precision, Fp8GroupedGemmMatchesTheCpuAndIsDeterministic) {
  if (test::device_count() < 1) GTEST_SKIP() << "no GPU";
  const int k = 320, n = 264;                       // neither a multiple of the 128 x 256 tile
  const std::vector<int> real_rows{130, 0, 300};    // an empty expert, rows not a multiple of 128
  std::vector<int32_t> offsets{0};
  for (int r : real_rows) offsets.push_back(offsets.back() + (r + 127) / 128 * 128);
  const int experts = static_cast<int>(real_rows.size());
  const int used = offsets.back(), capacity = used + 128;  // rows past the last expert stay untouched

  Rng rng(0xf8f8f8ull);
  std::vector<uint8_t> a(size_t(capacity) * k, 0), b(size_t(experts) * n * k);
  for (int e = 0; e < experts; ++e)
    for (int r = offsets[e]; r < offsets[e] + real_rows[e]; ++r)
      for (int c = 0; c < k; ++c) a[size_t(r) * k + c] = random_e4m3(rng);
  for (uint8_t& v : b) v = random_e4m3(rng);

  // The oracle: fp64 sums of the same products, per expert segment.
  std::vector<double> ref(size_t(used) * n, 0.0);
  for (int e = 0; e < experts; ++e)
    for (int r = offsets[e]; r < offsets[e + 1]; ++r)
      for (int j = 0; j < n; ++j) {
        double s = 0.0;
        for (int c = 0; c < k; ++c) s += double(fp8::decode(a[size_t(r) * k + c])) * fp8::decode(b[(size_t(e) * n + j) * k + c]);
        ref[size_t(r) * n + j] = s;
      }

  DeviceBuffer<uint8_t> da(a.size()), db(b.size());
  DeviceBuffer<uint16_t> dout(size_t(capacity) * n);
  DeviceBuffer<int32_t> doff(offsets.size()), dstatus(1);
  ASSERT_NE(da.ptr, nullptr);
  da.upload(a);
  db.upload(b);
  doff.upload(offsets);
  CUDA_OK(cudaMemset(dstatus.ptr, 0, sizeof(int32_t)));

  std::vector<uint16_t> first;
  for (int run = 0; run < 3; ++run) {
    dout.poison();
    test::fp8_grouped_gemm(da.ptr, db.ptr, dout.ptr, doff.ptr, capacity, k, n, experts, dstatus.ptr, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> bits = dout.download();
    if (run == 0) {
      const std::vector<float> out = from_bits(bits);
      double err = 0.0, norm = 0.0;
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_TRUE(std::isfinite(out[i])) << "row " << i / n << " column " << i % n;
        err += (out[i] - ref[i]) * (out[i] - ref[i]);
        norm += ref[i] * ref[i];
      }
      const double rel = std::sqrt(err / norm);
      std::printf("[ fp8 ] rel error %.2e\n", rel);
      EXPECT_LT(rel, 4e-3);  // bf16 rounding of the output; the products and fp32 sums are near exact
      for (int e = 0; e < experts; ++e)  // a segment's padding rows (zero in a) come out zero
        for (int r = offsets[e] + real_rows[e]; r < offsets[e + 1]; ++r)
          for (int j = 0; j < n; ++j) ASSERT_EQ(out[size_t(r) * n + j], 0.0f) << "padding row " << r;
      for (int r = used; r < capacity; ++r)  // past the last expert: never written
        for (int j = 0; j < n; ++j) ASSERT_EQ(bits[size_t(r) * n + j], 0xffff) << "row " << r;
      first = bits;
    } else {
      ASSERT_EQ(bits, first) << "run " << run << " differs from run 0";
    }
  }
  EXPECT_EQ(dstatus.download()[0], 0);
}

TEST(Precision, Fp8BlockScaledGroupedGemmMatchesTheCpuOracle) {
  if (test::device_count() < 1) GTEST_SKIP() << "no GPU";
  // k and n past a whole number of 128-blocks (partial last scale blocks), an empty expert, rows
  // not a multiple of 128; activations whose magnitude changes along k (each k-block its own
  // scale) and from row to row, weights per expert and block.
  const int k = 128 * 3 + 64, n = 128 * 2 + 40;
  const std::vector<int> real_rows{130, 0, 300};
  std::vector<int32_t> offsets{0};
  for (int r : real_rows) offsets.push_back(offsets.back() + (r + 127) / 128 * 128);
  const int experts = static_cast<int>(real_rows.size());
  const int used = offsets.back(), capacity = used + 128;
  const int kbs = (k + 127) / 128, nbs = (n + 127) / 128;

  Rng rng(0xf8c9ull);
  std::vector<float> x(size_t(capacity) * k, 0.0f), w(size_t(experts) * n * k);
  for (int e = 0; e < experts; ++e)
    for (int r = offsets[e]; r < offsets[e] + real_rows[e]; ++r)
      for (int c = 0; c < k; ++c)
        x[size_t(r) * k + c] = round_to_bf16(std::ldexp(float(rng.normal()), (r % 7) - 3 + 2 * (c / 128)));
  for (size_t i = 0; i < w.size(); ++i) w[i] = round_to_bf16(std::ldexp(float(rng.normal()), -6 + int(i % 5)));
  // The oracle: the quantized operands and their block-scaled product, per expert segment.
  const fp8::Quantized xq = fp8::quantize_activations(x.data(), capacity, k);
  std::vector<uint8_t> wcodes;
  std::vector<float> wscales;  // [experts, nbs, kbs]
  std::vector<float> ref(size_t(used) * n, 0.0f);
  for (int e = 0; e < experts; ++e) {
    const fp8::Quantized wq = fp8::quantize_weights(w.data() + size_t(e) * n * k, n, k);
    wcodes.insert(wcodes.end(), wq.codes.begin(), wq.codes.end());
    wscales.insert(wscales.end(), wq.scales.begin(), wq.scales.end());
    const int rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    fp8::Quantized seg = xq;  // the segment's rows of x, with their scales
    seg.rows = rows;
    seg.codes.assign(xq.codes.begin() + size_t(offsets[e]) * k, xq.codes.begin() + size_t(offsets[e + 1]) * k);
    seg.scales.assign(xq.scales.begin() + size_t(offsets[e]) * kbs, xq.scales.begin() + size_t(offsets[e + 1]) * kbs);
    fp8::gemm_nt(seg, wq, ref.data() + size_t(offsets[e]) * n);
  }
  std::vector<float> xscales_t(size_t(kbs) * capacity);  // k-block major, as the kernel reads them
  for (int r = 0; r < capacity; ++r)
    for (int b = 0; b < kbs; ++b) xscales_t[size_t(b) * capacity + r] = xq.scales[size_t(r) * kbs + b];
  ASSERT_EQ(int(wscales.size()), experts * nbs * kbs);

  DeviceBuffer<uint8_t> da(xq.codes.size()), db(wcodes.size());
  DeviceBuffer<float> dsa(xscales_t.size()), dsb(wscales.size());
  DeviceBuffer<uint16_t> dout(size_t(capacity) * n);
  DeviceBuffer<int32_t> doff(offsets.size()), dstatus(1);
  ASSERT_NE(da.ptr, nullptr);
  da.upload(xq.codes);
  db.upload(wcodes);
  dsa.upload(xscales_t);
  dsb.upload(wscales);
  doff.upload(offsets);
  CUDA_OK(cudaMemset(dstatus.ptr, 0, sizeof(int32_t)));
  std::vector<uint16_t> first;
  for (int run = 0; run < 3; ++run) {
    dout.poison();
    test::fp8_scaled_grouped_gemm(da.ptr, dsa.ptr, db.ptr, dsb.ptr, dout.ptr, doff.ptr, capacity, k, n, experts,
                                  dstatus.ptr, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> bits = dout.download();
    if (run == 0) {
      const std::vector<float> out = from_bits(bits);
      double err = 0.0, norm = 0.0;
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_TRUE(std::isfinite(out[i])) << "row " << i / n << " column " << i % n;
        err += double(out[i] - ref[i]) * (out[i] - ref[i]);
        norm += double(ref[i]) * ref[i];
      }
      const double rel = std::sqrt(err / norm);
      std::printf("[ fp8 block-scaled ] rel error %.2e against the oracle\n", rel);
      EXPECT_LT(rel, 4e-3);  // bf16 rounding of the output; within a k-block the sums are near exact
      for (int r = used; r < capacity; ++r)  // past the last expert: never written
        for (int j = 0; j < n; ++j) ASSERT_EQ(bits[size_t(r) * n + j], 0xffff) << "row " << r;
      first = bits;
    } else {
      ASSERT_EQ(bits, first) << "run " << run << " differs from run 0";
    }
  }
  EXPECT_EQ(dstatus.download()[0], 0);
  EXPECT_THROW(test::fp8_scaled_grouped_gemm(da.ptr, nullptr, db.ptr, dsb.ptr, dout.ptr, doff.ptr, capacity, k, n,
                                             experts, dstatus.ptr, nullptr),
               std::invalid_argument);
}

TEST(Precision, Fp8QuantizedActivationsEqualTheCpuOracleBitForBit) {
  if (test::device_count() < 1) GTEST_SKIP() << "no GPU";
  // Rows of magnitudes from 2^-40 to 2^40 (tiny blocks lose values to e4m3's subnormals; huge ones
  // take large scales), an all-zero row, a row of one large value among small ones, exact 448s
  // and negative zeros; 7168 + 80 columns, so the last block of a row is partial. Three forms of
  // the quantizer: the vector one (columns a multiple of 8, x 16-byte aligned), and the scalar one
  // for 7168 + 77 columns and for an x one element off 16-byte alignment.
  struct Case {
    int64_t cols, x_offset;
  };
  for (const Case c : {Case{7168 + 80, 0}, Case{7168 + 77, 0}, Case{7168 + 80, 1}}) {
    SCOPED_TRACE("cols " + std::to_string(c.cols) + ", x offset " + std::to_string(c.x_offset));
    const int64_t rows = 83, cols = c.cols;
    Rng rng(0xf8a5ull + uint64_t(cols));
    std::vector<float> x = test::random_bf16(rng, rows * cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t col = 0; col < cols; ++col) {
        float& v = x[size_t(r * cols + col)];
        v = r == 3 ? 0.0f : round_to_bf16(std::ldexp(v, int(r % 81) - 40));
      }
    x[size_t(5 * cols + 17)] = 10240.0f;  // exact in bf16 (1.25 * 2^13), as every input must be
    x[size_t(6 * cols + 1)] = 448.0f;
    x[size_t(6 * cols + 2)] = -448.0f;
    x[size_t(7 * cols + 9)] = -0.0f;
    const fp8::Quantized want = fp8::quantize_activations(x.data(), rows, cols);
    const int64_t col_blocks = want.col_blocks();

    std::vector<float> padded(size_t(c.x_offset), 0.0f);
    padded.insert(padded.end(), x.begin(), x.end());
    DeviceBuffer<uint16_t> dx(padded.size());
    DeviceBuffer<uint8_t> dcodes(want.codes.size());
    DeviceBuffer<float> dscales(want.scales.size());
    DeviceBuffer<int32_t> drows_used(1);
    ASSERT_NE(dx.ptr, nullptr);
    ASSERT_NE(drows_used.ptr, nullptr);
    dx.upload(test::to_bits(padded));
    const uint16_t* xp = dx.ptr + c.x_offset;
    for (int run = 0; run < 2; ++run) {
      dcodes.poison(0xaa);
      dscales.poison();
      cuda::quantize_rows_e4m3(xp, rows, cols, dcodes.ptr, dscales.ptr, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint8_t> codes = dcodes.download();
      const std::vector<float> scales = dscales.download();
      for (size_t i = 0; i < want.scales.size(); ++i)
        ASSERT_EQ(std::memcmp(&scales[i], &want.scales[i], sizeof(float)), 0)
            << "scale of row " << i / col_blocks << " block " << i % col_blocks << ": " << scales[i] << " against "
            << want.scales[i];
      for (size_t i = 0; i < want.codes.size(); ++i)
        ASSERT_EQ(codes[i], want.codes[i]) << "row " << i / cols << " column " << i % cols << " (x " << x[i] << ")";
    }
    // k-major scales with rows_used: the first 50 rows as above (scales transposed), the rest untouched.
    const int32_t used = 50;
    drows_used.upload(std::vector<int32_t>{used});
    dcodes.poison(0xaa);
    dscales.poison();
    cuda::quantize_rows_e4m3_k_major(xp, rows, cols, dcodes.ptr, dscales.ptr, drows_used.ptr, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> codes = dcodes.download();
    const std::vector<float> scales = dscales.download();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t cb = 0; cb < col_blocks; ++cb) {
        const float got = scales[size_t(cb * rows + r)];
        if (r < used)
          ASSERT_EQ(std::memcmp(&got, &want.scales[size_t(r * col_blocks + cb)], sizeof(float)), 0)
              << "k-major scale of row " << r << " block " << cb;
        else
          ASSERT_TRUE(std::isnan(got)) << "k-major scale of unused row " << r << " block " << cb << " written";
      }
      for (int64_t col = 0; col < cols; ++col)
        ASSERT_EQ(codes[size_t(r * cols + col)], r < used ? want.codes[size_t(r * cols + col)] : uint8_t{0xaa})
            << "k-major code of row " << r << " column " << col;
    }
  }
  DeviceBuffer<uint16_t> dx(16);
  DeviceBuffer<uint8_t> dcodes(16);
  DeviceBuffer<float> dscales(1);
  EXPECT_THROW(cuda::quantize_rows_e4m3(dx.ptr, -1, 16, dcodes.ptr, dscales.ptr, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::quantize_rows_e4m3(nullptr, 1, 16, dcodes.ptr, dscales.ptr, nullptr), std::invalid_argument);
}

// The fp8 weight gradients' operands: x quantized per 128 rows x 1 column and written transposed
// (quantize_columns_e4m3_transposed) is fp8::quantize(x, rows, cols, 128, 1) bit for bit, its codes
// transposed into rows of ld_t bytes; 300 rows (a partial last block) and 200 columns (a partial
// last tile); with rows_used = 256 the third block's codes and scales are not written; reruns the
// same bits; bad arguments refused by name.
TEST(Precision, Fp8ColumnQuantizedTransposesEqualTheCpuOracleBitForBit) {
  if (test::device_count() < 1) GTEST_SKIP() << "no GPU";
  const int64_t rows = 300, cols = 200, ld_t = 304, row_blocks = 3;
  Rng rng(0xc01full);
  std::vector<float> x = test::random_bf16(rng, rows * cols);
  for (int64_t r = 0; r < rows; ++r)  // magnitudes that differ by column and by row block
    for (int64_t c = 0; c < cols; ++c) {
      float& v = x[size_t(r * cols + c)];
      v = round_to_bf16(std::ldexp(v, int(c % 23) - 11 + int(r / 128) * 3));
    }
  for (int64_t r = 0; r < 128; ++r) x[size_t(r * cols + 7)] = 0.0f;  // an all-zero block
  const fp8::Quantized want = fp8::quantize(x.data(), rows, cols, 128, 1);
  ASSERT_EQ(int64_t(want.scales.size()), row_blocks * cols);
  DeviceBuffer<uint16_t> dx(x.size());
  DeviceBuffer<uint8_t> dcodes(size_t(cols * ld_t));
  DeviceBuffer<float> dscales(size_t(row_blocks * cols));
  DeviceBuffer<int32_t> dused(1);
  ASSERT_TRUE(dx.ptr && dcodes.ptr && dscales.ptr && dused.ptr);
  dx.upload(test::to_bits(x));
  dused.upload(std::vector<int32_t>{256});
  std::vector<uint8_t> first;
  for (const bool limited : {false, true, false}) {
    dcodes.poison(0xaa);
    dscales.poison();
    cuda::quantize_columns_e4m3_transposed(dx.ptr, rows, cols, dcodes.ptr, dscales.ptr, ld_t,
                                           limited ? dused.ptr : nullptr, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> codes = dcodes.download();
    const std::vector<float> scales = dscales.download();
    const int64_t used = limited ? 256 : rows;
    for (int64_t c = 0; c < cols; ++c) {
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        const float got = scales[size_t(rb * cols + c)];
        if (rb * 128 < used)
          ASSERT_EQ(std::memcmp(&got, &want.scales[size_t(rb * cols + c)], sizeof(float)), 0)
              << "scale of column " << c << " block " << rb << (limited ? " (rows_used)" : "");
        else
          ASSERT_TRUE(std::isnan(got)) << "scale of column " << c << " block " << rb << " past rows_used written";
      }
      for (int64_t r = 0; r < ld_t; ++r)
        ASSERT_EQ(codes[size_t(c * ld_t + r)], r < used ? want.codes[size_t(r * cols + c)] : uint8_t{0xaa})
            << "x^T row " << c << " column " << r << (limited ? " (rows_used)" : "");
    }
    if (!limited && first.empty()) first = codes;
    if (!limited) EXPECT_EQ(codes, first) << "a rerun differs";
  }
  EXPECT_THROW(cuda::quantize_columns_e4m3_transposed(dx.ptr, rows, cols, dcodes.ptr, dscales.ptr, 296, nullptr,
                                                      nullptr),
               std::invalid_argument);  // ld_t below the rows
  EXPECT_THROW(cuda::quantize_columns_e4m3_transposed(dx.ptr, rows, cols, dcodes.ptr, dscales.ptr, 310, nullptr,
                                                      nullptr),
               std::invalid_argument);  // not a multiple of 16
  EXPECT_THROW(cuda::quantize_columns_e4m3_transposed(nullptr, rows, cols, dcodes.ptr, dscales.ptr, ld_t, nullptr,
                                                      nullptr),
               std::invalid_argument);
}

TEST(Precision, Fp8QuantizedWeightsEqualTheCpuOracleBitForBit) {
  if (test::device_count() < 1) GTEST_SKIP() << "no GPU";
  // Both kernel forms (vectorized and general) give the oracle's codes, scales and transposes.
  // Three planes (experts) of 300 x (1024 + 80): partial 128 x 128 blocks at both edges. Each
  // block's magnitudes from 2^-40 to 2^40 by its position; one all-zero block; two blocks of small
  // values (2^-10) whose largest value is placed: 30720 in block 45's last (partial) row (scale
  // 2^7, code 240), 448 and -448 in block 54 (scale 1, the largest codes); a negative zero.
  const int64_t planes = 3, rows = 300, cols = 1024 + 80;
  const int64_t row_blocks = (rows + 127) / 128, col_blocks = (cols + 127) / 128;
  Rng rng(0xf8b7ull);
  std::vector<float> w = test::random_bf16(rng, planes * rows * cols);
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        float& v = w[size_t((p * rows + r) * cols + c)];
        const int64_t block = (p * row_blocks + r / 128) * col_blocks + c / 128;
        const int shift = block == 45 || block == 54 ? -10 : int(block * 7 % 81) - 40;
        v = block == 5 ? 0.0f : round_to_bf16(std::ldexp(v, shift));
      }
  // Plane 1, row 299 (row block 2, partial), column 3: block (1 * 3 + 2) * 9 + 0 = 45.
  w[size_t((1 * rows + 299) * cols + 3)] = 30720.0f;  // 1.875 * 2^14: exact in bf16
  // Plane 2, rows 0 and 1: block (2 * 3 + 0) * 9 + 0 = 54.
  w[size_t((2 * rows + 0) * cols + 1)] = 448.0f;
  w[size_t((2 * rows + 1) * cols + 2)] = -448.0f;
  w[size_t((0 * rows + 7) * cols + 9)] = -0.0f;
  std::vector<uint8_t> want_codes;
  std::vector<float> want_scales;
  for (int64_t p = 0; p < planes; ++p) {
    const fp8::Quantized q = fp8::quantize_weights(w.data() + p * rows * cols, rows, cols);
    want_codes.insert(want_codes.end(), q.codes.begin(), q.codes.end());
    want_scales.insert(want_scales.end(), q.scales.begin(), q.scales.end());
  }
  ASSERT_EQ(int64_t(want_scales.size()), planes * row_blocks * col_blocks);
  ASSERT_EQ(want_scales[45], 128.0f);  // the placed values decide their blocks' scales
  ASSERT_EQ(want_scales[54], 1.0f);

  // Both of the quantizer's forms: the vectorized one (x 16-byte aligned, cols % 8 == 0, rows % 4
  // == 0), and the general one, which x one bf16 into its buffer (2-byte aligned) selects.
  DeviceBuffer<uint16_t> dw_buffer(w.size() + 1);
  DeviceBuffer<uint8_t> dcodes(want_codes.size());
  DeviceBuffer<float> dscales(want_scales.size());
  const int64_t ld_t = 768, blocks_t = ld_t / 128;
  DeviceBuffer<uint8_t> dcodes_t(planes * cols * ld_t);
  DeviceBuffer<float> dscales_t(planes * col_blocks * blocks_t);
  ASSERT_NE(dw_buffer.ptr, nullptr);
  for (const int misalign : {0, 1}) {
    SCOPED_TRACE(misalign ? "the general kernel (x 2-byte aligned)" : "the vectorized kernel");
    const uint16_t* dw = dw_buffer.ptr + misalign;
    const std::vector<uint16_t> bits = test::to_bits(w);
    CUDA_OK(cudaMemcpy(dw_buffer.ptr + misalign, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
    for (int run = 0; run < 2; ++run) {
      dcodes.poison(0xaa);
      dscales.poison();
      cuda::quantize_blocks_e4m3(dw, planes, rows, cols, dcodes.ptr, dscales.ptr, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint8_t> codes = dcodes.download();
      const std::vector<float> scales = dscales.download();
      for (size_t i = 0; i < want_scales.size(); ++i)
        ASSERT_EQ(std::memcmp(&scales[i], &want_scales[i], sizeof(float)), 0)
            << "scale of block " << i << ": " << scales[i] << " against " << want_scales[i];
      for (size_t i = 0; i < want_codes.size(); ++i)
        ASSERT_EQ(codes[i], want_codes[i]) << "plane " << i / (rows * cols) << " row " << i / cols % rows << " column "
                                           << i % cols << " (w " << w[i] << ")";
    }
    EXPECT_THROW(cuda::quantize_blocks_e4m3(dw, planes, -1, cols, dcodes.ptr, dscales.ptr, nullptr),
                 std::invalid_argument);
    EXPECT_THROW(cuda::quantize_blocks_e4m3(dw, planes, rows, cols, nullptr, dscales.ptr, nullptr),
                 std::invalid_argument);

    // The transposes (the fp8 dgrad's W^T operands): each plane's fp8::transpose of the oracle's
    // quantization, at column offsets 0 and 384 of rows of 768 (as [W_gate^T | W_up^T] would sit),
    // nothing written in the columns past a plane's 300 rows; with and without the plain codes.
    dcodes_t.poison(0xaa);
    dscales_t.poison();
    dcodes.poison(0xaa);
    cuda::quantize_blocks_e4m3_transposed(dw, planes, rows, cols, dcodes.ptr, dscales.ptr, dcodes_t.ptr,
                                          dscales_t.ptr, ld_t, 0, nullptr);
    cuda::quantize_blocks_e4m3_transposed(dw, planes, rows, cols, nullptr, nullptr, dcodes_t.ptr, dscales_t.ptr,
                                          ld_t, 384, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(dcodes.download(), want_codes) << "the plain codes beside the transposes";
    const std::vector<uint8_t> codes_t = dcodes_t.download();
    const std::vector<float> scales_t = dscales_t.download();
    for (int64_t p = 0; p < planes; ++p) {
      const fp8::Quantized t = fp8::transpose(fp8::quantize_weights(w.data() + p * rows * cols, rows, cols));
      for (const int64_t offset : {int64_t{0}, int64_t{384}}) {
        for (int64_t c = 0; c < cols; ++c)
          for (int64_t r = 0; r < 384; ++r) {
            const uint8_t got = codes_t[size_t((p * cols + c) * ld_t + offset + r)];
            if (r < rows) {
              ASSERT_EQ(got, t.codes[size_t(c * rows + r)]) << "plane " << p << " W^T row " << c << " column " << r
                                                            << " at offset " << offset;
            } else {
              ASSERT_EQ(got, 0xaa) << "written past the plane's rows: plane " << p << " row " << c << " column " << r;
            }
          }
        for (int64_t cb = 0; cb < col_blocks; ++cb)
          for (int64_t rb = 0; rb < row_blocks; ++rb)
            ASSERT_EQ(scales_t[size_t((p * col_blocks + cb) * blocks_t + offset / 128 + rb)],
                      t.scales[size_t(cb * row_blocks + rb)])
                << "plane " << p << " W^T block " << cb << "," << rb << " at offset " << offset;
      }
    }
    for (const int64_t bad_offset : {int64_t{64}, int64_t{512}})  // not a block; 512 + 300 > 768
      EXPECT_THROW(cuda::quantize_blocks_e4m3_transposed(dw, planes, rows, cols, nullptr, nullptr, dcodes_t.ptr,
                                                         dscales_t.ptr, ld_t, bad_offset, nullptr),
                   std::invalid_argument);
  }
}

// The block quantizer's two forms at the edges of the vectorized form's conditions (with
// transposes rows % 4 == 0; cols % 8 == 0; codes 8-byte aligned) and at small partial blocks:
// every case gives the oracle's codes, scales and transposes, with and without the transposes,
// and writes nothing past them (poisoned margins stay).
TEST(Precision, Fp8QuantizedWeightsAtTheVectorFormsEdgesEqualTheOracle) {
  if (test::device_count() < 1) GTEST_SKIP() << "no GPU";
  struct Case {
    int64_t rows, cols;
    int codes_offset;  // bytes into the codes buffer: 1 makes the codes 1-byte aligned
  };
  const int64_t planes = 2, margin = 64;
  for (const Case c : {Case{302, 1104, 0}, Case{300, 1100, 0}, Case{300, 1104, 1}, Case{4, 8, 0}, Case{132, 136, 0}}) {
    SCOPED_TRACE(std::to_string(c.rows) + " x " + std::to_string(c.cols) + ", codes at +" +
                 std::to_string(c.codes_offset));
    const int64_t rows = c.rows, cols = c.cols, n = planes * rows * cols;
    const int64_t row_blocks = (rows + 127) / 128, col_blocks = (cols + 127) / 128;
    const int64_t ld_t = row_blocks * 128, blocks_t = ld_t / 128;
    Rng rng(uint64_t(rows * 7919 + cols));
    const std::vector<float> w = test::random_bf16(rng, n);
    std::vector<fp8::Quantized> want, want_t;
    for (int64_t p = 0; p < planes; ++p) {
      want.push_back(fp8::quantize_weights(w.data() + p * rows * cols, rows, cols));
      want_t.push_back(fp8::transpose(want.back()));
    }
    DeviceBuffer<uint16_t> dw(static_cast<size_t>(n));
    DeviceBuffer<uint8_t> dcodes(size_t(n + c.codes_offset + margin));
    DeviceBuffer<float> dscales(size_t(planes * row_blocks * col_blocks));
    DeviceBuffer<uint8_t> dcodes_t(size_t(planes * cols * ld_t + margin));
    DeviceBuffer<float> dscales_t(size_t(planes * col_blocks * blocks_t));
    ASSERT_NE(dw.ptr, nullptr);
    dw.upload(test::to_bits(w));
    for (const bool transposes : {false, true}) {
      SCOPED_TRACE(transposes ? "with the transposes" : "the codes alone");
      dcodes.poison(0xaa);
      dscales.poison();
      dcodes_t.poison(0xaa);
      dscales_t.poison();
      if (transposes)
        cuda::quantize_blocks_e4m3_transposed(dw.ptr, planes, rows, cols, dcodes.ptr + c.codes_offset, dscales.ptr,
                                              dcodes_t.ptr, dscales_t.ptr, ld_t, 0, nullptr);
      else
        cuda::quantize_blocks_e4m3(dw.ptr, planes, rows, cols, dcodes.ptr + c.codes_offset, dscales.ptr, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint8_t> codes = dcodes.download(), codes_t = dcodes_t.download();
      const std::vector<float> scales = dscales.download(), scales_t = dscales_t.download();
      for (int64_t i = 0; i < int64_t(codes.size()); ++i) {
        const int64_t at = i - c.codes_offset, p = at / (rows * cols);
        if (at < 0 || at >= n)
          ASSERT_EQ(codes[size_t(i)], 0xaa) << "written outside the codes at byte " << i;
        else
          ASSERT_EQ(codes[size_t(i)], want[size_t(p)].codes[size_t(at % (rows * cols))]) << "code " << at;
      }
      for (int64_t p = 0; p < planes; ++p)
        for (int64_t b = 0; b < row_blocks * col_blocks; ++b)
          ASSERT_EQ(scales[size_t(p * row_blocks * col_blocks + b)], want[size_t(p)].scales[size_t(b)])
              << "plane " << p << " block " << b;
      if (!transposes) {
        for (const uint8_t byte : codes_t) ASSERT_EQ(byte, 0xaa) << "transposes written without being asked";
        continue;
      }
      for (int64_t i = 0; i < int64_t(codes_t.size()); ++i) {
        const int64_t p = i / (cols * ld_t), row = i / ld_t % cols, col = i % ld_t;
        if (p >= planes || col >= rows)
          ASSERT_EQ(codes_t[size_t(i)], 0xaa) << "written past the plane's rows: byte " << i;
        else
          ASSERT_EQ(codes_t[size_t(i)], want_t[size_t(p)].codes[size_t(row * rows + col)])
              << "plane " << p << " W^T row " << row << " column " << col;
      }
      for (int64_t p = 0; p < planes; ++p)
        for (int64_t cb = 0; cb < col_blocks; ++cb)
          for (int64_t rb = 0; rb < row_blocks; ++rb)
            ASSERT_EQ(scales_t[size_t((p * col_blocks + cb) * blocks_t + rb)],
                      want_t[size_t(p)].scales[size_t(cb * row_blocks + rb)])
                << "plane " << p << " W^T block " << cb << "," << rb;
    }
  }
}

// The experts' fp8 forward (experts_forward_fp8) against its CPU oracle (reference.h:
// experts_forward_fp8) on fresh random bf16 inputs quantized on the GPU: g|u, h and y within a
// tolerance (the tensor cores' sum within a k-block is not the oracle's exact one), h_codes and
// h_scales the CPU quantization of the GPU's own h bit for bit, rows past the experts untouched,
// five reruns, a run on 3 SMs and one without clusters (MOK_FP8_CLUSTER=off) bit for bit.
// The fp8 kernels' switches (fp8_experts.cu: MOK_FP8_CLUSTER, MOK_FP8_FUSED_DGU; on by default)
// are set per scope (test::SwitchEnv).
using test::SwitchEnv;

struct Fp8ForwardCase {
  const char* name;
  int64_t H, I;
  std::vector<int64_t> rows;  // real rows per expert
  std::optional<float> limit;
};

class Fp8ExpertsForward : public ::testing::TestWithParam<Fp8ForwardCase> {};

TEST_P(Fp8ExpertsForward, MatchesTheOracleAndIsDeterministic) {
  if (test::device_count() < 1) GTEST_SKIP() << "no GPU";
  const Fp8ForwardCase& c = GetParam();
  const int64_t H = c.H, I = c.I, El = int64_t(c.rows.size());
  std::vector<int64_t> offsets{0};
  for (int64_t n : c.rows) offsets.push_back(offsets.back() + (n + 127) / 128 * 128);
  const int64_t M = offsets.back(), capacity = M + 128;  // slack past the last expert stays untouched

  Rng rng(std::hash<std::string>{}(c.name) ^ 0xf8f0ull);
  std::vector<float> x(size_t(capacity * H), 0.0f);
  for (int64_t e = 0; e < El; ++e)  // real rows random, padding rows zero
    for (int64_t r = offsets[e]; r < offsets[e] + c.rows[e]; ++r)
      for (int64_t k = 0; k < H; ++k) x[size_t(r * H + k)] = round_to_bf16(float(rng.normal()));
  const auto wg = test::random_bf16(rng, El * I * H, 1.0 / std::sqrt(double(H)));
  const auto wu = test::random_bf16(rng, El * I * H, 1.0 / std::sqrt(double(H)));
  const auto wd = test::random_bf16(rng, El * H * I, 1.0 / std::sqrt(double(I)));

  std::vector<float> gu_ref(M * 2 * I), h_ref(M * I), y_ref(M * H);
  const ref::ExpertsView<float> view{wg.data(), wu.data(), wd.data(), El};
  ref::experts_forward_fp8(ref::MlpShape{H, I, c.limit}, view, offsets, x.data(), gu_ref.data(), h_ref.data(),
                           y_ref.data());

  // The operands quantized on the GPU (bit for bit the oracle's: the quantizer tests).
  DeviceBuffer<uint16_t> dx(x.size()), dwg(wg.size()), dwu(wu.size()), dwd(wd.size());
  DeviceBuffer<uint8_t> xq(x.size()), wgq(wg.size()), wuq(wu.size()), wdq(wd.size()), hq(capacity * I);
  DeviceBuffer<float> xs(H / 128 * capacity), wgs(El * I / 128 * H / 128), wus(wgs.n), wds(wgs.n), hs(I / 128 * capacity);
  DeviceBuffer<uint16_t> dgu(capacity * 2 * I), dh(capacity * I), dy(capacity * H);
  DeviceBuffer<int32_t> doff(offsets.size()), dstatus(1);
  ASSERT_TRUE(dx.ptr && dwg.ptr && dwu.ptr && dwd.ptr && xq.ptr && wgq.ptr && wuq.ptr && wdq.ptr && hq.ptr && xs.ptr &&
              wgs.ptr && wus.ptr && wds.ptr && hs.ptr && dgu.ptr && dh.ptr && dy.ptr && doff.ptr && dstatus.ptr);
  dx.upload(test::to_bits(x));
  dwg.upload(test::to_bits(wg));
  dwu.upload(test::to_bits(wu));
  dwd.upload(test::to_bits(wd));
  doff.upload(std::vector<int32_t>(offsets.begin(), offsets.end()));
  CUDA_OK(cudaMemset(dstatus.ptr, 0, sizeof(int32_t)));
  cuda::quantize_rows_e4m3_k_major(dx.ptr, capacity, H, xq.ptr, xs.ptr, nullptr, nullptr);
  cuda::quantize_blocks_e4m3(dwg.ptr, El, I, H, wgq.ptr, wgs.ptr, nullptr);
  cuda::quantize_blocks_e4m3(dwu.ptr, El, I, H, wuq.ptr, wus.ptr, nullptr);
  cuda::quantize_blocks_e4m3(dwd.ptr, El, H, I, wdq.ptr, wds.ptr, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  {  // the k-major scales are the row-major quantizer's, transposed
    const fp8::Quantized want = fp8::quantize_activations(x.data(), capacity, H);
    ASSERT_EQ(xq.download(), want.codes);
    const std::vector<float> got = xs.download();
    for (int64_t r = 0; r < capacity; ++r)
      for (int64_t b = 0; b < H / 128; ++b)
        ASSERT_EQ(got[size_t(b * capacity + r)], want.scales[size_t(r * (H / 128) + b)]) << "row " << r << " block " << b;
  }

  cuda::ExpertsForwardFp8Args a;
  a.row_capacity = capacity;
  a.hidden = H;
  a.intermediate = I;
  a.local_experts = El;
  a.expert_offsets = doff.ptr;
  a.x = xq.ptr;
  a.x_scales = xs.ptr;
  a.w_gate = wgq.ptr;
  a.w_gate_scales = wgs.ptr;
  a.w_up = wuq.ptr;
  a.w_up_scales = wus.ptr;
  a.w_down = wdq.ptr;
  a.w_down_scales = wds.ptr;
  a.gu = dgu.ptr;
  a.h = dh.ptr;
  a.h_codes = hq.ptr;
  a.h_scales = hs.ptr;
  a.y = dy.ptr;
  a.swiglu_limit = c.limit;
  a.status = dstatus.ptr;
  ASSERT_EQ(cuda::can_implement(a), "");

  std::vector<uint16_t> first_gu, first_h, first_y;
  std::vector<uint8_t> first_hq;
  for (int run = 0; run < 7; ++run) {
    a.num_sms = run == 5 ? 3 : 0;  // on 3 CTAs (one cluster of two): many tiles each
    const SwitchEnv clusters("MOK_FP8_CLUSTER", run == 6 ? "off" : "on");  // the last run without clusters
    ASSERT_TRUE(clusters.ok);
    dgu.poison();
    dh.poison();
    dy.poison();
    hq.poison();
    hs.poison();
    cuda::experts_forward_fp8(a, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(dstatus.download()[0], 0);
    auto gu = dgu.download(), h = dh.download(), y = dy.download();
    auto codes = hq.download();
    if (run == 0) {
      const auto gu_f = from_bits(gu), h_f = from_bits(h), y_f = from_bits(y);
      const std::vector<float> gu_m(gu_f.begin(), gu_f.begin() + M * 2 * I), h_m(h_f.begin(), h_f.begin() + M * I),
          y_m(y_f.begin(), y_f.begin() + M * H);
      const Comparison cg = compare(gu_m, gu_ref), ch = compare(h_m, h_ref), cy = compare(y_m, y_ref);
      EXPECT_TRUE(cg.within(1e-2)) << cg.describe("gu");
      EXPECT_TRUE(ch.within(1e-2)) << ch.describe("h");
      EXPECT_TRUE(cy.within(2e-2)) << cy.describe("y");
      std::printf("[ fp8 %s ] rel error gu %.2e h %.2e y %.2e (rows %lld)\n", c.name, cg.rel_error, ch.rel_error,
                  cy.rel_error, static_cast<long long>(M));
      // h_codes and h_scales: the oracle's quantization of the GPU's own h rows, bit for bit.
      const fp8::Quantized want = fp8::quantize_activations(h_m.data(), M, I);
      const std::vector<float> scales = hs.download();
      for (int64_t r = 0; r < M; ++r) {
        for (int64_t b = 0; b < I / 128; ++b)
          ASSERT_EQ(scales[size_t(b * capacity + r)], want.scales[size_t(r * (I / 128) + b)]) << "h row " << r;
        for (int64_t j = 0; j < I; ++j) ASSERT_EQ(codes[size_t(r * I + j)], want.codes[size_t(r * I + j)]) << "h row " << r;
      }
      for (int64_t r = M; r < capacity; ++r) {  // past the experts: nothing written
        for (int64_t j = 0; j < H; ++j) ASSERT_EQ(y[size_t(r * H + j)], 0xffff) << "y row " << r;
        for (int64_t j = 0; j < I; ++j) ASSERT_EQ(h[size_t(r * I + j)], 0xffff) << "h row " << r;
        for (int64_t j = 0; j < I; ++j) ASSERT_EQ(codes[size_t(r * I + j)], 0xff) << "h_codes row " << r;
        for (int64_t j = 0; j < 2 * I; ++j) ASSERT_EQ(gu[size_t(r * 2 * I + j)], 0xffff) << "gu row " << r;
      }
      first_gu = std::move(gu);
      first_h = std::move(h);
      first_y = std::move(y);
      first_hq = std::move(codes);
    } else {
      EXPECT_EQ(first_bit_difference(gu, first_gu), -1) << "gu differs in run " << run;
      EXPECT_EQ(first_bit_difference(h, first_h), -1) << "h differs in run " << run;
      EXPECT_EQ(first_bit_difference(y, first_y), -1) << "y differs in run " << run;
      EXPECT_EQ(codes, first_hq) << "h_codes differ in run " << run;
    }
  }
  // Without gu: the same h and y.
  a.gu = nullptr;
  a.num_sms = 0;
  dh.poison();
  dy.poison();
  cuda::experts_forward_fp8(a, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(first_bit_difference(dh.download(), first_h), -1) << "h differs without gu";
  EXPECT_EQ(first_bit_difference(dy.download(), first_y), -1) << "y differs without gu";
}

INSTANTIATE_TEST_SUITE_P(Gpu, Fp8ExpertsForward,
                         ::testing::Values(Fp8ForwardCase{"small", 256, 256, {130, 0, 300}, std::nullopt},
                                           Fp8ForwardCase{"clamped", 512, 384, {77, 200}, 0.75f},
                                           Fp8ForwardCase{"four_experts", 512, 256, {1, 129, 256, 40}, std::nullopt}),
                         [](const auto& info) { return std::string(info.param.name); });

// The planned fp8 dgrad (experts_dgrad_fp8, then the bf16 weight gradients experts_wgrad) against
// its CPU oracle (reference.h: experts_backward_fp8_dgrad) on fresh random bf16 inputs: dx, d row
// weight and the three weight gradients within a tolerance (dh's k-block sums are the tensor
// cores', not the oracle's exact ones), the weights' transposes quantized on the GPU
// (quantize_blocks_e4m3_transposed), outputs poisoned first, rows past the experts untouched,
// dg|du's codes and scales (quantized in the dh epilogue) the CPU quantization of the GPU's own
// dg|du bit for bit, reruns, a run on 3 SMs, one without clusters and one with dg|du quantized
// by its own kernel (MOK_FP8_FUSED_DGU=off) bit for bit.
class Fp8ExpertsDgrad : public ::testing::TestWithParam<Fp8ForwardCase> {};

TEST_P(Fp8ExpertsDgrad, MatchesTheOracleAndIsDeterministic) {
  if (test::device_count() < 1) GTEST_SKIP() << "no GPU";
  const Fp8ForwardCase& c = GetParam();
  const int64_t H = c.H, I = c.I, El = int64_t(c.rows.size());
  std::vector<int64_t> offsets{0};
  for (int64_t n : c.rows) offsets.push_back(offsets.back() + (n + 127) / 128 * 128);
  const int64_t M = offsets.back(), capacity = M + 128;  // slack past the last expert stays untouched

  Rng rng(std::hash<std::string>{}(c.name) ^ 0xd9adull);
  std::vector<float> x(size_t(capacity * H), 0.0f), dy(size_t(capacity * H), 0.0f), rw(size_t(capacity), 0.0f);
  for (int64_t e = 0; e < El; ++e)  // real rows random, padding rows zero (router weight 0)
    for (int64_t r = offsets[e]; r < offsets[e] + c.rows[e]; ++r) {
      for (int64_t k = 0; k < H; ++k) {
        x[size_t(r * H + k)] = round_to_bf16(float(rng.normal()));
        dy[size_t(r * H + k)] = round_to_bf16(float(rng.normal()));
      }
      rw[size_t(r)] = float(0.05 + 0.9 * rng.uniform());
    }
  const auto wg = test::random_bf16(rng, El * I * H, 1.0 / std::sqrt(double(H)));
  const auto wu = test::random_bf16(rng, El * I * H, 1.0 / std::sqrt(double(H)));
  const auto wd = test::random_bf16(rng, El * H * I, 1.0 / std::sqrt(double(I)));
  const ref::ExpertsView<float> view{wg.data(), wu.data(), wd.data(), El};
  const ref::MlpShape shape{H, I, c.limit};
  std::vector<float> gu(size_t(capacity * 2 * I), 0.0f), h(size_t(capacity * I), 0.0f), y(size_t(M * H));
  ref::experts_forward(shape, view, offsets, x.data(), gu.data(), h.data(), y.data(), ref::Rounding::bf16);
  std::vector<float> dx_ref(M * H), drw_ref(M), dwg_ref(El * I * H), dwu_ref(El * I * H), dwd_ref(El * H * I);
  ref::experts_backward_fp8_dgrad(shape, view, offsets, x.data(), gu.data(), h.data(), dy.data(), rw.data(),
                                  dx_ref.data(), drw_ref.data(), dwg_ref.data(), dwu_ref.data(), dwd_ref.data());

  DeviceBuffer<uint16_t> dx_in(x.size()), dgu_in(gu.size()), dh_in(h.size()), ddy(dy.size()), dwg(wg.size()),
      dwu(wu.size()), dwd(wd.size());
  DeviceBuffer<float> drw(rw.size());
  DeviceBuffer<uint8_t> wdt(El * I * H), wgut(El * H * 2 * I), dyq(capacity * H), dguq(capacity * 2 * I);
  DeviceBuffer<float> wdts(El * (I / 128) * (H / 128)), wguts(El * (H / 128) * (2 * I / 128)),
      dys(H / 128 * capacity), dgus(2 * I / 128 * capacity), partial(capacity * (I / 128));
  DeviceBuffer<uint16_t> ddgu(capacity * 2 * I), dhw(capacity * I), ddx(capacity * H);
  DeviceBuffer<float> dd_rw(capacity), dWg(El * I * H), dWu(El * I * H), dWd(El * H * I);
  DeviceBuffer<int32_t> doff(offsets.size()), dstatus(1);
  ASSERT_TRUE(dx_in.ptr && dgu_in.ptr && dh_in.ptr && ddy.ptr && dwg.ptr && dwu.ptr && dwd.ptr && drw.ptr && wdt.ptr &&
              wgut.ptr && dyq.ptr && dguq.ptr && wdts.ptr && wguts.ptr && dys.ptr && dgus.ptr && partial.ptr &&
              ddgu.ptr && dhw.ptr && ddx.ptr && dd_rw.ptr && dWg.ptr && dWu.ptr && dWd.ptr && doff.ptr && dstatus.ptr);
  dx_in.upload(test::to_bits(x));
  dgu_in.upload(test::to_bits(gu));
  dh_in.upload(test::to_bits(h));
  ddy.upload(test::to_bits(dy));
  dwg.upload(test::to_bits(wg));
  dwu.upload(test::to_bits(wu));
  dwd.upload(test::to_bits(wd));
  drw.upload(rw);
  doff.upload(std::vector<int32_t>(offsets.begin(), offsets.end()));
  CUDA_OK(cudaMemset(dstatus.ptr, 0, sizeof(int32_t)));
  // W_down^T [El, I, H]; [W_gate^T | W_up^T] [El, H, 2I].
  cuda::quantize_blocks_e4m3_transposed(dwd.ptr, El, H, I, nullptr, nullptr, wdt.ptr, wdts.ptr, H, 0, nullptr);
  cuda::quantize_blocks_e4m3_transposed(dwg.ptr, El, I, H, nullptr, nullptr, wgut.ptr, wguts.ptr, 2 * I, 0, nullptr);
  cuda::quantize_blocks_e4m3_transposed(dwu.ptr, El, I, H, nullptr, nullptr, wgut.ptr, wguts.ptr, 2 * I, I, nullptr);

  cuda::ExpertsDgradFp8Args a;
  cuda::ExpertsBackwardArgs& b = a.base;
  b.row_capacity = capacity;
  b.hidden = H;
  b.intermediate = I;
  b.local_experts = El;
  b.expert_offsets = doff.ptr;
  b.x = dx_in.ptr;
  b.gu = dgu_in.ptr;
  b.h = dh_in.ptr;
  b.dy = ddy.ptr;
  b.row_weight = drw.ptr;
  b.w_gate = dwg.ptr;
  b.w_up = dwu.ptr;
  b.w_down = dwd.ptr;
  b.dgu = ddgu.ptr;
  b.hw = dhw.ptr;
  b.dw_partial = partial.ptr;
  b.dx = ddx.ptr;
  b.d_row_weight = dd_rw.ptr;
  b.d_w_gate = dWg.ptr;
  b.d_w_up = dWu.ptr;
  b.d_w_down = dWd.ptr;
  b.swiglu_limit = c.limit;
  b.status = dstatus.ptr;
  a.w_down_t = wdt.ptr;
  a.w_down_t_scales = wdts.ptr;
  a.w_gate_up_t = wgut.ptr;
  a.w_gate_up_t_scales = wguts.ptr;
  a.dy_codes = dyq.ptr;
  a.dy_scales = dys.ptr;
  a.dgu_codes = dguq.ptr;
  a.dgu_scales = dgus.ptr;
  ASSERT_EQ(cuda::can_implement(a), "");

  std::vector<uint16_t> first_dx;
  std::vector<float> first_rw, first_g, first_u, first_d, first_dgus;
  std::vector<uint8_t> first_dguq;
  for (int run = 0; run < 6; ++run) {
    b.num_sms = run == 3 ? 3 : 0;  // on 3 CTAs (one cluster of two): many tiles each
    const SwitchEnv clusters("MOK_FP8_CLUSTER", run == 4 ? "off" : "on");  // run 4 without clusters
    const SwitchEnv fused_dgu("MOK_FP8_FUSED_DGU", run == 5 ? "off" : "on");  // run 5: dg|du's own quantizer
    ASSERT_TRUE(clusters.ok && fused_dgu.ok);
    dguq.poison();
    dgus.poison();
    ddgu.poison();
    dhw.poison();
    ddx.poison();
    dd_rw.poison();
    dWg.poison();
    dWu.poison();
    dWd.poison();
    cuda::experts_dgrad_fp8(a, nullptr);
    cuda::experts_wgrad(b, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(dstatus.download()[0], 0);
    auto dxv = ddx.download();
    auto dgu_codes = dguq.download();
    auto dgu_scales = dgus.download();
    auto drwv = dd_rw.download(), g = dWg.download(), u = dWu.download(), d = dWd.download();
    if (run == 0) {
      const auto dx_f = from_bits(dxv);
      const std::vector<float> dx_m(dx_f.begin(), dx_f.begin() + M * H), rw_m(drwv.begin(), drwv.begin() + M);
      const Comparison cx = compare(dx_m, dx_ref), cw = compare(rw_m, drw_ref), cg = compare(g, dwg_ref),
                       cu = compare(u, dwu_ref), cd = compare(d, dwd_ref);
      EXPECT_TRUE(cx.within(2e-2)) << cx.describe("dx");
      EXPECT_TRUE(cw.within(1e-2)) << cw.describe("d_row_weight");
      EXPECT_TRUE(cg.within(1e-2)) << cg.describe("dW_gate");
      EXPECT_TRUE(cu.within(1e-2)) << cu.describe("dW_up");
      EXPECT_TRUE(cd.within(1e-2)) << cd.describe("dW_down");
      std::printf("[ fp8 dgrad %s ] rel error dx %.2e d_row_weight %.2e dW_gate %.2e dW_up %.2e dW_down %.2e\n", c.name,
                  cx.rel_error, cw.rel_error, cg.rel_error, cu.rel_error, cd.rel_error);
      for (int64_t r = M; r < capacity; ++r) {  // past the experts: nothing written
        for (int64_t j = 0; j < H; ++j) ASSERT_EQ(dxv[size_t(r * H + j)], 0xffff) << "dx row " << r;
        ASSERT_TRUE(std::isnan(drwv[size_t(r)])) << "d_row_weight row " << r;
        for (int64_t j = 0; j < 2 * I; ++j) ASSERT_EQ(dgu_codes[size_t(r * 2 * I + j)], 0xff) << "dg|du codes row " << r;
      }
      // dg|du's codes and scales: the oracle's quantization of the GPU's own bf16 dg|du, 1 x 128.
      const auto dgu_f = from_bits(ddgu.download());
      const std::vector<float> dgu_m(dgu_f.begin(), dgu_f.begin() + M * 2 * I);
      const fp8::Quantized want = fp8::quantize_activations(dgu_m.data(), M, 2 * I);
      for (int64_t r = 0; r < M; ++r) {
        for (int64_t k = 0; k < 2 * I / 128; ++k)
          ASSERT_EQ(dgu_scales[size_t(k * capacity + r)], want.scales[size_t(r * (2 * I / 128) + k)])
              << "dg|du scale row " << r << " block " << k;
        for (int64_t j = 0; j < 2 * I; ++j)
          ASSERT_EQ(dgu_codes[size_t(r * 2 * I + j)], want.codes[size_t(r * 2 * I + j)]) << "dg|du code row " << r;
      }
      first_dguq = std::move(dgu_codes);
      first_dgus = std::move(dgu_scales);
      first_dx = std::move(dxv);
      first_rw = std::move(drwv);
      first_g = std::move(g);
      first_u = std::move(u);
      first_d = std::move(d);
    } else {
      EXPECT_EQ(first_bit_difference(dxv, first_dx), -1) << "dx differs in run " << run;
      EXPECT_EQ(dgu_codes, first_dguq) << "dg|du codes differ in run " << run;
      EXPECT_EQ(first_bit_difference(dgu_scales, first_dgus), -1) << "dg|du scales differ in run " << run;
      EXPECT_EQ(first_bit_difference(drwv, first_rw), -1) << "d_row_weight differs in run " << run;
      EXPECT_EQ(first_bit_difference(g, first_g), -1) << "dW_gate differs in run " << run;
      EXPECT_EQ(first_bit_difference(u, first_u), -1) << "dW_up differs in run " << run;
      EXPECT_EQ(first_bit_difference(d, first_d), -1) << "dW_down differs in run " << run;
    }
  }
  a.dy_codes = nullptr;
  EXPECT_NE(cuda::can_implement(a).find("dy_codes"), std::string::npos);
  EXPECT_THROW(cuda::experts_dgrad_fp8(a, nullptr), std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Gpu, Fp8ExpertsDgrad,
                         ::testing::Values(Fp8ForwardCase{"small", 256, 256, {130, 0, 300}, std::nullopt},
                                           Fp8ForwardCase{"clamped", 512, 384, {77, 200}, 0.75f},
                                           Fp8ForwardCase{"four_experts", 512, 256, {1, 129, 256, 40}, std::nullopt}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace mok
