#pragma once
// Memory-mapped token shards: files of uint16 or uint32 token ids.
//
// Why mmap: a pretraining corpus is larger than RAM and read at random positions (shuffled
// windows); mapping lets the kernel page in what a batch touches and share the pages between
// the thread ranks of one process. Nothing is parsed or copied at open time.
//
// Two layouts are read:
//   headerless  raw little-endian tokens (nanoGPT's train.bin is uint16 of this kind); the
//               caller says the width; the token count is file size / width.
//   loom header 64 bytes, then the tokens:
//     offset  size  field
//          0     8  magic "LOOMTOK1"
//          8     4  header_bytes (u32, = 64)
//         12     4  token_bytes  (u32, 2 or 4)
//         16     8  n_tokens     (u64)
//         24     4  vocab_size   (u32, 0 = not recorded)
//         28    36  reserved, zero
//     all integers little-endian. A file whose size disagrees with n_tokens is refused, and so
//     are nonzero reserved bytes (a later format), so a header that lies never reaches a read.
// Token ids are checked on every read against the model's vocabulary and, when the header
// records one, the shard's: a shard whose ids exceed its own header is corrupt even if the
// model's vocabulary is larger.
// write_token_shard() writes either layout (examples/data uses it to build the corpus).

#include <loom/core/error.hpp>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::data {

enum class token_width : std::uint32_t { u16 = 2, u32 = 4 };

inline constexpr char shard_magic[8] = {'L', 'O', 'O', 'M', 'T', 'O', 'K', '1'};
inline constexpr std::size_t shard_header_bytes = 64;

struct shard_header {
  char magic[8];
  std::uint32_t header_bytes;
  std::uint32_t token_bytes;
  std::uint64_t n_tokens;
  std::uint32_t vocab_size;
  std::uint8_t reserved[36];
};
static_assert(sizeof(shard_header) == shard_header_bytes);

/// A read-only mapping of one shard file.
class token_shard {
 public:
  token_shard() = default;
  /// Opens `path`. With a loom header the width comes from it (`headerless_width` is ignored
  /// unless the file has no header); a file without a header needs `headerless_width`.
  explicit token_shard(const std::string& path, std::optional<token_width> headerless_width = std::nullopt) : path_(path) {
    // O_NONBLOCK: opening a FIFO would otherwise wait for a writer; regular files ignore it
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    LOOM_CHECK(fd >= 0, "token_shard: cannot open path='", path, "': ", std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      LOOM_THROW("token_shard: path='", path, "' is not a regular file");
    }
    bytes_ = static_cast<std::size_t>(st.st_size);
    if (bytes_ > 0) {
      void* p = ::mmap(nullptr, bytes_, PROT_READ, MAP_SHARED, fd, 0);
      ::close(fd);
      LOOM_CHECK(p != MAP_FAILED, "token_shard: mmap of path='", path, "' (", bytes_, " bytes) failed: ", std::strerror(errno));
      map_ = static_cast<const std::byte*>(p);
    } else {
      ::close(fd);
    }
    // The destructor does not run when the constructor throws: a refused file must not keep
    // its mapping (each one would pin the file's pages and an address range for good).
    struct unmap_unless_kept {
      token_shard* s;
      ~unmap_unless_kept() {
        if (s && s->map_) ::munmap(const_cast<std::byte*>(s->map_), s->bytes_);
      }
    } guard{this};
    if (bytes_ >= 8 && std::memcmp(map_, shard_magic, 8) == 0) {
      LOOM_CHECK(bytes_ >= shard_header_bytes, "token_shard: path='", path, "' has a loom magic but only ", bytes_, " bytes");
      shard_header h;
      std::memcpy(&h, map_, sizeof h);
      LOOM_CHECK(h.header_bytes == shard_header_bytes, "token_shard: path='", path, "' header_bytes=", h.header_bytes,
                 " (expected 64)");
      LOOM_CHECK(h.token_bytes == 2 || h.token_bytes == 4, "token_shard: path='", path, "' token_bytes=", h.token_bytes,
                 " (expected 2 or 4)");
      for (std::size_t i = 0; i < sizeof h.reserved; ++i)
        LOOM_CHECK(h.reserved[i] == 0, "token_shard: path='", path, "' reserved header byte ", 28 + i, " is ",
                   static_cast<int>(h.reserved[i]), " (expected 0; a newer format?)");
      LOOM_CHECK(h.vocab_size <= static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max()), "token_shard: path='", path,
                 "' vocab_size=", h.vocab_size, " does not fit the int32 token ids");
      LOOM_CHECK(h.n_tokens == (bytes_ - shard_header_bytes) / h.token_bytes && (bytes_ - shard_header_bytes) % h.token_bytes == 0,
                 "token_shard: path='", path, "' header says n_tokens=", h.n_tokens, " but the file holds ",
                 bytes_ - shard_header_bytes, " bytes of tokens of ", h.token_bytes, " bytes");
      width_ = static_cast<token_width>(h.token_bytes);
      size_ = h.n_tokens;
      vocab_ = h.vocab_size;
      tokens_ = map_ + shard_header_bytes;
      has_header_ = true;
    } else {
      LOOM_CHECK(headerless_width.has_value(), "token_shard: path='", path,
                 "' has no loom header (magic LOOMTOK1); give the token width (uint16 or uint32) for a headerless file");
      width_ = *headerless_width;
      const std::size_t w = static_cast<std::size_t>(width_);
      LOOM_CHECK(bytes_ % w == 0, "token_shard: headerless path='", path, "' has ", bytes_, " bytes, not a multiple of the token width ", w);
      size_ = bytes_ / w;
      tokens_ = map_;
    }
    guard.s = nullptr;  // accepted: the mapping is this shard's until its destructor
  }
  token_shard(token_shard&& o) noexcept { swap(o); }
  token_shard& operator=(token_shard&& o) noexcept {
    token_shard t(std::move(o));
    swap(t);
    return *this;
  }
  token_shard(const token_shard&) = delete;
  token_shard& operator=(const token_shard&) = delete;
  ~token_shard() {
    if (map_) ::munmap(const_cast<std::byte*>(map_), bytes_);
  }

  std::size_t size() const noexcept { return size_; }
  token_width width() const noexcept { return width_; }
  bool has_header() const noexcept { return has_header_; }
  /// The vocabulary size recorded in the header (0 when absent or not recorded).
  std::uint32_t vocab_size() const noexcept { return vocab_; }
  const std::string& path() const noexcept { return path_; }

  std::uint32_t operator[](std::size_t i) const noexcept {
    if (width_ == token_width::u16) {
      std::uint16_t t;
      std::memcpy(&t, tokens_ + 2 * i, 2);
      return t;
    }
    std::uint32_t t;
    std::memcpy(&t, tokens_ + 4 * i, 4);
    return t;
  }

  /// out[k] = token[first + k]; every token must be < vocab and < the header's vocab_size when
  /// recorded (else a loom::error naming it and where).
  void read(std::size_t first, std::span<std::int32_t> out, std::uint32_t vocab) const {
    LOOM_CHECK(first <= size_ && out.size() <= size_ - first, "token_shard: read of [", first, ", +", out.size(), ") past the ",
               size_, " tokens of path='", path_, "'");
    LOOM_CHECK(vocab <= static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max()), "token_shard: vocab_size=", vocab,
               " does not fit the int32 token ids");
    const bool header_limits = vocab_ != 0 && vocab_ < vocab;
    if (header_limits) vocab = vocab_;
    std::uint32_t bad = 0;
    if (width_ == token_width::u16) {
      const auto* p = reinterpret_cast<const std::uint16_t*>(tokens_) + first;
      for (std::size_t k = 0; k < out.size(); ++k) {
        const std::uint32_t t = p[k];
        bad |= static_cast<std::uint32_t>(t >= vocab);
        out[k] = static_cast<std::int32_t>(t);
      }
    } else {
      const auto* p = reinterpret_cast<const std::uint32_t*>(tokens_) + first;
      for (std::size_t k = 0; k < out.size(); ++k) {
        const std::uint32_t t = p[k];
        bad |= static_cast<std::uint32_t>(t >= vocab);
        out[k] = static_cast<std::int32_t>(t);
      }
    }
    if (bad) {
      for (std::size_t k = 0; k < out.size(); ++k)
        LOOM_CHECK(static_cast<std::uint32_t>(out[k]) < vocab, "token id ", static_cast<std::uint32_t>(out[k]), " >= vocab_size ",
                   vocab, header_limits ? " (the shard header's)" : "", " at token ", first + k, " of path='", path_, "'");
    }
  }

 private:
  void swap(token_shard& o) noexcept {
    std::swap(path_, o.path_);
    std::swap(map_, o.map_);
    std::swap(tokens_, o.tokens_);
    std::swap(bytes_, o.bytes_);
    std::swap(size_, o.size_);
    std::swap(width_, o.width_);
    std::swap(vocab_, o.vocab_);
    std::swap(has_header_, o.has_header_);
  }
  std::string path_;
  const std::byte* map_ = nullptr;
  const std::byte* tokens_ = nullptr;
  std::size_t bytes_ = 0, size_ = 0;
  token_width width_ = token_width::u16;
  std::uint32_t vocab_ = 0;
  bool has_header_ = false;
};

/// Writes tokens as a shard of the given width, with the loom header (default) or headerless.
inline void write_token_shard(const std::string& path, std::span<const std::uint32_t> tokens, token_width width,
                              std::uint32_t vocab_size = 0, bool header = true) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  LOOM_CHECK(f.good(), "write_token_shard: cannot create path='", path, "'");
  if (header) {
    shard_header h{};
    std::memcpy(h.magic, shard_magic, 8);
    h.header_bytes = shard_header_bytes;
    h.token_bytes = static_cast<std::uint32_t>(width);
    h.n_tokens = tokens.size();
    h.vocab_size = vocab_size;
    f.write(reinterpret_cast<const char*>(&h), sizeof h);
  }
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const std::uint32_t t = tokens[i];
    if (width == token_width::u16) {
      LOOM_CHECK(t <= 0xffffu, "write_token_shard: token id ", t, " at index ", i, " does not fit uint16 (path='", path, "')");
      const std::uint16_t s = static_cast<std::uint16_t>(t);
      f.write(reinterpret_cast<const char*>(&s), 2);
    } else {
      f.write(reinterpret_cast<const char*>(&t), 4);
    }
  }
  LOOM_CHECK(f.good(), "write_token_shard: write to path='", path, "' failed");
}

}  // namespace loom::data
