#pragma once
// Memory resources with byte accounting.
//
// Why: ZeRO's whole point is memory; loom proves its savings by measuring, not estimating.
// Every allocation loom makes goes through a memory_resource, which counts current and peak
// bytes. Thread ranks share one process, so a per-rank figure comes from giving each rank
// its own resource object (they are cheap). A resource may carry a byte limit, which lets
// tests and the host backend emulate a device of a given size: an allocation past the limit
// throws loom::error naming the request and the usage instead of swapping the machine.
//
// Resources here: host_memory_resource (aligned host memory). core/cuda/memory.hpp adds
// pinned_host_memory_resource and cuda_memory_resource with the same accounting.
//
// Large host blocks (>= 4 MiB) are 2 MiB-aligned and marked MADV_HUGEPAGE on Linux, so where
// transparent huge pages are in "madvise" mode (Debian's default) a model's weights,
// gradients and activations sit on 2 MiB pages: GEMMs stream them with far fewer TLB misses
// (training steps +1.2-1.6% on the 2-core machine, docs/benchmarks.md). The slack of the
// alignment is address space, not resident memory. LOOM_HUGEPAGES=0 turns it off.

#include <loom/core/config.hpp>
#include <loom/core/device.hpp>
#include <loom/core/error.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <string_view>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace loom {

/// Default alignment of loom allocations: one cache line, enough for AVX-512 loads.
inline constexpr std::size_t default_alignment = 64;

struct memory_stats {
  std::size_t current_bytes = 0;     ///< bytes allocated and not yet freed
  std::size_t peak_bytes = 0;        ///< high-water mark of current_bytes since creation or reset_peak()
  std::size_t allocations = 0;       ///< number of allocate() calls that succeeded
  std::size_t live_allocations = 0;  ///< allocations not yet freed
};

/// Base of all loom memory resources: argument checks and byte accounting around
/// do_allocate/do_deallocate. Thread-safe.
class memory_resource {
 public:
  explicit memory_resource(std::string name) : name_(std::move(name)) {}
  memory_resource(const memory_resource&) = delete;
  memory_resource& operator=(const memory_resource&) = delete;
  virtual ~memory_resource() = default;

  /// Allocates `bytes` bytes aligned to `alignment` (a power of two). Zero bytes gives nullptr.
  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment) {
    LOOM_CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0, name_,
               ": alignment must be a power of two, got alignment=", alignment);
    if (bytes == 0) return nullptr;
    const std::size_t limit = limit_.load(std::memory_order_relaxed);
    std::size_t now = current_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    if (now > limit) {
      current_.fetch_sub(bytes, std::memory_order_relaxed);
      LOOM_THROW(name_, ": allocation of bytes=", bytes, " exceeds the limit of ", limit, " bytes (",
                 now - bytes, " bytes in use)");
    }
    void* p = nullptr;
    try {
      p = do_allocate(bytes, alignment);
    } catch (...) {
      current_.fetch_sub(bytes, std::memory_order_relaxed);
      throw;
    }
    std::size_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    allocations_.fetch_add(1, std::memory_order_relaxed);
    live_.fetch_add(1, std::memory_order_relaxed);
    return p;
  }

  /// Returns memory obtained from allocate() with the same bytes and alignment.
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment) noexcept {
    if (p == nullptr) return;
    do_deallocate(p, bytes, alignment);
    current_.fetch_sub(bytes, std::memory_order_relaxed);
    live_.fetch_sub(1, std::memory_order_relaxed);
  }

  memory_stats stats() const noexcept {
    return {current_.load(), peak_.load(), allocations_.load(), live_.load()};
  }
  std::size_t current_bytes() const noexcept { return current_.load(); }
  std::size_t peak_bytes() const noexcept { return peak_.load(); }
  /// Restarts the high-water mark at the current usage.
  void reset_peak() noexcept { peak_.store(current_.load()); }
  /// Caps current_bytes; allocations past it throw. Default: unlimited.
  void set_limit(std::size_t bytes) noexcept { limit_.store(bytes); }
  std::size_t limit() const noexcept { return limit_.load(); }
  const std::string& name() const noexcept { return name_; }
  /// Whether the host may dereference memory from this resource.
  virtual bool host_accessible() const noexcept = 0;

 protected:
  virtual void* do_allocate(std::size_t bytes, std::size_t alignment) = 0;
  virtual void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept = 0;

 private:
  std::string name_;
  std::atomic<std::size_t> current_{0}, peak_{0}, allocations_{0}, live_{0};
  std::atomic<std::size_t> limit_{std::numeric_limits<std::size_t>::max()};
};

namespace detail {
inline constexpr std::size_t huge_page = std::size_t(2) << 20;
/// LOOM_HUGEPAGES's value (null or empty: on); a loom::error names a bad one.
inline bool parse_hugepages(const char* v) {
  if (!v || !*v) return true;
  LOOM_CHECK(std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0, "LOOM_HUGEPAGES='", v, "' is not 0 or 1");
  return v[0] == '1';
}
/// Whether large host blocks get huge pages (LOOM_HUGEPAGES, read on first use).
inline bool host_hugepages() {
  static const bool on = parse_hugepages(std::getenv("LOOM_HUGEPAGES"));
  return on;
}
}  // namespace detail

/// Aligned host memory from the global operator new; blocks of 4 MiB and more 2 MiB-aligned
/// and offered huge pages (see the header comment).
class host_memory_resource final : public memory_resource {
 public:
  explicit host_memory_resource(std::string name = "host") : memory_resource(std::move(name)) {}
  bool host_accessible() const noexcept override { return true; }

  /// The alignment a block of `bytes` asked with `alignment` really gets.
  static std::size_t block_alignment(std::size_t bytes, std::size_t alignment) {
    return bytes >= 2 * detail::huge_page && detail::host_hugepages() ? std::max(alignment, detail::huge_page) : alignment;
  }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    const std::size_t a = block_alignment(bytes, alignment);
    void* p = nullptr;
    try {
      p = ::operator new(bytes, std::align_val_t{a});
    } catch (const std::bad_alloc&) {
      LOOM_THROW(name(), ": out of host memory allocating bytes=", bytes, " (", current_bytes() - bytes,
                 " bytes in use by this resource)");
    }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (a >= detail::huge_page) (void)::madvise(p, bytes / detail::huge_page * detail::huge_page, MADV_HUGEPAGE);  // advice only
#endif
    return p;
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    ::operator delete(p, std::align_val_t{block_alignment(bytes, alignment)});
  }
};

/// The process-wide default resource of a device. The host one is defined here; the CUDA one
/// in core/cuda/memory.hpp.
template <device_tag D>
memory_resource& default_resource();

template <>
inline memory_resource& default_resource<host>() {
  static host_memory_resource r("host(default)");
  return r;
}

}  // namespace loom
