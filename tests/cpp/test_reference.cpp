// The CPU reference against a naive fp64 computation, against finite differences, and on bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "mok/core/compare.h"
#include "mok/core/error.h"
#include "mok/core/problem.h"
#include "mok/core/reference.h"
#include "naive.h"

namespace mok {
namespace {

using test::flat;

struct Case {
  std::string name;
  int64_t T, H, I, E, k, R, Is;
  std::optional<float> limit;
  RoutingKind routing;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

MoeDesc desc_of(const Case& c) {
  MoeDesc d;
  d.tokens_per_rank = c.T;
  d.hidden = c.H;
  d.intermediate = c.I;
  d.num_experts = c.E;
  d.topk = c.k;
  d.ranks = c.R;
  d.shared_intermediate = c.Is;
  d.swiglu_limit = c.limit;
  return d;
}

std::vector<Case> adversarial_cases() {
  return {
      {"one_token", 1, 24, 16, 4, 2, 2, 8, std::nullopt, RoutingKind::uniform},
      {"sizes_not_multiples_of_any_tile", 37, 71, 43, 6, 3, 3, 19, std::nullopt, RoutingKind::zipf},
      {"topk_1", 20, 32, 16, 8, 1, 2, 0, std::nullopt, RoutingKind::uniform},
      {"experts_equal_ranks", 9, 40, 24, 4, 2, 4, 0, std::nullopt, RoutingKind::uniform},
      {"every_token_to_one_expert", 17, 32, 16, 8, 1, 4, 16, std::nullopt, RoutingKind::one_expert},
      {"empty_experts", 6, 32, 16, 16, 2, 2, 0, std::nullopt, RoutingKind::zipf},
      {"clamped_swiglu", 64, 64, 48, 4, 2, 2, 32, 1.0f, RoutingKind::uniform},
      {"no_tokens", 0, 16, 8, 4, 2, 2, 8, std::nullopt, RoutingKind::uniform},
      {"balanced", 16, 64, 32, 8, 4, 2, 32, std::nullopt, RoutingKind::balanced},
      {"empty_slots", 23, 40, 24, 8, 3, 2, 16, std::nullopt, RoutingKind::masked},
  };
}

// Every output of the reference and of the naive computation, side by side.
template <class Real>
std::vector<std::pair<std::string, std::pair<std::vector<double>, std::vector<double>>>> pair_outputs(
    const ref::LayerForward<Real>& f, const ref::LayerGrads<Real>& g, const test::NaiveResult& n) {
  auto d = [](const std::vector<Real>& v) { return std::vector<double>(v.begin(), v.end()); };
  std::vector<std::pair<std::string, std::pair<std::vector<double>, std::vector<double>>>> out;
  out.push_back({"y", {d(flat(f.y)), flat(n.y)}});
  out.push_back({"dx", {d(flat(g.dx)), flat(n.dx)}});
  out.push_back({"d_topk_w", {d(flat(g.d_topk_w)), flat(n.d_topk_w)}});
  out.push_back({"dW_gate", {d(g.d_routed.gate), n.d_gate}});
  out.push_back({"dW_up", {d(g.d_routed.up), n.d_up}});
  out.push_back({"dW_down", {d(g.d_routed.down), n.d_down}});
  std::vector<Real> sg, su, sd;
  for (const auto& s : g.d_shared) {
    sg.insert(sg.end(), s.gate.begin(), s.gate.end());
    su.insert(su.end(), s.up.begin(), s.up.end());
    sd.insert(sd.end(), s.down.begin(), s.down.end());
  }
  out.push_back({"shared dW_gate", {d(sg), flat(n.ds_gate)}});
  out.push_back({"shared dW_up", {d(su), flat(n.ds_up)}});
  out.push_back({"shared dW_down", {d(sd), flat(n.ds_down)}});
  return out;
}

class ReferenceVsNaive : public ::testing::TestWithParam<Case> {};

TEST_P(ReferenceVsNaive, ExactModeMatchesToRoundoff) {
  const Case& c = GetParam();
  const MoeDesc d = desc_of(c);
  const auto in = make_inputs<double>(d, c.routing, 7, /*bf16_values=*/false);
  const auto dy = make_output_grad<double>(d, 7, false);
  const auto f = ref::layer_forward(in, ref::Rounding::none);
  const auto g = ref::layer_backward(in, f.context, dy, ref::Rounding::none);
  const auto n = test::naive_layer(in, dy);
  for (const auto& [name, v] : pair_outputs(f, g, n)) {
    const Comparison cmp = compare(v.first, v.second);
    EXPECT_TRUE(cmp.within(1e-12)) << c.name << " " << cmp.describe(name);
  }
}

TEST_P(ReferenceVsNaive, Bf16ModeIsWithinTheBf16Bound) {
  const Case& c = GetParam();
  const MoeDesc d = desc_of(c);
  const auto in = make_inputs<float>(d, c.routing, 11, /*bf16_values=*/true);
  const auto dy = make_output_grad<float>(d, 11, true);
  const auto f = ref::layer_forward(in, ref::Rounding::bf16);
  const auto g = ref::layer_backward(in, f.context, dy, ref::Rounding::bf16);
  const auto n = test::naive_layer(test::convert<double>(in),
                                   [&] {
                                     std::vector<std::vector<double>> v;
                                     for (const auto& r : dy) v.emplace_back(r.begin(), r.end());
                                     return v;
                                   }());
  for (const auto& [name, v] : pair_outputs(f, g, n)) {
    const Comparison cmp = compare(v.first, v.second);
    EXPECT_TRUE(cmp.within(kBf16RelTolerance)) << c.name << " " << cmp.describe(name);
    // The rounding points are real: bf16 outputs are bf16 values.
    if (name == "y" || name == "dx") {
      for (double x : v.first) ASSERT_EQ(static_cast<float>(x), round_to_bf16(static_cast<float>(x)));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Adversarial, ReferenceVsNaive, ::testing::ValuesIn(adversarial_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(Reference, EmptyExpertsReallyOccurAndGetZeroGradients) {
  const Case c = adversarial_cases()[5];
  const MoeDesc d = desc_of(c);
  const auto in = make_inputs<double>(d, c.routing, 7, false);
  const auto f = ref::layer_forward(in, ref::Rounding::none);
  int empty = 0;
  for (const auto& s : f.context.schedules) {
    for (int64_t n : s.expert_rows) empty += n == 0;
  }
  EXPECT_GT(empty, 0) << "the zipf case no longer exercises empty experts";
  const auto g = ref::layer_backward(in, f.context, make_output_grad<double>(d, 7, false), ref::Rounding::none);
  for (int64_t r = 0; r < d.ranks; ++r) {
    for (int64_t e = 0; e < d.local_experts(); ++e) {
      if (f.context.schedules[r].expert_rows[e] != 0) continue;
      const int64_t ge = r * d.local_experts() + e;
      for (int64_t i = 0; i < d.intermediate * d.hidden; ++i) {
        ASSERT_EQ(g.d_routed.gate[ge * d.intermediate * d.hidden + i], 0.0);
      }
    }
  }
}

// An empty slot (id -1) is the slot routed with weight 0, except that it costs no row and its
// d topk_w is 0: y and dx hold the same values, the weight gradients the same to rounding (their
// row sums go in fixed blocks of rows, which the zero-weight rows shift).
TEST(Reference, EmptySlotsAddNothing) {
  const MoeDesc d = desc_of({"empty", 40, 32, 16, 8, 4, 2, 16, std::nullopt, RoutingKind::masked});
  const auto in = make_inputs<float>(d, RoutingKind::masked, 19, true);
  auto zero_weight = in;
  int64_t empty = 0, all_empty_tokens = 0;
  for (int64_t r = 0; r < d.ranks; ++r) {
    for (int64_t t = 0; t < d.tokens_per_rank; ++t) {
      int64_t in_token = 0;
      for (int64_t j = 0; j < d.topk; ++j) {
        const size_t s = static_cast<size_t>(t * d.topk + j);
        if (in.topk_idx[r][s] != kNoExpert) continue;
        ++empty, ++in_token;
        zero_weight.topk_idx[r][s] = static_cast<int32_t>((t + j) % d.num_experts);
        zero_weight.topk_w[r][s] = 0.0f;
      }
      all_empty_tokens += in_token == d.topk;
    }
  }
  ASSERT_GT(empty, d.ranks * d.tokens_per_rank * d.topk / 5) << "the masked routing has few empty slots";
  ASSERT_GT(all_empty_tokens, 0) << "the masked routing has no token without experts";
  const auto dy = make_output_grad<float>(d, 19, true);
  const auto f = ref::layer_forward(in, ref::Rounding::bf16);
  const auto g = ref::layer_backward(in, f.context, dy, ref::Rounding::bf16);
  const auto f0 = ref::layer_forward(zero_weight, ref::Rounding::bf16);
  const auto g0 = ref::layer_backward(zero_weight, f0.context, dy, ref::Rounding::bf16);
  int64_t rows = 0, rows0 = 0;
  for (int64_t r = 0; r < d.ranks; ++r) {
    rows += f.context.schedules[r].real_rows();
    rows0 += f0.context.schedules[r].real_rows();
  }
  EXPECT_EQ(rows, rows0 - empty) << "an empty slot must not become a row";
  const auto same_values = [](const std::vector<float>& a, const std::vector<float>& b, const char* what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << what << "[" << i << "]";
  };
  same_values(flat(f.y), flat(f0.y), "y");
  same_values(flat(g.dx), flat(g0.dx), "dx");
  const auto close = [](const std::vector<float>& a, const std::vector<float>& b, const char* what) {
    const Comparison cmp = compare(std::vector<double>(a.begin(), a.end()), std::vector<double>(b.begin(), b.end()));
    EXPECT_TRUE(cmp.within(kBf16RelTolerance)) << cmp.describe(what);
  };
  close(g.d_routed.gate, g0.d_routed.gate, "dW_gate");
  close(g.d_routed.up, g0.d_routed.up, "dW_up");
  close(g.d_routed.down, g0.d_routed.down, "dW_down");
  for (int64_t r = 0; r < d.ranks; ++r) {
    for (size_t s = 0; s < in.topk_idx[r].size(); ++s) {
      const float want = in.topk_idx[r][s] == kNoExpert ? 0.0f : g0.d_topk_w[r][s];
      ASSERT_EQ(g.d_topk_w[r][s], want) << "d topk_w[rank " << r << "][slot " << s << "]";
    }
  }
}

TEST(Reference, DuplicateExpertIdsCountEachSlot) {
  MoeDesc d = desc_of({"dup", 4, 16, 8, 4, 2, 2, 0, std::nullopt, RoutingKind::uniform});
  auto in = make_inputs<double>(d, RoutingKind::uniform, 3, false);
  for (auto& idx : in.topk_idx) {
    for (size_t s = 0; s < idx.size(); s += 2) idx[s + 1] = idx[s];
  }
  const auto dy = make_output_grad<double>(d, 3, false);
  const auto f = ref::layer_forward(in, ref::Rounding::none);
  const auto g = ref::layer_backward(in, f.context, dy, ref::Rounding::none);
  const auto n = test::naive_layer(in, dy);
  for (const auto& [name, v] : pair_outputs(f, g, n)) {
    EXPECT_TRUE(compare(v.first, v.second).within(1e-12)) << name;
  }
}

// d/dθ of L = sum over ranks of <y, dy>, by central differences, against the analytic gradient.
class FiniteDifferences : public ::testing::TestWithParam<std::optional<float>> {};

TEST_P(FiniteDifferences, EveryGradientMatches) {
  const MoeDesc d = desc_of({"fd", 3, 6, 4, 4, 2, 2, 3, GetParam(), RoutingKind::uniform});
  auto in = make_inputs<double>(d, RoutingKind::uniform, 5, false);
  const auto dy = make_output_grad<double>(d, 5, false);
  const auto f = ref::layer_forward(in, ref::Rounding::none);
  const auto g = ref::layer_backward(in, f.context, dy, ref::Rounding::none);
  const auto loss = [&](const ref::LayerInputs<double>& p) {
    const auto y = ref::layer_forward(p, ref::Rounding::none).y;
    double l = 0;
    for (size_t r = 0; r < y.size(); ++r) {
      for (size_t i = 0; i < y[r].size(); ++i) l += y[r][i] * dy[r][i];
    }
    return l;
  };
  const double eps = 1e-6;
  int checked = 0;
  const auto check = [&](const std::string& what, std::vector<double>& param, const std::vector<double>& grad) {
    ASSERT_EQ(param.size(), grad.size()) << what;
    for (size_t i = 0; i < param.size(); ++i) {
      const double saved = param[i];
      param[i] = saved + eps;
      const double up = loss(in);
      param[i] = saved - eps;
      const double down = loss(in);
      param[i] = saved;
      const double fd = (up - down) / (2 * eps);
      EXPECT_NEAR(grad[i], fd, 1e-6 * (1.0 + std::fabs(fd))) << what << "[" << i << "]";
      ++checked;
    }
  };
  for (int64_t r = 0; r < d.ranks; ++r) {
    check("x[rank " + std::to_string(r) + "]", in.x[r], g.dx[r]);
    check("topk_w[rank " + std::to_string(r) + "]", in.topk_w[r], g.d_topk_w[r]);
  }
  check("w_gate", in.routed.gate, g.d_routed.gate);
  check("w_up", in.routed.up, g.d_routed.up);
  check("w_down", in.routed.down, g.d_routed.down);
  // The shared weights are replicated: their gradient is the sum of every rank's.
  std::vector<double> sg(in.shared.gate.size()), su(in.shared.up.size()), sd(in.shared.down.size());
  for (const auto& s : g.d_shared) {
    for (size_t i = 0; i < sg.size(); ++i) sg[i] += s.gate[i];
    for (size_t i = 0; i < su.size(); ++i) su[i] += s.up[i];
    for (size_t i = 0; i < sd.size(); ++i) sd[i] += s.down[i];
  }
  check("shared w_gate", in.shared.gate, sg);
  check("shared w_up", in.shared.up, su);
  check("shared w_down", in.shared.down, sd);
  EXPECT_GT(checked, 300);
}

INSTANTIATE_TEST_SUITE_P(Fp64, FiniteDifferences, ::testing::Values(std::nullopt, std::optional<float>(0.3f)),
                         [](const auto& info) { return info.param ? std::string("clamped") : std::string("plain"); });

// Bad input: each raises InvalidArgument with a message naming the tensor and position.
void expect_message(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    FAIL() << "no error, expected one mentioning '" << needle << "'";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Reference, BadInputIsNamed) {
  const MoeDesc d = desc_of({"bad", 4, 8, 4, 4, 2, 2, 4, std::nullopt, RoutingKind::uniform});
  const auto good = make_inputs<float>(d, RoutingKind::uniform, 1, true);
  const auto run = [](const ref::LayerInputs<float>& in) { ref::layer_forward(in, ref::Rounding::bf16); };
  auto in = good;
  in.x[1][2 * 8 + 3] = std::numeric_limits<float>::quiet_NaN();
  expect_message([&] { run(in); }, "x[rank 1][2][3] is not finite");
  in = good;
  in.topk_w[0][5] = std::numeric_limits<float>::infinity();
  expect_message([&] { run(in); }, "topk_w[rank 0][2][1] is not finite");
  in = good;
  in.topk_idx[1][3] = 9;
  expect_message([&] { run(in); }, "topk_idx[rank 1][token 1][1] = 9 is out of range [0, 4)");
  in = good;
  in.topk_idx[0][2] = -2;  // -1 is an empty slot; nothing else below 0 is an id
  expect_message([&] { run(in); }, "topk_idx[rank 0][token 1][0] = -2 is out of range [0, 4) and not -1");
  in = good;
  in.x[0].pop_back();
  expect_message([&] { run(in); }, "x[rank 0] has 31 elements, expected 32");
  in = good;
  in.routed.down.resize(3);
  expect_message([&] { run(in); }, "w_down has 3 elements, expected 128");
  in = good;
  in.shared.gate.clear();
  expect_message([&] { run(in); }, "shared w_gate has 0 elements, expected 32");
  in = good;
  in.routed.up[7] = std::numeric_limits<float>::quiet_NaN();
  expect_message([&] { run(in); }, "w_up[0][7] is not finite");
  in = good;
  in.x.pop_back();
  expect_message([&] { run(in); }, "x is given for 1 ranks, expected 2");
  in = good;
  in.desc.precision = Precision::fp8_block;
  in.desc.hidden = 128;
  expect_message([&] { run(in); }, "fp8_block needs intermediate % 128 == 0");

  const auto f = ref::layer_forward(good, ref::Rounding::bf16);
  auto dy = make_output_grad<float>(d, 1, true);
  dy[1][0] = std::numeric_limits<float>::quiet_NaN();
  expect_message([&] { ref::layer_backward(good, f.context, dy, ref::Rounding::bf16); },
                 "dy[rank 1][0][0] is not finite");
  dy.pop_back();
  expect_message([&] { ref::layer_backward(good, f.context, dy, ref::Rounding::bf16); },
                 "dy is given for 1 ranks, expected 2");
}

// The layer at precision fp8_block: the experts' GEMMs on e4m3 (experts_forward_fp8), the rest
// as at bf16. Its y is near the bf16 layer's (e4m3's 3 mantissa bits on x, the weights and h) and
// not equal to it; its backward is the bf16 one from its own saved rows; float and bf16 rounding
// points only.
TEST(Reference, Fp8LayerIsNearTheBf16Layer) {
  const MoeDesc d = desc_of({"fp8", 40, 256, 128, 8, 2, 2, 128, 4.0f, RoutingKind::zipf});
  const auto in = make_inputs<float>(d, RoutingKind::zipf, 17, true);
  auto in8 = in;
  in8.desc.precision = Precision::fp8_block;
  const auto f = ref::layer_forward(in, ref::Rounding::bf16);
  const auto f8 = ref::layer_forward(in8, ref::Rounding::bf16);
  const auto y = flat(f.y), y8 = flat(f8.y);
  const Comparison c = compare(y8, y);
  EXPECT_TRUE(c.within(0.1)) << c.describe("fp8 y against bf16 y");
  EXPECT_GT(c.rel_error, 1e-3) << "the fp8 layer computed the bf16 one";
  const auto dy = make_output_grad<float>(d, 17, true);
  const auto g = ref::layer_backward(in, f.context, dy, ref::Rounding::bf16);
  const auto g8 = ref::layer_backward(in8, f8.context, dy, ref::Rounding::bf16);
  const Comparison cx = compare(flat(g8.dx), flat(g.dx));
  EXPECT_TRUE(cx.within(0.1)) << cx.describe("fp8 dx against bf16 dx");
  const Comparison cw = compare(g8.d_routed.down, g.d_routed.down);
  EXPECT_TRUE(cw.within(0.1)) << cw.describe("fp8 dW_down against bf16 dW_down");
  expect_message([&] { ref::layer_forward(in8, ref::Rounding::none); }, "precision fp8_block has the GPU's rounding");
  auto odd = in8;
  odd.desc.shared_intermediate = 64;
  odd.shared.gate.resize(64 * 256);
  odd.shared.up.resize(64 * 256);
  odd.shared.down.resize(256 * 64);
  expect_message([&] { ref::layer_forward(odd, ref::Rounding::bf16); }, "fp8_block needs shared_intermediate % 128");
  auto in8d = make_inputs<double>(d, RoutingKind::zipf, 17, true);
  in8d.desc.precision = Precision::fp8_block;
  expect_message([&] { ref::layer_forward(in8d, ref::Rounding::bf16); }, "computed in float");
}

// The layer at precision fp8_dgrad: fp8_block's forward bit for bit; the backward's data
// gradients on e4m3 (experts_backward_fp8_dgrad for the routed and the shared experts), so dx and
// d topk_w are near fp8_block's and not equal to them, and the weight gradients (bf16 GEMMs of
// the same x rows and of dg|du, which now carries dy's and dh's quantization) near them too.
TEST(Reference, Fp8DgradLayerIsNearTheFp8Layer) {
  const MoeDesc d = desc_of({"fp8", 40, 256, 128, 8, 2, 2, 128, 4.0f, RoutingKind::zipf});
  auto in8 = make_inputs<float>(d, RoutingKind::zipf, 23, true);
  in8.desc.precision = Precision::fp8_block;
  auto ind = in8;
  ind.desc.precision = Precision::fp8_dgrad;
  const auto f8 = ref::layer_forward(in8, ref::Rounding::bf16);
  const auto fd = ref::layer_forward(ind, ref::Rounding::bf16);
  EXPECT_EQ(first_bit_difference(flat(fd.y), flat(f8.y)), -1) << "fp8_dgrad's forward is fp8_block's";
  const auto dy = make_output_grad<float>(d, 23, true);
  const auto g8 = ref::layer_backward(in8, f8.context, dy, ref::Rounding::bf16);
  const auto gd = ref::layer_backward(ind, fd.context, dy, ref::Rounding::bf16);
  const Comparison cx = compare(flat(gd.dx), flat(g8.dx));
  EXPECT_TRUE(cx.within(0.1)) << cx.describe("fp8_dgrad dx against fp8_block dx");
  EXPECT_GT(cx.rel_error, 1e-3) << "the fp8_dgrad backward computed the bf16 one";
  const Comparison cw = compare(flat(gd.d_topk_w), flat(g8.d_topk_w));
  EXPECT_TRUE(cw.within(0.1)) << cw.describe("fp8_dgrad d topk_w against fp8_block's");
  const std::vector<std::tuple<const std::vector<float>*, const std::vector<float>*, const char*>> weights{
      {&gd.d_routed.gate, &g8.d_routed.gate, "dW_gate"},
      {&gd.d_routed.down, &g8.d_routed.down, "dW_down"},
      {&gd.d_shared[0].up, &g8.d_shared[0].up, "shared dW_up"}};
  for (const auto& [got, want, what] : weights) {
    const Comparison c = compare(*got, *want);
    EXPECT_TRUE(c.within(0.1)) << c.describe(std::string("fp8_dgrad ") + what + " against fp8_block's");
  }
  expect_message([&] { ref::layer_backward(ind, fd.context, dy, ref::Rounding::none); },
                 "precision fp8_dgrad has the GPU's rounding");
}

TEST(Reference, StagesRejectBadOffsets) {
  const ref::MlpShape shape{8, 4, std::nullopt};
  std::vector<float> w(2 * 8 * 4), x(8 * 8), gu(8 * 8), h(8 * 4), y(8 * 8);
  const ref::ExpertsView<float> view{w.data(), w.data(), w.data(), 2};
  const std::vector<int64_t> decreasing{0, 5, 3};
  expect_message([&] { ref::experts_forward(shape, view, decreasing, x.data(), gu.data(), h.data(), y.data(), ref::Rounding::bf16); },
                 "expert offsets must not decrease");
  const std::vector<int64_t> short_offsets{0, 5};
  expect_message([&] { ref::experts_forward(shape, view, short_offsets, x.data(), gu.data(), h.data(), y.data(), ref::Rounding::bf16); },
                 "expert offsets have 2 entries, expected count+1=3");
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(round_to_bf16(1.0f + 1.0f / 256), 1.0f);               // a tie, to even
  EXPECT_EQ(round_to_bf16(1.0f + 3.0f / 256), 1.0f + 4.0f / 256);  // a tie, to even (up)
  EXPECT_EQ(round_to_bf16(-2.5f), -2.5f);
  EXPECT_TRUE(std::isnan(round_to_bf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isinf(round_to_bf16(std::numeric_limits<float>::infinity())));
  EXPECT_TRUE(std::isinf(round_to_bf16(3.4e38f)));  // rounds past the largest bf16
}

TEST(Bf16, NeighboursOfALimit) {
  EXPECT_EQ(bf16_next_above(1.0f), 1.0f + 1.0f / 128);
  EXPECT_EQ(bf16_next_above(-1.0f), -1.0f + 1.0f / 256);
  EXPECT_GT(bf16_next_above(0.0f), 0.0f);
  EXPECT_EQ(bf16_at_most(7.0f), 7.0f);
  EXPECT_EQ(bf16_at_most(0.3f), round_to_bf16(0.3f) <= 0.3f ? round_to_bf16(0.3f) : 0.298828125f);
  EXPECT_LE(bf16_at_most(0.3f), 0.3f);
  EXPECT_EQ(bf16_at_most(-0.3f), -bf16_next_above(0.3f));
}

// With a SwiGLU limit, the backward decides the clamp from the saved bf16 g and u exactly as the
// forward did from the unrounded ones, also for values within one bf16 step of the limit.
TEST(Reference, SavedGateUpKeepTheForwardsClampDecision) {
  for (float L : {1.0f, 0.3f}) {
    const ref::MlpShape shape{64, 48, L};
    const MoeDesc d = desc_of({"clamp", 64, 64, 48, 1, 1, 1, 0, L, RoutingKind::uniform});
    const auto in = make_inputs<float>(d, RoutingKind::uniform, 13, true);
    const std::vector<int64_t> offsets{0, 64};
    const ref::ExpertsView<float> w{in.routed.gate.data(), in.routed.up.data(), in.routed.down.data(), 1};
    std::vector<float> gu_exact(64 * 96), gu(64 * 96), h(64 * 48), y(64 * 64);
    ref::experts_forward(shape, w, offsets, in.x[0].data(), gu_exact.data(), h.data(), y.data(), ref::Rounding::none);
    ref::experts_forward(shape, w, offsets, in.x[0].data(), gu.data(), h.data(), y.data(), ref::Rounding::bf16);
    int near_limit = 0;
    for (int64_t m = 0; m < 64; ++m) {
      for (int64_t i = 0; i < 48; ++i) {
        const float g0 = gu_exact[m * 96 + i], g1 = gu[m * 96 + i];
        const float u0 = gu_exact[m * 96 + 48 + i], u1 = gu[m * 96 + 48 + i];
        ASSERT_EQ(g0 <= L, g1 <= L) << "g " << g0 << " saved as " << g1;
        ASSERT_EQ(std::fabs(u0) <= L, std::fabs(u1) <= L) << "u " << u0 << " saved as " << u1;
        ASSERT_EQ(g1, round_to_bf16(g1));
        ASSERT_EQ(u1, round_to_bf16(u1));
        near_limit += std::fabs(std::fabs(u0) - L) < L / 64 || std::fabs(g0 - L) < L / 64;
      }
    }
    EXPECT_GT(near_limit, 10) << "the case no longer has values near the limit";
  }
}

}  // namespace
}  // namespace mok
