#pragma once
// Bytes from outside (files, requests): the helpers every reader of them uses.
//
// Why: a broken or hostile file must give a loom::error, never a crash, an allocation sized
// by the file's own claims, or an error message as large as the bad value. Two rules follow:
//  - every size computed from input is computed with overflow checks (mul_u64 / add_u64 /
//    shape_numel) before it is compared with the file's size or used to allocate;
//  - every input value quoted in a message goes through quote_input(), which bounds its
//    length and escapes control bytes (a 100 MB value must not become a 100 MB message,
//    and a message must not carry terminal escapes from the file).
// Lives in data/ because both data/ and io/ (the layer below it) read outside bytes.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace loom::data {

/// How many bytes of an input value an error message quotes.
inline constexpr std::size_t quote_limit = 64;

/// `s` in double quotes for an error message: at most `limit` bytes of it, then "..." and the
/// full length; quotes, backslashes and control bytes escaped.
inline std::string quote_input(std::string_view s, std::size_t limit = quote_limit) {
  std::string out = "\"";
  const std::size_t n = s.size() < limit ? s.size() : limit;
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f) {
      static constexpr char hex[] = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
  if (n < s.size()) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

/// a * b, or nothing when it does not fit 64 bits.
inline std::optional<std::uint64_t> mul_u64(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

/// a + b, or nothing when it does not fit 64 bits.
inline std::optional<std::uint64_t> add_u64(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

/// The element count of `shape`, or nothing when an extent is negative or a partial product
/// does not fit an int64 (what named_tensor::numel returns); [2^40, 2^40, 0] is refused too.
inline std::optional<std::uint64_t> shape_numel(std::span<const std::int64_t> shape) {
  std::uint64_t n = 1;
  for (auto e : shape) {
    if (e < 0) return std::nullopt;
    const auto p = mul_u64(n, static_cast<std::uint64_t>(e));
    if (!p || *p > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
    n = *p;
  }
  return n;
}

}  // namespace loom::data
