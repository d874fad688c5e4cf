// llama-train3d: train a LLaMA over data x tensor x pipeline thread ranks with ZeRO 0-3 on the
// data-parallel groups. Prints the mesh and each rank's memory at start, then progress lines.
// Under `mpirun -np dp*tp*pp` (a build with MPI) each process is one rank, over mpi_comm.
// The corpus is the synthetic counting stream of train3d.hpp (learnable, the same for every
// mesh, so runs on different meshes print the same losses).
#include <common/cli.hpp>
#include <common/fail_fast.hpp>
#include <common/fault_inject.hpp>
#include <loom/data/batches.hpp>
#include <loom/zero/ds_config.hpp>
#include <llama/generate/llama_loader.hpp>
#include "checkpoint.hpp"
#include "train3d.hpp"

#include <loom/comm/thread_comm.hpp>
#include <loom/io/ds_config.hpp>
#ifdef LOOM_HAS_MPI
#include <loom/comm/mpi_comm.hpp>
#endif

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

const char* usage =
    "usage: llama-train3d [--dp D] [--tp T] [--pp P] [--schedule gpipe|1f1b|interleaved] [--chunks V] [--zero 0|1|2|3]\n"
    "                     [--config ds_config.json] [--steps N] [--micro-batches M] [--batch B] [--seq S]\n"
    "                     [--dim D] [--n-layers L] [--n-heads H] [--n-kv-heads K] [--hidden-dim F] [--vocab V]\n"
    "                     [--tied] [--checkpointing] [--lr LR] [--clip C] [--precision fp32|bf16|fp16] [--seed S] [--print-every N]\n"
    "                     [--data a.bin,b.bin | chat.jsonl]   token shards (uint16) or chat records; default: a counting corpus\n"
    "                     [--eval-every N [--eval-data FILES] [--eval-batches K]]   held-out loss and perplexity every N steps\n"
    "                     [--save DIR [--save-every N] [--keep-last K]] [--resume DIR]   sharded checkpoints: DIR/step-<N>,\n"
    "                     DIR/latest (--keep-last: only the newest K are kept); [--export-hf OUT]: after the last save, the\n"
    "                     model as a Hugging Face LLaMA folder (config.json, safetensors shards, index); a\n"
    "                     checkpoint resumes on any mesh and ZeRO stage (--resume DIR: its latest, or DIR/step-<N>)\n"
    "  Ranks are threads (dp*tp*pp of them), or the processes of `mpirun -np dp*tp*pp`. A config's zero stage, micro batch, gradient\n"
    "  accumulation (= micro-batches per step), precision (fp16: its loss scaler), optimizer, scheduler and clipping win over\n"
    "  the flags. bf16 / fp16 store parameters in that type (fp32 master weights and compute).\n";

using examples::cli::bad_args;
using examples::cli::number;

struct program_options {
  llama::config cfg;
  llama3d::train_options train;
  std::string config_path;
  std::vector<std::string> data;  ///< --data: token shards or one chat .jsonl; none: the counting corpus
  std::vector<std::string> eval_data;  ///< --eval-data: held-out files (none: held-out counting batches)
  int eval_every = 0;                  ///< --eval-every N: evaluate after every N steps (0: never)
  int eval_batches = 1;                ///< --eval-batches K: global batches per evaluation
  std::optional<loom::dtype> precision_flag;  ///< --precision
  loom::dtype precision = loom::dtype::f32;   ///< what the run stores parameters as
  std::int64_t steps = 20;
  int print_every = 1;
  std::string save, resume;  ///< --save DIR, --resume DIR
  int save_every = 0;        ///< --save-every N (0: only at the end)
  int keep_last = 0;         ///< --keep-last K (0: keep every checkpoint)
  std::string export_hf;     ///< --export-hf OUT: the last checkpoint as an HF folder
  bool help = false;
};

program_options parse(int argc, char** argv) {
  program_options o;
  o.cfg.dim = 64, o.cfg.n_layers = 4, o.cfg.n_heads = 4, o.cfg.n_kv_heads = 2, o.cfg.hidden_dim = 128;
  o.cfg.vocab = 256, o.cfg.seq_len = 64;
  o.train.mesh = {2, 2, 2};
  o.train.seq = 64;
  o.train.micro_batch_size = 2;
  o.train.micro_batches = 4;
  o.train.zero_stage = 3;
  o.train.adamw.lr = 3e-3f;
  o.train.gradient_clipping = 1.f;
  o.help = !examples::cli::parse(argc, argv, [&](const std::string& a, const auto& value) {
    if (a == "--dp") o.train.mesh.dp = number<int>(a, value());
    else if (a == "--tp") o.train.mesh.tp = number<int>(a, value());
    else if (a == "--pp") o.train.mesh.pp = number<int>(a, value());
    else if (a == "--schedule") o.train.schedule = value();
    else if (a == "--chunks") o.train.chunks = number<int>(a, value());
    else if (a == "--zero") o.train.zero_stage = number<int>(a, value());
    else if (a == "--config") o.config_path = value();
    else if (a == "--steps") o.steps = number<std::int64_t>(a, value());
    else if (a == "--micro-batches") o.train.micro_batches = number<int>(a, value());
    else if (a == "--batch") o.train.micro_batch_size = number<loom::index_t>(a, value());
    else if (a == "--seq") o.train.seq = number<loom::index_t>(a, value());
    else if (a == "--dim") o.cfg.dim = number<loom::index_t>(a, value());
    else if (a == "--n-layers") o.cfg.n_layers = number<loom::index_t>(a, value());
    else if (a == "--n-heads") o.cfg.n_heads = number<loom::index_t>(a, value());
    else if (a == "--n-kv-heads") o.cfg.n_kv_heads = number<loom::index_t>(a, value());
    else if (a == "--hidden-dim") o.cfg.hidden_dim = number<loom::index_t>(a, value());
    else if (a == "--vocab") o.cfg.vocab = number<loom::index_t>(a, value());
    else if (a == "--tied") o.cfg.tied_output = true;
    else if (a == "--checkpointing") o.train.checkpointing = true;
    else if (a == "--data" || a == "--eval-data") {
      const std::string list = value();
      auto& files = a == "--data" ? o.data : o.eval_data;
      std::stringstream ss(list);
      for (std::string p; std::getline(ss, p, ',');)
        if (!p.empty()) files.push_back(p);
      LOOM_CHECK(!files.empty(), "llama-train3d: ", a, " '", list.substr(0, 64), "' names no file");
    } else if (a == "--eval-every") {
      o.eval_every = number<int>(a, value());
      LOOM_CHECK(o.eval_every >= 0, "llama-train3d: --eval-every ", o.eval_every, " must be >= 0");
    } else if (a == "--eval-batches") {
      o.eval_batches = number<int>(a, value());
      LOOM_CHECK(o.eval_batches >= 1, "llama-train3d: --eval-batches ", o.eval_batches, " must be >= 1");
    }
    else if (a == "--lr") o.train.adamw.lr = number<float>(a, value());
    else if (a == "--clip") o.train.gradient_clipping = number<float>(a, value());
    else if (a == "--seed") o.train.seed = number<std::uint64_t>(a, value());
    else if (a == "--precision") o.precision_flag = examples::cli::precision(a, value());
    else if (a == "--print-every") o.print_every = number<int>(a, value());
    else if (a == "--save") o.save = value();
    else if (a == "--resume") o.resume = value();
    else if (a == "--save-every") {
      o.save_every = number<int>(a, value());
      LOOM_CHECK(o.save_every >= 0, "llama-train3d: --save-every ", o.save_every, " must be >= 0");
    }
    else if (a == "--export-hf") o.export_hf = value();
    else if (a == "--keep-last") {
      o.keep_last = number<int>(a, value());
      LOOM_CHECK(o.keep_last >= 1, "llama-train3d: --keep-last ", o.keep_last, " must be >= 1");
    }
    else return false;
    return true;
  });
  o.cfg.seq_len = std::max(o.cfg.seq_len, o.train.seq);
  o.precision = o.precision_flag.value_or(loom::dtype::f32);
  LOOM_CHECK(o.export_hf.empty() || !o.save.empty(), "llama-train3d: --export-hf ", o.export_hf,
             " needs --save DIR (it exports the checkpoint the run saves last)");
  return o;
}

/// "  scale 65536" (the loss scale of an fp16 step, %g).
std::string scale_text(float scale) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "  scale %g", double(scale));
  return buf;
}

#ifdef LOOM_HAS_MPI
// Under mpirun every process is one rank of the mesh (Open MPI sets OMPI_COMM_WORLD_SIZE).
struct mpi_session {
  bool active = false;
  mpi_session(int* argc, char*** argv) {
    if (!std::getenv("OMPI_COMM_WORLD_SIZE") && !std::getenv("PMI_SIZE")) return;
    int provided = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    active = true;
  }
  ~mpi_session() {
    if (active) MPI_Finalize();
  }
};
#endif

}  // namespace

int main(int argc, char** argv) {
#ifdef LOOM_HAS_MPI
  mpi_session mpi(&argc, &argv);
  const bool under_mpirun = mpi.active;
#endif
  program_options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama-train3d: %s\n%s", e.what(), usage);
    return 2;
  }
  if (o.help) {
    std::fputs(usage, stdout);
    return 0;
  }
  try {
    loom::optim::any_lr_schedule schedule{loom::optim::constant_lr{o.train.adamw.lr}};
    bool offload_note = false;
    if (!o.config_path.empty()) {
      auto c = loom::io::load_ds_config(o.config_path);
      loom::io::ds_context ctx;
      ctx.world_size = o.train.mesh.dp;
      ctx.hidden_size = o.cfg.dim;
      ctx.total_steps = o.steps;
      ctx.lr = o.train.adamw.lr;
      ctx.gradient_clipping = o.train.gradient_clipping;
      ctx.micro_batch = o.train.micro_batch_size;
      ctx.grad_accum = o.train.micro_batches;
      ctx.precision = o.precision;
      loom::io::resolve_ds_config(c, ctx);
      LOOM_CHECK(!o.precision_flag || *o.precision_flag == c.precision(), "llama-train3d: --precision ",
                 std::string(loom::dtype_name(*o.precision_flag)), " contradicts the config's ",
                 std::string(loom::dtype_name(c.precision())), " (", o.config_path, ")");
      // offload to cpu: optimizer states and parameters live in host memory on the host
      // backend already; nvme: the engine keeps the optimizer states in a mapped file
      const loom::zero::engine_options eo = loom::zero::engine_options_from(c);
      o.train.stage3 = eo.stage3;
      o.train.offload_optimizer = eo.offload_optimizer;
      o.train.nvme_path = eo.nvme_path;
      offload_note = c.zero.offload_optimizer.device == loom::io::offload_device::cpu ||
                     c.zero.offload_param.device == loom::io::offload_device::cpu;
      o.train.checkpointing = o.train.checkpointing || c.activation_checkpointing.enabled;
      o.precision = c.precision();
      o.train.loss_scaler = loom::zero::loss_scaler_from(c);
      o.train.zero_stage = c.zero.stage;
      o.train.micro_batch_size = c.train_micro_batch_size_per_gpu;
      o.train.micro_batches = static_cast<int>(c.gradient_accumulation_steps);
      o.train.gradient_clipping = c.gradient_clipping.value;
      o.train.adamw = {c.optimizer.lr.value, c.optimizer.beta1.value, c.optimizer.beta2.value, c.optimizer.eps.value,
                       c.optimizer.weight_decay.value};
      schedule = c.lr_schedule();
      for (const auto& w : c.warnings) std::fprintf(stderr, "llama-train3d: warning: %s\n", w.c_str());
    }
    const auto mesh = o.train.mesh;
    const int world = mesh.size();
    LOOM_CHECK(world >= 1 && world <= 256, "llama-train3d: dp*tp*pp = ", world, " ranks (1..256)");
    std::mutex io;
    // --precision fp16 without a config: DeepSpeed's default dynamic scaler (2^16, window 1000, hysteresis 2, min 1)
    if (o.config_path.empty() && o.precision == loom::dtype::f16) o.train.loss_scaler = loom::amp::dynamic_loss_scaler{};
    // One rank's whole run with parameters stored as P; Comm: thread_comm (default) or
    // mpi_comm (under mpirun).
    auto run_rank = [&](auto p_tag, auto& comm, loom::host_memory_resource& mr, const char* kind) {
      using P = typename decltype(p_tag)::type;
      using comm_t = std::remove_reference_t<decltype(comm)>;
      const int r = comm.rank();
      llama3d::trainer<P, float, comm_t> t(comm, o.cfg, o.train, mr);
      const auto c = t.mesh().coord();
      const auto b = t.bytes();
      if (r == 0)
        std::printf("llama-train3d: mesh dp=%d x tp=%d x pp=%d (%d %s ranks), ZeRO-%d, schedule %s, m=%d micro-batches of "
                    "[%lld, %lld], model dim=%lld layers=%lld heads=%lld/%lld vocab=%lld, parameters %s%s\n",
                    mesh.dp, mesh.tp, mesh.pp, world, kind, o.train.zero_stage, o.train.schedule.c_str(), o.train.micro_batches,
                    (long long)o.train.micro_batch_size, (long long)o.train.seq, (long long)o.cfg.dim,
                    (long long)o.cfg.n_layers, (long long)o.cfg.n_heads, (long long)o.cfg.n_kv_heads, (long long)o.cfg.vocab,
                    std::string(loom::dtype_name(o.precision)).c_str(),
                    offload_note ? " (offload to cpu: the host backend keeps these states in host memory already)" : "");
      comm.barrier();
      for (int k = 0; k < world; ++k) {
        if (k == r) {
          std::lock_guard lock(io);
          std::string layers;
          for (int k = 0; k < t.chunks(); ++k)
            layers += (k ? " " : "") + std::string("[") + std::to_string(t.model(k).layers().first) + ", " +
                      std::to_string(t.model(k).layers().last) + ")";
          std::printf("  rank %d (dp=%d, tp=%d, pp=%d): layers %s%s%s, model states %.1f KiB (params %.1f, grads %.1f, "
                      "optimizer %.1f), memory in use %.1f KiB\n",
                      r, c.dp, c.tp, c.pp, layers.c_str(), t.model().first_stage() ? " +embedding" : "",
                      t.model(t.chunks() - 1).last_stage() ? " +norm+output" : "",
                      (b.parameters + b.gradients + b.optimizer) / 1024.0, b.parameters / 1024.0, b.gradients / 1024.0,
                      b.optimizer / 1024.0, mr.current_bytes() / 1024.0);
          std::fflush(stdout);
        }
        comm.barrier();
      }
      const double tokens = double(mesh.dp) * o.train.micro_batches * double(o.train.micro_batch_size * o.train.seq);
      // Real data: every rank reads the micro-batches it is given by their global index
      // (include/loom/data/batches.hpp), so the loss curve is the same on every mesh.
      std::optional<loom::data::batch_loader> loader;
      if (!o.data.empty())
        loader.emplace(loom::data::make_batch_loader(o.data, o.cfg.vocab, o.train.seq, o.train.micro_batch_size, o.train.seed));
      std::optional<loom::data::batch_loader> eval_loader;
      if (!o.eval_data.empty())
        eval_loader.emplace(loom::data::make_batch_loader(o.eval_data, o.cfg.vocab, o.train.seq, o.train.micro_batch_size,
                                                        o.train.seed));
      const std::int64_t held_out = std::int64_t(1) << 40;
      loom::data::token_batch batch;
      const int G = mesh.dp * o.train.micro_batches;
      if (!o.resume.empty()) {
        llama3d::load_checkpoint(t, o.resume);
        if (r == 0) std::printf("resumed from %s at step %lld\n", loom::checkpoint::resolve(o.resume).c_str(), (long long)t.steps());
      }
      LOOM_CHECK(o.steps >= t.steps(), "llama-train3d: --steps ", o.steps, " is below the resumed checkpoint's step ", t.steps());
      auto save = [&] {
        const std::string dir = llama3d::save_checkpoint(t, o.save, o.keep_last);
        if (r == 0) std::printf("saved checkpoint %s\n", dir.c_str());
      };
      for (std::int64_t s = t.steps(); s < o.steps; ++s) {
        if (examples::inject_fault(r, s)) return;  // test hook (LOOM_FAULT_INJECT)
        t.set_lr(schedule.lr(t.steps()));  // a skipped step does not advance the schedule (DeepSpeed)
        auto st = t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
          if (!loader)
            return llama3d::counting_batch(o.train.seed, step, g, o.train.micro_batch_size, o.train.seq, o.cfg.vocab, tok, tgt);
          loom::data::global_micro_batch(*loader, step, g, G, batch);
          std::copy(batch.tokens.begin(), batch.tokens.end(), tok.begin());
          std::copy(batch.targets.begin(), batch.targets.end(), tgt.begin());
        });
        double peak = double(mr.peak_bytes());
        comm.all_reduce(std::span<const double>(&peak, 1), std::span<double>(&peak, 1), loom::comm::reduce_op::max);
        double secs = st.seconds;
        comm.all_reduce(std::span<const double>(&secs, 1), std::span<double>(&secs, 1), loom::comm::reduce_op::max);
        if (r == 0 && (s % o.print_every == 0 || s + 1 == o.steps))
          std::printf("step %4lld  loss %.4f  grad_norm %.3f%s%s  %.0f tokens/s  peak memory/rank %.1f KiB\n", (long long)s + 1,
                      st.loss, st.grad_norm,
                      o.precision == loom::dtype::f16 ? scale_text(st.loss_scale).c_str() : "",
                      st.skipped ? " (skipped: overflow)" : "", tokens / secs, peak / 1024.0);
        if (o.eval_every > 0 && ((s + 1) % o.eval_every == 0 || s + 1 == o.steps)) {
          double eval = 0;
          for (int k = 0; k < o.eval_batches; ++k)
            eval += t.evaluate(
                        [&](std::int64_t index, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
                          if (!eval_loader)  // held-out counting batches: step indices training never reaches
                            return llama3d::counting_batch(o.train.seed, held_out + index, g, o.train.micro_batch_size,
                                                           o.train.seq, o.cfg.vocab, tok, tgt);
                          loom::data::global_micro_batch(*eval_loader, index, g, G, batch);
                          std::copy(batch.tokens.begin(), batch.tokens.end(), tok.begin());
                          std::copy(batch.targets.begin(), batch.targets.end(), tgt.begin());
                        },
                        k) /
                    o.eval_batches;
          if (r == 0) std::printf("eval after step %lld: loss %.4f  perplexity %.3f\n", (long long)s + 1, eval, std::exp(eval));
        }
        if (!o.save.empty() && o.save_every > 0 && (s + 1) % o.save_every == 0 && s + 1 != o.steps) save();
      }
      if (!o.save.empty()) save();
      if (!o.export_hf.empty() && r == 0) {  // streamed from the checkpoint just written, one tensor at a time
        const int files = llama::export_hf(o.save, o.export_hf, o.cfg);
        std::printf("exported %s as the HF folder %s (%d safetensors file%s)\n", loom::checkpoint::resolve(o.save).c_str(),
                    o.export_hf.c_str(), files, files == 1 ? "" : "s");
      }
    };
    auto body = [&](auto& comm, loom::host_memory_resource& mr, const char* kind) {
      switch (o.precision) {
        case loom::dtype::bf16: return run_rank(std::type_identity<loom::bfloat16>{}, comm, mr, kind);
        case loom::dtype::f16: return run_rank(std::type_identity<loom::half>{}, comm, mr, kind);
        default: return run_rank(std::type_identity<float>{}, comm, mr, kind);
      }
    };
#ifdef LOOM_HAS_MPI
    if (under_mpirun) {
      auto comm = loom::comm::mpi_comm::world();
      LOOM_CHECK(comm.size() == world, "llama-train3d: dp x tp x pp = ", world, " but mpirun started ", comm.size(), " ranks");
      loom::host_memory_resource mr("rank " + std::to_string(comm.rank()));
      body(comm, mr, "MPI");
      return 0;
    }
#endif
    std::vector<std::unique_ptr<loom::host_memory_resource>> mem;
    for (int r = 0; r < world; ++r) mem.push_back(std::make_unique<loom::host_memory_resource>("rank " + std::to_string(r)));
    loom::comm::run_ranks(world, [&](loom::comm::thread_comm& comm) { body(comm, *mem[static_cast<std::size_t>(comm.rank())], "thread"); });
    return 0;
  } catch (const std::exception& e) {
    return examples::fail("llama-train3d", e.what());  // under mpirun: MPI_Abort, not a hang in MPI_Finalize
  }
}
