// LoRA adapters served over one base (examples/llama/generate/llama_lora.hpp, the server's
// field "model"). Oracles: the adapter MERGED into the base's weights (W + scaling B A, summed
// here in double from the PEFT folder's tensors, with HF's q/k row order undone by its formula)
// and served alone as a plain model; and the adapter served alone through the unmerged path.
// A continuous batch mixing the base and two adapters (different targets, r, rsLoRA, GQA
// shapes) must give every request the tokens of those runs, including after the base has left
// its prompt blocks in the prefix cache; over HTTP, "model" picks the run. Bad adapters are
// refused when loaded, naming the parameter and value.
#include <doctest/doctest.h>

#include "llama_server.hpp"
#include "serve_model.hpp"

#include <loom/core/random.hpp>
#include <support/error_of.hpp>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <thread>
#include <unistd.h>

using namespace llama;
using loom::test::error_of;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Each adapter of the test: its PEFT config and its factors by PEFT's names, random with B
// nonzero (B = 0 would make any adapter path look right).
struct lora_spec {
  loom::lora::config cfg;
  loom::io::tensor_map peft;
};

// The decoder tensor each HF module name is (LLaMA's seven, ChatGLM's four fused ones).
const std::map<std::string, std::string> lora_tensor_of = {
    {"q_proj", "attention.wq"},          {"k_proj", "attention.wk"},         {"v_proj", "attention.wv"},
    {"o_proj", "attention.wo"},          {"gate_proj", "feed_forward.w1"},   {"up_proj", "feed_forward.w3"},
    {"down_proj", "feed_forward.w2"},    {"query_key_value", "attention.wqkv"}, {"dense", "attention.wo"},
    {"dense_h_to_4h", "feed_forward.w13"}, {"dense_4h_to_h", "feed_forward.w2"}};

lora_spec make_lora(const llama::config& c, const loom::lora::config& lc, std::uint64_t seed, float b_scale) {
  const loom::counter_rng rng(seed);
  lora_spec s{lc, {}};
  std::uint64_t at = 0;
  const loom::nn::param_layout layout = llama3d::full_layout(c);
  for (index_t l = 0; l < c.n_layers; ++l)
    for (const auto& m : lc.target_modules) {
      const auto& e = layout.find("layers.0." + lora_tensor_of.at(m) + ".weight");
      const index_t out = e.shape[0], in = e.shape[1];
      loom::io::named_tensor A{{lc.r, in}, loom::buffer<float>(static_cast<std::size_t>(lc.r * in))};
      loom::io::named_tensor B{{out, lc.r}, loom::buffer<float>(static_cast<std::size_t>(out * lc.r))};
      rng.fill_uniform(A.data.span(), at, -1.f / std::sqrt(float(in)), 1.f / std::sqrt(float(in)));
      at += A.data.size();
      rng.fill_uniform(B.data.span(), at, -b_scale, b_scale);
      at += B.data.size();
      s.peft[loom::lora::peft_tensor_name(c.model_type, l, m, 'A')] = std::move(A);
      s.peft[loom::lora::peft_tensor_name(c.model_type, l, m, 'B')] = std::move(B);
    }
  return s;
}

// The base with the adapter merged: W += scaling B A in double. PEFT stores B of a LLaMA's q/k
// in HF's half-split row order; loom's row h*hd + 2i + p (interleaved pairs) is HF's
// h*hd + p*hd/2 + i. ChatGLM's fused tensors are merged whole ([Q | K | V], [gate | up]).
flat_weights merged(const flat_weights& w, const lora_spec& s) {
  const llama::config& c = w.cfg;
  flat_weights out{c, w.layout, loom::buffer<float>(w.params.size())};
  std::copy_n(w.params.data(), w.params.size(), out.params.data());
  const double scaling = s.cfg.use_rslora ? s.cfg.lora_alpha / std::sqrt(double(s.cfg.r)) : s.cfg.lora_alpha / s.cfg.r;
  const index_t hd = c.head_dim(), r = s.cfg.r;
  for (index_t l = 0; l < c.n_layers; ++l)
    for (const auto& m : s.cfg.target_modules) {
      const auto& e = w.layout.find("layers." + std::to_string(l) + "." + lora_tensor_of.at(m) + ".weight");
      const index_t rows = e.shape[0], cols = e.shape[1];
      const auto& A = s.peft.at(loom::lora::peft_tensor_name(c.model_type, l, m, 'A')).data;
      const auto& B = s.peft.at(loom::lora::peft_tensor_name(c.model_type, l, m, 'B')).data;
      const bool permuted = (m == "q_proj" || m == "k_proj") && c.rope == loom::ops::rope_style::interleaved;
      for (index_t i = 0; i < rows; ++i) {
        const index_t h = i / hd, k = i % hd, hf = permuted ? h * hd + (k % 2) * (hd / 2) + k / 2 : i;
        for (index_t j = 0; j < cols; ++j) {
          double d = 0;
          for (index_t q = 0; q < r; ++q) d += double(B[hf * r + q]) * double(A[q * cols + j]);
          float& x = out.params.data()[e.offset + i * cols + j];
          x = static_cast<float>(double(x) + scaling * d);
        }
      }
    }
  return out;
}

struct lora_fixture {
  fs::path dir = fs::temp_directory_path() / ("loom_serve_lora_" + std::to_string(::getpid()));
  llama::config cfg = serve_test::small_model();
  flat_weights w = flat_weights::random(cfg, 3);
  lora_spec a, b;
  lora_fixture() {
    loom::lora::config ca;  // the attention's four projections (GQA: k, v narrower than q)
    ca.r = 4, ca.lora_alpha = 8, ca.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
    loom::lora::config cb;  // the MLP and k, rank-stabilised
    cb.r = 2, cb.lora_alpha = 3, cb.use_rslora = true, cb.target_modules = {"gate_proj", "up_proj", "down_proj", "k_proj"};
    a = make_lora(cfg, ca, 11, 0.6f);
    b = make_lora(cfg, cb, 12, 0.6f);
    loom::lora::save_peft((dir / "alpha").string(), a.cfg, a.peft);
    loom::lora::save_peft((dir / "beta").string(), b.cfg, b.peft);
  }
  ~lora_fixture() { fs::remove_all(dir); }
  std::vector<served_adapter> adapters() const {
    std::vector<served_adapter> v;
    v.push_back(served_adapter::from_peft("alpha", (dir / "alpha").string(), cfg));
    v.push_back(served_adapter::from_peft("beta", (dir / "beta").string(), cfg));
    return v;
  }
};

engine_config lora_engine_config() {
  engine_config ec;
  ec.num_blocks = 96;
  ec.block_size = 8;
  ec.scheduler.max_num_batched_tokens = 48;  // prompts are prefilled in chunks beside decodes
  ec.scheduler.max_num_seqs = 16;
  return ec;
}

loom::kv::request lora_request(std::uint64_t id, std::vector<loom::kv::token_id> prompt, std::int32_t adapter, int max_new = 14) {
  loom::kv::request r;
  r.id = id, r.prompt = std::move(prompt), r.max_new_tokens = max_new, r.adapter = adapter;
  r.sampling.temperature = 0.f;
  return r;
}

std::vector<std::vector<loom::kv::token_id>> lora_prompts() {
  // the first two share a prefix of three blocks, so the prefix cache has something to offer
  std::vector<loom::kv::token_id> shared;
  for (int i = 0; i < 26; ++i) shared.push_back(3 + (i * 37) % 200);
  auto p2 = shared;
  p2.resize(24);
  p2.push_back(77), p2.push_back(78);
  return {shared, p2, {5, 9, 200, 31, 64}};
}

loom::io::tensor_map copy_of(const loom::io::tensor_map& m) {
  loom::io::tensor_map out;
  for (const auto& [name, t] : m) {
    loom::io::named_tensor c{t.shape, loom::buffer<float>(t.data.size())};
    std::copy_n(t.data.data(), t.data.size(), c.data.data());
    out[name] = std::move(c);
  }
  return out;
}


}  // namespace

TEST_CASE("serving LoRA: two adapters and the base in one batch give each request its adapter's tokens alone") {
  lora_fixture fx;
  const auto prompts = lora_prompts();
  const flat_weights wa = merged(fx.w, fx.a), wb = merged(fx.w, fx.b);
  // Oracle: each prompt alone on the merged model (adapter 0 of a plain engine).
  std::map<std::pair<int, std::size_t>, std::vector<loom::kv::token_id>> want;  // (adapter, prompt)
  for (int ad = 0; ad < 3; ++ad)
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      llama_engine<float> eng(ad == 0 ? fx.w : ad == 1 ? wa : wb, lora_engine_config());
      want[{ad, i}] = eng.generate({lora_request(1, prompts[i], 0)})[1];
    }
  // The adapters change the model: otherwise nothing below would tell the paths apart.
  int differ = 0;
  for (std::size_t i = 0; i < prompts.size(); ++i) differ += (want[{1, i}] != want[{0, i}]) + (want[{2, i}] != want[{0, i}]);
  CHECK(differ >= 4);

  SUBCASE("each adapter alone, unmerged") {
    for (int ad = 1; ad < 3; ++ad)
      for (std::size_t i = 0; i < prompts.size(); ++i) {
        CAPTURE(ad);
        CAPTURE(i);
        llama_engine<float> eng(fx.w, lora_engine_config(), fx.adapters());
        CHECK(eng.generate({lora_request(1, prompts[i], ad)})[1] == want[{ad, i}]);
      }
  }
  SUBCASE("mixed in one continuous batch, after the base filled the prefix cache") {
    llama_engine<float> eng(fx.w, lora_engine_config(), fx.adapters());
    // the base first, alone: its prompts' full blocks stay in the prefix cache
    for (std::size_t i = 0; i < prompts.size(); ++i)
      CHECK(eng.generate({lora_request(100 + i, prompts[i], 0)})[100 + i] == want[{0, i}]);
    const auto hits_before = eng.allocator().num_hits();
    std::vector<loom::kv::request> reqs;
    for (std::size_t i = 0; i < prompts.size(); ++i)  // interleaved: base, alpha, beta, base, ...
      for (int ad = 0; ad < 3; ++ad) reqs.push_back(lora_request(10 * i + ad, prompts[i], ad));
    std::int32_t most = 0;
    for (auto& r : reqs) eng.add(std::move(r));
    std::map<std::uint64_t, std::vector<loom::kv::token_id>> got;
    while (eng.has_work()) {
      for (const auto& e : eng.step()) got[e.id].push_back(e.token);
      most = std::max(most, static_cast<std::int32_t>(eng.scheduler().num_running()));
    }
    for (std::size_t i = 0; i < prompts.size(); ++i)
      for (int ad = 0; ad < 3; ++ad) {
        CAPTURE(i);
        CAPTURE(ad);
        CHECK(got[10 * i + ad] == want[{ad, i}]);
      }
    CHECK(most >= 6);                                   // the adapters really shared steps
    // the base's cached blocks were taken (by the base: the adapters' tokens above are right)
    CHECK(eng.allocator().num_hits() > hits_before);
  }
}

TEST_CASE("serving LoRA on ChatGLM's fused query_key_value and dense_h_to_4h: the merged model's tokens in a mixed batch") {
  llama::config c = llama::config::chatglm();  // fused q/k/v with bias, packed gate/up, partial rotary, GQA
  c.dim = 48, c.hidden_dim = 96, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.vocab = 259, c.seq_len = 192;
  const flat_weights w = flat_weights::random(c, 5);
  loom::lora::config lc;
  lc.r = 3, lc.lora_alpha = 6, lc.target_modules = {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"};
  const lora_spec spec = make_lora(c, lc, 21, 0.6f);
  const fs::path dir = fs::temp_directory_path() / ("loom_serve_lora_glm_" + std::to_string(::getpid()));
  loom::lora::save_peft(dir.string(), lc, spec.peft);
  std::vector<served_adapter> ads;
  ads.push_back(served_adapter::from_peft("glm", dir.string(), c));
  fs::remove_all(dir);
  const flat_weights wm = merged(w, spec);
  const auto prompts = lora_prompts();
  llama_engine<float> eng(w, lora_engine_config(), std::move(ads));
  std::vector<loom::kv::request> reqs;
  for (std::size_t i = 0; i < prompts.size(); ++i)
    for (int ad = 0; ad < 2; ++ad) reqs.push_back(lora_request(10 * i + ad, prompts[i], ad));
  auto got = eng.generate(std::move(reqs));
  int differ = 0;
  for (std::size_t i = 0; i < prompts.size(); ++i)
    for (int ad = 0; ad < 2; ++ad) {
      CAPTURE(i);
      CAPTURE(ad);
      llama_engine<float> alone(ad == 0 ? w : wm, lora_engine_config());
      const auto want = alone.generate({lora_request(1, prompts[i], 0)})[1];
      CHECK(got[10 * i + ad] == want);
      if (ad == 1) differ += got[10 * i + 1] != got[10 * i];
    }
  CHECK(differ >= 2);
}

TEST_CASE("serving LoRA over HTTP: the field 'model' picks the base or an adapter") {
  lora_fixture fx;
  const loom::serve::text_codec codec;
  const std::vector<std::string> texts = {"Once upon a time", "The base and the adapters", "xyz"};
  // Oracle: the adapter merged into the base, the prompt alone, decoded as the server decodes.
  const flat_weights wa = merged(fx.w, fx.a), wb = merged(fx.w, fx.b);
  auto alone = [&](const flat_weights& w, const std::string& text) {
    llama_engine<float> eng(w, lora_engine_config());
    auto r = lora_request(1, codec.encode(text), 0, 12);
    r.stop_tokens = codec.stop_tokens();
    const auto toks = eng.generate({r})[1];
    std::string s;
    loom::kv::token_id prev = r.prompt.back();
    for (auto t : toks) {
      if (t != codec.eos()) s += codec.decode(prev, t);
      prev = t;
    }
    return json::parse(json(s).dump(-1, ' ', false, json::error_handler_t::replace)).get<std::string>();
  };
  loom::serve::server_options opt;
  opt.model_name = "base-model";
  llama_server server(fx.w, lora_engine_config(), codec, opt, fx.adapters());
  const int port = server.start("127.0.0.1", 0);
  REQUIRE(port > 0);
  auto post = [&](const json& body, const char* path = "/v1/completions") {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(std::chrono::seconds(60));
    auto res = c.Post(path, body.dump(), "application/json");
    REQUIRE(res);
    return std::pair{res->status, res->body};
  };

  SUBCASE("completions for base, alpha and beta, concurrently") {
    const std::vector<std::pair<std::string, const flat_weights*>> models = {
        {"", &fx.w}, {"base-model", &fx.w}, {"alpha", &wa}, {"beta", &wb}};
    std::vector<std::thread> clients;
    std::vector<std::pair<int, std::string>> results(models.size() * texts.size());
    for (std::size_t m = 0; m < models.size(); ++m)
      for (std::size_t t = 0; t < texts.size(); ++t)
        clients.emplace_back([&, m, t] {
          json req = {{"prompt", texts[t]}, {"max_tokens", 12}, {"temperature", 0}};
          if (!models[m].first.empty()) req["model"] = models[m].first;
          results[m * texts.size() + t] = post(req);
        });
    for (auto& c : clients) c.join();
    for (std::size_t m = 0; m < models.size(); ++m)
      for (std::size_t t = 0; t < texts.size(); ++t) {
        CAPTURE(models[m].first);
        CAPTURE(texts[t]);
        const auto& [status, body] = results[m * texts.size() + t];
        REQUIRE(status == 200);
        const auto j = json::parse(body);
        CHECK(j["choices"][0]["text"] == alone(*models[m].second, texts[t]));
        CHECK(j["model"] == (models[m].first.empty() ? "base-model" : models[m].first));
      }
    CHECK(alone(wa, texts[0]) != alone(fx.w, texts[0]));  // the adapter answers differently
  }
  SUBCASE("chat completions name the adapter too") {
    const auto [status, body] = post({{"model", "beta"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                      {"max_tokens", 12}, {"temperature", 0}},
                                     "/v1/chat/completions");
    REQUIRE(status == 200);
    CHECK(json::parse(body)["choices"][0]["message"]["content"] == alone(wb, "user: hi\nassistant: "));
  }
  SUBCASE("an unknown model is a 404 naming it; a model that is not a string a 400") {
    const auto [status, body] = post({{"model", "gamma"}, {"prompt", "x"}});
    CHECK(status == 404);
    const std::string msg = json::parse(body)["error"]["message"];
    CHECK(msg.find("model \"gamma\" does not exist; this server serves \"base-model\", \"alpha\", \"beta\"") !=
          std::string::npos);
    const auto [s2, b2] = post({{"model", 7}, {"prompt", "x"}});
    CHECK(s2 == 400);
    CHECK(json::parse(b2)["error"]["message"].get<std::string>().find("field 'model' must be a string") != std::string::npos);
    CHECK(post({{"model", "alpha"}, {"prompt", "x"}, {"max_tokens", 2}}).first == 200);  // still serving
  }
  SUBCASE("/v1/models lists the base and its adapters") {
    httplib::Client c("127.0.0.1", port);
    auto res = c.Get("/v1/models");
    REQUIRE(res);
    const auto j = json::parse(res->body);
    REQUIRE(j["data"].size() == 3);
    CHECK(j["data"][0]["id"] == "base-model");
    CHECK(j["data"][1]["id"] == "alpha");
    CHECK(j["data"][2]["id"] == "beta");
    CHECK(j["data"][2]["parent"] == "base-model");
  }
  server.stop();
  CHECK(server.server_errors() == 0);
}

TEST_CASE("serving LoRA: adapters that do not fit the base are refused when loaded, naming what") {
  lora_fixture fx;
  auto write_config = [&](const std::string& name, const json& cfg, const loom::io::tensor_map& t) {
    const fs::path d = fx.dir / name;
    fs::create_directories(d);
    std::ofstream(d / "adapter_config.json") << cfg.dump();
    loom::io::write_safetensors((d / "adapter_model.safetensors").string(), t);
    return d.string();
  };
  json cfg = loom::lora::adapter_config_json(fx.a.cfg);
  auto load = [&](const std::string& dir) { return error_of([&] { served_adapter::from_peft("x", dir, fx.cfg); }); };

  cfg["r"] = 0;
  CHECK(load(write_config("r0", cfg, fx.a.peft)).find("r must be >= 1, got 0") != std::string::npos);
  cfg["r"] = -2;
  CHECK(load(write_config("rneg", cfg, fx.a.peft)).find("r must be >= 1, got -2") != std::string::npos);
  cfg = loom::lora::adapter_config_json(fx.a.cfg);
  cfg["target_modules"] = {"q_proj", "qkv"};
  CHECK(load(write_config("unknown", cfg, fx.a.peft)).find("unknown target module 'qkv'") != std::string::npos);
  cfg["target_modules"] = {"query_key_value"};  // ChatGLM's, not a layer of this LLaMA
  CHECK(load(write_config("glm", cfg, fx.a.peft)).find("target module 'query_key_value' is not a layer") != std::string::npos);
  // an adapter made for another base: lora_B of k_proj with q_proj's rows (no GQA), lora_A of another width
  auto t = copy_of(fx.a.peft);
  const std::string kb = loom::lora::peft_tensor_name("llama", 1, "k_proj", 'B');
  t[kb] = loom::io::named_tensor{{48, 4}, loom::buffer<float>(48 * 4)};
  std::string e = load(write_config("gqa", loom::lora::adapter_config_json(fx.a.cfg), t));
  CHECK(e.find("tensor '" + kb + "' has shape [48,4], the base model with r=4 needs [24,4]") != std::string::npos);
  t = copy_of(fx.a.peft);
  const std::string qa = loom::lora::peft_tensor_name("llama", 0, "q_proj", 'A');
  t[qa] = loom::io::named_tensor{{4, 64}, loom::buffer<float>(4 * 64)};
  e = load(write_config("dim", loom::lora::adapter_config_json(fx.a.cfg), t));
  CHECK(e.find("tensor '" + qa + "' has shape [4,64], the base model with r=4 needs [4,48]") != std::string::npos);
  // A served_adapter read for another base, given to this one's engine.
  llama::config wide = fx.cfg;
  wide.dim = 64, wide.hidden_dim = 128;
  const lora_spec ws = make_lora(wide, fx.a.cfg, 3, 0.1f);
  loom::lora::save_peft((fx.dir / "wide").string(), ws.cfg, ws.peft);
  std::vector<served_adapter> other;
  other.push_back(served_adapter::from_peft("wide", (fx.dir / "wide").string(), wide));
  e = error_of([&] { llama_engine<float> eng(fx.w, lora_engine_config(), std::move(other)); });
  CHECK(e.find("adapter 'wide' has q_proj of layer 0 as A [4, 64], B [64, 4] with r=4; the base's weight is [48, 48]") !=
        std::string::npos);
  // Two adapters of one name; a request for an adapter the engine does not serve.
  auto two = fx.adapters();
  two.push_back(served_adapter::from_peft("alpha", (fx.dir / "beta").string(), fx.cfg));
  CHECK(error_of([&] { llama_engine<float> eng(fx.w, lora_engine_config(), std::move(two)); })
            .find("two adapters are called 'alpha'") != std::string::npos);
  llama_engine<float> eng(fx.w, lora_engine_config(), fx.adapters());
  CHECK(error_of([&] { eng.add(lora_request(1, {5, 6}, 3)); }).find("request 1 has adapter=3, the model serves adapters 1..2") !=
        std::string::npos);
  // The server refuses an adapter named as the base.
  loom::serve::server_options opt;
  opt.model_name = "alpha";
  CHECK(error_of([&] { llama_server s(fx.w, lora_engine_config(), loom::serve::text_codec{}, opt, fx.adapters()); })
            .find("adapter 1 is called 'alpha', which is empty or the base model's name") != std::string::npos);
}
