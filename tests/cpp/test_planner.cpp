// Planner heuristics on the preset shapes, checked against hand-computed values.
#include <gtest/gtest.h>

#include "mok/core/error.h"
#include "mok/core/planner.h"
#include "mok/core/presets.h"
#include "mok/core/symmetric_layout.h"

namespace mok {
namespace {

TEST(Planner, KimiK2OnTwoH200s) {
  const MoeConfig c = plan(find_preset("kimi-k2").desc(2, 8192), DeviceFacts::h200());
  // No comm SMs (comm warps in every CTA pull the rows): 132 compute SMs. As comm CTAs, 372 GB/s
  // at 24 GB/s per SM = 15.5 -> 16 (even).
  EXPECT_EQ(c.comm_sms, 0);
  EXPECT_EQ(c.compute_sms, 132);
  EXPECT_EQ(comm_ctas_for_peer_reads(find_preset("kimi-k2").desc(2, 8192), DeviceFacts::h200()), 16);
  // gate|up: 2I = 4096 -> 16 tiles of 256; down: H = 7168 -> 28. Two waves over 132 SMs need
  // 264 tiles -> ceil(264/16) = 17 row tiles of 128 = 2176 rows.
  EXPECT_EQ(c.minibatch_rows, 2176);
  // Ring row: x and h, 2H + 2I = 2*7168 + 2*2048 = 18432 bytes. 512 MiB / 18432 = 29127 rows
  // -> 13 minibatches = 28288.
  EXPECT_EQ(c.ring_row_bytes, 18432);
  EXPECT_EQ(c.ring_rows, 28288);
  EXPECT_EQ(c.expected_rows, 8192 * 8);
  EXPECT_FALSE(c.keeps_forward_context);
  // 6 * (T*k*I + T*Is) * H = 6 * 7168 * 2048 * (65536 + 8192).
  EXPECT_DOUBLE_EQ(c.forward.flops, 6.0 * 7168 * 2048 * (65536 + 8192));
  EXPECT_STREQ(c.forward.bound_by, "GEMM");
  EXPECT_NEAR(c.forward.floor_ms, c.forward.flops / 790e12 * 1e3, 1e-9);
  // Per direction: T*k rows of H bf16, half of them remote, in both dispatch and combine.
  EXPECT_DOUBLE_EQ(c.forward.nvlink_bytes, 2.0 * 65536 * 7168 * 2 * 0.5);
  EXPECT_NE(c.explanation.find("minibatch: 2176 rows"), std::string::npos) << c.explanation;
  EXPECT_NE(c.explanation.find("comm SMs: 0: 3 warps of every CTA pull the rows"), std::string::npos);
  // The kept context, 65536 rows x (2H + 6I) = 65536 x 26624 bytes = 1.62 GiB, and a backward with
  // no replay: 12 * (T*k*I + T*Is) * H flops.
  EXPECT_NE(c.explanation.find("training context: the forward keeps x, g|u and h of every row for the backward, "
                               "1.62 GiB per rank"),
            std::string::npos)
      << c.explanation;
  EXPECT_DOUBLE_EQ(c.backward.flops, 12.0 * 7168 * 2048 * (65536 + 8192));
}

TEST(Planner, PaddingIsTheShareOfRowTilesOnNoRow) {
  // Kimi K2 on 2 ranks at 8192 tokens: 2*8192*8/384 = 341.33 rows per expert, 342 padded to 384.
  const MoeConfig kimi = plan(find_preset("kimi-k2").desc(2, 8192), DeviceFacts::h200());
  EXPECT_NEAR(kimi.rows_per_expert, 341.333, 1e-3);
  EXPECT_EQ(kimi.padded_rows_per_expert, 384);
  EXPECT_NEAR(kimi.padding_share, 1.0 - 341.333 / 384, 1e-5);
  EXPECT_NE(kimi.explanation.find("padding: 341.3 rows per expert under balanced routing, 384 in 128-row tiles: 11%"),
            std::string::npos)
      << kimi.explanation;
  // DeepSeek-V4 at 2048 tokens: 2*2048*6/384 = 64 rows, half of each 128-row tile; at 8192, 256: none.
  const MoeConfig small = plan(find_preset("deepseek-v4-pro").desc(2, 2048), DeviceFacts::h200());
  EXPECT_EQ(small.padded_rows_per_expert, 128);
  EXPECT_DOUBLE_EQ(small.padding_share, 0.5);
  const MoeConfig large = plan(find_preset("deepseek-v4-pro").desc(2, 8192), DeviceFacts::h200());
  EXPECT_EQ(large.padded_rows_per_expert, 256);
  EXPECT_DOUBLE_EQ(large.padding_share, 0.0);
  // No tokens: nothing to pad.
  const MoeConfig none = plan(find_preset("tiny").desc(2, 0), DeviceFacts::h200());
  EXPECT_EQ(none.padded_rows_per_expert, 0);
  EXPECT_DOUBLE_EQ(none.padding_share, 0.0);
}

TEST(Planner, TheBackwardPathFollowsTheShareOfCommunication) {
  // Backward NVLink bytes: 2 passes (dy pull, dx push) x T*k rows x H bf16, half remote; GEMM
  // flops: 12 * T*k * I * H (the shared expert's too, when the preset has one).
  for (const char* name : {"kimi-k2", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v4-pro"}) {
    const MoeDesc d = find_preset(name).desc(2, 8192);
    const MoeConfig c = plan(d, DeviceFacts::h200());
    const double share = c.backward.nvlink_ms / c.backward.gemm_ms;
    EXPECT_EQ(c.fused_backward, share >= kFusedBackwardCommShare) << name << " share " << share;
    EXPECT_NE(c.explanation.find(c.fused_backward ? "backward path: one megakernel launch: its NVLink time is"
                                                  : "backward path: stage kernels: its NVLink time is"),
              std::string::npos)
        << c.explanation;
  }
  // The measured sides (planner.h): qwen3-30b fused, kimi-k2 and mixtral as stage kernels.
  EXPECT_TRUE(plan(find_preset("qwen3-30b-a3b").desc(2, 8192), DeviceFacts::h200()).fused_backward);
  EXPECT_FALSE(plan(find_preset("kimi-k2").desc(2, 8192), DeviceFacts::h200()).fused_backward);
  EXPECT_FALSE(plan(find_preset("mixtral-8x7b").desc(2, 8192), DeviceFacts::h200()).fused_backward);
  // One rank moves nothing over NVLink: stage kernels. An override wins either way.
  EXPECT_FALSE(plan(find_preset("qwen3-30b-a3b").desc(1, 8192), DeviceFacts::h200()).fused_backward);
  PlanOverrides fused;
  fused.fused_backward = true;
  const MoeConfig c = plan(find_preset("kimi-k2").desc(2, 8192), DeviceFacts::h200(), fused);
  EXPECT_TRUE(c.fused_backward);
  EXPECT_NE(c.explanation.find("backward path: one megakernel launch (given)"), std::string::npos);
}

TEST(Planner, OneRankUsesALocalGather) {
  const MoeConfig c = plan(find_preset("kimi-k2").desc(1, 8192), DeviceFacts::h200());
  EXPECT_EQ(c.comm_sms, 0);
  EXPECT_EQ(comm_ctas_for_peer_reads(find_preset("kimi-k2").desc(1, 8192), DeviceFacts::h200()), 4);
  // 264 tiles over 16 column tiles -> 17 row tiles.
  EXPECT_EQ(c.minibatch_rows, 2176);
  EXPECT_EQ(c.forward.nvlink_bytes, 0.0);
}

TEST(Planner, NarrowestGemmDecides) {
  // qwen3-30b-a3b: 2I = 1536 -> 6 tiles, H = 2048 -> 8 tiles: ceil(264/6) = 44 row tiles.
  EXPECT_EQ(plan(find_preset("qwen3-30b-a3b").desc(2, 2048), DeviceFacts::h200()).minibatch_rows, 44 * 128);
  // mixtral: down (H = 4096 -> 16 tiles) is narrower than gate|up (2I = 28672 -> 112 tiles).
  EXPECT_EQ(plan(find_preset("mixtral-8x7b").desc(2, 8192), DeviceFacts::h200()).minibatch_rows, 2176);
}

TEST(Planner, SmallBatchesTakeOneMinibatch) {
  const MoeConfig c = plan(find_preset("tiny").desc(2, 10), DeviceFacts::h200());
  EXPECT_EQ(c.minibatch_rows, 128);  // 20 expected rows, one row tile
  EXPECT_TRUE(c.keeps_forward_context);
  const MoeConfig empty = plan(find_preset("tiny").desc(2, 0), DeviceFacts::h200());
  EXPECT_EQ(empty.minibatch_rows, 128);
  EXPECT_GE(empty.ring_rows, empty.minibatch_rows);
}

TEST(Planner, RingIsCappedByTheWorstCaseAndRaisedToOneMinibatch) {
  // tiny at T=100, R=2: at most R*T*k = 400 rows (+ padding) can arrive.
  const MoeConfig c = plan(find_preset("tiny").desc(2, 100), DeviceFacts::h200());
  EXPECT_EQ(c.minibatch_rows, 256);
  // Capacity 400 + 4 experts * 127 padding = 908 rows -> 4 minibatches of 256; the budget
  // (512 MiB) would hold far more.
  EXPECT_EQ(c.ring_rows, 1024);
  PlanOverrides tight;
  tight.ring_budget_bytes = 1;
  const MoeConfig t = plan(find_preset("kimi-k2").desc(2, 8192), DeviceFacts::h200(), tight);
  EXPECT_EQ(t.ring_rows, t.minibatch_rows);
  EXPECT_NE(t.explanation.find("raised to one minibatch"), std::string::npos);
}

TEST(Planner, OverridesAreHonouredAndChecked) {
  const MoeDesc d = find_preset("glm-5.2").desc(2, 4096);
  PlanOverrides ov;
  ov.comm_sms = 20;
  ov.minibatch_rows = 512;
  ov.ring_rows = 2048;
  const MoeConfig c = plan(d, DeviceFacts::h200(), ov);
  EXPECT_EQ(c.comm_sms, 20);
  EXPECT_EQ(c.compute_sms, 112);
  EXPECT_EQ(c.minibatch_rows, 512);
  EXPECT_EQ(c.ring_rows, 2048);
  PlanOverrides bad;
  bad.minibatch_rows = 100;
  EXPECT_THROW(plan(d, DeviceFacts::h200(), bad), InvalidArgument);
  bad = {};
  bad.ring_rows = 1000;
  EXPECT_THROW(plan(d, DeviceFacts::h200(), bad), InvalidArgument);
  bad = {};
  bad.comm_sms = 132;
  EXPECT_THROW(plan(d, DeviceFacts::h200(), bad), InvalidArgument);
  bad.comm_sms = -1;
  EXPECT_THROW(plan(d, DeviceFacts::h200(), bad), InvalidArgument);
  PlanOverrides warps;
  warps.comm_sms = 0;
  EXPECT_EQ(plan(d, DeviceFacts::h200(), warps).compute_sms, 132);
}

TEST(Planner, EveryPresetPlansAtTwoAndSixtyFourRanks) {
  for (const ModelPreset& p : model_presets()) {
    for (int64_t R : {2, 64}) {
      const MoeDesc d = p.desc(R, 2048);
      if (p.num_experts % R != 0) {
        EXPECT_THROW(plan(d, DeviceFacts::h200()), InvalidArgument) << p.name << " R=" << R;
        continue;
      }
      const MoeConfig c = plan(d, DeviceFacts::h200());
      EXPECT_GT(c.minibatch_rows, 0);
      EXPECT_EQ(c.minibatch_rows % c.tiles.block_m, 0);
      EXPECT_EQ(c.ring_rows % c.minibatch_rows, 0);
      EXPECT_GT(c.forward.floor_ms, 0.0) << p.name;
      EXPECT_GE(c.backward.floor_ms, c.forward.floor_ms) << p.name;
      EXPECT_GE(c.schedule_capacity_rows, R * 2048 * p.topk);
    }
  }
}

TEST(Planner, TheCpuDeviceLeavesComputeSms) {
  for (int64_t R : {1, 2}) {
    const MoeConfig c = plan(find_preset("small").desc(R, 64), DeviceFacts::cpu());
    EXPECT_EQ(c.comm_sms, 0);
    EXPECT_EQ(c.compute_sms, 2);
  }
}

TEST(Planner, SymmetricBytes) {
  MoeDesc d;
  d.tokens_per_rank = 4;
  d.hidden = 64;
  d.intermediate = 32;
  d.num_experts = 2;
  d.topk = 2;
  // 3 * 128 + 1 signal lines of 128 bytes (sized for the most ranks) -> 49408, then x 512,
  // idx 32->256, w 32->256, combine 1024, dy 512, dx slots 1024, dw 32->256, x codes 256->256,
  // x scales 16->256.
  EXPECT_EQ(symmetric_bytes(d), 49408 + 512 + 256 + 256 + 1024 + 512 + 1024 + 256 + 256 + 256);
}

TEST(SymmetricLayout, RegionsAreAlignedDisjointAndInOrder) {
  for (int64_t T : {0, 1, 37, 8192}) {
    for (int64_t R : {1, 2, 64}) {
      const SymmetricLayout l = SymmetricLayout::make(T, 7168, 8, R);
      const int64_t starts[] = {l.signals, l.x,        l.topk_idx, l.topk_w,   l.combine, l.dy,
                                l.dx_slots, l.dw_slots, l.x_codes,  l.x_scales, l.total};
      const int64_t sizes[] = {(3 * 128 + 1) * 128, T * 7168 * 2,     T * 8 * 4, T * 8 * 4, T * 8 * 7168 * 2,
                               T * 7168 * 2,        T * 8 * 7168 * 2, T * 8 * 4, T * 7168,  T * 56 * 4};
      EXPECT_EQ(l.signals, 0);
      for (int i = 0; i < 10; ++i) {
        EXPECT_EQ(starts[i] % SymmetricLayout::kAlign, 0);
        EXPECT_GE(starts[i + 1] - starts[i], sizes[i]) << "region " << i << " overlaps the next";
        EXPECT_LT(starts[i + 1] - starts[i], sizes[i] + SymmetricLayout::kAlign) << "region " << i;
      }
      // Signal words: one per line, all inside the signal region, the status last; their offsets
      // depend on no shape (the same for every T and R).
      EXPECT_EQ(l.combine_arrived(0), l.signals);
      EXPECT_EQ(l.dx_arrived(SymmetricLayout::kMaxRanks - 1) + SymmetricLayout::kSignalLine, l.barrier(0));
      EXPECT_EQ(l.status() + SymmetricLayout::kSignalLine, l.signals + (3 * 128 + 1) * SymmetricLayout::kSignalLine);
      EXPECT_LE(l.status() + SymmetricLayout::kSignalLine, l.x);
      const SymmetricLayout other = SymmetricLayout::make(T + 5, 512, 2, 1);
      EXPECT_EQ(l.barrier(R - 1), other.barrier(R - 1));
      EXPECT_EQ(l.status(), other.status());
    }
  }
  alignas(256) static char base[65536];
  const SymmetricLayout small = SymmetricLayout::make(2, 16, 2, 2);
  ASSERT_LE(small.total, 65536);
  EXPECT_EQ(reinterpret_cast<char*>(SymmetricLayout::at<float>(base, small.topk_w)), base + small.topk_w);
}

TEST(Planner, FormatsBytes) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3.0 * (1 << 30)), "3.00 GiB");
}

TEST(Planner, FactsForAGpuByItsDriverName) {
  // A known part gets its measured rates with the SMs and memory it has (the H100 PCIe has 114).
  const DeviceFacts h200 = facts_for_gpu("NVIDIA H200", 132, int64_t{140} << 30);
  EXPECT_EQ(h200.name, "h200");
  EXPECT_EQ(h200.sm_count, 132);
  EXPECT_EQ(h200.memory_bytes, int64_t{140} << 30);
  EXPECT_DOUBLE_EQ(h200.bf16_tflops, DeviceFacts::h200().bf16_tflops);
  EXPECT_EQ(facts_for_gpu("NVIDIA H200 NVL", 132, 1).name, "h200");
  EXPECT_EQ(facts_for_gpu("NVIDIA GH200 480GB", 132, int64_t{96} << 30).name, "h200");
  EXPECT_EQ(facts_for_gpu("NVIDIA H100 80GB HBM3", 132, int64_t{80} << 30).name, "h100");
  const DeviceFacts h100 = facts_for_gpu("NVIDIA H100 PCIe", 114, int64_t{80} << 30);
  EXPECT_EQ(h100.name, "h100");
  EXPECT_EQ(h100.sm_count, 114);
  EXPECT_DOUBLE_EQ(h100.hbm_gbps, DeviceFacts::h100().hbm_gbps);
  // Only whole words: an H800 is neither.
  EXPECT_EQ(facts_for_gpu("NVIDIA H800", 132, int64_t{80} << 30).name, "NVIDIA H800");
  // Any other GPU: its own SMs and memory, no rates; the plan still comes out (by shape alone).
  const DeviceFacts other = facts_for_gpu("NVIDIA L40S", 142, int64_t{48} << 30);
  EXPECT_EQ(other.name, "NVIDIA L40S");
  EXPECT_EQ(other.sm_count, 142);
  EXPECT_EQ(other.memory_bytes, int64_t{48} << 30);
  EXPECT_EQ(other.bf16_tflops, 0.0);
  const MoeConfig c = plan(find_preset("kimi-k2").desc(2, 8192), other, {});
  EXPECT_EQ(c.compute_sms, 142);
  EXPECT_FALSE(c.fused_backward);
  EXPECT_THROW(facts_for_gpu("NVIDIA H200", 0, 1), InvalidArgument);
}

}  // namespace
}  // namespace mok
