// llama2.c checkpoint readers (io/llama2c.hpp) on arbitrary bytes: read_llama2c,
// read_llama2c_config, the header alone that the generator's memory plan reads before loading,
// and llama2c_file, the range reader a rank reads its slice with.
#include "fuzz_input.hpp"

#include <loom/io/llama2c.hpp>

#include <cstring>
#include <span>

namespace {
bool same(const loom::io::llama2c_config& a, const loom::io::llama2c_config& b) {
  return a.dim == b.dim && a.hidden_dim == b.hidden_dim && a.n_layers == b.n_layers && a.n_heads == b.n_heads &&
         a.n_kv_heads == b.n_kv_heads && a.vocab_size == b.vocab_size && a.seq_len == b.seq_len &&
         a.shared_classifier == b.shared_classifier && a.version == b.version;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = loom_fuzz::write_input(data, size);
  bool loaded = false, planned = false;
  loom::io::llama2c_config full{}, head{};
  loom_fuzz::call([&] {
    const auto ck = loom::io::read_llama2c(path);
    // The reader promises each tensor holds exactly numel(shape) floats: a lie here would be
    // an over-read for whoever uses the tensor next.
    for (const auto& [name, t] : ck.tensors)
      if (static_cast<std::size_t>(t.numel()) != t.data.size()) __builtin_trap();
    full = ck.config, loaded = true;
    // The range reader opens the same file and reads each tensor's first and last elements:
    // the bytes the whole-file reader gave, at the offsets llama2c_tensors computes.
    const loom::io::llama2c_file f(path);
    for (const auto& [name, t] : ck.tensors) {
      if (t.data.empty()) continue;
      float x[1];
      for (const std::size_t at : {std::size_t{0}, t.data.size() - 1}) {
        f.read(name, at, std::span<float>(x, 1));
        if (std::memcmp(x, t.data.data() + at, sizeof x) != 0) __builtin_trap();
      }
    }
  });
  loom_fuzz::call([&] {
    head = loom::io::read_llama2c_config(path);
    planned = true;
  });
  // The plan made from the header must be the one the load would give: the header reader
  // accepts exactly the files the full reader accepts, with the same config.
  if (loaded != planned || (loaded && !same(full, head))) __builtin_trap();
  return 0;
}
