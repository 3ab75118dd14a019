// A small blocking Redis client for the prefix store (hiredis underneath).
//
// Every call is bounded: connecting waits at most connect_timeout_ms, each
// command at most command_timeout_ms, so a hung or vanished Redis never
// hangs a request. Any connection error drops the connection and marks the
// client unhealthy; the next call reconnects only once the backoff has
// passed (100 ms, doubling to max_backoff_ms, reset by a success), and calls
// made before that fail at once without touching the network.
//
// Thread-safe: one mutex serialises the connection; healthy() and the
// round-trip counters are atomics, read without waiting behind a call.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

struct redisContext;

namespace kvcodec::server {

struct RedisEndpoint {
  std::string host = "127.0.0.1";
  int port = 6379;
  int connect_timeout_ms = 200;
  int command_timeout_ms = 500;
  int max_backoff_ms = 1000;
};

// "redis://HOST:PORT" (port defaults to 6379). Throws Error(kConfig) naming
// the flag for anything else.
RedisEndpoint parse_redis_url(const std::string& url);

class RedisClient {
 public:
  explicit RedisClient(RedisEndpoint endpoint);
  ~RedisClient();
  RedisClient(const RedisClient&) = delete;
  RedisClient& operator=(const RedisClient&) = delete;

  // Each throws Error(kIo) when Redis cannot be reached or answers with an
  // error (the message says which and why).
  // MGET: one value per key, nullopt where the key is missing.
  std::vector<std::optional<std::string>> get_many(const std::vector<std::string>& keys);
  // SET key value NX: true when written, false when the key already existed.
  bool set_if_absent(const std::string& key, const std::string& value);
  // DEL key (a chunk found corrupt, so a writer can store it again).
  void del(const std::string& key);
  // PING, so start-up can say whether Redis is there.
  void ping();

  bool healthy() const { return healthy_.load(); }
  double mean_rtt_ms() const;
  uint64_t reconnects() const { return reconnects_.load(); }  // successful connections after the first
  const RedisEndpoint& endpoint() const { return ep_; }

 private:
  // Runs one command (argv form, binary-safe); returns the reply through
  // `on_reply` under the lock. Throws Error(kIo).
  template <class OnReply>
  void command(const std::vector<std::string>& argv, OnReply&& on_reply);
  void connect_locked();
  void drop_locked(const std::string& why);

  RedisEndpoint ep_;
  std::mutex mu_;
  redisContext* ctx_ = nullptr;
  std::chrono::steady_clock::time_point next_attempt_{};
  int backoff_ms_ = 0;
  bool ever_connected_ = false;
  std::string last_error_;
  std::atomic<bool> healthy_{false};
  std::atomic<uint64_t> reconnects_{0}, rtt_count_{0}, rtt_us_sum_{0};
};

}  // namespace kvcodec::server
