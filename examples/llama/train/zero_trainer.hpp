#pragma once
// llama-train's training run: `llama-train --ranks N` (thread ranks; N = 1 by default), or the
// same binary under `mpirun -np N` (MPI processes, when built with loom::mpi).
//
// This is the mesh trainer (train3d/train3d.hpp) at dp = N, tp = pp = 1: one trainer, the
// library's zero::engine owning each rank's parameters, gradients and optimizer state as the
// configured stage partitions them (stage 3 gathers one decoder block at a time, with the
// config's prefetch bucket and live-parameters cap), and the model's layers reading their
// parameters from the engine. What this file adds is llama-train's side: the ds_config's
// options, the data (include/loom/data/batches.hpp: micro-batch g of step t is batch t G + g,
// whatever the number of ranks), the lr schedule, --save/--resume (sharded checkpoints) and
// llama-train's progress lines.

#include "trainer.hpp"  // options, results, progress_line

#include <loom/data/batches.hpp>
#include <loom/zero/ds_config.hpp>
#include <loom/zero/ds_config.hpp>
#include <llama/train3d/checkpoint.hpp>
#include <loom/comm/self_comm.hpp>
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

/// The mesh trainer's options for a resolved ds_config on `world` data-parallel ranks.
inline llama3d::train_options zero_train_options(const options& o, const loom::io::ds_config& c, int world) {
  const loom::zero::engine_options e = loom::zero::engine_options_from(c);
  llama3d::train_options t;
  t.mesh = {world, 1, 1};
  t.zero_stage = c.zero.stage;
  t.schedule = "1f1b";  // one pipeline stage: each micro-batch's forward, then its backward
  t.micro_batches = static_cast<int>(c.gradient_accumulation_steps);
  t.micro_batch_size = static_cast<loom::index_t>(c.train_micro_batch_size_per_gpu);
  t.seq = o.model.seq_len;
  t.adamw = e.adamw;
  t.gradient_clipping = e.gradient_clipping;
  t.stage3 = e.stage3;
  t.offload_optimizer = e.offload_optimizer;
  t.nvme_path = e.nvme_path;
  t.seed = o.seed;
  t.checkpointing = o.checkpointing || c.activation_checkpointing.enabled;
  t.loss_scaler = loom::zero::loss_scaler_from(c);
  return t;
}

template <class P, loom::comm::communicator C>
train_result run_zero_rank(C& comm, const options& o, const loom::io::ds_config& c, std::ostream* log) {
  const int rank = comm.rank(), world = comm.size();
  if (rank == 0 && log && c.zero.offload_param.device == loom::io::offload_device::cpu)
    *log << "llama-train: offload_param cpu: the host backend keeps parameters in host memory already" << std::endl;
  loom::host_memory_resource mem("llama-train rank"), params("parameters");
  const llama3d::train_options to = zero_train_options(o, c, world);
  llama3d::trainer<P, float, C> t(comm, o.model, to, mem, &params);
  const int G = world * to.micro_batches;  // micro-batches per step, all ranks together
  loom::data::batch_loader loader = loom::data::make_batch_loader(o.data, o.model.vocab, o.model.seq_len, to.micro_batch_size, o.seed);
  loom::data::token_batch batch;
  const auto data = [&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
    loom::data::global_micro_batch(loader, step, g, G, batch);
    std::copy(batch.tokens.begin(), batch.tokens.end(), tok.begin());
    std::copy(batch.targets.begin(), batch.targets.end(), tgt.begin());
  };
  const auto sched = c.lr_schedule();
  train_result res;
  res.parameter_count = static_cast<std::int64_t>(t.model().layout().parameter_count());
  if (!o.resume.empty()) llama3d::load_checkpoint(t, o.resume);
  LOOM_CHECK(o.steps >= t.steps(), "llama-train: --steps ", o.steps, " is below the resumed checkpoint's step ", t.steps());
  if (rank == 0 && log)
    *log << "parameters " << res.parameter_count
         << (o.resume.empty() ? "" : ", resumed from " + loom::checkpoint::resolve(o.resume) + " at step " + std::to_string(t.steps()))
         << std::endl;
  for (std::int64_t s = t.steps() + 1; s <= o.steps; ++s) {
    const float lr = sched.lr(t.steps());  // a skipped step does not advance the schedule (DeepSpeed)
    t.set_lr(lr);
    const auto st = t.step(data);
    step_record r{.step = s, .loss = st.loss, .lr = lr, .scale = st.loss_scale, .skipped = st.skipped,
                  .grad_norm = st.grad_norm};
    r.seconds = st.seconds;
    const double tokens = static_cast<double>(G * to.micro_batch_size * o.model.seq_len);
    r.tokens_per_s = tokens / r.seconds;
    r.flops_per_s = tokens * o.model.flops_per_token(o.model.seq_len) / r.seconds;
    r.mem_bytes = mem.current_bytes() + params.current_bytes(), r.peak_bytes = mem.peak_bytes() + params.peak_bytes();
    if (rank == 0 && log && (s % o.print_every == 0 || s == o.steps))
      *log << progress_line(r, o.steps, c.precision() == loom::dtype::f16) << " | rank0" << std::endl;
    res.steps.push_back(r);
  }
  if (rank == 0 && log && res.steps.size() > 1) {  // the first step pays for allocations and cold caches
    double sec = 0, tok = 0, fl = 0;
    for (std::size_t i = 1; i < res.steps.size(); ++i) {
      const auto& r = res.steps[i];
      sec += r.seconds, tok += r.tokens_per_s * r.seconds, fl += r.flops_per_s * r.seconds;
    }
    char buf[160];
    std::snprintf(buf, sizeof buf, "mean over steps 2-%zu: %.0f tok/s, %.3f GFLOP/s, %.1f ms/step", res.steps.size(), tok / sec,
                  fl / sec * 1e-9, 1e3 * sec / static_cast<double>(res.steps.size() - 1));
    *log << buf << std::endl;
  }
  if (!o.save.empty()) {
    const std::string dir = llama3d::save_checkpoint(t, o.save);
    if (rank == 0 && log) *log << "saved checkpoint " << dir << " at step " << t.steps() << std::endl;
  }
  res.params = t.consolidated_master();
  res.parameter_peak_bytes = params.peak_bytes();
  res.parameter_full_bytes = t.model().size() * sizeof(P);
  const auto& L = t.model().layout();
  for (std::size_t u = 0; u < L.units(); ++u)
    res.largest_unit_bytes = std::max(res.largest_unit_bytes, (L.unit_end(u) - L.unit_begin(u)) * sizeof(P));
  if (rank == 0 && log) {
    const auto b = t.bytes();
    *log << "zero stage " << c.zero.stage << " x " << world << " ranks: per-rank states " << b.parameters << " B params + "
         << b.persistent << " B persistent + " << b.gradients << " B grads + " << b.optimizer << " B optimizer ("
         << (to.offload_optimizer == loom::zero::offload_device::none ? "on device" : "offloaded")
         << "); peak parameter memory " << params.peak_bytes() << " B of " << t.model().size() * sizeof(P)
         << " B unpartitioned" << std::endl;
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
  switch (c.precision()) {
    case loom::dtype::bf16: return run_zero_rank<loom::bfloat16>(comm, o, c, log);
    case loom::dtype::f16: return run_zero_rank<loom::half>(comm, o, c, log);
    default: return run_zero_rank<float>(comm, o, c, log);
  }
}

/// Runs llama-train with the config's ZeRO stage: on the MPI processes when started by
/// mpirun (o.ranks is then the process count), else on o.ranks thread ranks. Returns this
/// process's rank-0 result (MPI: each process's own).
inline train_result run_zero(const options& o, const loom::io::ds_config& c, std::ostream* log) {
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
  if (o.ranks == 1) {  // one rank: collectives are copies or nothing, no thread is started
    loom::comm::self_comm comm;
    return run_zero_on(comm, o, c, log);
  }
  train_result out;
  loom::comm::run_ranks(o.ranks, [&](loom::comm::thread_comm& comm) {
    train_result r = run_zero_on(comm, o, c, log);
    if (comm.rank() == 0) out = std::move(r);
  });
  return out;
}

}  // namespace llama_train
