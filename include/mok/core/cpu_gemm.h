// The CPU backend's matrix product: C = A * B^T with a fixed reduction order per element.
//
// Each C[m,n] sums A[m,k]*B[n,k] into 16 lanes (lane = k mod 16, k increasing) and then adds
// the lanes in a fixed tree. The order depends only on K, never on blocking, threads or the
// instruction set, so the result is bitwise reproducible on any machine with IEEE arithmetic
// (the core is built with -ffp-contract=off: no fused multiply-adds).
#pragma once

#include <cstdint>

namespace mok::cpu {

// C[M,N] (row stride ldc) = A[M,K] (row stride lda) * B[N,K]^T (row stride ldb). Multi-threaded.
void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc);
void gemm_nt(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B,
             int64_t ldb, double* C, int64_t ldc);

// out[cols, rows] = in[rows, cols]^T (row strides ld_in, ld_out).
template <class Real>
void transpose(int64_t rows, int64_t cols, const Real* in, int64_t ld_in, Real* out, int64_t ld_out) {
  for (int64_t r0 = 0; r0 < rows; r0 += 32) {
    for (int64_t c0 = 0; c0 < cols; c0 += 32) {
      const int64_t r1 = r0 + 32 < rows ? r0 + 32 : rows;
      const int64_t c1 = c0 + 32 < cols ? c0 + 32 : cols;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) out[c * ld_out + r] = in[r * ld_in + c];
      }
    }
  }
}

}  // namespace mok::cpu
