// The forward megakernel of one rank: dispatch (a pull of token rows from every rank's x into
// the ring), gate/up + SwiGLU, down, and the combine push of each output row into its (token, j)
// slot on the source rank, in one persistent launch (megakernel.h has the protocol around it).
// The kernel, megakernel_kernel<Pass>, is shared with the backward: a pass gives its Params, its
// mainloop and its two epilogues (ForwardPass below; BackwardPass in megakernel_backward.cuh).
//
// Roles by CTA: the first comm_ctas CTAs pull rows; the others compute tasks in one fixed order:
// minibatch by minibatch, its gate/up tiles, then its down tiles. Minibatch b is rows
// [b*M, (b+1)*M) of the rank's schedule (M a multiple of 128, so no tile crosses a minibatch or an
// expert) and lives in ring slot b % S. Tasks wait on counters, never on CTAs:
//   gate/up tile of b      waits x_ready[b]  == comm_ctas      (every comm CTA pulled its rows of b)
//   down tile of row block waits h_ready[rb] == gate/up column tiles (the whole h row block exists)
//   dispatch of b (b >= S) waits y_done[b-S] == down tiles of b-S (slot b % S is free again;
//                          counted only where the ring reuses slots, ring_rows < row_capacity)
// A task's inputs come only from earlier tasks, and every CTA takes its tasks in increasing order,
// so the lowest unfinished task can always run: no deadlock for any skew, ring or minibatch size.
// Each output tile is computed by one CTA with the expert kernels' k order, so which CTA takes it
// cannot change a bit; a row's outputs do not depend on the other rows of its minibatch.
//
// Every wait is bounded (WaitStatus): on timeout the first waiter records (code, rank, where,
// seen) in the status words, every other wait then gives up at once, and the kernel runs to its
// end with garbage, which the host reports as an error naming the rank and the wait.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/core/symmetric_layout.h"
#include "mok/cuda/detail/call_status.cuh"
#include "mok/cuda/detail/grouped_gemm_kernel.cuh"
#include "mok/cuda/routing.h"

namespace mok::cuda::detail {

using namespace cute;

// ---- memory-model helpers ----
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void add_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void add_relaxed_gpu(uint32_t* p, uint32_t v) {
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Orders generic-proxy accesses with the TMA (async proxy) accesses around it.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// Status words of a rank (device memory, kStatusWords): code (0 = fine), rank, where, seen, the
// epoch of the call that failed, and the running call's epoch (call_status.cuh).
struct WaitStatus {
  int32_t* words;
  int32_t rank;
  uint64_t timeout_ns;
};
// The running call's epoch (call_status.cuh: kCallEpochWord).
__device__ __forceinline__ uint32_t call_epoch(const WaitStatus& s) { return call_epoch(s.words); }

// Timing-only switches (megakernel.cu: MOK_EXPERIMENTS): parts of the megakernel left out.
enum ExperimentSkip : int32_t { kSkipPull = 1, kSkipPush = 2, kSkipWaits = 4, kSkipQuantize = 8, kSkipTurns = 16 };
#ifdef MOK_EXPERIMENTS
#define MOK_EXPERIMENT_FIELDS int32_t experiment_skips;
#define MOK_SKIPS(p, bit) (((p).experiment_skips & (bit)) != 0)
#else
#define MOK_EXPERIMENT_FIELDS
#define MOK_SKIPS(p, bit) false
#endif

// Codes of the waits (megakernel.h: describe_wait_status).
enum WaitCode : int32_t {
  kWaitRingSlot = 16,    // dispatch waited for the down tiles of minibatch `where` to free its ring slot
  kWaitRows = 17,        // gate/up waited for the rows of minibatch `where`
  kWaitHidden = 18,      // down waited for the gate/up tiles of row block `where`
  kWaitBarrier = 19,     // the start barrier waited for rank `where`
  kWaitCombine = 20,     // the combine waited for rank `where`'s pushes
  kWaitGrads = 21,       // the backward waited for rank `where`'s dx and d topk_w pushes
  kWaitDyRows = 22,      // the backward's GEMMs waited for the dy rows of minibatch `where`
  kWaitDgradTiles = 23,  // the backward's second GEMM or weight gradients waited for the dh tiles of row block `where`
  kCallMismatch = 24,    // the start barrier: rank `where` makes a different call (shapes or pass)
  kWaitScheduled = 25,   // a schedule call's end barrier waited for rank `where` to read the routing
};
// The tile scheduler's status for a call given up before the megakernel's launch (no tasks).
inline constexpr int32_t kCallGivenUp = 3;

// The first wait of a call to give up records why in the status words (the others see it and
// give up at once: waits_abandoned).
__device__ __forceinline__ void record_give_up(const WaitStatus& s, int32_t code, int32_t where, uint32_t seen) {
  if (atomicCAS(s.words, 0, code) == 0) {
    s.words[1] = s.rank;
    s.words[2] = where;
    s.words[3] = static_cast<int32_t>(seen);
    s.words[4] = static_cast<int32_t>(call_epoch(s));
    __threadfence_system();
  }
}
// Another wait of this call gave up (a failure of an earlier call does not end this call's waits
// early, so a failed rank still meets the others at the barriers).
__device__ __forceinline__ bool waits_abandoned(const WaitStatus& s) { return call_given_up(s.words); }

// Spins until *p >= target; false when it gave up (it timed out, or another wait did).
template <bool kSystem>
__device__ bool wait_at_least(const uint32_t* p, uint32_t target, const WaitStatus& s, int32_t code, int32_t where) {
  const uint64_t start = global_ns();
  for (int spin = 0;; ++spin) {
    const uint32_t seen = kSystem ? ld_acquire_sys(p) : ld_acquire_gpu(p);
    if (seen >= target) return true;
    if (waits_abandoned(s)) return false;
    if (global_ns() - start > s.timeout_ns) {
      record_give_up(s, code, where, seen);
      return false;
    }
    if (spin > 32) __nanosleep(256);
  }
}

// What megakernel_kernel reads of either pass beside its GEMMs' loads and epilogues: the
// schedule, the ring, the counters, the pull's sources and the push's targets on every rank.
struct MegaPassParams {
  int32_t experts, row_capacity;
  int32_t ring_rows, mb_rows;       // S = ring_rows / mb_rows slots
  int32_t n_first, n_second, k_first, k_second;  // column tiles and k-blocks of the two GEMMs
  int32_t comm_ctas;                 // CTAs that only pull rows (0: comm warps pull them)
  int32_t comm_warps;                // 1: warps 1..3 of every compute CTA pull rows (comm_ctas = 0)
  int32_t skip_padding_halves;       // 1: no MMA for a tile's 64 rows that are all padding
  int32_t ranks, rank, topk, slots, hidden, row_vectors;
  const int32_t* offsets;
  const int32_t* src_rank;
  const int32_t* src_slot;
  uint4* ring_x;                     // [ring_rows, H]: the pulled rows
  const int32_t* row_first;          // optional: each row's token's first row on this rank
                                     // (routing.h: link_token_rows); null unless the ring holds every row
  uint32_t* x_ready;                 // [max minibatches]
  uint32_t* y_done;                  // [max minibatches]
  uint32_t* h_ready;                 // [row_capacity / 128]
  uint32_t* done_ctas;               // [1]
  uint32_t* task_claims;             // [1]: the next task to claim (claim_tasks)
  int32_t claim_tasks;               // 1: compute CTAs claim tasks from task_claims; 0: c + j ctas (take_task)
  WaitStatus status;                 // with the call's epoch, which the arrival words are set to
  const uint4* x[kMaxRanks];               // [T, H] on each rank: what is pulled (x, or dy)
  __nv_bfloat16* combine[kMaxRanks];       // [T*k, H] slots on each rank: where rows are pushed
  uint32_t* arrived[kMaxRanks];            // rank s's arrival word of this (source) rank
  MOK_EXPERIMENT_FIELDS
  // The fp8 forward's pull also copies each row's scales (megakernel_fp8.cuh: MegaFp8ForwardParams).
  static constexpr bool kPullsScales = false;
};

struct MegaForwardParams : MegaPassParams {
  static constexpr bool kPullsRowWeights = false;  // the backward's pull also copies each row's topk_w
  static constexpr bool kWeightGradients = false;  // the backward's tasks end with the weight gradients
  static constexpr int32_t kWaitFirst = kWaitRows, kWaitSecond = kWaitHidden;  // what a timeout names
  ForwardMainloop::Params first_load, second_load;  // gate|up, down
  SwiGluEpilogue::Params first_store;  // h into the ring; g|u (optional) at global rows
};

// The schedule's rows, or 0 when the offsets are malformed (the compute CTAs then do nothing
// either, and the status word says why).
template <class Params>
__device__ __forceinline__ int scheduled_rows(const Params& p) {
  const int used = p.offsets[p.experts];
  return (used < 0 || used > p.row_capacity || used % GemmConfig::kBlockM != 0) ? 0 : used;
}

struct MegaTask {
  bool second;  // the second GEMM of the minibatch (forward: down)
  int wgrad;    // 0, or 1 + which weight gradient (backward: W_gate, W_up, W_down) the tile is of
  int minibatch;
  int row_block;  // global row block of the schedule
  GroupedTile tile;
};

// The task order of a two-GEMM pass (forward: gate/up then down; backward: dgrad of down then of
// gate/up). Params has experts, mb_rows, ring_rows, n_first, n_second, k_first, k_second. Host
// and device: cuda/tests/test_task_order.cu checks the order on the CPU.
template <class Params>
struct MegaTasks {
  static constexpr int kRowGroup = 8;  // row blocks of an expert's segment taken together
  const Params& p;
  const GroupedTileSchedulerStorage<GemmConfig::kMaxExperts>& s;

  CUTE_HOST_DEVICE int row_blocks() const { return s.status == 0 ? s.offsets[p.experts] / GemmConfig::kBlockM : 0; }
  CUTE_HOST_DEVICE int mb_blocks() const { return p.mb_rows / GemmConfig::kBlockM; }
  CUTE_HOST_DEVICE int blocks_of(int b) const { return min(mb_blocks(), row_blocks() - b * mb_blocks()); }
  CUTE_HOST_DEVICE int pass_total() const {
    const int rb = row_blocks(), mb = mb_blocks();
    if (rb == 0) return 0;
    const int full = (rb - 1) / mb;  // minibatches before the last
    return full * mb * (p.n_first + p.n_second) + (rb - full * mb) * (p.n_first + p.n_second);
  }
  // The weight gradient tiles come after every task of the two GEMMs: expert by expert, W_gate's,
  // W_up's, then W_down's tiles (column fastest), each over all of the expert's rows in order
  // (as ExpertTileScheduler). A malformed schedule has none either.
  CUTE_HOST_DEVICE int wgrad_per_expert() const { return 2 * p.wg_m * p.wg_n + p.wd_m * p.wd_n; }
  CUTE_HOST_DEVICE int total() const {
    if constexpr (Params::kWeightGradients) {
      return s.status == 0 ? pass_total() + p.experts * wgrad_per_expert() : 0;
    } else {
      return pass_total();
    }
  }
  CUTE_HOST_DEVICE MegaTask wgrad_at(int linear) const {
    const int per_expert = wgrad_per_expert(), gate_up = p.wg_m * p.wg_n;
    MegaTask task;
    task.second = false;
    task.minibatch = 0;
    task.row_block = 0;
    task.tile.expert = linear / per_expert;
    int local = linear - task.tile.expert * per_expert;
    task.wgrad = local < gate_up ? 1 : local < 2 * gate_up ? 2 : 3;
    local -= (task.wgrad - 1) * gate_up;
    const int n_blocks = task.wgrad == 3 ? p.wd_n : p.wg_n;
    task.tile.m_block = local / n_blocks;
    task.tile.save_m_block = task.tile.m_block;
    task.tile.n_block = local % n_blocks;
    task.tile.row_end = s.offsets[task.tile.expert + 1];
    constexpr int kRows = OperandConfig<bfloat16_t>::kBlockK;  // rows per k-block (bf16)
    task.tile.k_begin = s.offsets[task.tile.expert] / kRows;
    task.tile.k_end = task.tile.row_end / kRows;
    return task;
  }

  CUTE_HOST_DEVICE MegaTask at(int linear) const {
    if constexpr (Params::kWeightGradients) {
      const int first = pass_total();
      if (linear >= first) return wgrad_at(linear - first);
    }
    const int mb = mb_blocks();
    const int b = linear / (mb * (p.n_first + p.n_second));
    const int rbs = blocks_of(b);
    int local = linear - b * mb * (p.n_first + p.n_second);
    MegaTask task;
    task.wgrad = 0;
    task.second = local >= rbs * p.n_first;
    if (task.second) local -= rbs * p.n_first;
    const int n_blocks = task.second ? p.n_second : p.n_first;
    // Expert by expert inside the minibatch, and inside an expert groups of kRowGroup row blocks,
    // each group's row blocks fastest, then its column blocks: the CTAs running together share an
    // expert's weight tiles in L2. (Groups of 8 row blocks of the minibatch, crossing experts,
    // re-read weights from HBM: on kimi the megakernel moved 32 GB to its GEMMs' 21, session 7's
    // ncu. A segment without groups, all its row blocks fastest, finishes every row block's first
    // GEMM only at the segment's end, so the second GEMM's first tiles wait for its tail: mixtral's
    // 17-block segments ran 3% slower so, session 8.) Every row block of the minibatch has
    // n_blocks tasks, so task `local` lies in the segment of its row block local / n_blocks, and
    // the segment's tasks start at its first row block's.
    const int first_rb = b * mb;
    int lo = 0, hi = p.experts - 1;  // the expert holding that row block: the last one starting at or before it
    {
      const int row = (first_rb + local / n_blocks) * GemmConfig::kBlockM;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (s.offsets[mid] <= row) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
    }
    const int expert = lo;
    const int seg_begin = max(s.offsets[expert] / GemmConfig::kBlockM - first_rb, 0);  // in the minibatch
    const int seg_end = min(s.offsets[expert + 1] / GemmConfig::kBlockM - first_rb, rbs);
    const int in_seg = local - seg_begin * n_blocks;
    const int group = in_seg / (kRowGroup * n_blocks), in_group = in_seg - group * kRowGroup * n_blocks;
    const int group_rows = min(kRowGroup, seg_end - seg_begin - group * kRowGroup);
    const int rb_local = seg_begin + group * kRowGroup + in_group % group_rows;
    task.minibatch = b;
    task.row_block = first_rb + rb_local;
    const int slots = p.ring_rows / p.mb_rows;
    task.tile.expert = expert;
    task.tile.m_block = (b % slots) * mb + rb_local;  // the ring's row block
    task.tile.save_m_block = task.row_block;
    task.tile.n_block = in_group / group_rows;
    task.tile.row_end = s.offsets[expert + 1];
    task.tile.k_begin = 0;
    task.tile.k_end = task.second ? p.k_second : p.k_first;
    return task;
  }
};

// How the compute CTAs of either pass take their tasks (MegaPassParams::claim_tasks): CTA c takes
// c, c + ctas, c + 2 ctas, ... (0), or each producer claims the next unclaimed task from a counter
// when it is free to load one (1, the default: the CTAs that finish early take more tasks; 2-4.5%
// faster on one H200, session 15). Either way a CTA's tasks increase and tasks are claimed in
// increasing order, so the lowest unfinished task can always run; which CTA computes a tile
// cannot change a bit. The producer tells its consumers which task comes next in the stage of
// the task's first k-block (task_of_stage: written after the stage is free and before the
// producer's arrival on its full barrier, which releases the write to the consumers' wait). A
// task without k-blocks (an empty expert's weight gradient) gets a stage that holds only its id,
// and the producer ends with one that holds the task count (announce_without_bytes).
// The id's word also says whether the tile's second 64 rows are all padding (kPaddingHalfFlag:
// MegaPassParams::skip_padding_halves), which the consumers have no register to spare to find.
constexpr int kPaddingHalfFlag = 1 << 30;
// The task a producer takes next: the counter's next (claim_tasks), else `in_order`, the next of
// its CTA's own sequence.
template <class Params>
__device__ __forceinline__ int take_task(const Params& p, int in_order) {
  return p.claim_tasks ? int(atomicAdd(p.task_claims, 1u)) : in_order;
}
template <class State, class Storage>
__device__ __forceinline__ void announce_task(const State& state, Storage& smem, int word) {
  smem.pipeline.empty_barrier_[state.index()].wait(state.phase());
  smem.task_of_stage[state.index()] = word;
}
// A stage with the word and no bytes: its full barrier passes at the producer's plain arrival.
template <class State, class Storage>
__device__ __forceinline__ void announce_without_bytes(State& state, Storage& smem, int word) {
  announce_task(state, smem, word);
  smem.pipeline.full_barrier_[state.index()].arrive();
  ++state;
}
// The producer's part of a task: `word` (its id and flags) in the stage of its first k-block,
// then its k-blocks in order (load_k_blocks); no k-blocks, a stage with the word alone.
// (load_k_blocks' first acquire finds that stage free at once. Loading the first k-block apart,
// without that second look, copied the mainloop's loads into the backward's producer once more,
// and the comm warps beside it spilled 8 bytes: session 16.)
template <class Mainloop, class Storage, class Pipeline, class State>
__device__ __forceinline__ void load_task(const typename Mainloop::Params& load, Storage& smem,
                                          const GroupedTile& tile, int word, Pipeline& pipeline, State& state) {
  if (tile.k_end <= tile.k_begin) {
    announce_without_bytes(state, smem, word);
    return;
  }
  announce_task(state, smem, word);
  load_k_blocks<Mainloop>(load, smem.a, smem.b, tile, pipeline, state);
}

// The teams that count in x_ready[b] when they have pulled minibatch b's rows: every compute CTA's
// comm warps, or the comm CTAs.
template <class Params>
__device__ __forceinline__ uint32_t pulling_teams(const Params& p) {
  return uint32_t(p.comm_warps ? int(gridDim.x) - p.comm_ctas : p.comm_ctas);
}

// ---- dispatch: comm CTAs pull the rows of each minibatch into its ring slot ----
// Whether schedule row r is a token row (else a padding row, zero in the ring).
template <class Params>
__device__ __forceinline__ bool is_token_row(const Params& p, int r) {
  const int rank = p.src_rank[r], slot = p.src_slot[r];
  return rank >= 0 && rank < p.ranks && slot >= 0 && slot < p.slots;
}
template <class Params>
__device__ __forceinline__ const uint4* source_row(const Params& p, int r) {
  return p.x[p.src_rank[r]] + int64_t(p.src_slot[r] / p.topk) * p.row_vectors;
}

// The fp8 forward's row scales (Params::kPullsScales): schedule row r's ceil(H / 128) scales into
// column `ring_row` of the ring's k-block-major scales [H / 128, ring_rows] (the layout the GEMM's
// bulk copy reads), from its rank's x scales or from ring row `from_row` (>= 0) where its token was
// pulled before; 0 for a padding row.
template <class Params>
__device__ __forceinline__ void pull_scales(const Params& p, int r, int ring_row, int lane, int from_row) {
  const bool token = is_token_row(p, r);
  for (int kb = lane; kb < p.scale_blocks; kb += 32) {
    float v = 0.0f;
    if (token) {
      v = from_row >= 0 ? p.ring_scales[int64_t(kb) * p.ring_rows + from_row]
                        : p.x_scales[p.src_rank[r]][int64_t(p.src_slot[r] / p.topk) * p.scale_blocks + kb];
    }
    p.ring_scales[int64_t(kb) * p.ring_rows + ring_row] = v;
  }
}

// One warp copies schedule row r into its ring row `dst` (one warp per row, kUnroll 16-byte loads
// in flight per lane: peer reads are long; padding rows are zeros), and its router weight where
// the pass pulls them. `from` is where its token lies when not at its rank: the ring row of the
// token's first row on this rank, pulled in an earlier minibatch (else null). (pull_minibatches
// keeps its own copy of this body: through this function the comm warps' loop spilled 8 bytes of
// their 40 registers.)
template <int kUnroll, class Params>
__device__ __forceinline__ void pull_row(const Params& p, int r, uint4* dst, int lane, const uint4* from) {
  const bool token = is_token_row(p, r);
  if constexpr (Params::kPullsRowWeights) {  // the router weight of the row (0 for padding)
    if (lane == 0) p.row_weight[r] = token ? p.topk_w[p.src_rank[r]][p.src_slot[r]] : 0.0f;
  }
  dst += lane;
  if (token && !MOK_SKIPS(p, kSkipPull)) {
    // The lane's pieces lane, lane + 32, ...: `left` counts them down (fewer live registers than
    // indices, for the comm warps' 40).
    const uint4* src = (from != nullptr ? from : source_row(p, r)) + lane;
    for (int left = p.row_vectors - lane; left > 0; left -= 32 * kUnroll) {
      uint4 part[kUnroll];
      CUTE_UNROLL
      for (int u = 0; u < kUnroll; ++u)
        if (32 * u < left) part[u] = src[32 * u];
      CUTE_UNROLL
      for (int u = 0; u < kUnroll; ++u)
        if (32 * u < left) dst[32 * u] = part[u];
      src += 32 * kUnroll;
      dst += 32 * kUnroll;
    }
  } else if (!token) {
    dst -= lane;
    for (int v = lane; v < p.row_vectors; v += 32) dst[v] = make_uint4(0, 0, 0, 0);  // padding row
  }
}

// The team has written its rows of minibatch b (sync), and the leader counts it in x_ready[b].
template <class Params, class Sync>
__device__ __forceinline__ void count_pulled(const Params& p, int b, bool leader, Sync sync) {
  sync();
  if (leader) {
    __threadfence();
    fence_proxy_async();  // the gate/up tiles read them with TMA
    add_release_gpu(&p.x_ready[b], 1);
  }
}

// The pull of comm CTAs where p.row_first is set (only where the ring holds every row: ring row =
// schedule row, no slot reused): a row whose token's first row on this rank lies in an earlier
// minibatch is copied from that ring row instead of read from its rank again, once every team
// has counted that minibatch (else it is read): a token crosses NVLink about once per rank and
// minibatch (rows of one token in the same minibatch are each read: the team's warps have no
// order between them). Comm CTAs only: in the comm warps' 40 registers every form of it spilled
// (a wait per copied row or per minibatch, first rows copying themselves forward, this one).
template <int kUnroll, class Params, class Sync>
__device__ void pull_minibatches_once(const Params& p, int used, int first, int stride, int warp, bool leader,
                                      Sync sync) {
  const int lane = threadIdx.x % 32;
  const int minibatches = (used + p.mb_rows - 1) / p.mb_rows;
  for (int b = 0; b < minibatches; ++b) {
    const int row0 = b * p.mb_rows, row1 = min(row0 + p.mb_rows, used);
    for (int r = row0 + first + warp; r < row1; r += stride) {
      // Each lane acquires the count before its own loads of the first row; the teams go at one
      // pace, so that minibatch is almost always counted.
      const int f = p.row_first[r];
      const bool copy = f >= 0 && f < row0 && ld_acquire_gpu(&p.x_ready[f / p.mb_rows]) >= pulling_teams(p);
      pull_row<kUnroll>(p, r, p.ring_x + int64_t(r) * p.row_vectors, lane,
                        copy ? p.ring_x + int64_t(f) * p.row_vectors : nullptr);
      if constexpr (Params::kPullsScales) pull_scales(p, r, r, lane, copy ? f : -1);
    }
    count_pulled(p, b, leader, sync);
  }
}

// The pull loop of a team of warps: for each minibatch b, the leader waits until b's ring slot is
// free, then warp w of the team copies schedule rows row0 + first + w, + stride, ... of b (one warp
// per row, kUnroll 16-byte loads in flight per lane: peer reads are long; padding rows are zeros),
// and once the team synchronized (sync) the leader counts it in x_ready[b].
// Teams: a comm CTA (all its warps), or the 3 warps of a compute CTA's producer warpgroup that do
// not issue TMA loads (comm_warps).
template <int kUnroll, class Params, class Sync>
__device__ void pull_minibatches(const Params& p, int used, int first, int stride, int warp, bool leader, Sync sync) {
  const int lane = threadIdx.x % 32;
  const int mb = p.mb_rows / GemmConfig::kBlockM;
  const int slots = p.ring_rows / p.mb_rows;
  const int row_blocks = used / GemmConfig::kBlockM;
  const int minibatches = (row_blocks + mb - 1) / mb;
  for (int b = 0; b < minibatches; ++b) {
    if (b >= slots) {
      const int prev = b - slots;
      const uint32_t need = uint32_t(min(mb, row_blocks - prev * mb) * p.n_second);
      if (leader) {
        wait_at_least<false>(&p.y_done[prev], need, p.status, kWaitRingSlot, prev);
        fence_proxy_async();  // the slot's last readers were TMA loads
      }
      sync();
    }
    const int row0 = b * p.mb_rows, row1 = min(row0 + p.mb_rows, used);
    uint4* ring = p.ring_x + int64_t(b % slots) * p.mb_rows * p.row_vectors;
    for (int r = row0 + first + warp; r < row1; r += stride) {
      uint4* dst = ring + int64_t(r - row0) * p.row_vectors + lane;
      const bool token = is_token_row(p, r);
      if constexpr (Params::kPullsRowWeights) {  // the router weight of the row (0 for padding)
        if (lane == 0) p.row_weight[r] = token ? p.topk_w[p.src_rank[r]][p.src_slot[r]] : 0.0f;
      }
      if (token && !MOK_SKIPS(p, kSkipPull)) {
        // The lane's pieces lane, lane + 32, ...: `left` counts them down (fewer live registers
        // than indices, for the comm warps' 40).
        const uint4* src = source_row(p, r) + lane;
        for (int left = p.row_vectors - lane; left > 0; left -= 32 * kUnroll) {
          uint4 part[kUnroll];
          CUTE_UNROLL
          for (int u = 0; u < kUnroll; ++u)
            if (32 * u < left) part[u] = src[32 * u];
          CUTE_UNROLL
          for (int u = 0; u < kUnroll; ++u)
            if (32 * u < left) dst[32 * u] = part[u];
          src += 32 * kUnroll;
          dst += 32 * kUnroll;
        }
      } else if (!token) {
        dst -= lane;
        for (int v = lane; v < p.row_vectors; v += 32) dst[v] = make_uint4(0, 0, 0, 0);  // padding row
      }
      if constexpr (Params::kPullsScales) pull_scales(p, r, (b % slots) * p.mb_rows + (r - row0), lane, -1);
    }
    sync();  // the team's rows of b are written
    if (leader) {
      __threadfence();
      fence_proxy_async();  // the gate/up tiles read them with TMA
      add_release_gpu(&p.x_ready[b], 1);
    }
  }
}

// A comm CTA: every warp pulls (no row of a call given up before the launch).
template <class Params>
__device__ void dispatch_role(const Params& p) {
  const int warps = blockDim.x / 32;
  const int used = waits_abandoned(p.status) ? 0 : scheduled_rows(p);
  const auto sync = [] { __syncthreads(); };
  if (p.row_first != nullptr) {
    pull_minibatches_once<8>(p, used, blockIdx.x * warps, p.comm_ctas * warps, threadIdx.x / 32, threadIdx.x == 0, sync);
  } else {
    pull_minibatches<8>(p, used, blockIdx.x * warps, p.comm_ctas * warps, threadIdx.x / 32, threadIdx.x == 0, sync);
  }
}

// Comm warps: warps 1..3 of compute CTA `cta` of `ctas` (warp 0 issues the TMA loads). They run
// within the producer warpgroup's 40 registers, so 3 loads in flight per lane (2 measured the same:
// bench/results/2026-11-30-h200-session6).
// Named barrier of their 96 threads (ids 1-5 are the consumers': expert_epilogues.cuh,
// grouped_gemm_kernel.cuh).
inline constexpr int kCommWarps = 3, kCommWarpsBarrier = 6;
// `used`: the schedule's rows as the CTA's tile scheduler holds them (0 for a malformed schedule
// or a call given up before the launch).
template <class Params>
__device__ void dispatch_warps(const Params& p, int used, int cta, int ctas) {
  const int warp = threadIdx.x / 32 - 1;
  auto sync = [] { asm volatile("bar.sync %0, %1;" ::"r"(kCommWarpsBarrier), "r"(32 * kCommWarps) : "memory"); };
  pull_minibatches<3>(p, used, cta * kCommWarps, ctas * kCommWarps, warp, warp == 0 && threadIdx.x % 32 == 0, sync);
}

// ---- combine push: the down tile's rows go straight into their (token, j) slots on the source ----
// (push_rows, expert_epilogues.cuh.)
// Where a tile's rows go (a view of either pass's parameters, read in place, so that no register
// holds a copy): row r of the schedule to combine[src_rank[r]] + src_slot[r] * hidden, the
// forward's combine slots or the backward's dx slots (each pass wires its own into `combine`).
struct PushTarget {
  const MegaPassParams& p;
  __device__ __nv_bfloat16* dest(int rank) const { return p.combine[rank]; }
  __device__ const int32_t* src_rank() const { return p.src_rank; }
  __device__ const int32_t* src_slot() const { return p.src_slot; }
  __device__ int ranks() const { return p.ranks; }
  __device__ int slots() const { return p.slots; }
  __device__ int width() const { return p.hidden; }
  __device__ bool skips_push() const { return MOK_SKIPS(p, kSkipPush); }
};

// The epilogues take the thread index through an opaque move and derive their accumulator
// coordinates from it (the kernel's own `coords` go unused): their shared-memory addresses are
// then computed per tile instead of hoisted out of the task loop, where they did not fit the
// consumers' 232 registers (the backward spilled 196 bytes, session 6; the forward's push 4,
// session 7, once its task order looked up the expert's segment).
__device__ __forceinline__ int opaque_thread(int thread) {
  int t;
  asm volatile("mov.b32 %0, %1;" : "=r"(t) : "r"(thread));
  return t;
}
template <class Mainloop>
__device__ auto epilogue_coords(int thread) {
  ExpertTiledMma<typename Mainloop::Element, Mainloop::kMajorA, Mainloop::kMajorB> mma;
  return mma.get_thread_slice(thread).partition_C(
      make_identity_tensor(Shape<Int<GemmConfig::kBlockM>, Int<GemmConfig::kBlockN>>{}));
}

// The forward pass: gate|up with the SwiGLU epilogue (h into the ring, its row block counted in
// h_ready once stored), then down with the combine push. A pass (this, megakernel_backward.cuh's
// BackwardPass) gives megakernel_kernel its Params, its Mainloop and the two epilogues.
struct ForwardPass {
  using Params = MegaForwardParams;
  using Mainloop = ForwardMainloop;

  template <class Acc, class Coords>
  static __device__ void first_epilogue(const Params& p, const MegaTask& task, Acc& acc, const Coords& coords,
                                        int thread, bfloat16_t* staging) {
    SwiGluEpilogue::apply(p.first_store, task.tile, acc, coords, thread, staging);
    if (thread == 0) {
      // h of this tile is in global memory (not only read out of shared memory) before the
      // count. h's chunks are the epilogue's last, so this waits for every group (measured on
      // 2 H200s: waiting only for h's, when they came first, changed nothing).
      // (Counting without this wait measured the same on 2 H200s, session 7: the stores' latency
      // is not what the forward loses to its GEMMs.)
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      fence_proxy_async();
      __threadfence();
      add_release_gpu(&p.h_ready[task.row_block], 1);
    }
  }
  template <class Acc, class Coords>
  static __device__ void second_epilogue(const Params& p, const MegaTask& task, Acc& acc, const Coords&,
                                         int thread, bfloat16_t* staging) {
    const int t = opaque_thread(thread);
    push_rows(PushTarget{p}, task.row_block, task.tile.n_block, acc, epilogue_coords<Mainloop>(t), t, staging);
  }
};

// Warp 0 of a compute CTA: the schedule's segments into the CTA's tile scheduler (a malformed
// schedule's status into the status words, once). A call given up before the launch (its start
// barrier found a rank making another call, or timed out) runs no task and pulls no row: peers'
// buffers may not have this rank's layout. Decided once here, so every role of the CTA sees the
// same task count.
template <class Params, class Tiles>
__device__ __forceinline__ void init_pass_schedule(const Params& p, Tiles& tiles, int cta) {
  const int bad = GroupedTileScheduler<GemmConfig::kBlockM, GemmConfig::kMaxExperts>::init(tiles, p.offsets, p.experts,
                                                                                          p.row_capacity);
  if (bad != 0 && threadIdx.x == 0 && cta == 0) atomicCAS(p.status.words, 0, bad);
  if (threadIdx.x == 0 && waits_abandoned(p.status)) tiles.status = kCallGivenUp;
}

// The consumers of a compute CTA after its last task: its pushes reach the peers, then the last
// of the `ctas` compute CTAs sets this rank's arrival word on every rank to the call's epoch.
template <class Params>
__device__ __forceinline__ void announce_pushes(const Params& p, int consumer_thread, int ctas) {
  drain_stores(consumer_thread % 128);  // each warpgroup's bulk stores (the weight gradients' turns)
  // The pushes of every CTA reach the peers before the last CTA tells them so.
  __threadfence_system();
  consumers_sync();
  if (consumer_thread == 0) {
    const uint32_t before = atomicAdd(p.done_ctas, 1u);
    if (before == uint32_t(ctas - 1)) {
      __threadfence_system();
      const uint32_t epoch = call_epoch(p.status);
      for (int s = 0; s < p.ranks; ++s) st_release_sys(p.arrived[s], epoch);
    }
  }
}

// One rank's pass of two chained grouped GEMMs with its communication (see the top of this file).
template <class Pass>
__global__ void __launch_bounds__(GemmConfig::kThreads, 1)
    megakernel_kernel(const __grid_constant__ typename Pass::Params p) {
  using Params = typename Pass::Params;
  using Mainloop = typename Pass::Mainloop;
  using Pipeline = GemmConfig::Pipeline;
  constexpr int kStages = GemmConfig::kStages;
  extern __shared__ __align__(1024) char smem_raw[];
  if (int(blockIdx.x) < p.comm_ctas) {
    dispatch_role(p);
    return;
  }
  using SharedStorage = GroupedGemmSharedStorage<typename Mainloop::Element>;
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int warp = threadIdx.x / 32;
  const int warpgroup = threadIdx.x / 128;
  const int cta = blockIdx.x - p.comm_ctas, ctas = gridDim.x - p.comm_ctas;

  if (warp == 0) {
    init_pass_schedule(p, smem.tiles, cta);
    if (threadIdx.x == 0) {
      Mainloop::prefetch(p.first_load);
      Mainloop::prefetch(p.second_load);
    }
  }
  typename Pipeline::Params pp;
  pp.transaction_bytes = Mainloop::Operand::kStageBytes;
  pp.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = 256;
  Pipeline pipeline(smem.pipeline, pp, Shape<_1, _1, _1>{});
  __syncthreads();

  const MegaTasks<typename Pass::Params> tasks{p, smem.tiles};
  // (Each role derives the task count after its register change: a value live across setmaxnreg
  // was spilled.)

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp != 0) {
      if (p.comm_warps) dispatch_warps(p, smem.tiles.status == 0 ? smem.tiles.offsets[p.experts] : 0, cta, ctas);
    } else if (cute::elect_one_sync()) {
      const int total = tasks.total();
      [[maybe_unused]] int ready_expert = -1;  // weight gradients: the last expert whose rows were seen done
      auto state = cutlass::make_producer_start_state<Pipeline>();
      for (int linear = take_task(p, cta); linear < total; linear = take_task(p, linear + ctas)) {
        const MegaTask task = tasks.at(linear);
        if constexpr (Params::kWeightGradients) {
          if (task.wgrad != 0) {
            Pass::load_wgrad(p, task, linear, smem, pipeline, state, ready_expert);
            continue;
          }
        }
        // Both GEMMs' A rows are the schedule's rows of the block (forward: the pulled rows, then
        // their h; backward: the pulled dy, then dg|du): a segment's token rows come first and its
        // padding rows (zeros) last, and every 128-row block starts with a token row, so only the
        // second warpgroup's half can be all padding. The flag goes with the id. (The schedule was
        // written before the launch, so this load is issued before the counter's wait: its latency
        // then overlaps the wait's instead of following it on every task.)
        const bool padding_half = p.skip_padding_halves &&
                                  p.src_rank[task.row_block * GemmConfig::kBlockM + GemmConfig::kBlockM / 2] < 0;
        if (MOK_SKIPS(p, kSkipWaits)) {
        } else if (task.second) {
          wait_at_least<false>(&p.h_ready[task.row_block], uint32_t(p.n_first), p.status, Params::kWaitSecond,
                               task.row_block);
        } else {
          wait_at_least<false>(&p.x_ready[task.minibatch], pulling_teams(p), p.status, Params::kWaitFirst,
                               task.minibatch);
        }
        fence_proxy_async();  // the rows the counter announced are read by TMA
        load_task<Mainloop>(task.second ? p.second_load : p.first_load, smem, task.tile,
                            linear | (padding_half ? kPaddingHalfFlag : 0), pipeline, state);
      }
      announce_without_bytes(state, smem, total);  // no more tasks
      pipeline.producer_tail(state);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<232>();
    const int total = tasks.total();
    const int consumer_thread = threadIdx.x - 128;
    ExpertTiledMma<typename Mainloop::Element, Mainloop::kMajorA, Mainloop::kMajorB> mma;
    auto thr = mma.get_thread_slice(consumer_thread);
    Tensor sA = make_tensor(make_smem_ptr(smem.a), typename Mainloop::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(smem.b), typename Mainloop::SmemLayoutB{});
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    Tensor cC = make_identity_tensor(Shape<Int<GemmConfig::kBlockM>, Int<GemmConfig::kBlockN>>{});
    Tensor tCcC = thr.partition_C(cC);
    Tensor acc = partition_fragment_C(mma, Shape<Int<GemmConfig::kBlockM>, Int<GemmConfig::kBlockN>>{});

    cutlass::PipelineState<kStages> read_state;
    [[maybe_unused]] bool turns = false;  // the weight gradients' turns began (BackwardPass::wgrad_task)
    for (;;) {
      // Every task releases each stage it reads, so here the release state is the read state: a
      // copy per task, not a second state kept through the epilogues (registers: with the padding
      // halves' branch, keeping it spilled 12 bytes there).
      cutlass::PipelineState<kStages> release_state = read_state;
      // The producer's choice, in the stage of the task's first k-block (load_task).
      pipeline.consumer_wait(read_state);
      const int word = *reinterpret_cast<volatile int*>(&smem.task_of_stage[read_state.index()]);
      const int linear = word & (kPaddingHalfFlag - 1);
      const bool padding_half = (word & kPaddingHalfFlag) != 0;  // the second warpgroup's rows are all padding
      if (linear >= total) {  // no more tasks: the stage holds no bytes
        pipeline.consumer_release(read_state);
        ++read_state;
        if constexpr (Params::kWeightGradients) Pass::end_turns(p, turns, consumer_thread);
        break;
      }
      if constexpr (Params::kWeightGradients) {
        if (linear >= tasks.pass_total()) {
          Pass::wgrad_task(p, tasks.at(linear), acc, tCcC, consumer_thread, smem, pipeline, read_state, release_state,
                           turns);
          continue;
        }
      }
      // Only the k-block count lives through the mainloop; the task is derived again for the
      // epilogue (registers: the accumulator takes 128 of them).
      const int k_blocks = tasks.at(linear).tile.k_end;
      if (padding_half && warpgroup == 2) {
        reduce_padding_half(mma, tCrA, tCrB, acc, pipeline, read_state, release_state, 0, k_blocks);
      } else {
        reduce_k_blocks(mma, tCrA, tCrB, acc, pipeline, read_state, release_state, 0, k_blocks, padding_half);
      }
      const MegaTask task = tasks.at(linear);
      if (!task.second) {
        Pass::first_epilogue(p, task, acc, tCcC, consumer_thread, smem.staging[0]);
      } else {
        // The tile frees its ring rows for the minibatch S later, where the ring reuses slots (a
        // ring holding every row has no waiter: the training forward, whose context is its ring,
        // and the backward). Its only reads of the ring are the TMA loads of its A operand, and
        // thread 0 has waited for every one of them to land in shared memory. So a relaxed add
        // here, before the epilogue: a release would first wait until every push of this thread
        // still in flight to a peer is acknowledged (measured, session 10: deepseek-v4's forward in
        // the planner's ring 16.04 ms with the release after the pushes, 13.93 with this).
        if (p.ring_rows < p.row_capacity && consumer_thread == 0) add_relaxed_gpu(&p.y_done[task.minibatch], 1);
        Pass::second_epilogue(p, task, acc, tCcC, consumer_thread, smem.staging[0]);
      }
    }
    announce_pushes(p, consumer_thread, ctas);
  }
}

// ---- the small kernels around it ----
// Start barrier: tell every rank this one has arrived (its x, topk_idx and topk_w are written),
// then wait until every rank has. flags[s] = rank s's barrier word of this rank; mine[s] = this
// rank's barrier word of rank s.
// The call word sits in the same signal line as the barrier flag, 8 bytes after it: a signalling
// rank writes what it was called with (call_word), then releases the epoch; a waiter that sees the
// epoch compares the word with its own (0: no comparison, for the waits that only wait).
struct BarrierParams {
  int32_t ranks;
  WaitStatus status;  // its epoch is the one signalled and waited for
  int32_t code;
  unsigned long long call;
  uint32_t* flags[kMaxRanks];
  const uint32_t* mine[kMaxRanks];
};
__device__ __forceinline__ unsigned long long* call_word(uint32_t* flag) {
  return reinterpret_cast<unsigned long long*>(flag + 2);
}

__global__ void signal_barrier_kernel(const __grid_constant__ BarrierParams p, int signal) {
  const int s = threadIdx.x;
  if (s >= p.ranks) return;
  const uint32_t epoch = call_epoch(p.status);
  if (signal) {
    if (p.call != 0) *call_word(p.flags[s]) = p.call;
    __threadfence_system();
    st_release_sys(p.flags[s], epoch);
  }
  if (wait_at_least<true>(p.mine[s], epoch, p.status, p.code, s) && p.call != 0) {
    // Ordered after the acquire of the epoch that was released after it.
    const unsigned long long theirs = *reinterpret_cast<const volatile unsigned long long*>(
        call_word(const_cast<uint32_t*>(p.mine[s])));
    if (theirs != p.call) record_give_up(p.status, kCallMismatch, s, static_cast<uint32_t>(theirs));
  }
}

}  // namespace mok::cuda::detail
