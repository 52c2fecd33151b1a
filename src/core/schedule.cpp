#include "mok/core/schedule.h"

#include <algorithm>

#include "mok/core/error.h"

namespace mok {

int64_t RankSchedule::real_rows() const {
  int64_t total = 0;
  for (int64_t n : expert_rows) total += n;
  return total;
}

void validate_routing(const MoeDesc& desc, int64_t src_rank, std::span<const int32_t> topk_idx) {
  const int64_t slots = desc.routed_slots();
  MOK_REQUIRE(static_cast<int64_t>(topk_idx.size()) == slots, "topk_idx of rank ", src_rank,
              " has ", topk_idx.size(), " entries, expected T*k=", desc.tokens_per_rank, "*",
              desc.topk, "=", slots);
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t e = topk_idx[static_cast<size_t>(s)];
    MOK_REQUIRE(e == kNoExpert || (e >= 0 && e < desc.num_experts), "topk_idx[rank ", src_rank, "][token ",
                s / desc.topk, "][", s % desc.topk, "] = ", e, " is out of range [0, ", desc.num_experts,
                ") and not -1 (no expert)");
  }
}

int64_t schedule_capacity_rows(const MoeDesc& desc, int64_t pad_to) {
  const int64_t real = desc.ranks * desc.routed_slots();
  // Padding adds at most pad_to-1 rows per local expert.
  return real + desc.local_experts() * (pad_to - 1);
}

namespace {

// Checks what every destination's schedule relies on: the descriptor, R routings, the ids.
void validate_schedule_inputs(const MoeDesc& desc, std::span<const int32_t* const> topk_idx, int64_t pad_to) {
  desc.validate();
  MOK_REQUIRE(static_cast<int64_t>(topk_idx.size()) == desc.ranks, "routing of ", topk_idx.size(),
              " ranks given, expected ranks=", desc.ranks);
  MOK_REQUIRE(pad_to >= 1, "pad_to must be >= 1, got ", pad_to);
  const int64_t slots = desc.routed_slots();
  for (int64_t r = 0; r < desc.ranks; ++r) {
    MOK_REQUIRE(slots == 0 || topk_idx[r] != nullptr, "topk_idx of rank ", r, " is null");
    validate_routing(desc, r, std::span<const int32_t>(topk_idx[r], static_cast<size_t>(slots)));
  }
}

// The schedule of one destination from validated inputs.
RankSchedule build_validated(const MoeDesc& desc, int64_t dest_rank, std::span<const int32_t* const> topk_idx,
                             int64_t pad_to) {
  const int64_t El = desc.local_experts();
  const int64_t slots = desc.routed_slots();
  const int64_t first = dest_rank * El;
  RankSchedule s;
  s.rank = dest_rank;
  s.pad_to = pad_to;
  s.expert_rows.assign(static_cast<size_t>(El), 0);
  for (int64_t r = 0; r < desc.ranks; ++r) {
    for (int64_t i = 0; i < slots; ++i) {
      const int64_t e = topk_idx[r][i] - first;
      if (e >= 0 && e < El) ++s.expert_rows[static_cast<size_t>(e)];
    }
  }
  s.expert_offsets.assign(static_cast<size_t>(El + 1), 0);
  for (int64_t e = 0; e < El; ++e) {
    const int64_t n = s.expert_rows[static_cast<size_t>(e)];
    s.expert_offsets[static_cast<size_t>(e + 1)] =
        s.expert_offsets[static_cast<size_t>(e)] + (n + pad_to - 1) / pad_to * pad_to;
  }
  s.rows.assign(static_cast<size_t>(s.padded_rows()), RouteRow{});
  // A stable counting sort: visiting (rank, token, j) in increasing order places each expert's
  // rows in the canonical order.
  std::vector<int64_t> cursor(s.expert_offsets.begin(), s.expert_offsets.end() - 1);
  for (int64_t r = 0; r < desc.ranks; ++r) {
    for (int64_t i = 0; i < slots; ++i) {
      const int64_t e = topk_idx[r][i] - first;
      if (e < 0 || e >= El) continue;
      s.rows[static_cast<size_t>(cursor[static_cast<size_t>(e)]++)] =
          RouteRow{static_cast<int32_t>(r), static_cast<int32_t>(i)};
    }
  }
  return s;
}

}  // namespace

RankSchedule build_rank_schedule(const MoeDesc& desc, int64_t dest_rank,
                                 std::span<const int32_t* const> topk_idx, int64_t pad_to) {
  validate_schedule_inputs(desc, topk_idx, pad_to);
  MOK_REQUIRE(dest_rank >= 0 && dest_rank < desc.ranks, "dest_rank must be in [0, ", desc.ranks,
              "), got ", dest_rank);
  return build_validated(desc, dest_rank, topk_idx, pad_to);
}

std::vector<RankSchedule> build_schedules(const MoeDesc& desc, std::span<const int32_t* const> topk_idx,
                                          int64_t pad_to) {
  validate_schedule_inputs(desc, topk_idx, pad_to);  // once, not once per destination
  std::vector<RankSchedule> out;
  out.reserve(static_cast<size_t>(desc.ranks));
  for (int64_t d = 0; d < desc.ranks; ++d) out.push_back(build_validated(desc, d, topk_idx, pad_to));
  return out;
}

}  // namespace mok
