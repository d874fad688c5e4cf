#pragma once
// The collective tests, written once over `communicator C` and instantiated for thread_comm
// (tests/comm/thread_comm_test.cpp) and mpi_comm (tests/comm/mpi_comm_test.cpp).
//
// Oracle: a naive reference computed in double straight from the generator below, for every
// rank's view of the result; nothing of the communicator's own arithmetic is reused. Data are
// small integers, so sum, max and min are exact in every element type and every summation
// order (MPI's order is its own); avg is compared within one unit in the last place of T.
// Each check returns a list of failures (empty = pass), so it can run on any rank or thread.

#include <loom/comm/communicator.hpp>
#include <loom/core/dtype.hpp>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace loom_test {

using loom::comm::reduce_op;

/// The value rank r contributes at index i: a small integer in [-8, 8].
inline double gen(int r, std::size_t i) { return static_cast<double>(static_cast<int>((r * 31 + i * 7 + 3) % 17) - 8); }

template <class T>
T to_t(double v) {
  if constexpr (std::is_same_v<T, loom::half> || std::is_same_v<T, loom::bfloat16>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

template <class T>
double ulp_rel() {
  if constexpr (std::is_same_v<T, loom::half>) return 1.0 / 1024;
  else if constexpr (std::is_same_v<T, loom::bfloat16>) return 1.0 / 128;
  else if constexpr (std::is_same_v<T, float>) return 1.0 / (1 << 23);
  else return 0.0;  // double: exact sum / n; integers: exact
}

/// Reference of op over ranks 0..size-1 of gen(r, j), rounded to T.
template <class T>
double reduce_ref(reduce_op op, int size, std::size_t j) {
  double acc = gen(0, j);
  for (int r = 1; r < size; ++r) {
    const double v = gen(r, j);
    if (op == reduce_op::sum || op == reduce_op::avg) acc += v;
    if (op == reduce_op::max) acc = std::max(acc, v);
    if (op == reduce_op::min) acc = std::min(acc, v);
  }
  if (op == reduce_op::avg) acc = std::is_integral_v<T> ? std::trunc(acc / size) : acc / size;
  return static_cast<double>(to_t<T>(acc));
}

template <class T>
bool close(T got, double want, reduce_op op) {
  const double g = static_cast<double>(got);
  if (op != reduce_op::avg) return g == want;
  return std::abs(g - want) <= ulp_rel<T>() * std::abs(want) * 1.0001;
}

struct failures {
  std::vector<std::string> list;
  template <class... P>
  void add(P&&... parts) {
    std::ostringstream os;
    (os << ... << parts);
    list.push_back(os.str());
  }
};

template <class T>
std::string tname() { return std::string(loom::dtype_name(loom::dtype_of<T>)); }

template <loom::comm::communicator C, loom::element T>
void check_all_gather(C& c, std::size_t n, bool async, bool in_place, failures& f) {
  const int p = c.size(), me = c.rank();
  std::vector<T> in(n), out(n * static_cast<std::size_t>(p), to_t<T>(99));
  for (std::size_t i = 0; i < n; ++i) in[i] = to_t<T>(gen(me, i));
  std::span<const T> src = in;
  if (in_place) {
    std::copy(in.begin(), in.end(), out.begin() + static_cast<std::ptrdiff_t>(n * static_cast<std::size_t>(me)));
    src = std::span<const T>(out.data() + n * static_cast<std::size_t>(me), n);
  }
  if (async) {
    auto w = c.all_gather_async(src, std::span<T>(out));
    w.wait();
  } else {
    c.all_gather(src, std::span<T>(out));
  }
  std::size_t wrong = 0;
  for (int r = 0; r < p; ++r)
    for (std::size_t i = 0; i < n; ++i)
      wrong += static_cast<double>(out[static_cast<std::size_t>(r) * n + i]) != static_cast<double>(to_t<T>(gen(r, i)));
  if (wrong) f.add("all_gather<", tname<T>(), "> n=", n, " async=", async, " in_place=", in_place, " rank ", me, ": ", wrong, " wrong");
}

template <loom::comm::communicator C, loom::element T>
void check_reduce_scatter(C& c, std::size_t n, reduce_op op, bool async, failures& f) {
  const int p = c.size(), me = c.rank();
  std::vector<T> in(n * static_cast<std::size_t>(p)), out(n, to_t<T>(99));
  for (std::size_t j = 0; j < in.size(); ++j) in[j] = to_t<T>(gen(me, j));
  if (async) {
    auto w = c.reduce_scatter_async(std::span<const T>(in), std::span<T>(out), op);
    while (!w.test()) {
    }
  } else {
    c.reduce_scatter(std::span<const T>(in), std::span<T>(out), op);
  }
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += !close(out[i], reduce_ref<T>(op, p, static_cast<std::size_t>(me) * n + i), op);
  if (wrong)
    f.add("reduce_scatter<", tname<T>(), ", ", loom::comm::reduce_op_name(op), "> n=", n, " async=", async, " rank ", me, ": ", wrong, " wrong");
}

template <loom::comm::communicator C, loom::element T>
void check_all_reduce(C& c, std::size_t n, reduce_op op, bool async, bool in_place, failures& f) {
  const int me = c.rank();
  std::vector<T> in(n), out(n, to_t<T>(99));
  for (std::size_t i = 0; i < n; ++i) in[i] = to_t<T>(gen(me, i));
  std::span<T> dst = in_place ? std::span<T>(in) : std::span<T>(out);
  if (async) {
    auto w = c.all_reduce_async(std::span<const T>(in), dst, op);
    w.wait();
  } else {
    c.all_reduce(std::span<const T>(in), dst, op);
  }
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += !close(dst[i], reduce_ref<T>(op, c.size(), i), op);
  if (wrong)
    f.add("all_reduce<", tname<T>(), ", ", loom::comm::reduce_op_name(op), "> n=", n, " async=", async, " in_place=", in_place,
          " rank ", me, ": ", wrong, " wrong");
}

template <loom::comm::communicator C, loom::element T>
void check_broadcast(C& c, std::size_t n, int root, bool async, failures& f) {
  const int me = c.rank();
  std::vector<T> buf(n);
  for (std::size_t i = 0; i < n; ++i) buf[i] = to_t<T>(me == root ? gen(root, i) : 99.0);
  if (async) {
    auto w = c.broadcast_async(std::span<T>(buf), root);
    w.wait();
  } else {
    c.broadcast(std::span<T>(buf), root);
  }
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += static_cast<double>(buf[i]) != static_cast<double>(to_t<T>(gen(root, i)));
  if (wrong) f.add("broadcast<", tname<T>(), "> n=", n, " root=", root, " async=", async, " rank ", me, ": ", wrong, " wrong");
}

/// Ring exchange: every rank sends to rank+1 and receives from rank-1, two tags, posted in
/// opposite orders so that matching by tag (not by arrival) is exercised.
template <loom::comm::communicator C, loom::element T>
void check_send_recv(C& c, std::size_t n, failures& f) {
  const int p = c.size(), me = c.rank();
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  std::vector<T> a(n), b(n), ra(n), rb(n);
  for (std::size_t i = 0; i < n; ++i) {
    a[i] = to_t<T>(gen(me, i));
    b[i] = to_t<T>(gen(me + 100, i));
  }
  auto rwb = c.recv_async(std::span<T>(rb), prev, 2);
  auto rwa = c.recv_async(std::span<T>(ra), prev, 1);
  auto swa = c.send_async(std::span<const T>(a), next, 1);
  auto swb = c.send_async(std::span<const T>(b), next, 2);
  swa.wait();
  swb.wait();
  rwa.wait();
  rwb.wait();
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) {
    wrong += static_cast<double>(ra[i]) != static_cast<double>(to_t<T>(gen(prev, i)));
    wrong += static_cast<double>(rb[i]) != static_cast<double>(to_t<T>(gen(prev + 100, i)));
  }
  if (wrong) f.add("send/recv<", tname<T>(), "> n=", n, " rank ", me, ": ", wrong, " wrong");
}

/// Every operation on T at count n (blocking; async for some sizes; in-place variants).
template <loom::comm::communicator C, loom::element T>
void check_type(C& c, std::size_t n, bool with_async, failures& f) {
  check_all_gather<C, T>(c, n, false, false, f);
  check_all_gather<C, T>(c, n, false, true, f);
  for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min}) {
    check_reduce_scatter<C, T>(c, n, op, false, f);
    check_all_reduce<C, T>(c, n, op, false, false, f);
  }
  check_all_reduce<C, T>(c, n, reduce_op::sum, false, true, f);
  check_broadcast<C, T>(c, n, c.size() - 1, false, f);
  check_send_recv<C, T>(c, n, f);
  if (with_async) {
    check_all_gather<C, T>(c, n, true, false, f);
    check_reduce_scatter<C, T>(c, n, reduce_op::max, true, f);
    check_all_reduce<C, T>(c, n, reduce_op::sum, true, true, f);
    check_broadcast<C, T>(c, n, 0, true, f);
  }
}

/// Every operation on every element type at count n.
template <loom::comm::communicator C>
void check_every_type(C& c, std::size_t n, bool with_async, failures& f) {
  check_type<C, float>(c, n, with_async, f);
  check_type<C, double>(c, n, with_async, f);
  check_type<C, loom::half>(c, n, with_async, f);
  check_type<C, loom::bfloat16>(c, n, with_async, f);
  check_type<C, std::int32_t>(c, n, with_async, f);
  check_type<C, std::int64_t>(c, n, with_async, f);
}

/// The whole matrix: every op x {float, double, half, bfloat16, int32, int64} x sizes 0, 1, 7,
/// 1000 and (when `big`) 2^20+3, which no rank count > 1 divides.
template <loom::comm::communicator C>
failures run_suite(C& c, bool big = true) {
  failures f;
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}})
    check_every_type(c, n, n == 1 || n == 1000, f);
  if (big) check_every_type(c, (std::size_t{1} << 20) + 3, true, f);
  return f;
}

inline std::string join(const failures& f) {
  std::string s;
  for (const auto& x : f.list) s += x + "\n";
  return s;
}

}  // namespace loom_test
