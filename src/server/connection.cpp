#include "server/connection.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdlib>

namespace kvcodec::server {
namespace {

// Address text and port of a socket end, as cpp-httplib formats them.
bool address_of(const sockaddr_storage& a, std::string& host, int& port) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(a);
    if (!inet_ntop(AF_INET, &in.sin_addr, buf, sizeof buf)) return false;
    port = ntohs(in.sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(a);
    if (!inet_ntop(AF_INET6, &in6.sin6_addr, buf, sizeof buf)) return false;
    port = ntohs(in6.sin6_port);
  } else {
    return false;
  }
  host = buf;
  return true;
}

}  // namespace

int find_connection_fd(const std::string& remote_addr, int remote_port, int local_port) {
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return -1;
  int found = -1;
  while (dirent* d = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(d->d_name, &end, 10);
    if (end == d->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    sockaddr_storage peer{}, self{};
    socklen_t pl = sizeof peer, sl = sizeof self;
    if (getpeername(int(fd), reinterpret_cast<sockaddr*>(&peer), &pl) != 0) continue;  // not a connected socket
    if (getsockname(int(fd), reinterpret_cast<sockaddr*>(&self), &sl) != 0) continue;
    std::string peer_host, self_host;
    int peer_port = -1, self_port = -1;
    if (!address_of(peer, peer_host, peer_port) || !address_of(self, self_host, self_port)) continue;
    if (peer_port == remote_port && self_port == local_port && peer_host == remote_addr) {
      found = int(fd);
      break;
    }
  }
  closedir(dir);
  return found;
}

bool peer_closed(int fd) {
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;  // nothing to report: still there
  if (p.revents & (POLLERR | POLLHUP | POLLRDHUP | POLLNVAL)) return true;
  char c;
  const ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

}  // namespace kvcodec::server
