#pragma once
// llama-train: the one LLaMA / ChatGLM training program. Every run -- one rank or a
// dp x tp x pp mesh, ZeRO 0-3, offload, fp32 / bf16 / fp16, token shards or chat records --
// is the mesh trainer (train3d/train3d.hpp) on thread ranks, or on the processes of mpirun.
//
// This header is the program's interface: its options, its results, and run(), which is
// compiled once (train.cpp and train_rank.cpp, the static library llama_train_lib) and
// shared by the CLI (llama_train.cpp), the demo and the tests, so that the trainer's
// templates are instantiated once per build rather than once per program that trains.
// docs/training.md lists the flags and the ds_config keys.

#include <llama/model/config.hpp>
#include <loom/comm/mesh.hpp>
#include <loom/core/dtype.hpp>
#include <loom/io/ds_config.hpp>
#include <loom/lora/config.hpp>
#include <loom/optim/param_groups.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace llama_train {

struct options {
  std::string config_path;  ///< ds_config.json ("" = the flags below)
  bool allow_unknown = false;
  llama::config model{.dim = 64, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .hidden_dim = 192, .vocab = 256, .seq_len = 64};
  loom::comm::mesh_shape mesh{1, 1, 1};  ///< data x tensor x pipeline ranks (threads, or mpirun's processes)
  std::string schedule = "1f1b";         ///< gpipe | 1f1b | interleaved
  int chunks = 1;                        ///< model chunks per pipeline stage (interleaved)
  int zero = 0;                          ///< ZeRO stage without a config (a config's stage wins)
  std::int64_t steps = 50;               ///< total optimizer steps (a resumed run continues up to it)
  /// token shards (uint16), one chat .jsonl, or "counting" (a learnable synthetic stream);
  /// empty: the program's default corpus
  std::vector<std::string> data;
  std::string tokenizer;           ///< chat records: bytes (default), tokenizer.model or tokenizer.bin
  std::string chat_template;       ///< chat records: chatglm2 (default), chatglm3, llama2
  /// chat records: ChatGLM's max_source_length / max_target_length (ids of the prompt side and
  /// of the response per row; 0: half the row each). Both given: the row is their sum.
  std::int64_t max_source_length = 0, max_target_length = 0;
  std::vector<std::string> eval_data;  ///< held-out files for --eval-every (counting data: held-out batches)
  int eval_every = 0;                  ///< evaluate after every N steps (0: never)
  int eval_batches = 1;                ///< global batches per evaluation
  /// a Hugging Face LLaMA / ChatGLM2/3 folder to start from: its config.json gives the model's
  /// shape (model.seq_len stays the training length), each rank reads only its slices
  std::string init_from;
  std::string save, resume;            ///< sharded checkpoints: DIR/step-<N>, DIR/latest
  int save_every = 0;                  ///< also save every N steps (0: only at the end)
  int keep_last = 0;                   ///< keep the newest K checkpoints (0: all)
  std::string export_hf;               ///< after the last save: the model as a Hugging Face folder
  std::optional<loom::dtype> precision;  ///< --precision; a config's fp16/bf16 win, "auto" takes this
  std::uint64_t seed = 1234;
  float lr = 1e-3f;
  std::int64_t warmup = 0;
  float weight_decay = 0.01f;
  float clip = 1.f;             ///< for gradient_clipping "auto"
  std::int64_t batch = 8;       ///< micro batch without a config
  std::int64_t grad_accum = 1;  ///< micro-batches per data-parallel rank and step, without a config
  std::int64_t print_every = 1;
  bool checkpointing = false;   ///< also on when the config has activation_checkpointing
  /// LoRA adapters on a frozen base (--lora-r, --lora-alpha, --lora-dropout, --lora-targets,
  /// --rslora); empty: every parameter trains
  std::optional<loom::lora::config> lora;
  std::string lora_from;    ///< a PEFT adapter folder to start the adapters from
  std::string export_lora;  ///< after the last step: the adapters as a PEFT folder
  std::string lora_base = "fp32";  ///< --lora-base: the frozen base's projections as fp32, bf16 or nf4 (QLoRA)
  bool lora_merged = false;        ///< --lora-merged: an fp32 base with the adapters merged each step (llama3d::train_options)
  /// Parameter groups and progressive unfreezing by flags (--group, --unfreeze), else the
  /// config's "param_groups" / "progressive_unfreezing" (not both); --group-lr / --group-wd
  /// set a group's lr / weight_decay (of either source; "base" included).
  loom::optim::param_groups groups;
  std::vector<std::pair<std::string, float>> group_lr, group_wd;
};

/// --group NAME=GLOB[,GLOB...][@FIRST:LAST] (either bound may be empty; negative: from the end).
loom::optim::param_group parse_group(const std::string& spec);
/// --unfreeze UNTIL:GROUP[+GROUP...][,UNTIL:...], e.g. "0.3:lora,0.7:lora+top,1:lora+top+base".
std::vector<loom::optim::unfreeze_phase> parse_unfreeze(const std::string& spec);
/// --group-lr / --group-wd NAME=VALUE.
std::pair<std::string, float> parse_group_value(const std::string& flag, const std::string& spec);
/// The name the groups' globs match for a tensor of loom's name: HF's (model.layers.3.self_attn.q_proj.weight,
/// ChatGLM's transformer.encoder...), and for a LoRA factor PEFT's without its base_model.model. prefix
/// (model.layers.3.self_attn.q_proj.lora_A.weight).
std::string group_name(const llama::config& c, const std::string& loom_name);

struct step_record {
  std::int64_t step = 0;  ///< 1-based
  double loss = 0;        ///< mean over the step's global batch
  float lr = 0, scale = 1;
  bool skipped = false;
  double grad_norm = 0;
  double seconds = 0, tokens_per_s = 0, flops_per_s = 0;
  std::size_t mem_bytes = 0, peak_bytes = 0;  ///< the largest rank's
  std::optional<double> eval_loss;            ///< after this step, with --eval-every
};

struct train_result {
  std::vector<step_record> steps;
  std::vector<float> params;  ///< final fp32 master weights, in the single-rank flat layout (LoRA: the adapters', llama3d::lora_full_layout)
  std::int64_t parameter_count = 0;
  /// Rank 0: the most parameter memory the rank held (its share of the parameters plus what
  /// ZeRO-3 gathered at once), and the unpartitioned stage's bytes.
  std::size_t parameter_peak_bytes = 0, parameter_full_bytes = 0;
  std::size_t largest_unit_bytes = 0;  ///< the largest piece ZeRO-3 gathers (a decoder block, the embedding)
  std::string checkpoint;              ///< the last checkpoint saved ("" if none)
};

/// The resolved ds_config for these options (the flags' values when there is no config).
loom::io::ds_config resolve_config(const options& o);

/// "step 12/50 | loss 2.3456 | lr 1.00e-03 | grad_norm 0.123 | 12345 tok/s | 1.23 GFLOP/s | mem 12.3 MiB (peak 14.5)"
std::string progress_line(const step_record& r, std::int64_t total, bool show_scale);

/// Trains as the options and config say: on the processes of mpirun when started by it (the
/// mesh must have as many ranks), else on mesh.size() thread ranks (one rank: no thread).
/// Prints progress to `log` (may be null). Returns rank 0's result (MPI: this process's).
/// Collective under MPI; throws loom::error naming the option or file at bad input.
train_result run(const options& o, std::ostream* log);

/// Number of processes when started by mpirun (Open MPI's or a PMI launcher's environment), else 0.
int mpi_launch_size();
/// This process's rank when started by mpirun, else 0.
int mpi_launch_rank();

}  // namespace llama_train
