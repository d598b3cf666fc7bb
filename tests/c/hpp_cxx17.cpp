// rdist.hpp compiles on its own as C++17 (nothing included before it) and
// links into two translation units (hpp_cxx17_other.cpp) without duplicate
// symbols. Checks what needs no other rank: float16 / bfloat16 conversions
// (exhaustively), dtype deduction, span, Options, Request, Error.
#include "rdist.hpp"

#include <cmath>
#include <cstdio>
#include <limits>

int other_translation_unit(rdist::Comm& comm);  // hpp_cxx17_other.cpp

namespace {

int failures = 0;
#define EXPECT(cond)                                                       \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      if (++failures > 20) std::exit(2);                                   \
    }                                                                      \
  } while (0)

static_assert(rdist::dtype_v<float> == RDIST_FLOAT32 && rdist::dtype_v<const double> == RDIST_FLOAT64);
static_assert(rdist::dtype_v<std::int8_t> == RDIST_INT8 && rdist::dtype_v<std::uint8_t> == RDIST_UINT8);
static_assert(rdist::dtype_v<std::int32_t> == RDIST_INT32 && rdist::dtype_v<std::uint32_t> == RDIST_UINT32);
static_assert(rdist::dtype_v<std::int64_t> == RDIST_INT64 && rdist::dtype_v<std::uint64_t> == RDIST_UINT64);
static_assert(rdist::dtype_v<rdist::float16> == RDIST_FLOAT16 && rdist::dtype_v<rdist::bfloat16> == RDIST_BFLOAT16);
static_assert(std::is_trivial_v<rdist::float16> && std::is_trivial_v<rdist::bfloat16>);
static_assert(!std::is_copy_constructible_v<rdist::Comm> && std::is_nothrow_move_constructible_v<rdist::Comm>);
static_assert(!std::is_copy_constructible_v<rdist::Request> && std::is_nothrow_move_constructible_v<rdist::Request>);
static_assert(!std::is_copy_constructible_v<rdist::Options> && std::is_nothrow_move_constructible_v<rdist::Options>);
static_assert(!std::is_convertible_v<float, rdist::float16>, "lossy conversion is explicit");
static_assert(std::is_convertible_v<rdist::float16, float>, "exact conversion is implicit");
static_assert(std::is_base_of_v<std::runtime_error, rdist::Error>);

float f32(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
std::uint32_t bits32(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Every finite value of a 16-bit format round-trips through float, and
// floats round to nearest, ties to even: at each midpoint between
// neighbours, and one float ulp either side of it.
template <class H>
void check_format() {
  for (std::uint32_t b = 0; b < 0x10000; b++) {
    const H h = H::from_bits(static_cast<std::uint16_t>(b));
    const float f = h;
    if (std::isnan(f)) {
      EXPECT(std::isnan(static_cast<float>(H(f))));
      continue;
    }
    EXPECT(H(f).bits == h.bits);
    if (std::isinf(f) || (b & 0x7fffu) == 0x7fffu) continue;
    const H next = H::from_bits(static_cast<std::uint16_t>(b + 1));  // next in magnitude
    const float g = next;
    if (std::isnan(g) || std::isinf(g)) continue;
    const float mid = f + (g - f) / 2;  // exact: 16-bit formats have few significand bits
    const H even = (h.bits & 1u) == 0 ? h : next;
    EXPECT(H(mid).bits == even.bits);
    if (f != 0 || (b & 0x8000u) == 0) {
      EXPECT(H(std::nextafter(mid, f)).bits == h.bits);
    }
    EXPECT(H(std::nextafter(mid, g)).bits == next.bits);
  }
}

}  // namespace

int main() {
  check_format<rdist::float16>();
  check_format<rdist::bfloat16>();
  EXPECT(rdist::float16(1.0f).bits == 0x3c00 && rdist::float16(-2.0f).bits == 0xc000);
  EXPECT(rdist::float16(65504.0f).bits == 0x7bff && rdist::float16(65520.0f).bits == 0x7c00);  // max, then inf
  EXPECT(rdist::float16(f32(0x33000000)).bits == 0 && rdist::float16(f32(0x33000001)).bits == 1);  // 2^-25
  EXPECT(rdist::float16(std::numeric_limits<float>::infinity()).bits == 0x7c00);
  EXPECT(rdist::bfloat16(1.0f).bits == 0x3f80 && rdist::bfloat16(f32(0x3f808000)).bits == 0x3f80);
  EXPECT(rdist::bfloat16(f32(0x3f818000)).bits == 0x3f82 && bits32(rdist::bfloat16::from_bits(0x4049)) == 0x40490000);
  EXPECT(std::isnan(static_cast<float>(rdist::bfloat16(std::numeric_limits<float>::quiet_NaN()))));

  // span: from pointer + size, arrays, vectors, const conversion, deduction
  std::vector<int> v{1, 2, 3};
  int arr[4] = {};
  rdist::span<int> s(v);
  rdist::span<const int> cs = s;
  rdist::span deduced(arr);
  const std::vector<int>& cv = v;
  rdist::span from_const(cv);
  static_assert(std::is_same_v<decltype(deduced), rdist::span<int>>);
  static_assert(std::is_same_v<decltype(from_const), rdist::span<const int>>);
  static_assert(!std::is_constructible_v<rdist::span<int>, const std::vector<int>&>);
  static_assert(!std::is_constructible_v<rdist::span<int>, std::vector<int>&&>);
  EXPECT(cs.size() == 3 && cs[2] == 3 && deduced.size() == 4 && s.subspan(1, 2)[0] == 2);
  EXPECT(from_const.size_bytes() == 3 * sizeof(int) && !cs.empty() && rdist::span<float>().empty());

  // Options: chaining, and errors as rdist::Error with the library's text
  rdist::Options opts;
  opts.set("timeout_ms", 5000).set("debug", "WARN");
  rdist::Options chained = rdist::Options().set("transport", "tcp");
  EXPECT(opts.capi() != nullptr && chained.capi() != nullptr);
  try {
    opts.set("timeout_ms", "soon");
    EXPECT(false);
  } catch (const rdist::Error& e) {
    EXPECT(e.code() == RDIST_ERR_INVALID_ARGUMENT);
    EXPECT(std::string(e.what()).find("timeout_ms") != std::string::npos);
  }

  // empty handles: a Request is complete, a Comm refuses work
  rdist::Request none;
  EXPECT(!none && none.test());
  none.wait();
  rdist::Comm empty;
  EXPECT(!empty && empty.capi() == nullptr);
  EXPECT(other_translation_unit(empty) == RDIST_ERR_INVALID_ARGUMENT);
  rdist::Group group;
  group.end();
  try {
    group.end();
    EXPECT(false);
  } catch (const rdist::Error& e) {
    EXPECT(e.code() == RDIST_ERR_INVALID_USAGE);
  }

  if (failures != 0) return 1;
  std::printf("rdist.hpp standalone: ok\n");
  return 0;
}
