#pragma once
// Shared by the fuzz targets: the readers under test take a path, so each input is written to
// one scratch file per process (on tmpfs when /dev/shm exists) and the reader opens that.
//
// A target calls the reader inside loom_fuzz_call(): a loom::error is the reader refusing bad
// bytes, which is its job; any other exception escapes and libFuzzer reports it as a crash
// (deadly signal from std::terminate), as it does sanitizer reports, timeouts and -rss_limit_mb.

#include <loom/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace loom_fuzz {

// Never destroyed: the atexit handler that removes the file is registered while the path is
// built, so it runs after a static string's destructor would have freed it.
inline const std::string& scratch_path() {
  static const std::string& path = *[] {
    const char* dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp");
    auto* p = new std::string(std::string(dir) + "/loom-fuzz-" + std::to_string(getpid()) + ".bin");
    std::atexit([] { std::remove(scratch_path().c_str()); });  // a crash leaves it: the input is in the artifact anyway
    return p;
  }();
  return path;
}

/// A scratch folder next to the scratch file (its path + `suffix`) for readers that take a
/// folder: made once per process, `fill(dir)` writes the fixed files the input is read with,
/// removed at exit. Never destroyed, as scratch_path().
template <class Fill>
const std::string& scratch_dir(const char* suffix, Fill fill) {
  static const std::string& dir = *[&] {
    auto* d = new std::string(scratch_path() + suffix);
    std::filesystem::create_directories(*d);
    fill(*d);
    std::atexit([] {  // registered once `dir` is about to be bound (fill did not throw)
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    });
    return d;
  }();
  return dir;
}

/// Writes the input to `path` (a file of the harness's own).
inline void write_file(const std::string& path, const std::uint8_t* data, std::size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || (size && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::perror(path.c_str());
    std::abort();  // the harness cannot work without its scratch file: stop rather than fuzz nothing
  }
}

/// Writes the input to the scratch file and returns its path.
inline const std::string& write_input(const std::uint8_t* data, std::size_t size) {
  const std::string& p = scratch_path();
  write_file(p, data, size);
  return p;
}

/// Traps when the scratch file is still mapped (Linux: /proc/self/maps), looking once every
/// `every` calls (reading the maps costs several executions). For readers that map their file:
/// a mapping left behind by a refused input is a leak no sanitizer reports, and it slows every
/// later truncation of the scratch file.
inline void check_unmapped(unsigned every = 128) {
  static unsigned calls = 0;
  if (++calls % every != 0) return;
  std::FILE* f = std::fopen("/proc/self/maps", "r");
  if (!f) return;
  const std::string& p = scratch_path();
  char line[4096];
  bool mapped = false;
  while (!mapped && std::fgets(line, sizeof line, f)) {
    std::size_t n = std::strlen(line);
    if (n && line[n - 1] == '\n') line[--n] = '\0';
    mapped = n >= p.size() && std::memcmp(line + n - p.size(), p.data(), p.size()) == 0;
  }
  std::fclose(f);
  if (mapped) {
    std::fprintf(stderr, "loom-fuzz: the reader left %s mapped, after this input or one of the %u before it\n", p.c_str(),
                 every - 1);
    __builtin_trap();
  }
}

/// Runs `f`; only loom::error (the documented way to refuse input) is swallowed. With
/// LOOM_FUZZ_VERBOSE set, refusals are printed (to see why a seed is refused: run the target
/// on files instead of a corpus directory).
template <class F>
void call(F&& f) {
  static const bool verbose = std::getenv("LOOM_FUZZ_VERBOSE") != nullptr;
  try {
    f();
    if (verbose) std::fprintf(stderr, "loom-fuzz: accepted\n");
  } catch (const loom::error& e) {
    if (verbose) std::fprintf(stderr, "loom-fuzz: refused: %s\n", e.what());
  }
}

}  // namespace loom_fuzz
