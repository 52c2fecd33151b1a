// Bitwise determinism: across thread counts, repeated runs, blockings, and the EP degree R.
#include <gtest/gtest.h>

#include "mok/core/compare.h"
#include "mok/core/cpu_gemm.h"
#include "mok/core/parallel.h"
#include "mok/core/problem.h"
#include "mok/core/reference.h"
#include "naive.h"

namespace mok {
namespace {

using test::flat;

struct ThreadGuard {
  ~ThreadGuard() { set_cpu_threads(0); }
};

struct Outputs {
  std::vector<float> y, dx, dw, gate, up, down, shared;
};

Outputs run_layer(const ref::LayerInputs<float>& in, const std::vector<std::vector<float>>& dy) {
  const auto f = ref::layer_forward(in, ref::Rounding::bf16);
  const auto g = ref::layer_backward(in, f.context, dy, ref::Rounding::bf16);
  Outputs o{flat(f.y), flat(g.dx), flat(g.d_topk_w), g.d_routed.gate, g.d_routed.up, g.d_routed.down, {}};
  for (const auto& s : g.d_shared) {
    o.shared.insert(o.shared.end(), s.gate.begin(), s.gate.end());
    o.shared.insert(o.shared.end(), s.up.begin(), s.up.end());
    o.shared.insert(o.shared.end(), s.down.begin(), s.down.end());
  }
  return o;
}

void expect_identical(const Outputs& a, const Outputs& b, const std::string& what, bool with_shared = true) {
  EXPECT_EQ(first_bit_difference(a.y, b.y), -1) << what << ": y";
  EXPECT_EQ(first_bit_difference(a.dx, b.dx), -1) << what << ": dx";
  EXPECT_EQ(first_bit_difference(a.dw, b.dw), -1) << what << ": d_topk_w";
  EXPECT_EQ(first_bit_difference(a.gate, b.gate), -1) << what << ": dW_gate";
  EXPECT_EQ(first_bit_difference(a.up, b.up), -1) << what << ": dW_up";
  EXPECT_EQ(first_bit_difference(a.down, b.down), -1) << what << ": dW_down";
  if (with_shared) {
    EXPECT_EQ(first_bit_difference(a.shared, b.shared), -1) << what << ": shared dW";
  }
}

// fp8_block and fp8_dgrad: whole 128-wide scale blocks (the routed and the shared experts' GEMMs in e4m3).
MoeDesc desc(int64_t T, int64_t R, Precision precision = Precision::bf16) {
  const bool fp8 = fp8_forward(precision);
  MoeDesc d;
  d.tokens_per_rank = T;
  d.hidden = fp8 ? 256 : 72;
  d.intermediate = fp8 ? 128 : 40;
  d.num_experts = 12;
  d.topk = 3;
  d.ranks = R;
  d.shared_intermediate = fp8 ? 128 : 24;
  d.precision = precision;
  return d;
}

void same_bits_for_any_number_of_ranks(Precision precision);

TEST(Determinism, AnyThreadCountAndRepeatedRuns) {
  ThreadGuard guard;
  const MoeDesc d = desc(50, 3);
  const auto in = make_inputs<float>(d, RoutingKind::zipf, 9, true);
  const auto dy = make_output_grad<float>(d, 9, true);
  set_cpu_threads(1);
  const Outputs base = run_layer(in, dy);
  for (int threads : {1, 2, 3, 7}) {
    set_cpu_threads(threads);
    for (int rep = 0; rep < 2; ++rep) {
      expect_identical(run_layer(in, dy), base, "threads=" + std::to_string(threads));
    }
  }
}

// The same global batch of 48 tokens split over R = 1, 2, 3, 4 ranks gives the same bits for
// every per-token output and for the routed weight gradients (their reduction walks the
// canonical order, which does not depend on R). The shared expert's weight gradient is each
// rank's own partial sum, so only its total over ranks is compared, to rounding. At every
// precision: fp8's quantization blocks are a row's (x, h, dy, dg|du) or an expert's (weights), never a rank's.
TEST(Determinism, SameBitsForAnyNumberOfRanks) {
  for (const Precision precision : {Precision::bf16, Precision::fp8_block, Precision::fp8_dgrad}) {
    SCOPED_TRACE(to_string(precision));
    same_bits_for_any_number_of_ranks(precision);
  }
}

void same_bits_for_any_number_of_ranks(Precision precision) {
  const int64_t N = 48;
  const auto global = make_inputs<float>(desc(N, 1, precision), RoutingKind::uniform, 21, true);
  const auto global_dy = make_output_grad<float>(desc(N, 1, precision), 21, true);
  const Outputs base = run_layer(global, global_dy);
  const MoeDesc gd = desc(N, 1, precision);
  for (int64_t R : {2, 3, 4}) {
    const int64_t T = N / R;
    ref::LayerInputs<float> in;
    in.desc = desc(T, R, precision);
    in.routed = global.routed;
    in.shared = global.shared;
    std::vector<std::vector<float>> dy;
    for (int64_t r = 0; r < R; ++r) {
      const auto rows = [&](const std::vector<float>& v, int64_t width) {
        return std::vector<float>(v.begin() + r * T * width, v.begin() + (r + 1) * T * width);
      };
      in.x.push_back(rows(global.x[0], gd.hidden));
      in.topk_w.push_back(rows(global.topk_w[0], gd.topk));
      in.topk_idx.emplace_back(global.topk_idx[0].begin() + r * T * gd.topk,
                               global.topk_idx[0].begin() + (r + 1) * T * gd.topk);
      dy.push_back(rows(global_dy[0], gd.hidden));
    }
    const Outputs o = run_layer(in, dy);
    expect_identical(o, base, "R=" + std::to_string(R), /*with_shared=*/false);
    // Shared weight gradient: sum of R partial sums against the single sum.
    const size_t per_rank = base.shared.size();
    std::vector<double> total(per_rank, 0.0);
    for (int64_t r = 0; r < R; ++r) {
      for (size_t i = 0; i < per_rank; ++i) total[i] += o.shared[r * per_rank + i];
    }
    EXPECT_TRUE(compare(total, base.shared).within(1e-5)) << "R=" << R;
  }
}

TEST(CpuGemm, BitsDoNotDependOnBlockingOrThreads) {
  ThreadGuard guard;
  Rng rng(3);
  const int64_t M = 37, N = 131, K = 203;
  std::vector<float> A(M * K), B(N * K);
  for (float& v : A) v = static_cast<float>(rng.normal());
  for (float& v : B) v = static_cast<float>(rng.normal());
  set_cpu_threads(1);
  std::vector<float> C(M * N);
  cpu::gemm_nt(M, N, K, A.data(), K, B.data(), K, C.data(), N);
  for (int threads : {2, 5}) {
    set_cpu_threads(threads);
    std::vector<float> D(M * N);
    cpu::gemm_nt(M, N, K, A.data(), K, B.data(), K, D.data(), N);
    EXPECT_EQ(first_bit_difference(C, D), -1) << threads;
  }
  // Each element computed alone (1x1 products) gives the same bits as inside the big product.
  for (int64_t m : {0, 17, 36}) {
    for (int64_t n : {0, 64, 130}) {
      float c = 0;
      cpu::gemm_nt(1, 1, K, A.data() + m * K, K, B.data() + n * K, K, &c, 1);
      EXPECT_EQ(c, C[m * N + n]) << m << "," << n;
    }
  }
  // And matches an fp64 product to fp32 accuracy.
  double diff = 0, norm = 0;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(A[m * K + k]) * B[n * K + k];
      diff += (s - C[m * N + n]) * (s - C[m * N + n]);
      norm += s * s;
    }
  }
  EXPECT_LT(std::sqrt(diff / norm), 1e-6);
}

}  // namespace
}  // namespace mok
