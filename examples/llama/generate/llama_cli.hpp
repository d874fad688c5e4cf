#pragma once
// Command-line options shared by llama-generate and llama-serve: where the model comes from
// (a checkpoint, or random weights to try the programs without files), its tokenizer, and the
// KV pool / scheduler sizes.

#include "llama_engine.hpp"
#include "llama_loader.hpp"

#include <common/cli.hpp>

#include <functional>
#include <string>

namespace llama {

struct model_args {
  std::string checkpoint, tokenizer;
  bool random = false;

  /// Consumes option `a` if it is one of ours (`next()` yields its value); false otherwise.
  bool parse(const std::string& a, const std::function<std::string()>& next, engine_config& ec) {
    if (a == "--checkpoint") checkpoint = next();
    else if (a == "--random") random = true;
    else if (a == "--tokenizer") tokenizer = next();
    else if (a == "--blocks") ec.num_blocks = examples::cli::number<int>(a, next());
    else if (a == "--block-size") ec.block_size = examples::cli::number<int>(a, next());
    else if (a == "--budget") ec.scheduler.max_num_batched_tokens = examples::cli::number<int>(a, next());
    else return false;
    return true;
  }
  void validate() const {
    LOOM_CHECK(random != !checkpoint.empty(), "give exactly one of --checkpoint PATH and --random");
  }
  /// The checkpoint's weights, or random weights of `random_config`.
  flat_weights load(const config& random_config) const {
    return random ? flat_weights::random(random_config, 1) : load_checkpoint(checkpoint);
  }
};

}  // namespace llama
