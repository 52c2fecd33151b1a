// Device fill for the timing tools: bf16 values uniform in [-scale, scale] from a hash of the index.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace {
__global__ void fill_random_kernel(uint16_t* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float v = (float(h & 0xffffff) / float(0xffffff) - 0.5f) * 2.0f * scale;
    uint32_t bits = __float_as_uint(v);
    p[i] = uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
  }
}

}  // namespace

void fill_random(uint16_t* p, size_t n, uint32_t seed, float scale) {
  fill_random_kernel<<<1024, 256>>>(p, n, seed, scale);
}
