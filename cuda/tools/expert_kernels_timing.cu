// Development timing of the expert kernels, one GEMM at a time, next to cuBLAS on the dense GEMM
// of the same total shape (the per-shape ceiling). Not a test and not the benchmark of record
// (that is bench/, against torch._grouped_mm in the same process); this answers "which kernel,
// how far from dense" while tuning.
//   expert_kernels_timing [H I experts rows_per_expert]...   (defaults: a few preset shapes)
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "mok/cuda/expert_kernels.h"
#include "mok/cuda/fp8.h"
#include "timing_util.h"

namespace {

// The mean times of two calls over 4 rounds, alternating which runs first (the clocks drift
// under the power cap).
template <class A, class B>
std::pair<float, float> alternating_ms(A a, B b, int iters) {
  float ta = 0, tb = 0;
  for (int r = 0; r < 4; ++r) {
    if (r % 2 == 0) ta += time_ms(a, iters) / 4;
    tb += time_ms(b, iters) / 4;
    if (r % 2 == 1) ta += time_ms(a, iters) / 4;
  }
  return {ta, tb};
}

// call() with the environment variable `name` set to `value`, unset again after (the fp8 kernels'
// switches are read at each call: same-process A/Bs).
template <class Call>
void with_env(const char* name, const char* value, Call&& call) {
  setenv(name, value, 1);
  call();
  unsetenv(name);
}

// call() with the fp8 switch `name` on and off, rounds alternating: {on ms, off ms}.
template <class Call>
std::pair<float, float> switch_ab(const char* name, Call&& call, int iters) {
  return alternating_ms([&] { with_env(name, "on", call); }, [&] { with_env(name, "off", call); }, iters);
}

// cuBLASLt's dense e4m3 GEMM C[m, n] = A[m, k] B[n, k]^T (row-major, bf16 out, unit scales): the
// fp8 ceiling beside which the block-scaled grouped GEMMs are read. Returns its ms, or -1 when
// cuBLASLt has no algorithm for it.
float cublaslt_fp8_ms(const uint8_t* a, const uint8_t* b, void* c, int64_t m, int64_t n, int64_t k, int iters) {
  cublasLtHandle_t lt;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) return -1;
  cublasLtMatmulDesc_t op;
  cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt));
  // Column-major: C^T [n, m] = (B as k x n)^T (A as k x m): fp8 wants this "TN" form.
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, n, k);
  cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, m, k);
  cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, m, n);
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  size_t workspace_bytes = size_t{64} << 20;
  void* workspace = nullptr;
  CHECK_CUDA(cudaMalloc(&workspace, workspace_bytes));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                       sizeof(workspace_bytes));
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  float ms = -1;
  if (cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heuristic, &found) == CUBLAS_STATUS_SUCCESS &&
      found > 0) {
    const float one = 1.0f, zero = 0.0f;
    ms = time_ms([&] {
      cublasLtMatmul(lt, op, &one, b, la, a, lb, &zero, c, lc, c, lc, &heuristic.algo, workspace, workspace_bytes,
                     nullptr);
    }, iters);
  }
  cudaFree(workspace);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(lt);
  return ms;
}

void run(int64_t H, int64_t I, int64_t El, int64_t rows_per_expert, cublasHandle_t blas) {
  const int64_t seg = (rows_per_expert + 127) / 128 * 128;
  const int64_t M = seg * El;
  std::vector<int32_t> offsets(El + 1);
  for (int64_t e = 0; e <= El; ++e) offsets[e] = int32_t(e * seg);
  uint16_t *x, *wg, *wu, *wd, *gu, *h, *y;
  int32_t *off, *status;
  CHECK_CUDA(cudaMalloc(&x, M * H * 2));
  CHECK_CUDA(cudaMalloc(&wg, El * I * H * 2));
  CHECK_CUDA(cudaMalloc(&wu, El * I * H * 2));
  CHECK_CUDA(cudaMalloc(&wd, El * H * I * 2));
  CHECK_CUDA(cudaMalloc(&gu, M * 2 * I * 2));
  CHECK_CUDA(cudaMalloc(&h, M * I * 2));
  CHECK_CUDA(cudaMalloc(&y, M * H * 2));
  CHECK_CUDA(cudaMalloc(&off, (El + 1) * 4));
  CHECK_CUDA(cudaMalloc(&status, 4));
  CHECK_CUDA(cudaMemset(status, 0, 4));
  CHECK_CUDA(cudaMemcpy(off, offsets.data(), (El + 1) * 4, cudaMemcpyHostToDevice));
  fill_random(x, M * H, 1, 1.0f);
  fill_random(wg, El * I * H, 2, 0.02f);
  fill_random(wu, El * I * H, 3, 0.02f);
  fill_random(wd, El * H * I, 4, 0.02f);
  mok::cuda::ExpertsForwardArgs a;
  a.row_capacity = M;
  a.hidden = H;
  a.intermediate = I;
  a.local_experts = El;
  a.expert_offsets = off;
  a.x = x;
  a.w_gate = wg;
  a.w_up = wu;
  a.w_down = wd;
  a.gu = gu;
  a.h = h;
  a.y = y;
  a.status = status;
  const int iters = 20;
  const double f_gate_up = 2.0 * M * 2 * I * H, f_down = 2.0 * M * H * I;
  const float t_gu = time_ms([&] { mok::cuda::gate_up_swiglu(a, nullptr); }, iters);
  a.gu = nullptr;
  const float t_gu_nosave = time_ms([&] { mok::cuda::gate_up_swiglu(a, nullptr); }, iters);
  const float t_down = time_ms([&] { mok::cuda::down_projection(a, nullptr); }, iters);
  // cuBLAS on the dense GEMMs of the same total shape: C[M, N] = A[M, K] B[N, K]^T (row-major).
  const float one = 1.0f, zero = 0.0f;
  auto dense = [&](const void* A, const void* B, void* C, int64_t m, int64_t n, int64_t k) {
    cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &one, B, CUDA_R_16BF, int(k), A, CUDA_R_16BF,
                 int(k), &zero, C, CUDA_R_16BF, int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  // Gate|up as one dense [M, 2I] GEMM needs a [2I, H] weight: gate and up are consecutive in
  // memory only per expert, so use gate's buffer twice as big: time the shape, not the values.
  uint16_t* w2;
  CHECK_CUDA(cudaMalloc(&w2, 2 * I * H * 2));
  const float c_gu = time_ms([&] { dense(x, w2, gu, M, 2 * I, H); }, iters);
  const float c_down = time_ms([&] { dense(h, wd, y, M, H, I); }, iters);
  // The fp8 forward (block-scaled e4m3, experts_forward_fp8) against the bf16 forward of the same
  // rows, both timed here; x and the weights quantized once, outside the timing (h's quantization
  // is inside: the launcher runs it between its GEMMs).
  if (H % 128 == 0 && I % 128 == 0) {
    uint8_t *xq, *wgq, *wuq, *wdq, *hq;
    float *xs, *wgs, *wus, *wds, *hs;
    CHECK_CUDA(cudaMalloc(&xq, M * H));
    CHECK_CUDA(cudaMalloc(&wgq, El * I * H));
    CHECK_CUDA(cudaMalloc(&wuq, El * I * H));
    CHECK_CUDA(cudaMalloc(&wdq, El * H * I));
    CHECK_CUDA(cudaMalloc(&hq, M * I));
    CHECK_CUDA(cudaMalloc(&xs, H / 128 * M * 4));
    CHECK_CUDA(cudaMalloc(&wgs, El * (I / 128) * (H / 128) * 4));
    CHECK_CUDA(cudaMalloc(&wus, El * (I / 128) * (H / 128) * 4));
    CHECK_CUDA(cudaMalloc(&wds, El * (I / 128) * (H / 128) * 4));
    CHECK_CUDA(cudaMalloc(&hs, I / 128 * M * 4));
    mok::cuda::quantize_rows_e4m3_k_major(x, M, H, xq, xs, nullptr, nullptr);
    mok::cuda::quantize_blocks_e4m3(wg, El, I, H, wgq, wgs, nullptr);
    mok::cuda::quantize_blocks_e4m3(wu, El, I, H, wuq, wus, nullptr);
    mok::cuda::quantize_blocks_e4m3(wd, El, H, I, wdq, wds, nullptr);
    mok::cuda::ExpertsForwardFp8Args f;
    f.row_capacity = M;
    f.hidden = H;
    f.intermediate = I;
    f.local_experts = El;
    f.expert_offsets = off;
    f.x = xq;
    f.x_scales = xs;
    f.w_gate = wgq;
    f.w_gate_scales = wgs;
    f.w_up = wuq;
    f.w_up_scales = wus;
    f.w_down = wdq;
    f.w_down_scales = wds;
    f.gu = gu;
    f.h = h;
    f.h_codes = hq;
    f.h_scales = hs;
    f.y = y;
    f.status = status;
    a.gu = gu;
    const auto [t_fp8, t_bf16] = alternating_ms([&] { mok::cuda::experts_forward_fp8(f, nullptr); },
                                                [&] { mok::cuda::experts_forward(a, nullptr); }, iters);
    std::printf("    forward fp8 (block-scaled e4m3) %7.3f ms %6.1f TF/s | bf16 %7.3f ms %6.1f TF/s | fp8/bf16 speed %.3fx\n",
                t_fp8, 3 * f_down / t_fp8 / 1e9, t_bf16, 3 * f_down / t_bf16 / 1e9, t_bf16 / t_fp8);
    // The fp8 GEMMs in clusters of two (the default) against single CTAs (MOK_FP8_CLUSTER=off),
    // rounds alternating.
    {
      const auto [t_on, t_off] =
          switch_ab("MOK_FP8_CLUSTER", [&] { mok::cuda::experts_forward_fp8(f, nullptr); }, iters);
      const auto [g_on, g_off] =
          switch_ab("MOK_FP8_CLUSTER", [&] { mok::cuda::experts_gate_up_fp8(f, nullptr); }, iters);
      std::printf("      fp8 clusters of two: forward %7.3f ms (single CTAs %7.3f, %.3fx) | gate|up %7.3f ms %6.1f TF/s "
                  "(single CTAs %7.3f, %.3fx)\n",
                  t_on, t_off, t_off / t_on, g_on, f_gate_up / g_on / 1e9, g_off, g_off / g_on);
    }
    // cuBLASLt's dense e4m3 GEMMs of the same total shapes (gate|up as [M, 2I] from a [2I, H]
    // weight: W_gate's codes read as one matrix when El >= 2; the shape is timed, not the values).
    if (El >= 2) {
      const float l_gu = cublaslt_fp8_ms(xq, wgq, gu, M, 2 * I, H, iters), l_down = cublaslt_fp8_ms(hq, wdq, y, M, H, I, iters);
      std::printf("      cuBLASLt dense e4m3 (unit scales): gate|up %6.1f TF/s | down %6.1f TF/s\n",
                  l_gu > 0 ? f_gate_up / l_gu / 1e9 : 0.0, l_down > 0 ? f_down / l_down / 1e9 : 0.0);
    }
    // Its parts: the gate|up GEMM alone, h's quantization alone, and down as the rest.
    const float t8_gu = time_ms([&] { mok::cuda::experts_gate_up_fp8(f, nullptr); }, iters);
    const float t8_q = time_ms([&] { mok::cuda::quantize_rows_e4m3_k_major(h, M, I, hq, hs, off + El, nullptr); }, iters);
    const float t8_down = t_fp8 - t8_gu - t8_q;
    std::printf("      fp8 gate|up %7.3f ms %6.1f TF/s | h quantized %6.3f ms | down (the rest) %7.3f ms %6.1f TF/s\n",
                t8_gu, f_gate_up / t8_gu / 1e9, t8_q, t8_down, f_down / t8_down / 1e9);
    // The weights' quantization, which training pays at every step (the weights change): the
    // forward's codes of all three, and with them, in the same pass, fp8_dgrad's transposes.
    {
      const double w_elems = 3.0 * El * I * H;
      const float t_codes = time_ms([&] {
        mok::cuda::quantize_blocks_e4m3(wg, El, I, H, wgq, wgs, nullptr);
        mok::cuda::quantize_blocks_e4m3(wu, El, I, H, wuq, wus, nullptr);
        mok::cuda::quantize_blocks_e4m3(wd, El, H, I, wdq, wds, nullptr);
      }, iters);
      uint8_t *wdt, *wgut;
      float *wdts, *wguts;
      CHECK_CUDA(cudaMalloc(&wdt, El * I * H));
      CHECK_CUDA(cudaMalloc(&wgut, El * H * 2 * I));
      CHECK_CUDA(cudaMalloc(&wdts, El * (I / 128) * (H / 128) * 4));
      CHECK_CUDA(cudaMalloc(&wguts, El * (H / 128) * (2 * I / 128) * 4));
      const float t_both = time_ms([&] {
        mok::cuda::quantize_blocks_e4m3_transposed(wd, El, H, I, wdq, wds, wdt, wdts, H, 0, nullptr);
        mok::cuda::quantize_blocks_e4m3_transposed(wg, El, I, H, wgq, wgs, wgut, wguts, 2 * I, 0, nullptr);
        mok::cuda::quantize_blocks_e4m3_transposed(wu, El, I, H, wuq, wus, wgut, wguts, 2 * I, I, nullptr);
      }, iters);
      const float t_t = time_ms([&] { mok::cuda::quantize_dgrad_weights(wg, wu, wd, El, H, I, wdt, wdts, wgut, wguts, nullptr); },
                                iters);
      std::printf("      weights quantized (3 x %lld x %lld x %lld): codes %6.3f ms (%5.0f GB/s) | transposes alone %6.3f ms "
                  "(%5.0f GB/s) | codes and transposes in one pass %6.3f ms (%5.0f GB/s)\n",
                  (long long)El, (long long)I, (long long)H, t_codes, 3.0 * w_elems / t_codes / 1e6, t_t,
                  3.0 * w_elems / t_t / 1e6, t_both, 4.0 * w_elems / t_both / 1e6);
      for (void* q : {(void*)wdt, (void*)wgut, (void*)wdts, (void*)wguts}) cudaFree(q);
    }
    for (void* q : {(void*)xq, (void*)wgq, (void*)wuq, (void*)wdq, (void*)hq, (void*)xs, (void*)wgs, (void*)wus, (void*)wds, (void*)hs})
      cudaFree(q);
  }
  // Backward: dgrad (down + SwiGLU, gate|up) and the three weight gradients.
  uint16_t *dgu, *hw, *dx;
  float *rw, *partial, *ddw, *dWg, *dWu, *dWd;
  const int64_t blocks = mok::cuda::dw_partial_blocks(I);
  CHECK_CUDA(cudaMalloc(&dgu, M * 2 * I * 2));
  CHECK_CUDA(cudaMalloc(&hw, M * I * 2));
  CHECK_CUDA(cudaMalloc(&dx, M * H * 2));
  CHECK_CUDA(cudaMalloc(&rw, M * 4));
  CHECK_CUDA(cudaMalloc(&partial, M * blocks * 4));
  CHECK_CUDA(cudaMalloc(&ddw, M * 4));
  CHECK_CUDA(cudaMalloc(&dWg, El * I * H * 4));
  CHECK_CUDA(cudaMalloc(&dWu, El * I * H * 4));
  CHECK_CUDA(cudaMalloc(&dWd, El * H * I * 4));
  {  // the router weights of top-8 (zeros would zero dg|du and hw, the weight gradients' operands,
     // and zero operands draw less power: faster clocks than real data)
    const std::vector<float> w(M, 0.125f);
    CHECK_CUDA(cudaMemcpy(rw, w.data(), M * 4, cudaMemcpyHostToDevice));
  }
  mok::cuda::ExpertsBackwardArgs b;
  b.row_capacity = M;
  b.hidden = H;
  b.intermediate = I;
  b.local_experts = El;
  b.expert_offsets = off;
  b.x = x;
  b.gu = gu;
  b.h = h;
  b.dy = y;
  b.row_weight = rw;
  b.w_gate = wg;
  b.w_up = wu;
  b.w_down = wd;
  b.dgu = dgu;
  b.hw = hw;
  b.dw_partial = partial;
  b.dx = dx;
  b.d_row_weight = ddw;
  b.d_w_gate = dWg;
  b.d_w_up = dWu;
  b.d_w_down = dWd;
  b.status = status;
  // MOK_TIMING_DW=bf16: bf16 weight gradients (what the layer writes for bf16 weights), else fp32.
  const char* dw = std::getenv("MOK_TIMING_DW");
  const bool dw_bf16 = dw != nullptr && std::string(dw) == "bf16";
  if (dw_bf16) b.d_w_type = mok::cuda::GradType::bf16;
  const float t_bwd = time_ms([&] { mok::cuda::experts_backward(b, nullptr); }, 10);
  std::printf("    backward (dgrad + wgrad, %s weight gradients) %7.3f ms %6.1f TF/s\n", dw_bf16 ? "bf16" : "fp32",
              t_bwd, 12.0 * M * H * I / t_bwd / 1e9);
  // Its two halves apart, and the weight gradients' ceiling: cuBLAS's strided-batched GEMM of the
  // same three products (one GEMM per expert over its seg rows, K = seg: the short-K shape of
  // many local experts), written in the same type. Column-major views of the row-major buffers:
  // dW_gate[e] (I x H row-major) = dg^T x is, column-major, H x I = x^T dg.
  const float t_dgrad = time_ms([&] { mok::cuda::experts_dgrad(b, nullptr); }, 10);
  // The weight gradients' turns (the default) against the cooperative epilogue (both warpgroups
  // reduce, then both store), in 3 rounds alternating which runs first.
  std::vector<float> wg_times[2];
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 2; ++i) {
      const int v = (i + round) % 2;
      if (v == 1) setenv("MOK_EXPERT_SCHEDULE", "cooperative", 1);
      wg_times[v].push_back(time_ms([&] { mok::cuda::experts_wgrad(b, nullptr); }, 10));
      unsetenv("MOK_EXPERT_SCHEDULE");
    }
  }
  for (auto& w : wg_times) std::sort(w.begin(), w.end());
  const float t_wgrad = wg_times[0][1], t_wgrad_coop = wg_times[1][1];
  const cudaDataType out_type = dw_bf16 ? CUDA_R_16BF : CUDA_R_32F;
  auto batched = [&](const void* A, int64_t lda, const void* B, int64_t ldb, void* C, int64_t m, int64_t n) {
    // C[e] (m x n column-major) = A[e] (m x seg, ld lda) * B[e]^T (n x seg, ld ldb)^T
    cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, int(m), int(n), int(seg), &one, A, CUDA_R_16BF, int(lda),
                               seg * lda, B, CUDA_R_16BF, int(ldb), seg * ldb, &zero, C, out_type, int(m), m * n,
                               int(El), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  const float c_wgrad = time_ms([&] {
    batched(x, H, dgu, 2 * I, dWg, H, I);
    batched(x, H, static_cast<uint16_t*>(dgu) + I, 2 * I, dWu, H, I);
    batched(hw, I, y, H, dWd, I, H);
  }, 10);
  std::printf("    dgrad %7.3f ms %6.1f TF/s | wgrad %7.3f ms %6.1f TF/s (cooperative %7.3f ms) | cublas strided-batched "
              "wgrad %7.3f ms %6.1f TF/s (K = %lld rows per expert)\n",
              t_dgrad, 6.0 * M * H * I / t_dgrad / 1e9, t_wgrad, 6.0 * M * H * I / t_wgrad / 1e9, t_wgrad_coop, c_wgrad,
              6.0 * M * H * I / c_wgrad / 1e9, (long long)seg);
  // The fp8 dgrad (experts_dgrad_fp8) against the bf16 one, rounds alternating which runs first;
  // the weights' transposes quantized once, outside the timing (dy's and dg|du's quantization
  // inside: the launcher runs them between its GEMMs).
  if (H % 128 == 0 && I % 128 == 0) {
    uint8_t *wdt, *wgut, *dyq, *dguq;
    float *wdts, *wguts, *dys, *dgus, *partial8;
    CHECK_CUDA(cudaMalloc(&wdt, El * I * H));
    CHECK_CUDA(cudaMalloc(&wgut, El * H * 2 * I));
    CHECK_CUDA(cudaMalloc(&dyq, M * H));
    CHECK_CUDA(cudaMalloc(&dguq, M * 2 * I));
    CHECK_CUDA(cudaMalloc(&wdts, El * (I / 128) * (H / 128) * 4));
    CHECK_CUDA(cudaMalloc(&wguts, El * (H / 128) * (2 * I / 128) * 4));
    CHECK_CUDA(cudaMalloc(&dys, H / 128 * M * 4));
    CHECK_CUDA(cudaMalloc(&dgus, 2 * I / 128 * M * 4));
    CHECK_CUDA(cudaMalloc(&partial8, M * (I / 128) * 4));
    mok::cuda::quantize_dgrad_weights(wg, wu, wd, El, H, I, wdt, wdts, wgut, wguts, nullptr);
    mok::cuda::ExpertsDgradFp8Args f8;
    f8.base = b;
    f8.base.dw_partial = partial8;
    f8.w_down_t = wdt;
    f8.w_down_t_scales = wdts;
    f8.w_gate_up_t = wgut;
    f8.w_gate_up_t_scales = wguts;
    f8.dy_codes = dyq;
    f8.dy_scales = dys;
    f8.dgu_codes = dguq;
    f8.dgu_scales = dgus;
    const auto [t8, t16] = alternating_ms([&] { mok::cuda::experts_dgrad_fp8(f8, nullptr); },
                                          [&] { mok::cuda::experts_dgrad(b, nullptr); }, 10);
    std::printf("    dgrad fp8 (block-scaled e4m3) %7.3f ms %6.1f TF/s | bf16 %7.3f ms %6.1f TF/s | fp8/bf16 speed %.3fx\n",
                t8, 6.0 * M * H * I / t8 / 1e9, t16, 6.0 * M * H * I / t16 / 1e9, t16 / t8);
    {
      const auto [t_on, t_off] =
          switch_ab("MOK_FP8_CLUSTER", [&] { mok::cuda::experts_dgrad_fp8(f8, nullptr); }, 10);
      std::printf("      fp8 dgrad in clusters of two %7.3f ms | single CTAs %7.3f ms | %.3fx\n", t_on, t_off, t_off / t_on);
      // dg|du quantized in the dh epilogue (the default) against its own quantizer launch.
      const auto [t_fused, t_sep] =
          switch_ab("MOK_FP8_FUSED_DGU", [&] { mok::cuda::experts_dgrad_fp8(f8, nullptr); }, 10);
      std::printf("      fp8 dgrad with dg|du quantized in the dh epilogue %7.3f ms | by its own launch %7.3f ms | %.3fx\n",
                  t_fused, t_sep, t_sep / t_fused);
    }
    // Where the fp8 dgrad's time goes: its two activation quantizations alone (the rest is the
    // two GEMMs and the d row weight's reduction), with the bytes each moves.
    const float t_qdy = time_ms([&] {
      mok::cuda::quantize_rows_e4m3_k_major(y, M, H, dyq, dys, off + El, nullptr);
    }, 10);
    const float t_qdgu = time_ms([&] {
      mok::cuda::quantize_rows_e4m3_k_major(dgu, M, 2 * I, dguq, dgus, off + El, nullptr);
    }, 10);
    std::printf("      of it: quantize dy %6.3f ms (%5.0f GB/s) | quantize dg|du %6.3f ms (%5.0f GB/s) | GEMMs and the rest "
                "%6.3f ms (%6.1f TF/s)\n",
                t_qdy, 3.0 * M * H / t_qdy / 1e6, t_qdgu, 6.0 * M * I / t_qdgu / 1e6, t8 - t_qdy - t_qdgu,
                6.0 * M * H * I / (t8 - t_qdy - t_qdgu) / 1e9);
    // The fp8 weight gradients' operands (quantize_columns_e4m3_transposed): x, dy, dg|du and w*h
    // quantized per 128 rows x 1 column and written transposed, one after another into one buffer.
    {
      const int64_t widest = std::max(H, 2 * I);
      uint8_t* qt;
      float* st;
      CHECK_CUDA(cudaMalloc(&qt, widest * M));
      CHECK_CUDA(cudaMalloc(&st, M / 128 * widest * 4));
      const float t_cols = time_ms([&] {
        mok::cuda::quantize_columns_e4m3_transposed(x, M, H, qt, st, M, off + El, nullptr);
        mok::cuda::quantize_columns_e4m3_transposed(y, M, H, qt, st, M, off + El, nullptr);
        mok::cuda::quantize_columns_e4m3_transposed(dgu, M, 2 * I, qt, st, M, off + El, nullptr);
        mok::cuda::quantize_columns_e4m3_transposed(hw, M, I, qt, st, M, off + El, nullptr);
      }, 10);
      std::printf("      fp8 weight gradients' operands: x, dy, dg|du, w*h quantized per column and transposed %6.3f ms "
                  "(%5.0f GB/s)\n",
                  t_cols, 3.0 * M * (2 * H + 3 * I) / t_cols / 1e6);
      cudaFree(qt);
      cudaFree(st);
    }
    for (void* q : {(void*)wdt, (void*)wgut, (void*)dyq, (void*)dguq, (void*)wdts, (void*)wguts, (void*)dys,
                    (void*)dgus, (void*)partial8})
      cudaFree(q);
  }
  for (void* q : {(void*)dgu, (void*)hw, (void*)dx, (void*)rw, (void*)partial, (void*)ddw, (void*)dWg, (void*)dWu, (void*)dWd})
    cudaFree(q);
  int32_t st = 0;
  CHECK_CUDA(cudaMemcpy(&st, status, 4, cudaMemcpyDeviceToHost));
  std::printf("H=%-5lld I=%-5lld El=%-4lld rows/expert=%-5lld | gate_up+swiglu %7.3f ms %6.1f TF/s (no gu save %6.1f) "
              "| down %7.3f ms %6.1f TF/s | cublas dense gate_up %6.1f down %6.1f TF/s | status %d\n",
              (long long)H, (long long)I, (long long)El, (long long)rows_per_expert, t_gu, f_gate_up / t_gu / 1e9,
              f_gate_up / t_gu_nosave / 1e9, t_down, f_down / t_down / 1e9, f_gate_up / c_gu / 1e9,
              f_down / c_down / 1e9, st);
  for (void* p : {(void*)x, (void*)wg, (void*)wu, (void*)wd, (void*)gu, (void*)h, (void*)y, (void*)off, (void*)status, (void*)w2})
    cudaFree(p);
}

}  // namespace

int main(int argc, char** argv) {
  cublasHandle_t blas;
  cublasCreate(&blas);
  if (argc >= 5) {
    for (int i = 1; i + 3 < argc; i += 4) run(atoll(argv[i]), atoll(argv[i + 1]), atoll(argv[i + 2]), atoll(argv[i + 3]), blas);
  } else {
    run(4096, 14336, 1, 4096, blas);  // mixtral, one expert: a dense GEMM
    run(7168, 2048, 48, 1024, blas);  // kimi-k2, EP8 experts
    run(7168, 2048, 48, 4096, blas);
    run(2048, 768, 16, 4096, blas);   // qwen3-30b-a3b
    run(2880, 2880, 16, 4096, blas);  // gpt-oss-120b
    run(7168, 2048, 48, 256, blas);
  }
  cublasDestroy(blas);
  return 0;
}
