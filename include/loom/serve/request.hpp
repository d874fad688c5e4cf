#pragma once
// The request bodies of loom::serve::http_server, read by pure functions: JSON text in, generation
// parameters out, or an http_error (400 naming the field) for anything else.
//
// Why apart from the server: a request body is outside bytes, and these functions are all the
// server does with it before it queues work. Without a socket, an engine or a model they run
// in fuzz/serve_request.cpp as the other readers do; the server calls the same functions.
//
// Protocols (http_server.hpp has the responses):
//  - ChatGLM's api.py, POST /: {"prompt", "history", "max_length", "top_p", "temperature"};
//    max_length counts prompt + response tokens as in ChatGLM; history is a list of
//    [query, response] pairs, rendered with the model's chat template (text_codec), or without
//    one as ChatGLM2's "[Round n]\n\n问：...\n\n答：..." text.
//  - OpenAI-compatible POST /v1/completions ("prompt") and /v1/chat/completions ("messages":
//    role system / user / assistant, and for ChatGLM3 observation (or OpenAI's "tool") and a
//    message's "metadata"), with "max_tokens", "stream", "n" (1 only), and the sampling fields shared by all three.
// A prompt is checked against the context before it is tokenized; every number is
// range-checked and max_tokens capped.

#include <loom/data/chat_template.hpp>
#include <loom/data/input.hpp>
#include <loom/data/json_input.hpp>
#include <loom/data/tokenizer.hpp>
#include <loom/io/llama2c.hpp>
#include <loom/kv/block_table.hpp>
#include <loom/kv/sampler.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace loom::serve {

/// Text <-> tokens, and a conversation -> prompt ids. Either a data::tokenizer (llama2.c
/// tokenizer.bin, SentencePiece tokenizer.model), or raw
/// bytes (id = 3 + byte, BOS 1, EOS 2: the byte-fallback ids of llama2.c's vocabulary), which
/// needs no file.
/// With a chat template (data/chat_template.hpp) a conversation becomes the ids the model's own
/// template gives (special tokens as ids), a raw prompt starts with the template's prefix
/// ([gMASK] sop, or bos), and generation stops on the template's stop ids (eos; ChatGLM3's
/// <|user|> and <|observation|>). Without one (the byte codec, llama2.c tokenizers, `--template
/// none`) a conversation is plain text after bos and generation stops on eos.
class text_codec {
 public:
  text_codec() = default;
  /// `templ` needs a tokenizer with the special tokens it uses (an error names the token and
  /// the tokenizer otherwise).
  explicit text_codec(const loom::data::any_tokenizer* tok, std::optional<loom::data::chat_template> templ = std::nullopt)
      : tok_(tok), templ_(templ) {
    LOOM_CHECK(tok_ || !templ_, "text_codec: a chat template needs a tokenizer (the byte codec has none)");
    // llama2.c's encode maps every byte of text into some piece, so text bytes / the longest
    // piece bounds its ids from below. SentencePiece normalizes first (whitespace runs may
    // collapse), so no such bound holds there: only the prefix is certain.
    if (const auto* l = tok_ ? tok_->get<loom::io::llama2c_tokenizer>() : nullptr)
      for (std::int32_t id = 0; id < l->vocab_size(); ++id) longest_piece_ = std::max(longest_piece_, l->piece(id).size());
    if (templ_) {
      loom::data::check_chat_template(*tok_, *templ_, tok_->name());
      stops_ = loom::data::chat_stop_ids(*tok_, *templ_);
    } else {
      stops_ = {eos()};
    }
  }
  /// The prompt for raw text: the template's prefix (bos without one), then the text's ids.
  std::vector<loom::kv::token_id> encode(const std::string& s) const {
    if (tok_) {
      std::vector<loom::kv::token_id> ids = templ_ ? loom::data::chat_prefix(*tok_, *templ_) : std::vector<loom::kv::token_id>{tok_->bos_id()};
      const auto t = tok_->encode(s);
      ids.insert(ids.end(), t.begin(), t.end());
      return ids;
    }
    std::vector<loom::kv::token_id> ids{1};
    for (unsigned char c : s) ids.push_back(3 + c);
    return ids;
  }
  /// The prompt for a conversation under the chat template (has_template() must hold).
  std::vector<loom::kv::token_id> render(std::span<const loom::data::chat_message> m) const {
    LOOM_CHECK(templ_, "text_codec::render: no chat template");
    return loom::data::render_chat(m, *tok_, *templ_);
  }
  bool has_template() const noexcept { return templ_.has_value(); }
  const std::optional<loom::data::chat_template>& chat_template() const noexcept { return templ_; }
  /// A lower bound on the ids of `bytes` bytes of text that costs nothing: a prompt too long
  /// for the context is refused before it is tokenized (tokenizing is the expensive part of a
  /// huge prompt).
  std::size_t min_tokens(std::size_t bytes) const {
    if (!tok_) return bytes + 1;
    return longest_piece_ ? 1 + bytes / longest_piece_ : 1;
  }
  std::size_t min_tokens(const std::string& s) const { return min_tokens(s.size()); }
  std::string decode(loom::kv::token_id prev, loom::kv::token_id id) const {
    if (tok_) return tok_->decode_piece(prev, id);
    return id >= 3 && id < 259 ? std::string(1, static_cast<char>(id - 3)) : std::string();
  }
  loom::kv::token_id eos() const { return tok_ ? tok_->eos_id() : 2; }
  /// The ids that end an answer (eos first); `ignore_eos` (vLLM's) leaves eos out, the others stay.
  std::vector<loom::kv::token_id> stop_tokens(bool ignore_eos = false) const {
    return ignore_eos ? std::vector<loom::kv::token_id>(stops_.begin() + 1, stops_.end()) : stops_;
  }
  bool is_stop(loom::kv::token_id id) const { return std::find(stops_.begin(), stops_.end(), id) != stops_.end(); }

 private:
  const loom::data::any_tokenizer* tok_ = nullptr;
  std::optional<loom::data::chat_template> templ_;
  std::vector<loom::kv::token_id> stops_{2};  // eos first; the byte codec's is 2
  std::size_t longest_piece_ = 0;  // 0: no bound from the text's length
};

/// The answer a client sees of the model's text, as the model's chat() returns it: ChatGLM2
/// strips it; ChatGLM3 writes a metadata line first (empty, or a tool's name for a call), and
/// its process_response drops an empty one and strips the answer (a tool call's line stays).
/// Other templates pass the text through. Fed piece by piece for streaming (push() returns
/// what may be sent now: whitespace that may turn out to trail is held back) or whole; the
/// concatenation of push()es and finish() is the same either way.
class answer_text {
 public:
  explicit answer_text(std::optional<loom::data::chat_template> t = std::nullopt)
      : mode_(t == loom::data::chat_template::chatglm3 ? mode::metadata
              : t == loom::data::chat_template::chatglm2 ? mode::lead
                                                          : mode::plain) {}
  std::string push(std::string_view piece) {
    held_ += piece;
    if (mode_ == mode::metadata) {  // until the metadata line ends
      const auto nl = held_.find('\n');
      if (nl == std::string::npos) return {};
      if (!is_blank(std::string_view(held_).substr(0, nl))) {
        mode_ = mode::plain;  // a tool call: its name and the rest as they are
      } else {
        held_.erase(0, nl + 1);
        mode_ = mode::lead;
      }
    }
    if (mode_ == mode::plain) return std::exchange(held_, {});
    if (mode_ == mode::lead) {  // leading whitespace goes
      const auto b = held_.find_first_not_of(ws);
      if (b == std::string::npos) return held_.clear(), std::string();
      held_.erase(0, b);
      mode_ = mode::body;
    }
    const auto e = held_.find_last_not_of(ws) + 1;  // what may trail is held back
    std::string out = held_.substr(0, e);
    held_.erase(0, e);
    return out;
  }
  /// The rest at the end: trailing whitespace goes (held text of a metadata line that never
  /// ended is the answer, stripped).
  std::string finish() {
    std::string rest = std::exchange(held_, {});
    if (mode_ == mode::plain) return rest;
    if (mode_ == mode::metadata) return std::string(loom::data::detail::strip(rest));
    return {};
  }
  /// The answer for a whole text.
  static std::string of(std::string_view text, std::optional<loom::data::chat_template> t) {
    answer_text a(t);
    std::string s = a.push(text);
    return s + a.finish();
  }

 private:
  enum class mode { plain, metadata, lead, body };
  static constexpr std::string_view ws = " \t\n\r\f\v";
  static bool is_blank(std::string_view s) { return s.find_first_not_of(ws) == std::string_view::npos; }
  mode mode_;
  std::string held_;
};

/// A request refused with an HTTP status and a message for the client.
struct http_error : std::runtime_error {
  http_error(int status, const std::string& msg) : std::runtime_error(msg), status(status) {}
  int status;
};
/// Thrown for requests that get HTTP 400.
struct bad_request : http_error {
  explicit bad_request(const std::string& msg) : http_error(400, msg) {}
};

/// What a request body may ask for: the engine's context and KV pool, the server's caps.
struct request_limits {
  std::int64_t context = 2048;            ///< prompt + new tokens of one sequence (max_model_len)
  std::int32_t block_size = 16;           ///< tokens per KV block
  std::int64_t num_blocks = 256;          ///< KV blocks in the pool
  std::int32_t max_tokens_limit = 4096;   ///< most new tokens one request may ask for
  std::int32_t default_max_tokens = 16;   ///< /v1/completions without max_tokens
};

/// One request's generation, as the engine takes it.
struct gen_params {
  std::vector<loom::kv::token_id> prompt;
  std::int32_t max_new = 16;
  loom::kv::sampling_params sampling;
  bool ignore_eos = false;  // vLLM's extension: generate max_new tokens even past EOS
  std::string model;        // OpenAI's field 'model': the base's or a LoRA adapter's name (empty: the base)
};

namespace request {

// ---- JSON helpers -------------------------------------------------------------------------------
inline nlohmann::json parse_body(const std::string& body) {
  nlohmann::json j;
  try {
    j = loom::data::parse_json_input(body, "request body");
  } catch (const loom::error& e) {
    throw bad_request(e.what());
  }
  if (!j.is_object()) throw bad_request("request body must be a JSON object");
  return j;
}
inline const nlohmann::json* optional(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}
inline std::string name(const char* key) { return std::string("field '") + key + "'"; }
inline std::int64_t integer(const nlohmann::json& j, const char* key, std::int64_t fallback, std::int64_t min, std::int64_t max) {
  const auto* v = optional(j, key);
  return v ? loom::data::json_integer(*v, name(key), min, max) : fallback;
}
inline float real(const nlohmann::json& j, const char* key, float fallback, double min, double max) {
  const auto* v = optional(j, key);
  return v ? loom::data::json_real<float>(*v, name(key), min, max) : fallback;
}
inline bool boolean(const nlohmann::json& j, const char* key, bool fallback) {
  const auto* v = optional(j, key);
  if (!v) return fallback;
  if (!v->is_boolean()) throw bad_request(name(key) + " must be true or false, got " + loom::data::quote_json(*v));
  return v->get<bool>();
}
inline std::string required_string(const nlohmann::json& j, const char* key) {
  if (!j.contains(key)) throw bad_request(std::string("missing field '") + key + "'");
  if (!j[key].is_string()) throw bad_request(name(key) + " must be a string");
  return j[key].get<std::string>();
}

// Turns the checks of the parsing phase (loom::error naming a field) into a 400.
template <class F>
auto parsing(F&& f) {
  try {
    return f();
  } catch (const loom::error& e) {
    throw bad_request(e.what());
  }
}

// A prompt is checked against the context before it is tokenized (a bound from its `bytes`
// bytes of text), then its ids from `encode()`.
template <class Encode>
std::vector<loom::kv::token_id> encode_checked(std::size_t bytes, const text_codec& codec, const request_limits& lim,
                                               Encode&& encode) {
  const std::int64_t ctx = lim.context;
  auto too_long = [&](const std::string& n) {
    return bad_request("prompt of " + n + " tokens does not fit the context of " + std::to_string(ctx) +
                       " tokens (prompt and at least one new token)");
  };
  const std::size_t at_least = codec.min_tokens(bytes);
  if (at_least >= static_cast<std::size_t>(ctx)) throw too_long("at least " + std::to_string(at_least));
  std::vector<loom::kv::token_id> ids = encode();
  if (static_cast<std::int64_t>(ids.size()) >= ctx) throw too_long(std::to_string(ids.size()));
  return ids;
}
inline std::vector<loom::kv::token_id> encode_prompt(const std::string& text, const text_codec& codec, const request_limits& lim) {
  return encode_checked(text.size(), codec, lim, [&] { return codec.encode(text); });
}
// A conversation through the codec's chat template (errors of the template, such as a role it
// has no place for, become a 400 in parsing()).
inline std::vector<loom::kv::token_id> encode_conversation(std::span<const loom::data::chat_message> m, const text_codec& codec,
                                                           const request_limits& lim) {
  std::size_t bytes = 0;
  for (const auto& x : m) bytes += x.content.size() + x.metadata.size();
  return encode_checked(bytes, codec, lim, [&] { return codec.render(m); });
}

// Sampling fields shared by all protocols, range-checked and naming the field. max_new is
// what the request asks for; it is clipped to the context (generation stops there anyway).
inline gen_params make_params(const nlohmann::json& j, std::vector<loom::kv::token_id> prompt, std::int64_t max_new,
                              float default_temperature, float default_top_p, const request_limits& lim) {
  gen_params p;
  const std::int64_t ctx = lim.context;
  const auto n = static_cast<std::int64_t>(prompt.size());
  p.max_new = static_cast<std::int32_t>(std::min(max_new, ctx - n));
  p.prompt = std::move(prompt);
  p.sampling.temperature = real(j, "temperature", default_temperature, 0.0, 100.0);
  p.sampling.top_p = real(j, "top_p", default_top_p, 0.0, 1.0);
  if (p.sampling.top_p == 0.f) throw bad_request("field 'top_p' must be in (0, 1], got 0");
  p.sampling.top_k = static_cast<std::int32_t>(integer(j, "top_k", 0, 0, INT32_MAX));
  p.sampling.repetition_penalty = real(j, "repetition_penalty", 1.f, 0.0, 100.0);
  if (p.sampling.repetition_penalty == 0.f) throw bad_request("field 'repetition_penalty' must be > 0, got 0");
  if (const auto* seed = optional(j, "seed"); seed && seed->is_number_unsigned())
    p.sampling.seed = seed->get<std::uint64_t>();  // the whole unsigned 64-bit range
  else
    p.sampling.seed = static_cast<std::uint64_t>(integer(j, "seed", 0, 0, INT64_MAX));
  p.sampling.validate();
  p.ignore_eos = boolean(j, "ignore_eos", false);
  if (const auto* m = optional(j, "model")) {
    if (!m->is_string()) throw bad_request("field 'model' must be a string, got " + loom::data::quote_json(*m));
    p.model = m->get<std::string>();
  }
  const std::int64_t blocks_needed =
      loom::kv::block_table::blocks_for(static_cast<std::int64_t>(p.prompt.size()) + p.max_new, lim.block_size);
  if (blocks_needed > lim.num_blocks)
    throw bad_request("prompt + max tokens need " + std::to_string(blocks_needed) + " KV blocks, the pool has " +
                      std::to_string(lim.num_blocks));
  return p;
}

}  // namespace request

/// A ChatGLM api.py request: its generation, and the prompt and history the response echoes.
struct chatglm_request {
  gen_params params;
  std::string prompt;
  nlohmann::json history;  ///< a list of [query, response] pairs (empty when absent or null)
};

/// Reads a body of POST / (ChatGLM's api.py); throws bad_request naming the field.
inline chatglm_request parse_chatglm_request(const nlohmann::json& j, const text_codec& codec, const request_limits& lim) {
  using namespace request;
  chatglm_request r;
  r.params = parsing([&] {
    r.prompt = required_string(j, "prompt");
    r.history = j.contains("history") && !j["history"].is_null() ? j["history"] : nlohmann::json::array();
    if (!r.history.is_array()) throw bad_request("field 'history' must be a list of [query, response] pairs");
    loom::data::chat_record rec;
    rec.prompt = r.prompt;
    for (auto& h : r.history) {
      if (!h.is_array() || h.size() != 2 || !h[0].is_string() || !h[1].is_string())
        throw bad_request("field 'history' must be a list of [query, response] pairs");
      rec.history.emplace_back(h[0].get<std::string>(), h[1].get<std::string>());
    }
    const std::int64_t max_length = integer(j, "max_length", 2048, 1, INT32_MAX);
    // the model's template; without one, ChatGLM2's text after bos
    auto ids = codec.has_template() ? encode_conversation(loom::data::chat_messages(rec), codec, lim)
                                    : encode_prompt(loom::data::chatglm2_prompt(rec), codec, lim);
    const auto n = static_cast<std::int64_t>(ids.size());
    if (max_length <= n)
      throw bad_request("prompt of " + std::to_string(n) + " tokens is not shorter than field 'max_length' (" +
                        std::to_string(max_length) + ")");
    // max_length bounds prompt + response as in ChatGLM; the server's cap bounds the response.
    return make_params(j, std::move(ids), std::min<std::int64_t>(max_length - n, lim.max_tokens_limit), 0.95f, 0.7f, lim);
  });
  return r;
}

/// An OpenAI-compatible request: its generation, and whether it is streamed (server-sent events).
struct openai_request {
  gen_params params;
  bool stream = false;
};

/// Reads a body of POST /v1/chat/completions (`chat`) or /v1/completions; throws bad_request
/// naming the field.
inline openai_request parse_openai_request(const nlohmann::json& j, bool chat, const text_codec& codec,
                                           const request_limits& lim) {
  using namespace request;
  openai_request r;
  r.params = parsing([&] {
    std::string text;
    std::vector<loom::data::chat_message> messages;
    if (chat) {
      if (!j.contains("messages")) throw bad_request("missing field 'messages'");
      if (!j["messages"].is_array() || j["messages"].empty()) throw bad_request("field 'messages' must be a non-empty list");
      const bool glm3 = codec.chat_template() == loom::data::chat_template::chatglm3;
      for (auto& m : j["messages"]) {
        if (!m.is_object() || !m.contains("role") || !m.contains("content") || !m["role"].is_string() ||
            !m["content"].is_string())
          throw bad_request("each message needs string fields 'role' and 'content'");
        auto& x = messages.emplace_back(loom::data::chat_message{m["role"].get<std::string>(), m["content"].get<std::string>(), {}});
        if (const auto* meta = optional(m, "metadata")) {
          if (!meta->is_string()) throw bad_request("a message's field 'metadata' must be a string");
          x.metadata = meta->get<std::string>();
        }
        if (glm3 && x.role == "tool") x.role = "observation";  // OpenAI's name for a tool's result
        text += x.role + ": " + x.content + "\n";
      }
      text += "assistant: ";
    } else {
      if (j.contains("prompt") && j["prompt"].is_array() && j["prompt"].size() == 1 && j["prompt"][0].is_string())
        text = j["prompt"][0].get<std::string>();
      else
        text = required_string(j, "prompt");
    }
    integer(j, "n", 1, 1, 1);  // one choice per request
    if (j.contains("stop") && !j["stop"].is_null()) throw bad_request("field 'stop' is not supported");
    const std::int64_t max_tokens =
        integer(j, "max_tokens", chat ? std::min(256, lim.max_tokens_limit) : lim.default_max_tokens, 1, lim.max_tokens_limit);
    r.stream = boolean(j, "stream", false);
    // a conversation through the model's template; without one as "role: content" lines
    auto ids = chat && codec.has_template() ? encode_conversation(messages, codec, lim) : encode_prompt(text, codec, lim);
    return make_params(j, std::move(ids), max_tokens, 1.f, 1.f, lim);
  });
  return r;
}

}  // namespace loom::serve
