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
#include <loom/optim/adamw.hpp>
#include <loom/optim/clip.hpp>
#include <loom/optim/cuda/adamw.cuh>
#include <loom/optim/cuda/clip.cuh>

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

TEST_CASE("ten training steps on the cuda tag (the decoder, global-norm clipping, fused AdamW) follow the host's") {
  // The single-rank step a trainer runs: forward and backward of the step's batch, clip the
  // gradients to norm 1, AdamW. Both runs start from init(3) and see the same batches; each
  // step's loss and the parameters after the last step are compared. AdamW divides by the
  // root of the second moment, so parameters agree to 1e-4 relative but elements whose
  // gradients stay near zero may move by a few lr-sized steps differently: 1e-3 absolute.
  auto c = small_config();
  c.fused_qkv = true, c.qkv_bias = true;
  loom::comm::self_comm self;
  llama3d::stage_model<float, float, loom::comm::self_comm> host_model(c, self, 0, 1);
  loom::nn::device_context<loom::cuda> ctx;
  llama3d::stage_model<float, float, loom::comm::self_comm, loom::cuda> gpu_model(ctx, c, self, 0, 1);
  host_model.init(3), gpu_model.init(3);
  const std::size_t n = host_model.size();
  std::vector<float> m(n, 0.f), v(n, 0.f);
  loom::buffer<float, loom::cuda> dm(n), dv(n);
  ctx.fill(dm.view(), 0.f), ctx.fill(dv.view(), 0.f);
  loom::optim::clip_workspace clip_ws;
  const loom::optim::adamw_options o{.lr = 3e-3f, .weight_decay = 0.1f};
  const auto dev = [](std::span<float> s) { return loom::make_view<loom::cuda>(s.data(), static_cast<index_t>(s.size())); };
  const index_t b = 2, s = 8;
  for (int step = 1; step <= 10; ++step) {
    const auto tok = ids(b * s, 5 + step, step, c.vocab), tgt = ids(b * s, 3 + step, 2 * step + 1, c.vocab);
    const auto tv = loom::make_view(tok.data(), b, s), gv = loom::make_view(tgt.data(), b, s);
    host_model.zero_grad(), gpu_model.zero_grad();
    const float hl = host_model.forward(0, tv, gv), gl = gpu_model.forward(0, tv, gv);
    host_model.backward(0), gpu_model.backward(0);
    host_model.release(0), gpu_model.release(0);
    INFO("step " << step);
    CHECK(gl == doctest::Approx(hl).epsilon(1e-4));
    const double hn = loom::optim::clip_by_global_norm(host_model.grads(), 1.0);
    const double gn = loom::optim::clip_by_global_norm(loom::cuda{}, {dev(gpu_model.grads())}, 1.0, clip_ws, {}, ctx.stream());
    CHECK(gn == doctest::Approx(hn).epsilon(1e-4));
    loom::optim::adamw_update(host_model.params(), host_model.grads(), m, v, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay,
                              step);
    loom::optim::adamw_update(loom::cuda{}, dev(gpu_model.params()), dev(gpu_model.grads()), dm.view(), dv.view(), o.lr,
                              o.beta1, o.beta2, o.eps, o.weight_decay, step, ctx.stream());
  }
  std::vector<float> host_params(host_model.layout().size()), gpu_params(host_params.size());
  host_model.store_params(std::span<float>(host_params));
  gpu_model.store_params(std::span<float>(gpu_params));
  require_close(gpu_params, host_params, 1e-4, 1e-3, "parameters after ten steps");
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
