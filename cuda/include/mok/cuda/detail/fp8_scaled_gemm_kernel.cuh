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
//     row scales, all on the stage's barrier; in clusters of two, a's 64-row half multicast to
//     both CTAs of the pair)
//   warpgroups 1, 2: consumers, 64 rows x 128 columns each: a k-block's wgmma into a zeroed
//     temporary, then acc += tmp * (sa * sb). Two 64 x 128 fragments are 128 registers, as the
//     bf16 kernels' one 64 x 256 fragment; the tile is 128 x 128.
// Three forms (kGateUp, kSwiGluBackward):
//   store (the down projection; the fp8 dgrad's dx): b one 128-row block of W[e], out[r, n] =
//     bf16(acc), two chunks; or, with push.ranks > 0 (the stage backward's fp8 dx), each row
//     pushed into its (token, j) slot as the bf16 dx GEMM's PushRowsEpilogue does, out unused.
//   SwiGLU backward (kSwiGluBackward; the fp8 dgrad's dh = dy W_down, b = W_down^T's codes): b as
//     the store form's, the epilogue the bf16 kernels' SwiGluBackwardEpilogueOf on a 128-column
//     tile (dg|du, w*h and one d topk_w partial per 128 columns).
//   gate|up (kGateUp): b's rows 0-63 are W_gate[e]'s rows [64n, 64n + 64) and rows 64-127 W_up[e]'s
//     same rows, each with its own weight scale (a 64-row block lies in one 128 x 128 scale
//     block); the epilogue pairs column c with c + 64 (accumulator values i and i + 32 of a
//     thread): h[:, 64n + c] = bf16(act(g, u)) from the fp32 sums, and with save_gu g and u
//     (bf16, clamp side kept) into gu[:, 64n + c] and gu[:, I + 64n + c], as the bf16 SwiGLU
//     epilogue (expert_epilogues.cuh) writes them.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "mok/cuda/detail/expert_epilogues.cuh"
#include "mok/cuda/detail/gemm_config.cuh"
#include "mok/cuda/detail/grouped_gemm_kernel.cuh"
#include "mok/cuda/detail/grouped_tile_scheduler.cuh"
#include "mok/cuda/detail/swiglu.cuh"

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

// a [rows, k] (K-major) in 128 x 128 tiles; b [experts, n, k] in 128-row tiles (the store form)
// or 64-row halves (gate|up: the smem stage seen as (64, 128, 2 * STAGES), half h of stage s at
// 2s + h: K-major swizzle atoms stack along rows first, so a stage's rows 0-63 and 64-127 are two
// consecutive 8 KiB blocks).
using Fp8SmemLayoutHalves = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float_e4m3_t>{},
                                                   Shape<_64, Int<Fp8GemmConfig::kBlockK>, Int<2 * Fp8GemmConfig::kStages>>{}));
// a's 64-row halves for a cluster of two CTAs at adjacent column tiles of the same rows: each CTA
// loads one half and multicasts it into both (half the L2 reads of a).
inline auto fp8_tma_a_half(const float_e4m3_t* ptr, int rows, int k) {
  Tensor t = make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(rows, k, 1), make_stride(int64_t(k), _1{}, int64_t(0))));
  return make_tma_atom(SM90_TMA_LOAD_MULTICAST{}, t, Fp8SmemLayoutHalves{}(_, _, 0),
                       Shape<_64, Int<Fp8GemmConfig::kBlockK>>{});
}
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
inline auto fp8_tma_b_half(const float_e4m3_t* ptr, int n, int k, int experts) {
  Tensor t = make_tensor(make_gmem_ptr(ptr),
                         make_layout(make_shape(n, k, experts), make_stride(int64_t(k), _1{}, int64_t(n) * k)));
  return make_tma_atom(SM90_TMA_LOAD{}, t, Fp8SmemLayoutHalves{}(_, _, 0), Shape<_64, Int<Fp8GemmConfig::kBlockK>>{});
}

// One k-block of a tile into stage s (on its full barrier `bar`): a's 128 x 128 codes at row block
// t.m_block, b's 128 rows at t.n_block (the store form) or the 64-row halves of W_gate and W_up at
// t.n_block (gate|up), and the row block's 128 scales of the k-block from a_scales [k_blocks,
// scale_stride] (a bulk copy of 512 contiguous bytes). Shared by the standalone launch and the fp8
// forward megakernel (megakernel_fp8.cuh). kLoadA false: a is left to the caller
// (load_fp8_a_half, the cluster form).
template <bool kGateUp, bool kLoadA = true, class TmaA, class TmaB, class TmaHalf, class Storage>
__device__ __forceinline__ void load_fp8_k_block(const TmaA& tma_a, const TmaB& tma_b, const TmaHalf& tma_gate,
                                                 const TmaHalf& tma_up, int a_rows, int k, int n, int experts,
                                                 const float* a_scales, int scale_stride, Storage& smem, uint64_t* bar,
                                                 int s, const GroupedTile& t, int kb) {
  using Config = Fp8GemmConfig;
  if constexpr (kLoadA) {
    Tensor mA = tma_a.get_tma_tensor(make_shape(a_rows, k, 1));
    Tensor gA = local_tile(mA, Shape<Int<Config::kBlockM>, Int<Config::kBlockK>>{}, make_coord(_, _, _));  // (BM, BK, m, k, 1)
    Tensor sA = make_tensor(make_smem_ptr(smem.a), Config::SmemLayout{});
    auto [tAg, tAs] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
    copy(tma_a.with(*bar), tAg(_, t.m_block, kb, 0), tAs(_, s));
  }
  if constexpr (kGateUp) {
    Tensor sH = make_tensor(make_smem_ptr(smem.b), Fp8SmemLayoutHalves{});  // (64, BK, 2*STAGES)
    static_for<2>([&](auto half_) {
      constexpr int half = decltype(half_)::value;
      const auto& tma = half == 0 ? tma_gate : tma_up;
      Tensor mW = tma.get_tma_tensor(make_shape(n, k, experts));
      Tensor gW = local_tile(mW, Shape<_64, Int<Config::kBlockK>>{}, make_coord(_, _, _));  // (64, BK, n, k, e)
      auto [tWg, tWs] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sH), group_modes<0, 2>(gW));
      copy(tma.with(*bar), tWg(_, t.n_block, kb, t.expert), tWs(_, 2 * s + half));
    });
  } else {
    Tensor mB = tma_b.get_tma_tensor(make_shape(n, k, experts));
    Tensor gB = local_tile(mB, Shape<Int<Config::kBlockN>, Int<Config::kBlockK>>{}, make_coord(_, _, _));  // (BN, BK, n, k, e)
    Tensor sB = make_tensor(make_smem_ptr(smem.b), Config::SmemLayout{});
    auto [tBg, tBs] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
    copy(tma_b.with(*bar), tBg(_, t.n_block, kb, t.expert), tBs(_, s));
  }
  SM90_BULK_COPY_G2S::copy(a_scales + int64_t(kb) * scale_stride + int64_t(t.m_block) * Config::kBlockM, bar,
                           smem.a_scales[s], int32_t(Config::kScaleBytes));
}

// The cluster form's a: this CTA's 64-row half (`half`, its rank in the cluster) of the tile's
// row block t.m_block at k-block kb, multicast into stage s of both CTAs (each CTA's full barrier
// at stage s counts the bytes of both halves: the stage's byte count is the unclustered one's).
template <class TmaAHalf, class Storage>
__device__ __forceinline__ void load_fp8_a_half(const TmaAHalf& tma_a_half, int a_rows, int k, Storage& smem,
                                                uint64_t* bar, int s, const GroupedTile& t, int kb, int half) {
  Tensor mA = tma_a_half.get_tma_tensor(make_shape(a_rows, k, 1));
  Tensor gA = local_tile(mA, Shape<_64, Int<Fp8GemmConfig::kBlockK>>{}, make_coord(_, _, _));  // (64, BK, m64, k, 1)
  Tensor sH = make_tensor(make_smem_ptr(smem.a), Fp8SmemLayoutHalves{});                         // (64, BK, 2*STAGES)
  auto [tAg, tAs] = tma_partition(tma_a_half, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sH), group_modes<0, 2>(gA));
  copy(tma_a_half.with(*bar, uint16_t(0b11)), tAg(_, 2 * t.m_block + half, kb, 0), tAs(_, 2 * s + half));
}

// A tile's k-blocks [k_begin, k_end) into acc (cleared first; an expert's k-blocks always exist,
// k >= 1): each k-block's wgmma into the zeroed temporary tmp, then acc += tmp * (sa * sb), in k
// order. sb (and su) point at the tile's weight scale row, one per k-block: with kTwoScales, sb
// scales values [0, 32) of the thread (the gate half) and su values [32, 64) (the up half).
// a_scales: the stages' row scales; r0 the thread's first row (values i with (i / 2) % 2 == 0),
// r0 + 8 its second. Each stage is released once its operands and scales are read.
template <bool kTwoScales, class Mma, class FragA, class FragB, class Acc, class Pipeline, class State>
__device__ __forceinline__ void reduce_scaled_k_blocks(Mma& mma, const FragA& tCrA, const FragB& tCrB, Acc& acc,
                                                       Acc& tmp, Pipeline& pipeline, State& state,
                                                       const float (*a_scales)[Fp8GemmConfig::kBlockM], int r0,
                                                       const float* sb, const float* su, int k_begin, int k_end) {
  clear(acc);
#ifdef MOK_FP8_EXPERIMENT_NO_PROMOTION
  // Timing only (wrong results; tools/gpu.sh MOK_CUDA_FLAGS=-DMOK_FP8_EXPERIMENT_NO_PROMOTION with
  // its own MOK_BUILD_DIR): every k-block's wgmma accumulates into acc unscaled, one batch kept in
  // flight as the bf16 mainloop keeps it: this data path's ceiling without promotions (session
  // 23: about 1090 TF/s, against 850-890 with them and cuBLASLt's dense e4m3 1355-1447).
  (void)tmp, (void)a_scales, (void)r0, (void)sb, (void)su;
  auto previous = state;
  bool pending = false;  // previous holds the stage of the batch still in flight
  for (int kb = k_begin; kb < k_end; ++kb) {
    pipeline.consumer_wait(state);
    const int s = state.index();
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(tCrA); ++kk) {
      cute::gemm(mma, tCrA(_, _, kk, s), tCrB(_, _, kk, s), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc);
    if (pending) pipeline.consumer_release(previous);
    previous = state;
    pending = true;
    ++state;
  }
  warpgroup_wait<0>();
  if (pending) pipeline.consumer_release(previous);
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  return;
#endif
  // Each k-block's weight scales are read one k-block ahead: the load's latency is off the
  // promotion that needs them.
  float next_b = __ldg(sb + k_begin), next_up = kTwoScales ? __ldg(su + k_begin) : next_b;
  for (int kb = k_begin; kb < k_end; ++kb) {
    const float b_scale = next_b, up_scale = next_up;
    if (kb + 1 < k_end) {
      next_b = __ldg(sb + kb + 1);
      next_up = kTwoScales ? __ldg(su + kb + 1) : next_b;
    }
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
    const float a0 = a_scales[s][r0], a1 = a_scales[s][r0 + 8];
    pipeline.consumer_release(state);  // the scales and operands of stage s are read
    ++state;
    // Powers of two: every product with a scale is exact (short of fp32's range ends), so the
    // order of the products is free, and one fused multiply-add rounds as the oracle's
    // multiply then add: half the instructions of the two (they were 30% of the samples).
    const float s0 = a0 * b_scale, s1 = a1 * b_scale, u0 = a0 * up_scale, u1 = a1 * up_scale;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) {
      const bool row0 = (i / 2) % 2 == 0, up = kTwoScales && i >= 32;
      acc(i) = __fmaf_rn(tmp(i), up ? (row0 ? u0 : u1) : (row0 ? s0 : s1), acc(i));
    }
  }
}

// The gate|up form's epilogue: values i (gate column c of the tile) and i + 32 (up column c).
// g|u first when saved (bf16, clamp side kept, as the bf16 SwiGLU epilogue saves them) into g
// and u at row block gu_m_block, then h = act(g, u) from the fp32 sums into h at h_m_block: one
// 64-column chunk each, through staging tile chunk % 2 (chunk counts on across tiles).
template <class Acc, class Coords>
__device__ __forceinline__ void fp8_swiglu_epilogue(bfloat16_t* staging, int& chunk, const StoreTensor& h,
                                                    const StoreTensor& g, const StoreTensor& u, bool save_gu,
                                                    bool has_limit, float limit, const Acc& acc, const Coords& coords,
                                                    int h_m_block, int gu_m_block, int n_block, int thread) {
  if (save_gu) {
    static_for<2>([&](auto plane_) {
      constexpr int plane = decltype(plane_)::value;
      const float lo = plane == 0 ? -INFINITY : -limit;
      store_saved_chunk<32 * plane>(staging, chunk++, plane == 0 ? g : u, coords, 64 * plane, gu_m_block, n_block,
                                    thread, acc, has_limit, lo, limit);
    });
  }
  store_chunk<0>(staging, chunk++, h, coords, 0, h_m_block, n_block, 0, thread, [&](auto i_) {
    constexpr int i = decltype(i_)::value;
    return __floats2bfloat162_rn(swiglu(acc(i), acc(i + 32), has_limit, limit),
                                 swiglu(acc(i + 1), acc(i + 33), has_limit, limit));
  });
}

struct Fp8ScaledGemmParams {
  decltype(fp8_tma_a(nullptr, 1, 1)) tma_a;
  decltype(fp8_tma_b(nullptr, 1, 1, 1)) tma_b;                     // the store form's b
  decltype(fp8_tma_b_half(nullptr, 1, 1, 1)) tma_gate, tma_up;     // gate|up's halves
  StoreTensor out;             // [rows, n_out] bf16, 128 x 64 boxes: y (store), h (gate|up)
  StoreTensor g, u;            // gate|up with save_gu: the two halves of gu [rows, 2I]
  bool save_gu, has_limit;
  float limit;
  const float* a_scales;       // [k_blocks, rows]
  const float* b_scales;       // [experts, b_scale_rows, k_blocks]: b's (store) or W_gate's (gate|up)
  const float* up_scales;      // gate|up: W_up's, the same shape
  int rows, k, n, experts;     // n: b's rows (a plane's)
  int n_blocks, k_blocks;      // output column tiles (128 wide: 128 of out, or 64 of g and 64 of u); k-blocks
  int b_scale_rows;            // ceil(n / 128)
  const int32_t* offsets;      // [experts + 1], 128-row aligned
  int32_t* status;
  SwiGluBackwardParams swiglu_backward{};  // the SwiGLU backward form's outputs and saved rows
  decltype(fp8_tma_a_half(nullptr, 1, 1)) tma_a_half{};  // the cluster form's a (kCluster == 2)
  PushRowsEpilogue::Params push{};  // the store form's rows pushed instead of stored (ranks > 0)
};

// The store form's parameters: out[rows, n] = bf16 of a [rows, k] (row scales a_scales
// [ceil(k / 128), rows]) times each expert's b [experts, n, k] (scales [experts, ceil(n / 128),
// ceil(k / 128)]). The gate|up form's fields hold valid stand-ins (b's halves, out), unused.
inline Fp8ScaledGemmParams fp8_store_params(const float_e4m3_t* a, const float* a_scales, const float_e4m3_t* b,
                                            const float* b_scales, const StoreTensor& out, int rows, int k, int n,
                                            int experts, const int32_t* offsets, int32_t* status) {
  const auto blocks = [](int v, int block) { return (v + block - 1) / block; };
  return Fp8ScaledGemmParams{fp8_tma_a(a, rows, k),
                             fp8_tma_b(b, n, k, experts),
                             fp8_tma_b_half(b, n, k, experts),
                             fp8_tma_b_half(b, n, k, experts),
                             out,
                             out,
                             out,
                             /*save_gu=*/false,
                             /*has_limit=*/false,
                             /*limit=*/0.0f,
                             a_scales,
                             b_scales,
                             b_scales,
                             rows,
                             k,
                             n,
                             experts,
                             blocks(n, Fp8GemmConfig::kBlockN),
                             blocks(k, Fp8GemmConfig::kBlockK),
                             blocks(n, 128),
                             offsets,
                             status,
                             {},
                             fp8_tma_a_half(a, rows, k)};
}

struct Fp8ScaledGemmSharedStorage {
  alignas(1024) float_e4m3_t a[Fp8GemmConfig::kStageElems * Fp8GemmConfig::kStages];
  alignas(1024) float_e4m3_t b[Fp8GemmConfig::kStageElems * Fp8GemmConfig::kStages];
  alignas(1024) bfloat16_t staging[kEpilogueBuffers][kStagingElems];
  alignas(16) float a_scales[Fp8GemmConfig::kStages][Fp8GemmConfig::kBlockM];
  Fp8GemmConfig::Pipeline::SharedStorage pipeline;
  GroupedTileSchedulerStorage<GemmConfig::kMaxExperts> tiles;
};

// kCluster 2: launched in clusters of two CTAs (cluster dims (2, 1, 1), an even grid) that take
// the same row block at column tiles 2j and 2j + 1 (n_blocks even): each loads one 64-row half of
// a and multicasts it to both, so a's L2 reads halve (the launch reads 32 KiB from L2 per 2 M
// MAC, about the rate L2 delivers: call 2 of session 23). The stages are released to both
// producers (the pipeline's cluster form) and the cluster meets once at the end, so no CTA exits
// while its peer may still write into it. The same k order and promotions: the same bits.
template <bool kGateUp, bool kSwiGluBackward = false, int kCluster = 1>
__global__ void __launch_bounds__(GemmConfig::kThreads, 1)
    fp8_scaled_gemm_kernel(const __grid_constant__ Fp8ScaledGemmParams p) {
  static_assert(!(kGateUp && kSwiGluBackward), "one form");
  static_assert(kCluster == 1 || kCluster == 2, "clusters of one or two CTAs");
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
      if constexpr (kCluster == 2) {
        prefetch_tma_descriptor(p.tma_a_half.get_tma_descriptor());
      } else {
        prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
      }
      if constexpr (kGateUp) {
        prefetch_tma_descriptor(p.tma_gate.get_tma_descriptor());
        prefetch_tma_descriptor(p.tma_up.get_tma_descriptor());
      } else {
        prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
      }
    }
  }
  typename Pipeline::Params pp;
  pp.transaction_bytes = Config::kStageBytes;
  pp.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = 256;
  Pipeline pipeline(smem.pipeline, pp, Shape<Int<kCluster>, _1, _1>{});
  // A cluster's tiles are column pairs: the scheduler walks n_blocks / 2 columns, and the CTA of
  // rank `half` takes column 2j + half of pair column j.
  int half = 0, first = blockIdx.x, stride = gridDim.x;
  if constexpr (kCluster == 2) {
    cute::cluster_arrive_relaxed();  // the barriers are initialized before a peer arrives on them
    cute::cluster_wait();
    half = int(cute::block_rank_in_cluster());
    first = blockIdx.x / 2;
    stride = gridDim.x / 2;
  } else {
    __syncthreads();
  }
  const Scheduler sched{smem.tiles, p.experts, p.n_blocks / kCluster, p.k_blocks};
  const auto tile_at = [&](int linear) {
    GroupedTile t = sched.tile(linear);
    t.n_block = kCluster * t.n_block + half;
    return t;
  };

  if (warpgroup == 0) {
    // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp == 0 && cute::elect_one_sync()) {
      const int total = sched.total_tiles();
      auto state = cutlass::make_producer_start_state<Pipeline>();
      for (int linear = first; linear < total; linear += stride) {
        const GroupedTile t = tile_at(linear);
        for (int kb = t.k_begin; kb < t.k_end; ++kb) {
          pipeline.producer_acquire(state);
          uint64_t* bar = pipeline.producer_get_barrier(state);
          if constexpr (kCluster == 2) load_fp8_a_half(p.tma_a_half, p.rows, p.k, smem, bar, state.index(), t, kb, half);
          load_fp8_k_block<kGateUp, kCluster == 1>(p.tma_a, p.tma_b, p.tma_gate, p.tma_up, p.rows, p.k, p.n, p.experts,
                                                   p.a_scales, p.rows, smem, bar, state.index(), t, kb);
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
    // The thread's two rows of the tile: values i with (i / 2) % 2 == 0 are row r0, the others
    // r0 + 8. Columns [0, 64) are values [0, 32) (gate|up: the gate half), [64, 128) values [32, 64).
    const int r0 = get<0>(tCcC(0));

    cutlass::PipelineState<Config::kStages> state;
    int chunk = 0;  // the staging tile of the next chunk: chunk % 2 (the gate|up form stores an odd count per tile)
    for (int linear = first; linear < total; linear += stride) {
      const GroupedTile t = tile_at(linear);
      // The weight scales of the tile's b rows: a 128-row block (store), or the 64-row halves'
      // blocks of W_gate and W_up (gate|up).
      const int64_t scale_row = int64_t(t.expert) * p.b_scale_rows + (kGateUp ? t.n_block / 2 : t.n_block);
      const float* sb = p.b_scales + scale_row * p.k_blocks;
      reduce_scaled_k_blocks<kGateUp>(mma, tCrA, tCrB, acc, tmp, pipeline, state, smem.a_scales, r0, sb,
                                      kGateUp ? p.up_scales + scale_row * p.k_blocks : sb, t.k_begin, t.k_end);
      if constexpr (kGateUp) {
        fp8_swiglu_epilogue(smem.staging[0], chunk, p.out, p.g, p.u, p.save_gu, p.has_limit, p.limit, acc, tCcC,
                            t.m_block, t.m_block, t.n_block, thread);
      } else if constexpr (kSwiGluBackward) {
        // (No bulk store in this form: the staging tiles are free of them.)
        SwiGluBackwardEpilogueOf<Config::kBlockM, Config::kBlockN>::apply(p.swiglu_backward, t, acc, tCcC, thread,
                                                                          smem.staging[0]);
      } else if (p.push.ranks > 0) {
        // (The same for every consumer thread: push_rows' barriers are met by all. A given-up
        // call only skips the stores.)
        const bool given_up = p.push.given_up_words != nullptr && call_given_up(p.push.given_up_words);
        push_rows<1>(PushRowsEpilogue::Target{p.push, given_up}, t.m_block, t.n_block, acc, tCcC, thread,
                     smem.staging[0]);
      } else {
        // bf16 out, 64 columns a chunk (values [32c, 32c + 32) of the fragment).
        static_for<2>([&](auto c_) {
          constexpr int c = decltype(c_)::value;
          store_chunk<32 * c>(smem.staging[0], chunk++, p.out, tCcC, 64 * c, t.m_block, 2 * t.n_block + c, 0, thread,
                              [&](auto i_) {
                                constexpr int i = decltype(i_)::value;
                                return __floats2bfloat162_rn(acc(i), acc(i + 1));
                              });
        });
      }
    }
    drain_stores(thread);
  }
  if constexpr (kCluster == 2) {
    cute::cluster_arrive();
    cute::cluster_wait();
  }
}

}  // namespace mok::cuda::detail
