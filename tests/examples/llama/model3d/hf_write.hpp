#pragma once
// A Hugging Face LLaMA folder of given weights, written by the tests themselves (HF's names,
// one F32 file, config.json), for init_from_hf tests whose oracle is the weights: the
// half-split configuration, whose q/k rows HF stores as they are.
#include <llama/generate/llama_loader.hpp>

#include <filesystem>
#include <fstream>
#include <string>

namespace train3d_suite {

inline void write_hf_llama(const std::string& dir, const llama::flat_weights& w) {
  const llama::config& c = w.cfg;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  loom::io::tensor_map t;
  for (const auto& e : w.layout.entries()) {
    auto& nt = t[llama::detail::hf_name(e.name)];
    nt.shape.assign(e.shape.begin(), e.shape.end());
    nt.data = loom::buffer<float>(e.numel);
    const auto src = w.tensor(e.name);
    std::copy(src.begin(), src.end(), nt.data.begin());
  }
  loom::io::write_safetensors(dir + "/model.safetensors", t);
  std::ofstream(dir + "/config.json") << nlohmann::json{{"model_type", "llama"}, {"hidden_size", c.dim},
                                                        {"intermediate_size", c.hidden_dim}, {"num_hidden_layers", c.n_layers},
                                                        {"num_attention_heads", c.n_heads}, {"num_key_value_heads", c.n_kv_heads},
                                                        {"vocab_size", c.vocab}, {"rms_norm_eps", c.norm_eps},
                                                        {"rope_theta", c.rope_theta}, {"tie_word_embeddings", c.tied_output}}
                                             .dump();
}

}  // namespace train3d_suite
