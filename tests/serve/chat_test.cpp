// llama-serve's chat templates: what api.py's {prompt, history} and OpenAI's messages become,
// against the independent Python transcription of ChatGLM2's build_prompt, ChatGLM3's
// build_chat_input and Meta's LLaMA-2 format (tests/data/tokenizer_fixtures.py, on an
// spm_train-made tokenizer.model with ChatGLM3's appended specials); the template llama-serve
// derives from a model and its tokenizer (loom/serve/chat_setup.hpp) and the errors for bad choices;
// the answer a client sees (answer_text); and, over HTTP, a tiny random ChatGLM3-shaped HF
// folder whose output row for <|user|> is made to win after a few tokens: the answer stops
// there, leaves the stop token out, and api.py's history grows by [prompt, response].
#include <doctest/doctest.h>

#include <loom/serve/chat_setup.hpp>
#include "llama_server.hpp"

#include <tokenizer_file.hpp>

#include <loom/data/sentencepiece_tokenizer.hpp>
#include <loom/io/safetensors.hpp>

#include <support/error_of.hpp>

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

using namespace llama;
using namespace loom::serve;
using nlohmann::json;
using loom::test::error_of;
namespace fs = std::filesystem;

namespace {

const std::string fixtures = LOOM_TOKENIZER_FIXTURES;

std::vector<json> json_lines(const std::string& path) {
  std::vector<json> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) out.push_back(json::parse(line));
  return out;
}
std::vector<std::string> lines(const std::string& path) {
  std::vector<std::string> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) out.push_back(line);
  return out;
}
std::vector<loom::kv::token_id> ids_of(const std::string& line) {
  std::vector<loom::kv::token_id> ids;
  std::istringstream in(line);
  for (loom::kv::token_id v; in >> v;) ids.push_back(v);
  return ids;
}

// A request's bad_request message, or "" when it was accepted.
template <class F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const bad_request& e) {
    return e.what();
  }
  return {};
}

const request_limits roomy{.context = 1 << 20, .block_size = 16, .num_blocks = 1 << 20, .max_tokens_limit = 4096,
                           .default_max_tokens = 16};

struct temp_dir {
  fs::path path = fs::temp_directory_path() / ("loom_serve_chat_" + std::to_string(::getpid()));
  temp_dir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() { fs::remove_all(path); }
};

}  // namespace

TEST_CASE("api.py history and OpenAI messages become the templates' ids, as the Python transcription gives them") {
  const loom::data::any_tokenizer tok(
      loom::data::sentencepiece_tokenizer(fixtures + "/bpe.model", {.appended_specials = loom::data::chatglm3_special_tokens()}),
      "bpe.model");
  const auto records = json_lines(fixtures + "/records.jsonl");
  const auto conversations = json_lines(fixtures + "/conversations.jsonl");
  REQUIRE(records.size() == 41);
  REQUIRE(conversations.size() == 45);
  for (const std::string name : {"chatglm2", "chatglm3", "llama2"}) {
    CAPTURE(name);
    const text_codec codec(&tok, loom::data::parse_chat_template(name));
    // api.py: {"prompt", "history": [[q, a], ...]}
    const auto api = lines(fixtures + "/api_" + name + ".txt");
    REQUIRE(api.size() == records.size());
    for (std::size_t k = 0; k < records.size(); ++k) {
      CAPTURE(k);
      const json body = {{"prompt", records[k]["prompt"]}, {"history", records[k]["history"]}, {"max_length", 1 << 20}};
      CHECK(parse_chatglm_request(body, codec, roomy).params.prompt == ids_of(api[k]));
    }
    // OpenAI chat completions: {"messages": [{"role", "content", "metadata"?}, ...]}
    const auto render = lines(fixtures + "/render_" + name + ".txt");
    REQUIRE(render.size() == conversations.size());
    std::size_t refused = 0;
    for (std::size_t k = 0; k < conversations.size(); ++k) {
      CAPTURE(k);
      const json body = {{"messages", conversations[k]["messages"]}, {"max_tokens", 8}};
      if (render[k] == "refused") {  // a 400 that names the message and the template
        ++refused;
        CHECK(refusal([&] { (void)parse_openai_request(body, true, codec, roomy); }).find("chat template " + name + ": message ") !=
              std::string::npos);
        continue;
      }
      CHECK(parse_openai_request(body, true, codec, roomy).params.prompt == ids_of(render[k]));
    }
    CHECK(refused == (name == "chatglm2" ? 25u : name == "llama2" ? 3u : 0u));
    // the stop ids, and vLLM's ignore_eos leaving only eos out
    const auto stops = ids_of(lines(fixtures + "/stop_" + name + ".txt").at(0));
    CHECK(codec.stop_tokens() == stops);
    CHECK(codec.stop_tokens(true) == std::vector<loom::kv::token_id>(stops.begin() + 1, stops.end()));
    // a raw completion starts as the model's tokenizer starts every input
    const auto raw = parse_openai_request({{"prompt", "hello"}}, false, codec, roomy).params.prompt;
    const std::vector<loom::kv::token_id> prefix =
        name == "llama2" ? std::vector<loom::kv::token_id>{tok.bos_id()}
                         : std::vector<loom::kv::token_id>{*tok.special_id("[gMASK]"), *tok.special_id("sop")};
    CHECK(std::equal(prefix.begin(), prefix.end(), raw.begin()));
  }
  // OpenAI's "tool" role is ChatGLM3's observation
  const text_codec glm3(&tok, loom::data::chat_template::chatglm3);
  json tool = conversations[41]["messages"];
  REQUIRE(tool[3]["role"] == "observation");
  tool[3]["role"] = "tool";
  CHECK(parse_openai_request({{"messages", tool}}, true, glm3, roomy).params.prompt == ids_of(lines(fixtures + "/render_chatglm3.txt")[41]));
  CHECK(refusal([&] { (void)parse_openai_request({{"messages", {{{"role", "user"}, {"content", "x"}, {"metadata", 3}}}}}, true, glm3, roomy); })
            .find("'metadata' must be a string") != std::string::npos);
  // an unknown role: a 400 naming it
  CHECK(refusal([&] { (void)parse_openai_request({{"messages", {{{"role", "wizard"}, {"content", "x"}}}}}, true, glm3, roomy); })
            .find("message 0 has role 'wizard', not one of system, user, assistant, observation") != std::string::npos);
  // without a template (bytes, llama2.c tokenizers, --template none): today's plain text
  const text_codec plain(&tok);
  CHECK(!plain.has_template());
  CHECK(plain.stop_tokens() == std::vector<loom::kv::token_id>{tok.eos_id()});
  const json body = {{"prompt", "hi"}, {"history", json::array({json::array({"q", "a"})})}};
  CHECK(parse_chatglm_request(body, plain, roomy).params.prompt ==
        plain.encode("[Round 1]\n\n问：q\n\n答：a\n\n[Round 2]\n\n问：hi\n\n答："));
}

TEST_CASE("answer_text: ChatGLM3's metadata line and ChatGLM2/3's strip, the same whole and streamed") {
  using loom::data::chat_template;
  CHECK(answer_text::of("\n  Hello, 世界 \n\n", chat_template::chatglm3) == "Hello, 世界");
  CHECK(answer_text::of("get_weather\n```python\ntool_call(city='x')\n```", chat_template::chatglm3) ==
        "get_weather\n```python\ntool_call(city='x')\n```");
  CHECK(answer_text::of("  no newline  ", chat_template::chatglm3) == "no newline");
  CHECK(answer_text::of("  hi  \n", chat_template::chatglm2) == "hi");
  CHECK(answer_text::of(" [INST] as is ", chat_template::llama2) == " [INST] as is ");
  CHECK(answer_text::of(" as is ", std::nullopt) == " as is ");
  for (const auto t : {chat_template::chatglm2, chat_template::chatglm3}) {
    for (const std::string text : {"\n a b  c \n d \n", "tool\n x ", "   ", "", "\n\n\nx"}) {
      CAPTURE(text);
      answer_text a(t);
      std::string streamed;
      for (char c : text) {
        const std::string out = a.push(std::string(1, c));
        CHECK((out.empty() || (out.back() != ' ' && out.back() != '\n') || text.starts_with("tool")));  // trailing space held
        streamed += out;
      }
      streamed += a.finish();
      CHECK(streamed == answer_text::of(text, t));
    }
  }
}

TEST_CASE("llama-serve's template: derived from model_type and the tokenizer's folder, or --template; bad choices named") {
  using loom::data::chat_template;
  temp_dir d;
  const fs::path glm3 = d.path / "glm3", glm2 = d.path / "glm2";
  fs::create_directories(glm3);
  fs::create_directories(glm2);
  std::ofstream(glm3 / "tokenizer_config.json") << R"({"additional_special_tokens": ["<|user|>", "<|observation|>"]})";
  std::ofstream(glm2 / "tokenizer_config.json") << R"({"tokenizer_class": "ChatGLMTokenizer"})";
  const std::string glm3_model = (glm3 / "tokenizer.model").string(), glm2_model = (glm2 / "tokenizer.model").string();

  auto s = choose_chat_template("", "chatglm", glm3_model, glm3.string());
  CHECK(s.templ == chat_template::chatglm3);
  CHECK(s.specials == "chatglm3");
  s = choose_chat_template("", "chatglm", glm2_model, glm2.string());
  CHECK(s.templ == chat_template::chatglm2);
  CHECK(s.specials == "chatglm2");
  s = choose_chat_template("", "chatglm", glm2_model, glm3.string());  // the checkpoint's folder declares them
  CHECK(s.templ == chat_template::chatglm3);
  s = choose_chat_template("", "llama", glm2_model, "ckpt.bin");
  CHECK(s.templ == chat_template::llama2);
  CHECK(s.specials == "none");
  CHECK(!choose_chat_template("", "llama", "tokenizer.bin", "ckpt.bin").templ);  // llama2.c: plain text as before
  CHECK(!choose_chat_template("", "chatglm", "", glm3.string()).templ);          // bytes
  CHECK(!choose_chat_template("none", "chatglm", glm3_model, glm3.string()).templ);
  s = choose_chat_template("chatglm3", "llama", glm2_model, "x");
  CHECK(s.templ == chat_template::chatglm3);
  CHECK(s.specials == "chatglm3");
  CHECK(template_name(s.templ) == "chatglm3");

  CHECK(error_of([] { (void)choose_chat_template("gpt4", "llama", "t.model", "x"); })
            .find("flag --template: 'gpt4' is not one of chatglm2, chatglm3, llama2, none") != std::string::npos);
  CHECK(error_of([] { (void)choose_chat_template("llama2", "llama", "", "x"); }).find("flag --template llama2 needs --tokenizer") !=
        std::string::npos);
  // a template whose special tokens the tokenizer lacks
  const auto glm2_tok = examples::open_tokenizer(fixtures + "/bpe.model", "chatglm2");
  CHECK(error_of([&] { text_codec c(&glm2_tok, chat_template::chatglm3); })
            .find("chat template chatglm3 needs the special token <|system|>, which tokenizer '" + fixtures + "/bpe.model' lacks") !=
        std::string::npos);
  const auto bin = examples::open_tokenizer("bytes");
  CHECK(error_of([&] { text_codec c(&bin, chat_template::chatglm3); }).find("needs the special token [gMASK], which tokenizer 'bytes' lacks") !=
        std::string::npos);
}

namespace {

config tiny_chatglm() {
  config c = config::chatglm();
  c.dim = 64, c.hidden_dim = 128, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2;
  c.vocab = 1416;  // bpe.model's 1400 pieces + ChatGLM3's 9 specials, padded
  c.seq_len = 256;
  return c;
}
engine_config tiny_engine() {
  return {.num_blocks = 64, .block_size = 16, .scheduler = {.max_num_batched_tokens = 256, .max_num_seqs = 8}};
}
// Greedy tokens of `prompt`, stopping on `stops` only.
std::vector<loom::kv::token_id> greedy(const flat_weights& w, const std::vector<loom::kv::token_id>& prompt, int n,
                                       std::vector<loom::kv::token_id> stops) {
  llama_engine<float> eng(w, tiny_engine());
  loom::kv::request r;
  r.id = 1;
  r.prompt = prompt;
  r.max_new_tokens = n;
  r.stop_tokens = std::move(stops);
  return eng.generate({r})[1];
}
void write_hf_folder(const flat_weights& w, const fs::path& dir) {
  loom::io::tensor_map m;
  for (const auto& e : w.layout.entries()) {
    loom::io::named_tensor t;
    t.shape.assign(e.shape.begin(), e.shape.end());
    t.data = loom::buffer<float>(e.numel);
    const auto src = w.tensor(e.name);
    std::copy(src.begin(), src.end(), t.data.begin());
    m.emplace(detail::chatglm_name(e.name), std::move(t));
  }
  loom::io::write_safetensors((dir / "model.safetensors").string(), m);
  std::ofstream(dir / "config.json") << loom::io::hf_chatglm_config_json(detail::chatglm_hf_config(w.cfg), "F32").dump(2);
}

}  // namespace

TEST_CASE("HTTP: a ChatGLM3 HF folder's answer stops at <|user|>, without it; api.py's history grows by [prompt, response]") {
  temp_dir d;
  const fs::path hf = d.path / "chatglm3-tiny";
  fs::create_directories(hf);
  fs::copy_file(fixtures + "/bpe.model", hf / "tokenizer.model");
  // ChatGLM3's tokenization_chatglm.py names its role tokens; a line of it marks the folder
  std::ofstream(hf / "tokenization_chatglm.py") << "role_special_tokens = [\"<|system|>\", \"<|user|>\", \"<|assistant|>\", \"<|observation|>\"]\n";
  const std::string tokenizer = (hf / "tokenizer.model").string();

  // what llama-serve does: the template from the folder, the tokenizer with its specials
  const chat_setup chat = choose_chat_template("", "chatglm", tokenizer, hf.string());
  REQUIRE(chat.templ == loom::data::chat_template::chatglm3);
  const config c = tiny_chatglm();
  const auto tok = examples::open_tokenizer(tokenizer, chat.specials, c.vocab);
  const text_codec codec(&tok, chat.templ);
  const loom::kv::token_id user = *tok.special_id("<|user|>");

  const json history = json::array({json::array({"你好", "你好！有什么可以帮你？"})});
  const json body = {{"prompt", "the quick brown fox"}, {"history", history}, {"temperature", 0}, {"max_length", 200}};
  const auto prompt = parse_chatglm_request(body, codec, roomy).params.prompt;

  // A random model, then <|user|>'s output row a scaled copy of the row of a token it writes
  // greedily a few steps in: <|user|> wins at some step k >= 1 (found below, not assumed).
  flat_weights w0 = flat_weights::random(c, 11);
  const auto free_run = greedy(w0, prompt, 16, {});
  REQUIRE(free_run.size() == 16);
  const auto out = w0.layout.find("output.weight");
  const auto D = static_cast<std::size_t>(c.dim);
  float* rows = w0.params.data() + out.offset;
  std::copy_n(rows + static_cast<std::size_t>(free_run[5]) * D, D, rows + static_cast<std::size_t>(user) * D);
  for (std::size_t i = 0; i < D; ++i) rows[static_cast<std::size_t>(user) * D + i] *= 1.5f;
  write_hf_folder(w0, hf);

  const flat_weights w = load_checkpoint(hf.string());
  REQUIRE(w.cfg.model_type == "chatglm");
  const auto run = greedy(w, prompt, 16, {});  // no stop tokens: what comes after
  const auto k = static_cast<std::size_t>(std::find(run.begin(), run.end(), user) - run.begin());
  std::string tokens;  // shown when the construction did not give a stop at some k >= 1
  for (auto t : run) tokens += std::to_string(t) + " ";
  INFO("greedy tokens without stops: ", tokens, "(<|user|> = ", user, ")");
  REQUIRE(k >= 1);
  REQUIRE(k + 1 < run.size());
  CHECK(greedy(w, prompt, 16, codec.stop_tokens()).size() == k + 1);  // the engine stops there
  std::string text;
  for (std::size_t i = 0; i < k; ++i) text += tok.decode_piece(i == 0 ? prompt.back() : run[i - 1], run[i]);
  const std::string want = json::parse(json(answer_text::of(text, chat.templ)).dump(-1, ' ', false, json::error_handler_t::replace));

  CHECK(!want.empty());
  llama_server server(w, tiny_engine(), codec);
  const int port = server.start("127.0.0.1", 0);
  httplib::Client cl("127.0.0.1", port);
  cl.set_read_timeout(std::chrono::seconds(60));

  auto res = cl.Post("/", body.dump(), "application/json");
  REQUIRE(res);
  REQUIRE(res->status == 200);
  const json j = json::parse(res->body);
  CHECK(j["response"] == want);
  json grown = history;
  grown.push_back({"the quick brown fox", want});
  CHECK(j["history"] == grown);

  // OpenAI chat completions with the same conversation: same prompt, same answer, finish "stop",
  // the stop token counted as generated but not in the content
  const json chat_body = {{"messages", {{{"role", "user"}, {"content", "你好"}},
                                        {{"role", "assistant"}, {"content", "你好！有什么可以帮你？"}},
                                        {{"role", "user"}, {"content", "the quick brown fox"}}}},
                          {"temperature", 0}, {"max_tokens", 64}};
  REQUIRE(parse_openai_request(chat_body, true, codec, roomy).params.prompt == prompt);
  res = cl.Post("/v1/chat/completions", chat_body.dump(), "application/json");
  REQUIRE(res);
  REQUIRE(res->status == 200);
  const json o = json::parse(res->body);
  CHECK(o["choices"][0]["message"]["content"] == want);
  CHECK(o["choices"][0]["finish_reason"] == "stop");
  CHECK(o["usage"]["completion_tokens"] == k + 1);
  CHECK(o["usage"]["prompt_tokens"] == prompt.size());

  // streamed: the deltas add up to the same answer
  json stream_body = chat_body;
  stream_body["stream"] = true;
  res = cl.Post("/v1/chat/completions", stream_body.dump(), "application/json");
  REQUIRE(res);
  REQUIRE(res->status == 200);
  std::string streamed, finish;
  std::istringstream events(res->body);
  for (std::string line; std::getline(events, line);) {
    if (!line.starts_with("data: {")) continue;
    const json e = json::parse(line.substr(6));
    const auto& ch = e["choices"][0];
    if (ch["delta"].contains("content")) streamed += ch["delta"]["content"].get<std::string>();
    if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
  }
  CHECK(streamed == want);
  CHECK(finish == "stop");
  server.stop();
  CHECK(server.server_errors() == 0);
}
