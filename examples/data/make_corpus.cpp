// loom-make-corpus: writes the examples' generated corpus as token shards (see synthetic_corpus.hpp).
//   loom-make-corpus <out_prefix> [--bytes N] [--seed S] [--text]
// writes <out_prefix>.train.bin (first 90%) and <out_prefix>.val.bin (last 10%); --text also
// writes <out_prefix>.txt.
#include "synthetic_corpus.hpp"

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
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::fputs(usage, stdout);
        return 0;
      } else if (a == "--bytes" && i + 1 < argc) {
        bytes = std::stoull(argv[++i]);
      } else if (a == "--seed" && i + 1 < argc) {
        seed = std::stoull(argv[++i]);
      } else if (a == "--text") {
        text = true;
      } else if (!a.empty() && a[0] != '-' && prefix.empty()) {
        prefix = a;
      } else {
        std::fprintf(stderr, "loom-make-corpus: unknown argument '%s'\n%s", a.c_str(), usage);
        return 2;
      }
    }
    if (prefix.empty() || bytes < 100) {
      std::fputs(usage, stderr);
      return 2;
    }
    const std::string s = examples::synthetic_corpus(bytes, seed);
    const std::size_t cut = s.size() / 10 * 9;
    examples::write_corpus_shard(prefix + ".train.bin", std::string_view(s).substr(0, cut));
    examples::write_corpus_shard(prefix + ".val.bin", std::string_view(s).substr(cut));
    if (text) std::ofstream(prefix + ".txt") << s;
    std::printf("wrote %s.train.bin (%zu tokens) and %s.val.bin (%zu tokens)\n", prefix.c_str(), cut, prefix.c_str(), s.size() - cut);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom-make-corpus: %s\n", e.what());
    return 1;
  }
}
