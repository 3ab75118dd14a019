// kvcodec: error types.
//
// Every failure the library reports is a kvcodec::Error carrying a stable
// numbered code (as zstd does) and a message that names what is wrong: the
// field, the value and what was allowed, or the file and the offset.
#pragma once

#include <stdexcept>
#include <string>

namespace kvcodec {

// Stable numbers: never renumber, only append.
enum class ErrorCode : int {
  kInvalidArgument = 1,   // a caller passed something out of range
  kConfig = 2,            // a configuration field is invalid (names field, value, range)
  kFormat = 3,            // malformed or corrupted bytes (file, container, stream)
  kChecksum = 4,          // a checksum did not match
  kIo = 5,                // the operating system refused a read or write
  kUnsupported = 6,       // a valid request the method cannot serve (e.g. head_dim)
  kShapeMismatch = 7,     // tensors or files of incompatible shapes
  kNotFound = 8,          // a named tensor, file or key is missing
  kInternal = 9,          // a broken invariant: a bug in kvcodec
};

const char* error_code_name(ErrorCode code) noexcept;

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// Throws Error(kConfig) with the uniform message
// "<field> = <value>: <allowed>" so every configuration error reads alike.
[[noreturn]] void throw_config_error(const std::string& field, const std::string& value,
                                     const std::string& allowed);

}  // namespace kvcodec
