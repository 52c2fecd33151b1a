// The tile shape and pipeline every expert GEMM shares: 128 x 256 output tiles (two consumer
// warpgroups of 64 rows), 4 shared-memory stages, persistent CTAs of 384 threads. What depends on
// the operands' element type (the precision) is in OperandConfig: a stage holds one 128-byte
// swizzle row of K per operand row (64 bf16 or 128 fp8 values), so the stages take the same bytes
// at every precision, and the wgmma atom.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace mok::cuda::detail {

using namespace cute;

struct GemmConfig {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;
  static constexpr int kHalfN = 128;
  static constexpr int kStages = 4;
  static constexpr int kMaxExperts = 512;  // per launch (rank); what fits beside 4 stages and 2 staging tiles
  static constexpr int kThreads = 384;
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
};

// The wgmma atom of a 64 x 256 warpgroup tile for an operand type and the operands' majors.
template <class Element, GMMA::Major kMajorA, GMMA::Major kMajorB>
struct MmaAtomOf;
template <GMMA::Major kMajorA, GMMA::Major kMajorB>
struct MmaAtomOf<bfloat16_t, kMajorA, kMajorB> {
  using type = SM90_64x256x16_F32BF16BF16_SS<kMajorA, kMajorB>;
};
template <GMMA::Major kMajorA, GMMA::Major kMajorB>
struct MmaAtomOf<float_e4m3_t, kMajorA, kMajorB> {
  static_assert(kMajorA == GMMA::Major::K && kMajorB == GMMA::Major::K, "fp8 wgmma reads both operands K-major");
  using type = SM90_64x256x32_F32E4M3E4M3_SS_TN<>;
};

// The precision-dependent part of a stage.
template <class Element_>
struct OperandConfig {
  using Element = Element_;
  static constexpr int kBlockK = 128 / int(sizeof(Element));  // k values of one 128-byte swizzle row
  static constexpr int kStageElemsA = GemmConfig::kBlockM * kBlockK;
  static constexpr int kStageElemsB = GemmConfig::kBlockN * kBlockK;
  static constexpr uint32_t kStageBytes = (kStageElemsA + kStageElemsB) * sizeof(Element);
};

// Shared-memory layouts of one operand's stages, (rows of the operand tile, BLOCK_K, STAGES),
// with the 128-byte swizzle; K-major (K contiguous) or MN-major (rows contiguous). MN-major atoms
// (64 rows x 8 k) are stacked along K first, so one TMA box covers 64 rows x BLOCK_K instead of
// 64 x 8 (CUTLASS orders its MN-major stages the same way).
template <class Element, GMMA::Major kMajor, int kRows>
struct OperandSmemLayoutOf {
  using Shape_ = Shape<Int<kRows>, Int<OperandConfig<Element>::kBlockK>, Int<GemmConfig::kStages>>;
  using type = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape_{}));
};
template <class Element, int kRows>
struct OperandSmemLayoutOf<Element, GMMA::Major::MN, kRows> {
  using Shape_ = Shape<Int<kRows>, Int<OperandConfig<Element>::kBlockK>, Int<GemmConfig::kStages>>;
  using type = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape_{}, Step<_2, _1, _3>{}));
};
template <class Element, GMMA::Major kMajor, int kRows>
using OperandSmemLayout = typename OperandSmemLayoutOf<Element, kMajor, kRows>::type;

// Two warpgroups on one 128 x 256 tile (cooperative), or one on a 64 x 256 tile (ping-pong).
template <class Element, GMMA::Major kMajorA, GMMA::Major kMajorB, int kWarpgroups = 2>
using ExpertTiledMma = decltype(make_tiled_mma(typename MmaAtomOf<Element, kMajorA, kMajorB>::type{},
                                               Layout<Shape<Int<kWarpgroups>, _1, _1>>{}));

}  // namespace mok::cuda::detail
