// Carries exceptions out of OpenMP parallel regions.
//
// An exception that leaves a parallel region ends the process through
// std::terminate (OpenMP allows no other exit). Every iteration's body runs
// through capture(): the first exception any thread throws is kept, later
// iterations still run (their results are discarded by the caller's
// rethrow), and rethrow() after the region throws it on the calling thread.
//
//   FirstException failure;
//   #pragma omp parallel for
//   for (int64_t i = 0; i < n; ++i) failure.capture([&] { body(i); });
//   failure.rethrow();
#pragma once

#include <exception>
#include <mutex>

namespace kvcodec {

class FirstException {
 public:
  template <typename Body>
  void capture(const Body& body) noexcept {
    try {
      body();
    } catch (...) {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (!first_) first_ = std::current_exception();
    }
  }
  bool failed() const noexcept { return bool(first_); }
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::mutex mutex_;
  std::exception_ptr first_;
};

}  // namespace kvcodec
