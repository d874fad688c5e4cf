// loom::cpu's answers against the kernel's own account of this CPU: the flags line of
// /proc/cpuinfo (Linux), an independent reading of the same CPUID bits.
#include <loom/core/cpu.hpp>

#include <doctest/doctest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

namespace {
// The first processor's flags, or an empty set where /proc/cpuinfo has none.
std::set<std::string> cpuinfo_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> flags;
    for (std::string w; words >> w;) flags.insert(w);
    return flags;
  }
  return {};
}
}  // namespace

TEST_CASE("cpu: the features loom's kernels ask for are those /proc/cpuinfo lists") {
  const auto flags = cpuinfo_flags();
  if (flags.empty()) {
    MESSAGE("skipped: no flags line in /proc/cpuinfo to compare with");
    return;
  }
  const bool x86 = LOOM_CPU_X86 != 0;
  CHECK(loom::cpu::has_avx512f() == (x86 && flags.count("avx512f") == 1));
  CHECK(loom::cpu::has_avx2_fma() == (x86 && flags.count("avx2") == 1 && flags.count("fma") == 1));
  MESSAGE("this CPU: avx2+fma ", loom::cpu::has_avx2_fma(), ", avx512f ", loom::cpu::has_avx512f());
}
