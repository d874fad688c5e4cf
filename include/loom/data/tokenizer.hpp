#pragma once
// The tokenizer concept the data loaders are written against, and a byte-level tokenizer.
//
// Why byte-level: loom's examples must run without downloading a vocabulary; bytes cover
// any UTF-8 text (the chat sample is Chinese) with a vocabulary of 256 + 3 special ids.
// A real BPE/SentencePiece tokenizer plugs in by satisfying `tokenizer`.

#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data {

/// Requires: T encodes text to ids and names its special ids and vocabulary size.
template <class T>
concept tokenizer = requires(const T& t, std::string_view text) {
  { t.encode(text) } -> std::same_as<std::vector<std::int32_t>>;
  { t.bos_id() } -> std::convertible_to<std::int32_t>;
  { t.eos_id() } -> std::convertible_to<std::int32_t>;
  { t.pad_id() } -> std::convertible_to<std::int32_t>;
  { t.vocab_size() } -> std::convertible_to<std::uint32_t>;
};

/// ids 0..255 are bytes; 256 = <bos>, 257 = <eos>, 258 = <pad>.
struct byte_tokenizer {
  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> ids(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  /// Bytes back to text; special ids are dropped.
  std::string decode(std::span<const std::int32_t> ids) const {
    std::string s;
    for (auto id : ids)
      if (id >= 0 && id < 256) s.push_back(static_cast<char>(id));
    return s;
  }
  std::int32_t bos_id() const noexcept { return 256; }
  std::int32_t eos_id() const noexcept { return 257; }
  std::int32_t pad_id() const noexcept { return 258; }
  std::uint32_t vocab_size() const noexcept { return 259; }
};

}  // namespace loom::data
