// model.safetensors.index.json of an HF checkpoint folder (loom/io/safetensors_folder.hpp,
// what llama-generate, llama-serve and the trainer's --init-from open HF folders with). The input is the index of a scratch folder whose other
// files are real and fixed:
//   model-00001-of-00002.safetensors   tensors "a" [2, 3] and "b" [4]
//   model-00002-of-00002.safetensors   tensor "c" [1]
//   config.json                        a JSON file that is not a shard
//   sub/                               a folder
// The reader must load exactly the shards the weight_map names, refuse a name that leaves the
// folder ("../x", "/etc/passwd", "."), a missing or non-shard file, and a tensor placed in a
// shard that does not hold it; whatever it accepts, every tensor it returns has its file.
// The seeds are written by scripts/make_fuzz_corpus.py.
#include "fuzz_input.hpp"

#include <loom/io/safetensors_folder.hpp>

#include <filesystem>
#include <fstream>
#include <vector>

namespace {

const std::string& folder() {
  return loom_fuzz::scratch_dir(".hf", [](const std::string& d) {
    auto tensor = [](std::vector<std::int64_t> shape, std::size_t n) {
      loom::io::named_tensor t;
      t.shape = std::move(shape);
      t.data = loom::buffer<float>(n);
      for (std::size_t i = 0; i < n; ++i) t.data[i] = static_cast<float>(i);
      return t;
    };
    loom::io::tensor_map s1, s2;
    s1.emplace("a", tensor({2, 3}, 6));
    s1.emplace("b", tensor({4}, 4));
    s2.emplace("c", tensor({1}, 1));
    loom::io::write_safetensors(d + "/model-00001-of-00002.safetensors", s1);
    loom::io::write_safetensors(d + "/model-00002-of-00002.safetensors", s2);
    std::ofstream(d + "/config.json") << "{\"model_type\": \"llama\"}\n";
    std::filesystem::create_directories(d + "/sub");
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& dir = folder();
  loom_fuzz::write_file(dir + "/model.safetensors.index.json", data, size);
  loom_fuzz::call([&] {
    const loom::io::safetensors_folder m(dir);
    const auto names = m.names();
    if (names.size() > 3) __builtin_trap();  // an empty weight_map opens nothing; the loader names the first missing tensor
    for (const auto& name : names) {
      if (!m.find(name) || std::filesystem::path(m.file_of(name)).parent_path() != dir) __builtin_trap();
      std::vector<float> all(static_cast<std::size_t>(m.find(name)->count));
      m.read(name, 0, all);  // what the index placed in a shard is read from that shard
    }
  });
  return 0;
}
