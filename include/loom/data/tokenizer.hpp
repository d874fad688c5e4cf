#pragma once
// The tokenizer concept that data loaders, chat templates, the generator and the server share,
// a byte-level tokenizer, a type-erased `any_tokenizer` for programs that pick a tokenizer file
// at run time, and the check that a tokenizer fits a model's vocabulary.
//
// Why one concept: a training sample, a prompt in the generator and a request in the server
// must become the same ids, or a fine-tuned model sees at serving time a text it was never
// trained on. Implementations: `byte_tokenizer` (here), `io::llama2c_tokenizer`
// (tokenizer.bin), `data::sentencepiece_tokenizer` (tokenizer.model, with ChatGLM's appended
// specials).
//
// Why byte-level: loom's examples must run without downloading a vocabulary; bytes cover
// any UTF-8 text (the chat sample is Chinese) with a vocabulary of 256 + 3 special ids.

#include <loom/core/error.hpp>

#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::data {

/// Requires: T turns text into ids and back and names its special ids.
///  - encode(text): the ids of the text alone (no bos / eos: templates add those).
///  - decode(ids): the text of a sequence; special ids give no text.
///  - decode_piece(prev, id): the text of `id` when it follows `prev` (prev < 0: the first
///    token), as raw bytes, for streaming one token at a time. Concatenated over a sequence
///    it equals decode() wherever decode() yields valid UTF-8.
///  - bos_id / eos_id / pad_id: ids inside the vocabulary (pad is what padding is filled with).
///  - vocab_size(): ids are in [0, vocab_size).
///  - special_id(name): the id of a special token by its name ("[gMASK]", "<|user|>", ...),
///    or nullopt when the tokenizer has none of that name.
template <class T>
concept tokenizer = requires(const T& t, std::string_view text, std::span<const std::int32_t> ids, std::int32_t id) {
  { t.encode(text) } -> std::same_as<std::vector<std::int32_t>>;
  { t.decode(ids) } -> std::same_as<std::string>;
  { t.decode_piece(id, id) } -> std::same_as<std::string>;
  { t.bos_id() } -> std::convertible_to<std::int32_t>;
  { t.eos_id() } -> std::convertible_to<std::int32_t>;
  { t.pad_id() } -> std::convertible_to<std::int32_t>;
  { t.vocab_size() } -> std::convertible_to<std::uint32_t>;
  { t.special_id(text) } -> std::same_as<std::optional<std::int32_t>>;
};

/// ids 0..255 are bytes; 256 = <bos>, 257 = <eos>, 258 = <pad>.
struct byte_tokenizer {
  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> ids(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  /// Bytes back to text; special ids are dropped.
  std::string decode(std::span<const std::int32_t> ids) const {
    std::string s;
    for (auto id : ids) s += decode_piece(-1, id);
    return s;
  }
  std::string decode_piece(std::int32_t /*prev*/, std::int32_t id) const {
    return id >= 0 && id < 256 ? std::string(1, static_cast<char>(id)) : std::string();
  }
  std::int32_t bos_id() const noexcept { return 256; }
  std::int32_t eos_id() const noexcept { return 257; }
  std::int32_t pad_id() const noexcept { return 258; }
  std::uint32_t vocab_size() const noexcept { return 259; }
  std::optional<std::int32_t> special_id(std::string_view name) const {
    if (name == "<bos>") return bos_id();
    if (name == "<eos>") return eos_id();
    if (name == "<pad>") return pad_id();
    return std::nullopt;
  }
};

/// Throws unless every id `tok` can produce embeds in a model of `model_vocab` ids: a
/// tokenizer.model meant for another model yields ids the embedding has no row for, and the
/// first sign would be an out-of-range read deep in a forward pass. `what` names the file.
template <tokenizer Tok>
void check_vocab_fits(const Tok& tok, std::int64_t model_vocab, std::string_view what) {
  LOOM_CHECK(static_cast<std::int64_t>(tok.vocab_size()) <= model_vocab, "tokenizer ", what, ": vocab_size=", tok.vocab_size(),
             " is larger than the model's vocab_size=", model_vocab, " (a tokenizer for another model?)");
}

/// Any tokenizer behind one type, for programs that choose the tokenizer file at run time
/// (llama-generate, llama-serve, loom-make-corpus). Satisfies `tokenizer` itself.
class any_tokenizer {
 public:
  template <class Tok>
    requires(!std::same_as<std::remove_cvref_t<Tok>, any_tokenizer> && tokenizer<Tok>)
  explicit any_tokenizer(Tok tok, std::string name = "tokenizer")
      : impl_(std::make_shared<model<Tok>>(std::move(tok))), name_(std::move(name)) {}

  std::vector<std::int32_t> encode(std::string_view text) const { return impl_->encode(text); }
  std::string decode(std::span<const std::int32_t> ids) const { return impl_->decode(ids); }
  std::string decode_piece(std::int32_t prev, std::int32_t id) const { return impl_->decode_piece(prev, id); }
  std::int32_t bos_id() const { return impl_->bos_id(); }
  std::int32_t eos_id() const { return impl_->eos_id(); }
  std::int32_t pad_id() const { return impl_->pad_id(); }
  std::uint32_t vocab_size() const { return impl_->vocab_size(); }
  std::optional<std::int32_t> special_id(std::string_view name) const { return impl_->special_id(name); }
  /// What it was made from (a file name, "bytes"), for messages.
  const std::string& name() const noexcept { return name_; }
  /// The concrete tokenizer, or nullptr when it is another type.
  template <tokenizer Tok>
  const Tok* get() const noexcept {
    auto* m = dynamic_cast<const model<Tok>*>(impl_.get());
    return m ? &m->tok : nullptr;
  }

 private:
  struct concept_t {
    virtual ~concept_t() = default;
    virtual std::vector<std::int32_t> encode(std::string_view) const = 0;
    virtual std::string decode(std::span<const std::int32_t>) const = 0;
    virtual std::string decode_piece(std::int32_t, std::int32_t) const = 0;
    virtual std::int32_t bos_id() const = 0;
    virtual std::int32_t eos_id() const = 0;
    virtual std::int32_t pad_id() const = 0;
    virtual std::uint32_t vocab_size() const = 0;
    virtual std::optional<std::int32_t> special_id(std::string_view) const = 0;
  };
  template <class Tok>
  struct model final : concept_t {
    explicit model(Tok t) : tok(std::move(t)) {}
    std::vector<std::int32_t> encode(std::string_view s) const override { return tok.encode(s); }
    std::string decode(std::span<const std::int32_t> ids) const override { return tok.decode(ids); }
    std::string decode_piece(std::int32_t prev, std::int32_t id) const override { return tok.decode_piece(prev, id); }
    std::int32_t bos_id() const override { return static_cast<std::int32_t>(tok.bos_id()); }
    std::int32_t eos_id() const override { return static_cast<std::int32_t>(tok.eos_id()); }
    std::int32_t pad_id() const override { return static_cast<std::int32_t>(tok.pad_id()); }
    std::uint32_t vocab_size() const override { return static_cast<std::uint32_t>(tok.vocab_size()); }
    std::optional<std::int32_t> special_id(std::string_view n) const override { return tok.special_id(n); }
    Tok tok;
  };
  std::shared_ptr<const concept_t> impl_;  // immutable, so copies may share it across threads
  std::string name_;
};

}  // namespace loom::data
