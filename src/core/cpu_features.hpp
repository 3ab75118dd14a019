// Run-time choice of the x86-64 AVX2/FMA/F16C paths.
//
// The library is compiled for baseline x86-64 (no -march=native in what is
// installed): the functions that use AVX2, FMA or F16C are compiled for
// them alone (KVCODEC_AVX2_BEGIN/END around them, or KVCODEC_TARGET_AVX2
// on one function) and their callers pick them when simd_avx2() says so,
// the plain paths otherwise. Both give the same bits (each dispatched
// function has a test comparing them), so what is encoded does not depend
// on the CPU it ran on.
#pragma once

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
// This build carries the AVX2 paths (chosen at run time).
#define KVCODEC_HAVE_AVX2_PATHS 1
// popcnt and bmi come with every AVX2 CPU (x86-64-v3); the check below
// tests them too.
#define KVCODEC_AVX2_TARGET_LIST "avx2,fma,f16c,popcnt,bmi,bmi2"
#define KVCODEC_TARGET_AVX2 __attribute__((target(KVCODEC_AVX2_TARGET_LIST)))
#if defined(__clang__)
#define KVCODEC_AVX2_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c,popcnt,bmi,bmi2\"))), apply_to = function)")
#define KVCODEC_AVX2_END _Pragma("clang attribute pop")
#else
#define KVCODEC_AVX2_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c,popcnt,bmi,bmi2\")")
#define KVCODEC_AVX2_END _Pragma("GCC pop_options")
#endif
// The AVX2 list plus AVX512-VNNI on 256-bit registers (EVEX: 32 of them),
// for code that runs where simd_vnni() says so (src/kvtc's int16 tiles).
#if defined(__clang__)
#define KVCODEC_VNNI_BEGIN                                                                                 \
  _Pragma(                                                                                                 \
      "clang attribute push(__attribute__((target(\"avx2,fma,f16c,popcnt,bmi,bmi2,avx512f,avx512vl,avx512vnni\"))), apply_to = function)")
#define KVCODEC_VNNI_END _Pragma("clang attribute pop")
#else
#define KVCODEC_VNNI_BEGIN \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c,popcnt,bmi,bmi2,avx512f,avx512vl,avx512vnni\")")
#define KVCODEC_VNNI_END _Pragma("GCC pop_options")
#endif
#endif

namespace kvcodec {

// Whether the CPU (and the operating system, which must save the AVX
// registers) supports every feature the AVX2 paths use. False where this
// build carries no AVX2 paths.
bool cpu_has_avx2_paths();

// Whether the AVX2 paths run: cpu_has_avx2_paths() unless the environment
// variable KVCODEC_SIMD was "off" (or "0") when first asked, or a test
// turned them off. KVCODEC_SIMD "auto", "on", "1" or unset: the CPU
// decides; any other value is reported once on stderr and means off
// (the plain paths give the same results, only slower).
bool simd_avx2();

// Tests: run the AVX2 paths or the plain ones from now on (on = true is
// honoured only where cpu_has_avx2_paths()); returns the previous setting.
bool set_simd_avx2(bool on);

// Whether the CPU (and the OS) run AVX512-VNNI on 256-bit registers
// (avx512vnni + avx512vl): the int16 products' vpdpwssd, a multiply-add
// and an add in one instruction (src/kvtc). False without AVX2 paths.
bool cpu_has_vnni_paths();
// Whether those run: simd_avx2() and cpu_has_vnni_paths(), unless a test
// turned them off (the AVX2 madd then add give the same integers).
bool simd_vnni();
// Tests: the VNNI paths on (where the CPU has them) or off; the previous setting.
bool set_simd_vnni(bool on);

// Tests: the plain paths (or the AVX2 ones, where the CPU has them) for one scope.
class ScopedSimd {
 public:
  explicit ScopedSimd(bool on) : previous_(set_simd_avx2(on)) {}
  ~ScopedSimd() { set_simd_avx2(previous_); }
  ScopedSimd(const ScopedSimd&) = delete;
  ScopedSimd& operator=(const ScopedSimd&) = delete;

 private:
  bool previous_;
};

// Tests: the VNNI paths on or off for one scope (AVX2 as it is).
class ScopedVnni {
 public:
  explicit ScopedVnni(bool on) : previous_(set_simd_vnni(on)) {}
  ~ScopedVnni() { set_simd_vnni(previous_); }
  ScopedVnni(const ScopedVnni&) = delete;
  ScopedVnni& operator=(const ScopedVnni&) = delete;

 private:
  bool previous_;
};

}  // namespace kvcodec
