#pragma once
// Parameter groups (per-group learning rate, weight decay, trainable flag) and progressive
// unfreezing: a schedule that says, for every optimizer step, which groups train.
//
// Why groups are matched by name: users say "the LoRA factors", "the top 8 layers", "the
// rest" in terms of the HF parameter names they know (model.layers.31.self_attn.q_proj.weight),
// and the same names are what checkpoints and adapters store. A group matches a parameter
// when one of its glob patterns matches the name (or it has none) and, if it gives a layer
// range, the name's `layers.<i>.` index is in it. Groups are tried in order, the first match
// wins; a parameter no group matches belongs to the implicit last group `base`.
//
// Why phases are fractions of training: the recipe (seed 004: 30% LoRA only, 40% LoRA + top
// layers, 30% everything) is stated that way and must mean the same for any --steps. Phase k
// covers the steps [round(until_{k-1} * T), round(until_k * T)) of T steps (until_0 = 0), so
// the phases tile the run exactly and each covers its fraction to within one step.

#include <loom/core/error.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom::optim {

/// One group of parameters with its optimizer settings.
struct param_group {
  std::string name;
  std::vector<std::string> patterns;  ///< globs over parameter names: '*' any run, '?' one character
  /// Layers [first, last); negative values count from the end as in Python (-8: the last 8).
  std::optional<std::int64_t> first_layer, last_layer;
  std::optional<float> lr;            ///< unset: the optimizer's (scheduled) lr
  std::optional<float> weight_decay;  ///< unset: the optimizer's weight decay
};

/// Until fraction `until` of training, exactly the groups named in `trainable` train.
struct unfreeze_phase {
  double until = 1.0;
  std::vector<std::string> trainable;
};

/// The name of the group that holds what no other group matches.
inline constexpr std::string_view base_group = "base";

struct param_groups {
  std::vector<param_group> groups;     ///< the implicit `base` group is appended by check()
  std::vector<unfreeze_phase> phases;  ///< empty: every group trains at every step
};

namespace detail {
/// Glob match with '*' (any run, also empty) and '?' (one character); iterative with one
/// backtrack point, so a hostile pattern costs O(|pattern| * |name|), never exponential time.
inline bool glob_match(std::string_view pat, std::string_view s) {
  std::size_t p = 0, i = 0, star = std::string_view::npos, mark = 0;
  while (i < s.size()) {
    if (p < pat.size() && (pat[p] == '?' || pat[p] == s[i])) {
      ++p, ++i;
    } else if (p < pat.size() && pat[p] == '*') {
      star = p++, mark = i;
    } else if (star != std::string_view::npos) {
      p = star + 1, i = ++mark;
    } else {
      return false;
    }
  }
  while (p < pat.size() && pat[p] == '*') ++p;
  return p == pat.size();
}

/// The i of the first ".layers.<i>." (or a leading "layers.<i>.") in an HF parameter name.
inline std::optional<std::int64_t> layer_index(std::string_view name) {
  for (std::size_t at = name.find("layers."); at != std::string_view::npos; at = name.find("layers.", at + 1)) {
    if (at != 0 && name[at - 1] != '.') continue;
    std::size_t i = at + 7;
    std::int64_t v = 0;
    std::size_t digits = 0;
    for (; i < name.size() && name[i] >= '0' && name[i] <= '9' && digits < 18; ++i, ++digits) v = v * 10 + (name[i] - '0');
    if (digits > 0 && (i == name.size() || name[i] == '.')) return v;
  }
  return std::nullopt;
}

inline std::int64_t resolve_layer(std::int64_t v, std::int64_t num_layers) { return v < 0 ? num_layers + v : v; }

inline bool has_group(const param_groups& g, std::string_view name) {
  for (const auto& x : g.groups)
    if (x.name == name) return true;
  return false;
}
}  // namespace detail

/// Checks the groups and phases and appends the implicit `base` group when it is not given.
/// A group that no phase lets train must not carry a learning rate: that is a configuration
/// mistake (the rate would never apply), not a setting.
inline void check(param_groups& g) {
  for (std::size_t i = 0; i < g.groups.size(); ++i) {
    const auto& x = g.groups[i];
    LOOM_CHECK(!x.name.empty() && x.name.size() <= 64, "param_groups[", i, "].name must be 1 to 64 characters, got ", x.name.size());
    for (std::size_t j = 0; j < i; ++j)
      LOOM_CHECK(g.groups[j].name != x.name, "param_groups: group name \"", x.name, "\" is given twice");
    const bool is_base = x.name == base_group;
    LOOM_CHECK(!is_base || (x.patterns.empty() && !x.first_layer && !x.last_layer),
               "param_groups: group \"base\" holds what no other group matches; give it no patterns or layers");
    LOOM_CHECK(is_base || !x.patterns.empty() || x.first_layer || x.last_layer, "param_groups: group \"", x.name,
               "\" needs patterns or a layer range (else it matches every parameter: that is \"base\")");
    LOOM_CHECK(!x.lr || (std::isfinite(*x.lr) && *x.lr >= 0.f), "param_groups: group \"", x.name, "\" lr must be finite and >= 0, got ",
               x.lr.value_or(0.f));
    LOOM_CHECK(!x.weight_decay || (std::isfinite(*x.weight_decay) && *x.weight_decay >= 0.f), "param_groups: group \"", x.name,
               "\" weight_decay must be finite and >= 0, got ", x.weight_decay.value_or(0.f));
  }
  if (!detail::has_group(g, base_group)) g.groups.push_back(param_group{std::string(base_group), {}, {}, {}, {}, {}});
  // `base` is tried last whatever its position in the config
  for (std::size_t i = 0; i + 1 < g.groups.size(); ++i)
    if (g.groups[i].name == base_group) std::swap(g.groups[i], g.groups.back());

  double prev = 0.0;
  for (std::size_t k = 0; k < g.phases.size(); ++k) {
    const auto& ph = g.phases[k];
    LOOM_CHECK(std::isfinite(ph.until) && ph.until > prev && ph.until <= 1.0, "progressive_unfreezing[", k,
               "].until must increase within (0, 1], got ", ph.until, " after ", prev);
    prev = ph.until;
    for (const auto& n : ph.trainable)
      LOOM_CHECK(detail::has_group(g, n), "progressive_unfreezing[", k, "].trainable names group \"", n.substr(0, 64),
                 "\", which is not in param_groups");
  }
  LOOM_CHECK(g.phases.empty() || prev == 1.0, "progressive_unfreezing: the last phase must end at until = 1, got ", prev);
  for (const auto& x : g.groups) {
    bool trains = g.phases.empty();
    for (const auto& ph : g.phases)
      for (const auto& n : ph.trainable) trains |= n == x.name;
    LOOM_CHECK(trains || !x.lr, "param_groups: group \"", x.name, "\" is frozen in every phase but is given lr=", *x.lr);
  }
}

/// The group index of parameter `name` in a model of `num_layers` layers (after check()).
inline std::size_t group_of(const param_groups& g, std::string_view name, std::int64_t num_layers) {
  LOOM_CHECK(!g.groups.empty() && g.groups.back().name == base_group, "param_groups: call check() before group_of()");
  const auto layer = detail::layer_index(name);
  for (std::size_t i = 0; i + 1 < g.groups.size(); ++i) {
    const auto& x = g.groups[i];
    bool ok = x.patterns.empty();
    for (const auto& p : x.patterns) ok = ok || detail::glob_match(p, name);
    if (ok && (x.first_layer || x.last_layer)) {
      const std::int64_t lo = detail::resolve_layer(x.first_layer.value_or(0), num_layers);
      const std::int64_t hi = detail::resolve_layer(x.last_layer.value_or(num_layers), num_layers);
      ok = layer && *layer >= lo && *layer < hi;
    }
    if (ok) return i;
  }
  return g.groups.size() - 1;
}

/// The first step of each phase and, last, `total_steps` (so phase k is [b[k], b[k+1])).
inline std::vector<std::int64_t> phase_bounds(const param_groups& g, std::int64_t total_steps) {
  LOOM_CHECK(total_steps >= 1, "progressive_unfreezing needs total_steps >= 1, got ", total_steps);
  std::vector<std::int64_t> b{0};
  for (const auto& ph : g.phases) b.push_back(std::llround(ph.until * static_cast<double>(total_steps)));
  if (g.phases.empty()) b.push_back(total_steps);
  return b;
}

/// Which groups train at optimizer step `step` (0-based) of `total_steps`, one flag per group.
inline std::vector<bool> trainable_at(const param_groups& g, std::int64_t step, std::int64_t total_steps) {
  std::vector<bool> on(g.groups.size(), g.phases.empty());
  if (g.phases.empty()) return on;
  const auto b = phase_bounds(g, total_steps);
  std::size_t k = 0;
  while (k + 1 < g.phases.size() && step >= b[k + 1]) ++k;
  for (std::size_t i = 0; i < g.groups.size(); ++i)
    for (const auto& n : g.phases[k].trainable) on[i] = on[i] || n == g.groups[i].name;
  return on;
}

}  // namespace loom::optim
