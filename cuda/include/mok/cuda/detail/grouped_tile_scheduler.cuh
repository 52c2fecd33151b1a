// Tiles of a grouped GEMM over rows grouped by expert, with the per-expert row offsets read on the
// device. Every role of a CTA walks the same tile sequence from one scheduler object.
//
// Tile order: expert-major; inside an expert, row blocks go in groups of kGroupM, and inside a
// group the row block changes fastest, then the column block. A wave of CTAs then covers about
// kGroupM row blocks x (CTAs / kGroupM) column blocks, so both the rows (A) and the weights (B) it
// reads are reused from L2 instead of the weights being streamed once per row block (measured:
// column-fastest order ran a 4096 x 28672 x 4096 GEMM at 58% of the dense rate).
#pragma once

#include <cstdint>

namespace mok::cuda::detail {

struct GroupedTile {
  int expert;
  int m_block;    // global row block: rows [m_block*kBlockM, +kBlockM)
  int n_block;    // column block of the output
  int row_end;    // the expert's segment end: rows at or past it are not stored
};

// Shared-memory state: the experts' offsets and the running count of tiles before each expert.
template <int kMaxExperts>
struct GroupedTileSchedulerStorage {
  int32_t offsets[kMaxExperts + 1];
  int32_t tiles_before[kMaxExperts + 1];
  int32_t status;  // 0, or why the offsets are malformed (then no tile is computed)
};

template <int kBlockM, int kMaxExperts, int kGroupM = 8>
struct GroupedTileScheduler {
  const GroupedTileSchedulerStorage<kMaxExperts>& s;
  int num_experts;
  int n_blocks;

  // Called by one full warp before any role starts; the CTA synchronizes after it. Returns (and
  // stores in st.status) 0, or a nonzero code when the offsets are malformed.
  static __device__ int init(GroupedTileSchedulerStorage<kMaxExperts>& st, const int32_t* offsets,
                             int num_experts, int n_blocks, int64_t row_capacity) {
    const int lane = threadIdx.x % 32;
    int carry = 0;
    int status = 0;
    for (int base = 0; base < num_experts; base += 32) {
      const int e = base + lane;
      int tiles = 0;
      if (e < num_experts) {
        const int32_t begin = offsets[e], end = offsets[e + 1];
        if (begin % kBlockM != 0) status = 1;
        if (end < begin || end > row_capacity) status = status ? status : 2;
        st.offsets[e] = begin;
        tiles = end > begin ? (end - begin + kBlockM - 1) / kBlockM * n_blocks : 0;
      }
      int inclusive = tiles;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += v;
      }
      if (e < num_experts) st.tiles_before[e + 1] = carry + inclusive;
      carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0) {
      st.tiles_before[0] = 0;
      st.offsets[num_experts] = num_experts > 0 ? offsets[num_experts] : 0;
    }
    // The last offset is checked too.
    if (lane == 0 && num_experts > 0 && (offsets[num_experts] > row_capacity)) status = 2;
    status = __reduce_max_sync(0xffffffffu, status);
    if (lane == 0) st.status = status;
    return status;
  }

  __device__ int total_tiles() const { return s.status == 0 ? s.tiles_before[num_experts] : 0; }

  __device__ GroupedTile tile(int linear) const {
    // The last expert whose first tile is at or before `linear` (empty experts are skipped).
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s.tiles_before[mid] <= linear) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int local = linear - s.tiles_before[lo];
    const int m_blocks = (s.offsets[lo + 1] - s.offsets[lo] + kBlockM - 1) / kBlockM;
    const int group = local / (kGroupM * n_blocks);
    const int group_rows = min(kGroupM, m_blocks - group * kGroupM);
    const int in_group = local - group * kGroupM * n_blocks;
    GroupedTile t;
    t.expert = lo;
    t.m_block = s.offsets[lo] / kBlockM + group * kGroupM + in_group % group_rows;
    t.n_block = in_group / group_rows;
    t.row_end = s.offsets[lo + 1];
    return t;
  }
};

}  // namespace mok::cuda::detail
