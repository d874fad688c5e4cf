// nn/tp layers on thread ranks against the single-rank nn layers (the oracle): the full
// layer gets the full parameters, each rank the rectangle its shard_desc names of the same
// buffer; outputs, input gradients and each rank's weight-gradient shard must agree.
#include <loom/comm/thread_comm.hpp>
#include <loom/core/random.hpp>
#include <loom/nn/attention.hpp>
#include <loom/nn/cross_entropy.hpp>
#include <loom/nn/embedding.hpp>
#include <loom/nn/linear.hpp>
#include <loom/nn/mlp.hpp>
#include <loom/nn/attention.hpp>
#include <loom/nn/tp/cross_entropy.hpp>
#include <loom/nn/tp/embedding.hpp>
#include <loom/nn/tp/linear.hpp>
#include <loom/nn/mlp.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace tp = loom::nn::tp;
using loom::index_t;
using loom::comm::thread_comm;
using T = double;

namespace {

template <class... E>
auto cview(const T* p, E... shape) {
  return loom::make_view(p, shape...);
}

std::vector<T> randn(std::size_t n, std::uint64_t seed, float std = 1.f) {
  std::vector<T> v(n);
  loom::counter_rng(seed).fill_normal(std::span<T>(v), 0, 0.f, std);
  return v;
}

double max_diff(std::span<const T> a, std::span<const T> b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// The oracle's parameters (full layout) and gradients; a rank's shards are read from them.
struct full_model {
  loom::nn::param_layout layout;
  std::vector<T> params, grads;
  void finish(std::uint64_t seed) {
    params = randn(layout.size(), seed, 0.3f);
    grads.assign(layout.size(), 0);
  }
  std::size_t offset(const std::string& name) const { return layout.find(name).offset; }
};

// This rank's parameters loaded from the full ones; after backward, its gradients must equal
// the full gradients' rectangles. Returns the largest difference.
struct rank_model {
  loom::nn::param_layout layout;
  tp::shard_list shards;
  std::vector<T> params, grads;
  void load(const full_model& f) {
    params.assign(layout.size(), 0);
    grads.assign(layout.size(), 0);
    tp::load_shards(shards, std::span<const T>(f.params), std::span<T>(params), [&](const std::string& n) { return f.offset(n); });
  }
  double grad_error(const full_model& f) const {
    std::vector<T> want(layout.size(), 0);
    tp::load_shards(shards, std::span<const T>(f.grads), std::span<T>(want), [&](const std::string& n) { return f.offset(n); });
    return max_diff(want, grads);
  }
};

// Runs body(rank comm, rank index) on tp thread ranks; errors[r] collects rank r's largest error.
template <class Body>
std::vector<double> on_ranks(int n, Body body) {
  std::vector<double> err(static_cast<std::size_t>(n), 0);
  loom::comm::run_ranks(n, [&](thread_comm& c) { err[static_cast<std::size_t>(c.rank())] = body(c, c.rank()); });
  return err;
}

void check_all(const std::vector<double>& err, double tol) {
  for (std::size_t r = 0; r < err.size(); ++r) {
    INFO("rank " << r);
    CHECK(err[r] < tol);
  }
}

// columns [c0, c0 + w) of a row-major [rows, cols] matrix
std::vector<T> columns(const std::vector<T>& m, index_t rows, index_t cols, index_t c0, index_t w) {
  std::vector<T> out(static_cast<std::size_t>(rows * w));
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < w; ++c) out[static_cast<std::size_t>(r * w + c)] = m[static_cast<std::size_t>(r * cols + c0 + c)];
  return out;
}

}  // namespace

TEST_CASE("column- then row-parallel linear equals the full layers") {
  const index_t n = 5, in = 6, hid = 8, out = 7;
  for (int t : {1, 2, 4}) {
    CAPTURE(t);
    full_model f;
    loom::nn::linear<T> a(f.layout, "a", in, hid), b(f.layout, "b", hid, out);
    f.finish(1);
    loom::nn::workspace<T> ws;
    auto x = randn(n * in, 2), dy = randn(n * out, 3);
    std::vector<T> h(n * hid), y(n * out), dh(n * hid, 0), dx(n * in, 0);
    a.forward(std::span<T>(f.params), cview(x.data(), n, in), loom::make_view(h.data(), n, hid), ws);
    b.forward(std::span<T>(f.params), cview(h.data(), n, hid), loom::make_view(y.data(), n, out), ws);
    b.backward(std::span<T>(f.params), std::span<T>(f.grads), cview(h.data(), n, hid),
               cview(dy.data(), n, out), loom::make_view(dh.data(), n, hid), ws);
    a.backward(std::span<T>(f.params), std::span<T>(f.grads), cview(x.data(), n, in),
               cview(dh.data(), n, hid), loom::make_view(dx.data(), n, in), ws);

    check_all(on_ranks(t, [&](thread_comm& c, int r) {
      rank_model m;
      tp::column_parallel_linear<T> ca(m.layout, "a", in, hid, {r, t}, &m.shards);
      tp::row_parallel_linear<T> rb(m.layout, "b", hid, out, {r, t}, &m.shards);
      m.load(f);
      loom::nn::workspace<T> w;
      const index_t hl = hid / t;
      std::vector<T> hloc(n * hl), yr(n * out), dhl(n * hl, 0), dxr(n * in, 0);
      ca.forward(c, std::span<T>(m.params), cview(x.data(), n, in), loom::make_view(hloc.data(), n, hl), w);
      rb.forward(c, std::span<T>(m.params), cview(hloc.data(), n, hl), loom::make_view(yr.data(), n, out), w);
      rb.backward(c, std::span<T>(m.params), std::span<T>(m.grads), cview(hloc.data(), n, hl),
                  cview(dy.data(), n, out), loom::make_view(dhl.data(), n, hl), w);
      ca.backward(c, std::span<T>(m.params), std::span<T>(m.grads), cview(x.data(), n, in),
                  cview(dhl.data(), n, hl), loom::make_view(dxr.data(), n, in), w);
      return std::max({max_diff(hloc, columns(h, n, hid, ca.first_output(), hl)), max_diff(yr, y),
                       max_diff(dhl, columns(dh, n, hid, rb.first_input(), hl)), max_diff(dxr, dx), m.grad_error(f)});
    }), 1e-12);
  }
}

TEST_CASE("vocab-parallel embedding equals the full embedding") {
  const index_t V = 12, d = 5, n = 9;
  const std::vector<std::int32_t> tokens = {0, 11, 3, 3, 7, 5, 8, 1, 10};
  for (int t : {1, 2, 4}) {
    CAPTURE(t);
    full_model f;
    loom::nn::embedding<T> e(f.layout, "tok", V, d);
    f.finish(4);
    auto dout = randn(n * d, 5);
    std::vector<T> out(n * d);
    auto tv = loom::make_view(tokens.data(), n);
    e.forward(std::span<T>(f.params), tv, loom::make_view(out.data(), n, d));
    e.backward(std::span<T>(f.grads), tv, cview(dout.data(), n, d));
    check_all(on_ranks(t, [&](thread_comm& c, int r) {
      rank_model m;
      tp::vocab_parallel_embedding<T> pe(m.layout, "tok", V, d, {r, t}, &m.shards);
      m.load(f);
      std::vector<T> o(n * d);
      pe.forward(c, std::span<T>(m.params), tv, loom::make_view(o.data(), n, d));
      pe.backward(std::span<T>(m.grads), tv, cview(dout.data(), n, d));
      return std::max(max_diff(o, out), m.grad_error(f));
    }), 1e-15);
  }
  rank_model m;
  CHECK_THROWS_WITH_AS(tp::vocab_parallel_embedding<T>(m.layout, "tok", 10, 4, {0, 4}),
                       doctest::Contains("tok vocabulary (10) must be divisible by the tensor-parallel size tp=4"),
                       loom::error);
}

TEST_CASE("vocab-parallel cross-entropy equals the full one and never holds full-vocabulary logits") {
  const index_t V = 64, n = 12;
  auto logits = randn(n * V, 6, 2.f);
  std::vector<std::int32_t> targets(n);
  for (index_t i = 0; i < n; ++i) targets[i] = static_cast<std::int32_t>((i * 37 + 5) % V);
  targets[3] = -100;
  targets[7] = -100;
  auto tv = loom::make_view(targets.data(), n);
  loom::nn::cross_entropy<T> ce;
  const T loss = ce.forward(cview(logits.data(), n, V), tv);
  std::vector<T> dl(n * V, 0);
  ce.backward(cview(logits.data(), n, V), tv, loom::make_view(dl.data(), n, V), T(0.5));
  for (int t : {1, 2, 4}) {
    CAPTURE(t);
    std::vector<double> peaks(t);
    check_all(on_ranks(t, [&](thread_comm& c, int r) {
      loom::host_memory_resource mr("rank" + std::to_string(r));
      const index_t vl = V / t;
      double err;
      {
        loom::buffer<T> local(n * vl, mr), dlocal(n * vl, mr);  // this rank's logits and their gradient
        auto cols = columns(logits, n, V, r * vl, vl);
        std::copy(cols.begin(), cols.end(), local.begin());
        std::fill(dlocal.begin(), dlocal.end(), T(0));
        const std::size_t before = mr.current_bytes();
        mr.reset_peak();
        tp::vocab_parallel_cross_entropy<T> pce(V, r * vl, {}, mr);
        const T l = pce.forward(c, local.view(n, vl), tv);
        pce.backward(local.view(n, vl), tv, dlocal.view(n, vl), T(0.5));
        err = std::max(std::abs(l - loss), max_diff(dlocal.span(), columns(dl, n, V, r * vl, vl)));
        peaks[static_cast<std::size_t>(r)] = double(mr.peak_bytes() - before);  // what the loss itself allocated
      }
      return err;
    }), 1e-13);
    // the loss allocates only per-row statistics (3 n numbers), never a [n, V] tensor; the
    // rank's logits are [n, V / t]
    for (double p : peaks) CHECK(p <= double(3 * n * sizeof(T)));
  }
  // strided logits (a transposed view) are refused by name
  on_ranks(1, [&](thread_comm& c, int) {
    tp::vocab_parallel_cross_entropy<T> pce(V, 0);
    auto tr = cview(logits.data(), V, n).transpose(0, 1);
    CHECK_THROWS_WITH_AS(pce.forward(c, tr, tv), doctest::Contains("logits_local must be contiguous"), loom::error);
    return 0.0;
  });
}

TEST_CASE("parallel attention equals nn::attention, GQA heads split or replicated, causal and prefix-LM") {
  const index_t b = 2, d = 16;
  // the prefix-LM case: 70 positions, the first 66 bidirectional, so the first 64-row query
  // tile sees 2 keys past its rows (a backward run under the causal mask would skip them)
  struct cse { index_t heads, kv, prefix, s; };
  for (cse k : {cse{4, 4, 0, 5}, cse{4, 2, 0, 5}, cse{4, 1, 0, 5}, cse{4, 2, 66, 70}}) {
    const index_t s = k.s;
    for (int t : {1, 2, 4}) {
      CAPTURE(k.heads);
      CAPTURE(k.kv);
      CAPTURE(k.prefix);
      CAPTURE(t);
      const loom::nn::attention_config ac{d, k.heads, k.kv, s, 10000.0, loom::ops::rope_style::interleaved, {k.prefix}, false};
      full_model f;
      loom::nn::attention<T> att(f.layout, "attn", ac);
      f.finish(7);
      loom::nn::workspace<T> ws;
      auto x = randn(b * s * d, 8), dy = randn(b * s * d, 9);
      std::vector<T> y(b * s * d), dx(b * s * d, 0);
      auto acts = att.make_activations(b, s);
      att.forward(std::span<T>(f.params), cview(x.data(), b, s, d), acts, loom::make_view(y.data(), b, s, d), ws);
      att.backward(std::span<T>(f.params), std::span<T>(f.grads), cview(x.data(), b, s, d), acts,
                   cview(dy.data(), b, s, d), loom::make_view(dx.data(), b, s, d), ws);
      check_all(on_ranks(t, [&](thread_comm& c, int r) {
        rank_model m;
        loom::nn::attention<T> pa(m.layout, "attn", ac, {r, t}, &m.shards);
        m.load(f);
        loom::nn::workspace<T> w;
        auto a = pa.make_activations(b, s);
        std::vector<T> yr(b * s * d), dxr(b * s * d, 0);
        pa.forward(c, std::span<T>(m.params), cview(x.data(), b, s, d), a, loom::make_view(yr.data(), b, s, d), w);
        // twice: gradients accumulate, and replicated heads must not double-count the first call
        for (int rep = 0; rep < 2; ++rep)
          pa.backward(c, std::span<T>(m.params), std::span<T>(m.grads), cview(x.data(), b, s, d), a,
                      cview(dy.data(), b, s, d), loom::make_view(dxr.data(), b, s, d), w);
        for (auto& g : m.grads) g *= 0.5;
        for (auto& g : dxr) g *= 0.5;
        return std::max({max_diff(yr, y), max_diff(dxr, dx), m.grad_error(f)});
      }), 1e-12);
    }
  }
  rank_model m;
  const loom::nn::attention_config bad{24, 6, 6, 8, 10000.0, loom::ops::rope_style::interleaved, {}, false};
  CHECK_THROWS_WITH_AS(loom::nn::attention<T>(m.layout, "attn", bad, {0, 4}),
                       doctest::Contains("n_heads (6) must be divisible by the tensor-parallel size tp=4"), loom::error);
  const loom::nn::attention_config gqa{32, 8, 2, 8, 10000.0, loom::ops::rope_style::interleaved, {}, false};
  CHECK_NOTHROW(loom::nn::attention<T>(m.layout, "ok", gqa, {0, 4}));
  const loom::nn::attention_config odd{48, 12, 3, 8, 10000.0, loom::ops::rope_style::interleaved, {}, false};
  rank_model m2;
  CHECK_THROWS_WITH_AS(loom::nn::attention<T>(m2.layout, "attn", odd, {0, 4}),
                       doctest::Contains("n_kv_heads (3) < tp=4 must divide tp"), loom::error);
}

TEST_CASE("parallel SwiGLU MLP equals nn::swiglu_mlp") {
  const index_t n = 6, d = 8, hid = 12;
  for (int t : {1, 2, 4}) {
    CAPTURE(t);
    full_model f;
    loom::nn::swiglu_mlp<T> mlp(f.layout, "ff", d, hid);
    f.finish(10);
    loom::nn::workspace<T> ws;
    auto x = randn(n * d, 11), dy = randn(n * d, 12);
    std::vector<T> y(n * d), dx(n * d, 0);
    auto acts = mlp.make_activations(n);
    mlp.forward(std::span<T>(f.params), cview(x.data(), n, d), acts, loom::make_view(y.data(), n, d), ws);
    mlp.backward(std::span<T>(f.params), std::span<T>(f.grads), cview(x.data(), n, d), acts,
                 cview(dy.data(), n, d), loom::make_view(dx.data(), n, d), ws);
    check_all(on_ranks(t, [&](thread_comm& c, int r) {
      rank_model m;
      loom::nn::swiglu_mlp<T> pm(m.layout, "ff", d, hid, {r, t}, &m.shards);
      m.load(f);
      loom::nn::workspace<T> w;
      auto a = pm.make_activations(n);
      std::vector<T> yr(n * d), dxr(n * d, 0);
      pm.forward(c, std::span<T>(m.params), cview(x.data(), n, d), a, loom::make_view(yr.data(), n, d), w);
      pm.backward(c, std::span<T>(m.params), std::span<T>(m.grads), cview(x.data(), n, d), a,
                  cview(dy.data(), n, d), loom::make_view(dxr.data(), n, d), w);
      return std::max({max_diff(yr, y), max_diff(dxr, dx), m.grad_error(f)});
    }), 1e-12);
  }
  rank_model m;
  CHECK_THROWS_WITH_AS(loom::nn::swiglu_mlp<T>(m.layout, "ff", 8, 10, {1, 4}),
                       doctest::Contains("ff hidden_dim (10) must be divisible by the tensor-parallel size tp=4"),
                       loom::error);
}
