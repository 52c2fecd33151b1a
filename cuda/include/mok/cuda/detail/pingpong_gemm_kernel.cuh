// The ping-pong form of the grouped-rows GEMM (grouped_gemm_kernel.cuh): each consumer warpgroup
// owns whole 64 x 256 tiles, the two taking alternate tiles of the CTA's sequence, so that one
// warpgroup's epilogue runs while the other's mainloop reduces (the cooperative kernel's two
// warpgroups share a 128 x 256 tile and stop the tensor cores together for its epilogue).
//
// Anatomy (STYLE.md 3): shared-memory plan -> barriers -> register split -> one tile scheduler
// shared by all roles -> one branch per role.
//   warpgroup 0: producer (one elected thread issues the TMA loads of every tile in order)
//   warpgroups 1, 2: consumers; warpgroup 1 + c computes the CTA's tiles j with j % 2 == c and
//     skips the other's stages (their k-blocks) in its pipeline state. The mainloops take turns:
//     a warpgroup starts waiting on tile j's stages only after the other has waited on every
//     stage of tile j - 1. (Without the turn, it would wait on a stage's barrier while the other
//     still cycles it: the parity it waits for recurs every two phases, so it would pass on the
//     other's data and release a stage twice.)
// Same tiles, same k order per output element as the cooperative kernel: the same bits.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "mok/cuda/detail/expert_epilogues.cuh"
#include "mok/cuda/detail/gemm_config.cuh"
#include "mok/cuda/detail/grouped_gemm_kernel.cuh"
#include "mok/cuda/detail/grouped_tile_scheduler.cuh"
#include "mok/cuda/detail/mainloops.cuh"

namespace mok::cuda::detail {

using namespace cute;

inline constexpr int kPingPongRows = 64;  // rows of a warpgroup's tile
inline constexpr int kPingPongStagingElems = kPingPongRows * 64;

template <class Mainloop>
struct PingPongSharedStorage {
  static_assert(Mainloop::kRows == kPingPongRows, "the mainloop loads 64-row A tiles");
  alignas(1024) typename Mainloop::Element a[Mainloop::kStageElemsA * GemmConfig::kStages];
  alignas(1024) typename Mainloop::Element b[Mainloop::Operand::kStageElemsB * GemmConfig::kStages];
  alignas(1024) bfloat16_t staging[2][kEpilogueBuffers][kPingPongStagingElems];  // per consumer warpgroup
  GemmConfig::Pipeline::SharedStorage pipeline;
  GroupedTileSchedulerStorage<GemmConfig::kMaxExperts> tiles;
};

// The row tiles of grouped rows in 64-row units: groups of 16 (the cooperative kernel's 8 row
// blocks of 128), offsets still 128-aligned.
using PingPongScheduler = GroupedTileScheduler<kPingPongRows, GemmConfig::kMaxExperts, 16, GemmConfig::kBlockM>;

// p.order must be grouped_rows (the host launcher's business); p.k_blocks is every tile's.
template <class Mainloop, class Epilogue>
__global__ void __launch_bounds__(GemmConfig::kThreads, 1)
    pingpong_gemm_kernel(const __grid_constant__ GroupedGemmParams<Mainloop, Epilogue> p) {
  using Pipeline = GemmConfig::Pipeline;
  constexpr int kStages = GemmConfig::kStages;
  extern __shared__ __align__(1024) char smem_raw[];
  using SharedStorage = PingPongSharedStorage<Mainloop>;
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  const int warp = threadIdx.x / 32;
  const int warpgroup = threadIdx.x / 128;

  // ---- tile schedule (warp 0), then barriers ----
  if (warp == 0) {
    const int bad = PingPongScheduler::init(smem.tiles, p.offsets, p.experts, p.rows);
    if (bad != 0 && threadIdx.x == 0 && blockIdx.x == 0 && p.status != nullptr) atomicCAS(p.status, 0, bad);
    if (threadIdx.x == 0) Mainloop::prefetch(p.mainloop);
  }
  typename Pipeline::Params pp;
  pp.transaction_bytes = Mainloop::kStageBytes;
  pp.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = 128;  // one warpgroup reads (and releases) each stage
  Pipeline pipeline(smem.pipeline, pp, Shape<_1, _1, _1>{});
  __syncthreads();  // barrier init and the tile schedule are visible to every role

  const PingPongScheduler sched{smem.tiles, p.experts, p.n_blocks, p.k_blocks};

  if (warpgroup == 0) {
    // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp == 0 && cute::elect_one_sync()) {
      const int total = sched.total_tiles();
      auto state = cutlass::make_producer_start_state<Pipeline>();
      for (int linear = blockIdx.x; linear < total; linear += gridDim.x)
        load_k_blocks<Mainloop>(p.mainloop, smem.a, smem.b, sched.tile(linear), pipeline, state);
      pipeline.producer_tail(state);
    }
  } else {
    // ---- consumers: warpgroup 1 + c takes the CTA's tiles j with j % 2 == c ----
    cutlass::arch::warpgroup_reg_alloc<232>();
    const int c = warpgroup - 1;
    const int wg_thread = threadIdx.x % 128;
    const int total = sched.total_tiles();
    ExpertTiledMma<typename Mainloop::Element, Mainloop::kMajorA, Mainloop::kMajorB, 1> mma;
    auto thr = mma.get_thread_slice(wg_thread);
    Tensor sA = make_tensor(make_smem_ptr(smem.a), typename Mainloop::SmemLayoutA{});  // (64, BK, STAGES)
    Tensor sB = make_tensor(make_smem_ptr(smem.b), typename Mainloop::SmemLayoutB{});  // (256, BK, STAGES)
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    Tensor cC = make_identity_tensor(Shape<Int<kPingPongRows>, Int<GemmConfig::kBlockN>>{});  // tile coordinates
    Tensor tCcC = thr.partition_C(cC);
    Tensor acc = partition_fragment_C(mma, Shape<Int<kPingPongRows>, Int<GemmConfig::kBlockN>>{});

    cutlass::PipelineState<kStages> read_state;
    cutlass::PipelineState<kStages> release_state;
    int j = 0;
    for (int linear = blockIdx.x; linear < total; linear += gridDim.x, ++j) {
      const GroupedTile t = sched.tile(linear);
      if (j % 2 != c) {  // the other warpgroup's tile: its stages are not ours
        read_state += uint32_t(t.k_end - t.k_begin);
        release_state += uint32_t(t.k_end - t.k_begin);
        continue;
      }
      if (j > 0) wait_turn(c);  // the other warpgroup gave it after tile j - 1's mainloop
      reduce_k_blocks(mma, tCrA, tCrB, acc, pipeline, read_state, release_state, t.k_begin, t.k_end);
      if (linear + int(gridDim.x) < total) give_turn(1 - c);  // tile j + 1 is the other's
      Epilogue::apply(p.epilogue, t, acc, tCcC, wg_thread, &smem.staging[c][0][0]);
    }
    drain_stores(wg_thread);
  }
}

}  // namespace mok::cuda::detail
