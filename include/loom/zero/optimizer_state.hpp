#pragma once
// optimizer_state: where a rank's fp32 master weights and Adam moments live.
//
// ZeRO-Offload and ZeRO-Infinity move the largest model state -- 12 bytes per parameter of
// fp32 optimizer state -- off the accelerator. Three places, chosen by ds_config.json's
// offload_optimizer.device:
//   none  the rank's own (device) memory resource
//   cpu   a host memory resource (pinned when CUDA is in use); the step runs on the host
//   nvme  a file under offload_optimizer.nvme_path, memory-mapped: the OS pages it in and
//         out, so optimizer state larger than RAM still trains. The file is created on
//         construction and removed on destruction (also after an exception).
// Whatever the place, the optimizer sees three float spans [n]: master, exp_avg, exp_avg_sq
// (state_store: n floats in one of the places).

#include <loom/core/buffer.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

namespace loom::zero {

enum class offload_device { none, cpu, nvme };

inline offload_device parse_offload_device(std::string_view s) {
  if (s == "none") return offload_device::none;
  if (s == "cpu") return offload_device::cpu;
  if (s == "nvme") return offload_device::nvme;
  LOOM_THROW("offload_optimizer.device='", s, "' is not supported (expected none, cpu or nvme)");
}

/// `n` floats in one of the three places: the rank's (device) memory resource, a host memory
/// resource, or a memory-mapped file of its own under `nvme_path` (created here, sized once,
/// removed on destruction, also after an exception; a fresh file reads zeros, as fresh memory
/// does after the caller zeroes it). The optimizer state below is one; the engine's per-group
/// Adam moments, allocated when a group first trains, are one each.
class state_store {
 public:
  state_store() = default;
  state_store(std::size_t n, offload_device where, memory_resource& device, memory_resource& host,
              const std::string& nvme_path = {}, int tag = 0)
      : n_(n), where_(where) {
    if (where == offload_device::nvme) {
      LOOM_CHECK(!nvme_path.empty(), "offload_optimizer.nvme_path must name a directory when device=nvme");
      static std::atomic<unsigned> counter{0};
      path_ = nvme_path + "/loom-zero-optimizer-" + std::to_string(::getpid()) + "-" + std::to_string(tag) + "-" +
              std::to_string(counter.fetch_add(1)) + ".bin";
      fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
      LOOM_CHECK(fd_ >= 0, "offload_optimizer.nvme_path='", nvme_path, "': cannot create ", path_, ": ",
                 std::strerror(errno));
      const std::size_t bytes = n * sizeof(float);
      if (bytes > 0) {
        if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
          const int e = errno;
          cleanup();
          LOOM_THROW("offload_optimizer.nvme_path: cannot size ", path_, " to ", bytes, " bytes: ", std::strerror(e));
        }
        void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
        if (p == MAP_FAILED) {
          const int e = errno;
          cleanup();
          LOOM_THROW("offload_optimizer.nvme_path: cannot map ", path_, ": ", std::strerror(e));
        }
        map_ = static_cast<float*>(p);
      }
      base_ = map_;
    } else {
      mem_ = buffer<float>(n, where == offload_device::cpu ? host : device);
      base_ = mem_.data();
    }
  }
  state_store(state_store&& o) noexcept { swap(o); }
  state_store& operator=(state_store&& o) noexcept {
    state_store t(std::move(o));
    swap(t);
    return *this;
  }
  state_store(const state_store&) = delete;
  state_store& operator=(const state_store&) = delete;
  ~state_store() { cleanup(); }

  std::size_t size() const noexcept { return n_; }
  std::size_t bytes() const noexcept { return n_ * sizeof(float); }
  offload_device where() const noexcept { return where_; }
  /// The backing file (nvme only).
  const std::string& path() const noexcept { return path_; }
  std::span<float> span() noexcept { return {base_, n_}; }

 private:
  void swap(state_store& o) noexcept {
    std::swap(n_, o.n_), std::swap(where_, o.where_), std::swap(mem_, o.mem_), std::swap(map_, o.map_);
    std::swap(base_, o.base_), std::swap(fd_, o.fd_), std::swap(path_, o.path_);
  }
  void cleanup() noexcept {
    if (map_) ::munmap(map_, n_ * sizeof(float));
    map_ = nullptr;
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(path_.c_str());
    }
    fd_ = -1;
  }
  std::size_t n_ = 0;
  offload_device where_ = offload_device::none;
  buffer<float> mem_;
  float* map_ = nullptr;
  float* base_ = nullptr;
  int fd_ = -1;
  std::string path_;
};

class optimizer_state {
 public:
  /// n elements per tensor. `device` is charged for `none`, `host` for `cpu`; `nvme_path`
  /// is a directory for `nvme` (tag makes the file name unique, e.g. the rank). moments
  /// false: the master only (a driver that keeps the moments elsewhere, e.g. per optimizer
  /// group in state_stores of their own, allocated when the group first trains).
  optimizer_state(std::size_t n, offload_device where, memory_resource& device, memory_resource& host,
                  const std::string& nvme_path = {}, int tag = 0, bool moments = true)
      : n_(n), moments_(moments), store_((moments ? 3 : 1) * n, where, device, host, nvme_path, tag) {}

  std::size_t size() const noexcept { return n_; }
  offload_device where() const noexcept { return store_.where(); }
  /// The backing file (nvme only).
  const std::string& path() const noexcept { return store_.path(); }
  bool has_moments() const noexcept { return moments_; }
  /// Bytes held: master (+ moments).
  std::size_t bytes() const noexcept { return store_.bytes(); }
  std::span<float> master() noexcept { return store_.span().subspan(0, n_); }
  std::span<float> exp_avg() noexcept { return moments_ ? store_.span().subspan(n_, n_) : std::span<float>{}; }
  std::span<float> exp_avg_sq() noexcept { return moments_ ? store_.span().subspan(2 * n_, n_) : std::span<float>{}; }

 private:
  std::size_t n_;
  bool moments_ = true;
  state_store store_;
};

}  // namespace loom::zero
