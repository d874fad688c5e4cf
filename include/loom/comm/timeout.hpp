#pragma once
// The communication timeout: how long a rank waits for its peers before it gives up.
//
// Why it is on by default, in every build: a rank that threw, returned early, was stopped or
// is stuck elsewhere otherwise leaves every other rank waiting forever, and a job that hangs
// costs more than one that fails. So every wait of every communicator (collective, send,
// recv, the agreement of checked mode) is bounded by the same deadline, whether checked mode
// is on or not. When it passes, the waiting rank throws loom::error naming the operation,
// itself, the rank(s) it waited for where that is knowable, the timeout and how to change
// it; the communicator is broken afterwards (a timed-out collective leaves the group in an
// unknown state).
//
// The default, 300 s, is longer than any single collective of a healthy job (a first NCCL
// call with its connection set-up, a checkpoint gather) yet short enough that a failed job
// ends within minutes. LOOM_COMM_TIMEOUT=<seconds> (read once, at the first use) or
// set_timeout changes it; 0 waits forever. A value that is not a number >= 0 is an error
// naming LOOM_COMM_TIMEOUT and the value, never silently the default.
//
// poll_until is the shared wait loop: test and spin first (a collective that completes
// within microseconds keeps its latency), then sleep with growing backoff (a rank waiting
// seconds for a slow peer does not burn the core the peer may need).

#include <loom/core/error.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>

namespace loom::comm {

/// The default timeout when LOOM_COMM_TIMEOUT is not set.
inline constexpr std::chrono::milliseconds default_timeout{std::chrono::seconds(300)};

namespace detail {

/// Milliseconds from a LOOM_COMM_TIMEOUT value in seconds ("300", "1.5", "0"); throws
/// naming the variable and the value for anything else.
inline std::int64_t parse_timeout_seconds(const char* text) {
  const std::string s = text ? text : "";
  char* end = nullptr;
  const double v = s.empty() ? -1.0 : std::strtod(s.c_str(), &end);
  const bool whole = !s.empty() && end && *end == '\0';
  LOOM_CHECK(whole && std::isfinite(v) && v >= 0 && v <= 1e9, "LOOM_COMM_TIMEOUT=\"", s,
             "\" is not a number of seconds >= 0 (0 waits forever; unset: ", default_timeout.count() / 1000, " s)");
  return static_cast<std::int64_t>(std::llround(v * 1000.0));
}

inline std::atomic<std::int64_t>& timeout_ms_value() {
  // A bad value throws here, and again at every later use: initialisation of a static that
  // threw is retried.
  static std::atomic<std::int64_t> ms{[] {
    const char* e = std::getenv("LOOM_COMM_TIMEOUT");
    return e ? parse_timeout_seconds(e) : std::int64_t{default_timeout.count()};
  }()};
  return ms;
}

}  // namespace detail

/// How long any wait for the other ranks lasts before it throws; zero means forever.
inline std::chrono::milliseconds timeout() {
  return std::chrono::milliseconds(detail::timeout_ms_value().load(std::memory_order_relaxed));
}

/// Sets the timeout for the process (every communicator); zero waits forever.
inline void set_timeout(std::chrono::milliseconds t) {
  LOOM_CHECK(t.count() >= 0, "set_timeout: timeout must be >= 0 ms, got ", t.count());
  detail::timeout_ms_value().store(t.count(), std::memory_order_relaxed);
}

/// The end of a sentence about a timeout: its value and how to change it.
inline std::string timeout_hint(std::chrono::milliseconds t) {
  std::ostringstream os;
  os << "(timeout " << t.count() << " ms; LOOM_COMM_TIMEOUT=<seconds> or loom::comm::set_timeout changes it, 0 waits forever)";
  return os.str();
}

namespace detail {

/// Calls `done()` until it returns true or `limit` passes (limit > 0); returns whether it
/// completed. Spins for the first 10 ms, as MPI's own blocking wait does (a yield would hand
/// the core to any other process for a whole time slice): MPI progresses a peer's message only while some call of this rank
/// runs, so a sleeping waiter would delay every step of a collective by its nap. Then sleeps
/// 10 us doubling up to 1 ms, so a rank waiting seconds for a slow peer leaves the core free.
template <class Done>
bool poll_until(std::chrono::milliseconds limit, Done done) {
  if (done()) return true;
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto deadline = start + limit;
  const auto spin_until = start + std::chrono::milliseconds(10);
  auto nap = std::chrono::microseconds(10);
  for (;;) {
    if (done()) return true;
    const auto now = clock::now();
    if (now >= deadline) return false;
    if (now >= spin_until) {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }
}

}  // namespace detail

}  // namespace loom::comm
