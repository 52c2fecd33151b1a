// bfloat16 storage and round-to-nearest-even conversion, identical to the GPU's __float2bfloat16_rn.
#pragma once

#include <cstdint>
#include <cstring>

namespace mok {

// A bf16 value as its 16 raw bits (the upper half of an IEEE float32).
struct bf16 {
  uint16_t bits = 0;
};

inline float bf16_to_float(bf16 v) {
  const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest, ties to even; NaN stays NaN (quiet), infinities stay infinite.
inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>((u + rounding_bias) >> 16)};
}

// The float nearest to f that a bf16 can hold: what a GPU epilogue's bf16 store keeps.
inline float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

}  // namespace mok
