#pragma once
// What a LoRA run adapts and how strongly: PEFT's LoraConfig fields under PEFT's names, so
// an adapter_config.json maps onto it one key per field (lora/peft.hpp).
//
//   y = base(x) + scaling * B(A(dropout(x))),  A: [r, in], B: [out, r]
//   scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (rank-stabilised LoRA)
//
// Target modules are named as Hugging Face names the linear layers (the names a PEFT user
// writes): LLaMA's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj and
// ChatGLM2/3's query_key_value, dense, dense_h_to_4h, dense_4h_to_h. A name outside these
// is refused rather than matching nothing, which PEFT would report only once it had found no
// module at all.

#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <string_view>
#include <vector>

namespace loom::lora {

/// Every module name a target list may hold: LLaMA's seven projections, then ChatGLM's four.
inline constexpr std::array<std::string_view, 11> known_modules{
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"};

inline bool is_known_module(std::string_view m) {
  return std::find(known_modules.begin(), known_modules.end(), m) != known_modules.end();
}

/// PEFT's LoraConfig (the fields loom implements), with PEFT's defaults.
struct config {
  index_t r = 8;
  double lora_alpha = 8.0;
  double lora_dropout = 0.0;
  bool use_rslora = false;
  std::vector<std::string> target_modules{"q_proj", "v_proj"};

  /// Refuses, naming the field and its value: r <= 0, a lora_alpha that is not finite, a
  /// dropout outside [0, 1), an empty, unknown or repeated target module.
  void validate() const {
    LOOM_CHECK(r > 0, "lora: r must be > 0, got r=", r);
    LOOM_CHECK(std::isfinite(lora_alpha), "lora: lora_alpha must be finite, got lora_alpha=", lora_alpha);
    LOOM_CHECK(lora_dropout >= 0.0 && lora_dropout < 1.0, "lora: lora_dropout must be in [0, 1), got lora_dropout=",
               lora_dropout);
    LOOM_CHECK(!target_modules.empty(), "lora: target_modules is empty");
    for (std::size_t i = 0; i < target_modules.size(); ++i) {
      const std::string& m = target_modules[i];
      LOOM_CHECK(is_known_module(m), "lora: unknown target module '", m.substr(0, 64),
                 "' (known: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, query_key_value, dense, "
                 "dense_h_to_4h, dense_4h_to_h)");
      LOOM_CHECK(std::find(target_modules.begin(), target_modules.begin() + static_cast<std::ptrdiff_t>(i), m) ==
                     target_modules.begin() + static_cast<std::ptrdiff_t>(i),
                 "lora: target module '", m, "' is listed twice");
    }
  }

  /// The factor of the low-rank term: lora_alpha / r, or lora_alpha / sqrt(r) (rsLoRA).
  double scaling() const {
    return use_rslora ? lora_alpha / std::sqrt(static_cast<double>(r)) : lora_alpha / static_cast<double>(r);
  }
  bool targets(std::string_view module) const {
    return std::find(target_modules.begin(), target_modules.end(), module) != target_modules.end();
  }
};

/// "q_proj,v_proj" -> {"q_proj", "v_proj"} (a command line's list; empty items refused).
inline std::vector<std::string> parse_targets(std::string_view list) {
  std::vector<std::string> out;
  for (std::size_t at = 0;;) {
    const std::size_t comma = list.find(',', at);
    const std::string_view item = list.substr(at, comma == std::string_view::npos ? std::string_view::npos : comma - at);
    LOOM_CHECK(!item.empty(), "lora: empty module name in target list '", std::string(list.substr(0, 256)), "'");
    out.emplace_back(item);
    if (comma == std::string_view::npos) return out;
    at = comma + 1;
  }
}

}  // namespace loom::lora
