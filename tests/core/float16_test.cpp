// half and bfloat16 conversions, checked exhaustively over all 65,536 bit patterns against
// independent references: the compiler's _Float16 (libgcc / F16C conversions) and a
// field-by-field decoding with ldexp, and for rounding a nearest-candidate search in double.
#include <loom/core/float16.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>

namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Reference decoding from the fields: (-1)^s * 2^(e-bias) * (1 + m / 2^mbits), subnormals without the 1.
double decode(std::uint32_t bits, int ebits, int mbits) {
  const std::uint32_t s = bits >> (ebits + mbits), e = (bits >> mbits) & ((1u << ebits) - 1),
                      m = bits & ((1u << mbits) - 1);
  const int bias = (1 << (ebits - 1)) - 1;
  const double sign = s ? -1.0 : 1.0;
  if (e == (1u << ebits) - 1)
    return m ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), 1 - bias - mbits);
  return sign * std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -mbits), static_cast<int>(e) - bias);
}

// Reference rounding of a float to a 16-bit format by searching the two neighbouring
// representable values in double arithmetic; ties go to the even mantissa. Overflow is
// decided against the value one step past the largest finite number, as IEEE 754 specifies.
std::uint16_t round_reference(float f, int ebits, int mbits) {
  if (std::isnan(f)) return 0xffff;  // marker: caller checks NaN-ness only
  const std::uint32_t sign = std::signbit(f) ? 1u << (ebits + mbits) : 0u;
  const double a = std::fabs(static_cast<double>(f));
  const std::uint32_t inf_bits = ((1u << ebits) - 1) << mbits;
  // Largest pattern whose magnitude <= a (binary search over the ordered magnitudes).
  std::uint32_t lo = 0, hi = inf_bits;  // magnitudes are increasing in the bit pattern
  const int bias = (1 << (ebits - 1)) - 1;
  auto value = [&](std::uint32_t b) {
    if (b == inf_bits) return std::ldexp(1.0, bias + 1);  // one step past the largest finite
    return decode(b, ebits, mbits);
  };
  if (a >= value(inf_bits)) return static_cast<std::uint16_t>(sign | inf_bits);
  while (lo + 1 < hi) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (value(mid) <= a) lo = mid; else hi = mid;
  }
  if (value(hi) <= a) lo = hi;  // hi can only be reached when a equals it exactly
  const std::uint32_t up = lo + 1;
  const double dlo = a - value(lo), dup = value(up) - a;
  std::uint32_t r = lo;
  if (dup < dlo || (dup == dlo && (lo & 1u))) r = up;
  return static_cast<std::uint16_t>(sign | r);
}

}  // namespace

TEST_CASE("half -> float: all 65536 patterns equal _Float16 and the field decoding") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float ours = loom::half::from_bits(static_cast<std::uint16_t>(b));
    _Float16 ref;
    const auto b16 = static_cast<std::uint16_t>(b);
    std::memcpy(&ref, &b16, 2);
    const double dec = decode(b, 5, 10);
    if (std::isnan(dec)) {
      REQUIRE(std::isnan(ours));
      REQUIRE(std::isnan(static_cast<float>(ref)));
      continue;
    }
    REQUIRE(bits_of(ours) == bits_of(static_cast<float>(ref)));
    REQUIRE(static_cast<double>(ours) == dec);
    REQUIRE(std::signbit(ours) == ((b & 0x8000u) != 0));
  }
}

TEST_CASE("float -> half: exact values, midpoints and their neighbours round to nearest even") {
  long checked = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float v = loom::half::from_bits(static_cast<std::uint16_t>(b));
    if (std::isnan(v)) {
      REQUIRE(std::isnan(static_cast<float>(loom::half(v))));
      continue;
    }
    // Candidates: the value itself, the midpoint to the next pattern, and one float ulp around it.
    const float next = ((b & 0x7fffu) < 0x7c00u) ? static_cast<float>(loom::half::from_bits(static_cast<std::uint16_t>(b + 1))) : v;
    float probes[6] = {v, v, v, v, v, v};
    if (std::isfinite(next) && std::isfinite(v)) {
      const float mid = static_cast<float>((static_cast<double>(v) + static_cast<double>(next)) / 2);
      probes[1] = mid;
      probes[2] = std::nextafter(mid, 0.f);
      probes[3] = std::nextafter(mid, std::copysign(std::numeric_limits<float>::infinity(), mid));
      probes[4] = float_of(bits_of(v) + 1);
      probes[5] = std::nextafter(next, 0.f);
    }
    for (float f : probes) {
      const loom::half h(f);
      _Float16 ref = static_cast<_Float16>(f);
      std::uint16_t ref_bits;
      std::memcpy(&ref_bits, &ref, 2);
      REQUIRE_MESSAGE(h.bits == ref_bits, "f=", f, " bits=", bits_of(f));
      REQUIRE(h.bits == round_reference(f, 5, 10));
      ++checked;
    }
  }
  CHECK(checked > 6 * 60000);
  // Overflow, underflow and the largest finite value.
  CHECK(loom::half(65504.f).bits == 0x7bff);
  CHECK(loom::half(65519.99f).bits == 0x7bff);
  CHECK(loom::half(65520.f).bits == 0x7c00);
  CHECK(loom::half(-1e10f).bits == 0xfc00);
  CHECK(loom::half(std::ldexp(1.f, -25)).bits == 0x0000);                         // tie -> even (0)
  CHECK(loom::half(std::nextafter(std::ldexp(1.f, -25), 1.f)).bits == 0x0001);  // just above -> min subnormal
  CHECK(loom::half(-0.f).bits == 0x8000);
  CHECK(loom::half(std::numeric_limits<float>::denorm_min()).bits == 0);
}

TEST_CASE("bfloat16 <-> float: all patterns, exact values, midpoints, neighbours and random low bits") {
  std::uint32_t lcg = 12345;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float v = loom::bfloat16::from_bits(static_cast<std::uint16_t>(b));
    const double dec = decode(b, 8, 7);
    if (std::isnan(dec)) {
      REQUIRE(std::isnan(v));
      REQUIRE(std::isnan(static_cast<float>(loom::bfloat16(v))));
      continue;
    }
    REQUIRE(static_cast<double>(v) == dec);
    lcg = lcg * 1664525u + 1013904223u;
    for (std::uint32_t low : {0u, 1u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, lcg & 0xffffu}) {
      const float f = float_of((b << 16) | low);
      if (std::isnan(f)) {
        REQUIRE(std::isnan(static_cast<float>(loom::bfloat16(f))));
        continue;
      }
      REQUIRE_MESSAGE(loom::bfloat16(f).bits == round_reference(f, 8, 7), "f bits=", (b << 16) | low);
    }
  }
  CHECK(loom::bfloat16(std::numeric_limits<float>::max()).bits == 0x7f80);  // rounds past the largest finite
  CHECK(loom::bfloat16(1.f).bits == 0x3f80);
}

TEST_CASE("half and bfloat16 are constexpr and convert implicitly through float") {
  static_assert(loom::half(1.0f).bits == 0x3c00);
  static_assert(loom::bfloat16(-2.0f).bits == 0xc000);
  loom::half a = 1.5f, b = 2.25f;
  CHECK(static_cast<float>(a) + static_cast<float>(b) == 3.75f);
  CHECK(a < b);
}
