// Chat templates (data/chat_template.hpp) against an independent Python transcription of
// ChatGLM2's build_prompt + ptuning preprocessing, ChatGLM3's build_chat_input and Meta's
// LLaMA-2 chat format (tokenizer_fixtures.py), on the seed's record and 40 generated ones with
// history, under five truncation settings each. Without SentencePiece only the byte-level
// cases build; the fixture cases report why they were left out.
#include <support/error_of.hpp>
#include <loom/data/chat_jsonl.hpp>
#include <loom/data/chat_template.hpp>
#if LOOM_HAS_SENTENCEPIECE
#include <loom/data/sentencepiece_tokenizer.hpp>
#endif

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

using namespace loom::data;
using loom::test::error_of;

#if LOOM_HAS_SENTENCEPIECE
TEST_CASE("chatglm2, chatglm3 and llama2 templates give the Python transcriptions' ids and loss masks") {
  const std::string dir = LOOM_TOKENIZER_FIXTURES;
  const auto records = read_chat_jsonl(dir + "/records.jsonl");
  REQUIRE(records.size() == 41);
  CHECK(records[0].history.size() == 2);  // the seed's record
  const sentencepiece_tokenizer tok(dir + "/bpe.model", {.appended_specials = chatglm3_special_tokens()});
  const std::string system = "You are a helpful assistant. 请用中文回答。";
  for (const std::string name : {"chatglm2", "chatglm3", "llama2"}) {
    CAPTURE(name);
    const chat_template_options o{.kind = parse_chat_template(name), .system = name == "chatglm2" ? "" : system};
    std::ifstream f(dir + "/chat_" + name + ".txt");
    REQUIRE(f.good());
    std::size_t n = 0, truncated = 0;
    for (std::string head, ids_line, mask_line; std::getline(f, head) && std::getline(f, ids_line) && std::getline(f, mask_line); ++n) {
      std::istringstream h(head);
      std::size_t k = 0, ms = 0, mt = 0;
      h >> k >> ms >> mt;
      CAPTURE(head);
      REQUIRE(k < records.size());
      const chat_parts p = apply_chat_template(records[k], tok, o);
      const chat_sample s = make_chat_sample(p, tok, {.max_source_length = ms, .max_target_length = mt});
      std::vector<std::int32_t> want_ids, want_mask;
      std::istringstream a(ids_line), b(mask_line);
      for (std::int32_t v; a >> v;) want_ids.push_back(v);
      for (std::int32_t v; b >> v;) want_mask.push_back(v);
      CHECK(s.ids == want_ids);
      CHECK(std::vector<std::int32_t>(s.is_response.begin(), s.is_response.end()) == want_mask);
      truncated += p.source.size() > ms || p.target.size() > mt;
    }
    CHECK(n == 41 * 5);
    CHECK(truncated > 100);
  }
}

TEST_CASE("chat_loader with a SentencePiece tokenizer and the chatglm3 template: loss on the response ids only") {
  const std::string dir = LOOM_TOKENIZER_FIXTURES;
  const auto records = read_chat_jsonl(dir + "/records.jsonl");
  const sentencepiece_tokenizer tok(dir + "/bpe.model", {.appended_specials = chatglm3_special_tokens()});
  const chat_encode_options o{.max_source_length = 48, .max_target_length = 24, .vocab_size = 2048,
                              .chat_template = {.kind = chat_template::chatglm3, .system = {}}};
  std::vector<std::int32_t> tokens, targets;
  encode_chat(records[1], tok, o, tokens, targets);
  const chat_sample s = make_chat_sample(apply_chat_template(records[1], tok, o.chat_template), tok, {48, 24});
  REQUIRE(tokens.size() == 72);
  for (std::size_t i = 0; i + 1 < s.ids.size(); ++i) {
    CHECK(tokens[i] == s.ids[i]);
    CHECK(targets[i] == (s.is_response[i + 1] ? s.ids[i + 1] : ignore_index));
  }
  for (std::size_t i = s.ids.size() - 1; i < 72; ++i) CHECK(targets[i] == ignore_index);
  CHECK(tokens.front() == *tok.special_id("[gMASK]"));
}
TEST_CASE("render_chat gives the transcriptions' prompt ids for conversations, ChatGLM3's tools and observations included") {
  const std::string dir = LOOM_TOKENIZER_FIXTURES;
  std::vector<std::vector<chat_message>> conversations;
  std::ifstream in(dir + "/conversations.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto& c = conversations.emplace_back();
    const auto j = nlohmann::json::parse(line);
    for (const auto& m : j["messages"])
      c.push_back({m["role"].get<std::string>(), m["content"].get<std::string>(), m.value("metadata", std::string())});
  }
  REQUIRE(conversations.size() == 45);
  const sentencepiece_tokenizer tok(dir + "/bpe.model", {.appended_specials = chatglm3_special_tokens()});
  for (const std::string name : {"chatglm2", "chatglm3", "llama2"}) {
    CAPTURE(name);
    const chat_template kind = parse_chat_template(name);
    std::ifstream f(dir + "/render_" + name + ".txt");
    std::size_t n = 0, refused = 0;
    for (std::string line; std::getline(f, line); ++n) {
      CAPTURE(n);
      REQUIRE(n < conversations.size());
      if (line == "refused") {  // a role the template has no place for: named in the error
        ++refused;
        const std::string e = error_of([&] { (void)render_chat(conversations[n], tok, kind); });
        CHECK(e.find("chat template " + name + ": message ") != std::string::npos);
        continue;
      }
      std::vector<std::int32_t> want;
      std::istringstream a(line);
      for (std::int32_t v; a >> v;) want.push_back(v);
      CHECK(render_chat(conversations[n], tok, kind) == want);
    }
    CHECK(n == conversations.size());
    CHECK(refused == (name == "chatglm2" ? 25u : name == "llama2" ? 3u : 0u));
    std::ifstream stop(dir + "/stop_" + name + ".txt");
    std::vector<std::int32_t> want;
    for (std::int32_t v; stop >> v;) want.push_back(v);
    CHECK(chat_stop_ids(tok, kind) == want);
    CHECK_NOTHROW(check_chat_template(tok, kind, "bpe.model"));
  }
  // The tool round trip as ChatGLM3 writes it: the observation's role token, its content.
  const auto& tools = conversations[41];
  CHECK(tools[2].metadata == "get_weather");
  const auto ids = render_chat(tools, tok, chat_template::chatglm3);
  CHECK(std::count(ids.begin(), ids.end(), *tok.special_id("<|observation|>")) == 1);
  CHECK(ids.back() == *tok.special_id("<|assistant|>"));
  // A tokenizer without ChatGLM3's role tokens: the check names the token and the file.
  const sentencepiece_tokenizer glm2(dir + "/bpe.model", {.appended_specials = chatglm2_special_tokens()});
  const std::string e = error_of([&] { check_chat_template(glm2, chat_template::chatglm3, "glm2/tokenizer.model"); });
  CHECK(e.find("chat template chatglm3 needs the special token <|system|>, which tokenizer 'glm2/tokenizer.model' lacks") !=
        std::string::npos);
  CHECK_NOTHROW(check_chat_template(glm2, chat_template::chatglm2, "glm2/tokenizer.model"));
}
#else
TEST_CASE("SentencePiece template cases") { MESSAGE("skipped: loom was configured without SentencePiece (libsentencepiece-dev)"); }
#endif

TEST_CASE("byte tokenizer: chatglm2 keeps the bos prefix; templates that need special tokens say which") {
  const byte_tokenizer tok;
  chat_record r{"hi", "yo", {{"a", "b"}}};
  const auto p = apply_chat_template(r, tok);
  CHECK(p.source.front() == tok.bos_id());
  CHECK(tok.decode(p.source) == chatglm2_prompt(r));
  CHECK(tok.decode(p.target) == "yo");
  const auto s = make_chat_sample(p, tok, {.max_source_length = 5, .max_target_length = 1});
  CHECK(s.ids == std::vector<std::int32_t>{256, '[', 'R', 'o', 'u', 'y', 257});
  CHECK(std::vector<int>(s.is_response.begin(), s.is_response.end()) == std::vector<int>{0, 0, 0, 0, 0, 1, 1});
  // llama2 over bytes: <s>/</s> between turns, contents stripped, <<SYS>> in the first message
  const auto l = apply_chat_template(chat_record{" q ", " r ", {{" a ", " b "}}}, tok, {.kind = chat_template::llama2, .system = "S"});
  std::vector<std::int32_t> want{256};
  for (unsigned char c : std::string("[INST] <<SYS>>\nS\n<</SYS>>\n\n a [/INST] b ")) want.push_back(c);
  want.push_back(257);
  want.push_back(256);
  for (unsigned char c : std::string("[INST] q [/INST]")) want.push_back(c);
  CHECK(l.source == want);
  CHECK(tok.decode(l.target) == "r");

  std::string e = error_of([&] { apply_chat_template(r, tok, {.kind = chat_template::chatglm3, .system = {}}); });
  CHECK(e.find("needs the special token [gMASK]") != std::string::npos);
  e = error_of([&] { apply_chat_template(r, tok, {.kind = chat_template::chatglm2, .system = "x"}); });
  CHECK(e.find("chatglm2 has no system prompt") != std::string::npos);
  e = error_of([&] { (void)parse_chat_template("gpt4"); });
  CHECK(e.find("chat template 'gpt4' is not one of chatglm2, chatglm3, llama2") != std::string::npos);
  // messages: roles a template has no place for, named with the message's index
  const std::vector<chat_message> obs{{"user", "q", {}}, {"observation", "{}", {}}};
  e = error_of([&] { (void)render_chat(obs, tok, chat_template::llama2); });
  CHECK(e.find("chat template llama2: message 1 has role 'observation' where 'assistant' was expected") != std::string::npos);
  e = error_of([&] { (void)render_chat(std::vector<chat_message>{{"user", "q", "tool"}}, tok, chat_template::chatglm2); });
  CHECK(e.find("message 0 has metadata, which only chatglm3 reads") != std::string::npos);
  e = error_of([&] { (void)render_chat(std::vector<chat_message>{{"system", "s", {}}, {"user", "q", {}}}, tok, chat_template::chatglm2); });
  CHECK(e.find("chatglm2 has no system prompt") != std::string::npos);
  e = error_of([&] { (void)render_chat(std::vector<chat_message>{{"user", "q", {}}, {"assistant", "a", {}}}, tok, chat_template::llama2); });
  CHECK(e.find("the last message has role 'assistant'; the model answers a user message") != std::string::npos);
  CHECK(render_chat(chat_messages(r), tok, chat_template::chatglm2) == p.source);
  CHECK(chat_stop_ids(tok, chat_template::llama2) == std::vector<std::int32_t>{257});
  e = error_of([&] { check_chat_template(tok, chat_template::chatglm3, "bytes"); });
  CHECK(e.find("needs the special token [gMASK], which tokenizer 'bytes' lacks") != std::string::npos);
  e = error_of([&] { (void)make_chat_sample(p, tok, {.max_source_length = 0}); });
  CHECK(e.find("max_source_length (0)") != std::string::npos);
}
