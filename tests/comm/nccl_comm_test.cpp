// nccl_comm on one GPU per rank (label gpu; skipped without enough devices): every collective
// on float, half, bfloat16, int32, int64 and double at sizes 0, 1, 7, 1000, 2^20+3, blocking
// and async, against the naive reference of collective_suite.hpp; point-to-point ring; split.
#include "collective_suite.hpp"

#include <loom/comm/nccl_comm.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/cuda/memory.hpp>

#include <doctest/doctest.h>

#include <vector>

using loom::comm::nccl_comm;
using loom::comm::reduce_op;

namespace {

template <class T>
loom::buffer<T, loom::cuda> to_device(const std::vector<T>& h) {
  loom::buffer<T, loom::cuda> d(h.size());
  if (!h.empty()) LOOM_CUDA_CHECK(cudaMemcpy(d.data(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <class T>
std::vector<T> to_host(const loom::buffer<T, loom::cuda>& d) {
  std::vector<T> h(d.size());
  if (!h.empty()) LOOM_CUDA_CHECK(cudaMemcpy(h.data(), d.data(), h.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}
template <class T>
std::span<T> dspan(loom::buffer<T, loom::cuda>& d) { return {d.data(), d.size()}; }

template <class T>
void check_type(nccl_comm& c, std::size_t n, bool async, loom_test::failures& f) {
  using loom_test::gen;
  using loom_test::to_t;
  const int p = c.size(), me = c.rank();
  const auto pn = n * static_cast<std::size_t>(p);
  std::vector<T> h_in(n), h_big(pn);
  for (std::size_t i = 0; i < n; ++i) h_in[i] = to_t<T>(gen(me, i));
  for (std::size_t j = 0; j < pn; ++j) h_big[j] = to_t<T>(gen(me, j));
  // all_gather
  {
    auto in = to_device(h_in);
    loom::buffer<T, loom::cuda> out(pn);
    if (async)
      c.all_gather_async(std::span<const T>(in.data(), n), dspan(out)).wait();
    else
      c.all_gather(std::span<const T>(in.data(), n), dspan(out));
    const auto got = to_host(out);
    std::size_t wrong = 0;
    for (int r = 0; r < p; ++r)
      for (std::size_t i = 0; i < n; ++i) wrong += double(got[std::size_t(r) * n + i]) != double(to_t<T>(gen(r, i)));
    if (wrong) f.add("nccl all_gather<", loom_test::tname<T>(), "> n=", n, ": ", wrong, " wrong");
  }
  // reduce_scatter and all_reduce. NCCL reduces half/bfloat16 in their own type: the data
  // are small integers, so sums stay exact there too.
  for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min}) {
    auto in = to_device(h_big);
    loom::buffer<T, loom::cuda> out(n);
    if (async)
      c.reduce_scatter_async(std::span<const T>(in.data(), pn), dspan(out), op).wait();
    else
      c.reduce_scatter(std::span<const T>(in.data(), pn), dspan(out), op);
    auto got = to_host(out);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) wrong += !loom_test::close(got[i], loom_test::reduce_ref<T>(op, p, std::size_t(me) * n + i), op);
    if (wrong) f.add("nccl reduce_scatter<", loom_test::tname<T>(), ", ", loom::comm::reduce_op_name(op), "> n=", n, ": ", wrong, " wrong");
    auto buf = to_device(h_in);
    c.all_reduce(dspan(buf), op);  // in place
    got = to_host(buf);
    wrong = 0;
    for (std::size_t i = 0; i < n; ++i) wrong += !loom_test::close(got[i], loom_test::reduce_ref<T>(op, p, i), op);
    if (wrong) f.add("nccl all_reduce<", loom_test::tname<T>(), ", ", loom::comm::reduce_op_name(op), "> n=", n, ": ", wrong, " wrong");
  }
  // broadcast from the last rank
  {
    std::vector<T> h(n);
    for (std::size_t i = 0; i < n; ++i) h[i] = to_t<T>(me == p - 1 ? gen(p - 1, i) : 99.0);
    auto buf = to_device(h);
    c.broadcast(dspan(buf), p - 1);
    const auto got = to_host(buf);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) wrong += double(got[i]) != double(to_t<T>(gen(p - 1, i)));
    if (wrong) f.add("nccl broadcast<", loom_test::tname<T>(), "> n=", n, ": ", wrong, " wrong");
  }
  // ring send/recv (async on both sides: NCCL matches them in issue order)
  if (p > 1) {
    auto a = to_device(h_in);
    loom::buffer<T, loom::cuda> r(n);
    auto rw = c.recv_async(dspan(r), (me + p - 1) % p, 0);
    auto sw = c.send_async(std::span<const T>(a.data(), n), (me + 1) % p, 0);
    sw.wait();
    rw.wait();
    const auto got = to_host(r);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) wrong += double(got[i]) != double(to_t<T>(gen((me + p - 1) % p, i)));
    if (wrong) f.add("nccl send/recv<", loom_test::tname<T>(), "> n=", n, ": ", wrong, " wrong");
  }
}

}  // namespace

TEST_CASE("nccl_comm: every op x type x size matches the naive reference") {
  nccl_comm c(loom::comm::mpi_comm::world());
  loom_test::failures f;
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}, (std::size_t{1} << 20) + 3}) {
    const bool async = n % 2 == 1;
    check_type<float>(c, n, async, f);
    check_type<loom::half>(c, n, async, f);
    check_type<loom::bfloat16>(c, n, async, f);
    check_type<double>(c, n, async, f);
    check_type<std::int32_t>(c, n, async, f);
    check_type<std::int64_t>(c, n, async, f);
  }
  CHECK_MESSAGE(f.list.empty(), loom_test::join(f));
}

TEST_CASE("nccl_comm: split, and 16-bit integers are refused by name") {
  nccl_comm c(loom::comm::mpi_comm::world());
  nccl_comm solo = c.split(c.rank(), 0);
  CHECK(solo.size() == 1);
  loom::buffer<std::int16_t, loom::cuda> b(4);
  CHECK_THROWS_WITH_AS(c.all_reduce(std::span<std::int16_t>(b.data(), 4)), doctest::Contains("int16"), loom::error);
}
