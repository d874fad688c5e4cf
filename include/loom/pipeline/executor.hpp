#pragma once
// The pipeline executor: runs a proven schedule on one rank of a pipeline group.
//
// Each rank (rank r of the communicator = stage r) builds an executor from the same schedule.
// The constructor proves the schedule with the simulator (a bad plan is refused before the
// first micro-batch) and plans the memory: every tensor that crosses a stage boundary (the
// input activation of a pass, its output, the gradient it receives and the one it sends) gets
// a slot in one pool, allocated once; slots are reused as soon as the schedule no longer
// needs them, so GPipe holds m input activations and 1F1B at most min(p-s, m) plus the
// transfers in flight. run() then walks the stage's op list without allocating:
//
//   forward(mb, chunk)   model.forward(mb, chunk, input, output)
//   backward(mb, chunk)  model.backward(mb, chunk, input, grad_output, grad_input)
//   send_*               comm.send_async(slot, peer, tag): the slot is not written again until
//                        the send completed, so the stage runs on while the tensor travels;
//                        after every pass the sends in flight are polled (work::test()),
//                        which is what lets Open MPI progress them
//   recv_*               comm.recv(slot, peer, tag)
//   optimizer_step       model.optimizer_step() if the model has one
//
// Spans given to the model: `input` is the activation received from the previous virtual
// stage (empty on virtual stage 0, whose model reads micro-batch mb of its data), `output`
// receives the activation for the next one (empty on the last virtual stage, which computes
// the loss); in backward `grad_output` is the gradient of the loss with respect to `output`
// (empty on the last virtual stage) and `grad_input` receives the gradient with respect to
// `input` (empty on virtual stage 0). All have activation_elements elements. The model
// accumulates its parameter gradients over the micro-batches of a step; the executor never
// touches parameters. Each transfer has its own tag ((mb * p*v + sending virtual stage) * 2 +
// is_gradient), so messages cannot be confused whatever the backend's matching rules are.
// Blocking the executor as the schedule says is safe on any backend: the schedule was proven
// under rendezvous sends, the strictest semantics.

#include <loom/comm/communicator.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>
#include <loom/pipeline/schedule.hpp>
#include <loom/pipeline/simulate.hpp>

#include <cstddef>
#include <deque>
#include <span>
#include <utility>
#include <vector>

namespace loom::pipeline {

/// Requires: M runs the passes of its stage's chunks on micro-batches (see the file comment).
template <class M, class T>
concept stage_model = requires(M& m, int microbatch, int chunk, std::span<const T> input, std::span<T> output,
                               std::span<const T> grad_output, std::span<T> grad_input) {
  m.forward(microbatch, chunk, input, output);
  m.backward(microbatch, chunk, input, grad_output, grad_input);
};

/// The largest tag the executor uses must stay below this (the MPI standard's guaranteed
/// minimum of MPI_TAG_UB).
inline constexpr long max_pipeline_tag = 32767;

template <element T, comm::communicator C>
class executor {
 public:
  /// Plans `s` for rank comm.rank(); throws loom::error if the schedule is not sound, if the
  /// group size is not the number of stages, or if activation_elements is 0.
  executor(schedule s, C& comm, std::size_t activation_elements, memory_resource& resource = default_resource<host>())
      : s_(std::move(s)), comm_(&comm), n_(activation_elements), stage_(comm.rank()) {
    LOOM_CHECK(comm.size() == s_.stages, "pipeline::executor: the communicator has size=", comm.size(),
               " ranks but schedule '", s_.name, "' has stages=", s_.stages);
    LOOM_CHECK(n_ > 0, "pipeline::executor: activation_elements=", n_, " must be > 0");
    const long top_tag = 2L * s_.microbatches * s_.virtual_stages();
    LOOM_CHECK(top_tag <= max_pipeline_tag, "pipeline::executor: m=", s_.microbatches, " micro-batches x ",
               s_.virtual_stages(), " virtual stages need tags up to ", top_tag, " > ", max_pipeline_tag);
    prove(s_);
    plan();
    pool_ = buffer<T>(static_cast<std::size_t>(slots_) * n_, resource);
    pending_.resize(static_cast<std::size_t>(slots_));
  }

  /// Runs one training step: every op of this rank's stage, in order. Blocks until this
  /// rank's sends have completed.
  template <stage_model<T> M>
  void run(M& model) {
    for (const step& x : steps_) {
      const op& o = x.o;
      switch (o.kind) {
        case op_kind::forward:
          writable(x.b);
          model.forward(o.microbatch, o.chunk, cview(x.a), view(x.b));
          progress();
          break;
        case op_kind::backward:
          writable(x.c);
          model.backward(o.microbatch, o.chunk, cview(x.a), cview(x.b), view(x.c));
          progress();
          break;
        case op_kind::send_activation:
        case op_kind::send_gradient:
          pending_[static_cast<std::size_t>(x.a)] = comm_->send_async(cview(x.a), o.peer, x.tag);
          break;
        case op_kind::recv_activation:
        case op_kind::recv_gradient:
          writable(x.a);
          comm_->recv(view(x.a), o.peer, x.tag);
          break;
        case op_kind::optimizer_step:
          if constexpr (requires { model.optimizer_step(); }) model.optimizer_step();
          break;
      }
    }
    for (auto& w : pending_) w.wait();
  }

  const schedule& plan_schedule() const noexcept { return s_; }
  int stage() const noexcept { return stage_; }
  /// Boundary tensors of activation_elements elements this stage holds at once.
  int slots() const noexcept { return slots_; }
  std::size_t pool_bytes() const noexcept { return pool_.bytes(); }

 private:
  /// An op with the pool slots it uses (-1: none) and its message tag.
  struct step {
    op o;
    int a = -1, b = -1, c = -1;
    int tag = -1;
  };

  std::span<T> view(int slot) {
    if (slot < 0) return {};
    return {pool_.data() + static_cast<std::size_t>(slot) * n_, n_};
  }
  std::span<const T> cview(int slot) { return view(slot); }
  /// Polls the sends in flight: Open MPI moves a message only inside MPI calls.
  void progress() {
    for (auto& w : pending_) w.test();
  }
  /// Before a slot is written: its last send must have completed.
  void writable(int slot) {
    if (slot >= 0) pending_[static_cast<std::size_t>(slot)].wait();
  }

  void plan() {
    const int p = s_.stages, v = s_.chunks, V = s_.virtual_stages();
    const std::size_t n = static_cast<std::size_t>(s_.microbatches) * static_cast<std::size_t>(v);
    // Slot of each boundary tensor of (mb, chunk) while it is alive.
    std::vector<int> act_in(n, -1), act_out(n, -1), grad_out(n, -1), grad_in(n, -1);
    std::deque<int> free;  // least recently released first: its send had the most time to finish
    const auto take = [&] {
      if (free.empty()) return slots_++;
      const int x = free.front();
      free.pop_front();
      return x;
    };
    const auto give = [&](int& x) {
      if (x >= 0) free.push_back(x);
      x = -1;
    };
    for (const op& o : s_.ops[static_cast<std::size_t>(stage_)]) {
      step x{o};
      if (o.kind == op_kind::optimizer_step) {
        steps_.push_back(x);
        continue;
      }
      const int k = s_.virtual_stage(stage_, o.chunk);
      const std::size_t i = static_cast<std::size_t>(o.microbatch) * static_cast<std::size_t>(v) + static_cast<std::size_t>(o.chunk);
      const bool local = p == 1;  // consecutive chunks of one stage hand over in place
      switch (o.kind) {
        case op_kind::recv_activation:
          x.a = act_in[i] = take();
          x.tag = tag(o.microbatch, k - 1, false);
          break;
        case op_kind::forward:
          x.a = act_in[i];
          if (k + 1 < V) x.b = local ? (act_in[i + 1] = take()) : (act_out[i] = take());
          break;
        case op_kind::send_activation:
          x.a = act_out[i];
          x.tag = tag(o.microbatch, k, false);
          give(act_out[i]);
          break;
        case op_kind::recv_gradient:
          x.a = grad_out[i] = take();
          x.tag = tag(o.microbatch, k + 1, true);
          break;
        case op_kind::backward:
          x.a = act_in[i];
          x.b = grad_out[i];
          if (k > 0) x.c = local ? (grad_out[i - 1] = take()) : (grad_in[i] = take());
          give(act_in[i]);
          give(grad_out[i]);
          break;
        case op_kind::send_gradient:
          x.a = grad_in[i];
          x.tag = tag(o.microbatch, k, true);
          give(grad_in[i]);
          break;
        case op_kind::optimizer_step:
          break;
      }
      steps_.push_back(x);
    }
  }

  int tag(int microbatch, int sender_virtual_stage, bool gradient) const {
    return (microbatch * s_.virtual_stages() + sender_virtual_stage) * 2 + (gradient ? 1 : 0);
  }

  schedule s_;
  C* comm_;
  std::size_t n_;
  int stage_;
  int slots_ = 0;
  std::vector<step> steps_;
  buffer<T> pool_;
  std::vector<comm::work> pending_;  // [slot] the send reading it, if any
};

}  // namespace loom::pipeline
