// Pictures of a schedule: the ASCII timeline of a small GPipe is the hand-drawn one; the SVG
// has a box per pass with its micro-batch, one row per stage, and broken schedules still draw.
#include <loom/pipeline/render.hpp>

#include <doctest/doctest.h>

#include <string>

namespace lp = loom::pipeline;

namespace {

std::size_t count(const std::string& text, const std::string& part) {
  std::size_t n = 0;
  for (std::size_t i = text.find(part); i != std::string::npos; i = text.find(part, i + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("ASCII timeline of GPipe p=2 m=2 is the hand-drawn one") {
  // f=1, b=2: stage 0 F0 [0,1] F1 [1,2] B0 [5,7] B1 [7,9]; stage 1 F0 [1,2] F1 [2,3] B0 [3,5]
  // B1 [5,7]. Four columns per time unit (labels are up to 3 characters).
  const std::string a = lp::render_ascii(lp::simulate(lp::gpipe(2, 2)));
  CHECK(a.find("time     0       2       4       6       8") != std::string::npos);
  CHECK(a.find("stage 0 |F0= F1=             B0===== B1===== |\n") != std::string::npos);
  CHECK(a.find("stage 1 |    F0= F1= B0===== B1=====         |\n") != std::string::npos);
}

TEST_CASE("ASCII marks chunks with letters on a half-unit grid") {
  const std::string a = lp::render_ascii(lp::simulate(lp::interleaved_one_f_one_b(2, 2, 2)));
  CHECK(a.find("0.5 time") != std::string::npos);
  CHECK(a.find("stage 0 |F0a F1a F0b ") != std::string::npos);
  CHECK(count(a, "B1b") == 2);
}

TEST_CASE("SVG: one row per stage, one labelled box per pass") {
  const lp::simulation r = lp::simulate(lp::interleaved_one_f_one_b(4, 8, 2));
  const std::string svg = lp::render_svg(r);
  CHECK(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0) == 0);
  CHECK(svg.find("</svg>\n") == svg.size() - 7);
  for (int s = 0; s < 4; ++s) CHECK(count(svg, ">stage " + std::to_string(s) + "</text>") == 1);
  CHECK(count(svg, "<title>forward(") == 4 * 8 * 2);
  CHECK(count(svg, "<title>backward(") == 4 * 8 * 2);
  CHECK(count(svg, "<title>forward(mb 7, chunk 1)") == 4);
  CHECK(svg.find("total time 28.5, bubble 15.79%") != std::string::npos);
  // Zero-cost transfers and optimizer steps take no room and are not drawn.
  CHECK(count(svg, "<title>send_") == 0);
  const std::string with_comm = lp::render_svg(lp::simulate(lp::gpipe(2, 1), {.communication = 0.25}));
  CHECK(count(with_comm, "<title>send_activation(") == 1);
  CHECK(count(with_comm, "<title>recv_gradient(") == 1);
}

TEST_CASE("a deadlocked schedule is drawn up to where it is stuck") {
  lp::schedule s = lp::gpipe(2, 2);
  std::swap(s.ops[1][0], s.ops[1][2]);  // stage 1 waits for mb 1 first
  const lp::simulation r = lp::simulate(s);
  REQUIRE(r.deadlock);
  CHECK(lp::render_svg(r).find("DEADLOCK") != std::string::npos);
  const std::string a = lp::render_ascii(r);
  CHECK(a.find("stage 0 |F0 |\n") != std::string::npos);  // only F0 ran; stage 1 never started
  CHECK(a.find("stage 1 |   |\n") != std::string::npos);
}
