#pragma once
// llama-train's entry point: every run is the mesh trainer at dp = --ranks (zero_trainer.hpp),
// on thread ranks, or on the MPI processes when started by mpirun.

#include "trainer.hpp"
#include "zero_trainer.hpp"

#include <ostream>
#include <string>

namespace llama_train {

/// Trains as the options and config say; prints progress to `log` (may be null).
inline train_result run(const options& o, std::ostream* log) {
  const auto c = resolve_config(o);
  for (const auto& w : c.warnings)
    if (log) *log << "note: " << w << std::endl;
  if (log)
    *log << "llama-train: dim " << o.model.dim << ", layers " << o.model.n_layers << ", heads " << o.model.n_heads << "/"
         << o.model.n_kv_heads << ", vocab " << o.model.vocab << ", seq " << o.model.seq_len << " | " << loom::dtype_name(c.precision())
         << " | micro batch " << c.train_micro_batch_size_per_gpu << " x accumulation " << c.gradient_accumulation_steps << std::endl;
  return run_zero(o, c, log);
}

}  // namespace llama_train
