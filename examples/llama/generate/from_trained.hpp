#pragma once
// The trained model (examples/llama/model, llama::model) -> the paged-KV engine's weights.
//
// Why a copy and not a view: the trainer keeps parameters in one flat buffer of P (float,
// bfloat16, half) laid out for ZeRO; the engine wants fp32 matrices. Both name tensors as
// Meta's checkpoints do, so the mapping goes through the same name table as llama2.c files.

#include "llama_loader.hpp"

#include <llama/model/llama.hpp>

namespace llama {

/// The engine's view of a training config (same architecture, fp32 inference).
inline llama_config engine_config_of(const config& tc) {
  llama_config c;
  c.dim = static_cast<std::int32_t>(tc.dim), c.hidden_dim = static_cast<std::int32_t>(tc.hidden_dim);
  c.n_layers = static_cast<std::int32_t>(tc.n_layers), c.n_heads = static_cast<std::int32_t>(tc.n_heads);
  c.n_kv_heads = static_cast<std::int32_t>(tc.n_kv_heads), c.vocab_size = static_cast<std::int32_t>(tc.vocab);
  c.max_seq_len = static_cast<std::int32_t>(tc.seq_len);
  c.norm_eps = static_cast<float>(tc.norm_eps), c.rope_theta = static_cast<float>(tc.rope_theta);
  c.rope_interleaved = tc.rope == loom::ops::rope_style::interleaved;
  c.shared_classifier = tc.tied_output;
  return c;
}

template <class P, loom::ops::compute_type T>
llama_weights from_trained(const model<P, T>& m) {
  const llama_config c = engine_config_of(m.cfg());
  loom::io::tensor_map tensors;
  const auto flat = m.params();
  for (const auto& e : m.layout().entries()) {
    loom::io::named_tensor t;
    t.shape.assign(e.shape.begin(), e.shape.end());
    t.data = loom::buffer<float>(e.numel);
    for (std::size_t i = 0; i < e.numel; ++i) t.data[i] = static_cast<float>(flat[e.offset + i]);
    tensors.emplace(e.name, std::move(t));
  }
  return detail::from_tensors(c, tensors, detail::meta_names);
}

}  // namespace llama
