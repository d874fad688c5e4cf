// Weight readers against files written by an independent Python writer: llama2.c legacy and
// version-1 checkpoints, HF safetensors (F32, and BF16 in two shards), llama2.c tokenizer.
// Oracles: per-tensor checksums computed by numpy, BPE encodings from a Python implementation,
// numpy's bf16 rounding. Corrupt files must give loom::error, never garbage.
#include <doctest/doctest.h>

#include "checkpoint_fixture.hpp"

#include <loom/core/float16.hpp>
#include <loom/data/tokenizer.hpp>
#include <loom/io/llama2c.hpp>
#include <loom/io/safetensors.hpp>

#include <cmath>
#include <fstream>

using namespace loom::io;

namespace {

void check_against_checksums(const tensor_map& m, const nlohmann::json& sums) {
  CHECK(m.size() == sums.size());
  for (auto& [name, v] : sums.items()) {
    CAPTURE(name);
    REQUIRE(m.contains(name));
    const auto& t = m.at(name);
    double s = 0;
    for (float x : t.data) s += x;
    CHECK(s == doctest::Approx(v[0].get<double>()).epsilon(1e-9).scale(1.0));
    CHECK(t.data[0] == v[1].get<float>());
    CHECK(t.data[t.data.size() - 1] == v[2].get<float>());
  }
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

TEST_CASE("llama2.c legacy and version-1 checkpoints") {
  const auto& f = checkpoint_files::get();
  const auto& dims = f.expected["dims"];
  for (const char* tag : {"a", "b"})
    for (const char* fmt : {"legacy", "v1"}) {
      CAPTURE(tag);
      CAPTURE(fmt);
      auto ck = read_llama2c(f.path(std::string(tag) + "_" + fmt + ".bin"));
      CHECK(ck.config.version == (std::string(fmt) == "v1" ? 1 : 0));
      CHECK(ck.config.dim == dims[0].get<int>());
      CHECK(ck.config.hidden_dim == dims[1].get<int>());
      CHECK(ck.config.n_kv_heads == dims[4].get<int>());
      CHECK(ck.config.vocab_size == dims[5].get<int>());
      CHECK(ck.config.shared_classifier == (std::string(tag) == "b"));
      check_against_checksums(ck.tensors, f.expected[tag]["checksums"]);
    }
}

TEST_CASE("HF safetensors: F32 file, BF16 shards, config.json, and our own writer") {
  const auto& f = checkpoint_files::get();
  auto m32 = read_safetensors(f.path("hf/model.safetensors"));
  CHECK(m32.size() == f.expected["a"]["checksums"].size());
  // Names map one to one; q/k rows are permuted, so compare sums (permutation invariant).
  const auto& sums = f.expected["a"]["checksums"];
  auto sum = [](const named_tensor& t) {
    double s = 0;
    for (float x : t.data) s += x;
    return s;
  };
  CHECK(sum(m32.at("model.layers.1.self_attn.q_proj.weight")) ==
        doctest::Approx(sums["layers.1.attention.wq.weight"][0].get<double>()));
  CHECK(sum(m32.at("lm_head.weight")) == doctest::Approx(sums["output.weight"][0].get<double>()));
  CHECK(m32.at("model.layers.0.mlp.down_proj.weight").shape == std::vector<std::int64_t>{32, 64});

  // BF16 shards hold numpy's round-to-nearest-even of the F32 values.
  tensor_map m16;
  for (const char* s : {"hf_bf16/model-00001-of-00002.safetensors", "hf_bf16/model-00002-of-00002.safetensors"})
    m16.merge(read_safetensors(f.path(s)));
  REQUIRE(m16.size() == m32.size());
  for (auto& [name, t] : m32)
    for (std::size_t i = 0; i < t.data.size(); ++i)
      REQUIRE(m16.at(name).data[i] == static_cast<float>(loom::bfloat16(t.data[i])));

  auto cfg = read_hf_llama_config(f.path("hf/config.json"));
  CHECK(cfg.hidden_size == 32);
  CHECK(cfg.num_key_value_heads == 2);
  CHECK_FALSE(cfg.tie_word_embeddings);

  // Round trip through our writer, in each dtype.
  for (const char* dt : {"F32", "F16", "BF16"}) {
    const std::string p = f.path(std::string("rt_") + dt + ".safetensors");
    write_safetensors(p, m32, dt, {{"who", "loom"}});
    auto back = read_safetensors(p);
    REQUIRE(back.size() == m32.size());
    for (auto& [name, t] : m32) {
      REQUIRE(back.at(name).shape == t.shape);
      for (std::size_t i = 0; i < t.data.size(); ++i) {
        const float want = std::string(dt) == "F32"   ? t.data[i]
                           : std::string(dt) == "F16" ? static_cast<float>(loom::half(t.data[i]))
                                                      : static_cast<float>(loom::bfloat16(t.data[i]));
        REQUIRE(back.at(name).data[i] == want);
      }
    }
  }
}

static_assert(loom::data::tokenizer<llama2c_tokenizer>, "tokenizer.bin serves wherever a data::tokenizer does");

TEST_CASE("llama2.c tokenizer encodes like the Python BPE and decodes back") {
  const auto& f = checkpoint_files::get();
  llama2c_tokenizer tok(f.path("tokenizer.bin"));
  CHECK(tok.vocab_size() == 259 + 17);
  for (auto& c : f.expected["tokenizer"]) {
    const std::string text = c["text"].get<std::string>();
    CAPTURE(text);
    const auto ids = tok.encode(text, /*add_bos=*/true);
    CHECK(ids == c["ids"].get<std::vector<std::int32_t>>());
    CHECK(tok.encode(text) == std::vector<std::int32_t>(ids.begin() + 1, ids.end()));  // data::tokenizer's encode: no bos
    CHECK(tok.decode(ids) == text);
  }
}

TEST_CASE("corrupt or mismatched files give loom::error") {
  const auto& f = checkpoint_files::get();
  // Truncated llama2.c checkpoint.
  {
    std::ifstream in(f.path("a_v1.bin"), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    write_bytes(f.path("trunc.bin"), bytes.substr(0, bytes.size() - 100));
    CHECK_THROWS_AS(read_llama2c(f.path("trunc.bin")), loom::error);
    write_bytes(f.path("long.bin"), bytes + "xxxx");
    CHECK_THROWS_AS(read_llama2c(f.path("long.bin")), loom::error);
  }
  CHECK_THROWS_AS(read_llama2c(f.path("does_not_exist.bin")), loom::error);
  // safetensors: bad header length, bad JSON, bad dtype, offsets past the end.
  auto st = [&](const std::string& json, const std::string& data) {
    std::string b(8, '\0');
    const std::uint64_t n = json.size();
    std::memcpy(b.data(), &n, 8);
    write_bytes(f.path("bad.safetensors"), b + json + data);
    return f.path("bad.safetensors");
  };
  CHECK_THROWS_AS(read_safetensors(st("{not json", "")), loom::error);
  CHECK_THROWS_AS(read_safetensors(st(R"({"x":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}})", "a")), loom::error);
  CHECK_THROWS_AS(read_safetensors(st(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "abcd")), loom::error);
  CHECK_THROWS_AS(read_safetensors(st(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "abcdefgh")), loom::error);
  CHECK_THROWS_AS(read_safetensors(st(R"({"x":{"dtype":"F32","shape":[2]}})", "abcdefgh")), loom::error);
  write_bytes(f.path("short.safetensors"), "abc");
  CHECK_THROWS_AS(read_safetensors(f.path("short.safetensors")), loom::error);
  tensor_map empty;
  CHECK_THROWS_AS(require_tensor(empty, "w", {1}), loom::error);
}
