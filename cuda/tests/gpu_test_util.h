// What the GPU tests share: a device buffer that can be poisoned, bf16 conversions of host vectors,
// seeded bf16 random data, and scoped environment switches.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "mok/core/bf16.h"
#include "mok/core/problem.h"

#define CUDA_OK(expr) \
  ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

namespace mok::test {

// GPUs this process sees (0 when CUDA reports none or fails): the GPU tests skip at 0.
inline int device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// `count` elements of device memory (ptr is null if the allocation failed).
template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    if (cudaMalloc(&ptr, std::max<size_t>(count, 1) * sizeof(T)) != cudaSuccess) ptr = nullptr;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), n(o.n) { o.ptr = nullptr; }
  ~DeviceBuffer() { cudaFree(ptr); }
  void upload(const std::vector<T>& v) {
    if (!v.empty()) cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> download() const {
    std::vector<T> v(n);
    if (n > 0) cudaMemcpy(v.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
  // Every byte set to `byte`; the default 0xff makes bf16 and fp32 values NaN.
  void poison(int byte = 0xff) { cudaMemset(ptr, byte, std::max<size_t>(n, 1) * sizeof(T)); }
};

inline std::vector<uint16_t> to_bits(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(v[i]).bits;
  return out;
}

inline std::vector<float> from_bits(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(bf16{v[i]});
  return out;
}

// n values ~ N(0, scale^2), each a bf16 value.
inline std::vector<float> random_bf16(Rng& rng, int64_t n, double scale = 1.0) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = round_to_bf16(static_cast<float>(rng.normal() * scale));
  return v;
}

// An environment switch of the library's (MOK_FP8_CLUSTER, MOK_EXPERIMENT_DX_SCATTER, ...) set for a
// scope, and unset again however the scope ends (a call that throws included).
struct SwitchEnv {
  SwitchEnv(const char* name, const char* value) : name(name), ok(setenv(name, value, 1) == 0) {}
  ~SwitchEnv() { unsetenv(name); }
  SwitchEnv(const SwitchEnv&) = delete;
  SwitchEnv& operator=(const SwitchEnv&) = delete;
  const char* name;
  bool ok;
};

}  // namespace mok::test
