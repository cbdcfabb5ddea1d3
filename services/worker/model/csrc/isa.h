// The instruction set every kernel in this library runs with: the best this CPU has, at most the one
// STRATA_NATIVE_ISA names ("avx2" or "portable"), so tests can run each kernel's every code path on
// one machine. Read once per process, at the first call.

#pragma once

#include <cstdlib>
#include <cstring>

namespace strata {

enum class Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

inline Isa detected_isa() {
  __builtin_cpu_init();
  // AVX-512 here means F with BW and VL (masked byte loads), which every AVX-512 server CPU has.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return Isa::kAvx512;
  // AVX2 here comes with FMA and F16C, as on every AVX2 CPU made.
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::kAvx2;
  return Isa::kPortable;
}

inline Isa chosen_isa() {
  static const Isa isa = [] {
    const Isa detected = detected_isa();
    const char* cap = std::getenv("STRATA_NATIVE_ISA");
    if (cap == nullptr) return detected;
    if (std::strcmp(cap, "portable") == 0) return Isa::kPortable;
    if (std::strcmp(cap, "avx2") == 0 && detected != Isa::kPortable) return Isa::kAvx2;
    return detected;
  }();
  return isa;
}

// Whether the CPU has AVX-512 VNNI (dpbusd: Cascade Lake, Ice Lake and later, Zen 4), which kernels
// of the AVX-512 instruction set may use beside it.
inline bool has_avx512_vnni() {
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  return vnni;
}

}  // namespace strata
