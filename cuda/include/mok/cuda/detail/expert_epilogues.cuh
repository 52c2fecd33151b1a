// Epilogues of the expert GEMMs: from the fp32 accumulator tile (128 x 256, two consumer
// warpgroups of 64 rows) to bf16 outputs in global memory, through swizzled 128 x 64 shared
// memory tiles (64 x 64 per warpgroup where each stores its own rows) and TMA bulk stores. The stores run asynchronously: the consumers go on to the next
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

#include "mok/cuda/detail/call_status.cuh"
#include "mok/cuda/detail/fp8_quantize.cuh"
#include "mok/cuda/detail/gemm_config.cuh"
#include "mok/cuda/detail/grouped_tile_scheduler.cuh"
#include "mok/cuda/detail/swiglu.cuh"

namespace mok::cuda::detail {

using namespace cute;

// The staging tile: 128 rows of 128 bytes (64 bf16 or 32 fp32 columns) with the 128-byte swizzle
// (conflict-free for the accumulator's 8-row x 16-byte write pattern). The ping-pong kernel's
// warpgroups each own a 64-row tile and stage 64 rows (the *Of<64> forms), as do the weight
// gradients' warpgroups taking turns (each its half of a 128-row tile).
template <int kRows>
using EpilogueTileShapeOf = Shape<Int<kRows>, _64>;
template <int kRows>
using SmemLayoutEpilogueOf = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bfloat16_t>{}, EpilogueTileShapeOf<kRows>{}));
using EpilogueTileShape = EpilogueTileShapeOf<128>;
using SmemLayoutEpilogue = SmemLayoutEpilogueOf<128>;
template <int kRows>
using SmemLayoutEpilogueF32Of = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{}, Shape<Int<kRows>, _32>{}));
inline constexpr int kEpilogueThreads = 256;
// Two staging tiles: chunk k is written into tile k % 2 while the bulk store of chunk k-1 drains.
// Every epilogue stores an even number of chunks per tile, so each tile starts at staging tile 0.
inline constexpr int kEpilogueBuffers = 2;
inline constexpr int kStagingElems = 128 * 64;
inline constexpr int kEpilogueBarrier = 1;  // named barrier id of the 256 consumer threads

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync %0, %1;" ::"r"(kEpilogueBarrier), "r"(kEpilogueThreads) : "memory");
}

// The barrier of the threads that write one staging tile: both consumer warpgroups for a 128-row
// tile; for a 64-row tile (ping-pong) the calling warpgroup alone (ids 2 and 3).
template <int kRows>
__device__ __forceinline__ void epilogue_sync() {
  if constexpr (kRows == 128) {
    consumers_sync();
  } else {
    static_assert(kRows == 64, "a staging tile is one or two warpgroups' rows");
    asm volatile("bar.sync %0, 128;" ::"r"(1 + int(threadIdx.x) / 128) : "memory");
  }
}

// A TMA store target: out[plane][rows, cols] with row stride `row_stride` elements, stored in
// kRows x 64 boxes.
template <int kRows = 128>
inline auto make_store_tma(bfloat16_t* ptr, int rows, int cols, int64_t row_stride, int planes, int64_t plane_stride) {
  Tensor t = make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(rows, cols, planes),
                                                         make_stride(row_stride, _1{}, plane_stride)));
  return make_tma_atom(SM90_TMA_STORE{}, t, SmemLayoutEpilogueOf<kRows>{}, EpilogueTileShapeOf<kRows>{});
}

template <int kRows_>
struct StoreTensorOf {
  static constexpr int kRows = kRows_;
  decltype(make_store_tma<kRows_>(nullptr, 1, 1, 1, 1, 1)) tma;
  int rows, cols, planes;
};
using StoreTensor = StoreTensorOf<128>;

// An fp32 target out[plane][rows, cols] (weight gradients: plane = expert), stored in kRows x 32
// boxes.
template <int kRows = 128>
inline auto make_store_tma_f32(float* ptr, int rows, int cols, int64_t row_stride, int planes,
                               int64_t plane_stride) {
  Tensor t = make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(rows, cols, planes),
                                                         make_stride(row_stride, _1{}, plane_stride)));
  return make_tma_atom(SM90_TMA_STORE{}, t, SmemLayoutEpilogueF32Of<kRows>{}, Shape<Int<kRows>, _32>{});
}

template <int kRows_>
struct StoreTensorF32Of {
  static constexpr int kRows = kRows_;
  decltype(make_store_tma_f32<kRows_>(nullptr, 1, 1, 1, 1, 1)) tma;
  int rows, cols, planes;
};
using StoreTensorF32 = StoreTensorF32Of<128>;

template <class Target>
struct StagingTraits;
template <int kRows_>
struct StagingTraits<StoreTensorOf<kRows_>> {
  using Element = bfloat16_t;
  using Pair = __nv_bfloat162;
  using Layout = SmemLayoutEpilogueOf<kRows_>;
  using TileShape = EpilogueTileShapeOf<kRows_>;
  static constexpr int kRows = kRows_;
  static constexpr int kCols = 64;
  static __device__ __forceinline__ Pair pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <int kRows_>
struct StagingTraits<StoreTensorF32Of<kRows_>> {
  using Element = float;
  using Pair = float2;
  using Layout = SmemLayoutEpilogueF32Of<kRows_>;
  using TileShape = Shape<Int<kRows_>, _32>;
  static constexpr int kRows = kRows_;
  static constexpr int kCols = 32;
  static __device__ __forceinline__ Pair pack(float a, float b) { return make_float2(a, b); }
};

// Calls f(Int<0>{}), ..., f(Int<N-1>{}): loops whose index must be a compile-time constant (an
// accumulator indexed at run time goes to local memory).
template <int N, class F>
__device__ __forceinline__ void static_for(F&& f) {
  cute::for_each(make_int_sequence<N>{}, f);
}

// One pair of a staging tile, stored through its 32-bit shared-window address: st.shared, where
// the dereferenced pointer compiled to a generic store (ST.E, an address-space lookup per store;
// 8% of the weight gradients' stall samples, session 11).
__device__ __forceinline__ void store_shared(void* at, __nv_bfloat162 v) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(at));
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(a), "r"(reinterpret_cast<const uint32_t&>(v)) : "memory");
}
__device__ __forceinline__ void store_shared(void* at, float2 v) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(at));
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(a), "f"(v.x), "f"(v.y) : "memory");
}
// And 16 bytes read through it (the forward's push read its staging rows with generic 64-bit
// loads, LD.E.128; their addresses' registers spilled 4 bytes there, session 16).
__device__ __forceinline__ uint4 load_shared_16(const void* at) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(at));
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
  return v;
}

// Writes chunk number `chunk` of a tile: value(Int<i>) for the thread's accumulator values
// i in [kI0, kI0 + kCols/2) (pairs i, i+1) goes to its (row, col - col0) in staging tile chunk % 2,
// then one thread stores that tile at (m_block, n_chunk, plane) of the target. A staging tile is
// rewritten only after its previous bulk store (two chunks back) has read it.
template <int kI0, class Target, class Coords, class Value>
__device__ __forceinline__ void store_chunk(bfloat16_t* staging, int chunk, const Target& target,
                                            const Coords& coords, int col0, int m_block, int n_chunk, int plane,
                                            int thread, Value value) {
  using Traits = StagingTraits<Target>;
  using Element = typename Traits::Element;
  using Pair = typename Traits::Pair;
  Element* buffer = reinterpret_cast<Element*>(staging + (chunk % kEpilogueBuffers) * (Traits::kRows * 64));
  Tensor sC = make_tensor(make_smem_ptr(buffer), typename Traits::Layout{});
  if (thread == 0) tma_store_wait<kEpilogueBuffers - 1>();
  epilogue_sync<Traits::kRows>();
  static_for<Traits::kCols / 4>([&](auto j) {
    constexpr int i = kI0 + 2 * decltype(j)::value;
    const int r = get<0>(coords(i)), c = get<1>(coords(i)) - col0;
    store_shared(&sC(r, c), Pair(value(Int<i>{})));
  });
  tma_store_fence();  // make the generic-proxy writes visible to the bulk copy
  epilogue_sync<Traits::kRows>();
  if (thread == 0) {
    Tensor mC = target.tma.get_tma_tensor(make_shape(target.rows, target.cols, target.planes));
    Tensor gC = local_tile(mC, typename Traits::TileShape{}, make_coord(_, _, _));  // (kRows, cols, m, n, plane)
    auto [tCg, tCs] = tma_partition(target.tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sC), group_modes<0, 2>(gC));
    copy(target.tma, tCs, tCg(_, m_block, n_chunk, plane));
    tma_store_arrive();
  }
}

// store_chunk of saved g or u values (value i and i + 1 of the accumulator a pair), as the
// backward reads them: bf16, and with a limit each kept on its own side of the clamp band
// [lo, limit] (save_for_clamp). One uniform branch per chunk, not per value: without a limit a
// chunk is 16 conversions.
template <int kI0, class Target, class Coords, class Acc>
__device__ __forceinline__ void store_saved_chunk(bfloat16_t* staging, int chunk, const Target& target,
                                                  const Coords& coords, int col0, int m_block, int n_chunk,
                                                  int thread, const Acc& acc, bool has_limit, float lo, float limit) {
  if (has_limit) {
    store_chunk<kI0>(staging, chunk, target, coords, col0, m_block, n_chunk, 0, thread, [&](auto i_) {
      constexpr int i = decltype(i_)::value;
      __nv_bfloat162 v;
      v.x = save_for_clamp(acc(i), lo, limit);
      v.y = save_for_clamp(acc(i + 1), lo, limit);
      return v;
    });
  } else {
    store_chunk<kI0>(staging, chunk, target, coords, col0, m_block, n_chunk, 0, thread, [&](auto i_) {
      constexpr int i = decltype(i_)::value;
      return __floats2bfloat162_rn(acc(i), acc(i + 1));
    });
  }
}

// Called once by every consumer thread after its last tile: the bulk stores have completed.
__device__ __forceinline__ void drain_stores(int thread) {
  if (thread == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// h[row, col] = act(g, u) over the tile's 128 gate columns and their 128 up columns; with save_gu,
// also g and u (bf16, clamp side preserved) into gu[rows, 2I]: g at columns [0, I) (target g),
// u at [I, 2I) (target u, the same buffer offset by I). kRows: the tile's rows (128: both
// consumer warpgroups; 64: one, ping-pong).
template <int kRows>
struct SwiGluEpilogueOf {
  struct Params {
    StoreTensorOf<kRows> h, g, u;
    bool save_gu;
    bool has_limit;
    float limit;
  };

  template <class Acc, class Coords>
  static __device__ void apply(const Params& p, const GroupedTile& t, Acc& acc, const Coords& coords, int thread,
                               bfloat16_t* staging) {
    static_assert(cute::size(Acc{}) == 128, "a 64x256 fragment per consumer thread");
    // g|u first (chunks 0-3), then h (the last two): the h chunks' math needs the most registers,
    // and by then the accumulator values behind each finished chunk are dead.
    if (p.save_gu) {
      static_for<2>([&](auto plane_) {
        constexpr int plane = decltype(plane_)::value;
        const float lo = plane == 0 ? -INFINITY : -p.limit;
        static_for<2>([&](auto c_) {
          constexpr int c = decltype(c_)::value;
          store_saved_chunk<32 * c + 64 * plane>(staging, 2 * plane + c, plane == 0 ? p.g : p.u, coords,
                                                 64 * c + 128 * plane, t.save_m_block, 2 * t.n_block + c, thread, acc,
                                                 p.has_limit, lo, p.limit);
        });
      });
    }
    // Chunk c of h (chunk 4 + c of the tile after a save: the same staging tile, c % 2).
    static_for<2>([&](auto c_) {
      constexpr int c = decltype(c_)::value;
      store_chunk<32 * c>(staging, c, p.h, coords, 64 * c, t.m_block, 2 * t.n_block + c, 0, thread, [&](auto i_) {
        constexpr int i = decltype(i_)::value;
        return __floats2bfloat162_rn(swiglu(acc(i), acc(i + 64), p.has_limit, p.limit),
                                     swiglu(acc(i + 1), acc(i + 65), p.has_limit, p.limit));
      });
    });
  }
};

// out[row, col] = bf16(acc) over the tile's 256 columns.
template <int kRows>
struct StoreEpilogueOf {
  struct Params {
    StoreTensorOf<kRows> out;
  };

  template <class Acc, class Coords>
  static __device__ void apply(const Params& p, const GroupedTile& t, Acc& acc, const Coords& coords, int thread,
                               bfloat16_t* staging) {
    static_for<4>([&](auto c_) {
      constexpr int c = decltype(c_)::value;
      store_chunk<32 * c>(staging, c, p.out, coords, 64 * c, t.m_block, 4 * t.n_block + c, 0, thread, [&](auto i_) {
        constexpr int i = decltype(i_)::value;
        return __floats2bfloat162_rn(acc(i), acc(i + 1));
      });
    });
  }
};

// ---- Rows pushed into their (token, j) slots (the megakernels' combine and dx, the stage dx: the
// bf16 GEMM's and the fp8 store form's) ----
// A tile's rows go to the slots its Target names (Target: dest(rank), src_rank(), src_slot(),
// ranks(), slots(), width(), skips_push()): row r of the grouped rows to dest(src_rank[r]) +
// src_slot[r] * width, a peer's slots by their mapped address; padding rows (-1) are not written.
// Two halves of 128 columns, each through both staging tiles (64 columns each): the accumulator
// values of a half are dead once written, which keeps the read-back within the register budget.
// Each thread of the two consumer warpgroups then stores 16-byte pieces of 4 rows
// (thread / 8 + 32 i) at columns 8 * (thread % 8) of both tiles.
// kHalves: the tile's 128-column halves (2: the bf16 down tile's 256 columns; 1: the fp8 one's 128).
template <int kHalves = 2, class Target, class Acc, class Coords>
__device__ void push_rows(const Target& p, int row_block, int n_block, Acc& acc, const Coords& coords, int thread,
                          bfloat16_t* staging) {
  const int piece = thread % 8;
  // Where the thread's 4 rows go, loaded once per tile and before the first staging writes (ncu:
  // the stores waited on these loads, issued per half right before them), one register a row:
  // rank << 24 | slot (ranks <= 128, slots = T*k < 2^24: the launcher's checks), -1 for padding.
  int where[4];
  CUTE_UNROLL
  for (int i = 0; i < 4; ++i) {
    const int row = row_block * GemmConfig::kBlockM + thread / 8 + 32 * i;
    const int rank = p.src_rank()[row], slot = p.src_slot()[row];
    where[i] = rank < 0 || rank >= p.ranks() || slot < 0 || slot >= p.slots() ? -1 : rank << 24 | slot;
  }
  if (thread == 0) tma_store_wait<0>();  // no bulk store still reads the staging tiles
  static_for<kHalves>([&](auto half_) {
    constexpr int half = decltype(half_)::value;
    consumers_sync();  // (half 0: the staging tiles are free; half 1: nobody reads them any more)
    static_for<2>([&](auto b_) {
      constexpr int c = 2 * half + decltype(b_)::value;  // 64-column chunk of the tile
      Tensor sC = make_tensor(make_smem_ptr(staging + decltype(b_)::value * kStagingElems), SmemLayoutEpilogue{});
      static_for<16>([&](auto j) {  // the thread's 32 values of columns [64c, 64c + 64)
        constexpr int i = 32 * c + 2 * decltype(j)::value;
        const int r = get<0>(coords(i)), col = get<1>(coords(i)) - 64 * c;
        store_shared(&sC(r, col), __floats2bfloat162_rn(acc(i), acc(i + 1)));
      });
    });
    consumers_sync();
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int r = thread / 8 + 32 * i;
      if (where[i] < 0) continue;  // padding row
      __nv_bfloat16* dst = p.dest(where[i] >> 24) + int64_t(where[i] & 0xffffff) * p.width();
      CUTE_UNROLL
      for (int b = 0; b < 2; ++b) {
        const int col = n_block * (128 * kHalves) + 64 * (2 * half + b) + 8 * piece;
        Tensor sC = make_tensor(make_smem_ptr(staging + b * kStagingElems), SmemLayoutEpilogue{});
        if (col < p.width() && !p.skips_push())
          *reinterpret_cast<uint4*>(dst + col) = load_shared_16(&sC(r, 8 * piece));
      }
    }
  });
}

// The stage backward's dx GEMM with the scatter fused (ExpertsBackwardArgs::dx_push; the fp8 dx
// GEMM takes its Params and Target too, fp8_scaled_gemm_kernel.cuh): every dx row
// goes straight into its (token, j) slot on its source rank, as scatter_rows would copy it, and no
// dx row is written. A call given up (given_up_words, call_status.cuh) pushes nothing: a peer's
// buffer may then be laid out otherwise.
inline constexpr int kMaxPushRanks = 128;  // routing.h: kMaxRanks (checked where it is filled)
struct PushRowsEpilogue {
  struct Params {
    __nv_bfloat16* dest[kMaxPushRanks];  // each rank's [slots, width] bf16 slots
    const int32_t* src_rank;             // [rows]: -1 for padding rows
    const int32_t* src_slot;
    const int32_t* given_up_words;       // optional
    int32_t ranks, slots, width;
  };
  struct Target {
    const Params& p;
    bool given_up;
    __device__ __nv_bfloat16* dest(int rank) const { return p.dest[rank]; }
    __device__ const int32_t* src_rank() const { return p.src_rank; }
    __device__ const int32_t* src_slot() const { return p.src_slot; }
    __device__ int ranks() const { return p.ranks; }
    __device__ int slots() const { return p.slots; }
    __device__ int width() const { return p.width; }
    __device__ bool skips_push() const { return given_up; }
  };

  template <class Acc, class Coords>
  static __device__ void apply(const Params& p, const GroupedTile& t, Acc& acc, const Coords& coords, int thread,
                               bfloat16_t* staging) {
    // A given-up call only skips the stores: every thread still meets push_rows' barriers,
    // whatever it read.
    const bool given_up = p.given_up_words != nullptr && call_given_up(p.given_up_words);
    push_rows(Target{p, given_up}, t.m_block, t.n_block, acc, coords, thread, staging);
  }
};

using SwiGluEpilogue = SwiGluEpilogueOf<128>;
using StoreEpilogue = StoreEpilogueOf<128>;

// Weight gradient tiles: out[expert][row, col] = acc over the tile's 256 columns, in the target's
// element type (fp32, or bf16 rounded once), in chunks of the staging tile's columns.
// With 64-row targets each consumer warpgroup stores its own half of the 128-row tile (t.m_block
// then counts 64-row blocks), so the grouped GEMM can run one warpgroup's epilogue under the
// other's mainloop (kPerWarpgroup; grouped_gemm_kernel.cuh, "turns").
template <class Target>
struct StorePlanesEpilogue {
  static constexpr bool kPerWarpgroup = Target::kRows == 64;
  struct Params {
    Target out;
  };

  template <class Acc, class Coords>
  static __device__ void apply(const Params& p, const GroupedTile& t, Acc& acc, const Coords& coords, int thread,
                               bfloat16_t* staging) {
    using Traits = StagingTraits<Target>;
    constexpr int kChunks = GemmConfig::kBlockN / Traits::kCols;
    // A 64-row half wholly past the output's rows (its 128-row tile's other half is not) stores
    // nothing: the box would lie outside the tensor.
    if (t.m_block * Target::kRows >= p.out.rows) return;
    static_for<kChunks>([&](auto c_) {
      constexpr int c = decltype(c_)::value;
      store_chunk<Traits::kCols / 2 * c>(staging, c, p.out, coords, Traits::kCols * c, t.m_block,
                                         kChunks * t.n_block + c, t.expert, thread, [&](auto i_) {
                                           constexpr int i = decltype(i_)::value;
                                           return Traits::pack(acc(i), acc(i + 1));
                                         });
    });
  }
};
using StoreF32Epilogue = StorePlanesEpilogue<StoreTensorF32>;
using StoreBf16PlanesEpilogue = StorePlanesEpilogue<StoreTensor>;
using StoreF32TurnsEpilogue = StorePlanesEpilogue<StoreTensorF32Of<64>>;
using StoreBf16PlanesTurnsEpilogue = StorePlanesEpilogue<StoreTensorOf<64>>;

// Backward of the down projection's input side, fused with the SwiGLU backward. The accumulator
// is dh = dy * W_down (unscaled) for 256 columns of I. With the saved g, u (bf16), h and the row's
// router weight w (the same formulas and rounding points as reference.h):
//   dg = (w*dh) * u * silu'(g),  du = (w*dh) * silu(g)   (clamped inputs pass no gradient)
//   hw = w * h                   (the wgrad operand of W_down)
//   dw_partial[row, n_block] = sum over the tile's columns of dh * h   (d topk_w, per column block)
// The accumulator goes through shared memory 32 fp32 columns at a time and is read back one row
// segment per thread (row = thread/2, 16 columns), so g, u, h are read and dg, du, hw written with
// 16-byte vectors; doing the math in the accumulator's own layout needs more registers than a
// consumer thread has.
struct SwiGluBackwardParams {
  __nv_bfloat16* dgu;       // [rows, 2I] out: dg | du
  __nv_bfloat16* hw;        // [rows, I] out
  const __nv_bfloat16* gu;  // [rows, 2I]
  const __nv_bfloat16* h;   // [rows, I]
  const float* row_weight;  // [rows]
  float* dw_partial;        // [rows, n_blocks]
  int n_blocks;
  int intermediate;
  bool has_limit;
  float limit;
  // With 128-column tiles (the fp8 dh): dg|du also quantized here, a tile's 128 columns of dg and
  // of du each one 1 x 128 block of a row, the same codes and scales as quantize_rows_e4m3_k_major
  // of the bf16 dg|du (fp8_quantize.cuh): codes [rows, 2I], scales [2I / 128, scale_rows]. Null:
  // not quantized.
  uint8_t* dgu_codes = nullptr;
  float* dgu_scales = nullptr;
  int64_t scale_rows = 0;
};

// kRows: the tile's rows (128: both consumer warpgroups, 256 threads; 64: one warpgroup,
// ping-pong). Either way a thread takes half a row (row = thread / 2). kCols: the tile's columns
// (256: the bf16 GEMMs' 64 x 256 fragment per warpgroup; 128: the fp8 GEMM's 64 x 128), each
// column tile one d topk_w partial; the fragments' values [16c, 16c + 16) are columns [32c, 32c +
// 32) either way.
template <int kRows, int kCols = GemmConfig::kBlockN>
struct SwiGluBackwardEpilogueOf {
  using Params = SwiGluBackwardParams;

  // One 8-column vector of a row: dg, du, hw from dh, and the dh*h partial sum in column order.
  static __device__ __forceinline__ void vector8(const Params& p, int64_t row, int64_t col, float w,
                                                 const float* dh, float& partial, uint4& dg_out, uint4& du_out) {
    const int64_t I = p.intermediate;
    const uint4 g8 = *reinterpret_cast<const uint4*>(p.gu + row * 2 * I + col);
    const uint4 u8 = *reinterpret_cast<const uint4*>(p.gu + row * 2 * I + I + col);
    const uint4 h8 = *reinterpret_cast<const uint4*>(p.h + row * I + col);
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&g8);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&u8);
    const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&h8);
    uint4 dg8, du8, hw8;
    __nv_bfloat162* dg2 = reinterpret_cast<__nv_bfloat162*>(&dg8);
    __nv_bfloat162* du2 = reinterpret_cast<__nv_bfloat162*>(&du8);
    __nv_bfloat162* hw2 = reinterpret_cast<__nv_bfloat162*>(&hw8);
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) {
      float out_g[2], out_u[2], out_hw[2];
      const float gs[2] = {__low2float(g2[q]), __high2float(g2[q])};
      const float us[2] = {__low2float(u2[q]), __high2float(u2[q])};
      const float hs[2] = {__low2float(h2[q]), __high2float(h2[q])};
      CUTE_UNROLL
      for (int v = 0; v < 2; ++v) {
        const float d = dh[2 * q + v];
        partial = __fadd_rn(partial, __fmul_rn(d, hs[v]));
        float gc = gs[v], uc = us[v];
        bool g_passes = true, u_passes = true;
        if (p.has_limit) {
          if (gc > p.limit) {
            gc = p.limit;
            g_passes = false;
          }
          if (uc > p.limit) {
            uc = p.limit;
            u_passes = false;
          } else if (uc < -p.limit) {
            uc = -p.limit;
            u_passes = false;
          }
        }
        const float sig = sigmoid_fast(gc);
        const float silu = __fmul_rn(gc, sig);
        const float dsilu = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(gc, __fsub_rn(1.0f, sig))));
        const float s = __fmul_rn(w, d);
        out_g[v] = g_passes ? __fmul_rn(__fmul_rn(s, uc), dsilu) : 0.0f;
        out_u[v] = u_passes ? __fmul_rn(s, silu) : 0.0f;
        out_hw[v] = __fmul_rn(w, hs[v]);
      }
      dg2[q] = __floats2bfloat162_rn(out_g[0], out_g[1]);
      du2[q] = __floats2bfloat162_rn(out_u[0], out_u[1]);
      hw2[q] = __floats2bfloat162_rn(out_hw[0], out_hw[1]);
    }
    *reinterpret_cast<uint4*>(p.dgu + row * 2 * I + col) = dg8;
    *reinterpret_cast<uint4*>(p.dgu + row * 2 * I + I + col) = du8;
    *reinterpret_cast<uint4*>(p.hw + row * I + col) = hw8;
    dg_out = dg8;
    du_out = du8;
  }

  // One round's read-back: the thread's 16 columns of both staging tiles (32 fp32 columns each),
  // starting at column col0 of the first; returns the running d topk_w partial. Unrolled, so the
  // four vectors' loads of g, u and h are in flight together: an out-of-line copy with its loops
  // rolled made the kernel 4x smaller but the backward 1-6% slower (tools/ab_timing.sh on an
  // H200, session 4); this kernel's code size did not cost instruction fetches.
  // dg and du: the round's four 8-column vectors of each (b, v order), for the quantization.
  static __device__ __forceinline__ float read_back_round(const Params& p, const bfloat16_t* staging, int64_t row,
                                                         int64_t col0, int seg_row, int seg_col, float w,
                                                         float partial, uint4 (&dg)[4], uint4 (&du)[4]) {
    CUTE_UNROLL
    for (int b = 0; b < 2; ++b) {
      Tensor sC = make_tensor(make_smem_ptr(reinterpret_cast<const float*>(staging + b * kRows * 64)),
                              SmemLayoutEpilogueF32Of<kRows>{});
      CUTE_UNROLL
      for (int v = 0; v < 2; ++v) {
        const int64_t col = col0 + 32 * b + 8 * v;
        // Two 16-byte loads through the shared window: the 128-byte swizzle moves 16-byte groups
        // only, so columns 4j..4j+3 of a row are contiguous (elementwise, these were 8 generic
        // 4-byte loads, LD.E: 128 per thread per tile, session 16).
        float dh[8];
        CUTE_UNROLL
        for (int q = 0; q < 2; ++q) {
          const uint4 four = load_shared_16(&sC(seg_row, seg_col + 8 * v + 4 * q));
          dh[4 * q] = __uint_as_float(four.x);
          dh[4 * q + 1] = __uint_as_float(four.y);
          dh[4 * q + 2] = __uint_as_float(four.z);
          dh[4 * q + 3] = __uint_as_float(four.w);
        }
        dg[2 * b + v] = du[2 * b + v] = make_uint4(0, 0, 0, 0);
        if (col < p.intermediate) vector8(p, row, col, w, dh, partial, dg[2 * b + v], du[2 * b + v]);  // I % 8 == 0
      }
    }
    return partial;
  }

  template <class Acc, class Coords>
  static __device__ void apply(const Params& p, const GroupedTile& t, Acc& acc, const Coords& coords, int thread,
                               bfloat16_t* staging) {
    static_assert(cute::size(Acc{}) == kCols / 2, "a 64 x kCols fragment per consumer thread");
    const int seg_row = thread / 2;          // this thread's row of the tile
    const int seg_col = (thread % 2) * 16;   // and its 16 columns of each 32-column chunk
    const int64_t row = int64_t(t.m_block) * kRows + seg_row;
    const float w = p.row_weight[row];
    float partial = 0.0f;
    uint4 dg[kCols / 64][4], du[kCols / 64][4];  // the thread's dg and du, kept for the quantization
    // Two 32-column chunks per round, one per staging tile: the accumulator values of a round are
    // dead once written, which keeps the thread under its register budget.
    static_for<kCols / 64>([&](auto round_) {
      constexpr int round = decltype(round_)::value;
      epilogue_sync<kRows>();  // every thread is done reading the staging tiles of the previous round
      static_for<2>([&](auto b_) {
        constexpr int c = 2 * round + decltype(b_)::value;
        Tensor sC = make_tensor(make_smem_ptr(reinterpret_cast<float*>(staging + decltype(b_)::value * kRows * 64)),
                                SmemLayoutEpilogueF32Of<kRows>{});  // (kRows, 32) fp32
        static_for<8>([&](auto j) {
          constexpr int i = 16 * c + 2 * decltype(j)::value;
          const int r = get<0>(coords(i)), col = get<1>(coords(i)) - 32 * c;
          // A 32-bit shared-window address (one register, where a generic pointer takes two: the
          // compiler keeps these addresses across the rounds).
          const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(&sC(r, col)));
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(at), "f"(acc(i)), "f"(acc(i + 1)) : "memory");
        });
      });
      epilogue_sync<kRows>();
      partial = read_back_round(p, staging, row, int64_t(t.n_block) * kCols + 64 * round + seg_col, seg_row, seg_col,
                                w, partial, dg[round], du[round]);
    });
    // The row's two threads (adjacent lanes) hold its two column halves: add them in a fixed order.
    const float other = __shfl_xor_sync(0xffffffffu, partial, 1);
    if (thread % 2 == 0) p.dw_partial[row * p.n_blocks + t.n_block] = __fadd_rn(partial, other);
    if constexpr (kCols == 128) {
      if (p.dgu_codes != nullptr) {  // (uniform: every thread of the launch takes the same branch)
        quantize_half_row(p, row, t.n_block, seg_col, dg, 0);
        quantize_half_row(p, row, t.n_block, seg_col, du, p.intermediate);
      }
    }
  }

  // The 128-column tiles' quantization of dg (plane 0) or du (plane_offset I): the thread holds 64
  // of the row's 128 bf16 values (round r, staging tile b, vector v at tile column 64r + 32b +
  // seg_col + 8v), its partner lane the other 64. The block's amax over both, its scale, and 16
  // codes per (r, b) into codes row `row` at plane_offset + 128 n_block + 64r + 32b + seg_col.
  static __device__ __forceinline__ void quantize_half_row(const Params& p, int64_t row, int n_block, int seg_col,
                                                           const uint4 (&x)[kCols / 64][4], int64_t plane_offset) {
    float amax = 0.0f;
    CUTE_UNROLL
    for (int r = 0; r < kCols / 64; ++r)
      CUTE_UNROLL
      for (int q = 0; q < 4; ++q) amax = bf16x8_amax(x[r][q], amax);
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    const int e = fp8_scale_exponent(amax);
    const int64_t block = (plane_offset + int64_t(n_block) * kCols) / 128;
    if (seg_col == 0) p.dgu_scales[block * p.scale_rows + row] = ldexpf(1.0f, e);
    const float inv = ldexpf(1.0f, -e);
    uint8_t* codes = p.dgu_codes + row * 2 * int64_t(p.intermediate) + plane_offset + int64_t(n_block) * kCols + seg_col;
    CUTE_UNROLL
    for (int r = 0; r < kCols / 64; ++r)
      CUTE_UNROLL
      for (int b = 0; b < 2; ++b) {
        const uint2 lo = bf16x8_codes(x[r][2 * b], inv), hi = bf16x8_codes(x[r][2 * b + 1], inv);
        *reinterpret_cast<uint4*>(codes + 64 * r + 32 * b) = make_uint4(lo.x, lo.y, hi.x, hi.y);
      }
  }
};
using SwiGluBackwardEpilogue = SwiGluBackwardEpilogueOf<128>;

}  // namespace mok::cuda::detail
