// Host API of the MoK forward on Hopper: one rank's whole routed MoE forward over symmetric
// buffers, with dispatch, the expert GEMMs and the combine fused in one persistent launch.
//
// Per call, on this rank's stream (every rank makes the same call with the same epoch):
//   1. start barrier: tell every rank this one's x, topk_idx and topk_w are in its symmetric
//      buffer (SymmetricLayout), and wait for every rank to say the same;
//   2. the routing schedule of this rank, from every rank's topk_idx (routing.h, no host sync);
//   3. the megakernel (detail/megakernel_forward.cuh): comm CTAs pull the rows of each minibatch
//      from the source ranks' x into the ring; compute CTAs run gate/up + SwiGLU and down on it
//      and push every output row into its (token, j) slot of the source rank's combine buffer;
//   4. wait until every rank has pushed its rows for this rank's tokens;
//   5. the fixed-order combine epilogue y = y_shared + sum_j topk_w[t, j] * slot[t, j].
// Nothing is allocated and the host never waits. Any skew runs in the fixed ring (the loops are
// longer, nothing is dropped). Every wait is bounded by timeout_s; a timeout ends the call with
// garbage and a status naming the rank and the wait (describe_wait_status), never a hang.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string>

#include "mok/core/symmetric_layout.h"
#include "mok/cuda/expert_kernels.h"
#include "mok/cuda/routing.h"

namespace mok::cuda {

// Status words of a rank: code (0 = fine), rank, where, seen, the epoch of the call that failed,
// and the running call's epoch (written by the call's first kernel; detail/call_status.cuh).
inline constexpr int kStatusWords = 8;
// The first of them that describe a failure: code, rank, where, seen, the failed call's epoch.
inline constexpr int kFailureWords = 5;

struct MoeForwardArgs {
  RoutingShape shape;      // R ranks, T tokens each, top-k of E experts
  int64_t rank = 0;        // this rank
  int64_t hidden = 0;      // H
  int64_t intermediate = 0;  // I
  // Every rank's symmetric buffer, as addressed from this rank's device: a host array of R base
  // pointers (bases[rank] is this rank's own), each laid out by `layout`.
  SymmetricLayout layout;
  void* const* bases = nullptr;
  // This rank's experts: El = E / R of them.
  const void* w_gate = nullptr;  // [El, I, H] bf16
  const void* w_up = nullptr;    // [El, I, H] bf16
  const void* w_down = nullptr;  // [El, H, I] bf16
  // This rank's schedule (routing.h: ScheduleArgs), rebuilt by every call unless schedule_given.
  int32_t* expert_offsets = nullptr;  // [El+1]
  int32_t* expert_rows = nullptr;     // [El]
  int32_t* src_rank = nullptr;        // [row_capacity]
  int32_t* src_slot = nullptr;        // [row_capacity]
  int64_t row_capacity = 0;           // >= routed_row_capacity(shape)
  void* schedule_workspace = nullptr; // schedule_workspace_bytes(shape)
  RoutingStatus* routing_status = nullptr;  // sticky: an out-of-range expert id
  // Optional, token_link_words(shape, row_capacity) words: with comm CTAs (comm_ctas > 0) and a
  // ring holding every row, the call links its schedule's rows of each token into it (routing.h:
  // link_token_rows) and the comm CTAs copy a row from its token's first row on this rank instead
  // of reading it from its rank again. (The comm warps read every row: megakernel_forward.cuh.)
  uint32_t* token_links = nullptr;
  // The schedule arrays hold this call's schedule already (moe_schedule built them from the
  // topk_idx every rank has written again for this call): step 2 builds only the token links.
  bool schedule_given = false;
  // The ring: S = ring_rows / minibatch_rows slots of one minibatch each.
  int64_t minibatch_rows = 0;  // a multiple of 128
  int64_t ring_rows = 0;       // a multiple of minibatch_rows
  void* ring_x = nullptr;      // [ring_rows, H] bf16
  void* ring_h = nullptr;      // [ring_rows, I] bf16
  void* gu = nullptr;          // optional [row_capacity, 2I] bf16: g | u of every row, for the backward
  uint32_t* counters = nullptr;  // megakernel_counter_words(row_capacity, minibatch_rows) words
  const void* y_shared = nullptr;  // optional [T, H] bf16: the shared expert's output, added in the combine
  // Optional: recorded where y_shared is computed (another stream); the combine waits for it, so
  // the shared expert runs beside the call's earlier kernels.
  cudaEvent_t y_shared_ready = nullptr;
  void* y = nullptr;               // [T, H] bf16 out
  uint32_t epoch = 1;        // > 0, one more on every call, the same on every rank
  // Optional, instead of `epoch`: a device word (zero before the first call; FusedBuffers has one)
  // that the call advances by one on its stream before anything else and takes as its epoch. A
  // CUDA graph replays its launches with the arguments of its capture, so only a call with this
  // word can be captured with peers: each replay then advances it like a new call (with R > 1 and
  // no word, a capture is refused). Forward and backward share it, as they share the epochs.
  uint32_t* epoch_counter = nullptr;
  int comm_ctas = 0;         // CTAs that only pull rows; 0 (the default): 3 warps of every CTA pull them
  int num_sms = 0;           // CTAs of the megakernel (0 = all SMs)
  // How the compute CTAs take their tasks: true (the default), each claims the next unclaimed
  // task from a counter when its producer is free; false, CTA c takes tasks c, c + CTAs, ...
  // The same bits either way (detail::take_task).
  bool claim_tasks = true;
  // A tile whose second 64 rows are all padding (a segment's last row block, where the segment
  // ends at most 64 rows into it): that half gets no MMA. Its outputs are not stored either way,
  // so every token row's bits are the same. Off only to measure what it saves.
  bool skip_padding_halves = true;
  std::optional<float> swiglu_limit;
  int32_t* status = nullptr;  // [kStatusWords] device words, zero before the first call: code, rank, where, seen,
                              // the failed call's epoch, the running call's epoch
  double timeout_s = 10.0;    // every wait's bound

  // Block-scaled fp8 (Precision::fp8_block; FusedBuffers made with fp8 wires the buffers below).
  // w_gate, w_up and w_down are then e4m3 codes (quantize_blocks_e4m3, fp8.h) with these scales;
  // the call quantizes this rank's x into its symmetric buffer's x_codes and x_scales before the
  // start barrier, the megakernel pulls codes and scales (half the bf16 rows' bytes) into the ring
  // (ring_x then holds codes [ring_rows, H]), runs gate|up and down as experts_forward_fp8 does
  // and pushes bf16 rows as the bf16 forward. hidden and intermediate must be multiples of 128.
  // The same bits as gather + experts_forward_fp8 + scatter + combine; g|u and ring_h (bf16 h) as
  // that forward saves them. Its backward: MoeBackwardArgs::fp8_forward.
  bool fp8 = false;
  const float* w_gate_scales = nullptr;  // [El, I / 128, H / 128]
  const float* w_up_scales = nullptr;    // [El, I / 128, H / 128]
  const float* w_down_scales = nullptr;  // [El, H / 128, I / 128]
  float* ring_x_scales = nullptr;        // [H / 128, ring_rows]: the pulled rows' scales
  uint8_t* ring_h_codes = nullptr;       // [ring_rows, I]: h quantized
  float* ring_h_scales = nullptr;        // [I / 128, ring_rows]
  uint32_t* pair_counters = nullptr;     // [row_capacity / 128 * I / 128]: h's column pairs (zeroed by the call)
};

// The backward of a forward that kept its rows (ring_rows >= row_capacity: ring_x and ring_h hold
// every row at its schedule position, gu was saved), one call per rank: start barrier (every
// rank's dy, topk_w and its forward's topk_idx are written); the backward megakernel (detail/megakernel_backward.cuh: comm
// warps pull dy rows and router weights from the source ranks; dh = dy W_down with the SwiGLU
// backward; dx = [dg|du] [W_gate; W_up] pushed into the source ranks' dx_slots, d topk_w into their
// dw_slots; then the weight gradients, fixed reduction order); a wait on every rank's arrival; the
// fixed-order dx sum. With fused = false the same steps run as stage kernels (gather, the expert
// backward whose dx GEMM, bf16 or fp8_dgrad's e4m3, pushes each row into its source rank's slot,
// the d topk_w scatter): the same bits, the planner's choice where communication is a small share
// of the backward.
//
// Replay (replay = true), for a forward that kept only its schedule (its ring smaller than the
// rows, no g|u): every rank has also written its x into its symmetric buffer again, and the call
// rebuilds the rows after the start barrier: it pulls every x row by the schedule into x_rows
// (once per token and rank with token_links), then runs gate|up + SwiGLU into h and gu (the
// forward's GEMM, the same bits), then the backward as above. Between the forward and the
// backward only the inputs and the schedule are kept (activation memory T*H against
// rows*(H + 3I)); x_rows, h and gu are then the call's scratch.
struct MoeBackwardArgs {
  RoutingShape shape;
  int64_t rank = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  SymmetricLayout layout;
  // As in MoeForwardArgs; dy, topk_w and the forward's topk_idx written into this rank's.
  void* const* bases = nullptr;
  const void* w_gate = nullptr;
  const void* w_up = nullptr;
  const void* w_down = nullptr;
  // The forward's schedule and kept rows (with replay: the rows are rebuilt here).
  const int32_t* expert_offsets = nullptr;
  const int32_t* src_rank = nullptr;
  const int32_t* src_slot = nullptr;
  int64_t row_capacity = 0;
  uint32_t* token_links = nullptr; // optional, as in MoeForwardArgs: the stage kernels' gather (and
                                   // the replay's) then reads a token once per rank (the backward
                                   // megakernel's comm warps read every row)
  int64_t minibatch_rows = 0;      // the backward megakernel's minibatch (a multiple of 128)
  uint32_t* counters = nullptr;    // megakernel_counter_words(row_capacity, minibatch_rows) words
  void* x_rows = nullptr;  // [row_capacity, H] (the forward's ring_x); written first with replay
  void* h = nullptr;       // [row_capacity, I] (the forward's ring_h); written first with replay
  void* gu = nullptr;      // [row_capacity, 2I]; written first with replay
  bool replay = false;     // rebuild x_rows, h and gu from every rank's x (above)
  // The backward of an fp8 forward (MoeForwardArgs::fp8 that kept every row: its ring held e4m3
  // codes, its ring_h every row's bf16 h, and it saved g|u): h and gu are that forward's, and
  // x_rows (scratch) is pulled again in bf16 from every rank's x, which every rank has written
  // into its symmetric buffer again. Then the bf16 backward on them, as ref::layer_backward defines
  // the fp8 layer's (the quantization passes gradients straight through).
  // With replay too (an fp8 forward that kept only its schedule): the pulled rows are quantized
  // (1 x 128, into the dy_rows scratch, free until the backward pulls dy) and the fp8 gate|up
  // runs again on them (experts_gate_up_fp8, with the forward's weights below) into h and gu:
  // the same bits as the forward's, as the bf16 replay's.
  bool fp8_forward = false;
  const void* w_gate_codes = nullptr;   // fp8_forward with replay: W_gate in e4m3 [El, I, H]
  const float* w_gate_scales = nullptr;  // and its 128 x 128 scales [El, I / 128, H / 128]
  const void* w_up_codes = nullptr;     // W_up in e4m3 [El, I, H]
  const float* w_up_scales = nullptr;    // [El, I / 128, H / 128]
  // Precision::fp8_dgrad (with fp8_forward): the expert backward's data gradients on e4m3
  // (experts_backward_fp8_dgrad, fp8.h), as ref::layer_backward defines that precision's. The
  // stage kernels only (fused = false: the backward megakernel is bf16). The weights' transposes
  // (quantize_blocks_e4m3_transposed) and fp8_dgrad_scratch_bytes(row_capacity, H, I) of scratch.
  bool fp8_dgrad = false;
  const void* w_down_t_codes = nullptr;     // W_down^T in e4m3 [El, I, H]
  const float* w_down_t_scales = nullptr;   // [El, I / 128, H / 128]
  const void* w_gate_up_t_codes = nullptr;  // [W_gate^T | W_up^T] in e4m3 [El, H, 2I]
  const float* w_gate_up_t_scales = nullptr;  // [El, H / 128, 2I / 128]
  void* fp8_dgrad_scratch = nullptr;
  // Scratch, [row_capacity] rows each: dy rows, router weights, dg|du, w*h, d topk_w partials.
  void* dy_rows = nullptr;         // [cap, H] bf16
  float* row_weight = nullptr;     // [cap]
  void* dgu = nullptr;             // [cap, 2I] bf16
  void* hw = nullptr;              // [cap, I] bf16
  float* dw_partial = nullptr;     // [cap, dw_partial_blocks(I)]
  // Optional [cap, H] bf16: only MOK_EXPERIMENT_DX_SCATTER=kernel's stage kernels use it (dx rows
  // written, then scattered; refused by name without it); otherwise the dx GEMM pushes its rows.
  // FusedBuffers::wire does not set it.
  void* dx_rows = nullptr;
  float* d_row_weight = nullptr;   // [cap]
  // Outputs.
  void* d_w_gate = nullptr;        // [El, I, H] d_w_type
  void* d_w_up = nullptr;          // [El, I, H] d_w_type
  void* d_w_down = nullptr;        // [El, H, I] d_w_type
  GradType d_w_type = GradType::fp32;
  const void* dx_shared = nullptr; // optional [T, H] bf16, added into dx (in the fp32 sum: one rounding)
  // Optional: recorded where dx_shared is computed (another stream); the dx sum waits for it, so
  // the shared expert's backward runs beside the call's earlier kernels.
  cudaEvent_t dx_shared_ready = nullptr;
  void* dx = nullptr;              // [T, H] bf16
  float* d_topk_w = nullptr;       // [T*k] fp32
  uint32_t epoch = 1;              // shares the forward's sequence: one more than the call before
  uint32_t* epoch_counter = nullptr;  // optional, as in MoeForwardArgs (the same word)
  std::optional<float> swiglu_limit;
  int32_t* status = nullptr;       // [kStatusWords], as in MoeForwardArgs
  int32_t* experts_status = nullptr;  // [1], the expert kernels' status word
  double timeout_s = 10.0;
  int num_sms = 0;     // CTAs of the backward megakernel (0 = all SMs)
  bool claim_tasks = true;          // as MoeForwardArgs's, for the backward megakernel's tasks
  bool skip_padding_halves = true;  // as MoeForwardArgs's: the backward megakernel's dh and dx tiles
  // true: the backward megakernel (needs minibatch_rows and counters: FusedBuffers::wire sets
  // them); false: the stage kernels. The C API and mok.moe take the planner's choice.
  bool fused = false;
};
std::string can_implement(const MoeBackwardArgs& args);
void moe_backward(const MoeBackwardArgs& args, cudaStream_t stream);

int64_t megakernel_counter_words(int64_t row_capacity, int64_t minibatch_rows);

// The local buffers of one rank's fused forward in one zeroed device allocation (on the current
// device): the schedule and its workspace, the status words, the ring and the counters; with
// keep_rows also the backward's scratch. Inputs, outputs, g|u and the symmetric buffer stay the
// caller's. Every user of moe_forward (the C API, the mok program, the GPU tests, the timing tool)
// gets its buffers here.
class FusedBuffers {
 public:
  // fp8: the fp8 forward's buffers too (MoeForwardArgs::fp8; hidden and intermediate multiples of
  // 128), and wire() sets fp8; with keep_rows its backward (MoeBackwardArgs::fp8_forward, which
  // wire() sets) pulls the bf16 x rows again: into ring_x when the ring holds every row (its codes
  // are dead by then; ring_x is bf16-sized), else into the replay's scratch.
  FusedBuffers(const RoutingShape& shape, int64_t hidden, int64_t intermediate, int64_t minibatch_rows,
               int64_t ring_rows, bool keep_rows, bool fp8 = false);
  ~FusedBuffers();
  FusedBuffers(const FusedBuffers&) = delete;
  FusedBuffers& operator=(const FusedBuffers&) = delete;

  // Sets a's shape (shape, hidden, intermediate, the symmetric layout: what the buffers were sized
  // for), its buffer fields and their sizes: the schedule, its workspace, the statuses, row
  // capacity, minibatch and ring rows, the ring, the counters. The caller sets the rank, bases,
  // weights, outputs and options.
  void wire(MoeForwardArgs& a) const;
  // Sets b's shape as above, its scratch, statuses and row capacity, and the forward's schedule;
  // x_rows and h too when the ring holds every row (ring_rows >= row capacity). Only with keep_rows.
  void wire(MoeBackwardArgs& b) const;

  int64_t bytes() const { return bytes_; }
  int64_t row_capacity() const { return capacity_; }
  int64_t ring_rows() const { return ring_rows_; }
  void* ring_x() const { return at(o_.ring_x); }
  void* ring_h() const { return at(o_.ring_h); }
  uint8_t* ring_h_codes() const { return fp8_ ? static_cast<uint8_t*>(at(o_.ring_h_codes)) : nullptr; }
  float* ring_h_scales() const { return fp8_ ? static_cast<float*>(at(o_.ring_h_scales)) : nullptr; }
  float* ring_x_scales() const { return fp8_ ? static_cast<float*>(at(o_.ring_x_scales)) : nullptr; }
  int32_t* status() const { return static_cast<int32_t*>(at(o_.status)); }
  RoutingStatus* routing_status() const { return static_cast<RoutingStatus*>(at(o_.routing_status)); }
  int32_t* expert_offsets() const { return static_cast<int32_t*>(at(o_.offsets)); }
  int32_t* experts_status() const { return keep_rows_ ? static_cast<int32_t*>(at(o_.experts_status)) : nullptr; }
  // A word for MoeForwardArgs::epoch_counter (zero at creation; wire() does not set it).
  uint32_t* epoch_counter() const { return static_cast<uint32_t*>(at(o_.epoch)); }

 private:
  struct Offsets {
    int64_t offsets, rows, src_rank, src_slot, links, workspace, routing_status, ring_x, ring_h, counters, status, epoch;
    int64_t dy_rows, row_weight, dgu, hw, dw_partial, d_row_weight, experts_status;  // keep_rows
    int64_t ring_x_scales, ring_h_codes, ring_h_scales, pair_counters;                   // fp8
  };
  void* at(int64_t offset) const { return static_cast<char*>(memory_) + offset; }
  RoutingShape shape_;
  int64_t hidden_, intermediate_, minibatch_rows_, ring_rows_, capacity_, bytes_ = 0;
  bool keep_rows_, fp8_;
  Offsets o_{};
  void* memory_ = nullptr;
  int device_ = 0;
};

// Loads every kernel moe_forward and moe_backward launch, on the current device. Both call it
// before their first spinning kernel; one host thread that drives several GPUs should also call
// it on every device before the first call on any (loading a module can synchronize, and a
// spinning rank would then hold up the launch of the rank it waits for).
void preload_kernels();
// Why moe_forward cannot run these arguments, or "" when it can.
std::string can_implement(const MoeForwardArgs& args);
void moe_forward(const MoeForwardArgs& args, cudaStream_t stream);

// This rank's schedule alone (the explicit passes' build_schedule), into args' expert_offsets,
// expert_rows, src_rank and src_slot: a start barrier (every rank's topk_idx is in its symmetric
// buffer; every rank makes this call), the schedule (routing.h), then an end barrier (every rank
// has read every topk_idx, so a later call may overwrite them). One call of the epoch sequence.
// Reads only the shapes (hidden, intermediate and swiglu_limit too: the call word), the rank,
// layout and bases, the schedule's arrays, workspace and routing status, status, epoch (or
// epoch_counter) and timeout of args. A later moe_forward with schedule_given
// runs on it; a bad expert id is reported as moe_forward reports it. src_rank and src_slot are
// -1 past expert_offsets[El] too (the whole arrays are set first). Optional, int64 [ranks] each
// (routing.h: schedule_totals): send_counts, this rank's slots routed to each rank's experts, and
// recv_counts, the schedule's rows pulled from each rank.
std::string can_implement_schedule(const MoeForwardArgs& args);
void moe_schedule(const MoeForwardArgs& args, cudaStream_t stream, int64_t* send_counts = nullptr,
                  int64_t* recv_counts = nullptr);

// "" for a clean status, else what failed, e.g. "rank 0 timed out waiting at the start barrier for
// rank 1 (saw epoch 0, wanted 3)" or the expert kernels' status message. The epoch named is the one
// the failed wait recorded (words[4]), whoever counted it: the host or the device's counter.
std::string describe_wait_status(const int32_t words[kFailureWords]);

}  // namespace mok::cuda
