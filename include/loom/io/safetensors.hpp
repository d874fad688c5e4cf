#pragma once
// safetensors read/write (HF's format): 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F32"|"F16"|"BF16", "shape": [...], "data_offsets": [begin, end]}, ...,
// "__metadata__": {string: string}}, then the raw tensor bytes (offsets relative to the end of
// the header). Reading converts every tensor to float (loom::half / loom::bfloat16 do the
// rounding-exact widening); writing stores F32, F16 or BF16.
//
// Why checked so carefully: a checkpoint comes from outside. Every offset, shape and size is
// validated against the file before a byte is read, and every failure names the file and the
// tensor, so a truncated download gives a message instead of garbage weights.
//
// Also reads HF's config.json of a LLaMA model (hf_llama_config), with nlohmann-json.

#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>
#include <loom/io/tensor_map.hpp>

#include <nlohmann/json.hpp>

#include <bit>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
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

/// All tensors of a .safetensors file, as float.
inline tensor_map read_safetensors(const std::string& path) {
  const std::vector<char> bytes = detail::read_file_bytes(path);
  LOOM_CHECK(bytes.size() >= 8, "safetensors '", path, "': file of ", bytes.size(), " bytes has no header");
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  LOOM_CHECK(n <= bytes.size() - 8, "safetensors '", path, "': header length ", n, " exceeds the file size ",
             bytes.size());
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  } catch (const nlohmann::json::exception& e) {
    LOOM_THROW("safetensors '", path, "': header is not valid JSON: ", e.what());
  }
  LOOM_CHECK(header.is_object(), "safetensors '", path, "': header is not a JSON object");
  const char* data = bytes.data() + 8 + n;
  const std::uint64_t data_size = bytes.size() - 8 - n;
  tensor_map out;
  for (auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      const std::string dt = info.at("dtype").get<std::string>();
      const std::size_t es = detail::dtype_size(dt);
      LOOM_CHECK(es != 0, "unsupported dtype '", dt, "' (F32, F16, BF16 are)");
      named_tensor t;
      t.shape = info.at("shape").get<std::vector<std::int64_t>>();
      for (auto e : t.shape) LOOM_CHECK(e >= 0, "negative extent ", e);
      const auto off = info.at("data_offsets").get<std::vector<std::uint64_t>>();
      LOOM_CHECK(off.size() == 2 && off[0] <= off[1] && off[1] <= data_size, "data_offsets out of the file's ",
                 data_size, " data bytes");
      const auto count = static_cast<std::uint64_t>(t.numel());
      LOOM_CHECK(off[1] - off[0] == count * es, "data_offsets span ", off[1] - off[0], " bytes, shape needs ",
                 count * es);
      t.data = buffer<float>(static_cast<std::size_t>(count));
      const char* p = data + off[0];
      for (std::uint64_t i = 0; i < count; ++i) {
        if (dt == "F32") {
          std::memcpy(&t.data[i], p + 4 * i, 4);
        } else {
          std::uint16_t b;
          std::memcpy(&b, p + 2 * i, 2);
          t.data[i] = dt == "F16" ? static_cast<float>(std::bit_cast<half>(b)) : static_cast<float>(std::bit_cast<bfloat16>(b));
        }
      }
      out.emplace(name, std::move(t));
    } catch (const nlohmann::json::exception& e) {
      LOOM_THROW("safetensors '", path, "': tensor '", name, "': bad entry: ", e.what());
    } catch (const loom::error& e) {
      LOOM_THROW("safetensors '", path, "': tensor '", name, "': ", e.what());
    }
  }
  return out;
}

/// Writes `tensors` as `dtype` ("F32", "F16" or "BF16"), names in sorted order.
inline void write_safetensors(const std::string& path, const tensor_map& tensors, const std::string& dtype = "F32",
                              const std::map<std::string, std::string>& metadata = {}) {
  const std::size_t es = detail::dtype_size(dtype);
  LOOM_CHECK(es != 0, "write_safetensors: unsupported dtype '", dtype, "'");
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t off = 0;
  for (auto& [name, t] : tensors) {
    LOOM_CHECK(static_cast<std::size_t>(t.numel()) == t.data.size(), "write_safetensors: tensor '", name, "' has ",
               t.data.size(), " elements for a shape of ", t.numel());
    const std::uint64_t nb = t.data.size() * es;
    header[name] = {{"dtype", dtype}, {"shape", t.shape}, {"data_offsets", {off, off + nb}}};
    off += nb;
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8) h.push_back(' ');  // data starts 8-byte aligned
  std::ofstream f(path, std::ios::binary);
  LOOM_CHECK(f.good(), "write_safetensors: cannot create '", path, "'");
  const std::uint64_t n = h.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (auto& [name, t] : tensors)
    for (float x : t.data) {
      if (dtype == "F32") {
        f.write(reinterpret_cast<const char*>(&x), 4);
      } else {
        const std::uint16_t b = dtype == "F16" ? std::bit_cast<std::uint16_t>(half(x)) : std::bit_cast<std::uint16_t>(bfloat16(x));
        f.write(reinterpret_cast<const char*>(&b), 2);
      }
    }
  LOOM_CHECK(f.good(), "write_safetensors: writing '", path, "' failed");
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
  hf_llama_config c;
  try {
    const auto j = nlohmann::json::parse(bytes.begin(), bytes.end());
    c.hidden_size = j.at("hidden_size").get<std::int32_t>();
    c.intermediate_size = j.at("intermediate_size").get<std::int32_t>();
    c.num_hidden_layers = j.at("num_hidden_layers").get<std::int32_t>();
    c.num_attention_heads = j.at("num_attention_heads").get<std::int32_t>();
    c.num_key_value_heads = j.value("num_key_value_heads", c.num_attention_heads);
    c.vocab_size = j.at("vocab_size").get<std::int32_t>();
    c.max_position_embeddings = j.value("max_position_embeddings", 2048);
    c.rms_norm_eps = j.value("rms_norm_eps", 1e-6f);
    c.rope_theta = j.value("rope_theta", 10000.f);
    c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  } catch (const nlohmann::json::exception& e) {
    LOOM_THROW("config '", path, "': ", e.what());
  }
  return c;
}

}  // namespace loom::io
