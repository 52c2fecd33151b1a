// Host launchers of the routing kernels (include/mok/cuda/routing.h).
#include "mok/cuda/routing.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "mok/core/bf16.h"
#include "mok/cuda/detail/routing_rows.cuh"
#include "mok/cuda/detail/routing_schedule.cuh"

namespace mok::cuda {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
// Dynamic shared memory the count and place kernels use without opting in: one [El] int table per warp.
constexpr int64_t kScheduleSmemBytes = 48 * 1024;
constexpr int kMaxScheduleWarps = 8;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("mok cuda routing: ") + what + ": " + cudaGetErrorString(e));
}

int device_sms(int requested) {
  if (requested > 0) return requested;
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "multiprocessor count");
  return sms;
}

int64_t chunks_per_rank(const RoutingShape& s) {
  return (s.slots() + detail::kChunkSlots - 1) / detail::kChunkSlots;
}

int schedule_warps_per_block(int64_t local_experts) {
  return static_cast<int>(std::clamp<int64_t>(kScheduleSmemBytes / (4 * std::max<int64_t>(local_experts, 1)),
                                              1, kMaxScheduleWarps));
}

// Appends "reason; " for every problem with the routing shape.
void check_shape(const RoutingShape& s, std::ostringstream& why) {
  if (s.ranks < 1 || s.ranks > kMaxRanks)
    why << "ranks must be in [1, " << kMaxRanks << "], got " << s.ranks << "; ";
  if (s.num_experts < 1 || (s.ranks >= 1 && s.num_experts % s.ranks != 0))
    why << "num_experts must be a positive multiple of ranks=" << s.ranks << ", got " << s.num_experts
        << "; ";
  if (s.topk < 1) why << "topk must be >= 1, got " << s.topk << "; ";
  if (s.tokens_per_rank < 0) why << "tokens_per_rank must be >= 0, got " << s.tokens_per_rank << "; ";
  if (s.ranks >= 1 && s.topk >= 1 && s.tokens_per_rank >= 0 && s.num_experts >= 1) {
    if (s.local_experts() > kMaxScheduleExperts)
      why << "local experts (E/R) must be at most " << kMaxScheduleExperts << ", got " << s.local_experts()
          << "; ";
    if (s.tokens_per_rank > kInt32Max / s.topk / s.ranks || routed_row_capacity(s) > kInt32Max)
      why << "the routed rows R*T*k plus padding must fit in int32, got R=" << s.ranks
          << " T=" << s.tokens_per_rank << " k=" << s.topk << "; ";
  }
}

void check_view(const ScheduleView& v, std::ostringstream& why) {
  if (v.local_experts < 1) why << "schedule.local_experts must be >= 1, got " << v.local_experts << "; ";
  if (v.row_capacity < 0 || v.row_capacity > kInt32Max)
    why << "schedule.row_capacity must be in [0, 2^31), got " << v.row_capacity << "; ";
  if (v.expert_offsets == nullptr || v.src_rank == nullptr || v.src_slot == nullptr)
    why << "schedule.expert_offsets, src_rank and src_slot must not be null; ";
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void check_hidden(int64_t hidden, std::ostringstream& why) {
  if (hidden < 8 || hidden % 8 != 0 || hidden > kInt32Max)
    why << "hidden must be a positive multiple of 8 (16-byte rows), got " << hidden << "; ";
}

// Every pointer of a per-rank table: present when `needed`, 16-byte aligned when `vectors`.
template <class P>
void check_table(P const* table, int64_t ranks, bool needed, bool vectors, const char* name,
                 std::ostringstream& why) {
  if (table == nullptr) {
    why << name << " (the table of per-rank pointers) must not be null; ";
    return;
  }
  for (int64_t r = 0; r < std::min<int64_t>(ranks, kMaxRanks); ++r) {
    if (needed && table[r] == nullptr) {
      why << name << "[" << r << "] is null; ";
    } else if (vectors && !aligned16(table[r])) {
      why << name << "[" << r << "] is not 16-byte aligned; ";
    }
  }
}

std::string finish(const std::ostringstream& why) {
  std::string s = why.str();
  if (s.size() >= 2) s.resize(s.size() - 2);
  return s;
}

template <class Args>
void require(const Args& a, const char* what) {
  const std::string why = can_implement(a);
  if (!why.empty()) throw std::invalid_argument(std::string("mok cuda ") + what + ": " + why);
}

detail::ScheduleRows schedule_rows(const ScheduleView& v) {
  return {static_cast<int32_t>(v.local_experts), static_cast<int32_t>(v.row_capacity), v.expert_offsets,
          v.src_rank, v.src_slot, v.given_up_words, v.row_link};
}

// Blocks of kRowsThreads for `items` warp- or thread-sized items, at most `per_sm` blocks per SM.
int rows_grid(int64_t items, int items_per_block, int num_sms, int per_sm) {
  const int64_t needed = (items + items_per_block - 1) / items_per_block;
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(needed, int64_t{device_sms(num_sms)} * per_sm)));
}

}  // namespace

int64_t routed_row_capacity(const RoutingShape& s) {
  const int64_t rows = s.ranks * s.slots() + s.local_experts() * (kRowAlign - 1);
  return (rows + 3) / 4 * 4;  // the fp8 kernels' row scales are planes of rows of 16-byte lines
}

std::string describe(const RoutingStatus& status, const RoutingShape& shape) {
  if (status.bad_expert == 0) return "";
  const int64_t position = int64_t{0xffffffff} - static_cast<int64_t>(status.bad_expert >> 32);
  const int32_t value = static_cast<int32_t>(static_cast<uint32_t>(status.bad_expert & 0xffffffffu));
  const int64_t slots = std::max<int64_t>(shape.slots(), 1), k = std::max<int64_t>(shape.topk, 1);
  const int64_t rank = position / slots, slot = position % slots;
  std::ostringstream s;
  s << "topk_idx[rank " << rank << "][token " << slot / k << "][" << slot % k << "] = " << value
    << " is out of range [0, " << shape.num_experts << ") and not -1 (no expert)";
  return s.str();
}

std::string describe_non_finite(unsigned long long key, const RoutingShape& shape, int64_t hidden) {
  if (key == 0) return "";
  const int tensor = 4 - int(key >> 62);
  const int64_t index = int64_t{0xffffffff} - static_cast<int64_t>((key >> 30) & 0xffffffffu);
  const int rank = int((key >> 16) & 0x3fff);
  const float value = bf16_to_float(bf16{static_cast<uint16_t>(key & 0xffffu)});
  const char* name = tensor == int(CheckedTensor::x) ? "x" : tensor == int(CheckedTensor::topk_w) ? "topk_w" : "dy";
  const int64_t width = std::max<int64_t>(1, tensor == int(CheckedTensor::topk_w) ? shape.topk : hidden);
  std::ostringstream s;
  s << name << "[rank " << rank << "][token " << index / width << "][" << index % width << "] is not finite (";
  if (std::isnan(value)) {
    s << "nan";
  } else {
    s << value;
  }
  s << ")";
  return s.str();
}

std::string read_routing_status(const RoutingStatus* device_status, const RoutingShape& shape,
                                cudaStream_t stream) {
  RoutingStatus host;
  check(cudaMemcpyAsync(&host, device_status, sizeof host, cudaMemcpyDeviceToHost, stream),
        "read routing status");
  check(cudaStreamSynchronize(stream), "synchronize for the routing status");
  return describe(host, shape);
}

void reset_routing_status(RoutingStatus* device_status, cudaStream_t stream) {
  check(cudaMemsetAsync(device_status, 0, sizeof(RoutingStatus), stream), "reset routing status");
}

// ---- non-finite inputs ----
namespace detail {
// Each thread keeps the first non-finite index of its grid-stride share; one atomicMax per key and
// thread that found one (the smallest index wins). bf16 values are read 8 at a time, fp32 4 at a time.
struct FiniteKeys {
  unsigned long long* words[kMaxRanks];
  int count;
};
__global__ void check_finite_kernel(const void* values, int f32, int64_t count, uint64_t tag,
                                    const __grid_constant__ FiniteKeys keys) {
  const int per_vector = f32 ? 4 : 8;
  const int64_t vectors = count / per_vector, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t first = -1;
  uint32_t bits16 = 0;
  auto look = [&](int64_t i, uint32_t as_bf16) {
    if ((as_bf16 & 0x7f80u) == 0x7f80u && (first < 0 || i < first)) {
      first = i;
      bits16 = as_bf16;
    }
  };
  // An fp32 as bf16 bits for the status: its upper half, or 0x7fc0 for any NaN (a NaN whose
  // payload is only in the lower half would otherwise read as an infinity).
  auto f32_bits = [](uint32_t w) {
    return (w & 0x7f800000u) == 0x7f800000u && (w & 0x7fffffu) != 0 ? 0x7fc0u : w >> 16;
  };
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < vectors && first < 0; v += stride) {
    const uint4 q = static_cast<const uint4*>(values)[v];
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    for (int j = 0; j < 4; ++j) {
      if (f32) {
        look(v * 4 + j, f32_bits(w[j]));
      } else {
        look(v * 8 + 2 * j, w[j] & 0xffffu);
        look(v * 8 + 2 * j + 1, w[j] >> 16);
      }
    }
  }
  for (int64_t i = vectors * per_vector + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count && first < 0;
       i += stride) {  // the tail past the last whole vector
    look(i, f32 ? f32_bits(static_cast<const uint32_t*>(values)[i]) : static_cast<const uint16_t*>(values)[i]);
  }
  if (first >= 0) {
    const uint64_t position = static_cast<uint64_t>(first < 0xffffffffLL ? first : 0xfffffffeLL);
    const uint32_t value = (bits16 & 0x7fu) == 0 ? bits16 : 0x7fc0u;  // an infinity keeps its sign; NaN is NaN
    const unsigned long long key = tag | (0xffffffffULL - position) << 30 | value;
    for (int r = 0; r < keys.count; ++r) atomicMax_system(keys.words[r], key);
  }
}
}  // namespace detail

void check_finite(const void* values, bool f32, int64_t count, CheckedTensor tensor, int64_t rank,
                  unsigned long long* const* keys, int num_keys, cudaStream_t stream) {
  if (count <= 0) return;
  if (reinterpret_cast<uintptr_t>(values) % 16 != 0)
    throw std::invalid_argument("mok check_finite: values must be 16-byte aligned");
  if (num_keys < 1 || num_keys > kMaxRanks)
    throw std::invalid_argument("mok check_finite: num_keys must be in [1, " + std::to_string(kMaxRanks) + "]");
  detail::FiniteKeys k{};
  for (int r = 0; r < num_keys; ++r) k.words[r] = keys[r];
  k.count = num_keys;
  const uint64_t tag = uint64_t(4 - int(tensor)) << 62 | uint64_t(rank & 0x3fff) << 16;
  const int64_t vectors = (count + 7) / 8;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((vectors + 255) / 256, 4 * device_sms(0))));
  detail::check_finite_kernel<<<blocks, 256, 0, stream>>>(values, f32 ? 1 : 0, count, tag, k);
  check(cudaGetLastError(), "launch check_finite");
}

// ---- schedule ----

int64_t schedule_workspace_bytes(const RoutingShape& s) {
  return s.local_experts() * s.ranks * chunks_per_rank(s) * int64_t{sizeof(int32_t)};
}

std::string can_implement(const ScheduleArgs& a) {
  std::ostringstream why;
  const RoutingShape& s = a.shape;
  check_shape(s, why);
  if (!why.str().empty()) return finish(why);
  if (a.dest_rank < 0 || a.dest_rank >= s.ranks)
    why << "dest_rank must be in [0, " << s.ranks << "), got " << a.dest_rank << "; ";
  if (a.row_capacity < routed_row_capacity(s) || a.row_capacity > kInt32Max)
    why << "row_capacity must be in [routed_row_capacity=" << routed_row_capacity(s) << ", 2^31), got "
        << a.row_capacity << "; ";
  check_table(a.topk_idx, s.ranks, s.slots() > 0, false, "topk_idx", why);
  if (a.expert_offsets == nullptr || a.expert_rows == nullptr || a.src_rank == nullptr ||
      a.src_slot == nullptr)
    why << "expert_offsets, expert_rows, src_rank and src_slot must not be null; ";
  if (schedule_workspace_bytes(s) > 0 && (a.workspace == nullptr || !aligned16(a.workspace)))
    why << "workspace must be a 16-byte aligned buffer of schedule_workspace_bytes()="
        << schedule_workspace_bytes(s) << " bytes; ";
  if (a.status == nullptr) why << "status must not be null; ";
  return finish(why);
}

namespace {
// The kernels' view of a schedule build (build_schedule and schedule_totals read the same one).
detail::ScheduleParams schedule_params(const ScheduleArgs& a) {
  const RoutingShape& s = a.shape;
  detail::ScheduleParams p{};
  p.ranks = static_cast<int32_t>(s.ranks);
  p.topk = static_cast<int32_t>(s.topk);
  p.num_experts = static_cast<int32_t>(s.num_experts);
  p.local_experts = static_cast<int32_t>(s.local_experts());
  p.first_expert = static_cast<int32_t>(a.dest_rank * s.local_experts());
  p.slots = static_cast<int32_t>(s.slots());
  p.chunks_per_rank = static_cast<int32_t>(chunks_per_rank(s));
  p.num_chunks = static_cast<int32_t>(s.ranks * chunks_per_rank(s));
  p.row_capacity = static_cast<int32_t>(a.row_capacity);
  p.counts = static_cast<int32_t*>(a.workspace);
  p.expert_offsets = a.expert_offsets;
  p.expert_rows = a.expert_rows;
  p.src_rank = a.src_rank;
  p.src_slot = a.src_slot;
  p.status = a.status;
  for (int64_t r = 0; r < s.ranks; ++r) p.topk_idx[r] = a.topk_idx[r];
  p.given_up_words = a.given_up_words;
  return p;
}
}  // namespace

void build_schedule(const ScheduleArgs& a, cudaStream_t stream) {
  require(a, "schedule");
  const int64_t El = a.shape.local_experts();
  const detail::ScheduleParams p = schedule_params(a);

  const int warps = schedule_warps_per_block(El);
  const size_t smem = static_cast<size_t>(warps) * static_cast<size_t>(El) * sizeof(int32_t);
  if (p.num_chunks > 0) {
    detail::schedule_count_kernel<<<(p.num_chunks + warps - 1) / warps, warps * 32, smem, stream>>>(p);
    check(cudaGetLastError(), "launch schedule count");
  }
  detail::schedule_scan_kernel<<<(p.local_experts + detail::kScanWarps - 1) / detail::kScanWarps,
                                 detail::kScanWarps * 32, 0, stream>>>(p);
  check(cudaGetLastError(), "launch schedule scan");
  detail::schedule_offsets_kernel<<<1, detail::kOffsetsThreads, 0, stream>>>(p);
  check(cudaGetLastError(), "launch schedule offsets");
  const int64_t place_warps = int64_t{p.num_chunks} + El;
  detail::schedule_place_kernel<<<static_cast<unsigned>((place_warps + warps - 1) / warps), warps * 32, smem,
                                  stream>>>(p);
  check(cudaGetLastError(), "launch schedule place");
}

void schedule_totals(const ScheduleArgs& a, int64_t* send_counts, int64_t* recv_counts, cudaStream_t stream) {
  require(a, "schedule_totals");
  if (send_counts == nullptr && recv_counts == nullptr) return;
  const detail::ScheduleParams p = schedule_params(a);
  detail::schedule_totals_kernel<<<1, detail::kTotalsThreads, 0, stream>>>(p, send_counts, recv_counts);
  check(cudaGetLastError(), "launch schedule totals");
}

// ---- dispatch and combine ----

std::string can_implement(const GatherArgs& a) {
  std::ostringstream why;
  check_shape(a.shape, why);
  check_hidden(a.hidden, why);
  check_view(a.schedule, why);
  if (!why.str().empty()) return finish(why);
  check_table(a.x, a.shape.ranks, a.shape.tokens_per_rank > 0, true, "x", why);
  if (a.rows == nullptr || !aligned16(a.rows)) why << "rows must be a 16-byte aligned device buffer; ";
  if ((a.topk_w == nullptr) != (a.row_weights == nullptr))
    why << "topk_w and row_weights must be given together; ";
  if (a.topk_w != nullptr) check_table(a.topk_w, a.shape.ranks, a.shape.slots() > 0, false, "topk_w", why);
  return finish(why);
}

void gather_rows(const GatherArgs& a, cudaStream_t stream) {
  require(a, "gather_rows");
  if (a.schedule.row_capacity == 0) return;
  detail::GatherParams p{};
  p.schedule = schedule_rows(a.schedule);
  p.ranks = static_cast<int32_t>(a.shape.ranks);
  p.topk = static_cast<int32_t>(a.shape.topk);
  p.slots = static_cast<int32_t>(a.shape.slots());
  p.row_vectors = static_cast<int32_t>(a.hidden / 8);
  p.rows = static_cast<uint4*>(a.rows);
  p.row_weights = a.row_weights;
  for (int64_t r = 0; r < a.shape.ranks; ++r) {
    p.x[r] = static_cast<const uint4*>(a.x[r]);
    p.topk_w[r] = a.topk_w != nullptr ? a.topk_w[r] : nullptr;
  }
  const int grid = rows_grid(a.schedule.row_capacity, detail::kRowsThreads / 32, a.num_sms, 8);
  detail::gather_rows_kernel<<<grid, detail::kRowsThreads, 0, stream>>>(p);
  check(cudaGetLastError(), "launch gather_rows");
}

int64_t token_link_words(const RoutingShape& shape, int64_t row_capacity) {
  return 2 * row_capacity + shape.ranks * shape.slots();
}

std::string can_implement_links(const RoutingShape& shape, const ScheduleView& schedule, const uint32_t* links) {
  std::ostringstream why;
  check_shape(shape, why);
  check_view(schedule, why);
  if (links == nullptr) why << "links must not be null; ";
  return finish(why);
}

void link_token_rows(const RoutingShape& shape, const ScheduleView& schedule, uint32_t* links, cudaStream_t stream) {
  if (const std::string why = can_implement_links(shape, schedule, links); !why.empty())
    throw std::invalid_argument("mok cuda link_token_rows: " + why);
  if (schedule.row_capacity == 0) return;
  int32_t* row_first = reinterpret_cast<int32_t*>(links + schedule.row_capacity);
  int32_t* row_of_slot = row_first + schedule.row_capacity;
  check(cudaMemsetAsync(row_of_slot, 0xff, size_t(shape.ranks * shape.slots()) * sizeof(int32_t), stream),
        "clear the token links' scratch");
  const detail::ScheduleRows rows = schedule_rows(schedule);
  const int ranks = static_cast<int>(shape.ranks), slots = static_cast<int>(shape.slots());
  const int grid = rows_grid(schedule.row_capacity, detail::kRowsThreads, 0, 4);
  detail::invert_schedule_kernel<<<grid, detail::kRowsThreads, 0, stream>>>(rows, ranks, slots, row_of_slot);
  check(cudaGetLastError(), "launch invert_schedule_kernel");
  detail::link_rows_kernel<<<grid, detail::kRowsThreads, 0, stream>>>(rows, ranks, slots, static_cast<int>(shape.topk),
                                                                      row_of_slot, links, row_first);
  check(cudaGetLastError(), "launch link_rows_kernel");
}

std::string can_implement(const ScatterArgs& a) {
  std::ostringstream why;
  check_shape(a.shape, why);
  check_hidden(a.hidden, why);
  check_view(a.schedule, why);
  if (!why.str().empty()) return finish(why);
  if (a.rows == nullptr || !aligned16(a.rows)) why << "rows must be a 16-byte aligned device buffer; ";
  check_table(a.slots, a.shape.ranks, a.shape.slots() > 0, true, "slots", why);
  return finish(why);
}

void scatter_rows(const ScatterArgs& a, cudaStream_t stream) {
  require(a, "scatter_rows");
  if (a.schedule.row_capacity == 0) return;
  detail::ScatterParams p{};
  p.schedule = schedule_rows(a.schedule);
  p.ranks = static_cast<int32_t>(a.shape.ranks);
  p.slots = static_cast<int32_t>(a.shape.slots());
  p.row_vectors = static_cast<int32_t>(a.hidden / 8);
  p.rows = static_cast<const uint4*>(a.rows);
  for (int64_t r = 0; r < a.shape.ranks; ++r) p.slot_rows[r] = static_cast<uint4*>(a.slots[r]);
  const int grid = rows_grid(a.schedule.row_capacity, detail::kRowsThreads / 32, a.num_sms, 8);
  detail::scatter_rows_kernel<<<grid, detail::kRowsThreads, 0, stream>>>(p);
  check(cudaGetLastError(), "launch scatter_rows");
}

std::string can_implement(const ScatterValuesArgs& a) {
  std::ostringstream why;
  check_shape(a.shape, why);
  check_view(a.schedule, why);
  if (!why.str().empty()) return finish(why);
  if (a.values == nullptr) why << "values must not be null; ";
  check_table(a.slot_values, a.shape.ranks, a.shape.slots() > 0, false, "slot_values", why);
  return finish(why);
}

void scatter_row_values(const ScatterValuesArgs& a, cudaStream_t stream) {
  require(a, "scatter_row_values");
  if (a.schedule.row_capacity == 0) return;
  detail::ScatterValuesParams p{};
  p.schedule = schedule_rows(a.schedule);
  p.ranks = static_cast<int32_t>(a.shape.ranks);
  p.slots = static_cast<int32_t>(a.shape.slots());
  p.values = a.values;
  for (int64_t r = 0; r < a.shape.ranks; ++r) p.slot_values[r] = a.slot_values[r];
  const int grid = rows_grid(a.schedule.row_capacity, detail::kRowsThreads, a.num_sms, 4);
  detail::scatter_row_values_kernel<<<grid, detail::kRowsThreads, 0, stream>>>(p);
  check(cudaGetLastError(), "launch scatter_row_values");
}

// ---- epilogues ----

namespace {

void check_epilogue(int64_t tokens, int64_t hidden, int64_t topk, const void* base, const void* slots,
                    const void* out, std::ostringstream& why) {
  if (tokens < 0) why << "tokens must be >= 0, got " << tokens << "; ";
  check_hidden(hidden, why);
  if (topk < 1 || topk > kInt32Max) why << "topk must be >= 1, got " << topk << "; ";
  if (tokens > 0 && (slots == nullptr || out == nullptr)) why << "slots and the output must not be null; ";
  if (!aligned16(base) || !aligned16(slots) || !aligned16(out))
    why << "bf16 buffers must be 16-byte aligned; ";
}

void launch_epilogue(bool weighted, const detail::EpilogueParams& p, int num_sms, cudaStream_t stream) {
  if (p.tokens == 0) return;
  const int grid = rows_grid(p.tokens * p.row_vectors, detail::kRowsThreads, num_sms, 8);
  if (weighted) {
    detail::epilogue_kernel<true><<<grid, detail::kRowsThreads, 0, stream>>>(p);
  } else {
    detail::epilogue_kernel<false><<<grid, detail::kRowsThreads, 0, stream>>>(p);
  }
  check(cudaGetLastError(), weighted ? "launch combine_epilogue" : "launch dispatch_grad_epilogue");
}

}  // namespace

std::string can_implement(const CombineArgs& a) {
  std::ostringstream why;
  check_epilogue(a.tokens, a.hidden, a.topk, a.y_shared, a.slots, a.y, why);
  if (a.tokens > 0 && a.topk_w == nullptr) why << "topk_w must not be null; ";
  return finish(why);
}

void combine_epilogue(const CombineArgs& a, cudaStream_t stream) {
  require(a, "combine_epilogue");
  const detail::EpilogueParams p{a.tokens,
                                 static_cast<int32_t>(a.topk),
                                 static_cast<int32_t>(a.hidden / 8),
                                 static_cast<const uint4*>(a.y_shared),
                                 static_cast<const uint4*>(a.slots),
                                 a.topk_w,
                                 a.topk_idx,
                                 nullptr,
                                 nullptr,
                                 static_cast<uint4*>(a.y)};
  launch_epilogue(true, p, a.num_sms, stream);
}

std::string can_implement(const DispatchGradArgs& a) {
  std::ostringstream why;
  check_epilogue(a.tokens, a.hidden, a.topk, a.dx_shared, a.slots, a.dx, why);
  if (a.tokens > 0 && a.d_topk_w != nullptr && a.slot_values == nullptr)
    why << "slot_values must not be null with d_topk_w; ";
  return finish(why);
}

void dispatch_grad_epilogue(const DispatchGradArgs& a, cudaStream_t stream) {
  require(a, "dispatch_grad_epilogue");
  const detail::EpilogueParams p{a.tokens,
                                 static_cast<int32_t>(a.topk),
                                 static_cast<int32_t>(a.hidden / 8),
                                 static_cast<const uint4*>(a.dx_shared),
                                 static_cast<const uint4*>(a.slots),
                                 nullptr,
                                 a.topk_idx,
                                 a.slot_values,
                                 a.d_topk_w,
                                 static_cast<uint4*>(a.dx)};
  launch_epilogue(false, p, a.num_sms, stream);
}

void preload_routing_kernels() {
  cudaFuncAttributes attr;
  check(cudaFuncGetAttributes(&attr, detail::schedule_count_kernel), "load schedule kernels");
  check(cudaFuncGetAttributes(&attr, detail::schedule_scan_kernel), "load schedule kernels");
  check(cudaFuncGetAttributes(&attr, detail::schedule_offsets_kernel), "load schedule kernels");
  check(cudaFuncGetAttributes(&attr, detail::schedule_place_kernel), "load schedule kernels");
  check(cudaFuncGetAttributes(&attr, detail::schedule_totals_kernel), "load schedule kernels");
  check(cudaFuncGetAttributes(&attr, detail::gather_rows_kernel), "load row kernels");
  check(cudaFuncGetAttributes(&attr, detail::invert_schedule_kernel), "load row kernels");
  check(cudaFuncGetAttributes(&attr, detail::link_rows_kernel), "load row kernels");
  check(cudaFuncGetAttributes(&attr, detail::scatter_rows_kernel), "load row kernels");
  check(cudaFuncGetAttributes(&attr, detail::scatter_row_values_kernel), "load row kernels");
  check(cudaFuncGetAttributes(&attr, detail::epilogue_kernel<true>), "load epilogue kernels");
  check(cudaFuncGetAttributes(&attr, detail::epilogue_kernel<false>), "load epilogue kernels");
  check(cudaFuncGetAttributes(&attr, detail::check_finite_kernel), "load the input check");
}

namespace {
__global__ void copy_bytes_kernel(uint4* __restrict__ dst, const uint4* __restrict__ src, int64_t n) {
  // Four independent 16-byte loads in flight per thread before their stores (peer reads are long).
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}
}  // namespace

void copy_bytes(void* dst, const void* src, int64_t bytes, int blocks, cudaStream_t stream) {
  const auto misaligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 != 0; };
  if (bytes < 0 || bytes % 16 != 0 || misaligned(dst) || misaligned(src)) {
    throw std::invalid_argument("copy_bytes: pointers and byte count must be multiples of 16 (bytes = " +
                                std::to_string(bytes) + ")");
  }
  if (bytes == 0) return;
  const int grid = blocks > 0 ? blocks : 2 * device_sms(0);
  copy_bytes_kernel<<<grid, 512, 0, stream>>>(static_cast<uint4*>(dst), static_cast<const uint4*>(src), bytes / 16);
  check(cudaGetLastError(), "copy_bytes launch");
}

}  // namespace mok::cuda
