// include/loom/data/batches.hpp with a tokenizer.model and the chatglm3 template: every row the
// trainers get is one of the rows the Python transcription of the template gives
// (tests/data/tokenizer_fixtures.py, max_source = max_target = 64), shifted and padded as
// ChatGLM's ptuning does; a tokenizer larger than the model is refused naming both sizes.
#include <support/error_of.hpp>
#include <loom/data/batches.hpp>
#include <tokenizer_file.hpp>

#include <doctest/doctest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {
const std::string fixtures = LOOM_TOKENIZER_FIXTURES;

// (tokens, targets) rows of seq 128 from the oracle's ids and loss flags at 64 / 64.
std::set<std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>>> oracle_rows(std::int32_t pad) {
  std::ifstream f(fixtures + "/chat_chatglm3.txt");
  REQUIRE(f.good());
  std::set<std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>>> rows;
  for (std::string head, a, b; std::getline(f, head) && std::getline(f, a) && std::getline(f, b);) {
    if (head.substr(head.find(' ')) != " 64 64") continue;
    std::vector<std::int32_t> ids, mask;
    std::istringstream ia(a), ib(b);
    for (std::int32_t v; ia >> v;) ids.push_back(v);
    for (std::int32_t v; ib >> v;) mask.push_back(v);
    std::vector<std::int32_t> input(129, pad), labels(129, loom::data::ignore_index);
    for (std::size_t i = 0; i < ids.size(); ++i) input[i] = ids[i], labels[i] = mask[i] ? ids[i] : loom::data::ignore_index;
    rows.insert({std::vector<std::int32_t>(input.begin(), input.end() - 1), std::vector<std::int32_t>(labels.begin() + 1, labels.end())});
  }
  return rows;
}
}  // namespace

TEST_CASE("chat JSONL through a tokenizer.model and the chatglm3 template: the trainers' rows are the oracle's") {
  const auto tok = examples::open_tokenizer(fixtures + "/bpe.model", "chatglm3");
  const auto want = oracle_rows(tok.pad_id());
  REQUIRE(want.size() > 30);
  loom::data::chat_encoding chat{.tokenizer = &tok, .chat_template = {.kind = loom::data::chat_template::chatglm3,
                                                                     .system = "You are a helpful assistant. 请用中文回答。"}};
  auto loader = loom::data::make_batch_loader({fixtures + "/records.jsonl"}, 2048, 128, 4, 7, 0, 1, chat);
  loom::data::token_batch batch;
  std::set<std::vector<std::int32_t>> seen;
  for (int g = 0; g < 10; ++g) {
    loom::data::global_micro_batch(loader, 0, g, 10, batch);
    REQUIRE(batch.seq_len == 128);
    for (std::size_t b = 0; b < batch.batch; ++b) {
      const std::vector<std::int32_t> t(batch.tokens.begin() + b * 128, batch.tokens.begin() + (b + 1) * 128);
      const std::vector<std::int32_t> y(batch.targets.begin() + b * 128, batch.targets.begin() + (b + 1) * 128);
      CHECK(want.count({t, y}) == 1);
      seen.insert(t);
    }
  }
  CHECK(seen.size() > 20);

  const std::string e = loom::test::error_of([&] { loom::data::make_batch_loader({fixtures + "/records.jsonl"}, 1000, 128, 4, 7, 0, 1, chat); });
  CHECK(e.find("bpe.model'") != std::string::npos);
  CHECK(e.find("vocab_size=1409 is larger than the model's vocab_size=1000") != std::string::npos);
}

TEST_CASE("without a tokenizer the chat path stays byte-level (bos first, as before)") {
  auto loader = loom::data::make_batch_loader({fixtures + "/records.jsonl"}, 259, 64, 2, 7);
  loom::data::token_batch batch;
  loom::data::global_micro_batch(loader, 0, 0, 1, batch);
  CHECK(batch.tokens[0] == 256);
  CHECK(batch.tokens[64] == 256);
}
