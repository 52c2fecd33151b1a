// Block-scaled e4m3 (fp8.h): the conversion against a brute-force nearest-even search over every
// code, the power-of-two scales, quantization error bounds, and the block-scaled GEMM.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <tuple>
#include <span>
#include <vector>

#include "mok/core/bf16.h"
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

// The backward's W^T operands: quantizing the transposed weights with transposed blocks gives the
// forward's codes and scales, moved (a block's scale depends only on its set of values), with
// partial blocks at both edges; and [a | b] puts b's codes and scales after a's.
TEST(Fp8, TransposedQuantizationIsTheForwardCodesMoved) {
  const int64_t rows = 300, cols = 200;  // 3 x 2 weight blocks, the last ones partial
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(rows * cols), wt(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      w[r * cols + c] = normal(rng) * std::ldexp(1.0f, int((r / 128 + 2 * (c / 128)) % 5) - 2);
      wt[c * rows + r] = w[r * cols + c];
    }
  const Quantized q = quantize_weights(w.data(), rows, cols), t = transpose(q);
  const Quantized direct = quantize_weights(wt.data(), cols, rows);
  ASSERT_EQ(t.rows, cols);
  ASSERT_EQ(t.cols, rows);
  EXPECT_EQ(t.codes, direct.codes);
  EXPECT_EQ(t.scales, direct.scales);
  for (int64_t r = 0; r < rows; r += 37)
    for (int64_t c = 0; c < cols; c += 11) ASSERT_EQ(t.value(c, r), q.value(r, c));
  EXPECT_NE(q.scales[0], q.scales[1]) << "blocks of different magnitudes (else a moved scale would go unnoticed)";
  // Activations (1 x 128): a transposed activation matrix has 128 x 1 blocks.
  const Quantized a = quantize_activations(w.data(), rows, cols), at = transpose(a);
  EXPECT_EQ(at.block_rows, kBlock);
  EXPECT_EQ(at.block_cols, 1);
  EXPECT_EQ(at.codes, quantize(wt.data(), cols, rows, kBlock, 1).codes);
  EXPECT_EQ(at.scales, quantize(wt.data(), cols, rows, kBlock, 1).scales);

  // w's columns [0, 128) and [128, 200) quantized apart, then put side by side: whole blocks on
  // the left, so the concatenation is the whole matrix's quantization.
  std::vector<float> left_part(rows * 128), right_part(rows * 72);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) (c < 128 ? left_part[r * 128 + c] : right_part[r * 72 + c - 128]) = w[r * cols + c];
  const Quantized left = quantize_weights(left_part.data(), rows, 128);
  const Quantized both = concat_cols(left, quantize_weights(right_part.data(), rows, 72));
  EXPECT_EQ(both.codes, q.codes);
  EXPECT_EQ(both.scales, q.scales);
  try {
    (void)concat_cols(quantize_weights(right_part.data(), rows, 72), left);
    FAIL() << "a left matrix of a partial block must be refused";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not whole"), std::string::npos) << e.what();
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

// The planned fp8 dgrad's oracle (reference.h: experts_backward_fp8_dgrad). On dy and weights that
// e4m3 holds exactly under their block scales, dh's k-block sums are exact, so everything computed
// from dh (dg|du, w*h, d_row_weight) and the weight gradients are experts_backward's at bf16 bit
// for bit; dx differs only by dg|du's quantization (e4m3's 3 mantissa bits).
TEST(Fp8, BackwardDgradIsTheBf16FormWhereE4m3IsExact) {
  const int64_t H = 256, I = 128, El = 3;
  const std::vector<int64_t> offsets{0, 6, 6, 19};  // an empty expert between two
  const int64_t M = offsets.back();
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> small(-4, 4), tiny(-2, 2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(M * H), dy(M * H), rw(M), wg(El * I * H), wu(El * I * H), wd(El * H * I);
  for (float& v : x) v = round_to_bf16(normal(rng));
  for (float& v : dy) v = float(small(rng));
  for (int64_t m = 0; m < M; ++m) rw[m] = m % 3 == 0 ? 0.5f : 0.125f;
  for (auto* w : {&wg, &wu, &wd})
    for (float& v : *w) v = float(tiny(rng)) / 16.0f;
  const ref::ExpertsView<float> view{wg.data(), wu.data(), wd.data(), El};
  for (const std::optional<float> limit : {std::optional<float>{}, std::optional<float>{1.5f}}) {
    const ref::MlpShape shape{H, I, limit};
    std::vector<float> gu(M * 2 * I), h(M * I), y(M * H);
    ref::experts_forward(shape, view, offsets, x.data(), gu.data(), h.data(), y.data(), ref::Rounding::bf16);
    struct Grads {
      std::vector<float> dx, dw, dg, du, dd;
    };
    const auto run = [&](bool fp8) {
      Grads g{std::vector<float>(M * H), std::vector<float>(M), std::vector<float>(El * I * H),
              std::vector<float>(El * I * H), std::vector<float>(El * H * I)};
      if (fp8) {
        ref::experts_backward_fp8_dgrad(shape, view, offsets, x.data(), gu.data(), h.data(), dy.data(), rw.data(),
                                        g.dx.data(), g.dw.data(), g.dg.data(), g.du.data(), g.dd.data());
      } else {
        ref::experts_backward(shape, view, offsets, x.data(), gu.data(), h.data(), dy.data(), rw.data(), g.dx.data(),
                              g.dw.data(), g.dg.data(), g.du.data(), g.dd.data(), ref::Rounding::bf16);
      }
      return g;
    };
    const Grads f = run(true), b = run(false);
    EXPECT_EQ(f.dw, b.dw) << "d_row_weight";
    EXPECT_EQ(f.dg, b.dg) << "dW_gate";
    EXPECT_EQ(f.du, b.du) << "dW_up";
    EXPECT_EQ(f.dd, b.dd) << "dW_down";
    double err = 0.0, norm = 0.0;
    for (int64_t i = 0; i < M * H; ++i) {
      err += double(f.dx[i] - b.dx[i]) * (f.dx[i] - b.dx[i]);
      norm += double(b.dx[i]) * b.dx[i];
    }
    ASSERT_GT(norm, 0.0);
    EXPECT_LT(std::sqrt(err / norm), 0.06);
    EXPECT_GT(err, 0.0) << "dg|du's quantization changed nothing: the check of dx cannot tell the paths apart";
  }
  const ref::MlpShape odd{H, 192, std::nullopt};  // not whole scale blocks
  std::vector<float> out(M * 2 * 192 * El);
  EXPECT_THROW(ref::experts_backward_fp8_dgrad(odd, view, offsets, x.data(), out.data(), out.data(), dy.data(),
                                               rw.data(), out.data(), out.data(), out.data(), out.data(), out.data()),
               InvalidArgument);
}

// The weight gradients on e4m3 too (ref::experts_backward_fp8): dx and d_row_weight are the fp8
// dgrad's bit for bit (the weight gradients come after them); each weight gradient is near the
// bf16 one of the same dg|du, x, dy and w*h, and not equal to it; an expert's gradients depend on
// its own rows only (its quantization blocks are 128 of its rows: the same bits when its rows run
// alone), with a partial last block (13 rows) and an empty expert.
TEST(Fp8, BackwardWeightGradientsOnE4m3AreAnExpertsOwn) {
  const int64_t H = 256, I = 128, El = 3;
  const std::vector<int64_t> offsets{0, 6, 6, 19};
  const int64_t M = offsets.back();
  std::mt19937 rng(23);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(M * H), dy(M * H), rw(M), wg(El * I * H), wu(El * I * H), wd(El * H * I);
  for (auto* v : {&x, &dy})
    for (float& f : *v) f = round_to_bf16(normal(rng));
  for (int64_t m = 0; m < M; ++m) rw[m] = m % 3 == 0 ? 0.5f : 0.125f;
  for (auto* w : {&wg, &wu, &wd})
    for (float& v : *w) v = round_to_bf16(0.05f * normal(rng));
  const ref::ExpertsView<float> view{wg.data(), wu.data(), wd.data(), El};
  const ref::MlpShape shape{H, I, std::nullopt};
  std::vector<float> gu(M * 2 * I), h(M * I), y(M * H);
  ref::experts_forward(shape, view, offsets, x.data(), gu.data(), h.data(), y.data(), ref::Rounding::bf16);
  struct Grads {
    std::vector<float> dx, dw, dg, du, dd;
  };
  const auto run = [&](bool fp8_wgrad, const ref::ExpertsView<float>& v, std::span<const int64_t> offs, int64_t m0) {
    const int64_t rows = offs.back(), experts = v.count;
    Grads g{std::vector<float>(rows * H), std::vector<float>(rows), std::vector<float>(experts * I * H),
            std::vector<float>(experts * I * H), std::vector<float>(experts * H * I)};
    auto* backward = fp8_wgrad ? &ref::experts_backward_fp8 : &ref::experts_backward_fp8_dgrad;
    backward(shape, v, offs, x.data() + m0 * H, gu.data() + m0 * 2 * I, h.data() + m0 * I, dy.data() + m0 * H,
             rw.data() + m0, g.dx.data(), g.dw.data(), g.dg.data(), g.du.data(), g.dd.data());
    return g;
  };
  const Grads f = run(true, view, offsets, 0), b = run(false, view, offsets, 0);
  EXPECT_EQ(f.dx, b.dx) << "dx";
  EXPECT_EQ(f.dw, b.dw) << "d_row_weight";
  for (const auto& [got, want, name] : {std::tuple{&f.dg, &b.dg, "dW_gate"}, std::tuple{&f.du, &b.du, "dW_up"},
                                        std::tuple{&f.dd, &b.dd, "dW_down"}}) {
    double err = 0.0, norm = 0.0;
    for (size_t i = 0; i < want->size(); ++i) {
      err += double((*got)[i] - (*want)[i]) * ((*got)[i] - (*want)[i]);
      norm += double((*want)[i]) * (*want)[i];
    }
    ASSERT_GT(norm, 0.0) << name;
    EXPECT_LT(std::sqrt(err / norm), 0.06) << name;
    EXPECT_GT(err, 0.0) << name << ": the e4m3 weight gradient is the bf16 one";
  }
  // Expert 2's rows (13, one partial block) alone: its gradients the same bits.
  const ref::ExpertsView<float> last{wg.data() + 2 * I * H, wu.data() + 2 * I * H, wd.data() + 2 * H * I, 1};
  const std::vector<int64_t> alone{0, 13};
  const Grads a = run(true, last, alone, 6);
  EXPECT_EQ(a.dg, std::vector<float>(f.dg.begin() + 2 * I * H, f.dg.end()));
  EXPECT_EQ(a.du, std::vector<float>(f.du.begin() + 2 * I * H, f.du.end()));
  EXPECT_EQ(a.dd, std::vector<float>(f.dd.begin() + 2 * H * I, f.dd.end()));
  for (int64_t i = 0; i < I * H; ++i) ASSERT_EQ(f.dg[size_t(I * H + i)], 0.0f) << "the empty expert's dW_gate";
  const ref::MlpShape odd{H, 192, std::nullopt};
  std::vector<float> out(M * 2 * 192 * El);
  EXPECT_THROW(ref::experts_backward_fp8(odd, view, offsets, x.data(), out.data(), out.data(), dy.data(), rw.data(),
                                         out.data(), out.data(), out.data(), out.data(), out.data()),
               InvalidArgument);
}

}  // namespace
}  // namespace mok::fp8
