// loom-bench-gpu's decoder row: one training step (forward and backward of a batch, gradients
// added) of a ~1.1B LLaMA (TinyLlama's shape: hidden 2048, 22 layers, 32 query / 4 key-value
// heads, MLP 5632, vocabulary 32000) through llama3d::stage_model on the cuda tag, the same
// decoder the host trainer runs. The layers compute in fp32 today (cuBLAS in strict fp32,
// attention on the CUDA cores), so the row is the baseline the bf16 path is measured against:
// model FLOP/s (config::flops_per_token) as a share of the bf16 peak is the step's MFU.
// --quick: 4 layers. Parameters are random (their values do not change the step's time).
#include "bench_gpu.hpp"

#include <llama/model/config.hpp>
#include <llama/model3d/llama3d.hpp>
#include <loom/comm/self_comm.hpp>
#include <loom/nn/cuda/context.cuh>

#include <cstdint>
#include <string>
#include <vector>

namespace loom_bench_gpu {

void bench_step(const options& o) {
  llama::config c;
  c.dim = 2048, c.n_layers = o.quick ? 4 : 22, c.n_heads = 32, c.n_kv_heads = 4, c.hidden_dim = 5632, c.vocab = 32000;
  c.seq_len = 2048;
  const index_t batch = 2, seq = 2048;
  loom::comm::self_comm self;
  loom::nn::device_context<loom::cuda> ctx;
  llama3d::stage_model<float, float, loom::comm::self_comm, loom::cuda> m(ctx, c, self, 0, 1);
  const auto random = filled<float>(m.size(), 0.02f);
  ctx.copy(random.data(), m.params().data(), m.size());
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(batch * seq));
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 7919) % std::size_t(c.vocab));
  const auto t = loom::make_view(static_cast<const std::int32_t*>(tokens.data()), batch, seq);
  const double ms = median_ms(o.quick ? 3 : 5, [&] {
    m.forward(0, t, t);
    m.backward(0);
    m.release(0);
  });
  const double flops = c.flops_per_token(seq) * double(batch * seq);
  row("decoder training step (fp32 layers, " + std::to_string(c.n_layers) + " layers of a ~1.1B LLaMA)",
      std::to_string(batch) + " x " + std::to_string(seq) + " tokens, " + std::to_string(int(double(batch * seq) / (ms * 1e-3))) +
          " tokens/s",
      ms, flops / (ms * 1e-3) / 1e12, "TFLOP/s", o.peak_tflops);
}

}  // namespace loom_bench_gpu
