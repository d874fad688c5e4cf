#pragma once
// tensor_map: named float tensors, the common currency of loom's weight readers.
//
// Why: checkpoint formats differ in layout and element type (llama2.c: one fp32 stream in a
// fixed order; safetensors: a JSON index over fp32/fp16/bf16 bytes), while a model only needs
// "the tensor called X, of shape S". Readers convert to this; a model maps names to its layers.

#include <loom/core/buffer.hpp>
#include <loom/core/error.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace loom::io {

struct named_tensor {
  std::vector<std::int64_t> shape;
  buffer<float> data;  // row-major, numel(shape) elements

  std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (auto e : shape) n *= e;
    return n;
  }
};

using tensor_map = std::map<std::string, named_tensor>;

namespace detail {
/// The file's bytes, or its first `limit` bytes; `file_bytes` (when given) gets its size.
inline std::vector<char> read_file_bytes(const std::string& path, std::size_t limit = static_cast<std::size_t>(-1),
                                         std::size_t* file_bytes = nullptr) {
  // A directory opens on Linux and reports a huge size: only regular files are read
  std::error_code ec;
  const bool regular = std::filesystem::is_regular_file(path, ec);
  LOOM_CHECK(regular || !std::filesystem::exists(path, ec), "'", path, "' is not a regular file");
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  LOOM_CHECK(f.good(), "cannot open file '", path, "'");
  const auto end = f.tellg();
  LOOM_CHECK(end >= 0, "cannot determine the size of '", path, "'");
  if (file_bytes) *file_bytes = static_cast<std::size_t>(end);
  const auto size = std::min(static_cast<std::size_t>(end), limit);
  std::vector<char> bytes(size);
  f.seekg(0);
  f.read(bytes.data(), static_cast<std::streamsize>(size));
  LOOM_CHECK(f.good() || size == 0, "cannot read ", size, " bytes of '", path, "'");
  return bytes;
}

/// A file open for range reads (pread), closed with its owner: a reader of slices opens each
/// file once and then reads any byte range at one system call, never the whole file.
struct file_handle {
  int fd = -1;
  file_handle(const file_handle&) = delete;
  file_handle& operator=(const file_handle&) = delete;
  explicit file_handle(int f) : fd(f) {}
  /// Opens `path` read-only; a loom::error names `what` when it cannot.
  static std::shared_ptr<file_handle> open(const std::string& path, const std::string& what) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    LOOM_CHECK(fd >= 0, what, ": cannot open it for reading");
    return std::make_shared<file_handle>(fd);
  }
  ~file_handle() {
    if (fd >= 0) ::close(fd);
  }
  /// Reads up to `n` bytes at file offset `at` into `out`; returns how many (fewer only at the
  /// end of the file or on an error, which the caller names).
  std::uint64_t read_at(char* out, std::uint64_t n, std::uint64_t at) const {
    std::uint64_t got = 0;
    while (got < n) {
      const ::ssize_t k = ::pread(fd, out + got, static_cast<std::size_t>(n - got), static_cast<::off_t>(at + got));
      if (k <= 0) break;
      got += static_cast<std::uint64_t>(k);
    }
    return got;
  }
};
}  // namespace detail

/// The tensor `name` of the given shape; a clear error if it is missing or shaped otherwise.
inline const named_tensor& require_tensor(const tensor_map& m, const std::string& name,
                                          const std::vector<std::int64_t>& shape) {
  auto it = m.find(name);
  LOOM_CHECK(it != m.end(), "tensor '", name, "' is missing from the checkpoint");
  bool same = it->second.shape == shape;
  if (!same) {
    std::string got, want;
    for (auto e : it->second.shape) got += std::to_string(e) + ",";
    for (auto e : shape) want += std::to_string(e) + ",";
    LOOM_THROW("tensor '", name, "' has shape [", got, "], expected [", want, "]");
  }
  return it->second;
}

}  // namespace loom::io
