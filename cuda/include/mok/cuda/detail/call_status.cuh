// The one reading of a call's wait status that every kernel of the call shares: whether the call
// was given up (megakernel.h: the status words hold the code at [0] and the call's epoch at [4]).
// The megakernel's waits stop on it; the schedule and the row kernels then visit no row.
#pragma once

#include <cstdint>

namespace mok::cuda::detail {

// Set by a wait of the call with this epoch that gave up (a failure of an earlier call does not
// count: a failed rank still meets the others at the barriers of the next call).
__device__ __forceinline__ bool call_given_up(const int32_t* words, uint32_t epoch) {
  const volatile int32_t* w = words;
  return w[0] != 0 && uint32_t(w[4]) == epoch;
}

}  // namespace mok::cuda::detail
