// The one reading of a call's wait status that every kernel of the call shares: whether the call
// was given up (megakernel.h: the status words hold the code at [0], the failed call's epoch at [4]
// and the running call's epoch at [5]). The megakernel's waits stop on it; the schedule and the row
// kernels then visit no row.
#pragma once

#include <cstdint>

namespace mok::cuda::detail {

// Where the running call's epoch is: the call's first kernel writes it (megakernel.cu:
// begin_call_kernel: the launch argument, or the next value of the device's epoch counter, which
// is what a CUDA graph's replay needs), so every later kernel of the call reads it in stream order.
inline constexpr int kCallEpochWord = 5;

__device__ __forceinline__ uint32_t call_epoch(const int32_t* words) {
  return uint32_t(reinterpret_cast<const volatile int32_t*>(words)[kCallEpochWord]);
}

// Set by a wait of the running call that gave up (a failure of an earlier call does not count: a
// failed rank still meets the others at the barriers of the next call).
__device__ __forceinline__ bool call_given_up(const int32_t* words) {
  const volatile int32_t* w = words;
  return w[0] != 0 && w[4] == w[kCallEpochWord];
}

}  // namespace mok::cuda::detail
