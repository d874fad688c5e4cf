// SentencePiece tokenizer.model files through loom's wrapper (data/sentencepiece_tokenizer.hpp):
// the input is the model file; the wrapper loads it (size bound, SentencePiece's own checks,
// bos / eos required, the appended specials), then encodes a short text, decodes the ids whole
// and one at a time, and looks up the special tokens.
//
// What this reaches: loom's code around the library (and its own check of the charsmaps the
// library trusts, data/sentencepiece_model_check.hpp). Debian's libsentencepiece (and the
// protobuf-lite it parses with) is not built with the fuzzer's instrumentation, so libFuzzer
// gets no coverage from inside it and cannot steer mutations through the model's parser, the
// normalizer or the lattice; ASan still catches loom's misuse of what the library returns
// (and a crash inside the library still ends the run as a finding). The seeds
// (scripts/make_fuzz_corpus.py, spm_train) are therefore whole small models of each kind, so
// the mutations start from files the library accepts.
//
// The appended specials come from the input's size mod 3: none (LLaMA), ChatGLM2's, ChatGLM3's.
#include "fuzz_input.hpp"

#include <loom/data/sentencepiece_tokenizer.hpp>

#include <string_view>
#include <vector>

namespace {

// Text that meets the normalizer, whitespace runs, byte fallback (CJK, emoji, a cut UTF-8
// sequence), digits and the names of ChatGLM's specials, which encode() must treat as text.
constexpr std::string_view text = "  Hello world 你好 123 sop [gMASK]\t\xf0\x9f\x99\x82 \xef\xbc\xa1 \xe2\x82";

void check(bool ok) {
  if (!ok) __builtin_trap();
}

void exercise(const loom::data::sentencepiece_tokenizer& tok, const std::vector<std::string>& specials) {
  const std::int32_t pieces = tok.piece_size();
  check(pieces > 0 && tok.vocab_size() == static_cast<std::uint32_t>(pieces) + specials.size());
  check(tok.bos_id() >= 0 && tok.bos_id() < pieces && tok.eos_id() >= 0 && tok.eos_id() < pieces);
  check(tok.pad_id() < pieces);
  for (std::size_t i = 0; i < specials.size(); ++i) check(tok.special_id(specials[i]) == pieces + static_cast<std::int32_t>(i));
  for (std::string_view name : {"<s>", "</s>", "<unk>", "<pad>", "▁", ""})
    if (const auto id = tok.special_id(name)) check(*id >= 0 && *id < pieces);

  std::vector<std::int32_t> ids = tok.encode(text);
  for (const auto id : ids) check(id >= 0 && id < pieces);  // encode yields only the model's pieces
  (void)tok.decode(ids);
  // A sequence as the engine sees it: specials between runs, and an id past the vocabulary
  // (a padded model's row)
  ids.insert(ids.begin(), tok.bos_id());
  if (!specials.empty()) ids.insert(ids.begin() + static_cast<std::ptrdiff_t>(ids.size() / 2), pieces);
  ids.push_back(static_cast<std::int32_t>(tok.vocab_size()) + 7);
  ids.push_back(tok.eos_id());
  (void)tok.decode(ids);
  std::int32_t prev = -1;
  for (const auto id : ids) {
    (void)tok.decode_piece(prev, id);
    prev = id;
  }
  // Every piece of a small model on its own and after a text piece (byte, control, unknown,
  // user-defined and unused pieces each take their own branch)
  const std::int32_t n = pieces < 512 ? pieces : 512;
  for (std::int32_t id = 0; id < n; ++id) {
    (void)tok.decode_piece(-1, id);
    (void)tok.decode_piece(ids.empty() ? -1 : ids.front(), id);
  }
  const loom::data::sentencepiece_tokenizer copy = tok;  // copies share the loaded model
  check(copy.encode(text) == tok.encode(text));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = loom_fuzz::write_input(data, size);
  loom_fuzz::call([&] {
    std::vector<std::string> specials;
    if (size % 3 == 1) specials = loom::data::chatglm2_special_tokens();
    if (size % 3 == 2) specials = loom::data::chatglm3_special_tokens();
    const loom::data::sentencepiece_tokenizer tok(path, {.appended_specials = specials});
    exercise(tok, specials);
  });
  return 0;
}
