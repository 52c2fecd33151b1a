// The producers' side of the expert GEMMs: which global tiles of A and B go into each stage.
//
// ForwardMainloop: A = rows [rows, K] (K-major); B = two 128-row halves, each from its own
//   K-major tensor [El, N, K] (gate|up: W_gate and W_up at the same rows; down: W_down's two
//   consecutive 128-row blocks).
// BackwardMainloop<MajorA>: A from a 3-mode tensor (M, K, planes) that is K-major (activation rows)
//   or MN-major (activations read transposed, for weight gradients); B = one 256-row tile of an
//   MN-major tensor (N contiguous), chosen per k-block: the reduction may run over two planes
//   (dgrad of gate|up: [dg|du] against [W_gate; W_up]), k-blocks [0, kb_per_plane) from plane 0,
//   then plane 1.
// Both are templates on the operands' element type (the precision); the kernels use bf16. fp8
// (e4m3) fits ForwardMainloopOf (both operands K-major), not BackwardMainloopOf (its B is MN-major,
// which fp8 wgmma cannot read).
#pragma once

#include <cute/tensor.hpp>

#include "mok/cuda/detail/gemm_config.cuh"
#include "mok/cuda/detail/grouped_tile_scheduler.cuh"

namespace mok::cuda::detail {

using namespace cute;

// ForwardMainloopOf's TMA descriptors: A [rows, K] as (rows, K, 1), loaded as (kRowsA, BLOCK_K)
// tiles; B [El, N, K] as (N, K, El), loaded as (128, BLOCK_K) halves.
template <class Element, int kRowsA = GemmConfig::kBlockM>
using ForwardSmemLayoutA = OperandSmemLayout<Element, GMMA::Major::K, kRowsA>;
template <class Element>
using ForwardSmemLayoutBHalves = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                        Shape<Int<GemmConfig::kHalfN>, Int<OperandConfig<Element>::kBlockK>,
                                                              Int<2 * GemmConfig::kStages>>{}));
template <class Element, int kRowsA = GemmConfig::kBlockM>
auto forward_tma_a(const Element* ptr, int rows, int k) {
  Tensor t = make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(rows, k, 1), make_stride(int64_t(k), _1{}, int64_t(0))));
  return make_tma_atom(SM90_TMA_LOAD{}, t, ForwardSmemLayoutA<Element, kRowsA>{}(_, _, 0),
                       Shape<Int<kRowsA>, Int<OperandConfig<Element>::kBlockK>>{});
}
template <class Element>
auto forward_tma_b(const Element* ptr, int n, int k, int experts) {
  Tensor t = make_tensor(make_gmem_ptr(ptr),
                         make_layout(make_shape(n, k, experts), make_stride(int64_t(k), _1{}, int64_t(n) * k)));
  return make_tma_atom(SM90_TMA_LOAD{}, t, ForwardSmemLayoutBHalves<Element>{}(_, _, 0),
                       Shape<Int<GemmConfig::kHalfN>, Int<OperandConfig<Element>::kBlockK>>{});
}

// kRowsA: the rows of an A tile (128; 64 for the ping-pong kernel, whose warpgroups each own a
// 64-row tile).
template <class Element_, int kRowsA = GemmConfig::kBlockM>
struct ForwardMainloopOf {
  using Element = Element_;
  using Operand = OperandConfig<Element>;
  static constexpr int kBlockK = Operand::kBlockK;
  static constexpr int kRows = kRowsA;
  static constexpr int kStageElemsA = kRowsA * kBlockK;
  static constexpr uint32_t kStageBytes = (kStageElemsA + Operand::kStageElemsB) * sizeof(Element);
  static constexpr GMMA::Major kMajorA = GMMA::Major::K;
  static constexpr GMMA::Major kMajorB = GMMA::Major::K;
  using SmemLayoutA = ForwardSmemLayoutA<Element, kRowsA>;
  using SmemLayoutB = OperandSmemLayout<Element, GMMA::Major::K, GemmConfig::kBlockN>;
  // The same bytes as SmemLayoutB seen as 128-row halves: (kHalfN, BLOCK_K, 2*STAGES), half h of
  // stage s at index 2s+h (tile_to_shape stacks K-major swizzle atoms along rows first, so a
  // stage's rows 0-127 and 128-255 are two consecutive 16 KiB blocks).
  using SmemLayoutBHalves = ForwardSmemLayoutBHalves<Element>;
  using TileA = Shape<Int<kRowsA>, Int<kBlockK>>;
  using TileBHalf = Shape<Int<GemmConfig::kHalfN>, Int<kBlockK>>;

  static auto make_a(const Element* ptr, int rows, int k) { return forward_tma_a<Element, kRowsA>(ptr, rows, k); }
  static auto make_b(const Element* ptr, int n, int k, int experts) { return forward_tma_b(ptr, n, k, experts); }

  struct Params {
    decltype(forward_tma_a<Element, kRowsA>(nullptr, 1, 1)) tma_a;
    decltype(forward_tma_b<Element>(nullptr, 1, 1, 1)) tma_b0, tma_b1;
    int rows, k, b_rows, experts;
    int b1_row_shift;  // half 1 reads B1's 128-row block 2n+1 (and half 0 block 2n) when 1, else both block n
  };
  static __device__ void prefetch(const Params& p) {
    prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_b0.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_b1.get_tma_descriptor());
  }

  // Issues k-block kb of tile t into `stage`, completing on `bar`. One thread.
  template <class Barrier>
  static __device__ void load(const Params& p, Element* smem_a, Element* smem_b, const GroupedTile& t, int kb,
                              int stage, Barrier& bar) {
    Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.rows, p.k, 1));
    Tensor mB0 = p.tma_b0.get_tma_tensor(make_shape(p.b_rows, p.k, p.experts));
    Tensor mB1 = p.tma_b1.get_tma_tensor(make_shape(p.b_rows, p.k, p.experts));
    Tensor gA = local_tile(mA, TileA{}, make_coord(_, _, _));        // (BM, BK, m, k, 1)
    Tensor gB0 = local_tile(mB0, TileBHalf{}, make_coord(_, _, _));  // (128, BK, n, k, e)
    Tensor gB1 = local_tile(mB1, TileBHalf{}, make_coord(_, _, _));
    Tensor sA = make_tensor(make_smem_ptr(smem_a), SmemLayoutA{});        // (BM, BK, STAGES)
    Tensor sB = make_tensor(make_smem_ptr(smem_b), SmemLayoutBHalves{});  // (128, BK, 2*STAGES)
    auto [tAg, tAs] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
    auto [tB0g, tB0s] = tma_partition(p.tma_b0, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB0));
    auto [tB1g, tB1s] = tma_partition(p.tma_b1, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB1));
    const int b0_block = p.b1_row_shift ? 2 * t.n_block : t.n_block;
    const int b1_block = p.b1_row_shift ? 2 * t.n_block + 1 : t.n_block;
    copy(p.tma_a.with(bar), tAg(_, t.m_block, kb, 0), tAs(_, stage));
    copy(p.tma_b0.with(bar), tB0g(_, b0_block, kb, t.expert), tB0s(_, 2 * stage));
    copy(p.tma_b1.with(bar), tB1g(_, b1_block, kb, t.expert), tB1s(_, 2 * stage + 1));
  }
};
using ForwardMainloop = ForwardMainloopOf<bfloat16_t>;

// kRowsA: the rows of an A tile (128; 64 for the ping-pong kernel).
template <class Element_, GMMA::Major kMajorA_, int kRowsA = GemmConfig::kBlockM>
struct BackwardMainloopOf {
  static_assert(sizeof(Element_) == 2, "B is MN-major, which only 16-bit wgmma reads");
  using Element = Element_;
  using Operand = OperandConfig<Element>;
  static constexpr int kBlockK = Operand::kBlockK;
  static constexpr int kRows = kRowsA;
  static constexpr int kStageElemsA = kRowsA * kBlockK;
  static constexpr uint32_t kStageBytes = (kStageElemsA + Operand::kStageElemsB) * sizeof(Element);
  static constexpr GMMA::Major kMajorA = kMajorA_;
  static constexpr GMMA::Major kMajorB = GMMA::Major::MN;
  using SmemLayoutA = OperandSmemLayout<Element, kMajorA_, kRowsA>;
  using SmemLayoutB = OperandSmemLayout<Element, GMMA::Major::MN, GemmConfig::kBlockN>;
  using TileA = Shape<Int<kRowsA>, Int<kBlockK>>;
  using TileB = Shape<Int<GemmConfig::kBlockN>, Int<kBlockK>>;

  // A as (M, K, planes): K-major rows (stride (row_stride, 1, plane_stride)) or MN-major
  // (stride (1, row_stride, plane_stride)), where row_stride is the activation's row stride.
  static auto make_a(const Element* ptr, int m, int k, int planes, int64_t row_stride, int64_t plane_stride) {
    if constexpr (kMajorA_ == GMMA::Major::K) {
      Tensor t = make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(m, k, planes),
                                                             make_stride(row_stride, _1{}, plane_stride)));
      return make_tma_atom(SM90_TMA_LOAD{}, t, SmemLayoutA{}(_, _, 0), TileA{});
    } else {
      Tensor t = make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(m, k, planes),
                                                             make_stride(_1{}, row_stride, plane_stride)));
      return make_tma_atom(SM90_TMA_LOAD{}, t, SmemLayoutA{}(_, _, 0), TileA{});
    }
  }
  // B as (N, K, L), N contiguous: element (n, k, l) at n + k*row_stride + l*batch_stride.
  static auto make_b(const Element* ptr, int n, int k, int l, int64_t row_stride, int64_t batch_stride) {
    Tensor t = make_tensor(make_gmem_ptr(ptr),
                           make_layout(make_shape(n, k, l), make_stride(_1{}, row_stride, batch_stride)));
    return make_tma_atom(SM90_TMA_LOAD{}, t, SmemLayoutB{}(_, _, 0), TileB{});
  }

  struct Params {
    decltype(make_a(nullptr, 1, 1, 1, 1, 1)) tma_a;
    decltype(make_b(nullptr, 1, 1, 1, 1, 1)) tma_b0, tma_b1;
    int a_m, a_k, a_planes;
    int b_n, b_k, b_l;
    int kb_per_plane;  // k-blocks of plane 0 before plane 1 starts; a huge value = one plane
    int b_by_expert;   // B's L index is the tile's expert (1) or 0
  };

  static __device__ void prefetch(const Params& p) {
    prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_b0.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_b1.get_tma_descriptor());
  }

  // Which B tile k-block kb of tile t reads: equal keys, equal bytes (the producer keeps B in a
  // stage that already holds it, load_k_blocks_keeping_b).
  struct BKey {
    int n_block, kb, l;
    __device__ bool operator==(const BKey& o) const { return n_block == o.n_block && kb == o.kb && l == o.l; }
  };
  static constexpr bool kCanKeepB = true;
  static constexpr uint32_t kStageBytesA = kStageElemsA * sizeof(Element);
  static constexpr uint32_t kStageBytesB = kStageBytes - kStageBytesA;
  static __device__ BKey b_key(const Params& p, const GroupedTile& t, int kb) {
    return {t.n_block, kb, p.b_by_expert ? t.expert : 0};
  }

  // Issues k-block kb of tile t (its A and B; or one of them) into `stage`, completing on `bar`.
  // One thread.
  template <bool kLoadA = true, bool kLoadB = true, class Barrier>
  static __device__ void load(const Params& p, Element* smem_a, Element* smem_b, const GroupedTile& t, int kb,
                              int stage, Barrier& bar) {
    const int plane = kb < p.kb_per_plane ? 0 : 1;
    const int k_in_plane = plane == 0 ? kb : kb - p.kb_per_plane;
    if constexpr (kLoadA) {
      Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.a_m, p.a_k, p.a_planes));
      Tensor gA = local_tile(mA, TileA{}, make_coord(_, _, _));  // (BM, BK, m, k, plane)
      Tensor sA = make_tensor(make_smem_ptr(smem_a), SmemLayoutA{});
      auto [tAg, tAs] =
          tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
      copy(p.tma_a.with(bar), tAg(_, t.m_block, k_in_plane, plane), tAs(_, stage));
    }
    if constexpr (kLoadB) {
      Tensor sB = make_tensor(make_smem_ptr(smem_b), SmemLayoutB{});
      const int l = p.b_by_expert ? t.expert : 0;
      // The two descriptors differ only in their tensor.
      const auto& tma_b = plane == 0 ? p.tma_b0 : p.tma_b1;
      Tensor mB = tma_b.get_tma_tensor(make_shape(p.b_n, p.b_k, p.b_l));
      Tensor gB = local_tile(mB, TileB{}, make_coord(_, _, _));  // (BN, BK, n, k, l)
      auto [tBg, tBs] =
          tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
      copy(tma_b.with(bar), tBg(_, t.n_block, k_in_plane, l), tBs(_, stage));
    }
  }
};
template <GMMA::Major kMajorA>
using BackwardMainloop = BackwardMainloopOf<bfloat16_t, kMajorA>;

}  // namespace mok::cuda::detail
