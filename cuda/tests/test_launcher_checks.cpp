// Launcher checks that run on the host (can_implement touches no GPU), with every ctest.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "mok/cuda/expert_kernels.h"
#include "mok/cuda/fp8.h"
#include "mok/cuda/megakernel.h"

namespace mok::cuda {
namespace {

// The push epilogue packs a row's destination as rank << 24 | slot: both passes' launchers refuse
// T*k >= 2^24 by name.
template <class Args>
void expect_slot_limit() {
  const char* what = "tokens_per_rank * topk must be < 2^24";
  Args a;
  a.shape = RoutingShape{2, (int64_t{1} << 24) / 8, 8, 16};  // T*k = 2^24
  EXPECT_NE(can_implement(a).find(what), std::string::npos) << can_implement(a);
  a.shape.tokens_per_rank -= 1;  // T*k = 2^24 - 8
  EXPECT_EQ(can_implement(a).find(what), std::string::npos) << can_implement(a);
}

TEST(MegakernelChecks, CombineSlotsPastTwoToThe24AreRefusedByName) {
  expect_slot_limit<MoeForwardArgs>();
  expect_slot_limit<MoeBackwardArgs>();
}

// A megakernel task's id shares a 32-bit word with the padding-half flag (bit 30): a call of 2^30
// tiles or more is refused by name, one row block fewer is not (both passes).
TEST(MegakernelChecks, CallsOfTwoToThe30TilesAreRefusedByName) {
  const char* what = "too many tiles for one forward call";
  MoeForwardArgs a;
  a.hidden = 256;         // 1 down column tile of 256
  a.intermediate = 16384;  // 128 gate|up column tiles of 128: 129 tiles per row block
  const int64_t blocks = ((int64_t{1} << 30) + 128) / 129;  // the fewest row blocks reaching 2^30 tiles
  a.row_capacity = blocks * 128;                             // (under the 2^30 rows refused on their own)
  ASSERT_LE(a.row_capacity, int64_t{1} << 30);
  EXPECT_NE(can_implement(a).find(what), std::string::npos) << can_implement(a);
  a.row_capacity -= 128;
  EXPECT_EQ(can_implement(a).find(what), std::string::npos) << can_implement(a);

  // The fused backward: 128 dh column tiles of 256 (dw_partial_blocks) and 1 dx tile per row
  // block, then one expert's weight-gradient tiles: 256 x 1 of dW_gate and of dW_up, 2 x 128 of
  // dW_down.
  const char* backward = "too many tiles for one fused backward call";
  MoeBackwardArgs b;
  b.fused = true;
  b.shape = RoutingShape{1, 1, 1, 1};
  b.hidden = 256;
  b.intermediate = 32768;
  const int64_t wgrad = 2 * 256 + 2 * 128;
  b.row_capacity = ((int64_t{1} << 30) - wgrad + 128) / 129 * 128;  // the fewest row blocks reaching 2^30
  ASSERT_LE(b.row_capacity, int64_t{1} << 30);
  EXPECT_NE(can_implement(b).find(backward), std::string::npos) << can_implement(b);
  b.row_capacity -= 128;
  EXPECT_EQ(can_implement(b).find(backward), std::string::npos) << can_implement(b);
  b.fused = false;  // the stage kernels have no task ids
  b.row_capacity += 128;
  EXPECT_EQ(can_implement(b).find(backward), std::string::npos) << can_implement(b);
}

// The fp8 forward (MoeForwardArgs::fp8): whole 128-column scale blocks, its buffers, and twice the
// bf16 forward's tiles per row block in the tile limit, each refused by name; FusedBuffers refuses
// partial blocks before allocating anything; its backward (fp8_forward) replays only with the
// forward's gate|up weights.
TEST(MegakernelChecks, Fp8ForwardArgumentsAreRefusedByName) {
  MoeForwardArgs a;
  a.fp8 = true;
  a.hidden = 200;
  a.intermediate = 256;
  EXPECT_NE(can_implement(a).find("fp8 needs hidden and intermediate multiples of 128"), std::string::npos)
      << can_implement(a);
  EXPECT_NE(can_implement(a).find("fp8 needs the weights' scales"), std::string::npos) << can_implement(a);
  a.hidden = 256;
  EXPECT_EQ(can_implement(a).find("multiples of 128"), std::string::npos) << can_implement(a);
  a.fp8 = false;
  EXPECT_EQ(can_implement(a).find("fp8"), std::string::npos) << can_implement(a);

  // 1 down tile of 128 and 256 gate|up tiles of 64 + 64 columns: 257 tiles per row block.
  const char* what = "too many tiles for one forward call";
  a.fp8 = true;
  a.hidden = 128;
  a.intermediate = 16384;
  a.row_capacity = ((int64_t{1} << 30) + 256) / 257 * 128;  // the fewest row blocks reaching 2^30 tiles
  EXPECT_NE(can_implement(a).find(what), std::string::npos) << can_implement(a);
  a.row_capacity -= 128;
  EXPECT_EQ(can_implement(a).find(what), std::string::npos) << can_implement(a);

  const RoutingShape shape{1, 64, 2, 4};
  MoeBackwardArgs back;
  back.fp8_forward = true;
  back.replay = true;
  EXPECT_NE(can_implement(back).find("an fp8 replay needs the forward's gate|up weights"), std::string::npos)
      << can_implement(back);
  back.replay = false;
  EXPECT_NE(can_implement(back).find("x_rows (scratch), h and gu (the fp8 forward's kept rows) must be set"),
            std::string::npos)
      << can_implement(back);
  try {
    FusedBuffers b(shape, 256, 192, 128, 128, /*keep_rows=*/false, /*fp8=*/true);
    ADD_FAILURE() << "fp8 with intermediate 192 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fp8 needs hidden and intermediate multiples of 128"), std::string::npos)
        << e.what();
  }
}

// MOK_EXPERT_SCHEDULE (the benchmark's switch between the expert GEMMs' two schedules) takes
// cooperative or pingpong, MOK_WGRAD_TILES (the weight gradients' tile order) columns or rows;
// anything else is refused by name, by can_implement and before a kernel is launched (the
// arguments point at host memory: a launch would fail with a CUDA error instead).
TEST(ExpertScheduleChecks, AnUnknownScheduleIsRefusedByName) {
  std::vector<uint16_t> rows(128 * 64);
  std::vector<int32_t> offsets{0, 128};
  ExpertsForwardArgs f;
  f.row_capacity = 128;
  f.hidden = f.intermediate = 64;
  f.local_experts = 1;
  f.expert_offsets = offsets.data();
  f.x = f.w_gate = f.w_up = f.w_down = rows.data();
  f.h = f.y = rows.data();
  ASSERT_EQ(can_implement(f), "");
  ExpertsBackwardArgs b;
  b.row_capacity = 128;
  b.hidden = b.intermediate = 64;
  b.local_experts = 1;
  b.expert_offsets = offsets.data();
  b.x = b.gu = b.h = b.dy = b.w_gate = b.w_up = b.w_down = rows.data();
  b.dgu = b.hw = b.dx = b.d_w_gate = b.d_w_up = b.d_w_down = rows.data();
  b.row_weight = b.dw_partial = b.d_row_weight = reinterpret_cast<float*>(rows.data());
  ASSERT_EQ(can_implement(b), "");
  const auto refused = [](auto&& call) {
    try {
      call();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    } catch (const std::exception& e) {
      return std::string("not refused by name: ") + e.what();
    }
    return std::string("not refused");
  };
  struct Bad {
    const char* variable;
    const char* value;
    const char* message;
  };
  for (const Bad& bad :
       {Bad{"MOK_EXPERT_SCHEDULE", "pingpong2",
            "MOK_EXPERT_SCHEDULE must be cooperative or pingpong, got 'pingpong2'"},
        Bad{"MOK_WGRAD_TILES", "diagonal", "MOK_WGRAD_TILES must be columns or rows, got 'diagonal'"}}) {
    ASSERT_EQ(setenv(bad.variable, bad.value, 1), 0);
    const std::string forward = refused([&] { experts_forward(f, nullptr); });
    const std::string backward = refused([&] { experts_backward(b, nullptr); });
    // can_implement names it too: the megakernel's stage kernels refuse it before any launch.
    const std::string checked_forward = can_implement(f), checked_backward = can_implement(b);
    unsetenv(bad.variable);
    for (const std::string& what : {forward, backward, checked_forward, checked_backward})
      EXPECT_NE(what.find(bad.message), std::string::npos) << what;
  }
}

// The fp8 forward's arguments (fp8.h: experts_forward_fp8): whole scale blocks, 16-byte scale
// rows, every operand with its scales; refused by name by can_implement and before any launch
// (the pointers are host memory: a launch would fail with a CUDA error instead).
TEST(Fp8ExpertsForwardArgs, BadArgumentsAreRefusedByName) {
  std::vector<uint8_t> bytes(64);
  std::vector<float> scales(64);
  std::vector<int32_t> offsets{0, 128};
  ExpertsForwardFp8Args a;
  a.row_capacity = 128;
  a.hidden = 256;
  a.intermediate = 128;
  a.local_experts = 1;
  a.expert_offsets = offsets.data();
  a.x = a.w_gate = a.w_up = a.w_down = bytes.data();
  a.h_codes = bytes.data();
  a.x_scales = a.w_gate_scales = a.w_up_scales = a.w_down_scales = scales.data();
  a.h_scales = scales.data();
  a.h = a.y = bytes.data();
  ASSERT_EQ(can_implement(a), "");
  const auto refused = [&](auto&& change, const char* message) {
    ExpertsForwardFp8Args b = a;
    change(b);
    const std::string why = can_implement(b);
    EXPECT_NE(why.find(message), std::string::npos) << why;
    try {
      experts_forward_fp8(b, nullptr);
      ADD_FAILURE() << "not refused: " << message;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  refused([](auto& b) { b.intermediate = 192; }, "intermediate must be a positive multiple of 128");
  refused([](auto& b) { b.hidden = 100; }, "hidden must be a positive multiple of 128");
  refused([](auto& b) { b.row_capacity = 130; }, "row_capacity must be a multiple of 4");
  refused([](auto& b) { b.w_up_scales = nullptr; }, "must not be null");
  refused([](auto& b) { b.swiglu_limit = -1.0f; }, "swiglu_limit must be > 0");
  refused([](auto& b) { b.local_experts = 0; }, "local_experts must be in");
  // The fp8 switches (fp8_experts.cu: MOK_FP8_CLUSTER, MOK_FP8_FUSED_DGU) are checked with the arguments.
  ASSERT_EQ(setenv("MOK_FP8_CLUSTER", "two", 1), 0);
  refused([](auto&) {}, "MOK_FP8_CLUSTER must be on or off, got 'two'");
  unsetenv("MOK_FP8_CLUSTER");
  ASSERT_EQ(setenv("MOK_FP8_FUSED_DGU", "maybe", 1), 0);
  refused([](auto&) {}, "MOK_FP8_FUSED_DGU must be on or off, got 'maybe'");
  unsetenv("MOK_FP8_FUSED_DGU");
}

// The fp8 dgrad's arguments (fp8.h: experts_dgrad_fp8): whole scale blocks, 16-byte scale rows,
// every operand, output and scratch; refused by name by can_implement and before any launch
// (host pointers: a launch would fail with a CUDA error instead).
TEST(Fp8ExpertsDgradArgs, BadArgumentsAreRefusedByName) {
  std::vector<uint8_t> bytes(64);
  std::vector<float> floats(64);
  std::vector<int32_t> offsets{0, 128};
  ExpertsDgradFp8Args a;
  ExpertsBackwardArgs& b = a.base;
  b.row_capacity = 128;
  b.hidden = 256;
  b.intermediate = 128;
  b.local_experts = 1;
  b.expert_offsets = offsets.data();
  b.gu = b.h = b.dy = b.dgu = b.hw = b.dx = bytes.data();
  b.row_weight = b.dw_partial = b.d_row_weight = floats.data();
  a.w_down_t = a.w_gate_up_t = a.dy_codes = a.dgu_codes = bytes.data();
  a.w_down_t_scales = a.w_gate_up_t_scales = a.dy_scales = a.dgu_scales = floats.data();
  ASSERT_EQ(can_implement(a), "");
  const auto refused = [&](auto&& change, const char* message) {
    ExpertsDgradFp8Args c = a;
    change(c);
    const std::string why = can_implement(c);
    EXPECT_NE(why.find(message), std::string::npos) << why;
    try {
      experts_dgrad_fp8(c, nullptr);
      ADD_FAILURE() << "not refused: " << message;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  refused([](auto& c) { c.base.intermediate = 192; }, "intermediate must be a positive multiple of 128");
  refused([](auto& c) { c.base.hidden = 100; }, "hidden must be a positive multiple of 128");
  refused([](auto& c) { c.base.row_capacity = 130; }, "row_capacity must be a multiple of 4");
  refused([](auto& c) { c.base.dw_partial = nullptr; }, "dw_partial");
  refused([](auto& c) { c.w_gate_up_t_scales = nullptr; }, "w_down_t and w_gate_up_t");
  refused([](auto& c) { c.dgu_codes = nullptr; }, "the scratch");
  refused([](auto& c) { c.base.swiglu_limit = 0.0f; }, "swiglu_limit must be > 0");
  refused([](auto& c) { c.base.expert_offsets = nullptr; }, "expert_offsets is null");
}

}  // namespace
}  // namespace mok::cuda
