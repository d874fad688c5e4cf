// Hostile and broken weight files, written byte by byte in the test: llama2.c checkpoints,
// llama2.c tokenizers and safetensors. Each must be a loom::error whose message names the
// file and the field or tensor at fault, found before any allocation the file's claims size;
// never a crash, an over-read or an unbounded message.
#include <doctest/doctest.h>

#include <loom/io/llama2c.hpp>
#include <loom/io/safetensors.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

using namespace loom::io;

namespace {

/// Little-endian bytes of a file under construction.
struct bytes {
  std::string b;
  template <class T>
  bytes& put(T v) {
    char c[sizeof(T)];
    std::memcpy(c, &v, sizeof(T));
    b.append(c, sizeof(T));
    return *this;
  }
  bytes& raw(const std::string& s) {
    b += s;
    return *this;
  }
  bytes& pad_to(std::size_t n) {
    b.resize(n, '\0');
    return *this;
  }
};

struct temp_dir {
  std::filesystem::path dir = std::filesystem::temp_directory_path() / ("loom_hostile_" + std::to_string(::getpid()));
  temp_dir() { std::filesystem::create_directories(dir); }
  ~temp_dir() { std::filesystem::remove_all(dir); }
  std::string write(const std::string& name, const std::string& b) const {
    const auto p = (dir / name).string();
    std::ofstream(p, std::ios::binary).write(b.data(), static_cast<std::streamsize>(b.size()));
    return p;
  }
};

/// The message of the loom::error that `f` throws ("" if it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const loom::error& e) {
    return e.what();
  }
  return "";
}

#define CHECK_ERROR_HAS(expr, ...)                                 \
  do {                                                              \
    const std::string msg_ = error_of([&] { (void)(expr); });       \
    CAPTURE(msg_);                                                  \
    CHECK(!msg_.empty());                                           \
    for (const char* part : {__VA_ARGS__}) CHECK(msg_.find(part) != std::string::npos); \
  } while (0)

struct dims {
  std::int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
};

/// A version-1 header (256 bytes) with these fields.
bytes v1_header(dims d, bool shared = true) {
  bytes h;
  h.put(llama2c_magic).put(std::int32_t{1});
  for (auto f : {d.dim, d.hidden_dim, d.n_layers, d.n_heads, d.n_kv_heads, d.vocab_size, d.seq_len}) h.put(f);
  h.put(static_cast<std::uint8_t>(shared)).pad_to(256);
  return h;
}
bytes legacy_header(dims d) {
  bytes h;
  for (auto f : {d.dim, d.hidden_dim, d.n_layers, d.n_heads, d.n_kv_heads, d.vocab_size, d.seq_len}) h.put(f);
  return h;
}
/// n floats 0, 1, 2, ...
bytes& counting_floats(bytes& b, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) b.put(static_cast<float>(i));
  return b;
}

}  // namespace

TEST_CASE("llama2.c: a small file read exactly; short, long, negative and huge headers refused by field") {
  temp_dir t;
  // dim 4, hidden 6, 2 layers, 2 heads (head_dim 2), 1 kv head (KD 2), vocab 5, seq_len 3
  const dims d{4, 6, 2, 2, 1, 5, 3};
  const std::size_t per_layer = 2 * 4 + 2 * 16 + 2 * 2 * 4 + 3 * 6 * 4, v1_floats = 2 * per_layer + 4 + 5 * 4;
  {
    bytes b = v1_header(d);
    const auto p = t.write("ok_v1.bin", counting_floats(b, v1_floats).b);
    auto ck = read_llama2c(p);
    CHECK(ck.config.n_kv_heads == 1);
    // version 1 order: attention_norm (all layers), ffn_norm (all layers), norm, tok_embeddings, ...
    CHECK(ck.tensors.at("layers.1.attention_norm.weight").data[0] == 4.f);
    CHECK(ck.tensors.at("norm.weight").data[0] == 16.f);
    CHECK(ck.tensors.at("tok_embeddings.weight").data[0] == 20.f);
    CHECK(ck.tensors.at("layers.0.attention.wk.weight").shape == std::vector<std::int64_t>{2, 4});
    CHECK(ck.tensors.at("layers.1.feed_forward.w3.weight").data[23] == static_cast<float>(v1_floats - 1));
    // unshared: the classifier follows
    bytes u = v1_header(d, false);
    CHECK(read_llama2c(t.write("ok_v1u.bin", counting_floats(u, v1_floats + 20).b)).tensors.at("output.weight").data[19] ==
          static_cast<float>(v1_floats + 19));
    // legacy, unshared (negative vocab_size), with two RoPE tables [3, 1] before the classifier
    bytes l = legacy_header({4, 6, 2, 2, 1, -5, 3});
    auto lk = read_llama2c(t.write("ok_legacy.bin", counting_floats(l, v1_floats + 6 + 20).b));
    CHECK_FALSE(lk.config.shared_classifier);
    CHECK(lk.tensors.at("output.weight").data[0] == static_cast<float>(v1_floats + 6));
  }

  // a version-1 file shorter than its 256-byte header (the reader used to seek past the end)
  bytes shortv1;
  shortv1.put(llama2c_magic).put(std::int32_t{1});
  for (int i = 0; i < 7; ++i) shortv1.put(std::int32_t{1 << 20});
  CHECK_ERROR_HAS(read_llama2c(t.write("short_v1.bin", shortv1.b)), "short_v1.bin", "version-1 header is 256 bytes, the file has 36");
  CHECK_ERROR_HAS(read_llama2c(t.write("empty.bin", "")), "empty.bin", "truncated");
  CHECK_ERROR_HAS(read_llama2c(t.write("three.bin", "ak4")), "three.bin", "truncated");
  // every field by name
  const char* names[] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
  for (int i = 0; i < 7; ++i)
    for (std::int32_t bad : {0, -3, INT32_MIN}) {
      dims x = d;
      std::int32_t* f[] = {&x.dim, &x.hidden_dim, &x.n_layers, &x.n_heads, &x.n_kv_heads, &x.vocab_size, &x.seq_len};
      *f[i] = bad;
      const std::string want = std::string("header field ") + names[i] + "=" + std::to_string(bad) + " must be > 0";
      CHECK_ERROR_HAS(read_llama2c(t.write("neg.bin", v1_header(x).b)), "neg.bin", want.c_str());
      if (i == 5 && bad != INT32_MIN) continue;  // legacy: a negative vocab_size means an unshared classifier
      CHECK_ERROR_HAS(read_llama2c(t.write("neg_legacy.bin", legacy_header(x).b)), "neg_legacy.bin", want.c_str());
    }
  CHECK_ERROR_HAS(read_llama2c(t.write("div.bin", v1_header({6, 6, 1, 4, 1, 5, 3}).b)), "dim=6 is not divisible by n_heads=4");
  CHECK_ERROR_HAS(read_llama2c(t.write("div2.bin", v1_header({8, 6, 1, 4, 3, 5, 3}).b)), "n_heads=4 is not divisible by n_kv_heads=3");
  // huge dimensions: the products overflow 64 bits, or merely exceed the file; both before any allocation
  CHECK_ERROR_HAS(read_llama2c(t.write("huge.bin", v1_header({INT32_MAX, INT32_MAX, INT32_MAX, 1, 1, INT32_MAX, 1}).b)), "huge.bin",
                  "describes more than 2^64 bytes of weights, the file has 0");
  CHECK_ERROR_HAS(read_llama2c(t.write("big.bin", v1_header({1 << 16, 1 << 16, 64, 1, 1, 32000, 1}).b)), "big.bin", "dim=65536",
                  "the file has 0 after the 256-byte header (truncated?)");
  CHECK_ERROR_HAS(read_llama2c(t.write("huge_legacy.bin", legacy_header({2, 2, 1, 1, 1, 3, INT32_MAX}).b)), "huge_legacy.bin",
                  "seq_len=2147483647", "(truncated?)");
  // one float short, one float long
  bytes s = v1_header(d);
  CHECK_ERROR_HAS(read_llama2c(t.write("short.bin", counting_floats(s, v1_floats - 1).b)), "short.bin", "(truncated?)");
  bytes lng = v1_header(d);
  CHECK_ERROR_HAS(read_llama2c(t.write("long.bin", counting_floats(lng, v1_floats + 1).b)), "long.bin", "(wrong format?)");
  CHECK_ERROR_HAS(read_llama2c(t.dir.string()), "is not a regular file");
}

TEST_CASE("llama2.c tokenizer: empty, tokenless, truncated, negative or overlong lengths are load-time errors") {
  temp_dir t;
  auto tok = [](std::int32_t max_len, std::initializer_list<std::string> pieces) {
    bytes b;
    b.put(max_len);
    float score = 0;
    for (const auto& p : pieces) b.put(score--).put(static_cast<std::int32_t>(p.size())).raw(p);
    return b;
  };
  {
    // the smallest usable file: <unk>, <s>, </s>; a byte piece whose digits are not hex stays text
    const auto p = t.write("ok.bin", tok(6, {"<unk>", "<s>", "</s>", "<0xZZ>", "<0x41>"}).b);
    llama2c_tokenizer k(p);
    CHECK(k.vocab_size() == 5);
    CHECK(k.decode(0, 3) == "<0xZZ>");
    CHECK(k.decode(0, 4) == "A");
    CHECK(k.encode("xy") == std::vector<std::int32_t>{1, 0, 0});  // no byte tokens in this vocabulary: <unk>
    CHECK(llama2c_tokenizer(p, 3).vocab_size() == 3);
    CHECK(llama2c_tokenizer(p, 100).vocab_size() == 5);  // a model's larger vocabulary is allowed
  }
  CHECK_ERROR_HAS(llama2c_tokenizer(t.write("empty.bin", "")), "tokenizer '", "empty.bin", "no max_token_length");
  CHECK_ERROR_HAS(llama2c_tokenizer(t.write("none.bin", tok(8, {}).b)), "none.bin", "holds 0 tokens; needs at least 3");
  CHECK_ERROR_HAS(llama2c_tokenizer(t.write("two.bin", tok(8, {"a", "b"}).b)), "two.bin", "holds 2 tokens");
  CHECK_ERROR_HAS(llama2c_tokenizer(t.write("maxlen.bin", tok(0, {"a", "b", "c"}).b)), "maxlen.bin", "max_token_length=0 must be > 0");
  CHECK_ERROR_HAS(llama2c_tokenizer(t.write("toolong.bin", tok(2, {"a", "b", "ccc"}).b)), "toolong.bin",
                  "token 2 has length 3 outside [0, max_token_length=2]");
  bytes neg = tok(8, {"a"});
  neg.put(1.f).put(std::int32_t{-5}).raw("bcdefgh");
  CHECK_ERROR_HAS(llama2c_tokenizer(t.write("neg.bin", neg.b)), "neg.bin", "token 1 has length -5");
  bytes past = tok(8, {"a", "b"});
  past.put(1.f).put(std::int32_t{7}).raw("abc");
  CHECK_ERROR_HAS(llama2c_tokenizer(t.write("past.bin", past.b)), "past.bin", "token 2 has length 7 but only 3 bytes are left");
  bytes cut = tok(8, {"a", "b", "c"});
  cut.raw("xyz");  // 3 bytes of a fourth token's score
  CHECK_ERROR_HAS(llama2c_tokenizer(t.write("cut.bin", cut.b)), "cut.bin", "truncated in token 3");
  CHECK_ERROR_HAS(llama2c_tokenizer(t.write("ok2.bin", tok(8, {"a", "b", "c"}).b), 2), "vocab_size=2 is too small");
  CHECK_ERROR_HAS(llama2c_tokenizer(t.dir.string()), "is not a regular file");
}
