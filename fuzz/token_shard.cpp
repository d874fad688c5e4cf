// Token shards (data/token_shard.hpp): open the bytes as a shard, with no headerless width or
// with uint16 / uint32 (chosen by the input's size mod 3, so the bytes themselves are left
// whole; opening once per input keeps the mmap cost to one), then read every token in chunks
// against a vocabulary.
#include "fuzz_input.hpp"

#include <loom/data/token_shard.hpp>

#include <optional>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using loom::data::token_width;
  const std::string& path = loom_fuzz::write_input(data, size);
  const std::optional<token_width> widths[] = {std::nullopt, token_width::u16, token_width::u32};
  {
    const std::optional<token_width> w = widths[size % 3];
    loom_fuzz::call([&] {
      const loom::data::token_shard s(path, w);
      const std::size_t width = static_cast<std::size_t>(s.width());
      // The size the shard claims must fit in the file: it is what every later read trusts
      if (s.size() * width > size) __builtin_trap();
      std::vector<std::int32_t> out(61);  // chunks that straddle the end of the shard
      const std::uint32_t vocab = size ? 1u + data[0] * 300u : 1u;  // some ids in range, some not
      for (std::size_t first = 0; first < s.size(); first += out.size()) {
        const std::size_t n = s.size() - first < out.size() ? s.size() - first : out.size();
        loom_fuzz::call([&] { s.read(first, std::span(out.data(), n), vocab); });
        for (std::size_t k = 0; k < n; ++k) (void)s[first + k];
      }
      loom_fuzz::call([&] { s.read(s.size(), std::span(out.data(), 1), vocab); });  // past the end: must refuse
    });
  }
  loom_fuzz::check_unmapped();  // accepted or refused, the shard is gone: so is its mapping
  return 0;
}
