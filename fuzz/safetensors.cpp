// safetensors reader (io/safetensors.hpp: read_safetensors) on arbitrary bytes.
#include "fuzz_input.hpp"

#include <loom/io/safetensors.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = loom_fuzz::write_input(data, size);
  loom_fuzz::call([&] {
    const auto m = loom::io::read_safetensors(path);
    for (const auto& [name, t] : m)
      if (static_cast<std::size_t>(t.numel()) != t.data.size()) __builtin_trap();  // shape and data must agree
  });
  return 0;
}
