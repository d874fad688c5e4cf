#pragma once
// llama_server: an HTTP front end (cpp-httplib) over one llama_engine.
//
// Protocols:
//  - ChatGLM's api.py: POST / {"prompt", "history", "max_length", "top_p", "temperature"}
//    -> {"response", "history", "status", "time"}; max_length counts prompt + response tokens
//    as in ChatGLM; history is a list of [query, response] pairs rendered with ChatGLM2's
//    "[Round n]\n\n问：...\n\n答：..." template.
//  - OpenAI-compatible POST /v1/completions and /v1/chat/completions, with "stream": true as
//    server-sent events ending in "data: [DONE]"; GET /v1/models; GET /health.
// Threads: HTTP handlers run on httplib's pool (sized for many concurrent clients); they only
// validate, tokenize and enqueue. One engine thread owns the engine: it admits queued
// requests, runs steps while there is work, and hands each produced token to its request's
// channel, which the handler waits on (whole response) or streams from (SSE). So concurrent
// requests share one continuous batch. A client that disconnects mid-stream is aborted and
// its blocks are freed. Bad input (malformed JSON, missing or mistyped fields, prompt longer
// than the context) gets HTTP 400 with a message; the server keeps serving.

#include "llama_engine.hpp"

#include <loom/io/llama2c.hpp>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <sys/socket.h>

namespace llama {

/// Text <-> tokens. Either a llama2.c tokenizer, or raw bytes (id = 3 + byte, BOS 1, EOS 2:
/// the byte-fallback ids of llama2.c's vocabulary), which needs no file.
class text_codec {
 public:
  text_codec() = default;
  explicit text_codec(const loom::io::llama2c_tokenizer* tok) : tok_(tok) {}
  std::vector<loom::kv::token_id> encode(const std::string& s) const {
    if (tok_) return tok_->encode(s);
    std::vector<loom::kv::token_id> ids{1};
    for (unsigned char c : s) ids.push_back(3 + c);
    return ids;
  }
  std::string decode(loom::kv::token_id prev, loom::kv::token_id id) const {
    if (tok_) return tok_->decode(prev, id);
    return id >= 3 && id < 259 ? std::string(1, static_cast<char>(id - 3)) : std::string();
  }
  loom::kv::token_id eos() const noexcept { return 2; }

 private:
  const loom::io::llama2c_tokenizer* tok_ = nullptr;
};

struct server_options {
  std::string model_name = "loom-llama";
  std::int32_t default_max_tokens = 16;  ///< OpenAI default for /v1/completions
  std::int32_t http_threads = 64;        ///< concurrent connections served
  std::int32_t request_timeout_s = 600;  ///< a handler never waits longer than this
  int listen_backlog = 1024;             ///< pending connections the kernel queues
};

/// Thrown for requests that get HTTP 400.
struct bad_request : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class llama_server {
 public:
  llama_server(const llama_weights& w, engine_config ec, text_codec codec, server_options opt = {})
      : engine_(w, ec), codec_(codec), opt_(std::move(opt)) {
    routes();
  }
  ~llama_server() { stop(); }

  /// Binds host:port (port 0: any free port), starts serving; returns the port.
  int start(const std::string& host = "127.0.0.1", int port = 0) {
    http_.new_task_queue = [n = opt_.http_threads] { return new httplib::ThreadPool(static_cast<std::size_t>(n)); };
    socket_t listen_fd = -1;
    http_.set_socket_options([&listen_fd](socket_t s) {
      httplib::default_socket_options(s);
      listen_fd = s;
    });
    port_ = port == 0 ? http_.bind_to_any_port(host) : (http_.bind_to_port(host, port) ? port : -1);
    LOOM_CHECK(port_ > 0, "llama_server: cannot bind ", host, ":", port);
    // httplib 0.11 listens with a backlog of 5: a burst of clients overflows it and some see
    // their connection reset. Listening again on the bound socket raises the backlog.
    if (listen_fd >= 0) ::listen(listen_fd, opt_.listen_backlog);
    running_ = true;
    engine_thread_ = std::thread([this] { engine_loop(); });
    http_thread_ = std::thread([this] { http_.listen_after_bind(); });
    return port_;
  }
  /// Blocks until stop() is called from elsewhere (a signal handler, another thread).
  void wait() {
    if (http_thread_.joinable()) http_thread_.join();
  }
  void stop() {
    if (!running_.exchange(false)) return;
    http_.stop();
    cv_.notify_all();
    if (http_thread_.joinable()) http_thread_.join();
    if (engine_thread_.joinable()) engine_thread_.join();
  }
  int port() const noexcept { return port_; }
  /// Most sequences in one engine step so far (shows that requests shared the batch).
  std::int32_t max_batch() const noexcept { return max_batch_.load(); }
  std::int64_t requests_served() const noexcept { return served_.load(); }

 private:
  // One request's token stream, shared by its handler and the engine thread.
  struct channel {
    std::mutex m;
    std::condition_variable cv;
    std::vector<loom::kv::token_id> tokens;
    loom::kv::finish_reason finished = loom::kv::finish_reason::none;
    std::string error;
    std::int64_t prompt_tokens = 0;
    loom::kv::token_id last_prompt_token = 1;
  };
  struct job {
    loom::kv::request req;
    std::shared_ptr<channel> ch;
  };

  // ---- engine thread -------------------------------------------------------------------------
  void engine_loop() {
    std::map<std::uint64_t, std::shared_ptr<channel>> live;
    while (running_) {
      {
        std::unique_lock lk(mu_);
        cv_.wait_for(lk, std::chrono::milliseconds(50),
                     [&] { return !running_ || !queue_.empty() || !aborts_.empty() || engine_.has_work(); });
        for (auto id : aborts_) {
          engine_.cancel(id);
          if (auto it = live.find(id); it != live.end()) finish(*it->second, loom::kv::finish_reason::aborted, "");
          live.erase(id);
        }
        aborts_.clear();
        while (!queue_.empty()) {
          job j = std::move(queue_.front());
          queue_.pop_front();
          try {
            const auto id = j.req.id;
            engine_.add(std::move(j.req));
            live.emplace(id, j.ch);
          } catch (const std::exception& e) {
            finish(*j.ch, loom::kv::finish_reason::aborted, e.what());
          }
        }
      }
      if (!running_ || !engine_.has_work()) continue;
      try {
        const auto& events = engine_.step();
        std::int32_t batch = static_cast<std::int32_t>(engine_.scheduler().num_running());
        if (batch > max_batch_) max_batch_ = batch;
        for (const auto& e : events) {
          auto it = live.find(e.id);
          if (it == live.end()) continue;
          {
            std::lock_guard g(it->second->m);
            it->second->tokens.push_back(e.token);
            it->second->finished = e.finished;
          }
          it->second->cv.notify_all();
          if (e.finished != loom::kv::finish_reason::none) live.erase(it);
        }
        engine_.scheduler().take_finished();
      } catch (const std::exception& e) {  // a failed step fails its requests, not the server
        for (auto& [id, ch] : live) {
          engine_.cancel(id);
          finish(*ch, loom::kv::finish_reason::aborted, e.what());
        }
        live.clear();
      }
    }
    for (auto& [id, ch] : live) finish(*ch, loom::kv::finish_reason::aborted, "server stopped");
    std::lock_guard lk(mu_);
    for (auto& j : queue_) finish(*j.ch, loom::kv::finish_reason::aborted, "server stopped");
    queue_.clear();
  }
  static void finish(channel& ch, loom::kv::finish_reason r, const std::string& err) {
    {
      std::lock_guard g(ch.m);
      ch.finished = r;
      ch.error = err;
    }
    ch.cv.notify_all();
  }

  // ---- request intake --------------------------------------------------------------------------
  struct gen_params {
    std::vector<loom::kv::token_id> prompt;
    std::int32_t max_new = 16;
    loom::kv::sampling_params sampling;
  };

  std::shared_ptr<channel> submit(gen_params p, std::uint64_t& id_out) {
    auto ch = std::make_shared<channel>();
    ch->prompt_tokens = static_cast<std::int64_t>(p.prompt.size());
    ch->last_prompt_token = p.prompt.back();
    job j;
    j.req.id = id_out = next_id_++;
    j.req.prompt = std::move(p.prompt);
    j.req.max_new_tokens = p.max_new;
    j.req.sampling = p.sampling;
    j.req.stop_tokens = {codec_.eos()};
    j.ch = ch;
    {
      std::lock_guard lk(mu_);
      LOOM_CHECK(running_, "server is stopping");
      queue_.push_back(std::move(j));
    }
    cv_.notify_all();
    return ch;
  }
  void abort_request(std::uint64_t id) {
    {
      std::lock_guard lk(mu_);
      aborts_.push_back(id);
    }
    cv_.notify_all();
  }

  // Waits for the whole output; returns the tokens and the finish reason.
  std::pair<std::vector<loom::kv::token_id>, loom::kv::finish_reason> wait_all(channel& ch) {
    std::unique_lock g(ch.m);
    const bool done = ch.cv.wait_for(g, std::chrono::seconds(opt_.request_timeout_s),
                                     [&] { return ch.finished != loom::kv::finish_reason::none; });
    if (!done) throw std::runtime_error("timed out waiting for the engine");
    if (!ch.error.empty()) throw std::runtime_error(ch.error);
    return {ch.tokens, ch.finished};
  }

  std::string detok(const channel& ch, const std::vector<loom::kv::token_id>& toks, std::size_t from = 0,
                    std::size_t to = std::size_t(-1)) const {
    std::string s;
    to = std::min(to, toks.size());
    for (std::size_t i = from; i < to; ++i) {
      if (toks[i] == codec_.eos()) continue;
      s += codec_.decode(i == 0 ? ch.last_prompt_token : toks[i - 1], toks[i]);
    }
    return s;
  }

  // ---- JSON helpers -----------------------------------------------------------------------------
  static nlohmann::json parse_body(const httplib::Request& req) {
    try {
      auto j = nlohmann::json::parse(req.body);
      if (!j.is_object()) throw bad_request("request body must be a JSON object");
      return j;
    } catch (const nlohmann::json::parse_error& e) {
      throw bad_request(std::string("malformed JSON: ") + e.what());
    }
  }
  template <class T>
  static T field(const nlohmann::json& j, const char* key, T fallback) {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    try {
      return j[key].get<T>();
    } catch (const nlohmann::json::exception&) {
      throw bad_request(std::string("field '") + key + "' has the wrong type");
    }
  }
  static std::string required_string(const nlohmann::json& j, const char* key) {
    if (!j.contains(key)) throw bad_request(std::string("missing field '") + key + "'");
    if (!j[key].is_string()) throw bad_request(std::string("field '") + key + "' must be a string");
    return j[key].get<std::string>();
  }
  static std::string dump(const nlohmann::json& j) {
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);  // model bytes may not be UTF-8
  }
  static void send_error(httplib::Response& res, int status, const std::string& msg) {
    res.status = status;
    res.set_content(dump({{"error", {{"message", msg}, {"type", status == 400 ? "invalid_request_error" : "server_error"},
                                     {"code", status}}}}),
                    "application/json");
  }

  // Sampling fields shared by all protocols, checked; prompt length checked against the context.
  gen_params make_params(const nlohmann::json& j, std::vector<loom::kv::token_id> prompt, std::int64_t max_new,
                         float default_temperature) const {
    gen_params p;
    const std::int64_t ctx = engine_.config().scheduler.max_model_len;
    if (static_cast<std::int64_t>(prompt.size()) >= ctx)
      throw bad_request("prompt of " + std::to_string(prompt.size()) + " tokens does not fit the context of " +
                        std::to_string(ctx) + " tokens");
    if (max_new <= 0) throw bad_request("the number of tokens to generate must be > 0, got " + std::to_string(max_new));
    p.max_new = static_cast<std::int32_t>(std::min<std::int64_t>(max_new, ctx - static_cast<std::int64_t>(prompt.size())));
    p.prompt = std::move(prompt);
    p.sampling.temperature = field<float>(j, "temperature", default_temperature);
    p.sampling.top_p = field<float>(j, "top_p", 1.f);
    p.sampling.top_k = field<std::int32_t>(j, "top_k", 0);
    p.sampling.repetition_penalty = field<float>(j, "repetition_penalty", 1.f);
    p.sampling.seed = field<std::uint64_t>(j, "seed", 0);
    try {
      p.sampling.validate();
    } catch (const loom::error& e) {
      throw bad_request(e.what());
    }
    const std::int64_t blocks_needed =
        loom::kv::block_table::blocks_for(static_cast<std::int64_t>(p.prompt.size()) + p.max_new, engine_.config().block_size);
    if (blocks_needed > engine_.config().num_blocks)
      throw bad_request("prompt + max tokens need " + std::to_string(blocks_needed) + " KV blocks, the pool has " +
                        std::to_string(engine_.config().num_blocks));
    return p;
  }

  // Length of the longest prefix of s that does not end inside a UTF-8 multi-byte character.
  static std::size_t utf8_complete_prefix(const std::string& s) {
    for (std::size_t k = 1; k <= 3 && k <= s.size(); ++k) {
      const auto c = static_cast<unsigned char>(s[s.size() - k]);
      if ((c & 0xC0) == 0x80) continue;  // continuation byte: look further back
      const std::size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
      return need > k ? s.size() - k : s.size();
    }
    return s.size();
  }

  static std::string now_string() {
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
    return buf;
  }

  // Wraps a handler: bad_request -> 400, anything else -> 500; the server keeps serving.
  httplib::Server::Handler guarded(std::function<void(const httplib::Request&, httplib::Response&)> f) {
    return [f = std::move(f)](const httplib::Request& req, httplib::Response& res) {
      try {
        f(req, res);
      } catch (const bad_request& e) {
        send_error(res, 400, e.what());
      } catch (const std::exception& e) {
        send_error(res, 500, e.what());
      }
    };
  }

  // ---- routes -----------------------------------------------------------------------------------
  void routes() {
    http_.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("ok", "text/plain"); });
    http_.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(dump({{"object", "list"}, {"data", {{{"id", opt_.model_name}, {"object", "model"}, {"owned_by", "loom"}}}}}),
                      "application/json");
    });
    http_.Post("/", guarded([this](const httplib::Request& req, httplib::Response& res) { chatglm(req, res); }));
    http_.Post("/v1/completions", guarded([this](const httplib::Request& req, httplib::Response& res) {
                 openai(req, res, false);
               }));
    http_.Post("/v1/chat/completions", guarded([this](const httplib::Request& req, httplib::Response& res) {
                 openai(req, res, true);
               }));
  }

  void chatglm(const httplib::Request& req, httplib::Response& res) {
    const auto j = parse_body(req);
    const std::string prompt = required_string(j, "prompt");
    nlohmann::json history = j.contains("history") && !j["history"].is_null() ? j["history"] : nlohmann::json::array();
    if (!history.is_array()) throw bad_request("field 'history' must be a list of [query, response] pairs");
    std::string text;
    int round = 1;
    for (auto& h : history) {
      if (!h.is_array() || h.size() != 2 || !h[0].is_string() || !h[1].is_string())
        throw bad_request("field 'history' must be a list of [query, response] pairs");
      text += "[Round " + std::to_string(round++) + "]\n\n问：" + h[0].get<std::string>() + "\n\n答：" +
              h[1].get<std::string>() + "\n\n";
    }
    text += "[Round " + std::to_string(round) + "]\n\n问：" + prompt + "\n\n答：";
    auto ids = codec_.encode(text);
    const std::int64_t max_length = field<std::int64_t>(j, "max_length", 2048);
    if (max_length <= static_cast<std::int64_t>(ids.size()))
      throw bad_request("prompt of " + std::to_string(ids.size()) + " tokens is not shorter than max_length=" +
                        std::to_string(max_length));
    const std::int64_t n = static_cast<std::int64_t>(ids.size());
    gen_params p = make_params(j, std::move(ids), max_length - n, 0.95f);
    if (!j.contains("top_p")) p.sampling.top_p = 0.7f;  // api.py's defaults
    std::uint64_t id;
    auto ch = submit(std::move(p), id);
    auto [toks, why] = wait_all(*ch);
    const std::string response = detok(*ch, toks);
    history.push_back({prompt, response});
    ++served_;
    res.set_content(dump({{"response", response}, {"history", history}, {"status", 200}, {"time", now_string()}}),
                    "application/json");
  }

  void openai(const httplib::Request& req, httplib::Response& res, bool chat) {
    const auto j = parse_body(req);
    std::string text;
    if (chat) {
      if (!j.contains("messages")) throw bad_request("missing field 'messages'");
      if (!j["messages"].is_array() || j["messages"].empty())
        throw bad_request("field 'messages' must be a non-empty list");
      for (auto& m : j["messages"]) {
        if (!m.is_object() || !m.contains("role") || !m.contains("content") || !m["role"].is_string() ||
            !m["content"].is_string())
          throw bad_request("each message needs string fields 'role' and 'content'");
        text += m["role"].get<std::string>() + ": " + m["content"].get<std::string>() + "\n";
      }
      text += "assistant: ";
    } else {
      if (j.contains("prompt") && j["prompt"].is_array() && j["prompt"].size() == 1 && j["prompt"][0].is_string())
        text = j["prompt"][0].get<std::string>();
      else
        text = required_string(j, "prompt");
    }
    if (field<std::int32_t>(j, "n", 1) != 1) throw bad_request("only n=1 is supported");
    if (j.contains("stop") && !j["stop"].is_null()) throw bad_request("'stop' is not supported");
    const std::int64_t max_tokens = field<std::int64_t>(j, "max_tokens", chat ? 256 : opt_.default_max_tokens);
    gen_params p = make_params(j, codec_.encode(text), max_tokens, 1.f);
    const bool stream = field<bool>(j, "stream", false);
    const std::int64_t created = static_cast<std::int64_t>(std::time(nullptr));
    std::uint64_t id;
    auto ch = submit(std::move(p), id);
    const std::string rid = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(id);
    auto reason = [](loom::kv::finish_reason r) { return r == loom::kv::finish_reason::stop ? "stop" : "length"; };
    if (!stream) {
      auto [toks, why] = wait_all(*ch);
      const std::string out = detok(*ch, toks);
      nlohmann::json choice = {{"index", 0}, {"finish_reason", reason(why)}};
      if (chat)
        choice["message"] = {{"role", "assistant"}, {"content", out}};
      else
        choice["text"] = out, choice["logprobs"] = nullptr;
      const auto n = static_cast<std::int64_t>(toks.size());
      ++served_;
      res.set_content(dump({{"id", rid},
                            {"object", chat ? "chat.completion" : "text_completion"},
                            {"created", created},
                            {"model", opt_.model_name},
                            {"choices", {choice}},
                            {"usage", {{"prompt_tokens", ch->prompt_tokens}, {"completion_tokens", n},
                                       {"total_tokens", ch->prompt_tokens + n}}}}),
                      "application/json");
      return;
    }
    // Server-sent events: one chunk per produced token, then the finish chunk and [DONE].
    auto sent = std::make_shared<std::size_t>(0);
    auto pending = std::make_shared<std::string>();
    auto ended = std::make_shared<bool>(false);
    auto chunk = [=, this](const std::string& delta, const char* finish, bool first) {
      nlohmann::json choice = {{"index", 0}, {"finish_reason", finish ? nlohmann::json(finish) : nlohmann::json(nullptr)}};
      if (chat) {
        choice["delta"] = nlohmann::json::object();
        if (first) choice["delta"]["role"] = "assistant";
        if (!delta.empty()) choice["delta"]["content"] = delta;
      } else {
        choice["text"] = delta, choice["logprobs"] = nullptr;
      }
      return "data: " +
             dump({{"id", rid}, {"object", chat ? "chat.completion.chunk" : "text_completion"}, {"created", created},
                   {"model", opt_.model_name}, {"choices", {choice}}}) +
             "\n\n";
    };
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [=, this](std::size_t, httplib::DataSink& sink) {
          std::unique_lock g(ch->m);
          ch->cv.wait_for(g, std::chrono::seconds(1), [&] {
            return ch->tokens.size() > *sent || ch->finished != loom::kv::finish_reason::none;
          });
          std::vector<loom::kv::token_id> toks = ch->tokens;
          const auto fin = ch->finished;
          const std::string err = ch->error;
          g.unlock();
          std::string out;
          const bool first = *sent == 0;
          *pending += detok(*ch, toks, *sent, toks.size());
          *sent = toks.size();
          // Send whole UTF-8 characters only: a character split over two tokens goes out whole.
          const std::size_t cut = fin != loom::kv::finish_reason::none ? pending->size() : utf8_complete_prefix(*pending);
          if (cut > 0 || (first && !toks.empty())) {
            out += chunk(pending->substr(0, cut), nullptr, first);
            pending->erase(0, cut);
          }
          if (fin != loom::kv::finish_reason::none) {
            if (!err.empty())
              out += "data: " + dump({{"error", {{"message", err}, {"type", "server_error"}}}}) + "\n\n";
            else
              out += chunk("", reason(fin), toks.empty());
            out += "data: [DONE]\n\n";
          }
          if (!out.empty() && !sink.write(out.data(), out.size())) return false;
          if (fin != loom::kv::finish_reason::none) {
            *ended = true;
            ++served_;
            sink.done();
          }
          return true;
        },
        [=, this](bool) {
          if (!*ended) abort_request(id);  // client went away: free its blocks
        });
  }

  llama_engine<float> engine_;
  text_codec codec_;
  server_options opt_;
  httplib::Server http_;
  std::thread engine_thread_, http_thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<job> queue_;
  std::vector<std::uint64_t> aborts_;
  std::atomic<bool> running_{false};
  std::atomic<std::uint64_t> next_id_{1};
  std::atomic<std::int32_t> max_batch_{0};
  std::atomic<std::int64_t> served_{0};
  int port_ = -1;
};

}  // namespace llama
