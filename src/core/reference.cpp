#include "mok/core/reference.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "mok/core/cpu_gemm.h"
#include "mok/core/error.h"
#include "mok/core/fp8.h"
#include "mok/core/parallel.h"

namespace mok::ref {
namespace {

template <class Real>
inline Real store(Real v, Rounding r) {
  if constexpr (std::is_same_v<Real, float>) {
    return r == Rounding::bf16 ? round_to_bf16(v) : v;
  } else {
    return r == Rounding::bf16 ? static_cast<Real>(round_to_bf16(static_cast<float>(v))) : v;
  }
}

template <class Real>
inline Real sigmoid(Real v) {
  return Real(1) / (Real(1) + std::exp(-v));
}

// The activation's inputs after the optional clamp, and which of them pass gradient.
template <class Real>
struct Clamped {
  Real g, u;
  bool g_passes, u_passes;
};

template <class Real>
inline Clamped<Real> clamp_inputs(Real g, Real u, const std::optional<float>& limit) {
  if (!limit) return {g, u, true, true};
  const Real L = static_cast<Real>(*limit);
  Clamped<Real> c{g, u, true, true};
  if (g > L) {
    c.g = L;
    c.g_passes = false;
  }
  if (u > L) {
    c.u = L;
    c.u_passes = false;
  } else if (u < -L) {
    c.u = -L;
    c.u_passes = false;
  }
  return c;
}

// g or u rounded for the backward such that the clamp decides the same from the saved value as
// from the unrounded one: a value that passes the band [lo, hi] is saved inside it, one that is
// clamped is saved outside it. A clamped value's magnitude is never used (its derivative is
// zero), and a passing value moves at most one bf16 step, so this costs no accuracy; without it,
// values within one bf16 step of the limit would flip between passing and clamped.
template <class Real>
inline Real save_for_clamp(Real v, float lo, float hi, Rounding rounding) {
  const Real saved = store(v, rounding);
  if (rounding == Rounding::none) return saved;
  const bool passes = v >= lo && v <= hi;
  if (passes == (saved >= lo && saved <= hi)) return saved;
  if (passes) return saved > hi ? static_cast<Real>(bf16_at_most(hi)) : static_cast<Real>(-bf16_at_most(-lo));
  return v > hi ? static_cast<Real>(bf16_next_above(hi)) : static_cast<Real>(-bf16_next_above(-lo));
}

void require_offsets(std::span<const int64_t> offsets, int64_t count) {
  MOK_REQUIRE(static_cast<int64_t>(offsets.size()) == count + 1, "expert offsets have ",
              offsets.size(), " entries, expected count+1=", count + 1);
  MOK_REQUIRE(count == 0 || offsets[0] == 0, "expert offsets must start at 0, got ", offsets[0]);
  for (int64_t e = 0; e < count; ++e) {
    MOK_REQUIRE(offsets[e + 1] >= offsets[e], "expert offsets must not decrease: offsets[", e + 1,
                "]=", offsets[e + 1], " < offsets[", e, "]=", offsets[e]);
  }
}

// The fp8 oracles' shape condition: hidden and intermediate are whole 128-wide scale blocks.
void require_fp8_blocks(const char* who, const MlpShape& shape) {
  MOK_REQUIRE(shape.hidden % fp8::kBlock == 0 && shape.intermediate % fp8::kBlock == 0, who,
              " needs hidden and intermediate multiples of 128 (whole scale blocks), got ", shape.hidden, " and ",
              shape.intermediate);
}

template <class Real>
void require_finite(const std::vector<Real>& v, const char* what, int64_t rank, int64_t row_width) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) {
      const int64_t w = row_width > 0 ? row_width : 1;
      throw InvalidArgument(detail::concat(what, rank >= 0 ? "[rank " + std::to_string(rank) + "]" : "",
                                           "[", static_cast<int64_t>(i) / w, "][",
                                           static_cast<int64_t>(i) % w, "] is not finite (", v[i], ")"));
    }
  }
}

template <class Real>
void require_size(const std::vector<Real>& v, int64_t expected, const char* what, int64_t rank) {
  MOK_REQUIRE(static_cast<int64_t>(v.size()) == expected, what,
              rank >= 0 ? "[rank " + std::to_string(rank) + "]" : "", " has ", v.size(),
              " elements, expected ", expected);
}


// h = act(g, u) of M rows of unrounded [g|u] (acc [M, 2I]), and the saved gu (may be null).
template <class Real>
void activate_rows(const MlpShape& shape, int64_t M, const Real* acc, Real* gu, Real* h, Rounding rounding) {
  const int64_t I = shape.intermediate;
  parallel_for(M, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const Real* a = acc + m * 2 * I;
      for (int64_t i = 0; i < I; ++i) {
        const Clamped<Real> c = clamp_inputs(a[i], a[I + i], shape.swiglu_limit);
        h[m * I + i] = store(c.g * sigmoid(c.g) * c.u, rounding);
        if (gu != nullptr) {
          if (shape.swiglu_limit) {
            const float L = *shape.swiglu_limit;
            gu[m * 2 * I + i] = save_for_clamp(a[i], -INFINITY, L, rounding);
            gu[m * 2 * I + I + i] = save_for_clamp(a[I + i], -L, L, rounding);
          } else {
            gu[m * 2 * I + i] = store(a[i], rounding);
            gu[m * 2 * I + I + i] = store(a[I + i], rounding);
          }
        }
      }
    }
  });
}
}  // namespace

template <class Real>
void experts_forward(const MlpShape& shape, const ExpertsView<Real>& w,
                     std::span<const int64_t> offsets, const Real* x, Real* gu, Real* h, Real* y,
                     Rounding rounding) {
  require_offsets(offsets, w.count);
  const int64_t H = shape.hidden, I = shape.intermediate;
  const int64_t M = w.count == 0 ? 0 : offsets[w.count];
  std::vector<Real> acc(static_cast<size_t>(M * 2 * I));  // unrounded [g|u] per row
  for (int64_t e = 0; e < w.count; ++e) {
    const int64_t m0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    cpu::gemm_nt(rows, I, H, x + m0 * H, H, w.gate + e * I * H, H, acc.data() + m0 * 2 * I, 2 * I);
    cpu::gemm_nt(rows, I, H, x + m0 * H, H, w.up + e * I * H, H, acc.data() + m0 * 2 * I + I, 2 * I);
  }
  activate_rows(shape, M, acc.data(), gu, h, rounding);
  for (int64_t e = 0; e < w.count; ++e) {
    const int64_t m0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    cpu::gemm_nt(rows, H, I, h + m0 * I, I, w.down + e * H * I, I, y + m0 * H, H);
  }
  parallel_for(M * H, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) y[i] = store(y[i], rounding);
  });
}

namespace {

// The backward's two data-gradient GEMMs of one expert over its `rows` rows, unrounded:
// dh [rows, I] = dy W_down and dx [rows, H] = [dg|du] [W_gate; W_up]. The bf16 form multiplies the
// values as they are (cpu::gemm_nt); the fp8 form (Fp8DgradGemms) quantizes both operands.
template <class Real>
struct DgradGemms {
  const MlpShape& shape;
  const ExpertsView<Real>& w;
  std::vector<Real> wt;  // one expert's transposed weights

  void dh(int64_t e, int64_t rows, const Real* dy, Real* out) {
    const int64_t H = shape.hidden, I = shape.intermediate;
    // W_down [H,I] as its transpose [I,H].
    wt.resize(static_cast<size_t>(I * H));
    cpu::transpose(H, I, w.down + e * H * I, I, wt.data(), H);
    cpu::gemm_nt(rows, I, H, dy, H, wt.data(), H, out, I);
  }
  void dx(int64_t e, int64_t rows, const Real* dgu, Real* out) {
    const int64_t H = shape.hidden, I = shape.intermediate;
    // B = [W_gate^T | W_up^T], [H, 2I].
    wt.resize(static_cast<size_t>(H * 2 * I));
    cpu::transpose(I, H, w.gate + e * I * H, H, wt.data(), 2 * I);
    cpu::transpose(I, H, w.up + e * I * H, H, wt.data() + I, 2 * I);
    cpu::gemm_nt(rows, H, 2 * I, dgu, 2 * I, wt.data(), 2 * I, out, H);
  }
};

// Block-scaled e4m3: dy's and [dg|du]'s rows quantized 1 x 128 along K (H, then 2I), the weights'
// transposes 128 x 128 (the forward's codes moved: fp8::transpose), fp8::gemm_nt.
struct Fp8DgradGemms {
  const MlpShape& shape;
  const ExpertsView<float>& w;

  void dh(int64_t e, int64_t rows, const float* dy, float* out) const {
    const int64_t H = shape.hidden, I = shape.intermediate;
    fp8::gemm_nt(fp8::quantize_activations(dy, rows, H),
                 fp8::transpose(fp8::quantize_weights(w.down + e * H * I, H, I)), out);
  }
  void dx(int64_t e, int64_t rows, const float* dgu, float* out) const {
    const int64_t H = shape.hidden, I = shape.intermediate;
    const fp8::Quantized b = fp8::concat_cols(fp8::transpose(fp8::quantize_weights(w.gate + e * I * H, I, H)),
                                              fp8::transpose(fp8::quantize_weights(w.up + e * I * H, I, H)));
    fp8::gemm_nt(fp8::quantize_activations(dgu, rows, 2 * I), b, out);
  }
};

// The weight gradients' GEMMs, reductions over an expert's rows in their (canonical) order:
// dW_gate = dg^T x, dW_up = du^T x (dgu [rows, 2I], x [rows, H]) and dW_down = dy^T (w*h). The
// bf16 form multiplies the values as they are; the fp8 form (Fp8WgradGemms) quantizes both operands.
template <class Real>
struct WgradGemms {
  std::vector<Real> at, bt;  // transposed activations: [width, rows]

  void gate_up(int64_t rows, int64_t H, int64_t I, const Real* dgu, const Real* x, Real* dg, Real* du) {
    at.resize(static_cast<size_t>(2 * I * rows));
    bt.resize(static_cast<size_t>(H * rows));
    cpu::transpose(rows, 2 * I, dgu, 2 * I, at.data(), rows);
    cpu::transpose(rows, H, x, H, bt.data(), rows);
    cpu::gemm_nt(I, H, rows, at.data(), rows, bt.data(), rows, dg, H);
    cpu::gemm_nt(I, H, rows, at.data() + I * rows, rows, bt.data(), rows, du, H);
  }
  void down(int64_t rows, int64_t H, int64_t I, const Real* dy, const Real* hw, Real* dd) {
    at.resize(static_cast<size_t>(I * rows));
    bt.resize(static_cast<size_t>(H * rows));
    cpu::transpose(rows, H, dy, H, bt.data(), rows);
    cpu::transpose(rows, I, hw, I, at.data(), rows);
    cpu::gemm_nt(H, I, rows, bt.data(), rows, at.data(), rows, dd, I);
  }
};

// Block-scaled e4m3 weight gradients: both operands quantized along the reduction, the expert's
// rows (K), i.e. each activation's transpose in 1 x 128 blocks (128 rows x 1 column of the
// activation each), then fp8::gemm_nt. The expert's rows need not be whole blocks (the last is
// partial for both operands alike); in the layer every expert's segment is (kRowAlign).
struct Fp8WgradGemms {
  std::vector<float> t;

  // The activation a [rows, cols] (row stride lda) quantized along its rows: a^T in 1 x 128 blocks.
  fp8::Quantized along_rows(int64_t rows, int64_t cols, const float* a, int64_t lda) {
    t.resize(static_cast<size_t>(cols * rows));
    cpu::transpose(rows, cols, a, lda, t.data(), rows);
    return fp8::quantize_activations(t.data(), cols, rows);
  }
  void gate_up(int64_t rows, int64_t H, int64_t I, const float* dgu, const float* x, float* dg, float* du) {
    const fp8::Quantized xq = along_rows(rows, H, x, H);
    fp8::gemm_nt(along_rows(rows, I, dgu, 2 * I), xq, dg);
    fp8::gemm_nt(along_rows(rows, I, dgu + I, 2 * I), xq, du);
  }
  void down(int64_t rows, int64_t H, int64_t I, const float* dy, const float* hw, float* dd) {
    fp8::gemm_nt(along_rows(rows, H, dy, H), along_rows(rows, I, hw, I), dd);
  }
};

template <class Real, class Gemms, class Wgrads>
void experts_backward_with(Gemms& gemms, Wgrads& wgrads, const MlpShape& shape, const ExpertsView<Real>& w,
                           std::span<const int64_t> offsets, const Real* x, const Real* gu, const Real* h,
                           const Real* dy, const Real* row_weight, Real* dx, Real* d_row_weight, Real* d_gate,
                           Real* d_up, Real* d_down, Rounding rounding) {
  require_offsets(offsets, w.count);
  const int64_t H = shape.hidden, I = shape.intermediate;
  const int64_t M = w.count == 0 ? 0 : offsets[w.count];
  std::vector<Real> dh(static_cast<size_t>(M * I));
  std::vector<Real> dgu(static_cast<size_t>(M * 2 * I));  // [dg|du] per row
  std::vector<Real> hw(static_cast<size_t>(M * I));
  for (int64_t e = 0; e < w.count; ++e) {
    const int64_t m0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    Real* dg_e = d_gate + e * I * H;
    Real* du_e = d_up + e * I * H;
    Real* dd_e = d_down + e * H * I;
    if (rows == 0) {
      std::fill(dg_e, dg_e + I * H, Real(0));
      std::fill(du_e, du_e + I * H, Real(0));
      std::fill(dd_e, dd_e + H * I, Real(0));
      continue;
    }
    gemms.dh(e, rows, dy + m0 * H, dh.data() + m0 * I);
    // SwiGLU backward per row, from the saved (rounded) g and u.
    parallel_for(rows, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t m = m0 + r;
        const Real rw = row_weight[m];
        const Real* g_u = gu + m * 2 * I;
        Real dw_acc = 0;
        for (int64_t i = 0; i < I; ++i) {
          const Real d = dh[m * I + i];
          dw_acc = dw_acc + d * h[m * I + i];
          const Clamped<Real> c = clamp_inputs(g_u[i], g_u[I + i], shape.swiglu_limit);
          const Real sig = sigmoid(c.g);
          const Real silu = c.g * sig;
          const Real dsilu = sig * (Real(1) + c.g * (Real(1) - sig));
          const Real s = rw * d;
          dgu[m * 2 * I + i] = c.g_passes ? store(s * c.u * dsilu, rounding) : Real(0);
          dgu[m * 2 * I + I + i] = c.u_passes ? store(s * silu, rounding) : Real(0);
          hw[m * I + i] = store(rw * h[m * I + i], rounding);
        }
        if (d_row_weight != nullptr) d_row_weight[m] = dw_acc;
      }
    });

    gemms.dx(e, rows, dgu.data() + m0 * 2 * I, dx + m0 * H);

    // Weight gradients: reductions over the expert's rows, in their (canonical) order.
    wgrads.gate_up(rows, H, I, dgu.data() + m0 * 2 * I, x + m0 * H, dg_e, du_e);
    wgrads.down(rows, H, I, dy + m0 * H, hw.data() + m0 * I, dd_e);
  }
  parallel_for(M * H, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dx[i] = store(dx[i], rounding);
  });
}

}  // namespace

template <class Real>
void experts_backward(const MlpShape& shape, const ExpertsView<Real>& w,
                      std::span<const int64_t> offsets, const Real* x, const Real* gu, const Real* h,
                      const Real* dy, const Real* row_weight, Real* dx, Real* d_row_weight,
                      Real* d_gate, Real* d_up, Real* d_down, Rounding rounding) {
  DgradGemms<Real> gemms{shape, w, {}};
  WgradGemms<Real> wgrads;
  experts_backward_with(gemms, wgrads, shape, w, offsets, x, gu, h, dy, row_weight, dx, d_row_weight, d_gate, d_up,
                        d_down, rounding);
}

void experts_backward_fp8_dgrad(const MlpShape& shape, const ExpertsView<float>& w, std::span<const int64_t> offsets,
                                const float* x, const float* gu, const float* h, const float* dy,
                                const float* row_weight, float* dx, float* d_row_weight, float* d_gate, float* d_up,
                                float* d_down) {
  require_fp8_blocks("experts_backward_fp8_dgrad", shape);
  Fp8DgradGemms gemms{shape, w};
  WgradGemms<float> wgrads;
  experts_backward_with(gemms, wgrads, shape, w, offsets, x, gu, h, dy, row_weight, dx, d_row_weight, d_gate, d_up,
                        d_down, Rounding::bf16);
}

void experts_backward_fp8(const MlpShape& shape, const ExpertsView<float>& w, std::span<const int64_t> offsets,
                          const float* x, const float* gu, const float* h, const float* dy, const float* row_weight,
                          float* dx, float* d_row_weight, float* d_gate, float* d_up, float* d_down) {
  require_fp8_blocks("experts_backward_fp8", shape);
  Fp8DgradGemms gemms{shape, w};
  Fp8WgradGemms wgrads;
  experts_backward_with(gemms, wgrads, shape, w, offsets, x, gu, h, dy, row_weight, dx, d_row_weight, d_gate, d_up,
                        d_down, Rounding::bf16);
}

template <class Real>
void gather_token_rows(const RankSchedule& s, int64_t topk, int64_t width,
                       std::span<const Real* const> src, Real* rows) {
  for (size_t i = 0; i < s.rows.size(); ++i) {
    const RouteRow r = s.rows[i];
    Real* out = rows + static_cast<int64_t>(i) * width;
    if (r.is_padding()) {
      std::fill(out, out + width, Real(0));
    } else {
      const Real* in = src[static_cast<size_t>(r.src_rank)] + (r.src_slot / topk) * width;
      std::copy(in, in + width, out);
    }
  }
}

template <class Real>
void gather_slot_values(const RankSchedule& s, std::span<const Real* const> src, Real* values) {
  for (size_t i = 0; i < s.rows.size(); ++i) {
    const RouteRow r = s.rows[i];
    values[i] = r.is_padding() ? Real(0) : src[static_cast<size_t>(r.src_rank)][r.src_slot];
  }
}

template <class Real>
void scatter_slot_rows(const RankSchedule& s, int64_t width, const Real* rows,
                       std::span<Real* const> dst) {
  for (size_t i = 0; i < s.rows.size(); ++i) {
    const RouteRow r = s.rows[i];
    if (r.is_padding()) continue;
    const Real* in = rows + static_cast<int64_t>(i) * width;
    std::copy(in, in + width, dst[static_cast<size_t>(r.src_rank)] + int64_t{r.src_slot} * width);
  }
}

template <class Real>
void combine_epilogue(int64_t tokens, int64_t hidden, int64_t topk, const Real* y_shared,
                      const Real* slots, const Real* topk_w, const int32_t* topk_idx, Real* y, Rounding rounding) {
  parallel_for(tokens, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t c = 0; c < hidden; ++c) {
        Real acc = y_shared != nullptr ? y_shared[t * hidden + c] : Real(0);
        for (int64_t j = 0; j < topk; ++j) {
          if (topk_idx != nullptr && topk_idx[t * topk + j] == kNoExpert) continue;
          const Real term = topk_w[t * topk + j] * slots[(t * topk + j) * hidden + c];
          acc = acc + term;
        }
        y[t * hidden + c] = store(acc, rounding);
      }
    }
  });
}

template <class Real>
void dispatch_grad_epilogue(int64_t tokens, int64_t hidden, int64_t topk, const Real* dx_shared,
                            const Real* slots, const int32_t* topk_idx, Real* dx, Rounding rounding) {
  parallel_for(tokens, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t c = 0; c < hidden; ++c) {
        Real acc = dx_shared != nullptr ? dx_shared[t * hidden + c] : Real(0);
        for (int64_t j = 0; j < topk; ++j) {
          if (topk_idx != nullptr && topk_idx[t * topk + j] == kNoExpert) continue;
          acc = acc + slots[(t * topk + j) * hidden + c];
        }
        dx[t * hidden + c] = store(acc, rounding);
      }
    }
  });
}

template <class Real>
void validate_inputs(const LayerInputs<Real>& in) {
  const MoeDesc& d = in.desc;
  d.validate();
  if (fp8_forward(d.precision)) {
    MOK_REQUIRE((std::is_same_v<Real, float>), "precision ", to_string(d.precision),
                " is computed in float (its oracle's type) only");
    MOK_REQUIRE(!d.has_shared() || d.shared_intermediate % fp8::kBlock == 0, to_string(d.precision),
                " needs shared_intermediate % 128 == 0 (128-wide scale blocks), got ", d.shared_intermediate);
  }
  const int64_t R = d.ranks, T = d.tokens_per_rank, H = d.hidden, I = d.intermediate, k = d.topk;
  MOK_REQUIRE(static_cast<int64_t>(in.x.size()) == R, "x is given for ", in.x.size(), " ranks, expected ", R);
  MOK_REQUIRE(static_cast<int64_t>(in.topk_idx.size()) == R, "topk_idx is given for ", in.topk_idx.size(),
              " ranks, expected ", R);
  MOK_REQUIRE(static_cast<int64_t>(in.topk_w.size()) == R, "topk_w is given for ", in.topk_w.size(),
              " ranks, expected ", R);
  for (int64_t r = 0; r < R; ++r) {
    require_size(in.x[r], T * H, "x", r);
    require_size(in.topk_w[r], T * k, "topk_w", r);
    validate_routing(d, r, in.topk_idx[r]);
    require_finite(in.x[r], "x", r, H);
    require_finite(in.topk_w[r], "topk_w", r, k);
  }
  require_size(in.routed.gate, d.num_experts * I * H, "w_gate", -1);
  require_size(in.routed.up, d.num_experts * I * H, "w_up", -1);
  require_size(in.routed.down, d.num_experts * H * I, "w_down", -1);
  require_finite(in.routed.gate, "w_gate", -1, H);
  require_finite(in.routed.up, "w_up", -1, H);
  require_finite(in.routed.down, "w_down", -1, I);
  const int64_t Is = d.shared_intermediate;
  require_size(in.shared.gate, Is * H, "shared w_gate", -1);
  require_size(in.shared.up, Is * H, "shared w_up", -1);
  require_size(in.shared.down, H * Is, "shared w_down", -1);
  require_finite(in.shared.gate, "shared w_gate", -1, H);
  require_finite(in.shared.up, "shared w_up", -1, H);
  require_finite(in.shared.down, "shared w_down", -1, Is);
}

template <class Real>
LayerForward<Real> layer_forward(const LayerInputs<Real>& in, Rounding rounding) {
  validate_inputs(in);
  const MoeDesc& d = in.desc;
  const int64_t R = d.ranks, T = d.tokens_per_rank, H = d.hidden, I = d.intermediate, k = d.topk;
  const int64_t El = d.local_experts(), Is = d.shared_intermediate;
  const MlpShape routed_shape{H, I, d.swiglu_limit};
  const MlpShape shared_shape{H, Is, d.swiglu_limit};

  std::vector<const int32_t*> idx;
  std::vector<const Real*> x_ptrs;
  for (int64_t r = 0; r < R; ++r) {
    idx.push_back(in.topk_idx[r].data());
    x_ptrs.push_back(in.x[r].data());
  }

  // The experts' MLP at the layer's precision: bf16, or block-scaled e4m3 GEMMs
  // (experts_forward_fp8: float, bf16 rounding points) for the routed and the shared experts.
  const bool fp8 = fp8_forward(d.precision);
  MOK_REQUIRE(!fp8 || rounding == Rounding::bf16, "precision ", to_string(d.precision),
              " has the GPU's rounding points: call it with Rounding::bf16");
  auto experts_mlp = [&](const MlpShape& shape, const ExpertsView<Real>& w, std::span<const int64_t> offsets,
                         const Real* x, Real* gu, Real* h, Real* y) {
    if constexpr (std::is_same_v<Real, float>) {
      if (fp8) return experts_forward_fp8(shape, w, offsets, x, gu, h, y);
    }
    experts_forward(shape, w, offsets, x, gu, h, y, rounding);
  };

  LayerForward<Real> out;
  LayerContext<Real>& ctx = out.context;
  ctx.schedules = build_schedules(d, idx);
  std::vector<std::vector<Real>> combine(static_cast<size_t>(R), std::vector<Real>(static_cast<size_t>(T * k * H)));
  std::vector<Real*> combine_ptrs;
  for (auto& c : combine) combine_ptrs.push_back(c.data());

  for (int64_t dst = 0; dst < R; ++dst) {
    const RankSchedule& s = ctx.schedules[dst];
    const int64_t M = s.padded_rows();
    auto& x_rows = ctx.x_rows.emplace_back(static_cast<size_t>(M * H));
    auto& gu = ctx.gu.emplace_back(static_cast<size_t>(M * 2 * I));
    auto& h = ctx.h.emplace_back(static_cast<size_t>(M * I));
    std::vector<Real> y_rows(static_cast<size_t>(M * H));
    gather_token_rows<Real>(s, k, H, x_ptrs, x_rows.data());
    const ExpertsView<Real> w{in.routed.gate.data() + dst * El * I * H,
                              in.routed.up.data() + dst * El * I * H,
                              in.routed.down.data() + dst * El * H * I, El};
    experts_mlp(routed_shape, w, s.expert_offsets, x_rows.data(), gu.data(), h.data(), y_rows.data());
    scatter_slot_rows<Real>(s, H, y_rows.data(), combine_ptrs);
  }

  for (int64_t r = 0; r < R; ++r) {
    auto& y = out.y.emplace_back(static_cast<size_t>(T * H));
    std::vector<Real> y_shared;
    if (d.has_shared()) {
      auto& sgu = ctx.shared_gu.emplace_back(static_cast<size_t>(T * 2 * Is));
      auto& sh = ctx.shared_h.emplace_back(static_cast<size_t>(T * Is));
      y_shared.resize(static_cast<size_t>(T * H));
      const std::vector<int64_t> offsets{0, T};
      const ExpertsView<Real> sw{in.shared.gate.data(), in.shared.up.data(), in.shared.down.data(), 1};
      experts_mlp(shared_shape, sw, offsets, in.x[r].data(), sgu.data(), sh.data(), y_shared.data());
    }
    combine_epilogue(T, H, k, d.has_shared() ? y_shared.data() : nullptr, combine[r].data(),
                     in.topk_w[r].data(), in.topk_idx[r].data(), y.data(), rounding);
  }
  return out;
}

template <class Real>
LayerGrads<Real> layer_backward(const LayerInputs<Real>& in, const LayerContext<Real>& ctx,
                                const std::vector<std::vector<Real>>& dy, Rounding rounding) {
  const MoeDesc& d = in.desc;
  const int64_t R = d.ranks, T = d.tokens_per_rank, H = d.hidden, I = d.intermediate, k = d.topk;
  const int64_t El = d.local_experts(), Is = d.shared_intermediate;
  MOK_REQUIRE(static_cast<int64_t>(dy.size()) == R, "dy is given for ", dy.size(), " ranks, expected ", R);
  MOK_REQUIRE(static_cast<int64_t>(ctx.schedules.size()) == R, "the forward context has ",
              ctx.schedules.size(), " ranks, expected ", R);
  for (int64_t r = 0; r < R; ++r) {
    require_size(dy[r], T * H, "dy", r);
    require_finite(dy[r], "dy", r, H);
  }
  const MlpShape routed_shape{H, I, d.swiglu_limit};
  const MlpShape shared_shape{H, Is, d.swiglu_limit};
  // The experts' backward at the layer's precision: bf16, or fp8_dgrad's e4m3 data gradients
  // (experts_backward_fp8_dgrad: float, bf16 rounding points) for the routed and the shared experts.
  const bool fp8 = fp8_dgrad(d.precision);
  MOK_REQUIRE(!fp8 || rounding == Rounding::bf16, "precision ", to_string(d.precision),
              " has the GPU's rounding points: call it with Rounding::bf16");
  auto experts_bwd = [&](const MlpShape& shape, const ExpertsView<Real>& w, std::span<const int64_t> offsets,
                         const Real* x, const Real* gu, const Real* h, const Real* dy_rows, const Real* row_w,
                         Real* dx_rows, Real* dw_rows, Real* d_gate, Real* d_up, Real* d_down) {
    if constexpr (std::is_same_v<Real, float>) {
      if (fp8)
        return experts_backward_fp8_dgrad(shape, w, offsets, x, gu, h, dy_rows, row_w, dx_rows, dw_rows, d_gate, d_up,
                                          d_down);
    }
    experts_backward(shape, w, offsets, x, gu, h, dy_rows, row_w, dx_rows, dw_rows, d_gate, d_up, d_down, rounding);
  };

  LayerGrads<Real> g;
  g.d_routed.gate.resize(static_cast<size_t>(d.num_experts * I * H));
  g.d_routed.up.resize(static_cast<size_t>(d.num_experts * I * H));
  g.d_routed.down.resize(static_cast<size_t>(d.num_experts * H * I));
  std::vector<std::vector<Real>> dx_slots(static_cast<size_t>(R), std::vector<Real>(static_cast<size_t>(T * k * H)));
  g.d_topk_w.assign(static_cast<size_t>(R), std::vector<Real>(static_cast<size_t>(T * k)));
  std::vector<Real*> dx_slot_ptrs, dw_ptrs;
  std::vector<const Real*> dy_ptrs, w_ptrs;
  for (int64_t r = 0; r < R; ++r) {
    dx_slot_ptrs.push_back(dx_slots[r].data());
    dw_ptrs.push_back(g.d_topk_w[r].data());
    dy_ptrs.push_back(dy[r].data());
    w_ptrs.push_back(in.topk_w[r].data());
  }

  for (int64_t dst = 0; dst < R; ++dst) {
    const RankSchedule& s = ctx.schedules[dst];
    const int64_t M = s.padded_rows();
    std::vector<Real> dy_rows(static_cast<size_t>(M * H)), row_w(static_cast<size_t>(M));
    std::vector<Real> dx_rows(static_cast<size_t>(M * H)), dw_rows(static_cast<size_t>(M));
    gather_token_rows<Real>(s, k, H, dy_ptrs, dy_rows.data());
    gather_slot_values<Real>(s, w_ptrs, row_w.data());
    const ExpertsView<Real> w{in.routed.gate.data() + dst * El * I * H,
                              in.routed.up.data() + dst * El * I * H,
                              in.routed.down.data() + dst * El * H * I, El};
    experts_bwd(routed_shape, w, s.expert_offsets, ctx.x_rows[dst].data(), ctx.gu[dst].data(), ctx.h[dst].data(),
                dy_rows.data(), row_w.data(), dx_rows.data(), dw_rows.data(), g.d_routed.gate.data() + dst * El * I * H,
                g.d_routed.up.data() + dst * El * I * H, g.d_routed.down.data() + dst * El * H * I);
    scatter_slot_rows<Real>(s, H, dx_rows.data(), dx_slot_ptrs);
    scatter_slot_rows<Real>(s, 1, dw_rows.data(), dw_ptrs);
  }

  for (int64_t r = 0; r < R; ++r) {
    auto& dx = g.dx.emplace_back(static_cast<size_t>(T * H));
    auto& ds = g.d_shared.emplace_back();
    std::vector<Real> dx_shared;
    if (d.has_shared()) {
      ds.gate.resize(static_cast<size_t>(Is * H));
      ds.up.resize(static_cast<size_t>(Is * H));
      ds.down.resize(static_cast<size_t>(H * Is));
      dx_shared.resize(static_cast<size_t>(T * H));
      const std::vector<Real> ones(static_cast<size_t>(T), Real(1));
      const std::vector<int64_t> offsets{0, T};
      const ExpertsView<Real> sw{in.shared.gate.data(), in.shared.up.data(), in.shared.down.data(), 1};
      experts_bwd(shared_shape, sw, offsets, in.x[r].data(), ctx.shared_gu[r].data(), ctx.shared_h[r].data(),
                  dy[r].data(), ones.data(), dx_shared.data(), static_cast<Real*>(nullptr), ds.gate.data(),
                  ds.up.data(), ds.down.data());
    }
    dispatch_grad_epilogue(T, H, k, d.has_shared() ? dx_shared.data() : nullptr, dx_slots[r].data(),
                           in.topk_idx[r].data(), dx.data(), rounding);
  }
  return g;
}

void experts_forward_fp8(const MlpShape& shape, const ExpertsView<float>& w, std::span<const int64_t> offsets,
                         const float* x, float* gu, float* h, float* y) {
  require_offsets(offsets, w.count);
  require_fp8_blocks("experts_forward_fp8", shape);
  const int64_t H = shape.hidden, I = shape.intermediate;
  const int64_t M = w.count == 0 ? 0 : offsets[w.count];
  std::vector<float> acc(static_cast<size_t>(M * 2 * I));  // unrounded [g|u] per row
  std::vector<float> part;
  for (int64_t e = 0; e < w.count; ++e) {
    const int64_t m0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    const fp8::Quantized xq = fp8::quantize_activations(x + m0 * H, rows, H);
    part.resize(static_cast<size_t>(rows * I));
    for (int plane = 0; plane < 2; ++plane) {
      fp8::gemm_nt(xq, fp8::quantize_weights((plane == 0 ? w.gate : w.up) + e * I * H, I, H), part.data());
      for (int64_t m = 0; m < rows; ++m)
        std::copy_n(part.data() + m * I, I, acc.data() + (m0 + m) * 2 * I + plane * I);
    }
  }
  activate_rows(shape, M, acc.data(), gu, h, Rounding::bf16);
  for (int64_t e = 0; e < w.count; ++e) {
    const int64_t m0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    fp8::gemm_nt(fp8::quantize_activations(h + m0 * I, rows, I), fp8::quantize_weights(w.down + e * H * I, H, I),
                 y + m0 * H);
  }
  for (int64_t i = 0; i < M * H; ++i) y[i] = store(y[i], Rounding::bf16);
}

#define MOK_INSTANTIATE_REFERENCE(Real)                                                            \
  template void experts_forward<Real>(const MlpShape&, const ExpertsView<Real>&,                   \
                                      std::span<const int64_t>, const Real*, Real*, Real*, Real*,  \
                                      Rounding);                                                   \
  template void experts_backward<Real>(const MlpShape&, const ExpertsView<Real>&,                  \
                                       std::span<const int64_t>, const Real*, const Real*,         \
                                       const Real*, const Real*, const Real*, Real*, Real*, Real*, \
                                       Real*, Real*, Rounding);                                    \
  template void gather_token_rows<Real>(const RankSchedule&, int64_t, int64_t,                     \
                                        std::span<const Real* const>, Real*);                      \
  template void gather_slot_values<Real>(const RankSchedule&, std::span<const Real* const>, Real*); \
  template void scatter_slot_rows<Real>(const RankSchedule&, int64_t, const Real*,                 \
                                        std::span<Real* const>);                                   \
  template void combine_epilogue<Real>(int64_t, int64_t, int64_t, const Real*, const Real*,        \
                                       const Real*, const int32_t*, Real*, Rounding);              \
  template void dispatch_grad_epilogue<Real>(int64_t, int64_t, int64_t, const Real*, const Real*,  \
                                             const int32_t*, Real*, Rounding);                     \
  template void validate_inputs<Real>(const LayerInputs<Real>&);                                   \
  template LayerForward<Real> layer_forward<Real>(const LayerInputs<Real>&, Rounding);             \
  template LayerGrads<Real> layer_backward<Real>(const LayerInputs<Real>&, const LayerContext<Real>&, \
                                                 const std::vector<std::vector<Real>>&, Rounding);

MOK_INSTANTIATE_REFERENCE(float)
MOK_INSTANTIATE_REFERENCE(double)

}  // namespace mok::ref
