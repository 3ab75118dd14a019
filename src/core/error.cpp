#include "kvcodec/error.hpp"

namespace kvcodec {

const char* error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kConfig: return "configuration error";
    case ErrorCode::kFormat: return "format error";
    case ErrorCode::kChecksum: return "checksum mismatch";
    case ErrorCode::kIo: return "I/O error";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kShapeMismatch: return "shape mismatch";
    case ErrorCode::kNotFound: return "not found";
    case ErrorCode::kInternal: return "internal error";
  }
  return "unknown error";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(message), code_(code) {}

void throw_config_error(const std::string& field, const std::string& value,
                        const std::string& allowed) {
  throw Error(ErrorCode::kConfig, field + " = " + value + ": " + allowed);
}

}  // namespace kvcodec
