#pragma once
// The part of the CUDA runtime API loom calls, on the host, for code compiled with g++ under
// the emulator (../emulation.hpp): this folder comes before any CUDA include path of an
// emulated test, so loom's headers include it as <cuda_runtime_api.h>. "Device" memory is host
// memory that the emulator keeps a record of, so that a copy whose direction names the wrong
// side, a kernel handed a host pointer, or a free of something never allocated fails with the
// error the runtime would give (a GPU would give a crash or garbage for some of them). Every
// call is synchronous: streams and events order nothing here (the emulator runs one launch at
// a time), so the emulator cannot show a missing stream synchronisation.

#include "../emulation.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorInvalidDevice = 101,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
inline constexpr unsigned cudaStreamNonBlocking = 0x01, cudaEventDisableTiming = 0x02;

struct CUstream_st {};
struct CUevent_st {};
using cudaStream_t = CUstream_st*;
using cudaEvent_t = CUevent_st*;

namespace loom::emulation {
/// Allocations the emulated device holds ("device memory"): start -> bytes.
struct device_memory {
  std::mutex mutex;
  std::map<std::uintptr_t, std::size_t> blocks;
  cudaError_t last_error = cudaSuccess;
};
inline device_memory& device() {
  static device_memory d;
  return d;
}
inline cudaError_t fail(cudaError_t e) {
  device().last_error = e;
  return e;
}
/// Whether [p, p + bytes) lies inside one device allocation (bytes 0: p inside or one past).
inline bool on_device_address(std::uintptr_t a, std::size_t bytes) {
  auto& d = device();
  std::lock_guard lock(d.mutex);
  auto it = d.blocks.upper_bound(a);
  if (it == d.blocks.begin()) return false;
  --it;
  return a - it->first + bytes <= it->second && (bytes > 0 || a - it->first <= it->second);
}
// (an address, not a pointer: a copy's source may be uninitialised host memory, which GCC
// would warn about handing to a function that could read it)
inline bool on_device(const void* p, std::size_t bytes) { return on_device_address(reinterpret_cast<std::uintptr_t>(p), bytes); }
/// The side a cudaMemcpy kind names must be the side each pointer is on.
inline bool copy_sides_match(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  if (bytes == 0) return true;
  const bool dst_device = on_device(dst, bytes), src_device = on_device(src, bytes);
  switch (kind) {
    case cudaMemcpyHostToHost: return !dst_device && !src_device;
    case cudaMemcpyHostToDevice: return dst_device && !src_device;
    case cudaMemcpyDeviceToHost: return !dst_device && src_device;
    case cudaMemcpyDeviceToDevice: return dst_device && src_device;
    case cudaMemcpyDefault: return true;
  }
  return false;
}
}  // namespace loom::emulation

inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
  }
  return "cudaErrorUnknown";
}
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument (emulated runtime)";
    case cudaErrorMemoryAllocation: return "out of memory (emulated runtime)";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument (emulated runtime)";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer (emulated runtime)";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy (emulated runtime)";
    case cudaErrorInvalidDevice: return "invalid device ordinal (emulated runtime)";
    case cudaErrorNotReady: return "device not ready (emulated runtime)";
    case cudaErrorIllegalAddress: return "a kernel was handed a pointer outside device memory (emulated runtime)";
  }
  return "unknown error (emulated runtime)";
}
inline cudaError_t cudaGetLastError() {
  auto& d = loom::emulation::device();
  return std::exchange(d.last_error, cudaSuccess);
}

inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : loom::emulation::fail(cudaErrorInvalidDevice);  // one device
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

inline cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  // 256-byte aligned as cudaMalloc's; a zero-byte request still gets a distinct block
  void* q = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
  if (!q) return loom::emulation::fail(cudaErrorMemoryAllocation);
  auto& d = loom::emulation::device();
  std::lock_guard lock(d.mutex);
  d.blocks[reinterpret_cast<std::uintptr_t>(q)] = bytes;
  *p = q;
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  auto& d = loom::emulation::device();
  {
    std::lock_guard lock(d.mutex);
    if (d.blocks.erase(reinterpret_cast<std::uintptr_t>(p)) == 0) return loom::emulation::fail(cudaErrorInvalidDevicePointer);
  }
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaMallocHost(void** p, std::size_t bytes) {
  *p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096 + 4096);
  return *p ? cudaSuccess : loom::emulation::fail(cudaErrorMemoryAllocation);
}
inline cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  return cudaSuccess;
}

inline cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  if (!loom::emulation::copy_sides_match(dst, src, bytes, kind)) return loom::emulation::fail(cudaErrorInvalidValue);
  if (bytes) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t = nullptr) {
  return cudaMemcpy(dst, src, bytes, kind);
}
inline cudaError_t cudaMemset(void* p, int value, std::size_t bytes) {
  if (bytes && !loom::emulation::on_device(p, bytes)) return loom::emulation::fail(cudaErrorInvalidValue);
  if (bytes) std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t = nullptr) {
  return cudaMemset(p, value, bytes);
}

namespace loom::emulation {
/// A stream or an event: an object that orders nothing (every call is synchronous).
template <class H>
cudaError_t create(H** h) {
  *h = new H;
  return cudaSuccess;
}
template <class H>
cudaError_t destroy(H* h) {
  delete h;
  return cudaSuccess;
}
}  // namespace loom::emulation
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) { return loom::emulation::create(s); }
inline cudaError_t cudaStreamDestroy(cudaStream_t s) { return loom::emulation::destroy(s); }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return loom::emulation::create(e); }
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { return loom::emulation::create(e); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) { return loom::emulation::destroy(e); }
inline cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t = nullptr) { return cudaSuccess; }
inline cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }  // every launch has finished
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }

/// The most dynamic shared memory a block may opt in to (an H100's or H200's 227 KiB).
inline constexpr int emulated_max_dynamic_shared_bytes = 232448;
template <class F>
cudaError_t cudaFuncSetAttribute(F*, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize &&
      (value < 0 || value > emulated_max_dynamic_shared_bytes))
    return loom::emulation::fail(cudaErrorInvalidValue);
  return cudaSuccess;
}

namespace loom::emulation {
template <class A>
bool device_or_null(const A& a) {
  if constexpr (std::is_pointer_v<A> && !std::is_function_v<std::remove_pointer_t<A>>)
    return a == nullptr || on_device(a, 0);
  else
    return true;
}

/// What LOOM_LAUNCH(kernel, grid, block, smem, stream) is under the emulator (ops/cuda/launch.hpp):
/// the launch's checks as the runtime makes them (block size, grid, dynamic shared memory),
/// plus one a GPU makes only by failing: every pointer argument must be device memory or
/// null. A failed check is the launch's error, returned by the next cudaGetLastError(), and
/// nothing runs.
template <class F>
struct launcher {
  F call;
  dim3 grid, block;
  std::size_t smem;
  template <class... A>
  void operator()(A... args) const {
    if (block.x == 0 || block.x > 1024 || block.x % 32 != 0 || block.y != 1 || block.z != 1 || grid.x == 0 ||
        grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
      fail(cudaErrorInvalidConfiguration);
      return;
    }
    if (smem > dynamic_shared_bytes || smem > static_cast<std::size_t>(emulated_max_dynamic_shared_bytes)) {
      fail(cudaErrorInvalidValue);
      return;
    }
    if (!(device_or_null(args) && ...)) {
      fail(cudaErrorIllegalAddress);
      return;
    }
    emulate_grid([&] { call(args...); }, grid, block.x);
  }
};
template <class F>
launcher<F> launch(F call, dim3 grid, dim3 block, std::size_t smem) {
  return {std::move(call), grid, block, smem};
}
}  // namespace loom::emulation
