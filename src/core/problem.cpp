#include "mok/core/problem.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "mok/core/error.h"

namespace mok {

const char* to_string(RoutingKind r) {
  switch (r) {
    case RoutingKind::balanced: return "balanced";
    case RoutingKind::uniform: return "uniform";
    case RoutingKind::zipf: return "zipf";
    case RoutingKind::one_expert: return "one_expert";
    case RoutingKind::masked: return "masked";
  }
  return "unknown";
}

RoutingKind parse_routing(const std::string& name) {
  if (name == "balanced") return RoutingKind::balanced;
  if (name == "uniform") return RoutingKind::uniform;
  if (name == "zipf") return RoutingKind::zipf;
  if (name == "one_expert" || name == "all_to_one") return RoutingKind::one_expert;
  if (name == "masked") return RoutingKind::masked;
  throw InvalidArgument("routing '" + name + "' is not one of: balanced, uniform, zipf, one_expert, masked");
}

uint64_t Rng::next() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

double Rng::normal() {
  const double u1 = 1.0 - uniform();  // (0, 1]
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

std::vector<std::vector<int32_t>> make_routing(const MoeDesc& desc, RoutingKind kind, uint64_t seed) {
  desc.validate();
  const int64_t R = desc.ranks, T = desc.tokens_per_rank, k = desc.topk, E = desc.num_experts;
  MOK_REQUIRE(kind == RoutingKind::balanced || k <= E, "routing ", to_string(kind), " picks k distinct experts: ",
              "topk=", k, " exceeds num_experts=", E, " (balanced takes any k)");
  std::vector<std::vector<int32_t>> idx(static_cast<size_t>(R), std::vector<int32_t>(static_cast<size_t>(T * k)));
  Rng rng(seed ^ 0x5eedull);
  std::vector<double> weight(static_cast<size_t>(E), 1.0);
  if (kind == RoutingKind::zipf || kind == RoutingKind::masked) {
    std::vector<int64_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    for (int64_t i = E - 1; i > 0; --i) std::swap(order[i], order[rng.next() % (i + 1)]);
    for (int64_t rank = 0; rank < E; ++rank) weight[order[rank]] = 1.0 / std::pow(rank + 1.0, 1.2);
  }
  std::vector<double> w;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t t = 0; t < T; ++t) {
      int32_t* out = idx[r].data() + t * k;
      const int64_t g = r * T + t;
      if (kind == RoutingKind::balanced) {
        for (int64_t j = 0; j < k; ++j) out[j] = static_cast<int32_t>((g * k + j) % E);
      } else if (kind == RoutingKind::one_expert) {
        for (int64_t j = 0; j < k; ++j) out[j] = static_cast<int32_t>(j);
      } else {
        // k distinct experts, drawn without replacement in proportion to weight.
        w = weight;
        for (int64_t j = 0; j < k; ++j) {
          double total = 0;
          for (double v : w) total += v;
          double pick = rng.uniform() * total;
          int64_t e = 0;
          while (e < E - 1 && (pick >= w[e] || w[e] == 0.0)) {
            pick -= w[e];
            ++e;
          }
          while (w[e] == 0.0) e = (e + 1) % E;  // rounding at the end of the scan
          out[j] = static_cast<int32_t>(e);
          w[e] = 0.0;
        }
        if (kind == RoutingKind::masked) {
          for (int64_t j = 0; j < k; ++j)
            if (g % 5 == 4 || rng.next() % 4 == 0) out[j] = kNoExpert;
        }
      }
    }
  }
  return idx;
}

namespace {
template <class Real>
Real draw(Rng& rng, double scale, bool bf16_values) {
  const double v = rng.normal() * scale;
  return bf16_values ? static_cast<Real>(round_to_bf16(static_cast<float>(v))) : static_cast<Real>(v);
}

template <class Real>
std::vector<Real> draw_vector(Rng& rng, int64_t n, double scale, bool bf16_values) {
  std::vector<Real> v(static_cast<size_t>(n));
  for (Real& x : v) x = draw<Real>(rng, scale, bf16_values);
  return v;
}
}  // namespace

template <class Real>
ref::LayerInputs<Real> make_inputs(const MoeDesc& desc, RoutingKind kind, uint64_t seed, bool bf16_values) {
  desc.validate();
  const int64_t R = desc.ranks, T = desc.tokens_per_rank, H = desc.hidden, I = desc.intermediate;
  const int64_t k = desc.topk, E = desc.num_experts, Is = desc.shared_intermediate;
  ref::LayerInputs<Real> in;
  in.desc = desc;
  in.topk_idx = make_routing(desc, kind, seed);
  Rng rng(seed);
  for (int64_t r = 0; r < R; ++r) {
    in.x.push_back(draw_vector<Real>(rng, T * H, 1.0, bf16_values));
    std::vector<Real> w(static_cast<size_t>(T * k));
    std::vector<double> raw(static_cast<size_t>(k));
    for (int64_t t = 0; t < T; ++t) {
      double total = 0;
      for (int64_t j = 0; j < k; ++j) total += (raw[static_cast<size_t>(j)] = 0.1 + rng.uniform());
      for (int64_t j = 0; j < k; ++j) {
        w[t * k + j] = static_cast<Real>(static_cast<float>(raw[static_cast<size_t>(j)] / total));
      }
    }
    in.topk_w.push_back(std::move(w));
  }
  in.routed.gate = draw_vector<Real>(rng, E * I * H, 1.0 / std::sqrt(static_cast<double>(H)), bf16_values);
  in.routed.up = draw_vector<Real>(rng, E * I * H, 1.0 / std::sqrt(static_cast<double>(H)), bf16_values);
  in.routed.down = draw_vector<Real>(rng, E * H * I, 1.0 / std::sqrt(static_cast<double>(I)), bf16_values);
  if (Is > 0) {
    in.shared.gate = draw_vector<Real>(rng, Is * H, 1.0 / std::sqrt(static_cast<double>(H)), bf16_values);
    in.shared.up = draw_vector<Real>(rng, Is * H, 1.0 / std::sqrt(static_cast<double>(H)), bf16_values);
    in.shared.down = draw_vector<Real>(rng, H * Is, 1.0 / std::sqrt(static_cast<double>(Is)), bf16_values);
  }
  return in;
}

template <class Real>
std::vector<std::vector<Real>> make_output_grad(const MoeDesc& desc, uint64_t seed, bool bf16_values) {
  Rng rng(seed ^ 0xd1ull);
  std::vector<std::vector<Real>> dy;
  for (int64_t r = 0; r < desc.ranks; ++r) {
    dy.push_back(draw_vector<Real>(rng, desc.tokens_per_rank * desc.hidden, 1.0, bf16_values));
  }
  return dy;
}

template ref::LayerInputs<float> make_inputs<float>(const MoeDesc&, RoutingKind, uint64_t, bool);
template ref::LayerInputs<double> make_inputs<double>(const MoeDesc&, RoutingKind, uint64_t, bool);
template std::vector<std::vector<float>> make_output_grad<float>(const MoeDesc&, uint64_t, bool);
template std::vector<std::vector<double>> make_output_grad<double>(const MoeDesc&, uint64_t, bool);

}  // namespace mok
