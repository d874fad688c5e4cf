// The 3D trainer on real data (include/loom/data/batches.hpp): token shards and chat JSONL
// records, micro-batch g of step t read by its global index, so every mesh trains on the same
// rows: 8 steps on (1,2,1), (2,1,2) and (2,2,1) equal the (1,1,1) run (losses within 1e-5
// relative, consolidated master within 1e-5), and the loss falls on the learnable shard.
#include "train3d_suite.hpp"

#include <loom/data/batches.hpp>
#include <loom/data/token_shard.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

using loom::comm::any_comm;
using namespace train3d_suite;

namespace {

struct temp_dir {
  std::filesystem::path dir = std::filesystem::temp_directory_path() / ("loom_train3d_data_" + std::to_string(::getpid()));
  temp_dir() { std::filesystem::create_directories(dir); }
  ~temp_dir() { std::filesystem::remove_all(dir); }
  std::string path(const std::string& name) const { return (dir / name).string(); }
};

run_result run_on_data(loom::comm::mesh_shape mesh, int m, const llama::config& cfg, const std::vector<std::string>& data,
                       int n_steps) {
  auto o = options(mesh, 3, "1f1b", m);
  o.seq = cfg.seq_len;
  run_result out;
  train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
    llama3d::trainer<double, double, any_comm> t(world, cfg, o, loom::default_resource<loom::host>());
    auto loader = loom::data::make_batch_loader(data, cfg.vocab, o.seq, o.micro_batch_size, o.seed);
    loom::data::token_batch batch;
    const int G = mesh.dp * m;
    run_result r;
    for (int s = 0; s < n_steps; ++s)
      r.losses.push_back(t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
                            loom::data::global_micro_batch(loader, step, g, G, batch);
                            REQUIRE(batch.tokens.size() == tok.size());
                            std::copy(batch.tokens.begin(), batch.tokens.end(), tok.begin());
                            std::copy(batch.targets.begin(), batch.targets.end(), tgt.begin());
                          }).loss);
    r.master = t.consolidated_master();
    if (world.rank() == 0) out = r;
  });
  return out;
}

}  // namespace

TEST_CASE("3D training on token shards: every mesh equals the (1,1,1) run, and the loss falls") {
  temp_dir tmp;
  auto cfg = tiny(false);
  std::vector<std::uint32_t> tokens(6000);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint32_t>((i * 7 + i / 97) % 32);
  loom::data::write_token_shard(tmp.path("a.bin"), tokens, loom::data::token_width::u16, 32);
  loom::data::write_token_shard(tmp.path("b.bin"), std::span<const std::uint32_t>(tokens).subspan(0, 2500),
                                loom::data::token_width::u16, 32);
  const std::vector<std::string> data{tmp.path("a.bin"), tmp.path("b.bin")};
  const run_result base1 = run_on_data({1, 1, 1}, 4, cfg, data, 8);
  CHECK(base1.losses.back() < base1.losses.front() - 0.1);
  for (auto mesh : {loom::comm::mesh_shape{1, 2, 1}, {2, 1, 2}, {2, 2, 1}}) {
    CAPTURE(mesh.dp);
    CAPTURE(mesh.tp);
    CAPTURE(mesh.pp);
    compare(run_on_data(mesh, 4 / mesh.dp, cfg, data, 8), base1);
  }
}

TEST_CASE("3D training on chat records (loss on responses only): every mesh equals the (1,1,1) run") {
  temp_dir tmp;
  auto cfg = tiny(false);
  cfg.vocab = 260, cfg.seq_len = 24;  // byte tokens + bos/eos/pad
  {
    std::ofstream f(tmp.path("chat.jsonl"));
    for (int i = 0; i < 24; ++i)
      f << R"({"prompt": "count )" << i << R"(", "response": ")" << i + 1 << " " << i + 2 << R"(", "history": []})" << "\n";
  }
  const std::vector<std::string> data{tmp.path("chat.jsonl")};
  const run_result base1 = run_on_data({1, 1, 1}, 4, cfg, data, 4);
  for (auto mesh : {loom::comm::mesh_shape{1, 2, 1}, {2, 2, 1}}) {
    CAPTURE(mesh.dp);
    CAPTURE(mesh.tp);
    compare(run_on_data(mesh, 4 / mesh.dp, cfg, data, 4), base1);
  }
  CHECK_THROWS_WITH_AS(loom::data::make_batch_loader({tmp.path("chat.jsonl"), tmp.path("x.bin")}, 260, 24, 1, 1),
                       doctest::Contains("must be the only file"), loom::error);
  CHECK_THROWS_WITH_AS(loom::data::make_batch_loader(data, 100, 24, 1, 1), doctest::Contains("vocab >= "), loom::error);
}
