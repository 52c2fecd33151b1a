// MoeDesc validation: every bad field raises InvalidArgument naming the field and value.
#include <gtest/gtest.h>

#include <string>

#include "mok/core/desc.h"
#include "mok/core/error.h"
#include "mok/core/presets.h"

namespace mok {
namespace {

MoeDesc valid() {
  MoeDesc d;
  d.tokens_per_rank = 3;
  d.hidden = 16;
  d.intermediate = 8;
  d.num_experts = 4;
  d.topk = 2;
  d.ranks = 2;
  return d;
}

// Expects validate() to throw InvalidArgument whose message contains `needle`.
void expect_invalid(const MoeDesc& d, const std::string& needle) {
  try {
    d.validate();
    FAIL() << "no error for " << d.to_string() << ", expected one mentioning '" << needle << "'";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' does not mention '" << needle << "'";
  }
}

TEST(MoeDesc, ValidDescriptorsPass) {
  EXPECT_NO_THROW(valid().validate());
  MoeDesc d = valid();
  d.tokens_per_rank = 0;  // an empty batch is a valid batch
  EXPECT_NO_THROW(d.validate());
  d.ranks = 4;
  d.topk = 4;  // E = R, k = E
  EXPECT_NO_THROW(d.validate());
  d.swiglu_limit = 7.0f;
  d.shared_intermediate = 24;
  EXPECT_NO_THROW(d.validate());
}

TEST(MoeDesc, EachBadFieldIsNamed) {
  MoeDesc d = valid();
  d.tokens_per_rank = -1;
  expect_invalid(d, "tokens_per_rank must be >= 0, got -1");
  d = valid();
  d.hidden = 0;
  expect_invalid(d, "hidden must be in [1, 1048576], got 0");
  d = valid();
  d.intermediate = -5;
  expect_invalid(d, "intermediate must be in [1, 1048576], got -5");
  d = valid();
  d.num_experts = 0;
  expect_invalid(d, "num_experts must be in [1, 65536], got 0");
  d = valid();
  d.topk = 5;  // more slots than experts: repeated ids and empty slots make it meaningful
  EXPECT_NO_THROW(d.validate());
  d = valid();
  d.topk = 0;
  expect_invalid(d, "topk must be >= 1, got 0");
  d = valid();
  d.ranks = 3;
  expect_invalid(d, "num_experts=4 must be divisible by ranks=3");
  d = valid();
  d.ranks = 0;
  expect_invalid(d, "ranks must be in [1, 4096], got 0");
  d = valid();
  d.shared_intermediate = -1;
  expect_invalid(d, "shared_intermediate must be in [0, 1048576]");
  d = valid();
  d.swiglu_limit = -1.0f;
  expect_invalid(d, "swiglu_limit must be a finite value > 0, got -1");
  d = valid();
  d.swiglu_limit = std::numeric_limits<float>::quiet_NaN();
  expect_invalid(d, "swiglu_limit must be a finite value > 0");
  d = valid();
  d.precision = Precision::fp8_block;
  expect_invalid(d, "fp8_block needs hidden % 128 == 0");
  d = valid();
  d.tokens_per_rank = int64_t{1} << 30;
  d.topk = 4;
  expect_invalid(d, "tokens_per_rank*topk must fit in int32");
}

TEST(MoeDesc, PrintsEveryField) {
  MoeDesc d = valid();
  d.swiglu_limit = 7.0f;
  d.shared_intermediate = 24;
  EXPECT_EQ(d.to_string(), "T=3 H=16 I=8 E=4 k=2 R=2 shared=24 limit=7 bf16");
}

TEST(Presets, MatchTheDesignTable) {
  const ModelPreset& kimi = find_preset("kimi-k2");
  EXPECT_EQ(kimi.num_experts, 384);
  EXPECT_EQ(kimi.hidden, 7168);
  EXPECT_EQ(kimi.intermediate, 2048);
  EXPECT_EQ(kimi.topk, 8);
  EXPECT_EQ(kimi.shared_intermediate, 2048);
  const ModelPreset& oss = find_preset("gpt-oss-120b");
  ASSERT_TRUE(oss.swiglu_limit.has_value());
  EXPECT_EQ(*oss.swiglu_limit, 7.0f);
  EXPECT_EQ(oss.shared_intermediate, 0);
  for (const ModelPreset& p : model_presets()) {
    EXPECT_NO_THROW(p.desc(1, 2048).validate()) << p.name;
  }
}

TEST(Presets, UnknownNameListsTheKnownOnes) {
  try {
    find_preset("kimi");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("unknown preset 'kimi'; known presets: kimi-k2, glm-5.2"),
              std::string::npos)
        << e.what();
  }
}

TEST(Precision, ParsesAndRejects) {
  EXPECT_EQ(parse_precision("bf16"), Precision::bf16);
  EXPECT_EQ(parse_precision("fp8_block"), Precision::fp8_block);
  EXPECT_EQ(parse_precision("fp8"), Precision::fp8_block);
  EXPECT_EQ(parse_precision("fp8_dgrad"), Precision::fp8_dgrad);
  EXPECT_STREQ(to_string(Precision::fp8_dgrad), "fp8_dgrad");
  EXPECT_TRUE(fp8_forward(Precision::fp8_dgrad) && fp8_forward(Precision::fp8_block) && !fp8_forward(Precision::bf16));
  EXPECT_TRUE(fp8_dgrad(Precision::fp8_dgrad) && !fp8_dgrad(Precision::fp8_block));
  EXPECT_THROW(parse_precision("fp4"), InvalidArgument);
}

}  // namespace
}  // namespace mok
