#pragma once
// The trained model (examples/llama/model, llama::model) -> the paged-KV engine's weights.
//
// Why a copy and not a view: the trainer keeps parameters as P (float, bfloat16, half) in
// its own flat buffer, which it updates and may drop (ZeRO); the engine wants fp32 for its
// packed GEMMs and a buffer that stays. The layout is the same (the one decoder's, at tp = pp
// = 1), so the copy is element for element.

#include "llama_loader.hpp"

#include <llama/model/llama.hpp>

namespace llama {

template <class P, loom::ops::compute_type T>
flat_weights from_trained(const model<P, T>& m) {
  flat_weights w{m.cfg(), m.layout(), loom::buffer<float>(m.layout().size())};
  const auto flat = m.params();  // the layout's elements, then padding to the data-parallel size (none at one rank)
  std::transform(flat.begin(), flat.begin() + static_cast<std::ptrdiff_t>(w.params.size()), w.params.begin(),
                 [](P v) { return static_cast<float>(v); });
  return w;
}

}  // namespace llama
