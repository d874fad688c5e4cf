// The example of docs/pipeline.md, compiled and checked: each of 4 stages doubles its input;
// micro-batch mb enters as n copies of mb + 1, so the loss sum(y) is sum_mb n (mb+1) 2^4 and
// the gradient reaching stage 0 is 2^3 per element (stages 1..3 each double it).
#include <loom/comm/thread_comm.hpp>
#include <loom/pipeline/executor.hpp>
#include <loom/pipeline/render.hpp>

#include <doctest/doctest.h>

#include <iostream>
#include <span>

namespace {

// --- docs/pipeline.md example begins ---
struct doubling_stage {  // one stage of a toy model: y = 2 x; loss = sum(y) on the last stage
  int stage, stages;
  double loss = 0, grad_seen = 0;
  void forward(int mb, int chunk, std::span<const float> in, std::span<float> out) {
    for (std::size_t i = 0; i < (out.empty() ? in.size() : out.size()); ++i) {
      const float x = in.empty() ? float(mb + 1) : in[i];  // stage 0 reads micro-batch mb
      if (out.empty()) loss += 2 * x;                       // last stage: the loss
      else out[i] = 2 * x;
    }
  }
  void backward(int mb, int chunk, std::span<const float> in, std::span<const float> grad_out,
                std::span<float> grad_in) {
    for (std::size_t i = 0; i < grad_in.size(); ++i) grad_in[i] = 2 * (grad_out.empty() ? 1.0f : grad_out[i]);
    if (grad_in.empty()) grad_seen += grad_out[0];  // stage 0: d loss / d (its output)
  }
};

void pipeline_example(double& loss, double& grad) {
  namespace lp = loom::pipeline;
  lp::schedule plan = lp::one_f_one_b(/*p=*/4, /*m=*/8);
  lp::simulation sim = lp::prove(plan, {.forward = 1, .backward = 2});  // throws if unsound
  std::cout << lp::render_ascii(sim) << sim.report();

  loom::comm::run_ranks(4, [&](loom::comm::thread_comm& comm) {  // rank = stage
    lp::executor<float, loom::comm::thread_comm> ex(plan, comm, /*activation_elements=*/16);
    doubling_stage stage{comm.rank(), comm.size()};
    ex.run(stage);  // one training step: 8 micro-batches
    if (comm.rank() == 3) loss = stage.loss;
    if (comm.rank() == 0) grad = stage.grad_seen;
  });
}
// --- docs/pipeline.md example ends ---

}  // namespace

TEST_CASE("the example of docs/pipeline.md") {
  double loss = 0, grad = 0;
  pipeline_example(loss, grad);
  CHECK(loss == doctest::Approx(16.0 * 16 * (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8)));
  CHECK(grad == doctest::Approx(8.0 * 8));  // 8 micro-batches, 2^3 each
}
