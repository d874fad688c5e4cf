// Paged attention (prefill and decode, grouped-query heads, chunked queries) against naive
// attention over contiguous keys and values: two-pass softmax in double, per sequence.
#include <doctest/doctest.h>

#include <loom/core/float16.hpp>
#include <loom/core/random.hpp>
#include <loom/kv/block_allocator.hpp>
#include <loom/kv/block_table.hpp>
#include <loom/kv/paged_attention.hpp>
#include <loom/kv/paged_kv_cache.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

using namespace loom;
using namespace loom::kv;

namespace {

// out[i, h, :] for queries q[i] at positions kv_len - q_len + i over contiguous k, v.
//   q: [q_len, nh, dim]; k, v: [kv_len, hk, dim]
std::vector<double> naive_attention(const std::vector<float>& q, const std::vector<float>& k,
                                    const std::vector<float>& v, int q_len, int kv_len, int nh, int hk, int dim,
                                    bool causal) {
  std::vector<double> out(static_cast<std::size_t>(q_len * nh * dim), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  for (int i = 0; i < q_len; ++i)
    for (int h = 0; h < nh; ++h) {
      const int g = h / (nh / hk);
      const int n = causal ? kv_len - q_len + i + 1 : kv_len;
      std::vector<double> s(static_cast<std::size_t>(n));
      double mx = -1e300;
      for (int j = 0; j < n; ++j) {
        double acc = 0;
        for (int d = 0; d < dim; ++d) acc += double(q[static_cast<std::size_t>((i * nh + h) * dim + d)]) * k[static_cast<std::size_t>((j * hk + g) * dim + d)];
        s[static_cast<std::size_t>(j)] = acc * scale;
        mx = std::max(mx, s[static_cast<std::size_t>(j)]);
      }
      double sum = 0;
      for (auto& x : s) sum += (x = std::exp(x - mx));
      for (int j = 0; j < n; ++j)
        for (int d = 0; d < dim; ++d)
          out[static_cast<std::size_t>((i * nh + h) * dim + d)] += s[static_cast<std::size_t>(j)] / sum * v[static_cast<std::size_t>((j * hk + g) * dim + d)];
    }
  return out;
}

template <class T>
void run_case(int block_size, int nh, int hk, int dim, bool decode, bool causal, double tol) {
  const int batch = 5;
  counter_rng rng(7 + static_cast<std::uint64_t>(block_size * 100 + nh * 10 + hk));
  std::uint64_t off = 0;
  auto draw = [&](std::vector<float>& x) {
    rng.fill_normal(std::span<float>(x), off);
    off += x.size();
  };
  kv_cache_shape shape{1, 128, block_size, hk, dim};
  paged_kv_cache<T> cache(shape);
  block_allocator alloc(shape.num_blocks, block_size);
  // Scramble the free list so that pages are not in order.
  std::vector<block_id> hold;
  for (int i = 0; i < 7; ++i) hold.push_back(alloc.allocate());
  for (int i = 0; i < 7; i += 2) alloc.release(hold[static_cast<std::size_t>(i)]);

  std::vector<int> kv_lens{1, 5, 17, 33, 48}, q_lens{1, 5, 3, 16, 48};
  if (decode) q_lens.assign(static_cast<std::size_t>(batch), 1);
  std::vector<block_table> tables(static_cast<std::size_t>(batch));
  std::vector<std::vector<float>> ks(static_cast<std::size_t>(batch)), vs(static_cast<std::size_t>(batch)),
      qs(static_cast<std::size_t>(batch));
  paged_kv_csr csr;
  csr.block_size = block_size;
  csr.clear();
  std::vector<std::int32_t> qo{0};
  std::vector<float> all_k, all_v, all_q;
  std::vector<std::int32_t> bidx;
  std::vector<std::int64_t> pos;
  for (int b = 0; b < batch; ++b) {
    const auto sb = static_cast<std::size_t>(b);
    std::vector<block_copy> copies;
    REQUIRE(tables[sb].prepare_write(alloc, 0, kv_lens[sb], copies));
    ks[sb].resize(static_cast<std::size_t>(kv_lens[sb] * hk * dim));
    vs[sb].resize(ks[sb].size());
    qs[sb].resize(static_cast<std::size_t>(q_lens[sb] * nh * dim));
    draw(ks[sb]), draw(vs[sb]), draw(qs[sb]);
    if constexpr (!std::is_same_v<T, float>)  // the oracle sees the stored (rounded) values
      for (auto* x : {&ks[sb], &vs[sb]})
        for (auto& e : *x) e = static_cast<float>(T(e));
    csr.push(tables[sb], kv_lens[sb]);
    qo.push_back(qo.back() + q_lens[sb]);
    all_k.insert(all_k.end(), ks[sb].begin(), ks[sb].end());
    all_v.insert(all_v.end(), vs[sb].begin(), vs[sb].end());
    all_q.insert(all_q.end(), qs[sb].begin(), qs[sb].end());
    for (int p = 0; p < kv_lens[sb]; ++p) bidx.push_back(b), pos.push_back(p);
  }
  const auto nk = static_cast<index_t>(bidx.size());
  append_paged_kv_cache(host{}, make_view<host>(static_cast<const float*>(all_k.data()), nk, hk, dim),
                        make_view<host>(static_cast<const float*>(all_v.data()), nk, hk, dim), bidx, pos,
                        cache.layer(0), csr);
  const auto nq = static_cast<index_t>(all_q.size() / static_cast<std::size_t>(nh * dim));
  std::vector<float> out(all_q.size(), -99.f);
  auto qv = make_view<host>(static_cast<const float*>(all_q.data()), nq, nh, dim);
  auto ov = make_view<host>(out.data(), nq, nh, dim);
  if (decode)
    batch_decode_with_paged_kv_cache(host{}, qv, cache.layer(0), csr, ov);
  else
    batch_prefill_with_paged_kv_cache(host{}, qv, qo, cache.layer(0), csr, ov, {0.f, causal});
  double worst = 0;
  for (int b = 0; b < batch; ++b) {
    const auto sb = static_cast<std::size_t>(b);
    auto ref = naive_attention(qs[sb], ks[sb], vs[sb], q_lens[sb], kv_lens[sb], nh, hk, dim, causal);
    for (std::size_t i = 0; i < ref.size(); ++i)
      worst = std::max(worst, std::abs(ref[i] - out[static_cast<std::size_t>(qo[sb] * nh * dim) + i]));
  }
  CAPTURE(block_size);
  CAPTURE(nh);
  CAPTURE(hk);
  CAPTURE(decode);
  CAPTURE(causal);
  CHECK(worst < tol);
  for (auto& t : tables) t.release(alloc);
}

}  // namespace

TEST_CASE("paged prefill and decode equal naive contiguous attention") {
  for (int bs : {1, 4, 16})
    for (auto [nh, hk] : {std::pair{4, 4}, std::pair{4, 2}, std::pair{6, 1}}) {
      run_case<float>(bs, nh, hk, 8, false, true, 1e-5);
      run_case<float>(bs, nh, hk, 8, false, false, 1e-5);
      run_case<float>(bs, nh, hk, 8, true, true, 1e-5);
    }
  run_case<half>(16, 8, 2, 16, false, true, 1e-4);
  run_case<bfloat16>(16, 8, 2, 16, true, true, 1e-4);
}

TEST_CASE("paged attention rejects mismatched shapes") {
  kv_cache_shape shape{1, 4, 4, 2, 8};
  paged_kv_cache<float> cache(shape);
  block_allocator alloc(4, 4);
  block_table t;
  std::vector<block_copy> copies;
  REQUIRE(t.prepare_write(alloc, 0, 3, copies));
  paged_kv_csr csr;
  csr.block_size = 4;
  csr.clear();
  csr.push(t, 3);
  std::vector<float> q(3 * 3 * 8), out(q.size());
  auto qv = make_view<host>(static_cast<const float*>(q.data()), 3, 3, 8);  // 3 heads over 2 kv heads
  std::vector<std::int32_t> qo{0, 3};
  CHECK_THROWS_AS(batch_prefill_with_paged_kv_cache(host{}, qv, qo, cache.layer(0), csr, make_view<host>(out.data(), 3, 3, 8)),
                  loom::error);
  std::vector<float> q4(4 * 4 * 8), o4(q4.size());
  auto q4v = make_view<host>(static_cast<const float*>(q4.data()), 4, 4, 8);  // 4 queries, kv_len 3
  std::vector<std::int32_t> qo4{0, 4};
  CHECK_THROWS_AS(
      batch_prefill_with_paged_kv_cache(host{}, q4v, qo4, cache.layer(0), csr, make_view<host>(o4.data(), 4, 4, 8)),
      loom::error);
  csr.block_size = 8;
  CHECK_THROWS_AS(batch_decode_with_paged_kv_cache(host{}, make_view<host>(static_cast<const float*>(q4.data()), 1, 4, 8),
                                                   cache.layer(0), csr, make_view<host>(o4.data(), 1, 4, 8)),
                  loom::error);
}

TEST_CASE("online-softmax states of split key ranges merge to the one-pass result (the GPU's split-KV arithmetic)") {
  // attend_row over all keys against attend_row's own steps over [0, cut) and [cut, n) merged
  // with ops::math::online_softmax_merge, for every cut including the empty ranges; the
  // oracle for both is naive attention in double.
  const int n = 37, dim = 12;
  std::vector<float> q(dim), k(static_cast<std::size_t>(n * dim)), v(k.size());
  counter_rng(91).fill_normal(std::span<float>(q), 0, 0.f, 1.f);
  counter_rng(92).fill_normal(std::span<float>(k), 0, 0.f, 2.f);
  counter_rng(93).fill_normal(std::span<float>(v), 0, 0.f, 1.f);
  const auto want = naive_attention(q, k, v, 1, n, 1, 1, dim, false);
  const float scale = 1.f / std::sqrt(float(dim));
  auto run = [&](int j0, int j1, float& m, float& l, std::vector<float>& acc) {
    m = -std::numeric_limits<float>::infinity(), l = 0.f;
    acc.assign(dim, 0.f);
    for (int j = j0; j < j1; ++j)
      kv::detail::softmax_step(kv::detail::dot(q.data(), &k[std::size_t(j * dim)], dim) * scale, &v[std::size_t(j * dim)], dim, m, l,
                           acc.data());
  };
  for (int cut = 0; cut <= n; ++cut) {
    CAPTURE(cut);
    float m1, l1, m2, l2, c1, c2;
    std::vector<float> a1, a2;
    run(0, cut, m1, l1, a1);
    run(cut, n, m2, l2, a2);
    ops::math::online_softmax_merge(m1, l1, m2, l2, c1, c2);
    for (int d = 0; d < dim; ++d) {
      const double got = double(a1[std::size_t(d)] * c1 + a2[std::size_t(d)] * c2) / l1;
      CHECK(std::abs(got - want[std::size_t(d)]) <= 1e-5 * (1 + std::abs(want[std::size_t(d)])));
    }
  }
  // two empty ranges stay empty: no NaN from e^(-inf - -inf)
  float m = -std::numeric_limits<float>::infinity(), l = 0.f, c1 = -1.f, c2 = -1.f;
  ops::math::online_softmax_merge(m, l, -std::numeric_limits<float>::infinity(), 0.f, c1, c2);
  CHECK(l == 0.f);
  CHECK(c1 == 0.f);
  CHECK(c2 == 0.f);
}
