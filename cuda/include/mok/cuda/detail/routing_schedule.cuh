// Device side of the routing schedule (mok/cuda/routing.h): four small kernels, no host sync.
//
// Every source rank's T*k slots are cut into chunks of kChunkSlots; chunk c of the N = R * chunks
// is rank c / chunks_per_rank's slots [(c % chunks_per_rank) * kChunkSlots, +kChunkSlots), so chunk
// order is the canonical (rank, token, j) order. One warp owns one chunk.
//   1. count:   counts[e][c] = rows of chunk c routed to local expert e (and id validation: ids in
//               [0, E) or -1, an empty slot, which no schedule holds)
//   2. scan:    counts[e][c] <- sum of counts[e][c' < c] (exclusive, in place); expert_rows[e]
//   3. offsets: expert_offsets = exclusive scan of expert_rows rounded up to kRowAlign
//   4. place:   each chunk's warp writes its rows at offsets[e] + counts[e][c] + (its rank among
//               the chunk's earlier slots for e), in slot order; extra warps write the padding rows
// Integer sums are exact in any order, and each row's position is a function of the routing only,
// so the result is the same bits every run.
#pragma once

#include <cstdint>

#include "mok/cuda/detail/call_status.cuh"
#include "mok/cuda/routing.h"

namespace mok::cuda::detail {

inline constexpr int kChunkSteps = 16;                // 32-slot steps per chunk
inline constexpr int kChunkSlots = 32 * kChunkSteps;  // slots per chunk (one warp)
inline constexpr int kScanWarps = 8;                  // warps per block of the scan kernel
inline constexpr int kOffsetsThreads = 1024;          // the offsets kernel's one block

struct ScheduleParams {
  int32_t ranks;
  int32_t topk;
  int32_t num_experts;
  int32_t local_experts;  // El
  int32_t first_expert;   // dest_rank * El
  int32_t slots;          // T*k per rank
  int32_t chunks_per_rank;
  int32_t num_chunks;  // N = R * chunks_per_rank
  int32_t row_capacity;
  int32_t* counts;          // workspace [El][N]
  int32_t* expert_offsets;  // [El+1]
  int32_t* expert_rows;     // [El]
  int32_t* src_rank;        // [row_capacity]
  int32_t* src_slot;        // [row_capacity]
  RoutingStatus* status;
  const int32_t* given_up_words;  // optional: a wait status that, set for the running call, makes
                                  // the schedule empty (call_status.cuh)
  const int32_t* topk_idx[kMaxRanks];
};

// The call was given up before the schedule (the start barrier found a rank making another call,
// or timed out): read no rank's topk_idx, whose layout may not be this rank's; no rows.
__device__ __forceinline__ bool schedule_abandoned(const ScheduleParams& p) {
  return p.given_up_words != nullptr && call_given_up(p.given_up_words);
}

struct ChunkRange {
  int rank, begin, end;  // slots [begin, end) of rank
};

__device__ __forceinline__ ChunkRange chunk_range(const ScheduleParams& p, int chunk) {
  const int rank = chunk / p.chunks_per_rank;
  const int begin = (chunk % p.chunks_per_rank) * kChunkSlots;
  if (schedule_abandoned(p)) return {rank, begin, begin};  // empty: every kernel of the schedule agrees
  return {rank, begin, min(p.slots, begin + kChunkSlots)};
}

// The chunk's expert ids, lane-strided: ids[s] is slot begin + 32*s + lane, or -1 past the end.
// All loads are issued before any is used.
__device__ __forceinline__ void load_chunk(const ScheduleParams& p, const ChunkRange& c, int lane,
                                           int32_t (&ids)[kChunkSteps]) {
  const int32_t* idx = p.topk_idx[c.rank];
#pragma unroll
  for (int s = 0; s < kChunkSteps; ++s) {
    const int slot = c.begin + 32 * s + lane;
    ids[s] = slot < c.end ? idx[slot] : -1;
  }
}

__device__ __forceinline__ unsigned long long shfl_xor_u64(unsigned long long v, int mask) {
  const unsigned lo = __shfl_xor_sync(0xffffffffu, static_cast<unsigned>(v), mask);
  const unsigned hi = __shfl_xor_sync(0xffffffffu, static_cast<unsigned>(v >> 32), mask);
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

// Block of (dynamic shared memory / El) warps; shared memory: one [El] histogram per warp.
__global__ void schedule_count_kernel(const __grid_constant__ ScheduleParams p) {
  extern __shared__ int32_t schedule_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunk = blockIdx.x * (blockDim.x / 32) + warp;
  if (chunk >= p.num_chunks) return;  // warp-uniform; only warp-level synchronization below
  const int El = p.local_experts;
  int32_t* hist = schedule_smem + warp * El;
  for (int e = lane; e < El; e += 32) hist[e] = 0;
  const ChunkRange c = chunk_range(p, chunk);
  int32_t ids[kChunkSteps];
  load_chunk(p, c, lane, ids);
  __syncwarp();
  unsigned long long bad = 0;
#pragma unroll
  for (int s = 0; s < kChunkSteps; ++s) {
    const int slot = c.begin + 32 * s + lane;
    const int32_t v = ids[s];
    if (slot < c.end && (v < kNoExpert || v >= p.num_experts)) {
      const unsigned position = static_cast<unsigned>(c.rank) * static_cast<unsigned>(p.slots) + slot;
      const unsigned long long key =
          (static_cast<unsigned long long>(0xffffffffu - position) << 32) | static_cast<uint32_t>(v);
      bad = max(bad, key);
    }
    if (slot < c.end && v >= p.first_expert && v < p.first_expert + El)
      atomicAdd(&hist[v - p.first_expert], 1);
  }
#pragma unroll
  for (int m = 16; m > 0; m /= 2) bad = max(bad, shfl_xor_u64(bad, m));
  if (lane == 0 && bad != 0) atomicMax(&p.status->bad_expert, bad);
  __syncwarp();
  for (int e = lane; e < El; e += 32) p.counts[static_cast<int64_t>(e) * p.num_chunks + chunk] = hist[e];
}

// One warp per expert: its chunk counts become exclusive prefix sums in chunk order.
__global__ void schedule_scan_kernel(const __grid_constant__ ScheduleParams p) {
  constexpr int kPerLane = 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int e = blockIdx.x * kScanWarps + warp;
  if (e >= p.local_experts) return;
  int32_t* counts = p.counts + static_cast<int64_t>(e) * p.num_chunks;
  int32_t running = 0;
  for (int base = 0; base < p.num_chunks; base += 32 * kPerLane) {
    int32_t v[kPerLane];
    int32_t sum = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = base + lane * kPerLane + i;
      v[i] = c < p.num_chunks ? counts[c] : 0;
      sum += v[i];
    }
    int32_t inclusive = sum;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += up;
    }
    int32_t prefix = running + inclusive - sum;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = base + lane * kPerLane + i;
      if (c < p.num_chunks) counts[c] = prefix;
      prefix += v[i];
    }
    running += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  if (lane == 0) p.expert_rows[e] = running;
}

// One block of kOffsetsThreads: expert_offsets = exclusive scan of the rows padded to kRowAlign.
__global__ void schedule_offsets_kernel(const __grid_constant__ ScheduleParams p) {
  __shared__ int32_t warp_sums[kOffsetsThreads / 32];
  __shared__ int32_t carry;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < p.local_experts; base += kOffsetsThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    constexpr int32_t kAlign = static_cast<int32_t>(kRowAlign);
    const int32_t v = e < p.local_experts ? (p.expert_rows[e] + kAlign - 1) / kAlign * kAlign : 0;
    int32_t inclusive = v;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += up;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    int32_t before = carry;
    for (int w = 0; w < warp; ++w) before += warp_sums[w];
    if (e < p.local_experts) p.expert_offsets[e] = before + inclusive - v;
    __syncthreads();  // everyone has read carry and warp_sums
    if (threadIdx.x == kOffsetsThreads - 1) carry = before + inclusive;
    __syncthreads();
  }
  if (threadIdx.x == 0) p.expert_offsets[p.local_experts] = carry;
}

// One block (kTotalsThreads): the schedule's per-rank totals (routing.h: schedule_totals), after the
// scan kernel (counts[e][c] are exclusive prefixes in chunk order, expert_rows[e] the totals).
inline constexpr int kTotalsThreads = 1024;
__global__ void schedule_totals_kernel(const __grid_constant__ ScheduleParams p, int64_t* send_counts,
                                       int64_t* recv_counts) {
  __shared__ int32_t sent[kMaxRanks];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.ranks, El = p.local_experts;
  for (int d = threadIdx.x; d < R; d += blockDim.x) sent[d] = 0;
  __syncthreads();
  if (send_counts != nullptr && !schedule_abandoned(p)) {
    const int32_t* idx = p.topk_idx[p.first_expert / El];
    for (int base = 0; base < p.slots; base += blockDim.x) {  // the same trip count on every lane
      const int slot = base + static_cast<int>(threadIdx.x);
      const int32_t v = slot < p.slots ? idx[slot] : kNoExpert;
      const int d = v >= 0 && v < p.num_experts ? v / El : -1;
      const unsigned peers = __match_any_sync(0xffffffffu, d);  // one shared atomic per rank and warp
      if (d >= 0 && __ffs(peers) - 1 == lane) atomicAdd(&sent[d], __popc(peers));
    }
  }
  __syncthreads();
  if (send_counts != nullptr)
    for (int d = threadIdx.x; d < R; d += blockDim.x) send_counts[d] = sent[d];
  if (recv_counts == nullptr) return;
  // Rank s's rows of expert e: prefix at s's first chunk to prefix at s + 1's (expert_rows[e] past the last).
  for (int s = warp; s < R; s += blockDim.x / 32) {
    int64_t rows = 0;
    if (p.chunks_per_rank > 0) {
      const int first = s * p.chunks_per_rank, next = first + p.chunks_per_rank;
      for (int e = lane; e < El; e += 32) {
        const int32_t* c = p.counts + static_cast<int64_t>(e) * p.num_chunks;
        rows += (next < p.num_chunks ? c[next] : p.expert_rows[e]) - c[first];
      }
    }
#pragma unroll
    for (int m = 16; m > 0; m /= 2) rows += __shfl_xor_sync(0xffffffffu, rows, m);
    if (lane == 0) recv_counts[s] = rows;
  }
}

// Warps [0, N) place the rows of chunk = warp; warps [N, N + El) write expert (warp - N)'s padding.
// Shared memory: one [El] cursor table per warp.
__global__ void schedule_place_kernel(const __grid_constant__ ScheduleParams p) {
  extern __shared__ int32_t schedule_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int global_warp = blockIdx.x * (blockDim.x / 32) + warp;
  const int El = p.local_experts;
  if (global_warp >= p.num_chunks) {
    const int e = global_warp - p.num_chunks;
    if (e >= El) return;
    const int end = min(p.expert_offsets[e + 1], p.row_capacity);
    for (int i = p.expert_offsets[e] + p.expert_rows[e] + lane; i < end; i += 32) {
      p.src_rank[i] = -1;
      p.src_slot[i] = -1;
    }
    return;
  }
  const int chunk = global_warp;
  int32_t* cursor = schedule_smem + warp * El;
  const ChunkRange c = chunk_range(p, chunk);
  int32_t ids[kChunkSteps];
  load_chunk(p, c, lane, ids);
  for (int e = lane; e < El; e += 32) {
    cursor[e] = p.expert_offsets[e] + p.counts[static_cast<int64_t>(e) * p.num_chunks + chunk];
  }
  __syncwarp();
  const unsigned lanes_below = (1u << lane) - 1u;
#pragma unroll
  for (int s = 0; s < kChunkSteps; ++s) {
    const int slot = c.begin + 32 * s + lane;
    const int32_t v = ids[s];
    const bool local = slot < c.end && v >= p.first_expert && v < p.first_expert + El;
    const int e = local ? v - p.first_expert : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int rank_in_step = __popc(peers & lanes_below);
    if (local) {
      const int row = cursor[e] + rank_in_step;
      if (row < p.row_capacity) {
        p.src_rank[row] = c.rank;
        p.src_slot[row] = slot;
      }
    }
    __syncwarp();  // every lane has read cursor[e] before the group's first lane advances it
    if (local && rank_in_step == 0) cursor[e] += __popc(peers);
    __syncwarp();
  }
}

}  // namespace mok::cuda::detail
