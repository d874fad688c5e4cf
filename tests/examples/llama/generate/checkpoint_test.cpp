// The engine's forward pass against PyTorch: checkpoints written by the independent Python
// writer (llama2.c legacy and version 1, HF safetensors) are loaded and run through the paged
// engine; greedy tokens must equal PyTorch's and the last-position logits agree to 1e-4.
#include <doctest/doctest.h>

#include "checkpoint_fixture.hpp"
#include "llama_engine.hpp"
#include "llama_loader.hpp"

#include <loom/comm/thread_comm.hpp>

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

// What a program plans with before loading (checkpoint_config: config.json and the shards'
// headers, or a llama2.c header alone) is the config the loader then gives; the checkpoint
// on 2 tensor-parallel thread ranks generates PyTorch's greedy tokens, each rank holding the
// weights its memory plan says; a per-rank limit between the tp 1 and tp 2 plans admits only tp 2.
TEST_CASE("checkpoint config before loading = the loaded one; the checkpoint at tp 2 = PyTorch, in its planned memory") {
  const auto& f = checkpoint_files::get();
  for (const char* file : {"a_legacy.bin", "a_v1.bin", "b_legacy.bin", "b_v1.bin", "hf", "hf/model.safetensors"}) {
    CAPTURE(file);
    const config early = checkpoint_config(f.path(file));
    const config loaded = load_checkpoint(f.path(file)).cfg;
    CHECK(early.dim == loaded.dim);
    CHECK(early.hidden_dim == loaded.hidden_dim);
    CHECK(early.n_layers == loaded.n_layers);
    CHECK(early.n_heads == loaded.n_heads);
    CHECK(early.n_kv_heads == loaded.n_kv_heads);
    CHECK(early.vocab == loaded.vocab);
    CHECK(early.seq_len == loaded.seq_len);
    CHECK(early.tied_output == loaded.tied_output);
    CHECK(early.rope == loaded.rope);
  }
  CHECK_THROWS_WITH_AS(checkpoint_config(f.path("nothing_here")), doctest::Contains("does not exist"), loom::error);

  using tp_engine = llama_engine<float, loom::comm::thread_comm>;
  const flat_weights w = load_checkpoint(f.path("a_v1.bin"));
  engine_config ec;
  ec.num_blocks = 16;
  ec.block_size = 4;
  // One sequence, a small token budget: the weights dominate (at tp > 1 each rank also holds
  // full logit rows for the gather, which for many sequences of a tiny model outweighs the
  // halved weights: the plan says so, and smallest_tp follows it).
  ec.scheduler.max_num_seqs = 1;
  ec.scheduler.max_num_batched_tokens = 32;
  const std::size_t limit = tp_engine::memory_plan(w.cfg, ec, 2).total();
  REQUIRE(tp_engine::memory_plan(w.cfg, ec, 1).total() > limit);
  CHECK(tp_engine::smallest_tp(w.cfg, ec, limit) == 2);
  loom::kv::request r;
  r.id = 1;
  r.prompt = f.expected["prompt"].get<std::vector<loom::kv::token_id>>();
  r.max_new_tokens = f.expected["steps"].get<int>();
  std::vector<loom::kv::token_id> out;
  std::vector<std::size_t> held(2);
  loom::comm::run_ranks(2, [&](loom::comm::thread_comm& comm) {
    loom::host_memory_resource weights("rank weights");
    tp_engine eng(w, comm, ec, weights);
    held[static_cast<std::size_t>(comm.rank())] = weights.current_bytes() + eng.kv_bytes() + eng.workspace_bytes();
    if (comm.rank() != 0) return eng.follow();
    out = eng.generate({r})[1];
    eng.stop_followers();
  });
  CHECK(out == f.expected["a"]["greedy"].get<std::vector<loom::kv::token_id>>());
  for (auto h : held) CHECK(h == limit);
}
