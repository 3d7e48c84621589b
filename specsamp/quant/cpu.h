// The vector instruction set the native kernels (qkernels.cc, attention.cc) may use.

#pragma once

#include <cstdlib>
#include <cstring>

namespace specsamp {

// 2: AVX-512, 1: AVX2 (with FMA), 0: portable loops. SPECSAMP_ISA=portable|avx2|avx512
// caps it (the tests run the other paths on an AMX / AVX-512 machine this way).
inline int isa() {
  static const int level = [] {
    int best = 0;
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = 1;
    if (best && __builtin_cpu_supports("avx512f")) best = 2;
#endif
    const char* cap = std::getenv("SPECSAMP_ISA");
    if (cap && std::strcmp(cap, "portable") == 0) best = 0;
    if (cap && std::strcmp(cap, "avx2") == 0 && best > 1) best = 1;
    return best;
  }();
  return level;
}

// Whether the AVX-512 path may use VNNI byte products (a8.h, 8-bit activations).
inline bool vnni() {
  static const bool on = [] {
#if defined(__x86_64__) || defined(_M_X64)
    return isa() == 2 && __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
  }();
  return on;
}

bool amx_available();  // qkernels.cc (amx.h): the CPU has AMX and the OS grants it

// Whether weights may take the tile layout and the tile unit (amx.h): AVX-512, AMX, and
// SPECSAMP_ISA not capping below it.
inline bool amx_enabled() {
  static const bool on = [] {
    const char* cap = std::getenv("SPECSAMP_ISA");
    return isa() == 2 && !(cap && *cap && std::strcmp(cap, "amx") != 0) && amx_available();
  }();
  return on;
}

}  // namespace specsamp
