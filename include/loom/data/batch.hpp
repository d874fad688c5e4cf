#pragma once
// What every loader in loom::data produces: a batch of (tokens, targets).
//
// Targets are the next tokens; a position whose target is `ignore_index` carries no loss
// (padding, and the prompt part of a chat sample). int32 ids: the embedding and the
// cross-entropy take them as they are.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace loom::data {

/// Ignored targets (positions without loss), PyTorch's default ignore_index.
inline constexpr std::int32_t ignore_index = -100;

/// One batch: tokens and targets, both [batch, seq_len], row-major int32.
struct token_batch {
  std::vector<std::int32_t> tokens;   // [batch, seq_len]
  std::vector<std::int32_t> targets;  // [batch, seq_len], ignore_index where no loss
  std::size_t batch = 0, seq_len = 0;
};

}  // namespace loom::data
