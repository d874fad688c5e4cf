#pragma once
// Shared by the thread-rank and MPI tests of QLoRA in the 3D trainer (test_train3d_qlora,
// test_train3d_mpi): the adapters and options the tests train with, and one rank's run.
#include "train3d_suite.hpp"

#include <loom/comm/any_comm.hpp>
#include <loom/quant/nf4.hpp>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace qlora_suite {

using loom::comm::any_comm;

using qlora_trainer = llama3d::trainer<float, float, any_comm>;

// Targets on both splits: q/v/up column-parallel, o/down row-parallel.
inline loom::lora::config qlora_adapters(loom::index_t r = 4) {
  loom::lora::config l;
  l.r = r, l.lora_alpha = 8;
  l.target_modules = {"q_proj", "v_proj", "o_proj", "up_proj", "down_proj"};
  return l;
}

// AdamW with eps = 1 (far above sqrt(v) ~ |g|): the update is lr g / (|g| + 1), about lr g, so
// two runs' adapters differ as their gradients do (a normalised step would turn a rounding
// difference in a near-zero gradient into a full-size one). No clipping, no weight decay.
inline llama3d::train_options qlora_options(loom::comm::mesh_shape mesh, int zero, llama3d::lora_base base) {
  auto o = train3d_suite::options(mesh, zero, "1f1b", 4 / mesh.dp);
  o.lora = qlora_adapters();
  o.lora_base = base;
  o.nf4.block_size = 8;  // divides every shard's rows of the tiny model at tp 2 (wo: 8 columns)
  o.nf4.absmax_block_size = 4;
  o.adamw.lr = 0.5f, o.adamw.eps = 1.f, o.adamw.weight_decay = 0.f;
  o.gradient_clipping = 0.f;
  return o;
}

struct qlora_result {
  std::vector<double> losses;
  double eval = 0;               // evaluate() after the steps
  std::size_t partitioned = 0;   // rank 0's slices of a partitioned base (ZeRO-3)
  std::vector<float> adapters;
  std::vector<float> base;       // full layout: the projections dequantised as the ranks hold them
  std::vector<char> quantised;   // full layout: which elements are projections
};

// Whether a tensor of the decoder is one of a block's projections (what a quantised base holds
// outside the model's flat buffer).
inline bool is_projection(const std::string& name) {
  return name.find("attention.w") != std::string::npos || name.find("feed_forward.w") != std::string::npos;
}
// The projections' elements in a layout.
inline std::size_t projection_numel(const loom::nn::param_layout& layout) {
  std::size_t n = 0;
  for (const auto& e : layout.entries())
    if (is_projection(e.name)) n += e.numel;
  return n;
}

inline void qlora_steps(qlora_trainer& t, const llama::config& cfg, const llama3d::train_options& o, int n, std::vector<double>& losses) {
  for (int s = 0; s < n; ++s)
    losses.push_back(t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
                       llama3d::counting_batch(7, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
                     }).loss);
}

// Biases (ChatGLM's q/k/v) made nonzero, by their index in the full tensor (the same values on
// every mesh): the counter-RNG init gives them 0, which would leave their path untested.
inline void set_biases(qlora_trainer& t) {
  auto& m = t.model();
  const auto p = m.params();
  for (const auto& s : m.shards())
    if (s.name.ends_with(".bias"))
      for (loom::index_t r = 0; r < s.rows; ++r) p[s.local_offset + static_cast<std::size_t>(r)] = 0.05f * std::sin(float(s.row0 + r + 1));
}

// One rank's run on any communicator: n steps, then evaluate(). base(model, shard, values) is
// called for each projection shard dp rank 0 holds (its first replica) with the values it
// dequantises to (frozen_values: collective over dp when the base is partitioned). Losses,
// eval and the adapters are every rank's (consolidated_lora gathers them on each); partitioned
// is this rank's bytes of a partitioned base.
template <class BaseFn>
qlora_result qlora_rank(any_comm& world, const llama::config& cfg, const llama3d::train_options& o, int n, BaseFn&& base) {
  qlora_trainer t(world, cfg, o, loom::default_resource<loom::host>());
  set_biases(t);
  const auto& m = t.model();
  for (std::size_t k = 0; k < m.frozen_shards().size(); ++k) {
    const std::vector<float> v = t.frozen_values(k);
    const auto& s = m.frozen_shards()[k];
    if (t.mesh().coord().dp == 0 && s.replica == 0) base(m, s, v);
  }
  qlora_result out;
  out.partitioned = t.frozen_partition() ? t.frozen_partition()->shard_bytes() : 0;
  qlora_steps(t, cfg, o, n, out.losses);
  out.adapters = t.consolidated_lora();
  out.eval = t.evaluate([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
    llama3d::counting_batch(8, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
  });
  return out;
}

}  // namespace qlora_suite
