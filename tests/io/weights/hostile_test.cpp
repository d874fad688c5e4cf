// Hostile and broken weight files, written byte by byte in the test: llama2.c checkpoints,
// llama2.c tokenizers, safetensors and folders of safetensors shards. Each must be a loom::error whose message names the
// file and the field or tensor at fault, found before any allocation the file's claims size;
// never a crash, an over-read or an unbounded message.
#include <support/error_of.hpp>
#include <doctest/doctest.h>

#include <loom/io/llama2c.hpp>
#include <loom/io/safetensors.hpp>
#include <loom/io/safetensors_folder.hpp>

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

using loom::test::error_of;

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
    CHECK(k.encode("xy", /*add_bos=*/true) == std::vector<std::int32_t>{1, 0, 0});  // no byte tokens in this vocabulary: <unk>
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

namespace {
/// A safetensors file: 8-byte header length, the header, the data bytes.
std::string safetensors_bytes(const std::string& header, const std::string& data, std::uint64_t length_field = UINT64_MAX) {
  bytes b;
  b.put(length_field == UINT64_MAX ? static_cast<std::uint64_t>(header.size()) : length_field).raw(header).raw(data);
  return b.b;
}
}  // namespace

TEST_CASE("safetensors: lying lengths, offsets, shapes and dtypes, each naming the file and the tensor") {
  temp_dir t;
  auto st = [&](const std::string& header, const std::string& data, std::uint64_t length_field = UINT64_MAX) {
    return t.write("bad.safetensors", safetensors_bytes(header, data, length_field));
  };
  {
    // a valid file built by hand: F16, BF16, a zero-size tensor, __metadata__
    bytes d;
    d.put(std::uint16_t{0x3c00}).put(std::uint16_t{0xc000}).put(std::uint16_t{0x3f80});  // f16 1, f16 -2, bf16 1
    const auto p = t.write("ok.safetensors",
                           safetensors_bytes(R"({"__metadata__": {"format": "pt"}, "h": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
                                                 "b": {"dtype": "BF16", "shape": [1, 1], "data_offsets": [4, 6]},
                                                 "z": {"dtype": "F32", "shape": [0, 3], "data_offsets": [6, 6]}})",
                                             d.b));
    auto m = read_safetensors(p);
    CHECK(m.at("h").data[1] == -2.f);
    CHECK(m.at("b").data[0] == 1.f);
    CHECK(m.at("z").shape == std::vector<std::int64_t>{0, 3});
    CHECK(m.at("z").data.size() == 0);
  }
  const std::string f32x2 = R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  CHECK_ERROR_HAS(read_safetensors(st(f32x2, "12345678", 1000)), "bad.safetensors", "header length 1000 exceeds the file size");
  CHECK_ERROR_HAS(read_safetensors(st(f32x2, "12345678", UINT64_MAX - 3)), "header length 18446744073709551612 exceeds");
  CHECK_ERROR_HAS(read_safetensors(st(std::string(100000, '[') + std::string(100000, ']'), "")), "bad.safetensors",
                  "nesting deeper than 64");
  CHECK_ERROR_HAS(read_safetensors(st("[1, 2]", "")), "header is not a JSON object");
  // offsets
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 100]}})", "12345678")),
                  "bad.safetensors", "tensor \"x\": data_offsets[1] must be <= 8, got 100");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}})", "12345678")),
                  "tensor \"x\": data_offsets[0] must be >= 0, got -8");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0.5, 8]}})", "12345678")),
                  "tensor \"x\": data_offsets[0] must be an integer, got 0.5");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", "12345678")),
                  "tensor \"x\": data_offsets [8, 0] span");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", "12345678")),
                  "tensor \"x\": data_offsets must be [begin, end], got [0]");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", "123456789012")),
                  "bad.safetensors", "tensor \"b\" (data_offsets [4, 12]) overlaps tensor \"a\" (ending at 8)");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                          "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})", "123456789012")),
                  "data bytes [4, 8) belong to no tensor (before tensor \"b\")");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", "12345678")),
                  "data bytes [4, 8) after the last tensor belong to no tensor");
  // shapes: negative, fractional, overflowing the element count or the byte count
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}})", "12345678")),
                  "tensor \"x\": shape[0] must be >= 0, got -1");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": "F32", "shape": [2.0001], "data_offsets": [0, 8]}})", "12345678")),
                  "tensor \"x\": shape[0] must be an integer");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": "F32", "shape": [4294967296, 4294967296, 0], "data_offsets": [0, 0]}})", "")),
                  "tensor \"x\": shape [4294967296, 4294967296, 0] has more elements than fit 64 bits");
  // 2^62 elements of 4 bytes: the byte count used to wrap to 0 and match an empty span
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 0]}})", "")),
                  "tensor \"x\": shape [4611686018427387904] has more elements than fit 64 bits");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": "F32", "shape": [18446744073709551615], "data_offsets": [0, 0]}})", "")),
                  "tensor \"x\": shape[0] must be <= 9223372036854775807");
  // dtypes and entries
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": "F16", "shape": [3], "data_offsets": [0, 12]}})", "123456789012")),
                  "tensor \"x\": data_offsets [0, 12] span 12 bytes, shape [3] of F16 needs 6");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": 5, "shape": [1], "data_offsets": [0, 4]}})", "1234")),
                  "tensor \"x\": unsupported dtype 5");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})", "12345678")),
                  "tensor \"x\": unsupported dtype \"I64\"");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": [1, 2]})", "")), "tensor \"x\": entry must be an object, got [1, 2]");
  CHECK_ERROR_HAS(read_safetensors(st(R"({"x": {"dtype": "F32", "data_offsets": [0, 0]}})", "")), "tensor \"x\": missing \"shape\"");
  // a 1 MB tensor name is quoted short
  const std::string long_name(1 << 20, 'n');
  const std::string msg = error_of([&] {
    read_safetensors(st("{\"" + long_name + R"(": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}})", "1"));
  });
  CHECK(msg.find("tensor \"nnnn") != std::string::npos);
  CHECK(msg.find("(1048576 bytes)") != std::string::npos);
  CHECK(msg.size() < 1000);
}

TEST_CASE("safetensors index and range reads: only the header is parsed, a range reads those elements, checked") {
  temp_dir t;
  bytes d;
  d.put(std::uint16_t{0x3c00}).put(std::uint16_t{0xc000}).put(std::uint16_t{0x4000});  // f16 1, -2, 2
  for (float x : {5.f, 6.f, 7.f, 8.f}) d.put(x);
  const auto p = t.write("idx.safetensors",
                         safetensors_bytes(R"({"__metadata__": {"rank": "3"}, "h": {"dtype": "F16", "shape": [3], "data_offsets": [0, 6]},
                                               "f": {"dtype": "F32", "shape": [2, 2], "data_offsets": [6, 22]}})",
                                           d.b));
  const safetensors_index ix = read_safetensors_index(p);
  CHECK(ix.metadata.at("rank") == "3");
  CHECK(ix.tensors.at("f").count == 4);
  float two[2];
  read_safetensors_range(ix, "f", 1, two);  // the oracle: the values written above
  CHECK((two[0] == 6.f && two[1] == 7.f));
  read_safetensors_range(ix, "h", 1, two);
  CHECK((two[0] == -2.f && two[1] == 2.f));
  CHECK_ERROR_HAS(read_safetensors_range(ix, "f", 3, two), "idx.safetensors", "has 4 elements; asked for [3, 5)");
  CHECK_ERROR_HAS(read_safetensors_range(ix, "g", 0, two), "no tensor \"g\"");
  // the index checks the header against the file's size without reading the data
  std::filesystem::resize_file(p, std::filesystem::file_size(p) - 4);
  CHECK_ERROR_HAS(read_safetensors_index(p), "idx.safetensors", "data_offsets[1] must be <=");
  CHECK_ERROR_HAS(read_safetensors_index(t.write("short.safetensors", "1234")), "short.safetensors", "has no header");
}

TEST_CASE("safetensors folder: the index decides which shard holds a tensor; files outside the folder refused") {
  temp_dir t;
  const auto shard = [&](const std::string& name, const std::string& tensor, float first) {
    bytes d;
    for (float x : {first, first + 1, first + 2, first + 3}) d.put(x);
    t.write(name, safetensors_bytes("{\"" + tensor + R"(": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}})", d.b));
  };
  shard("s1.safetensors", "a", 0.f);
  shard("s2.safetensors", "b", 10.f);
  const auto index = [&](const std::string& weight_map) {
    t.write("model.safetensors.index.json", R"({"metadata": {}, "weight_map": )" + weight_map + "}");
  };
  {  // without an index every shard is read; the oracle: the values written above
    const safetensors_folder f(t.dir);
    CHECK(f.names() == std::vector<std::string>{"a", "b"});
    CHECK(f.file_of("b") == (t.dir / "s2.safetensors").string());
    float two[2];
    f.read("b", 1, two);
    CHECK((two[0] == 11.f && two[1] == 12.f));
    CHECK(f.bytes_read() == 8);
    CHECK(f.file_bytes() == std::filesystem::file_size(t.dir / "s1.safetensors") * 2);
    CHECK_ERROR_HAS(f.read("c", 0, two), "no tensor 'c'");
    const safetensors_folder one(t.dir / "s1.safetensors");  // one file
    CHECK(one.names() == std::vector<std::string>{"a"});
  }
  index(R"({"a": "s1.safetensors"})");  // the index leaves s2 out: b is not read
  CHECK(safetensors_folder(t.dir).names() == std::vector<std::string>{"a"});
  index(R"({"a": "../s1.safetensors"})");
  CHECK_ERROR_HAS(safetensors_folder(t.dir), "model.safetensors.index.json", "is not a file of the folder");
  index(R"({"a": "s3.safetensors"})");
  CHECK_ERROR_HAS(safetensors_folder(t.dir), "shard '", "s3.safetensors' (tensor 'a'", "is missing");
  index(R"({"a": "s2.safetensors"})");
  CHECK_ERROR_HAS(safetensors_folder(t.dir), "places tensor 'a' in '", "s2.safetensors', which does not hold it");
  index(R"({"a": 3})");
  CHECK_ERROR_HAS(safetensors_folder(t.dir), "weight_map[\"a\"] is not a file name");
  std::filesystem::remove(t.dir / "model.safetensors.index.json");
  shard("s3.safetensors", "a", 20.f);  // without an index, a tensor in two shards
  CHECK_ERROR_HAS(safetensors_folder(t.dir), "tensor 'a' is in both '");
}

TEST_CASE("HF config.json: numbers range-checked by field, no silent narrowing") {
  temp_dir t;
  const std::string base = R"("hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 100)";
  auto cfg = [&](const std::string& more) { return t.write("config.json", "{" + base + more + "}"); };
  auto c = read_hf_llama_config(cfg(R"(, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": true)"));
  CHECK(c.num_key_value_heads == 2);
  CHECK(c.rms_norm_eps == 1e-5f);
  CHECK(c.tie_word_embeddings);
  CHECK(c.max_position_embeddings == 2048);
  // 2^32 + 4 used to read as 4 through get<int32_t>
  CHECK_ERROR_HAS(read_hf_llama_config(cfg(R"(, "num_attention_heads": 4294967300)")), "config.json",
                  "\"num_attention_heads\" must be <= 65536, got 4294967300");
  CHECK_ERROR_HAS(read_hf_llama_config(cfg(R"(, "num_attention_heads": 4, "rms_norm_eps": 1e300)")), "\"rms_norm_eps\" must be <= 1, got 1e+300");
  CHECK_ERROR_HAS(read_hf_llama_config(cfg(R"(, "num_attention_heads": 4, "rope_theta": -1)")), "\"rope_theta\" must be >= 1, got -1");
  CHECK_ERROR_HAS(read_hf_llama_config(cfg(R"(, "num_attention_heads": -4)")), "\"num_attention_heads\" must be >= 1, got -4");
  CHECK_ERROR_HAS(read_hf_llama_config(cfg(R"(, "num_attention_heads": 4.5)")), "\"num_attention_heads\" must be an integer, got 4.5");
  CHECK_ERROR_HAS(read_hf_llama_config(cfg(R"(, "num_attention_heads": 3)")), "hidden_size=64 is not divisible by num_attention_heads=3");
  CHECK_ERROR_HAS(read_hf_llama_config(cfg(R"(, "num_attention_heads": 4, "num_key_value_heads": 3)")),
                  "num_attention_heads=4 is not divisible by num_key_value_heads=3");
  CHECK_ERROR_HAS(read_hf_llama_config(cfg(R"(, "num_attention_heads": 4, "tie_word_embeddings": "yes")")),
                  "\"tie_word_embeddings\" must be true or false, got \"yes\"");
  CHECK_ERROR_HAS(read_hf_llama_config(t.write("c2.json", R"({"hidden_size": 64})")), "c2.json", "missing \"intermediate_size\"");
  CHECK_ERROR_HAS(read_hf_llama_config(t.write("c3.json", std::string(1000, '['))), "c3.json", "nesting deeper than 64");
}
