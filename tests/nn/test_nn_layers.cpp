// nn layers: for each layer, the objective L = sum(r * layer(x)) in double; the analytic
// gradients from backward (with respect to every parameter and the input) are compared with
// central finite differences. Plus the flat parameter layout, the workspace and the
// checkpointing bookkeeping.
#include "grad_check.hpp"

#include <loom/nn/attention.hpp>
#include <loom/nn/checkpoint.hpp>
#include <loom/nn/cross_entropy.hpp>
#include <loom/nn/embedding.hpp>
#include <loom/nn/linear.hpp>
#include <loom/nn/mlp.hpp>
#include <loom/nn/norm.hpp>
#include <loom/nn/parameters.hpp>
#include <loom/nn/workspace.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

using namespace loom;
using loom::test::check_gradient;
using loom::test::dot;
using loom::test::random_vector;
using vec = std::vector<double>;

namespace {
/// Runs forward (returns L) and backward (fills grads and dx) of one layer, then checks both.
template <class Fwd, class Bwd>
void check_layer(vec& params, vec& x, Fwd fwd, Bwd bwd, const char* name) {
  fwd();
  vec grads(params.size(), 0.0), dx(x.size(), 0.0);
  bwd(grads, dx);
  INFO(name);
  check_gradient(params, grads, fwd, "parameters");
  check_gradient(x, dx, fwd, "input");
}
}  // namespace

TEST_CASE("param_layout: aligned offsets, names, errors") {
  nn::param_layout L(16);
  auto a = L.add("a.weight", extents<2>{3, 5});
  auto b = L.add("b.weight", extents<1>{7});
  CHECK(a.offset == 0);
  CHECK(b.offset == 16);
  CHECK(L.size() == 32);
  CHECK(L.parameter_count() == 22);
  CHECK(L.find("b.weight").offset == 16);
  CHECK(L.entries()[0].shape == std::vector<index_t>{3, 5});
  CHECK_THROWS_AS(L.add("a.weight", extents<1>{2}), loom::error);
  CHECK_THROWS_AS(L.find("c"), loom::error);
  CHECK_THROWS_AS(L.add("z", extents<1>{0}), loom::error);
  nn::param_store<float> store(L);
  CHECK(store.params().size() == 32);
  store.param("b.weight")[6] = 2.f;
  CHECK(b.in(store.params())(6) == 2.f);
}

TEST_CASE("param_layout units: slots relative to their unit, entries and unit bounds in the whole buffer") {
  nn::param_layout L(4);
  CHECK(L.begin_unit(3) == 0);  // the first unit starts at 0; units are multiples of lcm(4, 3) = 12
  auto a = L.add("a", extents<1>{5});
  CHECK(L.begin_unit(3) == 1);
  auto b = L.add("b", extents<1>{2});
  auto c = L.add("c", extents<2>{2, 3});
  CHECK(L.begin_unit() == 2);
  auto d = L.add("d", extents<1>{1});
  // by hand: a [0, 5) -> unit 0 is [0, 12); b [12, 14), c [16, 22) -> unit 1 [12, 24); d [24, 25)
  CHECK(L.units() == 3);
  CHECK((L.unit_begin(0) == 0 && L.unit_end(0) == 12 && L.unit_begin(1) == 12 && L.unit_end(1) == 24));
  CHECK((L.unit_begin(2) == 24 && L.unit_end(2) == 36 && L.size() == 36));
  CHECK((a.offset == 0 && b.offset == 0 && c.offset == 4 && d.offset == 0));
  CHECK((L.find("c").offset == 16 && L.find("d").offset == 24));
  std::vector<float> flat(L.size());
  for (std::size_t i = 0; i < flat.size(); ++i) flat[i] = float(i);
  // a slot read through its unit's span sees the same elements as the entry's whole-buffer offset
  CHECK(c.in(L.unit(std::span<float>(flat), 1))(1, 2) == flat[16 + 5]);
  CHECK(d.in(L.unit(std::span<float>(flat), 2))(0) == flat[24]);
  CHECK_THROWS_WITH_AS(L.unit(std::span<float>(flat).first(30), 2), doctest::Contains("does not fit"), loom::error);
  CHECK_THROWS_WITH_AS(L.begin_unit(0), doctest::Contains("multiple=0"), loom::error);
  L.begin_unit();
  CHECK_THROWS_WITH_AS(L.begin_unit(), doctest::Contains("has no parameter"), loom::error);
}

TEST_CASE("workspace: spans stay valid when the arena grows; reset merges") {
  nn::workspace<float> ws(32);
  auto s1 = ws.take(20);
  std::fill(s1.begin(), s1.end(), 1.f);
  auto s2 = ws.take(100000);  // forces a new chunk
  std::fill(s2.begin(), s2.end(), 2.f);
  CHECK(s1[19] == 1.f);
  CHECK(ws.take_zeroed(5)[4] == 0.f);
  ws.reset();
  CHECK(ws.capacity() >= 100032);
  const auto cap = ws.capacity();
  ws.take(20), ws.take(100000);
  CHECK(ws.capacity() == cap);  // no allocation the second time
}

TEST_CASE("block_activations: n sets, or one recomputed set with checkpointing") {
  int made = 0, recomputed = 0;
  nn::block_activations<int> keep(3, false, [&] { return ++made; });
  CHECK(keep.sets() == 3);
  CHECK(keep.for_backward(2, [&](int&) { ++recomputed; }) == 3);
  nn::block_activations<int> ckpt(3, true, [&] { return ++made; });
  CHECK(ckpt.sets() == 1);
  ckpt.for_backward(1, [&](int&) { ++recomputed; });
  CHECK(recomputed == 1);
  CHECK_THROWS_AS(ckpt.for_forward(3), loom::error);
}

TEST_CASE("linear with bias: finite differences") {
  const index_t n = 3, in = 4, out = 5;
  nn::param_layout L(1);
  nn::linear<double> lin(L, "fc", in, out, true);
  vec p = random_vector(L.size(), 1), x = random_vector(n * in, 2), r = random_vector(n * out, 3), y(n * out);
  nn::workspace<double> ws;
  check_layer(
      p, x,
      [&] {
        lin.forward(std::span(p), make_view(x.data(), n, in), make_view(y.data(), n, out), ws);
        return dot(r, y);
      },
      [&](vec& g, vec& dx) {
        lin.backward(std::span(p), std::span(g), make_view(x.data(), n, in), make_view(r.data(), n, out),
                     make_view(dx.data(), n, in), ws);
      },
      "linear");
}

TEST_CASE("linear::forward_all / backward_all (two layers with biases on one input): finite differences") {
  const index_t n = 3, in = 4, o1 = 5, o2 = 2;
  nn::param_layout L(1);
  nn::linear<double> a(L, "a", in, o1, true), b(L, "b", in, o2, true);
  vec p = random_vector(L.size(), 11), x = random_vector(n * in, 12), r1 = random_vector(n * o1, 13),
      r2 = random_vector(n * o2, 14), y1(n * o1), y2(n * o2);
  nn::workspace<double> ws;
  check_layer(
      p, x,
      [&] {
        nn::linear<double>::forward_all(std::span(p), make_view(as_const(x).data(), n, in),
                                        {{&a, make_view(y1.data(), n, o1)}, {&b, make_view(y2.data(), n, o2)}}, ws);
        return dot(r1, y1) + dot(r2, y2);
      },
      [&](vec& g, vec& dx) {
        nn::linear<double>::backward_all(std::span(p), std::span(g), make_view(as_const(x).data(), n, in),
                                         {{&a, make_view(as_const(r1).data(), n, o1)}, {&b, make_view(as_const(r2).data(), n, o2)}},
                                         make_view(dx.data(), n, in), ws);
      },
      "linear group");
}

TEST_CASE("rmsnorm and layernorm layers: finite differences") {
  const index_t n = 3, d = 6;
  {
    nn::param_layout L(1);
    nn::rmsnorm<double> norm(L, "n", d, 1e-5);
    vec p = random_vector(L.size(), 4), x = random_vector(n * d, 5), r = random_vector(n * d, 6), y(n * d), rs(n);
    check_layer(
        p, x,
        [&] {
          norm.forward(std::span(p), make_view(x.data(), n, d), make_view(y.data(), n, d), make_view(rs.data(), n));
          return dot(r, y);
        },
        [&](vec& g, vec& dx) {
          norm.backward(std::span(p), std::span(g), make_view(r.data(), n, d), make_view(x.data(), n, d),
                        make_view(rs.data(), n), make_view(dx.data(), n, d));
        },
        "rmsnorm");
  }
  {
    nn::param_layout L(1);
    nn::layernorm<double> norm(L, "n", d, 1e-5);
    vec p = random_vector(L.size(), 7), x = random_vector(n * d, 8), r = random_vector(n * d, 9), y(n * d), mu(n), rs(n);
    check_layer(
        p, x,
        [&] {
          norm.forward(std::span(p), make_view(x.data(), n, d), make_view(y.data(), n, d), make_view(mu.data(), n),
                       make_view(rs.data(), n));
          return dot(r, y);
        },
        [&](vec& g, vec& dx) {
          norm.backward(std::span(p), std::span(g), make_view(r.data(), n, d), make_view(x.data(), n, d),
                        make_view(mu.data(), n), make_view(rs.data(), n), make_view(dx.data(), n, d));
        },
        "layernorm");
  }
}

TEST_CASE("attention layer (GQA, MQA, prefix-LM, both rotary conventions, ChatGLM's fused q/k/v with biases and half-head rotary): finite differences") {
  const index_t b = 2, s = 4, dim = 8;
  struct cfg { index_t h, kvh, prefix; ops::rope_style rope; bool bias, qkv_bias = false, fused = false; index_t rot = 0; };
  for (cfg c : {cfg{2, 1, 0, ops::rope_style::interleaved, false}, cfg{4, 2, 2, ops::rope_style::half_split, true},
                cfg{2, 2, 0, ops::rope_style::half_split, false}, cfg{2, 1, 0, ops::rope_style::interleaved, false, true, true, 2},
                cfg{2, 2, 0, ops::rope_style::interleaved, false, true, false, 2}}) {
    CAPTURE(c.h);
    CAPTURE(c.kvh);
    CAPTURE(c.prefix);
    CAPTURE(c.fused);
    nn::param_layout L(1);
    nn::attention<double> att(L, "attn", {dim, c.h, c.kvh, 8, 10000.0, c.rope, {c.prefix}, c.bias, c.qkv_bias, c.fused, c.rot});
    if (c.fused) {  // one tensor with rows [Q | K | V] and its bias
      const index_t rows = (c.h + 2 * c.kvh) * (dim / c.h);
      CHECK(L.find("attn.wqkv.weight").shape == std::vector<index_t>{rows, dim});
      CHECK(L.find("attn.wqkv.bias").shape == std::vector<index_t>{rows});
      CHECK(!L.contains("attn.wq.weight"));
    }
    auto acts = att.make_activations(b, s);
    nn::workspace<double> ws;
    vec p = random_vector(L.size(), 10, 0.5), x = random_vector(b * s * dim, 11), r = random_vector(b * s * dim, 12),
        y(b * s * dim);
    check_layer(
        p, x,
        [&] {
          att.forward(std::span(p), make_view(x.data(), b, s, dim), acts, make_view(y.data(), b, s, dim), ws);
          ws.reset();
          return dot(r, y);
        },
        [&](vec& g, vec& dx) {
          att.backward(std::span(p), std::span(g), make_view(x.data(), b, s, dim), acts, make_view(r.data(), b, s, dim),
                       make_view(dx.data(), b, s, dim), ws);
          ws.reset();
        },
        "attention");
  }
  nn::param_layout L(1);
  CHECK_THROWS_AS(nn::attention<double>(L, "bad", {12, 4, 3, 8}), loom::error);
}

namespace {
/// Finite-difference check of an MLP layer (swiglu_mlp or gelu_mlp) declared in L.
template <class Mlp>
void check_mlp(const nn::param_layout& L, const Mlp& mlp, index_t n, index_t dim, std::uint64_t seed, const char* name) {
  nn::workspace<double> ws;
  auto acts = mlp.make_activations(n);
  vec p = random_vector(L.size(), seed), x = random_vector(n * dim, seed + 1), r = random_vector(n * dim, seed + 2),
      y(n * dim);
  check_layer(
      p, x,
      [&] {
        mlp.forward(std::span(p), make_view(x.data(), n, dim), acts, make_view(y.data(), n, dim), ws);
        ws.reset();
        return dot(r, y);
      },
      [&](vec& g, vec& dx) {
        mlp.backward(std::span(p), std::span(g), make_view(x.data(), n, dim), acts, make_view(r.data(), n, dim),
                     make_view(dx.data(), n, dim), ws);
        ws.reset();
      },
      name);
}
}  // namespace

TEST_CASE("SwiGLU and GeLU MLPs: finite differences") {
  const index_t n = 3, dim = 5, hidden = 7;
  nn::param_layout ls(1), lg(1), lf(1);
  const nn::swiglu_mlp<double> swiglu(ls, "ff", dim, hidden);
  const nn::gelu_mlp<double> gelu(lg, "mlp", dim, hidden, ops::gelu_approx::tanh);
  const nn::swiglu_mlp<double> fused(lf, "ff", dim, hidden, {}, nullptr, /*fused_gate_up=*/true);
  CHECK(lf.find("ff.w13.weight").shape == std::vector<index_t>{2 * hidden, dim});  // rows [gate | up]
  check_mlp(ls, swiglu, n, dim, 13, "swiglu_mlp");
  check_mlp(lg, gelu, n, dim, 16, "gelu_mlp");
  check_mlp(lf, fused, n, dim, 19, "swiglu_mlp with fused gate/up");
}

namespace {
/// backward(dx, accumulate) with accumulate = false into a NaN-filled dx, after the workspace
/// was filled with NaN (buffers the layer takes and writes, not zeroes, start as garbage),
/// must give the dx and the parameter gradients of accumulate = true into zeros.
template <class Bwd>
void check_write_equals_add(std::size_t params, std::size_t dx_size, nn::workspace<double>& ws, Bwd bwd, const char* name) {
  INFO(name);
  vec g_add(params, 0.0), dx_add(dx_size, 0.0), g_write(params, 0.0), dx_write(dx_size, std::nan(""));
  bwd(g_add, dx_add, true);
  ws.reset();
  auto junk = ws.take(ws.capacity());
  std::fill(junk.begin(), junk.end(), std::nan(""));
  ws.reset();
  bwd(g_write, dx_write, false);
  ws.reset();
  CHECK(dx_write == dx_add);  // NaN anywhere fails
  CHECK(g_write == g_add);
}
}  // namespace

TEST_CASE("backward with accumulate = false writes dx: linear, linear group, attention (GQA, prefix-LM), MLPs") {
  const index_t n = 6, in = 8;
  nn::workspace<double> ws;
  vec x = random_vector(n * in, 40);
  {
    nn::param_layout L(1);
    nn::linear<double> a(L, "a", in, 5, true), b(L, "b", in, 3);
    vec p = random_vector(L.size(), 41), r1 = random_vector(n * 5, 42), r2 = random_vector(n * 3, 43);
    check_write_equals_add(L.size(), x.size(), ws, [&](vec& g, vec& dx, bool acc) {
      a.backward(std::span(p), std::span(g), make_view(as_const(x).data(), n, in), make_view(as_const(r1).data(), n, 5),
                 make_view(dx.data(), n, in), ws, acc);
    }, "linear");
    check_write_equals_add(L.size(), x.size(), ws, [&](vec& g, vec& dx, bool acc) {
      nn::linear<double>::backward_all(std::span(p), std::span(g), make_view(as_const(x).data(), n, in),
                                       {{&a, make_view(as_const(r1).data(), n, 5)}, {&b, make_view(as_const(r2).data(), n, 3)}},
                                       make_view(dx.data(), n, in), ws, acc);
    }, "linear group");
  }
  {
    const index_t b = 2, s = n / 2;
    nn::param_layout L(1);
    nn::attention<double> att(L, "attn", {in, 4, 2, 8, 10000.0, ops::rope_style::interleaved, {2}, false});
    auto acts = att.make_activations(b, s);
    vec p = random_vector(L.size(), 44, 0.5), y(x.size()), r = random_vector(x.size(), 45);
    att.forward(std::span(p), make_view(as_const(x).data(), b, s, in), acts, make_view(y.data(), b, s, in), ws);
    check_write_equals_add(L.size(), x.size(), ws, [&](vec& g, vec& dx, bool acc) {
      att.backward(std::span(p), std::span(g), make_view(as_const(x).data(), b, s, in), acts,
                   make_view(as_const(r).data(), b, s, in), make_view(dx.data(), b, s, in), ws, acc);
    }, "attention");
  }
  auto mlp = [&](const nn::param_layout& L, const auto& m, std::uint64_t seed, const char* name) {
    auto acts = m.make_activations(n);
    vec p = random_vector(L.size(), seed), y(x.size()), r = random_vector(x.size(), seed + 1);
    ws.reset();
    m.forward(std::span(p), make_view(as_const(x).data(), n, in), acts, make_view(y.data(), n, in), ws);
    check_write_equals_add(L.size(), x.size(), ws, [&](vec& g, vec& dx, bool acc) {
      m.backward(std::span(p), std::span(g), make_view(as_const(x).data(), n, in), acts, make_view(as_const(r).data(), n, in),
                 make_view(dx.data(), n, in), ws, acc);
    }, name);
  };
  nn::param_layout ls(1), lg(1);
  mlp(ls, nn::swiglu_mlp<double>(ls, "ff", in, 12), 46, "swiglu_mlp");
  mlp(lg, nn::gelu_mlp<double>(lg, "mlp", in, 12), 48, "gelu_mlp");
}

TEST_CASE("embedding + cross-entropy layers: finite differences through a tiny classifier") {
  // logits = embedding(tokens): the loss gradient reaches the table through both layers.
  const index_t n = 4, v = 6;
  nn::param_layout L(1);
  nn::embedding<double> emb(L, "emb", v, v);
  nn::cross_entropy<double> ce;
  vec p = random_vector(L.size(), 19);
  std::vector<std::int32_t> tok{1, 5, 1, 0}, tgt{2, -100, 3, 5};
  vec logits(n * v);
  auto fwd = [&] {
    emb.forward(std::span(p), make_view(tok.data(), n), make_view(logits.data(), n, v));
    return ce.forward(make_view(logits.data(), n, v), make_view(tgt.data(), n));
  };
  fwd();
  vec dlogits(n * v, 0.0), g(p.size(), 0.0);
  ce.backward(make_view(logits.data(), n, v), make_view(tgt.data(), n), make_view(dlogits.data(), n, v));
  emb.backward(std::span(g), make_view(tok.data(), n), make_view(dlogits.data(), n, v));
  check_gradient(p, g, fwd, "embedding table");
}

TEST_CASE("inference: attention::forward_cached one token at a time and swiglu_mlp's packed forward equal the training forward") {
  // Oracle: the training layers' forward over the whole causal sequence (ops::attention_forward);
  // forward_cached sees the tokens one by one, each at its position, and attends over keys and
  // values the test keeps itself, with a naive softmax in double.
  const index_t s = 9, dim = 16, hidden = 24;
  struct variant {
    ops::rope_style rope;
    bool chatglm;  // fused q/k/v with biases, half-head rotary, fused gate/up
  };
  for (auto [rope, chatglm] : {variant{ops::rope_style::interleaved, false}, variant{ops::rope_style::half_split, false},
                               variant{ops::rope_style::interleaved, true}}) {
    CAPTURE(static_cast<int>(rope));
    CAPTURE(chatglm);
    nn::param_layout L;
    const nn::attention<float> att(L, "attn", {dim, 4, 2, s, 10000.0, rope, {}, false, chatglm, chatglm, chatglm ? 2 : 0});
    const nn::swiglu_mlp<float> mlp(L, "ff", dim, hidden, {}, nullptr, chatglm);
    std::vector<float> p(L.size()), x(s * dim);
    const vec pd = random_vector(p.size(), 41), xd = random_vector(x.size(), 42);
    std::copy(pd.begin(), pd.end(), p.begin());
    std::copy(xd.begin(), xd.end(), x.begin());
    const std::span<float> params(p);
    nn::workspace<float> ws;
    auto acts = att.make_activations(1, s);
    std::vector<float> want(s * dim), got(s * dim);
    att.forward(params, make_view(static_cast<const float*>(x.data()), 1, s, dim), acts, make_view(want.data(), 1, s, dim), ws);

    const auto packed = att.pack(params);
    const index_t hd = dim / 4, kvd = 2 * hd;
    std::vector<float> keys, values;  // [tokens so far, kv_heads * head_dim]
    comm::self_comm self;
    for (index_t t = 0; t < s; ++t) {
      const std::int64_t pos[1] = {t};
      auto attend = [&](auto q, auto k, auto v, auto out) {
        keys.insert(keys.end(), k.data(), k.data() + kvd);
        values.insert(values.end(), v.data(), v.data() + kvd);
        for (index_t h = 0; h < 4; ++h) {
          const index_t g = h / 2;
          std::vector<double> sc(static_cast<std::size_t>(t + 1));
          double mx = -1e300, sum = 0;
          for (index_t j = 0; j <= t; ++j) {
            double d = 0;
            for (index_t i = 0; i < hd; ++i) d += double(q(0, h, i)) * keys[j * kvd + g * hd + i];
            sc[j] = d / std::sqrt(double(hd)), mx = std::max(mx, sc[j]);
          }
          for (auto& e : sc) sum += (e = std::exp(e - mx));
          for (index_t i = 0; i < hd; ++i) {
            double o = 0;
            for (index_t j = 0; j <= t; ++j) o += sc[j] / sum * values[j * kvd + g * hd + i];
            out(0, h, i) = float(o);
          }
        }
      };
      ws.reset();
      att.forward_cached(self, packed, make_view(static_cast<const float*>(x.data()) + t * dim, 1, dim), pos, attend,
                         make_view(got.data() + t * dim, 1, dim), ws);
    }
    for (index_t i = 0; i < s * dim; ++i) CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-4));

    auto macts = mlp.make_activations(s);
    mlp.forward(params, make_view(static_cast<const float*>(x.data()), s, dim), macts, make_view(want.data(), s, dim), ws);
    ws.reset();
    mlp.forward(self, mlp.pack(params), make_view(static_cast<const float*>(x.data()), s, dim), make_view(got.data(), s, dim), ws);
    for (index_t i = 0; i < s * dim; ++i) CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-5));
  }
  nn::param_layout L;
  const nn::attention<float> att(L, "attn", {8, 2, 2, 4, 10000.0, ops::rope_style::interleaved, {}, false});
  std::vector<float> p(L.size()), x(8 * 3), y(8);
  nn::workspace<float> ws;
  comm::self_comm self;
  const std::int64_t pos[1] = {0};
  CHECK_THROWS_AS(att.forward_cached(self, att.pack(std::span<const float>(p)), make_view(static_cast<const float*>(x.data()), 1, 24),
                                     pos, [](auto...) {}, make_view(y.data(), 1, 8), ws),
                  loom::error);  // 24 features, the layer takes 8
  nn::param_layout Lb;
  const nn::attention<float> biased(Lb, "attn", {8, 2, 2, 4, 10000.0, ops::rope_style::interleaved, {}, true});
  std::vector<float> pb(Lb.size());
  CHECK_THROWS_WITH_AS(biased.pack(std::span<const float>(pb)), doctest::Contains("bias=true"), loom::error);
}
