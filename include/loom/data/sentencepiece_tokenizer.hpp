#pragma once
// SentencePiece tokenizer.model files (LLaMA, ChatGLM2/3) as a data::tokenizer, through the
// SentencePiece library (loom::sentencepiece, Debian's libsentencepiece-dev).
//
// Why the library and not a parser of our own: the model file holds a normalizer (NFKC rules
// compiled into a character map, whitespace handling) and either a unigram lattice or BPE
// merges; matching SentencePiece id for id means running its code, and the library is
// packaged everywhere loom builds.
//
// ChatGLM2/3 append their own special tokens after the SentencePiece vocabulary:
// [MASK] [gMASK] [sMASK] sop eop (and ChatGLM3's <|system|> <|user|> <|assistant|>
// <|observation|>) take ids piece_size, piece_size + 1, ... in that order. They are never
// produced by encode() (ChatGLM does not parse them out of text), decode to no text, and are
// found by name with special_id(). LLaMA's tokenizer needs none: its <s> / </s> are
// SentencePiece's own control pieces (bos_id / eos_id, found by name too).
//
// Decoding one token at a time (decode_piece, for streaming) follows SentencePiece's rules:
// the first text piece of a run loses its leading "▁" (the dummy prefix encode() adds), a
// piece <0xXX> is that raw byte, control pieces give nothing, <unk> gives SentencePiece's
// " ⁇ ". A run starts at the sequence's start and after every control or appended special
// token, as ChatGLM3 decodes the text between special tokens separately.
//
// The file comes from outside: its size is bounded before it is read, the normalizers'
// character maps the library trusts are checked before the library sees them
// (sentencepiece_model_check.hpp), and errors name the file.

#include <loom/core/error.hpp>
#include <loom/data/sentencepiece_model_check.hpp>
#include <loom/data/tokenizer.hpp>

#include <sentencepiece_processor.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <sys/stat.h>
#include <vector>

namespace loom::data {

/// ChatGLM2's special tokens, in the order they follow the SentencePiece vocabulary.
inline const std::vector<std::string>& chatglm2_special_tokens() {
  static const std::vector<std::string> t{"[MASK]", "[gMASK]", "[sMASK]", "sop", "eop"};
  return t;
}
/// ChatGLM3's: ChatGLM2's, then the role tokens.
inline const std::vector<std::string>& chatglm3_special_tokens() {
  static const std::vector<std::string> t{"[MASK]",   "[gMASK]",  "[sMASK]",       "sop",           "eop",
                                          "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"};
  return t;
}

struct sentencepiece_options {
  /// Special tokens appended after the SentencePiece vocabulary (chatglm2_special_tokens(), ...).
  std::vector<std::string> appended_specials;
  /// Largest file read (tokenizer.model files are a few MiB; the library holds it whole).
  std::size_t max_file_bytes = std::size_t{256} << 20;
};

class sentencepiece_tokenizer {
 public:
  explicit sentencepiece_tokenizer(const std::string& path, sentencepiece_options o = {})
      : path_(path), appended_(std::move(o.appended_specials)) {
    struct stat st {};
    LOOM_CHECK(::stat(path.c_str(), &st) == 0, "sentencepiece_tokenizer: cannot open path='", path, "' (no such file?)");
    LOOM_CHECK(S_ISREG(st.st_mode), "sentencepiece_tokenizer: path='", path, "' is not a regular file");
    LOOM_CHECK(static_cast<std::uint64_t>(st.st_size) <= o.max_file_bytes, "sentencepiece_tokenizer: path='", path, "' has ",
               st.st_size, " bytes, more than max_file_bytes=", o.max_file_bytes, " (sentencepiece_options::max_file_bytes)");
    // Read here, checked where the library trusts the file (sentencepiece_model_check.hpp), then
    // handed to the library: the bytes checked are the bytes loaded.
    std::string bytes(static_cast<std::size_t>(st.st_size), '\0');
    {
      std::ifstream f(path, std::ios::binary);
      LOOM_CHECK(f.read(bytes.data(), static_cast<std::streamsize>(bytes.size())) && f.gcount() == st.st_size,
                 "sentencepiece_tokenizer: cannot read the ", st.st_size, " bytes of path='", path, "'");
    }
    detail::check_sentencepiece_model(bytes, "sentencepiece_tokenizer: path='" + path + "' is not a SentencePiece model");
    auto sp = std::make_shared<sentencepiece::SentencePieceProcessor>();
    sentencepiece::util::Status status;
    // The library reports most broken models by status, but some by throwing: a piece that
    // starts with NUL makes its trie builder (Darts) throw its own exception, which must become
    // a loom::error naming the file, as every other refusal does.
    try {
      status = sp->LoadFromSerializedProto(bytes);
    } catch (const std::exception& e) {
      LOOM_THROW("sentencepiece_tokenizer: path='", path, "' is not a SentencePiece model: ", std::string(e.what()).substr(0, 200));
    }
    // The library's message may quote the file; a bounded prefix says enough.
    LOOM_CHECK(status.ok(), "sentencepiece_tokenizer: path='", path, "' is not a SentencePiece model: ",
               status.ToString().substr(0, 200));
    sp_ = std::move(sp);
    pieces_ = sp_->GetPieceSize();
    LOOM_CHECK(sp_->bos_id() >= 0 && sp_->eos_id() >= 0, "sentencepiece_tokenizer: path='", path, "' has no <s> / </s> (bos_id=",
               sp_->bos_id(), ", eos_id=", sp_->eos_id(), "); loom's templates need both");
    // A name may also be a piece of the model ("sop" can be a subword): as in ChatGLM, the
    // appended token wins for special_id(), and encode() still yields the piece for the text.
    for (std::size_t i = 0; i < appended_.size(); ++i)
      LOOM_CHECK(std::count(appended_.begin(), appended_.begin() + static_cast<std::ptrdiff_t>(i), appended_[i]) == 0,
                 "sentencepiece_tokenizer: appended special token '", appended_[i].substr(0, 64), "' given twice");
  }

  const std::string& path() const noexcept { return path_; }
  /// Pieces of the SentencePiece model (without the appended specials).
  std::int32_t piece_size() const noexcept { return pieces_; }

  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<int> ids;
    const auto status = sp_->Encode(text, &ids);
    LOOM_CHECK(status.ok(), "sentencepiece_tokenizer '", path_, "': encode failed: ", status.ToString().substr(0, 200));
    return std::vector<std::int32_t>(ids.begin(), ids.end());
  }

  /// Text of `ids`: each run between control / appended special tokens is decoded by
  /// SentencePiece (bytes joined, invalid UTF-8 replaced as it does); specials, and ids past the
  /// vocabulary that a padded model may sample, give no text.
  std::string decode(std::span<const std::int32_t> ids) const {
    std::string out, part;
    std::vector<int> run;
    const auto flush = [&] {
      if (run.empty()) return;
      const auto status = sp_->Decode(run, &part);
      LOOM_CHECK(status.ok(), "sentencepiece_tokenizer '", path_, "': decode failed: ", status.ToString().substr(0, 200));
      out += part;
      run.clear();
    };
    for (const auto id : ids) {
      check_id(id);
      if (starts_run(id)) flush();
      else run.push_back(id);
    }
    flush();
    return out;
  }

  std::string decode_piece(std::int32_t prev, std::int32_t id) const {
    check_id(id);
    if (starts_run(id)) return {};
    if (sp_->IsByte(id)) {  // "<0xXX>"
      const std::string& p = sp_->IdToPiece(id);
      return std::string(1, static_cast<char>(std::stoi(p.substr(3, 2), nullptr, 16)));
    }
    if (prev < 0 || starts_run(prev) || sp_->IsUnknown(id)) {  // as SentencePiece decodes a run's first piece
      std::string s;
      const auto status = sp_->Decode(std::vector<int>{id}, &s);
      LOOM_CHECK(status.ok(), "sentencepiece_tokenizer '", path_, "': decode failed: ", status.ToString().substr(0, 200));
      return s;
    }
    std::string s;
    const std::string& p = sp_->IdToPiece(id);
    static constexpr std::string_view space = "\xe2\x96\x81";  // U+2581, SentencePiece's space
    for (std::size_t i = 0; i < p.size();) {
      if (p.compare(i, space.size(), space) == 0) s += ' ', i += space.size();
      else s += p[i++];
    }
    return s;
  }

  std::int32_t bos_id() const { return sp_->bos_id(); }
  std::int32_t eos_id() const { return sp_->eos_id(); }
  /// SentencePiece's <pad> when the model has one, else <unk> (ChatGLM pads with unk = 0).
  std::int32_t pad_id() const { return sp_->pad_id() >= 0 ? sp_->pad_id() : sp_->unk_id(); }
  std::uint32_t vocab_size() const noexcept { return static_cast<std::uint32_t>(pieces_) + static_cast<std::uint32_t>(appended_.size()); }

  /// An appended special token, or one of the model's control / unknown pieces (<s>, </s>, <unk>).
  std::optional<std::int32_t> special_id(std::string_view name) const {
    for (std::size_t i = 0; i < appended_.size(); ++i)
      if (appended_[i] == name) return pieces_ + static_cast<std::int32_t>(i);
    const int id = sp_->PieceToId(name);
    if (id >= 0 && id < pieces_ && (sp_->IsControl(id) || sp_->IsUnknown(id)) && sp_->IdToPiece(id) == name) return id;
    return std::nullopt;
  }

 private:
  void check_id(std::int32_t id) const {
    LOOM_CHECK(id >= 0, "sentencepiece_tokenizer '", path_, "': negative token id ", id);
  }
  // Control pieces, appended specials and ids past the vocabulary (a model's padded rows) have
  // no text and end a decoding run.
  bool starts_run(std::int32_t id) const { return id >= pieces_ || sp_->IsControl(id); }

  std::string path_;
  std::vector<std::string> appended_;
  std::shared_ptr<const sentencepiece::SentencePieceProcessor> sp_;  // immutable after load: copies share it
  std::int32_t pieces_ = 0;
};

}  // namespace loom::data
