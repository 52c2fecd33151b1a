// GPU tests of the sm_90a expert kernels against the CPU reference's experts_forward stage.
// Fresh random inputs per case, outputs poisoned before every run, NaN never passes, and five
// reruns compared bit for bit. Runs only where a GPU is (tools/gpu.sh).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "mok/core/bf16.h"
#include "mok/core/compare.h"
#include "mok/core/problem.h"
#include "mok/core/reference.h"
#include "mok/cuda/expert_kernels.h"
#include "gpu_test_util.h"

namespace mok {
namespace {

using test::DeviceBuffer;
using test::from_bits;
using test::random_bf16;
using test::to_bits;

struct Case {
  std::string name;
  int64_t H, I, El;
  std::vector<int64_t> rows;  // real rows per expert
  std::optional<float> limit;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// MOK_EXPERT_SCHEDULE (and MOK_WGRAD_TILES) set for a scope, and unset again however the scope ends.
struct ScheduleEnv {
  explicit ScheduleEnv(const char* schedule, const char* wgrad_tiles = "") {
    ok = setenv("MOK_EXPERT_SCHEDULE", schedule, 1) == 0 && setenv("MOK_WGRAD_TILES", wgrad_tiles, 1) == 0;
  }
  ~ScheduleEnv() {
    unsetenv("MOK_EXPERT_SCHEDULE");
    unsetenv("MOK_WGRAD_TILES");
  }
  bool ok;
};

class ExpertKernels : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertKernels, ForwardMatchesTheReferenceAndIsDeterministic) {
  const Case& c = GetParam();
  const int64_t H = c.H, I = c.I, El = c.El;
  std::vector<int64_t> offsets{0};
  for (int64_t n : c.rows) offsets.push_back(offsets.back() + (n + cuda::kRowAlign - 1) / cuda::kRowAlign * cuda::kRowAlign);
  const int64_t M = offsets.back();
  const int64_t capacity = M + 2 * cuda::kRowAlign;  // slack past the last expert stays untouched

  Rng rng(std::hash<std::string>{}(c.name) ^ 0x9e37ull);
  std::vector<float> x(static_cast<size_t>(capacity * H), 0.0f);
  for (int64_t e = 0; e < El; ++e) {  // real rows random, padding rows zero
    for (int64_t r = offsets[e]; r < offsets[e] + c.rows[e]; ++r) {
      for (int64_t k = 0; k < H; ++k) x[r * H + k] = round_to_bf16(static_cast<float>(rng.normal()));
    }
  }
  const auto wg = random_bf16(rng, El * I * H, 1.0 / std::sqrt(double(H)));
  const auto wu = random_bf16(rng, El * I * H, 1.0 / std::sqrt(double(H)));
  const auto wd = random_bf16(rng, El * H * I, 1.0 / std::sqrt(double(I)));

  // The oracle: the CPU reference's stage, on the same rows.
  std::vector<float> gu_ref(M * 2 * I), h_ref(M * I), y_ref(M * H);
  const ref::ExpertsView<float> view{wg.data(), wu.data(), wd.data(), El};
  ref::experts_forward(ref::MlpShape{H, I, c.limit}, view, offsets, x.data(), gu_ref.data(), h_ref.data(),
                       y_ref.data(), ref::Rounding::bf16);

  DeviceBuffer<uint16_t> dx(x.size()), dwg(wg.size()), dwu(wu.size()), dwd(wd.size());
  DeviceBuffer<uint16_t> dgu(capacity * 2 * I), dh(capacity * I), dy(capacity * H);
  DeviceBuffer<int32_t> doff(offsets.size()), dstatus(1);
  ASSERT_TRUE(dx.ptr && dwg.ptr && dwu.ptr && dwd.ptr && dgu.ptr && dh.ptr && dy.ptr && doff.ptr && dstatus.ptr);
  dx.upload(to_bits(x));
  dwg.upload(to_bits(wg));
  dwu.upload(to_bits(wu));
  dwd.upload(to_bits(wd));
  doff.upload(std::vector<int32_t>(offsets.begin(), offsets.end()));
  CUDA_OK(cudaMemset(dstatus.ptr, 0, sizeof(int32_t)));

  cuda::ExpertsForwardArgs a;
  a.row_capacity = capacity;
  a.hidden = H;
  a.intermediate = I;
  a.local_experts = El;
  a.expert_offsets = doff.ptr;
  a.x = dx.ptr;
  a.w_gate = dwg.ptr;
  a.w_up = dwu.ptr;
  a.w_down = dwd.ptr;
  a.gu = dgu.ptr;
  a.h = dh.ptr;
  a.y = dy.ptr;
  a.swiglu_limit = c.limit;
  a.status = dstatus.ptr;
  ASSERT_EQ(cuda::can_implement(a), "");

  std::vector<uint16_t> first_gu, first_h, first_y;
  for (int run = 0; run < 5; ++run) {
    dgu.poison();
    dh.poison();
    dy.poison();
    cuda::experts_forward(a, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(dstatus.download()[0], 0);
    auto gu = dgu.download(), h = dh.download(), y = dy.download();
    if (run == 0) {
      // Rows [0, M) are all written (no poison left, no NaN); the slack past M is not touched.
      const auto gu_f = from_bits(gu), h_f = from_bits(h), y_f = from_bits(y);
      const std::vector<float> gu_m(gu_f.begin(), gu_f.begin() + M * 2 * I), h_m(h_f.begin(), h_f.begin() + M * I),
          y_m(y_f.begin(), y_f.begin() + M * H);
      const Comparison cg = compare(gu_m, gu_ref), ch = compare(h_m, h_ref), cy = compare(y_m, y_ref);
      EXPECT_TRUE(cg.within(1e-2)) << cg.describe("gu");
      EXPECT_TRUE(ch.within(1e-2)) << ch.describe("h");
      EXPECT_TRUE(cy.within(1e-2)) << cy.describe("y");
      std::printf("[ %s ] rel error gu %.2e h %.2e y %.2e (rows %lld)\n", c.name.c_str(), cg.rel_error, ch.rel_error,
                  cy.rel_error, static_cast<long long>(M));
      for (size_t i = M * H; i < y.size(); ++i) ASSERT_EQ(y[i], 0xffff) << "row past the experts was written";
      for (size_t i = M * I; i < h.size(); ++i) ASSERT_EQ(h[i], 0xffff) << "row past the experts was written";
      for (size_t i = M * 2 * I; i < gu.size(); ++i) ASSERT_EQ(gu[i], 0xffff) << "row past the experts was written";
      first_gu = std::move(gu);
      first_h = std::move(h);
      first_y = std::move(y);
    } else {
      EXPECT_EQ(first_bit_difference(gu, first_gu), -1) << "gu differs in run " << run;
      EXPECT_EQ(first_bit_difference(h, first_h), -1) << "h differs in run " << run;
      EXPECT_EQ(first_bit_difference(y, first_y), -1) << "y differs in run " << run;
    }
  }
  // The ping-pong schedule (one warpgroup per 64-row tile) reduces every output in the same k
  // order: the same bits, on every SM and then on 3 CTAs (many tiles each: both warpgroups take
  // turns many times).
  for (int run = 0; run < 2; ++run) {
    a.num_sms = run == 0 ? 0 : 3;
    dgu.poison();
    dh.poison();
    dy.poison();
    {
      const ScheduleEnv env("pingpong");
      ASSERT_TRUE(env.ok);
      cuda::experts_forward(a, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
    }
    ASSERT_EQ(dstatus.download()[0], 0);
    EXPECT_EQ(first_bit_difference(dgu.download(), first_gu), -1) << "ping-pong gu differs (run " << run << ")";
    EXPECT_EQ(first_bit_difference(dh.download(), first_h), -1) << "ping-pong h differs (run " << run << ")";
    EXPECT_EQ(first_bit_difference(dy.download(), first_y), -1) << "ping-pong y differs (run " << run << ")";
  }
}

std::vector<Case> cases() {
  return {
      {"small_balanced", 512, 256, 4, {200, 200, 200, 200}, std::nullopt},
      {"rows_not_multiple_of_tile", 384, 192, 3, {1, 129, 300}, std::nullopt},
      {"empty_experts", 256, 128, 5, {0, 77, 0, 0, 260}, std::nullopt},
      {"one_expert_takes_all", 256, 384, 4, {1000, 0, 0, 0}, std::nullopt},
      {"widths_not_multiple_of_tile", 328, 200, 2, {130, 70}, std::nullopt},
      {"clamped_swiglu", 256, 256, 2, {150, 90}, 0.75f},
      {"kimi_k2_shape", 7168, 2048, 2, {300, 170}, std::nullopt},
      {"gpt_oss_shape", 2880, 2880, 2, {200, 140}, 7.0f},
      {"qwen3_shape", 2048, 768, 8, {64, 100, 3, 0, 250, 128, 1, 40}, std::nullopt},
      // Every expert at most 256 rows and 16 x 9 = 144 columns of dW_gate: more than an H200's
      // 132 SMs, so even on every SM the weight gradients' columns order keeps B (with 2 and 4
      // k-blocks per expert mixed), not only on the 3-CTA runs.
      {"many_small_experts", 2304, 256, 16, {200, 256, 17, 0, 128, 90, 250, 1, 256, 64, 0, 129, 33, 256, 100, 7},
       std::nullopt},
  };
}

INSTANTIATE_TEST_SUITE_P(Gpu, ExpertKernels, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// The backward kernels against the reference's experts_backward stage, fed the same saved g|u and
// h (the reference forward's, bf16), dy rows and router weights. Padding rows are zero (and have
// router weight 0), as the dispatch writes them.
class ExpertBackwardKernels : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertBackwardKernels, BackwardMatchesTheReferenceAndIsDeterministic) {
  const Case& c = GetParam();
  const int64_t H = c.H, I = c.I, El = c.El;
  std::vector<int64_t> offsets{0};
  for (int64_t n : c.rows) offsets.push_back(offsets.back() + (n + cuda::kRowAlign - 1) / cuda::kRowAlign * cuda::kRowAlign);
  const int64_t M = offsets.back();
  Rng rng(std::hash<std::string>{}(c.name) ^ 0xb4c7ull);
  std::vector<float> x(static_cast<size_t>(M * H), 0.0f), dy(static_cast<size_t>(M * H), 0.0f), rw(static_cast<size_t>(M), 0.0f);
  for (int64_t e = 0; e < El; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e] + c.rows[e]; ++r) {
      for (int64_t k = 0; k < H; ++k) {
        x[r * H + k] = round_to_bf16(static_cast<float>(rng.normal()));
        dy[r * H + k] = round_to_bf16(static_cast<float>(rng.normal()));
      }
      rw[r] = static_cast<float>(0.05 + rng.uniform());
    }
  }
  const auto wg = random_bf16(rng, El * I * H, 1.0 / std::sqrt(double(H)));
  const auto wu = random_bf16(rng, El * I * H, 1.0 / std::sqrt(double(H)));
  const auto wd = random_bf16(rng, El * H * I, 1.0 / std::sqrt(double(I)));
  const ref::MlpShape shape{H, I, c.limit};
  const ref::ExpertsView<float> view{wg.data(), wu.data(), wd.data(), El};
  std::vector<float> gu(M * 2 * I), h(M * I), y(M * H);
  ref::experts_forward(shape, view, offsets, x.data(), gu.data(), h.data(), y.data(), ref::Rounding::bf16);
  std::vector<float> dx_ref(M * H), dw_ref(M), dg_ref(El * I * H), du_ref(El * I * H), dd_ref(El * H * I);
  ref::experts_backward(shape, view, offsets, x.data(), gu.data(), h.data(), dy.data(), rw.data(), dx_ref.data(),
                        dw_ref.data(), dg_ref.data(), du_ref.data(), dd_ref.data(), ref::Rounding::bf16);

  // The row buffers hold 256 rows more than the experts use: those rows must stay untouched.
  const int64_t cap = M + 2 * cuda::kRowAlign;
  const int64_t blocks = cuda::dw_partial_blocks(I);
  auto padded = [&](std::vector<float> v, int64_t width) {
    v.resize(static_cast<size_t>(cap * width), 0.0f);
    return v;
  };
  DeviceBuffer<uint16_t> dx_in(cap * H), dgu_in(cap * 2 * I), dh_in(cap * I), ddy(cap * H), dwg(wg.size()),
      dwu(wu.size()), dwd(wd.size()), dgu(cap * 2 * I), dhw(cap * I), ddx(cap * H);
  DeviceBuffer<float> drw(cap), dpartial(cap * blocks), ddw(cap), dWg(El * I * H), dWu(El * I * H), dWd(El * H * I);
  DeviceBuffer<int32_t> doff(offsets.size()), dstatus(1);
  dx_in.upload(to_bits(padded(x, H)));
  dgu_in.upload(to_bits(padded(gu, 2 * I)));
  dh_in.upload(to_bits(padded(h, I)));
  ddy.upload(to_bits(padded(dy, H)));
  dwg.upload(to_bits(wg));
  dwu.upload(to_bits(wu));
  dwd.upload(to_bits(wd));
  drw.upload(padded(rw, 1));
  doff.upload(std::vector<int32_t>(offsets.begin(), offsets.end()));
  CUDA_OK(cudaMemset(dstatus.ptr, 0, sizeof(int32_t)));

  cuda::ExpertsBackwardArgs a;
  a.row_capacity = cap;
  a.hidden = H;
  a.intermediate = I;
  a.local_experts = El;
  a.expert_offsets = doff.ptr;
  a.x = dx_in.ptr;
  a.gu = dgu_in.ptr;
  a.h = dh_in.ptr;
  a.dy = ddy.ptr;
  a.row_weight = drw.ptr;
  a.w_gate = dwg.ptr;
  a.w_up = dwu.ptr;
  a.w_down = dwd.ptr;
  a.dgu = dgu.ptr;
  a.hw = dhw.ptr;
  a.dw_partial = dpartial.ptr;
  a.dx = ddx.ptr;
  a.d_row_weight = ddw.ptr;
  a.d_w_gate = dWg.ptr;
  a.d_w_up = dWu.ptr;
  a.d_w_down = dWd.ptr;
  a.swiglu_limit = c.limit;
  a.status = dstatus.ptr;
  ASSERT_EQ(cuda::can_implement(a), "");

  std::vector<uint16_t> first_dx, first_dgu, first_hw;
  std::vector<float> first_dw, first_g, first_u, first_d;
  const auto poison_outputs = [&] {
    ddx.poison();
    ddw.poison();
    dWg.poison();
    dWu.poison();
    dWd.poison();
    dgu.poison();
    dhw.poison();
  };
  for (int run = 0; run < 5; ++run) {
    poison_outputs();
    cuda::experts_backward(a, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(dstatus.download()[0], 0);
    auto dx = ddx.download();
    auto dw = ddw.download(), g = dWg.download(), u = dWu.download(), d = dWd.download();
    if (run == 0) {
      for (size_t i = M * H; i < dx.size(); ++i) ASSERT_EQ(dx[i], 0xffff) << "dx row past the experts was written";
      for (size_t i = M; i < dw.size(); ++i) ASSERT_TRUE(std::isnan(dw[i])) << "d_row_weight past the experts written";
      const std::vector<float> dx_m = from_bits(std::vector<uint16_t>(dx.begin(), dx.begin() + M * H));
      const std::vector<float> dw_m(dw.begin(), dw.begin() + M);
      const Comparison cx = compare(dx_m, dx_ref), cw = compare(dw_m, dw_ref), cg = compare(g, dg_ref),
                       cu = compare(u, du_ref), cd = compare(d, dd_ref);
      EXPECT_TRUE(cx.within(1e-2)) << cx.describe("dx");
      EXPECT_TRUE(cw.within(1e-2)) << cw.describe("d_row_weight");
      EXPECT_TRUE(cg.within(1e-2)) << cg.describe("dW_gate");
      EXPECT_TRUE(cu.within(1e-2)) << cu.describe("dW_up");
      EXPECT_TRUE(cd.within(1e-2)) << cd.describe("dW_down");
      std::printf("[ %s backward ] rel error dx %.2e dw %.2e dWg %.2e dWu %.2e dWd %.2e\n", c.name.c_str(),
                  cx.rel_error, cw.rel_error, cg.rel_error, cu.rel_error, cd.rel_error);
      // Empty experts: their weight gradients are exactly zero (written, not left poisoned).
      for (int64_t e = 0; e < El; ++e) {
        if (c.rows[e] != 0) continue;
        for (int64_t i = e * I * H; i < (e + 1) * I * H; ++i) {
          ASSERT_EQ(g[i], 0.0f) << "dW_gate of empty expert " << e;
          ASSERT_EQ(u[i], 0.0f) << "dW_up of empty expert " << e;
          ASSERT_EQ(d[i], 0.0f) << "dW_down of empty expert " << e;
        }
      }
      first_dx = std::move(dx);
      first_dgu = dgu.download();  // the dh launch's own outputs, for the ping-pong runs below
      first_hw = dhw.download();
      first_dw = std::move(dw);
      first_g = std::move(g);
      first_u = std::move(u);
      first_d = std::move(d);
    } else {
      EXPECT_EQ(first_bit_difference(dx, first_dx), -1) << "dx differs in run " << run;
      EXPECT_EQ(first_bit_difference(dw, first_dw), -1) << "d_row_weight differs in run " << run;
      EXPECT_EQ(first_bit_difference(g, first_g), -1) << "dW_gate differs in run " << run;
      EXPECT_EQ(first_bit_difference(u, first_u), -1) << "dW_up differs in run " << run;
      EXPECT_EQ(first_bit_difference(d, first_d), -1) << "dW_down differs in run " << run;
    }
  }

  // Every launch on each schedule, the same bits as the defaults above: cooperative (128-row
  // tiles; the dh launch's default is ping-pong, one warpgroup per 64-row tile) and ping-pong (the
  // weight gradients' form: cooperative tiles whose two warpgroups take turns, each storing its 64
  // rows under the other's mainloop), each with the weight gradients in the columns order (the
  // default: B kept across a column's tiles, stages holding B k-blocks of other experts and
  // columns as the k-blocks per expert change) and in the rows order, on every SM and then on 3
  // CTAs (many tiles each).
  for (const char* schedule : {"cooperative", "pingpong"}) {
    for (int run = 0; run < 4; ++run) {
      a.num_sms = run % 2 == 0 ? 0 : 3;
      const char* tiles = run < 2 ? "columns" : "rows";
      poison_outputs();
      {
        const ScheduleEnv env(schedule, tiles);
        ASSERT_TRUE(env.ok);
        cuda::experts_backward(a, nullptr);
        CUDA_OK(cudaDeviceSynchronize());
      }
      ASSERT_EQ(dstatus.download()[0], 0);
      const std::string where = std::string(schedule) + ", " + tiles + " (run " + std::to_string(run) + ")";
      EXPECT_EQ(first_bit_difference(dgu.download(), first_dgu), -1) << "dg|du differs, " << where;
      EXPECT_EQ(first_bit_difference(dhw.download(), first_hw), -1) << "w*h differs, " << where;
      EXPECT_EQ(first_bit_difference(ddx.download(), first_dx), -1) << "dx differs, " << where;
      EXPECT_EQ(first_bit_difference(ddw.download(), first_dw), -1) << "d_row_weight differs, " << where;
      EXPECT_EQ(first_bit_difference(dWg.download(), first_g), -1) << "dW_gate differs, " << where;
      EXPECT_EQ(first_bit_difference(dWu.download(), first_u), -1) << "dW_up differs, " << where;
      EXPECT_EQ(first_bit_difference(dWd.download(), first_d), -1) << "dW_down differs, " << where;
    }
  }
  a.num_sms = 0;

  // bf16 weight gradients (d_w_type = bf16): the fp32 ones rounded to nearest even, bit for bit
  // (the same accumulation, one rounding in the epilogue), on poisoned buffers: the default
  // schedule, then each forced on 3 CTAs.
  DeviceBuffer<uint16_t> hWg(El * I * H), hWu(El * I * H), hWd(El * H * I);
  a.d_w_gate = hWg.ptr;
  a.d_w_up = hWu.ptr;
  a.d_w_down = hWd.ptr;
  a.d_w_type = cuda::GradType::bf16;
  ASSERT_EQ(cuda::can_implement(a), "");
  const std::vector<uint16_t> want_g = to_bits(first_g), want_u = to_bits(first_u), want_d = to_bits(first_d);
  for (const char* schedule : {"", "cooperative", "pingpong"}) {
    hWg.poison();
    hWu.poison();
    hWd.poison();
    {
      const ScheduleEnv env(schedule);
      ASSERT_TRUE(env.ok);
      a.num_sms = *schedule == '\0' ? 0 : 3;
      cuda::experts_backward(a, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
    }
    ASSERT_EQ(dstatus.download()[0], 0);
    const std::string where = *schedule == '\0' ? std::string("default schedule") : std::string(schedule);
    EXPECT_EQ(first_bit_difference(hWg.download(), want_g), -1) << "bf16 dW_gate is not fp32's rounded, " << where;
    EXPECT_EQ(first_bit_difference(hWu.download(), want_u), -1) << "bf16 dW_up is not fp32's rounded, " << where;
    EXPECT_EQ(first_bit_difference(hWd.download(), want_d), -1) << "bf16 dW_down is not fp32's rounded, " << where;
  }
  a.num_sms = 0;
}

INSTANTIATE_TEST_SUITE_P(Gpu, ExpertBackwardKernels, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

TEST(ExpertKernelsArgs, BadOffsetsAreReportedNotComputed) {
  DeviceBuffer<uint16_t> buf(256 * 256 * 4);
  DeviceBuffer<int32_t> doff(3), dstatus(1);
  doff.upload({0, 100, 256});  // 100 is not a multiple of 128
  CUDA_OK(cudaMemset(dstatus.ptr, 0, sizeof(int32_t)));
  cuda::ExpertsForwardArgs a;
  a.row_capacity = 256;
  a.hidden = 64;
  a.intermediate = 64;
  a.local_experts = 2;
  a.expert_offsets = doff.ptr;
  a.x = a.w_gate = a.w_up = a.w_down = buf.ptr;
  a.h = a.y = buf.ptr;
  a.status = dstatus.ptr;
  cuda::experts_forward(a, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(dstatus.download()[0], cuda::kStatusMisalignedOffsets);
  a.hidden = 60;
  EXPECT_NE(cuda::can_implement(a).find("hidden must be a positive multiple of 8"), std::string::npos);
}

// A thread whose first CUDA call is a launcher (torch's autograd threads, whose tensors came from
// its allocator's cache, are such threads): no context is bound to it yet, and the launcher's TMA
// descriptors, made with the driver, need one (session 20: an illegal instruction in mok.moe's fp8
// backward). The launch from a fresh thread gives the main thread's bits.
TEST(ExpertKernelsThreads, AThreadWhoseFirstCudaCallIsALauncherComputesTheSameBits) {
  const int64_t H = 512, I = 256, El = 2, M = 256;
  Rng rng(0x7e5d);
  const auto x = random_bf16(rng, M * H, 1.0), wg = random_bf16(rng, El * I * H, 0.05),
             wu = random_bf16(rng, El * I * H, 0.05), wd = random_bf16(rng, El * H * I, 0.06);
  DeviceBuffer<uint16_t> dx(x.size()), dwg(wg.size()), dwu(wu.size()), dwd(wd.size()), dh(M * I), dy(M * H);
  DeviceBuffer<int32_t> doff(El + 1), dstatus(1);
  ASSERT_TRUE(dx.ptr && dwg.ptr && dwu.ptr && dwd.ptr && dh.ptr && dy.ptr && doff.ptr && dstatus.ptr);
  dx.upload(to_bits(x));
  dwg.upload(to_bits(wg));
  dwu.upload(to_bits(wu));
  dwd.upload(to_bits(wd));
  doff.upload({0, 128, 256});
  CUDA_OK(cudaMemset(dstatus.ptr, 0, sizeof(int32_t)));
  cuda::ExpertsForwardArgs a;
  a.row_capacity = M;
  a.hidden = H;
  a.intermediate = I;
  a.local_experts = El;
  a.expert_offsets = doff.ptr;
  a.x = dx.ptr;
  a.w_gate = dwg.ptr;
  a.w_up = dwu.ptr;
  a.w_down = dwd.ptr;
  a.h = dh.ptr;
  a.y = dy.ptr;
  a.status = dstatus.ptr;
  cuda::experts_forward(a, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  const auto want = dy.download();
  dy.poison();
  dh.poison();
  CUDA_OK(cudaDeviceSynchronize());

  // The driver's cuCtxGetCurrent, looked up here: the lookup is a runtime call, which in the
  // thread below would bind the context itself.
  using CtxGetCurrent = int (*)(void**);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  CUDA_OK(cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault, &found));
  ASSERT_TRUE(fn != nullptr && found == cudaDriverEntryPointSuccess);
  void* context_before = &context_before;  // not null: the thread must overwrite it
  std::string error;
  std::thread launcher([&] {
    reinterpret_cast<CtxGetCurrent>(fn)(&context_before);
    try {
      cuda::experts_forward(a, nullptr);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  launcher.join();
  ASSERT_EQ(error, "");
  CUDA_OK(cudaDeviceSynchronize());
  // (What makes this test mean something: the launch came first in a thread with no context.)
  std::printf("[ fresh thread ] context bound before the launch: %s\n", context_before ? "yes" : "no");
  EXPECT_EQ(context_before, nullptr) << "the fresh thread had a context already: the test no longer covers the case";
  EXPECT_EQ(dstatus.download()[0], 0);
  EXPECT_EQ(first_bit_difference(dy.download(), want), -1) << "y from the fresh thread differs";
}

}  // namespace
}  // namespace mok
