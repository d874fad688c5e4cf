#pragma once
// The tokenizer an example program's --tokenizer names, behind one type (data::any_tokenizer):
//   bytes              data::byte_tokenizer (no file; 256 bytes + bos/eos/pad)
//   *.model            SentencePiece (LLaMA, ChatGLM2/3), with ChatGLM's special tokens appended
//                      when `specials` is chatglm2 or chatglm3; needs loom::sentencepiece
//   any other file     llama2.c's tokenizer.bin
// Why here and not in the library: choosing a format by a file's name is a program's
// convention; the library's part is the concept the three share.

#include <loom/data/tokenizer.hpp>
#include <loom/io/llama2c.hpp>
#if LOOM_HAS_SENTENCEPIECE
#include <loom/data/sentencepiece_tokenizer.hpp>
#endif

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <string_view>

namespace examples {

/// Opens `spec` (see above). `specials`: none, chatglm2 or chatglm3 (SentencePiece only).
/// `model_vocab` > 0: the model's vocabulary, which the tokenizer's must fit (a llama2.c file
/// is read up to it, as llama2c_tokenizer does; a tokenizer.model larger than it is an error
/// naming both sizes).
inline loom::data::any_tokenizer open_tokenizer(const std::string& spec, std::string_view specials = "none",
                                                std::int64_t model_vocab = 0) {
  LOOM_CHECK(specials == "none" || specials == "chatglm2" || specials == "chatglm3", "tokenizer specials '", specials.substr(0, 32),
             "' is not one of none, chatglm2, chatglm3");
  const auto fits = [&](const loom::data::any_tokenizer& t) {
    if (model_vocab > 0) loom::data::check_vocab_fits(t, model_vocab, "'" + spec + "'");
    return t;
  };
  if (spec == "bytes") {
    LOOM_CHECK(specials == "none", "the byte tokenizer has no ", specials, " special tokens (give a tokenizer.model)");
    return fits(loom::data::any_tokenizer(loom::data::byte_tokenizer{}, "bytes"));
  }
  if (spec.ends_with(".model")) {
#if LOOM_HAS_SENTENCEPIECE
    loom::data::sentencepiece_options o;
    if (specials == "chatglm2") o.appended_specials = loom::data::chatglm2_special_tokens();
    if (specials == "chatglm3") o.appended_specials = loom::data::chatglm3_special_tokens();
    return fits(loom::data::any_tokenizer(loom::data::sentencepiece_tokenizer(spec, o), spec));
#else
    LOOM_THROW("tokenizer '", spec, "' is a SentencePiece model, but this program was built without SentencePiece ",
               "(apt-get install libsentencepiece-dev, then configure again)");
#endif
  }
  LOOM_CHECK(specials == "none", "tokenizer '", spec, "': ", specials, " special tokens need a SentencePiece tokenizer.model");
  return loom::data::any_tokenizer(
      loom::io::llama2c_tokenizer(spec, model_vocab > 0 ? static_cast<std::int32_t>(std::min<std::int64_t>(model_vocab, INT32_MAX)) : 0),
      spec);
}

}  // namespace examples
