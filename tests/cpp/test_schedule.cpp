// The routing schedule: canonical order, offsets, padding, validation.
#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "mok/core/error.h"
#include "mok/core/problem.h"
#include "mok/core/schedule.h"

namespace mok {
namespace {

MoeDesc desc_of(int64_t T, int64_t E, int64_t k, int64_t R) {
  MoeDesc d;
  d.tokens_per_rank = T;
  d.hidden = 8;
  d.intermediate = 8;
  d.num_experts = E;
  d.topk = k;
  d.ranks = R;
  return d;
}

std::vector<const int32_t*> pointers(const std::vector<std::vector<int32_t>>& idx) {
  std::vector<const int32_t*> p;
  for (const auto& v : idx) p.push_back(v.data());
  return p;
}

TEST(Schedule, HandWorkedExample) {
  // R=2, T=2, k=2, E=4 (El=2). Rank 0 tokens: t0 -> {3, 0}, t1 -> {1, 3}; rank 1: t0 -> {2, 3},
  // t1 -> {0, 1}.
  const MoeDesc d = desc_of(2, 4, 2, 2);
  const std::vector<std::vector<int32_t>> idx = {{3, 0, 1, 3}, {2, 3, 0, 1}};
  const auto p = pointers(idx);
  const RankSchedule s0 = build_rank_schedule(d, 0, p);
  // Expert 0: (r0,t0,j1)=slot 1, (r1,t1,j0)=slot 2. Expert 1: (r0,t1,j0)=slot 2, (r1,t1,j1)=slot 3.
  EXPECT_EQ(s0.expert_offsets, (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(s0.expert_rows, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(s0.rows, (std::vector<RouteRow>{{0, 1}, {1, 2}, {0, 2}, {1, 3}}));
  const RankSchedule s1 = build_rank_schedule(d, 1, p);
  // Expert 2: (r1,t0,j0). Expert 3: (r0,t0,j0), (r0,t1,j1), (r1,t0,j1).
  EXPECT_EQ(s1.expert_offsets, (std::vector<int64_t>{0, 1, 4}));
  EXPECT_EQ(s1.rows, (std::vector<RouteRow>{{1, 0}, {0, 0}, {0, 3}, {1, 1}}));
}

TEST(Schedule, PaddingKeepsOrderAndMarksPadRows) {
  const MoeDesc d = desc_of(2, 4, 2, 2);
  const std::vector<std::vector<int32_t>> idx = {{3, 0, 1, 3}, {2, 3, 0, 1}};
  const auto p = pointers(idx);
  const RankSchedule s = build_rank_schedule(d, 1, p, /*pad_to=*/4);
  EXPECT_EQ(s.expert_offsets, (std::vector<int64_t>{0, 4, 8}));
  EXPECT_EQ(s.expert_rows, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(s.real_rows(), 4);
  EXPECT_EQ(s.rows[0], (RouteRow{1, 0}));
  for (int i = 1; i < 4; ++i) EXPECT_TRUE(s.rows[i].is_padding());
  EXPECT_EQ(s.rows[4], (RouteRow{0, 0}));
  EXPECT_EQ(s.rows[6], (RouteRow{1, 1}));
  EXPECT_TRUE(s.rows[7].is_padding());
}

// Property test: for random routings, every (rank, slot) appears exactly once over all
// destinations, at the expert it names, and each expert's rows are strictly increasing in
// (global token, j).
TEST(Schedule, CanonicalOrderAndCompletenessOnRandomRoutings) {
  for (const auto& [T, E, k, R, kind] :
       std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, RoutingKind>>{
           {1, 4, 1, 1, RoutingKind::uniform},
           {7, 12, 3, 3, RoutingKind::zipf},
           {33, 8, 8, 4, RoutingKind::uniform},
           {20, 6, 2, 6, RoutingKind::one_expert},
           {16, 16, 4, 2, RoutingKind::balanced},
           {0, 4, 2, 2, RoutingKind::uniform}}) {
    const MoeDesc d = desc_of(T, E, k, R);
    const auto idx = make_routing(d, kind, 42 + T);
    const auto p = pointers(idx);
    const auto schedules = build_schedules(d, p, /*pad_to=*/3);
    std::map<std::pair<int32_t, int32_t>, int> seen;
    for (const RankSchedule& s : schedules) {
      for (int64_t e = 0; e < d.local_experts(); ++e) {
        int64_t last_key = -1;
        int64_t real = 0;
        for (int64_t i = s.expert_offsets[e]; i < s.expert_offsets[e + 1]; ++i) {
          const RouteRow r = s.rows[i];
          if (r.is_padding()) {
            // Padding comes only after the expert's real rows.
            EXPECT_EQ(real, s.expert_rows[e]);
            continue;
          }
          ++real;
          EXPECT_EQ(idx[r.src_rank][r.src_slot], s.rank * d.local_experts() + e);
          const int64_t key = (r.src_rank * T + r.src_slot / k) * k + r.src_slot % k;
          EXPECT_GT(key, last_key) << "rows out of canonical order";
          last_key = key;
          ++seen[{r.src_rank, r.src_slot}];
        }
        EXPECT_EQ(real, s.expert_rows[e]);
        EXPECT_EQ((s.expert_offsets[e + 1] - s.expert_offsets[e]) % 3, 0);
      }
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), R * T * k);
    for (const auto& [key, count] : seen) EXPECT_EQ(count, 1);
  }
}

TEST(Schedule, EveryTokenToOneExpertLeavesOtherRanksEmpty) {
  const MoeDesc d = desc_of(5, 8, 1, 4);
  const auto idx = make_routing(d, RoutingKind::one_expert, 1);
  const auto schedules = build_schedules(d, pointers(idx));
  EXPECT_EQ(schedules[0].expert_rows, (std::vector<int64_t>{20, 0}));
  for (int r = 1; r < 4; ++r) EXPECT_EQ(schedules[r].padded_rows(), 0);
  EXPECT_LE(schedules[0].padded_rows(), schedule_capacity_rows(d));
}

TEST(Schedule, OutOfRangeIdNamesRankTokenAndSlot) {
  const MoeDesc d = desc_of(2, 4, 2, 2);
  std::vector<std::vector<int32_t>> idx = {{3, 0, 1, 3}, {2, 3, 4, 1}};
  try {
    build_rank_schedule(d, 0, pointers(idx));
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "topk_idx[rank 1][token 1][0] = 4 is out of range [0, 4) and not -1 (no expert)");
  }
  idx[1][2] = -2;
  EXPECT_THROW(build_rank_schedule(d, 0, pointers(idx)), InvalidArgument);
}

// -1 leaves a slot empty: no destination's schedule holds it, and the other slots keep their order.
TEST(Schedule, EmptySlotsAreNoRows) {
  const MoeDesc d = desc_of(2, 4, 2, 2);  // T=2, E=4, k=2, R=2
  const std::vector<std::vector<int32_t>> idx = {{3, -1, -1, -1}, {-1, 0, 1, 3}};
  const auto all = build_schedules(d, pointers(idx));
  ASSERT_EQ(all[0].real_rows() + all[1].real_rows(), 4);
  std::vector<std::pair<int64_t, int64_t>> rank1_rows;
  for (const RouteRow& r : all[1].rows) rank1_rows.emplace_back(r.src_rank, r.src_slot);
  // Rank 1 owns experts 2 and 3: slot 0 of rank 0 (expert 3) and slot 3 of rank 1 (expert 3).
  EXPECT_EQ(rank1_rows, (std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {1, 3}}));
  EXPECT_EQ(all[0].expert_rows, (std::vector<int64_t>{1, 1}));
}

TEST(Schedule, BadArgumentsAreErrors) {
  const MoeDesc d = desc_of(2, 4, 2, 2);
  const std::vector<std::vector<int32_t>> idx = {{3, 0, 1, 3}, {2, 3, 0, 1}};
  auto p = pointers(idx);
  EXPECT_THROW(build_rank_schedule(d, 2, p), InvalidArgument);
  EXPECT_THROW(build_rank_schedule(d, 0, p, 0), InvalidArgument);
  p.pop_back();
  EXPECT_THROW(build_rank_schedule(d, 0, p), InvalidArgument);
  EXPECT_THROW(validate_routing(d, 0, std::span<const int32_t>(idx[0].data(), 3)), InvalidArgument);
}

TEST(Schedule, CapacityCoversTheWorstCase) {
  const MoeDesc d = desc_of(100, 8, 4, 4);
  EXPECT_EQ(schedule_capacity_rows(d), 4 * 100 * 4);
  EXPECT_EQ(schedule_capacity_rows(d, 128), 4 * 100 * 4 + 2 * 127);
}

}  // namespace
}  // namespace mok
