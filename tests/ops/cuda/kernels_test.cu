// Every CUDA kernel of ops/cuda, optim/cuda, kv/cuda and quant/cuda against its host counterpart (the oracle: the
// host kernels run the same ops/math functions and have their own tests against naive and
// PyTorch references) on random inputs; GEMM against a naive double-precision product.
// Labelled `gpu`; without a device the test main skips it by name.
//
// Tolerances, per dtype (|gpu - host| <= atol + rtol |host|):
//   fp32 elementwise and row kernels: rtol 1e-5, atol 1e-6 (nvcc contracts a*b+c into FMAs and
//     the row sums are added in another order; both change only the last bits)
//   fp32 GEMM (cuBLAS, fp32 compute, no TF32): rtol 1e-4, atol 1e-4 against double
//   bf16 / fp16 GEMM operands, fp32 accumulation: rtol 1e-3, atol 1e-3 against double on the
//     same rounded operands; a bf16 / fp16 C adds its rounding: rtol 1e-2 (bf16), 2e-3 (fp16)
//   squared norm (double accumulation on both sides, in another order): rtol 1e-10
//   embedding forward and backward: exact (a copy, and sums in the host's token order)
//   NF4 dequantisation: exact (one fp32 multiply per value on both sides)
//   paged KV append: exact (a copy); paged decode: rtol 1e-5, atol 1e-5 (split-KV and
//     warp-parallel sums add the same terms in another order)
//   attention (online softmax over key tiles against the host's GEMMs and column softmax;
//     backward from the saved log-sum-exp and <dO, O>): out rtol 1e-4, atol 1e-5; lse
//     against a double loop rtol 1e-5, atol 1e-5; dq, dk, dv rtol 1e-4, atol 1e-4
#include <loom/core/buffer.hpp>
#include <loom/core/cuda/memory.hpp>
#include <loom/core/random.hpp>
#include <loom/kv/cuda/paged_attention.cuh>
#include <loom/kv/cuda/sampler.cuh>
#include <loom/kv/paged_attention.hpp>
#include <loom/kv/sampler.hpp>
#include <loom/ops/cuda/activation.cuh>
#include <loom/ops/cuda/attention.cuh>
#include <loom/ops/cuda/cross_entropy.cuh>
#include <loom/ops/cuda/embedding.cuh>
#include <loom/ops/cuda/gemm.hpp>
#include <loom/ops/cuda/mma.cuh>
#include <loom/ops/cuda/norm.cuh>
#include <loom/ops/cuda/reduce.cuh>
#include <loom/ops/cuda/rope.cuh>
#include <loom/ops/host/activation.hpp>
#include <loom/ops/host/attention.hpp>
#include <loom/ops/host/cross_entropy.hpp>
#include <loom/ops/host/embedding.hpp>
#include <loom/ops/host/norm.hpp>
#include <loom/ops/host/rope.hpp>
#include <loom/optim/adamw.hpp>
#include <loom/optim/clip.hpp>
#include <loom/optim/cuda/adamw.cuh>
#include <loom/optim/cuda/clip.cuh>
#include <loom/quant/cuda/nf4.cuh>
#include <loom/quant/nf4.hpp>

#include <doctest/doctest.h>

#include "ops/cuda/compare.hpp"
#include "ops/cuda/transfer.hpp"

#include "kv/cuda/scrambled_pool.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace {

using loom::host;
using loom::index_t;
using loom::make_view;
namespace ops = loom::ops;

using loom::testing::cview;
using loom::testing::download;
using loom::testing::mview;
using loom::testing::upload;

constexpr double rtol32 = 1e-5, atol32 = 1e-6;

/// Compiled for the emulator (kernels_emulated_test.cpp: the CPU runs every CUDA thread), the
/// shapes only a GPU runs in moments are cut to a CPU's size; each still takes the same paths.
#if defined(LOOM_CUDA_EMULATION)
constexpr bool emulated = true;
#else
constexpr bool emulated = false;
#endif

template <class P>
void check_rmsnorm(index_t n, index_t d) {
  const auto x = random_vector<float>(std::size_t(n * d), 1), dy = random_vector<float>(x.size(), 2);
  auto w = random_vector<P>(std::size_t(d), 3);
  std::vector<float> y(x.size()), rstd(static_cast<std::size_t>(n)), dx = random_vector<float>(x.size(), 4), dw = random_vector<float>(std::size_t(d), 5);
  auto gx = upload(x), gdy = upload(dy), gy = upload(y), grstd = upload(rstd), gdx = upload(dx), gdw = upload(dw);
  auto gw = upload(w);
  ops::rmsnorm_forward(host{}, make_view(x.data(), n, d), make_view(w.data(), d), make_view(y.data(), n, d),
                       make_view(rstd.data(), n), 1e-5f);
  ops::rmsnorm_backward(host{}, make_view(dy.data(), n, d), make_view(x.data(), n, d), make_view(w.data(), d),
                        make_view(rstd.data(), n), make_view(dx.data(), n, d), make_view(dw.data(), d));
  ops::rmsnorm_forward(loom::cuda{}, cview(gx, n, d), cview(gw, d), mview(gy, n, d), mview(grstd, n), 1e-5f);
  ops::rmsnorm_backward(loom::cuda{}, cview(gdy, n, d), cview(gx, n, d), cview(gw, d), cview(grstd, n), mview(gdx, n, d),
                        mview(gdw, d));
  require_close(download(gy), y, rtol32, atol32, "rmsnorm y");
  require_close(download(grstd), rstd, rtol32, atol32, "rmsnorm rstd");
  require_close(download(gdx), dx, rtol32, 1e-5, "rmsnorm dx");
  require_close(download(gdw), dw, rtol32, 1e-4, "rmsnorm dw (a sum over rows)");
}

}  // namespace

TEST_CASE("rmsnorm forward and backward on the GPU equal the host's (fp32, fp32 and bf16 weights)") {
  for (auto [n, d] : {std::pair<index_t, index_t>{1, 1}, {7, 130}, {33, 1024}, {64, 4099}}) {
    CAPTURE(n);
    CAPTURE(d);
    check_rmsnorm<float>(n, d);
    check_rmsnorm<loom::bfloat16>(n, d);
  }
  loom::buffer<float, loom::cuda> x(12), y(12), r(3);
  loom::buffer<float, loom::cuda> w(4);
  CHECK_THROWS_WITH_AS(ops::rmsnorm_forward(loom::cuda{}, cview(x, 3, 4), cview(w, 4), mview(y, 3, 4), mview(r, 3), 0.f),
                       doctest::Contains("eps must be > 0, got eps=0"), loom::error);
}

TEST_CASE("rope forward and backward on the GPU equal the host's in both conventions, partial rotary included") {
  const index_t b = 2, s = 9, h = 3, hd = 16;
  for (index_t rot : {index_t(0), index_t(8)})
    for (auto style : {ops::rope_style::interleaved, ops::rope_style::half_split}) {
      CAPTURE(rot);
    CAPTURE(int(style));
      const ops::rope_table<float> table(20, hd, 10000.0, rot);
      const std::vector<float> cos(table.cos.begin(), table.cos.end()), sin(table.sin.begin(), table.sin.end());
      auto gcos = upload(cos), gsin = upload(sin);
      const index_t half = table.rotary_dim / 2;
      auto x = random_vector<float>(std::size_t(b * s * h * hd), 6);
      auto gx = upload(x);
      ops::rope_forward(host{}, make_view(x.data(), b, s, h, hd), table, style, 3);
      ops::rope_forward(loom::cuda{}, mview(gx, b, s, h, hd), cview(gcos, 20, half), cview(gsin, 20, half), style, 3);
      require_close(download(gx), x, rtol32, atol32, "rope forward");
      ops::rope_backward(host{}, make_view(x.data(), b, s, h, hd), table, style, 2);
      ops::rope_backward(loom::cuda{}, mview(gx, b, s, h, hd), cview(gcos, 20, half), cview(gsin, 20, half), style, 2);
      require_close(download(gx), x, rtol32, atol32, "rope backward");
      CHECK_THROWS_WITH_AS(ops::rope_forward(loom::cuda{}, mview(gx, b, s, h, hd), cview(gcos, 20, half), cview(gsin, 20, half), style, 12),
                           doctest::Contains("exceed the table's max_seq=20"), loom::error);
    }
}

TEST_CASE("swiglu forward and backward on the GPU equal the host's") {
  const index_t n = emulated ? 10007 : 100003;
  const auto a = random_vector<float>(std::size_t(n), 7, 3.f), bv = random_vector<float>(std::size_t(n), 8), dout = random_vector<float>(std::size_t(n), 9);
  std::vector<float> out(a.size()), da = random_vector<float>(a.size(), 10), db = random_vector<float>(a.size(), 11);
  auto ga = upload(a), gb = upload(bv), gdo = upload(dout), gout = upload(out), gda = upload(da), gdb = upload(db);
  ops::swiglu_forward(host{}, make_view(a.data(), n), make_view(bv.data(), n), make_view(out.data(), n));
  ops::swiglu_forward(loom::cuda{}, mview(ga, n), mview(gb, n), mview(gout, n));  // mutable inputs pass too
  require_close(download(gout), out, rtol32, atol32, "swiglu");
  for (bool acc : {true, false}) {
    ops::swiglu_backward(host{}, make_view(dout.data(), n), make_view(a.data(), n), make_view(bv.data(), n),
                         make_view(da.data(), n), make_view(db.data(), n), acc);
    ops::swiglu_backward(loom::cuda{}, cview(gdo, n), cview(ga, n), cview(gb, n), mview(gda, n), mview(gdb, n), acc);
    require_close(download(gda), da, rtol32, atol32, "swiglu da");
    require_close(download(gdb), db, rtol32, atol32, "swiglu db");
  }
}

namespace {

template <class P, class Tok>
void check_embedding(index_t n, index_t vocab, index_t d) {
  std::vector<Tok> tokens(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) tokens[std::size_t(i)] = Tok((i * 7919 + i / 3) % vocab);  // repeats, unordered
  if (n > 2) tokens[2] = tokens[0];
  const auto table = random_vector<P>(std::size_t(vocab * d), 30);
  const auto dout = random_vector<float>(std::size_t(n * d), 31);
  std::vector<float> out(std::size_t(n * d)), dtable = random_vector<float>(std::size_t(vocab * d), 32);
  auto gtok = upload(tokens);
  auto gtable = upload(table);
  auto gout = upload(out), gdout = upload(dout), gdtable = upload(dtable);
  ops::embedding_forward(host{}, make_view(tokens.data(), n), make_view(table.data(), vocab, d), make_view(out.data(), n, d));
  ops::embedding_backward(host{}, make_view(tokens.data(), n), make_view(dout.data(), n, d), make_view(dtable.data(), vocab, d));
  ops::embedding_workspace ws;
  ops::embedding_forward(loom::cuda{}, mview(gtok, n), cview(gtable, vocab, d), mview(gout, n, d), ws);
  ops::embedding_backward(loom::cuda{}, mview(gtok, n), cview(gdout, n, d), mview(gdtable, vocab, d));
  CHECK(download(gout) == out);
  CHECK(download(gdtable) == dtable);  // token order on both sides: the same bits
}

}  // namespace

TEST_CASE("embedding forward and backward on the GPU equal the host's bit for bit; a bad id is named") {
  // the last: several ids a residue class (a GPU: a ~1B model's table)
  const auto large = emulated ? std::tuple<index_t, index_t, index_t>{64, 3000, 512} : std::tuple<index_t, index_t, index_t>{256, 8192, 2048};
  for (auto [n, vocab, d] : {std::tuple<index_t, index_t, index_t>{1, 1, 1}, {37, 11, 130}, {1000, 257, 64}, large}) {
    CAPTURE(n);
    CAPTURE(vocab);
    CAPTURE(d);
    check_embedding<float, std::int32_t>(n, vocab, d);
    check_embedding<loom::bfloat16, std::int64_t>(n, vocab, d);
  }
  const std::vector<std::int32_t> tokens{0, 3, 9, -1};
  auto gtok = upload(tokens);
  loom::buffer<float, loom::cuda> table(36), out(36);
  ops::embedding_workspace ws;
  CHECK_THROWS_WITH_AS(ops::embedding_forward(loom::cuda{}, mview(gtok, 4), cview(table, 4, 9), mview(out, 4, 9), ws),
                       doctest::Contains("token id 9 at position 2 is outside the vocabulary [0, 4)"), loom::error);
}

TEST_CASE("gelu forward and backward on the GPU equal the host's (erf and tanh forms)") {
  const index_t n = emulated ? 7001 : 70001;
  const auto x = random_vector<float>(std::size_t(n), 33, 3.f), dy = random_vector<float>(std::size_t(n), 34);
  for (auto approx : {ops::gelu_approx::none, ops::gelu_approx::tanh}) {
    CAPTURE(int(approx));
    std::vector<float> y(x.size()), dx = random_vector<float>(x.size(), 35);
    auto gx = upload(x), gdy = upload(dy), gy = upload(y), gdx = upload(dx);
    ops::gelu_forward(host{}, make_view(x.data(), n), make_view(y.data(), n), approx);
    ops::gelu_backward(host{}, make_view(dy.data(), n), make_view(x.data(), n), make_view(dx.data(), n), approx);
    ops::gelu_forward(loom::cuda{}, cview(gx, n), mview(gy, n), approx);
    ops::gelu_backward(loom::cuda{}, cview(gdy, n), cview(gx, n), mview(gdx, n), approx);
    require_close(download(gy), y, rtol32, atol32, "gelu");
    require_close(download(gdx), dx, rtol32, atol32, "gelu dx");
  }
}

namespace {

/// Sequences of kv_lens tokens in a scrambled pool: keys/values appended on both sides, then
/// one decode query per sequence; the GPU's pool and output against the host's.
template <class T>
void check_paged_decode(std::int32_t block_size, std::int64_t nh, std::int64_t hk, std::int64_t dim,
                        const std::vector<std::int64_t>& kv_lens) {
  namespace kv = loom::kv;
  const auto batch = static_cast<std::int32_t>(kv_lens.size());
  kv::testing::scrambled_pool pool(block_size, kv_lens);
  const std::int64_t total = pool.total;
  const std::int32_t num_blocks = pool.num_blocks;
  const auto& csr = pool.csr;
  const auto& bidx = pool.bidx;
  const auto& pos = pool.pos;
  const auto k = random_vector<float>(std::size_t(total * hk * dim), 40), v = random_vector<float>(k.size(), 41);
  const auto q = random_vector<float>(std::size_t(batch * nh * dim), 42, 2.f);
  const std::size_t cache_elems = std::size_t(num_blocks) * 2 * std::size_t(block_size * hk * dim);
  std::vector<T> cache(cache_elems, T(0.f));
  std::vector<float> out(q.size(), -9.f);
  auto cache_view = make_view(cache.data(), num_blocks, 2, block_size, hk, dim);
  kv::append_paged_kv_cache(host{}, make_view(k.data(), total, hk, dim), make_view(v.data(), total, hk, dim), bidx, pos,
                            cache_view, csr);
  kv::batch_decode_with_paged_kv_cache(host{}, make_view(q.data(), batch, nh, dim), cache_view, csr,
                                       make_view(out.data(), batch, nh, dim));

  auto gk = upload(k), gv = upload(v), gq = upload(q);
  auto gbidx = upload(bidx);
  auto gpos = upload(pos);
  auto gcache = upload(std::vector<T>(cache_elems, T(0.f)));
  auto gout = upload(std::vector<float>(q.size(), -9.f));
  kv::paged_kv_csr_device dcsr;
  dcsr.upload(csr);
  kv::decode_workspace ws;
  const loom::tensor_view<T, loom::cuda, 5> gcache_view(gcache.data(), loom::extents<5>{num_blocks, 2, block_size, hk, dim});
  kv::append_paged_kv_cache(loom::cuda{}, cview(gk, total, hk, dim), cview(gv, total, hk, dim), gbidx.data(), gpos.data(),
                            gcache_view, dcsr);
  kv::batch_decode_with_paged_kv_cache(loom::cuda{}, cview(gq, batch, nh, dim), gcache_view, dcsr, mview(gout, batch, nh, dim),
                                       ws);
  const auto got_cache = download(gcache);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < cache_elems; ++i) differ += static_cast<float>(got_cache[i]) != static_cast<float>(cache[i]);
  CHECK(differ == 0);
  require_close(download(gout), out, 1e-5, 1e-5, "paged decode");
}

}  // namespace

TEST_CASE("paged KV append and split-KV decode on the GPU equal the host's (GQA, fp32 and bf16 pools, long contexts)") {
  check_paged_decode<float>(16, 4, 4, 64, {1, 17, 300});
  check_paged_decode<float>(16, 8, 2, 128, {1000, 5, 2600});     // several splits
  check_paged_decode<loom::bfloat16>(8, 6, 1, 96, {700, 33});    // MQA, a head_dim of 3 lanes
  check_paged_decode<float>(1, 2, 2, 256, {513});                // one token a block, the largest head_dim
  // the benchmark's heads (bf16, 32 / 8 of 128) at a long context; a group of 8; element loads
  check_paged_decode<loom::bfloat16>(16, 32, 8, 128, {4100, 1, emulated ? 700 : 33000});
  check_paged_decode<loom::bfloat16>(16, 16, 2, 128, {900, 2});
  check_paged_decode<float>(16, 4, 2, 36, {700, 40});
  loom::kv::paged_kv_csr_device dcsr;
  loom::kv::decode_workspace ws;
  loom::buffer<float, loom::cuda> q(2 * 512), cache(2 * 2 * 16 * 512), out(2 * 512);
  const loom::tensor_view<float, loom::cuda, 5> cv(cache.data(), loom::extents<5>{2, 2, 16, 1, 512});
  CHECK_THROWS_WITH_AS(loom::kv::batch_decode_with_paged_kv_cache(loom::cuda{}, cview(q, 0, 2, 512), cv, dcsr,
                                                                  mview(out, 0, 2, 512), ws),
                       doctest::Contains("head_dim=512 outside the supported [1, 256]"), loom::error);
}

namespace {

/// q, k, v, dout random; the host's attention (forward, then backward adding into random
/// gradients, and again writing them) against the GPU's, and the GPU's lse against a double
/// loop over the same scores.
void check_attention(index_t b, index_t s, index_t h, index_t kvh, index_t hd, index_t prefix) {
  INFO("batch " << b << ", seq " << s << ", heads " << h << "/" << kvh << ", head_dim " << hd << ", prefix " << prefix);
  const ops::attention_mask mask{prefix};
  const auto nq = std::size_t(b * s * h * hd), nk = std::size_t(b * s * kvh * hd);
  const auto q = random_vector<float>(nq, 31), k = random_vector<float>(nk, 32), v = random_vector<float>(nk, 33),
             dout = random_vector<float>(nq, 34);
  const auto dq0 = random_vector<float>(nq, 35), dk0 = random_vector<float>(nk, 36), dv0 = random_vector<float>(nk, 37);
  std::vector<float> out(nq), probs(std::size_t(b * h * s * s)), scratch(std::size_t(s * s));
  auto hq = make_view(q.data(), b, s, h, hd), hk = make_view(k.data(), b, s, kvh, hd), hv = make_view(v.data(), b, s, kvh, hd);
  ops::attention_forward(host{}, hq, hk, hv, make_view(out.data(), b, s, h, hd), make_view(probs.data(), b, h, s, s), mask);
  std::vector<float> hdq[2] = {dq0, dq0}, hdk[2] = {dk0, dk0}, hdv[2] = {dv0, dv0};
  for (int acc = 0; acc < 2; ++acc)
    ops::attention_backward(host{}, make_view(dout.data(), b, s, h, hd), hq, hk, hv, make_view(probs.data(), b, h, s, s),
                            make_view(hdq[acc].data(), b, s, h, hd), make_view(hdk[acc].data(), b, s, kvh, hd),
                            make_view(hdv[acc].data(), b, s, kvh, hd), make_view(scratch.data(), s, s), mask, acc == 1);

  auto gq = upload(q), gk = upload(k), gv = upload(v), gdout = upload(dout);
  auto gout = upload(std::vector<float>(nq, -9.f)), glse = upload(std::vector<float>(std::size_t(b * h * s), -9.f));
  ops::attention_forward(loom::cuda{}, cview(gq, b, s, h, hd), cview(gk, b, s, kvh, hd), cview(gv, b, s, kvh, hd),
                         mview(gout, b, s, h, hd), mview(glse, b, h, s), mask);
  require_close(download(gout), out, 1e-4, 1e-5, "attention out");
  std::vector<double> lse(std::size_t(b * h * s));
  const double scale = 1.0 / std::sqrt(double(hd));
  for (index_t bi = 0; bi < b; ++bi)
    for (index_t hi = 0; hi < h; ++hi)
      for (index_t t = 0; t < s; ++t) {
        std::vector<double> sc;
        for (index_t j = 0; j < mask.visible(t, s); ++j) {
          double dot = 0;
          for (index_t d = 0; d < hd; ++d)
            dot += double(q[std::size_t(((bi * s + t) * h + hi) * hd + d)]) *
                   double(k[std::size_t(((bi * s + j) * kvh + hi / (h / kvh)) * hd + d)]);
          sc.push_back(dot * scale);
        }
        const double mx = *std::max_element(sc.begin(), sc.end());
        double sum = 0;
        for (double x : sc) sum += std::exp(x - mx);
        lse[std::size_t((bi * h + hi) * s + t)] = mx + std::log(sum);
      }
  require_close(download(glse), lse, 1e-5, 1e-5, "attention lse");

  ops::attention_workspace ws;
  for (int acc = 0; acc < 2; ++acc) {
    auto gdq = upload(dq0), gdk = upload(dk0), gdv = upload(dv0);
    ops::attention_backward(loom::cuda{}, cview(gdout, b, s, h, hd), cview(gq, b, s, h, hd), cview(gk, b, s, kvh, hd),
                            cview(gv, b, s, kvh, hd), cview(gout, b, s, h, hd), cview(glse, b, h, s), mview(gdq, b, s, h, hd),
                            mview(gdk, b, s, kvh, hd), mview(gdv, b, s, kvh, hd), ws, mask, acc == 1);
    const std::string how = acc ? " (accumulate)" : " (write)";
    require_close(download(gdq), hdq[acc], 1e-4, 1e-4, "attention dq" + how);
    require_close(download(gdk), hdk[acc], 1e-4, 1e-4, "attention dk" + how);
    require_close(download(gdv), hdv[acc], 1e-4, 1e-4, "attention dv" + how);
  }
}

}  // namespace

TEST_CASE("attention forward and backward on the GPU equal the host's (causal and prefix-LM, GQA and MQA, head_dim 33-256)") {
  check_attention(2, 70, 4, 2, 64, 0);    // GQA, query tiles and key tiles cut mid-tile
  check_attention(1, 130, 4, 1, 128, 20);  // MQA, prefix-LM
  check_attention(2, 45, 2, 2, 40, 0);    // a head_dim that leaves lanes idle
  check_attention(1, 37, 3, 3, 33, 50);   // an odd head_dim; a prefix longer than the sequence
  check_attention(1, 66, 2, 1, 256, 0);   // the largest head_dim (over 48 KiB of shared memory)
  loom::buffer<float, loom::cuda> q(2 * 300), kv(2 * 300), out(2 * 300), lse(4);
  CHECK_THROWS_WITH_AS(ops::attention_forward(loom::cuda{}, cview(q, 1, 2, 1, 300), cview(kv, 1, 2, 1, 300),
                                              cview(kv, 1, 2, 1, 300), mview(out, 1, 2, 1, 300), mview(lse, 1, 1, 2)),
                       doctest::Contains("head_dim=300 outside the supported [1, 256]"), loom::error);
  CHECK_THROWS_WITH_AS(ops::attention_forward(loom::cuda{}, cview(q, 1, 2, 3, 8), cview(kv, 1, 2, 2, 8), cview(kv, 1, 2, 2, 8),
                                              mview(out, 1, 2, 3, 8), mview(lse, 1, 3, 2)),
                       doctest::Contains("heads (3) must be a multiple of kv_heads (2)"), loom::error);
  CHECK_THROWS_WITH_AS(ops::attention_forward(loom::cuda{}, cview(q, 1, 2, 1, 8), cview(kv, 1, 2, 1, 8), cview(kv, 1, 2, 1, 8),
                                              mview(out, 1, 2, 1, 8), mview(lse, 1, 2, 2)),
                       doctest::Contains("lse has shape [1, 2, 2], expected [1, 1, 2]"), loom::error);
}

namespace {

/// Ragged prefill on the GPU against the host's over the same scrambled pool (kernels
/// appended on the host, the pool uploaded): a whole prompt, a decode row and a chunk.
template <class T>
void check_paged_prefill(std::int32_t block_size, std::int64_t nh, std::int64_t hk, std::int64_t dim, bool causal,
                         const std::vector<std::int64_t>& kv_lens = {300, 5, 700},
                         const std::vector<std::int32_t>& qo_indptr = {0, 300, 301, 334}) {  // a whole prompt, a decode row, a chunk of 33
  namespace kv = loom::kv;
  kv::testing::scrambled_pool pool(block_size, kv_lens);
  const std::size_t cache_elems = std::size_t(pool.num_blocks) * 2 * std::size_t(block_size * hk * dim);
  std::vector<T> cache(cache_elems, T(0.f));
  const auto k = random_vector<float>(std::size_t(pool.total * hk * dim), 43), v = random_vector<float>(k.size(), 44);
  auto cache_view = make_view(cache.data(), pool.num_blocks, 2, block_size, hk, dim);
  kv::append_paged_kv_cache(host{}, make_view(k.data(), pool.total, hk, dim), make_view(v.data(), pool.total, hk, dim),
                            pool.bidx, pool.pos, cache_view, pool.csr);
  const std::int64_t total_q = qo_indptr.back();
  const auto q = random_vector<float>(std::size_t(total_q * nh * dim), 45, 2.f);
  std::vector<float> out(q.size(), -9.f);
  kv::attention_params params;
  params.causal = causal;
  kv::batch_prefill_with_paged_kv_cache(host{}, make_view(q.data(), total_q, nh, dim), qo_indptr, cache_view, pool.csr,
                                        make_view(out.data(), total_q, nh, dim), params);
  auto gq = upload(q), gout = upload(std::vector<float>(q.size(), -9.f));
  auto gcache = upload(cache);
  kv::paged_kv_csr_device dcsr;
  dcsr.upload(pool.csr);
  kv::prefill_workspace ws;
  const loom::tensor_view<T, loom::cuda, 5> gcache_view(gcache.data(), loom::extents<5>{pool.num_blocks, 2, block_size, hk, dim});
  kv::batch_prefill_with_paged_kv_cache(loom::cuda{}, cview(gq, total_q, nh, dim), qo_indptr, gcache_view, dcsr,
                                        mview(gout, total_q, nh, dim), ws, params);
  require_close(download(gout), out, 1e-5, 1e-5, "paged prefill");
}

}  // namespace

TEST_CASE("paged prefill on the GPU equals the host's (ragged queries, causal and not, GQA and MQA, a bf16 pool, split keys)") {
  check_paged_prefill<float>(16, 8, 2, 128, true);
  check_paged_prefill<float>(16, 8, 2, 128, false);
  check_paged_prefill<loom::bfloat16>(8, 6, 1, 96, true);
  // chunks of long prompts and a decode row: few query tiles, many keys, so the keys are split
  // (kernels::prefill_splits) and the ranges merged
  const std::vector<std::int64_t> long_kv{emulated ? 2100 : 20000, emulated ? 1500 : 2500, 40};
  const auto chunks = emulated ? std::vector<std::int32_t>{0, 32, 48, 49} : std::vector<std::int32_t>{0, 64, 97, 98};
  REQUIRE(loom::kv::kernels::prefill_splits(2 * 8 * 3, long_kv[0], chunks.back()) > 1);  // <= 2 query tiles a sequence
  check_paged_prefill<float>(16, 8, 2, 128, true, long_kv, chunks);
  check_paged_prefill<loom::bfloat16>(16, 8, 2, 64, false, long_kv, chunks);
  loom::kv::testing::scrambled_pool pool(16, {4, 6});
  loom::kv::paged_kv_csr_device dcsr;
  dcsr.upload(pool.csr);
  loom::kv::prefill_workspace ws;
  loom::buffer<float, loom::cuda> q(9 * 2 * 8), cache(std::size_t(pool.num_blocks) * 2 * 16 * 2 * 8), out(q.size());
  const loom::tensor_view<float, loom::cuda, 5> cv(cache.data(), loom::extents<5>{pool.num_blocks, 2, 16, 2, 8});
  const std::vector<std::int32_t> too_many{0, 5, 9};  // 5 queries for a sequence of 4 keys
  CHECK_THROWS_WITH_AS(loom::kv::batch_prefill_with_paged_kv_cache(loom::cuda{}, cview(q, 9, 2, 8), too_many, cv, dcsr,
                                                                   mview(out, 9, 2, 8), ws),
                       doctest::Contains("sequence 0 has q_len=5 outside [0, kv_len=4]"), loom::error);
}

TEST_CASE("vocab-parallel cross-entropy steps on the GPU, over two halves of the vocabulary, give the full row's") {
  const index_t n = 9, v = 32001, split = 16000;
  const auto logits = random_vector<float>(std::size_t(n * v), 18, 3.f);
  std::vector<std::int32_t> tgt{5, -100, 16000, 15999, 32000, 7, 0, 20000, 3};
  std::vector<float> lse(static_cast<std::size_t>(n)), dl(logits.size());
  const float loss = ops::cross_entropy_forward_backward(host{}, make_view(logits.data(), n, v), make_view(tgt.data(), n),
                                                         make_view(lse.data(), n), make_view(dl.data(), n, v));
  auto gt = upload(tgt);
  struct half {
    index_t first, width;
    loom::buffer<float, loom::cuda> x, mx, sums, g;
  };
  std::vector<half> ranks;
  for (auto [first, width] : {std::pair<index_t, index_t>{0, split}, {split, v - split}}) {
    std::vector<float> part;
    for (index_t i = 0; i < n; ++i) part.insert(part.end(), logits.begin() + i * v + first, logits.begin() + i * v + first + width);
    ranks.push_back({first, width, upload(part), loom::buffer<float, loom::cuda>(std::size_t(n)),
                     loom::buffer<float, loom::cuda>(std::size_t(2 * n)), upload(std::vector<float>(part.size(), 0.f))});
  }
  for (auto& r : ranks) ops::vocab_parallel_row_max(loom::cuda{}, cview(r.x, n, r.width), mview(r.mx, n));
  const auto m0 = download(ranks[0].mx), m1 = download(ranks[1].mx);
  std::vector<float> gmax(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < gmax.size(); ++i) gmax[i] = std::max(m0[i], m1[i]);
  auto gmx = upload(gmax);
  for (auto& r : ranks) ops::vocab_parallel_row_sums(loom::cuda{}, cview(r.x, n, r.width), cview(gt, n), r.first, cview(gmx, n), mview(r.sums, n, 2));
  const auto s0 = download(ranks[0].sums), s1 = download(ranks[1].sums);
  std::vector<float> full_lse(static_cast<std::size_t>(n));
  double total = 0;
  index_t counted = 0;
  for (std::size_t i = 0; i < full_lse.size(); ++i) {
    full_lse[i] = float(ops::math::log_sum_exp(double(gmax[i]), double(s0[2 * i]) + double(s1[2 * i])));
    if (tgt[i] != -100) total += double(full_lse[i]) - double(s0[2 * i + 1]) - double(s1[2 * i + 1]), ++counted;
  }
  CHECK(std::abs(total / double(counted) - double(loss)) <= 1e-5 * std::abs(double(loss)));
  require_close(full_lse, lse, rtol32, atol32, "vocab-parallel lse");
  auto glse = upload(full_lse);
  std::vector<float> got(dl.size());
  for (auto& r : ranks) {
    ops::vocab_parallel_backward(loom::cuda{}, cview(r.x, n, r.width), cview(gt, n), r.first, cview(glse, n), mview(r.g, n, r.width),
                                 1.f / float(counted));
    const auto g = download(r.g);
    for (index_t i = 0; i < n; ++i) std::copy_n(g.begin() + i * r.width, r.width, got.begin() + i * v + r.first);
  }
  require_close(got, dl, rtol32, atol32, "vocab-parallel dlogits");
}

TEST_CASE("NF4 rows dequantised on the GPU equal the host's bit for bit (plain and double-quantised absmax, fp32 and bf16)") {
  const index_t rows = 48, cols = 192;
  auto w = random_vector<float>(std::size_t(rows * cols), 50, 0.05f);
  for (index_t c = 0; c < 64; ++c) w[std::size_t(5 * cols + c)] = 0.f;  // a block of zeros
  for (bool dq : {false, true}) {
    CAPTURE(dq);
    loom::quant::nf4_options o;
    o.block_size = 64, o.double_quant = dq, o.absmax_block_size = 32;  // several second-level blocks
    const loom::quant::nf4_matrix m(make_view(static_cast<const float*>(w.data()), rows, cols), o);
    std::vector<float> want(w.size());
    m.dequantize(0, rows, 0, cols, want.data(), cols);
    const loom::quant::nf4_matrix_device dm(m);
    CHECK(dm.bytes() == m.bytes());
    const index_t r0 = 7, r1 = 41;  // a slice of rows
    loom::buffer<float, loom::cuda> got(std::size_t((r1 - r0) * cols));
    loom::buffer<loom::bfloat16, loom::cuda> got16(got.size());
    loom::quant::nf4_dequantize_rows(dm, r0, r1, mview(got, r1 - r0, cols));
    loom::quant::nf4_dequantize_rows(dm, r0, r1, mview(got16, r1 - r0, cols));
    const std::vector<float> slice(want.begin() + r0 * cols, want.begin() + r1 * cols);
    CHECK(download(got) == slice);
    const auto g16 = download(got16);
    std::size_t differ = 0;
    for (std::size_t i = 0; i < slice.size(); ++i) differ += static_cast<float>(g16[i]) != static_cast<float>(loom::bfloat16(slice[i]));
    CHECK(differ == 0);
  }
}

TEST_CASE("fused AdamW on the GPU equals optim::adamw_update over several steps") {
  const std::size_t n = emulated ? 1 << 12 | 5 : 1 << 16 | 5;
  auto p = random_vector<float>(n, 12), g = random_vector<float>(n, 13, 0.1f);
  std::vector<float> m(n), v(n);
  auto gp = upload(p), gg = upload(g), gm = upload(m), gv = upload(v);
  const auto len = index_t(n);
  for (std::int64_t t = 1; t <= 5; ++t) {
    loom::optim::adamw_update(p, g, m, v, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, t);
    loom::optim::adamw_update(loom::cuda{}, mview(gp, len), cview(gg, len), mview(gm, len), mview(gv, len), 1e-2f, 0.9f, 0.999f,
                              1e-8f, 0.1f, t);
  }
  require_close(download(gp), p, rtol32, atol32, "adamw params");
  require_close(download(gm), m, rtol32, atol32, "adamw exp_avg");
  require_close(download(gv), v, rtol32, 1e-9, "adamw exp_avg_sq");
}

TEST_CASE("the GPU squared norm equals the host's and flags inf and NaN") {
  for (std::size_t n : {std::size_t(1), std::size_t(1000), std::size_t(3'000'017)}) {
    CAPTURE(n);
    auto x = random_vector<float>(n, 14);
    auto gx = upload(x);
    loom::buffer<double, loom::cuda> ws(static_cast<std::size_t>(ops::sum_of_squares_workspace));
    loom::buffer<int, loom::cuda> flag(1);
    LOOM_CUDA_CHECK(cudaMemset(flag.data(), 0, sizeof(int)));
    ops::sum_of_squares(loom::cuda{}, cview(gx, index_t(n)), mview(ws, ops::sum_of_squares_workspace), mview(flag, 1));
    const auto got = download(ws);
    const double want = loom::optim::sum_of_squares(x);
    CHECK(std::abs(got[0] - want) <= 1e-10 * want);
    CHECK(download(flag)[0] == 0);
    for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
      x[n / 2] = bad;
      auto gbad = upload(x);
      ops::sum_of_squares(loom::cuda{}, cview(gbad, index_t(n)), mview(ws, ops::sum_of_squares_workspace), mview(flag, 1));
      CHECK(download(flag)[0] == 1);
      LOOM_CUDA_CHECK(cudaMemset(flag.data(), 0, sizeof(int)));
    }
  }
}

TEST_CASE("softmax cross-entropy forward and backward on the GPU equal the host's, ignore_index included") {
  for (auto [n, v] : {std::pair<index_t, index_t>{5, 7}, {64, 4096}, {17, 32001}}) {
    CAPTURE(n);
    CAPTURE(v);
    const auto logits = random_vector<float>(std::size_t(n * v), 15, 3.f);
    std::vector<std::int32_t> tgt(static_cast<std::size_t>(n));
    for (index_t i = 0; i < n; ++i) tgt[std::size_t(i)] = i % 4 == 1 ? -100 : std::int32_t((i * 37) % v);
    std::vector<float> lse(static_cast<std::size_t>(n)), dl(logits.size()), dl_acc = random_vector<float>(logits.size(), 16);
    auto gl = upload(logits), glse = upload(lse), gdl = upload(dl), gacc = upload(dl_acc);
    auto gt = upload(tgt);
    ops::cross_entropy_workspace ws(n);
    const float loss = ops::cross_entropy_forward_backward(host{}, make_view(logits.data(), n, v), make_view(tgt.data(), n),
                                                           make_view(lse.data(), n), make_view(dl.data(), n, v));
    const float gloss = ops::cross_entropy_forward(loom::cuda{}, cview(gl, n, v), cview(gt, n), mview(glse, n), ws, mview(gdl, n, v));
    CHECK(std::abs(gloss - loss) <= 1e-5 * std::abs(loss));
    require_close(download(glse), lse, rtol32, atol32, "cross-entropy lse");
    require_close(download(gdl), dl, rtol32, atol32, "cross-entropy dlogits (forward)");
    // Backward from the host's lse on both sides: an lse within rtol 1e-5 of ln(32001) is off
    // by up to 1e-4 absolute, and every exp(logit - lse) by that relative.
    const auto host_lse = upload(lse);
    ops::cross_entropy_backward(host{}, make_view(logits.data(), n, v), make_view(tgt.data(), n), make_view(lse.data(), n),
                                make_view(dl_acc.data(), n, v), 0.5f);
    ops::cross_entropy_backward(loom::cuda{}, cview(gl, n, v), cview(gt, n), cview(host_lse, n), mview(gacc, n, v), ws, 0.5f);
    require_close(download(gacc), dl_acc, rtol32, atol32, "cross-entropy dlogits (backward, accumulated)");
    // forward without dlogits (lse and loss only), backward that writes (ignored rows zeroed)
    const float gloss_only = ops::cross_entropy_forward(loom::cuda{}, cview(gl, n, v), cview(gt, n), mview(glse, n), ws);
    CHECK(gloss_only == gloss);
    require_close(download(glse), lse, rtol32, atol32, "cross-entropy lse (forward only)");
    ops::cross_entropy_backward(host{}, make_view(logits.data(), n, v), make_view(tgt.data(), n), make_view(lse.data(), n),
                                make_view(dl_acc.data(), n, v), 2.f, {}, false);
    ops::cross_entropy_backward(loom::cuda{}, cview(gl, n, v), cview(gt, n), cview(host_lse, n), mview(gacc, n, v), ws, 2.f,
                                {}, false);
    require_close(download(gacc), dl_acc, rtol32, atol32, "cross-entropy dlogits (backward, written)");
    tgt[std::size_t(n - 1)] = std::int32_t(v + 3);
    auto gbad = upload(tgt);
    const std::string message = "target " + std::to_string(v + 3) + " at position " + std::to_string(n - 1);
    CHECK_THROWS_WITH_AS(ops::cross_entropy_forward(loom::cuda{}, cview(gl, n, v), cview(gbad, n), mview(glse, n), ws),
                         doctest::Contains(message.c_str()), loom::error);
  }
}

namespace {
/// C = A B in double from float-converted operands: [m, k] x [k, n] (b_t: B given as [n, k]).
template <class T>
std::vector<double> naive_gemm(const std::vector<T>& a, const std::vector<T>& b, index_t m, index_t k, index_t n, bool b_t) {
  std::vector<double> c(std::size_t(m * n));
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) {
      double s = 0;
      for (index_t p = 0; p < k; ++p)
        s += double(float(a[std::size_t(i * k + p)])) * double(float(b[std::size_t(b_t ? j * k + p : p * n + j)]));
      c[std::size_t(i * n + j)] = s;
    }
  return c;
}

template <class T, class TC>
void check_gemm(const ops::cublas_handle& handle, double rtol, double atol) {
  const index_t m = 67, k = 130, n = 45;
  const auto a = random_vector<T>(std::size_t(m * k), 17), b = random_vector<T>(std::size_t(k * n), 18);
  auto ga = upload(a), gb = upload(b);
  loom::buffer<TC, loom::cuda> gc(static_cast<std::size_t>(m * n));
  for (bool b_t : {false, true}) {
    CAPTURE(b_t);
    const auto want = naive_gemm(a, b, m, k, n, b_t);
    // B as a [k, n] view: row-major, or the transpose of a row-major [n, k] matrix
    const auto bv = b_t ? loom::tensor_view<const T, loom::cuda, 2>(gb.data(), {k, n}, {1, k}) : cview(gb, k, n);
    ops::gemm(loom::cuda{}, handle, cview(ga, m, k), bv, mview(gc, m, n));
    const auto got = download(gc);
    require_close(got, want, rtol, atol, "gemm");
  }
}

/// A batch of 3: B per matrix, broadcast (batch stride 0) or transposed per matrix (the
/// attention scores' Q K^T); C = 0.5 A B + C, against naive products of each matrix.
template <class T>
void check_gemm_batched(const ops::cublas_handle& handle, double rtol, double atol) {
  const index_t batch = 3, m = 33, k = 40, n = 21;
  const auto a = random_vector<T>(std::size_t(batch * m * k), 19), b = random_vector<T>(std::size_t(batch * k * n), 20);
  const auto c0 = random_vector<float>(std::size_t(batch * m * n), 21);
  auto ga = upload(a), gb = upload(b);
  for (int mode = 0; mode < 3; ++mode) {  // 0: B per matrix, 1: one B for all, 2: B^T per matrix
    CAPTURE(mode);
    auto gc = upload(c0);
    const index_t b_stride = mode == 1 ? 0 : k * n;
    const auto bv = mode == 2 ? loom::tensor_view<const T, loom::cuda, 3>(gb.data(), {batch, k, n}, {k * n, 1, k})
                              : loom::tensor_view<const T, loom::cuda, 3>(gb.data(), {batch, k, n}, {b_stride, n, 1});
    ops::gemm_batched(loom::cuda{}, handle, cview(ga, batch, m, k), bv, mview(gc, batch, m, n), 0.5f, 1.f);
    std::vector<double> want;
    for (index_t q = 0; q < batch; ++q) {
      const std::vector<T> aq(a.begin() + q * m * k, a.begin() + (q + 1) * m * k);
      const index_t bq = mode == 1 ? 0 : q;
      const std::vector<T> bm(b.begin() + bq * k * n, b.begin() + (bq + 1) * k * n);
      const auto prod = naive_gemm(aq, bm, m, k, n, mode == 2);
      for (index_t i = 0; i < m * n; ++i) want.push_back(0.5 * prod[std::size_t(i)] + c0[std::size_t(q * m * n + i)]);
    }
    require_close(download(gc), want, rtol, atol, "gemm_batched");
  }
}

}  // namespace

TEST_CASE("cuBLAS strided batched GEMM: per-matrix, broadcast and transposed B, alpha and beta") {
  const ops::cublas_handle handle;
  check_gemm_batched<float>(handle, 1e-4, 1e-4);
  check_gemm_batched<loom::bfloat16>(handle, 1e-3, 1e-3);
  loom::buffer<float, loom::cuda> a(24), b(24), c(16);
  CHECK_THROWS_WITH_AS(ops::gemm_batched(loom::cuda{}, handle, cview(a, 2, 3, 4), cview(b, 3, 4, 2), mview(c, 2, 3, 2)),
                       doctest::Contains("batches differ: A 2, B 3, C 2"), loom::error);
  const loom::tensor_view<float, loom::cuda, 3> overlapping(c.data(), {2, 2, 2}, {1, 2, 1});
  CHECK_THROWS_WITH_AS(ops::gemm_batched(loom::cuda{}, handle, cview(a, 2, 2, 4), cview(b, 2, 4, 2), overlapping),
                       doctest::Contains("C's matrices overlap"), loom::error);
}

TEST_CASE("cuBLAS GEMM: fp32, and bf16 / fp16 operands with fp32 accumulation, against a double product") {
  const ops::cublas_handle handle;
  check_gemm<float, float>(handle, 1e-4, 1e-4);
  check_gemm<loom::bfloat16, float>(handle, 1e-3, 1e-3);
  check_gemm<loom::half, float>(handle, 1e-3, 1e-3);
  check_gemm<loom::bfloat16, loom::bfloat16>(handle, 1e-2, 1e-2);
  check_gemm<loom::half, loom::half>(handle, 2e-3, 2e-3);
  loom::buffer<float, loom::cuda> a(6), b(6), c(4);
  CHECK_THROWS_WITH_AS(ops::gemm(loom::cuda{}, handle, cview(a, 2, 3), cview(b, 2, 3), mview(c, 2, 2)),
                       doctest::Contains("inner sizes differ"), loom::error);
}

namespace {

/// One warp: d [16 mt][8 nt] = a [16 mt][16 ks] b [16 ks][8 nt] (row-major; bf16 in, fp32 out)
/// tile by tile through the m16n8k16 fragments, accumulating over k.
__global__ void mma_gemm(const loom::bfloat16* __restrict__ a, const loom::bfloat16* __restrict__ b, float* __restrict__ d,
                         int mt, int nt, int ks) {
  using L = ops::mma::m16n8k16;
  const int lane = static_cast<int>(threadIdx.x % 32), k = ks * L::k, n = nt * L::n;
  for (int ti = 0; ti < mt; ++ti)
    for (int tj = 0; tj < nt; ++tj) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int s = 0; s < ks; ++s) {
        const auto at = [&](int i) { return a[(ti * L::m + L::a_row(lane, i)) * k + s * L::k + L::a_col(lane, i)]; };
        const auto bt = [&](int i) { return b[(s * L::k + L::b_row(lane, i)) * n + tj * L::n + L::b_col(lane, i)]; };
        const std::uint32_t af[4] = {ops::mma::pack_bf16(at(0), at(1)), ops::mma::pack_bf16(at(2), at(3)),
                                     ops::mma::pack_bf16(at(4), at(5)), ops::mma::pack_bf16(at(6), at(7))};
        const std::uint32_t bf[2] = {ops::mma::pack_bf16(bt(0), bt(1)), ops::mma::pack_bf16(bt(2), bt(3))};
        float out[4];
        ops::mma::mma_bf16(out, af, bf, acc);
        for (int i = 0; i < 4; ++i) acc[i] = out[i];
      }
      for (int i = 0; i < 4; ++i) d[(ti * L::m + L::c_row(lane, i)) * n + tj * L::n + L::c_col(lane, i)] = acc[i];
    }
}

}  // namespace

TEST_CASE("the tensor-core product (mma m16n8k16, bf16 in, fp32 out) equals a double product; its fragment maps tile") {
  using L = ops::mma::m16n8k16;
  // every element of A, B and C is one lane's element, exactly once
  int a_seen[16][16] = {}, b_seen[16][8] = {}, c_seen[16][8] = {};
  for (int l = 0; l < 32; ++l) {
    for (int i = 0; i < 8; ++i) ++a_seen[L::a_row(l, i)][L::a_col(l, i)];
    for (int i = 0; i < 4; ++i) ++b_seen[L::b_row(l, i)][L::b_col(l, i)], ++c_seen[L::c_row(l, i)][L::c_col(l, i)];
  }
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) REQUIRE(a_seen[r][c] == 1);
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 8; ++c) REQUIRE((b_seen[r][c] == 1 && c_seen[r][c] == 1));
  const int mt = 2, nt = 3, ks = 3, m = 16 * mt, n = 8 * nt, k = 16 * ks;
  const auto a = random_vector<loom::bfloat16>(std::size_t(m * k), 80), b = random_vector<loom::bfloat16>(std::size_t(k * n), 81);
  std::vector<float> want(std::size_t(m * n));
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int kk = 0; kk < k; ++kk) s += double(float(a[std::size_t(i * k + kk)])) * double(float(b[std::size_t(kk * n + j)]));
      want[std::size_t(i * n + j)] = float(s);
    }
  auto ga = upload(a), gb = upload(b);
  auto gd = upload(std::vector<float>(want.size(), -9.f));
  LOOM_LAUNCH(mma_gemm, 1, 32, 0, nullptr)(ga.data(), gb.data(), gd.data(), mt, nt, ks);
  LOOM_CUDA_CHECK(cudaGetLastError());
  require_close(download(gd), want, 1e-5, 1e-5, "mma");  // bf16 products are exact in fp32: only the sums round
}

TEST_CASE("token sampling on the GPU picks the host sampler's token (greedy, temperature, top-k, top-p, penalty, ties)") {
  namespace kv = loom::kv;
  using sp = kv::sampling_params;
  const std::vector<sp> configs{
      {},                                                            // greedy
      {.repetition_penalty = 1.3f},                                  // greedy after the penalty
      {.temperature = 0.7f},                                         // the whole vocabulary
      {.temperature = 1.f, .top_k = 1},                              // top-1 is greedy
      {.temperature = 0.8f, .top_k = 5},
      {.temperature = 1.2f, .top_k = 50, .top_p = 0.9f},
      {.temperature = 1.f, .top_p = 0.5f},
      {.temperature = 2.f, .top_p = 0.99f, .repetition_penalty = 1.5f},
      {.temperature = 0.3f, .top_p = 0.1f},
      {.temperature = 1.f, .top_k = 3, .repetition_penalty = 0.8f},  // a penalty below 1 favours the history
      {.temperature = 5.f},
      {.temperature = 1.f, .top_k = 100000, .top_p = 0.95f},         // top_k above the vocabulary: all
  };
  for (index_t v : {index_t(7), index_t(1000), index_t(32000)}) {
    CAPTURE(v);
    std::vector<sp> params;
    std::vector<std::vector<kv::token_id>> histories;
    std::vector<std::int64_t> positions;
    for (int rep = 0; rep < 3; ++rep)
      for (std::size_t c = 0; c < configs.size(); ++c) {
        const auto b = params.size();
        params.push_back(configs[c]);
        params.back().seed = 1000 + b;
        positions.push_back(std::int64_t(b) * 5 + 3);
        std::vector<kv::token_id> h;
        for (int i = 0; i < 40; ++i) h.push_back(kv::token_id((i * 7 + int(b) * 13) % (i % 3 == 0 ? 5 : int(v))));  // repeats
        histories.push_back(h);
      }
    const index_t batch = index_t(params.size());
    auto logits = random_vector<float>(std::size_t(batch * v), 50, 4.f);
    for (index_t b = 0; b < batch; ++b)
      for (index_t j = 0; j < v; ++j) {
        float& l = logits[std::size_t(b * v + j)];
        if (b % 2 == 1) l = std::round(l * 2.f) / 2.f;                                    // many equal logits: ties by id
        if (b % 5 == 2 && j % 3 == 0) l = -std::numeric_limits<float>::infinity();       // masked tokens
      }
    std::vector<kv::token_id> expected(std::size_t(batch), -1);
    std::vector<float> penalized = logits;
    kv::sampler host_sampler;
    for (index_t b = 0; b < batch; ++b)
      expected[std::size_t(b)] = host_sampler.sample(std::span<float>(penalized.data() + b * v, std::size_t(v)),
                                                     params[std::size_t(b)], histories[std::size_t(b)],
                                                     positions[std::size_t(b)]);
    std::vector<std::span<const kv::token_id>> history_spans(histories.begin(), histories.end());
    auto glogits = upload(logits);
    auto gout = upload(std::vector<kv::token_id>(std::size_t(batch), -1));
    kv::sampling_workspace ws;
    kv::sample(loom::cuda{}, mview(glogits, batch, v), params, history_spans, positions, mview(gout, batch), ws);
    CHECK(download(gout) == expected);
    CHECK(download(glogits) == penalized);  // the penalty in place, bit for bit
    // the workspace again, on other draws and other histories (its penalty mask must have
    // been left clear: a token marked last time is not penalised now)
    for (auto& p : params) p.seed += 7;
    std::rotate(histories.begin(), histories.begin() + 1, histories.end());
    for (auto& h : histories) h.resize(h.size() / 2);
    history_spans.assign(histories.begin(), histories.end());
    penalized = logits;
    for (index_t b = 0; b < batch; ++b)
      expected[std::size_t(b)] = host_sampler.sample(std::span<float>(penalized.data() + b * v, std::size_t(v)),
                                                     params[std::size_t(b)], histories[std::size_t(b)],
                                                     positions[std::size_t(b)]);
    glogits = upload(logits);
    kv::sample(loom::cuda{}, mview(glogits, batch, v), params, history_spans, positions, mview(gout, batch), ws);
    CHECK(download(gout) == expected);
    CHECK(download(glogits) == penalized);
  }
  loom::buffer<float, loom::cuda> logits(2 * 10);
  loom::buffer<kv::token_id, loom::cuda> out(2);
  kv::sampling_workspace ws;
  const std::vector<kv::token_id> bad{3, 10};
  const std::vector<std::span<const kv::token_id>> h{bad, {}};
  const std::vector<std::int64_t> pos{0, 0};
  const std::vector<sp> penalised{{.repetition_penalty = 1.2f}, {}}, bad_top_p{{.temperature = 1.f, .top_p = 0.f}, {}};
  CHECK_THROWS_WITH_AS(kv::sample(loom::cuda{}, mview(logits, 2, 10), penalised, h, pos, mview(out, 2), ws),
                       doctest::Contains("history token 10 of row 0 outside the vocabulary of 10"), loom::error);
  CHECK_THROWS_WITH_AS(kv::sample(loom::cuda{}, mview(logits, 2, 10), bad_top_p, h, pos, mview(out, 2), ws),
                       doctest::Contains("top_p must be in (0, 1], got 0"), loom::error);
  CHECK_THROWS_WITH_AS(kv::sample(loom::cuda{}, mview(logits, 2, 10), penalised, h, std::span(pos).first(1), mview(out, 2), ws),
                       doctest::Contains("2 rows of logits, 2 params, 2 histories, 1 positions"), loom::error);
}

TEST_CASE("global-norm clipping on the GPU equals optim::clip_by_global_norm (clipped, not clipped, inf, a reducer)") {
  const std::vector<std::size_t> sizes{1000, 3, emulated ? 7001 : 70001};
  const auto make = [&](float spread) {
    std::vector<std::vector<float>> pieces;
    for (std::size_t i = 0; i < sizes.size(); ++i) pieces.push_back(random_vector<float>(sizes[i], 60 + int(i), spread));
    return pieces;
  };
  const auto doubled = [](double s) { return 2 * s; };  // as if a second rank held the same squares
  loom::optim::clip_workspace ws;
  for (double max_norm : {1.0, 1e9}) {
    for (bool reduce : {false, true}) {
      CAPTURE(max_norm);
      CAPTURE(reduce);
      auto host = make(0.5f);
      std::vector<loom::buffer<float, loom::cuda>> dev;
      for (const auto& p : host) dev.push_back(upload(p));
      const double want = reduce ? loom::optim::clip_by_global_norm({host[0], host[1], host[2]}, max_norm, doubled)
                                 : loom::optim::clip_by_global_norm({host[0], host[1], host[2]}, max_norm);
      const std::initializer_list<loom::tensor_view<float, loom::cuda, 1>> views{
          mview(dev[0], index_t(sizes[0])), mview(dev[1], index_t(sizes[1])), mview(dev[2], index_t(sizes[2]))};
      const double got = reduce ? loom::optim::clip_by_global_norm(loom::cuda{}, views, max_norm, ws, doubled)
                                : loom::optim::clip_by_global_norm(loom::cuda{}, views, max_norm, ws);
      CHECK(std::abs(got - want) <= 1e-10 * want);
      for (std::size_t i = 0; i < host.size(); ++i) {
        if (max_norm > 1e8) CHECK(download(dev[i]) == host[i]);  // not clipped: untouched
        else require_close(download(dev[i]), host[i], 1e-6, 0, "clipped gradients");
      }
    }
  }
  auto host = make(0.5f);
  host[1][2] = std::numeric_limits<float>::infinity();
  auto d0 = upload(host[0]), d1 = upload(host[1]);
  const double norm = loom::optim::clip_by_global_norm(loom::cuda{}, {mview(d0, index_t(sizes[0])), mview(d1, index_t(sizes[1]))},
                                                       1.0, ws);
  CHECK(std::isinf(norm));
  CHECK(download(d0) == host[0]);  // a non-finite norm clips nothing: amp skips the step
  CHECK_THROWS_WITH_AS(loom::optim::clip_by_global_norm(loom::cuda{}, {mview(d0, index_t(sizes[0]))}, 0.0, ws),
                       doctest::Contains("max_norm must be > 0, got max_norm=0"), loom::error);
}
