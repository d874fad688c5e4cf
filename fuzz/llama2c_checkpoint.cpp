// llama2.c checkpoint reader (io/llama2c.hpp: read_llama2c) on arbitrary bytes.
#include "fuzz_input.hpp"

#include <loom/io/llama2c.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = loom_fuzz::write_input(data, size);
  loom_fuzz::call([&] {
    const auto ck = loom::io::read_llama2c(path);
    // The reader promises each tensor holds exactly numel(shape) floats: a lie here would be
    // an over-read for whoever uses the tensor next.
    for (const auto& [name, t] : ck.tensors)
      if (static_cast<std::size_t>(t.numel()) != t.data.size()) __builtin_trap();
  });
  return 0;
}
