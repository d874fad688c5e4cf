// loom-bench-checkpoint: the mesh trainer's sharded checkpoints on thread ranks.
//   For each (mesh, ZeRO stage): seconds to save the whole training state (every rank writes
//   its own master and Adam slices, fsynced; median of --repeat saves), the largest rank file,
//   seconds to load it back on the same mesh, and to export it as an HF folder (one tensor at a
//   time; its memory resource's peak). Beside it, the gather-to-rank-0 way the demo used to
//   take: the whole fp32 model all-reduced onto every rank, then written by rank 0 (master
//   weights only, no optimizer state), with its per-rank peak (the whole model).
// Usage: loom-bench-checkpoint [--dir DIR] [--repeat 3] [--quick]
#include <llama/generate/llama_loader.hpp>
#include <llama/train3d/checkpoint.hpp>

#include <loom/comm/any_comm.hpp>
#include <loom/comm/thread_comm.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <functional>
#include <vector>

namespace {

using trainer_t = llama3d::trainer<float, float, loom::comm::any_comm>;  // llama_train_lib's (compiled there once)
using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct row {
  double save_s = 0, load_s = 0, gather_s = 0, export_s = 0;
  double rank_file_mib = 0, total_mib = 0, export_peak_mib = 0, gather_peak_mib = 0;
};

row measure(const llama::config& cfg, llama3d::train_options o, const std::string& dir, int repeat) {
  namespace fs = std::filesystem;
  fs::remove_all(dir);
  row r;
  std::vector<double> save_s, load_s, gather_s;
  loom::comm::run_ranks(o.mesh.size(), [&](loom::comm::thread_comm& ranks) {
    loom::comm::any_comm c(std::ref(ranks));
    trainer_t t(c, cfg, o, loom::default_resource<loom::host>());
    t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
      llama3d::counting_batch(1, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
    });
    for (int k = 0; k < repeat; ++k) {
      c.barrier();
      const auto t0 = clock_type::now();
      llama3d::save_checkpoint(t, dir);  // ends in a barrier
      if (c.rank() == 0) save_s.push_back(since(t0));
    }
    for (int k = 0; k < repeat; ++k) {
      c.barrier();
      const auto t0 = clock_type::now();
      llama3d::load_checkpoint(t, dir);
      c.barrier();
      if (c.rank() == 0) load_s.push_back(since(t0));
    }
    for (int k = 0; k < repeat; ++k) {
      c.barrier();
      const auto t0 = clock_type::now();
      const std::vector<float> full = t.consolidated_master();
      if (c.rank() == 0) {
        loom::io::tensor_map m;
        const auto layout = llama3d::full_layout(cfg);
        for (const auto& e : layout.entries()) {
          loom::io::named_tensor nt;
          nt.shape.assign(e.shape.begin(), e.shape.end());
          nt.data = loom::buffer<float>(e.numel);
          std::copy_n(full.begin() + static_cast<std::ptrdiff_t>(e.offset), e.numel, nt.data.begin());
          m.emplace(e.name, std::move(nt));
        }
        loom::io::write_safetensors(dir + "/gathered.safetensors", m);
        gather_s.push_back(since(t0));
        r.gather_peak_mib = double(full.size()) * 4 / (1 << 20);
      }
      c.barrier();
    }
  });
  r.save_s = median(save_s), r.load_s = median(load_s), r.gather_s = median(gather_s);
  const std::string ck = loom::checkpoint::resolve(dir);
  for (const auto& e : fs::directory_iterator(ck))
    if (e.path().extension() == ".safetensors") {
      const double mib = double(e.file_size()) / (1 << 20);
      r.rank_file_mib = std::max(r.rank_file_mib, mib);
      r.total_mib += mib;
    }
  loom::host_memory_resource mr("export");
  const auto t0 = clock_type::now();
  loom::checkpoint::folder_options fo;
  fo.max_shard_bytes = std::uint64_t{64} << 20;
  loom::checkpoint::export_folder(ck, dir + "/hf", fo, mr);
  r.export_s = since(t0);
  r.export_peak_mib = double(mr.peak_bytes()) / (1 << 20);
  fs::remove_all(dir);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "bench_checkpoint.tmp";
  int repeat = 3;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    else if (a == "--dir" && i + 1 < argc) dir = argv[++i];
    else if (a == "--repeat" && i + 1 < argc) repeat = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: loom-bench-checkpoint [--dir DIR] [--repeat N] [--quick]\n");
      return 2;
    }
  }
  llama::config cfg;
  cfg.dim = quick ? 64 : 512, cfg.n_layers = quick ? 4 : 8, cfg.n_heads = 8, cfg.n_kv_heads = 8;
  cfg.hidden_dim = llama::config::default_hidden_dim(cfg.dim), cfg.vocab = quick ? 256 : 8192, cfg.seq_len = 64;
  if (quick) repeat = 1;
  const double params = double(llama3d::full_layout(cfg).size());
  std::printf("model: dim %lld, %lld layers, vocab %lld: %.1f M parameters; state saved = fp32 master + 2 Adam moments "
              "(%.0f MiB)\n\n",
              (long long)cfg.dim, (long long)cfg.n_layers, (long long)cfg.vocab, params / 1e6, params * 12 / (1 << 20));
  std::printf("| mesh (dp x tp x pp) | ZeRO | save s | largest rank file MiB | all files MiB | load s | HF export s | export peak MiB "
              "| gather to rank 0 s (master only) | gather peak MiB per rank |\n|---|---|---|---|---|---|---|---|---|---|\n");
  struct point {
    loom::comm::mesh_shape mesh;
    int zero;
  };
  for (const point& p : {point{{2, 2, 2}, 3}, point{{8, 1, 1}, 1}, point{{1, 1, 1}, 0}}) {
    llama3d::train_options o;
    o.mesh = p.mesh;
    o.zero_stage = p.zero;
    o.micro_batches = p.mesh.pp * 2;
    o.micro_batch_size = 1;
    o.seq = 16;
    const row r = measure(cfg, o, dir, repeat);
    std::printf("| %d x %d x %d | %d | %.3f | %.1f | %.1f | %.3f | %.3f | %.1f | %.3f | %.1f |\n", p.mesh.dp, p.mesh.tp, p.mesh.pp,
                p.zero, r.save_s, r.rank_file_mib, r.total_mib, r.load_s, r.export_s, r.export_peak_mib, r.gather_s,
                r.gather_peak_mib);
    std::fflush(stdout);
  }
  return 0;
}
