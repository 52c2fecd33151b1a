// The block-scaled e4m3 grouped GEMM over rows grouped by expert:
//   out[r, n] = bf16( sum over k-blocks kb of (sum_{k in kb} a[r, k] b[e, n, k]) * sa[kb, r] * sb[e, n / 128, kb] )
// with a, b e4m3 codes, sa one fp32 scale per row and 128 columns of a (stored k-block major:
// [K / 128, rows], so a tile's 128 row scales of one k-block are 512 contiguous bytes), sb one per
// 128 x 128 block of each expert's b ([El, N / 128, K / 128]). A k-block of e4m3 is 128 values
// (one 128-byte swizzle row), exactly one scale block, so each k-block's product is promoted once,
// in k order, into the fp32 accumulator (mok/core/fp8.h: gemm_nt, the CPU oracle).
//
// Anatomy (STYLE.md 3): shared-memory plan -> barriers -> register split -> one tile scheduler
// shared by all roles -> one branch per role.
//   warpgroup 0: producer (one elected thread: TMA loads of a and b, the bulk copy of the tile's
//     row scales, all on the stage's barrier)
//   warpgroups 1, 2: consumers, 64 rows x 128 columns each: a k-block's wgmma into a zeroed
//     temporary, then acc += tmp * (sa * sb). Two 64 x 128 fragments are 128 registers, as the
//     bf16 kernels' one 64 x 256 fragment; the tile is 128 x 128.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "mok/cuda/detail/expert_epilogues.cuh"
#include "mok/cuda/detail/gemm_config.cuh"
#include "mok/cuda/detail/grouped_gemm_kernel.cuh"
#include "mok/cuda/detail/grouped_tile_scheduler.cuh"

namespace mok::cuda::detail {

using namespace cute;

struct Fp8GemmConfig {
  using Element = float_e4m3_t;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 128;  // one weight scale block wide
  static constexpr int kBlockK = 128;  // one 128-byte swizzle row, one scale block
  static constexpr int kStages = 5;
  static constexpr int kStageElems = kBlockM * kBlockK;  // a's and b's alike (kBlockN == kBlockM)
  static constexpr uint32_t kScaleBytes = kBlockM * sizeof(float);
  static constexpr uint32_t kStageBytes = 2 * kStageElems * sizeof(Element) + kScaleBytes;
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using SmemLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                            Shape<Int<kBlockM>, Int<kBlockK>, Int<kStages>>{}));  // (128, 128, STAGES)
  using TiledMma = decltype(make_tiled_mma(SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>{},
                                           Layout<Shape<_2, _1, _1>>{}));
};

inline auto fp8_tma_a(const float_e4m3_t* ptr, int rows, int k) {
  Tensor t = make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(rows, k, 1), make_stride(int64_t(k), _1{}, int64_t(0))));
  return make_tma_atom(SM90_TMA_LOAD{}, t, Fp8GemmConfig::SmemLayout{}(_, _, 0),
                       Shape<Int<Fp8GemmConfig::kBlockM>, Int<Fp8GemmConfig::kBlockK>>{});
}
inline auto fp8_tma_b(const float_e4m3_t* ptr, int n, int k, int experts) {
  Tensor t = make_tensor(make_gmem_ptr(ptr),
                         make_layout(make_shape(n, k, experts), make_stride(int64_t(k), _1{}, int64_t(n) * k)));
  return make_tma_atom(SM90_TMA_LOAD{}, t, Fp8GemmConfig::SmemLayout{}(_, _, 0),
                       Shape<Int<Fp8GemmConfig::kBlockN>, Int<Fp8GemmConfig::kBlockK>>{});
}

struct Fp8ScaledGemmParams {
  decltype(fp8_tma_a(nullptr, 1, 1)) tma_a;
  decltype(fp8_tma_b(nullptr, 1, 1, 1)) tma_b;
  StoreTensor out;             // [rows, n] bf16, 128 x 64 boxes
  const float* a_scales;       // [k_blocks, rows]
  const float* b_scales;       // [experts, n_blocks, k_blocks]
  int rows, k, n, experts;
  int n_blocks, k_blocks;
  const int32_t* offsets;      // [experts + 1], 128-row aligned
  int32_t* status;
};

struct Fp8ScaledGemmSharedStorage {
  alignas(1024) float_e4m3_t a[Fp8GemmConfig::kStageElems * Fp8GemmConfig::kStages];
  alignas(1024) float_e4m3_t b[Fp8GemmConfig::kStageElems * Fp8GemmConfig::kStages];
  alignas(1024) bfloat16_t staging[kEpilogueBuffers][kStagingElems];
  alignas(16) float a_scales[Fp8GemmConfig::kStages][Fp8GemmConfig::kBlockM];
  Fp8GemmConfig::Pipeline::SharedStorage pipeline;
  GroupedTileSchedulerStorage<GemmConfig::kMaxExperts> tiles;
};

__global__ void __launch_bounds__(GemmConfig::kThreads, 1)
    fp8_scaled_gemm_kernel(const __grid_constant__ Fp8ScaledGemmParams p) {
  using Config = Fp8GemmConfig;
  using Pipeline = Config::Pipeline;
  extern __shared__ __align__(1024) char smem_raw[];
  Fp8ScaledGemmSharedStorage& smem = *reinterpret_cast<Fp8ScaledGemmSharedStorage*>(smem_raw);
  const int warp = threadIdx.x / 32;
  const int warpgroup = threadIdx.x / 128;

  // ---- tile schedule (warp 0), then barriers ----
  using Scheduler = GroupedTileScheduler<Config::kBlockM, GemmConfig::kMaxExperts>;
  if (warp == 0) {
    const int bad = Scheduler::init(smem.tiles, p.offsets, p.experts, p.rows);
    if (bad != 0 && threadIdx.x == 0 && blockIdx.x == 0 && p.status != nullptr) atomicCAS(p.status, 0, bad);
    if (threadIdx.x == 0) {
      prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
    }
  }
  typename Pipeline::Params pp;
  pp.transaction_bytes = Config::kStageBytes;
  pp.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = 256;
  Pipeline pipeline(smem.pipeline, pp, Shape<_1, _1, _1>{});
  __syncthreads();

  const Scheduler sched{smem.tiles, p.experts, p.n_blocks, p.k_blocks};

  if (warpgroup == 0) {
    // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp == 0 && cute::elect_one_sync()) {
      const int total = sched.total_tiles();
      Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.rows, p.k, 1));
      Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.n, p.k, p.experts));
      Tensor gA = local_tile(mA, Shape<Int<Config::kBlockM>, Int<Config::kBlockK>>{}, make_coord(_, _, _));  // (BM, BK, m, k, 1)
      Tensor gB = local_tile(mB, Shape<Int<Config::kBlockN>, Int<Config::kBlockK>>{}, make_coord(_, _, _));  // (BN, BK, n, k, e)
      Tensor sA = make_tensor(make_smem_ptr(smem.a), Config::SmemLayout{});
      Tensor sB = make_tensor(make_smem_ptr(smem.b), Config::SmemLayout{});
      auto [tAg, tAs] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
      auto [tBg, tBs] = tma_partition(p.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
      auto state = cutlass::make_producer_start_state<Pipeline>();
      for (int linear = blockIdx.x; linear < total; linear += gridDim.x) {
        const GroupedTile t = sched.tile(linear);
        for (int kb = t.k_begin; kb < t.k_end; ++kb) {
          pipeline.producer_acquire(state);
          auto* bar = pipeline.producer_get_barrier(state);
          const int s = state.index();
          copy(p.tma_a.with(*bar), tAg(_, t.m_block, kb, 0), tAs(_, s));
          copy(p.tma_b.with(*bar), tBg(_, t.n_block, kb, t.expert), tBs(_, s));
          SM90_BULK_COPY_G2S::copy(p.a_scales + int64_t(kb) * p.rows + int64_t(t.m_block) * Config::kBlockM, bar,
                                   smem.a_scales[s], int32_t(Config::kScaleBytes));
          ++state;
        }
      }
      pipeline.producer_tail(state);
    }
  } else {
    // ---- consumers ----
    cutlass::arch::warpgroup_reg_alloc<232>();
    const int thread = threadIdx.x - 128;
    const int total = sched.total_tiles();
    Config::TiledMma mma;
    auto thr = mma.get_thread_slice(thread);
    Tensor sA = make_tensor(make_smem_ptr(smem.a), Config::SmemLayout{});
    Tensor sB = make_tensor(make_smem_ptr(smem.b), Config::SmemLayout{});
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    Tensor cC = make_identity_tensor(Shape<Int<Config::kBlockM>, Int<Config::kBlockN>>{});
    Tensor tCcC = thr.partition_C(cC);
    Tensor acc = partition_fragment_C(mma, Shape<Int<Config::kBlockM>, Int<Config::kBlockN>>{});
    Tensor tmp = partition_fragment_C(mma, Shape<Int<Config::kBlockM>, Int<Config::kBlockN>>{});
    static_assert(cute::size(decltype(acc){}) == 64, "a 64 x 128 fragment per consumer thread");
    // The thread's two rows of the tile: values i with (i / 2) % 2 == 0 are row r0, the others r0 + 8.
    const int r0 = get<0>(tCcC(0));

    cutlass::PipelineState<Config::kStages> state;
    for (int linear = blockIdx.x; linear < total; linear += gridDim.x) {
      const GroupedTile t = sched.tile(linear);
      clear(acc);  // an expert's k-blocks always exist (k >= 1): every tile reduces at least one
      const float* sb = p.b_scales + (int64_t(t.expert) * p.n_blocks + t.n_block) * p.k_blocks;
      for (int kb = t.k_begin; kb < t.k_end; ++kb) {
        const float b_scale = __ldg(sb + kb);  // read before the wait: off the path every k-block waits on
        pipeline.consumer_wait(state);
        const int s = state.index();
        warpgroup_fence_operand(tmp);
        warpgroup_arrive();
        mma.accumulate_ = GMMA::ScaleOut::Zero;
        CUTE_UNROLL
        for (int kk = 0; kk < size<2>(tCrA); ++kk) {
          cute::gemm(mma, tCrA(_, _, kk, s), tCrB(_, _, kk, s), tmp);
          mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        warpgroup_wait<0>();
        warpgroup_fence_operand(tmp);
        const float s0 = smem.a_scales[s][r0] * b_scale, s1 = smem.a_scales[s][r0 + 8] * b_scale;
        pipeline.consumer_release(state);  // the scales and operands of stage s are read
        ++state;
        CUTE_UNROLL
        for (int i = 0; i < size(acc); ++i) acc(i) = __fadd_rn(acc(i), __fmul_rn(tmp(i), (i / 2) % 2 == 0 ? s0 : s1));
      }
      // bf16 out, 64 columns a chunk (values [32c, 32c + 32) of the fragment).
      static_for<2>([&](auto c_) {
        constexpr int c = decltype(c_)::value;
        store_chunk<32 * c>(smem.staging[0], c, p.out, tCcC, 64 * c, t.m_block, 2 * t.n_block + c, 0, thread,
                            [&](auto i_) {
                              constexpr int i = decltype(i_)::value;
                              return __floats2bfloat162_rn(acc(i), acc(i + 1));
                            });
      });
    }
    drain_stores(thread);
  }
}

}  // namespace mok::cuda::detail
