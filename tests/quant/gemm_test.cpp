// The dequantising GEMMs (quant/host/gemm.hpp) against a naive product in double over the
// whole dequantised matrix: forward y = x W^T and backward dx = dy W, for NF4 (with and without
// double quantisation) and bf16 weights, tile shapes that do and do not divide the matrix.
#include <doctest/doctest.h>

#include <cmath>
#include <loom/quant/host/gemm.hpp>
#include <loom/quant/nf4.hpp>
#include <random>
#include <vector>

namespace {

using loom::index_t;
namespace quant = loom::quant;

std::vector<float> gemm_test_values(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& e : v) e = normal(gen);
  return v;
}

// C[m, n] = A[m, k] B[k, n] in double with A, B given by element functions; the error bound's
// scale sum_k |a_ik b_kj| alongside.
template <class A, class B>
void naive_product(index_t m, index_t n, index_t k, A a, B b, std::vector<double>& c, std::vector<double>& scale) {
  c.assign(static_cast<std::size_t>(m * n), 0.0);
  scale.assign(c.size(), 0.0);
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j)
      for (index_t p = 0; p < k; ++p) {
        c[i * n + j] += double(a(i, p)) * double(b(p, j));
        scale[i * n + j] += std::fabs(double(a(i, p)) * double(b(p, j)));
      }
}

// |got - want| <= 1e-5 of the dot product's scale (sum |x w|): fp32 GEMMs may sum in any order.
void check_close(const std::vector<float>& got, const std::vector<double>& want, const std::vector<double>& scale,
                 const char* what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    REQUIRE_MESSAGE(std::fabs(double(got[i]) - want[i]) <= 1e-5 * scale[i] + 1e-30, what, "[", i, "]: ", got[i], " vs ",
                    want[i]);
}

template <class W>
void check_dequant_gemms(const W& w, index_t m, const quant::dequant_gemm_options& o) {
  const index_t out = w.rows(), in = w.cols();
  std::vector<float> wd(static_cast<std::size_t>(out * in));  // the oracle's W: dequantised whole
  w.dequantize(0, out, 0, in, wd.data(), in);
  const auto x = gemm_test_values(static_cast<std::size_t>(m * in), 7);
  const auto dy = gemm_test_values(static_cast<std::size_t>(m * out), 8);
  std::vector<double> ref, scale;

  std::vector<float> y(static_cast<std::size_t>(m * out), 0.5f);
  quant::dequant_gemm_forward(loom::host{}, loom::make_view(x.data(), m, in), w, loom::make_view(y.data(), m, out), 0.f,
                              o);
  naive_product(
      m, out, in, [&](index_t i, index_t p) { return x[i * in + p]; },
      [&](index_t p, index_t j) { return wd[j * in + p]; }, ref, scale);
  check_close(y, ref, scale, "y");

  std::vector<float> dx(static_cast<std::size_t>(m * in), 0.25f);  // beta 1: added to what is there
  quant::dequant_gemm_backward(loom::host{}, loom::make_view(dy.data(), m, out), w, loom::make_view(dx.data(), m, in),
                               1.f, o);
  naive_product(
      m, in, out, [&](index_t i, index_t p) { return dy[i * out + p]; },
      [&](index_t p, index_t j) { return wd[p * in + j]; }, ref, scale);
  for (auto& r : ref) r += 0.25;
  check_close(dx, ref, scale, "dx");
}

}  // namespace

TEST_CASE("dequant GEMMs equal the naive product over the dequantised matrix, tiles dividing the shape or not") {
  struct shape {
    index_t m, out, in;
    quant::dequant_gemm_options tiles;
  };
  for (const shape s : {shape{33, 64, 256, {16, 128}},  // tiles divide
                        shape{5, 70, 192, {16, 128}},   // neither dimension divides
                        shape{17, 100, 320, {}},        // default tiles (one column tile)
                        shape{1, 3, 64, {2, 64}}}) {
    CAPTURE(s.m);
    CAPTURE(s.out);
    CAPTURE(s.in);
    const auto wf = gemm_test_values(static_cast<std::size_t>(s.out * s.in), 3);
    const auto wv = loom::make_view(wf.data(), s.out, s.in);
    check_dequant_gemms(quant::nf4_matrix(wv), s.m, s.tiles);
    check_dequant_gemms(quant::nf4_matrix(wv, {.double_quant = true}), s.m, s.tiles);
    check_dequant_gemms(quant::bf16_matrix(wv), s.m, s.tiles);
  }
}

TEST_CASE("dequant GEMMs read and write strided views: x transposed, y and dx inside wider rows") {
  // e.g. a fused q/k/v output [m, 3 out] written one projection at a time
  const index_t m = 6, out = 40, in = 128, wide = 3 * out;
  const auto wf = gemm_test_values(static_cast<std::size_t>(out * in), 11);
  const quant::nf4_matrix w(loom::make_view(wf.data(), out, in), {.double_quant = true});
  const auto xt = gemm_test_values(static_cast<std::size_t>(in * m), 12);  // x^T [in, m]
  const auto x = loom::make_view(xt.data(), in, m).transpose(0, 1);
  std::vector<float> contiguous(static_cast<std::size_t>(m * in));
  for (index_t i = 0; i < m; ++i)
    for (index_t k = 0; k < in; ++k) contiguous[i * in + k] = xt[k * m + i];
  std::vector<float> y_ref(static_cast<std::size_t>(m * out)), y_wide(static_cast<std::size_t>(m * wide), 7.f);
  quant::dequant_gemm_forward(loom::host{}, loom::make_view(contiguous.data(), m, in), w,
                              loom::make_view(y_ref.data(), m, out));
  const auto y_slice = loom::make_view(y_wide.data(), m, wide).slice(1, out, 2 * out);
  quant::dequant_gemm_forward(loom::host{}, x, w, y_slice);
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < wide; ++j) {
      const float got = y_wide[i * wide + j];
      if (j >= out && j < 2 * out)
        REQUIRE(got == doctest::Approx(y_ref[i * out + j - out]).epsilon(1e-5));
      else
        REQUIRE(got == 7.f);  // untouched outside the slice
    }
  std::vector<float> dx_ref(static_cast<std::size_t>(m * in)), dx_wide(static_cast<std::size_t>(m * 2 * in), 5.f);
  quant::dequant_gemm_backward(loom::host{}, loom::make_view(y_ref.data(), m, out), w,
                               loom::make_view(dx_ref.data(), m, in));
  quant::dequant_gemm_backward(loom::host{}, y_slice, w, loom::make_view(dx_wide.data(), m, 2 * in).slice(1, 0, in));
  for (index_t i = 0; i < m; ++i)
    for (index_t k = 0; k < 2 * in; ++k) {
      const float got = dx_wide[i * 2 * in + k];
      if (k < in)
        REQUIRE(got == doctest::Approx(dx_ref[i * in + k]).epsilon(1e-5));
      else
        REQUIRE(got == 5.f);
    }
}

TEST_CASE("bf16_matrix dequantises to the weight rounded to bfloat16") {
  const auto wf = gemm_test_values(5 * 7, 4);
  quant::bf16_matrix b(loom::make_view(wf.data(), 5, 7));
  std::vector<float> d(5 * 7);
  b.dequantize(0, 5, 0, 7, d.data(), 7);
  for (std::size_t i = 0; i < d.size(); ++i) CHECK(d[i] == float(loom::bfloat16(wf[i])));
}

TEST_CASE("dequant GEMMs: the result does not depend on the thread count") {
  const index_t m = 9, out = 96, in = 256;
  const auto wf = gemm_test_values(static_cast<std::size_t>(out * in), 5);
  const quant::nf4_matrix w(loom::make_view(wf.data(), out, in));
  const auto x = gemm_test_values(static_cast<std::size_t>(m * in), 6);
  const auto dy = gemm_test_values(static_cast<std::size_t>(m * out), 9);
  std::vector<std::vector<float>> ys, dxs;
  for (const int threads : {1, 3}) {
    loom::thread_pool pool(threads);
    const loom::host_pool_scope scope(pool);
    ys.emplace_back(static_cast<std::size_t>(m * out));
    dxs.emplace_back(static_cast<std::size_t>(m * in));
    quant::dequant_gemm_forward(loom::host{}, loom::make_view(x.data(), m, in), w,
                                loom::make_view(ys.back().data(), m, out), 0.f, {16, 128});
    quant::dequant_gemm_backward(loom::host{}, loom::make_view(dy.data(), m, out), w,
                                 loom::make_view(dxs.back().data(), m, in), 0.f, {16, 128});
  }
  CHECK(ys[0] == ys[1]);
  CHECK(dxs[0] == dxs[1]);
}

TEST_CASE("dequant GEMMs: bad shapes and tiles are a loom::error naming them") {
  const auto wf = gemm_test_values(8 * 64, 1);
  const quant::nf4_matrix w(loom::make_view(wf.data(), 8, 64));
  std::vector<float> x(4 * 64), y(4 * 8);
  CHECK_THROWS_WITH_AS(
      quant::dequant_gemm_forward(loom::host{}, loom::make_view(x.data(), 4, 32), w, loom::make_view(y.data(), 4, 8)),
      doctest::Contains("x has shape [4, 32] but the weight is [8, 64]"), loom::error);
  CHECK_THROWS_WITH_AS(
      quant::dequant_gemm_forward(loom::host{}, loom::make_view(x.data(), 4, 64), w, loom::make_view(y.data(), 8, 4)),
      doctest::Contains("y has shape [8, 4], expected [4, 8]"), loom::error);
  CHECK_THROWS_WITH_AS(
      quant::dequant_gemm_backward(loom::host{}, loom::make_view(y.data(), 4, 8), w, loom::make_view(x.data(), 2, 128)),
      doctest::Contains("dx has shape [2, 128], expected [4, 64]"), loom::error);
  CHECK_THROWS_WITH_AS(quant::dequant_gemm_backward(loom::host{}, loom::make_view(y.data(), 4, 8), w,
                                                    loom::make_view(x.data(), 4, 64), 0.f, {.tile_rows = -1}),
                       doctest::Contains("tile_rows=-1"), loom::error);
}
