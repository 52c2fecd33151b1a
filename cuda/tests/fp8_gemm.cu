// fp8_gemm.h: the persistent grouped GEMM instantiated at e4m3.
#include "fp8_gemm.h"

#include <stdexcept>
#include <string>

#include "mok/cuda/detail/fp8_scaled_gemm_kernel.cuh"
#include "mok/cuda/detail/grouped_gemm_kernel.cuh"

namespace mok::test {
namespace {

using namespace mok::cuda::detail;
using Mainloop = ForwardMainloopOf<float_e4m3_t>;
using Epilogue = StoreEpilogue;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace

void fp8_grouped_gemm(const void* a, const void* b, void* out, const int32_t* offsets, int rows, int k, int n,
                      int experts, int32_t* status, cudaStream_t stream) {
  if (rows <= 0 || k <= 0 || k % 16 != 0 || n <= 0 || n % 8 != 0 || experts < 1 || experts > GemmConfig::kMaxExperts)
    throw std::invalid_argument("fp8_grouped_gemm: bad shape");
  const auto* a8 = static_cast<const float_e4m3_t*>(a);
  const auto* b8 = static_cast<const float_e4m3_t*>(b);
  // B's two 128-row halves are blocks 2j and 2j+1 of the same [experts, n, k] tensor.
  const Mainloop::Params m{Mainloop::make_a(a8, rows, k), Mainloop::make_b(b8, n, k, experts),
                           Mainloop::make_b(b8, n, k, experts), rows, k, n, experts, /*b1_row_shift=*/1};
  auto* o = static_cast<bfloat16_t*>(out);
  const Epilogue::Params e{StoreTensor{make_store_tma(o, rows, n, n, 1, 0), rows, n, 1}};
  const GroupedGemmParams<Mainloop, Epilogue> p{m,     e,   TileOrder::grouped_rows, experts, rows, 0,
                                                 ceil_div(n, GemmConfig::kBlockN), ceil_div(k, Mainloop::kBlockK),
                                                 offsets, status};
  auto kernel = grouped_gemm_kernel<Mainloop, Epilogue>;
  const int smem = static_cast<int>(sizeof(GroupedGemmSharedStorage<Mainloop::Element>));
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "set shared memory");
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "multiprocessor count");
  kernel<<<sms, GemmConfig::kThreads, smem, stream>>>(p);
  check(cudaGetLastError(), "launch fp8 grouped GEMM");
}

void fp8_scaled_grouped_gemm(const void* a, const float* a_scales, const void* b, const float* b_scales, void* out,
                             const int32_t* offsets, int rows, int k, int n, int experts, int32_t* status,
                             cudaStream_t stream) {
  if (rows <= 0 || rows % 4 != 0 || k <= 0 || k % 16 != 0 || n <= 0 || n % 8 != 0 || experts < 1 ||
      experts > GemmConfig::kMaxExperts || a_scales == nullptr || b_scales == nullptr)
    throw std::invalid_argument("fp8_scaled_grouped_gemm: bad shape or null scales");
  const auto* a8 = static_cast<const float_e4m3_t*>(a);
  const auto* b8 = static_cast<const float_e4m3_t*>(b);
  auto* o = static_cast<bfloat16_t*>(out);
  const Fp8ScaledGemmParams p = fp8_store_params(a8, a_scales, b8, b_scales,
                                                 StoreTensor{make_store_tma(o, rows, n, n, 1, 0), rows, n, 1}, rows,
                                                 k, n, experts, offsets, status);
  const int smem = static_cast<int>(sizeof(Fp8ScaledGemmSharedStorage));
  check(cudaFuncSetAttribute(fp8_scaled_gemm_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "set shared memory");
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "multiprocessor count");
  fp8_scaled_gemm_kernel<false><<<sms, GemmConfig::kThreads, smem, stream>>>(p);
  check(cudaGetLastError(), "launch fp8 scaled grouped GEMM");
}

}  // namespace mok::test
