// The engine's forward pass against PyTorch: checkpoints written by the independent Python
// writer (llama2.c legacy and version 1, HF safetensors) are loaded and run through the paged
// engine; greedy tokens must equal PyTorch's and the last-position logits agree to 1e-4.
// Each rank's slice read from the files (checkpoint_reader, slice_from) against the slice cut
// from the whole model, and what a rank made from the files holds against its memory plan.
#include <doctest/doctest.h>

#include "checkpoint_fixture.hpp"
#include "llama_engine.hpp"
#include "llama_loader.hpp"

#include <loom/comm/thread_comm.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

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

namespace llama_checkpoint_slices {

// A ChatGLM2/3 HF folder of weights `w` written by the test itself (ChatGLM's names, the fused
// query_key_value and dense_h_to_4h as they are, config.json from the config), its tensors
// spread over two shard files without an index (every *.safetensors is a shard).
void write_hf_chatglm(const std::string& dir, const flat_weights& w) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  loom::io::tensor_map shard[2];
  int k = 0;
  for (const auto& e : w.layout.entries()) {
    auto& t = shard[k++ % 2][llama::detail::chatglm_name(e.name)];
    t.shape.assign(e.shape.begin(), e.shape.end());
    const auto src = w.tensor(e.name);
    t.data = loom::buffer<float>(src.size());
    std::copy(src.begin(), src.end(), t.data.begin());
  }
  loom::io::write_safetensors(dir + "/model-1.safetensors", shard[0]);
  loom::io::write_safetensors(dir + "/model-2.safetensors", shard[1]);
  std::ofstream(dir + "/config.json") << llama::detail::hf_config_json(w.cfg).dump(2);
}

// Rank `rank` of `tp`'s layers: the shards llama_paged cuts its slice by.
llama3d::stage_layers<float> rank_layers(const config& c, int rank, int tp) {
  return llama3d::stage_layers<float>(c, {rank, tp}, llama3d::split_layers(c.n_layers, 1, 0), true, true);
}

}  // namespace llama_checkpoint_slices

// The oracle is the whole model read by load_checkpoint (the whole llama2.c file; every HF
// tensor whole) and cut by load_shards, as the tensor-group constructor cuts it: each rank's
// slice read row by row from the files must be the same bits, and the reader must have read
// exactly the slice's bytes.
TEST_CASE("each rank's slice read from the files = the slice cut from the whole model (LLaMA, ChatGLM; tp 2, 4)") {
  using namespace llama_checkpoint_slices;
  const auto& f = checkpoint_files::get();
  config glm = config::chatglm();
  glm.dim = 64, glm.hidden_dim = 96, glm.n_layers = 2, glm.n_heads = 4, glm.n_kv_heads = 2, glm.vocab = 120, glm.seq_len = 64;
  const std::string glm_dir = f.path("chatglm_hf");
  write_hf_chatglm(glm_dir, flat_weights::random(glm, 11));
  for (const std::string file : {"a_legacy.bin", "a_v1.bin", "b_legacy.bin", "b_v1.bin", "hf", "hf_bf16", "chatglm_hf"}) {
    const std::string path = file == "chatglm_hf" ? glm_dir : f.path(file);
    const flat_weights full = load_checkpoint(path);
    const std::size_t elem = file == "hf_bf16" ? 2 : 4;
    for (int tp : {2, 4}) {
      for (int rank = 0; rank < tp; ++rank) {
        CAPTURE(file);
        CAPTURE(tp);
        CAPTURE(rank);
        const auto layers = rank_layers(full.cfg, rank, tp);
        std::vector<float> cut(layers.layout.size(), 0.f), read(layers.layout.size(), 0.f);
        loom::nn::tp::load_shards(layers.shards, full.params.span(), std::span<float>(cut),
                                  [&](const std::string& name) { return full.layout.find(name).offset; });
        const checkpoint_reader reader(path);
        CHECK(reader.cfg().model_type == full.cfg.model_type);
        slice_from(reader)(layers.shards, std::span<float>(read));
        CHECK(std::memcmp(cut.data(), read.data(), cut.size() * sizeof(float)) == 0);
        std::uint64_t slice = 0;
        for (const auto& s : layers.shards) slice += static_cast<std::uint64_t>(s.rows * s.cols) * elem;
        CHECK(reader.bytes_read() == slice);
      }
    }
  }
  CHECK_THROWS_WITH_AS(checkpoint_reader(f.path("nothing_here")), doctest::Contains("does not exist"), loom::error);
}

// Each of 2 thread ranks makes its engine from the checkpoint's files alone: its weight
// resource peaks at what the memory plan says it holds (its slice and the slice's packed
// copies: nothing of the rest of the model passes through it), it read no more of the files
// than its slice, and the tokens are PyTorch's.
TEST_CASE("an engine rank made from the files holds at its peak what the memory plan says, and generates PyTorch's tokens") {
  using llama_checkpoint_slices::rank_layers;
  using tp_engine = llama_engine<float, loom::comm::thread_comm>;
  const auto& f = checkpoint_files::get();
  for (const char* file : {"a_v1.bin", "hf"}) {
    CAPTURE(file);
    const config c = checkpoint_config(f.path(file));
    engine_config ec;
    ec.num_blocks = 16;
    ec.block_size = 4;
    const std::size_t plan = tp_engine::memory_plan(c, ec, 2).weights;
    loom::kv::request r;
    r.id = 1;
    r.prompt = f.expected["prompt"].get<std::vector<loom::kv::token_id>>();
    r.max_new_tokens = f.expected["steps"].get<int>();
    std::vector<loom::kv::token_id> out;
    std::vector<std::size_t> peak(2), read(2), slice(2);
    loom::comm::run_ranks(2, [&](loom::comm::thread_comm& comm) {
      const auto k = static_cast<std::size_t>(comm.rank());
      loom::host_memory_resource weights("rank weights");
      const checkpoint_reader reader(f.path(file));
      tp_engine eng(reader.cfg(), comm, slice_from(reader), ec, weights);
      peak[k] = weights.peak_bytes();
      read[k] = reader.bytes_read();
      for (const auto& s : rank_layers(c, comm.rank(), 2).shards) slice[k] += static_cast<std::size_t>(s.rows * s.cols) * sizeof(float);
      if (comm.rank() != 0) return eng.follow();
      out = eng.generate({r})[1];
      eng.stop_followers();
    });
    CHECK(out == f.expected["a"]["greedy"].get<std::vector<loom::kv::token_id>>());
    for (std::size_t k = 0; k < 2; ++k) {
      CAPTURE(k);
      CHECK(peak[k] == plan);
      CHECK(read[k] == slice[k]);
    }
  }
}
