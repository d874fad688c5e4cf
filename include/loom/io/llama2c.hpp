#pragma once
// llama2.c checkpoints and tokenizer (Karpathy's llama2.c, the smallest complete LLaMA files).
//
// Checkpoint formats, all little-endian float32 after a header:
//  - legacy ("version 0"): 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
//    vocab_size, seq_len), vocab_size negative when the classifier is not shared; then
//    tok_embeddings, per-layer attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3 (each kind
//    for all layers in turn), norm, two RoPE tables of seq_len * head_dim/2 (skipped), and the
//    classifier if not shared.
//  - version 1: uint32 magic 0x616b3432 ("ak42"), int32 version 1, the 7 int32, uint8
//    shared_classifier, zero padding to 256 bytes; then attention_norm (all layers),
//    ffn_norm (all layers), norm, tok_embeddings, wq, wk, wv, wo, w1, w2, w3 (all layers
//    each), and the classifier if not shared.
// Both come back as a tensor_map with the PyTorch names of llama2.c's model.py
// ("tok_embeddings.weight", "layers.3.attention.wq.weight", ..., "output.weight"); matrices
// are [out, in]. RoPE in these models rotates adjacent pairs (interleaved).
//
// tokenizer.bin: int32 max_token_length, then per token: float32 score, int32 length, bytes.
// Encoding is llama2.c's: optional BOS (1), a leading space piece, one piece per UTF-8
// character (byte-fallback tokens <0xXX> = id 3 + byte for characters not in the vocabulary),
// then repeatedly merge the adjacent pair whose concatenation has the highest score.

#include <loom/core/error.hpp>
#include <loom/io/tensor_map.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace loom::io {

struct llama2c_config {
  std::int32_t dim = 0, hidden_dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, vocab_size = 0, seq_len = 0;
  bool shared_classifier = true;
  std::int32_t version = 0;  ///< 0: legacy, 1: "ak42" version 1
};

struct llama2c_checkpoint {
  llama2c_config config;
  tensor_map tensors;
};

namespace detail {
class byte_reader {
 public:
  byte_reader(const std::vector<char>& b, std::string path) : b_(b), path_(std::move(path)) {}
  template <class T>
  T get() {
    T v;
    need(sizeof(T));
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  void need(std::size_t n) const {
    LOOM_CHECK(n <= b_.size() - pos_, "'", path_, "': truncated: needs ", n, " more bytes at offset ", pos_,
               " of a ", b_.size(), "-byte file");
  }
  void skip(std::size_t n) { need(n), pos_ += n; }
  void seek(std::size_t p) { pos_ = p; }
  std::size_t pos() const noexcept { return pos_; }
  std::size_t left() const noexcept { return b_.size() - pos_; }
  void floats(named_tensor& t) {
    const auto n = static_cast<std::size_t>(t.numel());
    need(n * 4);
    t.data = buffer<float>(n);
    std::memcpy(t.data.data(), b_.data() + pos_, n * 4);
    pos_ += n * 4;
  }

 private:
  const std::vector<char>& b_;
  std::string path_;
  std::size_t pos_ = 0;
};
}  // namespace detail

inline constexpr std::uint32_t llama2c_magic = 0x616b3432u;  // "ak42"

/// Reads a legacy or version-1 llama2.c checkpoint.
inline llama2c_checkpoint read_llama2c(const std::string& path) {
  const std::vector<char> bytes = detail::read_file_bytes(path);
  detail::byte_reader r(bytes, path);
  llama2c_checkpoint ck;
  llama2c_config& c = ck.config;
  const auto first = r.get<std::uint32_t>();
  if (first == llama2c_magic) {
    c.version = r.get<std::int32_t>();
    LOOM_CHECK(c.version == 1, "'", path, "': llama2.c version ", c.version,
               " is not supported (legacy and version 1 are; versions 2+ are quantised)");
  } else {
    r.seek(0);
  }
  std::int32_t* fields[] = {&c.dim, &c.hidden_dim, &c.n_layers, &c.n_heads, &c.n_kv_heads, &c.vocab_size, &c.seq_len};
  for (auto* f : fields) *f = r.get<std::int32_t>();
  if (c.version == 1) {
    c.shared_classifier = r.get<std::uint8_t>() != 0;
    r.seek(256);
  } else {
    c.shared_classifier = c.vocab_size > 0;
    if (c.vocab_size < 0) c.vocab_size = -c.vocab_size;
  }
  LOOM_CHECK(c.dim > 0 && c.hidden_dim > 0 && c.n_layers > 0 && c.n_heads > 0 && c.n_kv_heads > 0 && c.vocab_size > 0 &&
                 c.seq_len > 0 && c.dim % c.n_heads == 0 && c.n_heads % c.n_kv_heads == 0,
             "'", path, "': implausible llama2.c header: dim=", c.dim, " hidden_dim=", c.hidden_dim, " n_layers=",
             c.n_layers, " n_heads=", c.n_heads, " n_kv_heads=", c.n_kv_heads, " vocab_size=", c.vocab_size,
             " seq_len=", c.seq_len);
  const std::int64_t D = c.dim, H = c.hidden_dim, V = c.vocab_size, hd = c.dim / c.n_heads, KD = c.n_kv_heads * hd;
  auto& T = ck.tensors;
  auto read = [&](const std::string& name, std::vector<std::int64_t> shape) {
    named_tensor t;
    t.shape = std::move(shape);
    r.floats(t);
    T.emplace(name, std::move(t));
  };
  auto per_layer = [&](const std::string& kind, std::vector<std::int64_t> shape) {
    for (int l = 0; l < c.n_layers; ++l) read("layers." + std::to_string(l) + "." + kind, shape);
  };
  if (c.version == 1) {
    per_layer("attention_norm.weight", {D});
    per_layer("ffn_norm.weight", {D});
    read("norm.weight", {D});
    read("tok_embeddings.weight", {V, D});
    per_layer("attention.wq.weight", {D, D});
    per_layer("attention.wk.weight", {KD, D});
    per_layer("attention.wv.weight", {KD, D});
    per_layer("attention.wo.weight", {D, D});
    per_layer("feed_forward.w1.weight", {H, D});
    per_layer("feed_forward.w2.weight", {D, H});
    per_layer("feed_forward.w3.weight", {H, D});
  } else {
    read("tok_embeddings.weight", {V, D});
    per_layer("attention_norm.weight", {D});
    per_layer("attention.wq.weight", {D, D});
    per_layer("attention.wk.weight", {KD, D});
    per_layer("attention.wv.weight", {KD, D});
    per_layer("attention.wo.weight", {D, D});
    per_layer("ffn_norm.weight", {D});
    per_layer("feed_forward.w1.weight", {H, D});
    per_layer("feed_forward.w2.weight", {D, H});
    per_layer("feed_forward.w3.weight", {H, D});
    read("norm.weight", {D});
    r.skip(static_cast<std::size_t>(2 * c.seq_len * (hd / 2)) * 4);  // RoPE tables: recomputed
  }
  if (!c.shared_classifier) read("output.weight", {V, D});
  LOOM_CHECK(r.left() == 0, "'", path, "': ", r.left(), " unexpected bytes after the last tensor (wrong format?)");
  return ck;
}

/// llama2.c's BPE tokenizer (tokenizer.bin).
class llama2c_tokenizer {
 public:
  static constexpr std::int32_t bos = 1, eos = 2;

  /// Reads up to `vocab_size` tokens (all the file holds when vocab_size <= 0). A model whose
  /// vocabulary is larger than the tokenizer's never decodes the extra ids to text.
  explicit llama2c_tokenizer(const std::string& path, std::int32_t vocab_size = 0) {
    const std::vector<char> bytes = detail::read_file_bytes(path);
    detail::byte_reader r(bytes, path);
    max_len_ = r.get<std::int32_t>();
    LOOM_CHECK(max_len_ > 0, "tokenizer '", path, "': max_token_length=", max_len_);
    while (r.left() > 0 && (vocab_size <= 0 || static_cast<std::int32_t>(pieces_.size()) < vocab_size)) {
      const float score = r.get<float>();
      const auto len = r.get<std::int32_t>();
      LOOM_CHECK(len >= 0 && len <= max_len_, "tokenizer '", path, "': token ", pieces_.size(), " has length ", len);
      r.need(static_cast<std::size_t>(len));
      pieces_.emplace_back(bytes.data() + r.pos(), static_cast<std::size_t>(len));
      r.skip(static_cast<std::size_t>(len));
      scores_.push_back(score);
    }
    for (std::size_t i = 0; i < pieces_.size(); ++i) lookup_.emplace(pieces_[i], static_cast<std::int32_t>(i));
  }

  std::int32_t vocab_size() const noexcept { return static_cast<std::int32_t>(pieces_.size()); }
  /// Text of token `id`; ids past the tokenizer's vocabulary read as "" (a model may have more).
  const std::string& piece(std::int32_t id) const {
    static const std::string none;
    LOOM_CHECK(id >= 0, "tokenizer: negative token id ", id);
    return id < vocab_size() ? pieces_[static_cast<std::size_t>(id)] : none;
  }

  std::vector<std::int32_t> encode(const std::string& text, bool add_bos = true, bool add_eos = false) const {
    std::vector<std::int32_t> ids;
    if (add_bos) ids.push_back(bos);
    std::vector<std::int32_t> t;
    if (!text.empty()) {
      auto sp = lookup_.find(" ");
      if (sp != lookup_.end()) t.push_back(sp->second);
    }
    for (std::size_t i = 0; i < text.size();) {
      std::size_t n = 1;  // bytes of this UTF-8 character
      const auto c0 = static_cast<unsigned char>(text[i]);
      if (c0 >= 0xC0) n = c0 >= 0xF0 ? 4 : c0 >= 0xE0 ? 3 : 2;
      while (n > 1 && i + n > text.size()) --n;
      auto it = lookup_.find(text.substr(i, n));
      if (it != lookup_.end()) {
        t.push_back(it->second);
      } else {
        for (std::size_t k = 0; k < n; ++k) {  // byte fallback (<unk> = 0 if the vocabulary has no byte tokens)
          const std::int32_t b = static_cast<unsigned char>(text[i + k]) + 3;
          t.push_back(b < vocab_size() ? b : 0);
        }
      }
      i += n;
    }
    while (true) {  // merge the best-scoring adjacent pair until none is in the vocabulary
      float best = -1e30f;
      std::int32_t best_id = -1;
      std::size_t best_at = 0;
      for (std::size_t i = 0; i + 1 < t.size(); ++i) {
        auto it = lookup_.find(pieces_[static_cast<std::size_t>(t[i])] + pieces_[static_cast<std::size_t>(t[i + 1])]);
        if (it != lookup_.end() && scores_[static_cast<std::size_t>(it->second)] > best) {
          best = scores_[static_cast<std::size_t>(it->second)];
          best_id = it->second;
          best_at = i;
        }
      }
      if (best_id < 0) break;
      t[best_at] = best_id;
      t.erase(t.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
    }
    ids.insert(ids.end(), t.begin(), t.end());
    if (add_eos) ids.push_back(eos);
    return ids;
  }

  /// Text of `id` following `prev` (leading space dropped after BOS; <0xXX> is that raw byte).
  std::string decode(std::int32_t prev, std::int32_t id) const {
    std::string p = piece(id);
    if (prev == bos && !p.empty() && p[0] == ' ') p.erase(0, 1);
    if (p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>') {
      const auto hex = [](char ch) { return ch <= '9' ? ch - '0' : (ch | 0x20) - 'a' + 10; };
      return std::string(1, static_cast<char>(hex(p[3]) * 16 + hex(p[4])));
    }
    return p;
  }
  std::string decode(const std::vector<std::int32_t>& ids, std::int32_t prev = bos) const {
    std::string s;
    for (auto id : ids) {
      if (id == bos || id == eos) {
        prev = id;
        continue;
      }
      s += decode(prev, id);
      prev = id;
    }
    return s;
  }

 private:
  std::int32_t max_len_ = 0;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, std::int32_t> lookup_;
};

}  // namespace loom::io
