#pragma once
// One LoRA adapter on one linear layer, forward and backward written once for every
// tensor-parallel size (a size-1 group is the single-rank layer):
//
//   u = dropout(x)            // x * keep / (1 - p), the mask from the counter RNG
//   h = u A^T                 // [n, r]
//   y += scaling * h B^T      // [n, out]
//
// The adapter lives in its own flat buffer (layout), apart from the base layer's: that is
// what lets a trainer keep the base frozen (no gradient, no optimizer state) and train only
// these parameters.
//
// Tensor parallelism follows the base layer's split so that merging stays local
// (W_local += scaling * B_local A_local, no communication):
//   column-parallel base (W split by output rows, x replicated):
//     A [r, in] replicated, B [out/tp, r] split by rows. h is the same on every rank; y_local
//     gets this rank's rows. Backward: dh = scaling * dy_local B_local is a partial sum over
//     the ranks' rows: one all-reduce of dh [n, r] makes it whole, after which dA = dh^T u
//     is the full gradient on every rank (the replicas stay equal without a gradient sum)
//     and dx gets the whole LoRA term (x is replicated, so dx is too).
//   row-parallel base (W split by input columns, x_local [n, in/tp]):
//     A [r, in/tp] split by columns, B [out, r] replicated. h = sum over ranks of u_local
//     A_local^T: one all-reduce of h [n, r] in forward, after which y (the base's reduced
//     output) += scaling * h B^T, dB = scaling * dy^T h is whole on every rank and dh, dA_local,
//     dx_local need no communication.
// So each pass costs one all-reduce of [n, r] (r is small), and gradients of the replicated
// factor are computed from whole quantities rather than summed afterwards.
//
// Initialisation (PEFT's default): A ~ kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in),
// 1/sqrt(in)) over the FULL fan-in, element (i, j) from the counter RNG at the full tensor's
// index, so every tensor-parallel split initialises the same adapter; B = 0 (the adapted
// model starts as the base).

#include <loom/comm/communicator.hpp>
#include <loom/comm/self_comm.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/random.hpp>
#include <loom/nn/linear.hpp>
#include <loom/nn/parameters.hpp>
#include <loom/nn/tp/shard.hpp>
#include <loom/nn/workspace.hpp>
#include <loom/ops/host/gemm.hpp>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace loom::lora {

using nn::workspace;
using ops::in_view;

/// How the adapted base layer is split over the tensor group.
enum class split { column, row };

/// Dropout on the adapter's input: element (i, j) of the FULL [n, in] input is kept when the
/// counter RNG (seed, stream)'s uniform at `offset + i * in + j` is >= p, and scaled by
/// 1 / (1 - p) (PEFT's nn.Dropout). p = 0: no dropout. A new offset or stream per micro-batch
/// and step gives a new mask.
struct dropout {
  double p = 0.0;
  std::uint64_t seed = 0, offset = 0, stream = 0;
  bool active() const noexcept { return p > 0.0; }
};

/// out (+)= in * mask for the columns [col0, col0 + cols) of a [n, full_cols] input (accumulate:
/// added, else written), the mask drawn as dropout_mask does: the mask need not be kept, any
/// pass (a recompute under activation checkpointing, the backward) draws the same one again.
template <compute_type T>
inline void dropout_apply(const dropout& d, index_t col0, index_t full_cols, in_view<T, 2> in, tensor_view<T, host, 2> out,
                          bool accumulate = false) {
  LOOM_CHECK(d.p >= 0.0 && d.p < 1.0, "lora::dropout: p must be in [0, 1), got p=", d.p);
  LOOM_CHECK(in.extent(0) == out.extent(0) && in.extent(1) == out.extent(1), "lora::dropout: input [", in.extent(0), ", ",
             in.extent(1), "] and output [", out.extent(0), ", ", out.extent(1), "] differ");
  const counter_rng rng(d.seed, d.stream);
  const T keep = T(1.0 / (1.0 - d.p));
  for (index_t i = 0; i < out.extent(0); ++i)
    for (index_t j = 0; j < out.extent(1); ++j) {
      const auto at = d.offset + static_cast<std::uint64_t>(i * full_cols + col0 + j);
      const T v = static_cast<double>(rng.uniform(at)) >= d.p ? in(i, j) * keep : T(0);
      out(i, j) = accumulate ? out(i, j) + v : v;
    }
}

/// mask [n, cols] = keep / (1 - p) for the columns [col0, col0 + cols) of a [n, full_cols] input.
template <compute_type T>
inline void dropout_mask(const dropout& d, index_t col0, index_t full_cols, tensor_view<T, host, 2> mask) {
  std::vector<T> ones(static_cast<std::size_t>(mask.extent(1)), T(1));
  for (index_t i = 0; i < mask.extent(0); ++i)  // row by row: each row's counters start at (i * full_cols)
    dropout_apply(dropout{d.p, d.seed, d.offset + static_cast<std::uint64_t>(i * full_cols), d.stream}, col0, full_cols,
                  make_view(static_cast<const T*>(ones.data()), index_t(1), mask.extent(1)),
                  make_view(&mask(i, 0), index_t(1), mask.extent(1)));
}

template <compute_type T>
class adapter {
 public:
  /// What forward keeps for backward: h [n, r] (whole, after the row split's all-reduce) and,
  /// with dropout, the mask [n, in_local].
  struct activations {
    buffer<T> h, mask;
  };

  adapter() = default;
  /// Declares `<name>.lora_A.weight` [r, in_local] and `<name>.lora_B.weight` [out_local, r]
  /// for a base layer of full shape [out, in] split as `s` over t; shards, when given,
  /// records each factor's rectangle of the full tensor (the replicated factor as replicas).
  adapter(nn::param_layout& layout, const std::string& name, index_t in, index_t out, index_t r, split s,
          nn::tp::tp_rank t = {}, nn::tp::shard_list* shards = nullptr)
      : split_(s), in_(in), out_(out), tp_size_((t.validate(), t.size)) {
    LOOM_CHECK(r > 0, "lora::adapter '", name, "': r must be > 0, got r=", r);
    const index_t in_l = s == split::row ? nn::tp::split_even(in, t.size, (name + " input features").c_str()) : in;
    const index_t out_l = s == split::column ? nn::tp::split_even(out, t.size, (name + " output features").c_str()) : out;
    col0_ = s == split::row ? in_l * t.rank : 0;
    row0_ = s == split::column ? out_l * t.rank : 0;
    a_ = layout.add(name + ".lora_A.weight", extents<2>{r, in_l});
    b_ = layout.add(name + ".lora_B.weight", extents<2>{out_l, r});
    nn::tp::record(shards, name + ".lora_A.weight", a_, r, in, 0, col0_, s == split::column ? t.rank : 0);
    nn::tp::record(shards, name + ".lora_B.weight", b_, out, r, row0_, 0, s == split::row ? t.rank : 0);
  }

  index_t rank() const noexcept { return a_.shape[0]; }
  index_t in_features() const noexcept { return a_.shape[1]; }   ///< local
  index_t out_features() const noexcept { return b_.shape[0]; }  ///< local
  index_t first_input() const noexcept { return col0_; }
  index_t full_in_features() const noexcept { return in_; }
  index_t first_output() const noexcept { return row0_; }
  split parallel() const noexcept { return split_; }
  const nn::param_slot<2>& a() const noexcept { return a_; }
  const nn::param_slot<2>& b() const noexcept { return b_; }

  /// A from the counter RNG (kaiming-uniform, a = sqrt(5): bound 1 / sqrt(in)), B = 0.
  /// `offset`: where this adapter's A starts in the RNG's stream (the full tensor's elements
  /// follow), so a split rank draws the same values as the whole tensor.
  template <param_type P>
  void init(std::span<P> params, std::uint64_t seed, std::uint64_t offset) const {
    const counter_rng rng(seed);
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_));
    auto A = a_.in(params);
    for (index_t i = 0; i < rank(); ++i)
      for (index_t j = 0; j < in_features(); ++j) {
        const double u = rng.uniform(offset + static_cast<std::uint64_t>(i * in_ + col0_ + j));
        A(i, j) = P(static_cast<float>((2.0 * u - 1.0) * bound));
      }
    auto B = b_.in(params);
    for (index_t i = 0; i < out_features(); ++i)
      for (index_t j = 0; j < rank(); ++j) B(i, j) = P(0.f);
  }

  activations make_activations(index_t n, bool with_dropout, memory_resource& mr = default_resource<host>()) const {
    return {buffer<T>(static_cast<std::size_t>(n * rank()), mr),
            buffer<T>(with_dropout ? static_cast<std::size_t>(n * in_features()) : 0, mr)};
  }

  /// y += scaling * B(A(dropout(x))). x: the base's input as this rank sees it ([n, in]
  /// column, [n, in/tp] row); y: the base's output as this rank sees it ([n, out/tp] column;
  /// [n, out] row, after the base's all-reduce).
  template <comm::communicator C, param_type P>
  void forward(C& tp, std::span<P> params, in_view<T, 2> x, activations& a, tensor_view<T, host, 2> y, workspace<T>& ws,
               T scaling, const dropout& d = {}) const {
    const index_t n = x.extent(0);
    check(tp, x, a, n);
    LOOM_CHECK(y.extent(0) == n && y.extent(1) == out_features(), "lora::adapter: output is [", y.extent(0), ", ",
               y.extent(1), "], expected [", n, ", ", out_features(), "]");
    if (d.active()) dropout_mask(d, col0_, in_, a.mask.view(n, in_features()));
    const auto u = input(x, a, d, ws);
    auto h = a.h.view(n, rank());
    ops::gemm(host{}, u, nn::weights_as<T>(a_, params, ws).transpose(0, 1), h);
    if (split_ == split::row) tp.all_reduce(std::span<const T>(h.data(), a.h.size()), a.h.span(), comm::reduce_op::sum);
    ops::gemm(host{}, in_view<T, 2>(h), nn::weights_as<T>(b_, params, ws).transpose(0, 1), y, scaling, T(1));
  }

  /// dA, dB added into grads (this adapter's layout); dx += the LoRA term of the input
  /// gradient (whole for a column split, this rank's columns for a row split; skipped when
  /// dx is empty). dy: the gradient of forward's y, as this rank sees it.
  template <comm::communicator C, param_type P>
  void backward(C& tp, std::span<P> params, std::span<T> grads, in_view<T, 2> x, const activations& a, in_view<T, 2> dy,
                tensor_view<T, host, 2> dx, workspace<T>& ws, T scaling, const dropout& d = {}) const {
    const index_t n = x.extent(0), r = rank();
    check(tp, x, a, n);
    LOOM_CHECK(dy.extent(0) == n && dy.extent(1) == out_features(), "lora::adapter: dy is [", dy.extent(0), ", ",
               dy.extent(1), "], expected [", n, ", ", out_features(), "]");
    const in_view<T, 2> h = make_view(a.h.data(), n, r);
    // dB += scaling dy^T h;  dh = scaling dy B
    ops::gemm(host{}, dy.transpose(0, 1), h, b_.in(grads), scaling, T(1));
    auto dh_s = ws.take(static_cast<std::size_t>(n * r));
    auto dh = make_view(dh_s.data(), n, r);
    ops::gemm(host{}, dy, nn::weights_as<T>(b_, params, ws), dh, scaling, T(0));
    if (split_ == split::column) tp.all_reduce(std::span<const T>(dh_s.data(), dh_s.size()), dh_s, comm::reduce_op::sum);
    // dA += dh^T u;  dx += (dh A) * mask
    const auto u = input(x, a, d, ws);
    ops::gemm(host{}, in_view<T, 2>(dh).transpose(0, 1), u, a_.in(grads), T(1), T(1));
    if (dx.empty()) return;
    LOOM_CHECK(dx.extent(0) == n && dx.extent(1) == in_features(), "lora::adapter: dx is [", dx.extent(0), ", ",
               dx.extent(1), "], expected [", n, ", ", in_features(), "]");
    if (!d.active()) return ops::gemm(host{}, in_view<T, 2>(dh), nn::weights_as<T>(a_, params, ws), dx, T(1), T(1));
    auto t_s = ws.take(static_cast<std::size_t>(n * in_features()));
    auto t = make_view(t_s.data(), n, in_features());
    ops::gemm(host{}, in_view<T, 2>(dh), nn::weights_as<T>(a_, params, ws), t);
    for (index_t i = 0; i < n; ++i)
      for (index_t j = 0; j < in_features(); ++j) dx(i, j) += t(i, j) * a.mask.data()[i * in_features() + j];
  }

  /// The LoRA term as a partial sum over the tensor group, for a base layer whose own
  /// collectives sum it (the decoder's f and g around a column/row pair): y += scaling
  /// (u A_local^T) B_rows^T on every split, no communication, u = dropout(x). Row split: each
  /// rank's term uses its h_local = u_local A_local^T, and the sum over ranks is the layer's;
  /// column split: it is this rank's rows. Nothing is kept: backward recomputes h, and draws
  /// the same mask from d again (so a recompute under activation checkpointing does too).
  /// B_rows: the rows [b_row0, b_row0 + y's columns) of B_local -- all of it, or one part of a
  /// fused tensor (q/k/v, gate/up) whose parts the decoder runs as separate layers sharing A
  /// and the mask; the parts' terms and gradients add up to the fused adapter's.
  template <param_type P>
  void forward_partial(std::span<P> params, in_view<T, 2> x, tensor_view<T, host, 2> y, workspace<T>& ws, T scaling,
                       const dropout& d = {}, index_t b_row0 = 0) const {
    const index_t n = x.extent(0);
    const auto u = input_partial(x, d, ws);
    auto h = make_view(ws.take(static_cast<std::size_t>(n * rank())).data(), n, rank());
    ops::gemm(host{}, u, nn::weights_as<T>(a_, params, ws).transpose(0, 1), h);
    ops::gemm(host{}, in_view<T, 2>(h), b_rows(nn::weights_as<T>(b_, params, ws), b_row0, y.extent(1)).transpose(0, 1), y,
              scaling, T(1));
  }
  /// forward_partial's backward: dA, dB added into grads and dx += the LoRA term (skipped when
  /// dx is empty), each as this rank's part: dx is summed by the base layer's own collective,
  /// and the replicated factor's gradient (column: dA, row: dB) is a partial sum over the group
  /// until sum_replicated_grad (once after all passes: gradients are linear in the passes).
  template <param_type P>
  void backward_partial(std::span<P> params, std::span<T> grads, in_view<T, 2> x, in_view<T, 2> dy,
                        tensor_view<T, host, 2> dx, workspace<T>& ws, T scaling, const dropout& d = {},
                        index_t b_row0 = 0) const {
    const index_t n = x.extent(0), r = rank(), rows = dy.extent(1);
    const auto u = input_partial(x, d, ws);
    auto h = make_view(ws.take(static_cast<std::size_t>(n * r)).data(), n, r);
    auto dh = make_view(ws.take(static_cast<std::size_t>(n * r)).data(), n, r);
    const auto A = nn::weights_as<T>(a_, params, ws);
    const auto B = b_rows(nn::weights_as<T>(b_, params, ws), b_row0, rows);
    auto dB = b_.in(grads);
    ops::gemm(host{}, u, A.transpose(0, 1), h);                                               // h = u A^T
    ops::gemm(host{}, dy.transpose(0, 1), in_view<T, 2>(h), make_view(&dB(b_row0, 0), rows, r), scaling, T(1));  // dB += s dy^T h
    ops::gemm(host{}, dy, B, dh, scaling, T(0));                                              // dh = s dy B
    ops::gemm(host{}, in_view<T, 2>(dh).transpose(0, 1), u, a_.in(grads), T(1), T(1));       // dA += dh^T u
    if (dx.empty()) return;
    if (!d.active()) return ops::gemm(host{}, in_view<T, 2>(dh), A, dx, T(1), T(1));         // dx += dh A
    auto t = make_view(ws.take(static_cast<std::size_t>(n * in_features())).data(), n, in_features());
    ops::gemm(host{}, in_view<T, 2>(dh), A, t);
    dropout_apply(d, col0_, in_, in_view<T, 2>(t), dx, true);                                 // dx += (dh A) * mask
  }
  /// After the passes of forward_partial / backward_partial: the replicated factor's gradient
  /// in grads (this adapter's layout) summed over the tensor group, in place.
  template <comm::communicator C>
  void sum_replicated_grad(C& tp, std::span<T> grads) const {
    LOOM_CHECK(tp.size() == tp_size_, "lora::adapter: built for tensor-parallel size ", tp_size_, ", called on a group of ",
               tp.size());
    if (tp.size() == 1) return;
    auto g = (split_ == split::column ? a_ : b_).in(grads);
    const std::span<T> s(g.data(), static_cast<std::size_t>(g.numel()));
    tp.all_reduce(std::span<const T>(s), s, comm::reduce_op::sum);
  }

  /// The whole layer on one rank.
  template <param_type P>
  void forward(std::span<P> params, in_view<T, 2> x, activations& a, tensor_view<T, host, 2> y, workspace<T>& ws, T scaling,
               const dropout& d = {}) const {
    comm::self_comm self;
    forward(self, params, x, a, y, ws, scaling, d);
  }
  template <param_type P>
  void backward(std::span<P> params, std::span<T> grads, in_view<T, 2> x, const activations& a, in_view<T, 2> dy,
                tensor_view<T, host, 2> dx, workspace<T>& ws, T scaling, const dropout& d = {}) const {
    comm::self_comm self;
    backward(self, params, grads, x, a, dy, dx, ws, scaling, d);
  }

  /// W_local += sign * scaling * B_local A_local: the base weight slot `w` (this rank's shard,
  /// [out_local, in_local]) in `base` absorbs the adapter (sign +1, merge) or gives it back
  /// (sign -1, unmerge). Local on every split: no communication.
  template <param_type PB, param_type P>
  void merge(std::span<PB> base, const nn::param_slot<2>& w, std::span<const P> params, double scaling, int sign = 1) const {
    LOOM_CHECK(sign == 1 || sign == -1, "lora::adapter::merge: sign must be +1 or -1, got sign=", sign);
    LOOM_CHECK(w.shape[0] == out_features() && w.shape[1] == in_features(), "lora::adapter::merge: base weight is [",
               w.shape[0], ", ", w.shape[1], "], the adapter is for [", out_features(), ", ", in_features(), "]");
    const auto A = a_.in(params), B = b_.in(params);
    auto W = w.in(base);
    for (index_t i = 0; i < out_features(); ++i)
      for (index_t j = 0; j < in_features(); ++j) {
        double s = 0;
        for (index_t k = 0; k < rank(); ++k) s += ops::load<double>(B(i, k)) * ops::load<double>(A(k, j));
        const double v = ops::load<double>(W(i, j)) + sign * scaling * s;
        if constexpr (std::is_same_v<PB, double>) W(i, j) = v;
        else W(i, j) = PB(static_cast<float>(v));
      }
  }

  /// The merged-weight path's backward: when the base ran with W_eff = W + scaling * B A (the
  /// adapter merged), its weight gradient G = dL/dW_eff ([out_local, in_local], this rank's
  /// shard) gives dA += scaling * B^T G and dB += scaling * G A^T (dropout 0 only: merged, the
  /// LoRA branch sees x itself). Under tensor parallelism the gradient of the replicated
  /// factor is a sum over the ranks' shards (column: dA; row: dB): one all-reduce of it.
  template <comm::communicator C, param_type P>
  void backward_from_weight_grad(C& tp, std::span<P> params, std::span<T> grads, in_view<T, 2> G, workspace<T>& ws,
                                 T scaling) const {
    LOOM_CHECK(tp.size() == tp_size_, "lora::adapter: built for tensor-parallel size ", tp_size_, ", called on a group of ",
               tp.size());
    LOOM_CHECK(G.extent(0) == out_features() && G.extent(1) == in_features(), "lora::adapter: weight gradient is [",
               G.extent(0), ", ", G.extent(1), "], the adapter is for [", out_features(), ", ", in_features(), "]");
    const bool sum_a = split_ == split::column && tp.size() > 1, sum_b = split_ == split::row && tp.size() > 1;
    const auto& rep = sum_a ? a_ : b_;  // the replicated factor, whose increment is summed over the group
    auto tmp = (sum_a || sum_b) ? ws.take(rep.numel()) : std::span<T>{};
    auto target = [&](const nn::param_slot<2>& s) {
      return (sum_a || sum_b) && &s == &rep ? make_view(tmp.data(), s.shape[0], s.shape[1]) : s.in(grads);
    };
    const T beta_a = sum_a ? T(0) : T(1), beta_b = sum_b ? T(0) : T(1);
    ops::gemm(host{}, nn::weights_as<T>(b_, params, ws).transpose(0, 1), G, target(a_), scaling, beta_a);
    ops::gemm(host{}, G, nn::weights_as<T>(a_, params, ws).transpose(0, 1), target(b_), scaling, beta_b);
    if (!(sum_a || sum_b)) return;
    tp.all_reduce(std::span<const T>(tmp.data(), tmp.size()), tmp, comm::reduce_op::sum);
    auto g = rep.in(grads);
    for (std::size_t i = 0; i < tmp.size(); ++i) g.data()[i] += tmp[i];
  }

 private:
  template <comm::communicator C>
  void check(const C& tp, const in_view<T, 2>& x, const activations& a, index_t n) const {
    LOOM_CHECK(tp.size() == tp_size_, "lora::adapter: built for tensor-parallel size ", tp_size_, ", called on a group of ",
               tp.size());
    LOOM_CHECK(x.extent(1) == in_features(), "lora::adapter: input has ", x.extent(1), " features, the adapter takes ",
               in_features());
    LOOM_CHECK(a.h.size() == static_cast<std::size_t>(n * rank()), "lora::adapter: activations for ", a.h.size() / rank(),
               " rows, the input has ", n);
  }
  // dropout(x) drawn from d (nothing kept): x itself, or x * mask in the workspace
  in_view<T, 2> input_partial(in_view<T, 2> x, const dropout& d, workspace<T>& ws) const {
    LOOM_CHECK(x.extent(1) == in_features(), "lora::adapter: input has ", x.extent(1), " features, the adapter takes ",
               in_features());
    if (!d.active()) return x;
    auto u = make_view(ws.take(static_cast<std::size_t>(x.extent(0) * in_features())).data(), x.extent(0), in_features());
    dropout_apply(d, col0_, in_, x, u);
    return in_view<T, 2>(u);
  }
  // rows [row0, row0 + rows) of B_local [out_local, r]
  tensor_view<const T, host, 2> b_rows(tensor_view<const T, host, 2> B, index_t row0, index_t rows) const {
    LOOM_CHECK(row0 >= 0 && row0 + rows <= out_features(), "lora::adapter: B rows [", row0, ", ", row0 + rows, ") of ",
               out_features());
    return make_view(&B(row0, 0), rows, rank());
  }
  // dropout(x): x itself, or x * mask in the workspace
  in_view<T, 2> input(in_view<T, 2> x, const activations& a, const dropout& d, workspace<T>& ws) const {
    if (!d.active()) return x;
    LOOM_CHECK(a.mask.size() == static_cast<std::size_t>(x.extent(0) * in_features()),
               "lora::adapter: dropout p=", d.p, " but the activations were made without a mask");
    const index_t n = x.extent(0), k = in_features();
    auto u = ws.take(static_cast<std::size_t>(n * k));
    for (index_t i = 0; i < n; ++i)
      for (index_t j = 0; j < k; ++j) u[static_cast<std::size_t>(i * k + j)] = x(i, j) * a.mask.data()[i * k + j];
    return make_view(static_cast<const T*>(u.data()), n, k);
  }

  split split_ = split::column;
  index_t in_ = 0, out_ = 0, col0_ = 0, row0_ = 0;
  int tp_size_ = 1;
  nn::param_slot<2> a_{}, b_{};
};

}  // namespace loom::lora
