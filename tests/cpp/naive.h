// An independent, naive fp64 computation of the layer: every token through each of its experts,
// one token at a time, with hand-written gradients. No schedule, no grouping, no rounding.
#pragma once

#include <cmath>
#include <vector>

#include "mok/core/reference.h"

namespace mok::test {

struct NaiveResult {
  std::vector<std::vector<double>> y, dx, d_topk_w;                  // per rank
  std::vector<double> d_gate, d_up, d_down;                          // all E experts
  std::vector<std::vector<double>> ds_gate, ds_up, ds_down;          // shared, per rank
};

// One SwiGLU MLP on one row, forward and backward. W_gate, W_up [I,H], W_down [H,I].
// Accumulates the weight gradients (scaled by `scale`) and returns dx; d_scale = <dy, y>.
inline void naive_mlp(int64_t H, int64_t I, const std::optional<float>& limit, const double* x,
                      const double* wg, const double* wu, const double* wd, double scale,
                      const double* dy, std::vector<double>& y_out /*[H], += scale*y*/,
                      std::vector<double>& dx_out /*[H], +=*/, double* d_scale, double* dwg,
                      double* dwu, double* dwd) {
  std::vector<double> g(I), u(I), h(I), y(H, 0.0);
  for (int64_t i = 0; i < I; ++i) {
    double gs = 0, us = 0;
    for (int64_t c = 0; c < H; ++c) {
      gs += wg[i * H + c] * x[c];
      us += wu[i * H + c] * x[c];
    }
    g[i] = gs;
    u[i] = us;
    const double gc = limit ? std::min(gs, double(*limit)) : gs;
    const double uc = limit ? std::clamp(us, -double(*limit), double(*limit)) : us;
    h[i] = gc / (1.0 + std::exp(-gc)) * uc;
  }
  for (int64_t c = 0; c < H; ++c) {
    for (int64_t i = 0; i < I; ++i) y[c] += wd[c * I + i] * h[i];
    y_out[c] += scale * y[c];
  }
  if (dy == nullptr) return;
  double ds = 0;
  for (int64_t c = 0; c < H; ++c) ds += dy[c] * y[c];
  if (d_scale != nullptr) *d_scale = ds;
  std::vector<double> dh(I, 0.0);
  for (int64_t i = 0; i < I; ++i) {
    for (int64_t c = 0; c < H; ++c) dh[i] += scale * dy[c] * wd[c * I + i];
    for (int64_t c = 0; c < H; ++c) dwd[c * I + i] += scale * dy[c] * h[i];
  }
  for (int64_t i = 0; i < I; ++i) {
    const bool g_passes = !limit || g[i] <= *limit;
    const bool u_passes = !limit || (u[i] <= *limit && u[i] >= -*limit);
    const double gc = limit ? std::min(g[i], double(*limit)) : g[i];
    const double uc = limit ? std::clamp(u[i], -double(*limit), double(*limit)) : u[i];
    const double sig = 1.0 / (1.0 + std::exp(-gc));
    const double dg = g_passes ? dh[i] * uc * sig * (1.0 + gc * (1.0 - sig)) : 0.0;
    const double du = u_passes ? dh[i] * gc * sig : 0.0;
    for (int64_t c = 0; c < H; ++c) {
      dx_out[c] += dg * wg[i * H + c] + du * wu[i * H + c];
      dwg[i * H + c] += dg * x[c];
      dwu[i * H + c] += du * x[c];
    }
  }
}

inline NaiveResult naive_layer(const ref::LayerInputs<double>& in,
                               const std::vector<std::vector<double>>& dy) {
  const MoeDesc& d = in.desc;
  const int64_t R = d.ranks, T = d.tokens_per_rank, H = d.hidden, I = d.intermediate, k = d.topk;
  const int64_t E = d.num_experts, Is = d.shared_intermediate;
  NaiveResult out;
  out.d_gate.assign(E * I * H, 0.0);
  out.d_up.assign(E * I * H, 0.0);
  out.d_down.assign(E * H * I, 0.0);
  for (int64_t r = 0; r < R; ++r) {
    out.y.emplace_back(T * H, 0.0);
    out.dx.emplace_back(T * H, 0.0);
    out.d_topk_w.emplace_back(T * k, 0.0);
    out.ds_gate.emplace_back(Is * H, 0.0);
    out.ds_up.emplace_back(Is * H, 0.0);
    out.ds_down.emplace_back(H * Is, 0.0);
    for (int64_t t = 0; t < T; ++t) {
      const double* x = in.x[r].data() + t * H;
      const double* g = dy[r].data() + t * H;
      std::vector<double> y(H, 0.0), dx(H, 0.0);
      if (Is > 0) {
        naive_mlp(H, Is, d.swiglu_limit, x, in.shared.gate.data(), in.shared.up.data(),
                  in.shared.down.data(), 1.0, g, y, dx, nullptr, out.ds_gate[r].data(),
                  out.ds_up[r].data(), out.ds_down[r].data());
      }
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = in.topk_idx[r][t * k + j];
        if (e == kNoExpert) continue;  // an empty slot: no term, d topk_w stays 0
        naive_mlp(H, I, d.swiglu_limit, x, in.routed.gate.data() + e * I * H,
                  in.routed.up.data() + e * I * H, in.routed.down.data() + e * H * I,
                  in.topk_w[r][t * k + j], g, y, dx, &out.d_topk_w[r][t * k + j],
                  out.d_gate.data() + e * I * H, out.d_up.data() + e * I * H,
                  out.d_down.data() + e * H * I);
      }
      std::copy(y.begin(), y.end(), out.y[r].begin() + t * H);
      std::copy(dx.begin(), dx.end(), out.dx[r].begin() + t * H);
    }
  }
  return out;
}

template <class T>
std::vector<T> flat(const std::vector<std::vector<T>>& v) {
  std::vector<T> o;
  for (const auto& p : v) o.insert(o.end(), p.begin(), p.end());
  return o;
}

// The same inputs with every value converted to another Real.
template <class To, class From>
ref::LayerInputs<To> convert(const ref::LayerInputs<From>& in) {
  ref::LayerInputs<To> o;
  o.desc = in.desc;
  o.topk_idx = in.topk_idx;
  for (const auto& v : in.x) o.x.emplace_back(v.begin(), v.end());
  for (const auto& v : in.topk_w) o.topk_w.emplace_back(v.begin(), v.end());
  o.routed.gate.assign(in.routed.gate.begin(), in.routed.gate.end());
  o.routed.up.assign(in.routed.up.begin(), in.routed.up.end());
  o.routed.down.assign(in.routed.down.begin(), in.routed.down.end());
  o.shared.gate.assign(in.shared.gate.begin(), in.shared.gate.end());
  o.shared.up.assign(in.shared.up.begin(), in.shared.up.end());
  o.shared.down.assign(in.shared.down.begin(), in.shared.down.end());
  return o;
}

}  // namespace mok::test
