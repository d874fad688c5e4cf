// The fault matrix on thread ranks (docs/reliability.md, "Fault matrix"): on 4 ranks, rank 1
// throws, returns early, or is stopped (sleeps past the timeout) — while the others wait
// inside a collective, between two collectives, or in a pipeline chain of send/recv — and
// every other rank must end with loom::error naming rank 1 and the operation it waited in,
// within the timeout. Checked mode is off: the timeout must bound the waits on its own.
// Prints one line per case with the slowest survivor's detection time (the figures of the
// docs).
#include <loom/comm/fault_inject.hpp>
#include <loom/comm/thread_comm.hpp>

#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using loom::comm::reduce_op;
using loom::comm::run_ranks;
using loom::comm::thread_comm;
using clock_type = std::chrono::steady_clock;

namespace {

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

enum class fault { throws, returns, stopped };
enum class where { collective, between, pipeline };
constexpr const char* fault_name[] = {"throws", "returns", "stopped"};
constexpr const char* where_name[] = {"inside all_reduce", "between collectives", "pipeline send/recv"};

constexpr int bad = 1;  // the failing rank
constexpr auto limit = std::chrono::milliseconds(1000);

struct outcome {
  bool threw = false;
  std::string message;
  double seconds = 0;  // from the fault to the rank's error
};

/// Runs one cell of the matrix; returns what each rank saw.
std::array<outcome, 4> run_case(fault f, where w) {
  std::array<outcome, 4> seen{};
  std::atomic<std::int64_t> fault_at{0};  // clock ticks of the fault
  const auto stamp = [&] { fault_at = clock_type::now().time_since_epoch().count(); };
  // The failing rank's fault; true: return from the rank's function.
  const auto fail = [&]() -> bool {
    stamp();
    if (f == fault::throws) throw std::runtime_error("injected fault");
    if (f == fault::returns) return true;
    std::this_thread::sleep_for(limit * 5 / 2);  // stopped: resumes well after the others gave up
    return false;
  };
  std::vector<float> v0(8), v1(8), v2(8), v3(8);
  std::array<std::vector<float>*, 4> buf{&v0, &v1, &v2, &v3};
  try {
    run_ranks(4, [&](thread_comm& c) {
      const int r = c.rank();
      auto& v = *buf[static_cast<std::size_t>(r)];
      try {
        c.all_reduce(std::span<float>(v));  // every rank present
        if (w == where::collective) {
          // the others are waiting inside the all_reduce when rank 1 fails
          if (r == bad) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            if (fail()) return;
          }
          c.all_reduce(std::span<float>(v));
        } else if (w == where::between) {
          // rank 1 fails between two collectives, before the others enter the second
          if (r == bad && fail()) return;
          if (r != bad) std::this_thread::sleep_for(std::chrono::milliseconds(100));
          c.barrier();
        } else {
          // a pipeline: activations flow 0 -> 1 -> 2 -> 3; rank 1 fails instead of sending
          if (r > 0) c.recv(std::span<float>(v), r - 1, 7);
          if (r == bad && fail()) return;
          if (r < 3) c.send(std::span<const float>(v), r + 1, 7);
          c.barrier();
        }
      } catch (const loom::error& e) {
        const auto now = clock_type::now().time_since_epoch().count();
        seen[static_cast<std::size_t>(r)] = {true, e.what(), std::chrono::duration<double>(clock_type::duration(now - fault_at.load())).count()};
        throw;
      }
    });
  } catch (const std::exception&) {
  }
  return seen;
}

}  // namespace

TEST_CASE("fault matrix on thread ranks: every survivor ends with loom::error naming rank 1 and its operation, within the timeout") {
  loom::comm::checked_scope scope(false, limit);
  for (const fault f : {fault::throws, fault::returns, fault::stopped})
    for (const where w : {where::collective, where::between, where::pipeline}) {
      CAPTURE(fault_name[static_cast<int>(f)]);
      CAPTURE(where_name[static_cast<int>(w)]);
      const auto seen = run_case(f, w);
      double slowest = 0;
      for (int r = 0; r < 4; ++r) {
        if (r == bad) continue;
        const auto& o = seen[static_cast<std::size_t>(r)];
        CAPTURE(r);
        CAPTURE(o.message);
        REQUIRE(o.threw);
        slowest = std::max(slowest, o.seconds);
        // the failing rank is named: its own failure, its return, or the ranks that did not arrive
        if (f == fault::throws) CHECK(contains(o.message, "rank 1 failed: injected fault"));
        if (f == fault::returns) CHECK(contains(o.message, "rank 1 of the group returned from its function"));
        if (f == fault::stopped) {
          CHECK(contains(o.message, "timed out after 1000 ms"));
          // rank 1 is among the ranks waited for ([1], or [1, 2, 3] from rank 0's barrier), or
          // the rank waited for is itself waiting for rank 1 (rank 3 waits for rank 2)
          CHECK((contains(o.message, "waiting for rank(s) [1") || contains(o.message, "waits in recv(count=8, float32) from rank 1")));
          if (contains(o.message, "rank(s) [1")) CHECK(contains(o.message, "rank 1 is in no wait of thread_comm"));  // it sleeps
          CHECK(contains(o.message, "LOOM_COMM_TIMEOUT=<seconds>"));
          CHECK(o.seconds >= 0.5);  // the timeout, not something sooner, ended the wait
        } else {
          CHECK(!contains(o.message, "timed out"));  // found out at once, not by the timeout
        }
        CHECK(o.seconds < 1.0 + 5.0);  // within the timeout (and slack for a loaded CI machine)
        // the operation this rank waited in is named
        if (w == where::collective) CHECK(contains(o.message, "all_reduce(count=8, float32, sum)"));
        if (w == where::between) CHECK(contains(o.message, "barrier()"));
        if (w == where::pipeline && r == 2) CHECK(contains(o.message, "recv(count=8, float32) from rank 1 with tag 7"));
      }
      std::printf("fault matrix (thread ranks): rank 1 %s %s: slowest survivor's error after %.3f s\n", fault_name[static_cast<int>(f)],
                  where_name[static_cast<int>(w)], slowest);
    }
}

TEST_CASE("timeout: on by default, LOOM_COMM_TIMEOUT parsed strictly") {
  using loom::comm::detail::parse_timeout_seconds;
  CHECK(loom::comm::default_timeout == std::chrono::seconds(300));
  if (!std::getenv("LOOM_COMM_TIMEOUT")) CHECK(loom::comm::timeout() == loom::comm::default_timeout);
  CHECK(parse_timeout_seconds("300") == 300000);
  CHECK(parse_timeout_seconds("1.5") == 1500);
  CHECK(parse_timeout_seconds("0") == 0);
  for (const char* bad_value : {"", "abc", "-1", "5s", "nan", "inf"}) {
    CAPTURE(bad_value);
    const std::string want = "LOOM_COMM_TIMEOUT=\"" + std::string(bad_value) + "\"";
    CHECK_THROWS_WITH_AS(parse_timeout_seconds(bad_value), doctest::Contains(want.c_str()), loom::error);
  }
  CHECK_THROWS_WITH_AS(loom::comm::set_timeout(std::chrono::milliseconds(-5)), doctest::Contains("got -5"), loom::error);
}

TEST_CASE("fault injection: LOOM_FAULT_INJECT parsed strictly, naming the variable and the value") {
  using loom::comm::fault_plan;
  using loom::comm::parse_fault_plan;
  const fault_plan p = parse_fault_plan("3:17:return");
  CHECK((p.rank == 3 && p.step == 17 && p.what == fault_plan::kind::returns));
  CHECK(parse_fault_plan("0:0:throw").what == fault_plan::kind::throws);
  CHECK(parse_fault_plan("1:2:stop").what == fault_plan::kind::stop);
  CHECK(parse_fault_plan("1:2:kill").what == fault_plan::kind::kill);
  for (const char* bad_value : {"", "1", "1:2", "1:2:", "1:x:throw", "-1:2:throw", "1:2:explode", "1:1234567890123:throw"}) {
    CAPTURE(bad_value);
    const std::string want = "LOOM_FAULT_INJECT=\"" + std::string(bad_value) + "\" is not <rank>:<step>";
    CHECK_THROWS_WITH_AS(parse_fault_plan(bad_value), doctest::Contains(want.c_str()), loom::error);
  }
  // unset (as in this test), no rank fails
  if (!std::getenv("LOOM_FAULT_INJECT")) CHECK_FALSE(loom::comm::inject_fault(0, 0));
}
