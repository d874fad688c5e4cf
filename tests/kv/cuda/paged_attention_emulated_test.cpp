// kv/cuda/paged_attention.cuh's kernels (append, split-KV decode, the merge of the splits) on
// host threads (tests/ops/cuda/emulation.hpp), against the host's append_paged_kv_cache and
// batch_decode_with_paged_kv_cache (kv_paged_attention_test checks those against a contiguous
// reference): the pool the emulated append writes must equal the host's bit for bit, and
// decode the host's output within rtol/atol 1e-5 (warps and splits add in another order), on
// a scrambled pool, GQA and MQA, fp32 and bf16 pools, one and several splits. The split count
// is the header's own (decode_splits); the GPU test (tests/ops/cuda/kernels_test.cu) runs the
// same comparison on a device.
#include "ops/cuda/emulation.hpp"

#include <loom/kv/cuda/paged_attention.cuh>

#include <loom/core/float16.hpp>
#include <loom/core/random.hpp>
#include <loom/kv/paged_attention.hpp>

#include <doctest/doctest.h>

#include "ops/cuda/compare.hpp"

#include "kv/cuda/scrambled_pool.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace {

namespace kv = loom::kv;
namespace kernels = loom::kv::kernels;
using loom::host;
using loom::make_view;
using loom::emulation::emulate_launch;


template <class T>
void check(std::int32_t block_size, std::int64_t nh, std::int64_t hk, std::int64_t dim, const std::vector<std::int64_t>& kv_lens,
           bool aligned16 = true) {
  INFO("block_size " << block_size << ", heads " << nh << "/" << hk << ", head_dim " << dim << ", sequences " << kv_lens.size());
  const auto batch = static_cast<std::int32_t>(kv_lens.size());
  kv::testing::scrambled_pool pool(block_size, kv_lens);
  const std::int64_t total = pool.total, longest = pool.longest;
  const std::int32_t num_blocks = pool.num_blocks;
  const auto& csr = pool.csr;
  const auto& bidx = pool.bidx;
  const auto& pos = pool.pos;
  const auto k = random_vector(std::size_t(total * hk * dim), 40), v = random_vector(k.size(), 41);
  const auto q = random_vector(std::size_t(batch * nh * dim), 42, 2.f);
  const std::size_t cache_elems = std::size_t(num_blocks) * 2 * std::size_t(block_size * hk * dim);
  std::vector<T> cache(cache_elems, T(0.f)), ecache(cache_elems, T(0.f));
  std::vector<float> out(q.size(), -9.f), eout(q.size(), -9.f);
  auto cache_view = make_view(cache.data(), num_blocks, 2, block_size, hk, dim);
  kv::append_paged_kv_cache(host{}, make_view(k.data(), total, hk, dim), make_view(v.data(), total, hk, dim), bidx, pos,
                            cache_view, csr);
  kv::batch_decode_with_paged_kv_cache(host{}, make_view(q.data(), batch, nh, dim), cache_view, csr,
                                       make_view(out.data(), batch, nh, dim));

  emulate_launch(kernels::append_paged_kv<T>, dim3{3, 1, 1}, 64, k.data(), v.data(), bidx.data(), pos.data(), ecache.data(),
                 static_cast<const std::int32_t*>(csr.indptr.data()), static_cast<const std::int32_t*>(csr.indices.data()),
                 total, hk, dim, block_size);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < cache_elems; ++i) differ += static_cast<float>(ecache[i]) != static_cast<float>(cache[i]);
  CHECK(differ == 0);

  const std::int64_t splits = kernels::decode_splits(longest);
  std::vector<float> acc(std::size_t(batch * nh * splits * dim)), m(std::size_t(batch * nh * splits)), l(m.size());
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  kernels::with_decode_kernel<T>(dim, nh / hk, aligned16, [&](auto kernel, int heads, int lanes, std::size_t smem) {
    REQUIRE(smem <= loom::emulation::dynamic_shared_bytes);
    emulate_launch(kernel, dim3{unsigned(splits), unsigned(nh / heads), unsigned(batch)}, kernels::decode_warps * 32,
                   q.data(), static_cast<const T*>(ecache.data()), csr.indptr.data(), csr.indices.data(),
                   csr.last_page_len.data(), block_size, hk, static_cast<std::int32_t>(dim), lanes, scale, splits,
                   eout.data(), acc.data(), m.data(), l.data());
  });
  if (splits > 1)
    emulate_launch(kernels::merge_splits, dim3{unsigned(nh), unsigned(batch), 1}, 64, static_cast<const float*>(acc.data()),
                   static_cast<const float*>(m.data()), static_cast<const float*>(l.data()), splits,
                   static_cast<std::int32_t>(dim), eout.data());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < out.size(); ++i) bad += !(std::abs(eout[i] - out[i]) <= 1e-5 + 1e-5 * std::abs(out[i]));
  INFO("decode: " << bad << " of " << out.size() << " outputs differ (splits " << splits << ")");
  CHECK(bad == 0);
}

/// Ragged prefill over a scrambled pool: sequence b's last q_lens[b] tokens as queries (a
/// whole prompt, a decode row, a chunk), against the host's prefill, causal and not.
template <class T>
void check_prefill(std::int32_t block_size, std::int64_t nh, std::int64_t hk, std::int64_t dim,
                   const std::vector<std::int64_t>& kv_lens, const std::vector<std::int32_t>& q_lens, bool causal) {
  INFO("block_size " << block_size << ", heads " << nh << "/" << hk << ", head_dim " << dim << (causal ? ", causal" : ""));
  kv::testing::scrambled_pool pool(block_size, kv_lens);
  const auto num_blocks = pool.num_blocks;
  const std::size_t cache_elems = std::size_t(num_blocks) * 2 * std::size_t(block_size * hk * dim);
  std::vector<T> cache(cache_elems, T(0.f));
  const auto k = random_vector(std::size_t(pool.total * hk * dim), 43), v = random_vector(k.size(), 44);
  auto cache_view = make_view(cache.data(), num_blocks, 2, block_size, hk, dim);
  kv::append_paged_kv_cache(host{}, make_view(k.data(), pool.total, hk, dim), make_view(v.data(), pool.total, hk, dim),
                            pool.bidx, pool.pos, cache_view, pool.csr);
  std::vector<std::int32_t> qo_indptr{0};
  std::int64_t max_q = 0;
  for (auto n : q_lens) qo_indptr.push_back(qo_indptr.back() + n), max_q = std::max<std::int64_t>(max_q, n);
  const std::int64_t total_q = qo_indptr.back();
  const auto q = random_vector(std::size_t(total_q * nh * dim), 45, 2.f);
  std::vector<float> out(q.size(), -9.f), eout(q.size(), -9.f);
  kv::attention_params params;
  params.causal = causal;
  kv::batch_prefill_with_paged_kv_cache(host{}, make_view(q.data(), total_q, nh, dim), qo_indptr, cache_view, pool.csr,
                                        make_view(out.data(), total_q, nh, dim), params);
  const std::int64_t max_kv = *std::max_element(kv_lens.begin(), kv_lens.end());
  for (std::int64_t splits : {1, 2, 3}) {  // the launch code picks one split below 1024 keys: these force more
    CAPTURE(splits);
    const std::int64_t split_keys = kernels::prefill_split_keys(max_kv, splits);
    const auto shape = kernels::prefill_launch(static_cast<std::int32_t>(kv_lens.size()), nh, max_q,
                                               static_cast<std::int32_t>(dim), splits);
    REQUIRE(shape.smem <= loom::emulation::dynamic_shared_bytes);
    std::vector<float> acc(std::size_t(total_q * nh * splits * dim)), m(std::size_t(total_q * nh * splits)), l(m.size());
    std::fill(eout.begin(), eout.end(), -9.f);
    loom::ops::kernels::with_dims_per_lane(dim, [&](auto dpl) {
      emulate_launch(kernels::prefill_tiles<T, decltype(dpl)::value>, dim3{shape.x, shape.y, shape.z},
                     loom::ops::kernels::attention_warps * 32, q.data(), static_cast<const std::int32_t*>(qo_indptr.data()),
                     static_cast<const T*>(cache.data()), pool.csr.indptr.data(), pool.csr.indices.data(),
                     pool.csr.last_page_len.data(), block_size, hk, static_cast<std::int32_t>(dim),
                     1.f / std::sqrt(static_cast<float>(dim)), causal, eout.data(), splits, split_keys, acc.data(), m.data(),
                     l.data());
    });
    if (splits > 1)
      emulate_launch(kernels::merge_splits, dim3{unsigned(nh), unsigned(total_q), 1}, 64, static_cast<const float*>(acc.data()),
                     static_cast<const float*>(m.data()), static_cast<const float*>(l.data()), splits,
                     static_cast<std::int32_t>(dim), eout.data());
    require_close(eout, out, 1e-5, 1e-5, "prefill");
  }
}

}  // namespace

TEST_CASE("the CUDA paged prefill, emulated on host threads, equals the host's (ragged queries, causal and not, GQA, bf16)") {
  check_prefill<float>(16, 4, 2, 64, {40, 5, 90}, {40, 1, 33}, true);   // a whole prompt, a decode row, a chunk
  check_prefill<float>(16, 4, 2, 64, {40, 5, 90}, {40, 1, 33}, false);
  check_prefill<loom::bfloat16>(8, 3, 1, 40, {70, 9}, {0, 9}, true);    // MQA, a bf16 pool, a sequence without queries
}

TEST_CASE("the CUDA paged-KV append and split-KV decode, emulated on host threads, equal the host's") {
  check<float>(16, 4, 2, 64, {1, 17, 300});            // GQA, one split
  check<float>(16, 4, 2, 96, {600, 5, 1100});          // several splits; a head_dim of 3 lanes
  check<loom::bfloat16>(8, 3, 1, 40, {530, 33});       // MQA, a bf16 pool, lanes partly idle
  // every kernel with_decode_kernel picks: the staged one for 4, 2 and 1 heads a block (the
  // lines above: 2, 2 and 1), the register one with two vectors a lane (fp32, head_dim 256) and
  // with element loads (head_dim 36 and 33, or a pool not 16-byte aligned)
  check<loom::bfloat16>(16, 16, 2, 128, {600, 1, 77});  // a group of 8: 4 heads a block, two rows a warp
  check<loom::bfloat16>(16, 8, 2, 128, {300});          // 4 heads a block, one tile
  check<loom::bfloat16>(16, 12, 2, 64, {520, 3});       // a group of 6: 2 heads a block
  check<float>(16, 2, 2, 128, {400});                   // fp32, one head a block
  check<float>(4, 2, 1, 256, {700});                    // two vectors a lane
  check<loom::bfloat16>(16, 4, 2, 36, {530, 20});       // element loads
  check<float>(16, 3, 3, 33, {300, 2});
  check<loom::bfloat16>(16, 8, 2, 128, {600, 9}, false);
}
