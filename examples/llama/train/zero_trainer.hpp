#pragma once
// Data-parallel LLaMA training with ZeRO: `llama-train --ranks N` (thread ranks), or the
// same binary under `mpirun -np N` (MPI processes, when built with loom::mpi).
//
// Each rank holds a llama::model (its forward/backward work on the model's own flat
// buffers), a token loader reading its stride of every global batch, and a zero::engine
// that owns the rank's model states as the configured stage partitions them. The LLaMA's
// forward and backward are whole-model calls, so the adapter below presents the model to
// the engine as layers (embedding, one per transformer block, final norm + output) whose
// parameters are copied into the model before the whole-model forward runs at the last
// layer, and whose gradients are copied out (converted to the parameter type, times the
// loss scale) during the engine's backward. The engine then does what ZeRO does: bucketed
// all-reduce / reduce-scatter of gradients, AdamW on each rank's fp32 master shard,
// parameter all-gather (stage 3: layer by layer through the all-gather scheduler).
// Consequence, said plainly: the model's own full parameter and gradient buffers exist on
// every rank besides the engine's partitioned states; the memory line reports the engine's
// states (what ZeRO partitions). A layer-wise model (tests/zero's toy model) avoids that.
//
// Same step as trainer.hpp: G micro-batches, loss scaling with overflow skip, clipping,
// lr schedule; the loss printed is the mean over all ranks.

#include "trainer.hpp"  // options, results, progress_line

#include <loom/comm/thread_comm.hpp>
#include <loom/zero/engine.hpp>
#ifdef LOOM_HAS_MPI
#include <common/fail_fast.hpp>
#include <loom/comm/mpi_comm.hpp>
#include <mpi.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

namespace llama_train {

/// Engine layer of a LLaMA parameter: 0 embedding, 1 + i for block i, n_layers + 1 for the rest.
inline std::size_t zero_layer_of(const std::string& name, loom::index_t n_layers) {
  if (name.rfind("tok_embeddings", 0) == 0) return 0;
  if (name.rfind("layers.", 0) == 0) return 1 + std::stoul(name.substr(7));
  return static_cast<std::size_t>(n_layers) + 1;
}

/// The LLaMA as a zero::layered_model (see the file comment).
template <class P>
struct zero_llama_adapter {
  llama::model<P>* model;
  const loom::zero::flat_layout* layout;
  std::vector<std::size_t> model_offset;  // engine parameter -> offset in the model's flat buffer
  loom::data::token_loader* loader;
  loom::data::token_batch* batch;
  std::int64_t G = 1;
  float scale = 1.f;
  double loss = 0;

  template <class T>
  void forward(std::size_t l, const loom::zero::layer_params<const T>& p) {
    auto dst = model->params();
    for (std::size_t k = 0; k < p.size(); ++k) std::ranges::copy(p.span(k), dst.begin() + model_offset[p.global_index(k)]);
    if (l + 1 != layout->layers()) return;
    model->zero_grad();
    loss = 0;
    for (std::int64_t m = 0; m < G; ++m) {
      loader->next(*batch);
      const loom::extents<2> shape{static_cast<loom::index_t>(batch->batch), static_cast<loom::index_t>(batch->seq_len)};
      loss += model->forward({batch->tokens.data(), shape}, {batch->targets.data(), shape}) / static_cast<double>(G);
      model->backward(scale / static_cast<float>(G));
    }
  }
  template <class T>
  void backward(std::size_t, const loom::zero::layer_params<const T>&, const loom::zero::layer_params<T>& g) {
    auto src = model->grads();
    for (std::size_t k = 0; k < g.size(); ++k) {
      auto out = g.span(k);
      const std::size_t off = model_offset[g.global_index(k)];
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<T>(src[off + i]);
    }
  }
};

inline loom::zero::offload_device zero_offload(loom::io::offload_device d) {
  switch (d) {
    case loom::io::offload_device::cpu: return loom::zero::offload_device::cpu;
    case loom::io::offload_device::nvme: return loom::zero::offload_device::nvme;
    default: return loom::zero::offload_device::none;
  }
}

/// The engine options a resolved ds_config asks for.
inline loom::zero::engine_options zero_engine_options(const loom::io::ds_config& c) {
  loom::zero::engine_options e;
  e.adamw = c.optimizer.adamw();
  e.reduce_bucket_numel = static_cast<std::size_t>(c.zero.reduce_bucket_size.value);
  e.overlap_comm = c.zero.overlap();
  e.contiguous_gradients = c.zero.contiguous_gradients;
  e.stage3 = {static_cast<std::size_t>(c.zero.stage3_prefetch_bucket_size.value),
              static_cast<std::size_t>(c.zero.stage3_max_live_parameters),
              static_cast<std::size_t>(c.zero.stage3_param_persistence_threshold.value)};
  e.gradient_clipping = c.gradient_clipping.value;
  e.offload_optimizer = zero_offload(c.zero.offload_optimizer.device);
  e.nvme_path = c.zero.offload_optimizer.nvme_path;
  return e;
}

template <class Stage, class P, loom::comm::communicator C>
train_result run_zero_rank(C& comm, const options& o, const loom::io::ds_config& c, std::ostream* log) {
  const int rank = comm.rank(), world = comm.size();
  if (rank == 0 && log && c.zero.offload_param.device == loom::io::offload_device::cpu)
    *log << "llama-train: offload_param cpu: the host backend keeps parameters in host memory already" << std::endl;
  loom::host_memory_resource model_mem("llama-model"), states("zero-states"), scratch("zero-scratch"), host("zero-host");
  llama::model<P> model(o.model, model_mem);
  model.init(o.seed);
  model.set_checkpointing(o.checkpointing || c.activation_checkpointing.enabled);
  const std::int64_t G = c.gradient_accumulation_steps, micro = c.train_micro_batch_size_per_gpu;
  loom::data::token_loader loader(loom::data::open_shards(o.data, loom::data::token_width::u16),
                                  {.seq_len = std::size_t(o.model.seq_len), .batch = std::size_t(micro),
                                   .vocab_size = std::uint32_t(o.model.vocab), .seed = o.seed, .rank = rank, .world = world});
  loom::data::token_batch batch;

  // engine layout: the model's parameters grouped by layer (stable order within a layer)
  std::vector<loom::nn::param_info> entries = model.layout().entries();
  std::stable_sort(entries.begin(), entries.end(), [&](const auto& a, const auto& b) {
    return zero_layer_of(a.name, o.model.n_layers) < zero_layer_of(b.name, o.model.n_layers);
  });
  std::vector<loom::zero::param_spec> specs;
  zero_llama_adapter<P> adapter{&model, nullptr, {}, &loader, &batch, G};
  for (const auto& e : entries) {
    specs.push_back({e.name, e.shape, zero_layer_of(e.name, o.model.n_layers)});
    adapter.model_offset.push_back(e.offset);
  }
  const std::span<const P> init_params = model.params();
  loom::zero::engine<Stage, P, C> engine(
      comm, loom::zero::flat_layout(std::move(specs), std::size_t(world)), zero_engine_options(c), {&states, &scratch, &host},
      [&](std::size_t p, std::size_t first, std::span<float> out) {
        for (std::size_t k = 0; k < out.size(); ++k) out[k] = static_cast<float>(init_params[adapter.model_offset[p] + first + k]);
      });
  adapter.layout = &engine.layout();

  any_loss_scaler scaler = make_loss_scaler(c);
  const auto sched = c.lr_schedule();

  train_result res;
  res.parameter_count = static_cast<std::int64_t>(model.parameter_count());
  std::int64_t iteration = 0;
  for (std::int64_t s = 1; s <= o.steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    adapter.scale = std::visit([](const auto& sc) { return sc.scale(); }, scaler);
    const float lr = sched.lr(iteration);
    engine.set_lr(lr);
    engine.forward(adapter);
    engine.backward(adapter);
    const bool applied = engine.step(1.f / adapter.scale);
    std::visit([&](auto& sc) { sc.update(!applied); }, scaler);
    if (applied) ++iteration;
    float loss = static_cast<float>(adapter.loss);
    comm.all_reduce(std::span<const float>(&loss, 1), std::span<float>(&loss, 1), loom::comm::reduce_op::avg);
    step_record r{.step = s, .loss = loss, .lr = lr, .scale = adapter.scale, .skipped = !applied,
                  .grad_norm = engine.last_grad_norm()};
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tokens = static_cast<double>(G * micro * world * o.model.seq_len);
    r.tokens_per_s = tokens / r.seconds;
    r.flops_per_s = tokens * model.flops_per_token(o.model.seq_len) / r.seconds;
    r.mem_bytes = states.current_bytes(), r.peak_bytes = states.peak_bytes();
    if (rank == 0 && log && (s % o.print_every == 0 || s == o.steps))
      *log << progress_line(r, o.steps, c.precision() == loom::dtype::f16) << " | rank0 zero states" << std::endl;
    res.steps.push_back(r);
  }
  res.params = engine.gather_master();
  if (rank == 0 && log) {
    const auto b = engine.bytes();
    *log << "zero stage " << Stage::level << " x " << world << " ranks: per-rank states " << b.parameters << " B params + "
         << b.persistent << " B persistent + " << b.gradients << " B grads + " << b.optimizer << " B optimizer ("
         << (engine.optimizer().where() == loom::zero::offload_device::none ? "on device" : "offloaded") << ")" << std::endl;
  }
  return res;
}

/// Number of processes when started by mpirun (Open MPI's or a PMI launcher's environment), else 0.
inline int mpi_launch_size() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

/// This process's rank when started by mpirun, else 0.
inline int mpi_launch_rank() {
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMI_RANK"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

template <class C>
train_result run_zero_on(C& comm, const options& o, const loom::io::ds_config& c, std::ostream* log) {
  return loom::zero::dispatch_stage(c.zero.stage, [&](auto stage) {
    using S = decltype(stage);
    switch (c.precision()) {
      case loom::dtype::bf16: return run_zero_rank<S, loom::bfloat16>(comm, o, c, log);
      case loom::dtype::f16: return run_zero_rank<S, loom::half>(comm, o, c, log);
      default: return run_zero_rank<S, float>(comm, o, c, log);
    }
  });
}

/// Runs llama-train with the config's ZeRO stage: on the MPI processes when started by
/// mpirun (o.ranks is then the process count), else on o.ranks thread ranks. Returns this
/// process's rank-0 result (MPI: each process's own).
inline train_result run_zero(const options& o, const loom::io::ds_config& c, std::ostream* log) {
  LOOM_CHECK(o.resume.empty() && o.save.empty(), "llama-train: --save/--resume are single-rank only for now (--ranks ",
             o.ranks, ")");
  // offload_param: DeepSpeed moves the fp16 parameters from the GPU to host memory; on the
  // host backend they live in host memory already, so "cpu" holds by construction (the
  // parser refuses "nvme" for parameters; docs/training.md).
  LOOM_CHECK(c.zero.offload_param.device == loom::io::offload_device::none ||
                 c.zero.offload_param.device == loom::io::offload_device::cpu,
             "llama-train: zero_optimization.offload_param: only device \"cpu\" (or \"none\") is supported");
#ifdef LOOM_HAS_MPI
  if (mpi_launch_size() > 1) {
    int init = 0;
    MPI_Initialized(&init);
    if (!init) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    }
    train_result r;
    try {
      loom::comm::mpi_comm comm = loom::comm::mpi_comm::world();
      LOOM_CHECK(comm.size() == o.ranks, "llama-train: --ranks ", o.ranks, " differs from the ", comm.size(), " MPI processes");
      r = run_zero_on(comm, o, c, comm.rank() == 0 ? log : nullptr);
    } catch (const std::exception& e) {  // one failed process must not leave the others waiting
      examples::fail("llama-train", e.what());
    }
    if (!init) MPI_Finalize();
    return r;
  }
#endif
  train_result out;
  loom::comm::run_ranks(o.ranks, [&](loom::comm::thread_comm& comm) {
    train_result r = run_zero_on(comm, o, c, log);
    if (comm.rank() == 0) out = std::move(r);
  });
  return out;
}

}  // namespace llama_train
