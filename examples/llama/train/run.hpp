#pragma once
// llama-train's entry point: one rank and ZeRO stage 0 run trainer.hpp's single-rank trainer;
// several ranks, a ZeRO stage or optimizer offload run zero_trainer.hpp's data-parallel one.
// The two trainers depend on this file, never on each other's ends (zero_trainer.hpp uses
// trainer.hpp's options and results).

#include "trainer.hpp"
#include "zero_trainer.hpp"

#include <ostream>
#include <string>

namespace llama_train {

template <class P>
train_result run_as(const options& o, const loom::io::ds_config& c, std::ostream* log) {
  trainer<P> t(o, c, log);
  if (!o.resume.empty()) t.load(o.resume);
  LOOM_CHECK(o.steps >= t.step_count(), "llama-train: --steps ", o.steps, " is below the resumed checkpoint's step ", t.step_count());
  train_result res;
  res.parameter_count = static_cast<std::int64_t>(t.model().parameter_count());
  if (log)
    *log << "parameters " << res.parameter_count << (o.resume.empty() ? "" : ", resumed from " + o.resume + " at step " +
                                                                                  std::to_string(t.step_count()))
         << std::endl;
  while (t.step_count() < o.steps) {
    auto r = t.step();
    if (log && (r.step % o.print_every == 0 || r.step == o.steps))
      *log << progress_line(r, o.steps, c.precision() == loom::dtype::f16) << std::endl;
    res.steps.push_back(r);
  }
  if (log && res.steps.size() > 1) {  // the first step pays for allocations and cold caches
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
    t.save(o.save);
    if (log) *log << "saved checkpoint " << o.save << " at step " << t.step_count() << std::endl;
  }
  res.params = t.params_as_float();
  return res;
}

/// Trains as the options and config say; prints progress to `log` (may be null).
inline train_result run(const options& o, std::ostream* log) {
  const auto c = resolve_config(o);
  for (const auto& w : c.warnings)
    if (log) *log << "note: " << w << std::endl;
  if (log)
    *log << "llama-train: dim " << o.model.dim << ", layers " << o.model.n_layers << ", heads " << o.model.n_heads << "/"
         << o.model.n_kv_heads << ", vocab " << o.model.vocab << ", seq " << o.model.seq_len << " | " << loom::dtype_name(c.precision())
         << " | micro batch " << c.train_micro_batch_size_per_gpu << " x accumulation " << c.gradient_accumulation_steps << std::endl;
  if (o.ranks > 1 || c.zero.stage > 0 || c.zero.offload_optimizer.device != loom::io::offload_device::none) {
    for (const auto& d : o.data)
      LOOM_CHECK(!d.ends_with(".jsonl"), "llama-train: chat data (", d, ") is single-rank for now; use --ranks 1 and ZeRO stage 0");
    return run_zero(o, c, log);
  }
  switch (c.precision()) {
    case loom::dtype::bf16: return run_as<loom::bfloat16>(o, c, log);
    case loom::dtype::f16: return run_as<loom::half>(o, c, log);
    default: return run_as<float>(o, c, log);
  }
}

}  // namespace llama_train
