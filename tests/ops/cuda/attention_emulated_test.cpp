// ops/cuda/attention.cuh's kernels on host threads (emulation.hpp: a CUDA block as 128
// std::threads), against the host's attention (ops/host/attention.hpp, itself tested against
// a naive loop and finite differences): the kernels' indexing, masks, tiles, GQA head
// mapping, warp reductions and online softmax are checked by the CPU CI, which has no GPU.
// The launches (grids, head_dim per lane) are the header's own (attention_query_launch,
// attention_key_launch, with_dims_per_lane); the GPU test (kernels_test.cu) runs the same
// comparison on a device. Tolerances as there: out rtol 1e-4 / atol 1e-5, dq, dk, dv 1e-4.
#include "emulation.hpp"

#include <loom/ops/cuda/attention.cuh>

#include <loom/core/random.hpp>
#include <loom/ops/host/attention.hpp>

#include <doctest/doctest.h>

#include "ops/cuda/compare.hpp"

#include <cmath>
#include <span>
#include <string>
#include <vector>

namespace {

using loom::host;
using loom::index_t;
using loom::make_view;
namespace ops = loom::ops;
namespace kernels = loom::ops::kernels;
using loom::emulation::emulate_launch;



dim3 grid_of(const kernels::attention_launch& l) {
  REQUIRE(l.smem <= loom::emulation::dynamic_shared_bytes);
  return {l.x, l.y, l.z};
}

void check(index_t b, index_t s, index_t h, index_t kvh, index_t hd, index_t prefix, bool accumulate) {
  INFO("batch " << b << ", seq " << s << ", heads " << h << "/" << kvh << ", head_dim " << hd << ", prefix " << prefix
                << (accumulate ? ", accumulate" : ", write"));
  const ops::attention_mask mask{prefix};
  const auto nq = std::size_t(b * s * h * hd), nk = std::size_t(b * s * kvh * hd);
  const auto q = random_vector(nq, 31), k = random_vector(nk, 32), v = random_vector(nk, 33), dout = random_vector(nq, 34);
  const auto dq0 = random_vector(nq, 35), dk0 = random_vector(nk, 36), dv0 = random_vector(nk, 37);
  std::vector<float> out(nq), probs(std::size_t(b * h * s * s)), scratch(std::size_t(s * s)), dq = dq0, dk = dk0, dv = dv0;
  const auto hq = make_view(q.data(), b, s, h, hd), hk = make_view(k.data(), b, s, kvh, hd), hv = make_view(v.data(), b, s, kvh, hd);
  ops::attention_forward(host{}, hq, hk, hv, make_view(out.data(), b, s, h, hd), make_view(probs.data(), b, h, s, s), mask);
  ops::attention_backward(host{}, make_view(dout.data(), b, s, h, hd), hq, hk, hv, make_view(probs.data(), b, h, s, s),
                          make_view(dq.data(), b, s, h, hd), make_view(dk.data(), b, s, kvh, hd),
                          make_view(dv.data(), b, s, kvh, hd), make_view(scratch.data(), s, s), mask, accumulate);

  std::vector<float> eout(nq, -9.f), lse(std::size_t(b * h * s), -9.f), delta(lse.size()), edq = dq0, edk = dk0, edv = dv0;
  const float scale = 1.f / std::sqrt(float(hd));
  const int dim = static_cast<int>(hd);
  constexpr unsigned threads = kernels::attention_warps * 32;
  kernels::with_dims_per_lane(hd, [&](auto dpl) {
    constexpr int DPL = decltype(dpl)::value;
    emulate_launch(kernels::attention_forward<DPL>, grid_of(kernels::attention_query_launch(b, s, h, dim, 1)), threads, q.data(),
                   k.data(), v.data(), eout.data(), lse.data(), s, h, kvh, dim, scale, mask);
    emulate_launch(kernels::attention_delta, dim3{2, 1, 1}, 64, dout.data(), static_cast<const float*>(eout.data()),
                   delta.data(), b * s * h, s, h, dim);
    emulate_launch(kernels::attention_backward_dq<DPL>, grid_of(kernels::attention_query_launch(b, s, h, dim, 2)), threads,
                   dout.data(), q.data(), k.data(), v.data(), static_cast<const float*>(lse.data()),
                   static_cast<const float*>(delta.data()), edq.data(), s, h, kvh, dim, scale, mask, accumulate);
    emulate_launch(kernels::attention_backward_dkdv<DPL>, grid_of(kernels::attention_key_launch(b, s, kvh, dim)), threads,
                   dout.data(), q.data(), k.data(), v.data(), static_cast<const float*>(lse.data()),
                   static_cast<const float*>(delta.data()), edk.data(), edv.data(), s, h, kvh, dim, scale, mask, accumulate);
  });
  require_close(eout, out, 1e-4, 1e-5, "out");
  require_close(edq, dq, 1e-4, 1e-4, "dq");
  require_close(edk, dk, 1e-4, 1e-4, "dk");
  require_close(edv, dv, 1e-4, 1e-4, "dv");
}

}  // namespace

TEST_CASE("the CUDA attention kernels, emulated on host threads, equal the host's attention (causal, prefix-LM, GQA, MQA)") {
  check(2, 40, 4, 2, 64, 0, true);     // GQA, two batch entries; query and key tiles cut mid-tile
  check(1, 50, 2, 1, 128, 20, false);  // MQA, prefix-LM
  check(1, 37, 3, 3, 33, 50, true);    // an odd head_dim leaving lanes idle; a prefix past the sequence
  check(1, 40, 1, 1, 256, 0, false);   // the largest head_dim
}
