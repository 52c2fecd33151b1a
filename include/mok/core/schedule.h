// The routing schedule: for each destination rank and local expert, the ordered rows it computes.
//
// Canonical order: within an expert, rows are sorted by global token id (src_rank*T + src_token),
// then by j. The order depends only on the routing, never on timing, R's factorisation of the
// batch, the minibatch or the ring size; so does every reduction that walks it (wgrad).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "mok/core/desc.h"

namespace mok {

// One row an expert computes: token src_slot / k of rank src_rank, its (src_slot % k)-th choice.
// Padding rows are {-1, -1}.
struct RouteRow {
  int32_t src_rank = -1;
  int32_t src_slot = -1;  // t*k + j
  bool is_padding() const { return src_rank < 0; }
  bool operator==(const RouteRow&) const = default;
};

struct RankSchedule {
  int64_t rank = 0;                     // the destination (expert-owning) rank
  int64_t pad_to = 1;                   // each expert's segment is padded to a multiple of this
  std::vector<int64_t> expert_offsets;  // [El+1]: expert e's rows are [offsets[e], offsets[e+1])
  std::vector<int64_t> expert_rows;     // [El]: real (unpadded) rows of each expert
  std::vector<RouteRow> rows;           // [offsets[El]]

  int64_t padded_rows() const { return expert_offsets.empty() ? 0 : expert_offsets.back(); }
  int64_t real_rows() const;
};

// Throws InvalidArgument naming (rank, token, j) and the value of the first id outside [0, E)
// that is not kNoExpert (an empty slot, which no schedule holds).
void validate_routing(const MoeDesc& desc, int64_t src_rank, std::span<const int32_t> topk_idx);

// topk_idx[r] is rank r's [T*k] expert ids (row-major [T,k]); all R ranks must be given.
RankSchedule build_rank_schedule(const MoeDesc& desc, int64_t dest_rank,
                                 std::span<const int32_t* const> topk_idx, int64_t pad_to = 1);

std::vector<RankSchedule> build_schedules(const MoeDesc& desc, std::span<const int32_t* const> topk_idx,
                                          int64_t pad_to = 1);

// The most rows one rank can receive: every token of every rank routed to its experts (R*T*k).
// Schedule tables sized by this never overflow, whatever the skew.
int64_t schedule_capacity_rows(const MoeDesc& desc, int64_t pad_to = 1);

}  // namespace mok
