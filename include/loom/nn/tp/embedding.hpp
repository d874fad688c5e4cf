#pragma once
// Vocab-parallel token embedding (Megatron-LM): rank r holds rows [r*V/tp, (r+1)*V/tp) of
// the [V, dim] table. Forward: each rank writes the rows of the tokens it owns and zeros for
// the others, then the ranks' outputs are summed (all-reduce) so every rank has the full
// [n, dim] embedding. Backward: dout is replicated; each rank adds it into its own rows only.
// The table slot is exposed so a vocab-parallel output projection can share it (tied weights).

#include <loom/comm/communicator.hpp>
#include <loom/nn/parameters.hpp>
#include <loom/nn/tp/shard.hpp>
#include <loom/ops/host/common.hpp>
#include <loom/ops/host/embedding.hpp>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

namespace loom::nn::tp {

template <compute_type T>
class vocab_parallel_embedding {
 public:
  vocab_parallel_embedding() = default;
  vocab_parallel_embedding(param_layout& layout, const std::string& name, index_t vocab, index_t dim, tp_rank t,
                           shard_list* shards = nullptr)
      : vocab_(vocab),
        weight_(layout.add(name + ".weight",
                           extents<2>{(t.validate(), split_even(vocab, t.size, (name + " vocabulary").c_str())), dim})),
        first_(weight_.shape[0] * t.rank) {
    record(shards, name + ".weight", weight_, vocab, dim, first_, 0);
  }

  index_t vocab() const noexcept { return vocab_; }
  index_t local_vocab() const noexcept { return weight_.shape[0]; }
  index_t first_token() const noexcept { return first_; }
  index_t dim() const noexcept { return weight_.shape[1]; }
  const param_slot<2>& weight() const noexcept { return weight_; }

  /// On ctx's device: the whole table on one rank (tp = 1) only, for now (the split gather and
  /// its all-reduce are the host's).
  template <comm::communicator C, ops::param_type P, class Token, class D>
  void forward(const device_context<D>& ctx, C& tp, std::span<P> params, view_on<Token, D, 1> tokens,
               view_on<T, D, 2> out) const {
    if constexpr (std::is_same_v<D, host>) {
      forward(tp, params, tokens, out);
    } else {
      whole_table_on(D{});
      ctx.embedding_forward(tokens, weight_.template in<D>(as_const(params)), out);
    }
  }
  template <class Token, class D>
  void backward(const device_context<D>& ctx, std::span<T> grads, view_on<Token, D, 1> tokens, in_view_on<T, D, 2> dout) const {
    if constexpr (std::is_same_v<D, host>) {
      backward(grads, tokens, dout);
    } else {
      whole_table_on(D{});
      if (!grads.empty()) ctx.embedding_backward(tokens, dout, weight_.template in<D>(grads));
    }
  }

  /// out [n, dim] = table[tokens] (all-reduced over the tensor group); bad ids are a loom::error.
  template <comm::communicator C, ops::param_type P, class Token>
  void forward(C& tp, std::span<P> params, tensor_view<Token, host, 1> tokens, tensor_view<T, host, 2> out) const {
    LOOM_CHECK(out.extent(0) == tokens.extent(0) && out.extent(1) == dim() && out.is_contiguous(),
               "nn::tp::vocab_parallel_embedding: out has shape ", ops::detail::str(out.shape()), ", expected [",
               tokens.extent(0), ", ", dim(), "] contiguous");
    auto w = weight_.in(as_const(params));
    if (tp.size() == 1) return ops::embedding_forward(host{}, tokens, w, out);  // the whole table here
    for (index_t i = 0; i < tokens.extent(0); ++i) {
      const auto id = static_cast<std::int64_t>(tokens(i));
      LOOM_CHECK(id >= 0 && id < vocab_, "nn::tp::vocab_parallel_embedding: token id ", id, " at position ", i,
                 " is outside the vocabulary [0, ", vocab_, ")");
      T* o = &out(i, 0);
      if (id >= first_ && id < first_ + local_vocab()) {
        const auto* src = &w(static_cast<index_t>(id) - first_, 0);
        for (index_t j = 0; j < dim(); ++j) o[j] = ops::load<T>(src[j]);
      } else {
        std::fill_n(o, dim(), T(0));
      }
    }
    reduce_from_tensor_parallel_forward(tp, std::span<T>(out.data(), static_cast<std::size_t>(out.numel())));
  }

  /// dtable[tokens owned here] += dout  (dout [n, dim] is the same on every rank); grads
  /// empty: the table is frozen, nothing to do
  template <class Token>
  void backward(std::span<T> grads, tensor_view<Token, host, 1> tokens, in_view<T, 2> dout) const {
    if (grads.empty()) return;
    auto g = weight_.in(grads);
    for (index_t i = 0; i < tokens.extent(0); ++i) {
      const auto id = static_cast<index_t>(tokens(i));
      if (id < first_ || id >= first_ + local_vocab()) continue;
      T* dst = &g(id - first_, 0);
      for (index_t j = 0; j < dim(); ++j) dst[j] += dout(i, j);
    }
  }

 private:
  template <class D>
  void whole_table_on(D) const {
    LOOM_CHECK(local_vocab() == vocab_, "nn::tp::vocab_parallel_embedding: on ", D::name,
               " the whole table runs on one rank (tp = 1); this rank holds ", local_vocab(), " of ", vocab_, " tokens");
  }
  index_t vocab_ = 0;
  param_slot<2> weight_{};
  index_t first_ = 0;
};

}  // namespace loom::nn::tp
