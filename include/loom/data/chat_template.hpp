#pragma once
// Chat templates over a data::tokenizer: a chat record (prompt, response, history) becomes
// the ids a model is trained on, with a flag per id that says whether the loss covers it.
//
// Why ids and not text: ChatGLM3's role tokens and LLaMA-2's <s> / </s> between turns are
// special ids that no text encodes to, and each segment is encoded on its own (SentencePiece
// adds its dummy "▁" per encode call), so rendering one string and encoding it would give
// other ids than the models were trained on.
//
// A template splits a record into a source (everything the model reads: the prefix, the
// history, the prompt) and a target (what it must write). make_chat_sample() then applies
// ChatGLM's ptuning/main.py rule: source cut to max_source_length ids (its tail goes, the
// prefix stays), target cut to max_target_length, ids = source + target + [eos], and the loss
// covers the target and the eos only.
//
//   chatglm2  [gMASK] sop + encode("[Round 1]\n\n问：{q}\n\n答：{r}\n\n" ... "[Round n]\n\n问：{prompt}\n\n答：")
//             target encode(response). A tokenizer without [gMASK] / sop (bytes) starts with
//             bos instead, so byte-level examples train on the same text.
//   chatglm3  [gMASK] sop, then per message <|role|> + encode("\n") + encode(content)
//             (an optional <|system|> message, then user / assistant turns of the history,
//             then the prompt as <|user|>), then <|assistant|>; target encode("\n") +
//             encode(response): the empty metadata line and the answer the model writes.
//   llama2    per past turn: bos + encode("[INST] {q} [/INST] {r} ") + eos; then
//             bos + encode("[INST] {prompt} [/INST]"); contents stripped of surrounding
//             whitespace; a system prompt wraps the first user message as
//             "<<SYS>>\n{system}\n<</SYS>>\n\n{q}" (Meta's chat format); target encode(response).

#include <loom/core/error.hpp>
#include <loom/data/tokenizer.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace loom::data {

struct chat_record {
  std::string prompt, response;
  std::vector<std::pair<std::string, std::string>> history;  // [user, assistant] turns
};

enum class chat_template { chatglm2, chatglm3, llama2 };

/// "chatglm2" | "chatglm3" | "llama2" -> the template; anything else is an error naming it.
inline chat_template parse_chat_template(std::string_view name) {
  if (name == "chatglm2") return chat_template::chatglm2;
  if (name == "chatglm3") return chat_template::chatglm3;
  if (name == "llama2") return chat_template::llama2;
  LOOM_THROW("chat template '", name.substr(0, 64), "' is not one of chatglm2, chatglm3, llama2");
}

struct chat_template_options {
  chat_template kind = chat_template::chatglm2;
  std::string system;  ///< system prompt (chatglm3, llama2); empty: none. chatglm2 has none.
};

/// ChatGLM2's prompt text for a record (history rounds, then the prompt, ending in "答：").
inline std::string chatglm2_prompt(const chat_record& r) {
  std::string s;
  std::size_t round = 1;
  for (const auto& [user, assistant] : r.history)
    s += "[Round " + std::to_string(round++) + "]\n\n问：" + user + "\n\n答：" + assistant + "\n\n";
  s += "[Round " + std::to_string(round) + "]\n\n问：" + r.prompt + "\n\n答：";
  return s;
}

/// What the model reads and what it must write, before truncation.
struct chat_parts {
  std::vector<std::int32_t> source, target;
};

namespace detail {

inline void append(std::vector<std::int32_t>& to, const std::vector<std::int32_t>& ids) { to.insert(to.end(), ids.begin(), ids.end()); }

template <tokenizer Tok>
std::int32_t required_special(const Tok& tok, std::string_view name, std::string_view why) {
  const auto id = tok.special_id(name);
  LOOM_CHECK(id.has_value(), "chat template ", why, " needs the special token ", name,
             ", which the tokenizer lacks (a ChatGLM3 tokenizer.model with its appended specials?)");
  return *id;
}

/// Python's str.strip(): whitespace at both ends (ASCII; what the chat data holds).
inline std::string_view strip(std::string_view s) {
  constexpr std::string_view ws = " \t\n\r\f\v";
  const auto b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

}  // namespace detail

/// Splits `r` into source and target ids by the template `o.kind` (see the top of this file).
template <tokenizer Tok>
chat_parts apply_chat_template(const chat_record& r, const Tok& tok, const chat_template_options& o = {}) {
  chat_parts p;
  using detail::append;
  switch (o.kind) {
    case chat_template::chatglm2: {
      const auto gmask = tok.special_id("[gMASK]"), sop = tok.special_id("sop");
      if (gmask && sop) p.source = {*gmask, *sop};
      else p.source = {static_cast<std::int32_t>(tok.bos_id())};
      LOOM_CHECK(o.system.empty(), "chat template chatglm2 has no system prompt (give chatglm3 or llama2)");
      append(p.source, tok.encode(chatglm2_prompt(r)));
      p.target = tok.encode(r.response);
      break;
    }
    case chat_template::chatglm3: {
      p.source = {detail::required_special(tok, "[gMASK]", "chatglm3"), detail::required_special(tok, "sop", "chatglm3")};
      const std::vector<std::int32_t> newline = tok.encode("\n");  // the empty metadata line
      const auto message = [&](std::string_view role, std::string_view content) {
        p.source.push_back(detail::required_special(tok, role, "chatglm3"));
        append(p.source, newline);
        append(p.source, tok.encode(content));
      };
      if (!o.system.empty()) message("<|system|>", o.system);
      for (const auto& [user, assistant] : r.history) {
        message("<|user|>", user);
        message("<|assistant|>", assistant);
      }
      message("<|user|>", r.prompt);
      p.source.push_back(detail::required_special(tok, "<|assistant|>", "chatglm3"));
      p.target = newline;
      append(p.target, tok.encode(r.response));
      break;
    }
    case chat_template::llama2: {
      const auto bos = static_cast<std::int32_t>(tok.bos_id()), eos = static_cast<std::int32_t>(tok.eos_id());
      const auto user = [&](std::size_t turn, const std::string& q) {  // the system prompt joins the first message, then strip
        return std::string(detail::strip(turn == 0 && !o.system.empty() ? "<<SYS>>\n" + o.system + "\n<</SYS>>\n\n" + q : q));
      };
      for (std::size_t i = 0; i < r.history.size(); ++i) {
        p.source.push_back(bos);
        append(p.source, tok.encode("[INST] " + user(i, r.history[i].first) + " [/INST] " + std::string(detail::strip(r.history[i].second)) + " "));
        p.source.push_back(eos);
      }
      p.source.push_back(bos);
      append(p.source, tok.encode("[INST] " + user(r.history.size(), r.prompt) + " [/INST]"));
      p.target = tok.encode(detail::strip(r.response));
      break;
    }
  }
  return p;
}

/// Ids with a per-id loss flag.
struct chat_sample {
  std::vector<std::int32_t> ids;
  std::vector<std::uint8_t> is_response;  ///< 1: the loss covers this id (target and the final eos)
};

struct chat_truncation {
  std::size_t max_source_length = 64;
  std::size_t max_target_length = 64;
};

/// ChatGLM's ptuning rule: source[:max_source_length] + target[:max_target_length] + [eos].
template <tokenizer Tok>
chat_sample make_chat_sample(const chat_parts& p, const Tok& tok, const chat_truncation& t) {
  LOOM_CHECK(t.max_source_length >= 1 && t.max_target_length >= 1, "chat sample: max_source_length (", t.max_source_length,
             ") and max_target_length (", t.max_target_length, ") must be >= 1");
  const std::size_t a = std::min(p.source.size(), t.max_source_length), b = std::min(p.target.size(), t.max_target_length);
  chat_sample s;
  s.ids.reserve(a + b + 1);
  s.ids.insert(s.ids.end(), p.source.begin(), p.source.begin() + static_cast<std::ptrdiff_t>(a));
  s.ids.insert(s.ids.end(), p.target.begin(), p.target.begin() + static_cast<std::ptrdiff_t>(b));
  s.ids.push_back(static_cast<std::int32_t>(tok.eos_id()));
  s.is_response.assign(a, 0);
  s.is_response.resize(a + b + 1, 1);
  return s;
}

}  // namespace loom::data
