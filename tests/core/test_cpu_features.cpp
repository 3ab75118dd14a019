// The run-time choice of the AVX2 paths (core/cpu_features.hpp): the
// environment decides at first use, tests can switch for a scope, and the
// AVX2 paths never run on a CPU without them.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "core/cpu_features.hpp"

using namespace kvcodec;

namespace {

TEST(CpuFeatures, EnvironmentDecidesAtFirstUse) {
  // scripts/test.sh runs the suite once with KVCODEC_SIMD=off.
  const char* env = std::getenv("KVCODEC_SIMD");
  // Anything but unset, empty, auto, on or 1 means off (an unknown value is reported on stderr).
  const bool off = env && *env && std::strcmp(env, "auto") && std::strcmp(env, "on") && std::strcmp(env, "1");
  EXPECT_EQ(simd_avx2(), cpu_has_avx2_paths() && !off) << "KVCODEC_SIMD=" << (env ? env : "(unset)");
}

TEST(CpuFeatures, ScopedSwitchRestoresAndNeverExceedsTheCpu) {
  const bool before = simd_avx2();
  {
    ScopedSimd plain(false);
    EXPECT_FALSE(simd_avx2());
    {
      ScopedSimd on(true);
      EXPECT_EQ(simd_avx2(), cpu_has_avx2_paths());
    }
    EXPECT_FALSE(simd_avx2());
  }
  EXPECT_EQ(simd_avx2(), before);
#ifndef KVCODEC_HAVE_AVX2_PATHS
  EXPECT_FALSE(cpu_has_avx2_paths());
#endif
}

}  // namespace
