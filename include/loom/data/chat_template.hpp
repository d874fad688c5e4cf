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
//
// The same sources for a conversation as messages (render_chat: what a server reads from an
// OpenAI "messages" list or api.py's history), with ChatGLM3's four roles: system, user,
// assistant, observation (a tool's result), each `<|role|>` + encode(metadata + "\n") +
// encode(content) as its tokenizer's build_single_message does (metadata: an assistant's
// tool name, empty otherwise). chat_stop_ids() names the ids that end the model's answer:
// eos, and for ChatGLM3 the roles that follow an assistant turn (<|user|>, <|observation|>).

#include <loom/core/error.hpp>
#include <loom/data/tokenizer.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
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

/// One message of a conversation.
struct chat_message {
  std::string role;      ///< system, user, assistant, or observation (a tool's result; chatglm3 only)
  std::string content;
  std::string metadata;  ///< chatglm3: the text after the role token (an assistant's tool name); empty otherwise
};

/// The record's source as messages: a system message when `system` is not empty, the history
/// as user / assistant turns, the prompt as user.
inline std::vector<chat_message> chat_messages(const chat_record& r, std::string_view system = {}) {
  std::vector<chat_message> m;
  m.reserve(2 * r.history.size() + 2);
  if (!system.empty()) m.push_back({"system", std::string(system), {}});
  for (const auto& [user, assistant] : r.history) {
    m.push_back({"user", user, {}});
    m.push_back({"assistant", assistant, {}});
  }
  m.push_back({"user", r.prompt, {}});
  return m;
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

inline const char* template_name(chat_template kind) {
  switch (kind) {
    case chat_template::chatglm2: return "chatglm2";
    case chat_template::chatglm3: return "chatglm3";
    case chat_template::llama2: break;
  }
  return "llama2";
}

/// chatglm2 and llama2 read turns: m[from..] alternate user / assistant and end with user.
inline void check_turns(std::span<const chat_message> m, std::size_t from, chat_template kind) {
  LOOM_CHECK(m.size() > from, "chat template ", template_name(kind), ": the conversation has no user message to answer");
  for (std::size_t i = 0; i < m.size(); ++i)
    LOOM_CHECK(m[i].metadata.empty(), "chat template ", template_name(kind), ": message ", i,
               " has metadata, which only chatglm3 reads (a tool call)");
  for (std::size_t i = from; i < m.size(); ++i) {
    const char* want = (i - from) % 2 == 0 ? "user" : "assistant";
    LOOM_CHECK(m[i].role == want, "chat template ", template_name(kind), ": message ", i, " has role '", m[i].role.substr(0, 32),
               "' where '", want, "' was expected (", m[i].role == "system" ? "a system message only comes first; " : "",
               "turns alternate user / assistant and end with user", kind == chat_template::chatglm2 && m[i].role == "system" ? "; chatglm2 has no system prompt (give chatglm3 or llama2)" : "", ")");
  }
  LOOM_CHECK(m.back().role == "user", "chat template ", template_name(kind), ": the last message has role '", m.back().role.substr(0, 32),
             "'; the model answers a user message");
}

/// ChatGLM2's build_prompt over alternating user / assistant messages ending in a user one.
inline std::string chatglm2_text(std::span<const chat_message> m) {
  check_turns(m, 0, chat_template::chatglm2);
  std::string s;
  std::size_t round = 1;
  for (std::size_t i = 0; i + 1 < m.size(); i += 2)
    s += "[Round " + std::to_string(round++) + "]\n\n问：" + m[i].content + "\n\n答：" + m[i + 1].content + "\n\n";
  s += "[Round " + std::to_string(round) + "]\n\n问：" + m.back().content + "\n\n答：";
  return s;
}

}  // namespace detail

/// ChatGLM2's prompt text for a record (history rounds, then the prompt, ending in "答：").
inline std::string chatglm2_prompt(const chat_record& r) { return detail::chatglm2_text(chat_messages(r)); }

/// The special tokens template `kind` cannot do without (chatglm2 starts with bos when the
/// tokenizer lacks [gMASK] / sop; llama2 uses bos / eos, which every tokenizer has).
inline std::vector<std::string_view> chat_template_specials(chat_template kind) {
  if (kind == chat_template::chatglm3) return {"[gMASK]", "sop", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"};
  return {};
}

/// Throws unless `tok` (called `tokenizer_name` in the message) has every special token
/// template `kind` needs: a server checks this once, before the first request.
template <tokenizer Tok>
void check_chat_template(const Tok& tok, chat_template kind, std::string_view tokenizer_name) {
  for (const auto name : chat_template_specials(kind))
    LOOM_CHECK(tok.special_id(name).has_value(), "chat template ", detail::template_name(kind), " needs the special token ", name,
               ", which tokenizer '", tokenizer_name, "' lacks (ChatGLM3's tokenizer.model with its appended special tokens has it)");
}

/// The ids every prompt under template `kind` starts with, as the model's tokenizer adds them
/// (a raw completion prompt too): [gMASK] sop for ChatGLM2/3 (chatglm2 starts with bos on a
/// tokenizer without them, as byte-level examples do), bos for llama2.
template <tokenizer Tok>
std::vector<std::int32_t> chat_prefix(const Tok& tok, chat_template kind) {
  if (kind == chat_template::chatglm3)
    return {detail::required_special(tok, "[gMASK]", "chatglm3"), detail::required_special(tok, "sop", "chatglm3")};
  const auto gmask = tok.special_id("[gMASK]"), sop = tok.special_id("sop");
  if (kind == chat_template::chatglm2 && gmask && sop) return {*gmask, *sop};
  return {static_cast<std::int32_t>(tok.bos_id())};
}

/// The ids a model reads for `m` up to where the assistant's answer begins (see the top of
/// this file): chatglm2 and llama2 take alternating user / assistant messages ending in a user
/// one (llama2 a system message first); chatglm3 any sequence of its four roles, each with
/// its metadata. A role the template has no place for is an error naming the message.
template <tokenizer Tok>
std::vector<std::int32_t> render_chat(std::span<const chat_message> m, const Tok& tok, chat_template kind) {
  using detail::append;
  std::vector<std::int32_t> ids;
  switch (kind) {
    case chat_template::chatglm2:
      ids = chat_prefix(tok, kind);
      append(ids, tok.encode(detail::chatglm2_text(m)));
      break;
    case chat_template::chatglm3: {
      ids = chat_prefix(tok, kind);
      for (std::size_t i = 0; i < m.size(); ++i) {
        const std::string& role = m[i].role;
        LOOM_CHECK(role == "system" || role == "user" || role == "assistant" || role == "observation", "chat template chatglm3: message ",
                   i, " has role '", role.substr(0, 32), "', not one of system, user, assistant, observation");
        ids.push_back(detail::required_special(tok, "<|" + role + "|>", "chatglm3"));
        append(ids, tok.encode(m[i].metadata + "\n"));
        append(ids, tok.encode(m[i].content));
      }
      ids.push_back(detail::required_special(tok, "<|assistant|>", "chatglm3"));
      break;
    }
    case chat_template::llama2: {
      // Meta's chat_completion: a leading system message wraps the first user message.
      const bool has_system = !m.empty() && m[0].role == "system";
      const std::size_t first = has_system ? 1 : 0;
      detail::check_turns(m, first, kind);
      const auto bos = static_cast<std::int32_t>(tok.bos_id()), eos = static_cast<std::int32_t>(tok.eos_id());
      const auto user = [&](std::size_t i) {
        return std::string(detail::strip(i == first && has_system ? "<<SYS>>\n" + m[0].content + "\n<</SYS>>\n\n" + m[i].content
                                                                  : m[i].content));
      };
      for (std::size_t i = first; i + 1 < m.size(); i += 2) {
        ids.push_back(bos);
        append(ids, tok.encode("[INST] " + user(i) + " [/INST] " + std::string(detail::strip(m[i + 1].content)) + " "));
        ids.push_back(eos);
      }
      ids.push_back(bos);
      append(ids, tok.encode("[INST] " + user(m.size() - 1) + " [/INST]"));
      break;
    }
  }
  return ids;
}

/// The ids that end the model's answer under template `kind`: the tokenizer's eos, and for
/// chatglm3 <|user|> and <|observation|> (the turns that follow an assistant's, as ChatGLM3's
/// chat() stops on). The answer is the ids before the first of them.
template <tokenizer Tok>
std::vector<std::int32_t> chat_stop_ids(const Tok& tok, chat_template kind) {
  std::vector<std::int32_t> ids{static_cast<std::int32_t>(tok.eos_id())};
  if (kind == chat_template::chatglm3)
    for (const auto name : {"<|user|>", "<|observation|>"}) ids.push_back(detail::required_special(tok, name, "chatglm3"));
  return ids;
}

/// Splits `r` into source and target ids by the template `o.kind` (see the top of this file).
template <tokenizer Tok>
chat_parts apply_chat_template(const chat_record& r, const Tok& tok, const chat_template_options& o = {}) {
  LOOM_CHECK(o.kind != chat_template::chatglm2 || o.system.empty(), "chat template chatglm2 has no system prompt (give chatglm3 or llama2)");
  chat_parts p;
  p.source = render_chat(chat_messages(r, o.system), tok, o.kind);
  switch (o.kind) {
    case chat_template::chatglm2: p.target = tok.encode(r.response); break;
    case chat_template::chatglm3:  // the empty metadata line the model writes after <|assistant|>, then the answer
      p.target = tok.encode("\n");
      detail::append(p.target, tok.encode(r.response));
      break;
    case chat_template::llama2: p.target = tok.encode(detail::strip(r.response)); break;
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
