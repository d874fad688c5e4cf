#pragma once
// JSON from outside (config files, JSONL records, safetensors headers): parsing with a nesting
// limit, bounded quoting of values in messages, and range-checked numbers.
//
// Why: nlohmann::json parses any depth, but dump() and other member functions recurse, so a
// value nested 100000 deep overflows the stack when a message quotes it; parse_json_input()
// refuses such input while parsing, and quote_json() stays bounded in length and depth even
// for a value built by a caller. get<int>() and get<float>() narrow silently (2^32 + 64 reads
// as 64, 1e300 as inf); json_integer() and json_real() check the type, finiteness and the
// field's range instead, and name the field and the value.

#include <loom/core/error.hpp>
#include <loom/data/input.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

namespace loom::data {

/// Deepest nesting of arrays and objects accepted from a file; real configs and records use a
/// handful of levels.
inline constexpr int json_max_depth = 64;

/// Parses `input` (anything nlohmann::json::parse takes); `what` names the input in errors
/// ("ds_config path='x.json'", "chat jsonl x.jsonl:3"). Invalid JSON and nesting deeper than
/// `max_depth` are a loom::error.
namespace detail {
// nlohmann's DOM builder behind a depth count. Why not parse() with a callback: its callback
// parser scans the enclosing object after every nested value ends, so an object of n
// entries costs O(n^2) (a checkpoint's safetensors header has tens of thousands).
struct depth_limited_sax {
  using json = nlohmann::json;
  nlohmann::detail::json_sax_dom_parser<json> dom;
  int depth = 0, max_depth;
  const std::string& what;
  depth_limited_sax(json& out, int max, const std::string& w) : dom(out, true), max_depth(max), what(w) {}
  bool open() {
    if (depth >= max_depth) LOOM_THROW(what, ": nesting deeper than ", max_depth, " levels of arrays and objects");
    ++depth;
    return true;
  }
  bool null() { return dom.null(); }
  bool boolean(bool v) { return dom.boolean(v); }
  bool number_integer(json::number_integer_t v) { return dom.number_integer(v); }
  bool number_unsigned(json::number_unsigned_t v) { return dom.number_unsigned(v); }
  bool number_float(json::number_float_t v, const json::string_t& s) { return dom.number_float(v, s); }
  bool string(json::string_t& v) { return dom.string(v); }
  bool binary(json::binary_t& v) { return dom.binary(v); }
  bool start_object(std::size_t n) { return open() && dom.start_object(n); }
  bool key(json::string_t& k) { return dom.key(k); }
  bool end_object() { return --depth, dom.end_object(); }
  bool start_array(std::size_t n) { return open() && dom.start_array(n); }
  bool end_array() { return --depth, dom.end_array(); }
  template <class Exception>
  bool parse_error(std::size_t at, const std::string& token, const Exception& e) {
    return dom.parse_error(at, token, e);
  }
};
}  // namespace detail

template <class Input>
nlohmann::json parse_json_input(Input&& input, const std::string& what, int max_depth = json_max_depth) {
  try {
    nlohmann::json out;
    detail::depth_limited_sax sax(out, max_depth, what);
    nlohmann::json::sax_parse(std::forward<Input>(input), &sax);
    return out;
  } catch (const nlohmann::json::exception& e) {
    // nlohmann quotes the last token read, which may be a whole long string
    LOOM_THROW(what, ": not valid JSON: ", quote_input(e.what(), 4 * quote_limit));
  }
}

namespace detail {
inline void dump_bounded(const nlohmann::json& v, std::string& out, std::size_t limit) {
  if (out.size() > limit) return;
  const auto room = [&] { return out.size() < limit ? limit - out.size() + 1 : 1; };
  if (v.is_string()) {
    out += quote_input(v.get_ref<const std::string&>(), room());
  } else if (v.is_array() || v.is_object()) {
    out += v.is_array() ? '[' : '{';
    bool first = true;
    for (auto it = v.begin(); it != v.end() && out.size() <= limit; ++it) {
      if (!first) out += ", ";
      first = false;
      if (v.is_object()) out += quote_input(it.key(), room()) + ": ";
      dump_bounded(*it, out, limit);  // every level adds at least one byte, so depth <= limit
    }
    out += v.is_array() ? ']' : '}';
  } else {
    out += v.dump();  // number, boolean, null: short
  }
}
}  // namespace detail

/// `v` as JSON text for an error message, cut after about `limit` bytes with "...".
inline std::string quote_json(const nlohmann::json& v, std::size_t limit = quote_limit) {
  std::string out;
  detail::dump_bounded(v, out, limit);
  if (out.size() > limit) out = out.substr(0, limit) + "...";
  return out;
}

/// The integer in `v`, which must lie in [min, max]. Integral floating values (1e9, as
/// DeepSpeed configs write large counts) are accepted. `what` names the field in the message.
inline std::int64_t json_integer(const nlohmann::json& v, const std::string& what, std::int64_t min, std::int64_t max) {
  constexpr double two63 = 9223372036854775808.0;
  std::int64_t x = 0;
  bool above = false, below = false;
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    above = u > static_cast<std::uint64_t>(max < 0 ? 0 : max);
    x = above ? 0 : static_cast<std::int64_t>(u);
  } else if (v.is_number_integer()) {
    x = v.get<std::int64_t>();
  } else {
    const double d = v.is_number() ? v.get<double>() : 0.5;
    LOOM_CHECK(v.is_number() && std::isfinite(d) && std::floor(d) == d, what, " must be an integer, got ", quote_json(v));
    above = d >= two63;
    below = d < -two63;
    x = above || below ? 0 : static_cast<std::int64_t>(d);
  }
  LOOM_CHECK(!above && (below || x <= max), what, " must be <= ", max, ", got ", quote_json(v));
  LOOM_CHECK(!below && x >= min, what, " must be >= ", min, ", got ", quote_json(v));
  return x;
}

/// The number in `v` as T, finite and in [min, max] (max capped at T's largest value); a
/// nonzero value that T would round to zero is refused too.
template <std::floating_point T>
T json_real(const nlohmann::json& v, const std::string& what, double min, double max) {
  const double d = v.is_number() ? v.get<double>() : 0.0;
  LOOM_CHECK(v.is_number() && std::isfinite(d), what, " must be a number, got ", quote_json(v));
  if (max > static_cast<double>(std::numeric_limits<T>::max())) max = static_cast<double>(std::numeric_limits<T>::max());
  LOOM_CHECK(d >= min, what, " must be >= ", min, ", got ", quote_json(v));
  LOOM_CHECK(d <= max, what, " must be <= ", max, ", got ", quote_json(v));
  const T t = static_cast<T>(d);
  LOOM_CHECK(t != T(0) || d == 0.0, what, " is too small for a ", sizeof(T) * 8, "-bit float, got ", quote_json(v));
  return t;
}

}  // namespace loom::data
