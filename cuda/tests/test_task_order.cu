// The megakernel's task order (MegaTasks, megakernel_forward.cuh), checked on the CPU: no GPU
// needed, so it runs with every ctest. Every tile of both GEMMs comes exactly once per minibatch,
// the first GEMM's tiles before the second's (so the lowest unfinished task can always run), each
// naming the expert whose segment holds its row block and the ring slot of its minibatch; inside
// a minibatch's GEMM the tiles go expert by expert, in groups of kRowGroup row blocks, each
// group's row blocks fastest.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "mok/cuda/detail/megakernel_forward.cuh"

namespace mok::cuda::detail {
namespace {

struct Layout {
  std::vector<int32_t> rows;  // per expert, multiples of 128
  int mb_rows, ring_rows, n_first, n_second;
};

void check_order(const Layout& l) {
  auto p = std::make_unique<MegaForwardParams>();
  auto s = std::make_unique<GroupedTileSchedulerStorage<GemmConfig::kMaxExperts>>();
  const int experts = int(l.rows.size());
  s->offsets[0] = 0;
  for (int e = 0; e < experts; ++e) s->offsets[e + 1] = s->offsets[e] + l.rows[e];
  s->status = 0;
  p->experts = experts;
  p->row_capacity = s->offsets[experts];
  p->mb_rows = l.mb_rows;
  p->ring_rows = l.ring_rows;
  p->n_first = l.n_first;
  p->n_second = l.n_second;
  p->k_first = 7;
  p->k_second = 5;
  const MegaTasks<MegaForwardParams> tasks{*p, *s};
  const int row_blocks = s->offsets[experts] / 128, mb = l.mb_rows / 128, slots = l.ring_rows / l.mb_rows;
  const int minibatches = (row_blocks + mb - 1) / mb;
  ASSERT_EQ(tasks.total(), row_blocks * (l.n_first + l.n_second));

  std::set<std::tuple<int, int, int>> seen;  // (second, row block, n block)
  int linear = 0;
  for (int b = 0; b < minibatches; ++b) {
    const int blocks = std::min(mb, row_blocks - b * mb);
    for (int second = 0; second < 2; ++second) {
      const int n_blocks = second ? l.n_second : l.n_first;
      // The order written out plainly: expert by expert, inside an expert groups of kRowGroup row
      // blocks, each group's row blocks fastest, then its column blocks.
      std::vector<std::pair<int, int>> expected;  // (row block, n block)
      for (int e = 0; e < experts; ++e) {
        const int first = std::max(s->offsets[e] / 128, b * mb), end = std::min(s->offsets[e + 1] / 128, b * mb + blocks);
        for (int g = first; g < end; g += MegaTasks<MegaForwardParams>::kRowGroup) {
          const int g_end = std::min(g + MegaTasks<MegaForwardParams>::kRowGroup, end);
          for (int n = 0; n < n_blocks; ++n)
            for (int rb = g; rb < g_end; ++rb) expected.push_back({rb, n});
        }
      }
      ASSERT_EQ(int(expected.size()), blocks * n_blocks);
      for (int i = 0; i < blocks * n_blocks; ++i, ++linear) {
        const MegaTask t = tasks.at(linear);
        ASSERT_EQ(t.row_block, expected[i].first) << "task " << linear << " (minibatch " << b << ", " << i << ")";
        ASSERT_EQ(t.tile.n_block, expected[i].second) << "task " << linear << " (minibatch " << b << ", " << i << ")";
        ASSERT_EQ(t.minibatch, b) << linear;
        ASSERT_EQ(int(t.second), second) << "minibatch " << b << ": the first GEMM's tiles come first";
        ASSERT_EQ(t.wgrad, 0);
        ASSERT_GE(t.row_block, b * mb);
        ASSERT_LT(t.row_block, b * mb + blocks);
        ASSERT_GE(t.tile.n_block, 0);
        ASSERT_LT(t.tile.n_block, n_blocks);
        const int row = t.row_block * 128;
        ASSERT_LE(s->offsets[t.tile.expert], row) << "the expert's segment holds the row block";
        ASSERT_LT(row, s->offsets[t.tile.expert + 1]);
        ASSERT_EQ(t.tile.row_end, s->offsets[t.tile.expert + 1]);
        ASSERT_EQ(t.tile.m_block, (b % slots) * mb + (t.row_block - b * mb)) << "the minibatch's ring slot";
        ASSERT_EQ(t.tile.save_m_block, t.row_block);
        ASSERT_EQ(t.tile.k_begin, 0);
        ASSERT_EQ(t.tile.k_end, second ? 5 : 7);
        ASSERT_TRUE(seen.insert({second, t.row_block, t.tile.n_block}).second) << "task " << linear << " repeats a tile";
      }
    }
  }
  EXPECT_EQ(int(seen.size()), row_blocks * (l.n_first + l.n_second));
}

TEST(MegakernelTaskOrder, EveryTileOncePerMinibatchFirstGemmFirst) {
  // kimi-like (3 row blocks per expert, 17-block minibatches), mixtral-like (32 row blocks per
  // expert: groups of 8, minibatches ending inside experts), one expert with every row, empty
  // experts between, a ring of one minibatch, minibatches that end inside an expert.
  check_order({std::vector<int32_t>(192, 384), 2176, 6528, 16, 28});
  check_order({std::vector<int32_t>(4, 4096), 2176, 13056, 112, 16});
  check_order({{0, 0, 4096, 0}, 384, 384, 3, 2});
  check_order({{128, 0, 0, 256, 0, 1280, 128}, 256, 256, 5, 1});
  check_order({{128}, 128, 128, 1, 1});
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int32_t> rows(1 + rng() % 40);
    for (int32_t& r : rows) r = 128 * int32_t(rng() % 4 == 0 ? 0 : rng() % 30);
    if (std::all_of(rows.begin(), rows.end(), [](int32_t r) { return r == 0; })) rows[0] = 128;
    const int mb = 128 * int(1 + rng() % 24);
    check_order({rows, mb, mb * int(1 + rng() % 3), int(1 + rng() % 30), int(1 + rng() % 30)});
  }
}

TEST(MegakernelTaskOrder, MalformedOffsetsHaveNoTasks) {
  auto p = std::make_unique<MegaForwardParams>();
  auto s = std::make_unique<GroupedTileSchedulerStorage<GemmConfig::kMaxExperts>>();
  p->experts = 2;
  p->mb_rows = 128;
  p->ring_rows = 128;
  p->n_first = p->n_second = 4;
  s->offsets[0] = 0;
  s->offsets[1] = 128;
  s->offsets[2] = 256;
  s->status = 2;  // as GroupedTileScheduler::init reports a bad schedule
  EXPECT_EQ((MegaTasks<MegaForwardParams>{*p, *s}.total()), 0);
}

// The weight gradients' tiles (ExpertTileScheduler) in both orders: every (expert, row block,
// column block) exactly once, reducing over its expert's k-blocks. In the columns order each CTA
// (linear indices b, b + ctas, ...) goes down whole columns, row block after row block, so its
// consecutive tiles read the same B tiles, except in the last columns, which go over all CTAs.
void check_weight_tiles(const std::vector<int32_t>& rows, int m_blocks, int n_blocks, int ctas) {
  auto s = std::make_unique<GroupedTileSchedulerStorage<GemmConfig::kMaxExperts>>();
  const int experts = int(rows.size());
  s->offsets[0] = 0;
  for (int e = 0; e < experts; ++e) s->offsets[e + 1] = s->offsets[e] + rows[e];
  s->status = 0;
  using Sched = ExpertTileScheduler<128, 64, GemmConfig::kMaxExperts>;
  const Sched sched{*s, experts, m_blocks, n_blocks, ctas};
  const int total = sched.total_tiles();
  ASSERT_EQ(total, experts * m_blocks * n_blocks);
  const int columns = experts * n_blocks, full = columns / std::max(ctas, 1) * ctas;
  std::set<std::tuple<int, int, int>> seen;
  for (int b = 0; b < std::max(ctas, 1); ++b) {
    int i = 0;
    for (int linear = b; linear < total; linear += std::max(ctas, 1), ++i) {
      const GroupedTile t = sched.tile(linear);
      ASSERT_GE(t.expert, 0);
      ASSERT_LT(t.expert, experts);
      ASSERT_GE(t.m_block, 0);
      ASSERT_LT(t.m_block, m_blocks);
      ASSERT_GE(t.n_block, 0);
      ASSERT_LT(t.n_block, n_blocks);
      ASSERT_EQ(t.k_begin, s->offsets[t.expert] / 64);
      ASSERT_EQ(t.k_end, s->offsets[t.expert + 1] / 64);
      ASSERT_TRUE(seen.insert({t.expert, t.m_block, t.n_block}).second) << "tile " << linear << " repeats";
      if (ctas > 0 && linear < full * m_blocks) {  // CTA b's i-th tile: column i / M round's, row block i % M
        const int column = i / m_blocks * ctas + b;
        ASSERT_EQ(t.expert, column / n_blocks) << "CTA " << b << " tile " << i;
        ASSERT_EQ(t.n_block, column % n_blocks) << "CTA " << b << " tile " << i;
        ASSERT_EQ(t.m_block, i % m_blocks) << "CTA " << b << " tile " << i;
      } else if (ctas == 0) {  // rows order: expert-major, row block, column block fastest
        ASSERT_EQ(linear, (t.expert * m_blocks + t.m_block) * n_blocks + t.n_block);
      }
    }
  }
  EXPECT_EQ(int(seen.size()), total);
}

TEST(WeightGradientTileOrder, EveryTileOnceAndColumnsStayOnTheirCta) {
  check_weight_tiles(std::vector<int32_t>(192, 256), 24, 28, 132);  // deepseek-v4 dW_gate on 2 ranks
  check_weight_tiles(std::vector<int32_t>(192, 256), 56, 12, 132);  // its dW_down
  check_weight_tiles({128, 0, 384, 1024}, 3, 5, 3);
  check_weight_tiles({128, 0, 384, 1024}, 3, 5, 0);
  check_weight_tiles({256}, 2, 1, 132);  // fewer columns than CTAs: all in the tail
  std::mt19937 rng(11);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<int32_t> rows(1 + rng() % 20);
    for (int32_t& r : rows) r = 128 * int32_t(rng() % 6);
    check_weight_tiles(rows, int(1 + rng() % 30), int(1 + rng() % 30), int(rng() % 140));
  }
}

}  // namespace
}  // namespace mok::cuda::detail
