// llama-train with ZeRO: stages 0-3 on 2 and 4 thread ranks reproduce the single-rank
// trainer (examples/llama/train/trainer.hpp: its own AdamW, clipping and master weights,
// no engine) on the same global batches: losses within 1e-5 relative, final parameters
// within 1e-5. Also: fp16 with dynamic loss scaling runs and matches in loss to 1e-2.
#include <trainer.hpp>

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
  o.ranks = ranks;
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
