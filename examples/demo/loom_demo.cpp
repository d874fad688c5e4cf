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
#include <llama/generate/llama_engine.hpp>
#include <llama/generate/llama_loader.hpp>
#include <synthetic_corpus.hpp>
#include <train.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

const char* usage =
    "usage: loom-demo [--steps N] [--dp D] [--tp T] [--pp P] [--zero 0|1|2|3] [--out DIR] [--max-new N]\n"
    "  Trains a small LLaMA with ZeRO over dp x tp x pp thread ranks on the bundled corpus, saves a\n"
    "  sharded checkpoint, exports it as a Hugging Face folder, loads that into the paged-KV engine and generates.\n"
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
    fs::create_directories(o.out);
    // ---- the model, the data and the DeepSpeed-style config ---------------------------------
    llama_train::options t;
    t.model.dim = 128, t.model.n_layers = 4, t.model.n_heads = 4, t.model.n_kv_heads = 2, t.model.hidden_dim = 352;
    t.model.vocab = 256, t.model.seq_len = 128;  // byte-level tokens
    t.mesh = o.mesh;
    t.steps = o.steps;
    t.seed = 7;
    t.print_every = 10;
    const std::string corpus = (fs::path(o.out) / "corpus.bin").string();
    examples::write_corpus_shard(corpus, examples::synthetic_corpus(1 << 19));  // 512 KiB of byte-level text
    t.data = {corpus};
    t.config_path = (fs::path(o.out) / "ds_config.json").string();
    std::ofstream(t.config_path)
        << "{\"train_micro_batch_size_per_gpu\": 2, \"gradient_accumulation_steps\": 4, \"gradient_clipping\": 1.0,\n"
           " \"zero_optimization\": {\"stage\": " << o.zero << "},\n"
           " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-3, \"weight_decay\": 0.01}},\n"
           " \"scheduler\": {\"type\": \"WarmupCosineLR\", \"params\": {\"total_num_steps\": \"auto\", \"warmup_num_steps\": "
        << std::max<std::int64_t>(2, o.steps / 10) << ", \"cos_min_ratio\": 0.1}}}\n";
    t.save = (fs::path(o.out) / "checkpoint").string();
    t.keep_last = 1;
    t.export_hf = (fs::path(o.out) / "hf").string();
    std::printf("loom demo: LLaMA dim=%lld layers=%lld heads=%lld (kv %lld) vocab=%lld on %d thread ranks "
                "(dp=%d x tp=%d x pp=%d), ZeRO-%d, 1F1B, %lld steps (config %s)\n",
                (long long)t.model.dim, (long long)t.model.n_layers, (long long)t.model.n_heads, (long long)t.model.n_kv_heads,
                (long long)t.model.vocab, o.mesh.size(), o.mesh.dp, o.mesh.tp, o.mesh.pp, o.zero, (long long)o.steps,
                t.config_path.c_str());
    std::fflush(stdout);

    // ---- 1. train; 2. save the sharded checkpoint and export it as an HF LLaMA folder ---------
    const auto t_train = std::chrono::steady_clock::now();
    const auto trained = llama_train::run(t, &std::cout);
    std::printf("trained %lld steps in %.1f s: loss %.3f -> %.3f (uniform guess: %.3f)\n", (long long)o.steps, seconds_since(t_train),
                trained.steps.front().loss, trained.steps.back().loss, std::log(double(t.model.vocab)));
    const std::string model_dir = t.export_hf;
    std::printf("every rank wrote the training state it owns (%s); exported one tensor at a time as the HF folder %s (%.1f MiB)\n",
                trained.checkpoint.c_str(), model_dir.c_str(),
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
