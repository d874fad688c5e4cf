// The helpers every reader of outside bytes uses: bounded quoting, overflow-checked sizes,
// depth-limited JSON parsing and range-checked numbers.
#include <loom/data/input.hpp>
#include <loom/data/json_input.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

using loom::data::quote_input;
using loom::data::quote_json;
using nlohmann::json;

TEST_CASE("quote_input: short values whole, long ones cut with their length, control bytes escaped") {
  CHECK(quote_input("abc") == "\"abc\"");
  CHECK(quote_input("a\"b\\c") == "\"a\\\"b\\\\c\"");
  CHECK(quote_input(std::string("x\x1b[2J\n\0y", 8)) == "\"x\\x1b[2J\\x0a\\x00y\"");
  const std::string big(50'000'000, 'z');
  const std::string q = quote_input(big);
  std::string want(1, '"');  // (built with append: GCC 12 warns falsely on "x" + std::string + "y")
  want.append(loom::data::quote_limit, 'z').append("\"... (50000000 bytes)");
  CHECK(q == want);
  CHECK(quote_input("abcdef", 3) == "\"abc\"... (6 bytes)");
}

TEST_CASE("overflow-checked sizes") {
  constexpr auto u64max = std::numeric_limits<std::uint64_t>::max();
  CHECK(loom::data::mul_u64(1ull << 32, 1ull << 31) == (1ull << 63));
  CHECK_FALSE(loom::data::mul_u64(1ull << 32, 1ull << 32).has_value());
  CHECK(loom::data::add_u64(u64max - 1, 1) == u64max);
  CHECK_FALSE(loom::data::add_u64(u64max, 1).has_value());
  const std::vector<std::int64_t> ok{3, 5, 7}, zero{3, 0, 7}, neg{3, -1}, wraps{1ll << 32, 1ll << 32, 0},
      past_int64{1ll << 32, 1ll << 31};
  CHECK(loom::data::shape_numel(ok) == 105u);
  CHECK(loom::data::shape_numel(zero) == 0u);
  CHECK(loom::data::shape_numel(std::vector<std::int64_t>{}) == 1u);
  CHECK_FALSE(loom::data::shape_numel(neg).has_value());
  CHECK_FALSE(loom::data::shape_numel(wraps).has_value());  // a partial product that wraps is refused, even before a 0
  CHECK_FALSE(loom::data::shape_numel(past_int64).has_value());
}

TEST_CASE("quote_json stays short and shallow for any value") {
  json deep = 1;
  for (int i = 0; i < 300000; ++i) deep = json::array({std::move(deep)});
  const std::string q = quote_json(deep);
  CHECK(q.size() <= loom::data::quote_limit + 3);
  CHECK(q.substr(0, 10) == "[[[[[[[[[[");
  CHECK(q.substr(q.size() - 3) == "...");
  CHECK(quote_json(json::parse(R"({"a": [1, 2.5, "x", null, true]})")) == R"({"a": [1, 2.5, "x", null, true]})");
  json wide = json::object();
  wide[std::string(1 << 20, 'k')] = std::string(1 << 20, 'v');
  CHECK(quote_json(wide).size() <= loom::data::quote_limit + 3);
}

TEST_CASE("parse_json_input: nesting limit and invalid JSON are loom::errors naming the input") {
  CHECK(loom::data::parse_json_input(std::string(64, '[') + std::string(64, ']'), "in").is_array());
  CHECK_THROWS_WITH_AS(loom::data::parse_json_input(std::string(65, '[') + std::string(65, ']'), "file.json"),
                       doctest::Contains("file.json: nesting deeper than 64"), loom::error);
  CHECK_THROWS_WITH_AS(loom::data::parse_json_input(std::string(1'000'000, '['), "x.json"), doctest::Contains("x.json: nesting"),
                       loom::error);
  CHECK_THROWS_WITH_AS(loom::data::parse_json_input(R"({"a": 1)", "cfg", 4), doctest::Contains("cfg: not valid JSON"), loom::error);
  CHECK_THROWS_WITH_AS(loom::data::parse_json_input(R"({"a": {"b": {}}})", "cfg", 2), doctest::Contains("nesting deeper than 2"),
                       loom::error);
  // a long invalid string token: the parser's message quotes it, ours cuts it
  try {
    std::string text(1, '"');
    text.append(10'000'000, 'a').append("\x01\"");
    loom::data::parse_json_input(text, "big");
    FAIL("no error");
  } catch (const loom::error& e) {
    CHECK(std::string(e.what()).find("big: not valid JSON") != std::string::npos);
    CHECK(std::string(e.what()).size() < 1000);
  }
}

TEST_CASE("json_integer / json_real: type, finiteness and range, naming the field and the value") {
  using loom::data::json_integer, loom::data::json_real;
  CHECK(json_integer(json::parse("1e9"), "n", 0, 2'000'000'000) == 1'000'000'000);
  CHECK(json_integer(json::parse("-7"), "n", -10, 10) == -7);
  CHECK(json_integer(json::parse("9223372036854775807"), "n", 0, std::numeric_limits<std::int64_t>::max()) ==
        std::numeric_limits<std::int64_t>::max());
  CHECK_THROWS_WITH_AS(json_integer(json::parse("4294967360"), "\"heads\"", 1, 2147483647),
                       doctest::Contains("\"heads\" must be <= 2147483647, got 4294967360"), loom::error);
  CHECK_THROWS_WITH_AS(json_integer(json::parse("18446744073709551615"), "f", 0, std::numeric_limits<std::int64_t>::max()),
                       doctest::Contains("f must be <= 9223372036854775807, got 18446744073709551615"), loom::error);
  CHECK_THROWS_WITH_AS(json_integer(json::parse("-1"), "f", 0, 5), doctest::Contains("f must be >= 0, got -1"), loom::error);
  CHECK_THROWS_WITH_AS(json_integer(json::parse("1e300"), "f", 0, 5), doctest::Contains("f must be <= 5, got 1e+300"), loom::error);
  CHECK_THROWS_WITH_AS(json_integer(json::parse("-1e300"), "f", 0, 5), doctest::Contains("f must be >= 0, got -1e+300"), loom::error);
  CHECK_THROWS_WITH_AS(json_integer(json::parse("2.5"), "f", 0, 5), doctest::Contains("f must be an integer, got 2.5"), loom::error);
  CHECK_THROWS_WITH_AS(json_integer(json::parse("\"3\""), "f", 0, 5), doctest::Contains("f must be an integer, got \"3\""), loom::error);
  CHECK(json_real<float>(json::parse("0.5"), "r", 0, 1) == 0.5f);
  CHECK(json_real<double>(json::parse("1e300"), "r", 0, 1e301) == 1e300);
  CHECK_THROWS_WITH_AS(json_real<float>(json::parse("1e300"), "wd", 0, 1e308), doctest::Contains("wd must be <= 3.40282e+38, got 1e+300"),
                       loom::error);
  CHECK_THROWS_WITH_AS(json_real<float>(json::parse("1e-50"), "eps", 0, 1), doctest::Contains("eps is too small for a 32-bit float"),
                       loom::error);
  CHECK_THROWS_WITH_AS(json_real<float>(json::parse("-0.5"), "r", 0, 1), doctest::Contains("r must be >= 0, got -0.5"), loom::error);
  CHECK_THROWS_WITH_AS(json_real<float>(json::parse("[1]"), "r", 0, 1), doctest::Contains("r must be a number, got [1]"), loom::error);
}
