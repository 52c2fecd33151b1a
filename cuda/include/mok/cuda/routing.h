// Host API of the routing kernels: the routing schedule built on the device (no host sync), the
// dispatch gather, the combine scatter and the fixed-order epilogues. Plain pointers and sizes
// only (no CUDA types beyond cudaStream_t), like expert_kernels.h.
//
// Every rank's tensors are reached through a table of R pointers, one per source rank, passed as a
// host array and copied into the kernel's parameters at launch (the array is not kept). On one GPU
// these are R separate device buffers; over NVLink they are peer addresses of symmetric memory.
//
// The schedule equals the CPU's mok::build_rank_schedule(desc, dest_rank, topk_idx, kRowAlign)
// bit for bit: each local expert's rows are contiguous, in the canonical order (src_rank, token, j)
// ascending, and padded with {-1, -1} rows to a multiple of kRowAlign, the layout the expert
// kernels read. The tables are sized for any skew (routed_row_capacity), so nothing is dropped.
// Positions come from per-(expert, chunk) counts and exclusive prefix sums: the placement does not
// depend on timing, so reruns give the same bits.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "mok/core/expert_id.h"
#include "mok/core/symmetric_layout.h"
#include "mok/cuda/expert_kernels.h"

namespace mok::cuda {

// The most source ranks a pointer table holds (the tables travel in the kernels' parameters).
inline constexpr int kMaxRanks = 128;
static_assert(kMaxRanks == SymmetricLayout::kMaxRanks, "the signal lines are sized for kMaxRanks ranks");
// The most local experts a schedule handles (one warp's cursors per expert live in shared memory).
inline constexpr int64_t kMaxScheduleExperts = 12288;

// The routing problem: R ranks of T tokens, each choosing k of E global experts; destination rank d
// owns experts [d*El, (d+1)*El), El = E/R.
struct RoutingShape {
  int64_t ranks = 1;            // R
  int64_t tokens_per_rank = 0;  // T
  int64_t topk = 1;             // k
  int64_t num_experts = 0;      // E
  int64_t local_experts() const { return ranks > 0 ? num_experts / ranks : 0; }
  int64_t slots() const { return tokens_per_rank * topk; }  // (token, j) slots per rank: T*k
};

// Rows a destination rank's schedule and row buffers need for any routing: R*T*k real rows plus
// at most kRowAlign-1 padding rows per local expert (mok::schedule_capacity_rows(desc, kRowAlign)),
// rounded up to a multiple of 4 (the fp8 stage kernels' row scales: 16-byte lines).
int64_t routed_row_capacity(const RoutingShape& shape);

// Sticky device status of the schedule build. Zero (cudaMemset 0) means every expert id seen was
// in [0, E) or -1 (an empty slot). Otherwise it records the first bad id in (rank, token, j) order:
// bad_expert = (0xffffffff - (rank*T*k + token*k + j)) << 32 | uint32(id), kept by atomicMax so the
// smallest position wins whatever the timing. Bad ids are skipped (no row is placed for them).
struct RoutingStatus {
  unsigned long long bad_expert = 0;
};
// "" when the status is clean, else e.g. "topk_idx[rank 1][token 5][1] = 19 is out of range [0, 16)
// and not -1 (no expert)" (the CPU's validate_routing wording).
std::string describe(const RoutingStatus& status, const RoutingShape& shape);

// The tensors check_finite scans.
enum class CheckedTensor : int { x = 1, topk_w = 2, dy = 3 };
// A non-finite key: the first NaN or infinite element check_finite saw, x before topk_w before dy:
// (4 - tensor) << 62 | (0xffffffff - index) << 30 | rank << 16 | the value as bf16 bits (any NaN
// as 0x7fc0), kept by atomicMax; 0 = none. It lives in every rank's symmetric buffer
// (SymmetricLayout::status()), so every rank of the group sees a NaN that one rank found.
// "" for 0, else e.g. "x[rank 0][token 3][17] is not finite (nan)"; hidden is the row width of x
// and dy.
std::string describe_non_finite(unsigned long long key, const RoutingShape& shape, int64_t hidden);
// Records the first NaN or infinite of `count` values (bf16, or fp32 when f32) of this rank's
// `tensor` into each of `keys` (device words, one per rank, peer addresses allowed: system-scope
// atomics); asynchronous, one read of the values. NaN inputs would otherwise give NaN outputs (and
// NaN weight gradients for every row of an expert) without a word.
void check_finite(const void* values, bool f32, int64_t count, CheckedTensor tensor, int64_t rank,
                  unsigned long long* const* keys, int num_keys, cudaStream_t stream);
// Copies the device status to the host (synchronizes `stream`) and describes it.
std::string read_routing_status(const RoutingStatus* device_status, const RoutingShape& shape,
                                cudaStream_t stream);
// Zeroes the device status (asynchronous).
void reset_routing_status(RoutingStatus* device_status, cudaStream_t stream);

// ---- The schedule of one destination rank ----
struct ScheduleArgs {
  RoutingShape shape;
  int64_t dest_rank = 0;
  const int32_t* const* topk_idx = nullptr;  // host array of R device pointers, each [T*k] (row-major [T,k])
  int32_t* expert_offsets = nullptr;  // device [El+1] out: expert e's rows are [offsets[e], offsets[e+1])
  int32_t* expert_rows = nullptr;     // device [El] out: real rows of each expert
  int32_t* src_rank = nullptr;        // device [row_capacity] out: source rank of each row, -1 = padding
  int32_t* src_slot = nullptr;        // device [row_capacity] out: token*k + j, -1 = padding
  int64_t row_capacity = 0;           // >= routed_row_capacity(shape); rows past offsets[El] are untouched
  void* workspace = nullptr;          // device, schedule_workspace_bytes(shape) bytes (16-byte aligned)
  RoutingStatus* status = nullptr;    // device, see RoutingStatus; not reset by the launch
  // Optional, as in ScheduleView: when this call was given up, the schedule is empty and no rank's
  // topk_idx is read.
  const int32_t* given_up_words = nullptr;
};

int64_t schedule_workspace_bytes(const RoutingShape& shape);
// Why the schedule cannot be built with these arguments, or "" when it can.
std::string can_implement(const ScheduleArgs& args);
// Four small kernels on `stream`: count per (expert, chunk), prefix over chunks, expert offsets,
// placement and padding. Throws std::invalid_argument when can_implement fails.
void build_schedule(const ScheduleArgs& args, cudaStream_t stream);
// Per-rank totals of the schedule build_schedule(args) made last on `stream` (it reads that call's
// workspace and expert_rows, and args.dest_rank's topk_idx), one small kernel, no host sync:
// recv_counts[s] = rows of the schedule pulled from rank s, send_counts[d] = slots of dest_rank's
// topk_idx routed to rank d's experts (empty slots and bad ids in neither). int64 [ranks] each;
// either may be null. Integer sums: the same bits every run. A given-up call's totals are zeros.
void schedule_totals(const ScheduleArgs& args, int64_t* send_counts, int64_t* recv_counts, cudaStream_t stream);

// ---- What dispatch and combine read: a schedule on the device ----
struct ScheduleView {
  int64_t local_experts = 0;                // El
  int64_t row_capacity = 0;                 // rows of the schedule and row buffers
  const int32_t* expert_offsets = nullptr;  // device [El+1]; rows [0, offsets[El]) are visited
  const int32_t* src_rank = nullptr;        // device [row_capacity]
  const int32_t* src_slot = nullptr;        // device [row_capacity]
  // Optional: a megakernel wait status (megakernel.h: code at [0], the failed call's epoch at [4],
  // the running call's at [5]). When its words say the running call was given up (a rank made
  // another call, or a wait timed out), no row is visited: no peer buffer, whose layout may not be
  // this rank's, is touched.
  const int32_t* given_up_words = nullptr;
  // Optional: the rows of each token linked (link_token_rows). With them, dispatch reads a
  // token's row once per call however many of its k slots this rank holds, and writes it into
  // each of them: the same bytes, fewer peer reads (a quarter on 2 ranks with k = 8).
  const uint32_t* row_link = nullptr;
};

// The token links of a schedule, in a device buffer `links` of token_link_words(shape, row_capacity)
// words: for each row i,
//   links[i]                = (next + 1) | (i is not its token's first row) << 31, where next is the
//                             next row of the same (source rank, token) on this rank (next + 1 = 0:
//                             none): ScheduleView::row_link;
//   links[row_capacity + i] = the first (lowest) row of i's token on this rank, -1 for padding
//                             (token_first_rows);
// the rest is scratch. A memset and two kernels on `stream`.
inline constexpr uint32_t kLinkNotFirst = 1u << 31, kLinkNext = kLinkNotFirst - 1;  // a link's two fields
int64_t token_link_words(const RoutingShape& shape, int64_t row_capacity);
inline const int32_t* token_first_rows(const uint32_t* links, int64_t row_capacity) {
  return reinterpret_cast<const int32_t*>(links + row_capacity);
}
std::string can_implement_links(const RoutingShape& shape, const ScheduleView& schedule, const uint32_t* links);
void link_token_rows(const RoutingShape& shape, const ScheduleView& schedule, uint32_t* links, cudaStream_t stream);

// Dispatch: rows[i] = x[src_rank[i]][src_slot[i] / k] (bf16, width H), zeros for padding rows;
// optionally row_weights[i] = topk_w[src_rank[i]][src_slot[i]] (0 for padding). Rows past
// offsets[El] are untouched.
struct GatherArgs {
  RoutingShape shape;
  int64_t hidden = 0;  // H, a multiple of 8 (16-byte rows)
  ScheduleView schedule;
  const void* const* x = nullptr;        // host array of R device pointers, each [T, H] bf16
  void* rows = nullptr;                  // device [row_capacity, H] bf16 out
  const float* const* topk_w = nullptr;  // optional: host array of R device pointers, each [T*k] fp32
  float* row_weights = nullptr;          // device [row_capacity] out; needed iff topk_w is given
  int num_sms = 0;                       // 0 = all of the device's
};
std::string can_implement(const GatherArgs& args);
void gather_rows(const GatherArgs& args, cudaStream_t stream);

// Combine: slots[src_rank[i]][src_slot[i]] = rows[i] (bf16, width H) for every real row; padding
// rows are skipped. Each (token, j) slot is written by exactly one row of one destination rank.
struct ScatterArgs {
  RoutingShape shape;
  int64_t hidden = 0;  // H, a multiple of 8
  ScheduleView schedule;
  const void* rows = nullptr;    // device [row_capacity, H] bf16
  void* const* slots = nullptr;  // host array of R device pointers, each [T*k, H] bf16
  int num_sms = 0;
};
std::string can_implement(const ScatterArgs& args);
void scatter_rows(const ScatterArgs& args, cudaStream_t stream);

// Per-row fp32 values into per-slot values (e.g. d topk_w): slot_values[src_rank[i]][src_slot[i]]
// = values[i] for every real row.
struct ScatterValuesArgs {
  RoutingShape shape;
  ScheduleView schedule;
  const float* values = nullptr;        // device [row_capacity]
  float* const* slot_values = nullptr;  // host array of R device pointers, each [T*k]
  int num_sms = 0;
};
std::string can_implement(const ScatterValuesArgs& args);
void scatter_row_values(const ScatterValuesArgs& args, cudaStream_t stream);

// ---- Epilogues on each source rank, bitwise equal to the CPU reference's (Rounding::bf16) ----
// fp32, j = 0..k-1 in order, separate round-to-nearest multiply and add (no FMA), one bf16 rounding.

// y[t] = bf16(y_shared[t] + sum_j topk_w[t,j] * slots[t*k+j]); y_shared may be null (then 0 + ...).
// With topk_idx, the sum skips the empty slots (id -1: neither the slot nor its weight is read).
struct CombineArgs {
  int64_t tokens = 0;               // T
  int64_t hidden = 0;               // H, a multiple of 8
  int64_t topk = 1;                 // k
  const void* y_shared = nullptr;   // device [T, H] bf16, optional
  const void* slots = nullptr;      // device [T*k, H] bf16
  const float* topk_w = nullptr;    // device [T*k] fp32
  const int32_t* topk_idx = nullptr;  // device [T*k], optional: null means no slot is empty
  void* y = nullptr;                // device [T, H] bf16 out
  int num_sms = 0;
};
std::string can_implement(const CombineArgs& args);
void combine_epilogue(const CombineArgs& args, cudaStream_t stream);

// dx[t] = bf16(dx_shared[t] + sum_j slots[t*k+j]); dx_shared may be null; with topk_idx, empty
// slots skipped. With d_topk_w, also d_topk_w[s] = slot_values[s], or 0 where slot s is empty
// (slot_values may be d_topk_w itself: the empty slots are zeroed in place).
struct DispatchGradArgs {
  int64_t tokens = 0;
  int64_t hidden = 0;  // a multiple of 8
  int64_t topk = 1;
  const void* dx_shared = nullptr;      // device [T, H] bf16, optional
  const void* slots = nullptr;          // device [T*k, H] bf16
  const int32_t* topk_idx = nullptr;    // device [T*k], optional: null means no slot is empty
  const float* slot_values = nullptr;   // device [T*k] fp32 (the pushed d topk_w), with d_topk_w
  float* d_topk_w = nullptr;            // device [T*k] fp32 out, optional
  void* dx = nullptr;                   // device [T, H] bf16 out
  int num_sms = 0;
};
std::string can_implement(const DispatchGradArgs& args);
void dispatch_grad_epilogue(const DispatchGradArgs& args, cudaStream_t stream);

// Loads every routing kernel on the current device now. With CUDA's lazy module loading (the
// default) the first launch of a kernel loads its module, and that can wait for the kernels
// already running on the device; a caller that launches a spinning kernel (the megakernel's start
// barrier) and then, from the same host thread, kernels not yet loaded could block the host until
// the spin times out. Cheap after the first call.
void preload_routing_kernels();

// ---- Raw copies (the NVLink ceilings of the benchmark harness: dst or src may be a peer address) ----
// dst[0, bytes) = src[0, bytes) with 16-byte loads and stores by SMs (not the copy engine), on
// `blocks` CTAs (0 = two per SM). Both pointers and `bytes` must be multiples of 16.
void copy_bytes(void* dst, const void* src, int64_t bytes, int blocks, cudaStream_t stream);

}  // namespace mok::cuda
