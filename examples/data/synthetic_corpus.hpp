#pragma once
// A small, generated training corpus for loom's examples: byte-level text with structure a
// small model can learn in a few hundred steps, shipped as code instead of data.
//
// Why generated: the examples must run offline, and any shipped text would have to be
// written and licensed; a grammar plus the counter-based RNG gives the same corpus on every
// machine. The text mixes three kinds of lines, each with learnable regularities:
//   sentences   "the small cat sees a red ball near the river."  (agreement-free grammar)
//   arithmetic  "17 + 25 = 42."                                   (exact answers)
//   lists       "count: 3 4 5 6 7."                                (successor sequences)
// Tokens are the UTF-8 bytes (ids 0..255); write_corpus_shard() writes them as a uint16
// token shard with loom's header (loom/data/token_shard.hpp).

#include <loom/core/random.hpp>
#include <loom/data/token_shard.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace examples {

inline std::string synthetic_corpus(std::size_t bytes, std::uint64_t seed = 2024) {
  static constexpr std::array<std::string_view, 12> nouns = {"cat", "dog", "bird", "child", "farmer", "teacher",
                                                             "river", "house", "ball", "tree", "boat", "garden"};
  static constexpr std::array<std::string_view, 10> adjs = {"small", "old", "red", "quiet", "bright", "tall", "green", "happy", "cold", "busy"};
  static constexpr std::array<std::string_view, 10> verbs = {"sees", "finds", "likes", "paints", "follows", "carries", "watches", "builds",
                                                             "visits", "hears"};
  static constexpr std::array<std::string_view, 6> preps = {"near", "behind", "under", "beside", "across", "inside"};
  const loom::counter_rng rng(seed);
  std::uint64_t k = 0;
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng.bits(k++) % n); };
  std::string s;
  s.reserve(bytes + 128);
  while (s.size() < bytes) {
    switch (pick(4)) {
      case 0: {
        const auto a = pick(100), b = pick(100);
        char line[48];
        std::snprintf(line, sizeof line, "%zu + %zu = %zu.\n", a, b, a + b);
        s += line;
        break;
      }
      case 1: {
        std::size_t x = pick(50), n = 3 + pick(5);
        s += "count:";
        for (std::size_t i = 0; i < n; ++i) {
          char num[24];
          std::snprintf(num, sizeof num, " %zu", x + i);
          s += num;
        }
        s += ".\n";
        break;
      }
      default: {
        s += "the ";
        s += adjs[pick(adjs.size())];
        s += ' ';
        s += nouns[pick(nouns.size())];
        s += ' ';
        s += verbs[pick(verbs.size())];
        s += pick(2) ? " a " : " the ";
        s += adjs[pick(adjs.size())];
        s += ' ';
        s += nouns[pick(nouns.size())];
        if (pick(2)) {
          s += ' ';
          s += preps[pick(preps.size())];
          s += " the ";
          s += nouns[pick(nouns.size())];
        }
        s += ".\n";
      }
    }
  }
  s.resize(bytes);
  return s;
}

/// Writes `text` as a uint16 token shard of byte ids (vocab 256).
inline void write_corpus_shard(const std::string& path, std::string_view text) {
  std::vector<std::uint32_t> ids(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  loom::data::write_token_shard(path, ids, loom::data::token_width::u16, 256);
}

}  // namespace examples
