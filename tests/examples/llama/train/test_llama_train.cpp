// llama-train's trainer: resume = straight run bit for bit, bfloat16 training reduces the loss,
// loss scaling inside the loop follows the scaler's rules, gradient accumulation equals a
// bigger micro-batch, bad configs and data fail with a message naming the value.
#include "synthetic_corpus.hpp"
#include "train.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

namespace fs = std::filesystem;

namespace {

struct fixture {
  fs::path dir = fs::temp_directory_path() / ("loom_train_" + std::to_string(::getpid()));
  std::string corpus = (dir / "corpus.bin").string();
  fixture() {
    fs::create_directories(dir);
    examples::write_corpus_shard(corpus, examples::synthetic_corpus(200000, 7));
  }
  ~fixture() { fs::remove_all(dir); }
  std::string path(const char* f) const { return (dir / f).string(); }
  std::string write(const char* f, const std::string& text) const {
    std::ofstream(dir / f) << text;
    return path(f);
  }
  llama_train::options opts(std::int64_t steps) const {
    llama_train::options o;
    o.model = {.dim = 32, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .hidden_dim = 96, .vocab = 256, .seq_len = 32};
    o.steps = steps;
    o.data = {corpus};
    o.batch = 4;
    o.lr = 3e-3f;
    return o;
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("resume: 10 steps + checkpoint + 10 resumed steps = 20 straight steps, bit for bit") {
  fixture f;
  for (auto prec : {loom::dtype::f32, loom::dtype::bf16, loom::dtype::f16}) {
    CAPTURE(loom::dtype_name(prec));
    // a schedule and clipping that depend on the restored iteration and state
    auto cfg = f.write("sched.json", R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5, "fp16": {"enabled": "auto", "initial_scale_power": 8, "loss_scale_window": 3},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 4}}})");
    auto o = f.opts(20);
    o.config_path = cfg;
    o.precision = prec;
    auto straight = llama_train::run(o, nullptr);
    auto first = o;
    first.steps = 10;
    first.save = f.path("ckpt");
    auto a = llama_train::run(first, nullptr);
    auto second = o;
    second.resume = f.path("ckpt");
    auto b = llama_train::run(second, nullptr);
    REQUIRE(a.steps.size() == 10);
    REQUIRE(b.steps.size() == 10);
    for (int i = 0; i < 10; ++i) {
      REQUIRE(a.steps[i].loss == straight.steps[i].loss);
      REQUIRE(b.steps[i].step == 11 + i);
      REQUIRE(b.steps[i].loss == straight.steps[10 + i].loss);  // bitwise equal doubles
      REQUIRE(b.steps[i].lr == straight.steps[10 + i].lr);
      REQUIRE(b.steps[i].scale == straight.steps[10 + i].scale);
    }
    CHECK(same_bits(b.params, straight.params));
    CHECK_FALSE(same_bits(a.params, straight.params));  // the test would notice a run that does nothing
  }
}

TEST_CASE("bfloat16 training reduces the loss on the corpus and tracks fp32") {
  fixture f;
  auto o = f.opts(60);
  o.precision = loom::dtype::bf16;
  auto bf = llama_train::run(o, nullptr);
  o.precision = loom::dtype::f32;
  auto fp = llama_train::run(o, nullptr);
  // closed form at initialisation: near-uniform predictions over 256 bytes give ln(256)
  CHECK(bf.steps.front().loss == doctest::Approx(std::log(256.0)).epsilon(0.02));
  double last = 0;
  for (int i = 55; i < 60; ++i) last += bf.steps[i].loss / 5;
  CHECK(last < std::log(256.0) - 2.0);
  // bfloat16 parameters (fp32 master weights) follow the fp32 run closely
  for (int i = 0; i < 60; i += 10) CHECK(bf.steps[i].loss == doctest::Approx(fp.steps[i].loss).epsilon(0.02));
}

TEST_CASE("fp16 loss scaling inside the loop: overflowing steps are skipped, the scale follows DeepSpeed's rules") {
  fixture f;
  // 2^127 times the gradients overflows float: the scaler must back off, then training proceeds
  auto cfg = f.write("fp16.json", R"({"train_micro_batch_size_per_gpu": 4,
      "fp16": {"enabled": true, "initial_scale_power": 127, "hysteresis": 2, "loss_scale_window": 1000}})");
  auto o = f.opts(30);
  o.config_path = cfg;
  auto r = llama_train::run(o, nullptr);
  // oracle: hysteresis 2 -> the first overflow only spends hysteresis, later ones halve
  REQUIRE(r.steps[0].skipped);
  CHECK(r.steps[0].scale == std::ldexp(1.f, 127));
  CHECK(r.steps[1].scale == std::ldexp(1.f, 127));
  int skipped = 0;
  float expect = std::ldexp(1.f, 127);
  for (std::size_t i = 0; i < r.steps.size(); ++i) {
    CHECK(r.steps[i].scale == expect);
    if (!r.steps[i].skipped) break;
    ++skipped;
    if (i >= 1) expect /= 2;  // after the first overflow the budget is 1
  }
  CHECK(skipped >= 2);
  // training proceeds once the scale is sane (near float's limit an occasional step still overflows)
  int applied = 0;
  for (auto& x : r.steps) applied += !x.skipped;
  CHECK(applied >= 20);
  CHECK(r.steps.back().loss < r.steps[skipped].loss - 0.5);

  // a static scale that always overflows: every step skipped, parameters untouched
  auto st = f.write("static.json", R"({"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": true, "loss_scale": 3e38}})");
  o.config_path = st;
  o.steps = 3;
  auto s = llama_train::run(o, nullptr);
  for (auto& x : s.steps) CHECK(x.skipped);
  auto o0 = f.opts(0);
  o0.precision = loom::dtype::f16;
  auto init = llama_train::run(o0, nullptr);
  CHECK(same_bits(s.params, init.params));
}

TEST_CASE("gradient accumulation 2 x 4 equals one micro-batch of 8") {
  fixture f;
  auto o = f.opts(3);
  o.batch = 8, o.grad_accum = 1;
  auto big = llama_train::run(o, nullptr);
  o.batch = 4, o.grad_accum = 2;
  auto acc = llama_train::run(o, nullptr);
  for (int i = 0; i < 3; ++i) CHECK(acc.steps[i].loss == doctest::Approx(big.steps[i].loss).epsilon(1e-5));
  double max_diff = 0;
  for (std::size_t i = 0; i < big.params.size(); ++i) max_diff = std::max(max_diff, double(std::fabs(big.params[i] - acc.params[i])));
  CHECK(max_diff < 1e-4);
}

TEST_CASE("bad config and data fail with a message naming the value") {
  fixture f;
  auto o = f.opts(1);
  o.config_path = f.write("bad.json", R"({"train_batch_size": 8, "zero_optimizaton": {"stage": 1}})");
  CHECK_THROWS_WITH_AS(llama_train::run(o, nullptr), doctest::Contains("unknown key \"zero_optimizaton\""), loom::error);
  o.allow_unknown = true;
  CHECK_NOTHROW(llama_train::run(o, nullptr));
  o = f.opts(1);
  o.config_path = f.write("batch.json", R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})");
  CHECK_THROWS_WITH_AS(llama_train::run(o, nullptr), doctest::Contains("train_batch_size=10"), loom::error);
  o = f.opts(1);
  o.model.n_heads = 3;
  CHECK_THROWS_WITH_AS(llama_train::run(o, nullptr), doctest::Contains("dim (32) must be divisible by n_heads (3)"), loom::error);
  o = f.opts(1);
  o.model.n_kv_heads = 3;
  CHECK_THROWS_WITH_AS(llama_train::run(o, nullptr), doctest::Contains("n_heads (4) must be divisible by n_kv_heads (3)"), loom::error);
  o = f.opts(1);
  o.model.vocab = 200;  // the corpus has byte ids up to 255
  CHECK_THROWS_WITH_AS(llama_train::run(o, nullptr), doctest::Contains("vocab_size=256"), loom::error);
  loom::data::write_token_shard(f.path("headerless.bin"), std::vector<std::uint32_t>(4000, 250), loom::data::token_width::u16, 0, false);
  o.data = {f.path("headerless.bin")};
  CHECK_THROWS_WITH_AS(llama_train::run(o, nullptr), doctest::Contains("token id 250 >= vocab_size 200"), loom::error);
  o = f.opts(1);
  loom::data::write_token_shard(f.path("empty.bin"), std::vector<std::uint32_t>{}, loom::data::token_width::u16, 256);
  o.data = {f.path("empty.bin")};
  CHECK_THROWS_WITH_AS(llama_train::run(o, nullptr), doctest::Contains("empty dataset"), loom::error);
  o = f.opts(1);
  o.resume = f.path("missing.ckpt");
  CHECK_THROWS_WITH_AS(llama_train::run(o, nullptr), doctest::Contains("missing.ckpt"), loom::error);
  // a checkpoint of another shape is refused naming the tensor and both shapes
  auto s = f.opts(1);
  s.save = f.path("c.ckpt");
  llama_train::run(s, nullptr);
  o = f.opts(2);
  o.model.hidden_dim = 64;
  o.resume = f.path("c.ckpt");
  CHECK_THROWS_WITH_AS(llama_train::run(o, nullptr),
                       doctest::Contains("tensor 'layers.0.feed_forward.w1.weight' has shape [96,32], this model's is [64,32]"),
                       loom::error);
}

TEST_CASE("chat fine-tuning data (.jsonl): loss only on responses, and it goes down") {
  fixture f;
  std::string text;
  for (int i = 0; i < 16; ++i)
    text += R"({"prompt": "what is )" + std::to_string(i) + R"( plus one?", "response": ")" + std::to_string(i + 1) +
            R"(", "history": [["hi", "hello"]]})" + "\n";
  auto o = f.opts(40);
  o.data = {f.write("chat.jsonl", text)};
  o.model.vocab = 259;
  o.model.seq_len = 64;
  auto r = llama_train::run(o, nullptr);
  // the first loss is over response bytes + eos only: near ln(259) for an untrained model
  CHECK(r.steps.front().loss == doctest::Approx(std::log(259.0)).epsilon(0.03));
  CHECK(r.steps.back().loss < r.steps.front().loss - 2.0);
  o.model.vocab = 256;
  CHECK_THROWS_WITH_AS(llama_train::run(o, nullptr), doctest::Contains("chat data needs vocab >= 259"), loom::error);
}
