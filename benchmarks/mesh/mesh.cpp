// loom-bench-mesh: the 3D trainer (examples/llama/train3d) on thread ranks.
//   Table 1: for several (dp, tp, pp) meshes of the same world: tokens/s (median step after a
//   warm-up step), model-state bytes and peak bytes per rank (largest rank).
//   Table 2: pipeline bubble measured on each stage as 1 - busy / step pipeline time (busy:
//   its forward and backward compute), averaged over stages, against (p-1)/(m+p-1).
// Usage: loom-bench-mesh [--ranks 8] [--steps 5] [--quick]
#include <llama/train3d/train3d.hpp>

#include <loom/comm/any_comm.hpp>
#include <loom/comm/thread_comm.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <functional>
#include <vector>

namespace {

using trainer_t = llama3d::trainer<float, float, loom::comm::any_comm>;  // llama_train_lib's (compiled there once)

struct result {
  double tokens_per_s = 0, states_kib = 0, peak_kib = 0, bubble = 0;
};

result measure(const llama::config& cfg, llama3d::train_options o, int steps) {
  const int world = o.mesh.size();
  std::vector<std::unique_ptr<loom::host_memory_resource>> mem;
  for (int r = 0; r < world; ++r) mem.push_back(std::make_unique<loom::host_memory_resource>("rank"));
  std::vector<double> secs, bubble(static_cast<std::size_t>(world), 0);
  double states = 0;
  loom::comm::run_ranks(world, [&](loom::comm::thread_comm& ranks) {
    loom::comm::any_comm c(std::ref(ranks));
    trainer_t t(c, cfg, o, *mem[static_cast<std::size_t>(c.rank())]);
    const auto b = t.bytes();
    if (c.rank() == 0) states = double(b.parameters + b.gradients + b.optimizer);
    double bub = 0;
    for (int s = 0; s < steps + 1; ++s) {
      auto st = t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
        llama3d::counting_batch(1, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
      });
      double sec = st.seconds;
      c.all_reduce(std::span<const double>(&sec, 1), std::span<double>(&sec, 1), loom::comm::reduce_op::max);
      if (s == 0) continue;  // warm-up: first-touch allocations
      if (c.rank() == 0) secs.push_back(sec);
      bub += 1.0 - st.busy_seconds / st.pipeline_seconds;
    }
    bubble[static_cast<std::size_t>(c.rank())] = bub / steps;
  });
  std::sort(secs.begin(), secs.end());
  result r;
  const double tokens = double(o.mesh.dp) * o.micro_batches * double(o.micro_batch_size * o.seq);
  r.tokens_per_s = tokens / secs[secs.size() / 2];
  r.states_kib = states / 1024.0;
  for (const auto& m : mem) r.peak_kib = std::max(r.peak_kib, double(m->peak_bytes()) / 1024.0);
  for (double b : bubble) r.bubble += b / world;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 8, steps = 5;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    else if (a == "--ranks" && i + 1 < argc) ranks = std::atoi(argv[++i]);
    else if (a == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: loom-bench-mesh [--ranks 8] [--steps 5] [--quick]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (ranks != 8) {
    std::fprintf(stderr, "loom-bench-mesh: the mesh list is written for 8 ranks, got --ranks %d\n", ranks);
    return 2;
  }
  llama::config cfg;
  cfg.dim = quick ? 32 : 256, cfg.n_layers = 8, cfg.n_heads = 8, cfg.n_kv_heads = 4;
  cfg.hidden_dim = quick ? 64 : 704, cfg.vocab = quick ? 64 : 2048, cfg.seq_len = quick ? 16 : 128;
  if (quick) steps = 1;
  llama3d::train_options o;
  o.micro_batch_size = 2;
  o.seq = cfg.seq_len;
  o.micro_batches = 8;
  o.zero_stage = 1;
  o.schedule = "1f1b";
  std::printf("model: dim=%lld layers=%lld heads=%lld kv_heads=%lld hidden=%lld vocab=%lld; micro-batch [%lld, %lld], "
              "m=%d per dp rank, ZeRO-1, 1F1B, fp32, %d steps (median)\n\n",
              (long long)cfg.dim, (long long)cfg.n_layers, (long long)cfg.n_heads, (long long)cfg.n_kv_heads,
              (long long)cfg.hidden_dim, (long long)cfg.vocab, (long long)o.micro_batch_size, (long long)o.seq,
              o.micro_batches, steps);
  std::printf("| dp x tp x pp | tokens/s | model states / rank (KiB) | peak memory / rank (KiB) |\n|---|---|---|---|\n");
  const std::vector<loom::comm::mesh_shape> meshes =
      quick ? std::vector<loom::comm::mesh_shape>{{2, 2, 2}}
            : std::vector<loom::comm::mesh_shape>{{8, 1, 1}, {4, 2, 1}, {4, 1, 2}, {2, 2, 2}, {2, 4, 1},
                                                  {1, 8, 1}, {1, 2, 4}, {2, 1, 4}, {1, 1, 8}};
  for (auto m : meshes) {
    o.mesh = m;
    const result r = measure(cfg, o, steps);
    std::printf("| %d x %d x %d | %.0f | %.0f | %.0f |\n", m.dp, m.tp, m.pp, r.tokens_per_s, r.states_kib, r.peak_kib);
    std::fflush(stdout);
  }
  std::printf("\n| p | m | measured bubble | (p-1)/(m+p-1) |\n|---|---|---|---|\n");
  for (int p : quick ? std::vector<int>{2} : std::vector<int>{2, 4}) {
    for (int mm : quick ? std::vector<int>{2} : std::vector<int>{1, 2, 4, 8, 16}) {
      o.mesh = {1, 1, p};
      o.micro_batches = mm;
      const result r = measure(cfg, o, steps);
      std::printf("| %d | %d | %.3f | %.3f |\n", p, mm, r.bubble, double(p - 1) / double(mm + p - 1));
      std::fflush(stdout);
    }
  }
  return 0;
}
