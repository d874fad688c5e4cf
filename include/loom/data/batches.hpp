#pragma once
// Training data for a trainer: token shards, or (one path ending in
// .jsonl) chat records with the loss on the responses only, as (tokens, targets) micro-batches.
//
// Why one place: every trainer reads the same files the same way (the shards' windows or the
// encoded records, in one shuffled order per epoch); what differs is only who asks for which
// micro-batch. global_micro_batch() gives micro-batch g of the G in a training step (G over
// all data-parallel ranks together) at step t, the rows the same whichever rank asks, so a
// run's loss curve does not depend on how the mesh splits the batch.

#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/data/batch.hpp>
#include <loom/data/chat_jsonl.hpp>
#include <loom/data/token_loader.hpp>
#include <loom/data/tokenizer.hpp>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

namespace loom::data {

using batch_loader = std::variant<loom::data::token_loader, loom::data::chat_loader>;

/// Whether `data` names chat records (one path ending in .jsonl) rather than token shards.
inline bool is_chat_data(const std::vector<std::string>& data) {
  return data.size() == 1 && data[0].size() > 6 && data[0].ends_with(".jsonl");
}

/// How chat records become ids: a tokenizer (examples/data/tokenizer_file.hpp opens one from
/// a --tokenizer flag; none: byte tokens) and a chat template (chatglm2 by default).
struct chat_encoding {
  const loom::data::any_tokenizer* tokenizer = nullptr;
  loom::data::chat_template_options chat_template = {};
  /// source (prompt side) ids per row, ChatGLM's max_source_length; the target takes the rest
  /// of the row (max_target_length = seq - this). 0: half the row.
  std::size_t max_source_length = 0;
};

/// Batches of `micro` rows of `seq` tokens for the model's vocabulary. Chat records: tokens of
/// `chat` (bytes by default), chat.max_source_length ids (default half the sequence) for the
/// prompt side, the rest for the response.
/// rank / world: this loader reads every world-th batch (a data-parallel rank's stride); 0 / 1
/// reads them all.
inline batch_loader make_batch_loader(const std::vector<std::string>& data, loom::index_t vocab, loom::index_t seq,
                                      std::int64_t micro, std::uint64_t seed, int rank = 0, int world = 1,
                                      const chat_encoding& chat = {}) {
  LOOM_CHECK(!data.empty(), "data: no files given");
  LOOM_CHECK(seq >= 1 && micro >= 1, "data: seq=", seq, " and micro batch=", micro, " must be >= 1");
  const loom::data::sampler_options so{.batch = std::size_t(micro), .seed = seed, .rank = rank, .world = world};
  if (is_chat_data(data)) {
    LOOM_CHECK(chat.max_source_length < std::size_t(seq), "data: max_source_length ", chat.max_source_length,
               " leaves no room for the response in rows of seq=", seq, " ids");
    const std::size_t src = chat.max_source_length ? chat.max_source_length : std::size_t(seq) / 2;
    const loom::data::chat_encode_options eo{.max_source_length = src, .max_target_length = std::size_t(seq) - src,
                                             .vocab_size = std::uint32_t(vocab), .chat_template = chat.chat_template};
    if (chat.tokenizer) {
      loom::data::check_vocab_fits(*chat.tokenizer, vocab, "'" + chat.tokenizer->name() + "'");
      return loom::data::chat_loader(loom::data::read_chat_jsonl(data[0]), *chat.tokenizer, eo, so);
    }
    const loom::data::byte_tokenizer tok;
    LOOM_CHECK(vocab >= tok.vocab_size(), "data: chat data needs vocab >= ", tok.vocab_size(),
               " (bytes + bos/eos/pad), got vocab=", vocab);
    return loom::data::chat_loader(loom::data::read_chat_jsonl(data[0]), tok, eo, so);
  }
  for (const auto& d : data)
    LOOM_CHECK(!d.ends_with(".jsonl"), "data: chat records (", d, ") must be the only file, not one of ", data.size());
  return loom::data::token_loader(loom::data::open_shards(data, loom::data::token_width::u16),
                                  {.seq_len = std::size_t(seq), .batch = so.batch, .vocab_size = std::uint32_t(vocab),
                                   .seed = seed, .rank = rank, .world = world});
}

/// Micro-batch g of the G that make up step t, over the whole data set in its per-epoch order
/// (the loader must read every batch: rank 0 of world 1): batch number t G + g.
inline void global_micro_batch(batch_loader& loader, std::int64_t step, int g, int G, loom::data::token_batch& out) {
  LOOM_CHECK(step >= 0 && g >= 0 && g < G, "data: micro-batch ", g, " of ", G, " at step ", step);
  std::visit(
      [&](auto& l) {
        const auto per_epoch = static_cast<std::int64_t>(l.batches_per_epoch());
        const std::int64_t q = step * G + g;
        l.set_state({q / per_epoch, q % per_epoch});
        l.next(out);
      },
      loader);
}

}  // namespace loom::data
