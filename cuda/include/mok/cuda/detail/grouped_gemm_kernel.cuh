// A persistent, warp-specialized sm_90a grouped GEMM over rows grouped by expert:
//   out[rows of e, :] = epilogue( A[rows of e, :K] * B_e^T ),  B_e = [B0_e rows ; B1_e rows]
// The B tile of kBlockN = 256 rows is loaded as two 128-row halves, each from its own tensor and
// row block: gate|up takes half 0 from W_gate and half 1 from W_up (same rows), so the SwiGLU pairs
// column c with column c+128 in the same thread; down takes both halves from W_down.
//
// Anatomy (STYLE.md 3): shared-memory plan -> barriers -> register split -> one tile scheduler
// shared by all roles -> one branch per role.
//   warpgroup 0: producer (one elected thread issues the TMA loads of A and B)
//   warpgroups 1, 2: consumers (64 rows x 256 columns each, wgmma from shared memory; epilogue)
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "mok/cuda/detail/expert_epilogues.cuh"
#include "mok/cuda/detail/grouped_tile_scheduler.cuh"

namespace mok::cuda::detail {

using namespace cute;

struct GroupedGemmShape {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;
  static constexpr int kHalfN = 128;
  static constexpr int kBlockK = 64;
  static constexpr int kStages = 4;
  static constexpr int kMaxExperts = 512;  // per launch (rank); what fits beside 4 stages and 2 staging tiles
  static constexpr int kThreads = 384;
  using TileA = Shape<Int<kBlockM>, Int<kBlockK>>;
  using TileBHalf = Shape<Int<kHalfN>, Int<kBlockK>>;
  // (BLOCK_M, BLOCK_K, STAGES) and (BLOCK_N, BLOCK_K, STAGES), K-major with the 128-byte swizzle.
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bfloat16_t>{},
                                             Shape<Int<kBlockM>, Int<kBlockK>, Int<kStages>>{}));
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bfloat16_t>{},
                                             Shape<Int<kBlockN>, Int<kBlockK>, Int<kStages>>{}));
  // The same bytes as SmemLayoutB seen as 128-row halves: (kHalfN, BLOCK_K, 2*STAGES), half h of
  // stage s at index 2s+h (tile_to_shape stacks the swizzle atoms along rows first, so a stage's
  // rows 0-127 and 128-255 are two consecutive 16 KiB blocks).
  using SmemLayoutBHalves = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bfloat16_t>{},
                                                   Shape<Int<kHalfN>, Int<kBlockK>, Int<2 * kStages>>{}));
  using TiledMma = decltype(make_tiled_mma(
      SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{}, Layout<Shape<_2, _1, _1>>{}));
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kStageBytes = (kBlockM + kBlockN) * kBlockK * sizeof(bfloat16_t);
};

template <class Shape_>
struct GroupedGemmSharedStorage {
  alignas(1024) bfloat16_t a[cosize_v<typename Shape_::SmemLayoutA>];
  alignas(1024) bfloat16_t b[cosize_v<typename Shape_::SmemLayoutB>];
  alignas(1024) bfloat16_t staging[kEpilogueBuffers][cosize_v<SmemLayoutEpilogue>];  // epilogue's 128 x 64 output tiles
  typename Shape_::Pipeline::SharedStorage pipeline;
  GroupedTileSchedulerStorage<Shape_::kMaxExperts> tiles;
};

// The TMA descriptors for A [rows, K, 1] and the two B halves [N, K, El].
template <class Shape_>
struct GroupedGemmTma {
  static auto make_a(const bfloat16_t* ptr, int rows, int k) {
    Tensor t = make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(rows, k, 1), make_stride(int64_t(k), _1{}, int64_t(0))));
    return make_tma_atom(SM90_TMA_LOAD{}, t, typename Shape_::SmemLayoutA{}(_, _, 0), typename Shape_::TileA{});
  }
  static auto make_b(const bfloat16_t* ptr, int n, int k, int experts) {
    Tensor t = make_tensor(make_gmem_ptr(ptr),
                           make_layout(make_shape(n, k, experts), make_stride(int64_t(k), _1{}, int64_t(n) * k)));
    return make_tma_atom(SM90_TMA_LOAD{}, t, typename Shape_::SmemLayoutBHalves{}(_, _, 0), typename Shape_::TileBHalf{});
  }
  using TmaA = decltype(make_a(nullptr, 1, 1));
  using TmaB = decltype(make_b(nullptr, 1, 1, 1));
};

template <class Shape_, class Epilogue>
struct GroupedGemmParams {
  typename GroupedGemmTma<Shape_>::TmaA tma_a;
  typename GroupedGemmTma<Shape_>::TmaB tma_b0, tma_b1;
  int rows;          // row capacity of A
  int k;             // reduction size
  int b_rows;        // rows of each B tensor (N of W_gate/W_up, or H of W_down)
  int experts;
  int n_blocks;      // output column blocks per row block
  int b1_row_shift;  // half 1 reads B1's 128-row block (2*n_block + 1) when 1, else n_block
  const int32_t* offsets;
  int32_t* status;
  typename Epilogue::Params epilogue;
};

template <class Shape_, class Epilogue>
__global__ void __launch_bounds__(Shape_::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ GroupedGemmParams<Shape_, Epilogue> p) {
  using S = Shape_;
  using Pipeline = typename S::Pipeline;
  using Storage = GroupedGemmSharedStorage<S>;
  extern __shared__ __align__(1024) char smem_raw[];
  Storage& smem = *reinterpret_cast<Storage*>(smem_raw);

  const int warp = threadIdx.x / 32;
  const int warpgroup = threadIdx.x / 128;

  // ---- tile schedule (warp 0), then barriers ----
  if (warp == 0) {
    const int bad = GroupedTileScheduler<S::kBlockM, S::kMaxExperts>::init(smem.tiles, p.offsets, p.experts, p.rows);
    if (bad != 0 && threadIdx.x == 0 && blockIdx.x == 0 && p.status != nullptr) atomicCAS(p.status, 0, bad);
    if (threadIdx.x == 0) {
      prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_b0.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_b1.get_tma_descriptor());
    }
  }
  typename Pipeline::Params pp;
  pp.transaction_bytes = S::kStageBytes;
  pp.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = 256;
  Pipeline pipeline(smem.pipeline, pp, Shape<_1, _1, _1>{});
  __syncthreads();  // barrier init and the tile schedule are visible to every role

  const GroupedTileScheduler<S::kBlockM, S::kMaxExperts> sched{smem.tiles, p.experts, p.n_blocks};
  // A malformed schedule computes nothing (the status word says why).
  const int total = sched.total_tiles();

  // Global tensors as TMA coordinate tensors: A (rows, K, 1), B (N, K, El).
  Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.rows, p.k, 1));
  Tensor mB0 = p.tma_b0.get_tma_tensor(make_shape(p.b_rows, p.k, p.experts));
  Tensor mB1 = p.tma_b1.get_tma_tensor(make_shape(p.b_rows, p.k, p.experts));
  const int k_blocks = (p.k + S::kBlockK - 1) / S::kBlockK;

  if (warpgroup == 0) {
    // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp == 0 && cute::elect_one_sync()) {
      Tensor gA = local_tile(mA, typename S::TileA{}, make_coord(_, _, _));      // (BM, BK, m, k, 1)
      Tensor gB0 = local_tile(mB0, typename S::TileBHalf{}, make_coord(_, _, _));  // (128, BK, n, k, e)
      Tensor gB1 = local_tile(mB1, typename S::TileBHalf{}, make_coord(_, _, _));
      Tensor sA = make_tensor(make_smem_ptr(smem.a), typename S::SmemLayoutA{});          // (BM, BK, STAGES)
      Tensor sB = make_tensor(make_smem_ptr(smem.b), typename S::SmemLayoutBHalves{});    // (128, BK, 2*STAGES)
      auto [tAg, tAs] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                      group_modes<0, 2>(gA));     // (TMA, m, k, 1), (TMA, STAGES)
      auto [tB0g, tB0s] = tma_partition(p.tma_b0, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                        group_modes<0, 2>(gB0));  // (TMA, n, k, e), (TMA, 2*STAGES)
      auto [tB1g, tB1s] = tma_partition(p.tma_b1, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                        group_modes<0, 2>(gB1));
      auto state = cutlass::make_producer_start_state<Pipeline>();
      for (int linear = blockIdx.x; linear < total; linear += gridDim.x) {
        const GroupedTile t = sched.tile(linear);
        const int b0_block = p.b1_row_shift ? 2 * t.n_block : t.n_block;
        const int b1_block = p.b1_row_shift ? 2 * t.n_block + 1 : t.n_block;
        for (int kb = 0; kb < k_blocks; ++kb) {
          pipeline.producer_acquire(state);
          auto* bar = pipeline.producer_get_barrier(state);
          const int stage = state.index();
          copy(p.tma_a.with(*bar), tAg(_, t.m_block, kb, 0), tAs(_, stage));
          copy(p.tma_b0.with(*bar), tB0g(_, b0_block, kb, t.expert), tB0s(_, 2 * stage));
          copy(p.tma_b1.with(*bar), tB1g(_, b1_block, kb, t.expert), tB1s(_, 2 * stage + 1));
          ++state;
        }
      }
      pipeline.producer_tail(state);
    }
  } else {
    // ---- consumers ----
    cutlass::arch::warpgroup_reg_alloc<232>();
    const int consumer_thread = threadIdx.x - 128;
    typename S::TiledMma mma;
    auto thr = mma.get_thread_slice(consumer_thread);
    Tensor sA = make_tensor(make_smem_ptr(smem.a), typename S::SmemLayoutA{});  // (BM, BK, STAGES)
    Tensor sB = make_tensor(make_smem_ptr(smem.b), typename S::SmemLayoutB{});  // (BN, BK, STAGES)
    Tensor tCsA = thr.partition_A(sA);
    Tensor tCsB = thr.partition_B(sB);
    Tensor tCrA = thr.make_fragment_A(tCsA);
    Tensor tCrB = thr.make_fragment_B(tCsB);
    Tensor cC = make_identity_tensor(Shape<Int<S::kBlockM>, Int<S::kBlockN>>{});  // tile coordinates
    Tensor tCcC = thr.partition_C(cC);
    Tensor acc = partition_fragment_C(mma, Shape<Int<S::kBlockM>, Int<S::kBlockN>>{});  // (MMA, MMA_M, MMA_N)

    cutlass::PipelineState<S::kStages> read_state;
    cutlass::PipelineState<S::kStages> release_state;
    for (int linear = blockIdx.x; linear < total; linear += gridDim.x) {
      const GroupedTile t = sched.tile(linear);
      mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(acc);
      for (int kb = 0; kb < k_blocks; ++kb) {
        pipeline.consumer_wait(read_state);
        const int stage = read_state.index();
        warpgroup_arrive();
        CUTE_UNROLL
        for (int kk = 0; kk < size<2>(tCrA); ++kk) {
          cute::gemm(mma, tCrA(_, _, kk, stage), tCrB(_, _, kk, stage), acc);
          mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        // Keep one batch of wgmma in flight; the stage before it is then free.
        warpgroup_wait<1>();
        if (kb > 0) {
          pipeline.consumer_release(release_state);
          ++release_state;
        }
        ++read_state;
      }
      warpgroup_wait<0>();
      if (k_blocks > 0) {
        pipeline.consumer_release(release_state);
        ++release_state;
      }
      warpgroup_fence_operand(acc);
      Epilogue::apply(p.epilogue, t, acc, tCcC, consumer_thread, smem.staging[0]);
    }
    drain_stores(consumer_thread);
  }
}

}  // namespace mok::cuda::detail
