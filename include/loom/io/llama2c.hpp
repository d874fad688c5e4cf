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
// llama2c_tensors gives where each tensor lies; read_llama2c reads them all (a tensor_map),
// llama2c_file any element range of any of them (pread), for a rank that reads only its slice.
// Both give the PyTorch names of llama2.c's model.py
// ("tok_embeddings.weight", "layers.3.attention.wq.weight", ..., "output.weight"); matrices
// are [out, in]. RoPE in these models rotates adjacent pairs (interleaved).
//
// tokenizer.bin: int32 max_token_length, then per token: float32 score, int32 length, bytes.
// The tokenizer satisfies data::tokenizer (data/tokenizer.hpp). Encoding is llama2.c's: optional BOS (1), a leading space piece, one piece per UTF-8
// character (byte-fallback tokens <0xXX> = id 3 + byte for characters not in the vocabulary),
// then repeatedly merge the adjacent pair whose concatenation has the highest score.
//
// Both files come from outside: every header field is checked by name, and the bytes the
// header describes are computed with overflow checks and compared with the file's size before
// anything is allocated, so a truncated or hostile file is a loom::error naming the file and
// the field, never an over-read or an allocation sized by garbage.

#include <loom/core/error.hpp>
#include <loom/data/input.hpp>
#include <loom/io/tensor_map.hpp>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
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
/// Reads a file's bytes in order; every read is checked against the end (pos_ <= size always).
class byte_reader {
 public:
  /// `what` names the file in messages: "llama2.c checkpoint 'x.bin'".
  byte_reader(const std::vector<char>& b, std::string what) : b_(b), what_(std::move(what)) {}
  template <class T>
  T get() {
    T v;
    need(sizeof(T));
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  void need(std::size_t n) const {
    LOOM_CHECK(n <= b_.size() - pos_, what_, ": truncated: needs ", n, " more bytes at offset ", pos_, " of a ", b_.size(),
               "-byte file");
  }
  void skip(std::size_t n) { need(n), pos_ += n; }
  void seek(std::size_t p) {
    LOOM_CHECK(p <= b_.size(), what_, ": truncated: offset ", p, " is past the end of a ", b_.size(), "-byte file");
    pos_ = p;
  }
  std::size_t pos() const noexcept { return pos_; }
  std::size_t left() const noexcept { return b_.size() - pos_; }
  void floats(named_tensor& t) {
    const auto n = data::shape_numel(t.shape);
    const auto bytes = n ? data::mul_u64(*n, 4) : std::nullopt;
    LOOM_CHECK(bytes && *bytes <= left(), what_, ": truncated: tensor of shape ", t.shape, " needs more than the ", left(),
               " bytes left at offset ", pos_);
    t.data = buffer<float>(static_cast<std::size_t>(*n));
    if (*bytes) std::memcpy(t.data.data(), b_.data() + pos_, static_cast<std::size_t>(*bytes));
    pos_ += static_cast<std::size_t>(*bytes);
  }

 private:
  const std::vector<char>& b_;
  std::string what_;
  std::size_t pos_ = 0;
};

/// The float count of a llama2.c checkpoint with config `c`, or nothing when it does not fit
/// 64 bits (the fields are positive int32, the products are not bounded).
inline std::optional<std::uint64_t> llama2c_floats(const llama2c_config& c) {
  using opt = std::optional<std::uint64_t>;  // nothing stays nothing; an overflow gives nothing
  const auto mul = [](opt a, opt b) -> opt { return a && b ? data::mul_u64(*a, *b) : std::nullopt; };
  const auto add = [](opt a, opt b) -> opt { return a && b ? data::add_u64(*a, *b) : std::nullopt; };
  const auto u = [](std::int32_t x) -> opt { return static_cast<std::uint64_t>(x); };
  const opt D = u(c.dim), H = u(c.hidden_dim), V = u(c.vocab_size), head_dim = u(c.dim / c.n_heads),
            KD = mul(u(c.n_kv_heads), head_dim);
  // per layer: 2 norms [D], wq and wo [D, D], wk and wv [KD, D], w1 and w3 [H, D], w2 [D, H]
  const opt layer = add(add(mul(2u, D), mul(2u, mul(D, D))), add(mul(2u, mul(KD, D)), mul(3u, mul(H, D))));
  // the layers, the final norm [D], the embedding [V, D] and the classifier [V, D] unless shared
  opt total = add(add(mul(layer, u(c.n_layers)), D), mul(c.shared_classifier ? 1u : 2u, mul(V, D)));
  if (c.version == 0) total = add(total, mul(u(c.seq_len), mul(2u, *head_dim / 2)));  // two RoPE tables [seq_len, head_dim/2]
  return total;
}
}  // namespace detail

inline constexpr std::uint32_t llama2c_magic = 0x616b3432u;  // "ak42"

namespace detail {
inline constexpr std::size_t llama2c_v1_header_bytes = 256;

/// The header at the start of `r` (the file's first bytes, at least the 256 of a version-1
/// header when the file has them) into `c`, checked, and the weights it describes against
/// the `file_bytes` of the whole file; `r` is left at the first tensor.
inline void read_llama2c_header(byte_reader& r, std::size_t file_bytes, const std::string& what, llama2c_config& c) {
  constexpr std::size_t v1_header_bytes = llama2c_v1_header_bytes;
  const auto first = r.get<std::uint32_t>();
  if (first == llama2c_magic) {
    LOOM_CHECK(file_bytes >= v1_header_bytes, what, ": truncated: a version-1 header is ", v1_header_bytes,
               " bytes, the file has ", file_bytes);
    c.version = r.get<std::int32_t>();
    LOOM_CHECK(c.version == 1, what, ": llama2.c version ", c.version,
               " is not supported (legacy and version 1 are; versions 2+ are quantised)");
  } else {
    r.seek(0);
  }
  std::pair<const char*, std::int32_t*> fields[] = {{"dim", &c.dim},         {"hidden_dim", &c.hidden_dim}, {"n_layers", &c.n_layers},
                                                    {"n_heads", &c.n_heads}, {"n_kv_heads", &c.n_kv_heads}, {"vocab_size", &c.vocab_size},
                                                    {"seq_len", &c.seq_len}};
  for (auto [name, f] : fields) *f = r.get<std::int32_t>();
  if (c.version == 1) {
    c.shared_classifier = r.get<std::uint8_t>() != 0;
    r.seek(v1_header_bytes);
  } else {
    // legacy: a negative vocab_size marks an unshared classifier (INT32_MIN has no positive)
    c.shared_classifier = c.vocab_size > 0;
    if (c.vocab_size < 0 && c.vocab_size != INT32_MIN) c.vocab_size = -c.vocab_size;
  }
  for (auto [name, f] : fields) LOOM_CHECK(*f > 0, what, ": header field ", name, "=", *f, " must be > 0");
  LOOM_CHECK(c.dim % c.n_heads == 0, what, ": header field dim=", c.dim, " is not divisible by n_heads=", c.n_heads);
  LOOM_CHECK(c.n_heads % c.n_kv_heads == 0, what, ": header field n_heads=", c.n_heads, " is not divisible by n_kv_heads=", c.n_kv_heads);
  // The whole size before any allocation: huge dimensions in a small file stop here
  const auto floats = detail::llama2c_floats(c);
  const auto need = floats ? data::mul_u64(*floats, 4) : std::nullopt;
  const std::size_t left = file_bytes - r.pos();
  LOOM_CHECK(need && *need == left, what, ": the header (dim=", c.dim, " hidden_dim=", c.hidden_dim, " n_layers=", c.n_layers,
             " n_heads=", c.n_heads, " n_kv_heads=", c.n_kv_heads, " vocab_size=", c.vocab_size, " seq_len=", c.seq_len,
             c.shared_classifier ? " shared" : " unshared", " classifier) describes ",
             need ? std::to_string(*need) : std::string("more than 2^64"), " bytes of weights, the file has ", left,
             " after the ", r.pos(), "-byte header", need && *need > left ? " (truncated?)" : " (wrong format?)");
}
}  // namespace detail

/// The config of a legacy or version-1 llama2.c checkpoint from its header alone (the file's
/// first 256 bytes; its size checked against the weights the header describes), e.g. for a
/// memory plan made before the weights are read.
inline llama2c_config read_llama2c_config(const std::string& path) {
  std::size_t file_bytes = 0;
  const std::vector<char> head = detail::read_file_bytes(path, detail::llama2c_v1_header_bytes, &file_bytes);
  const std::string what = "llama2.c checkpoint '" + path + "'";
  detail::byte_reader r(head, what);
  llama2c_config c;
  detail::read_llama2c_header(r, file_bytes, what, c);
  return c;
}

/// One tensor of a llama2.c checkpoint: its name (llama2.c's model.py), shape and where its
/// float32 data start in the file.
struct llama2c_tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::uint64_t offset = 0;  ///< bytes from the start of the file
};

/// Where every tensor of a checkpoint with (checked) config `c` lies, in file order: the one
/// description of the two formats' orders, which whole-file and range readers both follow.
inline std::vector<llama2c_tensor> llama2c_tensors(const llama2c_config& c) {
  const std::int64_t D = c.dim, H = c.hidden_dim, V = c.vocab_size, hd = c.dim / c.n_heads, KD = c.n_kv_heads * hd;
  std::vector<llama2c_tensor> out;
  std::uint64_t at = c.version == 1 ? detail::llama2c_v1_header_bytes : 7 * sizeof(std::int32_t);
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape) {
    std::uint64_t n = 1;
    for (auto e : shape) n *= static_cast<std::uint64_t>(e);
    out.push_back({name, std::move(shape), at});
    at += n * 4;
  };
  auto per_layer = [&](const std::string& kind, const std::vector<std::int64_t>& shape) {
    for (int l = 0; l < c.n_layers; ++l) add("layers." + std::to_string(l) + "." + kind, shape);
  };
  if (c.version == 1) {
    per_layer("attention_norm.weight", {D});
    per_layer("ffn_norm.weight", {D});
    add("norm.weight", {D});
    add("tok_embeddings.weight", {V, D});
    per_layer("attention.wq.weight", {D, D});
    per_layer("attention.wk.weight", {KD, D});
    per_layer("attention.wv.weight", {KD, D});
    per_layer("attention.wo.weight", {D, D});
    per_layer("feed_forward.w1.weight", {H, D});
    per_layer("feed_forward.w2.weight", {D, H});
    per_layer("feed_forward.w3.weight", {H, D});
  } else {
    add("tok_embeddings.weight", {V, D});
    per_layer("attention_norm.weight", {D});
    per_layer("attention.wq.weight", {D, D});
    per_layer("attention.wk.weight", {KD, D});
    per_layer("attention.wv.weight", {KD, D});
    per_layer("attention.wo.weight", {D, D});
    per_layer("ffn_norm.weight", {D});
    per_layer("feed_forward.w1.weight", {H, D});
    per_layer("feed_forward.w2.weight", {D, H});
    per_layer("feed_forward.w3.weight", {H, D});
    add("norm.weight", {D});
    at += static_cast<std::uint64_t>(c.seq_len) * static_cast<std::uint64_t>(hd / 2) * 2 * 4;  // RoPE tables: recomputed
  }
  if (!c.shared_classifier) add("output.weight", {V, D});
  return out;
}

/// Reads a legacy or version-1 llama2.c checkpoint.
inline llama2c_checkpoint read_llama2c(const std::string& path) {
  const std::vector<char> bytes = detail::read_file_bytes(path);
  const std::string what = "llama2.c checkpoint '" + path + "'";
  detail::byte_reader r(bytes, what);
  llama2c_checkpoint ck;
  // The header check made the file exactly as long as the tensors it describes (and, in a
  // legacy file, the RoPE tables skipped here), so every tensor below lies inside it.
  detail::read_llama2c_header(r, bytes.size(), what, ck.config);
  for (auto& t : llama2c_tensors(ck.config)) {
    named_tensor n;
    n.shape = std::move(t.shape);
    r.seek(static_cast<std::size_t>(t.offset));
    r.floats(n);
    ck.tensors.emplace(std::move(t.name), std::move(n));
  }
  return ck;
}

/// A llama2.c checkpoint opened for range reads: the header (checked as read_llama2c checks
/// it, the file's size included), then any elements of any tensor at one pread, so that a rank
/// reads only its slice of a model and never holds the file.
class llama2c_file {
 public:
  explicit llama2c_file(const std::string& path)
      : what_("llama2.c checkpoint '" + path + "'"), config_(read_llama2c_config(path)), file_(detail::file_handle::open(path, what_)) {
    for (auto& t : llama2c_tensors(config_)) tensors_.emplace(t.name, std::move(t));
  }
  const llama2c_config& config() const noexcept { return config_; }
  /// Tensor `name`, or nullptr when the checkpoint has none of that name.
  const llama2c_tensor* find(const std::string& name) const {
    const auto it = tensors_.find(name);
    return it == tensors_.end() ? nullptr : &it->second;
  }
  /// Elements [first, first + out.size()) of tensor `name` (row-major): only those bytes are read.
  void read(const std::string& name, std::uint64_t first, std::span<float> out) const {
    const llama2c_tensor* t = find(name);
    LOOM_CHECK(t, what_, ": no tensor '", name.substr(0, 128), "'");
    std::uint64_t n = 1;
    for (auto e : t->shape) n *= static_cast<std::uint64_t>(e);
    LOOM_CHECK(first <= n && out.size() <= n - first, what_, ": tensor '", name, "' has ", n, " elements; asked for [", first,
               ", ", first + out.size(), ")");
    const std::uint64_t want = out.size() * 4;
    const std::uint64_t got = file_->read_at(reinterpret_cast<char*>(out.data()), want, t->offset + first * 4);
    LOOM_CHECK(got == want, what_, ": tensor '", name, "' could not be read (the file changed since its header was checked?)");
    bytes_read_ += want;
  }
  /// Tensor bytes read so far.
  std::uint64_t bytes_read() const noexcept { return bytes_read_; }

 private:
  std::string what_;
  llama2c_config config_;
  std::shared_ptr<detail::file_handle> file_;
  std::map<std::string, llama2c_tensor> tensors_;
  mutable std::uint64_t bytes_read_ = 0;
};

/// llama2.c's BPE tokenizer (tokenizer.bin).
class llama2c_tokenizer {
 public:
  static constexpr std::int32_t bos = 1, eos = 2;

  /// Reads up to `vocab_size` tokens (all the file holds when vocab_size <= 0). A model whose
  /// vocabulary is larger than the tokenizer's never decodes the extra ids to text. The file
  /// must hold at least ids 0..2 (<unk>, <s>, </s>): encode() emits 0 as byte fallback and
  /// 1 and 2 as bos and eos, and a model must be able to embed them.
  explicit llama2c_tokenizer(const std::string& path, std::int32_t vocab_size = 0) {
    const std::string what = "tokenizer '" + path + "'";
    LOOM_CHECK(vocab_size <= 0 || vocab_size >= 3, what, ": vocab_size=", vocab_size,
               " is too small (ids 0, 1, 2 are <unk>, <s>, </s>); give the model's vocab_size or 0 for the file's");
    const std::vector<char> bytes = detail::read_file_bytes(path);
    detail::byte_reader r(bytes, what);
    LOOM_CHECK(r.left() >= 4, what, ": truncated: ", bytes.size(), " bytes hold no max_token_length field");
    max_len_ = r.get<std::int32_t>();
    LOOM_CHECK(max_len_ > 0, what, ": max_token_length=", max_len_, " must be > 0");
    while (r.left() > 0 && (vocab_size <= 0 || static_cast<std::int32_t>(pieces_.size()) < vocab_size)) {
      LOOM_CHECK(r.left() >= 8, what, ": truncated in token ", pieces_.size(), ": ", r.left(),
                 " bytes left at offset ", r.pos(), ", a token needs 8 for its score and length");
      const float score = r.get<float>();
      const auto len = r.get<std::int32_t>();
      LOOM_CHECK(len >= 0 && len <= max_len_, what, ": token ", pieces_.size(), " has length ", len, " outside [0, max_token_length=",
                 max_len_, "]");
      LOOM_CHECK(static_cast<std::size_t>(len) <= r.left(), what, ": token ", pieces_.size(), " has length ", len, " but only ",
                 r.left(), " bytes are left at offset ", r.pos(), " (truncated?)");
      LOOM_CHECK(pieces_.size() < static_cast<std::size_t>(INT32_MAX), what, ": more than 2^31 - 1 tokens");
      pieces_.emplace_back(bytes.data() + r.pos(), static_cast<std::size_t>(len));
      r.skip(static_cast<std::size_t>(len));
      scores_.push_back(score);
    }
    LOOM_CHECK(pieces_.size() >= 3, what, ": holds ", pieces_.size(), " tokens; needs at least 3 (<unk>, <s>, </s>)");
    for (std::size_t i = 0; i < pieces_.size(); ++i) lookup_.emplace(pieces_[i], static_cast<std::int32_t>(i));
  }

  std::int32_t vocab_size() const noexcept { return static_cast<std::int32_t>(pieces_.size()); }
  // data::tokenizer: LLaMA has no pad token; padding uses <unk> (0), which targets mask anyway.
  std::int32_t bos_id() const noexcept { return bos; }
  std::int32_t eos_id() const noexcept { return eos; }
  std::int32_t pad_id() const noexcept { return 0; }
  std::optional<std::int32_t> special_id(std::string_view name) const {
    if (name == "<unk>") return 0;
    if (name == "<s>") return bos;
    if (name == "</s>") return eos;
    return std::nullopt;
  }
  /// Text of token `id`; ids past the tokenizer's vocabulary read as "" (a model may have more).
  const std::string& piece(std::int32_t id) const {
    static const std::string none;
    LOOM_CHECK(id >= 0, "tokenizer: negative token id ", id);
    return id < vocab_size() ? pieces_[static_cast<std::size_t>(id)] : none;
  }

  /// The ids of `text` (llama2.c's encode: a leading " " piece, characters, byte fallback, then
  /// merges by score); bos / eos only when asked (data::tokenizer's encode(text) adds neither).
  std::vector<std::int32_t> encode(std::string_view text, bool add_bos = false, bool add_eos = false) const {
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
      auto it = lookup_.find(std::string(text.substr(i, n)));
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
    const auto hex = [](char ch) {
      return ch >= '0' && ch <= '9' ? ch - '0' : (ch | 0x20) >= 'a' && (ch | 0x20) <= 'f' ? (ch | 0x20) - 'a' + 10 : -1;
    };
    if (p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>' && hex(p[3]) >= 0 && hex(p[4]) >= 0)
      return std::string(1, static_cast<char>(hex(p[3]) * 16 + hex(p[4])));
    return p;
  }
  /// data::tokenizer's decode_piece: decode(prev, id), except that bos / eos give no text (as
  /// in decode(ids)); prev < 0 (no token before) reads as bos.
  std::string decode_piece(std::int32_t prev, std::int32_t id) const {
    return id == bos || id == eos ? std::string() : decode(prev < 0 ? bos : prev, id);
  }
  std::string decode(std::span<const std::int32_t> ids, std::int32_t prev = bos) const {
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
