// Device side of dispatch, combine and the epilogues (mok/cuda/routing.h).
//
// Rows move as 16-byte vectors (8 bf16), one warp per row, warps striding over the rows of the
// schedule; the row count offsets[El] is read on the device. The epilogues give each thread 8
// consecutive columns of one token and reduce over j in order with __fmul_rn / __fadd_rn, so
// nothing is contracted into an FMA and the result is the CPU reference's bit for bit.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/cuda/detail/call_status.cuh"
#include "mok/cuda/routing.h"

namespace mok::cuda::detail {

inline constexpr int kRowsThreads = 256;  // threads per block of every kernel here

struct ScheduleRows {
  int32_t local_experts;
  int32_t row_capacity;
  const int32_t* expert_offsets;
  const int32_t* src_rank;
  const int32_t* src_slot;
  const int32_t* given_up_words;  // optional (routing.h: ScheduleView)
  const uint32_t* row_link;       // optional (routing.h: ScheduleView)
};

// Rows [0, offsets[El]) of the schedule, never past its capacity; none when the call was given up.
__device__ __forceinline__ int scheduled_rows(const ScheduleRows& s) {
  if (s.given_up_words != nullptr && call_given_up(s.given_up_words)) return 0;
  return max(0, min(s.expert_offsets[s.local_experts], s.row_capacity));
}

// A row's source, or valid = false for padding (and for anything a well-formed schedule never holds).
struct RowSource {
  int rank, slot;
  bool valid;
};
__device__ __forceinline__ RowSource row_source(const ScheduleRows& s, int row, int ranks, int slots) {
  const int rank = s.src_rank[row], slot = s.src_slot[row];
  return {rank, slot, rank >= 0 && rank < ranks && slot >= 0 && slot < slots};
}

// link_token_rows, step 1: row_of_slot[rank * slots + slot] = row for every real row (the buffer
// was set to -1 first).
__global__ void invert_schedule_kernel(const __grid_constant__ ScheduleRows s, int ranks, int slots,
                                       int32_t* row_of_slot) {
  const int rows = scheduled_rows(s);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += gridDim.x * blockDim.x) {
    const RowSource src = row_source(s, i, ranks, slots);
    if (src.valid) row_of_slot[int64_t(src.rank) * slots + src.slot] = i;
  }
}

// Step 2: each row's link and its token's first row, from the rows of the token's k slots (a
// thread per row).
__global__ void link_rows_kernel(const __grid_constant__ ScheduleRows s, int ranks, int slots, int topk,
                                 const int32_t* row_of_slot, uint32_t* row_link, int32_t* row_first) {
  const int rows = scheduled_rows(s);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += gridDim.x * blockDim.x) {
    const RowSource src = row_source(s, i, ranks, slots);
    uint32_t link = 0;
    int lowest = -1;
    if (src.valid) {
      const int32_t* token = row_of_slot + int64_t(src.rank) * slots + (src.slot - src.slot % topk);
      int next = -1;
      lowest = i;
      for (int j = 0; j < topk; ++j) {
        const int q = token[j];
        if (q >= 0 && q < lowest) lowest = q;
        if (q > i && (next < 0 || q < next)) next = q;
      }
      link = uint32_t(next + 1) | (lowest == i ? 0u : kLinkNotFirst);
    }
    row_link[i] = link;
    row_first[i] = lowest;
  }
}

struct GatherParams {
  ScheduleRows schedule;
  int32_t ranks;
  int32_t topk;
  int32_t slots;                   // T*k per rank
  int32_t row_vectors;             // H / 8
  uint4* rows;                     // [row_capacity, H]
  float* row_weights;              // [row_capacity] or null
  const uint4* x[kMaxRanks];       // [T, H] per rank
  const float* topk_w[kMaxRanks];  // [T*k] per rank, or all null
};

__global__ void gather_rows_kernel(const __grid_constant__ GatherParams p) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  const int rows = scheduled_rows(p.schedule);
  const int64_t width = p.row_vectors;
  for (int i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < rows; i += warps) {
    const RowSource src = row_source(p.schedule, i, p.ranks, p.slots);
    // With token links, a token's first row reads it and writes its other rows (and their router
    // weights); they are skipped here.
    const uint32_t link = src.valid && p.schedule.row_link != nullptr ? p.schedule.row_link[i] : 0u;
    if (link & kLinkNotFirst) continue;  // warp-uniform
    uint4* out = p.rows + i * width;
    if (src.valid) {
      const uint4* in = p.x[src.rank] + (src.slot / p.topk) * width;
#pragma unroll 4
      for (int64_t v = lane; v < width; v += 32) out[v] = in[v];
      // Each lane copies back the pieces it wrote itself (program order makes them visible).
      for (uint32_t next = link & kLinkNext; next != 0; next = p.schedule.row_link[next - 1] & kLinkNext) {
        const int q = int(next - 1);
        uint4* copy = p.rows + q * width;
#pragma unroll 4
        for (int64_t v = lane; v < width; v += 32) copy[v] = out[v];
        if (lane == 0 && p.row_weights != nullptr) p.row_weights[q] = p.topk_w[src.rank][p.schedule.src_slot[q]];
      }
    } else {
#pragma unroll 4
      for (int64_t v = lane; v < width; v += 32) out[v] = make_uint4(0, 0, 0, 0);
    }
    if (lane == 0 && p.row_weights != nullptr)
      p.row_weights[i] = src.valid ? p.topk_w[src.rank][src.slot] : 0.0f;
  }
}

struct ScatterParams {
  ScheduleRows schedule;
  int32_t ranks;
  int32_t slots;
  int32_t row_vectors;
  const uint4* rows;            // [row_capacity, H]
  uint4* slot_rows[kMaxRanks];  // [T*k, H] per rank
};

__global__ void scatter_rows_kernel(const __grid_constant__ ScatterParams p) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (blockDim.x / 32);
  const int rows = scheduled_rows(p.schedule);
  const int64_t width = p.row_vectors;
  for (int i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < rows; i += warps) {
    const RowSource dst = row_source(p.schedule, i, p.ranks, p.slots);
    if (!dst.valid) continue;  // warp-uniform
    const uint4* in = p.rows + i * width;
    uint4* out = p.slot_rows[dst.rank] + dst.slot * width;
#pragma unroll 4
    for (int64_t v = lane; v < width; v += 32) out[v] = in[v];
  }
}

struct ScatterValuesParams {
  ScheduleRows schedule;
  int32_t ranks;
  int32_t slots;
  const float* values;            // [row_capacity]
  float* slot_values[kMaxRanks];  // [T*k] per rank
};

__global__ void scatter_row_values_kernel(const __grid_constant__ ScatterValuesParams p) {
  const int rows = scheduled_rows(p.schedule);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += gridDim.x * blockDim.x) {
    const RowSource dst = row_source(p.schedule, i, p.ranks, p.slots);
    if (dst.valid) p.slot_values[dst.rank][dst.slot] = p.values[i];
  }
}

// 8 bf16 <-> 8 floats, exactly (bf16 -> fp32 is a shift; fp32 -> bf16 rounds to nearest even).
__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 pack_bf16x8(const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(f[2 * i]));
    const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(f[2 * i + 1]));
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// y[t] = bf16(base[t] + sum_j weight[t,j] * slots[t*k+j]); with weights null the terms are the
// slots themselves (the dispatch-grad epilogue); with base null the sum starts at 0; with topk_idx
// the slots whose id is -1 are skipped. With slot_out (the dispatch-grad epilogue's d topk_w), the
// thread of a token's first vector also writes slot_out[t*k+j] = slot_in[t*k+j], 0 for empty slots.
struct EpilogueParams {
  int64_t tokens;
  int32_t topk;
  int32_t row_vectors;      // H / 8
  const uint4* base;        // [T, H] or null
  const uint4* slots;       // [T*k, H]
  const float* weights;     // [T*k] or null
  const int32_t* topk_idx;  // [T*k] or null
  const float* slot_in;     // [T*k], with slot_out (may equal it)
  float* slot_out;          // [T*k] or null
  uint4* out;               // [T, H]
};

template <bool kWeighted>
__global__ void epilogue_kernel(const __grid_constant__ EpilogueParams p) {
  const int64_t total = p.tokens * p.row_vectors;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / p.row_vectors, v = i % p.row_vectors;
    float acc[8];
    if (p.base != nullptr) {
      unpack_bf16x8(p.base[i], acc);
    } else {
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[c] = 0.0f;
    }
    for (int j = 0; j < p.topk; ++j) {
      const int64_t slot = t * p.topk + j;
      const bool empty = p.topk_idx != nullptr && p.topk_idx[slot] == kNoExpert;
      if (p.slot_out != nullptr && v == 0) p.slot_out[slot] = empty ? 0.0f : p.slot_in[slot];
      if (empty) continue;
      float s[8];
      unpack_bf16x8(p.slots[slot * p.row_vectors + v], s);
      if constexpr (kWeighted) {
        const float w = p.weights[slot];
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] = __fadd_rn(acc[c], __fmul_rn(w, s[c]));
      } else {
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] = __fadd_rn(acc[c], s[c]);
      }
    }
    p.out[i] = pack_bf16x8(acc);
  }
}

}  // namespace mok::cuda::detail
