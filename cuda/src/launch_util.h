// Host helpers the launchers share (expert_kernels.cu, megakernel.cu): error checks, SM count,
// bf16 pointer casts, TMA store targets and can_implement messages.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "mok/cuda/detail/expert_epilogues.cuh"

namespace mok::cuda::host_util {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("mok cuda: ") + what + ": " + cudaGetErrorString(e));
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

inline detail::StoreTensor store_target(void* ptr, int64_t rows, int64_t cols, int64_t row_stride) {
  return {detail::make_store_tma(bf(ptr), int(rows), int(cols), row_stride, 1, 0), int(rows), int(cols), 1};
}

}  // namespace mok::cuda::host_util
