#pragma once
// The part of cuBLAS loom calls (cublasGemmStridedBatchedEx and the handle), on the host, for code compiled
// with g++ under the emulator: a plain triple loop in double over column-major operands, the
// arithmetic of the reference BLAS, so a test of ops::gemm(cuda) checks loom's operand layout
// (transposes, leading dimensions, the row-major to column-major swap) and not cuBLAS.
// Operands must be device memory (cuda_runtime_api.h), as cuBLAS requires.

#include "cuda_runtime_api.h"

#include <loom/core/float16.hpp>

#include <algorithm>
#include <cstdint>

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68 };
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 };
enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };

struct cublasContext {
  cudaStream_t stream = nullptr;
};
using cublasHandle_t = cublasContext*;

inline cublasStatus_t cublasCreate(cublasHandle_t* h) {
  *h = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasDestroy(cublasHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  h->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}
inline const char* cublasGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}
inline const char* cublasGetStatusString(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? "success" : "emulated cuBLAS refused the call";
}

namespace loom::emulation {
inline double load_element(const void* p, cudaDataType_t t, std::int64_t i) {
  switch (t) {
    case CUDA_R_32F: return static_cast<const float*>(p)[i];
    case CUDA_R_16F: return static_cast<float>(static_cast<const loom::half*>(p)[i]);
    case CUDA_R_16BF: return static_cast<float>(static_cast<const loom::bfloat16*>(p)[i]);
  }
  return 0;
}
inline void store_element(void* p, cudaDataType_t t, std::int64_t i, double v) {
  switch (t) {
    case CUDA_R_32F: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case CUDA_R_16F: static_cast<loom::half*>(p)[i] = loom::half(static_cast<float>(v)); break;
    case CUDA_R_16BF: static_cast<loom::bfloat16*>(p)[i] = loom::bfloat16(static_cast<float>(v)); break;
  }
}
inline std::size_t element_bytes(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }
}  // namespace loom::emulation

/// C_i = alpha op(A_i) op(B_i) + beta C_i for i < batch (X_i = X + i * strideX), column-major,
/// fp32 alpha/beta (CUBLAS_COMPUTE_32F).
inline cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                                 int k, const void* alpha, const void* a, cudaDataType_t at, int lda,
                                                 long long stride_a, const void* b, cudaDataType_t bt, int ldb,
                                                 long long stride_b, const void* beta, void* c, cudaDataType_t ct, int ldc,
                                                 long long stride_c, int batch, cublasComputeType_t compute,
                                                 cublasGemmAlgo_t) {
  namespace e = loom::emulation;
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (compute != CUBLAS_COMPUTE_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  const int a_rows = ta == CUBLAS_OP_N ? m : k, b_rows = tb == CUBLAS_OP_N ? k : n;
  if (m < 0 || n < 0 || k < 0 || batch < 0 || lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) ||
      ldc < std::max(1, m))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
  // every element the call reads or writes must be device memory
  const auto span = [&](int ld, int cols, int rows, long long stride) {
    return (static_cast<std::size_t>(ld) * (cols - 1) + rows + static_cast<std::size_t>(stride) * (batch - 1));
  };
  if ((k > 0 && (!e::on_device(a, span(lda, ta == CUBLAS_OP_N ? k : m, a_rows, stride_a) * e::element_bytes(at)) ||
                 !e::on_device(b, span(ldb, tb == CUBLAS_OP_N ? n : k, b_rows, stride_b) * e::element_bytes(bt)))) ||
      !e::on_device(c, span(ldc, n, m, stride_c) * e::element_bytes(ct)))
    return CUBLAS_STATUS_INVALID_VALUE;
  const double al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  for (long long q = 0; q < batch; ++q)
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        double s = 0;
        for (int p = 0; p < k; ++p) {
          const std::int64_t ai = q * stride_a + (ta == CUBLAS_OP_N ? i + std::int64_t(p) * lda : p + std::int64_t(i) * lda);
          const std::int64_t bi = q * stride_b + (tb == CUBLAS_OP_N ? p + std::int64_t(j) * ldb : j + std::int64_t(p) * ldb);
          s += e::load_element(a, at, ai) * e::load_element(b, bt, bi);
        }
        const std::int64_t ci = q * stride_c + i + std::int64_t(j) * ldc;
        e::store_element(c, ct, ci, al * s + (be == 0 ? 0.0 : be * e::load_element(c, ct, ci)));
      }
  return CUBLAS_STATUS_SUCCESS;
}
