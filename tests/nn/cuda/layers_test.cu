// nn's layers on the cuda tag (a CUDA workspace or context: nn/cuda/context.cuh) against the
// same layer objects on the host, on random inputs: the layer code is written once, so what
// this shows is that each device's ops, launched in the layers' order on the rank's stream,
// give the host's numbers. The host layers are the oracle (their gradients are checked
// against finite differences in test_nn_layers). Tolerances: fp32 throughout (cuBLAS in
// strict fp32, no TF32), so only summation order differs: 1e-4 relative and absolute.
#include <loom/comm/thread_comm.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/cuda/memory.hpp>
#include <loom/core/dtype.hpp>
#include <loom/nn/attention.hpp>
#include <loom/nn/cross_entropy.hpp>
#include <loom/nn/cuda/context.cuh>
#include <loom/nn/embedding.hpp>
#include <loom/nn/linear.hpp>
#include <loom/nn/mlp.hpp>
#include <loom/nn/norm.hpp>
#include <loom/nn/parameters.hpp>
#include <loom/nn/workspace.hpp>

#include <doctest/doctest.h>

#include "ops/cuda/compare.hpp"
#include "ops/cuda/transfer.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace {

using loom::host;
using loom::index_t;
using loom::make_view;
namespace nn = loom::nn;
using loom::testing::download;
using loom::testing::mview;
using loom::testing::upload;

constexpr double tol = 1e-4;

template <class T>
std::span<const T> cspan(const loom::buffer<T, loom::cuda>& b) {
  return {b.data(), b.size()};
}
template <class T>
std::span<T> mspan(loom::buffer<T, loom::cuda>& b) {
  return {b.data(), b.size()};
}

/// Two linear layers reading one x (one with a bias), forward_all and backward_all (weight,
/// bias and input gradients, added into random ones, dy scaled), parameters stored as P.
template <class P>
void check_linears() {
  INFO("parameters stored as " << loom::dtype_name(loom::dtype_of<P>));
  const index_t n = 24, in = 40, out_a = 56, out_b = 32;
  nn::param_layout layout;
  const nn::linear<float> a(layout, "a", in, out_a, /*bias=*/true), b(layout, "b", in, out_b);
  const auto params = random_vector<P>(layout.size(), 1, 0.2f);
  const auto x = random_vector<float>(std::size_t(n * in), 2), dya = random_vector<float>(std::size_t(n * out_a), 3),
             dyb = random_vector<float>(std::size_t(n * out_b), 4);
  const auto grads0 = random_vector<float>(layout.size(), 5), dx0 = random_vector<float>(x.size(), 6);

  // host
  std::vector<float> ya(std::size_t(n * out_a)), yb(std::size_t(n * out_b)), grads = grads0, dx = dx0;
  nn::workspace<float> hws;
  const std::span<const P> hp(params);
  nn::linear<float>::forward_all(hp, make_view(x.data(), n, in), {{&a, make_view(ya.data(), n, out_a)}, {&b, make_view(yb.data(), n, out_b)}},
                                 hws);
  nn::linear<float>::backward_all(hp, std::span<float>(grads), make_view(x.data(), n, in),
                                  {{&a, make_view(dya.data(), n, out_a)}, {&b, make_view(dyb.data(), n, out_b)}},
                                  make_view(dx.data(), n, in), hws, /*accumulate=*/true, 0.5f);

  // device
  nn::device_context<loom::cuda> ctx;
  nn::workspace<float, loom::cuda> ws(ctx);
  auto dp = upload(params);
  auto dxin = upload(x), ddya = upload(dya), ddyb = upload(dyb), dgrads = upload(grads0), ddx = upload(dx0);
  auto dya_out = upload(std::vector<float>(ya.size(), -7.f)), dyb_out = upload(std::vector<float>(yb.size(), -7.f));
  nn::linear<float>::forward_all(cspan(dp), mview(dxin, n, in), {{&a, mview(dya_out, n, out_a)}, {&b, mview(dyb_out, n, out_b)}},
                                 ws);
  nn::linear<float>::backward_all(cspan(dp), mspan(dgrads), mview(dxin, n, in),
                                  {{&a, mview(ddya, n, out_a)}, {&b, mview(ddyb, n, out_b)}}, mview(ddx, n, in), ws,
                                  /*accumulate=*/true, 0.5f);
  require_close(download(dya_out), ya, tol, tol, "y of the layer with a bias");
  require_close(download(dyb_out), yb, tol, tol, "y of the layer without");
  require_close(download(dgrads), grads, tol, tol, "weight and bias gradients");
  require_close(download(ddx), dx, tol, tol, "input gradient");

  // a single layer's backward writing dx (accumulate false) over garbage
  std::vector<float> dx_w(x.size());
  a.backward(hp, std::span<float>(), make_view(x.data(), n, in), make_view(dya.data(), n, out_a), make_view(dx_w.data(), n, in), hws,
             /*accumulate=*/false);
  auto ddx_w = upload(std::vector<float>(x.size(), 1e30f));
  a.backward(cspan(dp), std::span<float>(), mview(dxin, n, in), mview(ddya, n, out_a), mview(ddx_w, n, in), ws, false);
  require_close(download(ddx_w), dx_w, tol, tol, "a frozen-weight layer's written dx");
}

}  // namespace

TEST_CASE("linear layers on the cuda tag equal the host's (biases, a batch of layers, gradients added, 16-bit weights)") {
  check_linears<float>();
  check_linears<loom::bfloat16>();
}

TEST_CASE("an RMSNorm + SwiGLU MLP block on the cuda tag equals the host's, forward and backward") {
  const index_t n = 20, dim = 32, hidden = 72;
  nn::param_layout layout;
  const nn::rmsnorm<float> norm(layout, "norm", dim, 1e-5f);
  const nn::swiglu_mlp<float> mlp(layout, "mlp", dim, hidden);
  auto params = random_vector<float>(layout.size(), 11, 0.2f);
  for (index_t i = 0; i < dim; ++i) params[norm.weight().offset + std::size_t(i)] += 1.f;  // a norm's gain near 1
  const auto x = random_vector<float>(std::size_t(n * dim), 12), dy = random_vector<float>(x.size(), 13);
  const auto grads0 = random_vector<float>(layout.size(), 14), dx0 = random_vector<float>(x.size(), 15);

  // host: xn = norm(x), y = mlp(xn); backward through both, dx added into dx0
  std::vector<float> xn(x.size()), rstd(static_cast<std::size_t>(n)), y(x.size()), dxn(x.size()), grads = grads0, dx = dx0;
  nn::workspace<float> hws;
  auto acts = mlp.make_activations(n);
  const std::span<const float> hp(params);
  norm.forward(hp, make_view(x.data(), n, dim), make_view(xn.data(), n, dim), make_view(rstd.data(), n));
  mlp.forward(hp, make_view(xn.data(), n, dim), acts, make_view(y.data(), n, dim), hws);
  mlp.backward(hp, std::span<float>(grads), make_view(xn.data(), n, dim), acts, make_view(dy.data(), n, dim),
               make_view(dxn.data(), n, dim), hws, /*accumulate=*/false);
  norm.backward(hp, std::span<float>(grads), make_view(dxn.data(), n, dim), make_view(x.data(), n, dim),
                make_view(rstd.data(), n), make_view(dx.data(), n, dim));

  // device
  nn::device_context<loom::cuda> ctx;
  nn::workspace<float, loom::cuda> ws(ctx);
  auto dacts = mlp.make_activations<loom::cuda>(n);
  auto dp = upload(params), dxin = upload(x), ddy = upload(dy), dgrads = upload(grads0), ddx = upload(dx0);
  auto dxn_ = upload(std::vector<float>(x.size(), -7.f)), drstd = upload(std::vector<float>(rstd.size(), -7.f)),
       dyo = upload(std::vector<float>(x.size(), -7.f)), ddxn = upload(std::vector<float>(x.size(), 1e30f));
  norm.forward(ctx, cspan(dp), mview(dxin, n, dim), mview(dxn_, n, dim), mview(drstd, n));
  mlp.forward(cspan(dp), mview(dxn_, n, dim), dacts, mview(dyo, n, dim), ws);
  mlp.backward(cspan(dp), mspan(dgrads), mview(dxn_, n, dim), dacts, mview(ddy, n, dim), mview(ddxn, n, dim), ws, false);
  norm.backward(ctx, cspan(dp), mspan(dgrads), mview(ddxn, n, dim), mview(dxin, n, dim), mview(drstd, n), mview(ddx, n, dim));
  require_close(download(dxn_), xn, tol, tol, "normalised x");
  require_close(download(drstd), rstd, tol, tol, "rstd");
  require_close(download(dyo), y, tol, tol, "MLP output");
  require_close(download(dacts.hidden), std::vector<float>(acts.hidden.data(), acts.hidden.data() + acts.hidden.size()), tol, tol,
                "MLP hidden activations");
  require_close(download(ddxn), dxn, tol, tol, "gradient into the norm");
  require_close(download(dgrads), grads, tol, tol, "parameter gradients (norm gain, w1, w2, w3)");
  require_close(download(ddx), dx, tol, tol, "input gradient");
}

namespace {

/// Attention over x [batch, seq, dim], forward and backward (gradients added into random
/// ones; dx written), on both devices.
void check_attention(const nn::attention_config& c, index_t batch, index_t seq) {
  INFO("heads " << c.n_heads << "/" << c.n_kv_heads << ", head_dim " << c.head_dim() << ", rotary_dim " << c.rotary_dim
                << ", prefix " << c.mask.prefix << ", qkv bias " << c.qkv_bias << ", fused " << c.fused_qkv);
  nn::param_layout layout;
  const nn::attention<float> att(layout, "att", c);
  const auto params = random_vector<float>(layout.size(), 21, 0.3f);
  const auto nx = std::size_t(batch * seq * c.dim);
  const auto x = random_vector<float>(nx, 22), dy = random_vector<float>(nx, 23), grads0 = random_vector<float>(layout.size(), 24);
  std::vector<float> y(nx), dx(nx), grads = grads0;
  nn::workspace<float> hws;
  auto acts = att.make_activations(batch, seq);
  const std::span<const float> hp(params);
  att.forward(hp, make_view(x.data(), batch, seq, c.dim), acts, make_view(y.data(), batch, seq, c.dim), hws);
  att.backward(hp, std::span<float>(grads), make_view(x.data(), batch, seq, c.dim), acts, make_view(dy.data(), batch, seq, c.dim),
               make_view(dx.data(), batch, seq, c.dim), hws, /*accumulate=*/false);

  nn::device_context<loom::cuda> ctx;
  nn::workspace<float, loom::cuda> ws(ctx);
  auto dacts = att.make_activations<loom::cuda>(batch, seq);
  auto dp = upload(params), dxin = upload(x), ddy = upload(dy), dgrads = upload(grads0);
  auto dyo = upload(std::vector<float>(nx, -7.f)), ddx = upload(std::vector<float>(nx, 1e30f));
  att.forward(cspan(dp), mview(dxin, batch, seq, c.dim), dacts, mview(dyo, batch, seq, c.dim), ws);
  att.backward(cspan(dp), mspan(dgrads), mview(dxin, batch, seq, c.dim), dacts, mview(ddy, batch, seq, c.dim),
               mview(ddx, batch, seq, c.dim), ws, /*accumulate=*/false);
  require_close(download(dacts.q), std::vector<float>(acts.q.data(), acts.q.data() + acts.q.size()), tol, tol,
                "rotated queries");
  require_close(download(dyo), y, tol, tol, "attention output");
  require_close(download(dgrads), grads, tol, tol, "projection gradients");
  require_close(download(ddx), dx, tol, tol, "input gradient");
}

}  // namespace

TEST_CASE("attention on the cuda tag equals the host's (GQA and MQA, both rotary conventions, partial rotary, biases, prefix-LM)") {
  nn::attention_config c;
  c.dim = 64, c.n_heads = 4, c.n_kv_heads = 2, c.max_seq = 16;
  c.rope = loom::ops::rope_style::half_split;
  check_attention(c, 2, 9);
  c.rope = loom::ops::rope_style::interleaved, c.n_kv_heads = 1, c.mask.prefix = 4;  // MQA, prefix-LM
  check_attention(c, 1, 12);
  c.n_kv_heads = 2, c.rotary_dim = 8, c.qkv_bias = true, c.fused_qkv = true, c.mask.prefix = 0;  // ChatGLM's layout
  c.rope = loom::ops::rope_style::half_split;
  check_attention(c, 2, 7);
}

namespace {

/// A one-block decoder assembled from nn's layers: embedding, [RMSNorm, attention, residual,
/// RMSNorm, SwiGLU MLP, residual], the final RMSNorm, the output projection, cross-entropy.
/// step() is one training step's forward and backward, written once for both devices (its
/// device is its workspace's), as the decoder's own step will be.
struct tiny_decoder {
  index_t vocab = 50, dim = 32, hidden = 48;
  nn::attention_config ac{.dim = 32, .n_heads = 4, .n_kv_heads = 2, .max_seq = 16, .rope = loom::ops::rope_style::half_split};
  nn::param_layout layout;
  nn::embedding<float> emb{layout, "emb", vocab, dim};
  nn::rmsnorm<float> n1{layout, "n1", dim, 1e-5f};
  nn::attention<float> att{layout, "att", ac};
  nn::rmsnorm<float> n2{layout, "n2", dim, 1e-5f};
  nn::swiglu_mlp<float> mlp{layout, "mlp", dim, hidden};
  nn::rmsnorm<float> nf{layout, "nf", dim, 1e-5f};
  nn::linear<float> head{layout, "head", dim, vocab};

  /// Returns the mean loss; grads added into; logits left in `logits` [b * s, vocab].
  template <class D>
  float step(nn::workspace<float, D>& ws, std::span<const float> p, std::span<float> g,
             loom::tensor_view<const std::int32_t, D, 1> tokens, loom::tensor_view<const std::int32_t, D, 1> targets,
             index_t b, index_t s, loom::buffer<float, D>& logits) const {
    const auto& ctx = ws.context();
    const index_t n = b * s;
    const auto buf = [&](index_t k) { return loom::buffer<float, D>(static_cast<std::size_t>(k)); };
    auto x = buf(n * dim), xn1 = buf(n * dim), r1 = buf(n), h = buf(n * dim), xn2 = buf(n * dim), r2 = buf(n),
         out = buf(n * dim), xf = buf(n * dim), rf = buf(n), dlogits = buf(n * vocab), dxf = buf(n * dim),
         dout = buf(n * dim), dxn2 = buf(n * dim), dxn1 = buf(n * dim);
    auto aa = att.make_activations<D>(b, s);
    auto ma = mlp.make_activations<D>(n);
    const auto v2 = [](loom::buffer<float, D>& B, index_t r, index_t c) { return B.view(r, c); };
    const auto v3 = [&](loom::buffer<float, D>& B) { return B.view(b, s, dim); };
    const auto add = [&](loom::buffer<float, D>& y, loom::buffer<float, D>& xb) { ctx.add(y.view(), xb.view()); };
    nn::cross_entropy<float, D> ce(ctx);

    emb.forward(ctx, p, tokens, v2(x, n, dim));
    n1.forward(ctx, p, v2(x, n, dim), v2(xn1, n, dim), r1.view());
    att.forward(p, v3(xn1), aa, v3(h), ws);
    add(h, x);
    n2.forward(ctx, p, v2(h, n, dim), v2(xn2, n, dim), r2.view());
    mlp.forward(p, v2(xn2, n, dim), ma, v2(out, n, dim), ws);
    add(out, h);
    nf.forward(ctx, p, v2(out, n, dim), v2(xf, n, dim), rf.view());
    head.forward(p, v2(xf, n, dim), v2(logits, n, vocab), ws);
    const float loss = ce.forward_backward(v2(logits, n, vocab), targets, v2(dlogits, n, vocab));

    head.backward(p, g, v2(xf, n, dim), v2(dlogits, n, vocab), v2(dxf, n, dim), ws, /*accumulate=*/false);
    ctx.fill(dout.view(), 0.f);  // the norms' backward adds into dx
    nf.backward(ctx, p, g, v2(dxf, n, dim), v2(out, n, dim), rf.view(), v2(dout, n, dim));
    // dout is the gradient at out = h + mlp(...): it flows into h as it is, plus the MLP branch
    mlp.backward(p, g, v2(xn2, n, dim), ma, v2(dout, n, dim), v2(dxn2, n, dim), ws, /*accumulate=*/false);
    n2.backward(ctx, p, g, v2(dxn2, n, dim), v2(h, n, dim), r2.view(), v2(dout, n, dim));
    att.backward(p, g, v3(xn1), aa, v3(dout), v3(dxn1), ws, /*accumulate=*/false);
    n1.backward(ctx, p, g, v2(dxn1, n, dim), v2(x, n, dim), r1.view(), v2(dout, n, dim));
    emb.backward(ctx, g, tokens, v2(dout, n, dim));
    return loss;
  }
};

}  // namespace

TEST_CASE("a one-block decoder's training step written once runs on the cuda tag and equals the host's (loss, logits, every gradient)") {
  const tiny_decoder m;
  const index_t b = 2, s = 7, n = b * s;
  const auto params = random_vector<float>(m.layout.size(), 31, 0.3f);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n)), targets(tokens.size());
  for (index_t i = 0; i < n; ++i) tokens[std::size_t(i)] = std::int32_t((i * 17 + 3) % m.vocab), targets[std::size_t(i)] = std::int32_t((i * 29 + 11) % m.vocab);
  targets[5] = -100;  // ignored
  const auto grads0 = random_vector<float>(m.layout.size(), 32);

  std::vector<float> grads = grads0;
  nn::workspace<float> hws;
  loom::buffer<float> logits(static_cast<std::size_t>(n * m.vocab));
  const float loss = m.step(hws, std::span<const float>(params), std::span<float>(grads), make_view(as_const(tokens).data(), n),
                            make_view(as_const(targets).data(), n), b, s, logits);

  nn::device_context<loom::cuda> ctx;
  nn::workspace<float, loom::cuda> ws(ctx);
  auto dp = upload(params), dgrads = upload(grads0);
  const auto dtok = upload(tokens), dtgt = upload(targets);
  loom::buffer<float, loom::cuda> dlogits(logits.size());
  const float dloss = m.step(ws, cspan(dp), mspan(dgrads), make_view<loom::cuda>(dtok.data(), n), make_view<loom::cuda>(dtgt.data(), n),
                             b, s, dlogits);
  CHECK(dloss == doctest::Approx(loss).epsilon(1e-5));
  require_close(download(dlogits), std::vector<float>(logits.data(), logits.data() + logits.size()), tol, tol, "logits");
  require_close(download(dgrads), grads, tol, tol, "every parameter's gradient");
}

TEST_CASE("a layer on the cuda tag refuses what it cannot run, naming it") {
  nn::param_layout layout;
  nn::linear<float> l(layout, "l", 8, 4);
  struct never : nn::frozen_op<float> {
    void forward(loom::ops::in_view<float, 2>, loom::tensor_view<float, host, 2>, nn::workspace<float>&) const override {}
    void backward(loom::ops::in_view<float, 2>, loom::ops::in_view<float, 2>, loom::tensor_view<float, host, 2>, bool,
                  nn::workspace<float>&) const override {}
  } op;
  l.set_frozen(&op);
  nn::device_context<loom::cuda> ctx;
  nn::workspace<float, loom::cuda> ws(ctx);
  auto p = upload(std::vector<float>(layout.size(), 0.f)), x = upload(std::vector<float>(2 * 8, 0.f)),
       y = upload(std::vector<float>(2 * 4, 0.f));
  CHECK_THROWS_WITH_AS(l.forward(cspan(p), mview(x, 2, 8), mview(y, 2, 4), ws),
                       doctest::Contains("a frozen op (LoRA/QLoRA base) runs on the host only, not on cuda"), loom::error);
  l.set_frozen(nullptr);
  CHECK_THROWS_WITH_AS(l.forward(cspan(p), mview(y, 2, 4), mview(y, 2, 4), ws),
                       doctest::Contains("nn::linear: x has 4 features, the layer takes 8"), loom::error);
  // a token outside the vocabulary and a target outside it, named as on the host
  nn::param_layout el;
  const nn::embedding<float> e(el, "e", 5, 4);
  auto ep = upload(std::vector<float>(el.size(), 0.f)), eo = upload(std::vector<float>(8, 0.f));
  auto tok = upload(std::vector<std::int32_t>{1, 7});
  CHECK_THROWS_WITH_AS(e.forward(ctx, cspan(ep), make_view<loom::cuda>(tok.data(), 2), mview(eo, 2, 4)),
                       doctest::Contains("token id 7 at position 1 is outside the vocabulary [0, 5)"), loom::error);
  nn::cross_entropy<float, loom::cuda> ce(ctx);
  CHECK_THROWS_WITH_AS(ce.forward(mview(eo, 2, 4), make_view<loom::cuda>(tok.data(), 2)),
                       doctest::Contains("target 7 at position 1 is outside the vocabulary [0, 4)"), loom::error);
  CHECK_THROWS_WITH_AS(ce.backward(mview(eo, 4, 2), make_view<loom::cuda>(tok.data(), 2), mview(eo, 4, 2)),
                       doctest::Contains("nn::cross_entropy: backward for 4 rows before a forward with as many"), loom::error);
  // a tensor group of two ranks: its reductions would hand device memory to a host communicator
  nn::param_layout tl;
  const nn::swiglu_mlp<float> half(tl, "mlp", 8, 16, nn::tp::tp_rank{0, 2});
  auto acts2 = half.make_activations<loom::cuda>(2);
  auto tp_p = upload(std::vector<float>(tl.size(), 0.f)), tp_x = upload(std::vector<float>(16, 0.f)),
       tp_y = upload(std::vector<float>(16, 0.f));
  std::vector<std::string> what(2);
  loom::comm::run_ranks(2, [&](loom::comm::thread_comm& c) {
    try {  // refused before any launch (the emulator runs one launch at a time)
      half.forward(c, cspan(tp_p), mview(tp_x, 2, 8), acts2, mview(tp_y, 2, 8), ws);
    } catch (const loom::error& e) {
      what[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  for (const auto& w : what)
    CHECK(w.find("nn::swiglu_mlp: on cuda a tensor-parallel group of one rank for now, got tp=2") != std::string::npos);
  auto small = upload(std::vector<float>(3, 0.f));
  CHECK_THROWS_WITH_AS(l.forward(std::span<const float>(small.data(), small.size()), mview(x, 2, 8), mview(y, 2, 4), ws),
                       doctest::Contains("is too small for a parameter"), loom::error);
}
