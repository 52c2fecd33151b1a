// Block-scaled e4m3 (fp8.h): the conversion against a brute-force nearest-even search over every
// code, the power-of-two scales, quantization error bounds, and the block-scaled GEMM.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "mok/core/error.h"
#include "mok/core/fp8.h"
#include "mok/core/reference.h"

namespace mok::fp8 {
namespace {

// The nearest finite e4m3 code to v by search over all codes, ties to the even mantissa;
// saturating beyond 448.
uint8_t nearest_code(float v) {
  const double a = std::fabs(static_cast<double>(v));
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  uint8_t best = 0;
  double best_distance = std::numeric_limits<double>::infinity();
  for (int code = 0; code <= 0x7e; ++code) {
    const double d = std::fabs(static_cast<double>(decode(static_cast<uint8_t>(code))) - a);
    if (d < best_distance || (d == best_distance && (code & 1) == 0)) {
      best = static_cast<uint8_t>(code);
      best_distance = d;
    }
  }
  return sign | best;
}

TEST(Fp8, EveryCodeDecodesAndEncodesBack) {
  int finite = 0;
  for (int code = 0; code < 256; ++code) {
    const float v = decode(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << code;
      continue;
    }
    ++finite;
    EXPECT_EQ(encode(v), code) << v;
  }
  EXPECT_EQ(finite, 254);
  EXPECT_EQ(decode(0x7e), 448.0f);
  EXPECT_EQ(decode(0xfe), -448.0f);
  EXPECT_EQ(decode(0x08), std::ldexp(1.0f, -6));  // the smallest normal
  EXPECT_EQ(decode(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(decode(0x38), 1.0f);
}

TEST(Fp8, EncodeRoundsToNearestEvenAndSaturates) {
  // Ties between two codes go to the even mantissa.
  EXPECT_EQ(decode(encode(1.0625f)), 1.0f);    // between 1 (m=0) and 1.125 (m=1)
  EXPECT_EQ(decode(encode(1.1875f)), 1.25f);   // between 1.125 (m=1) and 1.25 (m=2)
  EXPECT_EQ(decode(encode(std::ldexp(1.0f, -10))), 0.0f);                  // half the smallest subnormal
  EXPECT_EQ(decode(encode(std::ldexp(3.0f, -10))), std::ldexp(2.0f, -9));  // 1.5 subnormal steps -> 2
  EXPECT_EQ(decode(encode(std::ldexp(15.0f, -10))), std::ldexp(1.0f, -6)); // 7.5 steps -> the smallest normal
  EXPECT_EQ(decode(encode(15.5f)), 16.0f);      // 15 and 16 are neighbours; 15.5 ties to 16 (m=0)
  // Saturation: beyond 448 (including infinity) to +-448; NaN to NaN.
  EXPECT_EQ(encode(449.0f), 0x7e);
  EXPECT_EQ(encode(1e30f), 0x7e);
  EXPECT_EQ(encode(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(encode(std::nanf("")), kNaN);
  EXPECT_EQ(encode(-0.0f), 0x80);
  // Against the search on random values over the whole range, subnormals included.
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> exponent(-12.0f, 9.5f);
  for (int i = 0; i < 20000; ++i) {
    const float v = (i % 2 ? -1.0f : 1.0f) * std::exp2(exponent(rng));
    ASSERT_EQ(encode(v), nearest_code(v)) << v;
  }
}

TEST(Fp8, BlockScalesArePowersOfTwoJustCoveringTheBlock) {
  EXPECT_EQ(block_scale(0.0f), 1.0f);
  EXPECT_EQ(block_scale(448.0f), 1.0f);
  EXPECT_EQ(block_scale(448.5f), 2.0f);
  EXPECT_EQ(block_scale(224.0f), 0.5f);
  EXPECT_EQ(block_scale(1.0f), std::ldexp(1.0f, -8));  // 1 <= 448 * 2^-8 = 1.75
  EXPECT_EQ(block_scale(std::numeric_limits<float>::denorm_min()), std::ldexp(1.0f, -126));  // clamped
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> exponent(-100.0f, 100.0f);
  for (int i = 0; i < 2000; ++i) {
    const float amax = std::exp2(exponent(rng));
    const float s = block_scale(amax);
    int e = 0;
    ASSERT_EQ(std::frexp(s, &e), 0.5f) << "a power of two";
    ASSERT_LE(amax / s, kMax) << amax;
    ASSERT_GT(amax / s, kMax / 2) << amax << ": the next smaller power of two would also cover it";
  }
  EXPECT_THROW(block_scale(std::nanf("")), InvalidArgument);
  EXPECT_THROW(block_scale(-1.0f), InvalidArgument);
}

TEST(Fp8, QuantizedValuesAreWithinHalfAStepOfTheInput) {
  // Rows of very different magnitudes, a zero block, partial blocks (200 columns, 130 rows).
  const int64_t rows = 130, cols = 200;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) x[r * cols + c] = r == 7 ? 0.0f : normal(rng) * std::ldexp(1.0f, int(r % 40) - 20);
  for (const auto& [br, bc] : {std::pair<int64_t, int64_t>{1, kBlock}, {kBlock, kBlock}}) {
    const Quantized q = quantize(x.data(), rows, cols, br, bc);
    ASSERT_EQ(q.row_blocks(), (rows + br - 1) / br);
    ASSERT_EQ(q.col_blocks(), 2);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float v = x[r * cols + c], s = q.scale(r, c), got = q.value(r, c);
        // Normals: within 2^-4 of the value (3 mantissa bits, half a step); below e4m3's smallest
        // normal: within half a subnormal step of the scaled grid.
        const float bound = std::max(std::fabs(v) * 0.0625f, s * std::ldexp(1.0f, -10));
        ASSERT_LE(std::fabs(got - v), bound) << r << "," << c;
        ASSERT_EQ(q.codes[r * cols + c], encode(v / s)) << "the code of the scaled value";
      }
    }
    EXPECT_EQ(q.scale(7, 0), br == 1 ? 1.0f : q.scale(0, 0)) << "a zero block's scale is 1";
  }
  std::vector<float> bad(x);
  bad[3 * cols + 5] = std::numeric_limits<float>::infinity();
  try {
    (void)quantize_activations(bad.data(), rows, cols);
    FAIL() << "an infinite input must be named";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("x[3][5] is not finite"), std::string::npos) << e.what();
  }
}

TEST(Fp8, BlockScaledGemmPromotesEachKBlockInOrder) {
  const int64_t M = 9, N = 130, K = 384;  // 3 k-blocks, 2 weight row blocks (the last partial)
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> a(M * K), b(N * K);
  for (int64_t i = 0; i < M * K; ++i) a[i] = normal(rng) * (i % K < 128 ? 100.0f : 0.01f);  // k-blocks of other scales
  for (float& v : b) v = normal(rng) * 0.05f;
  const Quantized qa = quantize_activations(a.data(), M, K), qb = quantize_weights(b.data(), N, K);
  std::vector<float> c(M * N);
  gemm_nt(qa, qb, c.data());
  double err = 0.0, norm = 0.0;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      // The same promotion written out: fp32, block by block, (partial * sa) * sb.
      float acc = 0.0f;
      double exact_dequantized = 0.0, unquantized = 0.0;
      for (int64_t kb = 0; kb < 3; ++kb) {
        double block = 0.0;
        for (int64_t k = kb * 128; k < (kb + 1) * 128; ++k) {
          block += double(decode(qa.codes[m * K + k])) * decode(qb.codes[n * K + k]);
          exact_dequantized += double(qa.value(m, k)) * qb.value(n, k);
          unquantized += double(a[m * K + k]) * b[n * K + k];
        }
        acc = acc + float(block) * qa.scale(m, kb * 128) * qb.scale(n, kb * 128);
      }
      ASSERT_EQ(c[m * N + n], acc) << m << "," << n;
      ASSERT_NEAR(c[m * N + n], exact_dequantized, 1e-5 * (std::fabs(exact_dequantized) + 1.0));
      err += (c[m * N + n] - unquantized) * (c[m * N + n] - unquantized);
      norm += unquantized * unquantized;
    }
  }
  // Against the unquantized product: e4m3's 3 mantissa bits on both operands.
  EXPECT_LT(std::sqrt(err / norm), 0.06);
  const Quantized narrow = quantize(a.data(), M, K, 1, 64);
  EXPECT_THROW(gemm_nt(narrow, qb, c.data()), InvalidArgument);
  const Quantized other = quantize_weights(b.data(), N / 2, K - 128);
  EXPECT_THROW(gemm_nt(qa, other, c.data()), InvalidArgument);
}

// The experts' fp8 forward oracle (reference.h: experts_forward_fp8). On inputs that e4m3 holds
// exactly under their block scales (small integers, and weights in steps of 1/16) every k-block's
// sum is exact, so g|u and h are the bf16 reference's bit for bit; y differs from it only by h's
// quantization (e4m3's 3 mantissa bits).
TEST(Fp8, ExpertsForwardIsTheBf16FormWhereE4m3IsExact) {
  const int64_t H = 256, I = 128, El = 3;
  const std::vector<int64_t> offsets{0, 5, 5, 21};  // an empty expert between two
  const int64_t M = offsets.back();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-4, 4), tiny(-2, 2);
  std::vector<float> x(M * H), wg(El * I * H), wu(El * I * H), wd(El * H * I);
  for (float& v : x) v = float(small(rng));
  for (auto* w : {&wg, &wu, &wd})
    for (float& v : *w) v = float(tiny(rng)) / 16.0f;
  const ref::ExpertsView<float> view{wg.data(), wu.data(), wd.data(), El};
  for (const std::optional<float> limit : {std::optional<float>{}, std::optional<float>{1.5f}}) {
    const ref::MlpShape shape{H, I, limit};
    std::vector<float> gu(M * 2 * I), h(M * I), y(M * H), gu_ref(M * 2 * I), h_ref(M * I), y_ref(M * H);
    ref::experts_forward_fp8(shape, view, offsets, x.data(), gu.data(), h.data(), y.data());
    ref::experts_forward(shape, view, offsets, x.data(), gu_ref.data(), h_ref.data(), y_ref.data(),
                         ref::Rounding::bf16);
    for (int64_t i = 0; i < M * 2 * I; ++i) ASSERT_EQ(gu[i], gu_ref[i]) << i;
    for (int64_t i = 0; i < M * I; ++i) ASSERT_EQ(h[i], h_ref[i]) << i;
    double err = 0.0, norm = 0.0;
    for (int64_t i = 0; i < M * H; ++i) {
      err += double(y[i] - y_ref[i]) * (y[i] - y_ref[i]);
      norm += double(y_ref[i]) * y_ref[i];
    }
    ASSERT_GT(norm, 0.0);
    EXPECT_LT(std::sqrt(err / norm), 0.06);
    EXPECT_GT(err, 0.0) << "h's quantization changed nothing: the check of y cannot tell the paths apart";
  }
  const ref::MlpShape odd{H, 192, std::nullopt};  // not whole scale blocks
  std::vector<float> out(M * 2 * 192);
  EXPECT_THROW(ref::experts_forward_fp8(odd, view, offsets, x.data(), out.data(), out.data(), out.data()),
               InvalidArgument);
}

}  // namespace
}  // namespace mok::fp8
