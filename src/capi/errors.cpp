// kvcodec_version, status names and the thread-local last error message.
#include <cstring>

#include "capi/guard.hpp"

namespace kvcodec::capi {
namespace {

thread_local std::string last_error_message;

// The C numbers 1-9 are kvcodec::ErrorCode's, by definition (kvcodec.h).
static_assert(int(KVCODEC_ERROR_INVALID_ARGUMENT) == int(ErrorCode::kInvalidArgument));
static_assert(int(KVCODEC_ERROR_CONFIG) == int(ErrorCode::kConfig));
static_assert(int(KVCODEC_ERROR_FORMAT) == int(ErrorCode::kFormat));
static_assert(int(KVCODEC_ERROR_CHECKSUM) == int(ErrorCode::kChecksum));
static_assert(int(KVCODEC_ERROR_IO) == int(ErrorCode::kIo));
static_assert(int(KVCODEC_ERROR_UNSUPPORTED) == int(ErrorCode::kUnsupported));
static_assert(int(KVCODEC_ERROR_SHAPE_MISMATCH) == int(ErrorCode::kShapeMismatch));
static_assert(int(KVCODEC_ERROR_NOT_FOUND) == int(ErrorCode::kNotFound));
static_assert(int(KVCODEC_ERROR_INTERNAL) == int(ErrorCode::kInternal));

}  // namespace

kvcodec_status fail(kvcodec_status status, const std::string& message) noexcept {
  try {
    last_error_message = message;
  } catch (...) {
    last_error_message.clear();  // no memory for the message: the status still tells
  }
  return status;
}

void require(const void* p, const char* name) {
  if (p == nullptr) throw Error(ErrorCode::kInvalidArgument, std::string(name) + " is NULL");
}

}  // namespace kvcodec::capi

extern "C" {

KVCODEC_API const char* kvcodec_version(void) {
#define KVCODEC_STR2(x) #x
#define KVCODEC_STR(x) KVCODEC_STR2(x)
  return KVCODEC_STR(KVCODEC_VERSION_MAJOR) "." KVCODEC_STR(KVCODEC_VERSION_MINOR) "." KVCODEC_STR(
      KVCODEC_VERSION_PATCH);
#undef KVCODEC_STR
#undef KVCODEC_STR2
}

KVCODEC_API unsigned kvcodec_version_number(void) { return KVCODEC_VERSION_NUMBER; }

KVCODEC_API const char* kvcodec_status_name(int status) {
  switch (status) {
    case KVCODEC_OK: return "ok";
    case KVCODEC_ERROR_BUFFER_TOO_SMALL: return "buffer too small";
    case KVCODEC_ERROR_OUT_OF_MEMORY: return "out of memory";
    default:
      if (status >= 1 && status <= int(KVCODEC_ERROR_INTERNAL))
        return kvcodec::error_code_name(static_cast<kvcodec::ErrorCode>(status));
      return "unknown error";
  }
}

KVCODEC_API const char* kvcodec_last_error(void) { return kvcodec::capi::last_error_message.c_str(); }

}  // extern "C"
