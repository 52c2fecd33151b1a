#include "mok/core/presets.h"

#include "mok/core/error.h"

namespace mok {

MoeDesc ModelPreset::desc(int64_t ranks, int64_t tokens_per_rank) const {
  MoeDesc d;
  d.tokens_per_rank = tokens_per_rank;
  d.hidden = hidden;
  d.intermediate = intermediate;
  d.num_experts = num_experts;
  d.topk = topk;
  d.ranks = ranks;
  d.shared_intermediate = shared_intermediate;
  d.swiglu_limit = swiglu_limit;
  return d;
}

const std::vector<ModelPreset>& model_presets() {
  // name, E, H, I, k, shared I, swiglu limit. The shared expert's width follows the reference
  // system's model (one shared expert of width I), which may not be exact for every model.
  static const std::vector<ModelPreset> presets = {
      {"kimi-k2", 384, 7168, 2048, 8, 2048, std::nullopt},
      {"glm-5.2", 256, 6144, 2048, 8, 2048, std::nullopt},
      {"qwen3.5-397b", 512, 4096, 1024, 10, 1024, std::nullopt},
      {"deepseek-v4-pro", 384, 7168, 3072, 6, 3072, std::nullopt},
      {"deepseek-v3", 256, 7168, 2048, 8, 2048, std::nullopt},
      {"qwen3-30b-a3b", 128, 2048, 768, 8, 0, std::nullopt},
      {"gpt-oss-120b", 128, 2880, 2880, 4, 0, 7.0f},
      {"mixtral-8x7b", 8, 4096, 14336, 2, 0, std::nullopt},
      // Small shapes for the CPU backend, tests and smoke runs.
      {"small", 16, 512, 256, 4, 256, std::nullopt},
      {"tiny", 8, 128, 64, 2, 64, std::nullopt},
  };
  return presets;
}

const ModelPreset& find_preset(const std::string& name) {
  std::string known;
  for (const ModelPreset& p : model_presets()) {
    if (p.name == name) return p;
    known += (known.empty() ? "" : ", ") + p.name;
  }
  throw InvalidArgument("unknown preset '" + name + "'; known presets: " + known);
}

}  // namespace mok
