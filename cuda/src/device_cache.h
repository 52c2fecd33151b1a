// A value per device computed once (SM counts, occupancy queries): the launchers' hot paths ask
// the driver nothing after the first call on a device. Shared by fp8.cu and fp8_experts.cu.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>

namespace mok::cuda::host_util {

// The cache of one query: a positive value per device ordinal (0 = not yet computed).
struct PerDevice {
  static constexpr int kDevices = 64;
  std::atomic<int> value[kDevices] = {};
};

// cache's value for the current device, computing it with compute() (an int; a positive value
// is kept, zero or less is returned and asked again next time). Two threads may both compute it
// the first time: the same value.
template <class Compute>
int per_device(PerDevice& cache, Compute&& compute) {
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess)
    throw std::runtime_error(std::string("mok cuda: cudaGetDevice: ") + cudaGetErrorString(e));
  const bool cached = device >= 0 && device < PerDevice::kDevices;
  if (cached) {
    if (const int v = cache.value[device].load(std::memory_order_relaxed); v > 0) return v;
  }
  const int v = compute();
  if (cached && v > 0) cache.value[device].store(v, std::memory_order_relaxed);
  return v;
}

}  // namespace mok::cuda::host_util
