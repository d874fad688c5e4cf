// The LLaMA cut over tp x pp thread ranks against the single-rank llama::model (same seed:
// the same parameters), and 3D training runs against the (1,1,1) run.
#include <llama/model/llama.hpp>
#include <llama/model3d/llama3d.hpp>
#include "train3d_suite.hpp"

#include <llama/train3d/train3d.hpp>

#include <loom/comm/mesh.hpp>
#include <loom/comm/self_comm.hpp>
#include <loom/comm/thread_comm.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>
#include <map>
#include <vector>

// A named namespace: this file is one of the trainer group's unity-built files
// (loom_add_test_group), whose helpers must not meet another file's.
namespace llama3d_model_test {

using loom::index_t;
using loom::comm::any_comm;

namespace {

llama::config small(bool tied = false) {
  llama::config c;
  c.dim = 32, c.n_layers = 3, c.n_heads = 4, c.n_kv_heads = 2, c.hidden_dim = 64, c.vocab = 32, c.seq_len = 8;
  c.tied_output = tied;
  return c;
}

std::vector<std::int32_t> ids(index_t n, std::uint64_t salt, index_t vocab) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((i * 7 + salt * 13 + i * i) % vocab);
  return v;
}

double max_diff(std::span<const double> a, std::span<const double> b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace

TEST_CASE("full_layout is Meta's checkpoint layout, and the stages of a pipeline split partition it") {
  for (bool tied : {false, true}) {
    const auto c = small(tied);
    // the oracle: Meta's names, shapes and order, written out here
    std::vector<std::pair<std::string, std::vector<index_t>>> want{{"tok_embeddings.weight", {c.vocab, c.dim}}};
    const index_t hd = c.head_dim();
    for (index_t l = 0; l < c.n_layers; ++l) {
      const std::string pre = "layers." + std::to_string(l) + ".";
      want.push_back({pre + "attention_norm.weight", {c.dim}});
      want.push_back({pre + "attention.wq.weight", {c.n_heads * hd, c.dim}});
      want.push_back({pre + "attention.wk.weight", {c.n_kv_heads * hd, c.dim}});
      want.push_back({pre + "attention.wv.weight", {c.n_kv_heads * hd, c.dim}});
      want.push_back({pre + "attention.wo.weight", {c.dim, c.n_heads * hd}});
      want.push_back({pre + "ffn_norm.weight", {c.dim}});
      want.push_back({pre + "feed_forward.w1.weight", {c.hidden_dim, c.dim}});
      want.push_back({pre + "feed_forward.w2.weight", {c.dim, c.hidden_dim}});
      want.push_back({pre + "feed_forward.w3.weight", {c.hidden_dim, c.dim}});
    }
    want.push_back({"norm.weight", {c.dim}});
    if (!tied) want.push_back({"output.weight", {c.vocab, c.dim}});
    const auto L = llama3d::full_layout(c);
    REQUIRE(L.entries().size() == want.size());
    std::size_t offset = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      const auto& e = L.entries()[i];
      CAPTURE(want[i].first);
      CHECK(e.name == want[i].first);
      CHECK(e.shape == want[i].second);
      CHECK(e.offset >= offset);  // in order, not overlapping (entries start on aligned offsets)
      offset = e.offset + e.numel;
    }
    llama::model<float> m(c);  // the single-rank model is that layout
    CHECK(m.layout().size() == L.size());
    // three pipeline stages hold every entry of the full layout once
    std::map<std::string, int> seen;
    loom::comm::self_comm self;
    for (int st = 0; st < 3; ++st) {
      llama3d::stage_model<float, float, loom::comm::self_comm> sm(c, self, st, 3);
      for (const auto& e : sm.layout().entries()) ++seen[e.name];
    }
    for (const auto& w : want)  // tied: the last stage holds a copy of the embedding (replica 1)
      CHECK(seen[w.first] == (tied && w.first == "tok_embeddings.weight" ? 2 : 1));
  }
}

namespace {
struct mesh_shape {
  int tp, pp;
};

/// Loss, gradients and parameters of c cut over tp x pp thread ranks against llama::model
/// (double): the same within 1e-12. Parameters: the counter-RNG init, plus (perturb) a
/// deterministic offset on every element so that biases and norms are not at their init.
void check_mesh(const llama::config& c, std::initializer_list<mesh_shape> shapes, bool perturb) {
  const index_t b = 2, s = 6, n = b * s;
  const int m = 2;  // micro-batches
  for (mesh_shape sh : shapes) {
    CAPTURE(sh.tp);
    CAPTURE(sh.pp);
    llama::model<double, double> full(c);
    full.init(42);
    if (perturb)
      for (std::size_t i = 0; i < full.params().size(); ++i) full.params()[i] += 0.05 * std::sin(0.37 * double(i));
    full.zero_grad();
    double loss = 0;
    for (int k = 0; k < m; ++k) {
      auto tok = ids(n, 2 * k, c.vocab), tgt = ids(n, 2 * k + 1, c.vocab);
      loss += full.forward(loom::make_view(static_cast<const std::int32_t*>(tok.data()), b, s), loom::make_view(static_cast<const std::int32_t*>(tgt.data()), b, s)) / m;
      full.backward(1.0 / m);
    }
    std::vector<double> err(static_cast<std::size_t>(sh.tp * sh.pp), 0), param_err(err.size(), 0);
    std::vector<double> losses(err.size(), 0);
    train3d_suite::run_ranks(sh.tp * sh.pp, [&](any_comm& world) {
      loom::comm::mesh<any_comm> mesh(world, 1, sh.tp, sh.pp);
      llama3d::stage_model<double, double, any_comm> st(c, mesh.tp(), mesh.coord().pp, sh.pp);
      const auto off = [&](const std::string& nm) { return full.layout().find(nm).offset; };
      st.init(42);
      if (perturb) loom::nn::tp::load_shards(st.shards(), std::span<const double>(full.params()), st.params(), off);
      double l = 0;
      for (int k = 0; k < m; ++k) {  // a sequential pipeline: forward through the stages, then backward
        auto tok = ids(n, 2 * k, c.vocab), tgt = ids(n, 2 * k + 1, c.vocab);
        if (!st.first_stage()) mesh.pp().recv(st.input(k, b, s), mesh.prev_stage(), k);
        l += st.forward(k, loom::make_view(static_cast<const std::int32_t*>(tok.data()), b, s), loom::make_view(static_cast<const std::int32_t*>(tgt.data()), b, s)) / m;
        if (!st.last_stage()) {
          mesh.pp().send(std::span<const double>(st.output(k)), mesh.next_stage(), k);
          mesh.pp().recv(st.output_grad(k), mesh.next_stage(), 100 + k);
        }
        st.backward(k, 1.0 / m);
        if (!st.first_stage()) mesh.pp().send(std::span<const double>(st.input_grad(k)), mesh.prev_stage(), 100 + k);
        st.release(k);
      }
      const auto r = static_cast<std::size_t>(world.rank());
      losses[r] = st.last_stage() ? l : loss;
      std::vector<double> want(st.size(), 0), wantp(st.size(), 0);
      loom::nn::tp::load_shards(st.shards(), std::span<const double>(full.grads()), std::span<double>(want), off);
      loom::nn::tp::load_shards(st.shards(), std::span<const double>(full.params()), std::span<double>(wantp), off);
      err[r] = max_diff(want, st.grads());
      param_err[r] = max_diff(wantp, std::span<const double>(st.params()));
    });
    for (std::size_t r = 0; r < err.size(); ++r) {
      CAPTURE(r);
      CHECK(param_err[r] == 0.0);  // the same parameters (counter-RNG values, or the loaded ones)
      CHECK(std::abs(losses[r] - loss) < 1e-12);
      CHECK(err[r] < 1e-12);
    }
  }
}
}  // namespace

TEST_CASE("tensor x pipeline LLaMA: loss and gradients equal llama::model") {
  struct shape { int tp, pp; bool tied; };
  for (shape sh : {shape{1, 1, false}, shape{2, 1, false}, shape{4, 1, false}, shape{1, 2, false}, shape{2, 2, false},
                   shape{1, 3, false}, shape{2, 1, true}, shape{4, 1, true}}) {
    CAPTURE(sh.tied);
    check_mesh(small(sh.tied), {{sh.tp, sh.pp}}, false);
  }
}

TEST_CASE("tensor x pipeline ChatGLM (fused q/k/v with biases, fused gate/up, half-head rotary) equals llama::model") {
  // tp 4 over 2 key/value groups: each rank holds a replica of its group's K and V rows and biases
  llama::config c = llama::config::chatglm();
  c.dim = 32, c.n_layers = 3, c.n_heads = 4, c.n_kv_heads = 2, c.hidden_dim = 64, c.vocab = 32, c.seq_len = 8;
  check_mesh(c, {{1, 1}, {2, 1}, {4, 1}, {1, 2}, {2, 2}, {1, 3}}, true);
}

TEST_CASE("bad meshes and splits are refused with an error naming them") {
  train3d_suite::run_ranks(1, [](any_comm& w) {
    auto c = small();
    c.n_heads = 4, c.n_kv_heads = 4;
    CHECK_THROWS_WITH_AS((llama3d::stage_model<float, float, any_comm>(c, w, 0, 4)),
                         doctest::Contains("n_layers (3) must be >= pp (4)"), loom::error);
    llama3d::train_options o;
    o.mesh = {2, 1, 1};
    CHECK_THROWS_WITH_AS((llama3d::trainer<float, float, any_comm>(w, c, o, loom::default_resource<loom::host>())),
                         doctest::Contains("must equal the world size 1"), loom::error);
    o.mesh = {1, 1, 1};
    o.schedule = "zigzag";
    CHECK_THROWS_WITH_AS((llama3d::trainer<float, float, any_comm>(w, c, o, loom::default_resource<loom::host>())),
                         doctest::Contains("schedule 'zigzag' is not supported"), loom::error);
    o.schedule = "interleaved";
    o.chunks = 4;  // 1 stage x 4 chunks > 3 layers
    CHECK_THROWS_WITH_AS((llama3d::trainer<float, float, any_comm>(w, c, o, loom::default_resource<loom::host>())),
                         doctest::Contains("n_layers (3) must be >= pp x chunks (1 x 4)"), loom::error);
  });
  train3d_suite::run_ranks(4, [](any_comm& w) {
    auto c = small();
    c.n_heads = 6, c.dim = 36, c.n_kv_heads = 6;
    CHECK_THROWS_WITH_AS((llama3d::stage_model<float, float, any_comm>(c, w, 0, 1)),
                         doctest::Contains("n_heads (6) must be divisible by tp (4)"), loom::error);
  });
}

}  // namespace llama3d_model_test
