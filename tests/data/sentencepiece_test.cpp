// data::sentencepiece_tokenizer against Debian's python3-sentencepiece: the fixture script
// (tokenizer_fixtures.py) trains two tokenizer.model files with spm_train and writes, for
// 10,000 strings each (English, Chinese, emoji, whitespace runs, invalid UTF-8, random bytes),
// the ids and the decoded text Python's SentencePiece gives; ChatGLM's appended special ids
// come from ChatGLM's rule computed in Python.
#include <support/error_of.hpp>
#include <loom/data/sentencepiece_tokenizer.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using loom::data::sentencepiece_tokenizer;
using loom::test::error_of;
const std::string fixtures = LOOM_TOKENIZER_FIXTURES;

std::string unhex(const std::string& h) {
  std::string s;
  for (std::size_t i = 0; i + 1 < h.size(); i += 2) s.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  return s;
}

std::vector<std::string> split(const std::string& line, char sep) {
  std::vector<std::string> out(1);
  for (char c : line) {
    if (c == sep) out.emplace_back();
    else out.back().push_back(c);
  }
  return out;
}

std::vector<std::int32_t> ints(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::int32_t> v;
  for (std::int32_t x; in >> x;) v.push_back(x);
  return v;
}

}  // namespace

static_assert(loom::data::tokenizer<sentencepiece_tokenizer>);
static_assert(loom::data::tokenizer<loom::data::any_tokenizer>);

TEST_CASE("encode, decode and streaming decode match python3-sentencepiece on 10,000 strings per model") {
  for (const std::string model : {"unigram", "bpe"}) {
    CAPTURE(model);
    const sentencepiece_tokenizer tok(fixtures + "/" + model + ".model");
    const loom::data::any_tokenizer any(tok, model);  // the type-erased path the programs use
    std::ifstream f(fixtures + "/cases_" + model + ".tsv");
    REQUIRE(f.good());
    std::size_t n = 0, streamed = 0, invalid_utf8 = 0, encode_bad = 0, decode_bad = 0, stream_bad = 0;
    for (std::string line; std::getline(f, line); ++n) {
      const auto col = split(line, '\t');
      REQUIRE(col.size() == 4);
      const std::string text = unhex(col[0]), want_text = unhex(col[2]);
      const auto want = ints(col[1]);
      const auto ids = (n % 2 ? tok.encode(text) : any.encode(text));
      if (ids != want && encode_bad++ < 5) CHECK_MESSAGE(false, "encode differs on hex ", col[0]);
      if (tok.decode(want) != want_text && decode_bad++ < 5) CHECK_MESSAGE(false, "decode differs on hex ", col[0]);
      invalid_utf8 += text.find('\xff') != std::string::npos || text.find('\x80') != std::string::npos;
      if (col[3] == "1") {  // no <unk>: one token at a time gives the same text
        std::string s;
        std::int32_t prev = -1;
        for (auto id : want) s += any.decode_piece(prev, id), prev = id;
        if (s != want_text && stream_bad++ < 5) CHECK_MESSAGE(false, "streaming decode differs on hex ", col[0]);
        ++streamed;
      }
    }
    CHECK(n == 10000);
    CHECK(encode_bad == 0);
    CHECK(decode_bad == 0);
    CHECK(stream_bad == 0);
    CHECK(streamed > 5000);
    CHECK(invalid_utf8 > 500);
  }
}

TEST_CASE("ChatGLM's special tokens follow the SentencePiece vocabulary, by name, and never come from text") {
  const std::string path = fixtures + "/bpe.model";
  const sentencepiece_tokenizer plain(path);
  const sentencepiece_tokenizer glm2(path, {.appended_specials = loom::data::chatglm2_special_tokens()});
  const sentencepiece_tokenizer glm3(path, {.appended_specials = loom::data::chatglm3_special_tokens()});
  CHECK(glm2.vocab_size() == plain.vocab_size() + 5);
  CHECK(glm3.vocab_size() == plain.vocab_size() + 9);
  std::ifstream f(fixtures + "/specials_bpe.tsv");
  REQUIRE(f.good());
  std::size_t n = 0;
  for (std::string line; std::getline(f, line); ++n) {
    const auto col = split(line, '\t');
    const std::int32_t want = std::stoi(col[1]);
    CAPTURE(col[0]);
    CHECK(glm3.special_id(col[0]) == want);
    const bool appended = want >= plain.piece_size();
    if (appended && want < plain.piece_size() + 5) CHECK(glm2.special_id(col[0]) == want);
    if (appended) CHECK_FALSE(plain.special_id(col[0]).has_value());
    else CHECK(plain.special_id(col[0]) == want);  // <unk> <s> </s>: the model's own
    if (appended) CHECK(glm3.decode(std::vector<std::int32_t>{want}).empty());
  }
  CHECK(n == 12);
  CHECK_FALSE(glm2.special_id("<|user|>").has_value());
  CHECK_FALSE(glm3.special_id("hello").has_value());
  CHECK(glm3.bos_id() == 1);
  CHECK(glm3.eos_id() == 2);
  CHECK(glm3.pad_id() == 0);  // the model has no <pad>: unk, as ChatGLM pads
  for (auto id : glm3.encode("[gMASK] sop <|user|> [MASK]")) CHECK(id < plain.piece_size());
  // Text between specials decodes run by run (ChatGLM3's decode): the run's leading space goes.
  const auto user = *glm3.special_id("<|user|>");
  std::vector<std::int32_t> ids{user};
  for (auto id : glm3.encode("hello")) ids.push_back(id);
  CHECK(glm3.decode(ids) == "hello");
  CHECK(glm3.decode_piece(user, ids[1]) == glm3.decode(std::vector<std::int32_t>{ids[1]}));
  // ids a padded model may sample past the tokenizer's vocabulary give no text
  CHECK(glm3.decode_piece(ids[1], 65000).empty());
  CHECK(error_of([&] { (void)glm3.decode_piece(-1, -3); }).find("negative token id -3") != std::string::npos);
}

TEST_CASE("bad tokenizer files and a vocabulary larger than the model's are loom::errors naming the file and sizes") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(fixtures) / "bad";
  fs::create_directories(dir);
  const std::string missing = (dir / "missing.model").string();
  std::string e = error_of([&] { sentencepiece_tokenizer t(missing); });
  CHECK(e.find("missing.model") != std::string::npos);
  CHECK(e.find("cannot open") != std::string::npos);

  const std::string garbage = (dir / "garbage.model").string();
  std::ofstream(garbage) << "this is not a protobuf \x01\x02\xff\xfe and never was";
  e = error_of([&] { sentencepiece_tokenizer t(garbage); });
  CHECK(e.find("garbage.model") != std::string::npos);
  CHECK(e.find("is not a SentencePiece model") != std::string::npos);
  CHECK(e.size() < 600);

  const std::string empty = (dir / "empty.model").string();
  std::ofstream{empty};
  e = error_of([&] { sentencepiece_tokenizer t(empty); });
  CHECK(e.find("empty.model") != std::string::npos);

  e = error_of([&] { sentencepiece_tokenizer t(dir.string()); });
  CHECK(e.find("is not a regular file") != std::string::npos);

  const std::string good = fixtures + "/bpe.model";
  e = error_of([&] { sentencepiece_tokenizer t(good, {.appended_specials = {}, .max_file_bytes = 1000}); });
  CHECK(e.find("bpe.model") != std::string::npos);
  CHECK(e.find("max_file_bytes=1000") != std::string::npos);

  e = error_of([&] { sentencepiece_tokenizer t(good, {.appended_specials = {"sop", "x", "sop"}}); });
  CHECK(e.find("'sop' given twice") != std::string::npos);
  const sentencepiece_tokenizer shadow(good, {.appended_specials = {"<s>"}});  // ChatGLM's lookup: the appended name first
  CHECK(shadow.special_id("<s>") == shadow.piece_size());
  CHECK(shadow.bos_id() == 1);

  const sentencepiece_tokenizer glm3(good, {.appended_specials = loom::data::chatglm3_special_tokens()});
  CHECK_NOTHROW(loom::data::check_vocab_fits(glm3, 65024, good));  // a padded model's vocabulary is larger: fine
  CHECK_NOTHROW(loom::data::check_vocab_fits(glm3, glm3.vocab_size(), good));
  e = error_of([&] { loom::data::check_vocab_fits(glm3, 1000, good); });
  CHECK(e.find("bpe.model") != std::string::npos);
  CHECK(e.find("vocab_size=" + std::to_string(glm3.vocab_size())) != std::string::npos);
  CHECK(e.find("model's vocab_size=1000") != std::string::npos);
}
