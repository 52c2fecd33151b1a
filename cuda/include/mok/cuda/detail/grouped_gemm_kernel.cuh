// The persistent, warp-specialized sm_90a GEMM every expert kernel is made of:
//   for each tile the scheduler yields: acc = sum over its k-blocks of A_tile * B_tile^T,
//   then the epilogue turns the fp32 128 x 256 accumulator into the outputs.
// The mainloop policy says which global tiles feed each stage (mainloops.cuh), the scheduler
// which tiles exist and their k-blocks (grouped_tile_scheduler.cuh), the epilogue what is stored
// (expert_epilogues.cuh).
//
// Anatomy (STYLE.md 3): shared-memory plan -> barriers -> register split -> one tile scheduler
// shared by all roles -> one branch per role.
//   warpgroup 0: producer (one elected thread issues the TMA loads of A and B)
//   warpgroups 1, 2: consumers (64 rows x 256 columns each, wgmma from shared memory; epilogue)
// With an epilogue that stores per warpgroup (Epilogue::kPerWarpgroup: the weight gradients'
// 64-row targets) the consumers take turns: warpgroup 1 reduces tile j while warpgroup 2 still
// stores tile j - 1, then the other way round, so one warpgroup's epilogue runs under the other's
// mainloop (in a tile of more k-blocks than stages, under the other's last k-blocks). A
// weight-gradient tile reduces only K = an expert's rows (4 k-blocks at 256 rows), and then
// stores as many bytes as it loaded: the two warpgroups' epilogues together stopped the tensor
// cores for about as long as the mainloop ran. Same k order per output element: the same bits.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "mok/cuda/detail/expert_epilogues.cuh"
#include "mok/cuda/detail/gemm_config.cuh"
#include "mok/cuda/detail/grouped_tile_scheduler.cuh"
#include "mok/cuda/detail/mainloops.cuh"

namespace mok::cuda::detail {

using namespace cute;

// The stages hold the operands' element type; their bytes are the same at every precision.
template <class Element>
struct GroupedGemmSharedStorage {
  alignas(1024) Element a[OperandConfig<Element>::kStageElemsA * GemmConfig::kStages];
  alignas(1024) Element b[OperandConfig<Element>::kStageElemsB * GemmConfig::kStages];
  // The epilogue's two 128 x 64 output tiles; with per-warpgroup epilogues (turns) staging[c] is
  // consumer c's two 64-row tiles.
  alignas(1024) bfloat16_t staging[kEpilogueBuffers][kStagingElems];
  GemmConfig::Pipeline::SharedStorage pipeline;
  GroupedTileSchedulerStorage<GemmConfig::kMaxExperts> tiles;
  int held_b[GemmConfig::kStages][3];  // the producer's load_k_blocks_keeping_b: each stage's B k-block
  int longest_segment;                 // TileOrder::expert_weight_columns: the most rows of one expert
  int task_of_stage[GemmConfig::kStages];  // the forward megakernel: the task whose first k-block a stage holds
};

// Which tiles a launch computes: the row tiles of grouped rows, or the per-expert weight tiles in
// the rows or the columns order (ExpertTileScheduler; in the columns order the producer keeps a
// column's B tiles in shared memory where the Mainloop can, kCanKeepB).
enum class TileOrder { grouped_rows, expert_weights, expert_weight_columns };

// Named barriers 4 + c: consumer warpgroup c's turn to run its mainloop (ids 2, 3 are the
// per-warpgroup epilogues', 1 both consumers'). The ping-pong kernel and the turns here use them.
inline constexpr int kTurnBarrier = 4;

__device__ __forceinline__ void wait_turn(int c) {
  asm volatile("bar.sync %0, 256;" ::"r"(kTurnBarrier + c) : "memory");
}
__device__ __forceinline__ void give_turn(int other) {
  asm volatile("bar.arrive %0, 256;" ::"r"(kTurnBarrier + other) : "memory");
}
// The k-block after whose wgmma batch a warpgroup taking turns hands over: the tile's kStages-th,
// or its last in a shorter tile (k_begin - 1 for a tile of none). Past it a warpgroup alone would
// wait for stages that only the other one frees. The grouped GEMM's weight gradients and the
// backward megakernel's (megakernel_backward.cuh) hand over here.
__device__ __forceinline__ int hand_over_k_block(const GroupedTile& t) {
  return t.k_begin + min(t.k_end - t.k_begin, GemmConfig::kStages) - 1;
}

// Epilogue::kPerWarpgroup, false where the epilogue does not say.
template <class Epilogue, class = void>
inline constexpr bool kPerWarpgroupEpilogue = false;
template <class Epilogue>
inline constexpr bool kPerWarpgroupEpilogue<Epilogue, std::void_t<decltype(Epilogue::kPerWarpgroup)>> =
    Epilogue::kPerWarpgroup;

// The producer's part of one tile: the k-blocks [k_begin, k_end) of its operands into the
// pipeline's stages, in order, each stage once the consumers freed it. Every kernel here and both
// megakernel passes load with it.
template <class Mainloop, class Element, class Pipeline, class State>
__device__ __forceinline__ void load_k_blocks(const typename Mainloop::Params& load, Element* smem_a,
                                              Element* smem_b, const GroupedTile& t, Pipeline& pipeline,
                                              State& state) {
  for (int kb = t.k_begin; kb < t.k_end; ++kb) {
    pipeline.producer_acquire(state);
    Mainloop::load(load, smem_a, smem_b, t, kb, state.index(), *pipeline.producer_get_barrier(state));
    ++state;
  }
}

// Mainloop::kCanKeepB, false where the mainloop does not say.
template <class Mainloop, class = void>
inline constexpr bool kCanKeepB = false;
template <class Mainloop>
inline constexpr bool kCanKeepB<Mainloop, std::void_t<decltype(Mainloop::kCanKeepB)>> = Mainloop::kCanKeepB;

// load_k_blocks where consecutive tiles may read the same B tiles (the weight gradients in the
// columns order): `held[s]` (shared memory) names the B k-block in stage s, and a stage that
// already holds the one it needs is given only A (the pipeline's transaction bytes are A's; a B
// load adds its own before either copy is issued, so the stage cannot complete early). Its
// consumers released the stage, so nothing reads or writes its B in between. With k-blocks per
// tile dividing the stages (2 or 4: an expert's rows are padded to 128) the tiles of a column
// after the first one or two load A alone: a third of the bytes.
template <class Mainloop, class Element, class Pipeline, class State, class Held>
__device__ __forceinline__ void load_k_blocks_keeping_b(const typename Mainloop::Params& load,
                                                        Element* smem_a, Element* smem_b,
                                                        const GroupedTile& t, Pipeline& pipeline,
                                                        State& state, Held& held) {
  for (int kb = t.k_begin; kb < t.k_end; ++kb) {
    pipeline.producer_acquire(state);
    auto& bar = *pipeline.producer_get_barrier(state);
    const int stage = state.index();
    const auto key = Mainloop::b_key(load, t, kb);
    if (held[stage] == key) {
      Mainloop::template load<true, false>(load, smem_a, smem_b, t, kb, stage, bar);
    } else {
      pipeline.producer_expect_transaction(state, Mainloop::kStageBytesB);
      Mainloop::load(load, smem_a, smem_b, t, kb, stage, bar);
      held[stage] = key;
    }
    ++state;
  }
}

// The consumers' mainloop of one tile: acc = the sum over k-blocks [k_begin, k_end) (at least
// one) of the stages' A x B^T, reading each stage once its TMA loads landed and releasing it once
// the wgmma batch after it was issued (one batch stays in flight). Every kernel here and both
// megakernel passes reduce with it, so a tile's bits depend only on its operands and k order.
// `for_padding_half`: the other warpgroup's rows are all padding (reduce_padding_half), so this
// one also releases the stages after the first on its behalf. `issued(kb)` runs once the wgmma
// batch of k-block kb was issued (the turns below hand over there).
struct NoHook {
  __device__ void operator()(int) const {}
};
template <class Mma, class FragA, class FragB, class Acc, class Pipeline, class State, class Issued = NoHook>
__device__ __forceinline__ void reduce_k_blocks(Mma& mma, const FragA& tCrA, const FragB& tCrB, Acc& acc,
                                                Pipeline& pipeline, State& read_state, State& release_state,
                                                int k_begin, int k_end, bool for_padding_half = false,
                                                Issued issued = {}) {
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  warpgroup_fence_operand(acc);
  for (int kb = k_begin; kb < k_end; ++kb) {
    pipeline.consumer_wait(read_state);
    const int stage = read_state.index();
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(tCrA); ++kk) {
      cute::gemm(mma, tCrA(_, _, kk, stage), tCrB(_, _, kk, stage), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    issued(kb);
    // Keep one batch of wgmma in flight; the stage before it is then free.
    warpgroup_wait<1>();
    if (kb > k_begin) {
      pipeline.consumer_release(release_state);
      if (for_padding_half && kb - 1 > k_begin) pipeline.consumer_release(release_state);
      ++release_state;
    }
    ++read_state;
  }
  warpgroup_wait<0>();
  pipeline.consumer_release(release_state);
  if (for_padding_half && k_end - 1 > k_begin) pipeline.consumer_release(release_state);
  ++release_state;
  warpgroup_fence_operand(acc);
}

// reduce_k_blocks for a warpgroup whose 64 rows of the tile are all padding rows (zeros in A):
// its accumulator is zero after any k-block, so it reduces only the first (a wgmma defines the
// accumulator: zeroing it with other instructions makes ptxas serialize every wgmma of the kernel,
// C7515) and leaves the other stages to the other warpgroup, which has the tensor cores to itself
// and releases them for both (reduce_k_blocks' for_padding_half). This one neither waits for nor
// polls them: the epilogue's barrier of both warpgroups keeps it from the next tile's stages
// until the other is done with these. (The zeros' signs are not specified.) The tile has at least
// one k-block (k_end > k_begin), as for reduce_k_blocks.
template <class Mma, class FragA, class FragB, class Acc, class Pipeline, class State>
__device__ __forceinline__ void reduce_padding_half(Mma& mma, const FragA& tCrA, const FragB& tCrB, Acc& acc,
                                                    Pipeline& pipeline, State& read_state, State& release_state,
                                                    int k_begin, int k_end) {
  reduce_k_blocks(mma, tCrA, tCrB, acc, pipeline, read_state, release_state, k_begin, k_begin + 1);
  read_state += uint32_t(k_end - k_begin - 1);  // the stages the other warpgroup reads and releases
  release_state += uint32_t(k_end - k_begin - 1);
}

template <class Mainloop, class Epilogue>
struct GroupedGemmParams {
  typename Mainloop::Params mainloop;
  typename Epilogue::Params epilogue;
  TileOrder order;
  int experts;
  int rows;      // row capacity (offsets are checked against it)
  int m_blocks;  // expert_weights: output row blocks per expert
  int n_blocks;  // output column blocks
  int k_blocks;  // grouped_rows: k-blocks of every tile
  const int32_t* offsets;
  int32_t* status;
};

template <class Mainloop, class Epilogue>
__global__ void __launch_bounds__(GemmConfig::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ GroupedGemmParams<Mainloop, Epilogue> p) {
  using Pipeline = GemmConfig::Pipeline;
  constexpr int kStages = GemmConfig::kStages;
  extern __shared__ __align__(1024) char smem_raw[];
  using SharedStorage = GroupedGemmSharedStorage<typename Mainloop::Element>;
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  const int warp = threadIdx.x / 32;
  const int warpgroup = threadIdx.x / 128;

  // ---- tile schedule (warp 0), then barriers ----
  if (warp == 0) {
    const int bad = GroupedTileScheduler<GemmConfig::kBlockM, GemmConfig::kMaxExperts>::init(smem.tiles, p.offsets,
                                                                                             p.experts, p.rows);
    if (bad != 0 && threadIdx.x == 0 && blockIdx.x == 0 && p.status != nullptr) atomicCAS(p.status, 0, bad);
    if (threadIdx.x == 0) Mainloop::prefetch(p.mainloop);
    if (p.order == TileOrder::expert_weight_columns) {
      __syncwarp();  // the offsets init wrote
      const int longest = longest_segment(smem.tiles, p.experts);
      if (threadIdx.x == 0) smem.longest_segment = longest;
    }
  }
  // The columns order keeps B only where a column's B k-blocks fit the stages (every expert's
  // rows, 128-aligned, at most kStages k-blocks: 2 or 4 of them, which then map to the same
  // stages tile after tile); with longer experts no stage would ever hold the B it needs, and the
  // rows order reads L2 better (measured: 4-13% faster at 384 rows per expert). The producer
  // loads with load_k_blocks_keeping_b either way (it only adds B where a stage lacks it).
  const bool keep_b = kCanKeepB<Mainloop> && p.order == TileOrder::expert_weight_columns;
  typename Pipeline::Params pp;
  pp.transaction_bytes = Mainloop::Operand::kStageBytes;
  if constexpr (kCanKeepB<Mainloop>) {
    static_assert(Mainloop::kStageBytesA + Mainloop::kStageBytesB == Mainloop::Operand::kStageBytes);
    if (keep_b) pp.transaction_bytes = Mainloop::kStageBytesA;  // a B load adds its bytes itself
  }
  pp.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = 256;
  Pipeline pipeline(smem.pipeline, pp, Shape<_1, _1, _1>{});
  __syncthreads();  // barrier init and the tile schedule are visible to every role

  const GroupedTileScheduler<GemmConfig::kBlockM, GemmConfig::kMaxExperts> rows_sched{smem.tiles, p.experts,
                                                                                     p.n_blocks, p.k_blocks};
  const bool columns = keep_b && smem.longest_segment <= kStages * Mainloop::kBlockK;
  const ExpertTileScheduler<GemmConfig::kBlockM, Mainloop::kBlockK, GemmConfig::kMaxExperts> weight_sched{
      smem.tiles, p.experts, p.m_blocks, p.n_blocks, columns ? int(gridDim.x) : 0};
  const bool by_rows = p.order == TileOrder::grouped_rows;
  // A malformed schedule computes nothing (the status word says why).
  const int total = by_rows ? rows_sched.total_tiles() : weight_sched.total_tiles();
  auto tile_at = [&](int linear) { return by_rows ? rows_sched.tile(linear) : weight_sched.tile(linear); };

  if (warpgroup == 0) {
    // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp == 0 && cute::elect_one_sync()) {
      auto state = cutlass::make_producer_start_state<Pipeline>();
      if constexpr (kCanKeepB<Mainloop>) {  // keep_b is false for any other mainloop
        if (keep_b) {
          auto* held = reinterpret_cast<typename Mainloop::BKey*>(smem.held_b);
          static_assert(sizeof(typename Mainloop::BKey) == sizeof(smem.held_b[0]));
          for (int s = 0; s < kStages; ++s) held[s] = typename Mainloop::BKey{-1, -1, -1};  // none held
          for (int linear = blockIdx.x; linear < total; linear += gridDim.x)
            load_k_blocks_keeping_b<Mainloop>(p.mainloop, smem.a, smem.b, tile_at(linear), pipeline, state,
                                              held);
        }
      }
      if (!keep_b) {
        for (int linear = blockIdx.x; linear < total; linear += gridDim.x)
          load_k_blocks<Mainloop>(p.mainloop, smem.a, smem.b, tile_at(linear), pipeline, state);
      }
      pipeline.producer_tail(state);
    }
  } else {
    // ---- consumers ----
    cutlass::arch::warpgroup_reg_alloc<232>();
    const int consumer_thread = threadIdx.x - 128;
    ExpertTiledMma<typename Mainloop::Element, Mainloop::kMajorA, Mainloop::kMajorB> mma;
    auto thr = mma.get_thread_slice(consumer_thread);
    Tensor sA = make_tensor(make_smem_ptr(smem.a), typename Mainloop::SmemLayoutA{});  // (BM, BK, STAGES)
    Tensor sB = make_tensor(make_smem_ptr(smem.b), typename Mainloop::SmemLayoutB{});  // (BN, BK, STAGES)
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    Tensor cC = make_identity_tensor(Shape<Int<GemmConfig::kBlockM>, Int<GemmConfig::kBlockN>>{});  // tile coordinates
    Tensor tCcC = thr.partition_C(cC);
    Tensor acc = partition_fragment_C(mma, Shape<Int<GemmConfig::kBlockM>, Int<GemmConfig::kBlockN>>{});

    cutlass::PipelineState<kStages> read_state;
    cutlass::PipelineState<kStages> release_state;
    constexpr bool kTurns = kPerWarpgroupEpilogue<Epilogue>;
    static_assert(!kTurns || kEpilogueBuffers * 64 * 64 <= kStagingElems,
                  "staging[c] holds a warpgroup's two 64 x 64 staging tiles");
    const int c = warpgroup - 1;
    for (int linear = blockIdx.x; linear < total; linear += gridDim.x) {
      const GroupedTile t = tile_at(linear);
      const bool last = linear + int(gridDim.x) >= total;
      // Turns (consumer c = warpgroup 1 + c): consumer 0 starts; each gives the other the turn
      // once it has issued the tile's first kStages k-blocks (all of them in a shorter tile;
      // consumer 1 after its last tile gives nothing: consumer 0 has no next tile to wait for).
      // In a longer tile consumer 0 could not go on alone (the next stages are freed only when
      // both read them), so the two share the tensor cores for the rest of its mainloop, and
      // its epilogue runs under consumer 1's last k-blocks. (Until session 21 both reduced a
      // longer tile at once and stored at once, nothing overlapped: Kimi K2's 341 rows per expert
      // are 6 k-blocks. Against the cooperative epilogue, same process: 5.7% faster there, 2-12%
      // on other shapes; handing over after 1-3 k-blocks measured within noise of kStages.)
      if (kTurns && (c == 1 || linear != int(blockIdx.x))) wait_turn(c);
      const bool gives = kTurns && (c == 0 || !last);
      const int give_after = hand_over_k_block(t);
      auto hand_over = [&](int kb) {
        if (gives && kb == give_after) give_turn(1 - c);
      };
      if (t.k_end <= t.k_begin) {
        clear(acc);  // nothing to reduce (an empty expert's weight gradient): the tile is zero
        hand_over(give_after);
      } else {
        reduce_k_blocks(mma, tCrA, tCrB, acc, pipeline, read_state, release_state, t.k_begin, t.k_end, false,
                        hand_over);
      }
      if constexpr (kTurns) {
        // This warpgroup's 64 rows: block 2 m + c of 64 rows, its own staging tiles.
        GroupedTile half = t;
        half.m_block = 2 * t.m_block + c;
        const auto coords = [&](int i) { return make_tuple(get<0>(tCcC(i)) - 64 * c, get<1>(tCcC(i))); };
        Epilogue::apply(p.epilogue, half, acc, coords, consumer_thread % 128, smem.staging[c]);
      } else {
        Epilogue::apply(p.epilogue, t, acc, tCcC, consumer_thread, smem.staging[0]);
      }
    }
    drain_stores(kTurns ? consumer_thread % 128 : consumer_thread);
  }
}

}  // namespace mok::cuda::detail
