#pragma once
// A test hook: LOOM_FAULT_INJECT=<rank>:<step>:<kind> makes rank <rank> fail at the start of
// training step <step> (0-based), so tests can check that every other rank, and the job,
// ends within the communication timeout instead of hanging (docs/reliability.md, "Fault
// matrix"). Kinds:
//   throw   the rank throws loom::error
//   return  the rank returns from its training function early, as if done
//   stop    the process stops itself (SIGSTOP), as a debugger or a frozen node would
//   kill    the process kills itself (SIGKILL)
// stop and kill act on the whole process: they are meant for mpirun, one rank per process.
// Unset: no fault, and the check costs one comparison per step. A malformed value is a
// loom::error naming LOOM_FAULT_INJECT and the value.
// Why in the library: any training loop over loom::comm is tested against the same fault
// matrix by calling inject_fault once per step (llama-train does); nothing in loom calls it.

#include <loom/core/error.hpp>

#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace loom::comm {

struct fault_plan {
  enum class kind { none, throws, returns, stop, kill };
  int rank = -1;
  std::int64_t step = -1;
  kind what = kind::none;
};

/// Parses "<rank>:<step>:<kind>"; throws naming LOOM_FAULT_INJECT and the value.
inline fault_plan parse_fault_plan(const std::string& v) {
  fault_plan p;
  const auto bad = [&] {
    return loom::error("LOOM_FAULT_INJECT=\"" + v + "\" is not <rank>:<step>:<throw|return|stop|kill> (rank, step >= 0)");
  };
  const auto c1 = v.find(':'), c2 = c1 == std::string::npos ? c1 : v.find(':', c1 + 1);
  if (c2 == std::string::npos) throw bad();
  const auto number = [&](const std::string& s) {
    if (s.empty() || s.size() > 12 || s.find_first_not_of("0123456789") != std::string::npos) throw bad();
    return std::stoll(s);
  };
  p.rank = static_cast<int>(number(v.substr(0, c1)));
  p.step = number(v.substr(c1 + 1, c2 - c1 - 1));
  const std::string k = v.substr(c2 + 1);
  if (k == "throw") p.what = fault_plan::kind::throws;
  else if (k == "return") p.what = fault_plan::kind::returns;
  else if (k == "stop") p.what = fault_plan::kind::stop;
  else if (k == "kill") p.what = fault_plan::kind::kill;
  else throw bad();
  return p;
}

/// The plan of LOOM_FAULT_INJECT (read once); kind::none when unset.
inline const fault_plan& fault_from_env() {
  static const fault_plan plan = [] {
    const char* e = std::getenv("LOOM_FAULT_INJECT");
    return e ? parse_fault_plan(e) : fault_plan{};
  }();
  return plan;
}

/// Call at the start of each step: fails as planned when (rank, step) is the planned one.
/// Returns true when the rank is to return early.
inline bool inject_fault(int rank, std::int64_t step) {
  const fault_plan& p = fault_from_env();
  if (p.what == fault_plan::kind::none || p.rank != rank || p.step != step) return false;
  switch (p.what) {
    case fault_plan::kind::throws:
      throw loom::error("injected fault (LOOM_FAULT_INJECT) on rank " + std::to_string(rank) + " at step " + std::to_string(step));
    case fault_plan::kind::returns: return true;
    case fault_plan::kind::stop: std::raise(SIGSTOP); return false;
    case fault_plan::kind::kill: std::raise(SIGKILL); return false;
    case fault_plan::kind::none: break;
  }
  return false;
}

}  // namespace loom::comm
