#include "mok/core/cpu_gemm.h"

#include <algorithm>

#include "mok/core/parallel.h"

namespace mok::cpu {
namespace {

constexpr int kLanes = 16;
constexpr int64_t kBlockN = 64;  // columns of C per work item

template <class Real>
inline Real reduce_lanes(const Real* lane) {
  Real l8[8], l4[4];
  for (int i = 0; i < 8; ++i) l8[i] = lane[i] + lane[i + 8];
  for (int i = 0; i < 4; ++i) l4[i] = l8[i] + l8[i + 4];
  return (l4[0] + l4[2]) + (l4[1] + l4[3]);
}

// Two rows of A against two rows of B: four dot products sharing their loads.
template <class Real>
inline __attribute__((always_inline)) void dot_2x2(int64_t K, const Real* a0, const Real* a1,
                                                   const Real* b0, const Real* b1, Real out[4]) {
  Real acc00[kLanes] = {}, acc01[kLanes] = {}, acc10[kLanes] = {}, acc11[kLanes] = {};
  const int64_t full = K / kLanes * kLanes;
  for (int64_t k = 0; k < full; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      acc00[l] += a0[k + l] * b0[k + l];
      acc01[l] += a0[k + l] * b1[k + l];
      acc10[l] += a1[k + l] * b0[k + l];
      acc11[l] += a1[k + l] * b1[k + l];
    }
  }
  for (int64_t k = full; k < K; ++k) {
    const int l = static_cast<int>(k - full);
    acc00[l] += a0[k] * b0[k];
    acc01[l] += a0[k] * b1[k];
    acc10[l] += a1[k] * b0[k];
    acc11[l] += a1[k] * b1[k];
  }
  out[0] = reduce_lanes(acc00);
  out[1] = reduce_lanes(acc01);
  out[2] = reduce_lanes(acc10);
  out[3] = reduce_lanes(acc11);
}

// C[m0:m0+2 (clipped), n0:n1] for one work item. Rows or columns past the end reuse a valid
// row as a dummy operand and their results are dropped, so every kept value comes from the same
// arithmetic.
template <class Real>
inline __attribute__((always_inline)) void block_nt(int64_t M, int64_t K, int64_t m0, int64_t n0,
                                                    int64_t n1, const Real* A, int64_t lda,
                                                    const Real* B, int64_t ldb, Real* C, int64_t ldc) {
  const bool two_rows = m0 + 1 < M;
  const Real* a0 = A + m0 * lda;
  const Real* a1 = two_rows ? a0 + lda : a0;
  for (int64_t n = n0; n < n1; n += 2) {
    const bool two_cols = n + 1 < n1;
    const Real* b0 = B + n * ldb;
    const Real* b1 = two_cols ? b0 + ldb : b0;
    Real out[4];
    dot_2x2(K, a0, a1, b0, b1, out);
    C[m0 * ldc + n] = out[0];
    if (two_cols) C[m0 * ldc + n + 1] = out[1];
    if (two_rows) {
      C[(m0 + 1) * ldc + n] = out[2];
      if (two_cols) C[(m0 + 1) * ldc + n + 1] = out[3];
    }
  }
}

__attribute__((target_clones("avx2", "default"))) void block_nt_f32(
    int64_t M, int64_t K, int64_t m0, int64_t n0, int64_t n1, const float* A, int64_t lda,
    const float* B, int64_t ldb, float* C, int64_t ldc) {
  block_nt(M, K, m0, n0, n1, A, lda, B, ldb, C, ldc);
}

__attribute__((target_clones("avx2", "default"))) void block_nt_f64(
    int64_t M, int64_t K, int64_t m0, int64_t n0, int64_t n1, const double* A, int64_t lda,
    const double* B, int64_t ldb, double* C, int64_t ldc) {
  block_nt(M, K, m0, n0, n1, A, lda, B, ldb, C, ldc);
}

template <class Real, class Block>
void gemm_nt_impl(int64_t M, int64_t N, int64_t K, const Real* A, int64_t lda, const Real* B,
                  int64_t ldb, Real* C, int64_t ldc, Block block) {
  if (M <= 0 || N <= 0) return;
  const int64_t row_pairs = (M + 1) / 2;
  const int64_t col_blocks = (N + kBlockN - 1) / kBlockN;
  // Work items: (row pair, column block). Tiny products stay on the calling thread.
  const auto work = [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t m0 = (w / col_blocks) * 2;
      const int64_t n0 = (w % col_blocks) * kBlockN;
      block(M, K, m0, n0, std::min(N, n0 + kBlockN), A, lda, B, ldb, C, ldc);
    }
  };
  const int64_t items = row_pairs * col_blocks;
  if (M * N * std::max<int64_t>(K, 1) < (int64_t{1} << 16)) {
    work(0, items);
  } else {
    parallel_for(items, work);
  }
}

}  // namespace

void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc) {
  gemm_nt_impl(M, N, K, A, lda, B, ldb, C, ldc, block_nt_f32);
}

void gemm_nt(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B,
             int64_t ldb, double* C, int64_t ldc) {
  gemm_nt_impl(M, N, K, A, lda, B, ldb, C, ldc, block_nt_f64);
}

}  // namespace mok::cpu
