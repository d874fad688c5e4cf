#pragma once
// safetensors read/write (HF's format): 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F32"|"F16"|"BF16", "shape": [...], "data_offsets": [begin, end]}, ...,
// "__metadata__": {string: string}}, then the raw tensor bytes (offsets relative to the end of
// the header). Reading converts every tensor to float (loom::half / loom::bfloat16 do the
// rounding-exact widening); writing stores F32, F16 or BF16.
//
// Why checked so carefully: a checkpoint comes from outside. Every offset, shape and size is
// validated against the file before a byte is read, and every failure names the file and the
// tensor, so a truncated download gives a message instead of garbage weights. Sizes are
// computed with overflow checks, the tensors must tile the data bytes exactly (no overlap, no
// hole, as the format's reference reader requires), and nothing is allocated before the whole
// header has passed.
//
// Also reads HF's config.json of a LLaMA model (hf_llama_config), with nlohmann-json.

#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>
#include <loom/data/input.hpp>
#include <loom/data/json_input.hpp>
#include <loom/io/tensor_map.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom::io {

namespace detail {
inline std::size_t dtype_size(const std::string& dt) {
  if (dt == "F32") return 4;
  if (dt == "F16" || dt == "BF16") return 2;
  return 0;
}
}  // namespace detail

static_assert(std::endian::native == std::endian::little, "loom::io reads little-endian files on little-endian hosts");

/// The largest header read; the format's reference reader refuses larger ones too, and a JSON
/// document costs several times its size in memory.
inline constexpr std::uint64_t safetensors_max_header_bytes = 100'000'000;

/// One tensor of a safetensors file, as its header states it (checked against the file).
struct safetensors_entry {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t count = 0, begin = 0, end = 0;  ///< elements; byte offsets after the header
};

/// A safetensors file's header: what a reader needs to read any tensor, or any range of
/// one, without reading the rest of the file.
struct safetensors_index {
  /// The open file, shared by copies of the index (closed with the last one), so that range
  /// reads cost one pread each, not an open.
  using file_handle = detail::file_handle;
  std::string path;
  std::shared_ptr<file_handle> file;  ///< set by read_safetensors_index
  std::uint64_t data_start = 0;  ///< file offset of the data bytes
  std::map<std::string, safetensors_entry> tensors;
  std::map<std::string, std::string> metadata;  ///< "__metadata__" (string values only)
};

namespace detail {
// Every entry is checked, and the entries together, before any tensor is allocated.
inline safetensors_index parse_safetensors_header(const std::string& path, std::string_view header_bytes,
                                                  std::uint64_t data_size) {
  using data::quote_input, data::quote_json;
  const std::string what = "safetensors '" + path + "'";
  const nlohmann::json header = data::parse_json_input(header_bytes, what + ": header");
  LOOM_CHECK(header.is_object(), what, ": header is not a JSON object");
  safetensors_index index;
  index.path = path;
  index.data_start = 8 + header_bytes.size();
  for (auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (info.is_object())
        for (auto& [k, v] : info.items())
          if (v.is_string()) index.metadata[k] = v.get<std::string>();
      continue;
    }
    const std::string where = what + ": tensor " + quote_input(name);
    LOOM_CHECK(info.is_object(), where, ": entry must be an object, got ", quote_json(info));
    for (const char* key : {"dtype", "shape", "data_offsets"}) LOOM_CHECK(info.contains(key), where, ": missing \"", key, "\"");
    safetensors_entry e;
    const auto& dt = info["dtype"];
    const std::size_t es = dt.is_string() ? detail::dtype_size(dt.get<std::string>()) : 0;
    LOOM_CHECK(es != 0, where, ": unsupported dtype ", quote_json(dt), " (F32, F16, BF16 are)");
    e.dtype = dt.get<std::string>();
    const auto& shape = info["shape"];
    LOOM_CHECK(shape.is_array(), where, ": shape must be a list of extents, got ", quote_json(shape));
    for (std::size_t i = 0; i < shape.size(); ++i)
      e.shape.push_back(data::json_integer(shape[i], where + ": shape[" + std::to_string(i) + "]", 0, INT64_MAX));
    const auto count = data::shape_numel(e.shape);
    const auto nbytes = count ? data::mul_u64(*count, es) : std::nullopt;
    LOOM_CHECK(nbytes, where, ": shape ", e.shape, " has more elements than fit 64 bits");
    e.count = *count;
    const auto& off = info["data_offsets"];
    LOOM_CHECK(off.is_array() && off.size() == 2, where, ": data_offsets must be [begin, end], got ", quote_json(off));
    const auto limit = static_cast<std::int64_t>(data_size);
    e.begin = static_cast<std::uint64_t>(data::json_integer(off[0], where + ": data_offsets[0]", 0, limit));
    e.end = static_cast<std::uint64_t>(data::json_integer(off[1], where + ": data_offsets[1]", 0, limit));
    LOOM_CHECK(e.begin <= e.end && e.end - e.begin == *nbytes, where, ": data_offsets [", e.begin, ", ", e.end, "] span ",
               e.end - e.begin, " bytes, shape ", e.shape, " of ", e.dtype, " needs ", *nbytes);
    index.tensors.emplace(name, std::move(e));
  }
  // The tensors must tile the data bytes exactly, as the format requires: an overlap would
  // alias two tensors, a hole would carry bytes no tensor accounts for
  std::vector<std::pair<const std::string*, const safetensors_entry*>> order;
  for (const auto& [name, e] : index.tensors) order.push_back({&name, &e});
  std::sort(order.begin(), order.end(),
            [](const auto& a, const auto& b) { return std::pair(a.second->begin, a.second->end) < std::pair(b.second->begin, b.second->end); });
  std::uint64_t at = 0;
  const std::string* prev = nullptr;
  for (const auto& [name, e] : order) {
    LOOM_CHECK(e->begin >= at, what, ": tensor ", quote_input(*name), " (data_offsets [", e->begin, ", ", e->end,
               "]) overlaps tensor ", quote_input(prev ? *prev : ""), " (ending at ", at, ")");
    LOOM_CHECK(e->begin == at, what, ": data bytes [", at, ", ", e->begin, ") belong to no tensor (before tensor ",
               quote_input(*name), ")");
    at = e->end, prev = name;
  }
  LOOM_CHECK(at == data_size, what, ": data bytes [", at, ", ", data_size, ") after the last tensor belong to no tensor");
  return index;
}

// count elements of dtype `dt` at p, widened to float.
inline void widen(const std::string& dt, const char* p, std::uint64_t count, float* out) {
  if (dt == "F32") {
    if (count) std::memcpy(out, p, 4 * static_cast<std::size_t>(count));
    return;
  }
  const bool f16 = dt == "F16";
  for (std::uint64_t i = 0; i < count; ++i) {
    std::uint16_t b;
    std::memcpy(&b, p + 2 * i, 2);
    out[i] = f16 ? static_cast<float>(std::bit_cast<half>(b)) : static_cast<float>(std::bit_cast<bfloat16>(b));
  }
}
}  // namespace detail

/// All tensors of a .safetensors file, as float.
inline tensor_map read_safetensors(const std::string& path) {
  const std::vector<char> bytes = detail::read_file_bytes(path);
  const std::string what = "safetensors '" + path + "'";
  LOOM_CHECK(bytes.size() >= 8, what, ": file of ", bytes.size(), " bytes has no header");
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  LOOM_CHECK(n <= bytes.size() - 8, what, ": header length ", n, " exceeds the file size ", bytes.size());
  LOOM_CHECK(n <= safetensors_max_header_bytes, what, ": header length ", n, " exceeds the limit of ", safetensors_max_header_bytes, " bytes");
  const safetensors_index index =
      detail::parse_safetensors_header(path, std::string_view(bytes.data() + 8, static_cast<std::size_t>(n)), bytes.size() - 8 - n);
  tensor_map out;
  for (const auto& [name, e] : index.tensors) {
    named_tensor t;
    t.shape = e.shape;
    t.data = buffer<float>(static_cast<std::size_t>(e.count));
    detail::widen(e.dtype, bytes.data() + index.data_start + e.begin, e.count, t.data.data());
    out.emplace(name, std::move(t));
  }
  return out;
}

/// The header of a .safetensors file, read and checked against the file's size without
/// reading its data.
inline safetensors_index read_safetensors_index(const std::string& path) {
  const std::string what = "safetensors '" + path + "'";
  std::error_code ec;
  LOOM_CHECK(std::filesystem::is_regular_file(path, ec), what, ": not a regular file (or missing)");
  const std::uint64_t size = std::filesystem::file_size(path, ec);
  LOOM_CHECK(!ec, what, ": cannot determine its size");
  std::ifstream f(path, std::ios::binary);
  LOOM_CHECK(f.good() && size >= 8, what, ": file of ", size, " bytes has no header");
  std::uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  LOOM_CHECK(n <= size - 8, what, ": header length ", n, " exceeds the file size ", size);
  LOOM_CHECK(n <= safetensors_max_header_bytes, what, ": header length ", n, " exceeds the limit of ", safetensors_max_header_bytes, " bytes");
  std::string header(static_cast<std::size_t>(n), '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  LOOM_CHECK(f.good(), what, ": cannot read its ", n, "-byte header");
  safetensors_index ix = detail::parse_safetensors_header(path, header, size - 8 - n);
  ix.file = detail::file_handle::open(path, what);
  return ix;
}

/// Elements [first, first + out.size()) of tensor `name` (row-major), widened to float: only
/// those bytes are read.
inline void read_safetensors_range(const safetensors_index& index, const std::string& name, std::uint64_t first,
                                   std::span<float> out) {
  const std::string what = "safetensors '" + index.path + "'";
  const auto it = index.tensors.find(name);
  LOOM_CHECK(it != index.tensors.end(), what, ": no tensor ", data::quote_input(name));
  const safetensors_entry& e = it->second;
  LOOM_CHECK(first <= e.count && out.size() <= e.count - first, what, ": tensor ", data::quote_input(name), " has ", e.count,
             " elements; asked for [", first, ", ", first + out.size(), ")");
  const std::size_t es = detail::dtype_size(e.dtype);
  std::vector<char> own;
  // F32 lands in `out` directly; narrower types go through a byte buffer and are widened
  char* bytes = e.dtype == "F32" ? reinterpret_cast<char*>(out.data()) : (own.resize(out.size() * es), own.data());
  const std::uint64_t want = out.size() * es, at = index.data_start + e.begin + first * es;
  std::uint64_t got = 0;
  if (index.file) {
    got = index.file->read_at(bytes, want, at);
  } else {
    std::ifstream f(index.path, std::ios::binary);
    f.seekg(static_cast<std::streamoff>(at));
    f.read(bytes, static_cast<std::streamsize>(want));
    got = static_cast<std::uint64_t>(f.gcount());
  }
  LOOM_CHECK(got == want, what, ": tensor ", data::quote_input(name), " is truncated (file shorter than its header says)");
  if (e.dtype != "F32") detail::widen(e.dtype, bytes, out.size(), out.data());
}

/// Writes a safetensors file one tensor at a time: the header (every name and shape) first,
/// then each tensor's data in name order, so a writer holds one tensor at most (a
/// consolidation of a sharded checkpoint streams a model larger than memory this way).
class safetensors_writer {
 public:
  /// shapes: every tensor's name and shape; dtype "F32", "F16" or "BF16".
  safetensors_writer(const std::string& path, std::map<std::string, std::vector<std::int64_t>> shapes,
                     const std::string& dtype = "F32", const std::map<std::string, std::string>& metadata = {})
      : path_(path), dtype_(dtype), shapes_(std::move(shapes)), next_(shapes_.begin()) {
    const std::size_t es = detail::dtype_size(dtype);
    LOOM_CHECK(es != 0, "write_safetensors: unsupported dtype '", dtype, "'");
    nlohmann::json header = nlohmann::json::object();
    if (!metadata.empty()) header["__metadata__"] = metadata;
    std::uint64_t off = 0;
    for (const auto& [name, shape] : shapes_) {
      std::uint64_t n = 1;
      for (auto e : shape) {
        LOOM_CHECK(e >= 0, "write_safetensors: tensor '", name, "' has a negative extent ", e);
        n *= static_cast<std::uint64_t>(e);
      }
      header[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {off, off + n * es}}};
      off += n * es;
    }
    std::string h = header.dump();
    while ((8 + h.size()) % 8) h.push_back(' ');  // data starts 8-byte aligned
    f_.open(path, std::ios::binary);
    LOOM_CHECK(f_.good(), "write_safetensors: cannot create '", path, "'");
    const std::uint64_t n = h.size();
    f_.write(reinterpret_cast<const char*>(&n), 8);
    f_.write(h.data(), static_cast<std::streamsize>(h.size()));
  }

  /// The next tensor in name order (the caller writes them all, in that order).
  void write(const std::string& name, std::span<const float> data) {
    LOOM_CHECK(next_ != shapes_.end() && next_->first == name, "write_safetensors: tensor '", name, "' written out of order",
               next_ != shapes_.end() ? " (expected '" + next_->first + "')" : std::string(" (all were written)"));
    std::uint64_t n = 1;
    for (auto e : next_->second) n *= static_cast<std::uint64_t>(e);
    LOOM_CHECK(n == data.size(), "write_safetensors: tensor '", name, "' has ", data.size(), " elements for a shape of ", n);
    if (dtype_ == "F32") {  // little-endian like the host (x86-64, aarch64)
      f_.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size() * 4));
    } else {  // narrowed a block at a time: one write per block, not per element
      std::uint16_t b[4096];
      for (std::size_t i = 0; i < data.size(); i += 4096) {
        const std::size_t m = std::min<std::size_t>(4096, data.size() - i);
        for (std::size_t j = 0; j < m; ++j)
          b[j] = dtype_ == "F16" ? std::bit_cast<std::uint16_t>(half(data[i + j])) : std::bit_cast<std::uint16_t>(bfloat16(data[i + j]));
        f_.write(reinterpret_cast<const char*>(b), static_cast<std::streamsize>(m * 2));
      }
    }
    ++next_;
  }
  /// Every tensor written: the file is complete (flushed).
  void close() {
    LOOM_CHECK(next_ == shapes_.end(), "write_safetensors: '", path_, "' closed before tensor '",
               next_ == shapes_.end() ? "" : next_->first, "' was written");
    f_.flush();
    LOOM_CHECK(f_.good(), "write_safetensors: writing '", path_, "' failed");
    f_.close();
  }

 private:
  std::string path_, dtype_;
  std::map<std::string, std::vector<std::int64_t>> shapes_;
  std::map<std::string, std::vector<std::int64_t>>::const_iterator next_;
  std::ofstream f_;
};

/// Writes `tensors` as `dtype` ("F32", "F16" or "BF16"), names in sorted order.
inline void write_safetensors(const std::string& path, const tensor_map& tensors, const std::string& dtype = "F32",
                              const std::map<std::string, std::string>& metadata = {}) {
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (auto& [name, t] : tensors) {
    LOOM_CHECK(static_cast<std::size_t>(t.numel()) == t.data.size(), "write_safetensors: tensor '", name, "' has ",
               t.data.size(), " elements for a shape of ", t.numel());
    shapes[name] = t.shape;
  }
  safetensors_writer w(path, std::move(shapes), dtype, metadata);
  for (auto& [name, t] : tensors) w.write(name, std::span<const float>(t.data.data(), t.data.size()));
  w.close();
}

/// The fields of an HF LLaMA config.json that inference needs.
struct hf_llama_config {
  std::int32_t hidden_size = 0, intermediate_size = 0, num_hidden_layers = 0, num_attention_heads = 0,
               num_key_value_heads = 0, vocab_size = 0, max_position_embeddings = 0;
  float rms_norm_eps = 1e-6f, rope_theta = 10000.f;
  bool tie_word_embeddings = false;
};

inline hf_llama_config read_hf_llama_config(const std::string& path) {
  const std::vector<char> bytes = detail::read_file_bytes(path);
  const std::string what = "config '" + path + "'";
  const auto j = data::parse_json_input(bytes, what);
  LOOM_CHECK(j.is_object(), what, ": not a JSON object");
  // Ranges well above any released model: a value beyond one is garbage, not a model
  const auto integer = [&](const char* key, std::int64_t max, std::optional<std::int32_t> fallback = std::nullopt) {
    LOOM_CHECK(j.contains(key) || fallback, what, ": missing \"", key, "\"");
    if (!j.contains(key)) return *fallback;
    return static_cast<std::int32_t>(data::json_integer(j[key], what + ": \"" + key + "\"", 1, max));
  };
  const auto real = [&](const char* key, double min, double max, float fallback) {
    return j.contains(key) ? data::json_real<float>(j[key], what + ": \"" + key + "\"", min, max) : fallback;
  };
  hf_llama_config c;
  c.hidden_size = integer("hidden_size", 1 << 20);
  c.intermediate_size = integer("intermediate_size", 1 << 22);
  c.num_hidden_layers = integer("num_hidden_layers", 1 << 14);
  c.num_attention_heads = integer("num_attention_heads", 1 << 16);
  c.num_key_value_heads = integer("num_key_value_heads", 1 << 16, c.num_attention_heads);
  c.vocab_size = integer("vocab_size", 1 << 26);
  c.max_position_embeddings = integer("max_position_embeddings", 1 << 30, 2048);
  c.rms_norm_eps = real("rms_norm_eps", 0.0, 1.0, 1e-6f);
  c.rope_theta = real("rope_theta", 1.0, 1e12, 10000.f);
  if (j.contains("tie_word_embeddings")) {
    LOOM_CHECK(j["tie_word_embeddings"].is_boolean(), what, ": \"tie_word_embeddings\" must be true or false, got ",
               data::quote_json(j["tie_word_embeddings"]));
    c.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  LOOM_CHECK(c.hidden_size % c.num_attention_heads == 0, what, ": hidden_size=", c.hidden_size,
             " is not divisible by num_attention_heads=", c.num_attention_heads);
  LOOM_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, what, ": num_attention_heads=", c.num_attention_heads,
             " is not divisible by num_key_value_heads=", c.num_key_value_heads);
  return c;
}

}  // namespace loom::io
