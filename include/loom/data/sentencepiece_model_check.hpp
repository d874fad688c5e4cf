#pragma once
// Checks the parts of a tokenizer.model that the SentencePiece library trusts, before the
// library sees the file (data/sentencepiece_tokenizer.hpp calls it).
//
// Why: the library checks the pieces, but not its normalizers' precompiled character maps.
// A charsmap is a little-endian uint32 trie size, a Darts-clone double array of that many
// bytes, then NUL-terminated replacement strings; the normalizer walks the array by the
// input's bytes with no bound check and reads a replacement string up to its NUL. A file whose
// array sends a walk outside it, or whose value points past the strings, made
// Normalizer::NormalizePrefix read out of bounds (SEGV; found by fuzz_sentencepiece_model).
// So every walk the library can take through each charsmap of the file is followed here, from
// the root, byte by byte, as Darts-clone's commonPrefixSearch takes it: each array index and
// each replacement must lie inside the map. That is a breadth-first pass over the trie's
// reachable states, 256 bytes each (milliseconds for the NFKC map of a real model).
//
// The file is a protobuf ModelProto: normalizer_spec (field 3) and denormalizer_spec (field 5)
// each hold precompiled_charsmap (field 2). Every occurrence is checked, since protobuf merges
// repeated occurrences of a message and keeps the last bytes field. A file this walk cannot
// read as protobuf is refused.

#include <loom/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data::detail {

/// One field of a protobuf message: number, wire type, and the value (varint or fixed) or
/// the bytes (wire type 2).
struct proto_field {
  std::uint32_t number = 0, wire = 0;
  std::uint64_t value = 0;
  std::string_view bytes;
};

/// Reads the fields of a serialized protobuf message one at a time; a truncated or malformed
/// field (and the deprecated groups, which SentencePiece never writes) is a loom::error.
class proto_reader {
 public:
  proto_reader(std::string_view b, std::string_view what) : b_(b), what_(what) {}
  bool next(proto_field& f) {
    if (pos_ == b_.size()) return false;
    const std::uint64_t key = varint();
    f.number = static_cast<std::uint32_t>(key >> 3), f.wire = static_cast<std::uint32_t>(key & 7);
    f.bytes = {};
    LOOM_CHECK(f.number != 0 && key >> 32 == 0, what_, ": malformed protobuf (field key ", key, " at byte ", pos_, ")");
    switch (f.wire) {
      case 0: f.value = varint(); break;
      case 1: f.value = fixed(8); break;
      case 5: f.value = fixed(4); break;
      case 2: {
        const std::uint64_t n = varint();
        LOOM_CHECK(n <= b_.size() - pos_, what_, ": malformed protobuf (field ", f.number, " holds ", n, " bytes, ", b_.size() - pos_,
                   " are left)");
        f.bytes = b_.substr(pos_, static_cast<std::size_t>(n));
        pos_ += static_cast<std::size_t>(n);
        break;
      }
      default: LOOM_THROW(what_, ": malformed protobuf (field ", f.number, " has wire type ", f.wire, ")");
    }
    return true;
  }

 private:
  std::uint64_t varint() {
    std::uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      LOOM_CHECK(pos_ < b_.size(), what_, ": malformed protobuf (truncated varint)");
      const auto c = static_cast<unsigned char>(b_[pos_++]);
      v |= std::uint64_t{c & 0x7Fu} << shift;
      if (c < 0x80) return v;
    }
    LOOM_THROW(what_, ": malformed protobuf (varint longer than 10 bytes)");
  }
  std::uint64_t fixed(std::size_t n) {
    LOOM_CHECK(n <= b_.size() - pos_, what_, ": malformed protobuf (truncated fixed field)");
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i) v |= std::uint64_t{static_cast<unsigned char>(b_[pos_ + i])} << (8 * i);
    pos_ += n;
    return v;
  }
  std::string_view b_, what_;
  std::size_t pos_ = 0;
};

/// Throws unless every walk of SentencePiece's normalizer through the precompiled charsmap
/// `blob` stays inside it (see the top of this file). `what` names the file and the spec.
inline void check_sentencepiece_charsmap(std::string_view blob, const std::string& what) {
  if (blob.empty()) return;  // no charsmap: the library does not normalize
  LOOM_CHECK(blob.size() >= 4, what, ": precompiled_charsmap of ", blob.size(), " bytes has no trie size");
  const auto byte = [&](std::size_t i) { return std::uint32_t{static_cast<unsigned char>(blob[i])}; };
  const std::uint32_t trie_bytes = byte(0) | byte(1) << 8 | byte(2) << 16 | byte(3) << 24;
  LOOM_CHECK(trie_bytes <= blob.size() - 4 && trie_bytes >= 4, what, ": precompiled_charsmap's trie of ", trie_bytes,
             " bytes does not fit its ", blob.size() - 4, " bytes");
  const std::size_t n = trie_bytes / 4;  // units, as the library counts them
  const std::string_view strings = blob.substr(4 + trie_bytes);
  const auto unit = [&](std::size_t i) {
    const std::size_t p = 4 + 4 * i;
    return byte(p) | byte(p + 1) << 8 | byte(p + 2) << 16 | byte(p + 3) << 24;
  };
  // Darts-clone's unit: label (bits 0-7 and 31), has_leaf (bit 8), the offset to the
  // children's block (bits 10-31, shifted by 8 when bit 9 is set), value (bits 0-30)
  const auto offset = [](std::uint32_t u) { return (u >> 10) << ((u & (1u << 9)) >> 6); };
  const auto label = [](std::uint32_t u) { return u & ((1u << 31) | 0xFFu); };

  std::vector<std::uint8_t> seen(n, 0);
  std::vector<std::size_t> todo{static_cast<std::size_t>(offset(unit(0)))};  // the root's children block
  while (!todo.empty()) {
    const std::size_t base = todo.back();
    todo.pop_back();
    if (base < n && seen[base]) continue;
    for (std::uint32_t c = 0; c < 256; ++c) {
      const std::size_t at = base ^ c;
      LOOM_CHECK(at < n, what, ": precompiled_charsmap's trie sends byte ", c, " to unit ", at, " of ", n,
                 " (a broken double array the library would read past)");
      const std::uint32_t u = unit(at);
      if (label(u) != c) continue;
      const std::size_t child = at ^ offset(u);
      LOOM_CHECK(child < n, what, ": precompiled_charsmap's trie sends unit ", at, " to unit ", child, " of ", n);
      if ((u >> 8) & 1) {  // a rule ends here: its replacement is strings[value] up to a NUL
        const std::uint32_t value = unit(child) & 0x7FFFFFFFu;
        LOOM_CHECK(value < strings.size() && strings.find('\0', value) != std::string_view::npos, what,
                   ": precompiled_charsmap's rule at unit ", child, " points at byte ", value, " of its ", strings.size(),
                   " bytes of replacements, past their last NUL");
      }
      if (!seen[child]) todo.push_back(child);
    }
    seen[base] = 1;
  }
}

/// Throws unless `model` (a tokenizer.model's bytes) reads as protobuf and each of its
/// normalizers' charsmaps passes check_sentencepiece_charsmap. `what` names the file (errors
/// are `what`: reason).
inline void check_sentencepiece_model(std::string_view model, const std::string& what) {
  proto_reader top(model, what);
  for (proto_field f; top.next(f);) {
    if ((f.number != 3 && f.number != 5) || f.wire != 2) continue;  // normalizer_spec, denormalizer_spec
    const std::string spec = what + (f.number == 3 ? ": normalizer_spec" : ": denormalizer_spec");
    proto_reader sub(f.bytes, spec);
    for (proto_field g; sub.next(g);)
      if (g.number == 2 && g.wire == 2) check_sentencepiece_charsmap(g.bytes, spec);
  }
}

}  // namespace loom::data::detail
