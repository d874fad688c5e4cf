// loom-bench-collectives: an nccl-tests-style sweep of loom's collectives over thread_comm,
// mpi_comm or nccl_comm.
//
// Same flags and columns as nccl-tests (-b -e -f -n -w -c -d -o -r; size count type redop root
// time algbw busbw #wrong, out-of-place then in-place; the "Avg bus bandwidth" footer), so
// figures can be read side by side with NCCL's. size is the larger buffer in bytes (nccl-tests'
// convention): all_reduce/broadcast count*sizeof(T), all_gather the gathered output,
// reduce_scatter the input. busbw = algbw x (n-1)/n for all_gather/reduce_scatter, x 2(n-1)/n
// for all_reduce, x 1 for broadcast. time is the slowest rank's mean over -n iterations.
// --baseline times the raw transport in the same run and prints its busbw and loom/baseline:
// for --comm mpi the raw MPI call on the out-of-place case's own buffers; for --comm thread a
// concurrent memcpy of `size` bytes on every rank (the bandwidth a shared-memory collective
// is bound by).
// With --rounds R the variants of a size are timed back to back in every round, the order
// rotated from round to round (so neither side always runs first), time/busbw are the best
// round, and the ratio is the median over rounds of the paired per-round ratio: drift of a
// shared machine between rounds cancels in the pair, and one disturbed round cannot move it.
// The program is written once over `communicator C`, like every loom algorithm.

#include <loom/comm/thread_comm.hpp>
#include <loom/core/buffer.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#if LOOM_HAS_MPI
#include <loom/comm/mpi_comm.hpp>
#endif
#if LOOM_HAS_NCCL
#include <loom/comm/nccl_comm.hpp>
#include <loom/core/cuda/memory.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace {

using loom::comm::reduce_op;

enum class coll { all_reduce, all_gather, reduce_scatter, broadcast };
constexpr const char* coll_name(coll c) {
  switch (c) {
    case coll::all_reduce: return "all_reduce";
    case coll::all_gather: return "all_gather";
    case coll::reduce_scatter: return "reduce_scatter";
    case coll::broadcast: return "broadcast";
  }
  return "?";
}

struct options {
  std::size_t min_bytes = 32 << 20, max_bytes = 32 << 20;
  double factor = 2;
  int iters = 20, warmup = 5, check = 1, root = 0, ranks = 4, rounds = 1;
  std::vector<loom::dtype> types{loom::dtype::f32};
  std::vector<reduce_op> ops{reduce_op::sum};
  std::vector<coll> colls{coll::all_reduce};
  std::string comm = "thread", json;
  bool baseline = false;
};

const char* usage_text =
    "usage: loom-bench-collectives [options]\n"
    "  -b, --minbytes <n[K|M|G]>   smallest size in bytes (default 32M)\n"
    "  -e, --maxbytes <n[K|M|G]>   largest size in bytes (default 32M)\n"
    "  -f, --stepfactor <x>        multiply the size by x each step (default 2)\n"
    "  -n, --iters <n>             timed iterations per size (default 20)\n"
    "  -w, --warmup_iters <n>      untimed iterations first (default 5)\n"
    "  -c, --check <0|1>           check results against a naive reference (default 1)\n"
    "  -d, --datatype <t|all>      float, double, half, bfloat16, int32, int64 (default float)\n"
    "  -o, --op <sum|avg|max|min|all>  reduction (default sum)\n"
    "  -r, --root <rank>           broadcast root (default 0)\n"
    "      --rounds <n>            time every variant n times, order rotated; keep the fastest; ratio: median of per-round pairs (default 1)\n"
    "      --coll <name|all>       all_reduce, all_gather, reduce_scatter, broadcast (default all_reduce)\n"
    "      --comm <thread|mpi|nccl> communicator (default thread; mpi and nccl under mpirun)\n"
    "      --ranks <n>             thread ranks (default 4)\n"
    "      --baseline              also time raw MPI (mpi) or memcpy (thread) on the same buffers\n"
    "      --json <file>           also write every row as JSON\n"
    "  -h, --help                  this text\n"
    "Exit status: 0 ok, 1 wrong results or a failure, 2 bad arguments.\n";

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::size_t parse_bytes(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || v < 0) throw usage_error("bad size '" + s + "'");
  double mult = 1;
  const std::string suf(end);
  if (suf == "K" || suf == "k") mult = 1024.0;
  else if (suf == "M" || suf == "m") mult = 1024.0 * 1024;
  else if (suf == "G" || suf == "g") mult = 1024.0 * 1024 * 1024;
  else if (!suf.empty()) throw usage_error("bad size suffix in '" + s + "'");
  return static_cast<std::size_t>(v * mult);
}

int parse_int(const std::string& s, int lo) {
  char* end = nullptr;
  const long v = std::strtol(s.c_str(), &end, 10);
  if (end == s.c_str() || *end || v < lo || v > 1 << 30) throw usage_error("bad number '" + s + "' (expected an integer >= " + std::to_string(lo) + ")");
  return static_cast<int>(v);
}

options parse(int argc, char** argv, bool& help) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) throw usage_error("missing value after " + a);
      return argv[++i];
    };
    if (a == "-h" || a == "--help") help = true;
    else if (a == "-b" || a == "--minbytes") o.min_bytes = parse_bytes(val());
    else if (a == "-e" || a == "--maxbytes") o.max_bytes = parse_bytes(val());
    else if (a == "-f" || a == "--stepfactor") {
      const std::string v = val();
      o.factor = std::atof(v.c_str());
      if (!(o.factor > 1)) throw usage_error("-f must be > 1, got '" + v + "'");
    } else if (a == "-n" || a == "--iters") o.iters = parse_int(val(), 1);
    else if (a == "-w" || a == "--warmup_iters") o.warmup = parse_int(val(), 0);
    else if (a == "-c" || a == "--check") o.check = parse_int(val(), 0);
    else if (a == "-r" || a == "--root") o.root = parse_int(val(), 0);
    else if (a == "--ranks") o.ranks = parse_int(val(), 1);
    else if (a == "--rounds") o.rounds = parse_int(val(), 1);
    else if (a == "--comm") {
      o.comm = val();
      if (o.comm != "thread" && o.comm != "mpi" && o.comm != "nccl") throw usage_error("--comm must be thread, mpi or nccl, got '" + o.comm + "'");
    } else if (a == "--json") o.json = val();
    else if (a == "--baseline") o.baseline = true;
    else if (a == "-d" || a == "--datatype") {
      const std::string v = val();
      if (v == "all") o.types = {loom::dtype::f32, loom::dtype::f64, loom::dtype::f16, loom::dtype::bf16, loom::dtype::i32, loom::dtype::i64};
      else {
        loom::dtype t{};
        try {
          t = loom::parse_dtype(v);
        } catch (const loom::error&) {
          throw usage_error("unknown datatype '" + v + "'");
        }
        if (t != loom::dtype::f32 && t != loom::dtype::f64 && t != loom::dtype::f16 && t != loom::dtype::bf16 && t != loom::dtype::i32 && t != loom::dtype::i64)
          throw usage_error("datatype '" + v + "' is not benchmarked (float, double, half, bfloat16, int32, int64)");
        o.types = {t};
      }
    } else if (a == "-o" || a == "--op") {
      const std::string v = val();
      if (v == "all") o.ops = {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min};
      else if (v == "sum") o.ops = {reduce_op::sum};
      else if (v == "avg") o.ops = {reduce_op::avg};
      else if (v == "max") o.ops = {reduce_op::max};
      else if (v == "min") o.ops = {reduce_op::min};
      else throw usage_error("unknown op '" + v + "'");
    } else if (a == "--coll") {
      const std::string v = val();
      if (v == "all") o.colls = {coll::all_reduce, coll::all_gather, coll::reduce_scatter, coll::broadcast};
      else if (v == "all_reduce") o.colls = {coll::all_reduce};
      else if (v == "all_gather") o.colls = {coll::all_gather};
      else if (v == "reduce_scatter") o.colls = {coll::reduce_scatter};
      else if (v == "broadcast") o.colls = {coll::broadcast};
      else throw usage_error("unknown collective '" + v + "'");
    } else throw usage_error("unknown argument '" + a + "'");
  }
  if (o.min_bytes > o.max_bytes) throw usage_error("-b (" + std::to_string(o.min_bytes) + ") must be <= -e (" + std::to_string(o.max_bytes) + ")");
  return o;
}

// -- data and reference ------------------------------------------------------------------
double gen(int r, std::size_t i) { return static_cast<double>(static_cast<int>((r * 31 + i * 7 + 3) % 17) - 8); }

template <class T>
T to_t(double v) {
  if constexpr (std::is_same_v<T, loom::half> || std::is_same_v<T, loom::bfloat16>) return T(static_cast<float>(v));
  else return static_cast<T>(v);
}

template <class T>
double reduce_ref(reduce_op op, int p, std::size_t j) {
  double acc = gen(0, j);
  for (int r = 1; r < p; ++r) {
    const double v = gen(r, j);
    acc = op == reduce_op::max ? std::max(acc, v) : op == reduce_op::min ? std::min(acc, v) : acc + v;
  }
  if (op == reduce_op::avg) acc = std::is_integral_v<T> ? std::trunc(acc / p) : acc / p;
  return static_cast<double>(to_t<T>(acc));
}

template <class T>
bool same(T got, double want, reduce_op op) {
  const double g = static_cast<double>(got);
  if (op != reduce_op::avg) return g == want;
  return std::abs(g - want) <= 1e-2 * std::abs(want);  // one ulp of the narrowest type
}

// -- buffers on the communicator's device ---------------------------------------------------
template <class T, class Dev>
struct dbuf {
  loom::buffer<T, Dev> b;
  explicit dbuf(std::size_t n) : b(n) {}
  T* data() { return b.data(); }
  void upload(const std::vector<T>& h, std::size_t off = 0) {
    if (h.empty()) return;
    if constexpr (Dev::host_accessible) std::memcpy(b.data() + off, h.data(), h.size() * sizeof(T));
#if LOOM_HAS_NCCL
    else LOOM_CUDA_CHECK(cudaMemcpy(b.data() + off, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
#endif
  }
  std::vector<T> download(std::size_t off, std::size_t n) {
    std::vector<T> h(n);
    if (!n) return h;
    if constexpr (Dev::host_accessible) std::memcpy(h.data(), b.data() + off, n * sizeof(T));
#if LOOM_HAS_NCCL
    else LOOM_CUDA_CHECK(cudaMemcpy(h.data(), b.data() + off, n * sizeof(T), cudaMemcpyDeviceToHost));
#endif
    return h;
  }
};

struct timing {
  double us = 0, algbw = 0, busbw = 0;
  long wrong = -1;  // -1: not checked / not applicable
  bool valid = false;
};

struct row {
  std::string coll_s, type_s, op_s;
  std::size_t bytes = 0, count = 0;
  int root = -1;
  timing oop, ip, base;
  double ratio = 0;  // loom out-of-place busbw / baseline busbw: median of the per-round pairs
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

double bus_factor(coll c, int p) {
  if (p == 1) return c == coll::broadcast ? 1.0 : 0.0;
  switch (c) {
    case coll::all_reduce: return 2.0 * (p - 1) / p;
    case coll::all_gather:
    case coll::reduce_scatter: return static_cast<double>(p - 1) / p;
    case coll::broadcast: return 1.0;
  }
  return 1.0;
}

// A raw-transport baseline over the same buffers; returns false when there is none.
struct no_baseline {
  template <class T>
  bool run(coll, reduce_op, const T*, T*, std::size_t, std::size_t, int) { return false; }
  bool is_memcpy() const { return false; }
};

template <loom::comm::communicator C, class Dev, class Baseline>
class bench {
 public:
  bench(C& c, const options& o, Baseline& b) : c_(c), o_(o), base_(b) {}

  template <class T>
  void run_type(coll k, reduce_op op, std::vector<row>& rows) {
    const int p = c_.size();
    if (c_.rank() == 0) std::printf("# %s\n", coll_name(k));
    for (double bytes_d = static_cast<double>(o_.min_bytes); bytes_d <= static_cast<double>(o_.max_bytes) * 1.0000001; bytes_d *= o_.factor) {
      std::size_t count = static_cast<std::size_t>(bytes_d) / sizeof(T);
      if (k == coll::all_gather || k == coll::reduce_scatter) count -= count % static_cast<std::size_t>(p);
      row r;
      r.coll_s = coll_name(k);
      r.type_s = std::string(loom::dtype_name(loom::dtype_of<T>));
      r.op_s = (k == coll::all_reduce || k == coll::reduce_scatter) ? std::string(loom::comm::reduce_op_name(op)) : "none";
      r.root = k == coll::broadcast ? o_.root : -1;
      r.count = count;
      r.bytes = count * sizeof(T);
      const std::size_t per = (k == coll::all_gather || k == coll::reduce_scatter) ? count / static_cast<std::size_t>(p) : count;
      // The variants of this size, timed in turn within each round so that they see the same
      // machine: out-of-place, in-place (all_reduce, all_gather), the baseline.
      std::vector<std::unique_ptr<bench_case<T>>> cases;
      cases.push_back(std::make_unique<bench_case<T>>(*this, k, op, count, per, variant::out_of_place));
      if (k == coll::all_reduce || k == coll::all_gather)
        cases.push_back(std::make_unique<bench_case<T>>(*this, k, op, count, per, variant::in_place));
      if (o_.baseline && base_.run(k, op, static_cast<const T*>(nullptr), static_cast<T*>(nullptr), 0, 0, o_.root))
        cases.push_back(std::make_unique<bench_case<T>>(*this, k, op, count, per, variant::baseline,
                                                        base_.is_memcpy() ? nullptr : cases.front().get()));
      std::vector<double> best(cases.size(), 0.0);
      std::vector<std::vector<double>> times(cases.size());  // [variant][round]
      for (auto& cs : cases) {
        cs->fill();
        for (int i = 0; i < o_.warmup; ++i) cs->once();
      }
      for (int round = 0; round < o_.rounds; ++round)
        for (std::size_t j = 0; j < cases.size(); ++j) {
          const std::size_t v = (j + static_cast<std::size_t>(round)) % cases.size();  // rotate who goes first
          c_.barrier();
          const auto t0 = std::chrono::steady_clock::now();
          for (int i = 0; i < o_.iters; ++i) cases[v]->once();
          if constexpr (!Dev::host_accessible) c_.barrier();  // device work must have finished
          const double us = slowest(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / o_.iters);
          times[v].push_back(us);
          best[v] = round == 0 ? us : std::min(best[v], us);
        }
      for (std::size_t v = 0; v < cases.size(); ++v) {
        timing t;
        t.valid = true;
        t.us = best[v];
        t.algbw = t.us > 0 ? static_cast<double>(r.bytes) / t.us / 1e3 : 0;
        const bool memcpy_base = cases[v]->var == variant::baseline && base_.is_memcpy();
        t.busbw = t.algbw * (memcpy_base ? 1.0 : bus_factor(k, p));
        if (o_.check && cases[v]->var != variant::baseline) t.wrong = cases[v]->check();
        (cases[v]->var == variant::out_of_place ? r.oop : cases[v]->var == variant::in_place ? r.ip : r.base) = t;
      }
      if (cases.back()->var == variant::baseline) {  // same bytes: busbw ratio = time ratio x bus factors
        const double f = (r.oop.us > 0 && r.base.us > 0) ? (r.oop.busbw * r.oop.us) / (r.base.busbw * r.base.us) : 0.0;
        std::vector<double> pairs;
        for (std::size_t i = 0; i < times.front().size(); ++i)
          if (times.front()[i] > 0) pairs.push_back(f * times.back()[i] / times.front()[i]);
        r.ratio = median(pairs);
      }
      rows.push_back(r);
      if (c_.rank() == 0) print_row(r);
      if (bytes_d == 0) break;
    }
  }

 private:
  enum class variant { out_of_place, in_place, baseline };

  // The slowest rank's time, agreed over the communicator.
  double slowest(double us) {
    c_.all_reduce(std::span<double>(&us, 1), reduce_op::max);
    return us;
  }

  // One variant of one size: its buffers, one call, and the check of its result.
  template <class T>
  struct bench_case {
    bench& b;
    coll k;
    reduce_op op;
    std::size_t count, per;  // count: elements of the larger buffer; per: of the smaller (all_gather, reduce_scatter)
    variant var;
    std::size_t n_in, n_out;
    dbuf<T, Dev> in, out;  // in: [n_in] (none when in place); out: [n_out]
    T* src;
    // The raw MPI baseline runs on the out-of-place case's very buffers (same pages, same
    // alignment: a large-message copy's cost depends on them); the memcpy baseline copies
    // `count` elements, more than an all_gather input holds, so it has its own.
    bench_case* shared;

    bench_case(bench& bb, coll kk, reduce_op o, std::size_t c, std::size_t p, variant v, bench_case* share = nullptr)
        : b(bb), k(kk), op(o), count(c), per(p), var(v), n_in(k == coll::all_gather ? per : count),
          n_out(k == coll::reduce_scatter ? per : count),
          in(v == variant::in_place || share ? 0 : (v == variant::baseline ? count : n_in)),
          out(share ? 0 : (v == variant::baseline ? count : n_out)),
          src(v == variant::in_place ? out.data() + (k == coll::all_gather ? per * static_cast<std::size_t>(b.c_.rank()) : 0) : in.data()),
          shared(share) {}

    void fill() {
      if (shared) return;
      const int me = b.c_.rank();
      std::vector<T> h(n_in);
      for (std::size_t i = 0; i < n_in; ++i) h[i] = to_t<T>(k == coll::broadcast && me != b.o_.root ? 99.0 : gen(me, i));
      if (var == variant::in_place) out.upload(h, k == coll::all_gather ? per * static_cast<std::size_t>(me) : 0);
      else if (k == coll::broadcast) out.upload(h);
      else in.upload(h);
    }
    void once() {
      if (var == variant::baseline) {
        bench_case& bc = shared ? *shared : *this;
        b.base_.run(k, op, static_cast<const T*>(bc.in.data()), bc.out.data(), per, count, b.o_.root);
        return;
      }
      auto& c = b.c_;
      switch (k) {
        case coll::all_reduce: c.all_reduce(std::span<const T>(src, count), std::span<T>(out.data(), count), op); break;
        case coll::all_gather: c.all_gather(std::span<const T>(src, per), std::span<T>(out.data(), count)); break;
        case coll::reduce_scatter: c.reduce_scatter(std::span<const T>(src, count), std::span<T>(out.data(), per), op); break;
        case coll::broadcast: c.broadcast(std::span<T>(out.data(), count), b.o_.root); break;
      }
    }
    // Refills, runs once, counts wrong values over all ranks.
    long check() {
      fill();
      once();
      const int p = b.c_.size(), me = b.c_.rank();
      const auto got = out.download(0, n_out);
      const std::size_t blk = std::max<std::size_t>(per, 1);
      long wrong = 0;
      for (std::size_t i = 0; i < n_out; ++i) {
        double want = 0;
        switch (k) {
          case coll::all_reduce: want = reduce_ref<T>(op, p, i); break;
          case coll::all_gather: want = static_cast<double>(to_t<T>(gen(static_cast<int>(i / blk), i % blk))); break;
          case coll::reduce_scatter: want = reduce_ref<T>(op, p, per * static_cast<std::size_t>(me) + i); break;
          case coll::broadcast: want = static_cast<double>(to_t<T>(gen(b.o_.root, i))); break;
        }
        wrong += !same(got[i], want, k == coll::all_reduce || k == coll::reduce_scatter ? op : reduce_op::sum);
      }
      b.c_.all_reduce(std::span<long>(&wrong, 1), reduce_op::sum);
      return wrong;
    }
  };

  void print_row(const row& r) {
    auto cols = [](const timing& t) {
      char b[96];
      if (!t.valid) std::snprintf(b, sizeof b, " %10s %7s %7s %6s", "N/A", "N/A", "N/A", "N/A");
      else if (t.wrong < 0) std::snprintf(b, sizeof b, " %10.2f %7.2f %7.2f %6s", t.us, t.algbw, t.busbw, "N/A");
      else std::snprintf(b, sizeof b, " %10.2f %7.2f %7.2f %6ld", t.us, t.algbw, t.busbw, t.wrong);
      return std::string(b);
    };
    std::printf("%14zu %14zu %10s %7s %7d%s  %s", r.bytes, r.count, r.type_s.c_str(), r.op_s.c_str(), r.root, cols(r.oop).c_str(),
                cols(r.ip).c_str());
    if (o_.baseline) {
      if (r.base.valid) std::printf("  %10.2f %7.2f %6.3f", r.base.us, r.base.busbw, r.ratio);
      else std::printf("  %10s %7s %6s", "N/A", "N/A", "N/A");
    }
    std::printf("\n");
    std::fflush(stdout);
  }

  C& c_;
  const options& o_;
  Baseline& base_;
};

// Concurrent memcpy of `size` bytes on every thread rank: the bound of a shared-memory collective.
struct memcpy_baseline {
  template <class T>
  bool run(coll, reduce_op, const T* in, T* out, std::size_t, std::size_t count, int) {
    if (count && in) std::memcpy(out, in, count * sizeof(T));
    return true;
  }
  bool is_memcpy() const { return true; }
};

#if LOOM_HAS_MPI
// The raw MPI call on the same buffers, on the same (duplicated) communicator.
struct mpi_baseline {
  MPI_Comm comm;
  template <class T>
  bool run(coll k, reduce_op op, const T* in, T* out, std::size_t per, std::size_t, int root) {
    if constexpr (std::is_same_v<T, loom::half> || std::is_same_v<T, loom::bfloat16>) {
      return false;  // MPI has no 16-bit float reduction: no raw baseline
    } else {
      if (!out) return true;  // availability probe: no call
      const MPI_Datatype t = loom::comm::detail::mpi_datatype(loom::dtype_of<T>);
      const MPI_Op mop = loom::comm::detail::mpi_reduce_op(op);
      int p = 1;
      MPI_Comm_size(comm, &p);
      const int n = static_cast<int>(per);
      switch (k) {
        case coll::all_reduce: LOOM_MPI_CHECK(MPI_Allreduce(in, out, n, t, mop, comm)); break;
        case coll::all_gather: LOOM_MPI_CHECK(MPI_Allgather(in, n, t, out, n, t, comm)); break;
        case coll::reduce_scatter: LOOM_MPI_CHECK(MPI_Reduce_scatter_block(in, out, n, t, mop, comm)); break;
        case coll::broadcast: LOOM_MPI_CHECK(MPI_Bcast(out, n, t, root, comm)); break;
      }
      return true;
    }
  }
  bool is_memcpy() const { return false; }
};
#endif

// -- driver ---------------------------------------------------------------------------------
template <loom::comm::communicator C, class Dev, class Baseline>
std::vector<row> run_all(C& c, const options& o, Baseline& base) {
  bench<C, Dev, Baseline> b(c, o, base);
  std::vector<row> rows;
  for (coll k : o.colls)
    for (loom::dtype t : o.types)
      for (reduce_op op : (k == coll::all_reduce || k == coll::reduce_scatter) ? o.ops : std::vector<reduce_op>{reduce_op::sum})
        loom::comm::visit_dtype(t, [&](auto tag) { b.template run_type<decltype(tag)>(k, op, rows); });
  return rows;
}

void print_header(const options& o, int ranks) {
  std::printf("# loom-bench-collectives: comm %s  ranks %d  minBytes %zu maxBytes %zu step: %g(factor) warmup iters: %d iters: %d validation: %d\n",
              o.comm.c_str(), ranks, o.min_bytes, o.max_bytes, o.factor, o.warmup, o.iters, o.check);
  std::printf("#\n#%66s%36s%s\n", "out-of-place", "in-place", o.baseline ? (o.comm == "thread" ? "                 memcpy" : "                raw MPI") : "");
  std::printf("#%13s %14s %10s %7s %7s %10s %7s %7s %6s  %10s %7s %7s %6s%s\n", "size", "count", "type", "redop", "root", "time",
              "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", o.baseline ? "        time   busbw  ratio" : "");
  std::printf("#%13s %14s %10s %7s %7s %10s %7s %7s %6s  %10s %7s %7s %6s%s\n", "(B)", "(elements)", "", "", "", "(us)", "(GB/s)",
              "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", o.baseline ? "        (us)  (GB/s)" : "");
}

int print_footer_and_json(const options& o, int ranks, const std::vector<row>& rows) {
  long wrong = 0;
  double bw = 0;
  int nbw = 0;
  for (const auto& r : rows) {
    wrong += std::max(0L, r.oop.wrong) + std::max(0L, r.ip.wrong);
    bw += r.oop.busbw;
    ++nbw;
  }
  std::printf("# Out of bounds values : %ld %s\n", wrong, wrong ? "FAILED" : "OK");
  std::printf("# Avg bus bandwidth    : %g \n#\n", nbw ? bw / nbw : 0.0);
  if (!o.json.empty()) {
    std::ofstream js(o.json);
    if (!js) {
      std::fprintf(stderr, "loom-bench-collectives: cannot write --json file '%s'\n", o.json.c_str());
      return 1;
    }
    auto t = [](const timing& x) {
      std::ostringstream os;
      if (!x.valid) return std::string("null");
      os << "{\"time_us\": " << x.us << ", \"algbw\": " << x.algbw << ", \"busbw\": " << x.busbw << ", \"wrong\": " << x.wrong << "}";
      return os.str();
    };
    js << "{\"comm\": \"" << o.comm << "\", \"ranks\": " << ranks << ", \"iters\": " << o.iters << ", \"warmup\": " << o.warmup
       << ", \"avg_busbw\": " << (nbw ? bw / nbw : 0.0) << ", \"wrong\": " << wrong << ", \"rows\": [\n";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      js << "  {\"coll\": \"" << r.coll_s << "\", \"size\": " << r.bytes << ", \"count\": " << r.count << ", \"type\": \"" << r.type_s
         << "\", \"redop\": \"" << r.op_s << "\", \"root\": " << r.root << ", \"out_of_place\": " << t(r.oop) << ", \"in_place\": " << t(r.ip)
         << ", \"baseline\": " << t(r.base) << ", \"ratio\": " << r.ratio
         << ", \"ratio_of_best\": " << (r.base.valid && r.base.busbw > 0 ? r.oop.busbw / r.base.busbw : 0.0)
         << "}" << (i + 1 < rows.size() ? ",\n" : "\n");
    }
    js << "]}\n";
  }
  return wrong ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool help = false;
  options o;
  try {
    o = parse(argc, argv, help);
  } catch (const usage_error& e) {
    std::fprintf(stderr, "loom-bench-collectives: %s\n%s", e.what(), usage_text);
    return 2;
  }
  if (help) {
    std::fputs(usage_text, stdout);
    return 0;
  }
  try {
    if (o.comm == "thread") {
      std::vector<row> rows;
      std::mutex m;
      print_header(o, o.ranks);
      loom::comm::run_ranks(o.ranks, [&](loom::comm::thread_comm& c) {
        memcpy_baseline mb;
        no_baseline nb;
        auto r = o.baseline ? run_all<loom::comm::thread_comm, loom::host>(c, o, mb) : run_all<loom::comm::thread_comm, loom::host>(c, o, nb);
        if (c.rank() == 0) {
          std::lock_guard lk(m);
          rows = std::move(r);
        }
      });
      return print_footer_and_json(o, o.ranks, rows);
    }
#if LOOM_HAS_MPI
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
    int rc = 0;
    {
      loom::comm::mpi_comm world = loom::comm::mpi_comm::world();
      if (world.rank() == 0) print_header(o, world.size());
      std::vector<row> rows;
      if (o.comm == "mpi") {
        mpi_baseline mb{world.native()};
        no_baseline nb;
        rows = o.baseline ? run_all<loom::comm::mpi_comm, loom::host>(world, o, mb) : run_all<loom::comm::mpi_comm, loom::host>(world, o, nb);
      } else {
#if LOOM_HAS_NCCL
        loom::comm::nccl_comm nc(world);
        no_baseline nb;
        rows = run_all<loom::comm::nccl_comm, loom::cuda>(nc, o, nb);
#else
        throw loom::error("--comm nccl: this loom-bench-collectives was built without NCCL");
#endif
      }
      if (world.rank() == 0) rc = print_footer_and_json(o, world.size(), rows);
      world.broadcast(std::span<int>(&rc, 1), 0);
    }
    MPI_Finalize();
    return rc;
#else
    throw loom::error("--comm " + o.comm + ": this loom-bench-collectives was built without MPI");
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom-bench-collectives: %s\n", e.what());
    return 1;
  }
}
