// HF config.json as llama-generate and llama-serve read it (loom/io/hf_config.hpp, through
// examples/llama/generate/llama_loader.hpp): io::read_hf_llama_config (the LLaMA reader), then
// the JSON object, its family (io::hf_model_type: model_type / architectures) and, for
// ChatGLM2/3, io::read_hf_chatglm_config, which must refuse ChatGLM-6B v1 and the variants the
// decoder does not run, and otherwise give sizes the decoder can build.
#include "fuzz_input.hpp"

#include <loom/io/hf_config.hpp>
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
  loom_fuzz::call([&] {
    const auto j = loom::data::parse_json_input(std::string_view(reinterpret_cast<const char*>(data), size), "config");
    if (!j.is_object()) return;  // load_hf_safetensors refuses it by name
    const std::string family = loom::io::hf_model_type(j, path);
    if (family != "llama" && family != "chatglm") __builtin_trap();
    if (family != "chatglm") return;
    const auto c = loom::io::read_hf_chatglm_config(j, path);
    if (c.num_layers <= 0 || c.hidden_size <= 0 || c.num_attention_heads <= 0 || c.multi_query_group_num <= 0 ||
        c.padded_vocab_size <= 0 || c.hidden_size % c.num_attention_heads || c.num_attention_heads % c.multi_query_group_num ||
        c.head_dim() % 4 || c.seq_length <= 0)
      __builtin_trap();
  });
  return 0;
}
