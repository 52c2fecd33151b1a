// SwiGLU on the device, with the same formulas and rounding points as the CPU reference
// (include/mok/core/reference.h).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mok::cuda::detail {

// sigmoid(v) = 1 / (1 + 2^(-v log2 e)) with the hardware's approximate exp2 and reciprocal,
// denormals flushed: six instructions per value. The epilogues apply it to every value of a tile,
// and the IEEE reciprocal (or the denormal handling of __expf and __fdividef) per value made their
// code larger than the instruction cache. Deterministic; within a few ulp of the reference's
// 1 / (1 + exp(-v)).
__device__ __forceinline__ float sigmoid_fast(float v) {
  float e, r;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(__fmul_rn(v, -1.4426950408889634f)));
  asm volatile("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(__fadd_rn(1.0f, e)));
  return r;
}

// act(g, u) = silu(min(g, L)) * clamp(u, -L, L); has_limit = false means no clamp.
__device__ __forceinline__ float swiglu(float g, float u, bool has_limit, float limit) {
  if (has_limit) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
  }
  return __fmul_rn(__fmul_rn(g, sigmoid_fast(g)), u);
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

// The rare case of save_for_clamp: the rounding moved v across a clamp edge. Out of line: the
// epilogues save every value of a tile, and an inlined copy of this per value made the kernel's
// code larger than the instruction cache (measured: a quarter of the stall samples waited for
// instructions).
inline __device__ __noinline__ float save_across_clamp(float v, float lo, float hi) {
  const float saved = bf16_value(v);
  if (v >= lo && v <= hi) return saved > hi ? bf16_at_most(hi) : -bf16_at_most(-lo);
  return v > hi ? bf16_next_above(hi) : -bf16_next_above(-lo);
}

// v rounded to bf16 for the backward, kept on its own side of the clamp band [lo, hi]
// (reference.h: save_for_clamp).
__device__ __forceinline__ __nv_bfloat16 save_for_clamp(float v, float lo, float hi) {
  const __nv_bfloat16 saved = __float2bfloat16_rn(v);
  const float f = __bfloat162float(saved);
  const bool passes = v >= lo && v <= hi;
  if (passes == (f >= lo && f <= hi)) return saved;
  return __float2bfloat16_rn(save_across_clamp(v, lo, hi));
}

}  // namespace mok::cuda::detail
