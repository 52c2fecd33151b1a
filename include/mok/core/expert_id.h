// The one special expert id, shared by the C++ core and the CUDA kernels (C++17, no other header).
#pragma once

#include <cstdint>

namespace mok {

// A topk_idx entry naming no expert: slot (t, j) is empty (desc.h says what that means).
inline constexpr int32_t kNoExpert = -1;

}  // namespace mok
