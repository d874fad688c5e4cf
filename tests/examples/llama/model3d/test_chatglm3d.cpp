// The ChatGLM configuration of the decoder through the mesh trainer: its fused q/k/v (with
// biases) and gate/up tensors are cut into several rectangles per rank, and ZeRO-3's gathers,
// the sharded checkpoint and the HF export must handle them like any other tensor. Oracles:
// the (1,1,1) run (losses and consolidated master within 1e-5, the mesh-equivalence
// tolerance), and the consolidated master itself for the exported folder (bit for bit).
#include "train3d_suite.hpp"

#include <llama/generate/llama_loader.hpp>
#include <llama/train3d/checkpoint.hpp>

#include <filesystem>

using loom::comm::any_comm;
using namespace train3d_suite;

namespace {

llama::config tiny_chatglm() {
  llama::config c = llama::config::chatglm();
  c.dim = 16, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.hidden_dim = 32, c.vocab = 32, c.seq_len = 8;
  return c;
}

/// `steps` steps on `mesh` / ZeRO `zero`; with `save`, the checkpoint written after them is
/// exported as an HF folder there (rank 0's result carries the losses and the master).
run_result train(loom::comm::mesh_shape mesh, int zero, int n_steps, const std::string& save = "") {
  const auto cfg = tiny_chatglm();
  const auto o = options(mesh, zero, "1f1b", 4 / mesh.dp);
  run_result out;
  train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
    llama3d::trainer<double, double, any_comm> t(world, cfg, o, loom::default_resource<loom::host>());
    run_result r;
    for (int s = 0; s < n_steps; ++s)
      r.losses.push_back(t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
                           llama3d::counting_batch(7, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
                         }).loss);
    if (!save.empty()) llama3d::save_checkpoint(t, save);
    r.master = t.consolidated_master();
    if (world.rank() == 0) out = r;
  });
  return out;
}

}  // namespace

TEST_CASE("ChatGLM on (2,2,2) ZeRO-3 trains as on one rank, and its checkpoint exports as an HF ChatGLM folder of the trained weights") {
  namespace fs = std::filesystem;
  const int n = 6;
  const run_result one = train({1, 1, 1}, 0, n);
  const std::string root = "chatglm3d_test.ckpt";
  fs::remove_all(root);
  const run_result mesh = train({2, 2, 2}, 3, n, root);
  compare(mesh, one);
  CHECK(one.losses.back() < one.losses.front());

  const std::string hf = root + "/hf";
  CHECK(llama::export_hf(root, hf, tiny_chatglm(), 1024) > 1);  // small shards: an index too
  const llama::flat_weights w = llama::load_hf_safetensors(hf);
  CHECK(w.cfg.model_type == "chatglm");
  CHECK(w.cfg.qkv_bias);
  CHECK(w.cfg.n_kv_heads == 2);
  CHECK(w.cfg.rotary_dim() == 2);
  CHECK(w.cfg.rope_theta == tiny_chatglm().rope_theta);
  REQUIRE(w.params.size() == mesh.master.size());
  CHECK(std::equal(w.params.begin(), w.params.end(), mesh.master.begin()));
  fs::remove_all(root);
}
