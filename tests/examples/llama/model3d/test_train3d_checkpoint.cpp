// Sharded checkpoints of the mesh trainer (examples/llama/train3d/checkpoint.hpp): 10 steps on
// (2,2,2) ZeRO-3, save, then 10 more steps resumed on several meshes and stages. Oracle: the
// uninterrupted 20-step run on (2,2,2) ZeRO-3 -- bit for bit on the same mesh and stage (the
// whole state is restored exactly), within 1e-5 on the others (the mesh-equivalence
// tolerance: only the order of summation differs). Computation in double.
#include "checkpoint_suite.hpp"

#include <support/error_of.hpp>

#include <llama/generate/llama_loader.hpp>
#include <llama/model/llama.hpp>

#include <filesystem>
#include <fstream>

using loom::comm::any_comm;
using namespace train3d_suite;

namespace {

// Steps [first, last) of a run on `mesh` / `zero` on thread ranks (checkpoint_suite.hpp).
run_result segment(loom::comm::mesh_shape mesh, int zero, int first, int last, const std::string& resume,
                   const std::string& save, std::string* saved_dir = nullptr) {
  run_result out;
  train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
    run_result r = segment_rank(world, mesh, zero, first, last, resume, save, saved_dir);
    if (world.rank() == 0) out = r;
  });
  return out;
}

}  // namespace

TEST_CASE("a (2,2,2) ZeRO-3 checkpoint resumes bit for bit on its mesh, and within 1e-5 on other meshes and stages") {
  namespace fs = std::filesystem;
  const std::string root = "train3d_checkpoint_test.ckpt";
  fs::remove_all(root);
  const run_result straight = segment({2, 2, 2}, 3, 0, steps, "", "");
  std::string dir;
  const run_result head = segment({2, 2, 2}, 3, 0, half_steps, "", root, &dir);
  CHECK(dir == root + "/step-" + std::to_string(half_steps));
  for (int r = 0; r < 8; ++r) CHECK(fs::exists(dir + "/rank-0000" + std::to_string(r) + ".safetensors"));
  CHECK(fs::exists(dir + "/manifest.json"));
  CHECK_FALSE(fs::exists(dir + ".partial"));
  for (int s = 0; s < half_steps; ++s) CHECK(head.losses[std::size_t(s)] == straight.losses[std::size_t(s)]);
  {  // consolidation streams one tensor at a time into the single-rank names; oracle: the
     // consolidated master (gathered by all-reduce over the mesh)
    loom::host_memory_resource mr("consolidate");
    const std::string file = root + "/model.safetensors";
    const std::size_t largest = loom::checkpoint::consolidate(root, file, mr);
    CHECK(mr.peak_bytes() == largest * sizeof(float));
    const auto tensors = loom::io::read_safetensors(file);
    const auto layout = llama3d::full_layout(tiny(false));
    REQUIRE(tensors.size() == layout.entries().size());
    for (const auto& e : layout.entries()) {
      CAPTURE(e.name);
      const auto& t = tensors.at(e.name);
      REQUIRE(t.data.size() == e.numel);
      bool same = true;
      for (std::size_t i = 0; i < e.numel; ++i) same = same && t.data[i] == head.master[e.offset + i];
      CHECK(same);
    }
  }
  {  // exported as an HF folder (shards cut small, q/k rows permuted for HF's half-split
     // rotary): read back by the HF loader (PyTorch-checked in llama_checkpoint_test) and run
     // with HF's rotary, it gives the logits of the trained model run with its own rotary.
    namespace fs = std::filesystem;
    const std::string hf = root + "/hf";
    const llama::config cfg = tiny(false);
    const int files = llama::export_hf(root, hf, cfg, 2048);
    CHECK(files > 2);
    CHECK(fs::exists(hf + "/model.safetensors.index.json"));
    const llama::flat_weights w = llama::load_hf_safetensors(hf);
    CHECK(w.cfg.rope == loom::ops::rope_style::half_split);
    CHECK(w.cfg.n_kv_heads == cfg.n_kv_heads);
    llama::model<double, double> trained(cfg), exported(w.cfg);
    for (const auto& e : trained.layout().entries())
      std::copy_n(head.master.begin() + static_cast<std::ptrdiff_t>(e.offset), e.numel, trained.params().begin() + static_cast<std::ptrdiff_t>(e.offset));
    for (const auto& e : exported.layout().entries()) {
      const auto t = w.tensor(e.name);
      std::copy(t.begin(), t.end(), exported.params().begin() + static_cast<std::ptrdiff_t>(e.offset));
    }
    std::vector<std::int32_t> tok(2 * 8);
    for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<std::int32_t>((i * 7 + 3) % 32);
    const loom::tensor_view<const std::int32_t, loom::host, 2> tv(tok.data(), loom::extents<2>{2, 8});
    trained.forward(tv);
    exported.forward(tv);
    const auto a = trained.logits(), b = exported.logits();
    double worst = 0;
    for (loom::index_t i = 0; i < 2 * 8 * 32; ++i) worst = std::max(worst, std::abs(a.data()[i] - b.data()[i]));
    CHECK(worst < 1e-9);
  }

  struct target {
    loom::comm::mesh_shape mesh;
    int zero;
  };
  for (const target& to : {target{{2, 2, 2}, 3}, target{{4, 1, 2}, 1}, target{{1, 2, 1}, 0}, target{{1, 1, 1}, 0}}) {
    CAPTURE(to.mesh.dp);
    CAPTURE(to.mesh.tp);
    CAPTURE(to.mesh.pp);
    CAPTURE(to.zero);
    const run_result tail = segment(to.mesh, to.zero, half_steps, steps, root, "");  // via root/latest
    run_result want;
    want.losses.assign(straight.losses.begin() + half_steps, straight.losses.end());
    want.master = straight.master;
    if (to.zero == 3 && to.mesh.dp == 2 && to.mesh.tp == 2) {
      CHECK(tail.losses == want.losses);  // bit for bit
      CHECK(tail.master == want.master);
    } else {
      compare(tail, want);
    }
  }
  fs::remove_all(root);
}

TEST_CASE("checkpoints: a torn file or another model is refused naming the file or the tensor; a crashed save leaves the last one") {
  namespace fs = std::filesystem;
  const std::string root = "train3d_checkpoint_bad.ckpt";
  fs::remove_all(root);
  std::string dir;
  segment({2, 1, 1}, 2, 0, 2, "", root, &dir);
  // a save that died before its rename leaves a .partial directory and `latest` unchanged
  fs::create_directories(root + "/step-3.partial");
  std::ofstream(root + "/step-3.partial/rank-00000.safetensors") << "torn";
  const run_result resumed = segment({2, 1, 1}, 2, 2, 3, root, "");
  CHECK(resumed.losses.size() == 1);
  // a truncated rank file
  const std::string f = dir + "/rank-00001.safetensors";
  fs::resize_file(f, fs::file_size(f) - 8);
  CHECK_THROWS_WITH_AS(segment({2, 1, 1}, 2, 2, 3, root, ""), doctest::Contains("rank-00001.safetensors"), loom::error);
  // a manifest with a bad number is refused naming the field (a hostile file, not a crash)
  {
    std::ifstream in(dir + "/manifest.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto at = text.find("\"step\"");
    REQUIRE(at != std::string::npos);
    text.replace(at, text.find(',', at) - at, "\"step\": -3");
    std::ofstream(dir + "/manifest.json") << text;
    CHECK_THROWS_WITH_AS(loom::checkpoint::reader{dir}, doctest::Contains("step must be >= 0"), loom::error);
  }
  // another model (more layers) is refused naming a tensor it lacks
  fs::remove_all(root);
  segment({1, 1, 1}, 0, 0, 1, "", root);
  // another seed or another number of micro-batches per step would not continue the saved
  // run's data: refused naming both values
  for (const auto& [seed, micro] : {std::pair<std::uint64_t, int>{99, 4}, std::pair<std::uint64_t, int>{0, 2}}) {
    auto o = options({1, 1, 1}, 0, "1f1b", micro);
    if (seed) o.seed = seed;
    const std::string m = loom::test::error_of([&] {
      train3d_suite::run_ranks(1, [&](any_comm& world) {
        llama3d::trainer<double, double, any_comm> t(world, tiny(false), o, loom::default_resource<loom::host>());
        llama3d::load_checkpoint(t, root);
      });
    });
    CAPTURE(m);
    CHECK(m.find(seed ? "this run has seed=99" : "saved with 4 micro-batches per step (dp x micro-batches), this run takes 2") !=
          std::string::npos);
  }
  const auto o = options({1, 1, 1}, 0, "1f1b", 4);
  CHECK_THROWS_WITH_AS(train3d_suite::run_ranks(1,
                                             [&](any_comm& world) {
                                               llama3d::trainer<double, double, any_comm> t(world, tiny(false, 3), o,
                                                                                               loom::default_resource<loom::host>());
                                               llama3d::load_checkpoint(t, root);
                                             }),
                       doctest::Contains("tensors"), loom::error);
  CHECK_THROWS_WITH_AS(loom::checkpoint::resolve("no_such_checkpoint_dir"), doctest::Contains("neither manifest.json"), loom::error);
  fs::remove_all(root);
}
