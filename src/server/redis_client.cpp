#include "server/redis_client.hpp"

#include <hiredis/hiredis.h>

#include <algorithm>

#include "kvcodec/error.hpp"

namespace kvcodec::server {

RedisEndpoint parse_redis_url(const std::string& url) {
  const std::string scheme = "redis://";
  if (url.rfind(scheme, 0) != 0) throw_config_error("--prefix-store", url, "redis://HOST[:PORT]");
  std::string rest = url.substr(scheme.size());
  if (!rest.empty() && rest.back() == '/') rest.pop_back();
  RedisEndpoint ep;
  const size_t colon = rest.rfind(':');
  ep.host = colon == std::string::npos ? rest : rest.substr(0, colon);
  if (ep.host.empty() || ep.host.find_first_of("/@ ") != std::string::npos)
    throw_config_error("--prefix-store", url, "redis://HOST[:PORT] (no user, password or database)");
  if (colon != std::string::npos) {
    const std::string port = rest.substr(colon + 1);
    if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
        std::stoi(port) < 1 || std::stoi(port) > 65535)
      throw_config_error("--prefix-store", url, "a port in [1, 65535]");
    ep.port = std::stoi(port);
  }
  return ep;
}

namespace {
timeval to_timeval(int ms) { return timeval{ms / 1000, (ms % 1000) * 1000}; }
}  // namespace

RedisClient::RedisClient(RedisEndpoint endpoint) : ep_(std::move(endpoint)) {}

RedisClient::~RedisClient() {
  if (ctx_) redisFree(ctx_);
}

void RedisClient::drop_locked(const std::string& why) {
  if (ctx_) redisFree(ctx_);
  ctx_ = nullptr;
  healthy_ = false;
  last_error_ = why;
  // Back off before the next attempt, so a Redis that is down costs each
  // request nothing (the calls fail at once) instead of a connect timeout.
  backoff_ms_ = std::clamp(backoff_ms_ * 2, 100, std::max(100, ep_.max_backoff_ms));
  next_attempt_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(backoff_ms_);
}

void RedisClient::connect_locked() {
  if (ctx_) return;
  const std::string where = "redis://" + ep_.host + ":" + std::to_string(ep_.port);
  if (std::chrono::steady_clock::now() < next_attempt_)
    throw Error(ErrorCode::kIo, where + " unavailable (" + last_error_ + "); next attempt after the backoff");
  redisContext* c = redisConnectWithTimeout(ep_.host.c_str(), ep_.port, to_timeval(ep_.connect_timeout_ms));
  if (!c || c->err) {
    const std::string why = c ? c->errstr : "out of memory";
    if (c) redisFree(c);
    drop_locked("cannot connect: " + why);
    throw Error(ErrorCode::kIo, where + ": cannot connect: " + why);
  }
  const timeval tv = to_timeval(ep_.command_timeout_ms);
  if (redisSetTimeout(c, tv) != REDIS_OK) {
    redisFree(c);
    drop_locked("cannot set the command timeout");
    throw Error(ErrorCode::kIo, where + ": cannot set the command timeout");
  }
  ctx_ = c;
  if (ever_connected_) ++reconnects_;
  ever_connected_ = true;
}

template <class OnReply>
void RedisClient::command(const std::vector<std::string>& argv, OnReply&& on_reply) {
  std::lock_guard<std::mutex> lock(mu_);
  connect_locked();
  std::vector<const char*> args;
  std::vector<size_t> lens;
  for (const auto& a : argv) {
    args.push_back(a.data());
    lens.push_back(a.size());
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto* reply = static_cast<redisReply*>(redisCommandArgv(ctx_, int(args.size()), args.data(), lens.data()));
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  if (!reply) {
    const std::string why = std::string(argv[0]) + ": " + (ctx_->errstr[0] ? ctx_->errstr : "no reply");
    drop_locked(why);
    throw Error(ErrorCode::kIo, "redis " + why);
  }
  rtt_us_sum_ += uint64_t(us);
  ++rtt_count_;
  if (reply->type == REDIS_REPLY_ERROR) {
    const std::string why = argv[0] + ": " + std::string(reply->str, reply->len);
    freeReplyObject(reply);
    throw Error(ErrorCode::kIo, "redis " + why);  // the connection is fine: Redis refused (e.g. OOM)
  }
  healthy_ = true;
  backoff_ms_ = 0;
  try {
    on_reply(*reply);
  } catch (...) {
    freeReplyObject(reply);
    throw;
  }
  freeReplyObject(reply);
}

std::vector<std::optional<std::string>> RedisClient::get_many(const std::vector<std::string>& keys) {
  std::vector<std::optional<std::string>> out;
  if (keys.empty()) return out;
  std::vector<std::string> argv{"MGET"};
  argv.insert(argv.end(), keys.begin(), keys.end());
  command(argv, [&](const redisReply& r) {
    if (r.type != REDIS_REPLY_ARRAY || r.elements != keys.size())
      throw Error(ErrorCode::kIo, "redis MGET: unexpected reply type " + std::to_string(r.type));
    for (size_t i = 0; i < r.elements; ++i) {
      const redisReply* e = r.element[i];
      if (e->type == REDIS_REPLY_STRING) out.emplace_back(std::string(e->str, e->len));
      else out.emplace_back(std::nullopt);
    }
  });
  return out;
}

bool RedisClient::set_if_absent(const std::string& key, const std::string& value) {
  bool written = false;
  command({"SET", key, value, "NX"}, [&](const redisReply& r) { written = r.type == REDIS_REPLY_STATUS; });
  return written;
}

void RedisClient::del(const std::string& key) {
  command({"DEL", key}, [](const redisReply&) {});
}

void RedisClient::ping() {
  command({"PING"}, [](const redisReply&) {});
}

double RedisClient::mean_rtt_ms() const {
  const uint64_t n = rtt_count_.load();
  return n ? double(rtt_us_sum_.load()) / double(n) / 1000.0 : 0.0;
}

}  // namespace kvcodec::server
