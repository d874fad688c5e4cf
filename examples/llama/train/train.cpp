// llama_train_lib: run() chooses the ranks (one, threads, or mpirun's processes) and the
// parameter type; run_rank's instantiations live in train_rank.cpp.
#include "instantiate.hpp"

#include <common/mpi_launch.hpp>
#include <loom/comm/fail_fast.hpp>
#include <loom/comm/self_comm.hpp>
#include <loom/comm/thread_comm.hpp>
#ifdef LOOM_HAS_MPI
#include <loom/comm/mpi_comm.hpp>
#endif
#include <llama/generate/llama_loader.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <exception>
#include <functional>
#include <memory>
#ifdef LOOM_HAS_MPI
#include <mpi.h>
#endif

LLAMA_TRAIN_RUN_RANK(extern, float)
LLAMA_TRAIN_RUN_RANK(extern, loom::bfloat16)
LLAMA_TRAIN_RUN_RANK(extern, loom::half)

namespace llama_train {

loom::io::ds_config resolve_config(const options& o) {
  loom::io::ds_config c = o.config_path.empty() ? loom::io::parse_ds_config(nlohmann::json::object())
                                                : loom::io::load_ds_config(o.config_path, {o.allow_unknown});
  if (o.config_path.empty()) {
    c.micro_batch_given = o.batch, c.grad_accum_given = o.grad_accum;
    c.zero.stage = o.zero;
  }
  loom::io::ds_context ctx{.world_size = o.mesh.dp, .hidden_size = o.model.dim, .total_steps = o.steps, .warmup_steps = o.warmup,
                           .lr = o.lr, .weight_decay = o.weight_decay, .gradient_clipping = o.clip,
                           .precision = o.precision.value_or(loom::dtype::f32), .micro_batch = o.batch, .grad_accum = o.grad_accum};
  loom::io::resolve_ds_config(c, ctx);
  LOOM_CHECK(!o.precision || c.precision() == *o.precision || o.config_path.empty(), "llama-train: --precision ",
             loom::dtype_name(*o.precision), " contradicts the config's ", loom::dtype_name(c.precision()), " (", o.config_path, ")");
  if (o.config_path.empty() && o.precision) {  // without a config, fp16 takes DeepSpeed's default dynamic scaler
    c.fp16.enabled.value = *o.precision == loom::dtype::f16;
    c.bf16.value = *o.precision == loom::dtype::bf16;
  }
  // offload_param: DeepSpeed moves the fp16 parameters from the GPU to host memory; on the
  // host backend they live there already, so "cpu" holds by construction (the parser refuses
  // "nvme" for parameters; docs/training.md).
  LOOM_CHECK(c.zero.offload_param.device == loom::io::offload_device::none ||
                 c.zero.offload_param.device == loom::io::offload_device::cpu,
             "llama-train: zero_optimization.offload_param: only device \"cpu\" (or \"none\") is supported");
  // parameter groups: the flags' or the config's, then the flags' per-group values
  const bool flag_groups = !o.groups.groups.empty() || !o.groups.phases.empty();
  LOOM_CHECK(!flag_groups || (c.groups.groups.empty() && c.groups.phases.empty()), "llama-train: --group / --unfreeze and the "
             "config's \"param_groups\" / \"progressive_unfreezing\" (", o.config_path, ") both give groups; give them in one place");
  if (flag_groups) c.groups = o.groups;
  for (const auto* values : {&o.group_lr, &o.group_wd})
    for (const auto& [name, v] : *values) {
      if (name == loom::optim::base_group && !loom::optim::detail::has_group(c.groups, name))
        c.groups.groups.push_back({name, {}, {}, {}, {}, {}});
      auto it = std::find_if(c.groups.groups.begin(), c.groups.groups.end(), [&](const auto& g) { return g.name == name; });
      LOOM_CHECK(it != c.groups.groups.end(), "llama-train: ", values == &o.group_lr ? "--group-lr" : "--group-wd", " names group \"",
                 name, "\", which no --group or param_groups defines");
      (values == &o.group_lr ? it->lr : it->weight_decay) = v;
    }
  if (!c.groups.groups.empty() || !c.groups.phases.empty()) loom::optim::check(c.groups);
  return c;
}

loom::optim::param_group parse_group(const std::string& spec) {
  const auto eq = spec.find('=');
  LOOM_CHECK(eq != std::string::npos && eq > 0, "llama-train: --group '", spec.substr(0, 64), "' is not NAME=GLOB[,GLOB...][@FIRST:LAST]");
  loom::optim::param_group g;
  g.name = spec.substr(0, eq);
  std::string globs = spec.substr(eq + 1);
  if (const auto at = globs.find('@'); at != std::string::npos) {
    const std::string range = globs.substr(at + 1);
    globs.resize(at);
    const auto colon = range.find(':');
    LOOM_CHECK(colon != std::string::npos, "llama-train: --group ", g.name, ": layer range '", range.substr(0, 64), "' is not FIRST:LAST");
    const auto bound = [&](const std::string& v) -> std::optional<std::int64_t> {
      if (v.empty()) return std::nullopt;
      std::size_t used = 0;
      std::int64_t x = 0;
      try {
        x = std::stoll(v, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      LOOM_CHECK(used == v.size() && used > 0, "llama-train: --group ", g.name, ": layer bound '", v.substr(0, 32), "' is not an integer");
      return x;
    };
    g.first_layer = bound(range.substr(0, colon)), g.last_layer = bound(range.substr(colon + 1));
  }
  std::stringstream ss(globs);
  for (std::string p; std::getline(ss, p, ',');)
    if (!p.empty()) g.patterns.push_back(p);
  return g;
}

std::vector<loom::optim::unfreeze_phase> parse_unfreeze(const std::string& spec) {
  std::vector<loom::optim::unfreeze_phase> out;
  std::stringstream ss(spec);
  for (std::string ph; std::getline(ss, ph, ',');) {
    const auto colon = ph.find(':');
    loom::optim::unfreeze_phase p;
    std::size_t used = 0;
    try {
      p.until = std::stod(ph.substr(0, colon), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    LOOM_CHECK(colon != std::string::npos && used == colon && used > 0, "llama-train: --unfreeze phase '", ph.substr(0, 64),
               "' is not UNTIL:GROUP[+GROUP...] (e.g. 0.3:lora)");
    std::stringstream gs(ph.substr(colon + 1));
    for (std::string n; std::getline(gs, n, '+');)
      if (!n.empty()) p.trainable.push_back(n);
    out.push_back(std::move(p));
  }
  LOOM_CHECK(!out.empty(), "llama-train: --unfreeze '", spec.substr(0, 64), "' gives no phase");
  return out;
}

std::pair<std::string, float> parse_group_value(const std::string& flag, const std::string& spec) {
  const auto eq = spec.find('=');
  std::size_t used = 0;
  float v = 0.f;
  try {
    v = std::stof(spec.substr(eq == std::string::npos ? spec.size() : eq + 1), &used);
  } catch (const std::exception&) {
    used = 0;
  }
  LOOM_CHECK(eq != std::string::npos && eq > 0 && used > 0 && eq + 1 + used == spec.size(), "llama-train: ", flag, " '",
             spec.substr(0, 64), "' is not NAME=NUMBER");
  return {spec.substr(0, eq), v};
}

std::string group_name(const llama::config& c, const std::string& n) {
  const auto hf = [&](const std::string& meta) { return c.model_type == "chatglm" ? llama::detail::chatglm_name(meta) : llama::detail::hf_name(meta); };
  const auto lora = n.find(".lora_");
  if (lora == std::string::npos) return hf(n);
  const std::string base = hf(n.substr(0, lora) + ".weight");  // model.layers.3.self_attn.q_proj.weight
  return base.substr(0, base.size() - 7) + n.substr(lora);
}

std::string progress_line(const step_record& r, std::int64_t total, bool show_scale) {
  char buf[320];
  int n = std::snprintf(buf, sizeof buf,
                        "step %lld/%lld | loss %.4f | lr %.3e | grad_norm %.3f | %.0f tok/s | %.3f GFLOP/s | mem %.1f MiB (peak %.1f)",
                        static_cast<long long>(r.step), static_cast<long long>(total), r.loss, static_cast<double>(r.lr), r.grad_norm,
                        r.tokens_per_s, r.flops_per_s * 1e-9, static_cast<double>(r.mem_bytes) / 1048576.0,
                        static_cast<double>(r.peak_bytes) / 1048576.0);
  if (show_scale && n > 0 && n < static_cast<int>(sizeof buf))
    std::snprintf(buf + n, sizeof buf - static_cast<std::size_t>(n), " | scale %g%s", static_cast<double>(r.scale),
                  r.skipped ? " (overflow: step skipped)" : "");
  return buf;
}

int mpi_launch_size() { return examples::mpi_launch_size(); }

int mpi_launch_rank() { return examples::mpi_launch_rank(); }

namespace {

// The backend's communicator erased (any_comm): the run and its trainer are compiled once for
// all three backends.
template <class C>
train_result run_on(C& backend, const options& o, const loom::io::ds_config& c, std::ostream* log) {
  loom::comm::any_comm comm(std::ref(backend));
  switch (c.precision()) {
    case loom::dtype::bf16: return run_rank<loom::bfloat16>(comm, o, c, log);
    case loom::dtype::f16: return run_rank<loom::half>(comm, o, c, log);
    default: return run_rank<float>(comm, o, c, log);
  }
}

}  // namespace

train_result run(const options& given, std::ostream* log) {
  options o = given;
  if (!o.init_from.empty()) {  // the folder's shape; the training length stays the run's
    const loom::index_t seq = o.model.seq_len;
    o.model = llama::config_from_hf(o.init_from);
    o.model.seq_len = seq;
  }
  if (o.max_source_length > 0 && o.max_target_length > 0) o.model.seq_len = o.max_source_length + o.max_target_length;
  else if (o.max_target_length > 0) o.max_source_length = o.model.seq_len - o.max_target_length;
  LOOM_CHECK(o.max_source_length >= 0 && o.max_source_length < o.model.seq_len, "llama-train: --max-source-length ",
             o.max_source_length, " (or --max-target-length ", o.max_target_length, ") does not fit rows of --seq-len ",
             o.model.seq_len);
  const int world = o.mesh.size();
  LOOM_CHECK(o.mesh.dp >= 1 && o.mesh.tp >= 1 && o.mesh.pp >= 1 && world <= 256, "llama-train: mesh dp=", o.mesh.dp, " tp=", o.mesh.tp,
             " pp=", o.mesh.pp, " must have 1..256 ranks");
  LOOM_CHECK(!o.data.empty(), "llama-train: no --data given");
  LOOM_CHECK(o.eval_every == 0 || !o.eval_data.empty() || (o.data.size() == 1 && o.data[0] == "counting"), "llama-train: --eval-every ",
             o.eval_every, " needs --eval-data (held-out files) unless --data is counting");
  LOOM_CHECK(o.export_hf.empty() || !o.save.empty() || o.lora, "llama-train: --export-hf ", o.export_hf,
             " needs --save DIR (it exports the checkpoint the run saves last)");
  LOOM_CHECK(o.lora || (o.export_lora.empty() && o.lora_from.empty()), "llama-train: --export-lora / --lora-from need LoRA "
             "adapters (--lora-r N)");
  const auto c = resolve_config(o);
  for (const auto& w : c.warnings)
    if (log && mpi_launch_rank() == 0) *log << "note: " << w << std::endl;
#ifdef LOOM_HAS_MPI
  if (mpi_launch_size() > 1) {
    examples::mpi_session mpi;
    train_result r;
    try {
      loom::comm::mpi_comm comm = loom::comm::mpi_comm::world();
      LOOM_CHECK(comm.size() == world, "llama-train: dp x tp x pp = ", world, " but mpirun started ", comm.size(), " processes");
      r = run_on(comm, o, c, log);
    } catch (const std::exception& e) {  // one failed process must not leave the others waiting
      loom::comm::fail("llama-train", e.what());
      throw;
    }
    return r;
  }
#endif
  if (world == 1) {  // one rank: collectives are copies or nothing, no thread is started
    loom::comm::self_comm comm;
    return run_on(comm, o, c, log);
  }
  train_result out;
  loom::comm::run_ranks(world, [&](loom::comm::thread_comm& comm) {
    train_result r = run_on(comm, o, c, log);
    if (comm.rank() == 0) out = std::move(r);
  });
  return out;
}

}  // namespace llama_train
