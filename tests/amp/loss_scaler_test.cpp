// Loss scalers against DeepSpeed's documented rules.
//
// The oracle `naive_ds_scaler` is a literal transcription of the rules DeepSpeed's
// DynamicLossScaler documents (cur_scale, cur_iter, last_overflow_iter, cur_hysteresis,
// delayed_shift), written independently of loom's class and in double precision.
#include <loom/amp/loss_scaler.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

namespace {

struct naive_ds_scaler {
  double cur_scale;
  long cur_iter = 0, last_overflow_iter = -1;
  long scale_window;
  double scale_factor = 2.0, min_scale;
  int delayed_shift, cur_hysteresis;
  bool consecutive_hysteresis;
  naive_ds_scaler(double init, long window, double min_s, int hyst, bool consec)
      : cur_scale(init), scale_window(window), min_scale(min_s), delayed_shift(hyst), cur_hysteresis(hyst),
        consecutive_hysteresis(consec) {}
  // returns false when it would raise
  bool update_scale(bool overflow) {
    if (overflow) {
      if (delayed_shift == 1 || cur_hysteresis == 1) {
        if (cur_scale == min_scale) return false;
        cur_scale = std::max(cur_scale / scale_factor, min_scale);
      } else {
        cur_hysteresis -= 1;
      }
      last_overflow_iter = cur_iter;
    } else {
      if (consecutive_hysteresis) cur_hysteresis = delayed_shift;
      if ((cur_iter - last_overflow_iter) % scale_window == 0) {
        if (!consecutive_hysteresis) cur_hysteresis = delayed_shift;
        cur_scale *= scale_factor;
      }
    }
    cur_iter += 1;
    return true;
  }
};

}  // namespace

TEST_CASE("dynamic scaler defaults are DeepSpeed's") {
  loom::amp::dynamic_loss_scaler s;
  CHECK(s.scale() == 65536.f);
  CHECK(s.options().scale_window == 1000);
  CHECK(s.options().hysteresis == 2);
  CHECK(s.options().min_scale == 1.f);
}

TEST_CASE("overflow skips the step; the scale halves only once hysteresis is spent") {
  loom::amp::dynamic_loss_scaler s;  // hysteresis 2
  CHECK(s.update(true) == false);   // skipped, hysteresis 2 -> 1
  CHECK(s.scale() == 65536.f);
  CHECK(s.update(true) == false);   // skipped, halved
  CHECK(s.scale() == 32768.f);
  CHECK(s.update(true) == false);   // budget stays at 1 without a window of clean steps
  CHECK(s.scale() == 16384.f);
  CHECK(s.update(false) == true);
  CHECK(s.skipped_steps() == 3);
}

TEST_CASE("the scale doubles after a window of clean steps") {
  loom::amp::dynamic_loss_scaler s;
  for (int i = 0; i < 999; ++i) REQUIRE(s.update(false));
  CHECK(s.scale() == 65536.f);
  s.update(false);  // 1000th clean step
  CHECK(s.scale() == 131072.f);
  for (int i = 0; i < 999; ++i) s.update(false);
  CHECK(s.scale() == 131072.f);
  s.update(false);
  CHECK(s.scale() == 262144.f);

  // after an overflow the window restarts from the overflow's iteration
  loom::amp::dynamic_loss_scaler t({.initial_scale = 8.f, .scale_window = 4, .hysteresis = 1});
  t.update(false), t.update(false);
  t.update(true);  // halves to 4 at iteration 2
  CHECK(t.scale() == 4.f);
  t.update(false), t.update(false), t.update(false);
  CHECK(t.scale() == 4.f);
  t.update(false);  // iteration 6: 6 - 2 = 4
  CHECK(t.scale() == 8.f);
}

TEST_CASE("overflow at the minimum scale is an error") {
  loom::amp::dynamic_loss_scaler s({.initial_scale = 2.f, .hysteresis = 1, .min_scale = 1.f});
  s.update(true);
  CHECK(s.scale() == 1.f);
  CHECK_THROWS_WITH_AS(s.update(true), doctest::Contains("min_scale=1"), loom::error);
  loom::amp::dynamic_loss_scaler q({.initial_scale = 2.f, .hysteresis = 1, .raise_error_at_min_scale = false});
  q.update(true), q.update(true);
  CHECK(q.scale() == 1.f);
}

TEST_CASE("bad options name the value") {
  using O = loom::amp::dynamic_loss_scaler_options;
  CHECK_THROWS_WITH_AS(loom::amp::dynamic_loss_scaler(O{.scale_window = 0}), doctest::Contains("scale_window=0"), loom::error);
  CHECK_THROWS_WITH_AS(loom::amp::dynamic_loss_scaler(O{.hysteresis = 0}), doctest::Contains("hysteresis=0"), loom::error);
  CHECK_THROWS_WITH_AS(loom::amp::dynamic_loss_scaler(O{.min_scale = 0.f}), doctest::Contains("min_scale=0"), loom::error);
  CHECK_THROWS_AS(loom::amp::static_loss_scaler(-1.f), loom::error);
}

TEST_CASE("step by step equal to a naive transcription of DeepSpeed's rules over scripted sequences") {
  struct cfg { float init; long window; float min_s; int hyst; bool consec; double p_overflow; };
  for (cfg c : {cfg{65536.f, 1000, 1.f, 2, false, 0.002}, cfg{1024.f, 7, 1.f, 2, false, 0.15}, cfg{1024.f, 5, 1.f, 3, true, 0.2},
                cfg{4096.f, 3, 0.25f, 1, false, 0.45}, cfg{256.f, 10, 1.f, 4, false, 0.25}}) {
    std::mt19937_64 gen(1234 + c.hyst);
    std::bernoulli_distribution overflow_dist(c.p_overflow);
    loom::amp::dynamic_loss_scaler s({.initial_scale = c.init, .scale_window = c.window, .hysteresis = c.hyst,
                                      .min_scale = c.min_s, .consecutive_hysteresis = c.consec});
    naive_ds_scaler ref(c.init, c.window, c.min_s, c.hyst, c.consec);
    long skipped = 0;
    for (int it = 0; it < 5000; ++it) {
      // scripted: bursts of overflow, random overflows, long clean stretches, and overflow
      // whenever the scale exceeds 2^20 (gradients of magnitude ~2^-4 in the last half binade)
      bool ovf = (it % 997 < 3) || overflow_dist(gen) || ref.cur_scale > 1048576.0;
      if (!ref.update_scale(ovf)) {
        CHECK_THROWS_AS(s.update(ovf), loom::error);
        break;
      }
      bool applied = s.update(ovf);
      skipped += ovf;
      REQUIRE(applied == !ovf);
      REQUIRE(static_cast<double>(s.scale()) == ref.cur_scale);
      REQUIRE(s.state().hysteresis_left == ref.cur_hysteresis);
    }
    CHECK(s.skipped_steps() == skipped);
  }
}

TEST_CASE("state round-trips: a restored scaler continues identically") {
  loom::amp::dynamic_loss_scaler a({.initial_scale = 64.f, .scale_window = 5});
  for (int i = 0; i < 13; ++i) a.update(i % 4 == 0);
  loom::amp::dynamic_loss_scaler b({.initial_scale = 64.f, .scale_window = 5});
  b.set_state(a.state());
  for (int i = 0; i < 40; ++i) {
    bool o = i % 6 == 1;
    a.update(o), b.update(o);
    REQUIRE(a.scale() == b.scale());
  }
}
