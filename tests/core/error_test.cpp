// LOOM_CHECK / LOOM_THROW: the message carries the caller's parts, the expression and file:line.
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>

#include <doctest/doctest.h>

#include <string>

TEST_CASE("LOOM_CHECK formats the arguments and location") {
  const int n_heads = 6, n_kv_heads = 4;
  try {
    LOOM_CHECK(n_heads % n_kv_heads == 0, "n_heads (", n_heads, ") must be divisible by n_kv_heads (", n_kv_heads, ")");
    FAIL("no throw");
  } catch (const loom::error& e) {
    const std::string m = e.what();
    CHECK(m.find("n_heads (6) must be divisible by n_kv_heads (4)") == 0);
    CHECK(m.find("n_heads % n_kv_heads == 0") != std::string::npos);
    CHECK(m.find("error_test.cpp:") != std::string::npos);
  }
  CHECK_NOTHROW(LOOM_CHECK(1 + 1 == 2, "never"));
  try {
    const std::array<long, 3> shape{2, 3, 4};
    const std::vector<int> ids{7, -1};
    LOOM_CHECK(false, "shape=", shape, " ids=", ids);
  } catch (const loom::error& e) {
    CHECK(std::string(e.what()).find("shape=[2, 3, 4] ids=[7, -1]") == 0);
  }
  CHECK_THROWS_AS(LOOM_THROW("x=", 3), loom::error);
  static_assert(std::is_base_of_v<std::runtime_error, loom::error>);
}

TEST_CASE("dtype names round-trip and bad names are refused by name") {
  for (auto t : {loom::dtype::f32, loom::dtype::f64, loom::dtype::f16, loom::dtype::bf16, loom::dtype::i32, loom::dtype::u16})
    CHECK(loom::parse_dtype(loom::dtype_name(t)) == t);
  CHECK(loom::parse_dtype("fp16") == loom::dtype::f16);
  CHECK(loom::dtype_size(loom::dtype::bf16) == 2);
  CHECK(loom::dtype_of<loom::half> == loom::dtype::f16);
  try {
    (void)loom::parse_dtype("float8");
    FAIL("no throw");
  } catch (const loom::error& e) {
    CHECK(std::string(e.what()).find("'float8'") != std::string::npos);
  }
  static_assert(loom::element<float> && !loom::element<long double>);
}
