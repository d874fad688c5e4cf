#pragma once
// llama-train's options, results and progress line. Every run -- one rank or several, any
// ZeRO stage, offload -- is the mesh trainer (train3d/train3d.hpp) at dp = ranks, tp = pp = 1:
// zero_trainer.hpp maps these options and the ds_config onto it and run.hpp chooses thread
// ranks or MPI processes. --save/--resume are its sharded checkpoints (docs/checkpoints.md):
// a resumed run repeats an uninterrupted one bit for bit, and may resume on another number
// of ranks or ZeRO stage.

#include <llama/model/config.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/io/ds_config.hpp>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace llama_train {

struct options {
  std::string config_path;    ///< ds_config.json ("" = defaults below)
  bool allow_unknown = false;
  llama::config model{.dim = 64, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .hidden_dim = 192, .vocab = 256, .seq_len = 64};
  std::int64_t steps = 50;    ///< total optimizer steps (a resumed run continues up to it)
  std::vector<std::string> data;
  std::string save, resume;  ///< sharded checkpoint directories (save: DIR/step-N and DIR/latest)
  std::optional<loom::dtype> precision;  ///< --precision; the config's fp16/bf16 win, "auto" takes this
  std::uint64_t seed = 1234;
  float lr = 1e-3f;
  std::int64_t warmup = 0;
  float weight_decay = 0.01f;
  float clip = 1.f;            ///< for gradient_clipping "auto"
  std::int64_t batch = 8;      ///< micro batch without a config
  std::int64_t grad_accum = 1;
  std::int64_t print_every = 1;
  int ranks = 1;               ///< data-parallel ranks (threads, or the processes of mpirun)
  bool checkpointing = false;  ///< also on when the config has activation_checkpointing
};

struct step_record {
  std::int64_t step = 0;  ///< 1-based
  double loss = 0;        ///< mean over the step's micro-batches
  float lr = 0, scale = 1;
  bool skipped = false;
  double grad_norm = 0;
  double seconds = 0, tokens_per_s = 0, flops_per_s = 0;
  std::size_t mem_bytes = 0, peak_bytes = 0;
};

struct train_result {
  std::vector<step_record> steps;
  std::vector<float> params;  ///< final fp32 master weights, in the single-rank flat layout
  std::int64_t parameter_count = 0;
  /// Rank 0: the most parameter memory the rank held (its share of the parameters plus what
  /// ZeRO-3 gathered at once), and the unpartitioned model's bytes.
  std::size_t parameter_peak_bytes = 0, parameter_full_bytes = 0;
  std::size_t largest_unit_bytes = 0;  ///< the largest piece ZeRO-3 gathers (a decoder block, the embedding)
};

/// The resolved ds_config for these options (defaults when no --config).
inline loom::io::ds_config resolve_config(const options& o) {
  loom::io::ds_config c = o.config_path.empty() ? loom::io::parse_ds_config(nlohmann::json::object())
                                                : loom::io::load_ds_config(o.config_path, {o.allow_unknown});
  if (o.config_path.empty()) c.micro_batch_given = o.batch, c.grad_accum_given = o.grad_accum;
  loom::io::ds_context ctx{.world_size = o.ranks, .hidden_size = o.model.dim, .total_steps = o.steps, .warmup_steps = o.warmup, .lr = o.lr,
                           .weight_decay = o.weight_decay, .gradient_clipping = o.clip,
                           .precision = o.precision.value_or(loom::dtype::f32), .micro_batch = o.batch, .grad_accum = o.grad_accum};
  loom::io::resolve_ds_config(c, ctx);
  LOOM_CHECK(!o.precision || c.precision() == *o.precision || o.config_path.empty(), "llama-train: --precision ",
             loom::dtype_name(*o.precision), " contradicts the config's ", loom::dtype_name(c.precision()), " (", o.config_path, ")");
  if (o.config_path.empty() && o.precision) {
    c.fp16.enabled.value = *o.precision == loom::dtype::f16;
    c.bf16.value = *o.precision == loom::dtype::bf16;
  }
  return c;
}

/// "step 12/50 | loss 2.3456 | lr 1.00e-03 | 12345 tok/s | 1.23 GFLOP/s | mem 12.3 MiB (peak 14.5)"
inline std::string progress_line(const step_record& r, std::int64_t total, bool show_scale) {
  char buf[256];
  int n = std::snprintf(buf, sizeof buf, "step %lld/%lld | loss %.4f | lr %.3e | %.0f tok/s | %.3f GFLOP/s | mem %.1f MiB (peak %.1f)",
                        static_cast<long long>(r.step), static_cast<long long>(total), r.loss, static_cast<double>(r.lr), r.tokens_per_s,
                        r.flops_per_s * 1e-9, static_cast<double>(r.mem_bytes) / 1048576.0, static_cast<double>(r.peak_bytes) / 1048576.0);
  if (show_scale && n > 0 && n < static_cast<int>(sizeof buf))
    std::snprintf(buf + n, sizeof buf - static_cast<std::size_t>(n), " | scale %g%s", static_cast<double>(r.scale),
                  r.skipped ? " (overflow: step skipped)" : "");
  return buf;
}

}  // namespace llama_train
