// data/sentencepiece_model_check.hpp on hand-made charsmaps and protobuf: what the SentencePiece
// library would read out of bounds is refused before it sees the file (fuzz_sentencepiece_model
// found a model whose charsmap made Normalizer::NormalizePrefix read past it). Needs no
// library: the checker is loom's own code.
#include <support/error_of.hpp>
#include <loom/data/sentencepiece_model_check.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

using loom::data::detail::check_sentencepiece_charsmap;
using loom::data::detail::check_sentencepiece_model;
using loom::test::error_of;

std::string le32(std::uint32_t v) {
  std::string s;
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  return s;
}

// A Darts-clone double array of 512 units with one rule, byte 'A' -> strings[0]: the root's
// children block starts at unit 256, 'A' lands on unit 256 ^ 'A' (a leaf whose value unit is
// 320); replacements "a\0".
std::vector<std::uint32_t> one_rule() {
  std::vector<std::uint32_t> u(512, 0);
  u[0] = 256u << 10;                          // offset 256
  u[256 ^ 'A'] = (1u << 10) | (1u << 8) | 'A';  // label 'A', leaf, offset 1 -> unit 320
  u[320] = 1u << 31;                          // value 0
  return u;
}

std::string charsmap(const std::vector<std::uint32_t>& units, const std::string& strings = std::string("a\0", 2)) {
  std::string trie;
  for (auto x : units) trie += le32(x);
  return le32(static_cast<std::uint32_t>(trie.size())) + trie + strings;
}

// protobuf: field `number` as bytes (lengths below 2^14)
std::string bytes_field(int number, const std::string& b) {
  std::string s(1, static_cast<char>(number << 3 | 2));
  std::size_t n = b.size();
  while (n >= 0x80) s.push_back(static_cast<char>((n & 0x7F) | 0x80)), n >>= 7;
  return s + static_cast<char>(n) + b;
}

}  // namespace

TEST_CASE("a charsmap whose every walk stays inside passes") {
  CHECK_NOTHROW(check_sentencepiece_charsmap(charsmap(one_rule()), "m"));
  CHECK_NOTHROW(check_sentencepiece_charsmap("", "m"));  // no charsmap: no normalization
  CHECK_NOTHROW(check_sentencepiece_model(bytes_field(3, bytes_field(1, "nfkc") + bytes_field(2, charsmap(one_rule()))), "m"));
}

TEST_CASE("charsmaps the library would read past are refused, naming the file and the unit") {
  auto u = one_rule();
  u[0] = 4096u << 10;  // the root's children past the array
  std::string e = error_of([&] { check_sentencepiece_charsmap(charsmap(u), "file 'x.model'"); });
  CHECK(e.find("file 'x.model': precompiled_charsmap's trie sends byte 0 to unit 4096 of 512") != std::string::npos);

  u = one_rule();
  u[256 ^ 'A'] = (70000u << 10) | (1u << 8) | 'A';  // the rule's value unit past the array
  e = error_of([&] { check_sentencepiece_charsmap(charsmap(u), "m"); });
  CHECK(e.find("sends unit 321 to unit") != std::string::npos);

  u = one_rule();
  u[320] = (1u << 31) | 5;  // the replacement past the strings
  e = error_of([&] { check_sentencepiece_charsmap(charsmap(u), "m"); });
  CHECK(e.find("points at byte 5 of its 2 bytes") != std::string::npos);
  e = error_of([&] { check_sentencepiece_charsmap(charsmap(one_rule(), "a"), "m"); });  // no NUL after it
  CHECK(e.find("past their last NUL") != std::string::npos);

  e = error_of([&] { check_sentencepiece_charsmap(le32(4096) + std::string(100, '\0'), "m"); });
  CHECK(e.find("trie of 4096 bytes does not fit its 100 bytes") != std::string::npos);
  e = error_of([&] { check_sentencepiece_charsmap(le32(0) + "ab", "m"); });  // an empty trie: the library reads unit 0
  CHECK(e.find("trie of 0 bytes") != std::string::npos);
  e = error_of([&] { check_sentencepiece_charsmap("ab", "m"); });
  CHECK(e.find("has no trie size") != std::string::npos);

  // through the model: normalizer_spec (3) and denormalizer_spec (5), every occurrence
  u = one_rule();
  u[0] = 4096u << 10;
  const std::string good = bytes_field(3, bytes_field(2, charsmap(one_rule()))), bad = bytes_field(2, charsmap(u));
  e = error_of([&] { check_sentencepiece_model(good + bytes_field(5, bad), "m"); });
  CHECK(e.find("m: denormalizer_spec: precompiled_charsmap's trie") != std::string::npos);
  e = error_of([&] { check_sentencepiece_model(bytes_field(3, bad) + good, "m"); });
  CHECK(e.find("m: normalizer_spec: precompiled_charsmap's trie") != std::string::npos);
}

TEST_CASE("bytes that are no protobuf are refused") {
  CHECK(error_of([&] { check_sentencepiece_model(bytes_field(1, "abc").substr(0, 3), "m"); }).find("m: malformed protobuf (field 1 holds 3 bytes, 1 are left)") !=
        std::string::npos);
  CHECK(error_of([&] { check_sentencepiece_model(std::string("\x0b", 1), "m"); }).find("wire type 3") != std::string::npos);
  CHECK(error_of([&] { check_sentencepiece_model(std::string(11, '\xff'), "m"); }).find("malformed protobuf") != std::string::npos);
  CHECK(error_of([&] { check_sentencepiece_model(std::string("\x08", 1), "m"); }).find("truncated varint") != std::string::npos);
  CHECK_NOTHROW(check_sentencepiece_model("", "m"));  // the library then says what is missing
}

#if LOOM_HAS_SENTENCEPIECE
#include <loom/data/sentencepiece_tokenizer.hpp>

#include <filesystem>
#include <fstream>
#include <unistd.h>

namespace {
// A ModelProto's pieces (score 0; type 1 normal, 2 unknown, 3 control): with nothing else, the
// smallest file SentencePiece loads (a unigram model without normalizer rules).
std::string pieces(const std::vector<std::pair<std::string, int>>& list) {
  std::string out;
  for (const auto& [piece, type] : list)
    out += bytes_field(1, bytes_field(1, piece) + std::string("\x15\0\0\0\0\x18", 6) + static_cast<char>(type));
  return out;
}
const std::vector<std::pair<std::string, int>> base{{"<unk>", 2}, {"<s>", 3}, {"</s>", 3}, {"\xe2\x96\x81", 1}, {"a", 1}, {"b", 1}};

// per process: other checkouts' test runs may share the machine's temp folder
const std::filesystem::path dir =
    std::filesystem::temp_directory_path() / ("loom_sentencepiece_model_check_test." + std::to_string(::getpid()));

std::string write_model(const std::string& name, const std::string& bytes) {
  std::filesystem::create_directories(dir);
  const std::string path = (dir / name).string();
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}
}  // namespace

TEST_CASE("sentencepiece_tokenizer: a model the library accepts loads; one it would read past or throw on is a loom::error") {
  using loom::data::sentencepiece_tokenizer;
  const sentencepiece_tokenizer plain(write_model("minimal.model", pieces(base)));
  CHECK(plain.piece_size() == 6);
  CHECK(plain.decode(plain.encode("ab")) == "ab");
  // the one-rule charsmap is what the library runs: 'A' normalizes to 'a'
  const sentencepiece_tokenizer rule(write_model("rule.model", pieces(base) + bytes_field(3, bytes_field(2, charsmap(one_rule())))));
  CHECK(rule.encode("bA") == rule.encode("ba"));

  // fuzz_sentencepiece_model's findings: a charsmap sending the normalizer past it (SEGV in
  // Normalizer::NormalizePrefix), and a piece starting with NUL (Darts builds its trie from C
  // strings: an empty key, and Load() threw Darts::Details::Exception)
  auto u = one_rule();
  u[256 ^ 'A'] = (70000u << 10) | (1u << 8) | 'A';
  const std::string past = write_model("past.model", pieces(base) + bytes_field(3, bytes_field(2, charsmap(u))));
  std::string e = error_of([&] { sentencepiece_tokenizer t(past); });
  CHECK(e.find("past.model' is not a SentencePiece model: normalizer_spec: precompiled_charsmap's trie sends unit 321") != std::string::npos);
  auto with_nul = base;
  with_nul.emplace_back(std::string("\0o", 2), 1);
  const std::string nul = write_model("nul_piece.model", pieces(with_nul));
  e = error_of([&] { sentencepiece_tokenizer t(nul); });
  CHECK(e.find("nul_piece.model' is not a SentencePiece model") != std::string::npos);
  CHECK(e.find("zero-length key") != std::string::npos);  // the library's own reason
  CHECK(e.size() < 600);
  std::filesystem::remove_all(dir);
}
#endif
