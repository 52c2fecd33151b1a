// Epilogues of the expert GEMMs: from the fp32 accumulator tile (128 x 256, two consumer
// warpgroups of 64 rows) to bf16 outputs in global memory, through one swizzled 128 x 64 shared
// memory tile and TMA bulk stores. The stores run asynchronously: the consumers go on to the next
// tile's mainloop while the last chunk drains. Rows past an expert's real rows are the segment's
// zero padding rows (segments are 128-row aligned, so a tile never crosses an expert), whose
// outputs are exactly zero; columns past the output width are clipped by the TMA unit.
//
// Accumulator fragment of SM90_64x256x16 per thread: value index i = v0 + 2*v1 + 4*v2 holds
// column 8*v2 + 2*(lane%4) + v0 (row: warp's 16-row slice + lane/4 + 8*v1). Hence columns
// [64c, 64c+64) are values [32c, 32c+32), and columns c and c+128 are values i and i+64 of the same
// thread: the SwiGLU pairs gate and up without data exchange.
#pragma once

#include <cuda_bf16.h>

#include <cute/tensor.hpp>

#include "mok/cuda/detail/grouped_tile_scheduler.cuh"
#include "mok/cuda/detail/swiglu.cuh"

namespace mok::cuda::detail {

using namespace cute;

// The staging tile: 128 rows x 64 bf16 columns, rows of 128 bytes with the 128-byte swizzle
// (conflict-free for the accumulator's 8-row x 16-byte write pattern).
using EpilogueTileShape = Shape<_128, _64>;
using SmemLayoutEpilogue = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bfloat16_t>{}, EpilogueTileShape{}));
inline constexpr int kEpilogueThreads = 256;
// Two staging tiles: chunk k is written into tile k % 2 while the bulk store of chunk k-1 drains.
// Every epilogue stores an even number of chunks per tile, so each tile starts at staging tile 0.
inline constexpr int kEpilogueBuffers = 2;
inline constexpr int kStagingElems = 128 * 64;
inline constexpr int kEpilogueBarrier = 1;  // named barrier id of the 256 consumer threads

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync %0, %1;" ::"r"(kEpilogueBarrier), "r"(kEpilogueThreads) : "memory");
}

// A TMA store target: out[plane][rows, cols] with row stride `row_stride` elements.
inline auto make_store_tma(bfloat16_t* ptr, int rows, int cols, int64_t row_stride, int planes, int64_t plane_stride) {
  Tensor t = make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(rows, cols, planes),
                                                         make_stride(row_stride, _1{}, plane_stride)));
  return make_tma_atom(SM90_TMA_STORE{}, t, SmemLayoutEpilogue{}, EpilogueTileShape{});
}

struct StoreTensor {
  decltype(make_store_tma(nullptr, 1, 1, 1, 1, 1)) tma;
  int rows, cols, planes;
};

// Writes chunk number `chunk` of a tile: value(i) for the thread's accumulator values [i0, i0+32)
// goes to its (row, col - col0) in staging tile chunk % 2, then one thread stores that tile at
// (m_block, n_chunk, plane). A staging tile is rewritten only after its previous bulk store (two
// chunks back) has read it.
template <class Coords, class Value>
__device__ __forceinline__ void store_chunk(bfloat16_t* staging, int chunk, const StoreTensor& target,
                                            const Coords& coords, int i0, int col0, int m_block, int n_chunk,
                                            int plane, int thread, Value value) {
  Tensor sC = make_tensor(make_smem_ptr(staging + (chunk % kEpilogueBuffers) * kStagingElems), SmemLayoutEpilogue{});
  if (thread == 0) tma_store_wait<kEpilogueBuffers - 1>();
  consumers_sync();
  CUTE_UNROLL
  for (int i = i0; i < i0 + 32; i += 2) {
    const int r = get<0>(coords(i)), c = get<1>(coords(i)) - col0;
    *reinterpret_cast<__nv_bfloat162*>(&sC(r, c)) = value(i);
  }
  tma_store_fence();  // make the generic-proxy writes visible to the bulk copy
  consumers_sync();
  if (thread == 0) {
    Tensor mC = target.tma.get_tma_tensor(make_shape(target.rows, target.cols, target.planes));
    Tensor gC = local_tile(mC, EpilogueTileShape{}, make_coord(_, _, _));  // (128, 64, m, n, plane)
    auto [tCg, tCs] = tma_partition(target.tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sC), group_modes<0, 2>(gC));
    copy(target.tma, tCs, tCg(_, m_block, n_chunk, plane));
    tma_store_arrive();
  }
}

// Called once by every consumer thread after its last tile: the bulk stores have completed.
__device__ __forceinline__ void drain_stores(int thread) {
  if (thread == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// h[row, col] = act(g, u) over the tile's 128 gate columns and their 128 up columns; with save_gu,
// also g and u (bf16, clamp side preserved) into gu[rows, 2I]: g at columns [0, I) (target g),
// u at [I, 2I) (target u, the same buffer offset by I).
struct SwiGluEpilogue {
  struct Params {
    StoreTensor h, g, u;
    bool save_gu;
    bool has_limit;
    float limit;
  };

  template <class Acc, class Coords>
  static __device__ void apply(const Params& p, const GroupedTile& t, Acc& acc, const Coords& coords, int thread,
                               bfloat16_t* staging) {
    static_assert(cute::size(Acc{}) == 128, "a 64x256 fragment per consumer thread");
    CUTE_UNROLL
    for (int c = 0; c < 2; ++c) {
      store_chunk(staging, c, p.h, coords, 32 * c, 64 * c, t.m_block, 2 * t.n_block + c, 0, thread, [&](int i) {
        return __floats2bfloat162_rn(swiglu(acc(i), acc(i + 64), p.has_limit, p.limit),
                                     swiglu(acc(i + 1), acc(i + 65), p.has_limit, p.limit));
      });
    }
    if (!p.save_gu) return;
    CUTE_UNROLL
    for (int plane = 0; plane < 2; ++plane) {
      CUTE_UNROLL
      for (int c = 0; c < 2; ++c) {
        const int i0 = 32 * c + 64 * plane;
        store_chunk(staging, 2 + 2 * plane + c, plane == 0 ? p.g : p.u, coords, i0, 64 * c + 128 * plane, t.m_block,
                    2 * t.n_block + c, 0, thread,
                    [&](int i) {
                      __nv_bfloat162 v;
                      if (p.has_limit) {
                        const float lo = plane == 0 ? -INFINITY : -p.limit;
                        v.x = save_for_clamp(acc(i), lo, p.limit);
                        v.y = save_for_clamp(acc(i + 1), lo, p.limit);
                      } else {
                        v = __floats2bfloat162_rn(acc(i), acc(i + 1));
                      }
                      return v;
                    });
      }
    }
  }
};

// out[row, col] = bf16(acc) over the tile's 256 columns.
struct StoreEpilogue {
  struct Params {
    StoreTensor out;
  };

  template <class Acc, class Coords>
  static __device__ void apply(const Params& p, const GroupedTile& t, Acc& acc, const Coords& coords, int thread,
                               bfloat16_t* staging) {
    CUTE_UNROLL
    for (int c = 0; c < 4; ++c) {
      store_chunk(staging, c, p.out, coords, 32 * c, 64 * c, t.m_block, 4 * t.n_block + c, 0, thread,
                  [&](int i) { return __floats2bfloat162_rn(acc(i), acc(i + 1)); });
    }
  }
};

}  // namespace mok::cuda::detail
