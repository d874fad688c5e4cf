// llama-serve over loopback (127.0.0.1, an ephemeral port), in process. Every response text
// is checked against the engine run alone on the same prompt and sampling parameters (the
// oracle: batching, streaming and HTTP must not change what a request produces). Covers the
// ChatGLM protocol, OpenAI completions and chat completions, SSE streaming, 32 concurrent
// clients, bad requests (HTTP 400, then the server keeps serving). The test stops the server.
#include <doctest/doctest.h>

#include "llama_server.hpp"
#include "serve_client.hpp"
#include "serve_model.hpp"

#include <loom/comm/mesh.hpp>
#include <loom/comm/thread_comm.hpp>

#include <nlohmann/json.hpp>

#include <regex>
#include <thread>

using namespace llama;
using namespace loom::serve;
using nlohmann::json;

namespace {

engine_config server_engine() {
  engine_config ec;
  ec.num_blocks = 160;
  ec.block_size = 16;
  ec.scheduler.max_num_batched_tokens = 256;
  ec.scheduler.max_num_seqs = 64;
  return ec;
}

// What the engine alone produces for `text` (byte codec), decoded as the server decodes.
std::string oracle(const flat_weights& w, const std::string& text, int max_new, loom::kv::sampling_params sp) {
  text_codec codec;
  llama_engine<float> eng(w, server_engine());
  loom::kv::request r;
  r.id = 7;
  r.prompt = codec.encode(text);
  r.max_new_tokens = std::min<int>(max_new, static_cast<int>(w.cfg.seq_len) - static_cast<int>(r.prompt.size()));
  r.sampling = sp;
  r.stop_tokens = {codec.eos()};
  auto out = eng.generate({r})[7];
  std::string s;
  loom::kv::token_id prev = r.prompt.back();
  for (auto t : out) {
    if (t != codec.eos()) s += codec.decode(prev, t);
    prev = t;
  }
  return s;
}

std::string json_text(const std::string& s) {  // how the server's JSON carries model bytes
  return json::parse(json(s).dump(-1, ' ', false, json::error_handler_t::replace)).get<std::string>();
}

// Concatenates the deltas of an SSE stream; checks the framing and [DONE].
std::string read_sse(const std::string& body, bool chat, std::string* finish) {
  std::string text;
  bool done = false;
  std::size_t pos = 0;
  while (pos < body.size()) {
    const auto end = body.find("\n\n", pos);
    REQUIRE(end != std::string::npos);
    const std::string ev = body.substr(pos, end - pos);
    pos = end + 2;
    REQUIRE(ev.rfind("data: ", 0) == 0);
    const std::string data = ev.substr(6);
    if (data == "[DONE]") {
      done = true;
      continue;
    }
    REQUIRE_FALSE(done);
    auto j = json::parse(data);
    CHECK(j["object"] == (chat ? "chat.completion.chunk" : "text_completion"));
    auto& c = j["choices"][0];
    if (chat) {
      if (c["delta"].contains("content")) text += c["delta"]["content"].get<std::string>();
    } else {
      text += c["text"].get<std::string>();
    }
    if (!c["finish_reason"].is_null()) *finish = c["finish_reason"].get<std::string>();
  }
  CHECK(done);
  return text;
}

}  // namespace

TEST_CASE("llama-serve: protocols, streaming, concurrency, errors") {
  const flat_weights w = flat_weights::random(serve_test::small_model(), 3);
  llama_server server(w, server_engine(), text_codec{});
  const int port = server.start("127.0.0.1", 0);
  REQUIRE(port > 0);
  auto client = [&] {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(std::chrono::seconds(60));
    return c;
  };

  SUBCASE("ChatGLM api.py protocol") {
    auto c = client();
    json req = {{"prompt", "hi"}, {"history", json::array({json::array({"q0", "a0"})})}, {"max_length", 120},
                {"top_p", 0.8}, {"temperature", 0.7}};
    auto res = c.Post("/", req.dump(), "application/json");
    REQUIRE(res);
    REQUIRE(res->status == 200);
    auto j = json::parse(res->body);
    loom::kv::sampling_params sp;
    sp.temperature = 0.7f, sp.top_p = 0.8f;
    const std::string text = "[Round 1]\n\n问：q0\n\n答：a0\n\n[Round 2]\n\n问：hi\n\n答：";
    const int prompt_len = static_cast<int>(text_codec{}.encode(text).size());
    CHECK(j["response"] == json_text(oracle(w, text, 120 - prompt_len, sp)));
    CHECK(j["status"] == 200);
    CHECK(j["history"].size() == 2);
    CHECK(j["history"][1][0] == "hi");
    CHECK(j["history"][1][1] == j["response"]);
    CHECK(std::regex_match(j["time"].get<std::string>(), std::regex(R"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")));
  }

  SUBCASE("OpenAI completions and chat completions, whole and streamed") {
    auto c = client();
    loom::kv::sampling_params sp;
    sp.temperature = 0.f;
    for (bool chat : {false, true}) {
      CAPTURE(chat);
      json req = {{"model", "loom-llama"}, {"max_tokens", 20}, {"temperature", 0}};
      std::string text;
      if (chat) {
        req["messages"] = {{{"role", "system"}, {"content", "be brief"}}, {{"role", "user"}, {"content", "hello"}}};
        text = "system: be brief\nuser: hello\nassistant: ";
      } else {
        req["prompt"] = "Once upon";
        text = "Once upon";
      }
      const std::string want = json_text(oracle(w, text, 20, sp));
      const char* path = chat ? "/v1/chat/completions" : "/v1/completions";
      auto res = c.Post(path, req.dump(), "application/json");
      REQUIRE(res);
      REQUIRE(res->status == 200);
      auto j = json::parse(res->body);
      CHECK(j["object"] == (chat ? "chat.completion" : "text_completion"));
      const auto& choice = j["choices"][0];
      CHECK((chat ? choice["message"]["content"] : choice["text"]) == want);
      CHECK(j["usage"]["completion_tokens"].get<int>() <= 20);
      CHECK(j["usage"]["prompt_tokens"].get<int>() == static_cast<int>(text_codec{}.encode(text).size()));
      req["stream"] = true;
      auto sres = c.Post(path, req.dump(), "application/json");
      REQUIRE(sres);
      REQUIRE(sres->status == 200);
      CHECK(sres->get_header_value("Content-Type").find("text/event-stream") == 0);
      std::string finish;
      // Deltas are split per token; the concatenation is the same text (JSON-escaped per delta).
      const std::string streamed = read_sse(sres->body, chat, &finish);
      CHECK(json_text(streamed) == want);
      CHECK(finish == choice["finish_reason"].get<std::string>());
    }
  }

  SUBCASE("32 concurrent clients share the continuous batch") {
    constexpr int n = 32;
    std::vector<std::string> got(n), want(n);
    std::vector<int> status(n, 0);
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i) {
      threads.emplace_back([&, i] {
        auto c = client();
        json req = {{"prompt", "request " + std::to_string(i) + std::string(static_cast<std::size_t>(i), '!')},
                    {"max_tokens", 8 + i}, {"temperature", 0.9}, {"top_k", 20}, {"seed", 100 + i}};
        if (i % 4 == 0) req["stream"] = true;
        auto res = c.Post("/v1/completions", req.dump(), "application/json");
        if (!res) {
          status[static_cast<std::size_t>(i)] = -static_cast<int>(res.error());
          return;
        }
        status[static_cast<std::size_t>(i)] = res->status;
        if (res->status != 200) return;
        if (i % 4 == 0) {
          std::string finish;
          got[static_cast<std::size_t>(i)] = json_text(read_sse(res->body, false, &finish));
        } else {
          got[static_cast<std::size_t>(i)] = json::parse(res->body)["choices"][0]["text"].get<std::string>();
        }
      });
    }
    for (int i = 0; i < n; ++i) {
      loom::kv::sampling_params sp;
      sp.temperature = 0.9f, sp.top_k = 20, sp.seed = static_cast<std::uint64_t>(100 + i);
      want[static_cast<std::size_t>(i)] =
          json_text(oracle(w, "request " + std::to_string(i) + std::string(static_cast<std::size_t>(i), '!'), 8 + i, sp));
    }
    for (auto& t : threads) t.join();
    for (int i = 0; i < n; ++i) {
      CAPTURE(i);
      CHECK(status[static_cast<std::size_t>(i)] == 200);
      CHECK(got[static_cast<std::size_t>(i)] == want[static_cast<std::size_t>(i)]);
    }
    CHECK(server.max_batch() > 1);
  }

  SUBCASE("bad requests get HTTP 400 with a message, and the server keeps serving") {
    auto c = client();
    struct bad {
      const char* path;
      std::string body;
    };
    const std::string too_long(400, 'x');  // 401 tokens > seq_len 192
    for (const bad& b : {bad{"/", "{\"prompt\": "}, bad{"/", "{\"history\": []}"}, bad{"/", "[1, 2]"},
                         bad{"/", json({{"prompt", too_long}}).dump()},
                         bad{"/", json({{"prompt", "a"}, {"max_length", "long"}}).dump()},
                         bad{"/", json({{"prompt", "a"}, {"history", "nope"}}).dump()},
                         bad{"/v1/completions", "not json"}, bad{"/v1/completions", json({{"max_tokens", 3}}).dump()},
                         bad{"/v1/completions", json({{"prompt", too_long}}).dump()},
                         bad{"/v1/completions", json({{"prompt", "a"}, {"max_tokens", -1}}).dump()},
                         bad{"/v1/completions", json({{"prompt", "a"}, {"top_p", 3.0}}).dump()},
                         bad{"/v1/chat/completions", json({{"model", "m"}}).dump()},
                         bad{"/v1/chat/completions", json({{"messages", {{{"role", "user"}}}}}).dump()}}) {
      CAPTURE(b.path);
      CAPTURE(b.body);
      auto res = c.Post(b.path, b.body, "application/json");
      REQUIRE(res);
      CHECK(res->status == 400);
      auto j = json::parse(res->body);
      CHECK_FALSE(j["error"]["message"].get<std::string>().empty());
    }
    auto ok = c.Post("/v1/completions", json({{"prompt", "still here"}, {"max_tokens", 4}}).dump(), "application/json");
    REQUIRE(ok);
    CHECK(ok->status == 200);
    auto health = c.Get("/health");
    REQUIRE(health);
    CHECK(health->status == 200);
  }

  server.stop();
  // After stop, nothing listens any more.
  httplib::Client late("127.0.0.1", port);
  late.set_connection_timeout(std::chrono::seconds(1));
  CHECK_FALSE(late.Get("/health"));
}

// The server over a tensor-parallel engine (llama-serve --tp): rank 0's server leads, rank 1
// follows. The oracle is the one-rank engine alone (greedy: the tp ranks' logits differ from
// one rank's only within rounding). The communicator's timeout is cut to 400 ms and the server
// left idle for longer: the follower, waiting for a plan, must be kept alive (keep_alive()).
TEST_CASE("llama-serve over tp 2 thread ranks: the engine alone's text, whole and streamed; a stream whose client leaves is cancelled; idle past the timeout; stop releases the follower") {
  llama::config c = serve_test::small_model(1024);  // a long context: the stream below is still running when its client leaves
  c.vocab = 260;                                     // tp 2 divides it (the byte codec's ids are 3..258)
  const flat_weights w = flat_weights::random(c, 3);
  using tp_engine = llama_engine<float, loom::comm::thread_comm>;
  loom::kv::sampling_params greedy;
  greedy.temperature = 0.f;
  const std::string want = json_text(oracle(w, "Once upon", 24, greedy));
  loom::comm::checked_scope short_timeout(loom::comm::checked(), std::chrono::milliseconds(400));
  std::string whole, streamed, finish;
  int status_whole = 0, status_stream = 0;
  std::int64_t leader_steps = -1, follower_steps = -2, cancelled = 0, tokens_after_cancel = 0;
  bool idle_after_cancel = false;
  using namespace std::chrono_literals;
  loom::comm::run_ranks(2, [&](loom::comm::thread_comm& comm) {
    if (comm.rank() == 1) {
      tp_engine eng(w, comm, server_engine());
      eng.follow();
      follower_steps = eng.steps();
      return;
    }
    http_server<tp_engine> server(text_codec{}, server_options{}, w, comm, server_engine());
    const int port = server.start("127.0.0.1", 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // idle: three timeouts
    httplib::Client cl("127.0.0.1", port);
    cl.set_read_timeout(std::chrono::seconds(60));
    json req = {{"prompt", "Once upon"}, {"max_tokens", 24}, {"temperature", 0}};
    if (auto res = cl.Post("/v1/completions", req.dump(), "application/json")) {
      status_whole = res->status;
      if (res->status == 200) whole = json::parse(res->body)["choices"][0]["text"].get<std::string>();
    }
    req["stream"] = true;
    if (auto res = cl.Post("/v1/completions", req.dump(), "application/json")) {
      status_stream = res->status;
      if (res->status == 200) streamed = json_text(read_sse(res->body, false, &finish));
    }
    {  // a stream whose client leaves after its first event is cancelled, as on one rank
      serve_test::raw_client rc(port);
      const json long_job = {{"prompt", "Once upon"}, {"max_tokens", 1000}, {"temperature", 0}, {"ignore_eos", true}, {"stream", true}};
      std::string got;
      if (rc.send(serve_test::post("/v1/completions", long_job.dump())))
        while (got.find("data: ") == std::string::npos && rc.read_some(got, std::chrono::steady_clock::now() + 10s)) {
        }
    }
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (server.requests_cancelled() == 0 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(10ms);
    cancelled = server.requests_cancelled();
    tokens_after_cancel = server.tokens_generated();
    std::this_thread::sleep_for(200ms);
    idle_after_cancel = server.tokens_generated() == tokens_after_cancel && server.in_flight() == 0;
    server.stop();
    leader_steps = server.engine().steps();
    server.engine().stop_followers();
  });
  CHECK(status_whole == 200);
  CHECK(status_stream == 200);
  CHECK(whole == want);
  CHECK(streamed == want);
  CHECK(cancelled == 1);
  CHECK(idle_after_cancel);               // nothing generates for the client that left
  CHECK(follower_steps == leader_steps);  // the follower ran every plan, and returned at stop
}

// The server over a pipeline (llama-serve --pp 2 --tp 2): the same text as the engine alone,
// whole and streamed, with two requests in one batch (two micro-batches per step); every
// rank of the mesh ran every plan and returned at stop.
TEST_CASE("llama-serve over a tp 2 x pp 2 mesh of thread ranks: the engine alone's text, whole and streamed") {
  llama::config c = serve_test::small_model();
  c.vocab = 260;  // tp 2 divides it
  const flat_weights w = flat_weights::random(c, 3);
  using mesh_engine = llama_engine<float, loom::comm::thread_comm>;
  loom::kv::sampling_params greedy;
  greedy.temperature = 0.f;
  const std::string want = json_text(oracle(w, "Once upon", 16, greedy));
  std::string whole, stream_body, finish;
  std::vector<std::int64_t> steps(4, -1);
  loom::comm::run_ranks(4, [&](loom::comm::thread_comm& comm) {
    loom::comm::mesh<loom::comm::thread_comm> mesh(comm, {1, 2, 2});
    if (comm.rank() != 0) {
      mesh_engine eng(w, mesh, server_engine());
      eng.follow();
      steps[static_cast<std::size_t>(comm.rank())] = eng.steps();
      return;
    }
    http_server<mesh_engine> server(text_codec{}, server_options{}, w, mesh, server_engine());
    const int port = server.start("127.0.0.1", 0);
    json req = {{"prompt", "Once upon"}, {"max_tokens", 16}, {"temperature", 0}};
    std::thread other([&] {  // a second request beside it: a step of two sequences
      httplib::Client cl("127.0.0.1", port);
      cl.set_read_timeout(std::chrono::seconds(60));
      json r2 = req;
      r2["stream"] = true;
      if (auto res = cl.Post("/v1/completions", r2.dump(), "application/json"); res && res->status == 200) stream_body = res->body;
    });
    httplib::Client cl("127.0.0.1", port);
    cl.set_read_timeout(std::chrono::seconds(60));
    if (auto res = cl.Post("/v1/completions", req.dump(), "application/json"); res && res->status == 200)
      whole = json::parse(res->body)["choices"][0]["text"].get<std::string>();
    other.join();
    server.stop();
    steps[0] = server.engine().steps();
    server.engine().stop_followers();
  });
  CHECK(whole == want);
  REQUIRE_FALSE(stream_body.empty());
  CHECK(json_text(read_sse(stream_body, false, &finish)) == want);
  for (std::size_t r = 1; r < steps.size(); ++r) CHECK(steps[r] == steps[0]);
}

TEST_CASE("llama-serve over tp 2: a failed rank fails the request and reports the failure, no hang") {
  llama::config c = serve_test::small_model();
  c.vocab = 260;
  const flat_weights w = flat_weights::random(c, 3);
  using tp_engine = llama_engine<float, loom::comm::thread_comm>;
  std::string failure, thrown;
  int status = 0;
  try {
    loom::comm::run_ranks(2, [&](loom::comm::thread_comm& comm) {
      if (comm.rank() == 1) {
        tp_engine eng(w, comm, server_engine());
        throw loom::error("rank 1 gives up");
      }
      http_server<tp_engine> server(text_codec{}, server_options{}, w, comm, server_engine());
      const int port = server.start("127.0.0.1", 0);
      httplib::Client cl("127.0.0.1", port);
      cl.set_read_timeout(std::chrono::seconds(60));
      if (auto res = cl.Post("/v1/completions", json({{"prompt", "hi"}, {"max_tokens", 4}}).dump(), "application/json"))
        status = res->status;
      failure = server.failure();
      server.stop();
      server.engine().stop_followers();  // nothing to send on a broken group
    });
  } catch (const loom::error& e) {
    thrown = e.what();
  }
  CHECK(status >= 500);
  CHECK(failure.find("rank 1 gives up") != std::string::npos);
  CHECK(thrown.find("rank 1 gives up") != std::string::npos);
}
