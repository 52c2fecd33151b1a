// MoeDesc: the problem an MoE layer poses, per rank of the expert-parallel group.
//
// Per rank r of R: x[T,H] bf16, topk_idx[T,k] (global expert ids), topk_w[T,k] fp32; rank r owns
// the routed experts [r*E/R, (r+1)*E/R): w_gate[El,I,H], w_up[El,I,H], w_down[El,H,I]; an optional
// shared expert of width Is replicated on every rank: s_gate[Is,H], s_up[Is,H], s_down[H,Is].
//   y[t] = shared(x[t]) + sum_j topk_w[t,j] * expert_{topk_idx[t,j]}(x[t])
// An id of -1 (kNoExpert) leaves slot (t, j) empty: it adds nothing to y and its d topk_w is 0 (its
// topk_w is checked finite like every other, but never multiplied): tokens routed to fewer than k
// experts, such as masked, dropped or padding tokens.
//   expert(x) = down(act(gate x, up x)),  act(g, u) = silu(g) * u
// With a SwiGLU limit L (gpt-oss style): act(g, u) = silu(min(g, L)) * clamp(u, -L, L).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "mok/core/expert_id.h"

namespace mok {

enum class Precision {
  bf16,       // bf16 operands, fp32 accumulation
  fp8_block,  // the experts' forward GEMMs in e4m3 with Hopper block scaling (1x128 activations,
              // 128x128 weights); the backward is bf16 (reference.h: layer_forward)
  fp8_dgrad,  // fp8_block's forward, and the backward's two data-gradient GEMMs (dh = dy W_down,
              // dx = [dg|du] [W_gate; W_up]) in e4m3 too (1x128 dy and dg|du, the weights'
              // 128x128 transposes); the weight gradients bf16 (reference.h: layer_backward)
};

// Whether the experts' forward runs on e4m3 (fp8_block and fp8_dgrad), and whether their data
// gradients do too (fp8_dgrad).
inline bool fp8_forward(Precision p) { return p != Precision::bf16; }
inline bool fp8_dgrad(Precision p) { return p == Precision::fp8_dgrad; }

const char* to_string(Precision p);
Precision parse_precision(const std::string& name);  // throws InvalidArgument

struct MoeDesc {
  int64_t tokens_per_rank = 0;      // T, any T >= 0
  int64_t hidden = 0;               // H
  int64_t intermediate = 0;         // I, of each routed expert
  int64_t num_experts = 0;          // E, routed experts over all ranks
  int64_t topk = 1;                 // k
  int64_t ranks = 1;                // R, the expert-parallel group size; divides E
  int64_t shared_intermediate = 0;  // Is, 0 = no shared expert
  std::optional<float> swiglu_limit;
  Precision precision = Precision::bf16;

  int64_t local_experts() const { return num_experts / ranks; }
  bool has_shared() const { return shared_intermediate > 0; }
  // Routed (token, j) pairs this rank sends out: T*k.
  int64_t routed_slots() const { return tokens_per_rank * topk; }

  // Throws InvalidArgument naming the first bad field and its value.
  void validate() const;
  // One line, e.g. "T=2048 H=7168 I=2048 E=384 k=8 R=2 shared=2048 limit=none bf16".
  std::string to_string() const;

  bool operator==(const MoeDesc&) const = default;
};

}  // namespace mok
