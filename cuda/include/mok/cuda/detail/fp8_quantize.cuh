// The device side of block-scaled e4m3 quantization, shared by the quantizers (src/fp8.cu) and
// the fp8 forward megakernel's h (megakernel_fp8.cuh): the same codes and scales as the CPU oracle
// (mok/core/fp8.h: block_scale and the quotient's conversion), bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace mok::cuda::detail {

// The smallest 2^e with amax <= 448 * 2^e, e in [-126, 127] (fp8::block_scale): amax = m * 2^E
// with m in [1, 2) and 448 = 1.75 * 2^8, so e = E - 8, plus one where m > 1.75.
__device__ __forceinline__ int fp8_scale_exponent(float amax) {
  if (amax == 0.0f) return 0;
  int e = ilogbf(amax) - 8;
  if (amax > ldexpf(448.0f, e)) ++e;
  return max(-126, min(127, e));
}

// v / 2^e as e4m3: a product with an exact power of two (inv = 2^-e is a float for e in
// [-126, 127]), rounded once as the CPU's quotient is, then the conversion, nearest even and
// saturating.
__device__ __forceinline__ uint8_t fp8_code(float v, float inv) {
  return __nv_cvt_float_to_fp8(__fmul_rn(v, inv), __NV_SATFINITE, __NV_E4M3);
}

// fp8_code of two values at once (one conversion instruction for both; the same codes): .x in
// the low byte.
__device__ __forceinline__ uint16_t fp8_code2(float2 v, float inv) {
  return __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v.x, inv), __fmul_rn(v.y, inv)), __NV_SATFINITE, __NV_E4M3);
}

// 8 bf16 values, one 16-byte vector (value i in bytes 2i, 2i + 1), as the quantizers load them:
// the larger of amax and their largest magnitude.
__device__ __forceinline__ float bf16x8_amax(const uint4& v, float amax) {
  const __nv_bfloat162* two = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(two[i]);
    amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
  }
  return amax;
}

// Their 8 codes at scale 2^e (inv = 2^-e, fp8_code each), value i in byte i.
__device__ __forceinline__ uint2 bf16x8_codes(const uint4& v, float inv) {
  const __nv_bfloat162* two = reinterpret_cast<const __nv_bfloat162*>(&v);
  uint32_t packed[2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
    packed[i] = uint32_t(fp8_code2(__bfloat1622float2(two[2 * i]), inv)) |
                uint32_t(fp8_code2(__bfloat1622float2(two[2 * i + 1]), inv)) << 16;
  return make_uint2(packed[0], packed[1]);
}

}  // namespace mok::cuda::detail
