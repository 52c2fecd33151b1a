// Epilogues of the expert GEMMs: from the fp32 accumulator tile (128 x 256, two consumer
// warpgroups of 64 rows) to bf16 rows in global memory. Rows at or past the expert's segment end
// and columns past the output width are not stored.
//
// Accumulator fragment of SM90_64x256x16 per thread: value index i = v0 + 2*v1 + 4*v2 holds
// column 8*v2 + 2*(lane%4) + v0; columns c and c+128 are therefore values i and i+64 of the same
// thread, which is what lets the SwiGLU pair gate and up without data exchange.
#pragma once

#include <cuda_bf16.h>

#include <cute/tensor.hpp>

#include "mok/cuda/detail/grouped_tile_scheduler.cuh"
#include "mok/cuda/detail/swiglu.cuh"

namespace mok::cuda::detail {

// h[row, col] = act(g, u) over the tile's 128 gate columns and their 128 up columns; with gu set,
// also g and u (bf16, clamp side preserved) at gu[row, col] and gu[row, I + col].
struct SwiGluEpilogue {
  struct Params {
    __nv_bfloat16* h;
    __nv_bfloat16* gu;
    int intermediate;
    bool has_limit;
    float limit;
  };

  template <class Acc, class Coords>
  static __device__ void apply(const Params& p, const GroupedTile& t, Acc& acc, const Coords& coords, int) {
    static_assert(cute::size(Acc{}) == 128, "a 64x256 fragment per consumer thread");
    const int64_t row0 = int64_t(t.m_block) * 128;
    const int64_t I = p.intermediate;
    CUTE_UNROLL
    for (int i = 0; i < 64; i += 2) {
      const int64_t row = row0 + cute::get<0>(coords(i));
      const int64_t col = int64_t(t.n_block) * 128 + cute::get<1>(coords(i));
      if (row >= t.row_end || col >= I) continue;
      const float g0 = acc(i), g1 = acc(i + 1), u0 = acc(i + 64), u1 = acc(i + 65);
      __nv_bfloat162 h2;
      h2.x = __float2bfloat16_rn(swiglu(g0, u0, p.has_limit, p.limit));
      h2.y = __float2bfloat16_rn(swiglu(g1, u1, p.has_limit, p.limit));
      *reinterpret_cast<__nv_bfloat162*>(p.h + row * I + col) = h2;
      if (p.gu != nullptr) {
        __nv_bfloat162 g2, u2;
        if (p.has_limit) {
          g2.x = save_for_clamp(g0, -INFINITY, p.limit);
          g2.y = save_for_clamp(g1, -INFINITY, p.limit);
          u2.x = save_for_clamp(u0, -p.limit, p.limit);
          u2.y = save_for_clamp(u1, -p.limit, p.limit);
        } else {
          g2 = __floats2bfloat162_rn(g0, g1);
          u2 = __floats2bfloat162_rn(u0, u1);
        }
        *reinterpret_cast<__nv_bfloat162*>(p.gu + row * 2 * I + col) = g2;
        *reinterpret_cast<__nv_bfloat162*>(p.gu + row * 2 * I + I + col) = u2;
      }
    }
  }
};

// out[row, col] = bf16(acc) over the tile's 256 columns.
struct StoreEpilogue {
  struct Params {
    __nv_bfloat16* out;
    int width;  // columns of out (its row stride)
  };

  template <class Acc, class Coords>
  static __device__ void apply(const Params& p, const GroupedTile& t, Acc& acc, const Coords& coords, int) {
    const int64_t row0 = int64_t(t.m_block) * 128;
    CUTE_UNROLL
    for (int i = 0; i < cute::size(acc); i += 2) {
      const int64_t row = row0 + cute::get<0>(coords(i));
      const int64_t col = int64_t(t.n_block) * 256 + cute::get<1>(coords(i));
      if (row >= t.row_end || col >= p.width) continue;
      *reinterpret_cast<__nv_bfloat162*>(p.out + row * p.width + col) = __floats2bfloat162_rn(acc(i), acc(i + 1));
    }
  }
};

}  // namespace mok::cuda::detail
