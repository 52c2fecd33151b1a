// Launcher checks that run on the host (can_implement touches no GPU), with every ctest.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "mok/cuda/megakernel.h"

namespace mok::cuda {
namespace {

// The push epilogue packs a row's destination as rank << 24 | slot: the launcher refuses
// T*k >= 2^24 by name.
TEST(MegakernelChecks, CombineSlotsPastTwoToThe24AreRefusedByName) {
  const char* what = "tokens_per_rank * topk must be < 2^24";
  MoeForwardArgs a;
  a.shape = RoutingShape{2, (int64_t{1} << 24) / 8, 8, 16};  // T*k = 2^24
  EXPECT_NE(can_implement(a).find(what), std::string::npos) << can_implement(a);
  a.shape.tokens_per_rank -= 1;  // T*k = 2^24 - 8
  EXPECT_EQ(can_implement(a).find(what), std::string::npos) << can_implement(a);
}

}  // namespace
}  // namespace mok::cuda
