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

#include <cute/config.hpp>

namespace mok::cuda::detail {

struct GroupedTile {
  int expert;
  int m_block;    // output row block: rows [m_block*kBlockM, +kBlockM) (global rows, or rows of W for wgrad)
  int save_m_block;  // the row block of the saved g|u (the megakernel's m_block is a ring row block)
  int n_block;    // output column block
  int row_end;    // the expert's segment end (grouped rows)
  int k_begin;    // k-blocks [k_begin, k_end) of the reduction
  int k_end;
};

// Shared-memory state: the experts' row offsets. Segments are contiguous and 128-row aligned, so
// the tiles before expert e are n_blocks * offsets[e] / kBlockM: no second table is needed.
template <int kMaxExperts>
struct GroupedTileSchedulerStorage {
  int32_t offsets[kMaxExperts + 1];
  int32_t status;  // 0, or why the offsets are malformed (then no tile is computed)
};

// kAlignM: the alignment the offsets must have (the segments'; a tile may be shorter).
template <int kBlockM, int kMaxExperts, int kGroupM = 8, int kAlignM = kBlockM>
struct GroupedTileScheduler {
  const GroupedTileSchedulerStorage<kMaxExperts>& s;
  int num_experts;
  int n_blocks;
  int k_blocks;  // every tile reduces over the same K

  // Called by one full warp before any role starts; the CTA synchronizes after it. Returns (and
  // stores in st.status) 0, or a nonzero code when the offsets are malformed.
  static __device__ int init(GroupedTileSchedulerStorage<kMaxExperts>& st, const int32_t* offsets,
                             int num_experts, int64_t row_capacity) {
    const int lane = threadIdx.x % 32;
    int status = 0;
    for (int e = lane; e <= num_experts; e += 32) {
      const int32_t v = offsets[e];
      st.offsets[e] = v;
      if (v % kAlignM != 0) status = 1;
      if (v < 0 || v > row_capacity || (e > 0 && v < offsets[e - 1])) status = status ? status : 2;
    }
    if (offsets[0] != 0) status = status ? status : 2;
    status = __reduce_max_sync(0xffffffffu, status);
    if (lane == 0) st.status = status;
    return status;
  }

  __device__ int tiles_before(int e) const { return s.offsets[e] / kBlockM * n_blocks; }
  __device__ int total_tiles() const { return s.status == 0 ? tiles_before(num_experts) : 0; }

  __device__ GroupedTile tile(int linear) const {
    // The last expert whose first tile is at or before `linear`: the one holding it (an empty
    // expert after it starts past `linear`).
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tiles_before(mid) <= linear) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int local = linear - tiles_before(lo);
    const int m_blocks = (s.offsets[lo + 1] - s.offsets[lo]) / kBlockM;
    const int group = local / (kGroupM * n_blocks);
    const int group_rows = min(kGroupM, m_blocks - group * kGroupM);
    const int in_group = local - group * kGroupM * n_blocks;
    GroupedTile t;
    t.expert = lo;
    t.m_block = s.offsets[lo] / kBlockM + group * kGroupM + in_group % group_rows;
    t.save_m_block = t.m_block;
    t.n_block = in_group / group_rows;
    t.row_end = s.offsets[lo + 1];
    t.k_begin = 0;
    t.k_end = k_blocks;
    return t;
  }
};

// The most rows of one expert (segments of st's offsets), for every lane of the calling warp.
template <int kMaxExperts>
__device__ int longest_segment(const GroupedTileSchedulerStorage<kMaxExperts>& st, int num_experts) {
  int longest = 0;
  for (int e = threadIdx.x % 32; e < num_experts; e += 32)
    longest = max(longest, st.offsets[e + 1] - st.offsets[e]);
  return __reduce_max_sync(0xffffffffu, longest);
}

// Tiles of the per-expert weight gradients: every expert has m_blocks x n_blocks output tiles
// of W, each reducing over all of that expert's rows in order, one k-block of kBlockK rows after
// the other: a fixed reduction order, no split-K. An empty expert's tiles have no k-blocks and
// store zeros. Two orders of the same tiles (the order changes no tile's bits):
//   rows (ctas == 0): expert-major, then row block, column block fastest.
//   columns (ctas > 0, the CTAs striding the linear order): a column is an expert's column block
//     (e * n_blocks + n); CTA b takes whole columns b, b + ctas, b + 2 ctas, ..., each row block
//     after the other, so its consecutive tiles read the same B tile (the activations' k-blocks
//     for that column): kept in shared memory, only A is loaded again (the producer's
//     load_k_blocks_keeping_b). The columns left after the last full round of ctas columns go
//     tile by tile over all CTAs (no reuse there, but no CTA takes a whole extra column).
template <int kBlockM, int kBlockK, int kMaxExperts>
struct ExpertTileScheduler {
  const GroupedTileSchedulerStorage<kMaxExperts>& s;
  int num_experts;
  int m_blocks;
  int n_blocks;
  int ctas = 0;  // > 0: the column order for this many CTAs

  // Host and device: test_task_order.cu checks the orders on the CPU.
  CUTE_HOST_DEVICE int total_tiles() const { return s.status == 0 ? num_experts * m_blocks * n_blocks : 0; }

  CUTE_HOST_DEVICE GroupedTile tile(int linear) const {
    int column, m;
    if (ctas > 0) {
      const int full = num_experts * n_blocks / ctas * ctas;  // columns of the full rounds
      if (linear < full * m_blocks) {
        const int i = linear / ctas;  // this CTA's i-th tile
        column = i / m_blocks * ctas + linear % ctas;
        m = i % m_blocks;
      } else {
        const int j = linear - full * m_blocks;
        column = full + j / m_blocks;
        m = j % m_blocks;
      }
    } else {
      const int per_expert = m_blocks * n_blocks;
      const int e = linear / per_expert, local = linear - e * per_expert;
      column = e * n_blocks + local % n_blocks;
      m = local / n_blocks;
    }
    GroupedTile t;
    t.expert = column / n_blocks;
    t.m_block = m;
    t.save_m_block = m;
    t.n_block = column % n_blocks;
    t.row_end = s.offsets[t.expert + 1];
    t.k_begin = s.offsets[t.expert] / kBlockK;
    t.k_end = s.offsets[t.expert + 1] / kBlockK;
    return t;
  }
};

}  // namespace mok::cuda::detail
