// The trained model's weights in the paged engine: for every position the engine's logits
// equal those of llama::model's own (contiguous, full-sequence, BLAS) forward to 1e-4, for
// interleaved and half-split RoPE, tied and untied output, grouped-query heads.
#include <doctest/doctest.h>

#include "from_trained.hpp"
#include "llama_engine.hpp"

#include <cmath>

TEST_CASE("llama::model weights run in the paged engine with the same logits") {
  for (int variant = 0; variant < 2; ++variant) {
    llama::config tc;
    tc.dim = 48, tc.n_layers = 2, tc.n_heads = 4, tc.n_kv_heads = variant ? 2 : 4, tc.hidden_dim = 96;
    tc.vocab = 80, tc.seq_len = 64, tc.tied_output = variant == 1;
    tc.rope = variant ? loom::ops::rope_style::half_split : loom::ops::rope_style::interleaved;
    llama::model<float, float> m(tc);
    m.init(11 + static_cast<std::uint64_t>(variant), 0.3f);  // larger weights: logits that depend on context
    const llama::flat_weights w = llama::from_trained(m);
    CHECK(w.cfg.rope == tc.rope);
    CHECK(w.cfg.tied_output == (variant == 1));

    std::vector<std::int32_t> tokens;
    for (int i = 0; i < 40; ++i) tokens.push_back((i * 37 + 5) % 80);
    m.forward(loom::make_view<loom::host>(static_cast<const std::int32_t*>(tokens.data()), 1, 40));
    auto ref = m.logits();  // [1, 40, vocab]

    // The engine sees growing prefixes: each prefix's last-row logits are position p's.
    llama::engine_config ec;
    ec.num_blocks = 64;
    ec.block_size = 4;
    double worst = 0;
    for (int p : {0, 1, 7, 8, 23, 39}) {
      llama::llama_engine<float> eng(w, ec);
      loom::kv::request r;
      r.prompt.assign(tokens.begin(), tokens.begin() + p + 1);
      r.max_new_tokens = 1;
      eng.add(r);
      eng.step();
      auto got = eng.last_logits(0);
      for (int v = 0; v < 80; ++v) worst = std::max(worst, std::abs(double(got[static_cast<std::size_t>(v)]) - ref(0, p, v)));
    }
    CAPTURE(variant);
    CHECK(worst < 1e-4);
  }
}
