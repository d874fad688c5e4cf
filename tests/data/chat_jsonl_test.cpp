// Chat JSONL encoding against a plain-Python transcription of ChatGLM2's preprocessing.
#include <support/error_of.hpp>
#include <loom/data/chat_jsonl.hpp>

#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace {
std::vector<std::vector<std::int32_t>> oracle(const std::string& path, int ms, int mt) {
  std::string cmd = "/usr/bin/python3 " LOOM_TEST_DIR "/chatglm_preprocess.py " + path + " " + std::to_string(ms) + " " +
                    std::to_string(mt);
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
  REQUIRE(p);
  std::vector<std::vector<std::int32_t>> rows;
  std::string cur;
  int c;
  while ((c = std::fgetc(p.get())) != EOF) {
    if (c == '\n') {
      std::istringstream is(cur);
      std::vector<std::int32_t> row;
      for (int v; is >> v;) row.push_back(v);
      rows.push_back(row);
      cur.clear();
    } else {
      cur.push_back(static_cast<char>(c));
    }
  }
  return rows;
}
}  // namespace

TEST_CASE("the seed's chat record encodes as ChatGLM2 does, loss only on the response") {
  const std::string path = LOOM_TEST_DIR "/chat_sample.jsonl";
  auto recs = loom::data::read_chat_jsonl(path);
  REQUIRE(recs.size() == 1);
  CHECK(recs[0].history.size() == 2);
  loom::data::byte_tokenizer tok;
  for (auto [ms, mt] : {std::pair{256, 128}, std::pair{64, 64}, std::pair{200, 16}}) {
    auto ref = oracle(path, ms, mt);
    REQUIRE(ref.size() == 2);
    std::vector<std::int32_t> tokens, targets;
    loom::data::encode_chat(recs[0], tok, {.max_source_length = std::size_t(ms), .max_target_length = std::size_t(mt)}, tokens, targets);
    CHECK(tokens == ref[0]);
    CHECK(targets == ref[1]);
    // independent of the oracle: the supervised targets are the response bytes (truncated) and eos
    std::vector<std::int32_t> supervised;
    for (auto t : targets)
      if (t != loom::data::ignore_index) supervised.push_back(t);
    auto resp = tok.encode(recs[0].response);
    resp.resize(std::min<std::size_t>(resp.size(), mt));
    resp.push_back(tok.eos_id());
    CHECK(supervised == resp);
  }
}

TEST_CASE("chat_loader batches encoded records; errors name the field, line and value") {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("loom_chat_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "c.jsonl");
    for (int i = 0; i < 6; ++i) f << R"({"prompt": "q)" << i << R"(", "response": "a)" << i << R"(", "history": []})" << "\n\n";
    std::ofstream bad(dir / "bad.jsonl");
    bad << R"({"prompt": "x", "response": "y"})" << "\n" << R"({"prompt": "x"})" << "\n";
    std::ofstream empty(dir / "empty.jsonl");
    std::ofstream hist(dir / "hist.jsonl");
    hist << R"({"prompt": "x", "response": "y", "history": [["only one"]]})" << "\n";
  }
  auto recs = loom::data::read_chat_jsonl((dir / "c.jsonl").string());
  REQUIRE(recs.size() == 6);
  loom::data::byte_tokenizer tok;
  loom::data::chat_loader L(recs, tok, {.max_source_length = 32, .max_target_length = 8}, {.batch = 2, .seed = 9});
  CHECK(L.seq_len() == 40);
  CHECK(L.batches_per_epoch() == 3);
  std::multiset<std::string> answers;
  loom::data::token_batch b;
  for (int k = 0; k < 3; ++k) {
    L.next(b);
    for (std::size_t r = 0; r < 2; ++r) {
      std::vector<std::int32_t> sup;
      for (std::size_t j = 0; j < 40; ++j)
        if (b.targets[r * 40 + j] != loom::data::ignore_index) sup.push_back(b.targets[r * 40 + j]);
      answers.insert(tok.decode(sup));
    }
  }
  CHECK(answers == std::multiset<std::string>{"a0", "a1", "a2", "a3", "a4", "a5"});

  CHECK_THROWS_WITH_AS(loom::data::read_chat_jsonl((dir / "bad.jsonl").string()), doctest::Contains("bad.jsonl:2: missing field \"response\""),
                       loom::error);
  CHECK_THROWS_WITH_AS(loom::data::read_chat_jsonl((dir / "empty.jsonl").string()), doctest::Contains("empty dataset"), loom::error);
  CHECK_THROWS_WITH_AS(loom::data::read_chat_jsonl((dir / "hist.jsonl").string()), doctest::Contains("history[0]"), loom::error);
  CHECK_THROWS_WITH_AS(loom::data::parse_chat_record("{not json"), doctest::Contains("not valid JSON"), loom::error);
  std::vector<std::int32_t> t, g;
  CHECK_THROWS_WITH_AS(loom::data::encode_chat(recs[0], tok, {.vocab_size = 200}, t, g), doctest::Contains("token id 256 >= vocab_size 200"),
                       loom::error);
  CHECK_THROWS_WITH_AS(loom::data::chat_loader({}, tok, {}, {}), doctest::Contains("empty dataset"), loom::error);
  fs::remove_all(dir);
}

namespace {
using loom::test::error_of;
}  // namespace

TEST_CASE("hostile chat JSONL: long lines, deep history, huge or mistyped values name file:line and field, messages stay short") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("loom_chat_hostile_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name, std::ios::binary) << text;
    return (dir / name).string();
  };
  const std::string ok = R"({"prompt": "q", "response": "a"})";
  // the line limit: stated, configurable, checked before the line is held whole
  std::string pad(1024 - ok.size(), ' ');
  const std::string exact = write("exact.jsonl", ok + "\n" + ok + pad + "\n" + ok);  // no final newline: still read
  CHECK(loom::data::read_chat_jsonl(exact, {}, {.max_line_bytes = 1024}).size() == 3);
  std::string m = error_of([&] { loom::data::read_chat_jsonl(exact, {}, {.max_line_bytes = 1023}); });
  CHECK(m.find("exact.jsonl:2: line longer than max_line_bytes=1023") != std::string::npos);
  const std::string big(20 << 20, 'x');
  const std::string huge = write("huge.jsonl", ok + "\n" + R"({"prompt": ")" + big + R"(", "response": "a"})" + "\n");
  m = error_of([&] { loom::data::read_chat_jsonl(huge); });
  CHECK(m.find("huge.jsonl:2: line longer than max_line_bytes=16777216") != std::string::npos);
  // deep nesting in history is refused while parsing (it used to overflow the stack in the message)
  const std::string deep =
      write("deep.jsonl", ok + "\n" + R"({"prompt": "q", "response": "a", "history": )" + std::string(200000, '[') +
                              std::string(200000, ']') + "}\n");
  m = error_of([&] { loom::data::read_chat_jsonl(deep); });
  CHECK(m.find("deep.jsonl:2: nesting deeper than 64") != std::string::npos);
  // a long bad value inside history, under the line limit: quoted short
  const std::string mid(4 << 20, 'y');
  const std::string longv = write("long.jsonl", R"({"prompt": "q", "response": "a", "history": [[")" + mid + R"("]]})" + "\n");
  m = error_of([&] { loom::data::read_chat_jsonl(longv); });
  CHECK(m.find("long.jsonl:1: field \"history\": history[0] must be [user, assistant] strings, got [\"yyyy") != std::string::npos);
  CHECK(m.size() < 500);
  // mistyped fields: the line, the field and the value
  const std::string typed = write("typed.jsonl", ok + "\n\n" + R"({"prompt": 5, "response": "a"})" + "\n");
  m = error_of([&] { loom::data::read_chat_jsonl(typed); });
  CHECK(m.find("typed.jsonl:3: field \"prompt\" must be a string, got number 5") != std::string::npos);
  const std::string hist = write("hist.jsonl", R"({"prompt": "q", "response": "a", "history": {"u": "a"}})");
  m = error_of([&] { loom::data::read_chat_jsonl(hist); });
  CHECK(m.find("hist.jsonl:1: field \"history\" must be a list of [user, assistant] pairs, got {\"u\": \"a\"}") != std::string::npos);
  const std::string notobj = write("notobj.jsonl", "[1]\n");
  m = error_of([&] { loom::data::read_chat_jsonl(notobj); });
  CHECK(m.find("notobj.jsonl:1: expected a JSON object, got array") != std::string::npos);
  fs::remove_all(dir);
}
