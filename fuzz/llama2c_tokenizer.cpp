// llama2.c tokenizer.bin reader (io/llama2c.hpp: llama2c_tokenizer) on arbitrary bytes, then
// encode and decode with whatever vocabulary it accepted.
#include "fuzz_input.hpp"

#include <loom/io/llama2c.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = loom_fuzz::write_input(data, size);
  loom_fuzz::call([&] {
    // Both constructors: all tokens, and a vocab_size cap taken from the input's last byte
    const std::int32_t cap = size ? 3 + data[size - 1] % 16 : 0;
    for (std::int32_t vocab : {0, cap}) {
      loom_fuzz::call([&] {
        const loom::io::llama2c_tokenizer tok(path, vocab);
        // Text that hits merges, byte fallback and multi-byte UTF-8 (including a cut one)
        const auto ids = tok.encode("hello world \xc3\xa9t\xc3\xa9 \xe2\x82\xac \xf0\x9f\x99\x82 \xe2\x82", true, true);
        for (auto id : ids)
          if (id < 0) __builtin_trap();  // encode only emits ids it can decode
        (void)tok.decode(ids);
        const std::int32_t n = tok.vocab_size() < 300 ? tok.vocab_size() : 300;
        for (std::int32_t id = 0; id < n + 2; ++id) (void)tok.decode(loom::io::llama2c_tokenizer::bos, id);
      });
    }
  });
  return 0;
}
