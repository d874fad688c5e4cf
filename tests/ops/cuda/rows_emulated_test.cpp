// The rest of the CUDA kernels on host threads (emulation.hpp), against their host
// counterparts: the row kernels over the block reductions of ops/cuda/reduce.cuh (RMSNorm
// forward and backward, softmax cross-entropy with its target count, mean loss and backward,
// the squared norm with its non-finite flag), RoPE in both conventions with partial rotary,
// SwiGLU and fused AdamW. Under emulation the block reduction is thread 0's sum in thread order
// instead of CUB's tree (reduce.cuh), so sums agree to rounding: the GPU test's tolerances
// (kernels_test.cu, which runs the same comparisons on a device): rtol 1e-5, atol 1e-6 (dw, a
// sum over rows: atol 1e-4; the squared norm in double: rtol 1e-10). Launch shapes as the
// headers' launch code: a block of row_block threads a row, grid_for over elements.
#include "emulation.hpp"

#include <loom/ops/cuda/activation.cuh>
#include <loom/ops/cuda/cross_entropy.cuh>
#include <loom/ops/cuda/norm.cuh>
#include <loom/ops/cuda/reduce.cuh>
#include <loom/ops/cuda/rope.cuh>
#include <loom/optim/cuda/adamw.cuh>

#include <loom/core/float16.hpp>
#include <loom/core/random.hpp>
#include <loom/ops/host/activation.hpp>
#include <loom/ops/host/cross_entropy.hpp>
#include <loom/ops/host/norm.hpp>
#include <loom/ops/host/rope.hpp>
#include <loom/optim/adamw.hpp>
#include <loom/optim/clip.hpp>

#include <doctest/doctest.h>

#include "ops/cuda/compare.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace {

using loom::host;
using loom::index_t;
using loom::make_view;
using loom::emulation::emulate_launch;
namespace ops = loom::ops;
namespace kernels = loom::ops::kernels;



constexpr double rtol32 = 1e-5, atol32 = 1e-6;
constexpr unsigned rows_block = kernels::row_block, block = kernels::elementwise_block;
dim3 grid(index_t n) { return {kernels::grid_for(n, block), 1, 1}; }
dim3 rows(index_t n) { return {static_cast<unsigned>(n), 1, 1}; }

template <class P>
void check_rmsnorm(index_t n, index_t d) {
  INFO("rows " << n << ", dim " << d);
  const auto x = random_vector(std::size_t(n * d), 1), dy = random_vector(x.size(), 2);
  const auto w = random_vector<P>(std::size_t(d), 3);
  std::vector<float> y(x.size()), rstd(static_cast<std::size_t>(n)), dx = random_vector(x.size(), 4), dw = random_vector(std::size_t(d), 5);
  std::vector<float> ey(x.size(), -9.f), erstd(rstd.size(), -9.f), edx = dx, edw = dw;
  ops::rmsnorm_forward(host{}, make_view(x.data(), n, d), make_view(w.data(), d), make_view(y.data(), n, d),
                       make_view(rstd.data(), n), 1e-5f);
  ops::rmsnorm_backward(host{}, make_view(dy.data(), n, d), make_view(x.data(), n, d), make_view(w.data(), d),
                        make_view(rstd.data(), n), make_view(dx.data(), n, d), make_view(dw.data(), d));
  emulate_launch(kernels::rmsnorm_forward<float, P>, rows(n), rows_block, x.data(), w.data(), ey.data(), erstd.data(), d, 1e-5f);
  emulate_launch(kernels::rmsnorm_backward_dx<float, P>, rows(n), rows_block, dy.data(), x.data(), w.data(),
                 static_cast<const float*>(erstd.data()), edx.data(), d);
  emulate_launch(kernels::rmsnorm_backward_dw<float>, grid(d), block, dy.data(), x.data(), static_cast<const float*>(erstd.data()),
                 edw.data(), n, d);
  require_close(ey, y, rtol32, atol32, "rmsnorm y");
  require_close(erstd, rstd, rtol32, atol32, "rmsnorm rstd");
  require_close(edx, dx, rtol32, atol32, "rmsnorm dx");
  require_close(edw, dw, rtol32, 1e-4, "rmsnorm dw");
}

}  // namespace

TEST_CASE("the CUDA RMSNorm kernels, emulated on host threads, equal the host's (fp32 and bf16 weights)") {
  for (auto [n, d] : {std::pair<index_t, index_t>{1, 1}, {7, 130}, {3, 600}}) {
    check_rmsnorm<float>(n, d);
    check_rmsnorm<loom::bfloat16>(n, d);
  }
}

TEST_CASE("the CUDA cross-entropy kernels, emulated on host threads, equal the host's (ignore_index, a bad target)") {
  for (auto [n, v] : {std::pair<index_t, index_t>{5, 7}, {9, 700}}) {
    INFO("rows " << n << ", vocab " << v);
    const auto logits = random_vector(std::size_t(n * v), 15, 3.f);
    std::vector<std::int32_t> tgt(static_cast<std::size_t>(n));
    for (index_t i = 0; i < n; ++i) tgt[std::size_t(i)] = i % 4 == 1 ? -100 : std::int32_t((i * 37) % v);
    std::vector<float> lse(static_cast<std::size_t>(n)), dl(logits.size()), acc = random_vector(logits.size(), 16);
    const float loss = ops::cross_entropy_forward_backward(host{}, make_view(logits.data(), n, v), make_view(tgt.data(), n),
                                                           make_view(lse.data(), n), make_view(dl.data(), n, v));
    std::vector<float> elog = acc;
    ops::cross_entropy_backward(host{}, make_view(logits.data(), n, v), make_view(tgt.data(), n), make_view(lse.data(), n),
                                make_view(acc.data(), n, v), 0.5f);
    unsigned long long stats[2] = {0, static_cast<unsigned long long>(n)};
    std::vector<float> e_lse(lse.size(), -9.f), row_loss(static_cast<std::size_t>(n)), edl(dl.size(), -9.f);
    float eloss = -9.f;
    const std::int64_t ignore = ops::cross_entropy_options{}.ignore_index;
    emulate_launch(kernels::count_targets<std::int32_t>, rows(1), rows_block, tgt.data(), n, v, ignore, stats);
    CHECK(stats[0] == static_cast<unsigned long long>(n - (n + 2) / 4));
    CHECK(stats[1] == static_cast<unsigned long long>(n));
    emulate_launch(kernels::cross_entropy_rows<float, std::int32_t>, rows(n), rows_block, logits.data(), tgt.data(), e_lse.data(),
                   row_loss.data(), edl.data(), static_cast<const unsigned long long*>(stats), v, ignore);
    emulate_launch(kernels::mean_loss, rows(1), rows_block, static_cast<const float*>(row_loss.data()), n,
                   static_cast<const unsigned long long*>(stats), &eloss);
    CHECK(std::abs(eloss - loss) <= 1e-5 * std::abs(loss));
    require_close(e_lse, lse, rtol32, atol32, "cross-entropy lse");
    require_close(edl, dl, rtol32, atol32, "cross-entropy dlogits (forward)");
    emulate_launch(kernels::cross_entropy_backward<float, std::int32_t>, rows(n), rows_block, logits.data(), tgt.data(),
                   static_cast<const float*>(e_lse.data()), elog.data(), static_cast<const unsigned long long*>(stats), v, 0.5f,
                   ignore, true);
    require_close(elog, acc, rtol32, atol32, "cross-entropy dlogits (backward, accumulated)");
    tgt[std::size_t(n - 2)] = std::int32_t(v + 3), tgt[std::size_t(n - 1)] = -5;  // the first bad one is n - 2
    stats[0] = 0, stats[1] = static_cast<unsigned long long>(n);
    emulate_launch(kernels::count_targets<std::int32_t>, rows(1), rows_block, tgt.data(), n, v, ignore, stats);
    CHECK(stats[1] == static_cast<unsigned long long>(n - 2));
  }
}

TEST_CASE("the CUDA squared norm, emulated on host threads, equals the host's and flags inf and NaN") {
  for (std::size_t n : {std::size_t(1), std::size_t(70'001)}) {
    CAPTURE(n);
    auto x = random_vector(n, 14);
    std::vector<double> partial(kernels::norm_blocks);
    double total = -1;
    int flag = 0;
    auto run = [&] {
      emulate_launch(kernels::sum_of_squares_partials<float>, dim3{kernels::norm_blocks, 1, 1}, rows_block,
                     static_cast<const float*>(x.data()), index_t(n), partial.data(), &flag);
      emulate_launch(kernels::sum_partials, rows(1), rows_block, static_cast<const double*>(partial.data()), kernels::norm_blocks,
                     &total);
    };
    run();
    const double want = loom::optim::sum_of_squares(x);
    CHECK(std::abs(total - want) <= 1e-10 * want);
    CHECK(flag == 0);
    for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
      x[n / 2] = bad;
      run();
      CHECK(flag == 1);
      flag = 0;
    }
  }
}

TEST_CASE("the CUDA RoPE, SwiGLU and AdamW kernels, emulated on host threads, equal the host's") {
  const index_t b = 2, s = 9, h = 3, hd = 16;
  for (index_t rot : {index_t(0), index_t(8)})
    for (auto style : {ops::rope_style::interleaved, ops::rope_style::half_split}) {
      INFO("rotary_dim " << rot << ", style " << int(style));
      const ops::rope_table<float> table(20, hd, 10000.0, rot);
      const index_t half = table.rotary_dim / 2, pairs = b * s * h * half;
      auto x = random_vector(std::size_t(b * s * h * hd), 6);
      auto ex = x;
      ops::rope_forward(host{}, make_view(x.data(), b, s, h, hd), table, style, 3);
      emulate_launch(kernels::rope<float>, grid(pairs), block, ex.data(), table.cos.data(), table.sin.data(), s, h, hd, half,
                     index_t(3), style, 1.f, pairs);
      require_close(ex, x, rtol32, atol32, "rope forward");
      ops::rope_backward(host{}, make_view(x.data(), b, s, h, hd), table, style, 2);
      emulate_launch(kernels::rope<float>, grid(pairs), block, ex.data(), table.cos.data(), table.sin.data(), s, h, hd, half,
                     index_t(2), style, -1.f, pairs);
      require_close(ex, x, rtol32, atol32, "rope backward");
    }
  const index_t n = 3001;
  const auto a = random_vector(std::size_t(n), 7, 3.f), bv = random_vector(std::size_t(n), 8), dout = random_vector(std::size_t(n), 9);
  std::vector<float> out(a.size()), eout(a.size(), -9.f), da = random_vector(a.size(), 10), db = random_vector(a.size(), 11);
  auto eda = da, edb = db;
  ops::swiglu_forward(host{}, make_view(a.data(), n), make_view(bv.data(), n), make_view(out.data(), n));
  emulate_launch(kernels::swiglu_forward<float>, grid(n), block, a.data(), bv.data(), eout.data(), n);
  require_close(eout, out, rtol32, atol32, "swiglu");
  for (bool acc : {true, false}) {
    ops::swiglu_backward(host{}, make_view(dout.data(), n), make_view(a.data(), n), make_view(bv.data(), n),
                         make_view(da.data(), n), make_view(db.data(), n), acc);
    emulate_launch(kernels::swiglu_backward<float>, grid(n), block, dout.data(), a.data(), bv.data(), eda.data(), edb.data(), n, acc);
    require_close(eda, da, rtol32, atol32, "swiglu da");
    require_close(edb, db, rtol32, atol32, "swiglu db");
  }
  auto p = random_vector(std::size_t(n), 12), g = random_vector(std::size_t(n), 13, 0.1f);
  std::vector<float> m(p.size()), v(p.size()), ep = p, em = m, ev = v;
  for (std::int64_t t = 1; t <= 3; ++t) {
    loom::optim::adamw_update(p, g, m, v, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, t);
    emulate_launch(loom::optim::kernels::adamw, grid(n), block, ep.data(), g.data(), em.data(), ev.data(), n,
                   ops::math::make_adamw_coefficients(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, t));
  }
  require_close(ep, p, rtol32, atol32, "adamw params");
  require_close(em, m, rtol32, atol32, "adamw exp_avg");
  require_close(ev, v, rtol32, 1e-9, "adamw exp_avg_sq");
}

TEST_CASE("the CUDA vocab-parallel cross-entropy steps, emulated on two ranks' halves, give the full row's loss and gradient") {
  const index_t n = 7, v = 700, split = 330;  // rank 0 holds [0, 330), rank 1 [330, 700)
  const auto logits = random_vector(std::size_t(n * v), 17, 3.f);
  std::vector<std::int32_t> tgt{5, -100, 400, 329, 330, 699, 12};
  std::vector<float> lse(static_cast<std::size_t>(n)), dl(logits.size());
  const float loss = ops::cross_entropy_forward_backward(host{}, make_view(logits.data(), n, v), make_view(tgt.data(), n),
                                                         make_view(lse.data(), n), make_view(dl.data(), n, v));
  const std::int64_t ignore = ops::cross_entropy_options{}.ignore_index;
  const index_t first[2] = {0, split}, width[2] = {split, v - split};
  std::vector<float> local[2], mx[2], sums[2];
  for (int r = 0; r < 2; ++r) {  // each rank's columns, its row maxima
    for (index_t i = 0; i < n; ++i)
      local[r].insert(local[r].end(), logits.begin() + i * v + first[r], logits.begin() + i * v + first[r] + width[r]);
    mx[r].assign(std::size_t(n), -9.f);
    emulate_launch(kernels::vocab_parallel_row_max<float>, rows(n), rows_block, static_cast<const float*>(local[r].data()),
                   width[r], mx[r].data());
  }
  std::vector<float> gmax(static_cast<std::size_t>(n));  // the all-reduce (max)
  for (std::size_t i = 0; i < gmax.size(); ++i) gmax[i] = std::max(mx[0][i], mx[1][i]);
  for (int r = 0; r < 2; ++r) {
    sums[r].assign(std::size_t(2 * n), -9.f);
    emulate_launch(kernels::vocab_parallel_row_sums<float, std::int32_t>, rows(n), rows_block,
                   static_cast<const float*>(local[r].data()), static_cast<const std::int32_t*>(tgt.data()), width[r], first[r],
                   static_cast<const float*>(gmax.data()), sums[r].data(), ignore);
  }
  std::vector<float> e_lse(static_cast<std::size_t>(n));  // the all-reduce (sum), then the layer's log-sum-exp and mean
  double eloss = 0;
  index_t counted = 0;
  for (index_t i = 0; i < n; ++i) {
    const auto k = std::size_t(i);
    e_lse[k] = float(ops::math::log_sum_exp(double(gmax[k]), double(sums[0][2 * k]) + double(sums[1][2 * k])));
    if (tgt[k] != ignore) eloss += double(e_lse[k]) - (double(sums[0][2 * k + 1]) + double(sums[1][2 * k + 1])), ++counted;
  }
  CHECK(std::abs(eloss / double(counted) - double(loss)) <= 1e-5 * std::abs(double(loss)));
  require_close(e_lse, lse, rtol32, atol32, "vocab-parallel lse");
  std::vector<float> edl(dl.size());
  for (int r = 0; r < 2; ++r) {
    std::vector<float> g(local[r].size(), 0.f);
    emulate_launch(kernels::vocab_parallel_backward<float, std::int32_t>, rows(n), rows_block,
                   static_cast<const float*>(local[r].data()), static_cast<const std::int32_t*>(tgt.data()),
                   static_cast<const float*>(e_lse.data()), g.data(), width[r], first[r], 1.f / float(counted), ignore);
    for (index_t i = 0; i < n; ++i)
      std::copy_n(g.begin() + i * width[r], width[r], edl.begin() + i * v + first[r]);
  }
  require_close(edl, dl, rtol32, atol32, "vocab-parallel dlogits");
}
