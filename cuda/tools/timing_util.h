// What the development timing tools share: a CUDA check that exits, the device fill
// (tools/fill_random.cu) and an event timer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(x)                                                                          \
  do {                                                                                         \
    cudaError_t e = (x);                                                                       \
    if (e != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

// bf16 values uniform in [-scale, scale], from a hash of the index.
void fill_random(uint16_t* p, size_t n, uint32_t seed, float scale);

// Milliseconds per call of f over `iters` calls after `warmup` untimed ones, between two events
// on the legacy stream.
template <class F>
float time_ms(F f, int iters, int warmup = 3) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < warmup; ++i) f();
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) f();
  cudaEventRecord(b);
  CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / iters;
}
