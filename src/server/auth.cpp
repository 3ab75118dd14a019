#include "server/auth.hpp"

#include <arpa/inet.h>

#include <algorithm>

#include "kvcodec/error.hpp"

namespace kvcodec::server {

bool is_loopback_host(const std::string& host) {
  if (host == "localhost" || host == "::1") return true;
  in_addr a{};
  if (inet_pton(AF_INET, host.c_str(), &a) == 1) return (ntohl(a.s_addr) >> 24) == 127;
  return false;
}

bool constant_time_equal(std::string_view a, std::string_view b) {
  // Every byte of the longer string is visited; a length difference counts as a mismatch.
  const size_t n = std::max(a.size(), b.size());
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= unsigned(x ^ y);
  }
  return diff == 0;
}

std::optional<std::string> bearer_refusal(const std::string& authorization, const std::string& key) {
  if (authorization.empty())
    return "this server needs an API key: send the header 'Authorization: Bearer <key>'";
  constexpr std::string_view scheme = "Bearer ";
  if (authorization.size() < scheme.size() || authorization.compare(0, scheme.size(), scheme) != 0)
    return "the Authorization header must be 'Bearer <key>'";
  if (!constant_time_equal(std::string_view(authorization).substr(scheme.size()), key))
    return "incorrect API key";
  return std::nullopt;
}

bool path_needs_key(const std::string& path) { return path != "/health" && path != "/"; }

void check_bind_policy(const std::string& host, const std::string& api_key, bool insecure_no_api_key) {
  if (is_loopback_host(host) || !api_key.empty() || insecure_no_api_key) return;
  throw_config_error("--host", host,
                     "a loopback address (127.0.0.1, ::1, localhost) unless an API key is set (--api-key or "
                     "KVCODEC_API_KEY); --insecure-no-api-key binds it without one");
}

}  // namespace kvcodec::server
