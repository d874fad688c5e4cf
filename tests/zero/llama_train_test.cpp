// llama-train with ZeRO: stages 0-3 on 2 and 4 thread ranks reproduce the single-rank
// trainer (examples/llama/train/trainer.hpp: its own AdamW, clipping and master weights,
// no engine) on the same global batches: losses within 1e-5 relative, final parameters
// within 1e-5. Also: fp16 with dynamic loss scaling runs and matches in loss to 1e-2;
// parameter and optimizer offload to cpu change nothing; the seed's own ds_config_zero3.json
// (fp16, ZeRO-3, both offloads, activation checkpointing) trains on 4 ranks as on one.
#include <train.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

namespace {

llama_train::options small(int ranks) {
  llama_train::options o;
  o.model = {.dim = 32, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .hidden_dim = 64, .vocab = 256, .seq_len = 16};
  o.steps = 6;
  o.batch = 8 / ranks;  // global batch 8
  o.mesh.dp = ranks;
  o.data = {LOOM_CORPUS};
  return o;
}

std::string write_config(int stage, const char* extra = "") {
  const std::string path = "zero_llama_train_test_stage" + std::to_string(stage) + (*extra ? "_x" : "") + ".json";
  std::ofstream f(path);
  f << "{\"train_batch_size\": 8, \"gradient_clipping\": 0.5, \"zero_optimization\": {\"stage\": " << stage
    << ", \"reduce_bucket_size\": 3000, \"stage3_prefetch_bucket_size\": 3000, \"stage3_param_persistence_threshold\": 64,"
       " \"stage3_max_live_parameters\": 20000}" << extra << "}";
  return path;
}

void check_same(const llama_train::train_result& got, const llama_train::train_result& want, double tol) {
  REQUIRE(got.steps.size() == want.steps.size());
  for (std::size_t s = 0; s < want.steps.size(); ++s) {
    INFO("step ", s + 1, " got ", got.steps[s].loss, " want ", want.steps[s].loss);
    CHECK(std::abs(got.steps[s].loss - want.steps[s].loss) <= tol * std::abs(want.steps[s].loss));
  }
  REQUIRE(got.params.size() == want.params.size());
  double worst = 0;
  for (std::size_t i = 0; i < want.params.size(); ++i)
    worst = std::max(worst, std::abs(double(got.params[i]) - want.params[i]) / std::max(1.0, std::abs(double(want.params[i]))));
  CHECK(worst <= tol);
}

}  // namespace

llama_train::train_result reference() {  // the single-rank trainer (stage 0, one rank)
  auto o = small(1);
  o.config_path = write_config(0);
  auto r = llama_train::run(o, nullptr);
  std::remove(o.config_path.c_str());
  return r;
}

TEST_CASE("llama-train: ZeRO stages 0-3 x 2, 4 thread ranks reproduce the single-rank trainer") {
  const auto ref = reference();
  CHECK(ref.steps.back().loss < ref.steps.front().loss);
  for (int stage = 0; stage <= 3; ++stage)
    for (int ranks : {2, 4}) {
      INFO("stage ", stage, " ranks ", ranks);
      auto o = small(ranks);
      o.config_path = write_config(stage);
      check_same(llama_train::run(o, nullptr), ref, 1e-5);
      std::remove(o.config_path.c_str());
    }
}

TEST_CASE("llama-train: fp16 with ZeRO-3 and dynamic loss scaling tracks fp32") {
  const auto ref = reference();
  auto o = small(4);
  o.config_path = write_config(3, ", \"fp16\": {\"enabled\": true, \"initial_scale_power\": 12}");
  const auto h = llama_train::run(o, nullptr);
  std::remove(o.config_path.c_str());
  REQUIRE(h.steps.size() == ref.steps.size());
  for (std::size_t s = 0; s < ref.steps.size(); ++s) CHECK(std::abs(h.steps[s].loss - ref.steps[s].loss) <= 2e-2 * ref.steps[s].loss);
}

TEST_CASE("llama-train: offload_param and offload_optimizer on cpu (ZeRO-3) reproduce the single-rank trainer") {
  const auto ref = reference();
  auto o = small(4);
  o.config_path = "zero_llama_train_test_offload.json";
  {  // write_config(3)'s settings with both offloads, as the seed's config has them
    std::ofstream f(o.config_path);
    f << "{\"train_batch_size\": 8, \"gradient_clipping\": 0.5, \"zero_optimization\": {\"stage\": 3,"
         " \"offload_optimizer\": {\"device\": \"cpu\", \"pin_memory\": true},"
         " \"offload_param\": {\"device\": \"cpu\", \"pin_memory\": true},"
         " \"reduce_bucket_size\": 3000, \"stage3_prefetch_bucket_size\": 3000,"
         " \"stage3_param_persistence_threshold\": 64, \"stage3_max_live_parameters\": 20000}}";
  }
  check_same(llama_train::run(o, nullptr), ref, 1e-5);
  std::remove(o.config_path.c_str());
}

TEST_CASE("llama-train: the seed's ds_config_zero3.json trains on 4 thread ranks as on one rank") {
  // fp16 with a dynamic scaler from 2^16, ZeRO-3, optimizer and parameter offload, activation
  // checkpointing, clipping 1.0; train_batch_size 1024 with 8 accumulation steps: micro
  // batches of 32 sequences on 4 ranks, 128 on one. Oracle: the one-rank run (the same
  // global batches), and for the first step's loss (before any update) the fp32 single-rank
  // trainer.
  auto run_seed = [](int ranks, const char* config) {
    auto o = small(ranks);
    o.steps = 3;
    o.batch = 1024 / 8 / ranks;
    o.config_path = config;
    return llama_train::run(o, nullptr);
  };
  const auto four = run_seed(4, LOOM_SEED_CONFIG), one = run_seed(1, LOOM_SEED_CONFIG);
  REQUIRE(four.steps.size() == 3);
  REQUIRE(one.steps.size() == 3);
  for (std::size_t s = 0; s < 3; ++s) {
    INFO("step ", s + 1, ": 4 ranks ", four.steps[s].loss, ", 1 rank ", one.steps[s].loss);
    CHECK(std::isfinite(four.steps[s].loss));
    CHECK(std::abs(four.steps[s].loss - one.steps[s].loss) <= 1e-3 * one.steps[s].loss);
  }
  auto o = small(1);
  o.steps = 1;
  o.batch = 128;
  o.config_path = "zero_llama_train_test_seed_fp32.json";
  {
    std::ofstream f(o.config_path);
    f << "{\"train_batch_size\": 1024, \"gradient_accumulation_steps\": 8, \"gradient_clipping\": 1.0}";
  }
  const auto fp32 = llama_train::run(o, nullptr);
  std::remove(o.config_path.c_str());
  CHECK(std::abs(four.steps[0].loss - fp32.steps[0].loss) <= 1e-2 * fp32.steps[0].loss);
}

TEST_CASE("llama-train: with the seed's ds_config_zero3.json a rank holds its parameter shard plus one gathered block") {
  // 4 ranks, 8 decoder blocks, fp16 parameters. The config's "auto" stage-3 knobs resolve to
  // a prefetch bucket of 0.9 h^2 and a persistence threshold of 10 h (h = dim = 32): every
  // unit is gathered, and none fits the prefetch bucket, so at most one unit is gathered at a
  // time: peak = S/4 + U_max (bytes), with S the unpartitioned stage and U_max its largest
  // unit -- against S without ZeRO-3.
  auto o = small(4);
  o.model.n_layers = 8;
  o.steps = 2;
  o.batch = 1024 / 8 / 4;
  o.config_path = LOOM_SEED_CONFIG;
  const auto r = llama_train::run(o, nullptr);
  const std::size_t S = r.parameter_full_bytes, U = r.largest_unit_bytes;
  REQUIRE(S > 0);
  CHECK(r.parameter_peak_bytes == S / 4 + U);
  CHECK(r.parameter_peak_bytes < S / 2);
  MESSAGE("seed ZeRO-3 config, 4 ranks, 8 blocks: peak parameter bytes ", r.parameter_peak_bytes, " of ", S, " (",
          double(r.parameter_peak_bytes) / double(S), "), largest unit ", U);
  for (const auto& st : r.steps) CHECK(std::isfinite(st.loss));
}
