// LOOM_CUDA_CHECK / LOOM_NCCL_CHECK turn failing status codes into loom::error naming the call
// and the library's own description (checked against cudaGetErrorName / ncclGetErrorString).
#include <loom/core/cuda/error.hpp>
#include <loom/core/cuda/memory.hpp>
#if defined(LOOM_HAS_NCCL)
#include <loom/core/cuda/nccl_error.hpp>
#endif

#include <doctest/doctest.h>

#include <string>

TEST_CASE("a failing CUDA call throws loom::error naming the call and the error") {
  const cudaError_t expect = cudaSetDevice(1 << 20);  // no machine has that many devices
  REQUIRE(expect != cudaSuccess);
  (void)cudaGetLastError();
  try {
    LOOM_CUDA_CHECK(cudaSetDevice(1 << 20));
    FAIL("no throw");
  } catch (const loom::error& e) {
    const std::string m = e.what();
    CHECK(m.find("cudaSetDevice(1 << 20)") != std::string::npos);
    CHECK(m.find(cudaGetErrorName(expect)) != std::string::npos);
  }
  if (expect == cudaErrorInvalidDevice)       // with a driver present the error is not sticky:
    CHECK(cudaGetLastError() == cudaSuccess);  // the checker cleared it
  CHECK_NOTHROW(LOOM_CUDA_CHECK(cudaSuccess));
  CHECK(loom::cuda_device_count() >= 0);
}

TEST_CASE("the CUDA memory resource reports failure as loom::error without leaking accounting") {
  if (loom::cuda_device_count() > 0) return;  // only meaningful without a device
  loom::cuda_memory_resource r("dev");
  CHECK_THROWS_AS((void)r.allocate(1024), loom::error);
  CHECK(r.current_bytes() == 0);
}

#if defined(LOOM_HAS_NCCL)
TEST_CASE("NCCL status codes") {
  try {
    LOOM_NCCL_CHECK(ncclInvalidArgument);
    FAIL("no throw");
  } catch (const loom::error& e) {
    CHECK(std::string(e.what()).find(ncclGetErrorString(ncclInvalidArgument)) != std::string::npos);
  }
  CHECK_NOTHROW(LOOM_NCCL_CHECK(ncclSuccess));
}
#endif
