// Host launcher of the experts' block-scaled e4m3 forward (include/mok/cuda/fp8.h:
// experts_forward_fp8): gate|up with the SwiGLU epilogue, h quantized as rows, down; the kernel is
// detail/fp8_scaled_gemm_kernel.cuh.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

#include "mok/cuda/detail/fp8_scaled_gemm_kernel.cuh"
#include "mok/cuda/expert_kernels.h"
#include "mok/cuda/fp8.h"
#include "device_cache.h"
#include "launch_util.h"

namespace mok::cuda {
namespace {

using detail::float_e4m3_t;
using detail::Fp8GemmConfig;
using detail::Fp8ScaledGemmParams;
using detail::GemmConfig;
using host_util::bf;
using host_util::check;
using host_util::device_sms;
using host_util::store_target;

static_assert(sizeof(detail::Fp8ScaledGemmSharedStorage) <= 232448, "shared storage exceeds 227 KiB");

const float_e4m3_t* e4m3(const uint8_t* p) { return reinterpret_cast<const float_e4m3_t*>(p); }

// The fp8 kernels' on/off switches, on unless set to off (read at each call: the timing tool's
// same-process A/Bs and the tests' bitwise comparisons): MOK_FP8_CLUSTER (the GEMMs in clusters
// of two) and MOK_FP8_FUSED_DGU (dg|du quantized in the dh epilogue). Other values are refused by
// name in can_implement.
constexpr const char* kSwitches[] = {"MOK_FP8_CLUSTER", "MOK_FP8_FUSED_DGU"};
std::string switch_problems() {
  std::string why;
  for (const char* name : kSwitches) {
    const char* v = std::getenv(name);
    if (!(v == nullptr || *v == '\0' || std::strcmp(v, "on") == 0 || std::strcmp(v, "off") == 0))
      why += std::string(name) + " must be on or off, got '" + v + "'; ";
  }
  return why;
}
bool switch_on(const char* name) {
  const char* v = std::getenv(name);
  return !(v != nullptr && std::strcmp(v, "off") == 0);
}

// A launch of `ctas` CTAs in clusters of two (the configuration holds a pointer to its attribute:
// kept together, not copied).
struct PairLaunch {
  cudaLaunchAttribute cluster{};
  cudaLaunchConfig_t config{};
  PairLaunch(int ctas, int smem, cudaStream_t stream) {
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 2;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.gridDim = dim3(unsigned(ctas));
    config.blockDim = dim3(GemmConfig::kThreads);
    config.dynamicSmemBytes = size_t(smem);
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
  }
  PairLaunch(const PairLaunch&) = delete;
  PairLaunch& operator=(const PairLaunch&) = delete;
};

// How many clusters of two of `kernel` the current device runs at once (asked once per device: a
// persistent grid larger than that would run its last clusters after the others).
template <class Kernel>
int resident_pairs(Kernel kernel, int smem, host_util::PerDevice& cache) {
  return host_util::per_device(cache, [&] {
    const PairLaunch query(2 * 64, smem, nullptr);
    int pairs = 0;
    check(cudaOccupancyMaxActiveClusters(&pairs, kernel, &query.config), "query the fp8 GEMM's resident clusters");
    return pairs;
  });
}

template <bool kGateUp, bool kSwiGluBackward = false>
void launch(const Fp8ScaledGemmParams& p, int num_sms, cudaStream_t stream) {
  const char* what = kGateUp ? "launch the fp8 gate|up GEMM" : kSwiGluBackward ? "launch the fp8 dh GEMM"
                                                                              : "launch the fp8 store GEMM";
  const int smem = int(sizeof(detail::Fp8ScaledGemmSharedStorage));
  const int ctas = device_sms(num_sms);
  if (switch_on("MOK_FP8_CLUSTER") && p.n_blocks % 2 == 0 && ctas >= 2) {
    const auto kernel = detail::fp8_scaled_gemm_kernel<kGateUp, kSwiGluBackward, 2>;
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "set shared memory");
    static host_util::PerDevice pairs_cache;  // one per form (a template's static)
    const int pairs = std::min(ctas / 2, resident_pairs(kernel, smem, pairs_cache));
    if (pairs >= 1) {  // (none resident, e.g. on a partition without clusters: single CTAs below)
      const PairLaunch pair(2 * pairs, smem, stream);
      check(cudaLaunchKernelEx(&pair.config, kernel, p), what);
      return;
    }
  }
  const auto kernel = detail::fp8_scaled_gemm_kernel<kGateUp, kSwiGluBackward>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "set shared memory");
  kernel<<<ctas, GemmConfig::kThreads, smem, stream>>>(p);
  check(cudaGetLastError(), what);
}

}  // namespace

namespace {
// What every fp8 launcher asks of its shapes: whole scale blocks, 16-byte rows of row scales.
void shape_checks(std::ostringstream& why, int64_t H, int64_t I, int64_t El, int64_t R, const int32_t* offsets) {
  why << switch_problems();
  if (H < 128 || H % 128 != 0) why << "hidden must be a positive multiple of 128 (whole fp8 scale blocks), got " << H << "; ";
  if (I < 128 || I % 128 != 0)
    why << "intermediate must be a positive multiple of 128 (whole fp8 scale blocks), got " << I << "; ";
  if (El < 1 || El > GemmConfig::kMaxExperts)
    why << "local_experts must be in [1, " << GemmConfig::kMaxExperts << "], got " << El << "; ";
  if (R < 0 || R > (int64_t{1} << 30) || R % 4 != 0)
    why << "row_capacity must be a multiple of 4 (16-byte rows of scales) in [0, 2^30], got " << R << "; ";
  if (offsets == nullptr) why << "expert_offsets is null; ";
}
}  // namespace

std::string can_implement(const ExpertsForwardFp8Args& a, bool gate_up_only) {
  std::ostringstream why;
  shape_checks(why, a.hidden, a.intermediate, a.local_experts, a.row_capacity, a.expert_offsets);
  if (gate_up_only) {
    if (!a.x || !a.x_scales || !a.w_gate || !a.w_gate_scales || !a.w_up || !a.w_up_scales || !a.h)
      why << "x, w_gate, w_up (each with its scales) and h must not be null; ";
  } else if (!a.x || !a.x_scales || !a.w_gate || !a.w_gate_scales || !a.w_up || !a.w_up_scales || !a.w_down ||
             !a.w_down_scales || !a.h || !a.h_codes || !a.h_scales || !a.y) {
    why << "x, w_gate, w_up, w_down (each with its scales), h, h_codes, h_scales and y must not be null; ";
  }
  if (a.swiglu_limit && !(*a.swiglu_limit > 0.0f)) why << "swiglu_limit must be > 0; ";
  return host_util::trimmed(why.str());
}

namespace {
// The gate|up GEMM of experts_forward_fp8 (checked arguments, rows > 0).
void gate_up_fp8(const ExpertsForwardFp8Args& a, cudaStream_t stream) {
  const int64_t R = a.row_capacity, H = a.hidden, I = a.intermediate, El = a.local_experts;
  const int rows = int(R), h = int(H), i = int(I), experts = int(El);
  // gate|up: tiles of 64 gate and 64 up columns; h in 64-column chunks, g|u into gu's two halves.
  const bool save = a.gu != nullptr;
  const Fp8ScaledGemmParams gate_up{detail::fp8_tma_a(e4m3(a.x), rows, h),
                                    detail::fp8_tma_b(e4m3(a.w_gate), i, h, experts),
                                    detail::fp8_tma_b_half(e4m3(a.w_gate), i, h, experts),
                                    detail::fp8_tma_b_half(e4m3(a.w_up), i, h, experts),
                                    store_target(a.h, R, I, I),
                                    save ? store_target(a.gu, R, I, 2 * I) : store_target(a.h, R, I, I),
                                    save ? store_target(bf(a.gu) + I, R, I, 2 * I) : store_target(a.h, R, I, I),
                                    save,
                                    a.swiglu_limit.has_value(),
                                    a.swiglu_limit.value_or(0.0f),
                                    a.x_scales,
                                    a.w_gate_scales,
                                    a.w_up_scales,
                                    rows,
                                    h,
                                    i,
                                    experts,
                                    i / 64,
                                    h / Fp8GemmConfig::kBlockK,
                                    i / 128,
                                    a.expert_offsets,
                                    a.status,
                                    {},
                                    detail::fp8_tma_a_half(e4m3(a.x), rows, h)};
  launch<true>(gate_up, a.num_sms, stream);
}

void require(const ExpertsForwardFp8Args& a, bool gate_up_only) {
  if (const std::string why = can_implement(a, gate_up_only); !why.empty())
    throw std::invalid_argument("mok cuda experts (fp8): " + why);
  host_util::bind_context();
}
}  // namespace

void experts_gate_up_fp8(const ExpertsForwardFp8Args& a, cudaStream_t stream) {
  require(a, true);
  if (a.row_capacity > 0) gate_up_fp8(a, stream);
}

void experts_forward_fp8(const ExpertsForwardFp8Args& a, cudaStream_t stream) {
  require(a, false);
  const int64_t R = a.row_capacity, H = a.hidden, I = a.intermediate, El = a.local_experts;
  if (R == 0) return;
  const int rows = int(R), h = int(H), i = int(I), experts = int(El);
  gate_up_fp8(a, stream);
  // h as rows of 1 x 128 blocks, only the experts' rows (offsets[El] read on the device).
  quantize_rows_e4m3_k_major(a.h, R, I, a.h_codes, a.h_scales, a.expert_offsets + El, stream);
  const Fp8ScaledGemmParams down =
      detail::fp8_store_params(e4m3(a.h_codes), a.h_scales, e4m3(a.w_down), a.w_down_scales,
                               store_target(a.y, R, H, H), rows, i, h, experts, a.expert_offsets, a.status);
  launch<false>(down, a.num_sms, stream);
}

namespace detail {
// Declared in fp8.cu, whose preload_fp8_kernels calls it (the kernels are this file's).
void preload_fp8_gemms() {
  cudaFuncAttributes attr;
  check(cudaFuncGetAttributes(&attr, fp8_scaled_gemm_kernel<true>), "load the fp8 gate|up GEMM");
  check(cudaFuncGetAttributes(&attr, fp8_scaled_gemm_kernel<false>), "load the fp8 store GEMM");
  check(cudaFuncGetAttributes(&attr, fp8_scaled_gemm_kernel<false, true>), "load the fp8 dh GEMM");
  check(cudaFuncGetAttributes(&attr, fp8_scaled_gemm_kernel<true, false, 2>), "load the fp8 gate|up GEMM (clusters)");
  check(cudaFuncGetAttributes(&attr, fp8_scaled_gemm_kernel<false, false, 2>), "load the fp8 store GEMM (clusters)");
  check(cudaFuncGetAttributes(&attr, fp8_scaled_gemm_kernel<false, true, 2>), "load the fp8 dh GEMM (clusters)");
}
}  // namespace detail

std::string can_implement(const ExpertsDgradFp8Args& a) {
  std::ostringstream why;
  const ExpertsBackwardArgs& b = a.base;
  shape_checks(why, b.hidden, b.intermediate, b.local_experts, b.row_capacity, b.expert_offsets);
  if (!b.gu || !b.h || !b.dy || !b.row_weight || !b.dgu || !b.hw || !b.dw_partial || !(b.dx || b.dx_push) ||
      !b.d_row_weight)
    why << "gu, h, dy, row_weight, dgu, hw, dw_partial, dx (or dx_push) and d_row_weight must not be null; ";
  if (b.dx_push) why << host_util::dx_push_problem(*b.dx_push);
  if (!a.w_down_t || !a.w_down_t_scales || !a.w_gate_up_t || !a.w_gate_up_t_scales)
    why << "w_down_t and w_gate_up_t (each with its scales) must not be null; ";
  if (!a.dy_codes || !a.dy_scales || !a.dgu_codes || !a.dgu_scales)
    why << "the scratch dy_codes, dy_scales, dgu_codes and dgu_scales must not be null; ";
  if (b.swiglu_limit && !(*b.swiglu_limit > 0.0f)) why << "swiglu_limit must be > 0; ";
  return host_util::trimmed(why.str());
}

void experts_dgrad_fp8(const ExpertsDgradFp8Args& a, cudaStream_t stream) {
  if (const std::string why = can_implement(a); !why.empty())
    throw std::invalid_argument("mok cuda experts (fp8 dgrad): " + why);
  host_util::bind_context();
  const ExpertsBackwardArgs& b = a.base;
  const int64_t R = b.row_capacity, H = b.hidden, I = b.intermediate, El = b.local_experts;
  if (R == 0) return;
  const int rows = int(R), h = int(H), i = int(I), experts = int(El);
  const int32_t* rows_used = b.expert_offsets + El;  // offsets[El], read on the device
  // dh = dy W_down: dy's rows 1 x 128, W_down^T [El, I, H] as the store form's b; the SwiGLU
  // backward in the epilogue (its store target is a valid stand-in, unused).
  quantize_rows_e4m3_k_major(b.dy, R, H, a.dy_codes, a.dy_scales, rows_used, stream);
  Fp8ScaledGemmParams dh =
      detail::fp8_store_params(e4m3(a.dy_codes), a.dy_scales, e4m3(a.w_down_t), a.w_down_t_scales,
                               store_target(b.hw, R, I, I), rows, h, i, experts, b.expert_offsets, b.status);
  dh.swiglu_backward = detail::SwiGluBackwardParams{static_cast<__nv_bfloat16*>(b.dgu),
                                                    static_cast<__nv_bfloat16*>(b.hw),
                                                    static_cast<const __nv_bfloat16*>(b.gu),
                                                    static_cast<const __nv_bfloat16*>(b.h),
                                                    b.row_weight,
                                                    b.dw_partial,
                                                    i / Fp8GemmConfig::kBlockN,
                                                    i,
                                                    b.swiglu_limit.has_value(),
                                                    b.swiglu_limit.value_or(0.0f)};
  // dg|du quantized by the dh tiles themselves (each one 1 x 128 block of dg and of du per row),
  // unless MOK_FP8_FUSED_DGU=off: then by quantize_rows_e4m3_k_major after it. The same bits.
  const bool fused_dgu = switch_on("MOK_FP8_FUSED_DGU");
  if (fused_dgu) {
    dh.swiglu_backward.dgu_codes = a.dgu_codes;
    dh.swiglu_backward.dgu_scales = a.dgu_scales;
    dh.swiglu_backward.scale_rows = R;
  }
  launch<false, true>(dh, b.num_sms, stream);
  host_util::reduce_row_partials(b.dw_partial, i / Fp8GemmConfig::kBlockN, b.expert_offsets, experts, b.d_row_weight,
                                 R, stream);
  // dx = [dg|du] [W_gate; W_up]: dg|du's rows 1 x 128 along 2I, [W_gate^T | W_up^T] [El, H, 2I].
  if (!fused_dgu) quantize_rows_e4m3_k_major(b.dgu, R, 2 * I, a.dgu_codes, a.dgu_scales, rows_used, stream);
  // With dx_push each row goes into its (token, j) slot (the bf16 dx GEMM's push) and dx is not
  // written: the store target is then a stand-in (dgu as it is), unused.
  const auto out = b.dx_push ? store_target(b.dgu, R, 2 * I, 2 * I) : store_target(b.dx, R, H, H);
  Fp8ScaledGemmParams dx = detail::fp8_store_params(e4m3(a.dgu_codes), a.dgu_scales, e4m3(a.w_gate_up_t),
                                                    a.w_gate_up_t_scales, out, rows, 2 * i, h, experts,
                                                    b.expert_offsets, b.status);
  if (b.dx_push) dx.push = host_util::push_rows_params(*b.dx_push, H);
  launch<false>(dx, b.num_sms, stream);
}

namespace {
// The scratch's parts in order (bytes, each rounded up to 256): dy codes, dy scales, dg|du codes,
// dg|du scales, d row weight partials.
std::array<int64_t, 5> dgrad_scratch_parts(int64_t R, int64_t H, int64_t I) {
  auto aligned = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  return {aligned(R * H), aligned(H / 128 * R * 4), aligned(R * 2 * I), aligned(2 * I / 128 * R * 4),
          aligned(R * (I / 128) * 4)};
}
}  // namespace

int64_t fp8_dgrad_scratch_bytes(int64_t row_capacity, int64_t hidden, int64_t intermediate) {
  int64_t total = 0;
  for (const int64_t part : dgrad_scratch_parts(row_capacity, hidden, intermediate)) total += part;
  return total;
}

void wire_fp8_dgrad_scratch(ExpertsDgradFp8Args& a, void* scratch) {
  const ExpertsBackwardArgs& b = a.base;
  const auto parts = dgrad_scratch_parts(b.row_capacity, b.hidden, b.intermediate);
  char* p[5];
  int64_t offset = 0;
  for (int i = 0; i < 5; ++i) {  // (no arithmetic on a null scratch: every field null, can_implement names them)
    p[i] = scratch == nullptr ? nullptr : static_cast<char*>(scratch) + offset;
    offset += parts[size_t(i)];
  }
  a.dy_codes = reinterpret_cast<uint8_t*>(p[0]);
  a.dy_scales = reinterpret_cast<float*>(p[1]);
  a.dgu_codes = reinterpret_cast<uint8_t*>(p[2]);
  a.dgu_scales = reinterpret_cast<float*>(p[3]);
  a.base.dw_partial = reinterpret_cast<float*>(p[4]);
}

ExpertsDgradFp8Args fp8_dgrad_args(const ExpertsBackwardArgs& base, const void* w_down_t, const float* w_down_t_scales,
                                   const void* w_gate_up_t, const float* w_gate_up_t_scales, void* scratch) {
  ExpertsDgradFp8Args a;
  a.base = base;
  a.w_down_t = static_cast<const uint8_t*>(w_down_t);
  a.w_down_t_scales = w_down_t_scales;
  a.w_gate_up_t = static_cast<const uint8_t*>(w_gate_up_t);
  a.w_gate_up_t_scales = w_gate_up_t_scales;
  wire_fp8_dgrad_scratch(a, scratch);
  return a;
}

void experts_backward_fp8_dgrad(const ExpertsDgradFp8Args& a, cudaStream_t stream) {
  experts_dgrad_fp8(a, stream);
  experts_wgrad(a.base, stream);
}

}  // namespace mok::cuda
