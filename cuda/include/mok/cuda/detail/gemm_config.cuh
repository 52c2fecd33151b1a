// The tile shape and pipeline every expert GEMM shares: 128 x 256 output tiles (two consumer
// warpgroups of 64 rows), 64-deep k-blocks, 4 shared-memory stages, persistent CTAs of 384 threads.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace mok::cuda::detail {

using namespace cute;

struct GemmConfig {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;
  static constexpr int kHalfN = 128;
  static constexpr int kBlockK = 64;
  static constexpr int kStages = 4;
  static constexpr int kMaxExperts = 512;  // per launch (rank); what fits beside 4 stages and 2 staging tiles
  static constexpr int kThreads = 384;
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kStageBytes = (kBlockM + kBlockN) * kBlockK * sizeof(bfloat16_t);
  static constexpr int kStageElemsA = kBlockM * kBlockK;
  static constexpr int kStageElemsB = kBlockN * kBlockK;
};

// Shared-memory layouts of one operand's stages, (rows of the operand tile, BLOCK_K, STAGES),
// with the 128-byte swizzle; K-major (K contiguous) or MN-major (rows contiguous). MN-major atoms
// (64 rows x 8 k) are stacked along K first, so one TMA box covers 64 rows x BLOCK_K instead of
// 64 x 8 (CUTLASS orders its MN-major stages the same way).
template <GMMA::Major kMajor, int kRows>
struct OperandSmemLayoutOf {
  using Shape_ = Shape<Int<kRows>, Int<GemmConfig::kBlockK>, Int<GemmConfig::kStages>>;
  using type = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bfloat16_t>{}, Shape_{}));
};
template <int kRows>
struct OperandSmemLayoutOf<GMMA::Major::MN, kRows> {
  using Shape_ = Shape<Int<kRows>, Int<GemmConfig::kBlockK>, Int<GemmConfig::kStages>>;
  using type = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<bfloat16_t>{}, Shape_{}, Step<_2, _1, _3>{}));
};
template <GMMA::Major kMajor, int kRows>
using OperandSmemLayout = typename OperandSmemLayoutOf<kMajor, kRows>::type;

template <GMMA::Major kMajorA, GMMA::Major kMajorB>
using ExpertTiledMma = decltype(make_tiled_mma(SM90_64x256x16_F32BF16BF16_SS<kMajorA, kMajorB>{},
                                               Layout<Shape<_2, _1, _1>>{}));

}  // namespace mok::cuda::detail
