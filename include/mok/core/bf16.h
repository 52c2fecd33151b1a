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

// The smallest bf16 value strictly greater than finite v.
inline float bf16_next_above(float v) {
  bf16 b = float_to_bf16(v);
  const float f = bf16_to_float(b);
  if (f > v) return f;
  if (f == 0.0f) return bf16_to_float(bf16{0x0001});
  b.bits = static_cast<uint16_t>((b.bits & 0x8000u) ? b.bits - 1 : b.bits + 1);
  return bf16_to_float(b);
}
// The largest bf16 value <= finite v.
inline float bf16_at_most(float v) {
  const float f = round_to_bf16(v);
  return f <= v ? f : -bf16_next_above(-v);
}

}  // namespace mok
