// Chat JSONL (data/chat_jsonl.hpp): parse_chat_record on the whole input as one line, and
// read_chat_jsonl on it as a file (default columns, and no history column with a small
// max_line_bytes so the long-line refusal is reached), then build each record's prompt.
#include "fuzz_input.hpp"

#include <loom/data/chat_jsonl.hpp>

#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  loom_fuzz::call([&] { (void)loom::data::chatglm2_prompt(loom::data::parse_chat_record(text)); });
  const std::string& path = loom_fuzz::write_input(data, size);
  loom_fuzz::call([&] {
    for (const auto& r : loom::data::read_chat_jsonl(path)) (void)loom::data::chatglm2_prompt(r);
  });
  loom_fuzz::call([&] {
    loom::data::chat_columns cols;
    cols.history.clear();
    loom::data::chat_read_options o;
    o.max_line_bytes = 256;
    (void)loom::data::read_chat_jsonl(path, cols, o);
  });
  return 0;
}
