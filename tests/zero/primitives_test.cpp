// zero building blocks: AdamW against PyTorch, partitioned_tensor gather/scatter and its
// memory, flat_layout / layer_params, stage policies, optimizer state placement.
#include <loom/zero/adamw.hpp>
#include <loom/zero/flat_layout.hpp>
#include <loom/zero/optimizer_state.hpp>
#include <loom/zero/partitioned_tensor.hpp>
#include <loom/zero/stage.hpp>

#include <loom/comm/thread_comm.hpp>

#include <doctest/doctest.h>

#include <filesystem>
#include <vector>

using namespace loom;

TEST_CASE("adamw_step matches torch.optim.AdamW") {
  // expected: torch 1.13 AdamW(lr=0.01, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1) in float64, 3 steps
  std::vector<float> w{0.5f, -1.25f, 2.0f, 0.0f, 3.0f}, m(5), v(5);
  const std::vector<std::vector<float>> grads{
      {0.1f, -0.2f, 0.3f, 0.0f, 5.0f}, {0.05f, 0.4f, -0.3f, 1.0f, -5.0f}, {-0.2f, 0.1f, 0.0f, -1.0f, 2.5f}};
  const zero::adamw_config c{0.01f, 0.9f, 0.95f, 1e-6f, 0.1f};
  for (std::size_t t = 0; t < grads.size(); ++t) {
    // pass the gradient doubled and scaled by 1/2: the scale is applied
    std::vector<half> g2;
    for (float g : grads[t]) g2.push_back(half(2 * g));
    zero::adamw_step<half>(w, g2, m, v, c, std::int64_t(t + 1), 0.5f);
  }
  const std::vector<double> expect{0.481172356, -1.24407657, 1.98496391, -0.00689594138, 2.97979256};
  for (std::size_t i = 0; i < 5; ++i) CHECK(w[i] == doctest::Approx(expect[i]).epsilon(2e-4));
  std::vector<float> short_grad(4);
  CHECK_THROWS_WITH_AS(zero::adamw_step<float>(w, short_grad, m, v, c, 1), doctest::Contains("grad=4"), loom::error);
  std::vector<float> g5(5);
  CHECK_THROWS_WITH_AS(zero::adamw_step<float>(w, g5, m, v, c, 0), doctest::Contains("t=0"), loom::error);
}

TEST_CASE("partitioned_tensor: each rank holds 1/N, gather restores the tensor, scratch is released") {
  for (int world : {1, 2, 3, 4}) {
    const std::size_t n = 1001;
    std::vector<float> full(n);
    for (std::size_t i = 0; i < n; ++i) full[i] = float(i) * 0.5f - 7.f;
    comm::run_ranks(world, [&](comm::thread_comm& c) {
      host_memory_resource mine("rank"), scratch("scratch");
      zero::partitioned_tensor<float, comm::thread_comm> t(c, n, mine);
      const std::size_t s = (n + world - 1) / world;
      CHECK(t.shard_numel() == s);
      CHECK(mine.current_bytes() == s * sizeof(float));
      t.scatter_from(full);
      for (std::size_t k = 0; k < s; ++k) {
        const std::size_t i = t.shard_begin() + k;
        CHECK(t.shard()[k] == (i < n ? full[i] : 0.f));
      }
      {
        buffer<float> g = t.gather(scratch);
        CHECK(scratch.current_bytes() == s * world * sizeof(float));
        bool same = true;
        for (std::size_t i = 0; i < n; ++i) same = same && g[i] == full[i];
        CHECK(same);
      }
      CHECK(scratch.current_bytes() == 0);
      std::vector<float> wrong(n - 1);
      CHECK_THROWS_WITH_AS(t.scatter_from(wrong), doctest::Contains("numel=1001"), loom::error);
    });
  }
}

TEST_CASE("flat_layout and layer_params: views of a layer at any place") {
  zero::flat_layout lay({{"w0", {3, 4}, 0}, {"b0", {3}, 0}, {"w1", {2, 3}, 1}}, 2);
  CHECK(lay.layers() == 2);
  CHECK(lay.find("w1") == 2);
  CHECK_THROWS_WITH_AS(lay.find("nope"), doctest::Contains("'nope'"), loom::error);
  std::vector<float> a(12), b(3), c(6);
  for (std::size_t i = 0; i < 12; ++i) a[i] = float(i);
  std::vector<float*> ptrs{a.data(), b.data(), c.data()};
  zero::layer_params<const float> p0(lay, 0, ptrs.data());
  CHECK(p0.size() == 2);
  CHECK(p0.view<2>(0)(2, 1) == 9.f);
  CHECK(p0.span(1).size() == 3);
  CHECK_THROWS_WITH_AS(p0.view<1>(0), doctest::Contains("Rank=1"), loom::error);
  CHECK_THROWS_WITH_AS(p0.span(2), doctest::Contains("k=2"), loom::error);
  zero::layer_params<const float> p1(lay, 1, ptrs.data());
  CHECK(p1.spec(0).name == "w1");
  CHECK_THROWS_WITH_AS(zero::flat_layout({{"bad", {3, 0}, 0}}, 1), doctest::Contains("extent=0"), loom::error);
}

TEST_CASE("stage policies and run-time dispatch") {
  static_assert(zero::stage_policy<zero::stage2>);
  static_assert(!zero::stage1::shards_gradients::value && zero::stage1::shards_optimizer::value);
  static_assert(zero::stage3::shards_parameters::value);
  CHECK(zero::dispatch_stage(2, [](auto s) { return decltype(s)::level; }) == 2);
  CHECK_THROWS_WITH_AS(zero::dispatch_stage(4, [](auto s) { return decltype(s)::level; }),
                       doctest::Contains("stage=4"), loom::error);
}

TEST_CASE("optimizer_state: device, cpu and nvme placement; the nvme file is removed") {
  host_memory_resource dev("device"), host("host");
  {
    zero::optimizer_state s(100, zero::offload_device::none, dev, host);
    CHECK(dev.current_bytes() == 1200);
    CHECK(host.current_bytes() == 0);
  }
  {
    zero::optimizer_state s(100, zero::offload_device::cpu, dev, host);
    CHECK(dev.current_bytes() == 0);
    CHECK(host.current_bytes() == 1200);
  }
  const auto dir = std::filesystem::temp_directory_path() / "loom_zero_nvme_test";
  std::filesystem::create_directories(dir);
  {
    zero::optimizer_state s(100, zero::offload_device::nvme, dev, host, dir.string(), 3);
    CHECK(dev.current_bytes() + host.current_bytes() == 0);
    CHECK(std::filesystem::file_size(s.path()) == 1200);
    s.master()[5] = 2.5f;
    s.exp_avg_sq()[99] = 1.f;
    CHECK(s.master()[5] == 2.5f);
    CHECK(s.exp_avg()[0] == 0.f);
    // a master without moments (the engine's lazy group moments keep those in stores of their own)
    zero::optimizer_state master_only(100, zero::offload_device::nvme, dev, host, dir.string(), 3, false);
    CHECK(std::filesystem::file_size(master_only.path()) == 400);
    CHECK(master_only.exp_avg().empty());
    // a store moved keeps its file; the one moved over has its own removed
    zero::state_store a(10, zero::offload_device::nvme, dev, host, dir.string(), 4), b(20, zero::offload_device::nvme, dev, host, dir.string(), 4);
    a.span()[9] = 7.f;
    const std::string a_path = a.path(), b_path = b.path();
    b = std::move(a);
    CHECK(b.path() == a_path);
    CHECK(b.span()[9] == 7.f);
    CHECK(std::filesystem::exists(a_path));
    CHECK_FALSE(std::filesystem::exists(b_path));
  }
  CHECK(std::filesystem::is_empty(dir));
  std::filesystem::remove(dir);
  CHECK_THROWS_WITH_AS(zero::optimizer_state(10, zero::offload_device::nvme, dev, host, "/nonexistent/dir"),
                       doctest::Contains("/nonexistent/dir"), loom::error);
  CHECK_THROWS_WITH_AS(zero::parse_offload_device("gpu"), doctest::Contains("'gpu'"), loom::error);
}
