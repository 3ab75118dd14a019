// API-key authentication of `kvcodec serve` (--api-key, DESIGN 10): when a
// key is set, every request but /health and the dashboard page needs
// `Authorization: Bearer KEY`; a server bound beyond loopback must have one.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace kvcodec::server {

// Whether `host` (a --host value) only accepts connections from this
// machine: localhost, 127.0.0.0/8, ::1.
bool is_loopback_host(const std::string& host);

// Equality whose time depends only on the lengths, not on where the bytes
// differ (a key is not guessed byte by byte from response times).
bool constant_time_equal(std::string_view a, std::string_view b);

// Checks an Authorization header value against `key`: empty when it grants
// access, else the reason for the 401 (missing header, not Bearer, wrong key).
std::optional<std::string> bearer_refusal(const std::string& authorization, const std::string& key);

// Whether a request path needs the key (all but /health and the dashboard page /).
bool path_needs_key(const std::string& path);

// Start-up rule: throws Error(kConfig) (exit status 2) naming --host when it
// is not loopback, no key is set and insecure_no_api_key is false.
void check_bind_policy(const std::string& host, const std::string& api_key, bool insecure_no_api_key);

}  // namespace kvcodec::server
