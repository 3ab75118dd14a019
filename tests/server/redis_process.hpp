// A redis-server in a child process on a free loopback port, for the Redis
// prefix-store tests: start() execs it (in its own temporary folder, so its
// persistence files are the test's) and waits until it answers PONG; kill()
// stops it with SIGKILL; the same object can start again on the same port
// and folder (a restart from persistence). Raw commands go through hiredis.
#pragma once

#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace kvcodec::server::testing {

inline bool have_redis_server() { return std::system("command -v redis-server >/dev/null 2>&1") == 0; }

// A port nothing listens on right now (bound once, then released).
inline int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    return 0;
  }
  close(fd);
  return ntohs(a.sin_port);
}

struct RedisProcess {
  pid_t pid = -1;
  int port = 0;
  std::filesystem::path dir;
  bool persist = false;  // AOF, fsync on every write

  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port); }

  // Starts (or restarts, same port and folder). Returns whether it answers.
  bool start() {
    if (port == 0) port = free_port();
    if (dir.empty()) {
      dir = std::filesystem::temp_directory_path() / ("kvcodec_redis_" + std::to_string(getpid()) + "_" + std::to_string(port));
      std::filesystem::remove_all(dir);
    }
    std::filesystem::create_directories(dir);
    pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // no redis-server outlives a test that died
      const std::string p = std::to_string(port), d = dir.string();
      std::vector<const char*> argv{"redis-server", "--port", p.c_str(), "--bind", "127.0.0.1", "--dir", d.c_str(),
                                    "--save", "", "--daemonize", "no", "--loglevel", "warning",
                                    "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"};
      if (persist) {
        for (const char* a : {"--appendonly", "yes", "--appendfsync", "always"}) argv.push_back(a);
      } else {
        for (const char* a : {"--appendonly", "no"}) argv.push_back(a);
      }
      argv.push_back(nullptr);
      freopen("/dev/null", "w", stdout);
      execvp("redis-server", const_cast<char* const*>(argv.data()));
      _exit(127);
    }
    for (int i = 0; i < 200; ++i) {
      // PONG, not just an answer: while it loads its AOF Redis answers -LOADING.
      if (command({"PING"}) == std::optional<std::string>("PONG")) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  void kill_now() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      pid = -1;
    }
  }
  void stop() {
    kill_now();
    if (!dir.empty()) std::filesystem::remove_all(dir);
  }

  // One command; the reply as text (status, string, integer), nullopt when
  // Redis does not answer; arrays give their string elements joined by '\n'.
  std::optional<std::string> command(const std::vector<std::string>& args) const {
    timeval tv{1, 0};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (!c || c->err) {
      if (c) redisFree(c);
      return std::nullopt;
    }
    redisSetTimeout(c, tv);
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const auto& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    auto* r = static_cast<redisReply*>(redisCommandArgv(c, int(argv.size()), argv.data(), lens.data()));
    std::optional<std::string> out;
    if (r) {
      if (r->type == REDIS_REPLY_INTEGER) out = std::to_string(r->integer);
      else if (r->type == REDIS_REPLY_NIL) out = "";
      else if (r->type == REDIS_REPLY_ARRAY) {
        std::string s;
        for (size_t i = 0; i < r->elements; ++i) s += std::string(r->element[i]->str, r->element[i]->len) + "\n";
        out = s;
      } else out = std::string(r->str, r->len);
      freeReplyObject(r);
    }
    redisFree(c);
    return out;
  }
  std::vector<std::string> keys() const {
    std::vector<std::string> out;
    const std::string all = command({"KEYS", "kvcodec:*"}).value_or("");
    size_t pos = 0;
    for (size_t nl; (nl = all.find('\n', pos)) != std::string::npos; pos = nl + 1) out.push_back(all.substr(pos, nl - pos));
    return out;
  }
};

}  // namespace kvcodec::server::testing
