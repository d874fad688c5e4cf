#pragma once
// A CUDA block on host threads, so that a kernel's logic (indexing, masks, tiles, warp
// reductions, barriers) is tested by the CPU CI, which has no GPU. Include this first, then a
// .cuh whose kernels are written for it (its launch code sits behind
// `#if !defined(LOOM_CUDA_EMULATION)`), and run a kernel with emulate_launch: one std::thread a
// CUDA thread; the block's threads run the grid's blocks one after another, a barrier between
// blocks; __syncthreads is a barrier of the block's threads; the warp intrinsics exchange
// values through a per-warp array between two barriers of its 32 threads (every lane must
// reach them, as with a full mask on a GPU); `__shared__` arrays are static (one per kernel,
// shared by the block's threads) and dynamic shared memory (LOOM_DYNAMIC_SHARED_FLOATS, see
// ops/cuda/launch.hpp) is one array of dynamic_shared_bytes.
// What it cannot show: races the GPU's memory model allows but these barriers order,
// performance, and anything of a real device (register spills, shared-memory limits).

#define LOOM_CUDA_EMULATION 1

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <deque>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __launch_bounds__(...)
#define __shared__ static

namespace loom::emulation {
inline constexpr std::size_t dynamic_shared_bytes = std::size_t(1) << 18;
inline float* dynamic_shared_floats() {
  static float memory[dynamic_shared_bytes / sizeof(float)];
  return memory;
}

struct warp_lanes {
  std::barrier<> meet{32};
  float f[32];
  int i[32];
};
inline thread_local warp_lanes* this_warp = nullptr;
inline std::barrier<>* this_block = nullptr;

/// All 32 lanes publish v, then each reads lane `from(lane)`'s value.
template <class F>
inline float exchange(float v, F&& from) {
  const unsigned lane = threadIdx.x % 32;
  this_warp->f[lane] = v;
  this_warp->meet.arrive_and_wait();
  const float r = this_warp->f[from(lane) % 32];
  this_warp->meet.arrive_and_wait();
  return r;
}
}  // namespace loom::emulation

using std::isfinite;  // CUDA's device isfinite is a global function

inline void __syncthreads() { loom::emulation::this_block->arrive_and_wait(); }
inline float __shfl_sync(unsigned, float v, int src) {
  return loom::emulation::exchange(v, [&](unsigned) { return static_cast<unsigned>(src); });
}
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  return loom::emulation::exchange(v, [&](unsigned lane) { return lane ^ static_cast<unsigned>(mask); });
}
inline int __any_sync(unsigned, int p) {
  auto* w = loom::emulation::this_warp;
  w->i[threadIdx.x % 32] = p != 0;
  w->meet.arrive_and_wait();
  int any = 0;
  for (int l = 0; l < 32; ++l) any |= w->i[l];
  w->meet.arrive_and_wait();
  return any;
}

inline unsigned long long atomicMin(unsigned long long* address, unsigned long long value) {
  std::atomic_ref<unsigned long long> a(*address);
  unsigned long long old = a.load();
  while (value < old && !a.compare_exchange_weak(old, value)) {
  }
  return old;
}

namespace loom::emulation {
/// kernel<<<grid, threads>>>(args...) on `threads` host threads (a multiple of 32), the
/// blocks in x, then y, then z order; returns when the whole grid has run.
template <class... P, class... A>
void emulate_launch(void (*kernel)(P...), dim3 grid, unsigned threads, A... args) {
  gridDim = grid, blockDim = {threads, 1, 1};
  std::barrier<> block(static_cast<std::ptrdiff_t>(threads));
  std::deque<warp_lanes> warps(threads / 32);
  this_block = &block;
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      threadIdx = {t, 0, 0};
      this_warp = &warps[t / 32];
      for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = {x, y, z};
            kernel(args...);
            block.arrive_and_wait();  // shared memory is the next block's only after every thread is done
          }
    });
  for (auto& th : pool) th.join();
}
}  // namespace loom::emulation
