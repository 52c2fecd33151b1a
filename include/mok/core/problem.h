// Seeded random problems: inputs, routings and output gradients for tests, the CLI and benches.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mok/core/reference.h"

namespace mok {

enum class RoutingKind {
  balanced,    // global token g takes experts (g*k + j) mod E: every expert gets the same rows
  uniform,     // k distinct experts uniformly at random
  zipf,        // k distinct experts, popularity ~ 1/rank^1.2 over a random expert order
  one_expert,  // every token takes experts 0..k-1: all rows land on rank 0, other ranks get none
  masked,      // zipf with empty slots (id -1): each slot with probability 1/4, every slot of every 5th token
};
const char* to_string(RoutingKind r);
RoutingKind parse_routing(const std::string& name);  // throws InvalidArgument

// A small deterministic generator (splitmix64), so problems are identical on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next();
  double uniform();  // [0, 1)
  double normal();   // N(0, 1), Box-Muller
 private:
  uint64_t state_;
};

// Every rank's topk_idx [R][T*k].
std::vector<std::vector<int32_t>> make_routing(const MoeDesc& desc, RoutingKind kind, uint64_t seed);

// x ~ N(0,1), weights ~ N(0, 1/fan_in), topk_w positive and summing to 1 per token. With
// bf16_values, every value is bf16-representable (what a bf16 tensor holds).
template <class Real>
ref::LayerInputs<Real> make_inputs(const MoeDesc& desc, RoutingKind kind, uint64_t seed, bool bf16_values);

// dy [R][T*H] ~ N(0,1).
template <class Real>
std::vector<std::vector<Real>> make_output_grad(const MoeDesc& desc, uint64_t seed, bool bf16_values);

}  // namespace mok
