// The precision template parameter of the expert GEMMs, at fp8: the persistent grouped GEMM with
// e4m3 operands (fp8_gemm.h) against a CPU product of the same values, on fresh random inputs,
// with an empty expert, a row count and a K and N that are not multiples of the tile, outputs
// poisoned first, and reruns compared bit for bit. Runs only where a GPU is (tools/gpu.sh).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "fp8_gemm.h"
#include "gpu_test_util.h"
#include "mok/core/bf16.h"
#include "mok/core/fp8.h"
#include "mok/core/problem.h"

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

}  // namespace
}  // namespace mok
