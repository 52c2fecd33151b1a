// A C entry point to the expert kernels for foreign-function callers (the Python package loads it
// with ctypes; torch tensors pass their data pointers and the current stream). Errors come back as
// a nonzero return and a message in `error`, never as an exception across the C boundary.
#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>

#include "mok/cuda/expert_kernels.h"
#include "mok/cuda/routing.h"

namespace {
void write_error(const std::exception& e, char* error, int error_len) {
  if (error != nullptr && error_len > 0) {
    std::strncpy(error, e.what(), static_cast<size_t>(error_len - 1));
    error[error_len - 1] = '\0';
  }
}
}  // namespace

extern "C" {

// which: 0 = both GEMMs, 1 = gate/up + SwiGLU only, 2 = down only.
int mok_cuda_experts_forward(int64_t row_capacity, int64_t hidden, int64_t intermediate, int64_t local_experts,
                             const void* expert_offsets, const void* x, const void* w_gate, const void* w_up,
                             const void* w_down, void* gu, void* h, void* y, int has_limit, float limit, void* status,
                             void* stream, int which, char* error, int error_len) {
  try {
    mok::cuda::ExpertsForwardArgs a;
    a.row_capacity = row_capacity;
    a.hidden = hidden;
    a.intermediate = intermediate;
    a.local_experts = local_experts;
    a.expert_offsets = static_cast<const int32_t*>(expert_offsets);
    a.x = x;
    a.w_gate = w_gate;
    a.w_up = w_up;
    a.w_down = w_down;
    a.gu = gu;
    a.h = h;
    a.y = y;
    if (has_limit) a.swiglu_limit = limit;
    a.status = static_cast<int32_t*>(status);
    auto s = static_cast<cudaStream_t>(stream);
    if (which == 1) {
      mok::cuda::gate_up_swiglu(a, s);
    } else if (which == 2) {
      mok::cuda::down_projection(a, s);
    } else {
      mok::cuda::experts_forward(a, s);
    }
    return 0;
  } catch (const std::exception& e) {
    write_error(e, error, error_len);
    return 1;
  }
}

// The backward on the same rows (mok::cuda::ExpertsBackwardArgs, in its field order).
int mok_cuda_experts_backward(int64_t row_capacity, int64_t hidden, int64_t intermediate, int64_t local_experts,
                              const void* expert_offsets, const void* x, const void* gu, const void* h, const void* dy,
                              const void* row_weight, const void* w_gate, const void* w_up, const void* w_down,
                              void* dgu, void* hw, void* dw_partial, void* dx, void* d_row_weight, void* d_w_gate,
                              void* d_w_up, void* d_w_down, int has_limit, float limit, void* status, void* stream,
                              char* error, int error_len) {
  try {
    mok::cuda::ExpertsBackwardArgs a;
    a.row_capacity = row_capacity;
    a.hidden = hidden;
    a.intermediate = intermediate;
    a.local_experts = local_experts;
    a.expert_offsets = static_cast<const int32_t*>(expert_offsets);
    a.x = x;
    a.gu = gu;
    a.h = h;
    a.dy = dy;
    a.row_weight = static_cast<const float*>(row_weight);
    a.w_gate = w_gate;
    a.w_up = w_up;
    a.w_down = w_down;
    a.dgu = dgu;
    a.hw = hw;
    a.dw_partial = static_cast<float*>(dw_partial);
    a.dx = dx;
    a.d_row_weight = static_cast<float*>(d_row_weight);
    a.d_w_gate = static_cast<float*>(d_w_gate);
    a.d_w_up = static_cast<float*>(d_w_up);
    a.d_w_down = static_cast<float*>(d_w_down);
    if (has_limit) a.swiglu_limit = limit;
    a.status = static_cast<int32_t*>(status);
    mok::cuda::experts_backward(a, static_cast<cudaStream_t>(stream));
    return 0;
  } catch (const std::exception& e) {
    write_error(e, error, error_len);
    return 1;
  }
}

// An SM copy of `bytes` (multiple of 16) between raw device addresses (a peer's, for NVLink rates).
int mok_cuda_copy_bytes(void* dst, const void* src, int64_t bytes, int blocks, void* stream, char* error,
                        int error_len) {
  try {
    mok::cuda::copy_bytes(dst, src, bytes, blocks, static_cast<cudaStream_t>(stream));
    return 0;
  } catch (const std::exception& e) {
    write_error(e, error, error_len);
    return 1;
  }
}

int64_t mok_cuda_dw_partial_blocks(int64_t intermediate) { return mok::cuda::dw_partial_blocks(intermediate); }

const char* mok_cuda_status_message(int code) { return mok::cuda::status_message(code); }

int mok_cuda_row_align() { return static_cast<int>(mok::cuda::kRowAlign); }

}  // extern "C"
