// Acceptance of the paged-KV engine: greedy generation of 32 concurrent sequences of
// different prompt and output lengths equals, token for token, a contiguous-KV reference that
// runs each sequence alone, one token at a time — with chunked prefill, with prefix sharing,
// and across forced preemptions. The reference keeps keys and values in one contiguous array
// per layer and knows nothing of blocks, tables, schedulers, caches or the layer objects: it
// reads the tensors by name and runs the host kernels one token at a time, its GEMMs unpacked
// (ops::gemm on the weights as they are): on
// loom's sgemm kernels a row's bits do not depend on the batch, so equality is demanded; on
// the BLAS path (no AVX2) that does not hold and the token comparison is skipped by name.
#include <doctest/doctest.h>

#include "engine_requests.hpp"
#include "llama_engine.hpp"

#include <support/sgemm_kernels.hpp>

#include <loom/kv/paged_attention.hpp>
#include <loom/ops/host/activation.hpp>
#include <loom/ops/host/gemm.hpp>
#include <loom/ops/host/norm.hpp>
#include <loom/ops/host/rope.hpp>

#include <vector>

using namespace llama;
using loom::kv::request;
using loom::kv::token_id;

namespace {

// y [1, out] = x [1, in] W^T for W [out, in] as stored (no packing).
void matvec(const float* x, const float* w, float* y, std::int64_t in, std::int64_t out) {
  loom::ops::gemm(loom::host{}, loom::make_view(x, 1, in), loom::make_view(w, out, in).transpose(0, 1), loom::make_view(y, 1, out));
}
void rmsnorm(const float* x, const float* g, float* y, std::int64_t n, float eps) {
  float rstd = 0;
  loom::ops::rmsnorm_forward(loom::host{}, loom::make_view(x, 1, n), loom::make_view(g, n), loom::make_view(y, 1, n),
                             loom::make_view(&rstd, 1), eps);
}

// Greedy generation of one sequence with contiguous KV.
std::vector<token_id> reference_generate(const flat_weights& w, std::vector<token_id> tokens, int max_new) {
  const config& c = w.cfg;
  const std::int64_t D = c.dim, hd = c.head_dim(), KD = c.n_kv_heads * hd, H = c.hidden_dim;
  const float eps = static_cast<float>(c.norm_eps);
  const loom::ops::rope_table<float> rope(c.seq_len, hd, c.rope_theta);
  const auto style = c.rope;
  auto t = [&](const std::string& name) { return w.tensor(name).data(); };
  // K, V: [layers][position][kv_dim], contiguous.
  std::vector<std::vector<float>> K(static_cast<std::size_t>(c.n_layers)), V(static_cast<std::size_t>(c.n_layers));
  std::vector<float> x(D), xb(D), q(D), k(KD), v(KD), att(D), h1(H), h3(H), hs(H), logits(static_cast<std::size_t>(c.vocab)), acc(hd);
  std::vector<token_id> out;
  for (std::int64_t pos = 0; pos < static_cast<std::int64_t>(tokens.size()); ++pos) {
    const float* e = t("tok_embeddings.weight") + tokens[static_cast<std::size_t>(pos)] * D;
    std::copy(e, e + D, x.begin());
    const std::int64_t p[1] = {pos};
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string L = "layers." + std::to_string(l) + ".";
      rmsnorm(x.data(), t(L + "attention_norm.weight"), xb.data(), D, eps);
      matvec(xb.data(), t(L + "attention.wq.weight"), q.data(), D, D);
      matvec(xb.data(), t(L + "attention.wk.weight"), k.data(), D, KD);
      matvec(xb.data(), t(L + "attention.wv.weight"), v.data(), D, KD);
      loom::ops::rope_forward(loom::host{}, loom::make_view(q.data(), 1, c.n_heads, hd), rope, style, std::span<const std::int64_t>(p));
      loom::ops::rope_forward(loom::host{}, loom::make_view(k.data(), 1, c.n_kv_heads, hd), rope, style, std::span<const std::int64_t>(p));
      auto& Kl = K[static_cast<std::size_t>(l)];
      auto& Vl = V[static_cast<std::size_t>(l)];
      Kl.insert(Kl.end(), k.begin(), k.end());
      Vl.insert(Vl.end(), v.begin(), v.end());
      const std::int64_t group = c.n_heads / c.n_kv_heads;
      for (std::int64_t h = 0; h < c.n_heads; ++h) {
        const std::int64_t g = h / group;
        auto key = [&](std::int64_t j) { return Kl.data() + j * KD + g * hd; };
        auto val = [&](std::int64_t j) { return Vl.data() + j * KD + g * hd; };
        loom::kv::attend_row(q.data() + h * hd, pos + 1, static_cast<std::int32_t>(hd), 1.f / std::sqrt(float(hd)), key,
                             val, acc.data(), att.data() + h * hd);
      }
      matvec(att.data(), t(L + "attention.wo.weight"), xb.data(), D, D);
      for (std::int64_t i = 0; i < D; ++i) x[static_cast<std::size_t>(i)] += xb[static_cast<std::size_t>(i)];
      rmsnorm(x.data(), t(L + "ffn_norm.weight"), xb.data(), D, eps);
      matvec(xb.data(), t(L + "feed_forward.w1.weight"), h1.data(), D, H);
      matvec(xb.data(), t(L + "feed_forward.w3.weight"), h3.data(), D, H);
      loom::ops::swiglu_forward(loom::host{}, loom::make_view(static_cast<const float*>(h1.data()), H),
                                loom::make_view(static_cast<const float*>(h3.data()), H), loom::make_view(hs.data(), H));
      matvec(hs.data(), t(L + "feed_forward.w2.weight"), xb.data(), H, D);
      for (std::int64_t i = 0; i < D; ++i) x[static_cast<std::size_t>(i)] += xb[static_cast<std::size_t>(i)];
    }
    if (pos + 1 < static_cast<std::int64_t>(tokens.size())) continue;  // still reading the prompt
    rmsnorm(x.data(), t("norm.weight"), xb.data(), D, eps);
    matvec(xb.data(), t(c.tied_output ? "tok_embeddings.weight" : "output.weight"), logits.data(), D, c.vocab);
    const token_id t = static_cast<token_id>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(t);
    if (static_cast<int>(out.size()) == max_new) break;
    tokens.push_back(t);
  }
  return out;
}

using llama_generate_test::make_requests;

config test_config() {
  config c;
  c.dim = 64, c.hidden_dim = 160, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.vocab = 97;
  c.seq_len = 128;
  c.tied_output = false;  // tied random embeddings make a model that repeats its input
  return c;
}

}  // namespace

TEST_CASE("paged generation equals contiguous-KV reference for 32 concurrent sequences, on each of loom's sgemm kernels") {
  loom::test::for_each_sgemm_kernel("paged = contiguous", [&](loom::ops::host_sgemm kernel) {
    if (!loom::test::split_invariant(kernel)) {
      MESSAGE("skipped: paged = contiguous token for token on the blas sgemm kernel (its rows depend on the batch)");
      return;
    }
    const config c = test_config();
    const flat_weights w = flat_weights::random(c, 5);
    auto reqs = make_requests(c, 32);
    std::vector<std::vector<token_id>> ref;
    for (auto& r : reqs) ref.push_back(reference_generate(w, r.prompt, r.max_new_tokens));

    struct scenario {
      const char* name;
      std::int32_t blocks, block_size, budget;
      bool prefix;
    };
    for (scenario s : {scenario{"large pool, chunked prefill, prefix sharing", 400, 16, 64, true},
                       scenario{"small pool: forced preemption", 40, 8, 80, true},
                       scenario{"no prefix cache, one-token blocks", 2000, 1, 48, false}}) {
      CAPTURE(s.name);
      engine_config ec;
      ec.num_blocks = s.blocks;
      ec.block_size = s.block_size;
      ec.scheduler.max_num_batched_tokens = s.budget;
      ec.scheduler.max_num_seqs = 32;
      ec.scheduler.enable_prefix_caching = s.prefix;
      llama_engine<float> eng(w, ec);
      auto out = eng.generate(reqs);
      for (std::size_t i = 0; i < reqs.size(); ++i) {
        CAPTURE(i);
        CHECK(out[reqs[i].id] == ref[i]);
      }
      std::size_t longest = 0;
      for (auto& r : reqs) longest = std::max(longest, r.prompt.size());
      CHECK(static_cast<std::int32_t>(longest) > s.budget);  // so some prompts were prefilled in chunks
      if (s.blocks == 40) CHECK(eng.scheduler().num_preemptions() > 0);
      if (s.prefix) CHECK(eng.allocator().num_hits() > 0);
      CHECK(eng.allocator().num_free() == s.blocks);
    }
  });
}

TEST_CASE("seeded sampling is reproducible regardless of batching and preemption") {
  const config c = test_config();
  const flat_weights w = flat_weights::random(c, 6);
  auto reqs = make_requests(c, 12);
  for (auto& r : reqs) {
    r.sampling.temperature = 0.9f;
    r.sampling.top_p = 0.95f;
    r.sampling.top_k = 40;
    r.sampling.seed = 3 * r.id + 1;
  }
  // Each alone with a large pool vs all together in a tiny pool.
  std::map<std::uint64_t, std::vector<token_id>> alone;
  for (auto& r : reqs) {
    engine_config ec;
    ec.num_blocks = 64;
    llama_engine<float> eng(w, ec);
    alone[r.id] = eng.generate({r})[r.id];
  }
  engine_config ec;
  ec.num_blocks = 24;
  ec.block_size = 8;
  ec.scheduler.max_num_batched_tokens = 40;
  llama_engine<float> eng(w, ec);
  auto together = eng.generate(reqs);
  CHECK(eng.scheduler().num_preemptions() > 0);
  for (auto& r : reqs) CHECK(together[r.id] == alone[r.id]);
}

TEST_CASE("engine rejects token ids outside the vocabulary") {
  const config c = test_config();
  const flat_weights w = flat_weights::random(c, 5);
  llama_engine<float> eng(w, {});
  request r;
  r.prompt = {1, 2, static_cast<token_id>(c.vocab)};
  CHECK_THROWS_AS(eng.add(r), loom::error);
}

TEST_CASE("weights that do not fit their config, and checkpoints that lack a tensor, are refused by name") {
  const config c = test_config();
  flat_weights w = flat_weights::random(c, 5);
  w.params = loom::buffer<float>(w.params.size() - 16);  // one aligned tensor slot short
  CHECK_THROWS_WITH_AS(llama_engine<float>(w, {}), doctest::Contains("llama_engine: the weights hold"), loom::error);

  const flat_weights full = flat_weights::random(c, 5);
  loom::io::tensor_map m;
  auto put = [&](const loom::nn::param_info& e) {
    loom::io::named_tensor t;
    t.shape.assign(e.shape.begin(), e.shape.end());
    t.data = loom::buffer<float>(e.numel);
    const auto src = full.tensor(e.name);
    std::copy(src.begin(), src.end(), t.data.begin());
    m.emplace(e.name, std::move(t));
  };
  const std::string dropped = "layers.1.feed_forward.w3.weight";
  for (const auto& e : full.layout.entries())
    if (e.name != dropped) put(e);
  CHECK_THROWS_WITH_AS(detail::from_tensors(c, m), doctest::Contains(dropped.c_str()), loom::error);
  put(full.layout.find(dropped));  // with it, the copy is the original, element for element
  const flat_weights back = detail::from_tensors(c, m);
  CHECK(std::equal(back.params.begin(), back.params.end(), full.params.begin(), full.params.end()));
}
