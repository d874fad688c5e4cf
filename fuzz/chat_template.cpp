// Chat templates (data/chat_template.hpp) over chat JSONL records (data/chat_jsonl.hpp) with a
// byte tokenizer: each record through apply_chat_template, ChatGLM's ptuning truncation
// (make_chat_sample) and encode_chat, checking what training relies on: one loss flag per id,
// the source and target cut to their bounds and in order, the loss on the target and the eos
// only, every id inside the vocabulary, and each template's structure (its special ids, the
// text between them).
//
// Input: 4 bytes of settings, then JSONL (one record a line, as read_chat_jsonl reads them):
//   [0] bits 0-1 template (chatglm2, chatglm3, llama2; 3: the name "chatglm4", refused),
//       bit 2 a system prompt, bit 3 the byte tokenizer with ChatGLM3's special tokens appended
//   [1] max_source_length, [2] max_target_length (0 is refused)
//   [3] bit 0: no history column
#include "fuzz_input.hpp"

#include <loom/data/chat_jsonl.hpp>

#include <algorithm>
#include <array>
#include <string>
#include <string_view>
#include <vector>

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

// ChatGLM3's special tokens after the 259 ids of the byte tokenizer, as a tokenizer.model
// appends them, so the chatglm templates run their special-token paths over bytes.
constexpr std::array<std::string_view, 9> glm_specials{"[MASK]",   "[gMASK]",  "[sMASK]",       "sop",           "eop",
                                                       "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"};
struct glm_byte_tokenizer : loom::data::byte_tokenizer {
  std::uint32_t vocab_size() const noexcept { return 259 + glm_specials.size(); }
  std::optional<std::int32_t> special_id(std::string_view name) const {
    for (std::size_t i = 0; i < glm_specials.size(); ++i)
      if (glm_specials[i] == name) return static_cast<std::int32_t>(259 + i);
    return byte_tokenizer::special_id(name);
  }
};

std::size_t count(const std::vector<std::int32_t>& ids, std::optional<std::int32_t> id) {
  return id ? static_cast<std::size_t>(std::count(ids.begin(), ids.end(), *id)) : 0;
}

template <class Tok>
void run(const loom::data::chat_record& r, const Tok& tok, const loom::data::chat_template_options& o,
         const loom::data::chat_truncation& t) {
  using loom::data::chat_template;
  const auto p = loom::data::apply_chat_template(r, tok, o);
  const std::size_t turns = r.history.size() + 1;
  check(!p.source.empty());
  switch (o.kind) {
    case chat_template::chatglm2:
      check(p.source.front() == (tok.special_id("[gMASK]") ? *tok.special_id("[gMASK]") : tok.bos_id()));
      check(tok.decode(p.source) == loom::data::chatglm2_prompt(r));  // specials decode to no text
      check(tok.decode(p.target) == r.response);
      break;
    case chat_template::chatglm3:
      check(count(p.source, tok.special_id("<|user|>")) == turns && count(p.source, tok.special_id("<|assistant|>")) == turns);
      check(count(p.source, tok.special_id("<|system|>")) == (o.system.empty() ? 0u : 1u));
      check(p.source.back() == *tok.special_id("<|assistant|>"));
      check(tok.decode(p.target) == "\n" + r.response);
      break;
    case chat_template::llama2:
      check(count(p.source, tok.bos_id()) == turns && count(p.source, tok.eos_id()) == turns - 1);
      check(p.source.front() == tok.bos_id());
      check(tok.decode(p.target) == loom::data::detail::strip(r.response));
      break;
  }

  const auto s = loom::data::make_chat_sample(p, tok, t);
  const std::size_t a = std::min(p.source.size(), t.max_source_length), b = std::min(p.target.size(), t.max_target_length);
  check(s.ids.size() == a + b + 1 && s.is_response.size() == s.ids.size());
  check(std::equal(p.source.begin(), p.source.begin() + static_cast<std::ptrdiff_t>(a), s.ids.begin()));
  check(std::equal(p.target.begin(), p.target.begin() + static_cast<std::ptrdiff_t>(b), s.ids.begin() + static_cast<std::ptrdiff_t>(a)));
  check(s.ids.back() == tok.eos_id());
  for (std::size_t i = 0; i < s.ids.size(); ++i) {
    check(s.ids[i] >= 0 && static_cast<std::uint32_t>(s.ids[i]) < tok.vocab_size());
    check(s.is_response[i] == (i < a ? 0 : 1));
  }

  // The padded, shifted training row: seq_len tokens and targets, loss on the b + 1 ids of
  // the cut target and the eos (never on the source, which is never empty)
  std::vector<std::int32_t> tokens, targets;
  loom::data::encode_chat(r, tok, {.max_source_length = t.max_source_length, .max_target_length = t.max_target_length, .chat_template = o},
                          tokens, targets);
  const std::size_t seq = t.max_source_length + t.max_target_length;
  check(tokens.size() == seq && targets.size() == seq);
  check(static_cast<std::size_t>(std::count_if(targets.begin(), targets.end(), [](auto x) { return x != loom::data::ignore_index; })) ==
        b + 1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 4) return 0;
  using loom::data::chat_template;
  static constexpr std::array<std::string_view, 4> names{"chatglm2", "chatglm3", "llama2", "chatglm4"};
  loom::data::chat_template_options o;
  if (data[0] & 4) o.system = "  You are loom.\n你好 ";
  const loom::data::chat_truncation t{.max_source_length = data[1], .max_target_length = data[2]};
  loom::data::chat_columns cols;
  if (data[3] & 1) cols.history.clear();
  const std::string_view text(reinterpret_cast<const char*>(data + 4), size - 4);

  std::size_t n = 0;
  for (std::size_t begin = 0; begin <= text.size();) {
    std::size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(begin, end - begin);
    begin = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    loom_fuzz::call([&] {
      o.kind = loom::data::parse_chat_template(names[data[0] & 3]);
      const auto r = loom::data::parse_chat_record(line, cols, "line " + std::to_string(++n));
      if (data[0] & 8) run(r, glm_byte_tokenizer{}, o, t);
      else run(r, loom::data::byte_tokenizer{}, o, t);
    });
  }
  return 0;
}
