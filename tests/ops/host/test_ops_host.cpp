// ops/host kernels: forward against naive loops written here, backward against central
// finite differences in double, 16-bit parameter storage against rounded fp32 weights, and
// bad input against loom::error.
#include "grad_check.hpp"

#include <support/sgemm_kernels.hpp>

#include <loom/core/buffer.hpp>
#include <loom/core/thread_pool.hpp>
#include <loom/ops/host/activation.hpp>
#include <loom/ops/host/attention.hpp>
#include <loom/ops/host/cross_entropy.hpp>
#include <loom/ops/host/embedding.hpp>
#include <loom/ops/host/fill.hpp>
#include <loom/ops/host/gemm.hpp>
#include <loom/ops/host/norm.hpp>
#include <loom/ops/host/packed_weight.hpp>
#include <loom/ops/host/rope.hpp>
#include <loom/ops/host/softmax.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

using namespace loom;
using loom::test::check_gradient;
using loom::test::dot;
using loom::test::random_vector;
using vec = std::vector<double>;

namespace {
std::vector<float> to_float(const vec& v) { return {v.begin(), v.end()}; }
}  // namespace

TEST_CASE("ops::exp for float: within 3 ulp of std::exp on the range softmax uses") {
  for (int i = -8600; i <= 8800; ++i) {
    const float x = float(i) * 0.01f + 0.003f;
    const double ref = std::exp(double(x));
    CHECK(std::abs(double(ops::exp(x)) - ref) <= 3 * 1.2e-7 * ref);
  }
  CHECK(ops::exp(-1e30f) >= 0.f);
  CHECK(ops::exp(-1e30f) < 1e-37f);
}

TEST_CASE("ops::exp for float at the edges: clamped to [-87, 88.5], +inf above, NaN kept, the same bits in a vectorised loop") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(ops::exp(-0.0f) == 1.0f);
  CHECK(ops::exp(0.0f) == 1.0f);
  CHECK(ops::exp(-inf) == ops::exp(-87.0f));
  CHECK(ops::exp(-1000.0f) == ops::exp(-87.0f));
  CHECK(ops::exp(-87.0f) > 0.f);
  CHECK(std::abs(double(ops::exp(-87.0f)) - std::exp(-87.0)) <= 3 * 1.2e-7 * std::exp(-87.0));
  CHECK(ops::exp(inf) == ops::exp(88.5f));
  CHECK(ops::exp(1e30f) == ops::exp(88.5f));
  CHECK(ops::exp(inf) == inf);  // 2^128 from x = 88.38 on (expf from 88.72)
  CHECK(std::isfinite(ops::exp(88.0f)));
  CHECK(std::isnan(ops::exp(nan)));
  CHECK(std::isnan(ops::exp(-nan)));
  // The kernels call exp inside loops the compiler vectorises; the lanes must give what the
  // scalar call gives, edges included (a vectorised clamp or NaN test that differed from the
  // scalar one would show here).
  std::vector<float> x;
  for (int i = -9000; i <= 9000; i += 7) x.push_back(float(i) * 0.0137f);
  for (float e : {-inf, inf, nan, -nan, -0.0f, 0.0f, -87.0f, 88.5f, -87.00001f, 88.50001f, 1e30f, -1e30f}) x.push_back(e);
  std::vector<float> vec_out(x.size());
  const float* px = x.data();
  float* po = vec_out.data();
  const auto n = static_cast<index_t>(x.size());
  LOOM_SIMD
  for (index_t i = 0; i < n; ++i) po[i] = ops::exp(px[i]);
  for (index_t i = 0; i < n; ++i) {
    volatile float xi = px[i];  // volatile: this call is not vectorised
    const float s = ops::exp(static_cast<float>(xi));
    CAPTURE(px[i]);
    if (std::isnan(s)) CHECK(std::isnan(po[i]));
    else CHECK(std::bit_cast<std::uint32_t>(po[i]) == std::bit_cast<std::uint32_t>(s));
  }
}

TEST_CASE("gemm: plain, transposed and strided operands against a naive product") {
  const index_t m = 5, k = 7, n = 3;
  auto a = to_float(random_vector(m * k * 2, 1)), b = to_float(random_vector(k * n * 2, 2));
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      // A stored as [m, 2k] (take the first k columns) or as [k, m] transposed
      tensor_view<const float, host, 2> av = ta ? make_view(a.data(), k, m).transpose(0, 1)
                                               : make_view(a.data(), m, 2 * k).slice(1, 0, k);
      tensor_view<const float, host, 2> bv = tb ? make_view(b.data(), n, k).transpose(0, 1) : make_view(b.data(), k, n);
      std::vector<float> c(m * n, 1.f);
      ops::gemm(host{}, av, bv, make_view(c.data(), m, n), 2.f, 0.5f);
      for (index_t i = 0; i < m; ++i)
        for (index_t j = 0; j < n; ++j) {
          double s = 0;
          for (index_t p = 0; p < k; ++p) s += double(av(i, p)) * double(bv(p, j));
          CHECK(c[i * n + j] == doctest::Approx(2 * s + 0.5).epsilon(1e-5));
        }
    }
  std::vector<float> c(m * m);
  CHECK_THROWS_AS(ops::gemm(host{}, make_view(a.data(), m, k), make_view(b.data(), m, k), make_view(c.data(), m, m)),
                  loom::error);
}

TEST_CASE("gemm split over the pool (by rows, by columns) against a naive product; loom's kernels: same bits on 1 and 3 threads") {
  // [m, n, k]: 300 rows make 3 row parts on 3 threads; 10 rows are one tile, so the 2200
  // columns are split instead; 40 x 40 x 40 is too small to split at all.
  const index_t shapes[][3] = {{300, 96, 300}, {10, 2200, 300}, {40, 40, 40}};
  loom::test::for_each_sgemm_kernel("gemm split over the pool", [&](ops::host_sgemm kernel) {
    for (const auto& sh : shapes) {
      const index_t m = sh[0], n = sh[1], k = sh[2];
      auto a = to_float(random_vector(m * k, 51)), b = to_float(random_vector(k * n, 52));
      const auto c0 = to_float(random_vector(m * (n + 3), 53));
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb) {
          INFO("m=", m, " n=", n, " k=", k, " ta=", ta, " tb=", tb);
          tensor_view<const float, host, 2> av = ta ? make_view(a.data(), k, m).transpose(0, 1) : make_view(a.data(), m, k);
          tensor_view<const float, host, 2> bv = tb ? make_view(b.data(), n, k).transpose(0, 1) : make_view(b.data(), k, n);
          auto product = [&](int threads) {  // C is [m, n] inside rows of n + 3 floats
            loom::thread_pool pool(threads);
            loom::host_pool_scope scope(pool);
            std::vector<float> c = c0;
            ops::gemm(host{}, av, bv, make_view(c.data(), m, n + 3).slice(1, 0, n), 1.5f, 0.5f);
            return c;
          };
          const auto c1 = product(1), c3 = product(3);
          if (loom::test::split_invariant(kernel)) CHECK(c1 == c3);  // BLAS: each within rounding (below)
          for (const auto* c : {&c1, &c3}) {
            int wrong = 0;
            for (index_t i = 0; i < m; ++i)
              for (index_t j = 0; j < n + 3; ++j) {
                const std::size_t at = static_cast<std::size_t>(i * (n + 3) + j);
                double want = c0[at];  // the 3 padding columns stay untouched
                if (j < n) {
                  double s = 0;
                  for (index_t p = 0; p < k; ++p) s += double(av(i, p)) * double(bv(p, j));
                  want = 1.5 * s + 0.5 * double(c0[at]);
                }
                wrong += !(std::abs(double((*c)[at]) - want) <= 1e-4 * (1 + std::abs(want)));
              }
            CHECK(wrong == 0);
          }
        }
    }
  });
}

TEST_CASE("gemm_batch: the same bits as gemm() on each product in turn; loom's kernels also on 3 threads; against a naive product") {
  // One batch as a layer group uses it: three products accumulating into one C (different K,
  // one with transposed B), two independent ones (one with 10 rows: split by columns), and a
  // product too small to split (runs whole in one part).
  const index_t n = 600, d = 128;  // each accumulating product splits 3 ways (>= 3 x 2^21 multiply-adds)
  const index_t ks[3] = {256, 128, 128};
  std::vector<std::vector<float>> A, B;
  for (int i = 0; i < 3; ++i) {
    A.push_back(to_float(random_vector(n * ks[i], 60 + i)));
    B.push_back(to_float(random_vector(ks[i] * d, 70 + i)));
  }
  const auto a4 = to_float(random_vector(10 * 300, 80)), b4 = to_float(random_vector(300 * 2200, 81));
  const auto a5 = to_float(random_vector(20 * 8, 82)), b5 = to_float(random_vector(8 * 12, 83));
  const auto c0 = to_float(random_vector(n * d, 84)), c40 = to_float(random_vector(10 * 2200, 85));
  auto run = [&](int threads, bool batched) {
    loom::thread_pool pool(threads);
    loom::host_pool_scope scope(pool);
    std::vector<float> c = c0, c4 = c40, c5(20 * 12, 0.f);
    std::vector<ops::gemm_op<float>> list;
    for (int i = 0; i < 3; ++i) {
      tensor_view<const float, host, 2> bv = i == 1 ? make_view(B[1].data(), d, ks[1]).transpose(0, 1)
                                                    : make_view(B[i].data(), ks[i], d);
      list.push_back({make_view(A[i].data(), n, ks[i]), bv, make_view(c.data(), n, d), 1.f, 1.f});
    }
    list.push_back({make_view(a4.data(), 10, 300), make_view(b4.data(), 300, 2200), make_view(c4.data(), 10, 2200), 2.f, 0.5f});
    list.push_back({make_view(a5.data(), 20, 8), make_view(b5.data(), 8, 12), make_view(c5.data(), 20, 12)});
    if (batched) {
      ops::gemm_batch(host{}, std::span<const ops::gemm_op<float>>(list));
    } else {
      for (const auto& g : list) ops::gemm(host{}, g.a, g.b, g.c, g.alpha, g.beta);
    }
    return std::tuple{c, c4, c5};
  };
  loom::test::for_each_sgemm_kernel("gemm_batch", [&](ops::host_sgemm kernel) {
    const auto seq = run(1, false), one = run(1, true), three = run(3, true), seq3 = run(3, false);
    CHECK(one == seq);
    if (loom::test::split_invariant(kernel)) {  // BLAS's bits depend on the split
      CHECK(three == seq);
      CHECK(seq3 == seq);
    }
    // the accumulated C against a naive sum of the three products
    const auto& c = std::get<0>(three);
    int wrong = 0;
    for (index_t r = 0; r < n; ++r)
      for (index_t j = 0; j < d; ++j) {
        double want = c0[static_cast<std::size_t>(r * d + j)];
        for (int i = 0; i < 3; ++i)
          for (index_t p = 0; p < ks[i]; ++p) {
            const double bij = i == 1 ? B[1][static_cast<std::size_t>(j * ks[1] + p)] : B[i][static_cast<std::size_t>(p * d + j)];
            want += double(A[i][static_cast<std::size_t>(r * ks[i] + p)]) * bij;
          }
        wrong += std::abs(double(c[static_cast<std::size_t>(r * d + j)]) - want) > 1e-4 * (1 + std::abs(want));
      }
    CHECK(wrong == 0);
  });
  std::vector<float> bad(4 * 4);
  const ops::gemm_op<float> mismatch{make_view(a5.data(), 20, 8), make_view(b5.data(), 12, 8), make_view(bad.data(), 4, 4)};
  CHECK_THROWS_WITH_AS(ops::gemm_batch(host{}, {mismatch}), doctest::Contains("inner dimensions differ"), loom::error);
}

TEST_CASE("rmsnorm: forward against the formula, backward against finite differences") {
  const index_t n = 3, d = 8;
  vec x = random_vector(n * d, 3), w = random_vector(d, 4), r = random_vector(n * d, 5);
  vec y(n * d), rstd(n);
  auto fwd = [&] {
    ops::rmsnorm_forward(host{}, make_view(x.data(), n, d), make_view(w.data(), d), make_view(y.data(), n, d),
                         make_view(rstd.data(), n), 1e-5);
    return dot(r, y);
  };
  fwd();
  for (index_t i = 0; i < n; ++i) {
    double ss = 0;
    for (index_t j = 0; j < d; ++j) ss += x[i * d + j] * x[i * d + j];
    for (index_t j = 0; j < d; ++j)
      CHECK(y[i * d + j] == doctest::Approx(x[i * d + j] / std::sqrt(ss / d + 1e-5) * w[j]).epsilon(1e-12));
  }
  vec dx(n * d, 0.0), dw(d, 0.0);
  ops::rmsnorm_backward(host{}, make_view(r.data(), n, d), make_view(x.data(), n, d), make_view(w.data(), d),
                        make_view(rstd.data(), n), make_view(dx.data(), n, d), make_view(dw.data(), d));
  check_gradient(x, dx, fwd, "dx");
  check_gradient(w, dw, fwd, "dw");
  // an empty dw (frozen weight): the same dx, bit for bit
  vec dx_frozen(n * d, 0.0);
  ops::rmsnorm_backward(host{}, make_view(r.data(), n, d), make_view(x.data(), n, d), make_view(w.data(), d),
                        make_view(rstd.data(), n), make_view(dx_frozen.data(), n, d), tensor_view<double, host, 1>{});
  CHECK(dx_frozen == dx);

  // bfloat16 weights compute like float weights rounded to bfloat16
  std::vector<float> xf = to_float(x), yf(n * d), yb(n * d), rs(n);
  std::vector<loom::bfloat16> wb(w.begin(), w.end());
  std::vector<float> wr(wb.begin(), wb.end());
  ops::rmsnorm_forward(host{}, make_view(xf.data(), n, d), make_view(wb.data(), d), make_view(yb.data(), n, d),
                       make_view(rs.data(), n), 1e-5f);
  ops::rmsnorm_forward(host{}, make_view(xf.data(), n, d), make_view(wr.data(), d), make_view(yf.data(), n, d),
                       make_view(rs.data(), n), 1e-5f);
  CHECK(yb == yf);
  CHECK_THROWS_AS(ops::rmsnorm_forward(host{}, make_view(x.data(), n, d), make_view(w.data(), d - 1),
                                       make_view(y.data(), n, d), make_view(rstd.data(), n), 1e-5),
                  loom::error);
}

TEST_CASE("layernorm: forward against the formula, backward against finite differences") {
  const index_t n = 3, d = 6;
  vec x = random_vector(n * d, 6), w = random_vector(d, 7), b = random_vector(d, 8), r = random_vector(n * d, 9);
  vec y(n * d), mean(n), rstd(n);
  auto fwd = [&] {
    ops::layernorm_forward(host{}, make_view(x.data(), n, d), make_view(w.data(), d), make_view(b.data(), d),
                           make_view(y.data(), n, d), make_view(mean.data(), n), make_view(rstd.data(), n), 1e-5);
    return dot(r, y);
  };
  fwd();
  for (index_t i = 0; i < n; ++i) {
    double mu = 0, var = 0;
    for (index_t j = 0; j < d; ++j) mu += x[i * d + j] / d;
    for (index_t j = 0; j < d; ++j) var += (x[i * d + j] - mu) * (x[i * d + j] - mu) / d;
    for (index_t j = 0; j < d; ++j)
      CHECK(y[i * d + j] == doctest::Approx((x[i * d + j] - mu) / std::sqrt(var + 1e-5) * w[j] + b[j]).epsilon(1e-12));
  }
  vec dx(n * d, 0.0), dw(d, 0.0), db(d, 0.0);
  ops::layernorm_backward(host{}, make_view(r.data(), n, d), make_view(x.data(), n, d), make_view(w.data(), d),
                          make_view(mean.data(), n), make_view(rstd.data(), n), make_view(dx.data(), n, d),
                          make_view(dw.data(), d), make_view(db.data(), d));
  check_gradient(x, dx, fwd, "dx");
  check_gradient(w, dw, fwd, "dw");
  check_gradient(b, db, fwd, "db");
  // dw and db empty (frozen weight and bias): the same dx, bit for bit; one of them alone is refused
  vec dx_frozen(n * d, 0.0);
  const auto frozen_backward = [&](tensor_view<double, host, 1> gw, tensor_view<double, host, 1> gb) {
    ops::layernorm_backward(host{}, make_view(r.data(), n, d), make_view(x.data(), n, d), make_view(w.data(), d),
                            make_view(mean.data(), n), make_view(rstd.data(), n), make_view(dx_frozen.data(), n, d), gw, gb);
  };
  frozen_backward({}, {});
  CHECK(dx_frozen == dx);
  CHECK_THROWS_AS(frozen_backward({}, make_view(db.data(), d)), loom::error);
}

TEST_CASE("rope: both conventions against complex rotation, backward inverts forward") {
  const index_t b = 2, s = 5, h = 3, hd = 8;
  const double theta = 10000.0;
  ops::rope_table<double> table(16, hd, theta);
  vec x0 = random_vector(b * s * h * hd, 10);
  for (auto style : {ops::rope_style::interleaved, ops::rope_style::half_split}) {
    vec x = x0;
    const index_t pos0 = 3;
    ops::rope_forward(host{}, make_view(x.data(), b, s, h, hd), table, style, pos0);
    for (index_t bi = 0; bi < b; ++bi)
      for (index_t t = 0; t < s; ++t)
        for (index_t hi = 0; hi < h; ++hi)
          for (index_t i = 0; i < hd / 2; ++i) {
            const index_t base = ((bi * s + t) * h + hi) * hd;
            const index_t i0 = style == ops::rope_style::interleaved ? base + 2 * i : base + i;
            const index_t i1 = style == ops::rope_style::interleaved ? base + 2 * i + 1 : base + i + hd / 2;
            const double ang = double(pos0 + t) / std::pow(theta, double(2 * i) / double(hd));
            // (x0 + i x1) * e^{i ang}
            CHECK(x[i0] == doctest::Approx(x0[i0] * std::cos(ang) - x0[i1] * std::sin(ang)).epsilon(1e-12));
            CHECK(x[i1] == doctest::Approx(x0[i0] * std::sin(ang) + x0[i1] * std::cos(ang)).epsilon(1e-12));
          }
    // backward of a rotation is the inverse rotation: it maps the rotated x back to x
    ops::rope_backward(host{}, make_view(x.data(), b, s, h, hd), table, style, pos0);
    for (std::size_t i = 0; i < x.size(); ++i) CHECK(x[i] == doctest::Approx(x0[i]).epsilon(1e-12));
  }
  vec x = x0;
  CHECK_THROWS_AS(ops::rope_forward(host{}, make_view(x.data(), b, s, h, hd), table, ops::rope_style::interleaved, 12),
                  loom::error);
  CHECK_THROWS_AS(ops::rope_table<float>(8, 7, 1e4), loom::error);
}

TEST_CASE("rope on part of each head (rotary_dim < head_dim, ChatGLM's half): the leading channels rotate, the rest pass through") {
  const index_t b = 2, s = 4, h = 3, hd = 12, rot = 4;
  const double theta = 15000.0;
  ops::rope_table<double> table(8, hd, theta, rot);
  const vec x0 = random_vector(b * s * h * hd, 13);
  const std::vector<std::int64_t> pos{2, 7, 0, 5, 1, 3, 6, 4};
  for (auto style : {ops::rope_style::interleaved, ops::rope_style::half_split}) {
    vec x = x0, y = x0;
    const index_t pos0 = 2;
    ops::rope_forward(host{}, make_view(x.data(), b, s, h, hd), table, style, pos0);
    ops::rope_forward(host{}, make_view(y.data(), b * s, h, hd), table, style, std::span<const std::int64_t>(pos));
    for (index_t row = 0; row < b * s; ++row)
      for (index_t hi = 0; hi < h; ++hi) {
        const index_t base = (row * h + hi) * hd;
        for (index_t c = rot; c < hd; ++c) {  // past rotary_dim: untouched
          CHECK(x[base + c] == x0[base + c]);
          CHECK(y[base + c] == x0[base + c]);
        }
        for (index_t i = 0; i < rot / 2; ++i) {  // pairs within the first rot channels, f_i = theta^(-2i/rot)
          const index_t i0 = style == ops::rope_style::interleaved ? base + 2 * i : base + i;
          const index_t i1 = style == ops::rope_style::interleaved ? base + 2 * i + 1 : base + i + rot / 2;
          const double f = 1.0 / std::pow(theta, double(2 * i) / double(rot));
          for (auto [out, p] : {std::pair{&x, double(pos0 + row % s)}, std::pair{&y, double(pos[std::size_t(row)])}}) {
            CHECK((*out)[i0] == doctest::Approx(x0[i0] * std::cos(p * f) - x0[i1] * std::sin(p * f)).epsilon(1e-12));
            CHECK((*out)[i1] == doctest::Approx(x0[i0] * std::sin(p * f) + x0[i1] * std::cos(p * f)).epsilon(1e-12));
          }
        }
      }
    ops::rope_backward(host{}, make_view(x.data(), b, s, h, hd), table, style, pos0);
    for (std::size_t i = 0; i < x.size(); ++i) CHECK(x[i] == doctest::Approx(x0[i]).epsilon(1e-12));
  }
  CHECK_THROWS_WITH_AS(ops::rope_table<float>(8, 12, 1e4, 6 + 8), doctest::Contains("rotary_dim must be even and in (0, head_dim=12], got rotary_dim=14"),
                       loom::error);
  CHECK_THROWS_AS(ops::rope_table<float>(8, 12, 1e4, 3), loom::error);
}

TEST_CASE("rope with per-token positions (ragged inference batches) against complex rotation; a position past the table is a loom::error") {
  const index_t n = 7, h = 3, hd = 8;
  const double theta = 500000.0;
  ops::rope_table<double> table(64, hd, theta);
  const std::vector<std::int64_t> pos{0, 5, 63, 5, 17, 1, 40};
  const vec x0 = random_vector(n * h * hd, 12);
  for (auto style : {ops::rope_style::interleaved, ops::rope_style::half_split}) {
    vec x = x0;
    ops::rope_forward(host{}, make_view(x.data(), n, h, hd), table, style, std::span<const std::int64_t>(pos));
    for (index_t t = 0; t < n; ++t)
      for (index_t hi = 0; hi < h; ++hi)
        for (index_t i = 0; i < hd / 2; ++i) {
          const index_t base = (t * h + hi) * hd;
          const index_t i0 = style == ops::rope_style::interleaved ? base + 2 * i : base + i;
          const index_t i1 = style == ops::rope_style::interleaved ? base + 2 * i + 1 : base + i + hd / 2;
          const double ang = double(pos[std::size_t(t)]) / std::pow(theta, double(2 * i) / double(hd));
          CHECK(x[i0] == doctest::Approx(x0[i0] * std::cos(ang) - x0[i1] * std::sin(ang)).epsilon(1e-12));
          CHECK(x[i1] == doctest::Approx(x0[i0] * std::sin(ang) + x0[i1] * std::cos(ang)).epsilon(1e-12));
        }
  }
  vec x = x0;
  const std::vector<std::int64_t> bad{0, 1, 2, 64, 0, 0, 0};
  CHECK_THROWS_WITH_AS(ops::rope_forward(host{}, make_view(x.data(), n, h, hd), table, ops::rope_style::interleaved,
                                         std::span<const std::int64_t>(bad)),
                       doctest::Contains("token 3 has position 64"), loom::error);
}

TEST_CASE("softmax: forward against exp/sum, backward against finite differences") {
  const index_t n = 4, d = 7;
  vec x = random_vector(n * d, 11, 3.0), r = random_vector(n * d, 12), y(n * d);
  auto fwd = [&] {
    ops::softmax_forward(host{}, make_view(x.data(), n, d), make_view(y.data(), n, d));
    return dot(r, y);
  };
  fwd();
  for (index_t i = 0; i < n; ++i) {
    double z = 0;
    for (index_t j = 0; j < d; ++j) z += std::exp(x[i * d + j]);
    for (index_t j = 0; j < d; ++j) CHECK(y[i * d + j] == doctest::Approx(std::exp(x[i * d + j]) / z).epsilon(1e-12));
  }
  vec dx(n * d, 0.0);
  ops::softmax_backward(host{}, make_view(y.data(), n, d), make_view(r.data(), n, d), make_view(dx.data(), n, d));
  check_gradient(x, dx, fwd, "dx");
}

namespace {
TEST_CASE("attention's column softmax: each query's keys under the mask, hidden ones exactly 0, float") {
  // A tile of rt queries starting at r0 over vis keys, stored transposed ([key][query], row
  // stride ld > rt); oracle: a double softmax over the keys each query sees (causal, or
  // prefix-LM: the first `prefix` positions see each other).
  struct cfg { index_t seq, r0, rt, prefix; };
  for (const cfg c : {cfg{5, 0, 5, 0}, cfg{70, 64, 6, 0}, cfg{128, 0, 64, 0}, cfg{128, 64, 64, 0}, cfg{70, 0, 64, 66},
                      cfg{70, 64, 6, 66}, cfg{5, 0, 5, 3}}) {
    CAPTURE(c.seq);
    CAPTURE(c.r0);
    CAPTURE(c.rt);
    CAPTURE(c.prefix);
    const ops::attention_mask mask{c.prefix};
    const index_t vis = mask.visible(c.r0 + c.rt - 1, c.seq), ld = c.rt + 3;
    std::vector<float> pt(static_cast<std::size_t>(vis * ld));
    for (std::size_t i = 0; i < pt.size(); ++i) pt[i] = static_cast<float>(std::sin(0.37 * double(i)) * 9.0);
    const std::vector<float> in = pt;
    ops::detail::softmax_columns(pt.data(), ld, vis, c.rt, mask, c.seq, c.r0);
    for (index_t r = 0; r < c.rt; ++r) {
      const index_t n = mask.visible(c.r0 + r, c.seq);  // keys [0, n) visible to this query
      double mx = in[static_cast<std::size_t>(r)], z = 0;
      for (index_t j = 0; j < n; ++j) mx = std::max(mx, double(in[static_cast<std::size_t>(j * ld + r)]));
      for (index_t j = 0; j < n; ++j) z += std::exp(double(in[static_cast<std::size_t>(j * ld + r)]) - mx);
      for (index_t j = 0; j < vis; ++j) {
        const float got = pt[static_cast<std::size_t>(j * ld + r)];
        if (j < n)
          CHECK(got == doctest::Approx(std::exp(double(in[static_cast<std::size_t>(j * ld + r)]) - mx) / z).epsilon(1e-5));
        else
          CHECK(got == 0.f);
      }
    }
    for (index_t j = 0; j < vis; ++j)  // the columns past the tile are not touched
      for (index_t r = c.rt; r < ld; ++r) CHECK(pt[static_cast<std::size_t>(j * ld + r)] == in[static_cast<std::size_t>(j * ld + r)]);
  }
}

// Naive attention: per query position, scores over allowed keys, softmax, weighted sum.
vec naive_attention(const vec& q, const vec& k, const vec& v, index_t b, index_t s, index_t h, index_t kvh, index_t hd,
                    index_t prefix) {
  vec out(b * s * h * hd, 0.0);
  for (index_t bi = 0; bi < b; ++bi)
    for (index_t hi = 0; hi < h; ++hi) {
      const index_t g = hi / (h / kvh);
      for (index_t t = 0; t < s; ++t) {
        std::vector<double> sc;
        for (index_t j = 0; j < s; ++j) {
          const bool allowed = j <= t || (t < prefix && j < prefix);
          if (!allowed) { sc.push_back(-INFINITY); continue; }
          double dotp = 0;
          for (index_t c = 0; c < hd; ++c)
            dotp += q[((bi * s + t) * h + hi) * hd + c] * k[((bi * s + j) * kvh + g) * hd + c];
          sc.push_back(dotp / std::sqrt(double(hd)));
        }
        const double mx = *std::max_element(sc.begin(), sc.end());
        double z = 0;
        for (auto& e : sc) z += (e = std::exp(e - mx));
        for (index_t j = 0; j < s; ++j)
          for (index_t c = 0; c < hd; ++c)
            out[((bi * s + t) * h + hi) * hd + c] += sc[j] / z * v[((bi * s + j) * kvh + g) * hd + c];
      }
    }
  return out;
}
}  // namespace

TEST_CASE("attention: GQA/MQA, causal and prefix-LM, forward against a naive loop, backward by finite differences") {
  const index_t hd = 4;
  struct cfg { index_t b, s, h, kvh, prefix; };
  // s = 70 crosses a query tile (ops::attention_tile = 64): the second tile sees more keys
  for (cfg c : {cfg{2, 5, 4, 2, 0}, cfg{2, 5, 4, 1, 0}, cfg{2, 5, 2, 2, 3}, cfg{1, 70, 2, 1, 0}, cfg{1, 70, 2, 1, 66}}) {
    const index_t b = c.b, s = c.s;
    const std::size_t step = s > 10 ? 7 : 1;
    CAPTURE(c.h);
    CAPTURE(c.kvh);
    CAPTURE(c.prefix);
    CAPTURE(s);
    vec q = random_vector(b * s * c.h * hd, 13), k = random_vector(b * s * c.kvh * hd, 14),
        v = random_vector(b * s * c.kvh * hd, 15), r = random_vector(b * s * c.h * hd, 16);
    vec out(q.size()), probs(b * c.h * s * s), scratch(s * s);
    const ops::attention_mask mask{c.prefix};
    auto fwd = [&] {
      ops::attention_forward(host{}, make_view(q.data(), b, s, c.h, hd), make_view(k.data(), b, s, c.kvh, hd),
                             make_view(v.data(), b, s, c.kvh, hd), make_view(out.data(), b, s, c.h, hd),
                             make_view(probs.data(), b, c.h, s, s), mask);
      return dot(r, out);
    };
    fwd();
    const vec ref = naive_attention(q, k, v, b, s, c.h, c.kvh, hd, c.prefix);
    for (std::size_t i = 0; i < ref.size(); ++i) CHECK(out[i] == doctest::Approx(ref[i]).epsilon(1e-12));
    vec dq(q.size(), 0.0), dk(k.size(), 0.0), dv(v.size(), 0.0);
    ops::attention_backward(host{}, make_view(r.data(), b, s, c.h, hd), make_view(q.data(), b, s, c.h, hd),
                            make_view(k.data(), b, s, c.kvh, hd), make_view(v.data(), b, s, c.kvh, hd),
                            make_view(probs.data(), b, c.h, s, s), make_view(dq.data(), b, s, c.h, hd),
                            make_view(dk.data(), b, s, c.kvh, hd), make_view(dv.data(), b, s, c.kvh, hd),
                            make_view(scratch.data(), s, s), mask);
    check_gradient(q, dq, fwd, "dq", 1e-6, step);
    check_gradient(k, dk, fwd, "dk", 1e-6, step);
    check_gradient(v, dv, fwd, "dv", 1e-6, step);
  }
  vec q(2 * 3 * 3 * 4), k(2 * 3 * 2 * 4), out(q.size()), probs(2 * 3 * 3 * 3);
  CHECK_THROWS_AS(ops::attention_forward(host{}, make_view(q.data(), 2, 3, 3, 4), make_view(k.data(), 2, 3, 2, 4),
                                         make_view(k.data(), 2, 3, 2, 4), make_view(out.data(), 2, 3, 3, 4),
                                         make_view(probs.data(), 2, 3, 3, 3)),
                  loom::error);
}

TEST_CASE("attention in float on every sgemm kernel: forward against the naive loop, backward against the double kernel") {
  // The float path's GEMMs run on the kernel set (transposed A and B: S^T = K Q^T, O = (P^T)^T V,
  // dQ = (dS^T)^T K); s = 1024 puts P^T's rows 4 KiB apart (the kernels' aliased-row paths).
  // Oracles: naive_attention in double for the output; for the gradients, the double kernel,
  // which the test above checks by finite differences.
  const index_t hd = 8;
  struct cfg { index_t b, s, h, kvh, prefix; };
  loom::test::for_each_sgemm_kernel("float attention", [&](ops::host_sgemm) {
    for (cfg c : {cfg{2, 70, 4, 2, 0}, cfg{1, 70, 2, 1, 66}, cfg{1, 1024, 2, 1, 0}}) {
      CAPTURE(c.s);
      CAPTURE(c.prefix);
      const index_t b = c.b, s = c.s;
      const ops::attention_mask mask{c.prefix};
      const vec q = random_vector(b * s * c.h * hd, 23), k = random_vector(b * s * c.kvh * hd, 24),
                v = random_vector(b * s * c.kvh * hd, 25), r = random_vector(b * s * c.h * hd, 26);
      // out and (dq, dk, dv) of attention in element type E (inputs converted from double)
      auto run = [&]<class E>(E) {
        const std::vector<E> qe(q.begin(), q.end()), ke(k.begin(), k.end()), ve(v.begin(), v.end()), re(r.begin(), r.end());
        std::vector<E> o(q.size()), probs(static_cast<std::size_t>(b * c.h * s * s)), sc(static_cast<std::size_t>(s * s));
        std::vector<E> dq(q.size(), E(0)), dk(k.size(), E(0)), dv(v.size(), E(0));
        ops::attention_forward(host{}, make_view(qe.data(), b, s, c.h, hd), make_view(ke.data(), b, s, c.kvh, hd),
                               make_view(ve.data(), b, s, c.kvh, hd), make_view(o.data(), b, s, c.h, hd),
                               make_view(probs.data(), b, c.h, s, s), mask);
        ops::attention_backward(host{}, make_view(re.data(), b, s, c.h, hd), make_view(qe.data(), b, s, c.h, hd),
                                make_view(ke.data(), b, s, c.kvh, hd), make_view(ve.data(), b, s, c.kvh, hd),
                                make_view(probs.data(), b, c.h, s, s), make_view(dq.data(), b, s, c.h, hd),
                                make_view(dk.data(), b, s, c.kvh, hd), make_view(dv.data(), b, s, c.kvh, hd),
                                make_view(sc.data(), s, s), mask);
        return std::tuple{o, dq, dk, dv};
      };
      const auto [out, dq, dk, dv] = run(0.f);
      const auto [outd, dqd, dkd, dvd] = run(0.0);
      const vec ref = naive_attention(q, k, v, b, s, c.h, c.kvh, hd, c.prefix);
      int wrong = 0;
      for (std::size_t i = 0; i < ref.size(); ++i) wrong += out[i] != doctest::Approx(ref[i]).epsilon(1e-4);
      for (std::size_t i = 0; i < dq.size(); ++i) wrong += dq[i] != doctest::Approx(dqd[i]).epsilon(1e-4);
      for (std::size_t i = 0; i < dk.size(); ++i) wrong += dk[i] != doctest::Approx(dkd[i]).epsilon(1e-4);
      for (std::size_t i = 0; i < dv.size(); ++i) wrong += dv[i] != doctest::Approx(dvd[i]).epsilon(1e-4);
      CHECK(wrong == 0);
    }
  });
}

TEST_CASE("swiglu and gelu: forward against closed forms, backward against finite differences") {
  const index_t n = 33;
  vec a = random_vector(n, 17, 2.0), bb = random_vector(n, 18), r = random_vector(n, 19), y(n);
  auto fwd = [&] {
    ops::swiglu_forward(host{}, make_view(a.data(), n), make_view(bb.data(), n), make_view(y.data(), n));
    return dot(r, y);
  };
  fwd();
  for (index_t i = 0; i < n; ++i) CHECK(y[i] == doctest::Approx(a[i] * bb[i] / (1 + std::exp(-a[i]))).epsilon(1e-12));
  vec da(n, 0.0), db(n, 0.0);
  ops::swiglu_backward(host{}, make_view(r.data(), n), make_view(a.data(), n), make_view(bb.data(), n),
                       make_view(da.data(), n), make_view(db.data(), n));
  check_gradient(a, da, fwd, "da");
  check_gradient(bb, db, fwd, "db");
  // accumulate = false writes the same gradients over whatever was there (NaN included).
  vec da2(n, std::nan("")), db2(n, std::nan(""));
  ops::swiglu_backward(host{}, make_view(r.data(), n), make_view(a.data(), n), make_view(bb.data(), n),
                       make_view(da2.data(), n), make_view(db2.data(), n), /*accumulate=*/false);
  for (index_t i = 0; i < n; ++i) {
    CHECK(da2[i] == doctest::Approx(da[i]).epsilon(1e-14));
    CHECK(db2[i] == doctest::Approx(db[i]).epsilon(1e-14));
  }

  for (auto approx : {ops::gelu_approx::none, ops::gelu_approx::tanh}) {
    auto g = [&] {
      ops::gelu_forward(host{}, make_view(a.data(), n), make_view(y.data(), n), approx);
      return dot(r, y);
    };
    g();
    for (index_t i = 0; i < n; ++i) {
      const double x = a[i];
      const double ref = approx == ops::gelu_approx::none
                             ? x * 0.5 * std::erfc(-x / std::sqrt(2.0))
                             : 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
      CHECK(y[i] == doctest::Approx(ref).epsilon(1e-12));
    }
    vec dx(n, 0.0);
    ops::gelu_backward(host{}, make_view(r.data(), n), make_view(a.data(), n), make_view(dx.data(), n), approx);
    check_gradient(a, dx, g, "gelu dx");
  }
}

TEST_CASE("add: y += x element by element on 1 and 3 threads; mismatched lengths are a loom::error") {
  const index_t n = 200003;  // several pool parts, an odd tail
  const auto x = to_float(random_vector(n, 41)), y0 = to_float(random_vector(n, 42));
  for (int threads : {1, 3}) {
    loom::thread_pool pool(threads);
    loom::host_pool_scope scope(pool);
    auto y = y0;
    ops::add(host{}, make_view(y.data(), n), make_view(x.data(), n));
    int wrong = 0;
    for (index_t i = 0; i < n; ++i) wrong += y[static_cast<std::size_t>(i)] != y0[static_cast<std::size_t>(i)] + x[static_cast<std::size_t>(i)];
    CHECK(wrong == 0);
  }
  auto y = y0;
  CHECK_THROWS_WITH_AS(ops::add(host{}, make_view(y.data(), n - 1), make_view(x.data(), n)), doctest::Contains("x has"), loom::error);
}

TEST_CASE("embedding: gather, scatter-add, and a token outside the vocabulary") {
  const index_t v = 5, d = 3;
  std::vector<std::int32_t> tok{4, 0, 4, 2};
  std::vector<half> table(v * d);
  for (index_t i = 0; i < v * d; ++i) table[i] = half(0.25f * float(i));
  std::vector<float> out(4 * d);
  ops::embedding_forward(host{}, make_view(tok.data(), 4), make_view(table.data(), v, d), make_view(out.data(), 4, d));
  for (index_t i = 0; i < 4; ++i)
    for (index_t j = 0; j < d; ++j) CHECK(out[i * d + j] == 0.25f * float(tok[i] * d + j));
  std::vector<float> dout(4 * d), dtab(v * d, 0.f);
  for (index_t i = 0; i < 4 * d; ++i) dout[i] = float(i + 1);
  ops::embedding_backward(host{}, make_view(tok.data(), 4), make_view(dout.data(), 4, d), make_view(dtab.data(), v, d));
  for (index_t j = 0; j < d; ++j) {
    CHECK(dtab[4 * d + j] == dout[0 * d + j] + dout[2 * d + j]);
    CHECK(dtab[0 * d + j] == dout[1 * d + j]);
    CHECK(dtab[2 * d + j] == dout[3 * d + j]);
    CHECK(dtab[1 * d + j] == 0.f);
  }
  tok[1] = 5;
  try {
    ops::embedding_forward(host{}, make_view(tok.data(), 4), make_view(table.data(), v, d), make_view(out.data(), 4, d));
    FAIL("no error for token 5");
  } catch (const loom::error& e) {
    CHECK(std::string(e.what()).find("token id 5") != std::string::npos);
  }
}

TEST_CASE("cross-entropy: mean over non-ignored targets, backward by finite differences") {
  const index_t n = 5, v = 7;
  vec logits = random_vector(n * v, 20, 2.0), lse(n);
  std::vector<std::int32_t> tgt{3, -100, 0, 6, 2};
  auto fwd = [&] {
    return ops::cross_entropy_forward(host{}, make_view(logits.data(), n, v), make_view(tgt.data(), n),
                                      make_view(lse.data(), n));
  };
  const double loss = fwd();
  double ref = 0;
  for (index_t i = 0; i < n; ++i) {
    if (tgt[i] < 0) continue;
    double z = 0;
    for (index_t j = 0; j < v; ++j) z += std::exp(logits[i * v + j]);
    ref += -std::log(std::exp(logits[i * v + tgt[i]]) / z) / 4;
  }
  CHECK(loss == doctest::Approx(ref).epsilon(1e-12));
  vec dl(n * v, 0.0);
  ops::cross_entropy_backward(host{}, make_view(logits.data(), n, v), make_view(tgt.data(), n), make_view(lse.data(), n),
                              make_view(dl.data(), n, v));
  check_gradient(logits, dl, fwd, "dlogits");
  for (index_t j = 0; j < v; ++j) CHECK(dl[1 * v + j] == 0.0);  // the ignored row
  // accumulate = false overwrites whatever dlogits held: same values as adding into zeros.
  fwd();  // lse of the unperturbed logits again (check_gradient's last call perturbed them)
  vec over(n * v, 7.0);
  ops::cross_entropy_backward(host{}, make_view(logits.data(), n, v), make_view(tgt.data(), n), make_view(lse.data(), n),
                              make_view(over.data(), n, v), 1.0, {}, /*accumulate=*/false);
  for (std::size_t i = 0; i < dl.size(); ++i) CHECK(over[i] == doctest::Approx(dl[i]).epsilon(1e-14));  // libm vs vector exp
  // forward_backward: forward's loss and lse, and dlogits written whole (7s before), equal to
  // the finite-difference-checked gradient above.
  const double loss_now = fwd();
  vec lse2(n), fb(n * v, 7.0);
  const double loss2 = ops::cross_entropy_forward_backward(host{}, make_view(as_const(logits).data(), n, v),
                                                           make_view(tgt.data(), n), make_view(lse2.data(), n),
                                                           make_view(fb.data(), n, v));
  CHECK(loss2 == loss_now);
  CHECK(lse2 == lse);
  for (std::size_t i = 0; i < dl.size(); ++i) CHECK(fb[i] == doctest::Approx(dl[i]).epsilon(1e-14));
  tgt[2] = 7;
  try {
    fwd();
    FAIL("no error for target 7");
  } catch (const loom::error& e) {
    CHECK(std::string(e.what()).find("target 7") != std::string::npos);
  }
}

TEST_CASE("host kernels split over the pool give bit-identical results on 1 and 3 threads") {
  using fvec = std::vector<float>;
  // Sizes chosen so that every kernel splits into 3 parts on the 3-thread pool.
  auto run = [](loom::thread_pool& pool) {
    loom::host_pool_scope scope(pool);
    std::vector<fvec> out;
    {  // rmsnorm [600, 256]
      const index_t n = 600, d = 256;
      fvec x = to_float(random_vector(n * d, 31)), w = to_float(random_vector(d, 32)), dy = to_float(random_vector(n * d, 33));
      fvec y(n * d), rstd(n), dx(n * d, 0.f), dw(d, 0.f);
      ops::rmsnorm_forward(host{}, make_view(x.data(), n, d), make_view(w.data(), d), make_view(y.data(), n, d),
                           make_view(rstd.data(), n), 1e-5f);
      ops::rmsnorm_backward(host{}, make_view(dy.data(), n, d), make_view(x.data(), n, d), make_view(w.data(), d),
                            make_view(rstd.data(), n), make_view(dx.data(), n, d), make_view(dw.data(), d));
      out.insert(out.end(), {y, rstd, dx, dw});
    }
    {  // cross-entropy [96, 1024] with ignored rows
      const index_t n = 96, v = 1024;
      fvec logits = to_float(random_vector(n * v, 34, 3.0)), lse(n), dl(n * v);
      std::vector<std::int32_t> tgt(n);
      for (index_t i = 0; i < n; ++i) tgt[i] = i % 7 == 3 ? -100 : std::int32_t((i * 37) % v);
      const float loss = ops::cross_entropy_forward(host{}, make_view(logits.data(), n, v), make_view(tgt.data(), n),
                                                    make_view(lse.data(), n));
      ops::cross_entropy_backward(host{}, make_view(logits.data(), n, v), make_view(tgt.data(), n), make_view(lse.data(), n),
                                  make_view(dl.data(), n, v), 1.f, {}, false);
      fvec lse2(n), fb(n * v);
      const float loss2 = ops::cross_entropy_forward_backward(host{}, make_view(as_const(logits).data(), n, v),
                                                              make_view(tgt.data(), n), make_view(lse2.data(), n),
                                                              make_view(fb.data(), n, v));
      out.insert(out.end(), {fvec{loss}, lse, dl, fvec{loss2}, lse2, fb});
    }
    {  // swiglu over 150,000 elements
      const index_t n = 150000;
      fvec a = to_float(random_vector(n, 35, 3.0)), b = to_float(random_vector(n, 36)), dy = to_float(random_vector(n, 37));
      fvec y(n), da(n, 0.f), db(n, 0.f);
      ops::swiglu_forward(host{}, make_view(a.data(), n), make_view(b.data(), n), make_view(y.data(), n));
      ops::swiglu_backward(host{}, make_view(dy.data(), n), make_view(a.data(), n), make_view(b.data(), n),
                           make_view(da.data(), n), make_view(db.data(), n));
      out.insert(out.end(), {y, da, db});
    }
    {  // rope [2, 512, 4, 32], both conventions, forward then backward
      const index_t b = 2, s = 512, h = 4, hd = 32;
      ops::rope_table<float> table(s, hd, 10000.0);
      for (auto style : {ops::rope_style::interleaved, ops::rope_style::half_split}) {
        fvec x = to_float(random_vector(b * s * h * hd, 38));
        ops::rope_forward(host{}, make_view(x.data(), b, s, h, hd), table, style);
        out.push_back(x);
        ops::rope_backward(host{}, make_view(x.data(), b, s, h, hd), table, style);
        out.push_back(x);
      }
    }
    {  // attention, GQA: [2, 80, 4 heads / 2 kv heads, 16]
      const index_t b = 2, s = 80, h = 4, kvh = 2, hd = 16;
      fvec q = to_float(random_vector(b * s * h * hd, 39)), k = to_float(random_vector(b * s * kvh * hd, 40)),
           v = to_float(random_vector(b * s * kvh * hd, 41)), dout = to_float(random_vector(b * s * h * hd, 42));
      fvec o(q.size()), probs(b * h * s * s), dq(q.size(), 0.f), dk(k.size(), 0.f), dv(v.size(), 0.f), scratch(s * s);
      ops::attention_forward(host{}, make_view(q.data(), b, s, h, hd), make_view(k.data(), b, s, kvh, hd),
                             make_view(v.data(), b, s, kvh, hd), make_view(o.data(), b, s, h, hd),
                             make_view(probs.data(), b, h, s, s));
      ops::attention_backward(host{}, make_view(dout.data(), b, s, h, hd), make_view(q.data(), b, s, h, hd),
                              make_view(k.data(), b, s, kvh, hd), make_view(v.data(), b, s, kvh, hd),
                              make_view(probs.data(), b, h, s, s), make_view(dq.data(), b, s, h, hd),
                              make_view(dk.data(), b, s, kvh, hd), make_view(dv.data(), b, s, kvh, hd),
                              make_view(scratch.data(), s, s));
      out.insert(out.end(), {o, probs, dq, dk, dv});
    }
    return out;
  };
  loom::thread_pool one(1), three(3);
  const auto a = run(one), b = run(three);
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO("output ", i);
    CHECK(a[i] == b[i]);
  }
}

namespace {
/// The rule by which loom's sgemm kernels compute each element of C (ops/host/sgemm.hpp),
/// written as a plain scalar loop with std::fma: an independent oracle for their exact bits.
float sgemm_rule(const tensor_view<const float, host, 2>& a, const tensor_view<const float, host, 2>& b, index_t i,
                 index_t j, float alpha, float beta, float c) {
  const index_t k = a.extent(1);
  for (index_t k0 = 0; k0 < k; k0 += ops::detail::sgemm_kc) {
    float acc = 0.f;
    for (index_t p = k0; p < std::min(k, k0 + ops::detail::sgemm_kc); ++p) acc = std::fma(a(i, p), b(p, j), acc);
    const float beta_k = k0 == 0 ? beta : 1.f;
    c = beta_k == 0.f ? alpha * acc : std::fma(alpha, acc, beta_k * c);
  }
  return c;
}
}  // namespace

TEST_CASE("sgemm kernels (avx512, avx2, blas): every layout, edge sizes, alpha/beta against a naive product; loom's bit for bit against their rule") {
  // m and n around the kernels' tiles (12 x 32 and 6 x 16), k across their 512-deep blocks
  // (and k = 1024: rows 4 KiB apart, which the AVX-512 kernel reads in 8-row tiles: m = 7, 11,
  // 13, 37 end in shorter ones); C has 5 padding columns that must stay untouched; beta = 0
  // must not read C (NaN there). loom's kernels must give exactly the bits of sgemm_rule, so
  // they also give the same bits as each other.
#ifndef LOOM_TEST_SANITIZED
  const index_t ms[] = {1, 5, 6, 7, 11, 12, 13, 37}, ns[] = {1, 7, 8, 9, 15, 16, 17, 32, 33, 70},
                ks[] = {1, 8, 17, 513, 1024, 1100};
#else
  // Under ASan/UBSan (tests/ops/host/CMakeLists.txt) the naive oracle in double is most of the
  // run: one size on each side of every tile edge and block boundary, a third of the products.
  const index_t ms[] = {1, 6, 7, 13, 37}, ns[] = {1, 8, 9, 17, 33, 70}, ks[] = {1, 17, 1024, 1100};
#endif
  loom::test::for_each_sgemm_kernel("every layout and edge size", [&](ops::host_sgemm kernel) {
    int wrong = 0, not_rule = 0, cases = 0;
    for (const index_t m : ms)
      for (const index_t n : ns)
        for (const index_t k : ks)
          for (int layout = 0; layout < 4; ++layout)
            for (const float beta : {0.f, 0.75f}) {
              const bool ta = layout & 1, tb = layout & 2;
              const auto a = to_float(random_vector(m * k, 90 + m)), b = to_float(random_vector(k * n, 91 + n));
              tensor_view<const float, host, 2> av = ta ? make_view(a.data(), k, m).transpose(0, 1) : make_view(a.data(), m, k);
              tensor_view<const float, host, 2> bv = tb ? make_view(b.data(), n, k).transpose(0, 1) : make_view(b.data(), k, n);
              auto c0 = to_float(random_vector(m * (n + 5), 92));
              std::vector<float> c = c0;
              if (beta == 0.f)
                for (index_t i = 0; i < m; ++i)
                  for (index_t j = 0; j < n; ++j) c[static_cast<std::size_t>(i * (n + 5) + j)] = std::nanf("");
              ops::gemm(host{}, av, bv, make_view(c.data(), m, n + 5).slice(1, 0, n), -1.25f, beta);
              ++cases;
              for (index_t i = 0; i < m; ++i)
                for (index_t j = 0; j < n + 5; ++j) {
                  const std::size_t at = static_cast<std::size_t>(i * (n + 5) + j);
                  double want = c0[at], scale = 1 + std::abs(want);
                  if (j < n) {
                    double s = 0, sa = 0;
                    for (index_t p = 0; p < k; ++p) s += double(av(i, p)) * double(bv(p, j)), sa += std::abs(double(av(i, p)) * double(bv(p, j)));
                    want = -1.25 * s + double(beta) * double(c0[at]);
                    scale = 1 + sa;
                    if (loom::test::split_invariant(kernel))
                      not_rule += std::bit_cast<std::uint32_t>(c[at]) !=
                                  std::bit_cast<std::uint32_t>(sgemm_rule(av, bv, i, j, -1.25f, beta, c0[at]));
                  } else {
                    not_rule += std::bit_cast<std::uint32_t>(c[at]) != std::bit_cast<std::uint32_t>(c0[at]);
                  }
                  wrong += !(std::abs(double(c[at]) - want) <= 1e-5 * scale);  // NaN counts as wrong
                }
            }
    // a transposed A whose rows are 4 KiB apart (dW = dlogits^T x; the AVX2 kernel copies its
    // tiles first): [m, k] views of the first m columns of a [k, 1024] buffer
    for (const index_t m : {5, 6, 13})
      for (const index_t k : {17, 600})
        for (const index_t n : {16, 40}) {
          const auto a = to_float(random_vector(k * 1024, 95)), b = to_float(random_vector(k * n, 96));
          const auto c0 = to_float(random_vector(m * n, 97));
          tensor_view<const float, host, 2> av = make_view(a.data(), k, 1024).transpose(0, 1).slice(0, 0, m);
          tensor_view<const float, host, 2> bv = make_view(b.data(), k, n);
          std::vector<float> c = c0;
          ops::gemm(host{}, av, bv, make_view(c.data(), m, n), 0.5f, 2.f);
          ++cases;
          for (index_t i = 0; i < m; ++i)
            for (index_t j = 0; j < n; ++j) {
              const std::size_t at = static_cast<std::size_t>(i * n + j);
              double s = 0, sa = 0;
              for (index_t p = 0; p < k; ++p) s += double(av(i, p)) * double(bv(p, j)), sa += std::abs(double(av(i, p)) * double(bv(p, j)));
              wrong += !(std::abs(double(c[at]) - (0.5 * s + 2.0 * double(c0[at]))) <= 1e-5 * (1 + sa + std::abs(double(c0[at]))));
              if (loom::test::split_invariant(kernel))
                not_rule += std::bit_cast<std::uint32_t>(c[at]) != std::bit_cast<std::uint32_t>(sgemm_rule(av, bv, i, j, 0.5f, 2.f, c0[at]));
            }
        }
    INFO(cases, " products");
    CHECK(wrong == 0);
    CHECK(not_rule == 0);
  });
}

TEST_CASE("sgemm kernels on a training step's shapes against an exact product; loom's: same bits on 1 and 3 threads and as each other") {
  // x W^T, dy W and dy^T x of a 1024-token linear layer, 128 -> 352
  const index_t t = 1024, d = 128, h = 352;
  const auto x = to_float(random_vector(t * d, 93)), w = to_float(random_vector(h * d, 94)), dy = to_float(random_vector(t * h, 95));
  const std::tuple<tensor_view<const float, host, 2>, tensor_view<const float, host, 2>, index_t, index_t> products[] = {
      {make_view(x.data(), t, d), make_view(w.data(), h, d).transpose(0, 1), t, h},
      {make_view(dy.data(), t, h), make_view(w.data(), h, d), t, d},
      {make_view(dy.data(), t, h).transpose(0, 1), make_view(x.data(), t, d), h, d}};
  for (const auto& [av, bv, m, n] : products) {
    auto run = [&](int threads) {
      loom::thread_pool pool(threads);
      loom::host_pool_scope scope(pool);
      std::vector<float> c(static_cast<std::size_t>(m * n));
      ops::gemm(host{}, av, bv, make_view(c.data(), m, n));
      return c;
    };
    std::vector<std::vector<float>> loom_results;
    loom::test::for_each_sgemm_kernel("a training step's GEMM shapes", [&](ops::host_sgemm kernel) {
      const auto one = run(1), three = run(3);
      if (loom::test::split_invariant(kernel)) {
        CHECK(one == three);
        loom_results.push_back(one);
      }
      int wrong = 0;  // within float rounding of the exact product
      for (index_t i = 0; i < m; ++i)
        for (index_t j = 0; j < n; ++j) {
          double s = 0, sa = 0;
          for (index_t p = 0; p < av.extent(1); ++p) s += double(av(i, p)) * double(bv(p, j)), sa += std::abs(double(av(i, p)) * double(bv(p, j)));
          const std::size_t at = static_cast<std::size_t>(i * n + j);
          wrong += !(std::abs(double(one[at]) - s) <= 1e-6 * sa) + !(std::abs(double(three[at]) - s) <= 1e-6 * sa);
        }
      CHECK(wrong == 0);
    });
    for (std::size_t i = 1; i < loom_results.size(); ++i) CHECK(loom_results[i] == loom_results[0]);  // avx512 == avx2
  }
}

TEST_CASE("LOOM_SGEMM: avx512, avx2, blas and auto (the best the CPU has); a kernel the CPU lacks or any other value is a loom::error naming it") {
  CHECK(ops::detail::parse_host_sgemm("blas") == ops::host_sgemm::blas);
  CHECK(ops::detail::parse_host_sgemm(nullptr) == ops::detail::parse_host_sgemm("auto"));
  const ops::host_sgemm best = ops::host_sgemm_supported(ops::host_sgemm::avx512) ? ops::host_sgemm::avx512
                               : ops::host_sgemm_supported(ops::host_sgemm::avx2) ? ops::host_sgemm::avx2
                                                                                    : ops::host_sgemm::blas;
  CHECK(ops::detail::parse_host_sgemm("") == best);
  for (const auto k : {ops::host_sgemm::avx512, ops::host_sgemm::avx2}) {
    INFO(ops::name(k));
    if (ops::host_sgemm_supported(k)) {
      CHECK(ops::detail::parse_host_sgemm(ops::name(k)) == k);
    } else {
      CHECK_THROWS_WITH_AS(ops::detail::parse_host_sgemm(ops::name(k)), doctest::Contains(ops::name(k)), loom::error);
      CHECK_THROWS_WITH_AS(ops::set_host_sgemm(k), doctest::Contains("this one has none"), loom::error);
    }
  }
  CHECK_THROWS_WITH_AS(ops::detail::parse_host_sgemm("mkl"), doctest::Contains("LOOM_SGEMM='mkl'"), loom::error);
  CHECK_THROWS_WITH_AS(ops::detail::parse_host_sgemm("loom"), doctest::Contains("LOOM_SGEMM='loom'"), loom::error);
}

TEST_CASE("packed_weight: y = x W^T with W packed once equals ops::gemm on the same kernel (bit for bit on loom's), on 1 and 3 threads; bad shapes are loom::errors") {
  // m from one decoded token to a prefill chunk; n and k across panel widths (16, 32), N
  // blocks (512) and K blocks (512); the weight's rows padded (row stride k + 3).
  const index_t ms[] = {1, 2, 5, 13, 40}, ns[] = {1, 17, 32, 33, 600, 1100}, ks[] = {1, 16, 513, 1030};
  loom::test::for_each_sgemm_kernel("packed weights", [&](ops::host_sgemm kernel) {
    int not_same = 0, wrong = 0, not_split_invariant = 0, cases = 0;
    for (const index_t n : ns)
      for (const index_t k : ks) {
        const auto w = to_float(random_vector(n * (k + 3), 100 + n + k));
        const auto wv = make_view(w.data(), n, k + 3).slice(1, 0, k);
        const ops::packed_weight pw(wv, kernel);
        CHECK(pw.kernel() == kernel);
        for (const index_t m : ms)
          for (const float beta : {0.f, 0.5f}) {
            const auto x = to_float(random_vector(m * k, 200 + m));
            const auto y0 = to_float(random_vector(m * n, 300));
            auto run = [&](int threads, bool packed) {
              loom::thread_pool pool(threads);
              loom::host_pool_scope scope(pool);
              auto y = y0;
              if (beta == 0.f) std::fill(y.begin(), y.end(), std::nanf(""));
              if (packed) ops::gemm(host{}, make_view(x.data(), m, k), pw, make_view(y.data(), m, n), 1.5f, beta);
              else ops::gemm(host{}, make_view(x.data(), m, k), wv.transpose(0, 1), make_view(y.data(), m, n), 1.5f, beta);
              return y;
            };
            const auto p1 = run(1, true), p3 = run(3, true), u1 = run(1, false);
            ++cases;
            if (loom::test::split_invariant(kernel)) not_same += p1 != u1, not_split_invariant += p1 != p3;
            for (index_t i = 0; i < m; ++i)
              for (index_t j = 0; j < n; ++j) {
                double sum = 0, mag = 0;
                for (index_t q = 0; q < k; ++q) sum += double(x[std::size_t(i * k + q)]) * double(wv(j, q)), mag += std::abs(double(x[std::size_t(i * k + q)]) * double(wv(j, q)));
                const double want = 1.5 * sum + double(beta) * double(y0[std::size_t(i * n + j)]);
                wrong += !(std::abs(double(p3[std::size_t(i * n + j)]) - want) <= 1e-5 * (1 + mag + std::abs(want)));
              }
          }
      }
    INFO(cases, " products");
    CHECK(not_same == 0);
    CHECK(not_split_invariant == 0);
    CHECK(wrong == 0);
  });
  const auto w = to_float(random_vector(8 * 6, 1));
  const ops::packed_weight pw(make_view(w.data(), 8, 6));
  std::vector<float> x(3 * 5), y(3 * 8);
  CHECK_THROWS_WITH_AS(ops::gemm(host{}, make_view(as_const(x).data(), 3, 5), pw, make_view(y.data(), 3, 8)),
                       doctest::Contains("x has 5 features"), loom::error);
  CHECK_THROWS_WITH_AS(ops::gemm(host{}, make_view(as_const(x).data(), 3, 6).slice(0, 0, 2), pw, make_view(y.data(), 3, 8)),
                       doctest::Contains("y has shape"), loom::error);
}
