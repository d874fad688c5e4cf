#pragma once
// Pictures of a simulated schedule: SVG for documents, ASCII for terminals.
//
// Both draw the timeline of a pipeline::simulation the way the figures of the Megatron-LM
// paper (Narayanan et al. 2021) do: one row per stage, time to the right, a box per forward
// (blue) and backward (green) pass labelled with its micro-batch; with v > 1 chunks the shade
// tells the chunk (darker = chunk 0). Idle time is the grey background: the bubble. Transfers
// and the optimizer step are drawn only when they take time. A deadlocked simulation is drawn
// up to where each stage got stuck, which is often the quickest way to see why.
//
// ASCII: one column block per time quantum (the largest step that divides every op's start
// and end, e.g. 1/2 for v = 2), each op a label (F/B, micro-batch, chunk letter a, b, ...)
// followed by '=' up to its length.

#include <loom/pipeline/simulate.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace loom::pipeline {

namespace detail {

/// The label of a compute op: "F3", "B3", with the chunk letter "F3a" when there are chunks.
inline std::string op_label(const op& o, int chunks) {
  if (o.kind == op_kind::optimizer_step) return "opt";
  std::string s(1, o.kind == op_kind::forward ? 'F' : o.kind == op_kind::backward ? 'B' : '~');
  s += std::to_string(o.microbatch);
  if (chunks > 1) s += static_cast<char>('a' + o.chunk % 26);
  return s;
}

inline bool drawn(const timed_op& t) { return t.end > t.start || t.o.kind == op_kind::forward || t.o.kind == op_kind::backward; }

inline std::string fmt(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.4g", x);
  return b;
}

}  // namespace detail

/// The timeline as text: a time ruler, then one line per stage, then the report.
inline std::string render_ascii(const simulation& r) {
  // The quantum: the smallest op duration, divided until every start and end is on its grid.
  double shortest = 0;
  for (const auto& st : r.per_stage)
    for (const auto& t : st.timeline)
      if (t.end > t.start && (shortest == 0 || t.end - t.start < shortest)) shortest = t.end - t.start;
  if (shortest == 0) shortest = 1;
  double q = shortest;
  for (int div = 1; div <= 12; ++div) {
    q = shortest / div;
    bool fits = true;
    for (const auto& st : r.per_stage)
      for (const auto& t : st.timeline)
        for (double x : {t.start, t.end})
          if (std::abs(x / q - std::round(x / q)) > 1e-6) fits = false;
    if (fits) break;
  }
  std::size_t label = 2;
  for (const auto& st : r.per_stage)
    for (const auto& t : st.timeline) label = std::max(label, detail::op_label(t.o, r.chunks).size());
  const std::size_t w = label + 1;  // characters per quantum
  const auto col = [&](double t) { return static_cast<std::size_t>(std::llround(t / q)) * w; };
  const std::size_t width = col(r.total_time);

  std::ostringstream os;
  os << r.name << ": p=" << r.stages << ", m=" << r.microbatches;
  if (r.chunks > 1) os << ", v=" << r.chunks;
  os << "  (F/B = forward/backward of a micro-batch";
  if (r.chunks > 1) os << ", letter = chunk";
  os << "; '=' its length, ' ' idle; " << w << " columns = " << detail::fmt(q) << " time)\n";
  // Ruler: a label at multiples of the smallest of 1, 2, 5, 10, 20, ... time units (or of the
  // quantum when that is larger) that leaves at least 7 columns between labels.
  std::string ruler(width + 8, ' ');
  double step = q;
  for (double nice : {1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0})
    if ((step = std::max(nice, q)) / q * static_cast<double>(w) >= 7) break;
  for (double t = 0; t <= r.total_time + 1e-9; t += step) {
    const std::string txt = detail::fmt(t);
    const std::size_t c = col(t);
    if (c + txt.size() <= ruler.size()) ruler.replace(c, txt.size(), txt);
  }
  os << "time     " << ruler << '\n';
  for (int s = 0; s < r.stages; ++s) {
    std::string row(width, ' ');
    for (const auto& t : r.per_stage[static_cast<std::size_t>(s)].timeline) {
      if (!detail::drawn(t)) continue;
      const std::size_t a = col(t.start), b = std::max(col(t.end), a + w);
      std::string box = detail::op_label(t.o, r.chunks);
      const char fill = is_compute(t.o.kind) ? '=' : '~';
      box.resize(b - a - 1, fill);
      box += ' ';
      if (b > row.size()) row.resize(b, ' ');
      row.replace(a, box.size(), box);
    }
    char head[24];
    std::snprintf(head, sizeof head, "stage %-2d|", s);
    os << head << row << "|\n";
  }
  return os.str();
}

struct svg_options {
  double px_per_time = 0;  ///< horizontal scale; 0 = the shortest pass is 22 px wide
  int row_height = 30;
  std::string title;  ///< empty = schedule name, sizes, total time and bubble
};

/// The timeline as a standalone SVG document.
inline std::string render_svg(const simulation& r, const svg_options& opt = {}) {
  double shortest = 0;
  for (const auto& st : r.per_stage)
    for (const auto& t : st.timeline)
      if (is_compute(t.o.kind) && t.end > t.start && (shortest == 0 || t.end - t.start < shortest)) shortest = t.end - t.start;
  const double px = opt.px_per_time > 0 ? opt.px_per_time : 22.0 / (shortest > 0 ? shortest : 1.0);
  const double left = 70, top = 44, rh = opt.row_height, box_h = rh - 6;
  const double plot_w = std::max(r.total_time, 1e-9) * px;
  const double width = left + plot_w + 20, height = top + rh * r.stages + 64;
  std::string title = opt.title;
  if (title.empty()) {
    std::ostringstream t;
    t << r.name << ": p=" << r.stages << ", m=" << r.microbatches;
    if (r.chunks > 1) t << ", v=" << r.chunks;
    if (r.deadlock)
      t << " - DEADLOCK (drawn up to where each stage is stuck)";
    else
      t << " - total time " << detail::fmt(r.total_time) << ", bubble " << detail::fmt(100 * r.bubble_fraction()) << "%";
    title = t.str();
  }
  // Colour of a pass: blue forward, green backward; chunk c lighter by c / v.
  const auto colour = [&](const op& o) {
    int rgb[3] = {0x1f, 0x5f, 0xb4};
    if (o.kind == op_kind::backward) rgb[0] = 0x2e, rgb[1] = 0x8b, rgb[2] = 0x3e;
    if (o.kind == op_kind::optimizer_step) rgb[0] = 0xe0, rgb[1] = 0x8a, rgb[2] = 0x1e;
    if (!is_compute(o.kind)) rgb[0] = rgb[1] = rgb[2] = 0x99;
    const double light = r.chunks > 1 && is_compute(o.kind) ? 0.55 * o.chunk / (r.chunks - 1) : 0.0;
    char b[8];
    std::snprintf(b, sizeof b, "#%02x%02x%02x", static_cast<int>(rgb[0] + (255 - rgb[0]) * light),
                  static_cast<int>(rgb[1] + (255 - rgb[1]) * light), static_cast<int>(rgb[2] + (255 - rgb[2]) * light));
    return std::string(b);
  };
  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << detail::fmt(width) << "\" height=\"" << detail::fmt(height)
     << "\" viewBox=\"0 0 " << detail::fmt(width) << ' ' << detail::fmt(height)
     << "\" font-family=\"Helvetica, Arial, sans-serif\">\n"
     << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
     << "<text x=\"" << left << "\" y=\"22\" font-size=\"15\" font-weight=\"bold\">" << title << "</text>\n";
  for (int s = 0; s < r.stages; ++s) {
    const double y = top + rh * s;
    os << "<text x=\"" << left - 8 << "\" y=\"" << y + rh / 2 + 4 << "\" font-size=\"13\" text-anchor=\"end\">stage " << s
       << "</text>\n"
       << "<rect x=\"" << left << "\" y=\"" << y + 3 << "\" width=\"" << detail::fmt(plot_w) << "\" height=\"" << box_h
       << "\" fill=\"#e6e6e6\"/>\n";
    for (const auto& t : r.per_stage[static_cast<std::size_t>(s)].timeline) {
      if (!(t.end > t.start)) continue;
      const double x = left + t.start * px, w = (t.end - t.start) * px;
      const bool pass = t.o.kind == op_kind::forward || t.o.kind == op_kind::backward;
      const double h = pass || t.o.kind == op_kind::optimizer_step ? box_h : box_h / 3;
      os << "<rect x=\"" << detail::fmt(x) << "\" y=\"" << detail::fmt(y + 3 + (box_h - h) / 2) << "\" width=\""
         << detail::fmt(w) << "\" height=\"" << detail::fmt(h) << "\" fill=\"" << colour(t.o)
         << "\" stroke=\"white\" stroke-width=\"1\"><title>" << to_string(t.o) << " [" << detail::fmt(t.start) << ", "
         << detail::fmt(t.end) << ")</title></rect>\n";
      if (!pass && t.o.kind != op_kind::optimizer_step) continue;
      const std::string text = pass ? std::to_string(t.o.microbatch) : "opt";
      const double font = std::min(12.0, std::max(7.0, w / (0.62 * static_cast<double>(text.size()) + 0.4)));
      const bool dark = !(r.chunks > 1 && t.o.chunk * 2 >= r.chunks);
      os << "<text x=\"" << detail::fmt(x + w / 2) << "\" y=\"" << detail::fmt(y + rh / 2 + font * 0.36)
         << "\" font-size=\"" << detail::fmt(font) << "\" text-anchor=\"middle\" fill=\"" << (dark ? "white" : "black")
         << "\">" << text << "</text>\n";
    }
  }
  // Time axis: ticks at whole units, labelled every `every` units.
  const double axis_y = top + rh * r.stages + 6;
  const int every = px >= 24 ? 2 : px >= 10 ? 5 : 10;
  os << "<line x1=\"" << left << "\" y1=\"" << axis_y << "\" x2=\"" << detail::fmt(left + plot_w) << "\" y2=\"" << axis_y
     << "\" stroke=\"#444\"/>\n";
  for (int t = 0; t <= static_cast<int>(std::floor(r.total_time + 1e-9)); ++t) {
    const double x = left + t * px;
    const bool labelled = t % every == 0;
    os << "<line x1=\"" << detail::fmt(x) << "\" y1=\"" << axis_y << "\" x2=\"" << detail::fmt(x) << "\" y2=\""
       << axis_y + (labelled ? 6 : 3) << "\" stroke=\"#444\"/>\n";
    if (labelled)
      os << "<text x=\"" << detail::fmt(x) << "\" y=\"" << axis_y + 18 << "\" font-size=\"11\" text-anchor=\"middle\">" << t
         << "</text>\n";
  }
  // Legend.
  double lx = left;
  const double ly = axis_y + 30;
  const auto legend = [&](const std::string& fill, const std::string& text) {
    os << "<rect x=\"" << detail::fmt(lx) << "\" y=\"" << ly << "\" width=\"14\" height=\"14\" fill=\"" << fill << "\"/>\n"
       << "<text x=\"" << detail::fmt(lx + 19) << "\" y=\"" << ly + 11.5 << "\" font-size=\"12\">" << text << "</text>\n";
    lx += 30 + 6.5 * static_cast<double>(text.size());
  };
  for (int c = 0; c < r.chunks; ++c) {
    const std::string suffix = r.chunks > 1 ? " (chunk " + std::to_string(c) + ")" : "";
    legend(colour(op{op_kind::forward, 0, c, -1}), "forward" + suffix);
  }
  for (int c = 0; c < r.chunks; ++c) {
    const std::string suffix = r.chunks > 1 ? " (chunk " + std::to_string(c) + ")" : "";
    legend(colour(op{op_kind::backward, 0, c, -1}), "backward" + suffix);
  }
  legend("#e6e6e6", "idle (bubble)");
  os << "</svg>\n";
  return os.str();
}

}  // namespace loom::pipeline
