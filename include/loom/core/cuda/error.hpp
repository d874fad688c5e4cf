#pragma once
// CUDA runtime status-code checker. LOOM_CUDA_CHECK(call) throws loom::error naming the call,
// the error name and its description. A failed call's error is also cleared from the
// runtime's last-error slot so that the next check does not report it again.

#include <loom/core/error.hpp>

#include <cuda_runtime_api.h>

namespace loom::detail {

inline void check_cuda(cudaError_t rc, const char* call, const char* file, int line) {
  if (LOOM_LIKELY(rc == cudaSuccess)) return;
  (void)cudaGetLastError();  // clear a non-sticky error
  throw_error_at(file, line, concat("CUDA call ", call, " failed: ", cudaGetErrorName(rc), " (", cudaGetErrorString(rc), ")"));
}

}  // namespace loom::detail

#define LOOM_CUDA_CHECK(call) ::loom::detail::check_cuda((call), #call, __FILE__, __LINE__)

namespace loom {
/// Number of CUDA devices visible to this process; 0 when there is no device or no driver.
inline int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}
}  // namespace loom
