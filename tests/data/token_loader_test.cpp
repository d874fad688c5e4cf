// Token shards and the loader against hand-written files and naive bookkeeping.
#include <loom/data/token_loader.hpp>

#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace {
struct temp_dir {
  fs::path p = fs::temp_directory_path() / ("loom_data_" + std::to_string(::getpid()));
  temp_dir() { fs::create_directories(p); }
  ~temp_dir() { fs::remove_all(p); }
  std::string operator/(const std::string& f) const { return (p / f).string(); }
};
template <class T>
void write_raw(const std::string& path, const std::vector<T>& v, const void* header = nullptr, std::size_t hb = 0) {
  std::ofstream f(path, std::ios::binary);
  if (header) f.write(static_cast<const char*>(header), static_cast<std::streamsize>(hb));
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
}
}  // namespace

TEST_CASE("headerless uint16 and uint32 shards read back the written values") {
  temp_dir d;
  std::vector<std::uint16_t> a(1000);
  std::vector<std::uint32_t> b(777);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<std::uint16_t>((i * 37) % 65535);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::uint32_t>(i * 100003u);
  write_raw(d / "a.bin", a);
  write_raw(d / "b.bin", b);
  loom::data::token_shard sa(d / "a.bin", loom::data::token_width::u16), sb(d / "b.bin", loom::data::token_width::u32);
  CHECK_FALSE(sa.has_header());
  REQUIRE(sa.size() == a.size());
  REQUIRE(sb.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(sa[i] == a[i]);
  for (std::size_t i = 0; i < b.size(); ++i) REQUIRE(sb[i] == b[i]);
  std::vector<std::int32_t> out(10);
  sa.read(990, out, 65536);
  for (int k = 0; k < 10; ++k) CHECK(out[k] == a[990 + k]);
  CHECK_THROWS_WITH_AS(loom::data::token_shard(d / "a.bin"), doctest::Contains("no loom header"), loom::error);
  CHECK_THROWS_WITH_AS(sa.read(995, out, 65536), doctest::Contains("read of [995"), loom::error);
}

TEST_CASE("the documented 64-byte header, written by hand, is read; write_token_shard writes it") {
  temp_dir d;
  unsigned char h[64] = {};
  std::memcpy(h, "LOOMTOK1", 8);
  h[8] = 64;       // header_bytes
  h[12] = 4;       // token_bytes
  h[16] = 5;       // n_tokens
  h[24] = 0x00, h[25] = 0x01;  // vocab_size = 256
  std::vector<std::uint32_t> t{1, 2, 3, 255, 0};
  write_raw(d / "h.bin", t, h, 64);
  loom::data::token_shard s(d / "h.bin", loom::data::token_width::u16);  // the header wins over the hint
  CHECK(s.has_header());
  CHECK(s.width() == loom::data::token_width::u32);
  CHECK(s.vocab_size() == 256);
  REQUIRE(s.size() == 5);
  for (int i = 0; i < 5; ++i) CHECK(s[i] == t[i]);

  loom::data::write_token_shard(d / "w.bin", t, loom::data::token_width::u16, 256);
  std::ifstream f(d / "w.bin", std::ios::binary);
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(f)), {});
  REQUIRE(bytes.size() == 64 + 10);
  CHECK(std::memcmp(bytes.data(), "LOOMTOK1", 8) == 0);
  CHECK(bytes[12] == 2);
  CHECK(bytes[16] == 5);
  CHECK(bytes[64 + 6] == 255);

  // a header that disagrees with the file size is refused
  h[16] = 6;
  write_raw(d / "bad.bin", t, h, 64);
  CHECK_THROWS_WITH_AS(loom::data::token_shard(d / "bad.bin"), doctest::Contains("n_tokens=6"), loom::error);
  CHECK_THROWS_WITH_AS(loom::data::write_token_shard(d / "x.bin", std::vector<std::uint32_t>{70000}, loom::data::token_width::u16),
                       doctest::Contains("token id 70000"), loom::error);
}

TEST_CASE("loader: targets are tokens shifted by one, every window once per epoch, deterministic, resumable") {
  temp_dir d;
  // two shards whose tokens encode their position: shard s token i = s * 2000 + i
  std::vector<std::string> paths;
  std::vector<std::vector<std::uint32_t>> data(2);
  for (int s = 0; s < 2; ++s) {
    data[s].resize(s == 0 ? 1601 : 1305);
    for (std::size_t i = 0; i < data[s].size(); ++i) data[s][i] = static_cast<std::uint32_t>(s * 2000 + i);
    paths.push_back(d / (s == 0 ? "s0.bin" : "s1.bin"));
    loom::data::write_token_shard(paths.back(), data[s], s == 0 ? loom::data::token_width::u16 : loom::data::token_width::u32, 4000);
  }
  const std::size_t S = 16;
  // naive count: (n - 1) / S windows per shard
  const std::size_t windows = (1601 - 1) / S + (1305 - 1) / S;
  loom::data::loader_options o{.seq_len = S, .batch = 4, .vocab_size = 4000, .seed = 7};
  loom::data::token_loader L(loom::data::open_shards(paths), o);
  REQUIRE(L.windows() == windows);
  CHECK(L.batches_per_epoch() == windows / 4);

  std::multiset<std::vector<std::int32_t>> seen;
  loom::data::token_batch b;
  std::vector<std::vector<std::int32_t>> first_epoch;
  for (std::size_t k = 0; k < L.batches_per_epoch(); ++k) {
    L.next(b);
    for (std::size_t r = 0; r < 4; ++r) {
      std::vector<std::int32_t> row(b.tokens.begin() + r * S, b.tokens.begin() + (r + 1) * S);
      for (std::size_t j = 0; j + 1 < S; ++j) REQUIRE(b.targets[r * S + j] == b.tokens[r * S + j + 1]);
      // the row is a window of one shard: consecutive positions
      first_epoch.push_back(row);
      seen.insert(row);
    }
  }
  CHECK(seen.size() == L.batches_per_epoch() * 4);
  std::set<std::vector<std::int32_t>> distinct(seen.begin(), seen.end());
  CHECK(distinct.size() == seen.size());  // no window twice
  CHECK(L.state().epoch == 1);
  CHECK(L.state().batch_in_epoch == 0);

  // the same seed gives the same order; the next epoch a different one
  loom::data::token_loader L2(loom::data::open_shards(paths), o);
  L2.next(b);
  CHECK(std::vector<std::int32_t>(b.tokens.begin(), b.tokens.begin() + S) == first_epoch[0]);
  L.next(b);
  CHECK(std::vector<std::int32_t>(b.tokens.begin(), b.tokens.begin() + S) != first_epoch[0]);

  // resume: a loader set to (epoch 0, batch 5) reads what the 6th batch was
  loom::data::token_loader L3(loom::data::open_shards(paths), o);
  L3.set_state({0, 5});
  L3.next(b);
  CHECK(std::vector<std::int32_t>(b.tokens.begin(), b.tokens.begin() + S) == first_epoch[5 * 4]);
}

TEST_CASE("ranks: disjoint samples, and their union is the one-rank batch of size batch*world") {
  temp_dir d;
  std::vector<std::uint32_t> t(4001);
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::uint32_t>(i % 60000);
  loom::data::write_token_shard(d / "t.bin", t, loom::data::token_width::u16, 60000);
  const std::size_t S = 8;
  loom::data::token_loader one(loom::data::open_shards({d / "t.bin"}), {.seq_len = S, .batch = 6, .vocab_size = 60000, .seed = 3});
  std::vector<loom::data::token_loader> ranks;
  for (int r = 0; r < 3; ++r)
    ranks.emplace_back(loom::data::open_shards({d / "t.bin"}),
                       loom::data::loader_options{.seq_len = S, .batch = 2, .vocab_size = 60000, .seed = 3, .rank = r, .world = 3});
  CHECK(ranks[0].batches_per_epoch() == one.batches_per_epoch());
  loom::data::token_batch b;
  for (int step = 0; step < 10; ++step) {
    one.next(b);
    std::multiset<std::int32_t> want, got;
    for (std::size_t r = 0; r < 6; ++r) want.insert(b.tokens[r * S]);  // a window's first token identifies it here
    for (auto& L : ranks) {
      L.next(b);
      for (std::size_t r = 0; r < 2; ++r) got.insert(b.tokens[r * S]);
    }
    REQUIRE(want == got);
  }
}

TEST_CASE("errors: empty dataset, token id >= vocab") {
  temp_dir d;
  CHECK_THROWS_WITH_AS(loom::data::token_loader({}, {.vocab_size = 10}), doctest::Contains("empty dataset"), loom::error);
  loom::data::write_token_shard(d / "short.bin", std::vector<std::uint32_t>{1, 2, 3}, loom::data::token_width::u16, 10);
  CHECK_THROWS_WITH_AS(loom::data::token_loader(loom::data::open_shards({d / "short.bin"}), {.seq_len = 8, .vocab_size = 10}),
                       doctest::Contains("empty dataset"), loom::error);
  std::vector<std::uint32_t> t(100, 5);
  t[42] = 300;
  loom::data::write_token_shard(d / "big.bin", t, loom::data::token_width::u16, 0);
  loom::data::token_loader L(loom::data::open_shards({d / "big.bin"}), {.seq_len = 9, .batch = 11, .vocab_size = 256, .shuffle = false});
  loom::data::token_batch b;
  CHECK_THROWS_WITH_AS(L.next(b), doctest::Contains("token id 300 >= vocab_size 256"), loom::error);
  CHECK_THROWS_WITH_AS(loom::data::token_loader(loom::data::open_shards({d / "short.bin"}), {.seq_len = 1, .vocab_size = 5}),
                       doctest::Contains("vocab_size=10"), loom::error);
  CHECK_THROWS_WITH_AS(loom::data::token_shard(d / "missing.bin"), doctest::Contains("missing.bin"), loom::error);
}

TEST_CASE("hostile shards: sizes that are no multiple of the token, headers that lie, ids beyond the header's vocabulary") {
  temp_dir d;
  using loom::data::token_shard, loom::data::token_width;
  auto header = [](std::uint32_t header_bytes, std::uint32_t token_bytes, std::uint64_t n_tokens, std::uint32_t vocab) {
    loom::data::shard_header h{};
    std::memcpy(h.magic, loom::data::shard_magic, 8);
    h.header_bytes = header_bytes, h.token_bytes = token_bytes, h.n_tokens = n_tokens, h.vocab_size = vocab;
    return h;
  };
  const std::vector<std::uint16_t> three{1, 2, 3};  // 6 bytes
  write_raw(d / "odd.bin", std::vector<std::uint8_t>(10, 1));
  CHECK_THROWS_WITH_AS(token_shard(d / "odd.bin", token_width::u32), doctest::Contains("odd.bin' has 10 bytes, not a multiple of the token width 4"),
                       loom::error);
  auto h = header(64, 4, 1, 0);
  write_raw(d / "odd_h.bin", three, &h, 64);  // 6 bytes of 4-byte tokens
  CHECK_THROWS_WITH_AS(token_shard(d / "odd_h.bin"), doctest::Contains("holds 6 bytes of tokens of 4 bytes"), loom::error);
  h = header(64, 2, ~std::uint64_t{0}, 0);
  write_raw(d / "lie.bin", three, &h, 64);
  CHECK_THROWS_WITH_AS(token_shard(d / "lie.bin"), doctest::Contains("n_tokens=18446744073709551615 but the file holds 6 bytes"), loom::error);
  h = header(128, 2, 3, 0);
  write_raw(d / "hb.bin", three, &h, 64);
  CHECK_THROWS_WITH_AS(token_shard(d / "hb.bin"), doctest::Contains("header_bytes=128"), loom::error);
  h = header(64, 3, 2, 0);
  write_raw(d / "tb.bin", three, &h, 64);
  CHECK_THROWS_WITH_AS(token_shard(d / "tb.bin"), doctest::Contains("token_bytes=3"), loom::error);
  h = header(64, 2, 3, 0);
  h.reserved[12] = 7;
  write_raw(d / "res.bin", three, &h, 64);
  CHECK_THROWS_WITH_AS(token_shard(d / "res.bin"), doctest::Contains("reserved header byte 40 is 7"), loom::error);
  h = header(64, 2, 3, 0x80000000u);
  write_raw(d / "v.bin", three, &h, 64);
  CHECK_THROWS_WITH_AS(token_shard(d / "v.bin"), doctest::Contains("vocab_size=2147483648 does not fit"), loom::error);
  write_raw(d / "magic.bin", std::vector<std::uint8_t>(20, 0), loom::data::shard_magic, 8);
  CHECK_THROWS_WITH_AS(token_shard(d / "magic.bin"), doctest::Contains("has a loom magic but only 28 bytes"), loom::error);
  CHECK_THROWS_WITH_AS(token_shard(d.p.string(), token_width::u16), doctest::Contains("is not a regular file"), loom::error);
  REQUIRE(::mkfifo((d / "fifo").c_str(), 0600) == 0);  // opening it used to wait for a writer
  CHECK_THROWS_WITH_AS(token_shard(d / "fifo", token_width::u16), doctest::Contains("is not a regular file"), loom::error);

  // ids beyond the header's own vocabulary are refused even when the model's is larger
  std::vector<std::uint32_t> t(20, 5);
  t[13] = 150;
  loom::data::write_token_shard(d / "hv.bin", t, token_width::u16, 100);
  token_shard s(d / "hv.bin");
  std::vector<std::int32_t> out(20);
  CHECK_THROWS_WITH_AS(s.read(0, out, 256), doctest::Contains("token id 150 >= vocab_size 100 (the shard header's) at token 13"), loom::error);
  CHECK_NOTHROW(s.read(0, std::span(out).first(13), 256));
  CHECK(out[12] == 5);
  CHECK_THROWS_WITH_AS(s.read(0, out, 0x80000000u), doctest::Contains("vocab_size=2147483648 does not fit"), loom::error);
  CHECK_THROWS_WITH_AS(loom::data::token_loader(loom::data::open_shards({d / "hv.bin"}), {.seq_len = 4, .vocab_size = 0x80000000u}),
                       doctest::Contains("vocab_size=2147483648"), loom::error);
}

// Lines of /proc/self/maps that map `path` (Linux): the kernel's own record of what is mapped.
static int mappings_of(const std::string& path) {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);)
    n += line.size() >= path.size() && line.compare(line.size() - path.size(), path.size(), path) == 0;
  return n;
}

TEST_CASE("a refused shard leaves no mapping behind; an open shard holds one until destroyed") {
  if (!fs::exists("/proc/self/maps")) return;  // Linux only: nothing to look at elsewhere
  temp_dir d;
  using loom::data::token_shard, loom::data::token_width;
  const std::string path = fs::canonical(d.p).string() + "/refused.bin";
  loom::data::shard_header h{};
  std::memcpy(h.magic, loom::data::shard_magic, 8);
  h.header_bytes = 64, h.token_bytes = 2, h.n_tokens = 4;  // the file holds 3 tokens
  write_raw(path, std::vector<std::uint16_t>{1, 2, 3}, &h, 64);
  for (int i = 0; i < 3; ++i) CHECK_THROWS_WITH_AS(token_shard{path}, doctest::Contains("n_tokens=4"), loom::error);
  write_raw(path, std::vector<std::uint8_t>(7, 1));  // headerless, not a multiple of 2
  CHECK_THROWS_WITH_AS(token_shard(path, token_width::u16), doctest::Contains("has 7 bytes"), loom::error);
  CHECK(mappings_of(path) == 0);
  write_raw(path, std::vector<std::uint16_t>{1, 2, 3, 4});
  {
    const token_shard s(path, token_width::u16);
    CHECK(s.size() == 4);
    CHECK(mappings_of(path) == 1);  // the check sees a live mapping
  }
  CHECK(mappings_of(path) == 0);
}
