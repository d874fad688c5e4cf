// loom-make-corpus: writes the examples' generated corpus as token shards (see synthetic_corpus.hpp).
//   loom-make-corpus <out_prefix> [--bytes N] [--seed S] [--text]
// writes <out_prefix>.train.bin (first 90%) and <out_prefix>.val.bin (last 10%); --text also
// writes <out_prefix>.txt.
#include "synthetic_corpus.hpp"

#include <common/cli.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string>

int main(int argc, char** argv) {
  const char* usage = "usage: loom-make-corpus <out_prefix> [--bytes N] [--seed S] [--text]\n";
  try {
    std::string prefix;
    std::size_t bytes = 1 << 20;
    std::uint64_t seed = 2024;
    bool text = false;
    using examples::cli::number;
    const bool run = examples::cli::parse(argc, argv, [&](const std::string& a, const auto& value) {
      if (a == "--bytes") bytes = number<std::size_t>(a, value());
      else if (a == "--seed") seed = number<std::uint64_t>(a, value());
      else if (a == "--text") text = true;
      else if (!a.empty() && a[0] != '-' && prefix.empty()) prefix = a;
      else return false;
      return true;
    });
    if (!run) {
      std::fputs(usage, stdout);
      return 0;
    }
    if (prefix.empty()) throw examples::cli::bad_args("give the output prefix");
    if (bytes < 100) throw examples::cli::bad_args("--bytes must be >= 100, got " + std::to_string(bytes));
    const std::string s = examples::synthetic_corpus(bytes, seed);
    const std::size_t cut = s.size() / 10 * 9;
    examples::write_corpus_shard(prefix + ".train.bin", std::string_view(s).substr(0, cut));
    examples::write_corpus_shard(prefix + ".val.bin", std::string_view(s).substr(cut));
    if (text) std::ofstream(prefix + ".txt") << s;
    std::printf("wrote %s.train.bin (%zu tokens) and %s.val.bin (%zu tokens)\n", prefix.c_str(), cut, prefix.c_str(), s.size() - cut);
  } catch (const examples::cli::bad_args& e) {
    std::fprintf(stderr, "loom-make-corpus: %s\n%s", e.what(), usage);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom-make-corpus: %s\n", e.what());
    return 1;
  }
}
