// safetensors reader (io/safetensors.hpp: read_safetensors, and the header index with range
// reads that sharded checkpoints use) on arbitrary bytes.
#include "fuzz_input.hpp"

#include <loom/io/safetensors.hpp>

#include <algorithm>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = loom_fuzz::write_input(data, size);
  loom_fuzz::call([&] {
    const auto m = loom::io::read_safetensors(path);
    for (const auto& [name, t] : m)
      if (static_cast<std::size_t>(t.numel()) != t.data.size()) __builtin_trap();  // shape and data must agree
  });
  loom_fuzz::call([&] {
    const auto ix = loom::io::read_safetensors_index(path);
    std::vector<float> out;
    for (const auto& [name, e] : ix.tensors) {  // the last few elements of each tensor
      const std::uint64_t n = std::min<std::uint64_t>(e.count, 4);
      out.assign(static_cast<std::size_t>(n), 0.f);
      loom::io::read_safetensors_range(ix, name, e.count - n, out);
    }
  });
  return 0;
}
