#include "core/cpu_features.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#ifdef KVCODEC_HAVE_AVX2_PATHS
#include <cpuid.h>
#endif

namespace kvcodec {

namespace {

// KVCODEC_SIMD's verdict: true unless it asks for the plain paths.
bool env_allows_simd() {
  const char* v = std::getenv("KVCODEC_SIMD");
  if (!v || !*v || !std::strcmp(v, "auto") || !std::strcmp(v, "on") || !std::strcmp(v, "1")) return true;
  if (!std::strcmp(v, "off") || !std::strcmp(v, "0")) return false;
  std::fprintf(stderr, "kvcodec: KVCODEC_SIMD=%s is not one of auto, on, 1, off, 0: using the plain paths\n", v);
  return false;
}

std::atomic<bool>& simd_flag() {
  static std::atomic<bool> flag{cpu_has_avx2_paths() && env_allows_simd()};
  return flag;
}

}  // namespace

bool cpu_has_avx2_paths() {
#ifdef KVCODEC_HAVE_AVX2_PATHS
  static const bool has = [] {
    __builtin_cpu_init();
    // F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports
    // does not know "f16c".
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
    return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("popcnt") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
  }();
  return has;
#else
  return false;
#endif
}

bool cpu_has_vnni_paths() {
#ifdef KVCODEC_HAVE_AVX2_PATHS
  // libgcc's checks include the OS's AVX-512 state (XCR0), which EVEX
  // instructions need even on 256-bit registers.
  static const bool has = [] {
    __builtin_cpu_init();
    return cpu_has_avx2_paths() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  }();
  return has;
#else
  return false;
#endif
}

namespace {
std::atomic<bool>& vnni_flag() {
  static std::atomic<bool> flag{cpu_has_vnni_paths()};
  return flag;
}
}  // namespace

bool simd_avx2() { return simd_flag().load(std::memory_order_relaxed); }

bool simd_vnni() { return simd_avx2() && vnni_flag().load(std::memory_order_relaxed); }

bool set_simd_vnni(bool on) { return vnni_flag().exchange(on && cpu_has_vnni_paths(), std::memory_order_relaxed); }

bool set_simd_avx2(bool on) { return simd_flag().exchange(on && cpu_has_avx2_paths(), std::memory_order_relaxed); }

}  // namespace kvcodec
