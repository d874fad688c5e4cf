// ds_config.json (io/ds_config.hpp): load_ds_config from a file, then resolve_ds_config with
// a context whose fields come from the input's first bytes (world size, hidden size, steps,
// micro-batch), so "auto" values and the batch rule see varied numbers; parameter groups
// are matched against names and their phases walked.
#include "fuzz_input.hpp"

#include <loom/io/ds_config.hpp>

#include <cstring>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = loom_fuzz::write_input(data, size);
  loom_fuzz::call([&] {
    loom::io::ds_parse_options po;
    po.allow_unknown = size % 2 == 1;
    auto c = loom::io::load_ds_config(path, po);
    std::uint8_t k[4] = {};
    std::memcpy(k, data, size < 4 ? size : 4);
    loom::io::ds_context ctx;
    ctx.world_size = 1 + k[0] % 8;
    ctx.hidden_size = k[1] % 2 ? 0 : 64 * (1 + k[1] % 64);
    ctx.total_steps = k[2] % 3 ? 100 * k[2] : 0;
    if (k[3] % 2) ctx.micro_batch = 1 + k[3] % 16;
    loom::io::resolve_ds_config(c, ctx);
    (void)c.lr_schedule();
    if (!c.groups.groups.empty()) {  // groups and phases are checked: matching and phases must hold
      for (const char* name : {"model.layers.31.self_attn.q_proj.lora_A.weight", "model.embed_tokens.weight", "layers.0.x"})
        (void)loom::optim::group_of(c.groups, name, 1 + k[0] % 40);
      const std::int64_t total = 1 + k[2] % 50;
      for (std::int64_t s = 0; s < total; ++s) (void)loom::optim::trainable_at(c.groups, s, total);
    }
  });
  return 0;
}
