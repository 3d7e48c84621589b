// IEEE half (float16, as uint16_t bits) <-> float32 in software, for the native kernels'
// portable loops and scalar paths (qkernels.cc: scales and minimums; attention.cc: a
// float16 KV cache). Vector paths convert 16 at once with F16C / AVX-512 instead.

#pragma once

#include <cstdint>
#include <cstring>

namespace specsamp {

// Exact (every half is a float).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1f,
                 mant = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant x 2^-24, exact in float
    const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  const uint32_t bits =
      sign | (exp == 31 ? 0x7f800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Rounded to nearest, ties to even; from 65520 on: infinity; nan stays nan.
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000;
  x &= 0x7fffffffu;
  if (x >= 0x47800000u) return sign | (x > 0x7f800000u ? 0x7e00 : 0x7c00);  // >= 65536, inf, nan
  if (x < 0x38800000u) {  // below 2^-14: a subnormal half; the float addition rounds
    float a;
    std::memcpy(&a, &x, sizeof a);
    a += 0.5f;  // the last mantissa bit of 0.5 weighs 2^-24, a half subnormal's step
    uint32_t y;
    std::memcpy(&y, &a, sizeof y);
    return sign | static_cast<uint16_t>(y - 0x3f000000u);
  }
  x += 0xc8000fffu + ((x >> 13) & 1);  // rebias the exponent (15 - 127), round to even
  return sign | static_cast<uint16_t>(x >> 13);
}

}  // namespace specsamp
