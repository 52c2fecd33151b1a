// Host launchers of the sm_90a expert kernels (include/mok/cuda/expert_kernels.h).
#include "mok/cuda/expert_kernels.h"

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>

#include "mok/cuda/detail/expert_epilogues.cuh"
#include "mok/cuda/detail/grouped_gemm_kernel.cuh"

namespace mok::cuda {
namespace {

using Shape_ = detail::GroupedGemmShape;
// sm_90's largest opt-in shared memory per block: 227 KiB.
static_assert(sizeof(detail::GroupedGemmSharedStorage<Shape_>) <= 232448, "shared storage exceeds 227 KiB");
using Tma = detail::GroupedGemmTma<Shape_>;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("mok cuda: ") + what + ": " + cudaGetErrorString(e));
}

int device_sms(int requested) {
  if (requested > 0) return requested;
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "multiprocessor count");
  return sms;
}

template <class Epilogue>
void launch(const detail::GroupedGemmParams<Shape_, Epilogue>& params, int num_sms, cudaStream_t stream) {
  auto kernel = detail::grouped_gemm_kernel<Shape_, Epilogue>;
  const int smem = static_cast<int>(sizeof(detail::GroupedGemmSharedStorage<Shape_>));
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "set shared memory");
  kernel<<<device_sms(num_sms), Shape_::kThreads, smem, stream>>>(params);
  check(cudaGetLastError(), "launch grouped GEMM");
}

const cute::bfloat16_t* bf(const void* p) { return static_cast<const cute::bfloat16_t*>(p); }

detail::StoreTensor store_target(void* ptr, int64_t rows, int64_t cols, int64_t row_stride, int planes,
                                 int64_t plane_stride) {
  return {detail::make_store_tma(static_cast<cute::bfloat16_t*>(ptr), int(rows), int(cols), row_stride, planes,
                                    plane_stride),
          int(rows), int(cols), planes};
}

}  // namespace

const char* status_message(int32_t code) {
  switch (code) {
    case kStatusOk: return "ok";
    case kStatusMisalignedOffsets: return "an expert offset is not a multiple of kRowAlign (128)";
    case kStatusOffsetsOutOfRange: return "expert offsets decrease or exceed the row capacity";
  }
  return "unknown status";
}

std::string can_implement(const ExpertsForwardArgs& a) {
  std::ostringstream why;
  if (a.hidden < 8 || a.hidden % 8 != 0) why << "hidden must be a positive multiple of 8 (16-byte rows for TMA), got " << a.hidden << "; ";
  if (a.intermediate < 8 || a.intermediate % 8 != 0)
    why << "intermediate must be a positive multiple of 8 (16-byte rows for TMA), got " << a.intermediate << "; ";
  if (a.local_experts < 1 || a.local_experts > Shape_::kMaxExperts)
    why << "local_experts must be in [1, " << Shape_::kMaxExperts << "], got " << a.local_experts << "; ";
  if (a.row_capacity < 0 || a.row_capacity > (int64_t{1} << 30)) why << "row_capacity must be in [0, 2^30], got " << a.row_capacity << "; ";
  if (a.expert_offsets == nullptr) why << "expert_offsets is null; ";
  if (a.x == nullptr || a.w_gate == nullptr || a.w_up == nullptr || a.w_down == nullptr || a.h == nullptr || a.y == nullptr)
    why << "x, w_gate, w_up, w_down, h and y must not be null; ";
  if (a.swiglu_limit && !(*a.swiglu_limit > 0.0f)) why << "swiglu_limit must be > 0; ";
  std::string s = why.str();
  if (s.size() >= 2) s.resize(s.size() - 2);
  return s;
}

namespace {
void require(const ExpertsForwardArgs& a) {
  const std::string why = can_implement(a);
  if (!why.empty()) throw std::invalid_argument("mok cuda experts: " + why);
}
}  // namespace

void gate_up_swiglu(const ExpertsForwardArgs& a, cudaStream_t stream) {
  require(a);
  if (a.row_capacity == 0) return;
  detail::GroupedGemmParams<Shape_, detail::SwiGluEpilogue> p{
      Tma::make_a(bf(a.x), int(a.row_capacity), int(a.hidden)),
      Tma::make_b(bf(a.w_gate), int(a.intermediate), int(a.hidden), int(a.local_experts)),
      Tma::make_b(bf(a.w_up), int(a.intermediate), int(a.hidden), int(a.local_experts)),
      int(a.row_capacity), int(a.hidden), int(a.intermediate), int(a.local_experts),
      int((a.intermediate + Shape_::kHalfN - 1) / Shape_::kHalfN), /*b1_row_shift=*/0, a.expert_offsets, a.status,
      {store_target(a.h, a.row_capacity, a.intermediate, a.intermediate, 1, 0),
       store_target(a.gu != nullptr ? a.gu : a.h, a.row_capacity, a.intermediate, 2 * a.intermediate, 1, 0),
       store_target(a.gu != nullptr ? static_cast<cute::bfloat16_t*>(a.gu) + a.intermediate : a.h, a.row_capacity,
                    a.intermediate, 2 * a.intermediate, 1, 0),
       a.gu != nullptr, a.swiglu_limit.has_value(), a.swiglu_limit.value_or(0.0f)}};
  launch(p, a.num_sms, stream);
}

void down_projection(const ExpertsForwardArgs& a, cudaStream_t stream) {
  require(a);
  if (a.row_capacity == 0) return;
  detail::GroupedGemmParams<Shape_, detail::StoreEpilogue> p{
      Tma::make_a(bf(a.h), int(a.row_capacity), int(a.intermediate)),
      Tma::make_b(bf(a.w_down), int(a.hidden), int(a.intermediate), int(a.local_experts)),
      Tma::make_b(bf(a.w_down), int(a.hidden), int(a.intermediate), int(a.local_experts)),
      int(a.row_capacity), int(a.intermediate), int(a.hidden), int(a.local_experts),
      int((a.hidden + Shape_::kBlockN - 1) / Shape_::kBlockN), /*b1_row_shift=*/1, a.expert_offsets, a.status,
      {store_target(a.y, a.row_capacity, a.hidden, a.hidden, 1, 0)}};
  launch(p, a.num_sms, stream);
}

void experts_forward(const ExpertsForwardArgs& a, cudaStream_t stream) {
  gate_up_swiglu(a, stream);
  down_projection(a, stream);
}

}  // namespace mok::cuda
