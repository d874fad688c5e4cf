// llama-train: pretrain a LLaMA on token shards, single rank, DeepSpeed-style config.
// See trainer.hpp for the step and docs/training.md for the flags and the config keys.
#include <common/cli.hpp>
#include <common/fail_fast.hpp>
#include "run.hpp"

#include <cstdio>
#include <exception>
#include <iostream>
#include <sstream>
#include <string>

#ifndef LLAMA_DEFAULT_DATA
#define LLAMA_DEFAULT_DATA ""
#endif

namespace {

const char* usage =
    "usage: llama-train [--config ds_config.json] [--allow-unknown] [--data shard.bin[,more.bin]] [--steps N]\n"
    "                   [--save ckpt] [--resume ckpt] [--precision fp32|bf16|fp16] [--seed S]\n"
    "                   [--dim D] [--n-layers L] [--n-heads H] [--n-kv-heads K] [--hidden-dim F] [--vocab V]\n"
    "                   [--seq-len T] [--tied] [--checkpointing]\n"
    "                   [--lr LR] [--warmup W] [--weight-decay WD] [--clip C] [--batch B] [--grad-accum G]\n"
    "                   [--print-every N] [--ranks N]\n"
    "  The config's batch, precision, optimizer, scheduler and clipping win; its \"auto\" values and a\n"
    "  missing config take the flags. --data defaults to the generated example corpus.\n";

using examples::cli::bad_args;
using examples::cli::number;

llama_train::options parse(int argc, char** argv) {
  llama_train::options o;
  bool hidden_given = false;
  const bool run = examples::cli::parse(argc, argv, [&](const std::string& a, const auto& value) {
    if (a == "--config") o.config_path = value();
    else if (a == "--allow-unknown") o.allow_unknown = true;
    else if (a == "--data") {
      std::stringstream ss(value());
      for (std::string p; std::getline(ss, p, ',');)
        if (!p.empty()) o.data.push_back(p);
    } else if (a == "--steps") o.steps = number<std::int64_t>(a, value());
    else if (a == "--save") o.save = value();
    else if (a == "--resume") o.resume = value();
    else if (a == "--precision") o.precision = examples::cli::precision(a, value());
    else if (a == "--seed") o.seed = number<std::uint64_t>(a, value());
    else if (a == "--dim") o.model.dim = number<loom::index_t>(a, value());
    else if (a == "--n-layers") o.model.n_layers = number<loom::index_t>(a, value());
    else if (a == "--n-heads") o.model.n_heads = number<loom::index_t>(a, value());
    else if (a == "--n-kv-heads") o.model.n_kv_heads = number<loom::index_t>(a, value());
    else if (a == "--hidden-dim") o.model.hidden_dim = number<loom::index_t>(a, value()), hidden_given = true;
    else if (a == "--vocab") o.model.vocab = number<loom::index_t>(a, value());
    else if (a == "--seq-len") o.model.seq_len = number<loom::index_t>(a, value());
    else if (a == "--tied") o.model.tied_output = true;
    else if (a == "--checkpointing") o.checkpointing = true;
    else if (a == "--lr") o.lr = number<float>(a, value());
    else if (a == "--warmup") o.warmup = number<std::int64_t>(a, value());
    else if (a == "--weight-decay") o.weight_decay = number<float>(a, value());
    else if (a == "--clip") o.clip = number<float>(a, value());
    else if (a == "--batch") o.batch = number<std::int64_t>(a, value());
    else if (a == "--grad-accum") o.grad_accum = number<std::int64_t>(a, value());
    else if (a == "--print-every") o.print_every = number<std::int64_t>(a, value());
    else if (a == "--ranks") o.ranks = number<int>(a, value());
    else return false;
    return true;
  });
  if (!run) {
    std::fputs(usage, stdout);
    std::exit(0);
  }
  if (!hidden_given) o.model.hidden_dim = llama::config::default_hidden_dim(o.model.dim);
  if (o.data.empty() && std::string(LLAMA_DEFAULT_DATA).size()) o.data.push_back(LLAMA_DEFAULT_DATA);
  if (o.steps < 1) throw bad_args("--steps must be >= 1, got " + std::to_string(o.steps));
  if (o.print_every < 1) throw bad_args("--print-every must be >= 1, got " + std::to_string(o.print_every));
  if (o.batch < 1) throw bad_args("--batch must be >= 1, got " + std::to_string(o.batch));
  if (o.ranks < 1) throw bad_args("--ranks must be >= 1, got " + std::to_string(o.ranks));
  if (const int n = llama_train::mpi_launch_size(); n > 1) o.ranks = n;  // under mpirun: one rank per process
  if (o.grad_accum < 1) throw bad_args("--grad-accum must be >= 1, got " + std::to_string(o.grad_accum));
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  llama_train::options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama-train: %s\n%s", e.what(), usage);
    return 2;
  }
  try {
    llama_train::run(o, llama_train::mpi_launch_rank() == 0 ? &std::cout : nullptr);  // under mpirun rank 0 prints
  } catch (const std::exception& e) {
    return examples::fail("llama-train", e.what());  // under mpirun: MPI_Abort, not a hang in MPI_Finalize
  }
}
