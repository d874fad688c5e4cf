// NF4 and double quantisation against (1) closed facts of the format (table values map to
// their codes, each side of every threshold, the dynamic map's shape, the byte formula, the
// error bound of the rounding) and (2) a numpy transcription of bitsandbytes' algorithm
// (bnb_nf4_reference.py, /usr/bin/python3 with torch), element for element and bit for bit:
// codes, absmax, double-quantised absmax, offset, scales, dequantised values.
#include <doctest/doctest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <loom/quant/nf4.hpp>
#include <random>
#include <string>
#include <vector>

namespace {

using loom::index_t;
namespace quant = loom::quant;

float next_up(float x, int ulps = 1) {
  for (int i = 0; i < ulps; ++i) x = std::nextafter(x, std::numeric_limits<float>::infinity());
  return x;
}
float next_down(float x, int ulps = 1) {
  for (int i = 0; i < ulps; ++i) x = std::nextafter(x, -std::numeric_limits<float>::infinity());
  return x;
}

// The float nearest the midpoint of NF4 values k and k + 1 (bitsandbytes' threshold k, up to
// the last bit of its decimal literal).
float nf4_midpoint(int k) {
  return static_cast<float>((double(quant::nf4_values[k]) + double(quant::nf4_values[k + 1])) / 2);
}

// A [rows, 128] weight (two blocks of 64 a row) whose first blocks are the edge cases: zeros,
// all equal (positive, negative), table values and both sides of every threshold at absmax 1,
// negative only, tiny normal and subnormal values, a negative absmax; then rows of equal
// blocks (equal absmax values for the second level), then normal values at varying scales.
std::vector<float> edge_case_weight(index_t rows) {
  const index_t cols = 128;
  std::vector<float> w(static_cast<std::size_t>(rows * cols));
  std::mt19937 gen(1234);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& v : w) v = normal(gen);
  auto block = [&](index_t b) { return w.data() + b * 64; };
  std::fill_n(block(0), 64, 0.f);
  std::fill_n(block(1), 64, 0.3f);
  std::fill_n(block(2), 64, -0.7f);
  float* t = block(3);  // absmax 1: x * (1 / 1) = x, so these sit exactly where written
  int j = 0;
  t[j++] = 1.f;
  for (int k = 0; k < 15; ++k) {
    const float m = nf4_midpoint(k);
    t[j++] = m, t[j++] = next_down(m), t[j++] = next_up(m);
  }
  for (int c = 0; c < 16 && j < 64; ++c) t[j++] = quant::nf4_values[c];
  while (j < 64) t[j++] = -0.f;
  for (int i = 0; i < 64; ++i) block(4)[i] = -std::fabs(normal(gen));
  for (int i = 0; i < 64; ++i) block(5)[i] = 1e-30f * normal(gen);
  for (int i = 0; i < 64; ++i)
    block(6)[i] = i % 5 == 0 ? 0.f : 1e-40f * float(i % 7 - 3);  // subnormal: 1 / absmax overflows
  for (int i = 0; i < 64; ++i) block(7)[i] = 0.01f * normal(gen);
  block(7)[17] = -2.5f;
  for (index_t r = rows / 3; r < rows / 2; ++r) std::fill_n(w.data() + r * cols, cols, 0.25f * float(r % 3 + 1));
  for (index_t r = rows / 2; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) w[static_cast<std::size_t>(r * cols + c)] *= std::exp2(float(r % 9) - 4.f);
  return w;
}

// Input of the 8-bit quantiser: blocks with absmax 1 holding every map entry and both sides of
// the fp32 midpoints of neighbours, a zero block, an all-equal block, tiny values.
std::vector<float> edge_case_v8() {
  const auto& map = quant::dynamic_map;
  std::vector<float> v(map.begin(), map.end());  // block 0: every entry (absmax 1)
  for (int q = 0; q < 255 && v.size() < 512; ++q) {
    const float mid = (map[q] + map[q + 1]) * 0.5f;
    v.push_back(q % 2 ? next_up(mid) : mid);
  }
  v[256] = 1.f;                                                      // block 1: midpoints, absmax 1
  v.resize(768, 0.f);                                                // block 2: zeros
  v.resize(1024, -0.125f);                                           // block 3: all equal
  for (int i = 0; i < 100; ++i) v.push_back(1e-7f * float(i - 50));  // a short last block
  return v;
}

template <class T>
std::vector<T> read_file(const std::filesystem::path& p, std::size_t n) {
  std::vector<T> v(n);
  std::ifstream f(p, std::ios::binary);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)));
  REQUIRE_MESSAGE(f.gcount() == static_cast<std::streamsize>(n * sizeof(T)), "short file ", p.string());
  return v;
}
template <class T>
void write_file(const std::filesystem::path& p, const std::vector<T>& v) {
  std::ofstream(p, std::ios::binary)
      .write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
}
// bit-for-bit, so -0.0 != 0.0 and the first difference is named
void check_same_bits(std::span<const float> got, const std::vector<float>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    REQUIRE_MESSAGE(std::bit_cast<std::uint32_t>(got[i]) == std::bit_cast<std::uint32_t>(want[i]), what, "[", i,
                    "]: ", got[i], " vs ", want[i]);
}
void check_same_bytes(std::span<const std::uint8_t> got, const std::vector<std::uint8_t>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) REQUIRE_MESSAGE(int(got[i]) == int(want[i]), what, "[", i, "]");
}

std::vector<float> dequantized(const quant::nf4_matrix& q) {
  std::vector<float> out(static_cast<std::size_t>(q.rows() * q.cols()));
  q.dequantize(0, q.rows(), 0, q.cols(), out.data(), q.cols());
  return out;
}

}  // namespace

TEST_CASE("nf4_code: each table value is its own code; each threshold splits its two codes") {
  for (int c = 0; c < 16; ++c) CHECK(quant::nf4_code(quant::nf4_values[c]) == c);
  for (int k = 0; k < 15; ++k) {
    const float m = nf4_midpoint(k);
    CHECK(quant::nf4_code(next_down(m, 2)) == k);
    CHECK(quant::nf4_code(next_up(m, 2)) == k + 1);
  }
  CHECK(quant::nf4_code(std::numeric_limits<float>::quiet_NaN()) == 0);  // a zero block's 0 * (1 / 0)
  CHECK(quant::nf4_code(2.f) == 15);
  CHECK(quant::nf4_code(-2.f) == 0);
}

TEST_CASE("nf4 expansion: every instruction set this CPU runs gives the scalar loop's values") {
  std::mt19937 gen(99);
  std::vector<std::uint8_t> q(77);  // not a multiple of any vector width
  for (auto& b : q) b = static_cast<std::uint8_t>(gen());
  float lut[16];
  for (int k = 0; k < 16; ++k) lut[k] = quant::nf4_values[k] * 0.37f;
  std::vector<float> want(2 * q.size()), got(2 * q.size());
  quant::detail::nf4_expand_scalar(q.data(), index_t(q.size()), lut, want.data());
  for (const auto isa : {quant::detail::nf4_isa::avx2, quant::detail::nf4_isa::avx512}) {
    if (isa > quant::detail::nf4_best_isa()) {  // this CPU lacks it: say so, by name
      MESSAGE("skipped: nf4 expansion ", isa == quant::detail::nf4_isa::avx2 ? "avx2" : "avx512", " (this CPU lacks it)");
      continue;
    }
    std::fill(got.begin(), got.end(), -9.f);
    quant::detail::nf4_expand(isa, q.data(), index_t(q.size()), lut, got.data());
    check_same_bits(got, want, isa == quant::detail::nf4_isa::avx2 ? "avx2" : "avx512");
  }
}

TEST_CASE("dynamic map: 256 ascending values in [-1, 1], symmetric, each entry its own code") {
  const auto& map = quant::dynamic_map;
  CHECK(map[127] == 0.f);
  CHECK(map[255] == 1.f);
  for (int q = 0; q < 255; ++q) CHECK(map[q] < map[q + 1]);
  for (int q = 0; q < 127; ++q) CHECK(map[q] == -map[254 - q]);
  for (int q = 0; q < 256; ++q) CHECK(quant::dynamic_code(map.data(), map[q]) == q);
}

TEST_CASE("nf4_matrix: dequantised within half a table gap of the weight (plus the scale's error); zeros stay zeros") {
  const index_t rows = 30;
  const auto w = edge_case_weight(rows);
  float half_gap = 0;
  for (int c = 0; c < 15; ++c) half_gap = std::max(half_gap, (quant::nf4_values[c + 1] - quant::nf4_values[c]) / 2);
  for (const bool dq : {false, true}) {
    quant::nf4_matrix q(loom::make_view(w.data(), rows, 128), {.double_quant = dq});
    const auto d = dequantized(q);
    float spread = 0;  // the second level's absmax: max |absmax - offset|
    for (index_t b = 0; b < rows * 2; ++b)
      spread = std::max(spread, std::fabs(quant::block_absmax({w.data() + b * 64, 64}) - q.absmax_offset()));
    for (index_t b = 0; b < rows * 2; ++b) {
      const float absmax = quant::block_absmax({w.data() + b * 64, 64});
      if (absmax < std::numeric_limits<float>::min()) continue;  // 1 / absmax overflows: bitsandbytes' codes are +-1
      // an 8-bit step of the second level (the map's widest relative gap near 1 is under 1%)
      const float scale_err = std::fabs(q.block_absmax_of(static_cast<std::size_t>(b)) - absmax);
      CHECK(scale_err <= (dq ? 0.01f * spread : 0.f));
      for (int i = 0; i < 64; ++i) {
        const float e = std::fabs(d[b * 64 + i] - w[b * 64 + i]);
        REQUIRE_MESSAGE(e <= absmax * half_gap * 1.0001f + scale_err * 1.0001f, "block ", b, " element ", i, ": error ",
                        e);
      }
    }
    if (!dq)
      for (int i = 0; i < 64; ++i) CHECK(d[i] == 0.f);  // bitsandbytes: code 0 (-1.0) times absmax 0, i.e. -0.0
  }
}

TEST_CASE("nf4_matrix: bytes() is the closed form, and what its memory resource holds") {
  for (const auto& [rows, cols] : {std::pair<index_t, index_t>{4096, 4096}, {300, 128}, {7, 64 * 300}}) {
    for (const bool dq : {false, true}) {
      const quant::nf4_options o{.double_quant = dq};
      std::vector<float> w(static_cast<std::size_t>(rows * cols), 0.5f);
      loom::host_memory_resource mr;
      quant::nf4_matrix q(loom::make_view(w.data(), rows, cols), o, mr);
      CHECK(q.bytes() == quant::nf4_bytes(rows, cols, o));
      CHECK(mr.current_bytes() == q.bytes() - (dq ? sizeof(float) : 0));  // the offset is a member, not allocated
      const double n = double(rows) * double(cols), blocks = n / 64;
      const double per_param = dq ? 0.5 + 1.0 / 64 + 4 * std::ceil(blocks / 256) / n + 4 / n : 0.5 + 4.0 / 64;
      CHECK(double(q.bytes()) / n == doctest::Approx(per_param).epsilon(1e-12));
    }
  }
  CHECK(quant::nf4_bytes(4096, 4096) == 4096 * 4096 / 2 + 4096 * 4096 / 64 * 4);
  CHECK(quant::nf4_bytes(4096, 4096, {.double_quant = true}) == 4096 * 4096 / 2 + 4096 * 4096 / 64 + 1024 * 4 + 4);
  quant::bf16_matrix b(loom::make_view(std::vector<float>(64 * 3, 1.f).data(), 3, 64));
  CHECK(b.bytes() == 64 * 3 * 2);
}

TEST_CASE("nf4_matrix / bf16_matrix packed: a view over the packed bytes, moved anywhere, dequantises as the matrix does") {
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  const index_t rows = 12, cols = 128;
  std::vector<float> w(static_cast<std::size_t>(rows * cols));
  for (float& x : w) x = normal(gen);
  const auto wv = loom::make_view(static_cast<const float*>(w.data()), rows, cols);
  const auto whole = [&](const auto& m) {
    std::vector<float> out(w.size());
    m.dequantize(0, rows, 0, cols, out.data(), cols);
    return out;
  };
  for (const bool dq : {false, true}) {
    CAPTURE(dq);
    const quant::nf4_options o{.block_size = 32, .double_quant = dq, .absmax_block_size = 8};
    const quant::nf4_matrix q(wv, o);
    // one byte in: the packed form carries no alignment
    std::vector<std::uint8_t> packed(quant::nf4_bytes(rows, cols, o) + 1);
    q.pack(std::span<std::uint8_t>(packed).subspan(1));
    const quant::nf4_view v(rows, cols, o, std::span<const std::uint8_t>(packed).subspan(1));
    CHECK(v.bytes() == q.bytes());
    CHECK(whole(v) == whole(q));
    for (std::size_t b = 0; b < static_cast<std::size_t>(rows * cols / 32); ++b) CHECK(v.block_absmax_of(b) == q.block_absmax_of(b));
    CHECK_THROWS_WITH_AS(quant::nf4_view(rows, cols, o, std::span<const std::uint8_t>(packed)),
                         doctest::Contains("packed bytes"), loom::error);
  }
  const quant::bf16_matrix b(wv);
  std::vector<std::uint8_t> packed(b.bytes() + 1);
  b.pack(std::span<std::uint8_t>(packed).subspan(1));
  const std::vector<float> bw = whole(b);
  CHECK(whole(quant::bf16_view(rows, cols, std::span<const std::uint8_t>(packed).subspan(1))) == bw);
  for (std::size_t i = 0; i < w.size(); ++i) CHECK(bw[i] == static_cast<float>(loom::bfloat16(w[i])));
}

TEST_CASE("nf4_matrix: bad input is a loom::error naming it") {
  std::vector<float> w(8 * 96, 0.1f);
  CHECK_THROWS_WITH_AS(quant::nf4_matrix(loom::make_view(w.data(), 8, 96)),
                       doctest::Contains("block_size=64 does not divide the row length cols=96"), loom::error);
  CHECK_THROWS_WITH_AS(quant::nf4_matrix(loom::make_view(w.data(), 8, 96), {.block_size = 3}),
                       doctest::Contains("block_size=3"), loom::error);
  CHECK_THROWS_WITH_AS(quant::nf4_matrix(loom::make_view(w.data(), 0, 96), {.block_size = 32}),
                       doctest::Contains("[0, 96]"), loom::error);
  CHECK_THROWS_WITH_AS(quant::nf4_matrix(loom::make_view(w.data(), 8, 0), {.block_size = 32}),
                       doctest::Contains("[8, 0]"), loom::error);
  w[5 * 96 + 7] = std::numeric_limits<float>::infinity();
  CHECK_THROWS_WITH_AS(quant::nf4_matrix(loom::make_view(w.data(), 8, 96), {.block_size = 32}),
                       doctest::Contains("w[5, 7]=inf"), loom::error);
  w[5 * 96 + 7] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS(quant::bf16_matrix(loom::make_view(w.data(), 8, 96)), doctest::Contains("w[5, 7]=nan"),
                       loom::error);
  w[5 * 96 + 7] = 0.f;
  CHECK_THROWS_WITH_AS(quant::nf4_matrix(loom::make_view(w.data(), 8, 96),
                                         {.block_size = 32, .double_quant = true, .absmax_block_size = 0}),
                       doctest::Contains("absmax_block_size=0"), loom::error);
  quant::nf4_matrix q(loom::make_view(w.data(), 8, 96), {.block_size = 32});
  std::vector<float> out(96);
  CHECK_THROWS_WITH_AS(q.dequantize(0, 1, 16, 96, out.data(), 96), doctest::Contains("cols [16, 96)"), loom::error);
}

#ifdef LOOM_TORCH_PYTHON
TEST_CASE("nf4, double quantisation and the 8-bit map equal the numpy transcription of bitsandbytes") {
  namespace fs = std::filesystem;
  const index_t rows = 300, cols = 128;  // 600 blocks: three second-level blocks, the last partial
  const auto w = edge_case_weight(rows);
  const auto v8 = edge_case_v8();
  const fs::path dir = fs::temp_directory_path() / ("loom_nf4_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  write_file(dir / "w.f32", w);
  write_file(dir / "v8.f32", v8);
  std::ofstream(dir / "params.txt") << rows << ' ' << cols << " 64 256 " << v8.size() << '\n';
  const std::string cmd = LOOM_TORCH_PYTHON " " LOOM_TEST_DIR "/bnb_nf4_reference.py " + dir.string();
  REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, "the oracle failed: ", cmd);
  const std::size_t n = static_cast<std::size_t>(rows * cols), blocks = n / 64;

  check_same_bits(quant::dynamic_map, read_file<float>(dir / "map.f32", 256), "dynamic_map");

  const quant::nf4_matrix plain(loom::make_view(w.data(), rows, cols));
  check_same_bytes(plain.codes(), read_file<std::uint8_t>(dir / "nodq_codes.u8", n / 2), "codes");
  check_same_bits(plain.absmax(), read_file<float>(dir / "nodq_absmax.f32", blocks), "absmax");
  check_same_bits(dequantized(plain), read_file<float>(dir / "nodq_deq.f32", n), "dequantized");

  const quant::nf4_matrix dq(loom::make_view(w.data(), rows, cols), {.double_quant = true});
  check_same_bytes(dq.codes(), read_file<std::uint8_t>(dir / "dq_codes.u8", n / 2), "dq codes");
  check_same_bytes(dq.absmax_codes(), read_file<std::uint8_t>(dir / "dq_qabsmax.u8", blocks), "absmax codes");
  const float offset = dq.absmax_offset();
  check_same_bits(std::span<const float>(&offset, 1), read_file<float>(dir / "dq_offset.f32", 1), "offset");
  check_same_bits(dq.absmax_scales(), read_file<float>(dir / "dq_absmax2.f32", 3), "absmax scales");
  check_same_bits(dequantized(dq), read_file<float>(dir / "dq_deq.f32", n), "dq dequantized");

  std::vector<std::uint8_t> q8(v8.size());
  std::vector<float> a8((v8.size() + 255) / 256);
  quant::quantize_blockwise_8bit(v8, 256, q8, a8);
  check_same_bytes(q8, read_file<std::uint8_t>(dir / "codes8.u8", v8.size()), "8-bit codes");
  check_same_bits(a8, read_file<float>(dir / "absmax8.f32", a8.size()), "8-bit absmax");
  fs::remove_all(dir);
}
#endif
