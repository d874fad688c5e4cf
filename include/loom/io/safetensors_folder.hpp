#pragma once
// safetensors_folder: a checkpoint stored as safetensors (one file, or a folder of shards as
// Hugging Face writes them) opened for range reads: every shard's header, no tensor data.
// Each read touches only the bytes of the elements it asks for and is counted (bytes_read),
// so a caller that reads slices (a rank reading what it owns) can show that it read no more.
//
// Why one reader for all of a folder: which shard holds a tensor is outside bytes too. The
// folder's model.safetensors.index.json ("weight_map": tensor -> file) decides when there is
// one: each file it names must be a file of the folder (no path: "../x" and "/etc/passwd" are
// refused), must exist, and must hold the tensors placed in it; a tensor the index does not
// place in a shard is not read from it. Without an index every *.safetensors in the folder is
// a shard. A tensor in two shards is refused, naming both. Names are the checkpoint's own:
// mapping them onto a model is the model's business (examples/llama/generate/llama_loader.hpp).

#include <loom/core/error.hpp>
#include <loom/data/json_input.hpp>
#include <loom/io/safetensors.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace loom::io {

/// The shard files of folder `dir` and the tensors each holds as its
/// model.safetensors.index.json lists them (each file must exist), or, without an index, every
/// *.safetensors in it (tensors unlisted: empty).
inline std::map<std::string, std::vector<std::string>> safetensors_shards(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::map<std::string, std::vector<std::string>> shards;  // file -> its tensors
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    const std::string what = "'" + index.string() + "'";
    const auto j = data::parse_json_input(detail::read_file_bytes(index.string()), what);
    LOOM_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), what,
               ": no \"weight_map\" object");
    for (const auto& [name, f] : j["weight_map"].items()) {
      LOOM_CHECK(f.is_string(), what, ": weight_map[\"", name.substr(0, 128), "\"] is not a file name");
      const auto file = f.get<std::string>();
      LOOM_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..", what,
                 ": weight_map[\"", name.substr(0, 128), "\"] = \"", file.substr(0, 128), "\" is not a file of the folder");
      shards[file].push_back(name);
    }
    for (const auto& [file, names] : shards)
      LOOM_CHECK(fs::is_regular_file(dir / file), "shard '", (dir / file).string(), "' (tensor '", names.front().substr(0, 128),
                 "' in ", what, ") is missing");
    return shards;
  }
  for (auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") shards[e.path().filename().string()];
  LOOM_CHECK(!shards.empty(), "no .safetensors file in '", dir.string(), "'");
  return shards;
}

class safetensors_folder {
 public:
  /// `path`: a folder of shards (safetensors_shards), or one .safetensors file.
  explicit safetensors_folder(const std::filesystem::path& path) : path_(path.string()) {
    namespace fs = std::filesystem;
    if (!fs::is_directory(path)) {
      add(read_safetensors_index(path.string()), nullptr);
      return;
    }
    const fs::path index = path / "model.safetensors.index.json";
    const bool indexed = fs::exists(index);
    for (const auto& [file, names] : safetensors_shards(path)) {
      auto ix = read_safetensors_index((path / file).string());
      for (const auto& n : names)
        LOOM_CHECK(ix.tensors.contains(n), "'", index.string(), "' places tensor '", n.substr(0, 128), "' in '", ix.path,
                   "', which does not hold it");
      add(std::move(ix), indexed ? &names : nullptr);
    }
  }

  /// The folder or file it was opened from.
  const std::string& path() const noexcept { return path_; }
  /// Tensor `name`'s header entry, or nullptr when no shard holds it.
  const safetensors_entry* find(const std::string& name) const {
    const auto it = where_.find(name);
    return it == where_.end() ? nullptr : &files_[it->second].tensors.at(name);
  }
  /// The file that holds tensor `name` (find(name) != nullptr).
  const std::string& file_of(const std::string& name) const { return files_[where_.at(name)].path; }
  /// Every tensor's name, sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [n, i] : where_) out.push_back(n);
    return out;
  }
  /// Elements [first, first + out.size()) of tensor `name` (row-major), widened to float.
  void read(const std::string& name, std::uint64_t first, std::span<float> out) const {
    const auto it = where_.find(name);
    LOOM_CHECK(it != where_.end(), "checkpoint '", path_, "': no tensor '", name.substr(0, 128), "'");
    const auto& ix = files_[it->second];
    read_safetensors_range(ix, name, first, out);
    bytes_read_ += out.size() * detail::dtype_size(ix.tensors.at(name).dtype);
  }
  /// Tensor data bytes read so far; the headers' bytes (read once each, by the constructor);
  /// the shard files' sizes.
  std::uint64_t bytes_read() const noexcept { return bytes_read_; }
  std::uint64_t header_bytes() const noexcept { return header_bytes_; }
  std::uint64_t file_bytes() const noexcept { return file_bytes_; }

 private:
  // `listed`: the tensors the index places in this shard (nullptr: all it holds)
  void add(safetensors_index ix, const std::vector<std::string>* listed) {
    file_bytes_ += std::filesystem::file_size(ix.path);
    header_bytes_ += ix.data_start;
    files_.push_back(std::move(ix));
    const auto& f = files_.back();
    for (const auto& [n, e] : f.tensors) {
      if (listed && std::find(listed->begin(), listed->end(), n) == listed->end()) continue;  // the index decides
      const auto [it, fresh] = where_.emplace(n, files_.size() - 1);
      LOOM_CHECK(fresh, "tensor '", n.substr(0, 128), "' is in both '", files_[it->second].path, "' and '", f.path, "'");
    }
  }

  std::string path_;
  std::vector<safetensors_index> files_;
  std::map<std::string, std::size_t> where_;  // tensor name -> files_ index
  mutable std::uint64_t bytes_read_ = 0;
  std::uint64_t header_bytes_ = 0, file_bytes_ = 0;
};

}  // namespace loom::io
