#include "row_file.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace sfctr {
namespace {

std::string Reason(int err) { return std::strerror(err); }

}  // namespace

bool HandlingDiskFull() {
  const std::exception_ptr current = std::current_exception();
  if (!current) return false;
  try {
    std::rethrow_exception(current);
  } catch (const DiskFull&) {
    return true;
  } catch (...) {
    return false;
  }
}

RowFile::RowFile(int fd, std::string dir)
    : fd_(fd),
      dir_(std::move(dir)),
      owner_(getpid()),
      page_(static_cast<uint64_t>(sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096)) {}

std::shared_ptr<RowFile> RowFile::Open(const std::string& dir) {
  if (dir.empty()) throw RowFileError("host_rows_dir is empty: name a directory");
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    throw RowFileError("host_rows_dir '" + dir + "' cannot be used: " + Reason(errno));
  }
  if (!S_ISDIR(st.st_mode)) {
    throw RowFileError("host_rows_dir '" + dir + "' is not a directory");
  }
  int fd = -1;
#if defined(O_TMPFILE)
  // An unnamed file: it goes when its last descriptor and mapping do.
  fd = open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
#endif
  if (fd < 0) {
    // File systems without O_TMPFILE: a named file, unlinked at once.
    std::string path = dir + (dir.back() == '/' ? "" : "/") + "tf_sfctr_rows.XXXXXX";
    std::vector<char> name(path.begin(), path.end());
    name.push_back('\0');
    fd = mkostemp(name.data(), O_CLOEXEC);
    if (fd < 0) {
      throw RowFileError("host_rows_dir '" + dir + "' cannot hold the table's row file: " +
                         Reason(errno));
    }
    unlink(name.data());
  }
  return std::shared_ptr<RowFile>(new RowFile(fd, dir));
}

RowFile::~RowFile() { close(fd_); }

bool RowFile::Owner() const { return getpid() == owner_; }

void* RowFile::Map(size_t bytes, uint64_t* offset) {
  const uint64_t len = (bytes + page_ - 1) / page_ * page_;
  std::lock_guard<std::mutex> lock(mu_);
  // A forked child must not take file space its parent may use.
  if (!Owner()) throw std::bad_alloc();
  // A hole of this length first (its disk space was given back, so it is
  // reserved again below); else the end of the file.
  const auto hole = free_.find(len);
  const uint64_t at = hole != free_.end() ? hole->second : end_;
  // Reserve the disk blocks now: a sparse range would fail later, on a
  // write to the mapping (SIGBUS), with no way to report it.
  const int err = posix_fallocate(fd_, static_cast<off_t>(at), static_cast<off_t>(len));
  if (err == ENOSPC || err == EDQUOT || err == EFBIG) throw DiskFull();
  if (err != 0) throw std::bad_alloc();
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, static_cast<off_t>(at));
  if (p == MAP_FAILED) throw std::bad_alloc();
  // Not inherited by fork(): a child writing to MAP_SHARED pages would
  // change the parent's rows.
  madvise(p, len, MADV_DONTFORK);
#if defined(MADV_RANDOM)
  // Rows are read at random: no read-ahead of the pages around a miss.
  madvise(p, len, MADV_RANDOM);
#endif
  try {
    mappings_.emplace(at, std::make_pair(p, len));
  } catch (...) {
    munmap(p, len);
    throw;
  }
  if (hole != free_.end()) {
    free_.erase(hole);
  } else {
    end_ = at + len;
  }
  mapped_ += len;
  *offset = at;
  return p;
}

void RowFile::Unmap(void* p, size_t bytes, uint64_t offset) {
  const uint64_t len = (bytes + page_ - 1) / page_ * page_;
  std::lock_guard<std::mutex> lock(mu_);
  mapped_ -= len;
  mappings_.erase(offset);
  // In a forked child the range was never mapped (MADV_DONTFORK; the
  // address may hold another mapping by now) and the file is the parent's:
  // leave both as they are.
  if (!Owner()) return;
  munmap(p, len);
  if (mappings_.empty()) {
    // Nothing mapped (the table was cleared or is going): start over.
    {
      // Ranges still recorded are gone: a refill must not wait on them.
      std::lock_guard<std::mutex> writing(writeback_mu_);
      writing_.clear();
      writing_bytes_ = 0;
    }
    if (ftruncate(fd_, 0) == 0) {
      end_ = 0;
      free_.clear();
    }
    return;
  }
#if defined(FALLOC_FL_PUNCH_HOLE) && defined(FALLOC_FL_KEEP_SIZE)
  // Give the range's disk space back (a hint: not every file system can).
  fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
            static_cast<off_t>(len));
#endif
  try {
    free_.emplace(len, offset);
  } catch (...) {  // the range is only not reused
  }
}

void RowFile::DropFromMemory() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!Owner()) return;
  for (const auto& [offset, where] : mappings_) {
    msync(where.first, where.second, MS_SYNC);
    // Unmaps the pages from this process (the file keeps their contents)...
    madvise(where.first, where.second, MADV_DONTNEED);
    // ...so that the page cache can drop them: they are clean now.
    posix_fadvise(fd_, static_cast<off_t>(offset), static_cast<off_t>(where.second),
                  POSIX_FADV_DONTNEED);
  }
}

bool RowFile::Resident(const void* p) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  void* start = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) & ~(page - 1));
  unsigned char in_memory = 0;
  // On failure (not expected for a mapped address), say resident: no hint.
  return mincore(start, page, &in_memory) != 0 || (in_memory & 1) != 0;
}

void RowFile::StartWriteback(uint64_t offset, uint64_t bytes) const {
  if (!Owner()) return;
  sync_file_range(fd_, static_cast<off_t>(offset), static_cast<off_t>(bytes),
                  SYNC_FILE_RANGE_WRITE);  // a hint: failure is harmless
  std::vector<std::pair<uint64_t, uint64_t>> wait;
  {
    std::lock_guard<std::mutex> lock(writeback_mu_);
    writing_.emplace_back(offset, bytes);
    writing_bytes_ += bytes;
    while (writing_bytes_ > kWritebackWindow) {
      wait.push_back(writing_.front());
      writing_bytes_ -= writing_.front().second;
      writing_.pop_front();
    }
  }
  // Outside the lock: other writers start their ranges meanwhile. Waits
  // for the writes started then only (rows rewritten since are left to the
  // kernel). A range unmapped since (or mapped again) is only waited for,
  // harmlessly.
  for (const auto& [from, n] : wait) {
    sync_file_range(fd_, static_cast<off_t>(from), static_cast<off_t>(n),
                    SYNC_FILE_RANGE_WAIT_BEFORE);
  }
  if (!wait.empty()) {
    std::lock_guard<std::mutex> lock(writeback_mu_);
    for (const auto& range : wait) waited_bytes_ += range.second;
  }
}

void RowFile::WillNeed(uint64_t offset, uint64_t bytes) const {
  posix_fadvise(fd_, static_cast<off_t>(offset), static_cast<off_t>(bytes),
                POSIX_FADV_WILLNEED);  // a hint: failure is harmless
}

uint64_t RowFile::length() const {
  std::lock_guard<std::mutex> lock(mu_);
  return end_;
}

uint64_t RowFile::writing_bytes() const {
  std::lock_guard<std::mutex> lock(writeback_mu_);
  return writing_bytes_;
}

uint64_t RowFile::waited_bytes() const {
  std::lock_guard<std::mutex> lock(writeback_mu_);
  return waited_bytes_;
}

uint64_t RowFile::mapped_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_;
}

}  // namespace sfctr
