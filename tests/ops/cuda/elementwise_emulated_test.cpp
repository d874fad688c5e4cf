// The grid-stride kernels that have not yet run on a GPU, on host threads
// (emulation.hpp), against their host counterparts: GeLU forward and backward (both forms;
// within 1e-6: the host's vector loops may contract into FMAs differently), embedding forward (and its record of the
// first id outside the vocabulary) and backward (a thread per column of one residue class of
// ids, adding in token order: the host's bits), and NF4 rows dequantised (plain and
// double-quantised absmax, fp32 and bf16 out; the host's bits). Launch shapes are the headers'
// (ops::kernels::grid_for, embedding_buckets); kernels_test.cu runs the same on a device.
#include "emulation.hpp"

#include <loom/ops/cuda/activation.cuh>
#include <loom/ops/cuda/embedding.cuh>
#include <loom/quant/cuda/nf4.cuh>

#include <loom/core/float16.hpp>
#include <loom/core/random.hpp>
#include <loom/ops/host/activation.hpp>
#include <loom/ops/host/embedding.hpp>
#include <loom/quant/nf4.hpp>

#include <doctest/doctest.h>

#include "ops/cuda/compare.hpp"

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace {

using loom::index_t;
using loom::make_view;
using loom::emulation::emulate_launch;
namespace ops = loom::ops;
namespace quant = loom::quant;


constexpr unsigned block = ops::kernels::elementwise_block;
dim3 grid(index_t n) { return {ops::kernels::grid_for(n, block), 1, 1}; }

}  // namespace

TEST_CASE("the CUDA GeLU kernels, emulated on host threads, equal the host's (erf and tanh forms)") {
  const index_t n = 3001;
  const auto x = random_vector(std::size_t(n), 33, 3.f), dy = random_vector(std::size_t(n), 34);
  const auto dx0 = random_vector(std::size_t(n), 35);
  for (auto approx : {ops::gelu_approx::none, ops::gelu_approx::tanh}) {
    CAPTURE(int(approx));
    std::vector<float> y(x.size()), ey(x.size(), -9.f), dx = dx0, edx = dx0;
    ops::gelu_forward(loom::host{}, make_view(x.data(), n), make_view(y.data(), n), approx);
    ops::gelu_backward(loom::host{}, make_view(dy.data(), n), make_view(x.data(), n), make_view(dx.data(), n), approx);
    emulate_launch(ops::kernels::gelu_forward<float>, grid(n), block, x.data(), ey.data(), n, approx);
    emulate_launch(ops::kernels::gelu_backward<float>, grid(n), block, dy.data(), x.data(), edx.data(), n, approx);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < y.size(); ++i)
      bad += !(std::abs(ey[i] - y[i]) <= 1e-6f + 1e-6f * std::abs(y[i])) || !(std::abs(edx[i] - dx[i]) <= 1e-6f + 1e-6f * std::abs(dx[i]));
    CHECK(bad == 0);
  }
}

TEST_CASE("the CUDA embedding kernels, emulated on host threads, equal the host's bit for bit; the first bad id is recorded") {
  const index_t n = 300, vocab = 50, d = 40;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) tokens[std::size_t(i)] = static_cast<std::int32_t>((i * i * 7 + 3) % vocab);  // ids repeat
  const auto table = random_vector(std::size_t(vocab * d), 60), dout = random_vector(std::size_t(n * d), 61);
  const auto dtable0 = random_vector(table.size(), 62);
  std::vector<float> out(std::size_t(n * d)), eout(out.size(), -9.f), dtable = dtable0, edtable = dtable0;
  ops::embedding_forward(loom::host{}, make_view(tokens.data(), n), make_view(table.data(), vocab, d), make_view(out.data(), n, d));
  ops::embedding_backward(loom::host{}, make_view(tokens.data(), n), make_view(dout.data(), n, d),
                          make_view(dtable.data(), vocab, d));
  unsigned long long first_bad = static_cast<unsigned long long>(n);
  emulate_launch(ops::kernels::embedding_forward<std::int32_t, float, float>, grid(n * d), block,
                 static_cast<const std::int32_t*>(tokens.data()), table.data(), eout.data(), n, vocab, d, &first_bad);
  CHECK(eout == out);
  CHECK(first_bad == static_cast<unsigned long long>(n));
  const index_t buckets = ops::kernels::embedding_buckets(vocab, d);
  CHECK(buckets == vocab);  // this shape: one class an id
  emulate_launch(ops::kernels::embedding_backward<std::int32_t, float>, grid(buckets * d), block,
                 static_cast<const std::int32_t*>(tokens.data()), dout.data(), edtable.data(), n, vocab, d, buckets);
  CHECK(edtable == dtable);
  // several ids a class (a wide row: fewer buckets than ids)
  const index_t wide = 4096, wide_buckets = ops::kernels::embedding_buckets(vocab, wide);
  CHECK(wide_buckets < vocab);
  const auto wdout = random_vector(std::size_t(n * wide), 63);
  std::vector<float> wd(std::size_t(vocab * wide)), ewd(wd.size());
  ops::embedding_backward(loom::host{}, make_view(tokens.data(), n), make_view(wdout.data(), n, wide), make_view(wd.data(), vocab, wide));
  emulate_launch(ops::kernels::embedding_backward<std::int32_t, float>, grid(wide_buckets * wide), block,
                 static_cast<const std::int32_t*>(tokens.data()), wdout.data(), ewd.data(), n, vocab, wide, wide_buckets);
  CHECK(ewd == wd);
  // ids outside the vocabulary: zero rows, the first position recorded; backward skips them
  tokens[17] = -1, tokens[5] = static_cast<std::int32_t>(vocab), tokens[200] = 1 << 30;
  emulate_launch(ops::kernels::embedding_forward<std::int32_t, float, float>, grid(n * d), block,
                 static_cast<const std::int32_t*>(tokens.data()), table.data(), eout.data(), n, vocab, d, &first_bad);
  CHECK(first_bad == 5);
  for (index_t i : {5, 17, 200})
    for (index_t j = 0; j < d; ++j) CHECK(eout[std::size_t(i * d + j)] == 0.f);
  std::vector<float> skipped = dtable0;
  emulate_launch(ops::kernels::embedding_backward<std::int32_t, float>, grid(buckets * d), block,
                 static_cast<const std::int32_t*>(tokens.data()), dout.data(), skipped.data(), n, vocab, d, buckets);
  std::vector<float> want = dtable0;
  for (index_t i = 0; i < n; ++i) {
    const auto t = tokens[std::size_t(i)];
    if (t < 0 || t >= vocab) continue;
    for (index_t j = 0; j < d; ++j) want[std::size_t(t * d + j)] += dout[std::size_t(i * d + j)];
  }
  CHECK(skipped == want);
}

TEST_CASE("the CUDA NF4 row dequantisation, emulated on host threads, equals the host's bit for bit") {
  const index_t rows = 48, cols = 192;
  auto w = random_vector(std::size_t(rows * cols), 50, 0.05f);
  for (index_t c = 0; c < 64; ++c) w[std::size_t(5 * cols + c)] = 0.f;  // a block of zeros
  for (bool dq : {false, true}) {
    CAPTURE(dq);
    quant::nf4_options o;
    o.block_size = 64, o.double_quant = dq, o.absmax_block_size = 32;  // several second-level blocks
    const quant::nf4_matrix m(make_view(static_cast<const float*>(w.data()), rows, cols), o);
    std::vector<float> want(w.size());
    m.dequantize(0, rows, 0, cols, want.data(), cols);
    const index_t r0 = 7, r1 = 41, bytes = (r1 - r0) * cols / 2;  // a slice of rows
    std::vector<float> got(std::size_t((r1 - r0) * cols), -9.f);
    std::vector<loom::bfloat16> got16(got.size());
    auto run = [&](auto* out) {
      emulate_launch(quant::kernels::nf4_dequantize_rows<std::remove_pointer_t<decltype(out)>>, grid(bytes), block,
                     m.codes().data(), m.absmax().data(), m.absmax_codes().data(), m.absmax_scales().data(),
                     m.absmax_offset(), quant::nf4_values.data(), quant::dynamic_map.data(), r0 * cols / 2, bytes,
                     o.block_size, dq ? o.absmax_block_size : index_t(1), dq, out);
    };
    run(got.data());
    run(got16.data());
    const std::vector<float> slice(want.begin() + r0 * cols, want.begin() + r1 * cols);
    CHECK(got == slice);
    std::size_t differ = 0;
    for (std::size_t i = 0; i < slice.size(); ++i) differ += static_cast<float>(got16[i]) != static_cast<float>(loom::bfloat16(slice[i]));
    CHECK(differ == 0);
  }
}
