// The C API's boundary: every exported function runs its body through
// guarded(), so no C++ exception crosses into C, and every failure leaves a
// status and a thread-local message (kvcodec_last_error()).
#pragma once

#include <exception>
#include <new>
#include <string>

#include "kvcodec/error.hpp"
#include "kvcodec/kvcodec.h"

namespace kvcodec::capi {

// A failure only the C API reports (KVCODEC_ERROR_BUFFER_TOO_SMALL).
class CapiError : public std::runtime_error {
 public:
  CapiError(kvcodec_status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  kvcodec_status status() const { return status_; }

 private:
  kvcodec_status status_;
};

// Sets this thread's last error message and returns status.
kvcodec_status fail(kvcodec_status status, const std::string& message) noexcept;

// Throws Error(kInvalidArgument) "<name> is NULL" when p is null.
void require(const void* p, const char* name);

// Runs body (returning void); maps kvcodec::Error to its code, bad_alloc to
// KVCODEC_ERROR_OUT_OF_MEMORY, anything else to KVCODEC_ERROR_INTERNAL. The
// message starts with the C function's name.
template <typename Body>
kvcodec_status guarded(const char* function, Body&& body) noexcept {
  try {
    body();
    return KVCODEC_OK;
  } catch (const CapiError& e) {
    return fail(e.status(), std::string(function) + ": " + e.what());
  } catch (const Error& e) {
    return fail(static_cast<kvcodec_status>(static_cast<int>(e.code())), std::string(function) + ": " + e.what());
  } catch (const std::bad_alloc&) {
    return fail(KVCODEC_ERROR_OUT_OF_MEMORY, std::string(function) + ": out of memory");
  } catch (const std::exception& e) {
    return fail(KVCODEC_ERROR_INTERNAL, std::string(function) + ": " + e.what());
  } catch (...) {
    return fail(KVCODEC_ERROR_INTERNAL, std::string(function) + ": unknown exception");
  }
}

}  // namespace kvcodec::capi
