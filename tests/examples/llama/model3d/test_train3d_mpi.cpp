// The 3D trainer under mpirun (-np 4: meshes (2,2,1) and (1,2,2); -np 8: (2,2,2)), every
// ZeRO stage and the three schedules, against the (1,1,1) run computed in each process;
// checkpoints, init_from_hf and QLoRA's partitioned base (ZeRO-3) with one process per rank.
#include "checkpoint_suite.hpp"
#include "qlora_suite.hpp"

#include "hf_write.hpp"

#include <llama/train3d/init_hf.hpp>

#include <filesystem>

#include <loom/comm/mpi_comm.hpp>

using namespace train3d_suite;

TEST_CASE("3D training on MPI ranks reproduces the (1,1,1) run") {
  loom::comm::mpi_comm mpi = loom::comm::mpi_comm::world();
  loom::comm::any_comm world(std::ref(mpi));  // the trainer type of the thread-rank tests
  const int n = world.size();
  std::vector<loom::comm::mesh_shape> meshes;
  if (n == 4) meshes = {{2, 2, 1}, {1, 2, 2}};
  if (n == 8) meshes = {{2, 2, 2}};
  REQUIRE(!meshes.empty());
  const int m = 2;
  for (auto mesh : meshes) {
    const run_result base = run({1, 1, 1}, 0, "1f1b", m * mesh.dp, false);
    for (int zero = 0; zero <= 3; ++zero)
      for (const char* sched : {"gpipe", "1f1b"}) {
        if (mesh.pp == 1 && std::string(sched) == "gpipe") continue;
        CAPTURE(mesh.dp);
        CAPTURE(mesh.tp);
        CAPTURE(mesh.pp);
        CAPTURE(zero);
        CAPTURE(sched);
        compare(run_rank(world, options(mesh, zero, sched, m), false), base);
      }
    if (mesh.pp > 1) {  // interleaved 1F1B, 2 chunks per stage, on a 4-layer model
      const run_result base4 = run({1, 1, 1}, 0, "1f1b", m * mesh.dp, false, 4);
      for (int zero : {3}) {
        auto o = options(mesh, zero, "interleaved", m);
        o.chunks = 2;
        CAPTURE(zero);
        compare(run_rank(world, o, false, 4), base4);
      }
    }
  }
}

TEST_CASE("a checkpoint saved by MPI ranks resumes bit for bit on its mesh and stage, within 1e-5 at another stage and world size") {
  // every process runs one rank; the directory is shared (one machine, or a shared filesystem)
  loom::comm::mpi_comm mpi = loom::comm::mpi_comm::world();
  loom::comm::any_comm world(std::ref(mpi));  // the trainer type of the thread-rank tests
  const int n = world.size();
  const loom::comm::mesh_shape mesh = n == 8 ? loom::comm::mesh_shape{2, 2, 2} : loom::comm::mesh_shape{2, 2, 1};
  REQUIRE(mesh.size() == n);
  const std::string root = "train3d_mpi_checkpoint_np" + std::to_string(n) + ".ckpt";
  if (world.rank() == 0) std::filesystem::remove_all(root);
  world.barrier();
  const run_result straight = segment_rank(world, mesh, 3, 0, steps, "", "");
  segment_rank(world, mesh, 3, 0, half_steps, "", root);
  run_result want;
  want.losses.assign(straight.losses.begin() + half_steps, straight.losses.end());
  want.master = straight.master;
  const run_result same = segment_rank(world, mesh, 3, half_steps, steps, root, "");
  CHECK(same.losses == want.losses);
  CHECK(same.master == want.master);
  compare(segment_rank(world, mesh, 1, half_steps, steps, root, ""), want);
  {  // a different world size: half of the processes resume it (the others wait)
    loom::comm::any_comm half = world.split(world.rank() < n / 2 ? 0 : 1, world.rank());
    if (world.rank() < n / 2) {
      const std::vector<std::pair<loom::comm::mesh_shape, int>> to =
          n == 8 ? std::vector<std::pair<loom::comm::mesh_shape, int>>{{{1, 2, 2}, 3}, {{4, 1, 1}, 1}}
                 : std::vector<std::pair<loom::comm::mesh_shape, int>>{{{2, 1, 1}, 2}};
      for (const auto& [m, zero] : to) {
        CAPTURE(m.dp);
        CAPTURE(m.tp);
        CAPTURE(m.pp);
        compare(segment_rank(half, m, zero, half_steps, steps, root, ""), want);
      }
    }
  }
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove_all(root);
}

TEST_CASE("init_from_hf on MPI ranks: each process reads its slices of an HF LLaMA folder, the master equals the folder") {
  loom::comm::mpi_comm mpi = loom::comm::mpi_comm::world();
  loom::comm::any_comm world(std::ref(mpi));  // the trainer type of the thread-rank tests
  const int n = world.size();
  const loom::comm::mesh_shape mesh = n == 8 ? loom::comm::mesh_shape{2, 2, 2} : loom::comm::mesh_shape{2, 2, 1};
  REQUIRE(mesh.size() == n);
  auto cfg = tiny(false);
  cfg.rope = loom::ops::rope_style::half_split;  // HF's rows as they are (test_init_hf covers the permutation)
  const auto w = llama::flat_weights::random(cfg, 99);
  const std::string dir = "train3d_mpi_init_hf_np" + std::to_string(n);
  if (world.rank() == 0) write_hf_llama(dir, w);
  world.barrier();
  llama3d::trainer<double, double, loom::comm::any_comm> t(world, cfg, options(mesh, 3, "1f1b", 2), loom::default_resource<loom::host>());
  llama3d::hf_read_stats stats;
  llama3d::init_from_hf(t, dir, stats);
  std::size_t owned = 0;
  for (int c = 0; c < t.chunks(); ++c)
    t.engine(c).for_each_state_slice([&](std::size_t, std::span<float> m, std::span<float>, std::span<float>) { owned += m.size(); });
  CHECK(stats.data_bytes <= 4 * owned);
  CHECK(stats.data_bytes < (stats.file_bytes - stats.header_bytes) / 2);
  const auto master = t.consolidated_master();
  REQUIRE(master.size() == w.params.size());
  CHECK(std::equal(master.begin(), master.end(), w.params.begin()));
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("QLoRA under ZeRO-3 on MPI ranks: the base partitioned over dp gives the run with the base whole on every rank, bit for bit, and the thread-rank run within 1e-5") {
  loom::comm::mpi_comm mpi = loom::comm::mpi_comm::world();
  loom::comm::any_comm world(std::ref(mpi));
  const int n = world.size();
  std::vector<loom::comm::mesh_shape> meshes;
  if (n == 4) meshes = {{4, 1, 1}, {2, 2, 1}};
  if (n == 8) meshes = {{2, 2, 2}};
  REQUIRE(!meshes.empty());
  const llama::config cfg = tiny(false);
  constexpr int steps = 3;
  const auto no_base = [](const auto&, const auto&, const std::vector<float>&) {};
  for (const auto mesh : meshes)
    for (const auto base : {llama3d::lora_base::nf4, llama3d::lora_base::bf16}) {
      const std::string what = std::string(llama3d::to_string(base)) + " on (" + std::to_string(mesh.dp) + "," +
                               std::to_string(mesh.tp) + "," + std::to_string(mesh.pp) + ")";
      CAPTURE(what);
      auto o = qlora_suite::qlora_options(mesh, 3, base);
      const auto part = qlora_suite::qlora_rank(world, cfg, o, steps, no_base);  // every projection partitioned
      // the same mesh on thread ranks in this process: another communicator, the same sums up to their order
      qlora_suite::qlora_result threads;
      run_ranks(mesh.size(), [&](loom::comm::any_comm& t) {
        auto r = qlora_suite::qlora_rank(t, cfg, o, steps, no_base);
        if (t.rank() == 0) threads = std::move(r);
      });
      o.stage3.persistence_threshold = std::size_t(1) << 40;  // every projection kept whole on every rank
      const auto whole = qlora_suite::qlora_rank(world, cfg, o, steps, no_base);
      CHECK(part.partitioned > 0);
      CHECK(whole.partitioned == 0);
      CHECK(part.losses == whole.losses);
      CHECK(part.eval == whole.eval);
      CHECK(part.adapters == whole.adapters);
      REQUIRE(part.losses.size() == threads.losses.size());
      for (std::size_t s = 0; s < threads.losses.size(); ++s) CHECK(std::abs(part.losses[s] - threads.losses[s]) <= 1e-5 * threads.losses[s]);
      REQUIRE(part.adapters.size() == threads.adapters.size());
      double worst = 0, moved = 0;
      for (std::size_t i = 0; i < threads.adapters.size(); ++i) {
        worst = std::max(worst, double(std::abs(part.adapters[i] - threads.adapters[i])));
        moved = std::max(moved, double(std::abs(threads.adapters[i])));
      }
      CHECK(worst <= 1e-5);
      CHECK(moved > 0);  // B started at zero: the steps really changed the adapters
    }
}
