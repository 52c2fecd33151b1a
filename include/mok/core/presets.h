// Model presets: the routed-expert shapes of the models MoK is measured on (DESIGN.md's table).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mok/core/desc.h"

namespace mok {

struct ModelPreset {
  std::string name;
  int64_t num_experts;          // E
  int64_t hidden;               // H
  int64_t intermediate;         // I
  int64_t topk;                 // k
  int64_t shared_intermediate;  // Is, 0 = no shared expert
  std::optional<float> swiglu_limit;

  // The descriptor for this model at R ranks and T tokens per rank.
  MoeDesc desc(int64_t ranks, int64_t tokens_per_rank) const;
};

const std::vector<ModelPreset>& model_presets();
// Throws InvalidArgument listing the known names.
const ModelPreset& find_preset(const std::string& name);

}  // namespace mok
