// Launcher checks that run on the host (can_implement touches no GPU), with every ctest.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "mok/cuda/megakernel.h"

namespace mok::cuda {
namespace {

// The push epilogue packs a row's destination as rank << 24 | slot: both passes' launchers refuse
// T*k >= 2^24 by name.
template <class Args>
void expect_slot_limit() {
  const char* what = "tokens_per_rank * topk must be < 2^24";
  Args a;
  a.shape = RoutingShape{2, (int64_t{1} << 24) / 8, 8, 16};  // T*k = 2^24
  EXPECT_NE(can_implement(a).find(what), std::string::npos) << can_implement(a);
  a.shape.tokens_per_rank -= 1;  // T*k = 2^24 - 8
  EXPECT_EQ(can_implement(a).find(what), std::string::npos) << can_implement(a);
}

TEST(MegakernelChecks, CombineSlotsPastTwoToThe24AreRefusedByName) {
  expect_slot_limit<MoeForwardArgs>();
  expect_slot_limit<MoeBackwardArgs>();
}

}  // namespace
}  // namespace mok::cuda
