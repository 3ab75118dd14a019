// Whether this test build is optimized and uninstrumented, so that time
// bounds hold: sanitizer builds (5-15x slower) still run every check of a
// timed test but only print its times.
#pragma once

namespace kvcodec::testing {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kTimedBuild = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kTimedBuild = false;
#else
inline constexpr bool kTimedBuild = true;
#endif
#else
inline constexpr bool kTimedBuild = true;
#endif

}  // namespace kvcodec::testing
