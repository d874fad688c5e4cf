// llama-train: train a LLaMA (or a ChatGLM-shaped decoder) on one rank or a dp x tp x pp mesh
// of thread ranks, or on the processes of `mpirun -np dp*tp*pp`, with ZeRO 0-3 and a
// DeepSpeed-style config. The run itself is train.hpp's run() (llama_train_lib);
// docs/training.md lists the flags and the config keys.
#include "train.hpp"

#include <common/cli.hpp>
#include <loom/comm/fail_fast.hpp>

#include <cstdio>
#include <exception>
#include <iostream>
#include <sstream>
#include <string>

#ifndef LLAMA_DEFAULT_DATA
#define LLAMA_DEFAULT_DATA "counting"
#endif

namespace {

const char* usage =
    "usage: llama-train [--dp D] [--tp T] [--pp P] [--ranks N] [--schedule gpipe|1f1b|interleaved] [--chunks V] [--zero 0|1|2|3]\n"
    "                   [--config ds_config.json] [--allow-unknown] [--steps N] [--batch B] [--grad-accum G] [--seq-len S]\n"
    "                   [--arch llama|chatglm] [--dim D] [--n-layers L] [--n-heads H] [--n-kv-heads K] [--hidden-dim F] [--vocab V] [--tied]\n"
    "                   [--checkpointing] [--precision fp32|bf16|fp16] [--seed S] [--print-every N]\n"
    "                   [--lr LR] [--warmup W] [--weight-decay WD] [--clip C]\n"
    "                   [--data a.bin,b.bin | chat.jsonl | counting] [--tokenizer bytes|x.model|tokenizer.bin]\n"
    "                   [--template chatglm2|chatglm3|llama2] [--max-source-length S] [--max-target-length T]\n"
    "                   [--eval-every N [--eval-data FILES] [--eval-batches K]]\n"
    "                   [--init-from HF_FOLDER] [--save DIR [--save-every N] [--keep-last K] [--export-hf OUT]] [--resume DIR]\n"
    "                   [--lora-r N [--lora-alpha A] [--lora-dropout P] [--lora-targets q_proj,v_proj] [--rslora]\n"
    "                    [--lora-base fp32|bf16|nf4] [--lora-merged] [--lora-from PEFT_DIR] [--export-lora PEFT_DIR]]\n"
    "                   [--group NAME=GLOB[,GLOB][@FIRST:LAST]]... [--unfreeze UNTIL:G[+G],...] [--group-lr NAME=LR] [--group-wd NAME=WD]\n"
    "  Ranks: dp x tp x pp threads (--ranks N: --dp N), or the processes of `mpirun -np dp*tp*pp`.\n"
    "  A config's ZeRO stage, batch (micro batch x accumulation), precision (fp16: its loss scaler), optimizer,\n"
    "  scheduler and clipping win over the flags; its \"auto\" values take them. bf16 / fp16 store parameters in that\n"
    "  type (fp32 master weights and compute).\n"
    "  --data: token shards (uint16), chat records (.jsonl: prompt/response/history, loss on responses, rendered by\n"
    "  --template with --tokenizer's ids; default chatglm2 and bytes), or counting (a learnable synthetic stream);\n"
    "  default: the generated example corpus. --eval-every: held-out loss and perplexity every N steps.\n"
    "  --save: sharded checkpoints DIR/step-<N> and DIR/latest (--keep-last: only the newest K); a checkpoint resumes\n"
    "  on any mesh and ZeRO stage (--resume DIR: its latest, or DIR/step-<N>); --export-hf: after the last save, the\n"
    "  model as a Hugging Face folder (config.json, safetensors shards, index). --init-from: start from a Hugging Face\n"
    "  LLaMA or ChatGLM2/3 folder (its config.json gives the model's shape; each rank reads only its slices).\n"
    "  --lora-*: LoRA adapters (PEFT's semantics: scaling alpha / r, or alpha / sqrt(r) with --rslora) on a frozen base;\n"
    "  targets by HF names (LLaMA q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; ChatGLM query_key_value dense\n"
    "  dense_h_to_4h dense_4h_to_h); --export-lora writes adapter_config.json + adapter_model.safetensors for PEFT;\n"
    "  --export-hf (no --save needed) the model with the adapters merged (and any base it unfroze) as an HF folder.\n"
    "  --lora-dropout: PEFT's dropout on the adapters' input only, while training (default 0; in [0, 1)).\n"
    "  --lora-base: the frozen base's projections kept fp32, or bf16 / nf4 (QLoRA: bitsandbytes' NF4 with double\n"
    "  quantisation, block 64; dequantised inside the GEMMs); the adapters run unmerged beside them. --lora-merged (fp32,\n"
    "  no dropout): merge them into the weights each step instead (the same results; more memory and time).\n"
    "  --group: a parameter group by HF names (model.layers.3.self_attn.q_proj.weight; LoRA factors ...q_proj.lora_A.weight)\n"
    "  and layers [FIRST, LAST) (negative: from the end); the rest is group base. --unfreeze: phases by fraction of --steps,\n"
    "  e.g. 0.3:lora,0.7:lora+top,1:lora+top+base. --group-lr: a group's lr (it follows the lr schedule's ratio).\n";

using examples::cli::bad_args;
using examples::cli::number;

std::vector<std::string> file_list(const std::string& flag, const std::string& list) {
  std::vector<std::string> files;
  std::stringstream ss(list);
  for (std::string p; std::getline(ss, p, ',');)
    if (!p.empty()) files.push_back(p);
  if (files.empty()) throw bad_args(flag + " '" + list.substr(0, 64) + "' names no file");
  return files;
}

template <class T>
T at_least(const std::string& flag, const std::string& v, T low) {
  const T x = number<T>(flag, v);
  if (x < low) throw bad_args(flag + " must be >= " + std::to_string(low) + ", got " + v);
  return x;
}

llama_train::options parse(int argc, char** argv, bool& help) {
  llama_train::options o;
  bool hidden_given = false;
  auto lora = [&]() -> loom::lora::config& {  // any --lora-* flag turns LoRA on (PEFT's defaults for the rest)
    if (!o.lora) o.lora.emplace();
    return *o.lora;
  };
  help = !examples::cli::parse(argc, argv, [&](const std::string& a, const auto& value) {
    if (a == "--config") o.config_path = value();
    else if (a == "--allow-unknown") o.allow_unknown = true;
    else if (a == "--dp" || a == "--ranks") o.mesh.dp = at_least<int>(a, value(), 1);
    else if (a == "--tp") o.mesh.tp = at_least<int>(a, value(), 1);
    else if (a == "--pp") o.mesh.pp = at_least<int>(a, value(), 1);
    else if (a == "--schedule") o.schedule = value();
    else if (a == "--chunks") o.chunks = at_least<int>(a, value(), 1);
    else if (a == "--zero") o.zero = number<int>(a, value());
    else if (a == "--data") o.data = file_list(a, value());
    else if (a == "--tokenizer") o.tokenizer = value();
    else if (a == "--template") o.chat_template = value();
    else if (a == "--max-source-length") o.max_source_length = at_least<std::int64_t>(a, value(), 1);
    else if (a == "--max-target-length") o.max_target_length = at_least<std::int64_t>(a, value(), 1);
    else if (a == "--eval-data") o.eval_data = file_list(a, value());
    else if (a == "--eval-every") o.eval_every = at_least<int>(a, value(), 0);
    else if (a == "--eval-batches") o.eval_batches = at_least<int>(a, value(), 1);
    else if (a == "--steps") o.steps = at_least<std::int64_t>(a, value(), 1);
    else if (a == "--save") o.save = value();
    else if (a == "--save-every") o.save_every = at_least<int>(a, value(), 0);
    else if (a == "--keep-last") o.keep_last = at_least<int>(a, value(), 1);
    else if (a == "--export-hf") o.export_hf = value();
    else if (a == "--resume") o.resume = value();
    else if (a == "--init-from") o.init_from = value();
    else if (a == "--precision") o.precision = examples::cli::precision(a, value());
    else if (a == "--seed") o.seed = number<std::uint64_t>(a, value());
    else if (a == "--arch") {
      const std::string arch = value();
      if (arch != "llama" && arch != "chatglm") throw bad_args("--arch must be llama or chatglm, got '" + arch.substr(0, 32) + "'");
      const llama::config sizes = o.model;
      if (arch == "chatglm") o.model = llama::config::chatglm();
      else o.model = llama::config{};
      o.model.dim = sizes.dim, o.model.n_layers = sizes.n_layers, o.model.n_heads = sizes.n_heads, o.model.n_kv_heads = sizes.n_kv_heads;
      o.model.hidden_dim = sizes.hidden_dim, o.model.vocab = sizes.vocab, o.model.seq_len = sizes.seq_len;
    } else if (a == "--dim") o.model.dim = number<loom::index_t>(a, value());
    else if (a == "--n-layers") o.model.n_layers = number<loom::index_t>(a, value());
    else if (a == "--n-heads") o.model.n_heads = number<loom::index_t>(a, value());
    else if (a == "--n-kv-heads") o.model.n_kv_heads = number<loom::index_t>(a, value());
    else if (a == "--hidden-dim") o.model.hidden_dim = number<loom::index_t>(a, value()), hidden_given = true;
    else if (a == "--vocab") o.model.vocab = number<loom::index_t>(a, value());
    else if (a == "--seq-len" || a == "--seq") o.model.seq_len = number<loom::index_t>(a, value());
    else if (a == "--tied") o.model.tied_output = true;
    else if (a == "--checkpointing") o.checkpointing = true;
    else if (a == "--lr") o.lr = number<float>(a, value());
    else if (a == "--warmup") o.warmup = number<std::int64_t>(a, value());
    else if (a == "--weight-decay") o.weight_decay = number<float>(a, value());
    else if (a == "--clip") o.clip = number<float>(a, value());
    else if (a == "--batch") o.batch = at_least<std::int64_t>(a, value(), 1);
    else if (a == "--grad-accum" || a == "--micro-batches") o.grad_accum = at_least<std::int64_t>(a, value(), 1);
    else if (a == "--print-every") o.print_every = at_least<std::int64_t>(a, value(), 1);
    else if (a == "--group") o.groups.groups.push_back(llama_train::parse_group(value()));
    else if (a == "--unfreeze") o.groups.phases = llama_train::parse_unfreeze(value());
    else if (a == "--group-lr") o.group_lr.push_back(llama_train::parse_group_value(a, value()));
    else if (a == "--group-wd") o.group_wd.push_back(llama_train::parse_group_value(a, value()));
    else if (a == "--lora-r") lora().r = at_least<loom::index_t>(a, value(), 1);
    else if (a == "--lora-alpha") lora().lora_alpha = number<double>(a, value());
    else if (a == "--lora-dropout") lora().lora_dropout = number<double>(a, value());
    else if (a == "--lora-targets") lora().target_modules = loom::lora::parse_targets(value());
    else if (a == "--rslora") lora().use_rslora = true;
    else if (a == "--lora-merged") lora(), o.lora_merged = true;
    else if (a == "--lora-from") lora(), o.lora_from = value();
    else if (a == "--export-lora") lora(), o.export_lora = value();
    else if (a == "--lora-base") {
      lora(), o.lora_base = value();
      if (o.lora_base != "fp32" && o.lora_base != "bf16" && o.lora_base != "nf4")
        throw bad_args("--lora-base must be fp32, bf16 or nf4, got '" + o.lora_base + "'");
    }
    else return false;
    return true;
  });
  if (o.lora) {
    try {
      o.lora->validate();
    } catch (const loom::error& e) {
      throw bad_args(e.what());
    }
  }
  if (!hidden_given) o.model.hidden_dim = llama::config::default_hidden_dim(o.model.dim);
  if (o.data.empty()) o.data.push_back(LLAMA_DEFAULT_DATA);
  if (const int n = llama_train::mpi_launch_size(); n > 1 && o.mesh.size() == 1) o.mesh.dp = n;  // mpirun -np N: dp = N by default
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  llama_train::options o;
  bool help = false;
  try {
    o = parse(argc, argv, help);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama-train: %s\n%s", e.what(), usage);
    return 2;
  }
  if (help) {
    std::fputs(usage, stdout);
    return 0;
  }
  // under mpirun rank 0 prints; a failure ends every process (MPI_Abort), never a hang in MPI_Finalize
  return loom::comm::run_or_fail("llama-train", [&] {
    llama_train::run(o, llama_train::mpi_launch_rank() == 0 ? &std::cout : nullptr);
    return 0;
  });
}
