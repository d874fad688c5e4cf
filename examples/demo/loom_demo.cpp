// loom-demo: the whole mission on one machine in a few minutes.
//
//   1. Train a small LLaMA on the bundled (generated, byte-level) corpus with ZeRO-3 over
//      data x tensor x pipeline parallel thread ranks (default 2 x 2 x 2 = 8 ranks, 1F1B),
//      printing step, loss, tokens/s and memory per rank.
//   2. Save a sharded checkpoint: every rank writes the training state it owns as a
//      safetensors file; then export it, one tensor at a time, as a Hugging Face LLaMA folder
//      (config.json, HF's names, safetensors).
//   3. Load that folder into the paged-KV inference engine and generate, in one continuous
//      batch, completions of a batch of prompts; print them and the throughput.
//
// Every part is a loom primitive or an example built from them: thread_comm and mesh
// (comm), pipeline schedules and executor (pipeline), ZeRO stage 3 (zero), tensor-parallel
// layers (nn/tp), AdamW and the warmup-cosine schedule (optim), safetensors (io), the block
// allocator, scheduler and paged attention (kv).

#include <common/cli.hpp>
#include <llama/generate/from_trained.hpp>
#include <llama/generate/llama_engine.hpp>
#include <llama/model/llama.hpp>
#include <llama/train3d/checkpoint.hpp>
#include <synthetic_corpus.hpp>

#include <loom/comm/thread_comm.hpp>
#include <loom/io/safetensors.hpp>
#include <loom/optim/lr_schedule.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

const char* usage =
    "usage: loom-demo [--steps N] [--dp D] [--tp T] [--pp P] [--zero 0|1|2|3] [--out DIR] [--max-new N]\n"
    "  Trains a small LLaMA with ZeRO over dp x tp x pp thread ranks on the bundled corpus, saves a\n"
    "  sharded checkpoint, consolidates it, loads it into the paged-KV engine and generates.\n"
    "  Defaults: --steps 200 --dp 2 --tp 2 --pp 2 --zero 3 --out loom-demo-out --max-new 40\n";

struct options {
  std::int64_t steps = 200;
  loom::comm::mesh_shape mesh{2, 2, 2};
  int zero = 3;
  std::string out = "loom-demo-out";
  int max_new = 40;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  using examples::cli::number;
  auto on = [&](const std::string& a, const auto& value) {
    if (a == "--steps") o.steps = number<int>(a, value());
    else if (a == "--dp") o.mesh.dp = number<int>(a, value());
    else if (a == "--tp") o.mesh.tp = number<int>(a, value());
    else if (a == "--pp") o.mesh.pp = number<int>(a, value());
    else if (a == "--zero") o.zero = number<int>(a, value());
    else if (a == "--out") o.out = value();
    else if (a == "--max-new") o.max_new = number<int>(a, value());
    else return false;
    return true;
  };
  const auto check = [&] {
    LOOM_CHECK(o.steps >= 1, "--steps must be >= 1, got ", o.steps);
    LOOM_CHECK(o.mesh.dp >= 1 && o.mesh.tp >= 1 && o.mesh.pp >= 1 && o.mesh.size() <= 64, "mesh dp=", o.mesh.dp,
               " tp=", o.mesh.tp, " pp=", o.mesh.pp, " must have 1..64 ranks");
    LOOM_CHECK(o.max_new >= 1, "--max-new must be >= 1, got ", o.max_new);
  };
  if (const auto rc = examples::cli::command_line(argc, argv, "loom-demo", usage, on, check)) return *rc;

  try {
    namespace fs = std::filesystem;
    const auto t_start = std::chrono::steady_clock::now();
    // ---- the model and the data ------------------------------------------------------------
    llama::config cfg;
    cfg.dim = 128, cfg.n_layers = 4, cfg.n_heads = 4, cfg.n_kv_heads = 2, cfg.hidden_dim = 352;
    cfg.vocab = 256, cfg.seq_len = 128;  // byte-level tokens
    cfg.validate();
    llama3d::train_options topt;
    topt.mesh = o.mesh;
    topt.zero_stage = o.zero;
    topt.schedule = "1f1b";
    topt.micro_batches = 4;  // per data-parallel rank and step
    topt.micro_batch_size = 4;
    topt.seq = 64;
    topt.adamw.lr = 3e-3f;
    topt.adamw.weight_decay = 0.01f;
    topt.gradient_clipping = 1.f;
    topt.seed = 7;
    loom::optim::warmup_cosine_lr lr{.base_lr = topt.adamw.lr, .total_num_steps = o.steps, .warmup_min_ratio = 0.f,
                                     .warmup_num_steps = std::max<std::int64_t>(2, o.steps / 10), .cos_min_ratio = 0.1f,
                                     .type = loom::optim::warmup_type::linear};
    const std::string corpus = examples::synthetic_corpus(1 << 19);  // 512 KiB of byte-level text
    const auto window = static_cast<std::size_t>(topt.seq);
    auto batch = [&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
      const loom::counter_rng rng(topt.seed, 99);  // row r of micro-batch g at step t: same on any mesh
      for (std::size_t r = 0; r < static_cast<std::size_t>(topt.micro_batch_size); ++r) {
        const std::uint64_t key = (static_cast<std::uint64_t>(step) * 4096u + static_cast<std::uint64_t>(g)) * 64u +
                                  static_cast<std::uint64_t>(r);
        const std::size_t start = rng.bits(key) % (corpus.size() - window - 1);
        for (std::size_t i = 0; i < window; ++i) {
          tok[r * window + i] = static_cast<unsigned char>(corpus[start + i]);
          tgt[r * window + i] = static_cast<unsigned char>(corpus[start + i + 1]);
        }
      }
    };

    const int world = o.mesh.size();
    fs::create_directories(fs::path(o.out) / "checkpoint");
    std::printf("loom demo: LLaMA dim=%lld layers=%lld heads=%lld (kv %lld) vocab=%lld on %d thread ranks "
                "(dp=%d x tp=%d x pp=%d), ZeRO-%d, 1F1B, %lld steps\n",
                (long long)cfg.dim, (long long)cfg.n_layers, (long long)cfg.n_heads, (long long)cfg.n_kv_heads,
                (long long)cfg.vocab, world, o.mesh.dp, o.mesh.tp, o.mesh.pp, o.zero, (long long)o.steps);
    std::vector<std::unique_ptr<loom::host_memory_resource>> mem;
    for (int r = 0; r < world; ++r) mem.push_back(std::make_unique<loom::host_memory_resource>("rank " + std::to_string(r)));

    // ---- 1. train; 2. save the sharded checkpoint ---------------------------------------------
    const double tokens_per_step = double(o.mesh.dp) * topt.micro_batches * double(topt.micro_batch_size * topt.seq);
    std::string checkpoint_dir;
    const auto t_train = std::chrono::steady_clock::now();
    loom::comm::run_ranks(world, [&](loom::comm::thread_comm& comm) {
      const int r = comm.rank();
      auto& mr = *mem[static_cast<std::size_t>(r)];
      llama3d::trainer<float, float, loom::comm::thread_comm> t(comm, cfg, topt, mr);
      const auto b = t.bytes();
      double states = double(b.parameters + b.gradients + b.optimizer), max_states = states;
      comm.all_reduce(std::span<const double>(&states, 1), std::span<double>(&max_states, 1), loom::comm::reduce_op::max);
      if (r == 0)
        std::printf("model states per rank: %.1f KiB (largest rank; parameters + gradients + fp32 master and Adam "
                    "moments, divided by tp x pp and, with ZeRO-3, by dp)\n",
                    max_states / 1024.0);
      double loss_first = 0;
      for (std::int64_t s = 0; s < o.steps; ++s) {
        t.set_lr(lr.lr(s));
        const auto st = t.step(batch);
        if (s == 0) loss_first = st.loss;
        double peak = double(mr.peak_bytes()), secs = st.seconds;
        comm.all_reduce(std::span<const double>(&peak, 1), std::span<double>(&peak, 1), loom::comm::reduce_op::max);
        comm.all_reduce(std::span<const double>(&secs, 1), std::span<double>(&secs, 1), loom::comm::reduce_op::max);
        if (r == 0 && (s % 10 == 0 || s + 1 == o.steps)) {
          std::printf("step %4lld  loss %.4f  lr %.2e  %6.0f tokens/s  peak memory/rank %.2f MiB\n", (long long)s + 1,
                      st.loss, lr.lr(s), tokens_per_step / secs, peak / (1024.0 * 1024.0));
          std::fflush(stdout);
        }
        if (r == 0 && s + 1 == o.steps)
          std::printf("trained %lld steps in %.1f s: loss %.3f -> %.3f (uniform guess: %.3f)\n", (long long)o.steps,
                      seconds_since(t_train), loss_first, st.loss, std::log(double(cfg.vocab)));
      }
      // Each rank writes the training state it owns (sharded checkpoint: nothing gathered).
      const std::string dir = llama3d::save_checkpoint(t, (fs::path(o.out) / "checkpoint").string());
      if (r == 0) checkpoint_dir = dir;
    });

    // ---- export the shards as an HF LLaMA folder, one tensor at a time -----------------------
    const std::string model_dir = (fs::path(o.out) / "hf").string();
    llama::export_hf(checkpoint_dir, model_dir, cfg);
    std::printf("saved the sharded checkpoint (%d rank files in %s) and exported it, one tensor at a time, as the HF "
                "folder %s (%.1f MiB)\n",
                world, checkpoint_dir.c_str(), model_dir.c_str(),
                double(fs::file_size(fs::path(model_dir) / "model.safetensors")) / (1024.0 * 1024.0));

    // ---- 3. load into the paged-KV engine and generate -------------------------------------------
    const llama::flat_weights w = llama::load_hf_safetensors(model_dir);
    llama::engine_config ec;
    ec.num_blocks = 512;
    ec.block_size = 16;
    llama::llama_engine<float> engine(w, ec);
    const std::vector<std::string> prompts = {
        "the small cat ", "17 + 25 = ", "count: 3 4 5 ", "the old farmer finds ", "8 + 9 = ", "count: 12 13 ",
        "the happy child ", "the tall teacher paints ", "41 + 7 = ", "count: 27 28 29 ", "a red ball ", "the boat ",
        "the quiet river ", "3 + 4 = ", "count: 7 ", "the busy dog hears "};
    std::vector<loom::kv::request> reqs;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      loom::kv::request q;
      q.id = i;
      q.prompt.assign(prompts[i].begin(), prompts[i].end());
      q.max_new_tokens = o.max_new;
      q.stop_tokens = {'\n'};
      reqs.push_back(std::move(q));
    }
    const auto t_gen = std::chrono::steady_clock::now();
    auto out = engine.generate(reqs);
    const double gen_secs = seconds_since(t_gen);
    std::size_t generated = 0;
    for (const auto& [id, toks] : out) generated += toks.size();
    std::printf("generated %zu tokens for %zu prompts in one continuous batch in %.2f s: %.0f tokens/s "
                "(%lld engine steps, KV pool %.1f MiB)\n",
                generated, prompts.size(), gen_secs, double(generated) / gen_secs, (long long)engine.steps(),
                double(engine.kv_bytes()) / (1024.0 * 1024.0));
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      std::string text;
      for (auto tkn : out[i])
        if (tkn != '\n') text.push_back(static_cast<char>(tkn));
      std::printf("  %-26s -> %s\n", ("\"" + prompts[i] + "\"").c_str(), text.c_str());
    }
    std::printf("demo finished in %.1f s\n", seconds_since(t_start));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom-demo: %s\n", e.what());
    return 1;
  }
}
