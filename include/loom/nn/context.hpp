#pragma once
// Where a layer's ops run: nn::device_context<D> is the one thing a layer needs to know about
// its device. The layers (nn/) are written once against it; the host's is empty (its ops run
// on loom's pool as they are called), CUDA's (<loom/nn/cuda/context.cuh>) holds a rank's stream
// and cuBLAS handle and launches each op on that stream.
//
// Why a context object rather than the tag alone: on a GPU an op is not complete without the
// stream it is ordered on (and the GEMM without its handle), and these are per rank, not per
// type. Why member functions rather than calling ops:: with the tag: the layers' templates are
// parsed before a CUDA translation unit's ops/cuda headers would be seen, so the lookup goes
// through the context's type, which the CUDA header completes.
//
// Each member mirrors the ops:: function of the same name without its tag (and, on CUDA,
// without its stream): the same arguments in the same order, none defaulted, so that an
// argument can never slide into another's place.

#include <loom/core/device.hpp>
#include <loom/ops/host/activation.hpp>
#include <loom/ops/host/cross_entropy.hpp>
#include <loom/ops/host/embedding.hpp>
#include <loom/ops/host/fill.hpp>
#include <loom/ops/host/gemm.hpp>
#include <loom/ops/host/norm.hpp>
#include <loom/ops/host/rope.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>

namespace loom::nn {

template <class D>
class device_context;  // loom::cuda: include <loom/nn/cuda/context.cuh>

/// Views on device D, with D not deduced from them: a layer's device comes from its context or
/// workspace, so a mutable view still passes where a const one is expected.
template <class T, class D, std::size_t R>
using view_on = tensor_view<T, std::type_identity_t<D>, R>;
template <class T, class D, std::size_t R>
using in_view_on = tensor_view<const std::type_identity_t<T>, std::type_identity_t<D>, R>;

template <>
class device_context<host> {
 public:
  using device = host;

  /// n elements from src to dst: within the device, from the host, to the host. The host's
  /// are one copy each; a device's wait where the host's memory is read or written.
  template <class E>
  void copy(const E* src, E* dst, std::size_t n) const {
    std::copy_n(src, n, dst);
  }
  template <class E>
  void copy_from_host(const E* src, E* dst, std::size_t n) const {
    std::copy_n(src, n, dst);
  }
  template <class E>
  void copy_to_host(const E* src, E* dst, std::size_t n) const {
    std::copy_n(src, n, dst);
  }
  /// Every product of the list, as one split over the pool (ops::gemm_batch).
  template <class T>
  void gemm_all(std::span<const ops::gemm_op<T>> g) const {
    ops::gemm_batch(host{}, g);
  }
  template <class In, class Out>
  void cast(In in, Out out) const {
    ops::cast(host{}, in, out);
  }
  template <class X, class V>
  void fill(X x, V value) const {
    ops::fill(host{}, x, value);
  }
  template <class Y, class X>
  void add(Y y, X x) const {
    ops::add(host{}, y, x);
  }
  template <class Y, class B>
  void add_bias(Y y, B b) const {
    ops::add_bias(host{}, y, b);
  }
  template <class DY, class DB, class S>
  void bias_backward(DY dy, DB db, S scale) const {
    ops::bias_backward(host{}, dy, db, scale);
  }
  template <class X, class W, class Y, class R, class E>
  void rmsnorm_forward(X x, W w, Y y, R rstd, E eps) const {
    ops::rmsnorm_forward(host{}, x, w, y, rstd, eps);
  }
  template <class DY, class X, class W, class R, class DX, class DW>
  void rmsnorm_backward(DY dy, X x, W w, R rstd, DX dx, DW dw) const {
    ops::rmsnorm_backward(host{}, dy, x, w, rstd, dx, dw);
  }
  template <class A, class B, class O>
  void swiglu_forward(A a, B b, O out) const {
    ops::swiglu_forward(host{}, a, b, out);
  }
  template <class Tok, class Table, class O>
  void embedding_forward(Tok tokens, Table table, O out) const {
    ops::embedding_forward(host{}, tokens, table, out);
  }
  template <class Tok, class DO, class DT>
  void embedding_backward(Tok tokens, DO dout, DT dtable) const {
    ops::embedding_backward(host{}, tokens, dout, dtable);
  }
  /// The mean loss; dlogits, when not empty, written with its gradient in the same pass.
  template <class L, class Tgt, class Lse, class DL>
  auto cross_entropy_forward(L logits, Tgt targets, Lse lse, DL dlogits, const ops::cross_entropy_options& opt) const {
    return dlogits.empty() ? ops::cross_entropy_forward(host{}, logits, targets, lse, opt)
                           : ops::cross_entropy_forward_backward(host{}, logits, targets, lse, dlogits, opt);
  }
  template <class L, class Tgt, class Lse, class DL, class S>
  void cross_entropy_backward(L logits, Tgt targets, Lse lse, DL dlogits, S dloss, const ops::cross_entropy_options& opt,
                              bool accumulate) const {
    ops::cross_entropy_backward(host{}, logits, targets, lse, dlogits, dloss, opt, accumulate);
  }
  template <class X, class Table, class Style, class I>
  void rope_forward(X x, const Table& table, Style style, I pos0) const {
    ops::rope_forward(host{}, x, table, style, pos0);
  }
  template <class X, class Table, class Style, class I>
  void rope_backward(X dx, const Table& table, Style style, I pos0) const {
    ops::rope_backward(host{}, dx, table, style, pos0);
  }
  template <class DO, class A, class B, class DA, class DB>
  void swiglu_backward(DO dout, A a, B b, DA da, DB db, bool accumulate) const {
    ops::swiglu_backward(host{}, dout, a, b, da, db, accumulate);
  }
};

/// The host's context: it holds nothing, so one serves every layer and workspace.
inline const device_context<host>& host_context() {
  static const device_context<host> c;
  return c;
}

}  // namespace loom::nn
