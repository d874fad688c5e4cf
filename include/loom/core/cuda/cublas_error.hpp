#pragma once
// cuBLAS status-code checker: LOOM_CUBLAS_CHECK(call) throws loom::error naming the call and
// cuBLAS's name and description of the status (as LOOM_CUDA_CHECK does for the runtime).

#include <loom/core/error.hpp>

#include <cublas_v2.h>

namespace loom::detail {

inline void check_cublas(cublasStatus_t rc, const char* call, const char* file, int line) {
  if (LOOM_LIKELY(rc == CUBLAS_STATUS_SUCCESS)) return;
  throw_error_at(file, line, concat("cuBLAS call ", call, " failed: ", cublasGetStatusName(rc), " (",
                                    cublasGetStatusString(rc), ")"));
}

}  // namespace loom::detail

#define LOOM_CUBLAS_CHECK(call) ::loom::detail::check_cublas((call), #call, __FILE__, __LINE__)
