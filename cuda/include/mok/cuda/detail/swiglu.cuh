// SwiGLU on the device, with the same formulas and rounding points as the CPU reference
// (include/mok/core/reference.h).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mok::cuda::detail {

__device__ __forceinline__ float sigmoid(float v) { return __frcp_rn(__fadd_rn(1.0f, __expf(-v))); }
// The same with an approximate division: no IEEE slow-path subroutine, which spills in the SwiGLU
// backward epilogue's register budget. Deterministic too; within 2 ulp of sigmoid().
__device__ __forceinline__ float sigmoid_fast(float v) { return __fdividef(1.0f, __fadd_rn(1.0f, __expf(-v))); }

// act(g, u) = silu(min(g, L)) * clamp(u, -L, L); has_limit = false means no clamp.
__device__ __forceinline__ float swiglu(float g, float u, bool has_limit, float limit) {
  if (has_limit) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
  }
  return __fmul_rn(__fmul_rn(g, sigmoid(g)), u);
}

__device__ __forceinline__ float bf16_value(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// The smallest bf16 strictly above finite v.
__device__ __forceinline__ float bf16_next_above(float v) {
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  const float f = __bfloat162float(b);
  if (f > v) return f;
  if (f == 0.0f) return __uint_as_float(0x00010000u);
  uint16_t bits = __bfloat16_as_ushort(b);
  bits = (bits & 0x8000u) ? bits - 1 : bits + 1;
  return __bfloat162float(__ushort_as_bfloat16(bits));
}
// The largest bf16 at or below finite v.
__device__ __forceinline__ float bf16_at_most(float v) {
  const float f = bf16_value(v);
  return f <= v ? f : -bf16_next_above(-v);
}

// v rounded to bf16 for the backward, kept on its own side of the clamp band [lo, hi]
// (reference.h: save_for_clamp).
__device__ __forceinline__ __nv_bfloat16 save_for_clamp(float v, float lo, float hi) {
  float saved = bf16_value(v);
  const bool passes = v >= lo && v <= hi;
  if (passes != (saved >= lo && saved <= hi)) {
    if (passes) {
      saved = saved > hi ? bf16_at_most(hi) : -bf16_at_most(-lo);
    } else {
      saved = v > hi ? bf16_next_above(hi) : -bf16_next_above(-lo);
    }
  }
  return __float2bfloat16_rn(saved);
}

}  // namespace mok::cuda::detail
