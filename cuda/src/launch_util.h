// Host helpers the launchers share (expert_kernels.cu, megakernel.cu): error checks, SM count,
// bf16 pointer casts, TMA store targets, the backward's GEMM operands and can_implement messages.
#pragma once

#include <cuda_runtime.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "mok/cuda/detail/expert_epilogues.cuh"
#include "mok/cuda/detail/mainloops.cuh"
#include "mok/cuda/expert_kernels.h"

namespace mok::cuda::host_util {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("mok cuda: ") + what + ": " + cudaGetErrorString(e));
}

// Binds the current device's primary context to the calling thread. Every public launcher calls
// it before making TMA descriptors: CuTe makes them with the driver (cuTensorMapEncodeTiled),
// which fails with CUDA_ERROR_INVALID_CONTEXT in a thread that has made no runtime call needing a
// context yet, and then CuTe only prints the failure and the kernel runs on a garbage descriptor
// (an illegal instruction). Such a thread is common: torch's autograd threads set the device
// without binding a context when it is already the "current" one, and their allocations can come
// from torch's cache, so a backward's first CUDA call can be ours (session 20: the shared
// expert's backward in mok.moe at fp8, where the forward had run no bf16 expert kernel). A thread
// with a context of its own (a caller's cuCtxCreate, say) keeps it.
inline void bind_context() {
  using CtxGetCurrent = int (*)(void**);  // CUresult cuCtxGetCurrent(CUcontext*), through the runtime
  static const CtxGetCurrent get_current = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const bool ok =
        cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault, &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess;
    return ok ? reinterpret_cast<CtxGetCurrent>(fn) : nullptr;
  }();
  void* context = nullptr;
  if (get_current != nullptr && get_current(&context) == 0 && context != nullptr) return;
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaSetDevice(device), "bind the device's context to this thread");
}

// `requested` if positive, else the current device's SM count.
inline int device_sms(int requested) {
  if (requested > 0) return requested;
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "multiprocessor count");
  return sms;
}

using bf16_t = cute::bfloat16_t;
inline const bf16_t* bf(const void* p) { return static_cast<const bf16_t*>(p); }
inline bf16_t* bf(void* p) { return static_cast<bf16_t*>(p); }
inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// A can_implement message: its reasons, each written as "...; ", without the last separator.
inline std::string trimmed(std::string s) {
  if (s.size() >= 2) s.resize(s.size() - 2);
  return s;
}

template <int kRows = 128>
inline detail::StoreTensorOf<kRows> store_target(void* ptr, int64_t rows, int64_t cols, int64_t row_stride) {
  return {detail::make_store_tma<kRows>(bf(ptr), int(rows), int(cols), row_stride, 1, 0), int(rows), int(cols), 1};
}

// d_row_weight[r] = the sum of row r's `blocks` d topk_w partials in block order, for the rows
// the experts hold (expert_kernels.cu; the bf16 and the fp8 dgrad share it).
void reduce_row_partials(const float* partial, int blocks, const int32_t* offsets, int experts, float* out,
                         int64_t rows, cudaStream_t stream);

// The dx push (ExpertsBackwardArgs::dx_push): what is wrong with it ("" if nothing), and its
// rows' epilogue parameters (the bf16 and the fp8 dx GEMM share both; expert_kernels.cu).
std::string dx_push_problem(const DxPush& push);
inline detail::PushRowsEpilogue::Params push_rows_params(const DxPush& push, int64_t width) {
  detail::PushRowsEpilogue::Params e{};
  for (int64_t r = 0; r < push.ranks; ++r) e.dest[r] = static_cast<__nv_bfloat16*>(push.slots_of[r]);
  e.src_rank = push.src_rank;
  e.src_slot = push.src_slot;
  e.given_up_words = push.given_up_words;
  e.ranks = int32_t(push.ranks);
  e.slots = int32_t(push.slots);
  e.width = int32_t(width);
  return e;
}

// ---- The backward's GEMMs, for the stage kernels and the backward megakernel alike ----
using BackwardK = detail::BackwardMainloop<cute::GMMA::Major::K>;
using BackwardMN = detail::BackwardMainloop<cute::GMMA::Major::MN>;
inline constexpr int kOnePlane = 1 << 30;  // kb_per_plane of a one-plane reduction

// dh = dy W_down: A = dy [rows, H]; B = W_down as (I, H, El), I contiguous.
// (kRows: the A tile's rows; 64 for the ping-pong kernel.)
template <int kRows = detail::GemmConfig::kBlockM>
inline typename detail::BackwardMainloopOf<bf16_t, cute::GMMA::Major::K, kRows>::Params dh_operands(
    const void* dy, const void* w_down, int64_t rows, int64_t H, int64_t I, int64_t El) {
  using Mainloop = detail::BackwardMainloopOf<bf16_t, cute::GMMA::Major::K, kRows>;
  return {Mainloop::make_a(bf(dy), int(rows), int(H), 1, H, 0),
          Mainloop::make_b(bf(w_down), int(I), int(H), int(El), I, H * I),
          Mainloop::make_b(bf(w_down), int(I), int(H), int(El), I, H * I),
          int(rows), int(H), 1, int(I), int(H), int(El), kOnePlane, /*b_by_expert=*/1};
}
// dx = dg W_gate + du W_up: A = dgu as (rows, I, 2 planes), B = W_gate then W_up as (H, I, El), H
// contiguous; the k-blocks of plane 0 then plane 1 into one accumulator.
inline BackwardK::Params dx_operands(const void* dgu, const void* w_gate, const void* w_up, int64_t rows, int64_t H,
                                     int64_t I, int64_t El) {
  return {BackwardK::make_a(bf(dgu), int(rows), int(I), 2, 2 * I, I),
          BackwardK::make_b(bf(w_gate), int(H), int(I), int(El), H, I * H),
          BackwardK::make_b(bf(w_up), int(H), int(I), int(El), H, I * H),
          int(rows), int(I), 2, int(H), int(I), int(El), ceil_div(I, BackwardK::kBlockK), /*b_by_expert=*/1};
}
// dh's epilogue: the SwiGLU backward into dg|du [rows, 2I] and hw [rows, I], with the d topk_w
// partials [rows, dw_partial_blocks(I)].
inline detail::SwiGluBackwardParams swiglu_backward_target(void* dgu, void* hw, const void* gu, const void* h,
                                                                     const float* row_weight, float* dw_partial,
                                                                     int64_t I, const std::optional<float>& limit) {
  return {static_cast<__nv_bfloat16*>(dgu), static_cast<__nv_bfloat16*>(hw), static_cast<const __nv_bfloat16*>(gu),
          static_cast<const __nv_bfloat16*>(h), row_weight, dw_partial, int(dw_partial_blocks(I)), int(I),
          limit.has_value(), limit.value_or(0.0f)};
}
// A weight gradient a^T b per expert over its rows: a [rows, a_cols] (row stride a_row_stride) and
// b [rows, b_cols], both read transposed (MN-major).
inline BackwardMN::Params weight_grad_operands(const void* a, int64_t a_cols, int64_t a_row_stride, const void* b,
                                               int64_t b_cols, int64_t rows) {
  return {BackwardMN::make_a(bf(a), int(a_cols), int(rows), 1, a_row_stride, 0),
          BackwardMN::make_b(bf(b), int(b_cols), int(rows), 1, b_cols, 0),
          BackwardMN::make_b(bf(b), int(b_cols), int(rows), 1, b_cols, 0),
          int(a_cols), int(rows), 1, int(b_cols), int(rows), 1, kOnePlane, /*b_by_expert=*/0};
}
// Where weight gradient tiles go: [planes][rows, cols], bf16 or fp32, in boxes of kRows rows (64:
// each consumer warpgroup stores its half of a tile, the turns of grouped_gemm_kernel.cuh).
template <int kRows = detail::GemmConfig::kBlockM>
inline typename detail::StorePlanesEpilogue<detail::StoreTensorOf<kRows>>::Params bf16_planes_target(
    void* out, int64_t rows, int64_t cols, int64_t planes) {
  return {{detail::make_store_tma<kRows>(bf(out), int(rows), int(cols), cols, int(planes), rows * cols), int(rows),
           int(cols), int(planes)}};
}
template <int kRows = detail::GemmConfig::kBlockM>
inline typename detail::StorePlanesEpilogue<detail::StoreTensorF32Of<kRows>>::Params f32_planes_target(
    void* out, int64_t rows, int64_t cols, int64_t planes) {
  return {{detail::make_store_tma_f32<kRows>(static_cast<float*>(out), int(rows), int(cols), cols, int(planes),
                                             rows * cols),
           int(rows), int(cols), int(planes)}};
}

}  // namespace mok::cuda::host_util
