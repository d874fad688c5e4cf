#pragma once
// CUDA memory resources: device memory (cudaMalloc) and pinned host memory (cudaMallocHost),
// with the same byte accounting as every loom resource (core/memory.hpp). Compiled by g++ or
// nvcc; needs the loom::cuda target.

#include <loom/core/cuda/error.hpp>
#include <loom/core/memory.hpp>

#include <cuda_runtime_api.h>

#include <string>

namespace loom {

/// Device memory of the current CUDA device.
class cuda_memory_resource final : public memory_resource {
 public:
  explicit cuda_memory_resource(std::string name = "cuda") : memory_resource(std::move(name)) {}
  bool host_accessible() const noexcept override { return false; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    LOOM_CHECK(alignment <= 256, name(), ": cudaMalloc aligns to 256 bytes, requested alignment=", alignment);
    void* p = nullptr;
    LOOM_CUDA_CHECK(cudaMalloc(&p, bytes));
    return p;
  }
  void do_deallocate(void* p, std::size_t, std::size_t) noexcept override { (void)cudaFree(p); }
};

/// Page-locked host memory: host-accessible, and the source/target of asynchronous copies.
class pinned_host_memory_resource final : public memory_resource {
 public:
  explicit pinned_host_memory_resource(std::string name = "pinned_host") : memory_resource(std::move(name)) {}
  bool host_accessible() const noexcept override { return true; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    LOOM_CHECK(alignment <= 4096, name(), ": pinned allocations align to a page, requested alignment=", alignment);
    void* p = nullptr;
    LOOM_CUDA_CHECK(cudaMallocHost(&p, bytes));
    return p;
  }
  void do_deallocate(void* p, std::size_t, std::size_t) noexcept override { (void)cudaFreeHost(p); }
};

template <>
inline memory_resource& default_resource<cuda>() {
  static cuda_memory_resource r("cuda(default)");
  return r;
}

}  // namespace loom
