#pragma once
// Which chat template a server renders conversations with (llama-serve's `--template`), and which special
// tokens the tokenizer it opens must carry for it.
//
// Why derived from the model: a chat model answers well only in the format it was trained on,
// and its HF folder says which family it is (config.json's model_type) but not which format:
// ChatGLM2 and ChatGLM3 share model_type, config keys and tokenizer.model, and differ in the
// special tokens their tokenizer code appends (ChatGLM3 adds the role tokens <|system|>
// <|user|> <|assistant|> <|observation|>). So, unless `--template` says:
//   model_type chatglm + a tokenizer.model  chatglm3 when the tokenizer's or the checkpoint's
//                                           folder declares the role tokens (tokenizer_config.json
//                                           or tokenization_chatglm.py names <|observation|>),
//                                           else chatglm2
//   llama + a tokenizer.model               llama2 (Meta's [INST] format, bos per turn)
//   a llama2.c tokenizer.bin, or none       no template: plain text as before
// `--template chatglm2|chatglm3` appends that family's special tokens to the tokenizer.model;
// a template the tokenizer cannot carry is an error naming the flag's value.

#include <loom/serve/request.hpp>

#include <loom/core/error.hpp>
#include <loom/data/chat_template.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>

namespace loom::serve {

struct chat_setup {
  std::optional<loom::data::chat_template> templ;  ///< nullopt: plain text (no template)
  std::string specials = "none";                   ///< what the tokenizer.model gets appended (open_tokenizer's)
  std::string why;                                 ///< how it was chosen, for the startup line
};

/// --template's value: chatglm2 | chatglm3 | llama2 (the template), none (nullopt); anything
/// else is an error naming it.
inline std::optional<loom::data::chat_template> parse_template_flag(std::string_view value) {
  if (value == "none") return std::nullopt;
  LOOM_CHECK(value == "chatglm2" || value == "chatglm3" || value == "llama2", "flag --template: '", value.substr(0, 64),
             "' is not one of chatglm2, chatglm3, llama2, none");
  return loom::data::parse_chat_template(value);
}

/// True when a file of ChatGLM3's tokenizer (tokenizer_config.json, tokenization_chatglm.py)
/// in one of `dirs` names its role token <|observation|>. Reads at most 1 MiB of each.
inline bool declares_chatglm3_roles(std::initializer_list<std::filesystem::path> dirs) {
  for (const auto& d : dirs)
    for (const char* name : {"tokenizer_config.json", "tokenization_chatglm.py"}) {
      std::error_code ec;
      const auto f = d / name;
      if (d.empty() || !std::filesystem::is_regular_file(f, ec)) continue;
      std::ifstream in(f, std::ios::binary);
      std::string text(std::size_t{1} << 20, '\0');
      in.read(text.data(), static_cast<std::streamsize>(text.size()));
      text.resize(static_cast<std::size_t>(in.gcount()));
      if (text.find("<|observation|>") != std::string::npos) return true;
    }
  return false;
}

/// The template for `flag` ("" when --template is not given: derived as at the top of this
/// file), a model of `model_type`, and the --tokenizer / --checkpoint paths.
inline chat_setup choose_chat_template(const std::string& flag, const std::string& model_type, const std::string& tokenizer,
                                       const std::string& checkpoint) {
  namespace fs = std::filesystem;
  const bool spm = tokenizer.ends_with(".model");
  chat_setup s;
  if (!flag.empty()) {
    s.templ = parse_template_flag(flag);
    s.why = "--template " + flag;
    LOOM_CHECK(!s.templ || !tokenizer.empty(), "flag --template ", flag,
               " needs --tokenizer (the model's tokenizer.model): the byte codec has no chat template");
  } else if (spm && model_type == "chatglm") {
    const fs::path ckpt(checkpoint);
    const bool glm3 = declares_chatglm3_roles({fs::path(tokenizer).parent_path(), fs::is_directory(ckpt) ? ckpt : ckpt.parent_path()});
    s.templ = glm3 ? loom::data::chat_template::chatglm3 : loom::data::chat_template::chatglm2;
    s.why = glm3 ? "model_type chatglm, the tokenizer's folder declares <|observation|>"
                 : "model_type chatglm, no ChatGLM3 role tokens declared next to the tokenizer";
  } else if (spm && model_type == "llama") {
    s.templ = loom::data::chat_template::llama2;
    s.why = "model_type llama with a SentencePiece tokenizer";
  } else {
    s.why = tokenizer.empty() ? "no tokenizer: bytes" : "tokenizer '" + tokenizer + "' is not a tokenizer.model";
  }
  if (spm && (s.templ == loom::data::chat_template::chatglm2 || s.templ == loom::data::chat_template::chatglm3))
    s.specials = s.templ == loom::data::chat_template::chatglm3 ? "chatglm3" : "chatglm2";
  return s;
}

/// The template's name, or "none".
inline std::string template_name(const std::optional<loom::data::chat_template>& t) {
  return t ? loom::data::detail::template_name(*t) : "none";
}

}  // namespace loom::serve
