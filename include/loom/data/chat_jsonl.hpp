#pragma once
// Chat fine-tuning data: ChatGLM-style JSONL records -> (tokens, targets) with loss only on
// the response.
//
// One JSON object per line: {"prompt": "...", "response": "...", "history": [[user,
// assistant], ...]} (user features folded into the prompt; column names configurable, history
// optional). Encoding follows ChatGLM2's fine-tuning recipe (ptuning/main.py) so a DeepSpeed
// user gets the same samples; the template (data/chat_template.hpp: chatglm2 by default,
// chatglm3, llama2) turns a record into source and target ids, then
//   a        = source, truncated to max_source_length ids
//   b        = target, truncated to max_target_length ids
//   input    = a + b + [eos]           labels = [ignore]*len(a) + b + [eos]
// padded with pad / ignore to max_source_length + max_target_length + 1, then shifted for
// next-token prediction: tokens = input[:-1], targets = labels[1:]. So the loss covers the
// response and the final eos, never the prompt or the history. With chatglm2 the source is
// [gMASK] sop (bos for a tokenizer without them, as the byte tokenizer) + encode of
//   "[Round i]\n\n问：{user}\n\n答：{assistant}\n\n" per earlier turn (i from 1), then
//   "[Round n]\n\n问：{prompt}\n\n答：".
//
// The file comes from outside: a line longer than chat_read_options::max_line_bytes is refused
// before it is held whole (parsing costs several times a line's size), nesting is limited,
// and messages name the file:line and the field and quote values bounded (data/json_input.hpp).

#include <loom/core/error.hpp>
#include <loom/data/batch.hpp>
#include <loom/data/chat_template.hpp>
#include <loom/data/json_input.hpp>
#include <loom/data/sampler.hpp>
#include <loom/data/tokenizer.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace loom::data {

struct chat_columns {
  std::string prompt = "prompt";
  std::string response = "response";
  std::string history = "history";  ///< empty: no history column
};

/// Parses one JSONL line; `where` (file:line) goes into error messages.
inline chat_record parse_chat_record(std::string_view line, const chat_columns& c = {}, const std::string& where = "line") {
  const nlohmann::json j = parse_json_input(line, "chat jsonl " + where);
  LOOM_CHECK(j.is_object(), "chat jsonl ", where, ": expected a JSON object, got ", j.type_name());
  auto text = [&](const std::string& key) {
    LOOM_CHECK(j.contains(key), "chat jsonl ", where, ": missing field \"", key, "\"");
    LOOM_CHECK(j.at(key).is_string(), "chat jsonl ", where, ": field \"", key, "\" must be a string, got ", j.at(key).type_name(), " ",
               quote_json(j.at(key)));
    return j.at(key).get<std::string>();
  };
  chat_record r{text(c.prompt), text(c.response), {}};
  if (!c.history.empty() && j.contains(c.history) && !j.at(c.history).is_null()) {
    const auto& h = j.at(c.history);
    LOOM_CHECK(h.is_array(), "chat jsonl ", where, ": field \"", c.history, "\" must be a list of [user, assistant] pairs, got ",
               quote_json(h));
    for (std::size_t i = 0; i < h.size(); ++i) {
      LOOM_CHECK(h[i].is_array() && h[i].size() == 2 && h[i][0].is_string() && h[i][1].is_string(), "chat jsonl ", where,
                 ": field \"", c.history, "\": history[", i, "] must be [user, assistant] strings, got ", quote_json(h[i]));
      r.history.emplace_back(h[i][0].get<std::string>(), h[i][1].get<std::string>());
    }
  }
  return r;
}

struct chat_read_options {
  /// Longest line read; a longer one is an error naming its line number (chat records are
  /// kilobytes; parsing costs several times the line's size in memory).
  std::size_t max_line_bytes = std::size_t{16} << 20;
};

/// Reads every non-blank line of a JSONL file; an empty file is an error.
inline std::vector<chat_record> read_chat_jsonl(const std::string& path, const chat_columns& c = {}, const chat_read_options& o = {}) {
  std::ifstream f(path, std::ios::binary);
  LOOM_CHECK(f.good(), "read_chat_jsonl: cannot open path='", path, "'");
  std::vector<chat_record> out;
  std::string line;
  std::streambuf* in = f.rdbuf();
  for (std::size_t n = 1;; ++n) {
    line.clear();
    int ch;
    while ((ch = in->sbumpc()) != std::char_traits<char>::eof() && ch != '\n') {
      LOOM_CHECK(line.size() < o.max_line_bytes, "chat jsonl ", path, ":", n, ": line longer than max_line_bytes=", o.max_line_bytes,
                 " (chat_read_options::max_line_bytes)");
      line.push_back(static_cast<char>(ch));
    }
    if (line.find_first_not_of(" \t\r") != std::string::npos) out.push_back(parse_chat_record(line, c, path + ":" + std::to_string(n)));
    if (ch == std::char_traits<char>::eof()) break;
  }
  LOOM_CHECK(!out.empty(), "read_chat_jsonl: empty dataset: path='", path, "' has no records");
  return out;
}

struct chat_encode_options {
  std::size_t max_source_length = 64;
  std::size_t max_target_length = 64;
  std::uint32_t vocab_size = 0;  ///< the model's; 0 = the tokenizer's
  chat_template_options chat_template = {};  ///< chatglm2 (the default), chatglm3, llama2; system prompt
};

/// Sequence length of an encoded sample.
inline std::size_t chat_seq_len(const chat_encode_options& o) { return o.max_source_length + o.max_target_length; }

/// Encodes one record; appends seq_len tokens and targets to `tokens` / `targets`.
template <tokenizer Tok>
inline void encode_chat(const chat_record& r, const Tok& tok, const chat_encode_options& o, std::vector<std::int32_t>& tokens,
                        std::vector<std::int32_t>& targets) {
  const std::uint32_t vocab = o.vocab_size ? o.vocab_size : static_cast<std::uint32_t>(tok.vocab_size());
  const chat_sample c = make_chat_sample(apply_chat_template(r, tok, o.chat_template), tok,
                                         {.max_source_length = o.max_source_length, .max_target_length = o.max_target_length});
  const std::size_t L = chat_seq_len(o) + 1;
  std::vector<std::int32_t> input(L, static_cast<std::int32_t>(tok.pad_id())), labels(L, ignore_index);
  for (std::size_t i = 0; i < c.ids.size(); ++i) {
    input[i] = c.ids[i];
    if (c.is_response[i]) labels[i] = c.ids[i];
  }
  for (std::size_t i = 0; i < L; ++i)
    LOOM_CHECK(input[i] >= 0 && static_cast<std::uint32_t>(input[i]) < vocab, "encode_chat: token id ", input[i],
               " >= vocab_size ", vocab, " at position ", i);
  tokens.insert(tokens.end(), input.begin(), input.end() - 1);
  targets.insert(targets.end(), labels.begin() + 1, labels.end());
}

/// Encoded chat samples with the same shuffling / rank striding as the token loader.
class chat_loader {
 public:
  template <tokenizer Tok>
  chat_loader(const std::vector<chat_record>& records, const Tok& tok, chat_encode_options o, sampler_options s)
      : seq_len_(chat_seq_len(o)) {
    LOOM_CHECK(!records.empty(), "chat_loader: empty dataset (no records)");
    for (const auto& r : records) encode_chat(r, tok, o, tokens_, targets_);
    sampler_ = distributed_sampler(records.size(), s, "chat_loader");
  }
  std::size_t seq_len() const noexcept { return seq_len_; }
  std::size_t size() const noexcept { return sampler_.size(); }
  std::size_t batches_per_epoch() const noexcept { return sampler_.batches_per_epoch(); }
  loader_state state() const noexcept { return state_; }
  void set_state(loader_state s) {
    sampler_.check_state(s, "chat_loader");
    state_ = s;
  }
  void next(token_batch& out) {
    const std::size_t B = sampler_.options().batch, S = seq_len_;
    out.batch = B, out.seq_len = S;
    out.tokens.resize(B * S);
    out.targets.resize(B * S);
    for (std::size_t b = 0; b < B; ++b) {
      const std::size_t k = static_cast<std::size_t>(sampler_.sample(state_, b));
      std::copy_n(tokens_.begin() + static_cast<std::ptrdiff_t>(k * S), S, out.tokens.begin() + static_cast<std::ptrdiff_t>(b * S));
      std::copy_n(targets_.begin() + static_cast<std::ptrdiff_t>(k * S), S, out.targets.begin() + static_cast<std::ptrdiff_t>(b * S));
    }
    state_ = sampler_.advance(state_);
  }

 private:
  std::size_t seq_len_;
  std::vector<std::int32_t> tokens_, targets_;  // [records, seq_len]
  distributed_sampler sampler_;
  loader_state state_;
};

}  // namespace loom::data
