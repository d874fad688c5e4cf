// The decoder itself (llama3d::stage_model: the one model every trainer and mesh runs) on the
// cuda tag against the same decoder on the host: two micro-batches' losses, logits, and the
// gradients they add, from the same initialisation. The host decoder is the oracle (it is
// checked against PyTorch, llama2.c and finite differences elsewhere); what differs between
// the two runs is only each device's ops, so fp32 agrees to summation order (1e-4), and 16-bit
// parameters are widened the same way on both.
#include <llama/model3d/llama3d.hpp>
#include <loom/comm/self_comm.hpp>
#include <loom/core/dtype.hpp>
#include <loom/nn/cuda/context.cuh>

#include <doctest/doctest.h>

#include "ops/cuda/compare.hpp"
#include "ops/cuda/transfer.hpp"

#include <cstdint>
#include <span>
#include <vector>

namespace {

using loom::index_t;
using loom::testing::download;

constexpr double tol = 1e-4;

llama::config small_config() {
  llama::config c;
  c.dim = 32, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.hidden_dim = 48, c.vocab = 40, c.seq_len = 16;
  return c;
}

std::vector<std::int32_t> ids(index_t n, int mul, int add, index_t vocab) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) v[std::size_t(i)] = std::int32_t((i * mul + add) % vocab);
  return v;
}

template <class P>
void check_decoder(const llama::config& c, bool checkpointing) {
  INFO("parameters " << loom::dtype_name(loom::dtype_of<P>) << ", tied " << c.tied_output << ", fused " << c.fused_qkv
                     << ", rotary " << c.partial_rotary_factor << ", checkpointing " << checkpointing);
  loom::comm::self_comm self;
  llama3d::stage_model<P, float, loom::comm::self_comm> host_model(c, self, 0, 1);
  loom::nn::device_context<loom::cuda> ctx;
  llama3d::stage_model<P, float, loom::comm::self_comm, loom::cuda> gpu_model(ctx, c, self, 0, 1);
  host_model.init(7), gpu_model.init(7);
  host_model.set_checkpointing(checkpointing), gpu_model.set_checkpointing(checkpointing);
  REQUIRE(gpu_model.size() == host_model.size());

  const index_t shapes[2][2] = {{2, 7}, {1, 12}};  // two micro-batches of different shapes, both in flight
  float host_loss[2], gpu_loss[2];
  for (int mb = 0; mb < 2; ++mb) {
    const index_t b = shapes[mb][0], s = shapes[mb][1];
    const auto tok = ids(b * s, 7 + mb, 3, c.vocab);
    auto tgt = ids(b * s, 11, 5 + mb, c.vocab);
    tgt[2] = -100;  // ignored
    const auto tv = loom::make_view(tok.data(), b, s), gv = loom::make_view(static_cast<const std::int32_t*>(tgt.data()), b, s);
    host_loss[mb] = host_model.forward(mb, tv, gv);
    gpu_loss[mb] = gpu_model.forward(mb, tv, gv);
  }
  for (int mb = 1; mb >= 0; --mb) {  // backward in the other order, gradients added
    host_model.backward(mb, 0.5f);
    gpu_model.backward(mb, 0.5f);
  }
  for (int mb = 0; mb < 2; ++mb) {
    CHECK(gpu_loss[mb] == doctest::Approx(host_loss[mb]).epsilon(1e-5));
    const auto hl = host_model.logits(mb);
    std::vector<float> dl(static_cast<std::size_t>(hl.numel()));
    ctx.copy_to_host(gpu_model.logits(mb).data(), dl.data(), dl.size());
    require_close(dl, std::vector<float>(hl.data(), hl.data() + hl.numel()), tol, tol, "logits");
    host_model.release(mb), gpu_model.release(mb);
  }
  std::vector<float> host_grads(host_model.layout().size()), gpu_grads(host_grads.size());
  host_model.store_grads(std::span<float>(host_grads));
  gpu_model.store_grads(std::span<float>(gpu_grads));
  require_close(gpu_grads, host_grads, tol, tol, "every parameter's gradient");
  std::vector<float> host_params(host_grads.size()), gpu_params(host_grads.size());
  host_model.store_params(std::span<float>(host_params));
  gpu_model.store_params(std::span<float>(gpu_params));
  CHECK(gpu_params == host_params);  // the same initialisation, copied to the device
}

}  // namespace

TEST_CASE("the decoder (llama3d::stage_model) on the cuda tag equals the host's: losses, logits and gradients of two micro-batches") {
  auto c = small_config();
  check_decoder<float>(c, false);
  check_decoder<float>(c, true);  // activation checkpointing: blocks recomputed in backward
  check_decoder<loom::bfloat16>(c, false);
  // ChatGLM2/3's shape: fused q/k/v with biases, fused gate/up, half the head rotating, tied output
  c.fused_qkv = true, c.qkv_bias = true, c.fused_gate_up = true, c.partial_rotary_factor = 0.5, c.tied_output = true;
  check_decoder<float>(c, false);
}

TEST_CASE("the decoder on the cuda tag refuses what it does not run yet, naming it") {
  const auto c = small_config();
  loom::comm::self_comm self;
  loom::nn::device_context<loom::cuda> ctx;
  CHECK_THROWS_WITH_AS((llama3d::stage_model<float, float, loom::comm::self_comm, loom::cuda>(ctx, c, self, 0, 2)),
                       doctest::Contains("on cuda a rank runs the whole model for now (tp = 1, pp = 1), got tp=1, pp=2"),
                       loom::error);
  llama3d::stage_model<float, float, loom::comm::self_comm, loom::cuda> m(ctx, c, self, 0, 1);
  struct source : llama3d::param_source<float> {
    std::span<float> acquire(std::size_t) override { return {}; }
    void release(std::size_t) override {}
  } src;
  CHECK_THROWS_WITH_AS(m.set_param_source(&src), doctest::Contains("serves a model on the host only, not on cuda"), loom::error);
  const std::vector<std::int32_t> bad{1, 2, 99};
  CHECK_THROWS_WITH_AS(m.forward(0, loom::make_view(bad.data(), 1, 3), loom::make_view(bad.data(), 1, 3)),
                       doctest::Contains("token id 99 at position 2 is outside the vocabulary [0, 40)"), loom::error);
}
