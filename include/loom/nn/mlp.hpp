#pragma once
// Feed-forward blocks with explicit backward:
//   swiglu_mlp (LLaMA):  y = W2 (silu(W1 x) * W3 x)    `<name>.w1/w2/w3.weight`
//   gelu_mlp   (GPT):    y = Wp gelu(Wf x + bf) + bp   `<name>.fc/proj.weight|bias`
// The hidden activations backward needs are in the caller-owned `activations`; inference runs
// swiglu_mlp forward only, over weights packed once, keeping none.
// swiglu_mlp with fused_gate_up keeps W1 and W3 as one tensor `<name>.w13.weight` [2 F, dim]
// with rows [gate | up] (ChatGLM's dense_h_to_4h); W1 and W3 are views of its two halves, so
// tensor parallelism still splits gate and up each (a rank's part is two rectangles).
// swiglu_mlp runs on any tensor-parallel size (the hidden units split, Megatron-LM's
// column- then row-parallel pair: one all-reduce in forward, one in backward); on one rank,
// with a comm::self_comm or the overloads without a communicator, those are no-ops.

#include <loom/comm/communicator.hpp>
#include <loom/comm/self_comm.hpp>
#include <loom/core/buffer.hpp>
#include <loom/nn/linear.hpp>
#include <loom/nn/projection_hook.hpp>
#include <loom/nn/tp/shard.hpp>
#include <loom/nn/workspace.hpp>
#include <loom/ops/host/activation.hpp>
#include <loom/ops/host/packed_weight.hpp>

#include <concepts>
#include <span>

#include <string>

namespace loom::nn {

template <compute_type T>
class swiglu_mlp {
 public:
  /// What backward needs, in device D's memory.
  template <class D = host>
  struct activations_on {
    index_t rows = 0;
    buffer<T, D> gate, up, hidden;  // [rows, hidden_dim]: W1 x, W3 x, silu(W1 x) * W3 x (local hidden units)
  };
  using activations = activations_on<>;

  swiglu_mlp() = default;
  /// This rank's part of the MLP: t is its place in the tensor group ({0, 1}: the whole
  /// MLP); the hidden units are split (W1, W3 column-parallel: rows [r F/tp, (r+1) F/tp);
  /// W2 row-parallel: the same columns); shards, when given, records each local rectangle.
  swiglu_mlp(param_layout& layout, const std::string& name, index_t dim, index_t hidden_dim, tp::tp_rank t = {},
             tp::shard_list* shards = nullptr, bool fused_gate_up = false) {
    t.validate();
    const index_t f = tp::split_even(hidden_dim, t.size, (name + " hidden_dim").c_str()), f0 = f * t.rank;
    if (fused_gate_up) {
      const auto w = layout.add(name + ".w13.weight", extents<2>{2 * f, dim});
      w1_ = linear<T>(param_slot<2>{w.offset, {f, dim}});
      w3_ = linear<T>(param_slot<2>{w.offset + static_cast<std::size_t>(f * dim), {f, dim}});
      w2_ = linear<T>(layout, name + ".w2", f, dim);
      tp::record(shards, name + ".w13.weight", w1_.weight(), 2 * hidden_dim, dim, f0, 0);
      tp::record(shards, name + ".w13.weight", w3_.weight(), 2 * hidden_dim, dim, hidden_dim + f0, 0);
      tp::record(shards, name + ".w2.weight", w2_.weight(), dim, hidden_dim, 0, f0);
    } else {
      w1_ = linear<T>(layout, name + ".w1", dim, f);
      w2_ = linear<T>(layout, name + ".w2", f, dim);
      w3_ = linear<T>(layout, name + ".w3", dim, f);
      tp::record(shards, name + ".w1.weight", w1_.weight(), hidden_dim, dim, f0, 0);
      tp::record(shards, name + ".w2.weight", w2_.weight(), dim, hidden_dim, 0, f0);
      tp::record(shards, name + ".w3.weight", w3_.weight(), hidden_dim, dim, f0, 0);
    }
    tp_size_ = t.size;
  }

  index_t dim() const noexcept { return w1_.in_features(); }
  /// Hidden units on this rank (hidden_dim / tp).
  index_t hidden_dim() const noexcept { return w1_.out_features(); }
  /// f(name, layer) for "w1", "w2", "w3" (fused gate/up: two views of w13), as attention's.
  template <class F>
  void for_each_linear(F&& f) {
    f("w1", w1_), f("w2", w2_), f("w3", w3_);
  }

  template <class D = host>
  activations_on<D> make_activations(index_t rows, memory_resource& mr = default_resource<D>()) const {
    const auto n = static_cast<std::size_t>(rows * hidden_dim());
    return {rows, buffer<T, D>(n, mr), buffer<T, D>(n, mr), buffer<T, D>(n, mr)};
  }

  /// y [rows, dim] = mlp(x [rows, dim]) summed over the tensor group tp; y is overwritten. On
  /// the workspace's device (the activations' and views' too).
  template <comm::communicator C, ops::param_type P, class D>
  void forward(C& tp, std::span<P> params, in_view_on<T, D, 2> x, activations_on<D>& a, view_on<T, D, 2> y,
               workspace<T, D>& ws) const {
    const index_t n = rows(tp, x, a), f = hidden_dim();
    linear<T>::forward_all(params, x, {{&w1_, a.gate.view(n, f)}, {&w3_, a.up.view(n, f)}}, ws);
    ws.context().swiglu_forward(a.gate.view(), a.up.view(), a.hidden.view());
    w2_.forward(params, a.hidden.view(n, f), y, ws);
    tp::reduce_from_tensor_parallel_forward(tp, std::span<T>(y.data(), static_cast<std::size_t>(y.numel())));
  }
  /// The whole MLP on one rank.
  template <ops::param_type P, class D>
  void forward(std::span<P> params, in_view_on<T, D, 2> x, activations_on<D>& a, view_on<T, D, 2> y,
               workspace<T, D>& ws) const {
    comm::self_comm self;
    forward(self, params, x, a, y, ws);
  }

  /// dx += d/dx summed over the group (dx = d/dx when !accumulate); this rank's parameter
  /// gradients added into `grads` (empty: the weights are frozen, dx only; nn::linear).
  template <comm::communicator C, ops::param_type P, class D>
  void backward(C& tp, std::span<P> params, std::span<T> grads, in_view_on<T, D, 2> x, const activations_on<D>& a,
                in_view_on<T, D, 2> dy, view_on<T, D, 2> dx, workspace<T, D>& ws, bool accumulate = true) const {
    const index_t n = rows(tp, x, a), f = hidden_dim();
    auto dh = ws.take(n * f), dg = ws.take(n * f), du = ws.take(n * f);  // written, not added into
    w2_.backward(params, grads, make_view<D>(a.hidden.data(), n, f), dy, make_view<D>(dh.data(), n, f), ws,
                 /*accumulate=*/false);
    ws.context().swiglu_backward(make_view<D>(as_const(dh).data(), n * f), a.gate.view(), a.up.view(),
                                 make_view<D>(dg.data(), n * f), make_view<D>(du.data(), n * f), /*accumulate=*/false);
    const auto target = tp::input_grad_target(tp, dx, ws);
    linear<T>::backward_all(
        params, grads, x,
        {{&w1_, make_view<D>(as_const(dg).data(), n, f)}, {&w3_, make_view<D>(as_const(du).data(), n, f)}}, target, ws,
        tp::input_grad_accumulates(tp, accumulate));
    tp::finish_input_grad(tp, target, dx, accumulate, ws.context());
  }
  /// The whole MLP on one rank.
  template <ops::param_type P, class D>
  void backward(std::span<P> params, std::span<T> grads, in_view_on<T, D, 2> x, const activations_on<D>& a,
                in_view_on<T, D, 2> dy, view_on<T, D, 2> dx, workspace<T, D>& ws, bool accumulate = true) const {
    comm::self_comm self;
    backward(self, params, grads, x, a, dy, dx, ws, accumulate);
  }

  /// Forward only (inference): the weights packed once for the GEMMs that read them
  /// (ops::packed_weight), from this MLP's parameters in `params` (fp32); the packed copies
  /// come from `mr` (so that a rank's weight memory is counted in one place).
  struct packed {
    ops::packed_weight w1, w2, w3;
  };
  packed pack(std::span<const float> params, memory_resource& mr = default_resource<host>()) const
    requires std::same_as<T, float>
  {
    auto p = [&](const linear<T>& l) { return ops::packed_weight(l.weight().in(params), ops::host_sgemm_kernel(), mr); };
    return {p(w1_), p(w2_), p(w3_)};
  }
  /// Bytes pack() takes from its resource (a memory plan made before the weights are read).
  std::size_t packed_bytes() const {
    std::size_t n = 0;
    for (const linear<T>* l : {&w1_, &w2_, &w3_}) n += ops::packed_weight::bytes_for(l->out_features(), l->in_features());
    return n;
  }
  /// y [rows, dim] = mlp(x [rows, dim]) summed over tp, keeping no activations (scratch from
  /// ws); y may be x's buffer (x is read only before y is written). `hook(projection, in,
  /// out)` runs after each projection (projection_hook.hpp): gate and up before the
  /// activation, down before the sum.
  template <comm::communicator C, class Hook = no_projection_hook>
    requires std::same_as<T, float>
  void forward(C& tp, const packed& w, in_view<T, 2> x, tensor_view<T, host, 2> y, workspace<T>& ws, Hook&& hook = {}) const {
    LOOM_CHECK(tp.size() == tp_size_, "nn::swiglu_mlp: built for tensor-parallel size ", tp_size_, ", called on a group of ",
               tp.size());
    const index_t n = x.extent(0), f = hidden_dim();
    auto gate = ws.take(n * f), up = ws.take(n * f);
    ops::gemm(host{}, x, w.w1, make_view(gate.data(), n, f));
    hook(projection::gate, x, make_view(gate.data(), n, f));
    ops::gemm(host{}, x, w.w3, make_view(up.data(), n, f));
    hook(projection::up, x, make_view(up.data(), n, f));
    ops::swiglu_forward(host{}, make_view(as_const(gate).data(), n * f), make_view(as_const(up).data(), n * f),
                        make_view(gate.data(), n * f));  // element by element: in place is safe
    ops::gemm(host{}, make_view(as_const(gate).data(), n, f), w.w2, y);
    hook(projection::down, make_view(as_const(gate).data(), n, f), y);
    tp::reduce_from_tensor_parallel_forward(tp, std::span<T>(y.data(), static_cast<std::size_t>(y.numel())));
  }

 private:
  template <comm::communicator C, class D>
  index_t rows(const C& tp, const tensor_view<const T, D, 2>& x, const activations_on<D>& a) const {
    tp::require_one_rank_on<D>(tp, "nn::swiglu_mlp");
    LOOM_CHECK(tp.size() == tp_size_, "nn::swiglu_mlp: built for tensor-parallel size ", tp_size_, ", called on a group of ",
               tp.size());
    LOOM_CHECK(x.extent(0) == a.rows, "nn::swiglu_mlp: input has ", x.extent(0), " rows, activations were made for ",
               a.rows);
    return a.rows;
  }
  linear<T> w1_, w2_, w3_;
  int tp_size_ = 1;
};

template <compute_type T>
class gelu_mlp {
 public:
  struct activations {
    index_t rows = 0;
    buffer<T> pre, hidden;  // [rows, hidden_dim]: Wf x + bf, gelu of it
  };

  gelu_mlp() = default;
  gelu_mlp(param_layout& layout, const std::string& name, index_t dim, index_t hidden_dim,
           ops::gelu_approx approx = ops::gelu_approx::none)
      : fc_(layout, name + ".fc", dim, hidden_dim, true), proj_(layout, name + ".proj", hidden_dim, dim, true),
        approx_(approx) {}

  index_t hidden_dim() const noexcept { return fc_.out_features(); }

  activations make_activations(index_t rows, memory_resource& mr = default_resource<host>()) const {
    const auto n = static_cast<std::size_t>(rows * hidden_dim());
    return {rows, buffer<T>(n, mr), buffer<T>(n, mr)};
  }

  template <ops::param_type P>
  void forward(std::span<P> params, in_view<T, 2> x, activations& a, tensor_view<T, host, 2> y, workspace<T>& ws) const {
    const index_t n = rows(x, a), f = hidden_dim();
    fc_.forward(params, x, a.pre.view(n, f), ws);
    ops::gelu_forward(host{}, a.pre.view(), a.hidden.view(), approx_);
    proj_.forward(params, a.hidden.view(n, f), y, ws);
  }

  /// dx += d/dx (dx = d/dx when !accumulate); parameter gradients added into `grads`.
  template <ops::param_type P>
  void backward(std::span<P> params, std::span<T> grads, in_view<T, 2> x, const activations& a, in_view<T, 2> dy,
                tensor_view<T, host, 2> dx, workspace<T>& ws, bool accumulate = true) const {
    const index_t n = rows(x, a), f = hidden_dim();
    auto dh = ws.take(n * f), dp = ws.take_zeroed(n * f);  // dh written; gelu_backward adds into dp
    proj_.backward(params, grads, make_view(a.hidden.data(), n, f), dy, make_view(dh.data(), n, f), ws, /*accumulate=*/false);
    ops::gelu_backward(host{}, make_view(dh.data(), n * f), a.pre.view(), make_view(dp.data(), n * f), approx_);
    fc_.backward(params, grads, x, make_view(dp.data(), n, f), dx, ws, accumulate);
  }

 private:
  index_t rows(const in_view<T, 2>& x, const activations& a) const {
    LOOM_CHECK(x.extent(0) == a.rows, "nn::gelu_mlp: input has ", x.extent(0), " rows, activations were made for ",
               a.rows);
    return a.rows;
  }
  linear<T> fc_, proj_;
  ops::gelu_approx approx_ = ops::gelu_approx::none;
};

}  // namespace loom::nn
