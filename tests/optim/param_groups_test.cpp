// Parameter groups and progressive unfreezing against independent oracles: glob matching
// against std::regex over the same pattern, phase lengths against the fractions they state,
// and the seed's 30/40/30 recipe step by step on a hand-counted 10-step run.
#include <loom/optim/param_groups.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <regex>
#include <string>
#include <vector>

namespace optim = loom::optim;

namespace {
std::regex glob_regex(const std::string& glob) {
  std::string r;
  for (char c : glob) {
    if (c == '*') r += ".*";
    else if (c == '?') r += '.';
    else r += std::string("[") + c + "]";
  }
  return std::regex(r);
}

/// The seed 004 recipe on 32 layers: LoRA only, then LoRA + the top 8 layers, then all.
optim::param_groups seed_recipe() {
  optim::param_groups g;
  g.groups.push_back({"lora", {"*lora_A*", "*lora_B*"}, {}, {}, 3e-4f, 0.f});
  g.groups.push_back({"top", {}, -8, {}, 3e-5f, {}});
  g.groups.push_back({"base", {}, {}, {}, 1e-5f, {}});
  g.phases = {{0.3, {"lora"}}, {0.7, {"lora", "top"}}, {1.0, {"lora", "top", "base"}}};
  optim::check(g);
  return g;
}
}  // namespace

TEST_CASE("glob_match equals std::regex over random names and patterns") {
  std::mt19937 rng(7);
  const std::string alphabet = "ab.*?";
  for (int t = 0; t < 4000; ++t) {
    std::string pat, name;
    for (int i = 0, n = static_cast<int>(rng() % 7); i < n; ++i) pat += alphabet[rng() % alphabet.size()];
    for (int i = 0, n = static_cast<int>(rng() % 9); i < n; ++i) name += alphabet[rng() % 3];
    CAPTURE(pat);
    CAPTURE(name);
    CHECK(optim::detail::glob_match(pat, name) == std::regex_match(name, glob_regex(pat)));
  }
}

TEST_CASE("layer_index reads HF names and nothing else") {
  using optim::detail::layer_index;
  CHECK(layer_index("model.layers.31.self_attn.q_proj.weight") == 31);
  CHECK(layer_index("transformer.encoder.layers.0.self_attention.query_key_value.weight") == 0);
  CHECK(layer_index("base_model.model.model.layers.7.mlp.down_proj.lora_B.weight") == 7);
  CHECK(layer_index("layers.3.x") == 3);
  CHECK_FALSE(layer_index("model.embed_tokens.weight"));
  CHECK_FALSE(layer_index("model.sublayers.3.x"));
  CHECK_FALSE(layer_index("model.layers.x3.w"));
  CHECK_FALSE(layer_index("model.layers.3x.w"));
}

TEST_CASE("groups: first match wins, layer ranges count from the end, the rest is base") {
  const auto g = seed_recipe();
  REQUIRE(g.groups.size() == 3);
  auto group = [&](const char* n) { return g.groups[optim::group_of(g, n, 32)].name; };
  CHECK(group("model.layers.30.self_attn.q_proj.lora_A.weight") == "lora");  // lora before top
  CHECK(group("model.layers.0.self_attn.v_proj.lora_B.weight") == "lora");
  CHECK(group("model.layers.24.mlp.up_proj.weight") == "top");
  CHECK(group("model.layers.31.input_layernorm.weight") == "top");
  CHECK(group("model.layers.23.mlp.up_proj.weight") == "base");
  CHECK(group("model.embed_tokens.weight") == "base");
  CHECK(group("model.norm.weight") == "base");
  CHECK(group("lm_head.weight") == "base");
}

TEST_CASE("the seed's 30/40/30 on 10 steps: steps 0-2 LoRA, 3-6 + top, 7-9 all") {
  const auto g = seed_recipe();
  const std::vector<std::vector<bool>> expect = {{true, false, false}, {true, true, false}, {true, true, true}};
  for (std::int64_t s = 0; s < 10; ++s) {
    CAPTURE(s);
    const std::size_t phase = s < 3 ? 0 : s < 7 ? 1 : 2;
    CHECK(optim::trainable_at(g, s, 10) == expect[phase]);
  }
}

TEST_CASE("phases tile every run and each covers its fraction to within one step") {
  const auto g = seed_recipe();
  const double frac[] = {0.3, 0.4, 0.3};
  for (std::int64_t total = 1; total <= 257; ++total) {
    std::int64_t count[3] = {0, 0, 0};
    for (std::int64_t s = 0; s < total; ++s) {
      const auto on = optim::trainable_at(g, s, total);
      // the phases are nested, so the number of trainable groups names the phase
      const auto n = std::count(on.begin(), on.end(), true);
      REQUIRE(n >= 1);
      ++count[n - 1];
    }
    CAPTURE(total);
    CHECK(count[0] + count[1] + count[2] == total);
    for (int k = 0; k < 3; ++k) CHECK(std::abs(static_cast<double>(count[k]) - frac[k] * static_cast<double>(total)) <= 1.0);
  }
}

TEST_CASE("no phases: every group trains at every step") {
  optim::param_groups g;
  g.groups.push_back({"lora", {"*lora*"}, {}, {}, 1e-3f, {}});
  optim::check(g);
  CHECK(g.groups.back().name == "base");
  CHECK(optim::trainable_at(g, 0, 5) == std::vector<bool>{true, true});
  CHECK(optim::trainable_at(g, 4, 5) == std::vector<bool>{true, true});
}

TEST_CASE("bad groups and phases are refused, naming what is wrong") {
  auto refuse = [](optim::param_groups g, const char* what) {
    CAPTURE(what);
    try {
      optim::check(g);
      FAIL("accepted");
    } catch (const loom::error& e) {
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  optim::param_groups frozen_with_lr;
  frozen_with_lr.groups = {{"lora", {"*lora*"}, {}, {}, 3e-4f, {}}, {"base", {}, {}, {}, 1e-5f, {}}};
  frozen_with_lr.phases = {{1.0, {"lora"}}};
  refuse(frozen_with_lr, "group \"base\" is frozen in every phase but is given lr=");

  optim::param_groups dup;
  dup.groups = {{"a", {"x"}, {}, {}, {}, {}}, {"a", {"y"}, {}, {}, {}, {}}};
  refuse(dup, "\"a\" is given twice");

  optim::param_groups everything;
  everything.groups = {{"all", {}, {}, {}, {}, {}}};
  refuse(everything, "group \"all\" needs patterns or a layer range");

  optim::param_groups bad_lr;
  bad_lr.groups = {{"a", {"x"}, {}, {}, -1.f, {}}};
  refuse(bad_lr, "group \"a\" lr must be finite and >= 0");

  optim::param_groups order;
  order.phases = {{0.5, {"base"}}, {0.4, {"base"}}};
  refuse(order, "progressive_unfreezing[1].until must increase");

  optim::param_groups short_end;
  short_end.phases = {{0.9, {"base"}}};
  refuse(short_end, "the last phase must end at until = 1");

  optim::param_groups unknown;
  unknown.phases = {{1.0, {"top"}}};
  refuse(unknown, "names group \"top\", which is not in param_groups");
}
