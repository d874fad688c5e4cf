// The engine's forward pass against PyTorch: checkpoints written by the independent Python
// writer (llama2.c legacy and version 1, HF safetensors) are loaded and run through the paged
// engine; greedy tokens must equal PyTorch's and the last-position logits agree to 1e-4.
#include <doctest/doctest.h>

#include "checkpoint_fixture.hpp"
#include "llama_engine.hpp"
#include "llama_loader.hpp"

#include <cmath>

using namespace llama;

TEST_CASE("llama2.c and HF checkpoints generate what PyTorch generates") {
  const auto& f = checkpoint_files::get();
  const auto prompt = f.expected["prompt"].get<std::vector<loom::kv::token_id>>();
  const int steps = f.expected["steps"].get<int>();
  struct c {
    const char* file;
    const char* model;
  };
  for (c k : {c{"a_legacy.bin", "a"}, c{"a_v1.bin", "a"}, c{"b_legacy.bin", "b"}, c{"b_v1.bin", "b"}, c{"hf", "a"},
              c{"hf/model.safetensors", "a"}}) {
    CAPTURE(k.file);
    const flat_weights w = load_checkpoint(f.path(k.file));
    CHECK((w.cfg.rope == loom::ops::rope_style::interleaved) == (std::string(k.file).find("hf") == std::string::npos));
    engine_config ec;
    ec.num_blocks = 16;
    ec.block_size = 4;
    llama_engine<float> eng(w, ec);
    loom::kv::request r;
    r.id = 1;
    r.prompt = prompt;
    r.max_new_tokens = steps;
    eng.add(r);
    std::vector<loom::kv::token_id> out;
    bool first = true;
    while (eng.has_work()) {
      for (auto& e : eng.step()) {
        out.push_back(e.token);
        if (first) {  // logits after the prompt
          const auto want = f.expected[k.model]["last_logits"].get<std::vector<double>>();
          auto got = eng.last_logits(0);
          REQUIRE(got.size() == want.size());
          double worst = 0;
          for (std::size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
          CHECK(worst < 1e-4);
          first = false;
        }
      }
    }
    CHECK(out == f.expected[k.model]["greedy"].get<std::vector<loom::kv::token_id>>());
  }
}

TEST_CASE("BF16 safetensors shards load (values rounded to bfloat16)") {
  const auto& f = checkpoint_files::get();
  const flat_weights w32 = load_checkpoint(f.path("hf"));
  const flat_weights w16 = load_checkpoint(f.path("hf_bf16"));
  const auto q32 = w32.tensor("layers.0.attention.wq.weight"), q16 = w16.tensor("layers.0.attention.wq.weight");
  REQUIRE(q32.size() == q16.size());
  for (std::size_t i = 0; i < q32.size(); ++i) REQUIRE(q16[i] == static_cast<float>(loom::bfloat16(q32[i])));
  CHECK_THROWS_AS(load_checkpoint(f.path("nothing_here")), loom::error);
}
