// A kvcodec server in a child process on a free loopback port, for the
// integration tests: start() forks, runs run_server() with the options and
// waits for the ready line; stop() kills it. Also small HTTP helpers.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "server/server.hpp"

namespace kvcodec::server::testing {

inline std::string model_dir() { return std::string(KVCODEC_SOURCE_DIR) + "/models/tinycode"; }
inline bool have_model() { return std::filesystem::exists(model_dir() + "/config.json"); }

// The options every test server starts from: the shipped model, any free
// port, one model thread, small limits.
inline ServeOptions test_options() {
  ServeOptions o;
  o.model_dir = model_dir();
  o.port = 0;
  o.prefix_block = 16;
  o.max_body_bytes = 8192;
  o.max_prompt_tokens = 200;
  o.default_max_tokens = 4;
  o.max_tokens_limit = 256;
  o.max_queue = 4;
  o.threads = 1;
  return o;
}

struct ServerProcess {
  pid_t pid = -1;
  int port = 0;
  FILE* log = nullptr;  // the server's stdout after the ready line
  std::string startup;  // what it printed up to the ready line

  // Forks the server. Call from a single-threaded point of the test (no
  // other threads running), as fork() requires.
  static ServerProcess start(const ServeOptions& o) {
    ServerProcess p;
    int fds[2];
    if (pipe(fds) != 0) return p;
    p.pid = fork();
    if (p.pid < 0) return p;
    if (p.pid == 0) {
      // A test process that dies (an abort, a sanitizer's report) takes its
      // server with it: an orphan would keep the test's pipes open and CI
      // waiting.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      close(fds[0]);
      dup2(fds[1], 1);
      int rc = 3;
      try {
        rc = run_server(o, std::cout);
      } catch (const std::exception& e) {
        std::cout << "error: " << e.what() << std::endl;
      }
      std::cout.flush();
      _exit(rc);
    }
    close(fds[1]);
    p.log = fdopen(fds[0], "r");
    char line[4096];
    while (fgets(line, sizeof line, p.log)) {
      const std::string l(line);
      p.startup += l;
      const auto at = l.find("ready on http://");
      if (at != std::string::npos) {
        p.port = std::stoi(l.substr(l.rfind(':') + 1));
        break;
      }
    }
    return p;
  }
  void stop() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      pid = -1;
    }
    if (log) fclose(log);
    log = nullptr;
  }

  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(120, 0);
    return c;
  }
  nlohmann::json post(const std::string& path, const std::string& body, int expect_status) const {
    auto c = client();
    auto r = c.Post(path.c_str(), body, "application/json");
    EXPECT_TRUE(r) << path;
    if (!r) return {};
    EXPECT_EQ(r->status, expect_status) << path << " " << body.substr(0, 200) << " -> " << r->body.substr(0, 400);
    return nlohmann::json::parse(r->body, nullptr, false);
  }
  nlohmann::json get(const std::string& path) const {
    auto c = client();
    auto r = c.Get(path.c_str());
    EXPECT_TRUE(r && r->status == 200) << path;
    return r ? nlohmann::json::parse(r->body, nullptr, false) : nlohmann::json();
  }
};

inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace kvcodec::server::testing
