// HF config.json reader for LLaMA models (io/safetensors.hpp: read_hf_llama_config).
#include "fuzz_input.hpp"

#include <loom/io/safetensors.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = loom_fuzz::write_input(data, size);
  loom_fuzz::call([&] {
    const auto c = loom::io::read_hf_llama_config(path);
    // What the reader promises its callers: positive sizes that divide as a model needs
    if (c.hidden_size <= 0 || c.num_attention_heads <= 0 || c.num_key_value_heads <= 0 || c.hidden_size % c.num_attention_heads ||
        c.num_attention_heads % c.num_key_value_heads)
      __builtin_trap();
  });
  return 0;
}
