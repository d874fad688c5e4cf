// loom-pipeline-plan: builds a pipeline schedule, proves it with the simulator, prints its
// timeline (ASCII) and report, and optionally writes the timeline as SVG.
//
//   loom-pipeline-plan --schedule 1f1b -p 4 -m 8
//   loom-pipeline-plan --schedule interleaved -p 4 -m 8 -v 2 --svg interleaved.svg
//
// Exit status: 0 when the schedule is proven, 1 when the simulator finds a problem, 2 on bad
// arguments (with the usage line).
#include <loom/comm/thread_comm.hpp>
#include <loom/pipeline/executor.hpp>
#include <loom/pipeline/render.hpp>
#include <loom/pipeline/schedule.hpp>
#include <loom/pipeline/simulate.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace lp = loom::pipeline;

namespace {

constexpr const char* usage =
    "usage: loom-pipeline-plan --schedule gpipe|1f1b|interleaved -p STAGES -m MICROBATCHES [-v CHUNKS]\n"
    "                          [--fwd-cost F] [--bwd-cost B] [--comm-cost C] [--svg FILE [--svg-scale PX]]\n"
    "                          [--ops] [--execute MS [--activation N] [--steps S]] [--help]\n"
    "  builds the schedule, proves it deadlock-free under blocking send/recv, prints its timeline,\n"
    "  total time, bubble fraction and peak in-flight activations per stage.\n"
    "  -v            model chunks per stage (interleaved only; m must be a multiple of p), default 2\n"
    "  --fwd-cost F  forward cost of a micro-batch through one stage (default 1; a chunk costs F/v)\n"
    "  --bwd-cost B  backward cost (default 2); --comm-cost C: one send/recv transfer (default 0)\n"
    "  --svg FILE    also write the timeline as SVG (--svg-scale: pixels per time unit)\n"
    "  --ops         print every stage's op list\n"
    "  --execute MS  also run the plan with the executor on p thread ranks (thread_comm), each pass\n"
    "                sleeping its cost x MS milliseconds and moving N floats per transfer (--activation,\n"
    "                default 65536); prints the measured step time (best of --steps, default 5)\n";

struct bad_args {
  std::string what;
};

int to_int(std::string_view flag, std::string_view s) {
  int v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || end != s.data() + s.size()) throw bad_args{std::string(flag) + " expects an integer, got '" + std::string(s) + "'"};
  return v;
}

double to_double(std::string_view flag, std::string_view s) {
  const std::string str(s);
  char* end = nullptr;
  const double v = std::strtod(str.c_str(), &end);
  if (str.empty() || end != str.c_str() + str.size()) throw bad_args{std::string(flag) + " expects a number, got '" + str + "'"};
  return v;
}

// A stage whose passes only sleep for their cost: measures what the executor and the
// communicator add to the schedule's own time.
struct sleeping_stage {
  double forward_ms, backward_ms;
  void forward(int, int, std::span<const float>, std::span<float> out) {
    if (!out.empty()) out[0] = 1.0f;
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(forward_ms));
  }
  void backward(int, int, std::span<const float>, std::span<const float>, std::span<float>) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(backward_ms));
  }
};

// Best-of-`steps` wall time in milliseconds of one step of `s` on thread ranks.
double execute(const lp::schedule& s, const lp::op_costs& costs, double ms, std::size_t activation, int steps) {
  double best = 1e300;
  loom::comm::run_ranks(s.stages, [&](loom::comm::thread_comm& c) {
    lp::executor<float, loom::comm::thread_comm> ex(s, c, activation);
    sleeping_stage model{costs.forward * ms / s.chunks, costs.backward * ms / s.chunks};
    for (int i = 0; i < steps; ++i) {
      c.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      ex.run(model);
      c.barrier();
      const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (c.rank() == 0) best = std::min(best, t);
    }
  });
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::string kind, svg_path;
  int p = 0, m = 0, v = 2;
  bool have_v = false, list_ops = false;
  double execute_ms = 0;
  int steps = 5, activation = 65536;
  lp::op_costs costs;
  lp::svg_options svg;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string_view a = argv[i];
      if (a == "--help" || a == "-h") {
        std::cout << usage;
        return 0;
      }
      if (a == "--ops") {
        list_ops = true;
        continue;
      }
      if (i + 1 >= argc) throw bad_args{std::string(a) + " needs a value"};
      const std::string_view val = argv[++i];
      if (a == "--schedule") kind = val;
      else if (a == "-p") p = to_int(a, val);
      else if (a == "-m") m = to_int(a, val);
      else if (a == "-v") v = to_int(a, val), have_v = true;
      else if (a == "--fwd-cost") costs.forward = to_double(a, val);
      else if (a == "--bwd-cost") costs.backward = to_double(a, val);
      else if (a == "--comm-cost") costs.communication = to_double(a, val);
      else if (a == "--svg") svg_path = val;
      else if (a == "--svg-scale") svg.px_per_time = to_double(a, val);
      else if (a == "--execute") execute_ms = to_double(a, val);
      else if (a == "--activation") activation = to_int(a, val);
      else if (a == "--steps") steps = to_int(a, val);
      else throw bad_args{"unknown argument '" + std::string(a) + "'"};
    }
    if (kind.empty()) throw bad_args{"--schedule is required"};
    if (p == 0 || m == 0) throw bad_args{"-p and -m are required"};
    if (execute_ms < 0 || activation < 1 || steps < 1)
      throw bad_args{"--execute must be >= 0, --activation and --steps >= 1"};
    if (have_v && kind != "interleaved") throw bad_args{"-v applies to --schedule interleaved only"};
    lp::schedule s;
    if (kind == "gpipe") s = lp::gpipe(p, m);
    else if (kind == "1f1b") s = lp::one_f_one_b(p, m);
    else if (kind == "interleaved") s = lp::interleaved_one_f_one_b(p, m, v);
    else throw bad_args{"unknown schedule '" + kind + "' (gpipe, 1f1b or interleaved)"};
    const lp::simulation r = lp::simulate(s, costs);

    if (list_ops)
      for (int st = 0; st < s.stages; ++st) {
        std::cout << "stage " << st << ':';
        for (const auto& o : s.ops[static_cast<std::size_t>(st)]) std::cout << "\n  " << o;
        std::cout << '\n';
      }
    std::cout << lp::render_ascii(r) << '\n' << r.report();
    if (r.ok()) {
      // The closed forms of Narayanan et al. 2021, for comparison (uniform stages).
      const double pm1 = p - 1;
      const int chunks = kind == "interleaved" ? v : 1;
      std::printf("closed form: bubble/busy (p-1)/(v m) = %.6g, idle/total (p-1)/(v m + p-1) = %.6g\n",
                  pm1 / (chunks * double(m)), pm1 / (chunks * double(m) + pm1));
    }
    if (!svg_path.empty()) {
      std::ofstream f(svg_path);
      f << lp::render_svg(r, svg);
      if (!f) throw loom::error("cannot write --svg file '" + svg_path + "'");
      std::cout << "wrote " << svg_path << '\n';
    }
    if (r.ok() && execute_ms > 0) {
      const double t = execute(s, costs, execute_ms, static_cast<std::size_t>(activation), steps);
      std::printf("executed on %d thread ranks (thread_comm), 1 time unit = %g ms, %d floats per transfer:\n"
                  "  measured step %.2f ms, simulated %.2f ms, overhead %.1f%% (best of %d steps)\n",
                  s.stages, execute_ms, activation, t, r.total_time * execute_ms,
                  100.0 * (t / (r.total_time * execute_ms) - 1.0), steps);
    }
    return r.ok() ? 0 : 1;
  } catch (const bad_args& e) {
    std::cerr << "loom-pipeline-plan: " << e.what << '\n' << usage;
    return 2;
  } catch (const loom::error& e) {
    std::cerr << "loom-pipeline-plan: " << e.what() << '\n' << usage;
    return 2;
  }
}
