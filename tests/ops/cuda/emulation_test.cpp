// The emulator itself (emulation.hpp), on kernels whose results have a closed form: a block
// barrier orders shared-memory writes before reads (a block reverses an array through shared
// memory), the warp intrinsics exchange the lanes' values (a butterfly sum, a broadcast, a
// vote), the grid's blocks each see their own blockIdx, and threads waiting at different
// barriers end the launch with an exception instead of a hang. And the emulated runtime
// (emulated_runtime/): copies whose direction names the wrong side, launches a GPU would
// refuse or crash on, and frees of what was never allocated are errors, as on a GPU.
#include "emulation.hpp"

#include <cuda_runtime.h>  // emulated_runtime/ (this test's include path), not the toolkit's

#include <loom/ops/cuda/launch.hpp>

#include <doctest/doctest.h>

#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <vector>

namespace {

using loom::emulation::emulate_launch;

constexpr unsigned max_threads = 256;

__global__ void reverse_through_shared(const int* in, int* out) {
  __shared__ int tile[max_threads];
  const unsigned t = threadIdx.x, n = blockDim.x, base = blockIdx.x * n;
  tile[t] = in[base + t];
  __syncthreads();  // without it, thread t reads tile[n - 1 - t] before its owner wrote it
  out[base + t] = tile[n - 1 - t];
}

__global__ void warp_exchanges(float* sum, float* from_lane_5, int* any_odd_of_lane_7) {
  const unsigned t = threadIdx.x, lane = t % 32;
  float v = static_cast<float>(t);
  for (int mask = 16; mask > 0; mask /= 2) v += __shfl_xor_sync(0xffffffffu, v, mask);
  sum[t] = v;
  from_lane_5[t] = __shfl_sync(0xffffffffu, static_cast<float>(t), 5);
  any_odd_of_lane_7[t] = __any_sync(0xffffffffu, lane == 7 && (t / 32) % 2 == 1);
}

__global__ void block_ids(int* out) {
  if (threadIdx.x == 0) out[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] =
      static_cast<int>(100 * blockIdx.z + 10 * blockIdx.y + blockIdx.x);
}

__global__ void barrier_in_a_branch(int* out) {
  if (threadIdx.x < 32) __syncthreads();  // the other threads never arrive: a GPU would hang
  out[threadIdx.x] = 1;
}

}  // namespace

TEST_CASE("emulation: __syncthreads orders shared memory between the block's threads, block after block") {
  for (unsigned threads : {32u, 96u, 256u}) {
    CAPTURE(threads);
    const unsigned blocks = 3;
    std::vector<int> in(threads * blocks), out(in.size(), -1);
    std::iota(in.begin(), in.end(), 1000);
    emulate_launch(reverse_through_shared, {blocks, 1, 1}, threads, in.data(), out.data());
    for (unsigned b = 0; b < blocks; ++b)
      for (unsigned t = 0; t < threads; ++t) REQUIRE(out[b * threads + t] == in[b * threads + threads - 1 - t]);
  }
}

TEST_CASE("emulation: warp shuffles and votes exchange the 32 lanes' values") {
  const unsigned threads = 128;
  std::vector<float> sum(threads), five(threads);
  std::vector<int> any(threads);
  emulate_launch(warp_exchanges, {1, 1, 1}, threads, sum.data(), five.data(), any.data());
  for (unsigned t = 0; t < threads; ++t) {
    const unsigned w = t / 32;
    CHECK(sum[t] == static_cast<float>(32 * 32 * w + 31 * 32 / 2));  // lanes 32w .. 32w+31
    CHECK(five[t] == static_cast<float>(32 * w + 5));
    CHECK(any[t] == static_cast<int>(w % 2));
  }
}

TEST_CASE("emulation: every block of a 3-D grid runs once with its own blockIdx") {
  std::vector<int> out(4 * 3 * 2, -1);
  emulate_launch(block_ids, {4, 3, 2}, 32, out.data());
  for (int z = 0; z < 2; ++z)
    for (int y = 0; y < 3; ++y)
      for (int x = 0; x < 4; ++x) CHECK(out[static_cast<std::size_t>((z * 3 + y) * 4 + x)] == 100 * z + 10 * y + x);
}

TEST_CASE("emulation: a barrier not every thread reaches is an error, not a hang; bad block sizes are refused") {
  std::vector<int> out(64);
  CHECK_THROWS_WITH_AS(emulate_launch(barrier_in_a_branch, {1, 1, 1}, 64, out.data()),
                       doctest::Contains("wait at different barriers"), std::logic_error);
  // the emulator is usable again after a deadlock
  std::vector<int> in(64), rev(64);
  std::iota(in.begin(), in.end(), 0);
  emulate_launch(reverse_through_shared, {1, 1, 1}, 64, in.data(), rev.data());
  CHECK(rev[0] == 63);
  CHECK_THROWS_WITH_AS(emulate_launch(block_ids, {1, 1, 1}, 48, out.data()), doctest::Contains("multiple of 32, got 48"),
                       std::invalid_argument);
}

namespace {
__global__ void add_one(int* p, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) p[i] += 1;
}
}  // namespace

TEST_CASE("emulated runtime: device memory, copies in the direction they name, launches checked as a GPU would") {
  const int n = 100;
  std::vector<int> host(n);
  std::iota(host.begin(), host.end(), 0);
  int* dev = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&dev), n * sizeof(int)) == cudaSuccess);
  CHECK(cudaMemcpy(dev, host.data(), n * sizeof(int), cudaMemcpyHostToDevice) == cudaSuccess);
  LOOM_LAUNCH(add_one, 4, 32, 0, nullptr)(dev, n);
  CHECK(cudaGetLastError() == cudaSuccess);
  std::vector<int> back(n);
  CHECK(cudaMemcpy(back.data(), dev, n * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
  for (int i = 0; i < n; ++i) REQUIRE(back[static_cast<std::size_t>(i)] == i + 1);

  // the wrong direction, a range past the allocation's end, memset of host memory
  CHECK(cudaMemcpy(host.data(), dev, n * sizeof(int), cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
  CHECK(cudaMemcpy(dev, host.data(), n * sizeof(int), cudaMemcpyDeviceToHost) == cudaErrorInvalidValue);
  CHECK(cudaMemcpy(dev + 1, host.data(), n * sizeof(int), cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
  CHECK(cudaMemset(host.data(), 0, sizeof(int)) == cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaSuccess);  // reading the error clears it

  // a kernel handed host memory, a block of 2048 threads, too much shared memory: nothing runs
  LOOM_LAUNCH(add_one, 4, 32, 0, nullptr)(host.data(), n);
  CHECK(cudaGetLastError() == cudaErrorIllegalAddress);
  CHECK(host[0] == 0);
  LOOM_LAUNCH(add_one, 1, 2048, 0, nullptr)(dev, n);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  LOOM_LAUNCH(add_one, 1, 32, std::size_t(300) << 10, nullptr)(dev, n);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  CHECK(cudaMemcpy(back.data(), dev, n * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(back[0] == 1);

  CHECK(cudaFree(dev) == cudaSuccess);
  CHECK(cudaFree(dev) == cudaErrorInvalidDevicePointer);  // freed twice
  void* not_device = std::malloc(16);
  CHECK(cudaFree(not_device) == cudaErrorInvalidDevicePointer);
  std::free(not_device);
  (void)cudaGetLastError();
}
