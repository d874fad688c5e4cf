#pragma once
// http_server: an HTTP front end (cpp-httplib) over one paged-KV engine, any model.
//
// Why in the library: nothing here depends on the model. The server needs an engine that
// takes loom::kv::requests and steps a loom::kv::scheduler (serve_engine below), and a
// text_codec (request.hpp) that turns text and conversations into ids; a program picks the
// engine and the tokenizer and calls start() (examples/llama/serve is one).
//
// Protocols (request.hpp reads the bodies):
//  - ChatGLM's api.py: POST / {"prompt", "history", "max_length", "top_p", "temperature"}
//    -> {"response", "history", "status", "time"}; history is the request's plus [prompt, response].
// Conversations (api.py's history, OpenAI's messages) become ids through the model's chat
// template (text_codec: chatglm2, chatglm3, llama2, or none); generation stops on the
// template's stop ids (eos; ChatGLM3's <|user|>, <|observation|>), which the answer leaves
// out; a chat answer is what the model's chat() returns (answer_text: ChatGLM3's empty
// metadata line dropped, ChatGLM2/3's answer stripped).
//  - OpenAI-compatible POST /v1/completions and /v1/chat/completions, with "stream": true as
//    server-sent events ending in "data: [DONE]"; GET /v1/models; GET /health.
// LoRA adapters: an engine that serves adapters over its base (adapter_names(), adapter i + 1
// of kv::request) has them chosen per request by the field "model" (any protocol): the base's
// name (server_options::model_name) or no field is the base, an adapter's name that adapter,
// anything else a 404 naming it. A server without adapters has no choice to make and answers
// whatever "model" says, as it always did (clients often send a fixed name). /v1/models lists
// the base and the adapters (vLLM's "parent").
// Threads: HTTP handlers run on the connection pool of http_guard.hpp; they only validate,
// tokenize and enqueue. One engine thread owns the engine: it admits queued requests, runs
// steps while there is work, and hands each produced token to its request's channel, which
// the handler waits on (whole response) or streams from (SSE). So concurrent requests share
// one continuous batch.
// An engine over a tensor group (kv::engine with a model on several ranks): the server talks
// to rank 0's engine only, which broadcasts each step's plan to the others; the engine
// thread keeps the followers waiting past their timeout while idle (keep_alive()). A
// failed step there breaks the group (engine.broken()): the server then fails its requests
// and every later one with its error and reports failure(), on which the program ends; one rank's
// failed step only fails its requests.
// Limits (server_options): a request body over max_body_bytes is refused (413) before it is
// read, compressed or multipart bodies are refused (415: a small gzip body can inflate to
// gigabytes); at most max_in_flight requests are admitted (503 above, Retry-After); a prompt
// is checked against the context before it is tokenized; every number is range-checked and
// max_tokens capped (400 naming the field); a request whose client leaves, or which runs past
// request_timeout, is cancelled and its KV blocks freed; slow or idle connections cannot
// hold the pool (http_guard.hpp). With api_key set, requests other than GET /health need
// "Authorization: Bearer <key>" (401). Error replies are JSON {"error": {"message", "type",
// "code"}} without the source locations loom::error carries; the server keeps serving.

#include <loom/data/input.hpp>
#include <loom/kv/scheduler.hpp>
#include <loom/serve/http_guard.hpp>
#include <loom/serve/request.hpp>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstring>
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

namespace loom::serve {

/// What the server drives: an engine over loom::kv's continuous-batching scheduler.
/// Requires: add(kv::request) queues a request (a bad one throws); cancel(id) drops one,
/// queued or running, and frees its blocks; has_work(); step() runs one scheduler step and
/// returns the tokens it produced; scheduler() is the kv::scheduler it steps; config() has
/// the scheduler's config (max_model_len), block_size and num_blocks, which bound what a
/// request may ask for.
template <class E>
concept serve_engine = requires(E& e, const E& ce, kv::request r, std::uint64_t id) {
  e.add(std::move(r));
  e.cancel(id);
  { ce.has_work() } -> std::convertible_to<bool>;
  { e.step() } -> std::convertible_to<const std::vector<kv::token_event>&>;
  { e.scheduler() } -> std::same_as<kv::scheduler&>;
  { ce.config().scheduler } -> std::convertible_to<kv::scheduler_config>;
  { ce.config().block_size } -> std::convertible_to<std::int32_t>;
  { ce.config().num_blocks } -> std::convertible_to<std::int64_t>;
};

struct server_options {
  std::string model_name = "loom";  ///< what GET /v1/models and the responses name
  std::int32_t default_max_tokens = 16;     ///< OpenAI default for /v1/completions
  std::int32_t max_tokens_limit = 4096;     ///< most new tokens one request may ask for (400 above)
  std::int32_t max_in_flight = 64;          ///< requests admitted at once (503 above)
  std::size_t max_body_bytes = 8u << 20;    ///< request body, refused (413) before it is read
  std::chrono::milliseconds request_timeout{std::chrono::seconds(600)};  ///< a request still running then is cancelled
  std::string api_key;                      ///< when set, requests need "Authorization: Bearer <key>"
  http::limits http;                        ///< connection threads, read deadlines, header budget
  int listen_backlog = 1024;                ///< pending connections the kernel queues
};

/// `msg` without the source locations loom::error appends (" [at file:line]", " [check `c`
/// failed at file:line]"): they are for the server's log, not for clients. Cut to `limit` bytes.
inline std::string client_message(std::string msg, std::size_t limit = 1024) {
  for (;;) {
    const std::size_t check = msg.find(" [check `"), at = msg.find(" [at ");
    const std::size_t from = std::min(check, at);
    if (from == std::string::npos) break;
    std::size_t end = std::string::npos;
    if (from == check) {
      const std::size_t failed = msg.find("` failed at ", from);
      if (failed != std::string::npos) end = msg.find(']', failed);
    } else {
      end = msg.find(']', from);
    }
    if (end == std::string::npos) {  // not a location: keep the text, stop looking
      break;
    }
    msg.erase(from, end + 1 - from);
  }
  if (msg.size() > limit) msg = msg.substr(0, limit) + "...";
  return msg;
}

/// The server over an Engine it owns, built in place from `engine_args` (an engine holds its
/// KV cache and scheduler, which are not moved).
template <serve_engine Engine>
class http_server {
 public:
  template <class... EngineArgs>
  http_server(text_codec codec, server_options opt, EngineArgs&&... engine_args)
      : engine_(std::forward<EngineArgs>(engine_args)...), codec_(std::move(codec)), opt_(std::move(opt)), http_(opt_.http) {
    LOOM_CHECK(opt_.max_in_flight > 0, "http_server: max_in_flight must be > 0, got ", opt_.max_in_flight);
    LOOM_CHECK(opt_.max_tokens_limit > 0, "http_server: max_tokens_limit must be > 0, got ", opt_.max_tokens_limit);
    LOOM_CHECK(opt_.max_body_bytes > 0, "http_server: max_body_bytes must be > 0, got ", opt_.max_body_bytes);
    LOOM_CHECK(opt_.request_timeout.count() > 0, "http_server: request_timeout must be > 0, got ",
               opt_.request_timeout.count(), " ms");
    // Handlers that wait on the engine need threads left over for reading and refusing others.
    LOOM_CHECK(opt_.http.threads > opt_.max_in_flight, "http_server: http threads (", opt_.http.threads,
               ") must exceed max_in_flight (", opt_.max_in_flight, ")");
    if constexpr (requires(const Engine& e) { e.adapter_names(); }) adapters_ = engine_.adapter_names();
    for (std::size_t i = 0; i < adapters_.size(); ++i) {
      LOOM_CHECK(!adapters_[i].empty() && adapters_[i] != opt_.model_name, "http_server: adapter ", i + 1, " is called '",
                 adapters_[i], "', which is empty or the base model's name");
      LOOM_CHECK(std::find(adapters_.begin(), adapters_.begin() + static_cast<std::ptrdiff_t>(i), adapters_[i]) ==
                     adapters_.begin() + static_cast<std::ptrdiff_t>(i),
                 "http_server: two adapters are called '", adapters_[i], "'");
    }
    routes();
  }
  ~http_server() { stop(); }
  http_server(const http_server&) = delete;
  http_server& operator=(const http_server&) = delete;

  /// Binds host:port (port 0: any free port), starts serving; returns the port. A port another
  /// socket listens on is an error (no SO_REUSEPORT: two servers must not split the requests).
  int start(const std::string& host = "127.0.0.1", int port = 0) {
    LOOM_CHECK(port >= 0 && port <= 65535, "http_server: port must be in [0, 65535] (0: any free port), got ", port);
    socket_t listen_fd = -1;
    http_.set_socket_options([&listen_fd](socket_t s) {
      int yes = 1;  // SO_REUSEADDR only: restart past TIME_WAIT, never share a live port
      ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
      listen_fd = s;
    });
    errno = 0;
    port_ = port == 0 ? http_.bind_to_any_port(host) : (http_.bind_to_port(host, port) ? port : -1);
    const int err = errno;
    LOOM_CHECK(port_ > 0, "http_server: cannot listen on ", host, ":", port,
               err == EADDRINUSE ? " (the port is in use: is another server running?)"
                                 : err ? std::string(" (") + std::strerror(err) + ")" : std::string());
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
    http_.close_all();
    cv_.notify_all();
    if (http_thread_.joinable()) http_thread_.join();
    if (engine_thread_.joinable()) engine_thread_.join();
  }
  int port() const noexcept { return port_; }
  /// The engine; use it only while the server is stopped (the engine thread owns it while
  /// running), e.g. to release a tensor group's followers after stop().
  Engine& engine() noexcept { return engine_; }
  /// Why the engine can no longer step (its tensor group failed); empty while it can.
  std::string failure() const {
    std::lock_guard lk(mu_);
    return failure_;
  }
  /// Most sequences in one engine step so far (shows that requests shared the batch).
  std::int32_t max_batch() const noexcept { return max_batch_.load(); }
  std::int64_t requests_served() const noexcept { return served_.load(); }
  /// Requests cancelled before they finished (client gone, deadline passed).
  std::int64_t requests_cancelled() const noexcept { return cancelled_.load(); }
  /// Requests admitted and not yet answered.
  std::int32_t in_flight() const noexcept { return in_flight_.load(); }
  /// Tokens the engine has produced over all requests.
  std::int64_t tokens_generated() const noexcept { return tokens_.load(); }
  /// Responses with status 500 or above sent (a healthy server under bad input sends none but 503).
  std::int64_t server_errors() const noexcept { return server_errors_.load(); }
  /// Connections closed to make room for new ones (slow or idle clients).
  std::int64_t connections_evicted() const noexcept { return http_.evictions(); }

 private:
  using clock = std::chrono::steady_clock;

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
  // A place among the max_in_flight admitted requests, held until the response is sent.
  struct slot {
    explicit slot(std::atomic<std::int32_t>& n) : n_(n) {}
    ~slot() { --n_; }
    slot(const slot&) = delete;
    slot& operator=(const slot&) = delete;
    std::atomic<std::int32_t>& n_;
  };

  // ---- engine thread -------------------------------------------------------------------------
  void engine_loop() {
    std::map<std::uint64_t, std::shared_ptr<channel>> live;
    while (running_) {
      {
        std::unique_lock lk(mu_);
        cv_.wait_for(lk, std::chrono::milliseconds(50),
                     [&] { return !running_ || !queue_.empty() || !aborts_.empty() || engine_.has_work(); });
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
        // After admitting: an abort may name a request that was still queued.
        for (auto id : aborts_) {
          engine_.cancel(id);
          if (auto it = live.find(id); it != live.end()) {
            finish(*it->second, loom::kv::finish_reason::aborted, "");
            live.erase(it);
            ++cancelled_;
          }
        }
        aborts_.clear();
      }
      if (!running_) continue;
      if (!engine_.has_work()) {
        if constexpr (requires { engine_.keep_alive(); }) {
          if (!engine_broken()) try {
              engine_.keep_alive();
            } catch (const std::exception& e) {
              fail_all(live, e.what());
            }
        }
        continue;
      }
      if (engine_broken()) {
        fail_all(live, failure());
        continue;
      }
      try {
        const auto& events = engine_.step();
        std::int32_t batch = static_cast<std::int32_t>(engine_.scheduler().num_running());
        if (batch > max_batch_) max_batch_ = batch;
        tokens_ += static_cast<std::int64_t>(events.size());
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
        fail_all(live, e.what());
      }
    }
    for (auto& [id, ch] : live) finish(*ch, loom::kv::finish_reason::aborted, "server stopped");
    std::lock_guard lk(mu_);
    for (auto& j : queue_) finish(*j.ch, loom::kv::finish_reason::aborted, "server stopped");
    queue_.clear();
  }
  bool engine_broken() const {
    if constexpr (requires(const Engine& e) { e.broken(); }) return engine_.broken();
    return false;
  }
  // A failed step (or keep-alive): its requests fail; a broken group records why, and every
  // request admitted later fails at once with it.
  void fail_all(std::map<std::uint64_t, std::shared_ptr<channel>>& live, const std::string& why) {
    if (engine_broken()) {
      std::lock_guard lk(mu_);
      if (failure_.empty()) failure_ = why;
    }
    for (auto& [id, ch] : live) {
      engine_.cancel(id);
      finish(*ch, loom::kv::finish_reason::aborted, why);
    }
    live.clear();
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
  // What a request body may ask for, from the engine's context and pool and the options.
  request_limits limits() const {
    const auto& ec = engine_.config();
    return {ec.scheduler.max_model_len, ec.block_size, ec.num_blocks, opt_.max_tokens_limit, opt_.default_max_tokens};
  }

  // The adapter a request's field "model" names (0: the base); a 404 naming an unknown one
  // when there are adapters to choose from.
  std::int32_t adapter_of(const std::string& model) const {
    if (model.empty() || model == opt_.model_name || adapters_.empty()) return 0;
    for (std::size_t i = 0; i < adapters_.size(); ++i)
      if (adapters_[i] == model) return static_cast<std::int32_t>(i + 1);
    std::string known = loom::data::quote_input(opt_.model_name);
    for (const auto& a : adapters_) known += ", " + loom::data::quote_input(a);
    throw http_error(404, "model " + loom::data::quote_input(model) + " does not exist; this server serves " + known);
  }
  // The name responses give: the one asked for, or the base's.
  std::string served_name(const gen_params& p) const { return adapter_of(p.model) == 0 ? opt_.model_name : p.model; }

  std::shared_ptr<channel> submit(gen_params p, std::uint64_t& id_out) {
    const std::int32_t adapter = adapter_of(p.model);
    auto ch = std::make_shared<channel>();
    ch->prompt_tokens = static_cast<std::int64_t>(p.prompt.size());
    ch->last_prompt_token = p.prompt.back();
    job j;
    j.req.id = id_out = next_id_++;
    j.req.prompt = std::move(p.prompt);
    j.req.max_new_tokens = p.max_new;
    j.req.sampling = p.sampling;
    j.req.stop_tokens = codec_.stop_tokens(p.ignore_eos);
    j.req.adapter = adapter;
    j.ch = ch;
    {
      std::lock_guard lk(mu_);
      if (!running_) throw http_error(503, "server is stopping");
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

  std::string timed_out() const {
    return "the request did not finish within the request timeout (--request-timeout, " +
           std::to_string(opt_.request_timeout.count()) + " ms) and was cancelled";
  }

  // Thrown when the client of a whole (non-streamed) response has gone: nothing to send.
  struct client_gone {};

  // Waits for the whole output; returns the tokens and the finish reason. The request is
  // cancelled when its client leaves or its deadline passes, so nobody generates for no one.
  std::pair<std::vector<loom::kv::token_id>, loom::kv::finish_reason> wait_all(channel& ch, std::uint64_t id,
                                                                             clock::time_point deadline) {
    http::connection* conn = http::server::current();
    std::unique_lock g(ch.m);
    while (ch.finished == loom::kv::finish_reason::none) {
      if (clock::now() >= deadline) {
        g.unlock();
        abort_request(id);
        throw http_error(503, timed_out());
      }
      if (conn && conn->client_gone()) {
        g.unlock();
        abort_request(id);
        throw client_gone{};
      }
      ch.cv.wait_for(g, std::chrono::milliseconds(50));
    }
    if (!ch.error.empty()) throw std::runtime_error(ch.error);
    return {ch.tokens, ch.finished};
  }

  std::string detok(const channel& ch, const std::vector<loom::kv::token_id>& toks, std::size_t from = 0,
                    std::size_t to = std::size_t(-1)) const {
    std::string s;
    to = std::min(to, toks.size());
    for (std::size_t i = from; i < to; ++i) {
      if (codec_.is_stop(toks[i])) continue;  // the stop token is not part of the answer
      s += codec_.decode(i == 0 ? ch.last_prompt_token : toks[i - 1], toks[i]);
    }
    return s;
  }

  // ---- JSON helpers -----------------------------------------------------------------------------
  static std::string dump(const nlohmann::json& j) {
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);  // model bytes may not be UTF-8
  }
  void send_error(httplib::Response& res, int status, const std::string& msg) {
    if (status >= 500 && status != 503) ++server_errors_;
    res.status = status;
    const char* type = status == 401 ? "authentication_error"
                       : status == 503 ? "overloaded_error"
                       : status < 500  ? "invalid_request_error"
                                       : "server_error";
    res.set_content(dump({{"error", {{"message", client_message(msg)}, {"type", type}, {"code", status}}}}),
                    "application/json");
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

  // ---- admission ------------------------------------------------------------------------------
  static bool body_route(const httplib::Request& req) {
    return req.path == "/" || req.path == "/v1/completions" || req.path == "/v1/chat/completions";
  }
  static bool same_key(const std::string& a, const std::string& b) {  // time independent of where they differ
    unsigned char diff = a.size() == b.size() ? 0 : 1;
    for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i % (b.size() ? b.size() : 1)]);
    return diff == 0 && !b.empty();
  }

  // Runs before httplib reads a body: authentication, then what the body may be. A refused
  // body is never read, and its connection is closed after the answer.
  void admit(const httplib::Request& req) const {
    if (!opt_.api_key.empty() && req.path != "/health" &&
        !same_key(req.get_header_value("Authorization"), "Bearer " + opt_.api_key))
      throw http_error(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'");
    const std::string length = req.get_header_value("Content-Length");
    const std::string transfer = req.get_header_value("Transfer-Encoding");
    const bool has_body = !transfer.empty() || (!length.empty() && length != "0");
    if (!(req.method == "POST" && body_route(req))) {
      if (has_body) throw http_error(404, req.method + " " + loom::data::quote_input(req.path) + " takes no request body");
      return;
    }
    const std::string encoding = req.get_header_value("Content-Encoding");
    if (!encoding.empty() && encoding != "identity")
      throw http_error(415, "Content-Encoding " + loom::data::quote_input(encoding) +
                                " is not accepted: send the JSON body uncompressed");
    if (req.is_multipart_form_data()) throw http_error(415, "multipart bodies are not accepted: send a JSON body");
    if (!transfer.empty()) {
      if (transfer != "chunked" && transfer != "Chunked")
        throw http_error(501, "Transfer-Encoding " + loom::data::quote_input(transfer) + " is not supported");
      return;  // chunked: the size limit applies while reading
    }
    if (length.empty()) throw http_error(411, "the request needs a Content-Length header (or chunked transfer)");
    const bool digits = length.size() <= 19 && length.find_first_not_of("0123456789") == std::string::npos;
    if (!digits) throw bad_request("Content-Length " + loom::data::quote_input(length) + " is not a byte count");
    if (std::stoull(length) > opt_.max_body_bytes)
      throw http_error(413, "request body of " + length + " bytes exceeds the limit of " +
                                std::to_string(opt_.max_body_bytes) + " bytes (--max-body-bytes)");
  }

  std::shared_ptr<slot> take_slot() {
    if (in_flight_.fetch_add(1) >= opt_.max_in_flight) {
      --in_flight_;
      throw http_error(503, "server busy: " + std::to_string(opt_.max_in_flight) +
                                " requests in flight (--max-concurrent); retry later");
    }
    return std::make_shared<slot>(in_flight_);
  }

  // Reads the body through httplib's reader, never more than max_body_bytes.
  std::string read_body(const httplib::ContentReader& reader) const {
    std::string body;
    bool too_big = false;
    const bool ok = reader([&](const char* data, std::size_t n) {
      if (n > opt_.max_body_bytes - body.size()) return !(too_big = true);
      body.append(data, n);
      return true;
    });
    if (too_big)
      throw http_error(413, "request body exceeds the limit of " + std::to_string(opt_.max_body_bytes) +
                                " bytes (--max-body-bytes)");
    if (!ok) throw bad_request("the request body could not be read (cut short, bad chunks, or past the read deadline)");
    return body;
  }

  // One handler per protocol, wrapped: http_error -> its status, bad input (loom::error from the
  // field checks) -> 400, anything else -> 500; the server keeps serving either way.
  using body_handler = void (http_server::*)(const nlohmann::json&, httplib::Response&, std::shared_ptr<slot>);
  httplib::Server::HandlerWithContentReader guarded(body_handler h) {
    return [this, h](const httplib::Request&, httplib::Response& res, const httplib::ContentReader& reader) {
      http::connection* conn = http::server::current();
      try {
        std::shared_ptr<slot> s;
        nlohmann::json j;
        try {
          s = take_slot();
          const std::string body = read_body(reader);
          if (conn) conn->begin_work();
          j = request::parse_body(body);
        } catch (const http_error&) {
          if (conn) conn->close_after();  // the rest of the body is unread
          throw;
        }
        (this->*h)(j, res, std::move(s));
      } catch (const http_error& e) {
        send_error(res, e.status, e.what());
        if (e.status == 503) res.set_header("Retry-After", "1");
      } catch (const client_gone&) {
        res.status = 499;  // nobody reads it: the connection is closed
        if (conn) conn->close_after();
      } catch (const std::exception& e) {
        send_error(res, 500, e.what());
      }
    };
  }

  // ---- routes -----------------------------------------------------------------------------------
  void routes() {
    http_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      try {
        admit(req);
        return httplib::Server::HandlerResponse::Unhandled;
      } catch (const http_error& e) {
        send_error(res, e.status, e.what());
        if (e.status == 401) res.set_header("WWW-Authenticate", "Bearer");
        res.set_header("Connection", "close");
        if (auto* conn = http::server::current()) conn->close_after();
        return httplib::Server::HandlerResponse::Handled;
      }
    });
    http_.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("ok", "text/plain"); });
    http_.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      nlohmann::json data = nlohmann::json::array({{{"id", opt_.model_name}, {"object", "model"}, {"owned_by", "loom"}}});
      for (const auto& a : adapters_)
        data.push_back({{"id", a}, {"object", "model"}, {"owned_by", "loom"}, {"parent", opt_.model_name}});
      res.set_content(dump({{"object", "list"}, {"data", data}}), "application/json");
    });
    http_.Post("/", guarded(&http_server::chatglm));
    http_.Post("/v1/completions", guarded(&http_server::completions));
    http_.Post("/v1/chat/completions", guarded(&http_server::chat_completions));
  }

  void completions(const nlohmann::json& j, httplib::Response& res, std::shared_ptr<slot> s) {
    openai(j, res, false, std::move(s));
  }
  void chat_completions(const nlohmann::json& j, httplib::Response& res, std::shared_ptr<slot> s) {
    openai(j, res, true, std::move(s));
  }

  void chatglm(const nlohmann::json& j, httplib::Response& res, std::shared_ptr<slot>) {
    const auto deadline = clock::now() + opt_.request_timeout;
    chatglm_request in = parse_chatglm_request(j, codec_, limits());
    nlohmann::json& history = in.history;
    const std::string& prompt = in.prompt;
    gen_params& p = in.params;
    std::uint64_t id;
    auto ch = submit(std::move(p), id);
    auto [toks, why] = wait_all(*ch, id, deadline);
    const std::string response = answer_text::of(detok(*ch, toks), codec_.chat_template());
    history.push_back({prompt, response});
    ++served_;
    res.set_content(dump({{"response", response}, {"history", history}, {"status", 200}, {"time", now_string()}}),
                    "application/json");
  }

  void openai(const nlohmann::json& j, httplib::Response& res, bool chat, std::shared_ptr<slot> s) {
    const auto deadline = clock::now() + opt_.request_timeout;
    openai_request in = parse_openai_request(j, chat, codec_, limits());
    const bool stream = in.stream;
    gen_params& p = in.params;
    const std::string model = served_name(p);
    const std::int64_t created = static_cast<std::int64_t>(std::time(nullptr));
    std::uint64_t id;
    auto ch = submit(std::move(p), id);
    const std::string rid = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(id);
    auto reason = [](loom::kv::finish_reason r) { return r == loom::kv::finish_reason::stop ? "stop" : "length"; };
    if (!stream) {
      auto [toks, why] = wait_all(*ch, id, deadline);
      const std::string out = chat ? answer_text::of(detok(*ch, toks), codec_.chat_template()) : detok(*ch, toks);
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
                            {"model", model},
                            {"choices", {choice}},
                            {"usage", {{"prompt_tokens", ch->prompt_tokens}, {"completion_tokens", n},
                                       {"total_tokens", ch->prompt_tokens + n}}}}),
                      "application/json");
      return;
    }
    // Server-sent events: one chunk per produced token, then the finish chunk and [DONE]. The
    // slot stays taken until the stream ends; a client that leaves, or a stream past its
    // deadline, cancels the request.
    auto sent = std::make_shared<std::size_t>(0);
    auto pending = std::make_shared<std::string>();
    auto ended = std::make_shared<bool>(false);
    // a chat answer as the model's chat() gives it (answer_text); completions as generated
    auto answer = std::make_shared<answer_text>(chat ? codec_.chat_template() : std::nullopt);
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
                   {"model", model}, {"choices", {choice}}}) +
             "\n\n";
    };
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [=, this](std::size_t, httplib::DataSink& sink) {
          std::unique_lock g(ch->m);
          ch->cv.wait_for(g, std::chrono::milliseconds(200), [&] {
            return ch->tokens.size() > *sent || ch->finished != loom::kv::finish_reason::none;
          });
          std::vector<loom::kv::token_id> toks = ch->tokens;
          auto fin = ch->finished;
          std::string err = ch->error;
          g.unlock();
          if (fin == loom::kv::finish_reason::none && clock::now() >= deadline) {
            abort_request(id);
            fin = loom::kv::finish_reason::aborted;
            err = timed_out();
          }
          std::string out;
          const bool first = *sent == 0;
          *pending += answer->push(detok(*ch, toks, *sent, toks.size()));
          *sent = toks.size();
          if (fin != loom::kv::finish_reason::none) *pending += answer->finish();
          // Send whole UTF-8 characters only: a character split over two tokens goes out whole.
          const std::size_t cut = fin != loom::kv::finish_reason::none ? pending->size() : utf8_complete_prefix(*pending);
          if (cut > 0 || (first && !toks.empty())) {
            out += chunk(pending->substr(0, cut), nullptr, first);
            pending->erase(0, cut);
          }
          if (fin != loom::kv::finish_reason::none) {
            if (!err.empty())
              out += "data: " + dump({{"error", {{"message", client_message(err)}, {"type", "server_error"}}}}) + "\n\n";
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
          (void)s;                          // the slot is released with this callback
        });
  }

  Engine engine_;
  text_codec codec_;
  server_options opt_;
  std::vector<std::string> adapters_;  // the engine's LoRA adapters by name: adapter i + 1
  http::server http_;
  std::thread engine_thread_, http_thread_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string failure_;  // the engine's group failed: why (guarded by mu_)
  std::deque<job> queue_;
  std::vector<std::uint64_t> aborts_;
  std::atomic<bool> running_{false};
  std::atomic<std::uint64_t> next_id_{1};
  std::atomic<std::int32_t> max_batch_{0};
  std::atomic<std::int64_t> served_{0};
  std::atomic<std::int64_t> cancelled_{0};
  std::atomic<std::int64_t> tokens_{0};
  std::atomic<std::int64_t> server_errors_{0};
  std::atomic<std::int32_t> in_flight_{0};
  int port_ = -1;
};

}  // namespace loom::serve
