#include "mok/core/fp8.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "mok/core/error.h"
#include "mok/core/parallel.h"

namespace mok::fp8 {

uint8_t encode(float v) {
  if (std::isnan(v)) return kNaN;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(v));
  if (a >= kMax) return sign | 0x7e;  // saturate (448 itself is 0x7e)
  // Subnormals and zero: multiples of 2^-9 below 2^-6 (code = multiple; 8 is the smallest normal).
  if (a < std::ldexp(1.0, -6)) {
    const double q = std::nearbyint(std::ldexp(a, 9));  // ties to even (the default rounding mode)
    return sign | static_cast<uint8_t>(q);
  }
  int exp2 = 0;
  (void)std::frexp(a, &exp2);  // a = f * 2^exp2, f in [0.5, 1)
  int e = exp2 - 1;            // a in [2^e, 2^(e+1))
  double q = std::nearbyint(std::ldexp(a, 3 - e));  // 8 + mantissa, in [8, 16]
  if (q == 16.0) {
    q = 8.0;
    ++e;
  }
  const int field = e + 7;
  if (field > 15 || (field == 15 && q - 8.0 > 6.0)) return sign | 0x7e;  // rounded past 448
  return sign | static_cast<uint8_t>(field << 3 | static_cast<int>(q - 8.0));
}

float decode(uint8_t code) {
  const int field = (code >> 3) & 0xf, mantissa = code & 0x7;
  const float sign = (code & 0x80) ? -1.0f : 1.0f;
  if (field == 15 && mantissa == 7) return std::nanf("");
  if (field == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(static_cast<float>(8 + mantissa), field - 10);
}

float block_scale(float amax) {
  MOK_REQUIRE(std::isfinite(amax) && amax >= 0.0f, "block_scale needs a finite amax >= 0, got ", amax);
  if (amax == 0.0f) return 1.0f;
  // Start near log2(amax / 448) and step to the smallest e with amax <= 448 * 2^e.
  int e = std::ilogb(amax) - 8;
  while (static_cast<double>(amax) > std::ldexp(static_cast<double>(kMax), e)) ++e;
  while (static_cast<double>(amax) <= std::ldexp(static_cast<double>(kMax), e - 1)) --e;
  return std::ldexp(1.0f, std::clamp(e, -126, 127));
}

Quantized quantize(const float* x, int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols) {
  MOK_REQUIRE(rows >= 0 && cols >= 0, "quantize: rows and cols must be >= 0, got ", rows, " x ", cols);
  MOK_REQUIRE(block_rows > 0 && block_cols > 0, "quantize: blocks must be at least 1 x 1, got ", block_rows, " x ",
              block_cols);
  MOK_REQUIRE(x != nullptr || rows * cols == 0, "quantize: x is null");
  Quantized q;
  q.rows = rows;
  q.cols = cols;
  q.block_rows = block_rows;
  q.block_cols = block_cols;
  q.codes.resize(static_cast<size_t>(rows * cols));
  q.scales.resize(static_cast<size_t>(q.row_blocks() * q.col_blocks()));
  for (int64_t rb = 0; rb < q.row_blocks(); ++rb) {
    const int64_t r0 = rb * block_rows, r1 = std::min(rows, r0 + block_rows);
    for (int64_t cb = 0; cb < q.col_blocks(); ++cb) {
      const int64_t c0 = cb * block_cols, c1 = std::min(cols, c0 + block_cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const float v = x[r * cols + c];
          MOK_REQUIRE(std::isfinite(v), "quantize: x[", r, "][", c, "] is not finite (", v, ")");
          amax = std::max(amax, std::fabs(v));
        }
      }
      const float s = block_scale(amax);
      q.scales[static_cast<size_t>(rb * q.col_blocks() + cb)] = s;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          // x / 2^e is exact (in double, then to float: the quotient is within e4m3's range).
          q.codes[static_cast<size_t>(r * cols + c)] =
              encode(static_cast<float>(static_cast<double>(x[r * cols + c]) / static_cast<double>(s)));
        }
      }
    }
  }
  return q;
}

Quantized transpose(const Quantized& q) {
  Quantized t;
  t.rows = q.cols;
  t.cols = q.rows;
  t.block_rows = q.block_cols;
  t.block_cols = q.block_rows;
  t.codes.resize(q.codes.size());
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t c = 0; c < q.cols; ++c) t.codes[static_cast<size_t>(c * q.rows + r)] = q.codes[static_cast<size_t>(r * q.cols + c)];
  t.scales.resize(q.scales.size());
  for (int64_t rb = 0; rb < q.row_blocks(); ++rb)
    for (int64_t cb = 0; cb < q.col_blocks(); ++cb)
      t.scales[static_cast<size_t>(cb * q.row_blocks() + rb)] = q.scales[static_cast<size_t>(rb * q.col_blocks() + cb)];
  return t;
}

Quantized concat_cols(const Quantized& a, const Quantized& b) {
  MOK_REQUIRE(a.rows == b.rows && a.block_rows == b.block_rows && a.block_cols == b.block_cols,
              "concat_cols: a is ", a.rows, " rows in ", a.block_rows, " x ", a.block_cols, " blocks, b ", b.rows,
              " rows in ", b.block_rows, " x ", b.block_cols);
  MOK_REQUIRE(a.cols % a.block_cols == 0, "concat_cols: a's ", a.cols, " columns are not whole ", a.block_cols,
              "-wide blocks");
  Quantized q;
  q.rows = a.rows;
  q.cols = a.cols + b.cols;
  q.block_rows = a.block_rows;
  q.block_cols = a.block_cols;
  q.codes.resize(static_cast<size_t>(q.rows * q.cols));
  q.scales.resize(static_cast<size_t>(q.row_blocks() * q.col_blocks()));
  for (int64_t r = 0; r < q.rows; ++r) {
    std::copy_n(a.codes.begin() + r * a.cols, a.cols, q.codes.begin() + r * q.cols);
    std::copy_n(b.codes.begin() + r * b.cols, b.cols, q.codes.begin() + r * q.cols + a.cols);
  }
  for (int64_t rb = 0; rb < q.row_blocks(); ++rb) {
    std::copy_n(a.scales.begin() + rb * a.col_blocks(), a.col_blocks(), q.scales.begin() + rb * q.col_blocks());
    std::copy_n(b.scales.begin() + rb * b.col_blocks(), b.col_blocks(),
                q.scales.begin() + rb * q.col_blocks() + a.col_blocks());
  }
  return q;
}

void gemm_nt(const Quantized& a, const Quantized& b, float* c) {
  MOK_REQUIRE(a.cols == b.cols, "gemm_nt: a has ", a.cols, " columns and b ", b.cols);
  MOK_REQUIRE(a.block_cols == kBlock && b.block_cols == kBlock, "gemm_nt: the k blocks must be ", kBlock,
              " wide, got ", a.block_cols, " and ", b.block_cols);
  MOK_REQUIRE(c != nullptr || a.rows * b.rows == 0, "gemm_nt: c is null");
  const int64_t K = a.cols, k_blocks = a.col_blocks();
  // The codes' values, decoded once (exact in float).
  float table[256];
  for (int code = 0; code < 256; ++code) table[code] = decode(static_cast<uint8_t>(code));
  const auto decoded = [&](const std::vector<uint8_t>& codes) {
    std::vector<float> v(codes.size());
    for (size_t i = 0; i < codes.size(); ++i) v[i] = table[codes[i]];
    return v;
  };
  const std::vector<float> av = decoded(a.codes), bv = decoded(b.codes);
  parallel_for(a.rows, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t n = 0; n < b.rows; ++n) {
        const float* ar = av.data() + m * K;
        const float* br = bv.data() + n * K;
        float acc = 0.0f;
        for (int64_t kb = 0; kb < k_blocks; ++kb) {
          // The block's code products, summed exactly: each product of two e4m3 values has at most
          // 8 significant bits between 2^-18 and 2^18 (exact in float), so 128 of them fit a
          // double's 53 bits in any order (four partial sums, for speed, give the same bits).
          const int64_t k1 = std::min(K, (kb + 1) * kBlock);
          double part[4] = {0.0, 0.0, 0.0, 0.0};
          int64_t k = kb * kBlock;
          for (; k + 4 <= k1; k += 4) {
            for (int u = 0; u < 4; ++u) part[u] += static_cast<double>(ar[k + u] * br[k + u]);
          }
          for (; k < k1; ++k) part[0] += static_cast<double>(ar[k] * br[k]);
          const float partial = static_cast<float>((part[0] + part[1]) + (part[2] + part[3]));
          const float scaled = partial * a.scale(m, kb * kBlock);
          acc = acc + scaled * b.scale(n, kb * kBlock);
        }
        c[m * b.rows + n] = acc;
      }
    }
  });
}

}  // namespace mok::fp8
