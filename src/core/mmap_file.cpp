#include "core/mmap_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "kvcodec/error.hpp"

namespace kvcodec {

namespace {

[[noreturn]] void throw_io(const std::string& what, const std::string& path, int err) {
  throw Error(ErrorCode::kIo, what + " '" + path + "': " + std::strerror(err));
}

// Closes a descriptor on every path out of a function.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::string parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

MappedFile::MappedFile(const std::string& path) {
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) throw_io("cannot open", path, errno);
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) throw_io("cannot stat", path, errno);
  if (!S_ISREG(st.st_mode)) throw Error(ErrorCode::kIo, "not a regular file: '" + path + "'");
  size_ = size_t(st.st_size);
  if (size_ == 0) return;  // mmap of length 0 is an error; an empty mapping is fine
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, f.fd, 0);
  if (p == MAP_FAILED) {
    size_ = 0;
    throw_io("cannot map", path, errno);
  }
  data_ = static_cast<const uint8_t*>(p);
}

MappedFile::~MappedFile() { release(); }

MappedFile::MappedFile(MappedFile&& other) noexcept : data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    release();
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

void MappedFile::release() noexcept {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

uint64_t file_size(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw_io("cannot stat", path, errno);
  if (!S_ISREG(st.st_mode)) throw Error(ErrorCode::kIo, "not a regular file: '" + path + "'");
  return uint64_t(st.st_size);
}

std::vector<uint8_t> read_file_bytes(const std::string& path, uint64_t max_bytes) {
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) throw_io("cannot open", path, errno);
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) throw_io("cannot stat", path, errno);
  if (!S_ISREG(st.st_mode)) throw Error(ErrorCode::kIo, "not a regular file: '" + path + "'");
  const uint64_t n = uint64_t(st.st_size);
  if (n > max_bytes) {
    throw Error(ErrorCode::kFormat, "file '" + path + "' is " + std::to_string(n) +
                                        " bytes, more than the limit of " + std::to_string(max_bytes));
  }
  std::vector<uint8_t> out(n);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::read(f.fd, out.data() + done, n - done);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_io("cannot read", path, errno);
    }
    if (r == 0) throw Error(ErrorCode::kIo, "file '" + path + "' shrank while being read");
    done += size_t(r);
  }
  return out;
}

void write_file_atomic(const std::string& path, const void* data, size_t size) {
  // Unique per process and call, so concurrent writers never share a temp file.
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." +
                          std::to_string(counter.fetch_add(1));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw_io("cannot create temporary file for", path, errno);
  auto fail = [&](const char* what) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    throw_io(what, path, err);
  };
  const auto* p = static_cast<const uint8_t*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t w = ::write(fd, p + done, size - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("cannot write");
    }
    done += size_t(w);
  }
  if (::fsync(fd) != 0) fail("cannot fsync");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw_io("cannot close", path, err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw_io("cannot rename temporary file onto", path, err);
  }
  // Make the rename itself durable; failure here is not fatal to the data.
  Fd dir;
  dir.fd = ::open(parent_dir(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir.fd >= 0) ::fsync(dir.fd);
}

}  // namespace kvcodec
