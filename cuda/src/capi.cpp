// A C entry point to the expert kernels for foreign-function callers (the Python package loads it
// with ctypes; torch tensors pass their data pointers and the current stream). Errors come back as
// a nonzero return and a message in `error`, never as an exception across the C boundary.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>

#include <cuda_runtime.h>

#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>

#include "mok/core/planner.h"
#include "mok/core/symmetric_layout.h"
#include "mok/cuda/expert_kernels.h"
#include "mok/cuda/fp8.h"
#include "mok/cuda/megakernel.h"
#include "mok/cuda/routing.h"

namespace {
void write_error(const std::exception& e, char* error, int error_len) {
  if (error != nullptr && error_len > 0) {
    std::strncpy(error, e.what(), static_cast<size_t>(error_len - 1));
    error[error_len - 1] = '\0';
  }
}
// One rank's fused forward: the planner's sizes and every local buffer, allocated once at creation
// (nothing is allocated per call). The symmetric buffers (one per rank, SymmetricLayout) belong to
// the caller (torch symmetric memory); their addresses come with every call.
struct ForwardHandle {
  mok::cuda::MoeForwardArgs args;
  mok::cuda::MoeBackwardArgs backward;  // its scratch, when the handle has a backward
  bool keeps_rows = false;
  bool fp8 = false;          // the block-scaled fp8 forward (mok_cuda_forward_run_fp8)
  bool fp8_dgrad = false;    // and its backward's data gradients on e4m3 (Precision::fp8_dgrad)
  void* dgrad_scratch = nullptr;  // fp8_dgrad: fp8_dgrad_scratch_bytes of the backward's rows (cudaMalloc)
  int64_t context_rows = 0;  // rows of a kept context's x_rows / h / gu (the row capacity, whole minibatches)
  mok::MoeConfig config;
  std::unique_ptr<mok::cuda::FusedBuffers> buffers;  // every local buffer, one allocation
  int device = 0;
  // Pinned host copies of the status words, refreshed asynchronously after every call: the next
  // call reads them without a device sync and raises if an earlier call failed.
  struct Mirror {
    int32_t words[mok::cuda::kFailureWords];
    mok::cuda::RoutingStatus routing;
    int32_t experts;
    unsigned long long non_finite;  // the key in this rank's symmetric buffer (check_finite)
  };
  void* own_base = nullptr;  // this rank's symmetric buffer, as of the last call
  Mirror* mirror = nullptr;

  ~ForwardHandle() {
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(device);
    buffers.reset();
    if (dgrad_scratch != nullptr) cudaFree(dgrad_scratch);
    if (mirror != nullptr) cudaFreeHost(mirror);
    cudaSetDevice(current);
  }
};

// What went wrong in the calls the statuses cover ("" = nothing).
std::string describe_statuses(const ForwardHandle& h, const int32_t words[mok::cuda::kFailureWords],
                              const mok::cuda::RoutingStatus& rs, int32_t experts, unsigned long long non_finite) {
  std::string text = mok::cuda::describe_wait_status(words);
  for (const std::string& more : {mok::cuda::describe(rs, h.args.shape),
                                  mok::cuda::describe_non_finite(non_finite, h.args.shape, h.args.hidden)})
    if (!more.empty()) text += (text.empty() ? "" : "; ") + more;
  if (experts != 0) text += std::string(text.empty() ? "" : "; ") + "expert backward: " + mok::cuda::status_message(experts);
  return text;
}

// Throws if the mirror shows a failed earlier call (it lags the device: no sync).
void raise_earlier_failure(const ForwardHandle& h) {
  const volatile ForwardHandle::Mirror* m = h.mirror;
  int32_t words[mok::cuda::kFailureWords];
  for (int i = 0; i < mok::cuda::kFailureWords; ++i) words[i] = m->words[i];
  mok::cuda::RoutingStatus rs;
  rs.bad_expert = m->routing.bad_expert;
  const std::string text = describe_statuses(h, words, rs, m->experts, m->non_finite);
  if (!text.empty()) throw std::runtime_error("an earlier call failed (the workspace stays failed): " + text);
}

// This rank's non-finite key in its symmetric buffer (null before the first call).
const void* non_finite_key(const ForwardHandle& h) {
  return h.own_base == nullptr ? nullptr
                               : static_cast<const char*>(h.own_base) + h.args.layout.status();
}

// Queues the copies of the device statuses into the mirror after a call.
void refresh_mirror(const ForwardHandle& h, cudaStream_t stream) {
  cudaMemcpyAsync(h.mirror->words, h.args.status, sizeof h.mirror->words, cudaMemcpyDeviceToHost, stream);
  cudaMemcpyAsync(&h.mirror->routing, h.args.routing_status, sizeof h.mirror->routing, cudaMemcpyDeviceToHost, stream);
  if (h.keeps_rows)
    cudaMemcpyAsync(&h.mirror->experts, h.backward.experts_status, sizeof h.mirror->experts, cudaMemcpyDeviceToHost,
                    stream);
  if (const void* key = non_finite_key(h))
    cudaMemcpyAsync(&h.mirror->non_finite, key, sizeof h.mirror->non_finite, cudaMemcpyDeviceToHost, stream);
}

// The rank bases of one call as pointers (the kernels' table), remembered as this rank's own.
void bind_bases(ForwardHandle& h, const int64_t* bases, void* (&table)[mok::cuda::kMaxRanks]) {
  for (int64_t r = 0; r < h.args.shape.ranks; ++r) table[r] = reinterpret_cast<void*>(bases[r]);
  h.own_base = table[h.args.rank];
}

// One call in the sequence every rank counts (forward and backward share it): refuses to run after
// a failed call, runs, and queues the status copies. The calls are counted by the handle's device
// counter, which each call advances on its stream: a CUDA graph that captured calls advances it on
// every replay, so the host keeps no count of its own.
template <class Args, class Launch>
void run_in_sequence(ForwardHandle& h, Args& args, Launch launch, void* stream) {
  raise_earlier_failure(h);
  args.epoch_counter = h.buffers->epoch_counter();
  launch(args, static_cast<cudaStream_t>(stream));  // checks everything before it launches
  refresh_mirror(h, static_cast<cudaStream_t>(stream));
}

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// A call on a handle through the C API: 0 when `body` ran, 1 for bad arguments
// (std::invalid_argument), 2 for a failed earlier call or a CUDA error; the message in `error`.
template <class Body>
int handle_call(char* error, int error_len, Body&& body) {
  try {
    body();
    return 0;
  } catch (const std::invalid_argument& e) {
    write_error(e, error, error_len);
    return 1;
  } catch (const std::exception& e) {
    write_error(e, error, error_len);
    return 2;
  }
}

// A call without a handle through the C API: 0 when `body` ran, 1 with the message in `error`
// when it threw (bad arguments or a CUDA error).
template <class Body>
int kernel_call(char* error, int error_len, Body&& body) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    write_error(e, error, error_len);
    return 1;
  }
}

// The shape fields every expert-kernel argument struct has (ExpertsForwardArgs,
// ExpertsForwardFp8Args, ExpertsBackwardArgs), from a C call's arguments.
template <class Args>
void set_expert_shape(Args& a, int64_t row_capacity, int64_t hidden, int64_t intermediate, int64_t local_experts,
                      const void* expert_offsets) {
  a.row_capacity = row_capacity;
  a.hidden = hidden;
  a.intermediate = intermediate;
  a.local_experts = local_experts;
  a.expert_offsets = static_cast<const int32_t*>(expert_offsets);
}

// The handle's forward arguments with what every forward call sets: the rank bases (through
// `table`, which must outlive the call), the weights, y_shared with its event, and y.
mok::cuda::MoeForwardArgs forward_call(ForwardHandle& h, const int64_t* bases, void* (&table)[mok::cuda::kMaxRanks],
                                       const void* w_gate, const void* w_up, const void* w_down, const void* y_shared,
                                       void* y_shared_ready, void* y) {
  bind_bases(h, bases, table);
  mok::cuda::MoeForwardArgs a = h.args;
  a.bases = table;
  a.w_gate = w_gate;
  a.w_up = w_up;
  a.w_down = w_down;
  a.y_shared = y_shared;
  a.y_shared_ready = static_cast<cudaEvent_t>(y_shared_ready);
  a.y = y;
  return a;
}

}  // namespace

extern "C" {

// which: 0 = both GEMMs, 1 = gate/up + SwiGLU only, 2 = down only.
int mok_cuda_experts_forward(int64_t row_capacity, int64_t hidden, int64_t intermediate, int64_t local_experts,
                             const void* expert_offsets, const void* x, const void* w_gate, const void* w_up,
                             const void* w_down, void* gu, void* h, void* y, int has_limit, float limit, void* status,
                             void* stream, int which, char* error, int error_len) {
  return kernel_call(error, error_len, [&] {
    mok::cuda::ExpertsForwardArgs a;
    set_expert_shape(a, row_capacity, hidden, intermediate, local_experts, expert_offsets);
    a.x = x;
    a.w_gate = w_gate;
    a.w_up = w_up;
    a.w_down = w_down;
    a.gu = gu;
    a.h = h;
    a.y = y;
    if (has_limit) a.swiglu_limit = limit;
    a.status = static_cast<int32_t*>(status);
    auto s = static_cast<cudaStream_t>(stream);
    if (which == 1) {
      mok::cuda::gate_up_swiglu(a, s);
    } else if (which == 2) {
      mok::cuda::down_projection(a, s);
    } else if (which == 0) {
      mok::cuda::experts_forward(a, s);
    } else {
      throw std::invalid_argument("mok_cuda_experts_forward: which must be 0, 1 or 2, got " + std::to_string(which));
    }
  });
}

// Block-scaled e4m3 quantization (mok/cuda/fp8.h): rows (1 x 128 scales, k-block major when
// k_major; rows_used, a device int32, may be null) or planes of 128 x 128 blocks.
int mok_cuda_quantize_rows_e4m3(const void* x, int64_t rows, int64_t cols, void* codes, void* scales, int k_major,
                                const void* rows_used, void* stream, char* error, int error_len) {
  return kernel_call(error, error_len, [&] {
    auto* c = static_cast<uint8_t*>(codes);
    auto* sc = static_cast<float*>(scales);
    const auto s = static_cast<cudaStream_t>(stream);
    if (k_major) {
      mok::cuda::quantize_rows_e4m3_k_major(x, rows, cols, c, sc, static_cast<const int32_t*>(rows_used), s);
    } else {
      if (rows_used != nullptr) throw std::invalid_argument("mok_cuda_quantize_rows_e4m3: rows_used needs k_major");
      mok::cuda::quantize_rows_e4m3(x, rows, cols, c, sc, s);
    }
  });
}

int mok_cuda_quantize_blocks_e4m3(const void* x, int64_t planes, int64_t rows, int64_t cols, void* codes,
                                  void* scales, void* stream, char* error, int error_len) {
  return kernel_call(error, error_len, [&] {
    mok::cuda::quantize_blocks_e4m3(x, planes, rows, cols, static_cast<uint8_t*>(codes), static_cast<float*>(scales),
                                    static_cast<cudaStream_t>(stream));
  });
}

// The experts' fp8 forward (mok::cuda::ExpertsForwardFp8Args, in its field order).
int mok_cuda_experts_forward_fp8(int64_t row_capacity, int64_t hidden, int64_t intermediate, int64_t local_experts,
                                 const void* expert_offsets, const void* x, const void* x_scales, const void* w_gate,
                                 const void* w_gate_scales, const void* w_up, const void* w_up_scales,
                                 const void* w_down, const void* w_down_scales, void* gu, void* h, void* h_codes,
                                 void* h_scales, void* y, int has_limit, float limit, void* status, void* stream,
                                 char* error, int error_len) {
  return kernel_call(error, error_len, [&] {
    mok::cuda::ExpertsForwardFp8Args a;
    set_expert_shape(a, row_capacity, hidden, intermediate, local_experts, expert_offsets);
    a.x = static_cast<const uint8_t*>(x);
    a.x_scales = static_cast<const float*>(x_scales);
    a.w_gate = static_cast<const uint8_t*>(w_gate);
    a.w_gate_scales = static_cast<const float*>(w_gate_scales);
    a.w_up = static_cast<const uint8_t*>(w_up);
    a.w_up_scales = static_cast<const float*>(w_up_scales);
    a.w_down = static_cast<const uint8_t*>(w_down);
    a.w_down_scales = static_cast<const float*>(w_down_scales);
    a.gu = gu;
    a.h = h;
    a.h_codes = static_cast<uint8_t*>(h_codes);
    a.h_scales = static_cast<float*>(h_scales);
    a.y = y;
    if (has_limit) a.swiglu_limit = limit;
    a.status = static_cast<int32_t*>(status);
    mok::cuda::experts_forward_fp8(a, static_cast<cudaStream_t>(stream));
  });
}

namespace {
// mok_cuda_experts_backward's arguments (and mok_cuda_experts_backward_fp8_dgrad's) as the struct.
mok::cuda::ExpertsBackwardArgs backward_args(int64_t row_capacity, int64_t hidden, int64_t intermediate,
                                             int64_t local_experts, const void* expert_offsets, const void* x,
                                             const void* gu, const void* h, const void* dy, const void* row_weight,
                                             const void* w_gate, const void* w_up, const void* w_down, void* dgu,
                                             void* hw, void* dw_partial, void* dx, void* d_row_weight, void* d_w_gate,
                                             void* d_w_up, void* d_w_down, int d_w_bf16, int has_limit, float limit,
                                             void* status) {
  mok::cuda::ExpertsBackwardArgs a;
  set_expert_shape(a, row_capacity, hidden, intermediate, local_experts, expert_offsets);
  a.x = x;
  a.gu = gu;
  a.h = h;
  a.dy = dy;
  a.row_weight = static_cast<const float*>(row_weight);
  a.w_gate = w_gate;
  a.w_up = w_up;
  a.w_down = w_down;
  a.dgu = dgu;
  a.hw = hw;
  a.dw_partial = static_cast<float*>(dw_partial);
  a.dx = dx;
  a.d_row_weight = static_cast<float*>(d_row_weight);
  a.d_w_gate = d_w_gate;
  a.d_w_up = d_w_up;
  a.d_w_down = d_w_down;
  a.d_w_type = d_w_bf16 ? mok::cuda::GradType::bf16 : mok::cuda::GradType::fp32;
  if (has_limit) a.swiglu_limit = limit;
  a.status = static_cast<int32_t*>(status);
  return a;
}
}  // namespace

// The backward on the same rows (mok::cuda::ExpertsBackwardArgs, in its field order). which: 0 =
// all of it, 1 = the dgrad steps only (experts_dgrad), 2 = the weight gradients only (experts_wgrad),
// 3 and 4 = the dgrad's two launches apart (experts_dh_swiglu_backward, experts_dx).
int mok_cuda_experts_backward(int64_t row_capacity, int64_t hidden, int64_t intermediate, int64_t local_experts,
                              const void* expert_offsets, const void* x, const void* gu, const void* h, const void* dy,
                              const void* row_weight, const void* w_gate, const void* w_up, const void* w_down,
                              void* dgu, void* hw, void* dw_partial, void* dx, void* d_row_weight, void* d_w_gate,
                              void* d_w_up, void* d_w_down, int d_w_bf16, int has_limit, float limit, void* status,
                              void* stream, int which, char* error, int error_len) {
  return kernel_call(error, error_len, [&] {
    const mok::cuda::ExpertsBackwardArgs a =
        backward_args(row_capacity, hidden, intermediate, local_experts, expert_offsets, x, gu, h, dy, row_weight,
                      w_gate, w_up, w_down, dgu, hw, dw_partial, dx, d_row_weight, d_w_gate, d_w_up, d_w_down,
                      d_w_bf16, has_limit, limit, status);
    auto s = static_cast<cudaStream_t>(stream);
    if (which == 1) {
      mok::cuda::experts_dgrad(a, s);
    } else if (which == 2) {
      mok::cuda::experts_wgrad(a, s);
    } else if (which == 3) {
      mok::cuda::experts_dh_swiglu_backward(a, s);
    } else if (which == 4) {
      mok::cuda::experts_dx(a, s);
    } else if (which == 0) {
      mok::cuda::experts_backward(a, s);
    } else {
      throw std::invalid_argument("mok_cuda_experts_backward: which must be 0 to 4, got " + std::to_string(which));
    }
  });
}

// The expert backward at Precision::fp8_dgrad (mok::cuda::experts_backward_fp8_dgrad): the
// arguments of mok_cuda_experts_backward but the bf16 weights and dw_partial (the scratch holds the
// partials), then the weights' e4m3 transposes (mok_cuda_quantize_blocks_e4m3_transposed) and
// mok_cuda_fp8_dgrad_scratch_bytes of scratch.
int mok_cuda_experts_backward_fp8_dgrad(int64_t row_capacity, int64_t hidden, int64_t intermediate,
                                        int64_t local_experts, const void* expert_offsets, const void* x,
                                        const void* gu, const void* h, const void* dy, const void* row_weight,
                                        void* dgu, void* hw, void* dx, void* d_row_weight, void* d_w_gate,
                                        void* d_w_up, void* d_w_down, int d_w_bf16, int has_limit, float limit,
                                        void* status, const void* w_down_t, const void* w_down_t_scales,
                                        const void* w_gate_up_t, const void* w_gate_up_t_scales, void* scratch,
                                        void* stream, char* error, int error_len) {
  return kernel_call(error, error_len, [&] {
    const mok::cuda::ExpertsBackwardArgs base =
        backward_args(row_capacity, hidden, intermediate, local_experts, expert_offsets, x, gu, h, dy, row_weight,
                      nullptr, nullptr, nullptr, dgu, hw, nullptr, dx, d_row_weight, d_w_gate, d_w_up, d_w_down,
                      d_w_bf16, has_limit, limit, status);
    mok::cuda::experts_backward_fp8_dgrad(
        mok::cuda::fp8_dgrad_args(base, w_down_t, static_cast<const float*>(w_down_t_scales), w_gate_up_t,
                                  static_cast<const float*>(w_gate_up_t_scales), scratch),
        static_cast<cudaStream_t>(stream));
  });
}

int64_t mok_cuda_fp8_dgrad_scratch_bytes(int64_t row_capacity, int64_t hidden, int64_t intermediate) {
  return mok::cuda::fp8_dgrad_scratch_bytes(row_capacity, hidden, intermediate);
}

// W [planes, rows, cols] bf16 -> W^T's e4m3 codes [planes, cols, ld_t] at column offset_t and
// their scales [planes, cols / 128, ld_t / 128], and in the same pass, where codes and scales are
// not null, W's own codes [planes, rows, cols] and scales [planes, ceil(rows / 128), ceil(cols / 128)]
// (mok::cuda::quantize_blocks_e4m3_transposed).
int mok_cuda_quantize_blocks_e4m3_transposed(const void* x, int64_t planes, int64_t rows, int64_t cols, void* codes,
                                             void* scales, void* codes_t, void* scales_t, int64_t ld_t,
                                             int64_t offset_t, void* stream, char* error, int error_len) {
  return kernel_call(error, error_len, [&] {
    mok::cuda::quantize_blocks_e4m3_transposed(x, planes, rows, cols, static_cast<uint8_t*>(codes),
                                               static_cast<float*>(scales), static_cast<uint8_t*>(codes_t),
                                               static_cast<float*>(scales_t), ld_t, offset_t,
                                               static_cast<cudaStream_t>(stream));
  });
}

// An SM copy of `bytes` (multiple of 16) between raw device addresses (a peer's, for NVLink rates).
int mok_cuda_copy_bytes(void* dst, const void* src, int64_t bytes, int blocks, void* stream, char* error,
                        int error_len) {
  return kernel_call(error, error_len, [&] {
    mok::cuda::copy_bytes(dst, src, bytes, blocks, static_cast<cudaStream_t>(stream));
  });
}

int64_t mok_cuda_dw_partial_blocks(int64_t intermediate) { return mok::cuda::dw_partial_blocks(intermediate); }

// The symmetric buffer layout (SymmetricLayout) as 9 int64: total, x, topk_idx, topk_w, combine,
// dy, dx_slots, dw_slots, signals.
void mok_cuda_symmetric_layout(int64_t tokens, int64_t hidden, int64_t topk, int64_t ranks, int64_t* out) {
  const mok::SymmetricLayout l = mok::SymmetricLayout::make(tokens, hidden, topk, ranks);
  const int64_t values[9] = {l.total, l.x, l.topk_idx, l.topk_w, l.combine, l.dy, l.dx_slots, l.dw_slots, l.signals};
  for (int i = 0; i < 9; ++i) out[i] = values[i];
}

// Creates rank `rank`'s fused forward on the current device. Plan overrides: 0 = the planner's
// choice (fused_backward: -1 = the planner's, 0 = the stage kernels, 1 = the backward megakernel).
// `plan_text` (optional) receives the planner's explanation. Returns null on error.
//
// fp8: 0 bf16; 1 the block-scaled fp8 forward (called with mok_cuda_forward_run_fp8); 2 that and
// its backward's data gradients on e4m3 (Precision::fp8_dgrad: the stage kernels, whatever
// fused_backward says; the handle allocates their scratch). With keep_rows its
// ring is the row capacity (whole minibatches: every row's e4m3 codes stay where its backward's
// schedule puts them), and its backward pulls the bf16 x rows again into that ring.
//
// keep_rows: the handle also owns the backward's scratch, and forwards may keep their context
// (schedule, every x row, h and g|u) in caller-owned buffers that the matching backward reads
// (training: autograd saves them per call, so layers sharing a handle do not collide).
void* mok_cuda_forward_create(int64_t ranks, int64_t rank, int64_t tokens, int64_t hidden, int64_t intermediate,
                              int64_t num_experts, int64_t topk, int has_limit, float limit, int comm_sms,
                              int64_t minibatch_rows, int64_t ring_rows, int fused_backward, int keep_rows,
                              int fp8, double timeout_s,
                              char* plan_text, int plan_len, char* error, int error_len) {
  try {
    mok::MoeDesc d;
    d.ranks = ranks;
    d.tokens_per_rank = tokens;
    d.hidden = hidden;
    d.intermediate = intermediate;
    d.num_experts = num_experts;
    d.topk = topk;
    if (has_limit) d.swiglu_limit = limit;
    if (fp8 < 0 || fp8 > 2)
      throw std::invalid_argument("fp8 must be 0 (bf16), 1 (fp8_block) or 2 (fp8_dgrad), got " + std::to_string(fp8));
    if (fp8) d.precision = fp8 == 2 ? mok::Precision::fp8_dgrad : mok::Precision::fp8_block;  // (whole 128-column scale blocks)
    d.validate();
    if (ranks > mok::cuda::kMaxRanks)
      throw std::invalid_argument("ranks=" + std::to_string(ranks) + " exceeds the kernels' pointer tables (" +
                                  std::to_string(mok::cuda::kMaxRanks) + ")");
    if (rank < 0 || rank >= ranks)
      throw std::invalid_argument("rank=" + std::to_string(rank) + " is not in [0, " + std::to_string(ranks) + ")");
    mok::PlanOverrides o;
    if (comm_sms > 0) o.comm_sms = comm_sms;
    if (minibatch_rows > 0) o.minibatch_rows = minibatch_rows;
    if (ring_rows > 0) o.ring_rows = ring_rows;
    if (fused_backward >= 0) o.fused_backward = fused_backward != 0;
    auto h = std::make_unique<ForwardHandle>();
    cuda_check(cudaGetDevice(&h->device), "cudaGetDevice");
    cudaDeviceProp props{};
    cuda_check(cudaGetDeviceProperties(&props, h->device), "cudaGetDeviceProperties");
    // The same facts as the Python package's plan (planner.h: facts_for_gpu).
    const mok::DeviceFacts facts =
        mok::facts_for_gpu(props.name, props.multiProcessorCount, static_cast<int64_t>(props.totalGlobalMem));
    h->config = mok::plan(d, facts, o);
    const mok::MoeConfig& c = h->config;
    mok::cuda::MoeForwardArgs& a = h->args;
    a.rank = rank;
    h->keeps_rows = keep_rows != 0;
    h->fp8 = fp8 != 0;
    h->fp8_dgrad = fp8 == 2;
    a.comm_ctas = c.comm_sms;
    a.num_sms = facts.sm_count;
    if (has_limit) a.swiglu_limit = limit;
    a.timeout_s = timeout_s;
    const mok::cuda::RoutingShape shape{ranks, tokens, topk, num_experts};
    const int64_t cap = mok::cuda::routed_row_capacity(shape);
    h->context_rows = (cap + c.minibatch_rows - 1) / c.minibatch_rows * c.minibatch_rows;
    // A kept context replaces a bf16 forward's ring (x_rows and h are its rows); an fp8 forward's
    // context holds h and g|u only, so its own ring (codes, scales, h codes) holds every row.
    const int64_t ring = h->fp8 && h->keeps_rows ? h->context_rows : c.ring_rows;
    h->buffers = std::make_unique<mok::cuda::FusedBuffers>(shape, hidden, intermediate, c.minibatch_rows, ring,
                                                           h->keeps_rows, h->fp8);
    h->buffers->wire(a);
    cuda_check(cudaHostAlloc(reinterpret_cast<void**>(&h->mirror), sizeof(ForwardHandle::Mirror), cudaHostAllocDefault),
               "allocate the status mirror");
    std::memset(h->mirror, 0, sizeof(ForwardHandle::Mirror));
    a.epoch = 0;  // unused: the calls count on the device (run_in_sequence)
    if (h->keeps_rows) {
      mok::cuda::MoeBackwardArgs& b = h->backward;
      b.rank = rank;
      h->buffers->wire(b);
      b.swiglu_limit = a.swiglu_limit;
      b.timeout_s = timeout_s;
      b.num_sms = a.num_sms;
      b.fused = c.fused_backward;  // the planner's (planner.h: kFusedBackwardCommShare) or the caller's
      // A development switch for same-process A/Bs on the GPU: MOK_EXPERIMENT_BACKWARD=stages|fused
      // (both paths give the same bits).
      if (const char* path = std::getenv("MOK_EXPERIMENT_BACKWARD"); path != nullptr) {
        if (std::string(path) == "stages") b.fused = false;
        if (std::string(path) == "fused") b.fused = true;
      }
      if (h->fp8_dgrad) {  // the stage kernels with the data gradients on e4m3 (the megakernel's are bf16)
        b.fused = false;
        b.fp8_dgrad = true;
        cuda_check(cudaMalloc(&h->dgrad_scratch,
                              size_t(mok::cuda::fp8_dgrad_scratch_bytes(b.row_capacity, hidden, intermediate))),
                   "allocate the fp8 dgrad scratch");
        b.fp8_dgrad_scratch = h->dgrad_scratch;
      }
    }
    if (plan_text != nullptr && plan_len > 0) {
      std::ostringstream text;
      text << "comm CTAs " << a.comm_ctas << ", minibatch " << a.minibatch_rows << " rows, ring " << a.ring_rows
           << " rows, row capacity " << cap << ", local buffers " << h->buffers->bytes() << " bytes\n" << c.explanation;
      std::strncpy(plan_text, text.str().c_str(), size_t(plan_len - 1));
      plan_text[plan_len - 1] = '\0';
    }
    return h.release();
  } catch (const std::exception& e) {
    write_error(e, error, error_len);
    return nullptr;
  }
}

void mok_cuda_forward_destroy(void* handle) { delete static_cast<ForwardHandle*>(handle); }

// One call of the fused forward (megakernel.h: moe_forward). bases: R device addresses of every
// rank's symmetric buffer as seen from this device; y_shared (optional) [T, H] bf16, and
// y_shared_ready (optional) a cudaEvent_t recorded after it on another stream. Every rank
// must make the same sequence of calls (forward and backward share one epoch sequence).
// schedule_given = 1: the context's schedule buffers hold this call's schedule already
// (mok_cuda_schedule_run built it from the topk_idx every rank has written again): the call does
// not build it. Context (on a keep_rows handle): what the forward keeps for its backward. Its schedule:
// offsets [El+1] int32, src_rank / src_slot [row capacity] int32; and either its rows, x_rows
// [context rows, H], h [context rows, I], gu [context rows, 2I] bf16 (a kept context), or none of
// them (a replay context: the forward runs in the handle's ring and its backward replays the
// rows into buffers of those sizes that it is given). All null: the forward keeps nothing.
// An fp8 handle's kept context is h and gu without x_rows (null): its backward pulls the bf16 x
// rows again into the handle's ring (megakernel.h: MoeBackwardArgs::fp8_forward); its replay
// context is the schedule, and the backward is given h and gu to fill.
struct Context {
  void *x_rows, *h, *gu, *offsets, *src_rank, *src_slot;
};

namespace {
enum class Kept { nothing, schedule, rows };

Kept context_kind(const ForwardHandle& h, const Context& c) {
  const bool schedule = c.offsets && c.src_rank && c.src_slot;
  const bool rows = (h.fp8 || c.x_rows) && c.h && c.gu;
  if ((c.offsets || c.src_rank || c.src_slot) && !schedule)
    throw std::invalid_argument("context buffers: give all three schedule buffers (offsets, src_rank, src_slot) or none");
  if (h.fp8 && c.x_rows)
    throw std::invalid_argument("context buffers: an fp8 forward keeps no x rows (its backward pulls them again): "
                                "give x_rows = null with h and gu");
  if ((c.x_rows || c.h || c.gu) && !(rows && schedule))
    throw std::invalid_argument(h.fp8 ? "context buffers: give h and gu with the schedule, or none"
                                      : "context buffers: give all three row buffers (x_rows, h, gu) with the schedule, "
                                        "or none");
  if (schedule && !h.keeps_rows)
    throw std::invalid_argument("this handle was created without keep_rows: it keeps no context");
  return rows ? Kept::rows : schedule ? Kept::schedule : Kept::nothing;
}

// Points a forward call at what it keeps in c (checked by context_kind): the schedule, and with
// rows h and g|u at every row's schedule position (bf16: the context's x rows and h are the ring;
// fp8: the handle's ring is the row capacity already and holds the codes).
void keep_context(const ForwardHandle& h, const Context& c, int schedule_given, mok::cuda::MoeForwardArgs& a) {
  const Kept kept = context_kind(h, c);
  if (schedule_given && kept == Kept::nothing)
    throw std::invalid_argument("schedule_given: the context's schedule buffers hold the schedule; give them");
  a.schedule_given = schedule_given != 0;
  if (kept == Kept::rows) {
    if (!h.fp8) {
      a.ring_x = c.x_rows;
      a.ring_rows = h.context_rows;
    }
    a.ring_h = c.h;
    a.gu = c.gu;
  }
  if (kept != Kept::nothing) {
    a.expert_offsets = static_cast<int32_t*>(c.offsets);
    a.src_rank = static_cast<int32_t*>(c.src_rank);
    a.src_slot = static_cast<int32_t*>(c.src_slot);
  }
}
}  // namespace

int mok_cuda_forward_run(void* handle, const int64_t* bases, const void* w_gate, const void* w_up, const void* w_down,
                         const void* y_shared, void* y_shared_ready, void* y, void* ctx_x_rows, void* ctx_h, void* ctx_gu, void* ctx_offsets,
                         void* ctx_src_rank, void* ctx_src_slot, int schedule_given, void* stream, char* error,
                         int error_len) {
  return handle_call(error, error_len, [&] {
    auto* h = static_cast<ForwardHandle*>(handle);
    if (h->fp8) throw std::invalid_argument("this forward was made with fp8: call mok_cuda_forward_run_fp8");
    const Context c{ctx_x_rows, ctx_h, ctx_gu, ctx_offsets, ctx_src_rank, ctx_src_slot};
    void* table[mok::cuda::kMaxRanks];
    mok::cuda::MoeForwardArgs a = forward_call(*h, bases, table, w_gate, w_up, w_down, y_shared, y_shared_ready, y);
    keep_context(*h, c, schedule_given, a);
    run_in_sequence(*h, a, mok::cuda::moe_forward, stream);
  });
}

// One call of the block-scaled fp8 forward (a handle made with fp8; megakernel.h:
// MoeForwardArgs::fp8): the weights as e4m3 codes with their 128 x 128 block scales
// (mok_cuda_quantize_blocks_e4m3), the rest as mok_cuda_forward_run; its kept context (training)
// is h and gu with the schedule, ctx_x_rows null (Context above).
int mok_cuda_forward_run_fp8(void* handle, const int64_t* bases, const void* w_gate, const void* w_gate_scales,
                             const void* w_up, const void* w_up_scales, const void* w_down, const void* w_down_scales,
                             const void* y_shared, void* y_shared_ready, void* y, void* ctx_x_rows, void* ctx_h,
                             void* ctx_gu, void* ctx_offsets, void* ctx_src_rank, void* ctx_src_slot,
                             int schedule_given, void* stream, char* error, int error_len) {
  return handle_call(error, error_len, [&] {
    auto* h = static_cast<ForwardHandle*>(handle);
    if (!h->fp8) throw std::invalid_argument("this forward was made without fp8: call mok_cuda_forward_run");
    const Context c{ctx_x_rows, ctx_h, ctx_gu, ctx_offsets, ctx_src_rank, ctx_src_slot};
    void* table[mok::cuda::kMaxRanks];
    mok::cuda::MoeForwardArgs a = forward_call(*h, bases, table, w_gate, w_up, w_down, y_shared, y_shared_ready, y);
    a.w_gate_scales = static_cast<const float*>(w_gate_scales);
    a.w_up_scales = static_cast<const float*>(w_up_scales);
    a.w_down_scales = static_cast<const float*>(w_down_scales);
    keep_context(*h, c, schedule_given, a);
    run_in_sequence(*h, a, mok::cuda::moe_forward, stream);
  });
}

// The backward of the forward that kept `ctx_*` (a keep_rows handle): every rank has written its
// dy, topk_w and that forward's topk_idx (the dx sum and d topk_w skip its empty slots) into its
// symmetric buffer. Weight gradients are fp32 (d_w_bf16 = 0) or bf16, and
// overwritten. replay = 1: the forward kept only its schedule (a replay context), every rank has
// written its x again too, and ctx_x_rows, ctx_h and ctx_gu are scratch the call fills first
// (megakernel.h: MoeBackwardArgs::replay). On an fp8 handle the context is the fp8 forward's h and
// gu, or with replay the scratch for them (ctx_x_rows null either way): every rank has written its
// x again, and the call pulls the bf16 x rows into the handle's ring (MoeBackwardArgs::
// fp8_forward); a replay quantizes them and reruns the fp8 gate|up with w_gate_codes / w_up_codes
// and their scales (as mok_cuda_forward_run_fp8 took them; null otherwise). On an fp8_dgrad handle
// (fp8 = 2) w_down_t, w_gate_up_t and their scales are the weights' e4m3 transposes
// (mok_cuda_quantize_blocks_e4m3_transposed; null on other handles). dx_shared (optional) is added in the dx sum, after
// dx_shared_ready (optional, a cudaEvent_t recorded after it on another stream).
int mok_cuda_backward_run(void* handle, const int64_t* bases, const void* w_gate, const void* w_up, const void* w_down,
                          const void* dx_shared, void* dx_shared_ready, void* dx, void* d_topk_w, void* d_w_gate,
                          void* d_w_up, void* d_w_down, int d_w_bf16, int replay, void* ctx_x_rows, void* ctx_h, void* ctx_gu,
                          void* ctx_offsets, void* ctx_src_rank, void* ctx_src_slot, const void* w_gate_codes,
                          const void* w_gate_scales, const void* w_up_codes, const void* w_up_scales,
                          const void* w_down_t, const void* w_down_t_scales, const void* w_gate_up_t,
                          const void* w_gate_up_t_scales, void* stream, char* error, int error_len) {
  return handle_call(error, error_len, [&] {
    auto* h = static_cast<ForwardHandle*>(handle);
    if (!h->keeps_rows) throw std::invalid_argument("this forward was created without keep_rows: it has no backward");
    const Context c{ctx_x_rows, ctx_h, ctx_gu, ctx_offsets, ctx_src_rank, ctx_src_slot};
    if (context_kind(*h, c) != Kept::rows)
      throw std::invalid_argument(replay ? "a replay backward needs its forward's schedule and buffers for the rows"
                                         : "the backward needs the context its forward kept");
    void* table[mok::cuda::kMaxRanks];
    bind_bases(*h, bases, table);
    mok::cuda::MoeBackwardArgs b = h->backward;
    b.bases = table;
    b.w_gate = w_gate;
    b.w_up = w_up;
    b.w_down = w_down;
    b.dx_shared = dx_shared;
    b.dx_shared_ready = static_cast<cudaEvent_t>(dx_shared_ready);
    b.dx = dx;
    b.d_topk_w = static_cast<float*>(d_topk_w);
    b.d_w_gate = d_w_gate;
    b.d_w_up = d_w_up;
    b.d_w_down = d_w_down;
    b.d_w_type = d_w_bf16 ? mok::cuda::GradType::bf16 : mok::cuda::GradType::fp32;
    if (!h->fp8) b.x_rows = c.x_rows;  // (fp8: the handle's ring_x, wired with fp8_forward)
    b.h = c.h;
    b.gu = c.gu;
    b.expert_offsets = static_cast<const int32_t*>(c.offsets);
    b.src_rank = static_cast<const int32_t*>(c.src_rank);
    b.src_slot = static_cast<const int32_t*>(c.src_slot);
    b.replay = replay != 0;
    b.w_gate_codes = w_gate_codes;
    b.w_gate_scales = static_cast<const float*>(w_gate_scales);
    b.w_up_codes = w_up_codes;
    b.w_up_scales = static_cast<const float*>(w_up_scales);
    const bool transposes = w_down_t || w_down_t_scales || w_gate_up_t || w_gate_up_t_scales;
    if (transposes && !h->fp8_dgrad)
      throw std::invalid_argument("the weights' transposes are for a handle made with fp8 = 2 (fp8_dgrad)");
    b.w_down_t_codes = w_down_t;
    b.w_down_t_scales = static_cast<const float*>(w_down_t_scales);
    b.w_gate_up_t_codes = w_gate_up_t;
    b.w_gate_up_t_scales = static_cast<const float*>(w_gate_up_t_scales);
    run_in_sequence(*h, b, mok::cuda::moe_backward, stream);
  });
}

// This rank's schedule alone (megakernel.h: moe_schedule), one call of the sequence: every rank
// has written its topk_idx into its symmetric buffer. offsets [El+1], src_rank and src_slot [row
// capacity] int32 (a context's schedule buffers, which a later forward with schedule_given runs
// on; rows past the real ones -1); optional: rows [El] int32, each expert's real rows, and
// send_counts, recv_counts [ranks] int64 (megakernel.h: moe_schedule).
int mok_cuda_schedule_run(void* handle, const int64_t* bases, void* offsets, void* rows, void* src_rank, void* src_slot,
                          void* send_counts, void* recv_counts, void* stream, char* error, int error_len) {
  return handle_call(error, error_len, [&] {
    auto* h = static_cast<ForwardHandle*>(handle);
    if (!h->keeps_rows) throw std::invalid_argument("this forward was created without keep_rows: it keeps no schedule");
    if (!offsets || !src_rank || !src_slot)
      throw std::invalid_argument("give the schedule's buffers (offsets, src_rank, src_slot)");
    void* table[mok::cuda::kMaxRanks];
    bind_bases(*h, bases, table);
    mok::cuda::MoeForwardArgs a = h->args;
    a.bases = table;
    a.expert_offsets = static_cast<int32_t*>(offsets);
    if (rows != nullptr) a.expert_rows = static_cast<int32_t*>(rows);
    a.src_rank = static_cast<int32_t*>(src_rank);
    a.src_slot = static_cast<int32_t*>(src_slot);
    run_in_sequence(*h, a, [&](const mok::cuda::MoeForwardArgs& args, cudaStream_t st) {
      mok::cuda::moe_schedule(args, st, static_cast<int64_t*>(send_counts), static_cast<int64_t*>(recv_counts));
    }, stream);
  });
}

int64_t mok_cuda_forward_row_capacity(void* handle) { return static_cast<ForwardHandle*>(handle)->args.row_capacity; }
int64_t mok_cuda_forward_context_rows(void* handle) { return static_cast<ForwardHandle*>(handle)->context_rows; }

// Synchronizes the device and describes the sticky status of every call so far ("" = fine).
// Returns 0 when fine, 1 when a call failed (the message says which wait or which expert id).
int mok_cuda_forward_check(void* handle, char* message, int message_len) {
  auto* h = static_cast<ForwardHandle*>(handle);
  std::string text;
  int previous = 0;
  cudaGetDevice(&previous);
  try {
    cuda_check(cudaSetDevice(h->device), "cudaSetDevice");
    cuda_check(cudaDeviceSynchronize(), "synchronize for the status");  // every stream's calls, not only the legacy one's
    int32_t words[mok::cuda::kFailureWords] = {};
    cuda_check(cudaMemcpy(words, h->args.status, sizeof words, cudaMemcpyDeviceToHost), "read the status");
    mok::cuda::RoutingStatus rs;
    cuda_check(cudaMemcpy(&rs, h->args.routing_status, sizeof rs, cudaMemcpyDeviceToHost), "read the routing status");
    int32_t experts = 0;
    if (h->keeps_rows)
      cuda_check(cudaMemcpy(&experts, h->backward.experts_status, 4, cudaMemcpyDeviceToHost), "read the status");
    unsigned long long non_finite = 0;
    if (const void* key = non_finite_key(*h))
      cuda_check(cudaMemcpy(&non_finite, key, sizeof non_finite, cudaMemcpyDeviceToHost), "read the input check");
    text = describe_statuses(*h, words, rs, experts, non_finite);
  } catch (const std::exception& e) {
    text = e.what();
  }
  cudaSetDevice(previous);
  if (message != nullptr && message_len > 0) {
    std::strncpy(message, text.c_str(), size_t(message_len - 1));
    message[message_len - 1] = '\0';
  }
  return text.empty() ? 0 : 1;
}

const char* mok_cuda_status_message(int code) { return mok::cuda::status_message(code); }

int mok_cuda_row_align() { return static_cast<int>(mok::cuda::kRowAlign); }

}  // extern "C"
