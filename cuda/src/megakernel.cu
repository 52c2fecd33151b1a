// Host side of the fused forward (include/mok/cuda/megakernel.h).
#include "mok/cuda/megakernel.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <atomic>
#include <string>
#include <sstream>
#include <stdexcept>

#include "launch_util.h"
#include "mok/cuda/detail/megakernel_backward.cuh"
#include "mok/cuda/detail/megakernel_fp8.cuh"
#include "mok/cuda/expert_kernels.h"
#include "mok/cuda/fp8.h"

namespace mok::cuda {
namespace {

using detail::GemmConfig;
using host_util::bf;
using host_util::ceil_div;
using host_util::check;

// The megakernel's dynamic shared memory: one expert GEMM CTA's (stages, staging tiles, schedule).
using ForwardSharedStorage = detail::GroupedGemmSharedStorage<detail::ForwardMainloop::Element>;
constexpr int kForwardSmem = static_cast<int>(sizeof(ForwardSharedStorage));
constexpr int kBackwardSmem =
    static_cast<int>(sizeof(detail::GroupedGemmSharedStorage<detail::BackwardDgradMainloop::Element>));
constexpr int kFp8ForwardSmem = static_cast<int>(sizeof(detail::MegaFp8SharedStorage));
static_assert(kFp8ForwardSmem <= 232448, "the fp8 megakernel's shared storage exceeds 227 KiB");

// Every rank's non-finite key (routing.h: check_finite), a word of its symmetric buffer.
void non_finite_keys(void* const* bases, const SymmetricLayout& l, int ranks, unsigned long long** keys) {
  for (int s = 0; s < ranks; ++s) keys[s] = SymmetricLayout::at<unsigned long long>(bases[s], l.status());
}

struct CounterLayout {
  int64_t minibatches, row_blocks;
  int64_t x_ready() const { return 0; }
  int64_t y_done() const { return minibatches; }
  int64_t h_ready() const { return 2 * minibatches; }
  int64_t done_ctas() const { return 2 * minibatches + row_blocks; }
  int64_t task_claims() const { return 2 * minibatches + row_blocks + 1; }
  int64_t words() const { return 2 * minibatches + row_blocks + 2; }
};

CounterLayout counter_layout(int64_t row_capacity, int64_t minibatch_rows) {
  const int64_t row_blocks = (row_capacity + GemmConfig::kBlockM - 1) / GemmConfig::kBlockM;
  const int64_t mb_blocks = std::max<int64_t>(1, minibatch_rows / GemmConfig::kBlockM);
  return {(row_blocks + mb_blocks - 1) / mb_blocks, row_blocks};
}

uint32_t* signal_word(void* base, int64_t offset) { return SymmetricLayout::at<uint32_t>(base, offset); }

#ifdef MOK_EXPERIMENTS
int32_t experiment_skips() {
  const int32_t skips = [] {  // (read on every call: a timing run may change it between calls)
    const char* e = std::getenv("MOK_EXPERIMENT_SKIP");
    const std::string v = e != nullptr ? e : "";
    int32_t bits = 0;
    if (v.find("pull") != std::string::npos) bits |= detail::kSkipPull;
    if (v.find("push") != std::string::npos) bits |= detail::kSkipPush;
    if (v.find("waits") != std::string::npos) bits |= detail::kSkipWaits;
    if (v.find("quantize") != std::string::npos) bits |= detail::kSkipQuantize;
    if (v.find("turns") != std::string::npos) bits |= detail::kSkipTurns;
    return bits;
  }();
  return skips;
}
#endif

// Development switches for timing only (the results are WRONG), compiled in only with
// -DMOK_EXPERIMENTS (tools/gpu.sh: MOK_CUDA_FLAGS=-DMOK_EXPERIMENTS):
//   MOK_EXPERIMENT_LOCAL=pull|push|both  the megakernels pull rows from / push rows to this rank's
//       own buffers instead of the source ranks' (what NVLink costs the fused passes, session 6);
//   MOK_EXPERIMENT_SKIP=pull,push,waits,quantize,turns  the comm warps count rows without copying them,
//       the push epilogue stages its tile but stores nothing, the producers issue loads without
//       waiting on the counters (what each costs the megakernel over its GEMMs alone); quantize:
//       the fp8 forward's gate|up tiles count their pair in h_ready with neither the pair's count,
//       barrier nor quantization; turns: the backward's weight-gradient tiles are reduced by both
//       warpgroups at once, then stored by both (no turns: the same bits, for a same-process A/B).
int experiment_local_peer([[maybe_unused]] const char* which, [[maybe_unused]] int me, int s) {
#ifdef MOK_EXPERIMENTS
  static const std::string mode = [] {
    const char* e = std::getenv("MOK_EXPERIMENT_LOCAL");
    return std::string(e != nullptr ? e : "");
  }();
  return mode == "both" || mode == which ? me : s;
#else
  return s;
#endif
}

// What a rank was called with, as one word every rank compares at the start barrier: the shapes
// and the pass (FNV-1a over them; 0 is kept for "do not compare"). The minibatch, ring and SM
// counts are each rank's own business and not part of it.
// The passes a call word names: every kind of call two ranks could be making at one epoch.
enum CallPass : int {
  kForwardCall = 1, kBackwardCall = 2, kReplayBackwardCall = 3, kFp8ForwardCall = 4, kFp8BackwardCall = 5,
  kFp8ReplayBackwardCall = 6, kScheduleCall = 7
};

unsigned long long call_word(const RoutingShape& s, int64_t hidden, int64_t intermediate,
                             const std::optional<float>& swiglu_limit, CallPass pass) {
  unsigned long long h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  uint32_t limit_bits = 0;
  if (swiglu_limit) std::memcpy(&limit_bits, &*swiglu_limit, 4);
  for (int64_t v : {s.ranks, s.tokens_per_rank, s.topk, s.num_experts, hidden, intermediate,
                    int64_t(swiglu_limit.has_value()), int64_t(limit_bits), int64_t(pass)})
    mix(uint64_t(v));
  return h == 0 ? 1 : h;
}

// One single-block kernel: signal (optionally) and wait on one word per rank; with a nonzero
// `call`, also write this rank's call word and compare every peer's with it.
template <class FlagOf, class MineOf>
void barrier(int ranks, const detail::WaitStatus& status, int32_t code, bool signal,
             const FlagOf& flag_of, const MineOf& mine_of, cudaStream_t stream, unsigned long long call = 0) {
  detail::BarrierParams p{};
  p.ranks = ranks;
  p.status = status;
  p.code = code;
  p.call = call;
  for (int s = 0; s < ranks; ++s) {
    p.flags[s] = flag_of(s);
    p.mine[s] = mine_of(s);
  }
  detail::signal_barrier_kernel<<<1, 32 * ((ranks + 31) / 32), 0, stream>>>(p, signal ? 1 : 0);
  check(cudaGetLastError(), signal ? "launch start barrier" : "launch combine wait");
}

// Why an optional ready event cannot be waited on ("" when it is null or a valid event): checked
// before the first launch, since a throw after the start barrier would leave the others waiting.
std::string event_problem(cudaEvent_t event, const char* name) {
  if (event == nullptr) return "";
  const cudaError_t e = cudaEventQuery(event);
  if (e == cudaSuccess || e == cudaErrorNotReady) return "";
  cudaGetLastError();  // not sticky: clear it
  return std::string(name) + " is not a valid CUDA event (" + cudaGetErrorString(e) + ")";
}

// What the forward and the backward check alike: ranks, this rank, the layout against the
// shapes, one buffer per rank, the row capacity, the epoch and the timeout.
std::string common_checks(const RoutingShape& s, int64_t rank, int64_t hidden, const SymmetricLayout& l,
                          void* const* bases, int64_t row_capacity, uint32_t epoch, const uint32_t* epoch_counter,
                          double timeout_s) {
  std::ostringstream why;
  if (s.ranks < 1 || s.ranks > kMaxRanks) why << "ranks must be in [1, " << kMaxRanks << "], got " << s.ranks << "; ";
  if (rank < 0 || rank >= s.ranks) why << "rank " << rank << " is not in [0, " << s.ranks << "); ";
  if (l.tokens != s.tokens_per_rank || l.hidden != hidden || l.topk != s.topk || l.ranks != s.ranks)
    why << "the symmetric layout was made for T=" << l.tokens << " H=" << l.hidden << " k=" << l.topk << " R=" << l.ranks
        << ", not T=" << s.tokens_per_rank << " H=" << hidden << " k=" << s.topk << " R=" << s.ranks << "; ";
  if (bases == nullptr) {
    why << "bases (one symmetric buffer per rank) is null; ";
  } else {
    for (int64_t r = 0; r < s.ranks && r < kMaxRanks; ++r)
      if (bases[r] == nullptr) why << "bases[" << r << "] is null; ";
  }
  if (row_capacity < routed_row_capacity(s))
    why << "row_capacity " << row_capacity << " < routed_row_capacity " << routed_row_capacity(s) << "; ";
  if (row_capacity > (int64_t{1} << 30)) why << "row_capacity must be <= 2^30; ";
  // The push epilogue packs a row's (rank, slot) into one register: rank << 24 | slot.
  if (int64_t{s.tokens_per_rank} * s.topk >= (int64_t{1} << 24))
    why << "tokens_per_rank * topk must be < 2^24 (the megakernel's combine slots), got "
        << int64_t{s.tokens_per_rank} * s.topk << "; ";
  if (epoch == 0 && epoch_counter == nullptr) why << "epoch must be > 0 (or an epoch_counter given); ";
  if (!(timeout_s > 0.0)) why << "timeout_s must be > 0; ";
  return why.str();
}

// Whether `stream` is being captured into a CUDA graph (a query that fails is an error naming `what`).
bool capturing(cudaStream_t stream, const char* what) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &capture);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; cleared so that it is not reported by a later call
    throw std::invalid_argument(std::string(what) + ": cannot tell whether the stream is being captured (" +
                                cudaGetErrorString(e) + ")");
  }
  return capture != cudaStreamCaptureStatusNone;
}

// A CUDA graph replays its launches with the arguments they were captured with. A call whose epoch
// is one of them (no epoch_counter) is right in a replay only alone: one rank meets only itself at
// its barriers, in stream order; with peers, a replay would find their flags at that epoch already
// and read their buffers before they wrote this call's rows. Refused before anything is launched
// (the capture stays valid).
void refuse_capture_with_peers(const RoutingShape& s, const uint32_t* epoch_counter, cudaStream_t stream,
                               const char* what) {
  if (s.ranks <= 1 || epoch_counter != nullptr) return;
  if (capturing(stream, what))
    throw std::invalid_argument(
        std::string(what) + ": CUDA graph capture of a call with " + std::to_string(s.ranks) +
        " ranks needs an epoch_counter (with the epoch a launch argument, a replay would pass the peers' "
        "barriers without them)");
}

// The running call's epoch into the status words (call_status.cuh: kCallEpochWord), where every
// later kernel of the call reads it: the launch argument, or the counter's next value.
__global__ void begin_call_kernel(int32_t* words, uint32_t* counter, uint32_t epoch) {
  if (counter != nullptr) epoch = ++*counter;
  words[detail::kCallEpochWord] = static_cast<int32_t>(epoch);
}

void begin_call(int32_t* words, uint32_t* counter, uint32_t epoch, cudaStream_t stream) {
  begin_call_kernel<<<1, 1, 0, stream>>>(words, counter, epoch);
  check(cudaGetLastError(), "launch the call's start");
}

// What both passes' megakernel reads beside its GEMMs (detail::MegaPassParams), from a call's
// arguments (MoeForwardArgs or MoeBackwardArgs: the same names): rows pulled from every rank's
// `pull` region into `ring_x` (`ring_rows` of them), pushed into their `push` region, and this
// rank's arrival word at `arrived` on each. The caller sets the GEMMs' tile counts.
template <class Args>
void wire_pass(detail::MegaPassParams& p, const Args& a, void* ring_x, int64_t ring_rows, int comm, int64_t pull,
               int64_t push, int64_t arrived) {
  const RoutingShape& shape = a.shape;
  const int R = int(shape.ranks), me = int(a.rank);
  const CounterLayout counters = counter_layout(a.row_capacity, a.minibatch_rows);
  p.experts = int(shape.local_experts());
  p.row_capacity = int(a.row_capacity);
  p.ring_rows = int(ring_rows);
  p.mb_rows = int(a.minibatch_rows);
  p.comm_ctas = comm;
  p.comm_warps = comm == 0 ? 1 : 0;
  p.ranks = R;
  p.rank = me;
  p.topk = int(shape.topk);
  p.slots = int(shape.slots());
  p.hidden = int(a.hidden);
  p.row_vectors = int(a.hidden / 8);
  p.offsets = a.expert_offsets;
  p.src_rank = a.src_rank;
  p.src_slot = a.src_slot;
  // Comm CTAs copy rows from their token's first row where no ring slot is reused (comm warps
  // cannot: megakernel_forward.cuh, pull_minibatches_once).
  p.row_first = comm > 0 && ring_rows >= a.row_capacity && a.token_links != nullptr
                    ? token_first_rows(a.token_links, a.row_capacity)
                    : nullptr;
  p.ring_x = static_cast<uint4*>(ring_x);
  p.x_ready = a.counters + counters.x_ready();
  p.y_done = a.counters + counters.y_done();
  p.h_ready = a.counters + counters.h_ready();
  p.done_ctas = a.counters + counters.done_ctas();
  p.task_claims = a.counters + counters.task_claims();
  p.claim_tasks = a.claim_tasks ? 1 : 0;
  p.skip_padding_halves = a.skip_padding_halves ? 1 : 0;
  p.status = detail::WaitStatus{a.status, me, static_cast<uint64_t>(a.timeout_s * 1e9)};
#ifdef MOK_EXPERIMENTS
  p.experiment_skips = experiment_skips();
#endif
  for (int s = 0; s < R; ++s) {
    p.x[s] = SymmetricLayout::at<const uint4>(a.bases[experiment_local_peer("pull", me, s)], pull);
    p.combine[s] = SymmetricLayout::at<__nv_bfloat16>(a.bases[experiment_local_peer("push", me, s)], push);
    p.arrived[s] = signal_word(a.bases[s], arrived);
  }
}

}  // namespace

namespace {
// Whether the buffers' token links are wired (each token read once per rank): yes unless
// MOK_TOKEN_LINKS=0, a measurement switch (the same bits either way).
bool token_links_wanted() {
  const char* v = std::getenv("MOK_TOKEN_LINKS");
  return v == nullptr || std::strcmp(v, "0") != 0;
}
}  // namespace

FusedBuffers::FusedBuffers(const RoutingShape& shape, int64_t hidden, int64_t intermediate, int64_t minibatch_rows,
                           int64_t ring_rows, bool keep_rows, bool fp8)
    : shape_(shape),
      hidden_(hidden),
      intermediate_(intermediate),
      minibatch_rows_(minibatch_rows),
      ring_rows_(ring_rows),
      capacity_(routed_row_capacity(shape)),
      keep_rows_(keep_rows),
      fp8_(fp8) {
  if (hidden <= 0 || intermediate <= 0 || minibatch_rows <= 0 || ring_rows <= 0)
    throw std::invalid_argument("mok FusedBuffers: hidden, intermediate, minibatch_rows and ring_rows must be > 0");
  if (fp8 && (hidden % 128 != 0 || intermediate % 128 != 0))
    throw std::invalid_argument("mok FusedBuffers: fp8 needs hidden and intermediate multiples of 128, got " +
                                std::to_string(hidden) + " and " + std::to_string(intermediate));
  const int64_t El = shape.local_experts(), cap = capacity_, H = hidden, I = intermediate;
  int64_t end = 0;
  auto take = [&](int64_t bytes) {  // 256-byte aligned pieces of one allocation
    const int64_t offset = end;
    end += (bytes + 255) / 256 * 256;
    return offset;
  };
  o_.offsets = take((El + 1) * 4);
  o_.rows = take(El * 4);
  o_.src_rank = take(cap * 4);
  o_.src_slot = take(cap * 4);
  o_.links = take(token_link_words(shape, cap) * 4);
  o_.workspace = take(schedule_workspace_bytes(shape));
  o_.routing_status = take(sizeof(RoutingStatus));
  o_.ring_x = take(ring_rows * H * 2);
  o_.ring_h = take(ring_rows * I * 2);
  o_.counters = take(megakernel_counter_words(cap, minibatch_rows) * 4);
  o_.status = take(kStatusWords * 4);
  o_.epoch = take(4);
  if (keep_rows) {
    o_.dy_rows = take(cap * H * 2);
    o_.row_weight = take(cap * 4);
    o_.dgu = take(cap * 2 * I * 2);
    o_.hw = take(cap * I * 2);
    o_.dw_partial = take(cap * dw_partial_blocks(I) * 4);
    o_.d_row_weight = take(cap * 4);
    o_.experts_status = take(16);
  }
  if (fp8) {
    o_.ring_x_scales = take(H / 128 * ring_rows * 4);
    o_.ring_h_codes = take(ring_rows * I);
    o_.ring_h_scales = take(I / 128 * ring_rows * 4);
    o_.pair_counters = take(ceil_div(cap, int64_t{GemmConfig::kBlockM}) * (I / 128) * 4);
  }
  bytes_ = std::max<int64_t>(end, 256);
  check(cudaGetDevice(&device_), "cudaGetDevice");
  check(cudaMalloc(&memory_, size_t(bytes_)), "allocate the fused forward's buffers");
  // Zeroed before any stream of the caller's uses them (statuses and counters start at 0).
  check(cudaMemset(memory_, 0, size_t(bytes_)), "zero the fused forward's buffers");
  check(cudaDeviceSynchronize(), "zero the fused forward's buffers");
}

FusedBuffers::~FusedBuffers() {
  int current = 0;
  cudaGetDevice(&current);
  cudaSetDevice(device_);
  cudaFree(memory_);
  cudaSetDevice(current);
}

void FusedBuffers::wire(MoeForwardArgs& a) const {
  a.shape = shape_;
  a.hidden = hidden_;
  a.intermediate = intermediate_;
  a.layout = SymmetricLayout::make(shape_.tokens_per_rank, hidden_, shape_.topk, shape_.ranks);
  a.expert_offsets = static_cast<int32_t*>(at(o_.offsets));
  a.expert_rows = static_cast<int32_t*>(at(o_.rows));
  a.src_rank = static_cast<int32_t*>(at(o_.src_rank));
  a.src_slot = static_cast<int32_t*>(at(o_.src_slot));
  a.token_links = token_links_wanted() ? static_cast<uint32_t*>(at(o_.links)) : nullptr;
  a.row_capacity = capacity_;
  a.schedule_workspace = at(o_.workspace);
  a.routing_status = routing_status();
  a.minibatch_rows = minibatch_rows_;
  a.ring_rows = ring_rows_;
  a.ring_x = ring_x();
  a.ring_h = ring_h();
  a.counters = static_cast<uint32_t*>(at(o_.counters));
  a.status = status();
  a.fp8 = fp8_;
  if (fp8_) {
    a.ring_x_scales = ring_x_scales();
    a.ring_h_codes = ring_h_codes();
    a.ring_h_scales = ring_h_scales();
    a.pair_counters = static_cast<uint32_t*>(at(o_.pair_counters));
  }
}

void FusedBuffers::wire(MoeBackwardArgs& b) const {
  if (!keep_rows_) throw std::invalid_argument("mok FusedBuffers: the backward's scratch needs keep_rows");
  b.shape = shape_;
  b.hidden = hidden_;
  b.intermediate = intermediate_;
  b.layout = SymmetricLayout::make(shape_.tokens_per_rank, hidden_, shape_.topk, shape_.ranks);
  b.expert_offsets = expert_offsets();
  b.src_rank = static_cast<const int32_t*>(at(o_.src_rank));
  b.src_slot = static_cast<const int32_t*>(at(o_.src_slot));
  b.row_capacity = capacity_;
  b.token_links = token_links_wanted() ? static_cast<uint32_t*>(at(o_.links)) : nullptr;
  b.minibatch_rows = minibatch_rows_;
  b.counters = static_cast<uint32_t*>(at(o_.counters));
  if (ring_rows_ >= capacity_) {  // every row kept at its schedule position
    b.x_rows = ring_x();  // (fp8: the forward's codes are dead by then; the backward pulls bf16 rows into it)
    b.h = ring_h();
  }
  b.fp8_forward = fp8_;
  b.dy_rows = at(o_.dy_rows);
  b.row_weight = static_cast<float*>(at(o_.row_weight));
  b.dgu = at(o_.dgu);
  b.hw = at(o_.hw);
  b.dw_partial = static_cast<float*>(at(o_.dw_partial));
  b.d_row_weight = static_cast<float*>(at(o_.d_row_weight));
  b.status = status();
  b.experts_status = experts_status();
}

void preload_kernels() {
  // Once per device: every call of moe_forward / moe_backward comes here, and after the first
  // the loads are no-ops that still cost host time on the hot path.
  static std::atomic<uint64_t> loaded{0};
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (loaded.load(std::memory_order_acquire) & bit) != 0) return;
  preload_routing_kernels();
  preload_expert_kernels();
  cudaFuncAttributes attr;
  check(cudaFuncGetAttributes(&attr, detail::signal_barrier_kernel), "load the barrier kernel");
  check(cudaFuncGetAttributes(&attr, begin_call_kernel), "load the call's start");
  check(cudaFuncSetAttribute(detail::megakernel_kernel<detail::ForwardPass>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kForwardSmem),
        "load the megakernel");
  check(cudaFuncSetAttribute(detail::megakernel_kernel<detail::BackwardPass>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, kBackwardSmem),
        "load the backward megakernel");
  check(cudaFuncSetAttribute(detail::megakernel_fp8_forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kFp8ForwardSmem),
        "load the fp8 megakernel");
  preload_fp8_kernels();
  loaded.fetch_or(bit, std::memory_order_release);
}

int64_t megakernel_counter_words(int64_t row_capacity, int64_t minibatch_rows) {
  return counter_layout(row_capacity, minibatch_rows).words();
}

namespace {
// A pass's tiles, as its launcher sets them (MegaPassParams, MegaBackwardParams) and can_implement
// counts them: per row block, the column tiles of its two GEMMs; the backward's weight gradients
// per expert, W_gate's and W_up's wg_m x wg_n tiles each and W_down's wd_m x wd_n (MegaTasks).
struct PassTiles {
  int64_t n_first, n_second;
  int64_t wg_m = 0, wg_n = 0, wd_m = 0, wd_n = 0;
  int64_t total(int64_t row_capacity, int64_t experts) const {
    return ceil_div(row_capacity, int64_t{GemmConfig::kBlockM}) * (n_first + n_second) +
           experts * (2 * wg_m * wg_n + wd_m * wd_n);
  }
};
// Gate|up (128 gate and 128 up columns a tile), then down; fp8: 64 and 64, then 128-column tiles.
PassTiles forward_tiles(int64_t H, int64_t I, bool fp8 = false) {
  if (fp8) return {ceil_div(I, int64_t{64}), ceil_div(H, int64_t{128})};
  return {ceil_div(I, int64_t{GemmConfig::kHalfN}), ceil_div(H, int64_t{GemmConfig::kBlockN})};
}
// dh with the SwiGLU backward (one tile per d topk_w partial block), dx, then the weight gradients.
PassTiles backward_tiles(int64_t H, int64_t I) {
  const int64_t m = GemmConfig::kBlockM, n = GemmConfig::kBlockN;
  return {dw_partial_blocks(I), ceil_div(H, n), ceil_div(I, m), ceil_div(H, n), ceil_div(H, m), ceil_div(I, n)};
}

// A megakernel task's id shares its word with a flag (detail::kPaddingHalfFlag).
std::string tile_limit(const char* pass, int64_t tasks) {
  if (tasks < detail::kPaddingHalfFlag) return "";
  return "too many tiles for one " + std::string(pass) + " call (" + std::to_string(tasks) +
         " >= 2^30: fewer tokens per call); ";
}
}  // namespace

std::string can_implement(const MoeForwardArgs& a) {
  std::ostringstream why;
  const RoutingShape& s = a.shape;
  const int64_t El = s.local_experts();
  why << common_checks(s, a.rank, a.hidden, a.layout, a.bases, a.row_capacity, a.epoch, a.epoch_counter,
                        a.timeout_s);
  if (s.tokens_per_rank < 0 || s.topk < 1 || s.num_experts < 1 || s.num_experts % std::max<int64_t>(s.ranks, 1) != 0)
    why << "bad routing shape (T=" << s.tokens_per_rank << ", k=" << s.topk << ", E=" << s.num_experts << "); ";
  if (El < 1 || El > GemmConfig::kMaxExperts)
    why << "local experts must be in [1, " << GemmConfig::kMaxExperts << "], got " << El << "; ";
  if (a.hidden < 8 || a.hidden % 8 != 0) why << "hidden must be a positive multiple of 8, got " << a.hidden << "; ";
  if (a.intermediate < 8 || a.intermediate % 8 != 0)
    why << "intermediate must be a positive multiple of 8, got " << a.intermediate << "; ";
  if (!a.w_gate || !a.w_up || !a.w_down || !a.expert_offsets || !a.expert_rows || !a.src_rank || !a.src_slot ||
      !a.schedule_workspace || !a.routing_status || !a.ring_x || !a.ring_h || !a.counters || !a.y || !a.status)
    why << "weights, schedule buffers, ring, counters, y and status must not be null; ";
  if (a.minibatch_rows < GemmConfig::kBlockM || a.minibatch_rows % GemmConfig::kBlockM != 0)
    why << "minibatch_rows must be a positive multiple of 128, got " << a.minibatch_rows << "; ";
  else if (a.ring_rows < a.minibatch_rows || a.ring_rows % a.minibatch_rows != 0)
    why << "ring_rows must be a positive multiple of minibatch_rows (" << a.minibatch_rows << "), got " << a.ring_rows
        << "; ";
  if (a.swiglu_limit && !(*a.swiglu_limit > 0.0f)) why << "swiglu_limit must be > 0; ";
  if (a.row_capacity > 0 && a.hidden > 0 && a.intermediate > 0)
    why << tile_limit("forward", forward_tiles(a.hidden, a.intermediate, a.fp8).total(a.row_capacity, 0));
  if (a.fp8) {
    if (a.hidden % 128 != 0 || a.intermediate % 128 != 0)
      why << "fp8 needs hidden and intermediate multiples of 128 (whole scale blocks), got " << a.hidden << " and "
          << a.intermediate << "; ";
    if (!a.w_gate_scales || !a.w_up_scales || !a.w_down_scales || !a.ring_x_scales || !a.ring_h_codes ||
        !a.ring_h_scales || !a.pair_counters)
      why << "fp8 needs the weights' scales, the ring's scales, h's codes and scales and the pair counters "
             "(FusedBuffers made with fp8 wires them); ";
  }
  return host_util::trimmed(why.str());
}

namespace {

// A cooperative launch: every CTA is resident before any runs. Compute CTAs own their tasks
// statically and spin on each other's counters, so a CTA held back by other work on the GPU
// (another stream's kernels) would otherwise stall the ones waiting for it until the timeout.
template <class Params>
void launch_cooperative(void (*kernel)(Params), Params& p, int sms, int smem, cudaStream_t stream, const char* what) {
  void* args[] = {&p};
  check(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(sms), dim3(GemmConfig::kThreads), args,
                                    smem, stream),
        what);
}

// The bf16 forward megakernel (detail/megakernel_forward.cuh) of moe_forward's step 3.
void launch_forward_megakernel(const MoeForwardArgs& a, int sms, int comm, cudaStream_t stream) {
  using Mainloop = detail::ForwardMainloop;
  const int64_t H = a.hidden, I = a.intermediate, El = a.shape.local_experts();
  const SymmetricLayout& l = a.layout;
  const int me = int(a.rank);
  const int64_t ring = a.ring_rows, cap = a.row_capacity;
  detail::MegaForwardParams p{};
  p.first_load = Mainloop::Params{Mainloop::make_a(bf(a.ring_x), int(ring), int(H)),
                               Mainloop::make_b(bf(a.w_gate), int(I), int(H), int(El)),
                               Mainloop::make_b(bf(a.w_up), int(I), int(H), int(El)), int(ring), int(H), int(I), int(El),
                               /*b1_row_shift=*/0};
  p.second_load = Mainloop::Params{Mainloop::make_a(bf(a.ring_h), int(ring), int(I)),
                                 Mainloop::make_b(bf(a.w_down), int(H), int(I), int(El)),
                                 Mainloop::make_b(bf(a.w_down), int(H), int(I), int(El)), int(ring), int(I), int(H),
                                 int(El), /*b1_row_shift=*/1};
  void* gu = a.gu != nullptr ? a.gu : a.ring_h;  // a valid pointer for the unused descriptors
  p.first_store = detail::SwiGluEpilogue::Params{
      host_util::store_target(a.ring_h, ring, I, I), host_util::store_target(gu, a.gu ? cap : ring, I, a.gu ? 2 * I : I),
      host_util::store_target(a.gu ? static_cast<void*>(bf(a.gu) + I) : a.ring_h, a.gu ? cap : ring, I, a.gu ? 2 * I : I),
      a.gu != nullptr, a.swiglu_limit.has_value(), a.swiglu_limit.value_or(0.0f)};
  wire_pass(p, a, a.ring_x, ring, comm, l.x, l.combine, l.combine_arrived(me));
  const PassTiles tiles = forward_tiles(H, I);
  p.n_first = int(tiles.n_first);
  p.n_second = int(tiles.n_second);
  p.k_first = ceil_div(H, detail::ForwardMainloop::kBlockK);
  p.k_second = ceil_div(I, detail::ForwardMainloop::kBlockK);
  launch_cooperative(detail::megakernel_kernel<detail::ForwardPass>, p, sms, kForwardSmem, stream,
                     "launch the megakernel (cooperative: all CTAs resident)");
}

// The fp8 forward megakernel (detail/megakernel_fp8.cuh) of moe_forward's step 3: the ring holds
// e4m3 codes and k-block-major scales, h is stored in bf16 and quantized into ring_h_codes.
void launch_fp8_megakernel(const MoeForwardArgs& a, int sms, int comm, cudaStream_t stream) {
  using detail::float_e4m3_t;
  const int64_t H = a.hidden, I = a.intermediate, El = a.shape.local_experts();
  const SymmetricLayout& l = a.layout;
  const int me = int(a.rank), ring = int(a.ring_rows), h = int(H), i = int(I), experts = int(El);
  const int64_t cap = a.row_capacity;
  auto e4m3 = [](const void* ptr) { return static_cast<const float_e4m3_t*>(ptr); };
  check(cudaMemsetAsync(a.pair_counters, 0, size_t(ceil_div(cap, int64_t{GemmConfig::kBlockM})) * (I / 128) * 4, stream),
        "zero the pair counters");
  detail::MegaFp8ForwardParams p{};
  wire_pass(p, a, a.ring_x, a.ring_rows, comm, l.x_codes, l.combine, l.combine_arrived(me));
  p.row_vectors = int(H / 16);  // a row of codes
  p.skip_padding_halves = 0;    // (the fp8 tasks compute whole tiles)
  const PassTiles tiles = forward_tiles(H, I, /*fp8=*/true);
  p.n_first = int(tiles.n_first);  // 64 W_gate and 64 W_up rows a tile
  p.n_second = int(tiles.n_second);
  p.k_first = h / 128;
  p.k_second = i / 128;
  p.tma_x = detail::fp8_tma_a(e4m3(a.ring_x), ring, h);
  p.tma_h = detail::fp8_tma_a(e4m3(a.ring_h_codes), ring, i);
  p.tma_down = detail::fp8_tma_b(e4m3(a.w_down), h, i, experts);
  p.tma_gate = detail::fp8_tma_b_half(e4m3(a.w_gate), i, h, experts);
  p.tma_up = detail::fp8_tma_b_half(e4m3(a.w_up), i, h, experts);
  p.gate_scales = a.w_gate_scales;
  p.up_scales = a.w_up_scales;
  p.down_scales = a.w_down_scales;
  p.ring_scales = a.ring_x_scales;
  p.ring_h = static_cast<const __nv_bfloat16*>(a.ring_h);
  p.ring_h_codes = a.ring_h_codes;
  p.ring_h_scales = a.ring_h_scales;
  p.h_out = host_util::store_target(a.ring_h, a.ring_rows, I, I);
  const bool save = a.gu != nullptr;
  p.g = save ? host_util::store_target(a.gu, cap, I, 2 * I) : p.h_out;
  p.u = save ? host_util::store_target(bf(a.gu) + I, cap, I, 2 * I) : p.h_out;
  p.save_gu = save;
  p.has_limit = a.swiglu_limit.has_value();
  p.limit = a.swiglu_limit.value_or(0.0f);
  p.pair_done = a.pair_counters;
  p.scale_blocks = h / 128;
  p.intermediate = i;
  for (int s = 0; s < int(a.shape.ranks); ++s)
    p.x_scales[s] = SymmetricLayout::at<const float>(a.bases[experiment_local_peer("pull", me, s)], l.x_scales);
  launch_cooperative(detail::megakernel_fp8_forward_kernel, p, sms, kFp8ForwardSmem, stream,
                     "launch the fp8 megakernel (cooperative: all CTAs resident)");
}

}  // namespace

namespace {

// The schedule build of a call (routing.h) from every rank's topk_idx, whose addresses go in
// `table` (kMaxRanks entries, kept by the caller while the arguments are used).
ScheduleArgs schedule_args(const MoeForwardArgs& a, const int32_t** table) {
  for (int s = 0; s < int(a.shape.ranks) && s < kMaxRanks; ++s)
    table[s] = SymmetricLayout::at<const int32_t>(a.bases[s], a.layout.topk_idx);
  ScheduleArgs sa;
  sa.shape = a.shape;
  sa.dest_rank = a.rank;
  sa.topk_idx = table;
  sa.expert_offsets = a.expert_offsets;
  sa.expert_rows = a.expert_rows;
  sa.src_rank = a.src_rank;
  sa.src_slot = a.src_slot;
  sa.row_capacity = a.row_capacity;
  sa.workspace = a.schedule_workspace;
  sa.status = a.routing_status;
  sa.given_up_words = a.status;  // a start barrier that gave up leaves an empty schedule
  return sa;
}

}  // namespace

std::string can_implement_schedule(const MoeForwardArgs& a) {
  std::ostringstream why;
  why << common_checks(a.shape, a.rank, a.hidden, a.layout, a.bases, a.row_capacity, a.epoch, a.epoch_counter,
                        a.timeout_s);
  if (a.status == nullptr) why << "status must not be null; ";
  if (why.tellp() == 0) {  // the bases are valid: the schedule's own checks
    const int32_t* table[kMaxRanks];
    why << can_implement(schedule_args(a, table));
  }
  return host_util::trimmed(why.str());
}

void moe_schedule(const MoeForwardArgs& a, cudaStream_t stream, int64_t* send_counts, int64_t* recv_counts) {
  if (const std::string why = can_implement_schedule(a); !why.empty())
    throw std::invalid_argument("mok moe_schedule: " + why);
  host_util::bind_context();
  refuse_capture_with_peers(a.shape, a.epoch_counter, stream, "mok moe_schedule");
  const int R = int(a.shape.ranks), me = int(a.rank);
  const SymmetricLayout& l = a.layout;
  void* mine = a.bases[me];
  const detail::WaitStatus status{a.status, me, static_cast<uint64_t>(a.timeout_s * 1e9)};
  preload_kernels();  // before the barrier spins (see moe_forward)
  const int32_t* topk_idx[kMaxRanks];
  const ScheduleArgs sa = schedule_args(a, topk_idx);
  // Every row past the real ones a padding row (local buffers: set before anything other ranks see).
  for (int32_t* rows : {a.src_rank, a.src_slot})
    check(cudaMemsetAsync(rows, 0xff, size_t(a.row_capacity) * sizeof(int32_t), stream), "clear the schedule's rows");
  begin_call(a.status, a.epoch_counter, a.epoch, stream);
  // 1. Every rank's topk_idx is written, and every rank makes this call.
  barrier(R, status, detail::kWaitBarrier, true,
          [&](int s) { return signal_word(a.bases[s], l.barrier(me)); },
          [&](int s) { return signal_word(mine, l.barrier(s)); }, stream,
          call_word(a.shape, a.hidden, a.intermediate, a.swiglu_limit, kScheduleCall));
  // 2. The schedule and its totals.
  build_schedule(sa, stream);
  schedule_totals(sa, send_counts, recv_counts, stream);
  // 3. Every rank has read every rank's topk_idx (the combine's arrival words: this call pushes no rows).
  barrier(R, status, detail::kWaitScheduled, true,
          [&](int s) { return signal_word(a.bases[s], l.combine_arrived(me)); },
          [&](int s) { return signal_word(mine, l.combine_arrived(s)); }, stream);
}

void moe_forward(const MoeForwardArgs& a, cudaStream_t stream) {
  if (const std::string why = can_implement(a); !why.empty()) throw std::invalid_argument("mok moe_forward: " + why);
  host_util::bind_context();
  refuse_capture_with_peers(a.shape, a.epoch_counter, stream, "mok moe_forward");
  const RoutingShape& shape = a.shape;
  const int R = int(shape.ranks), me = int(a.rank);
  const int64_t H = a.hidden, I = a.intermediate, El = shape.local_experts();
  const SymmetricLayout& l = a.layout;
  void* mine = a.bases[me];
  const detail::WaitStatus status{a.status, me, static_cast<uint64_t>(a.timeout_s * 1e9)};
  // Every kernel of the call is loaded before the first one that spins is launched (routing.h:
  // preload_routing_kernels says why; seen: one process driving two GPUs timed out at the barrier).
  preload_kernels();

  // Everything is checked before the first launch: a throw after the start barrier would leave
  // the other ranks waiting for this one's pushes.
  const int device_sms = host_util::device_sms(0);
  const int sms = host_util::device_sms(a.num_sms);
  const int comm = a.comm_ctas;  // 0: comm warps (detail::dispatch_warps)
  if (sms > device_sms)
    throw std::invalid_argument("mok moe_forward: num_sms " + std::to_string(sms) + " exceeds the device's " +
                                std::to_string(device_sms) + " SMs (one resident CTA per SM)");
  if (comm < 0 || comm >= sms)
    throw std::invalid_argument("mok moe_forward: comm_ctas must be in [0, CTAs) to leave compute CTAs (comm_ctas " +
                                std::to_string(comm) + ", CTAs " + std::to_string(sms) + ")");
  const int32_t* topk_idx[kMaxRanks];
  const ScheduleArgs sa = schedule_args(a, topk_idx);
  CombineArgs c;
  c.tokens = shape.tokens_per_rank;
  c.hidden = H;
  c.topk = shape.topk;
  c.y_shared = a.y_shared;
  c.slots = SymmetricLayout::at<const void>(mine, l.combine);
  c.topk_w = SymmetricLayout::at<const float>(mine, l.topk_w);
  c.topk_idx = SymmetricLayout::at<const int32_t>(mine, l.topk_idx);
  c.y = a.y;
  const ScheduleView schedule{El, a.row_capacity, a.expert_offsets, a.src_rank, a.src_slot, a.status};
  // The token links serve only the comm CTAs' copies (wire_pass: the comm warps read every row).
  const bool links = a.token_links != nullptr && comm > 0 && a.ring_rows >= a.row_capacity;
  for (const std::string& why : {can_implement(sa), can_implement(c),
                                 links ? can_implement_links(shape, schedule, a.token_links) : "",
                                 event_problem(a.y_shared_ready, "y_shared_ready")})
    if (!why.empty()) throw std::invalid_argument("mok moe_forward: " + why);

  begin_call(a.status, a.epoch_counter, a.epoch, stream);
  // 0. This rank's x and topk_w are finite (else every rank's non-finite key names the element;
  //    the call runs on).
  const int64_t T = shape.tokens_per_rank;
  unsigned long long* keys[kMaxRanks];
  non_finite_keys(a.bases, l, R, keys);
  check_finite(SymmetricLayout::at<const void>(mine, l.x), false, T * H, CheckedTensor::x, me, keys, R, stream);
  check_finite(SymmetricLayout::at<const void>(mine, l.topk_w), true, T * shape.topk, CheckedTensor::topk_w, me, keys,
               R, stream);
  // fp8: this rank's x as e4m3 codes and 1 x 128 scales, where every rank pulls them from.
  if (a.fp8)
    quantize_rows_e4m3(SymmetricLayout::at<const void>(mine, l.x), T, H, SymmetricLayout::at<uint8_t>(mine, l.x_codes),
                       SymmetricLayout::at<float>(mine, l.x_scales), stream);

  // 1. Start barrier: rank s's barrier word for this rank <- epoch; wait on ours for every s; every
  //    rank's call word must be this one's.
  barrier(R, status, detail::kWaitBarrier, true,
          [&](int s) { return signal_word(a.bases[s], l.barrier(me)); },
          [&](int s) { return signal_word(mine, l.barrier(s)); }, stream,
          call_word(shape, H, I, a.swiglu_limit, a.fp8 ? kFp8ForwardCall : kForwardCall));

  // 2. This rank's schedule from every rank's topk_idx (unless given), and its token links (each
  //    token pulled once).
  if (!a.schedule_given) build_schedule(sa, stream);
  if (links) link_token_rows(shape, schedule, a.token_links, stream);

  // 3. The megakernel.
  const CounterLayout counters = counter_layout(a.row_capacity, a.minibatch_rows);
  check(cudaMemsetAsync(a.counters, 0, counters.words() * sizeof(uint32_t), stream), "zero the counters");
  if (a.fp8) {
    launch_fp8_megakernel(a, sms, comm, stream);
  } else {
    launch_forward_megakernel(a, sms, comm, stream);
  }

  // 4. Every rank's pushes for this rank's tokens have landed.
  barrier(R, status, detail::kWaitCombine, false, [&](int) { return static_cast<uint32_t*>(nullptr); },
          [&](int s) { return signal_word(mine, l.combine_arrived(s)); }, stream);

  // 5. The fixed-order weighted sum (after the shared expert, when it runs on another stream).
  if (a.y_shared_ready != nullptr) check(cudaStreamWaitEvent(stream, a.y_shared_ready, 0), "wait for y_shared");
  combine_epilogue(c, stream);
}

namespace {

// The backward megakernel (detail/megakernel_backward.cuh) on this rank's kept rows.
void launch_backward_megakernel(const MoeBackwardArgs& a, int sms, cudaStream_t stream) {
  using Mainloop = detail::BackwardDgradMainloop;
  const RoutingShape& shape = a.shape;
  const int R = int(shape.ranks), me = int(a.rank);
  const int64_t H = a.hidden, I = a.intermediate, El = shape.local_experts(), cap = a.row_capacity;
  const SymmetricLayout& l = a.layout;
  const int64_t M = a.minibatch_rows;
  const CounterLayout counters = counter_layout(cap, M);
  detail::MegaBackwardParams p{};
  // The GEMMs of the stage kernels (experts_backward), on the kept rows.
  p.first_load = host_util::dh_operands(a.dy_rows, a.w_down, cap, H, I, El);
  p.second_load = host_util::dx_operands(a.dgu, a.w_gate, a.w_up, cap, H, I, El);
  p.first_store =
      host_util::swiglu_backward_target(a.dgu, a.hw, a.gu, a.h, a.row_weight, a.dw_partial, I, a.swiglu_limit);
  p.wgrad_load[0] = host_util::weight_grad_operands(a.dgu, I, 2 * I, a.x_rows, H, cap);
  p.wgrad_load[1] = host_util::weight_grad_operands(bf(a.dgu) + I, I, 2 * I, a.x_rows, H, cap);
  p.wgrad_load[2] = host_util::weight_grad_operands(a.dy_rows, H, H, a.hw, I, cap);
  void* const outs[3] = {a.d_w_gate, a.d_w_up, a.d_w_down};
  const int64_t out_rows[3] = {I, I, H}, out_cols[3] = {H, H, I};
  p.wgrad_bf16_out = a.d_w_type == GradType::bf16 ? 1 : 0;
  for (int g = 0; g < 3; ++g) {  // both kinds of store are set (valid descriptors); one is used
    p.wgrad_bf16[g] = host_util::bf16_planes_target<64>(outs[g], out_rows[g], out_cols[g], El);
    p.wgrad_f32[g] = host_util::f32_planes_target<64>(outs[g], out_rows[g], out_cols[g], El);
  }
  const PassTiles tiles = backward_tiles(H, I);
  p.wg_m = int(tiles.wg_m);
  p.wg_n = int(tiles.wg_n);
  p.wd_m = int(tiles.wd_m);
  p.wd_n = int(tiles.wd_n);
  // One ring slot per minibatch: every row is kept. Comm warps pull (no comm CTAs).
  wire_pass(p, a, a.dy_rows, counters.minibatches * M, /*comm=*/0, l.dy, l.dx_slots, l.dx_arrived(me));
  p.n_first = int(tiles.n_first);
  p.n_second = int(tiles.n_second);
  p.k_first = ceil_div(H, Mainloop::kBlockK);
  p.k_second = 2 * ceil_div(I, Mainloop::kBlockK);
  p.row_weight = a.row_weight;
  for (int s = 0; s < R; ++s) {
    p.topk_w[s] = SymmetricLayout::at<const float>(a.bases[s], l.topk_w);
    p.dw_slots[s] = SymmetricLayout::at<float>(a.bases[s], l.dw_slots);
  }
  launch_cooperative(detail::megakernel_kernel<detail::BackwardPass>, p, sms, kBackwardSmem, stream,
                     "launch the backward megakernel (cooperative: all CTAs resident)");
}

}  // namespace

std::string can_implement(const MoeBackwardArgs& a) {
  std::ostringstream why;
  why << common_checks(a.shape, a.rank, a.hidden, a.layout, a.bases, a.row_capacity, a.epoch, a.epoch_counter,
                        a.timeout_s);
  if (!a.x_rows || !a.h || !a.gu)
    why << (a.replay ? "x_rows, h and gu (the replay's scratch) must be set; "
            : a.fp8_forward ? "x_rows (scratch), h and gu (the fp8 forward's kept rows) must be set; "
                            : "x_rows, h and gu (the forward's kept rows) must be set: the backward needs a forward "
                              "that kept them, or replay; ");
  if (a.replay && a.fp8_forward && (!a.w_gate_codes || !a.w_gate_scales || !a.w_up_codes || !a.w_up_scales))
    why << "an fp8 replay needs the forward's gate|up weights (w_gate_codes, w_up_codes and their scales); ";
  if (a.replay && a.fp8_forward && (a.hidden % 128 != 0 || a.intermediate % 128 != 0))
    why << "an fp8 replay needs hidden and intermediate multiples of 128; ";
  if (!a.dy_rows || !a.row_weight || !a.dgu || !a.hw || !a.dw_partial || !a.d_row_weight || !a.d_w_gate ||
      !a.d_w_up || !a.d_w_down || !a.dx || !a.d_topk_w || !a.status || !a.experts_status || !a.expert_offsets ||
      !a.src_rank || !a.src_slot)
    why << "scratch, outputs, schedule and status pointers must be set; ";
  if (a.fused) {
    if (a.minibatch_rows < GemmConfig::kBlockM || a.minibatch_rows % GemmConfig::kBlockM != 0)
      why << "minibatch_rows must be a positive multiple of 128, got " << a.minibatch_rows << "; ";
    if (a.counters == nullptr) why << "counters must be set (the fused backward's); ";
    // (Other sizes: moe_backward's expert kernel checks refuse them.)
    if (a.row_capacity > 0 && a.hidden > 0 && a.intermediate > 0)
      why << tile_limit("fused backward", backward_tiles(a.hidden, a.intermediate)
                                              .total(a.row_capacity, a.shape.local_experts()));
  }
  return host_util::trimmed(why.str());
}

void moe_backward(const MoeBackwardArgs& a, cudaStream_t stream) {
  if (const std::string why = can_implement(a); !why.empty()) throw std::invalid_argument("mok moe_backward: " + why);
  host_util::bind_context();
  refuse_capture_with_peers(a.shape, a.epoch_counter, stream, "mok moe_backward");
  const RoutingShape& shape = a.shape;
  const int R = int(shape.ranks), me = int(a.rank);
  const int64_t H = a.hidden, I = a.intermediate, El = shape.local_experts(), cap = a.row_capacity;
  const SymmetricLayout& l = a.layout;
  void* mine = a.bases[me];
  const detail::WaitStatus status{a.status, me, static_cast<uint64_t>(a.timeout_s * 1e9)};
  preload_kernels();  // before the barrier spins (see moe_forward)

  // Every step's arguments, checked before the first launch (see moe_forward).
  // After a start barrier that gave up, the stage kernels touch no peer buffer.
  const ScheduleView view{El, cap, a.expert_offsets, a.src_rank, a.src_slot, a.status};
  const void* dy_table[kMaxRanks];
  const void* x_table[kMaxRanks];
  const float* w_table[kMaxRanks];
  void* dx_table[kMaxRanks];
  float* dw_table[kMaxRanks];
  for (int s = 0; s < R; ++s) {
    dy_table[s] = SymmetricLayout::at<const void>(a.bases[s], l.dy);
    x_table[s] = SymmetricLayout::at<const void>(a.bases[s], l.x);
    w_table[s] = SymmetricLayout::at<const float>(a.bases[s], l.topk_w);
    dx_table[s] = SymmetricLayout::at<void>(a.bases[s], l.dx_slots);
    dw_table[s] = SymmetricLayout::at<float>(a.bases[s], l.dw_slots);
  }
  GatherArgs g;  // dy rows and router weights from their source ranks
  g.shape = shape;
  g.hidden = H;
  g.schedule = view;
  // The token links serve the stage kernels' gather and the replay's (the backward megakernel's
  // comm warps read every row).
  const bool pulls_x = a.replay || a.fp8_forward;  // the x rows are pulled again
  // The backward megakernel runs where it is asked for and there are rows (a TMA descriptor cannot
  // have a zero extent); else the stage kernels.
  const bool megakernel = a.fused && cap > 0;
  const bool links = a.token_links != nullptr && (pulls_x || !megakernel);
  g.schedule.row_link = links ? a.token_links : nullptr;
  g.x = dy_table;
  g.rows = a.dy_rows;
  g.topk_w = w_table;
  g.row_weights = a.row_weight;
  GatherArgs gx = g;  // replay and fp8_forward: the x rows from their source ranks
  gx.x = x_table;
  gx.rows = a.x_rows;
  gx.topk_w = nullptr;
  gx.row_weights = nullptr;
  ExpertsForwardArgs f;  // replay: gate|up + SwiGLU on them (h, g|u), the forward's GEMM
  f.row_capacity = cap;
  f.hidden = H;
  f.intermediate = I;
  f.local_experts = El;
  f.expert_offsets = a.expert_offsets;
  f.x = a.x_rows;
  f.w_gate = a.w_gate;
  f.w_up = a.w_up;
  f.w_down = a.w_down;
  f.gu = a.gu;
  f.h = a.h;
  f.y = a.dgu;  // checked as set; gate_up_swiglu does not write y
  f.swiglu_limit = a.swiglu_limit;
  f.status = a.experts_status;
  // fp8 replay: the pulled rows quantized into the dy rows' scratch (codes [cap, H], then their
  // k-major scales; dy is pulled only after), then the fp8 gate|up into h and gu.
  uint8_t* const replay_codes = static_cast<uint8_t*>(a.dy_rows);
  float* const replay_scales = reinterpret_cast<float*>(replay_codes + cap * H);
  ExpertsForwardFp8Args q;
  q.row_capacity = cap;
  q.hidden = H;
  q.intermediate = I;
  q.local_experts = El;
  q.expert_offsets = a.expert_offsets;
  q.x = replay_codes;
  q.x_scales = replay_scales;
  q.w_gate = static_cast<const uint8_t*>(a.w_gate_codes);
  q.w_gate_scales = a.w_gate_scales;
  q.w_up = static_cast<const uint8_t*>(a.w_up_codes);
  q.w_up_scales = a.w_up_scales;
  q.gu = a.gu;
  q.h = a.h;
  q.swiglu_limit = a.swiglu_limit;
  q.status = a.experts_status;
  const bool fp8_replay = a.replay && a.fp8_forward;
  ExpertsBackwardArgs e;  // the expert backward on this rank's rows
  e.row_capacity = cap;
  e.hidden = H;
  e.intermediate = I;
  e.local_experts = El;
  e.expert_offsets = a.expert_offsets;
  e.x = a.x_rows;
  e.gu = a.gu;
  e.h = a.h;
  e.dy = a.dy_rows;
  e.row_weight = a.row_weight;
  e.w_gate = a.w_gate;
  e.w_up = a.w_up;
  e.w_down = a.w_down;
  e.dgu = a.dgu;
  e.hw = a.hw;
  e.dw_partial = a.dw_partial;
  e.d_row_weight = a.d_row_weight;
  e.d_w_gate = a.d_w_gate;
  e.d_w_up = a.d_w_up;
  e.d_w_down = a.d_w_down;
  e.d_w_type = a.d_w_type;
  e.swiglu_limit = a.swiglu_limit;
  e.status = a.experts_status;
  // The dx GEMM (bf16, or fp8_dgrad's e4m3) pushes its rows into their (token, j) slots on the
  // source ranks (the scatter fused into its epilogue: no dx row round trip through HBM).
  // MOK_EXPERIMENT_DX_SCATTER=kernel (read per call; the timing tool's A/B) writes the rows into
  // dx_rows, which the caller then provides, and scatter_rows copies them. The same bits either way.
  static_assert(detail::kMaxPushRanks == kMaxRanks, "PushRowsEpilogue's table holds every rank");
  const char* scatter_env = std::getenv("MOK_EXPERIMENT_DX_SCATTER");
  const bool scatter_kernel = scatter_env != nullptr && std::strcmp(scatter_env, "kernel") == 0 && !megakernel;
  DxPush push;
  push.ranks = R;
  push.slots = shape.slots();
  push.slots_of = dx_table;
  push.src_rank = view.src_rank;
  push.src_slot = view.src_slot;
  push.given_up_words = view.given_up_words;
  if (scatter_kernel) {
    e.dx = a.dx_rows;  // (null: refused below)
  } else {
    e.dx_push = &push;
  }
  // fp8_dgrad: the same backward with its data gradients on e4m3
  const ExpertsDgradFp8Args e8 = fp8_dgrad_args(e, a.w_down_t_codes, a.w_down_t_scales, a.w_gate_up_t_codes,
                                                a.w_gate_up_t_scales, a.fp8_dgrad_scratch);
  ScatterArgs sc;  // dx rows into their (token, j) slots on the source ranks
  sc.shape = shape;
  sc.hidden = H;
  sc.schedule = view;
  sc.rows = a.dx_rows;
  sc.slots = dx_table;
  ScatterValuesArgs sv;  // and d topk_w
  sv.shape = shape;
  sv.schedule = view;
  sv.values = a.d_row_weight;
  sv.slot_values = dw_table;
  DispatchGradArgs dg;  // dx = dx_shared + sum_j dx_slots[t, j] in j order
  dg.tokens = shape.tokens_per_rank;
  dg.hidden = H;
  dg.topk = shape.topk;
  dg.dx_shared = a.dx_shared;
  dg.slots = SymmetricLayout::at<const void>(mine, l.dx_slots);
  dg.topk_idx = SymmetricLayout::at<const int32_t>(mine, l.topk_idx);
  dg.slot_values = SymmetricLayout::at<const float>(mine, l.dw_slots);  // d topk_w: the pushed slots, 0 where empty
  dg.d_topk_w = a.d_topk_w;
  dg.dx = a.dx;
  const std::string scatter_problem =
      scatter_kernel && a.dx_rows == nullptr
          ? "MOK_EXPERIMENT_DX_SCATTER=kernel needs dx_rows [row_capacity, H] bf16 (the caller's: FusedBuffers "
            "holds none)"
          : "";
  std::string fp8_dgrad_problem;
  if (a.fp8_dgrad) {
    if (!a.fp8_forward) fp8_dgrad_problem = "fp8_dgrad is the backward of an fp8 forward (set fp8_forward)";
    else if (a.fused) fp8_dgrad_problem = "fp8_dgrad runs on the stage kernels (fused = false): the backward megakernel is bf16";
    else fp8_dgrad_problem = can_implement(e8);
  }
  for (const std::string& why : {scatter_problem, fp8_dgrad_problem, can_implement(g), can_implement(e),
                                 scatter_kernel ? can_implement(sc) : "", can_implement(sv),
                                 can_implement(dg), pulls_x ? can_implement(gx) : "",
                                 a.replay && !fp8_replay ? can_implement(f) : "",
                                 fp8_replay ? can_implement(q, /*gate_up_only=*/true) : "",
                                 links ? can_implement_links(shape, view, a.token_links) : "",
                                 event_problem(a.dx_shared_ready, "dx_shared_ready")})
    if (!why.empty()) throw std::invalid_argument("mok moe_backward: " + why);
  const int device_sms = host_util::device_sms(0);
  const int sms = host_util::device_sms(a.num_sms);
  if (a.fused && sms > device_sms)
    throw std::invalid_argument("mok moe_backward: num_sms " + std::to_string(sms) + " exceeds the device's " +
                                std::to_string(device_sms) + " SMs (one resident CTA per SM)");

  begin_call(a.status, a.epoch_counter, a.epoch, stream);
  // 0. This rank's dy is finite (else every rank's non-finite key names the element; the call runs on).
  unsigned long long* keys[kMaxRanks];
  non_finite_keys(a.bases, l, R, keys);
  check_finite(dy_table[me], false, shape.tokens_per_rank * H, CheckedTensor::dy, me, keys, R, stream);

  // The schedule's token links (local): dy (and with replay x) is then read once per token and rank.
  if (links) link_token_rows(shape, view, a.token_links, stream);

  // 1. Every rank's dy and topk_w (with replay or fp8_forward also x) are in its symmetric buffer, and every rank makes
  //    this call (a replay and a kept backward are different calls).
  barrier(R, status, detail::kWaitBarrier, true,
          [&](int s) { return signal_word(a.bases[s], l.barrier(me)); },
          [&](int s) { return signal_word(mine, l.barrier(s)); }, stream,
          call_word(shape, H, I, a.swiglu_limit,
                    fp8_replay  ? kFp8ReplayBackwardCall
                    : a.replay  ? kReplayBackwardCall
                    : a.fp8_forward ? kFp8BackwardCall
                                    : kBackwardCall));
  if (pulls_x) {
    // 1b. Replay and fp8_forward: every rank's x rows by the schedule; replay: then h and g|u from
    //     them (an fp8 replay quantizes the rows first, as the forward's pull carried them; a kept
    //     fp8 forward kept its own h and g|u).
    gather_rows(gx, stream);
    if (fp8_replay) {
      quantize_rows_e4m3_k_major(a.x_rows, cap, H, replay_codes, replay_scales, a.expert_offsets + El, stream);
      experts_gate_up_fp8(q, stream);
    } else if (a.replay) {
      gate_up_swiglu(f, stream);
    }
  }
  if (megakernel) {
    // 2. The backward megakernel: pull dy, dh with the SwiGLU backward, dx pushed, then the
    //    weight gradients; its last CTA tells every source rank.
    check(cudaMemsetAsync(a.counters, 0, counter_layout(cap, a.minibatch_rows).words() * sizeof(uint32_t), stream),
          "zero the counters");
    launch_backward_megakernel(a, sms, stream);
    // 3. Every rank's pushes for this rank's tokens have landed.
    barrier(R, status, detail::kWaitGrads, false, [&](int) { return static_cast<uint32_t*>(nullptr); },
            [&](int s) { return signal_word(mine, l.dx_arrived(s)); }, stream);
  } else {
    // 2-4. Pull, the expert backward, push.
    gather_rows(g, stream);
    if (a.fp8_dgrad) {
      experts_backward_fp8_dgrad(e8, stream);
    } else {
      experts_backward(e, stream);
    }
    if (scatter_kernel) scatter_rows(sc, stream);
    scatter_row_values(sv, stream);
    // 5. Tell every source its slots from this rank are written; wait for every rank's.
    barrier(R, status, detail::kWaitGrads, true,
            [&](int s) { return signal_word(a.bases[s], l.dx_arrived(me)); },
            [&](int s) { return signal_word(mine, l.dx_arrived(s)); }, stream);
  }
  // 6. The dx sum (after the shared expert's backward, when it runs on another stream), and d topk_w:
  //    the slots themselves, 0 for the empty ones (no row wrote them).
  if (a.dx_shared_ready != nullptr) check(cudaStreamWaitEvent(stream, a.dx_shared_ready, 0), "wait for dx_shared");
  dispatch_grad_epilogue(dg, stream);
}

std::string describe_wait_status(const int32_t w[kFailureWords]) {
  std::ostringstream out;
  const int32_t code = w[0], rank = w[1], where = w[2], seen = w[3];
  const uint32_t epoch = static_cast<uint32_t>(w[4]);  // record_give_up writes it with the code
  switch (code) {
    case 0: return "";
    case detail::kWaitRingSlot:
      out << "rank " << rank << " timed out waiting for the down tiles of minibatch " << where
          << " to free its ring slot (" << seen << " done)";
      break;
    case detail::kWaitRows:
      out << "rank " << rank << " timed out waiting for the dispatch of minibatch " << where << " (" << seen
          << " comm CTAs done)";
      break;
    case detail::kWaitHidden:
      out << "rank " << rank << " timed out waiting for the gate/up tiles of row block " << where << " (" << seen
          << " done)";
      break;
    case detail::kCallMismatch:
      out << "rank " << rank << " and rank " << where << " made different calls with epoch " << epoch
          << " (ranks, tokens per rank, top-k, experts, hidden, intermediate, swiglu_limit, or forward against "
             "backward differ): every rank must make the same call";
      break;
    case detail::kWaitDyRows:
      out << "rank " << rank << " timed out in the backward waiting for the dy rows of minibatch " << where << " ("
          << seen << " pulling teams done)";
      break;
    case detail::kWaitDgradTiles:
      out << "rank " << rank << " timed out in the backward waiting for the dh tiles of row block " << where << " ("
          << seen << " done)";
      break;
    case detail::kWaitBarrier:
      out << "rank " << rank << " timed out at the start barrier waiting for rank " << where << " (saw epoch " << seen
          << ", wanted " << epoch << "): that rank did not launch this call, or runs another one";
      break;
    case detail::kWaitGrads:
      out << "rank " << rank << " timed out waiting for rank " << where
          << " to push its dx and d topk_w rows (saw epoch " << seen << ", wanted " << epoch << ")";
      break;
    case detail::kWaitScheduled:
      out << "rank " << rank << " timed out after its schedule waiting for rank " << where
          << " to finish reading the routing (saw epoch " << seen << ", wanted " << epoch
          << "): that rank passed the start barrier of this schedule call and did not reach its end in time";
      break;
    case detail::kWaitCombine:
      out << "rank " << rank << " timed out waiting for rank " << where << " to push its combine rows (saw epoch "
          << seen << ", wanted " << epoch << ")";
      break;
    default:
      out << "rank " << rank << ": " << status_message(code);
  }
  return out.str();
}

}  // namespace mok::cuda
