// The CPU reference of the MoE layer: the oracle for every GPU result and the CPU backend.
//
// It is written as the same stages the GPU runs (dispatch by the schedule, routed expert MLP on
// rows grouped by expert, combine into per-(token, j) slots, fixed-order epilogue), so each GPU
// kernel can be checked against its stage, and the whole layer over R emulated ranks composes
// them. Real is float (fp32 accumulation) or double. With Rounding::bf16, values are rounded to
// bf16 exactly where the GPU path stores bf16 (the "rounding points" below); with
// Rounding::none the layer is an exact function of its inputs (used for finite differences).
//
// Rounding points, forward:   gu = [g|u] saved for backward (bf16; with a limit, a value within
//   one bf16 step of it is saved on its own side of the limit, so the backward's clamp decision
//   is the forward's), h = act(g, u) from the
//   unrounded g, u (bf16), y_expert (bf16), y_shared (bf16), y = y_shared + sum_j w_j*y_j (bf16).
// Backward (dy unscaled; w = the row's router weight):
//   dh = dy * W_down (fp32), d w = sum_i dh[i]*h[i] (fp32),
//   dg = w*dh*u*silu'(g), du = w*dh*silu(g) from the saved bf16 g, u (bf16),
//   hw = w*h (bf16, the wgrad operand of down), dx_row = [dg|du] * [W_gate;W_up] (bf16),
//   dW_gate = dg^T x, dW_up = du^T x, dW_down = dy^T hw: fp32, reduced over the expert's rows in
//   the canonical order (never rounded), dx = dx_shared + sum_j dx_j (bf16).
// Sums over j run j = 0, 1, ..., k-1 with separate multiply and add (no fused multiply-add).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "mok/core/bf16.h"
#include "mok/core/desc.h"
#include "mok/core/schedule.h"

namespace mok::ref {

enum class Rounding { none, bf16 };

// The shape of one SwiGLU MLP (a routed expert, or the shared expert with I = Is).
struct MlpShape {
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  std::optional<float> swiglu_limit;
};

// `count` consecutive experts: gate, up [count, I, H]; down [count, H, I].
template <class Real>
struct ExpertsView {
  const Real* gate = nullptr;
  const Real* up = nullptr;
  const Real* down = nullptr;
  int64_t count = 0;
};

// Routed experts forward on rows grouped by expert: expert e's rows are [offsets[e], offsets[e+1]).
// x [M,H] in; gu [M,2I] (may be null), h [M,I], y [M,H] out. M = offsets[count].
template <class Real>
void experts_forward(const MlpShape& shape, const ExpertsView<Real>& w,
                     std::span<const int64_t> offsets, const Real* x, Real* gu, Real* h, Real* y,
                     Rounding rounding);

// experts_forward with block-scaled e4m3 GEMMs (Precision::fp8_block; mok/core/fp8.h), the
// oracle of the GPU's fp8 forward: each expert's x rows quantized 1 x 128 and its weights 128 x 128,
// g and u by fp8::gemm_nt (fp32, unrounded), gu and h as experts_forward stores them (bf16), h
// quantized 1 x 128, y = bf16(fp8::gemm_nt(h, W_down)). hidden and intermediate are multiples of
// 128; x, h finite (fp8::quantize throws otherwise).
void experts_forward_fp8(const MlpShape& shape, const ExpertsView<float>& w, std::span<const int64_t> offsets,
                         const float* x, float* gu, float* h, float* y);

// Routed experts backward on the same grouped rows. row_weight [M] is each row's router weight
// (1 for the shared expert). Out: dx [M,H]; d_row_weight [M] (may be null); d_gate, d_up
// [count,I,H] and d_down [count,H,I], overwritten (not accumulated).
template <class Real>
void experts_backward(const MlpShape& shape, const ExpertsView<Real>& w,
                      std::span<const int64_t> offsets, const Real* x, const Real* gu, const Real* h,
                      const Real* dy, const Real* row_weight, Real* dx, Real* d_row_weight,
                      Real* d_gate, Real* d_up, Real* d_down, Rounding rounding);

// experts_backward with block-scaled e4m3 data gradients (Precision::fp8_dgrad; on the GPU
// experts_dgrad_fp8, mok/cuda/fp8.h): dh = fp8::gemm_nt(dy rows quantized 1 x 128, W_down^T
// quantized 128 x 128) and dx = fp8::gemm_nt([dg|du] rows quantized 1 x 128 along 2I,
// [W_gate^T | W_up^T] quantized 128 x 128), the weights' transposes being the forward's codes
// moved (fp8::transpose); the SwiGLU backward (from dh in fp32), d_row_weight and the weight
// gradients as experts_backward computes them, at Rounding::bf16. hidden and intermediate are
// multiples of 128; dy and dg|du finite.
void experts_backward_fp8_dgrad(const MlpShape& shape, const ExpertsView<float>& w, std::span<const int64_t> offsets,
                                const float* x, const float* gu, const float* h, const float* dy,
                                const float* row_weight, float* dx, float* d_row_weight, float* d_gate, float* d_up,
                                float* d_down);

// experts_backward_fp8_dgrad with the weight gradients on block-scaled e4m3 too (the planned fp8
// weight gradients; not a layer precision yet, and no GPU kernel yet): each is fp8::gemm_nt of
// its two activations quantized along the expert's rows, the reduction (dg|du^T and x^T, dy^T and
// (w*h)^T in 1 x 128 blocks: 128 rows x 1 column of each activation), in fp32 unrounded as
// experts_backward's. hidden and intermediate are multiples of 128.
void experts_backward_fp8(const MlpShape& shape, const ExpertsView<float>& w, std::span<const int64_t> offsets,
                          const float* x, const float* gu, const float* h, const float* dy, const float* row_weight,
                          float* dx, float* d_row_weight, float* d_gate, float* d_up, float* d_down);

// Dispatch by the schedule: rows[i] = src[row.src_rank][row.src_slot / k] (width `width`), or
// zeros for padding. src holds one pointer per rank.
template <class Real>
void gather_token_rows(const RankSchedule& s, int64_t topk, int64_t width,
                       std::span<const Real* const> src, Real* rows);
// rows[i] = src[row.src_rank][row.src_slot] (per-slot values, e.g. router weights), 0 for padding.
template <class Real>
void gather_slot_values(const RankSchedule& s, std::span<const Real* const> src, Real* values);
// Combine/reverse dispatch: dst[row.src_rank][row.src_slot] = rows[i] (width `width`), padding skipped.
template <class Real>
void scatter_slot_rows(const RankSchedule& s, int64_t width, const Real* rows,
                       std::span<Real* const> dst);

// y[t] = round(y_shared[t] + sum_j topk_w[t,j] * slots[t*k+j]), y_shared may be null; the sum skips
// the empty slots (topk_idx[t*k+j] == kNoExpert: neither the slot nor its weight is read), and
// topk_idx null means none is empty.
template <class Real>
void combine_epilogue(int64_t tokens, int64_t hidden, int64_t topk, const Real* y_shared,
                      const Real* slots, const Real* topk_w, const int32_t* topk_idx, Real* y, Rounding rounding);
// dx[t] = round(dx_shared[t] + sum_j slots[t*k+j]), dx_shared may be null; empty slots skipped as above.
template <class Real>
void dispatch_grad_epilogue(int64_t tokens, int64_t hidden, int64_t topk, const Real* dx_shared,
                            const Real* slots, const int32_t* topk_idx, Real* dx, Rounding rounding);

// ---- The whole layer over R emulated ranks ----

template <class Real>
struct RoutedWeights {
  std::vector<Real> gate, up;  // [n, I, H]
  std::vector<Real> down;      // [n, H, I]
};

template <class Real>
struct SharedWeights {
  std::vector<Real> gate, up;  // [Is, H]; empty when there is no shared expert
  std::vector<Real> down;      // [H, Is]
};

template <class Real>
struct LayerInputs {
  MoeDesc desc;
  std::vector<std::vector<Real>> x;             // [R][T*H]
  std::vector<std::vector<int32_t>> topk_idx;   // [R][T*k]
  std::vector<std::vector<Real>> topk_w;        // [R][T*k]
  RoutedWeights<Real> routed;                   // all E experts; rank r owns [r*El, (r+1)*El)
  SharedWeights<Real> shared;                   // replicated on every rank
};

// What the backward needs from the forward (the "keep" mode: nothing is recomputed).
template <class Real>
struct LayerContext {
  std::vector<RankSchedule> schedules;    // per destination rank
  std::vector<std::vector<Real>> x_rows;  // per destination rank [M,H]
  std::vector<std::vector<Real>> gu;      // [M,2I]
  std::vector<std::vector<Real>> h;       // [M,I]
  std::vector<std::vector<Real>> shared_gu, shared_h;  // per rank [T,2Is], [T,Is]
};

template <class Real>
struct LayerForward {
  std::vector<std::vector<Real>> y;  // [R][T*H]
  LayerContext<Real> context;
};

template <class Real>
struct LayerGrads {
  std::vector<std::vector<Real>> dx;        // [R][T*H]
  std::vector<std::vector<Real>> d_topk_w;  // [R][T*k]
  RoutedWeights<Real> d_routed;             // all E experts
  std::vector<SharedWeights<Real>> d_shared;  // per rank (its own tokens); empty vectors if none
};

// Checks sizes, expert ids and that x, topk_w and the weights are finite; throws InvalidArgument
// naming the tensor, rank and position.
template <class Real>
void validate_inputs(const LayerInputs<Real>& in);

// The layer's forward over R emulated ranks. At desc.precision fp8_block (float, Rounding::bf16
// only) the routed and the shared experts' MLPs are experts_forward_fp8 (a rank's x rows are
// quantized per row, so where that happens, source or expert rank, changes no code); everything
// else is the bf16 forward's. So is fp8_dgrad's forward. The backward (layer_backward) is the bf16
// one at fp8_block, from the saved bf16 x rows, g|u and h and the unquantized weights: the
// quantization passes gradients straight through. At fp8_dgrad the same, but the routed and the
// shared experts' data gradients are experts_backward_fp8_dgrad's (float, Rounding::bf16 only).
template <class Real>
LayerForward<Real> layer_forward(const LayerInputs<Real>& in, Rounding rounding);

// dy [R][T*H].
template <class Real>
LayerGrads<Real> layer_backward(const LayerInputs<Real>& in, const LayerContext<Real>& ctx,
                                const std::vector<std::vector<Real>>& dy, Rounding rounding);

}  // namespace mok::ref
