// tensor_view: indexing against hand-computed row-major offsets, slicing, selecting,
// transposing, reshaping, and bad input that must throw loom::error naming the value.
#include <loom/core/buffer.hpp>
#include <loom/core/tensor_view.hpp>

#include <doctest/doctest.h>
#include <support/error_of.hpp>

#include <numeric>
#include <string>
#include <vector>

using loom::test::error_of;  // "" when nothing is thrown: every check below then fails

TEST_CASE("tensor_view indexing matches row-major offsets") {
  std::vector<int> data(2 * 3 * 4);
  std::iota(data.begin(), data.end(), 0);
  auto v = loom::make_view(data.data(), 2, 3, 4);  // [2, 3, 4]
  CHECK(v.numel() == 24);
  CHECK(v.is_contiguous());
  CHECK(v.strides() == loom::extents<3>{12, 4, 1});
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k) REQUIRE(v(i, j, k) == i * 12 + j * 4 + k);
  CHECK(v.at(1, 2, 3) == 23);
}

TEST_CASE("slice, select, transpose, reshape") {
  std::vector<float> data(6 * 5);
  std::iota(data.begin(), data.end(), 0.f);
  auto m = loom::make_view(data.data(), 6, 5);  // [6, 5]

  auto rows = m.slice(0, 2, 5);  // rows 2..4
  CHECK(rows.extent(0) == 3);
  CHECK(rows.is_contiguous());
  CHECK(rows(0, 0) == 10.f);

  auto cols = m.slice(1, 1, 3);  // columns 1..2: not contiguous
  CHECK_FALSE(cols.is_contiguous());
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 2; ++j) REQUIRE(cols(i, j) == static_cast<float>(i * 5 + j + 1));

  auto row3 = m[3];
  CHECK(row3.rank == 1);
  CHECK(row3(4) == 19.f);
  auto col2 = m.select(1, 2);
  CHECK(col2.stride(0) == 5);
  CHECK(col2(5) == 27.f);

  auto t = m.transpose(0, 1);  // [5, 6]
  for (int i = 0; i < 5; ++i)
    for (int j = 0; j < 6; ++j) REQUIRE(t(i, j) == m(j, i));
  CHECK_FALSE(t.is_contiguous());

  auto r = m.reshape<3>({3, 2, 5});
  CHECK(r(2, 1, 4) == m(5, 4));
  CHECK(m.flatten()(29) == 29.f);

  loom::tensor_view<const float, loom::host, 2> cm = m;  // const conversion
  CHECK(cm(1, 1) == 6.f);
  auto empty = m.slice(0, 3, 3);
  CHECK(empty.empty());
}

TEST_CASE("bad input throws loom::error naming the value") {
  std::vector<float> data(12);
  auto m = loom::make_view(data.data(), 3, 4);
  CHECK(error_of([&] { (void)m.slice(0, 1, 7); }).find("[1, 7)") != std::string::npos);
  CHECK(error_of([&] { (void)m.slice(1, 3, 2); }).find("extent 4") != std::string::npos);
  CHECK(error_of([&] { (void)m.at(3, 0); }).find("index 3") != std::string::npos);
  CHECK(error_of([&] { (void)m.at(0, -1); }).find("index -1") != std::string::npos);
  CHECK(error_of([&] { (void)m.select(0, 5); }).find("index 5") != std::string::npos);
  CHECK(error_of([&] { (void)m.extent(2); }).find("dimension 2") != std::string::npos);
  CHECK(error_of([&] { (void)loom::make_view(data.data(), 2, -3); }).find("extent=-3") != std::string::npos);
  CHECK(error_of([&] { (void)m.reshape<2>({5, 3}); }).find("15 elements") != std::string::npos);
  CHECK(error_of([&] { (void)m.transpose(0, 1).flatten(); }).find("not contiguous") != std::string::npos);

  alignas(8) unsigned char bytes[16] = {};
  CHECK(error_of([&] { (void)loom::view_bytes_as<float>(bytes, 10); }).find("bytes=10") != std::string::npos);
  CHECK(error_of([&] { (void)loom::view_bytes_as<float>(bytes + 1, 8); }).find("not aligned") != std::string::npos);
  CHECK(loom::view_bytes_as<float>(bytes, 16).numel() == 4);
}

TEST_CASE("buffer views") {
  loom::buffer<float> b(24);
  for (float x : b) REQUIRE(x == 0.f);  // host buffers start zeroed
  auto v = b.view(2, 3, 4);
  v(1, 2, 3) = 5.f;
  CHECK(b[23] == 5.f);
  CHECK_THROWS_AS((void)b.view(5, 5), loom::error);
  loom::buffer<float> c(4, 2.5f);
  CHECK(c[3] == 2.5f);
}
