#pragma once
// The layers' CUDA context (nn/context.hpp): a rank's stream and cuBLAS handle. Each member
// launches the ops/cuda function of the same name on the stream, so nn's layers, written once,
// run on the GPU when their workspace (or the context they take) is a CUDA one:
//
//   nn::device_context<cuda> ctx(stream);
//   nn::workspace<float, cuda> ws(ctx);
//   mlp.forward(params_on_device, x, acts, y, ws);   // acts = mlp.make_activations<cuda>(rows)
//
// Work is asynchronous on the stream, as every op of ops/cuda is; views are device views. A
// context also keeps what its ops need between calls: a device copy of each rotary table
// (made on first use; a table is a function of its sizes and base, so all layers of one
// configuration share one) and the workspaces of attention's backward, the embedding's id
// check and the cross-entropy. Like its stream, a context is used by one host thread at a time.

#include <loom/nn/context.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/cuda/error.hpp>
#include <loom/ops/cuda/activation.cuh>
#include <loom/ops/cuda/attention.cuh>
#include <loom/ops/cuda/cross_entropy.cuh>
#include <loom/ops/cuda/embedding.cuh>
#include <loom/ops/cuda/fill.cuh>
#include <loom/ops/cuda/gemm.hpp>
#include <loom/ops/cuda/norm.cuh>
#include <loom/ops/cuda/rope.cuh>
#include <loom/ops/host/rope.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

namespace loom::nn {

template <>
class device_context<cuda> {
 public:
  using device = cuda;

  /// Layers run on `stream` (not owned: it must outlive the context; null: the default stream).
  explicit device_context(cudaStream_t stream = nullptr) : stream_(stream), blas_(stream) {}

  cudaStream_t stream() const noexcept { return stream_; }
  const ops::cublas_handle& blas() const noexcept { return blas_; }

  /// n elements from src to dst: within the device (ordered on the stream), from the host
  /// and to the host (these wait for the stream: the host's memory is free, or filled, on return).
  template <class E>
  void copy(const E* src, E* dst, std::size_t n) const {
    if (n) LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(E), cudaMemcpyDeviceToDevice, stream_));
  }
  template <class E>
  void copy_from_host(const E* src, E* dst, std::size_t n) const {
    if (!n) return;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(E), cudaMemcpyHostToDevice, stream_));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  template <class E>
  void copy_to_host(const E* src, E* dst, std::size_t n) const {
    if (!n) return;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(E), cudaMemcpyDeviceToHost, stream_));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  /// Every product of the list in list order (one cuBLAS call each; a later product may read
  /// or add into an earlier one's C, as on the host).
  template <class T>
  void gemm_all(std::span<const ops::gemm_op<T, cuda>> g) const {
    for (const auto& o : g) ops::gemm(cuda{}, blas_, o.a, o.b, o.c, static_cast<float>(o.alpha), static_cast<float>(o.beta));
  }
  template <class In, class Out>
  void cast(In in, Out out) const {
    ops::cast(cuda{}, in, out, stream_);
  }
  template <class X, class V>
  void fill(X x, V value) const {
    ops::fill(cuda{}, x, value, stream_);
  }
  template <class Y, class X>
  void add(Y y, X x) const {
    ops::add(cuda{}, y, x, stream_);
  }
  template <class Y, class B>
  void add_bias(Y y, B b) const {
    ops::add_bias(cuda{}, y, b, stream_);
  }
  template <class DY, class DB, class S>
  void bias_backward(DY dy, DB db, S scale) const {
    ops::bias_backward(cuda{}, dy, db, scale, stream_);
  }
  template <class X, class W, class Y, class R, class E>
  void rmsnorm_forward(X x, W w, Y y, R rstd, E eps) const {
    ops::rmsnorm_forward(cuda{}, x, w, y, rstd, eps, stream_);
  }
  template <class DY, class X, class W, class R, class DX, class DW>
  void rmsnorm_backward(DY dy, X x, W w, R rstd, DX dx, DW dw) const {
    ops::rmsnorm_backward(cuda{}, dy, x, w, rstd, dx, dw, stream_);
  }
  template <class A, class B, class O>
  void swiglu_forward(A a, B b, O out) const {
    ops::swiglu_forward(cuda{}, a, b, out, stream_);
  }
  template <class DO, class A, class B, class DA, class DB>
  void swiglu_backward(DO dout, A a, B b, DA da, DB db, bool accumulate) const {
    ops::swiglu_backward(cuda{}, dout, a, b, da, db, accumulate, stream_);
  }
  /// Waits for the stream (a bad id is a loom::error naming it, as on the host).
  template <class Tok, class Table, class O>
  void embedding_forward(Tok tokens, Table table, O out) const {
    ops::embedding_forward(cuda{}, tokens, table, out, embedding_ws_, stream_);
  }
  template <class Tok, class DO, class DT>
  void embedding_backward(Tok tokens, DO dout, DT dtable) const {
    ops::embedding_backward(cuda{}, tokens, dout, dtable, stream_);
  }
  /// The mean loss (waits for the stream: the loss and a bad target come back to the host);
  /// dlogits, when not empty, written with its gradient in the same pass.
  template <class L, class Tgt, class Lse, class DL>
  auto cross_entropy_forward(L logits, Tgt targets, Lse lse, DL dlogits, const ops::cross_entropy_options& opt) const {
    return ops::cross_entropy_forward(cuda{}, logits, targets, lse, cross_entropy_ws(logits.extent(0)), dlogits, opt, stream_);
  }
  template <class L, class Tgt, class Lse, class DL, class S>
  void cross_entropy_backward(L logits, Tgt targets, Lse lse, DL dlogits, S dloss, const ops::cross_entropy_options& opt,
                              bool accumulate) const {
    ops::cross_entropy_backward(cuda{}, logits, targets, lse, dlogits, cross_entropy_ws(logits.extent(0)), dloss, opt,
                                accumulate, stream_);
  }
  /// The host's table, rotated by its device copy.
  template <class X, class T, class Style, class I>
  void rope_forward(X x, const ops::rope_table<T>& table, Style style, I pos0) const {
    const auto& t = device_table(table);
    ops::rope_forward(cuda{}, x, make_view<cuda>(t.cos.data(), t.max_seq, t.half), make_view<cuda>(t.sin.data(), t.max_seq, t.half), style, pos0, stream_);
  }
  template <class X, class T, class Style, class I>
  void rope_backward(X dx, const ops::rope_table<T>& table, Style style, I pos0) const {
    const auto& t = device_table(table);
    ops::rope_backward(cuda{}, dx, make_view<cuda>(t.cos.data(), t.max_seq, t.half), make_view<cuda>(t.sin.data(), t.max_seq, t.half), style, pos0, stream_);
  }
  /// Attention with the log-sum-exp saved for backward instead of the probabilities (the host
  /// layer's): ops/cuda/attention.cuh.
  template <class Q, class K, class V, class O, class L>
  void attention_forward(Q q, K k, V v, O out, L lse, ops::attention_mask mask) const {
    ops::attention_forward(cuda{}, q, k, v, out, lse, mask, stream_);
  }
  template <class DO, class Q, class K, class V, class O, class L, class DQ, class DK, class DV>
  void attention_backward(DO dout, Q q, K k, V v, O out, L lse, DQ dq, DK dk, DV dv, ops::attention_mask mask,
                          bool accumulate) const {
    ops::attention_backward(cuda{}, dout, q, k, v, out, lse, dq, dk, dv, attention_ws_, mask, accumulate, stream_);
  }

 private:
  struct device_rope {
    index_t max_seq, half, head_dim;
    double theta;
    buffer<float, cuda> cos, sin;
  };
  template <class T>
  const device_rope& device_table(const ops::rope_table<T>& t) const {
    static_assert(std::is_same_v<T, float>, "nn::device_context<cuda>: rotary tables are float (the attention is fp32)");
    const index_t half = t.rotary_dim / 2;
    for (const auto& d : ropes_)
      if (d->max_seq == t.max_seq && d->half == half && d->head_dim == t.head_dim && d->theta == t.theta) return *d;
    auto d = std::make_unique<device_rope>(device_rope{t.max_seq, half, t.head_dim, t.theta, buffer<float, cuda>(t.cos.size()),
                                                       buffer<float, cuda>(t.sin.size())});
    LOOM_CUDA_CHECK(cudaMemcpy(d->cos.data(), t.cos.data(), t.cos.size() * sizeof(float), cudaMemcpyHostToDevice));
    LOOM_CUDA_CHECK(cudaMemcpy(d->sin.data(), t.sin.data(), t.sin.size() * sizeof(float), cudaMemcpyHostToDevice));
    ropes_.push_back(std::move(d));
    return *ropes_.back();
  }

  /// Grown to the largest row count so far.
  ops::cross_entropy_workspace& cross_entropy_ws(index_t rows) const {
    if (!cross_entropy_ws_ || static_cast<index_t>(cross_entropy_ws_->row_loss.size()) < rows) {
      if (cross_entropy_ws_) LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // launches may still read the old one
      cross_entropy_ws_.emplace(rows);
    }
    return *cross_entropy_ws_;
  }

  cudaStream_t stream_;
  ops::cublas_handle blas_;
  mutable std::vector<std::unique_ptr<device_rope>> ropes_;
  mutable ops::attention_workspace attention_ws_;
  mutable ops::embedding_workspace embedding_ws_;
  mutable std::optional<ops::cross_entropy_workspace> cross_entropy_ws_;
};

}  // namespace loom::nn
